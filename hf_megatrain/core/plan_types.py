"""The planner's inputs: a model's shape, a step's workload, and one named cost line.

Plain frozen dataclasses (no ``transformers`` import): the CLI builds a :class:`ModelShape` from
a config on the meta device, the trainer from the model it streams.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a decoder model (parameter counts, not weights)."""

    layer_numels: tuple[int, ...]  # parameters per decoder layer, in layer order
    non_layer_numel: int  # embeddings, final norm, LM head (a tied head counted once)
    hidden_size: int
    vocab_size: int
    intermediate_size: int  # MLP width (for MoE: the active experts' total width)
    tied_embeddings: bool = False
    fused_loss: bool = True  # whether training uses the chunked LM head + loss
    name: str = "model"
    # Width of one of k/v (kv heads x head dim); 0 when unknown: taken as hidden_size (an upper
    # bound, so kept-activation estimates err high).
    kv_size: int = 0
    # Width of one attention head; 0 when unknown (then the RoPE tables go uncounted).
    head_dim: int = 0
    # Query heads; 0 when unknown (then taken as hidden_size / head_dim).
    num_heads: int = 0
    # Whether attention normalizes q and k per head (Qwen3's q_norm / k_norm).
    qk_norm: bool = False
    # Whether RMSNorm and the gated MLP run as fused kernels (Liger-Kernel) that save their
    # inputs only, not their intermediate products (fewer kept-activation bytes).
    fused_layer_kernels: bool = False
    # Whether ``kept_activation_bytes_per_token`` is audited for this layer family (exact or
    # above autograd's saved tensors, tests/test_keep_activations.py). When not (Gemma3, the
    # MoE families) "auto" plans no kept activations rather than risk running out of memory.
    kept_bytes_audited: bool = True
    # Gemma3's layer: four RMSNorms (pre and post attention and MLP) computing in fp32, and
    # per-head q/k norms that keep an fp32 input and product (see
    # ``kept_activation_bytes_per_token``).
    gemma_norms: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layer_numels)

    @property
    def layer_numel(self) -> int:
        return sum(self.layer_numels)

    @property
    def total_numel(self) -> int:
        return self.layer_numel + self.non_layer_numel

    def with_num_layers(self, n: int) -> ModelShape:
        """The same family shape with ``n`` layers (each like the largest current one)."""
        big = max(self.layer_numels, default=0)
        return replace(self, layer_numels=(big,) * n, name=f"{self.name} x{n} layers")


#: ``Workload.attention_output_layers``: every recomputed layer.
ALL_LAYERS = -1


def parse_attention_layers(value: object, recompute_early_stop: bool = True) -> int | None:
    """``megatrain_keep_attention_outputs`` as ``Workload.attention_output_layers``: "off"
    (or False) 0, "all" (or True) ``ALL_LAYERS``, "auto" None, or a count of layers; 0 without
    the early-stop recompute (whole layers re-run: nothing is kept)."""
    text = str(value).strip().lower()
    named = {"off": 0, "false": 0, "none": 0, "": 0, "all": ALL_LAYERS, "true": ALL_LAYERS}
    if text == "auto":
        ask = None
    elif text in named:
        ask = named[text]
    elif text.isdigit():
        ask = int(text)
    else:
        raise ValueError(
            f"keep_attention_outputs={value!r}: use 'off', 'all', 'auto' or a layer count"
        )
    return ask if recompute_early_stop else 0


def last_recomputed(recomputed: list[int], count: int) -> list[int]:
    """The layers (of those recomputed in backward, in order) that keep their attention
    kernel's outputs: the last ``count``."""
    return recomputed[len(recomputed) - count :] if count > 0 else []


@dataclass(frozen=True)
class Workload:
    """One optimizer step: ``grad_accum`` micro-batches of ``micro_batch_tokens`` tokens."""

    seq_len: int
    micro_batch_tokens: int
    grad_accum: int = 1
    # Engine option: MLPs run in sequence tiles of this many tokens (0: whole micro-batch),
    # which bounds the MLP part of a layer's recompute working set.
    mlp_tile_tokens: int = 0
    # Engine option: layer-boundary activations live in pinned host memory instead of HBM.
    offload_activations: bool = False
    # Bytes per element of a saved layer-boundary activation (the residual stream): 4 keeps it
    # fp32; 2 is engine option boundary_dtype=bfloat16 (a rounded copy saved for the recompute).
    boundary_bytes_per_element: int = 4
    # Engine option checkpoint_every: only every k-th layer saves its input (a segment leader);
    # a segment's backward recomputes the others' and holds up to k - 1 of them (fp32) in HBM.
    checkpoint_every: int = 1
    # Engine option keep_attention_outputs: recomputed layers that keep their fused attention
    # kernel's output and log-sum-exp in HBM from forward to backward (no attention forward in
    # the recompute): 0 none, a count, ALL_LAYERS every recomputed layer, None as many as the
    # HBM left after the tier and kept activations fits. Without effect where layers re-run
    # whole (boundaries saved narrower). ``parse_attention_layers`` reads the option.
    attention_output_layers: int | None = 0

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch_tokens * self.grad_accum

    @classmethod
    def from_step(
        cls,
        seq_len: int,
        tokens_per_step: int,
        micro_batch_tokens: int | None = None,
        grad_accum: int | None = None,
    ) -> Workload:
        """Resolve the split of a step; by default the whole step is one micro-batch."""
        if seq_len < 1 or tokens_per_step < 1:
            raise ValueError("seq-len and tokens-per-step must be at least 1")
        if micro_batch_tokens is not None and micro_batch_tokens < 1:
            raise ValueError("micro-batch-tokens must be at least 1")
        if grad_accum is not None and grad_accum < 1:
            raise ValueError("grad-accum must be at least 1")
        if micro_batch_tokens is None:
            ga = grad_accum or 1
            if tokens_per_step % ga:
                raise ValueError(
                    f"tokens-per-step {tokens_per_step} does not split into {ga} micro-batches"
                )
            micro_batch_tokens = tokens_per_step // ga
        if tokens_per_step % micro_batch_tokens:
            raise ValueError(
                f"tokens-per-step {tokens_per_step} is not a multiple of micro-batch-tokens "
                f"{micro_batch_tokens}"
            )
        ga = tokens_per_step // micro_batch_tokens
        if grad_accum is not None and grad_accum != ga:
            raise ValueError(
                f"grad-accum {grad_accum} x micro-batch-tokens {micro_batch_tokens} != "
                f"tokens-per-step {tokens_per_step}"
            )
        if micro_batch_tokens % seq_len:
            raise ValueError(
                f"a micro-batch of {micro_batch_tokens} tokens (tokens-per-step / grad-accum) "
                f"is not a whole number of sequences of seq-len {seq_len}"
            )
        return cls(seq_len=seq_len, micro_batch_tokens=micro_batch_tokens, grad_accum=ga)


@dataclass(frozen=True)
class MemoryLine:
    """One named cost of the plan."""

    name: str
    nbytes: int
