"""Model FLOPs per trained token: the numerator of model TFLOP/s and MFU.

One definition for the trainer's logs and the benchmarks' rows. Useful work only: recompute is
overhead and not counted. Per token, forward + backward:

- dense work: 6 x the parameters the token runs through (an MoE token runs through top-k of its
  experts, not all of them);
- attention: per layer 6 x heads x (query/key dim + value dim) x the keys the query attends to
  on average (6 x heads x 2 x head_dim x s/2 = 6 x hidden x s for causal full attention; a
  sliding window w < s leaves w - w^2/2s keys; linear-attention, convolution and state-space
  layers have no quadratic term).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .layer_configs import head_dims

# layer_types entries without a softmax over past keys (their cost is in the parameters):
# linear-attention, convolution and state-space layers, and Nemotron-H's MLP and MoE layers.
_NO_QUADRATIC_TERM = ("linear_attention", "conv", "mamba", "ssm", "recurrent", "mlp", "moe")


def active_params(model: nn.Module) -> int:
    """Parameters one token runs through: all of them less the experts it is not routed to.

    Expert weights are the parameters under modules named ``experts`` (transformers' naming for
    routed experts, fused or as module lists; shared experts are named otherwise); a token uses
    ``num_experts_per_tok`` of ``num_experts`` of them. Lookup tables besides the input
    embedding (Gemma 4's per-layer input table, larger than its layers in E2B; learned position
    embeddings) do no matmul: not counted. Meta placeholders count too."""
    total = sum(p.numel() for p in model.parameters())
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    total -= sum(
        module.weight.numel()
        for module in model.modules()
        if isinstance(module, nn.Embedding)
        and module is not inputs
        and module.weight is not head_weight
    )
    cfg = _text_config(getattr(model, "config", None))
    experts = _first(cfg, "num_experts", "num_local_experts", "n_routed_experts")
    top_k = _first(cfg, "num_experts_per_tok", "moe_topk", "top_k", "top_k_experts")
    if not experts or not top_k or top_k >= experts:
        return total
    routed = sum(
        p.numel()
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] == "experts"
        for p in module.parameters()
    )
    return total - round(routed * (1 - top_k / experts))


def attention_flops_per_token(config: Any, seq_len: int) -> float:
    """Attention's FLOPs per token over all layers (forward + backward, causal) for rows of
    ``seq_len`` tokens, from the config's heads, head dims and layer types / sliding window."""
    cfg = _text_config(config)
    keys = [_keys_per_query(cfg, kind, seq_len) for kind in _layer_kinds(cfg)]
    if not any(keys):
        return 0.0  # (Mamba's config has no attention heads to read)
    heads = cfg.num_attention_heads
    qk_dim = getattr(cfg, "qk_head_dim", None)
    v_dim = getattr(cfg, "v_head_dim", None)
    total = 0.0
    # Per layer: its own head width where layers differ (Gemma 4's full-attention layers).
    for layer_keys, head_dim in zip(keys, head_dims(cfg)):
        per_key = 6 * heads * ((qk_dim or head_dim) + (v_dim or head_dim))
        total += per_key * layer_keys
    return total


def model_flops_utilization(
    config: Any, n_params: int, tokens_per_s: float, world: int, peak_tflops: float, row_len: int
) -> float:
    """MFU per GPU: the whole job's ``tokens_per_s`` over ``world`` GPUs of ``peak_tflops``, each
    token through ``n_params`` active parameters (6 FLOPs each) and causal attention over its row
    of ``row_len`` tokens (the whole row: under sequence parallelism N times the local shard).
    Recompute is not counted: it is overhead."""
    flops = 6 * n_params + attention_flops_per_token(config, row_len)
    return round(flops * tokens_per_s / (world * peak_tflops * 1e12), 4)


def model_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Dense plus attention FLOPs per trained token (MFU's numerator per token)."""
    return 6 * active_params(model) + attention_flops_per_token(model.config, seq_len)


def _layer_kinds(cfg: Any) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    kind = "sliding_attention" if _window(cfg) else "full_attention"
    return [kind] * cfg.num_hidden_layers


def _keys_per_query(cfg: Any, kind: str, seq_len: int) -> float:
    """Average keys a query attends to in a causal row of ``seq_len`` tokens."""
    if any(k in kind for k in _NO_QUADRATIC_TERM):
        return 0.0
    if kind == "chunked_attention":
        chunk = getattr(cfg, "attention_chunk_size", None) or seq_len
        return min(chunk, seq_len) / 2
    window = _window(cfg) if kind == "sliding_attention" else 0
    if window and window < seq_len:
        return window - window * window / (2 * seq_len)
    return seq_len / 2


def _window(cfg: Any) -> int:
    # Qwen2-style configs carry a sliding_window that use_sliding_window=False switches off.
    if getattr(cfg, "use_sliding_window", True) is False:
        return 0
    return int(getattr(cfg, "sliding_window", None) or 0)


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _first(cfg: Any, *names: str) -> int:
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0
