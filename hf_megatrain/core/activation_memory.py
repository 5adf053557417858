"""Activation memory of a training step: what each decoder layer saves for backward.

Boundary activations (the saved residual-stream inputs, in HBM or offloaded), what a layer that
keeps its graph saves per token (audited against autograd's saved tensors), the recompute working
set and the loss/LM-head temporaries: the per-micro-batch lines of the memory plan.

Each reads the step's micro-batch (:class:`~hf_megatrain.core.options.StepShape`) and the engine
options that shape activations (:class:`~hf_megatrain.core.options.ResolvedOptions`:
``mlp_tile_tokens``, ``offload_activations``, ``boundary_bytes_per_element``,
``checkpoint_every``).
"""

from __future__ import annotations

import torch

from .chunked_loss import default_chunk_tokens
from .options import ResolvedOptions, StepShape
from .plan_types import MemoryLine, ModelShape, itemsize

#: Bytes per token x hidden of a layer's backward on top of its saved input: the recomputed
#: attention half (bf16 norm output, q, attention output, o-proj output, post-norm output; fp32
#: mid-layer residual and post-norm input) and the fp32 gradients flowing in and out. A 1.5B
#: layer at a 512k-token sequence went out of memory with 8 B (the earlier estimate) planned.
#: Calibrated on untiled runs (4k-token sequences: 21 H200 runs planned 0.5-9.9% above measured).
ATTN_SIDE_BYTES_PER_TOKEN_HIDDEN = 26

#: The same with the MLP in tiles (long sequences), where a layer's backward peaks inside the
#: MLP's tile loop with every per-token tensor of the attention half alive. Itemized from the
#: CPU allocator's live blocks at that peak (torch.profiler memory events, bf16 autocast,
#: Qwen2.5-1.5B's layer at 2k and 4k tokens: 43.4 B/token/h, the saved input's fp32 cast-back
#: included, which the boundary line counts): the layer-output gradient (fp32, 4h); the saves
#: re-made for backward: the first norm's fp32 product (4h), q/k/v's own bf16 casts of its
#: output (3 x 2h), q after RoPE cast for attention (2h), the attention output (2h), the fp32
#: mid-layer residual (4h), the second norm's fp32 product (4h) and its output, the tiled MLP's
#: saved input (4h); the MLP output's gradient in bf16 (2h) and the input gradient the tiles fill
#: (fp32, 4h). Plus k and v after RoPE (2 x 2kv). With 26h the H200 runs at 1,048,576 tokens
#: (1.5B) and 524,288 (3B) peaked 19.8% and 10.5% above their plans.
TILED_BYTES_PER_TOKEN_HIDDEN = 36
TILED_BYTES_PER_TOKEN_KV = 4


#: Less per MLP token with Liger-Kernel's fused SwiGLU: no SiLU output tensor (2i; its
#: kept-activation audit drops the same tensor, 82,486 B/token measured on the H200 against
#: 82,488 counted). Without it the plans of Liger runs sat up to 10.1% above their measured peaks
#: (speed8b-attn-1524); with it +1.8% to +8.6% (plan_vs_measured.md). The fused RMSNorm's missing
#: fp32 products (8h) are not taken off: with them too the 7B's one 131,072-token micro-batch
#: (liger128k-1157) would be planned 0.4% below its measured peak.
FUSED_SWIGLU_BYTES_PER_TOKEN_INTER = 2


def _working_set_line(
    t: int, h: int, kv: int, inter: int, tile: int, fused_kernels: bool = False
) -> MemoryLine:
    """A layer's recompute working set: attention-side tensors scale with the micro-batch, the
    MLP's (tokens x intermediate) ones with the tile when MLP tiling is on."""
    mlp_t = min(t, tile) if tile > 0 else t
    mlp_i = 6 - (FUSED_SWIGLU_BYTES_PER_TOKEN_INTER if fused_kernels else 0)
    if mlp_t < t:
        what = f"MLP in tiles of {mlp_t} tokens"
        k = TILED_BYTES_PER_TOKEN_HIDDEN
        per_token = f"{k}h + {TILED_BYTES_PER_TOKEN_KV}kv"
        attn_side = t * (k * h + TILED_BYTES_PER_TOKEN_KV * kv)
    else:
        what = "untiled MLP"
        k = ATTN_SIDE_BYTES_PER_TOKEN_HIDDEN
        per_token, attn_side = f"{k}h", t * k * h
    if fused_kernels:
        what += ", fused SwiGLU"
    return MemoryLine(
        f"one layer's backward working set (estimate, {what}: tokens x {per_token} "
        f"+ tile x {mlp_i}i B)",
        attn_side + mlp_t * mlp_i * inter,
    )


def _query_width(shape: ModelShape) -> tuple[int, int]:
    """``(query heads, heads x head_dim)``; unknown widths taken as the hidden size."""
    h = shape.hidden_size
    heads = shape.num_heads or (h // shape.head_dim if shape.head_dim else 0)
    return heads, heads * shape.head_dim if heads and shape.head_dim else h


def attention_output_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
    """What engine option keep_attention_outputs keeps per token for one recomputed layer: the
    fused SDPA kernel's output (heads x head_dim in the compute dtype; o_proj's saved input is a
    view of it) and its fp32 log-sum-exp per head."""
    heads, q = _query_width(shape)
    return q * itemsize(dtype) + 4 * max(heads, 1)


def attention_output_line(
    shape: ModelShape, step: StepShape, dtype: torch.dtype, layers: int
) -> MemoryLine:
    per_token = attention_output_bytes_per_token(shape, dtype)
    return MemoryLine(
        f"attention outputs kept for the recompute of {layers} layers: "
        f"{step.micro_batch_tokens} tokens x {per_token} B each",
        layers * step.micro_batch_tokens * per_token,
    )


def kept_activation_bytes_per_token(shape: ModelShape) -> int:
    """Bytes a decoder layer's autograd graph saves per token when it is not recomputed.

    Counted for a pre-norm attention + gated-MLP layer (Llama/Qwen2 family) under bf16 autocast
    with an fp32 residual stream, on top of the saved layer input (a boundary activation,
    counted there), as audited with ``saved_tensors_hooks`` (tests/test_keep_activations.py):
    each RMSNorm saves its fp32 normalized product (2 x 4h) and the second one its fp32 input,
    the mid-layer residual (4h); the q/k/v and gate/up projections each save their own bf16 cast
    of the normalized input (5 x 2h); attention saves its bf16 q (2q, q = heads x head_dim,
    usually h), rotated k and v (4kv) and output, which o_proj saves as its input (2q: the same
    storage); the MLP saves the gate and up outputs, the SiLU output and their product (4 x 2i).
    RoPE saves nothing per layer: its products are with cos/sin, which need no gradient, so only
    the (shared) tables are kept. Per token besides: attention's fp32 log-sum-exp per head and
    the two norms' fp32 scales (4 x heads + 8). With per-head q/k norms (Qwen3), each saves its
    input cast to fp32, its bf16 output and a scale per head: 6q + 6kv + 4 x (heads + kv heads).
    """
    h, i = shape.hidden_size, shape.intermediate_size
    kv = shape.kv_size or h
    heads, q = _query_width(shape)
    total = 22 * h + 4 * q + 4 * kv + 8 * i + 4 * heads + 8
    if shape.qk_norm:
        kv_heads = kv // shape.head_dim if shape.head_dim else 0
        total += 6 * q + 6 * kv + 4 * (heads + kv_heads)
    if shape.gemma_norms:
        # Gemma3 (audited like the others): the post-attention and post-MLP norms each save
        # their input cast to fp32 and their fp32 product (2 x 8h) and a scale (2 x 4); its
        # per-head q/k norms keep their input in fp32 and their product in fp32 (2q + 2kv more
        # than Qwen3's). Per layer besides, not per token: each norm's fp32 (1 + weight).
        total += 16 * h + 2 * q + 2 * kv + 8
    if shape.fused_layer_kernels:
        # Liger's RMSNorm saves its input and scale, not the fp32 normalized product (8h for
        # the two layer norms; per-head q/k norms keep their bf16 input instead of an fp32 copy
        # and a bf16 output: 4q + 4kv); its SwiGLU saves gate and up but not the SiLU output
        # (2i; down_proj still saves the product as its input). Measured on the H200 for a
        # Qwen2.5-1.5B-wide layer: 82,486 B/token against 82,488 counted here.
        total -= 8 * h + 2 * i + (4 * q + 4 * kv if shape.qk_norm else 0)
    return total


def saved_boundary_layers(shape: ModelShape, options: ResolvedOptions) -> int:
    """How many layers save their input: all, or with checkpoint segments of k layers one per
    segment, ceil(layers / k). (Layers that keep their graph end a segment early; at the
    offload sizes segments are for, the planner keeps none.)"""
    k = max(1, options.checkpoint_every)
    return -(-shape.num_layers // k)


def segment_cache_layers(shape: ModelShape, options: ResolvedOptions) -> int:
    """fp32 layer inputs a checkpoint segment's backward holds at most beyond the boundary
    lines: the chain re-made from the leader's input caches the followers' (k - 1, the one in
    use included). With boundaries saved narrower the boundary lines already count one fp32
    input in use (a leader's cast back; a follower in backward has none of its own, only its
    re-made input, and ``segment_input`` frees the leader's fp32 input once the chain has run):
    k - 2 more."""
    k = min(options.checkpoint_every, shape.num_layers)
    in_use_counted = 1 if options.boundary_bytes_per_element < 4 else 0
    return max(0, k - 1 - in_use_counted)


def boundary_activation_bytes(shape: ModelShape, step: StepShape, options: ResolvedOptions) -> int:
    """Every saved layer input (the residual stream: fp32, or its bf16-rounded copy) for one
    micro-batch: one per layer, or one per checkpoint segment."""
    b = options.boundary_bytes_per_element
    return step.micro_batch_tokens * shape.hidden_size * b * saved_boundary_layers(shape, options)


def saved_layers_label(shape: ModelShape, options: ResolvedOptions) -> str:
    n = saved_boundary_layers(shape, options)
    if n == shape.num_layers:
        return f"{n} layers"
    return f"{n} saved (1 per {options.checkpoint_every} of {shape.num_layers} layers)"


def boundary_dtype_label(options: ResolvedOptions) -> str:
    b = options.boundary_bytes_per_element
    return {4: "fp32", 2: "bf16"}.get(b, f"{b} B")


def activation_lines(
    shape: ModelShape, step: StepShape, options: ResolvedOptions, dtype: torch.dtype
) -> list[MemoryLine]:
    """Per-micro-batch activation costs (micro-batches run one after another)."""
    isz = itemsize(dtype)
    t, h, v = step.micro_batch_tokens, shape.hidden_size, shape.vocab_size
    lines = []
    b = options.boundary_bytes_per_element
    # Saved narrower than the fp32 residual stream: backward recomputes each layer from its
    # saved input cast back to fp32, one more tokens x hidden x 4 B tensor while it runs.
    cast_back = 4 if b < 4 else 0
    if not options.offload_activations:
        lines.append(
            MemoryLine(
                f"boundary activations ({boundary_dtype_label(options)}): {t} tokens x hidden x "
                f"{b} B x {saved_layers_label(shape, options)}",
                boundary_activation_bytes(shape, step, options),
            )
        )
        if cast_back:
            lines.append(
                MemoryLine(
                    "boundary activation of the recomputing layer cast back to fp32",
                    t * h * cast_back,
                )
            )
    else:
        # Offloaded: the current layer's input and the next one prefetched for backward (and
        # the current one cast back to fp32 when saved narrower).
        what = (
            f"2 {boundary_dtype_label(options)} (in use + prefetched) + the one in use in fp32"
            if cast_back
            else "2 (in use + prefetched)"
        )
        lines.append(
            MemoryLine(
                f"boundary activations offloaded to host; in HBM: {what}",
                2 * t * h * b + t * h * cast_back,
            )
        )
    if shape.head_dim:
        # The rotary embedding's cos and sin for the micro-batch, in the dtype of the embedding
        # output (fp32: the non-layer parameters are fp32): one tensor pair that every layer
        # saves by reference (never offloaded), alive from the embedding to the last backward.
        lines.append(
            MemoryLine(
                f"RoPE cos/sin tables (fp32): {t} tokens x head_dim {shape.head_dim} x 2 x 4 B",
                t * shape.head_dim * 2 * 4,
            )
        )
    cached = segment_cache_layers(shape, options)
    if cached:
        lines.append(
            MemoryLine(
                f"checkpoint segment backward: up to {cached} recomputed layer inputs "
                f"(fp32, {t} tokens x hidden x 4 B) cached",
                cached * t * h * 4,
            )
        )
    lines.append(
        _working_set_line(
            t,
            h,
            shape.kv_size or h,
            shape.intermediate_size,
            options.mlp_tile_tokens,
            shape.fused_layer_kernels,
        )
    )
    if shape.fused_loss:
        chunk = min(default_chunk_tokens(v), t)
        lines.append(
            MemoryLine(
                f"fused loss chunk: {chunk} tokens x vocab fp32 logits + softmax grad",
                chunk * v * (4 + isz),
            )
        )
        head_copy = 0 if dtype == torch.float32 else v * h * isz
        lines.append(
            MemoryLine(
                "LM head compute copy + fp32 weight grad + hidden-state grad",
                head_copy + v * h * 4 + t * h * 4,
            )
        )
    else:
        # The model's own forward materializes the logits and upcasts them for the loss.
        lines.append(
            MemoryLine(
                "full logits (no fused loss for this architecture; estimate)",
                t * v * (isz + 4 + 4),
            )
        )
    return lines
