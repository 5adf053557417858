"""Turn a Hugging Face decoder model into its streamed form.

The model object stays the user's own ``PreTrainedModel``: its forward (embedding scale, masks,
rotary, soft-capping, MoE routing, loss) runs untouched. Only the decoder layers change: their
parameters move into the host store and are replaced by ``meta`` placeholders, and their
``forward`` becomes a ``StreamedLayer``. Everything outside the layers (embeddings, final norm,
LM head, buffers) stays resident on the compute device as fp32 masters.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.builder import LayerLayout, build_frozen_state, build_streamed_state
from ..core.host_store import HostStore, layout_slots
from ..core.options import (
    ALL_LAYERS,
    EngineOptions,
    ResolvedOptions,
    StepShape,
    parse_attention_layers,
    parse_keep_activations,
)
from ..core.plan_arithmetic import grad_dtype_label
from ..core.plan_types import ModelShape, last_recomputed
from ..core.planner import MemoryPlan
from ..core.streamed_layer import StreamedLayer
from ..core.streaming import StreamingEngine
from .adapter_memory import adapter_shape_fields
from .arguments import ARGUMENT_NAMER
from .capture import RecorderCapture, recorder_capture_available
from .compiled_kernels import is_compiled_forward, runs_compiled_norms, stand_in
from .conversions import save_revert_copy_numel
from .families import (
    family_key,
    model_family,
    outer_model_type,
    text_model_type,
    unsupported_model_type,
)
from .family_memory import (
    EAGER_SCORE_COPIES,
    EVERY_EXPERT_MODEL_TYPES,
    FAMILY_WORKING_SET_EXTRA,
    FITTED_KEPT_RESIDUALS,
    GEMMA_NORM_MODEL_TYPES,
    MOE_FP32_ROUTING_MODEL_TYPES,
    MOE_WORKING_SET_AUDITED_MODEL_TYPES,
    PEAK_WORKING_SET_AUDITED_MODEL_TYPES,
    carried_tensor_bytes,
    fitted_bytes,
    kept_bytes_audited,
)
from .layer_configs import attention_widths
from .layers import UnsupportedModelError, find_decoder_layers, forward_function
from .long_context import install_mlp_tiling, tileable_mlp
from .loss import (
    decoder_of,
    load_balancing_loss_function,
    router_aux_loss_on,
    supports_fused_loss,
    unwrap_peft,
)
from .module_calls import install_module_calls
from .rope_saves import rope_saved_bytes_per_token, rope_table_elements

logger = logging.getLogger(__name__)

_EAGER_WINDOW_MASK = re.compile(r'"sliding_attention":\s*create_sliding_window_causal_mask\(')

_MOE_TYPES = {
    "qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss", "granitemoe", "granitemoeshared",
    "flex_olmo",
}  # fmt: skip


@dataclass
class StreamedModelState:
    """What hf_megatrain attaches to a streamed model (``model._megatrain``)."""

    engine: StreamingEngine
    store: HostStore
    layers_prefix: str  # e.g. "model.layers"
    resident: list[tuple[str, nn.Parameter, bool]] = field(default_factory=list)
    # The memory plan behind resident_layers="auto" (None for an explicit count): what the run
    # expected to need, for logs and for comparison with the measured peaks.
    plan: MemoryPlan | None = None
    # The options the model was streamed with (resolved for its run) and the step it was
    # planned for: the trainer takes them from here for a model streamed before it.
    options: ResolvedOptions | None = None
    step: StepShape | None = None
    #: The options its caller asked for (before auto_fit's and the builder's own changes).
    asked: EngineOptions | None = None
    #: Streamed frozen (``prepare_frozen_streamed_model``): weights only, never trained.
    frozen: bool = False
    #: Streamed with PEFT adapters in it (a ``PeftModel``): adapters added later are refused.
    adapters: bool = False
    #: The PEFT model's active adapter(s) when streamed: the ones its resident stores train.
    active_adapters: tuple[str, ...] = ()
    #: ``config.use_cache`` before streaming turned it off (saved models record this one).
    use_cache: bool | None = None

    def full_name(self, layer: int, rel: str) -> str:
        return f"{self.layers_prefix}.{layer}.{rel}"

    def changed_since_streaming(self, model: nn.Module) -> str | None:
        """What was changed in ``model`` after it was streamed that training would not follow
        (None: nothing): a parameter replaced (``resize_token_embeddings``: the new head would
        never update), a streamed layer frozen or unfrozen (its store trains or not as it was
        built), adapters added to the streamed model or another of its adapters made active."""
        if _is_peft(model) and not self.adapters:
            return "PEFT adapters were added to an already streamed model (get_peft_model)"
        if self.adapters and _active_adapters(model) != self.active_adapters:
            # (Found by an audit: set_adapter between the trainer and train() ended in autograd's
            # "element 0 of tensors does not require grad".)
            return (
                f"the active adapter was changed to {list(_active_adapters(model))} (it was "
                f"{list(self.active_adapters)}: set_adapter)"
            )
        resident = {id(p) for _, p, _ in self.resident}
        for name, p in model.named_parameters():
            if p.device.type != "meta" and id(p) not in resident:
                return f"{name} was replaced (e.g. by resize_token_embeddings)"
        _, layers = find_decoder_layers(model)
        for i, (layer, store) in enumerate(zip(layers, self.store.layers)):
            trains = {slot.name: store.trainable and slot.trainable for slot in store.slots}
            for name, p in layer.named_parameters():
                if p.device.type == "meta" and p.requires_grad != trains[name]:
                    way = "unfrozen" if p.requires_grad else "frozen"
                    return f"decoder layer {i}'s streamed parameters were {way} ({name})"
        return None

    def decay_names(self) -> set[str]:
        """The parameters the engine's AdamW decays (fixed when the model was streamed)."""
        names = {name for name, _, decay in self.resident if decay}
        for i, layer in enumerate(self.store.layers):
            names.update(self.full_name(i, slot.name) for slot in layer.slots if slot.decay)
        return names


def _liger_patched(module: nn.Module | None) -> bool:
    """Whether ``module`` runs a Liger-Kernel forward: patched onto the instance (the Trainer's
    use_liger_kernel; also under MLP tiling, which keeps the forward it tiles) or its class
    swapped before the model was built (``apply_liger_kernel_to_*()``)."""
    if module is None:
        return False
    return str(getattr(forward_function(module), "__module__", "")).startswith("liger_kernel")


def runs_liger(model: nn.Module) -> bool:
    """Whether the model's decoder layers run Liger-Kernel's fused MLP (applied already)."""
    return layer_kernels_of(model) == "liger"


def layer_kernels_of(model: nn.Module) -> str:
    """The ``layer_kernels`` a model's decoder layers run already: "liger", "compiled" or
    "torch" (what a copy of it must run to compute alike)."""
    _, layers = find_decoder_layers(model)
    mlp = getattr(layers[0], "mlp", None) if layers else None
    if _liger_patched(mlp):
        return "liger"
    return "compiled" if is_compiled_forward(mlp) else "torch"


def model_shape(model: nn.Module, name: str = "model") -> ModelShape:
    """Parameter counts per decoder layer and outside them, for the memory planner.

    Works on a materialized model, on a ``meta`` skeleton and on a streamed model (whose layer
    parameters are ``meta`` placeholders of the right shapes).
    """
    _, layers = find_decoder_layers(model)
    layer_numels, adapter_numels, frozen_numels, largest_param = _layer_numels(layers)
    # parameters() yields a shared (tied) tensor once, so a tied head is counted once.
    total = sum(p.numel() for p in model.parameters())
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    frozen_non_layer = sum(
        p.numel() for p in model.parameters() if id(p) not in in_layers and not p.requires_grad
    )
    cfg = model.config
    family = family_key(cfg.model_type)
    text_cfg = _text_config(cfg)
    # GPT-style configs name the MLP width otherwise or leave it at the 4 x hidden default.
    inter = (
        getattr(text_cfg, "intermediate_size", None)
        or getattr(text_cfg, "n_inner", None)
        or getattr(text_cfg, "ffn_hidden_size", None)
        or 4 * text_cfg.hidden_size
    )
    # (Gemma 4 names its routed experts per token top_k_experts, set where MoE is on.)
    experts = getattr(text_cfg, "num_experts_per_tok", None) or (
        getattr(text_cfg, "top_k_experts", None) if getattr(text_cfg, "enable_moe_block", 0) else 0
    )
    if experts and family in EVERY_EXPERT_MODEL_TYPES:
        experts = getattr(text_cfg, "num_local_experts", None) or experts
    moe_inter = getattr(text_cfg, "moe_intermediate_size", None)
    if experts and moe_inter:  # MoE: the active experts' width drives the working set
        inter = experts * moe_inter
    elif experts:
        inter = experts * inter
    if not experts and layers:  # the MLP's own width where the config's is adjusted (LFM2),
        # at the widest layer where widths differ (Gemma 4's double-wide KV-sharing layers)
        inter = max(_mlp_width(layer) for layer in layers) or inter
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    heads = getattr(text_cfg, "num_attention_heads", 0) or 0
    # At the widest layer where layers differ (Gemma 4's full-attention layers): an upper bound.
    head_dim, kv_width = attention_widths(text_cfg)
    kv_heads = -(-kv_width // head_dim) if head_dim else heads
    # Liger's or compiled SwiGLU: both save the gate and up projections only (compiled: in
    # every layer; a model mixing dense and MoE layers has its experts unfused).
    mlp = getattr(layers[0], "mlp", None) if layers else None
    compiled = bool(layers) and all(is_compiled_forward(getattr(x, "mlp", None)) for x in layers)
    fused = _liger_patched(mlp) or compiled
    compiled_norms = runs_compiled_norms(model)
    input_linears = _normed_input_linears(layers[0], text_cfg.hidden_size) if layers else 5
    window, full = attention_windows(text_cfg)
    types = getattr(text_cfg, "layer_types", None) or ()
    # Which layers attend through the window (their kept copies of its mask are planned).
    sliding = tuple(t in _WINDOWED_LAYER_TYPES for t in types) if window else ()
    if len(sliding) != len(layers):
        sliding = ()  # every layer, where the window is set (Mistral, Phi-3): the plan's default
    attn = runs = getattr(cfg, "_attn_implementation", None) or "sdpa"
    # The first attention layer's (LFM2's first layers can be convolutions).
    attention = next((a for x in layers if (a := getattr(x, "self_attn", None)) is not None), None)
    source = _decoder_forward_source(model)
    # Always an explicit mask for SDPA (Falcon); with ALiBi added onto it, heads x s x s in
    # fp32: its masks planned as eager attention's, an upper bound (it still runs SDPA).
    explicit_mask = "allow_is_causal_skip=False" in source
    # A sparse-attention indexer (DeepSeek-V3.2) picks each query's keys: an explicit mask.
    indexer_heads = int(getattr(text_cfg, "index_n_heads", 0) or 0)
    explicit_mask = explicit_mask or indexer_heads > 0
    if explicit_mask and getattr(text_cfg, "alibi", False) and attn == "sdpa":
        attn, explicit_mask = "eager", False
    # A sliding-window mask built for every forward although no layer slides (Qwen2-MoE's mask
    # dict calls it where others defer it behind ``lambda`` or ``has_sliding_layers``).
    unused_window = -1
    if _EAGER_WINDOW_MASK.search(source) and "has_sliding_layers" not in source:
        if not window:
            unused_window = int(getattr(text_cfg, "sliding_window", 0) or 0)
    q_width = heads * head_dim
    extra_what, extra = "", 0
    if family in FAMILY_WORKING_SET_EXTRA:
        extra_what, per_token = FAMILY_WORKING_SET_EXTRA[family]
        extra = per_token(text_cfg, text_cfg.hidden_size, q_width, kv_width, inter)
    # The router aux loss's temporaries: which of transformers' two load-balancing losses the
    # family has (before 5.16 one-hot over every layer's top-k at once, then layer by layer).
    aux = router_aux_loss_on(model)
    # Which layers route to experts: each records router logits for the aux loss (where none is
    # found, every layer: an upper bound); the others are dense (Qwen-MoE's, DeepSeek's first).
    routes = [_has_experts(layer) for layer in layers] if experts or aux else []
    balance = load_balancing_loss_function(model) if aux else None
    one_hot = "one_hot" in getattr(getattr(balance, "__code__", None), "co_names", ())
    causal_lm = unwrap_peft(model)  # (the attributes its forward passes the aux loss)
    carried = carried_tensor_bytes(text_cfg, layers)
    return ModelShape(
        kv_size=kv_width,
        head_dim=head_dim,
        num_heads=heads,
        # Every attention layer of these families is alike: the first one says.
        qk_norm=_q_norm(attention) is not None,
        qk_norm_fp32_output=attention is not None and _widens_to_fp32(attention),
        fused_layer_kernels=fused,
        compiled_norms=compiled_norms,
        normed_input_linears=input_linears,
        layer_numels=layer_numels,
        non_layer_numel=total - sum(layer_numels) - sum(adapter_numels),
        frozen_layer_numels=frozen_numels if any(frozen_numels) else (),
        adapter_layer_numels=adapter_numels if any(adapter_numels) else (),
        **adapter_shape_fields(  # (the MLP's own width, not the routed experts' sum above)
            layers,
            text_cfg.hidden_size,
            getattr(text_cfg, "intermediate_size", None) or inter,
            experts or 0,
        ),
        frozen_non_layer_numel=frozen_non_layer,
        save_copy_numel=save_revert_copy_numel(causal_lm),
        largest_layer_param_numel=largest_param,
        frozen_embedding=embed is not None and not embed.weight.requires_grad,
        frozen_head=head is not None and not head.weight.requires_grad,
        hidden_size=text_cfg.hidden_size,
        vocab_size=text_cfg.vocab_size,
        intermediate_size=inter,
        tied_embeddings=tied,
        fused_loss=supports_fused_loss(model),
        router_aux_loss=aux,
        router_layers=(sum(routes) or len(layers)) if aux else 0,
        num_experts=getattr(causal_lm, "num_experts", 0) if aux else 0,
        # Routed experts per token (the working set's; 0 for dense models).
        experts_per_token=experts or 0,
        mlp_tileable=all(
            tileable_mlp(layer) is not None for layer in layers if not _has_experts(layer)
        ),
        router_aux_one_hot=one_hot,
        moe_working_set_audited=family in MOE_WORKING_SET_AUDITED_MODEL_TYPES,
        fp32_routing_weights=family in MOE_FP32_ROUTING_MODEL_TYPES,
        shared_expert_size=_shared_expert_size(layers, routes, text_cfg) if experts else 0,
        dense_mlp_size=_dense_mlp_size(layers, routes, text_cfg) if experts else 0,
        kept_bytes_audited=kept_bytes_audited(family, fused or compiled_norms),
        extra_kept_bytes_per_token=fitted_bytes(
            FITTED_KEPT_RESIDUALS.get(family),
            text_cfg.hidden_size,
            q_width,
            kv_width,
            inter,
        ),
        gemma_norms=family in GEMMA_NORM_MODEL_TYPES,
        peak_working_set_audited=family in PEAK_WORKING_SET_AUDITED_MODEL_TYPES,
        sdpa_attention=runs == "sdpa",
        attn_implementation=attn,
        sliding_window=window,
        full_attention_layers=full,
        sliding_layers=sliding,
        attn_softcapping=bool(getattr(text_cfg, "attn_logit_softcapping", None)),
        sdpa_explicit_mask=explicit_mask,
        indexer_heads=indexer_heads,
        indexer_head_dim=int(getattr(text_cfg, "index_head_dim", 0) or 0) if indexer_heads else 0,
        eager_score_copies=EAGER_SCORE_COPIES.get(family, (0, 0)),
        unused_window_mask_from=unused_window,
        extra_working_set_bytes_per_token=extra,
        extra_working_set_what=extra_what,
        rope_saved_bytes_per_token=rope_saved_bytes_per_token(
            model, heads, kv_heads, head_dim, torch.bfloat16
        ),
        rope_table_elements=rope_table_elements(model),
        carried_bytes_per_token=carried[0],
        carried_grad_bytes_per_token=carried[1],
        carried_what=carried[2],
        residual_streams=residual_streams(text_cfg),
        name=name,
    )


def _drop_unread_kv_stores(layers: nn.ModuleList) -> None:
    """Gemma 4's last layer of each attention type stores its keys and values in a mapping the
    model's forward passes every layer, for layers that reuse them or for a drafter model to
    read after the forward. Where no layer reuses them (31B, 26B-A4B), nothing reads them in
    training, yet a streamed layer would hand them out as outputs (core/carried.py) alive
    through the whole backward (unplanned HBM): such models store none."""
    attentions = [getattr(layer, "self_attn", None) for layer in layers]
    if any(getattr(a, "is_kv_shared_layer", False) for a in attentions):
        return
    for attention in attentions:
        if getattr(attention, "store_full_length_kv", False):
            attention.store_full_length_kv = False


def _layer_numels(
    layers: nn.ModuleList,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
    """Per layer: the parameters it streams (``streamed_names``), its resident trainable ones
    (LoRA adapters, in a layer that mixes both) and its streamed frozen ones (0 where they
    train); and the largest streamed parameter of any layer."""
    streamed, adapters, frozen, largest = [], [], [], 0
    for layer in layers:
        names = streamed_names(layer)
        params = dict(layer.named_parameters())
        n = sum(p.numel() for name, p in params.items() if name in names)
        streamed.append(n)
        adapters.append(sum(p.numel() for name, p in params.items() if name not in names))
        frozen.append(0 if any(params[name].requires_grad for name in names) else n)
        largest = max([largest] + [p.numel() for name, p in params.items() if name in names])
    return tuple(streamed), tuple(adapters), tuple(frozen), largest


def _decoder_forward_source(model: nn.Module) -> str:
    """The source of the decoder stack's forward (where masks are made), "" when unknown."""
    causal_lm = unwrap_peft(model)
    base = decoder_of(causal_lm)
    return _forward_source(type(base if base is not None else causal_lm))


@functools.cache
def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


#: Last name parts of the linears that write a layer's branch outputs back to the hidden width
#: (their inputs are the attention output or the MLP's product, already in the compute dtype).
_OUTPUT_PROJECTIONS = frozenset(
    {"o_proj", "down_proj", "out_proj", "dense", "c_proj", "wo", "w2", "fc2", "dense_4h_to_h"}
)


def _normed_input_linears(layer: nn.Module, hidden: int) -> int:
    """Linears of ``layer`` that read the hidden-width normed inputs (``normed_input_linears``):
    every ``in_features == hidden`` linear but the output projections, at most the 5 the
    kept-activation count assumes (routed experts hold their weights otherwise: not counted).
    A wrapped projection (PEFT's LoRA layer around its base) counts once. None found
    (projections of another kind): 2, which takes nothing off."""
    counted: list[str] = []
    for name, module in layer.named_modules():
        if getattr(module, "in_features", None) != hidden:
            continue
        if name.rpartition(".")[2] in _OUTPUT_PROJECTIONS:
            continue
        if any(name.startswith(f"{c}.") for c in counted):
            continue  # inside a counted wrapper
        counted.append(name)
    return min(len(counted), 5) if counted else 2


def _mlp_width(layer: nn.Module) -> int:
    """A dense layer's MLP width from its gate/up projection (the config's can be adjusted, as
    LFM2's ``block_auto_adjust_ff_dim``); 0 when not found."""
    return _gated_width(getattr(layer, "mlp", None) or getattr(layer, "feed_forward", None))


def _q_norm(attention: nn.Module | None) -> nn.Module | None:
    """The attention's per-head q norm (``q_norm``; LFM2's ``q_layernorm``), None without."""
    for name in ("q_norm", "q_layernorm"):
        norm = getattr(attention, name, None)
        if isinstance(norm, nn.Module):
            return norm
    return None


def _has_experts(layer: nn.Module) -> bool:
    return any(name.rsplit(".", 1)[-1] == "experts" for name, _ in layer.named_modules())


def _dense_mlp_size(layers: list[nn.Module], routes: list[bool], config) -> int:
    """In an MoE model, the widest MLP of its layers without routed experts (``routes``: which
    layers have them; their gate/up projection, else the config's ``intermediate_size``); 0
    where every layer routes."""
    dense = [layer for layer, routed in zip(layers, routes) if not routed]
    if not dense or len(dense) == len(layers):  # (none found routing: not told apart)
        return 0
    widths = [_mlp_width(layer) for layer in dense]
    return max(widths) or int(getattr(config, "intermediate_size", 0) or 0)


#: Layer types whose attention a mask narrower than causal limits: a sliding window, or Llama 4's
#: chunks (each query sees its own chunk's earlier keys): under SDPA both make one bool s x s
#: mask per forward and an additive copy per layer, planned alike (the chunk as the window).
_WINDOWED_LAYER_TYPES = ("sliding_attention", "chunked_attention")


def attends_in_chunks(text_cfg) -> bool:
    """Whether some layer attends in chunks (Llama 4's ``chunked_attention``)."""
    return "chunked_attention" in (getattr(text_cfg, "layer_types", None) or ())


def attention_windows(text_cfg) -> tuple[int, bool]:
    """``(sliding window, whether some layer attends fully)`` of a config: its ``layer_types``
    where it has them (sliding layers use ``sliding_window``, chunked ones
    ``attention_chunk_size``); without them a set ``sliding_window`` is every layer's (Mistral,
    Mixtral, Phi-3, Starcoder2: their models then make only the sliding-window mask)."""
    window = getattr(text_cfg, "sliding_window", None) or 0
    types = getattr(text_cfg, "layer_types", None)
    if types:
        if attends_in_chunks(text_cfg):
            window = getattr(text_cfg, "attention_chunk_size", None) or 0
        elif "sliding_attention" not in types:
            window = 0
        return window, any(t == "full_attention" for t in types)
    return window, not window


def meta_model(config) -> nn.Module:
    """``config``'s causal LM built on ``meta`` (no weight is allocated, so a 70B config is
    fine). Raises ``UnsupportedModelError`` when the config cannot be built."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (TypeError, ValueError, RuntimeError) as e:
        raise UnsupportedModelError(
            f"hf_megatrain: could not build {config.model_type} from this config: {e}"
        ) from None


def model_shape_from_config(config, name: str = "model") -> ModelShape:
    """:func:`model_shape` of ``config``'s causal LM, built on ``meta`` (``meta_model``)."""
    return model_shape(meta_model(config), name)


#: PEFT methods whose adapters stay resident and trainable over a streamed frozen base: the
#: adapter layers wrap the base projections and read their (bound) weights in the forward.
#: Each trains as stock does (tests/test_peft_variants.py). Not the prompt/prefix methods,
#: which change the inputs or the attention cache instead.
SUPPORTED_PEFT_TYPES = frozenset(
    {"LORA", "IA3", "LOHA", "LOKR", "ADALORA", "VERA", "OFT", "BOFT", "HRA", "FOURIERFT"}
)


def _causal_lm_class(model: nn.Module, model_type: str | None) -> bool:
    """Whether ``model`` is a causal LM class (with its head): a ``*ForCausalLM``, or the class
    transformers' causal-LM mapping builds for its type (GPT-2's ``GPT2LMHeadModel``)."""
    from transformers.models.auto.modeling_auto import (  # noqa: PLC0415
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal_lm,
    )

    name = type(model).__name__
    return name.endswith("ForCausalLM") or name == causal_lm.get(model_type or "")


def check_supported(model: nn.Module) -> str:
    """Raise ``UnsupportedModelError`` naming the problem, before anything is allocated."""
    if _is_peft(model):
        # Adapters (LoRA and its kin) stay resident and trainable, the frozen base streams.
        peft_types = {
            str(getattr(c.peft_type, "value", c.peft_type)) for c in model.peft_config.values()
        }
        if not peft_types <= SUPPORTED_PEFT_TYPES:
            raise UnsupportedModelError(
                f"hf_megatrain: PEFT method(s) {sorted(peft_types - SUPPORTED_PEFT_TYPES)} are "
                f"not supported; adapter methods are: {', '.join(sorted(SUPPORTED_PEFT_TYPES))}."
            )
        model = model.get_base_model()
    config = getattr(model, "config", None)
    named = getattr(config, "model_type", None)
    model_type = model_family(named)
    if model_type != named and not _from_transformers(model):
        model_type = None  # a type taken as a family's: only as transformers' own class builds it
    if model_type is None:
        if config is None:
            raise UnsupportedModelError(
                f"hf_megatrain: {type(model).__name__} has no config: not a transformers model"
            )
        # Name the type the user loaded: a multimodal one's own (its text model the detail), and
        # for a class transformers builds on another type's text config (Emu3ForCausalLM), that.
        outer = outer_model_type(type(model).__name__, named)
        text = named if outer else text_model_type(config)
        raise UnsupportedModelError(
            unsupported_model_type(
                f"hf_megatrain: {type(model).__name__}", outer or named, "", text
            )
        )
    if not _causal_lm_class(model, named):
        raise UnsupportedModelError(
            f"hf_megatrain: {type(model).__name__} is not a *ForCausalLM model; "
            f"load it with AutoModelForCausalLM."
        )
    if model_type in _MOE_TYPES and not recorder_capture_available():
        raise UnsupportedModelError(
            f"hf_megatrain: {model_type} needs transformers' output recorder to keep the router "
            f"aux-loss gradient, and this transformers version does not have it."
        )
    if getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False):
        raise UnsupportedModelError("hf_megatrain: quantized (8/4-bit) models are not supported.")
    if router_aux_loss_on(model) and not _returns_router_logits(model):
        import transformers  # noqa: PLC0415  (only its version, for the message)

        raise UnsupportedModelError(
            f"hf_megatrain: transformers {transformers.__version__}'s {type(model).__name__} does "
            f"not return its layers' router logits, so the router aux loss that "
            f"config.output_router_logits=True asks for cannot be computed (the model's own "
            f"forward fails on it too). Set model.config.output_router_logits = False to train "
            f"without it, or upgrade transformers."
        )
    return model_type


def _from_transformers(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers.")


def _returns_router_logits(model: nn.Module) -> bool:
    """Whether ``model``'s decoder returns the layers' router logits when asked: transformers'
    output recorder collects them, or its forward takes ``output_router_logits`` (GraniteMoE
    before transformers 5.24 does neither, and its ``ForCausalLM`` then fails adding an int)."""
    decoder = type(decoder_of(model) or model)
    recorded = getattr(decoder, "_can_record_outputs", None) or {}
    return "router_logits" in recorded or (
        "output_router_logits" in inspect.signature(decoder.forward).parameters
    )


#: PEFT methods that fold adapters into (or strip them from) the base weights, which a streamed
#: model does not hold in its layers (their base weights are ``meta`` placeholders bound from the
#: host store): merging would compute on the placeholders and leave a model that fails, or skips
#: the adapters, at its next forward.
#: peft methods that read or write the base weights in the layers (meta placeholders there):
#: refused in one line (``add_weighted_adapter`` failed deep in peft and left a half-built
#: adapter that blocked saving).
_MERGING_METHODS = ("merge_and_unload", "merge_adapter", "unload", "add_weighted_adapter")


def _refuse_merge(method: str, *args: Any, **kwargs: Any) -> None:
    raise UnsupportedModelError(
        f"hf_megatrain: {method}() cannot run on a streamed PEFT model: its frozen base weights "
        f"live in the host store, not in its layers. Save the adapters (trainer.save_model(dir)) "
        f"and apply them to a loaded base: PeftModel.from_pretrained("
        f"AutoModelForCausalLM.from_pretrained(base_path), dir).{method}()."
    )


def _refuse_merging(model: nn.Module) -> None:
    """Make ``model``'s merging methods (``_MERGING_METHODS``, reached through the PeftModel or
    its tuner) raise one clear error instead of failing deep inside peft or torch."""
    tuner = model.base_model
    for method in _MERGING_METHODS:
        if hasattr(tuner, method):
            # An instance attribute: found before PeftModel / the tuner forward to their class's.
            object.__setattr__(tuner, method, functools.partial(_refuse_merge, method))


def refuse_changes_since_streaming(
    model: nn.Module,
    state: StreamedModelState,
    advice: str = "make such changes before streaming (pass the materialized model to the trainer)",
) -> None:
    """Refuse ``model`` (streamed, ``state``) where it was changed after streaming in a way
    training would not follow (:meth:`StreamedModelState.changed_since_streaming`)."""
    if (change := state.changed_since_streaming(model)) is not None:
        raise ValueError(
            f"hf_megatrain: {change} after the model was streamed, which training would not "
            f"follow: {advice}"
        )


def disable_gradient_checkpointing(model: nn.Module) -> None:
    """Turn the model's own gradient checkpointing off (``gradient_checkpointing_enable``, as
    peft's ``prepare_model_for_kbit_training`` calls it): its recompute would run a streamed
    layer outside the engine (its weights are meta placeholders). The engine recomputes."""
    model = unwrap_peft(model)
    # (transformers 5.x renamed these activation_checkpointing; older 5.x has only the first.)
    on = getattr(model, "is_activation_checkpointing", None)
    if on is None:
        on = getattr(model, "is_gradient_checkpointing", False)
    if on:
        off = getattr(model, "activation_checkpointing_disable", None)
        (off or model.gradient_checkpointing_disable)()
        logger.info(
            "hf_megatrain: the model's gradient checkpointing is turned off: streamed layers "
            "recompute in the engine (checkpoint segments)"
        )


def _active_adapters(model: nn.Module) -> tuple[str, ...]:
    """A PEFT model's active adapter names (``()`` for other models)."""
    if not _is_peft(model):
        return ()
    active = getattr(model, "active_adapters", None)
    if active is None:
        active = getattr(model, "active_adapter", ())
    return (active,) if isinstance(active, str) else tuple(active)


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel  # noqa: PLC0415 - optional dependency
    except ImportError:
        return False
    return isinstance(model, PeftModel)


_RANDOM_CONFIG_KEYS = ("dropout", "pdrop", "jitter")  # e.g. attention_dropout, router_jitter_noise


#: Config names of how many hidden states per token a layer takes in and hands on: Gemma 3n's
#: AltUp predictions, the hyper-connection streams of Hunyuan V4 and DeepSeek-V4 (``hc_mult``)
#: and Qwen4-exp (``hc_count``).
_RESIDUAL_STREAM_NAMES = ("altup_num_inputs", "hc_mult", "hc_count")


def residual_streams(text_cfg) -> int:
    """Hidden states per token between layers (``ModelShape.residual_streams``; 1 for most)."""
    return next((int(v) for n in _RESIDUAL_STREAM_NAMES if (v := getattr(text_cfg, n, 0))), 1)


def _text_config(config):
    """The text model's config (the config itself for text-only models)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _shared_expert_size(layers: list[nn.Module], routes: list[bool], config) -> int:
    """The MLP width of an MoE layer's shared expert(s), run on every token beside the routed
    ones; 0 without. Read from the first routed layer's shared module (``shared_expert``,
    ``shared_experts``, ``shared_mlp``: Qwen2-MoE's and Qwen3-Next's own width; DeepSeek's,
    GLM-4-MoE's, ERNIE 4.5's, EXAONE-MoE's n experts of the routed width; Hunyuan's and
    GraniteMoE-Shared's own), as each config names its width otherwise; from the config's
    names where no such module is found."""
    routed = [layer for layer, r in zip(layers, routes) if r] or layers[:1]
    for layer in routed:
        for name, module in layer.named_modules():
            if "shared" in name.rsplit(".", 1)[-1] and (width := _gated_width(module)):
                return width
        # A dense MLP beside the experts, not holding them (Gemma 4's mlp runs every token).
        mlp = getattr(layer, "mlp", None)
        beside = mlp is not None and not any(n.endswith("experts") for n, _ in mlp.named_modules())
        if beside and _has_experts(layer) and (width := _gated_width(mlp)):
            return width
    width = getattr(config, "shared_expert_intermediate_size", None) or getattr(
        config, "shared_intermediate_size", None
    )
    if width:
        return int(width)
    n = next((getattr(config, a) for a in _SHARED_EXPERT_COUNTS if getattr(config, a, None)), 0)
    return int(n) * int(getattr(config, "moe_intermediate_size", 0) or 0)


#: Config names of the shared experts' count (each of the routed experts' width).
_SHARED_EXPERT_COUNTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")


def _gated_width(mlp: nn.Module) -> int:
    """An MLP module's width from its gate/up projection (a fused gate-up projection holds two
    of it); 0 when it has none."""
    for name, share in (("gate_proj", 1), ("up_proj", 1), ("w1", 1), ("input_linear", 2),
                        ("gate_up_proj", 2)):  # fmt: skip
        proj = getattr(mlp, name, None)
        proj = getattr(proj, "base_layer", proj)  # (under a PEFT adapter)
        if isinstance(proj, nn.Linear):
            return proj.out_features // share
    return 0


#: Modules whose parameters autocast casts to the compute dtype (matmul and convolution weights
#: and biases): a vector or scalar parameter of any other module, stock computes with at its
#: fp32 value.
_AUTOCAST_CAST_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d)


def _exact_params(layer: nn.Module, streamed: set[str]) -> list[str]:
    """The layer's parameters to bind at their fp32 master values
    (``StreamingEngine.bind_exact``), as the stock Trainer's autocast uses them: the norms'
    (RMSNorm / LayerNorm weights and biases, residual-stream and per-head q/k norms alike, the
    family's own class or a fused kernel's: Liger's, the compiled forwards) and every other
    vector or scalar parameter outside a matmul or convolution module (xIELU's alphas, gpt-oss's
    attention sinks and router bias, Qwen3-Next's decay parameters). Autocast casts matmul
    weights to bf16, never these, so a weight of 1 + 1e-3 computes as that and its gradient
    comes back in fp32; one an autocast op does consume is cast from the fp32 value to the same
    bf16 as the stream copy. (Bound as the bf16 copy, bf16 Gemma-2 drifted to 3x stock's own
    spread over 150 steps; Apertus's xIELU ran in bf16 where stock's runs in fp32.) Where a norm
    of bf16 activations returns ``weight * x`` (Llama-style per-head q/k norms: Qwen3), its
    output is then fp32 as in stock; the planner counts those bytes (``activation_memory``,
    exact q/k norms). So are the parameters of a module whose forward turns autocast off
    (ERNIE 4.5 MoE's router: its weight and score correction in fp32), and of its submodules:
    stock computes with their fp32 values there."""
    names = []
    fp32_modules = [n for n, m in layer.named_modules() if _turns_autocast_off(type(m))]
    for mod_name, module in layer.named_modules():
        cls = type(module).__name__
        norm = "RMSNorm" in cls or "LayerNorm" in cls  # (Nemotron's LayerNorm1P too)
        cast = isinstance(module, _AUTOCAST_CAST_MODULES)
        fp32 = any(mod_name == m or mod_name.startswith(f"{m}.") for m in fp32_modules)
        for attr, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{attr}" if mod_name else attr
            if not (p.dtype.is_floating_point and name in streamed):
                continue
            if fp32 or (norm and attr in ("weight", "bias")) or (not cast and p.dim() <= 1):
                names.append(name)
            elif name.endswith(_SCAN_FP32_PARAMS):
                names.append(name)
    return names


#: Parameters that Mamba's selective scan reads at fp32 outside any autocast op although the rule
#: above would bind them as the bf16 copy: its 2-D ``A_log`` (inner x state, ``A_log.float()``)
#: and the time-step projection's bias, added after the projection (``dt_proj.bias.float()``).
#: As the bf16 copy, one bf16 step's gradients of Mamba were 1e-3-5e-3 from stock's (CPU).
_SCAN_FP32_PARAMS = ("A_log", "dt_proj.bias")


@functools.cache
def _turns_autocast_off(cls: type) -> bool:
    """Whether ``cls.forward`` runs (part of) itself with autocast off: calls
    ``autocast(..., enabled=False)`` (torch's or transformers' ``maybe_autocast``). Read from the
    forward's syntax tree, so a comment or string that mentions it does not count."""
    if cls.__module__.startswith("torch."):
        return False
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:  # (a forward dedent cannot free: its text, as before)
        return bool(re.search(r"autocast\([^)]*enabled\s*=\s*False", source))
    return any(
        isinstance(node, ast.Call)
        and _called_name(node.func).endswith("autocast")
        and any(
            k.arg == "enabled" and isinstance(k.value, ast.Constant) and k.value.value is False
            for k in node.keywords
        )
        for node in ast.walk(tree)
    )


def _called_name(func: ast.expr) -> str:
    """``f`` of ``f(...)`` or ``a.b.f(...)``; empty for other callees."""
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _widens_to_fp32(attention: nn.Module | None) -> bool:
    """Whether the attention's q norm, its weight bound in fp32 (``_exact_params``), returns
    fp32 for a bf16 input: probed with the family's own forward (the compiled kernels restate
    it) on a small stand-in. Liger's kernel writes its input's dtype (and runs only on CUDA). A
    forward the stand-in cannot run is taken to widen: the plan then errs high, not low."""
    norm = _q_norm(attention)
    weight = getattr(norm, "weight", None)
    patched = getattr(norm, "__dict__", {}).get("forward")
    if not isinstance(weight, nn.Parameter) or "liger" in getattr(patched, "__module__", ""):
        return False
    proxy = stand_in(norm, weight=nn.Parameter(torch.ones(weight.shape)))
    x = torch.ones((2, *weight.shape), dtype=torch.bfloat16)
    try:
        with torch.no_grad():
            return type(norm).forward(proxy, x).dtype == torch.float32
    except Exception:  # noqa: BLE001 - a forward that needs more than one input: plan high
        return True


def _has_dropout(config) -> bool:
    """Whether a layer's forward draws random numbers (dropout, MoE router jitter) in training.

    Then the recompute in backward must replay the forward's RNG state, or it would use other
    dropout masks / routes than the forward and the gradients would be wrong.
    """
    for key, value in config.to_dict().items():
        if not any(part in key for part in _RANDOM_CONFIG_KEYS):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return True
    return False


def _has_dropout_modules(layers: nn.ModuleList) -> bool:
    """Whether a decoder layer holds a dropout module that drops (``p > 0``) which its config does
    not tell of: PEFT's LoRA dropout (``LoraConfig(lora_dropout=...)``) on each adapted
    projection. Its recompute must replay the forward's masks too (``_has_dropout``)."""
    return any(
        isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
        for layer in layers
        for m in layer.modules()
    )


def _has_adapter_layers(layers: nn.ModuleList) -> bool:
    """Whether a decoder layer holds a PEFT adapter layer: several draw random numbers in
    training outside any dropout module (LoHa's and LoKr's ``module_dropout`` skip the adapter
    by ``torch.rand``, BOFT's multiplicative dropout), so their recompute replays the forward's
    generator state too. Saving it per recomputed layer is cheap beside the layer."""
    return any(
        any(c.__name__ == "BaseTunerLayer" for c in type(m).__mro__)
        for layer in layers
        for m in layer.modules()
    )


def streamed_names(layer: nn.Module) -> set[str]:
    """The parameters of ``layer`` that go to the host store.

    A layer whose parameters are all trainable or all frozen streams them all; so does one whose
    frozen parameters are no more than its trainable ones (a router's statistics, a projection
    frozen by hand): they stream in the layer's trainable store, get no gradient and never
    update (``TensorSlot.trainable``). A layer that is mostly frozen (LoRA adapters over a
    frozen base) streams the frozen ones from a frozen store, and its trainable ones stay
    resident on the device with their own optimizer state.
    """
    params = dict(layer.named_parameters())
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    frozen = sum(p.numel() for p in params.values() if not p.requires_grad)
    if trainable == 0 or frozen <= trainable:
        return set(params)
    return {n for n, p in params.items() if not p.requires_grad}


def default_decay_names(model: nn.Module) -> set[str]:
    """The parameters the stock Trainer decays (its ``get_decay_parameter_names``)."""
    from transformers import Trainer  # noqa: PLC0415

    return set(Trainer.get_decay_parameter_names(None, model))


def layer_layouts(layers: nn.ModuleList, decay_names: set[str], prefix: str) -> list[LayerLayout]:
    """Per layer: the store layout of its streamed parameters (``core.builder.LayerLayout``)."""
    out = []
    seen: dict[int, str] = {}
    for i, layer in enumerate(layers):
        entries = []
        streamed = streamed_names(layer)
        for rel, p in layer.named_parameters():
            if rel not in streamed:
                continue
            full = f"{prefix}.{i}.{rel}"
            if id(p) in seen:
                raise UnsupportedModelError(
                    f"hf_megatrain: parameter {full} is shared with {seen[id(p)]}; weights shared "
                    f"across decoder layers cannot be streamed."
                )
            seen[id(p)] = full
            entries.append((rel, tuple(p.shape), full in decay_names))
        frozen = {n for n, p in layer.named_parameters() if n in streamed and not p.requires_grad}
        slots, numel, decay_numel = layout_slots(entries, frozen)
        trainable = len(frozen) < len(streamed)
        out.append(LayerLayout(slots, numel, decay_numel, trainable))
    return out


def streamed_state(model: nn.Module) -> StreamedModelState | None:
    return getattr(model, "_megatrain", None)


def host_adamw(
    state: StreamedModelState,
    resolved: ResolvedOptions,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
):
    """The engine's AdamW (``HostAdamW``) for a streamed model's run with options ``resolved``:
    the layers in their stores, the resident parameters (decayed as streamed), the host update's
    overlap and threads, device updates where the plan counted their staging, eager updates
    where the run has no clipping."""
    from ..core.optimizer import HostAdamW  # noqa: PLC0415

    options = resolved.options
    optimizer = HostAdamW(
        state.engine,
        state.resident,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        overlap_update=options.overlap_optimizer,
        update_threads=options.host_update_threads,
        device_update_lead=(
            options.device_update_lead
            if resolved.device_updates and state.plan is not None and state.plan.device_updates
            else 0
        ),
    )
    if resolved.eager_update:
        # No global norm to wait for: each layer updates as soon as its gradient of the step
        # is final, overlapping the rest of the backward.
        optimizer.enable_eager_updates()
    return optimizer


def streamed_optimizer(
    model: nn.Module,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
):
    """AdamW for a training loop of your own over a streamed model (``load_streamed_model``,
    ``prepare_streamed_model``): torch's optimizers see its decoder layers' placeholders, not
    their weights (which live in the host store), and are refused at their first step. The
    same update as the trainer's (fp32 masters and moments, exact); ``weight_decay`` applies
    to the parameters the model was streamed to decay (``decay_names``). Per step::

        loss = model(**batch).loss
        loss.backward()
        optimizer.clip_grad_norm_(1.0)  # the whole model's norm (clip_grad_norm_ of
        optimizer.step()                # model.parameters() misses the streamed layers)
        optimizer.zero_grad()
    """
    state = streamed_state(model)
    if state is None or state.options is None:
        raise ValueError(
            "hf_megatrain: streamed_optimizer() needs a streamed model: load it with "
            "load_streamed_model(path) or stream it with prepare_streamed_model(model, ...)"
        )
    if state.frozen:
        raise ValueError(
            "hf_megatrain: the model streams frozen (weights only, for a reference model) and "
            "cannot be trained; stream it trainable"
        )
    return host_adamw(state, state.options, lr, betas, eps, weight_decay)


def streamed_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient from the backward passes since the last optimizer step, by
    its name in the model, as fp32 host tensors: the decoder layers' from their host stores
    (compact bf16 slots widened with their fp32 parts), the resident parameters' from
    ``.grad``. Layers and parameters that got no gradient are left out (as a stock model's
    ``.grad`` is None there: frozen, or not reached by the loss). For checks and probes: read it after
    the step's last backward (it finishes the device-to-host copies, as the optimizer step
    does first) and before the optimizer step consumes the gradients."""
    state = streamed_state(model)
    if state is None:
        raise ValueError("hf_megatrain: not a streamed model (see prepare_streamed_model)")
    state.engine.finish_grads()
    grads: dict[str, torch.Tensor] = {}
    for i, store in enumerate(state.store.layers):
        if not state.engine.layer_has_grad(i):
            continue
        flat = torch.empty(store.numel)
        grad = state.engine.final_grad(i)
        if store.fp32_grad_slots:  # a compact slot: bf16 with fp32 parts
            store.widen_grad(0, store.numel, flat, grad)
        else:  # fp32 (a host slot, or an HBM-tier layer's on the device)
            flat.copy_(grad)
        gradless = {store.slots[k].name for k in state.engine.gradless_slots(i)}
        for rel, g in store.param_views(flat).items():
            if rel not in gradless:
                grads[state.full_name(i, rel)] = g
    for name, p, _ in state.resident:
        if p.grad is not None:
            grads[name] = p.grad.detach().float().cpu().clone()
    return grads


def prepare_streamed_model(
    model: nn.Module,
    device: torch.device | str,
    compute_dtype: torch.dtype,
    options: EngineOptions | None = None,
    *,
    decay_names: set[str] | None = None,
    step: StepShape | None = None,
    clipping: bool = True,
    single_backward: bool | None = None,
    **option_fields: Any,
) -> nn.Module:
    """Move ``model``'s decoder layers into a host store and stream them from now on.

    The one road to a streamed model: the loaders and ``HFMegaTrainer`` both come here. Works on
    a materialized model (parameters on CPU) and on a skeleton whose layer parameters are on
    ``meta`` (then the weights are filled by ``load_weights_into_store``). Idempotent.

    ``options`` (default: the defaults), with any :class:`EngineOptions` field given as a keyword
    applied over it, are resolved for a run that clips gradients (``clipping``) or not; the model
    remembers them (``streamed_state(model).options``). ``step`` (the micro-batch split) lets the
    memory plan size activations and the loss line by line instead of reserving
    ``hbm_reserve_gb`` for them. ``decay_names``: the parameters AdamW decays (default: the
    stock Trainer's set; a trainer with another one refuses the model). ``single_backward``: every optimizer step's gradients come from
    one backward pass of one process (default: the step's ``grad_accum`` is 1), which lets bf16
    runs keep compact gradient slots (``compact_host_grads``).
    """
    existing = streamed_state(model)
    if existing is not None:
        refuse_changes_since_streaming(model, existing)
        return model
    check_supported(model)
    disable_gradient_checkpointing(model)
    if decay_names is None:
        decay_names = default_decay_names(model)
    options = options if options is not None else EngineOptions()
    if option_fields:
        options = options.with_(**option_fields)
    device = torch.device(device)
    resolved = options.resolve(
        clipping=clipping,
        cuda=device.type == "cuda",
        # Data parallel turns it off (core/builder.py).
        single_backward=(
            single_backward
            if single_backward is not None
            else step is not None and step.grad_accum == 1
        ),
    )
    config = model.config
    use_cache = getattr(config, "use_cache", None)
    # A cache would be written through shared templates: never train with it.
    config.use_cache = False
    prefix, layers = find_decoder_layers(model)
    layouts = layer_layouts(layers, decay_names, prefix)
    streamed = [streamed_names(layer) for layer in layers]

    def fill(i: int, store) -> None:
        layer = layers[i]
        views = store.param_views(store.master)
        for rel, p in layer.named_parameters():
            # Shared weights (data parallel): the owner writes them.
            if rel in streamed[i] and p.device.type != "meta" and store.owned:
                views[rel].copy_(p.detach().to(torch.float32))
        if store.owned:
            store.refresh_stream_copy()
        _replace_with_meta(layer, streamed[i])

    built = build_streamed_state(
        layouts,
        resolved,
        device,
        compute_dtype,
        fill=fill,
        shape=model_shape(model) if step is not None else None,
        step=step,
        # What the caller hands over already materialized in host RAM (not meta, not a GPU's).
        input_model_bytes=sum(
            p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu"
        ),
        # Not gated on model.training: from_pretrained returns the model in eval mode and the
        # Trainer switches it to train mode only later, so the flag says nothing about training.
        preserve_rng=(
            _has_dropout(config) or _has_dropout_modules(layers) or _has_adapter_layers(layers)
        ),
        namer=ARGUMENT_NAMER,
    )
    engine = built.engine
    device = engine.device
    resolved = built.options or resolved  # with what auto_fit turned on
    layer_prefixes = tuple(f"{prefix}.{i}." for i in range(len(layers)))
    _place_resident(model, device, layer_prefixes)
    capture = RecorderCapture()
    for i, layer in enumerate(layers):
        # After _place_resident: the resident tensors are the final device parameters.
        layer_resident = [(n, p) for n, p in layer.named_parameters() if n not in streamed[i]]
        layer.forward = StreamedLayer(
            engine,
            i,
            layer,
            capture=capture,
            trainable=layouts[i].trainable and bool(streamed[i]),
            resident=layer_resident,
            fp32_params=_exact_params(layer, streamed[i]),
        )
    resident = list(_named_resident(model, decay_names))
    model._megatrain = StreamedModelState(
        engine=engine,
        store=HostStore(built.stores),
        layers_prefix=prefix,
        resident=resident,
        plan=built.plan,
        options=resolved,
        step=step,
        asked=built.asked,
        adapters=_is_peft(model),
        active_adapters=_active_adapters(model),
        use_cache=use_cache,
    )
    install_module_calls(model, layers, engine.device, streamed_state)
    _drop_unread_kv_stores(layers)
    if _is_peft(model):
        _refuse_merging(model)
    # The layer-level options: MLP tiles, kept activations, kept attention outputs.
    install_mlp_tiling(model, resolved.mlp_tile_tokens)
    keep_activations(model, options.keep_activations)
    keep_attention_outputs(
        model, options.keep_attention_outputs if options.recompute_early_stop else "off"
    )
    logger.info("hf_megatrain: %s", _store_report(model, built, resolved, compute_dtype, device))
    return model


def _store_report(model, built, resolved, compute_dtype, device) -> str:
    """Where the layers went, in the device's terms (a CPU has no HBM tier nor pinned memory)."""
    stores, n = built.stores, built.n_resident
    store = f"{model._megatrain.store.nbytes / 2**30:.2f} GiB host store"
    notes = _grad_slots_note(resolved, compute_dtype)
    notes += ", fp32 masters stream" if resolved.stream_fp32_master else ""
    if torch.device(device).type == "cuda":
        pinned = "pinned" if any(s.pinned for s in stores) else "pageable"
        layers = f"{n} layers in HBM, {len(stores) - n} streamed ({store}, {pinned}{notes})"
    else:
        whole = f"{n} layers kept whole, " if n else ""
        layers = f"{whole}{len(stores) - n} layers streamed ({store}{notes})"
    return f"{layers}; {len(model._megatrain.resident)} resident tensors on {device}"


def _grad_slots_note(resolved: ResolvedOptions, compute_dtype: torch.dtype) -> str:
    if not resolved.host_grads:
        return ", no grad slots (eager updates)"
    grad_dtype = resolved.host_grad_dtype(compute_dtype)
    return "" if grad_dtype == torch.float32 else f", {grad_dtype_label(grad_dtype)} grad slots"


def prepare_frozen_streamed_model(
    model: nn.Module,
    device: torch.device | str,
    compute_dtype: torch.dtype,
    options: EngineOptions | None = None,
    *,
    layer_weights: Callable[[int], dict[str, torch.Tensor]] | None = None,
) -> nn.Module:
    """Stream ``model`` frozen, for a model that is only ever run forward (a DPO reference).

    Its decoder layers move into weights-only host stores in ``compute_dtype`` (no fp32 master,
    gradient or AdamW moments: host RAM is the weights in the compute dtype); the other
    parameters become a frozen fp32 copy on ``device``, as a trained model's resident parameters
    are, so a forward computes exactly what the trainable streamed model of the same weights
    computes. Every parameter gets ``requires_grad=False``.

    ``layer_weights(i)``: decoder layer ``i``'s weights by name relative to the layer (default:
    the layer's own parameters; then they may be ``meta``, to be filled by
    ``load_weights_into_store``). Of ``options`` only ``pin_memory``, ``host_memory_limit_gb``
    and ``mlp_tile_tokens`` apply. Data parallel: every process holds its own copy.
    """
    if streamed_state(model) is not None:
        raise ValueError("hf_megatrain: the model is already streamed; pass a materialized one")
    check_supported(model)
    if _is_peft(model):
        raise UnsupportedModelError(
            "hf_megatrain: a PEFT model cannot be streamed frozen; merge its adapters first"
        )
    options = options if options is not None else EngineOptions()
    device = torch.device(device)
    model.config.use_cache = False
    for p in model.parameters():
        p.requires_grad_(False)
    prefix, layers = find_decoder_layers(model)
    # No decay split: a frozen store is never updated.
    layouts = layer_layouts(layers, set(), prefix)
    streamed = [streamed_names(layer) for layer in layers]

    def fill(i: int, store) -> None:
        layer = layers[i]
        source = layer_weights(i) if layer_weights is not None else dict(layer.named_parameters())
        with torch.no_grad():
            for rel, view in store.param_views(store.master).items():
                if source[rel].device.type != "meta":
                    view.copy_(source[rel])  # rounds to the compute dtype (as a stream copy)
        _replace_with_meta(layer, streamed[i])

    gb = options.host_memory_limit_gb
    built = build_frozen_state(
        layouts,
        device,
        compute_dtype,
        fill=fill,
        pin_memory=options.pin_memory,
        host_memory_limit_bytes=None if gb is None else int(gb * 2**30),
    )
    engine = built.engine
    _place_resident(model, engine.device, tuple(f"{prefix}.{i}." for i in range(len(layers))))
    capture = RecorderCapture()
    for i, layer in enumerate(layers):
        layer.forward = StreamedLayer(
            engine,
            i,
            layer,
            capture=capture,
            trainable=False,
            fp32_params=_exact_params(layer, streamed[i]),
        )
    model._megatrain = StreamedModelState(
        engine=engine,
        store=HostStore(built.stores),
        layers_prefix=prefix,
        # Listed for checkpoint loads (load_weights_into_store fills them); none is trainable.
        resident=list(_named_resident(model, set())),
        frozen=True,
    )
    install_module_calls(model, layers, engine.device, streamed_state)
    _drop_unread_kv_stores(layers)
    install_mlp_tiling(model, options.mlp_tile_tokens)
    logger.info(
        "hf_megatrain: frozen streamed model, %d layers (%.2f GiB host store, %s weights only)",
        len(layers),
        model._megatrain.store.nbytes / 2**30,
        str(compute_dtype).replace("torch.", ""),
    )
    return model


def keep_activations(model: nn.Module, value: int | str) -> int:
    """Let the last HBM-tier layers keep their forward activations (no recompute in backward).

    ``value``: "auto" (the memory plan's count when the model was streamed with a planned
    workload, else 0), "off", or a count of HBM-tier layers. Returns how many keep them. The
    choice can change between steps (it takes effect at the next forward).
    """
    state = streamed_state(model)
    if state is None:
        raise ValueError("hf_megatrain: keep_activations needs a streamed model")
    layers = [layer.forward for layer in find_decoder_layers(model)[1]]
    # Layers cast from their fp32 master into a reused stream buffer cannot keep a graph over
    # their weights, like streamed layers.
    tier = [
        i
        for i, store in enumerate(state.engine.stores)
        if store.resident and not store.casts_on_use
    ]
    count = parse_keep_activations(value)
    if count is None:  # "auto"
        count = state.plan.kept_layers if state.plan is not None else 0
    if count > len(tier):
        raise ValueError(
            f"hf_megatrain: keep_activations={count} but only {len(tier)} layers are in the HBM "
            "tier with their own compute-dtype copy (megatrain_resident_layers, "
            "megatrain_hbm_cast_weights off); streamed layers must recompute, their GPU buffer "
            "is reused by the next layer"
        )
    kept = set(tier[len(tier) - count :]) if count else set()
    _flag_layers(layers, "keep_graph", kept, "their activations (no recompute)")
    return count


def _flag_layers(layers: list, attr: str, chosen: set[int], what: str) -> None:
    """Set ``attr`` on the chosen streamed layers (and clear it on the others); say which."""
    for i, layer in enumerate(layers):
        setattr(layer, attr, i in chosen)
    if chosen:
        logger.info("hf_megatrain: layers %d-%d keep %s", min(chosen), max(chosen), what)


def keep_attention_outputs(model: nn.Module, value: object) -> int:
    """Let the last recomputed layers keep their attention kernel's outputs for the recompute.

    ``value``: "off" (or False), "all" (or True: every recomputed layer), "auto" (the memory
    plan's count when the model was streamed with a planned workload, else 0) or a count
    (capped at the recomputed layers). Call after :func:`keep_activations` (layers that keep
    their whole graph do not recompute). Returns how many keep them; takes effect at the next
    forward.
    """
    state = streamed_state(model)
    if state is None:
        raise ValueError("hf_megatrain: keep_attention_outputs needs a streamed model")
    layers = [layer.forward for layer in find_decoder_layers(model)[1]]
    ask = parse_attention_layers(value)
    recomputed = [i for i, layer in enumerate(layers) if not layer.keep_graph]
    if ask is None:
        if (state.plan is None or state.plan.step is None) and state.engine.is_cuda:
            # "auto" is the default: without the step's plan (an unknown row length; a CPU run
            # never has one, and is not told) it quietly keeps none, as "off" would.
            logger.info(
                "hf_megatrain: keep_attention_outputs='auto' without the memory plan of the step "
                "(a GPU and a known row length): no layer keeps them"
            )
        count = state.plan.attention_layers if state.plan is not None else 0
    else:
        count = len(recomputed) if ask == ALL_LAYERS else ask
    if _attention_implementation(model) != "sdpa":
        # The kept outputs are SDPA kernels' (recompute.attention_output_cache): under another
        # attention nothing would be kept, and FlexAttention run under the caching mode could
        # leave its compiled kernel (the trainer warns when they were asked for).
        count = 0
    keep = set(last_recomputed(recomputed, min(count, len(recomputed))))
    _flag_layers(layers, "keep_attention", keep, "their attention outputs for the recompute")
    return len(keep)


def _attention_implementation(model: nn.Module) -> str:
    config = getattr(unwrap_peft(model), "config", None)
    return getattr(config, "_attn_implementation", None) or "sdpa"


def _named_resident(model: nn.Module, decay_names: set[str]):
    """Parameters that live on the device (streamed ones are ``meta`` placeholders)."""
    for name, p in model.named_parameters():
        if p.device.type != "meta":
            yield name, p, name in decay_names


def _replace_with_meta(layer: nn.Module, names: set[str]) -> None:
    """Swap the named parameters of ``layer`` for ``meta`` placeholders, releasing storage."""
    for mod_name, module in layer.named_modules():
        for pname, p in list(module._parameters.items()):
            full = f"{mod_name}.{pname}" if mod_name else pname
            if p is None or full not in names:
                continue
            placeholder = nn.Parameter(
                torch.empty(p.shape, dtype=torch.float32, device="meta"),
                requires_grad=p.requires_grad,
            )
            module._parameters[pname] = placeholder


def _place_resident(
    model: nn.Module, device: torch.device, layer_prefixes: tuple[str, ...]
) -> None:
    """fp32 masters of the non-streamed parameters, and all buffers, on the compute device.

    Inside decoder layers, ``meta`` parameters are the streamed placeholders and stay so; real
    ones there (LoRA adapters) become resident like the embeddings. Parameters shared between
    modules (tied input/output embeddings) stay shared.
    """
    replaced: dict[int, nn.Parameter] = {}
    for mod_name, module in model.named_modules():
        in_layer = (mod_name + ".").startswith(layer_prefixes)
        for pname, p in list(module._parameters.items()):
            if p is None or (in_layer and p.device.type == "meta"):
                continue
            if id(p) not in replaced:
                if p.device.type == "meta":
                    data = torch.empty(p.shape, dtype=torch.float32, device=device)
                else:
                    data = p.detach().to(device=device, dtype=torch.float32)
                replaced[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
            module._parameters[pname] = replaced[id(p)]
        for bname, b in list(module._buffers.items()):
            if b is not None and b.device.type != "meta":
                module._buffers[bname] = b.to(device)
