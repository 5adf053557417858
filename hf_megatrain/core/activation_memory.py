"""Activation memory of a training step: what each decoder layer saves for backward.

Boundary activations (the saved residual-stream inputs, in HBM or offloaded), what a layer that
keeps its graph saves per token (audited against autograd's saved tensors), the recompute working
set, the s x s tensors of attention (masks, eager scores), the loss/LM-head temporaries and an
MoE router aux loss's: the per-micro-batch lines of the memory plan. Each line has a kind;
estimates of framework temporaries carry their kind's largest measured underestimate
(``ESTIMATE_ERRORS``), which the plan's slack line adds up.

Each reads the step's micro-batch (:class:`~hf_megatrain.core.options.StepShape`) and the engine
options that shape activations (:class:`~hf_megatrain.core.options.ResolvedOptions`:
``mlp_tile_tokens``, ``offload_activations``, ``boundary_bytes_per_element``,
``checkpoint_every``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .chunked_loss import default_chunk_tokens
from .options import ResolvedOptions, StepShape
from .plan_types import MemoryLine, ModelShape, itemsize

# ==== line kinds and their measured errors =========================================================
#: ``MemoryLine.kind`` of the activation lines. Exact kinds are buffers whose size this library
#: fixes (its error 0); the others estimate framework temporaries and carry the largest
#: underestimate measured for them (``ESTIMATE_ERRORS``).
BOUNDARY_KIND = "boundary activations"
ROPE_KIND = "RoPE tables"
TILED_WEIGHT_GRADS_KIND = "tiled MLP weight gradients"
LOSS_KIND = "fused loss"
WORKING_SET_KIND = "working set"
PEAK_WORKING_SET_KIND = "working set, gated MLP peak"
TILED_WORKING_SET_KIND = "working set, MLP tiles"
MOE_WORKING_SET_KIND = "working set, routed experts"
SEGMENT_CACHE_KIND = "segment cache"
FULL_LOGITS_KIND = "full logits"
ATTENTION_OUTPUTS_KIND = "attention outputs"
KEPT_ACTIVATIONS_KIND = "kept activations"
KEPT_APART_KIND = "kept activations, recompute apart"
MASK_KIND = "attention masks"
EAGER_SCORES_KIND = "eager attention scores"
INDEXER_KIND = "sparse-attention indexer"
ROUTER_AUX_KIND = "router aux loss"
ADAPTER_KIND = "LoRA adapters' activations"
CARRIED_KIND = "tensors carried past the layers"

#: For estimate kinds nothing measured on the H200 (the full logits of models without the fused
#: loss, an MoE router aux loss's temporaries): the largest error measured on any kind (the tiled
#: working set's 19%) rounded up, rather than none.
UNMEASURED_ERROR = 0.20

#: The largest measured underestimate of each estimate kind, as a fraction of its line
#: (``MemoryLine.error``; the slack line adds line x error). From
#: ``benchmarks/plan_vs_measured.py`` (``line_errors``, the table under
#: benchmarks/results/plan_vs_measured.md; it reads results.csv and the validation matrix's
#: validation_matrix.csv): every recorded H200 row that ran with its own plan (expandable
#: segments, planned placement) is re-planned; its measured peak less its exact lines and the
#: allocator's fragmentation is set against its estimate lines, a kind fixed from the rows where
#: the kinds beside it are fixed already; the worst row, rounded up to 1%. Rows that measured
#: only their first optimizer step (one step, no warm-up) did not hold the resident parameters'
#: AdamW moments at their peak (``HostAdamW`` makes them at the first update, after the
#: backward; 8 B/param, 2.3 GiB for Qwen3-1.7B, 4.4 GiB for Gemma-2-2B): those are taken off
#: their exact lines, so their estimate lines answer for what the step did hold:
#:
#: * tiled working set, 19%: long1m-1138 (Qwen2.5-1.5B, one 1,048,576-token sequence, 16k MLP
#:   tiles, a first-step row: +18.5% of 55.8 GiB; 15.4% before its 1.7 GiB of moments, absent
#:   at its peak, came off its exact lines). long3b-1138 +9.0%; h200-g and long7b-0759 under.
#: * untiled working set, 14%: the validation matrix's Qwen3-1.7B at one 262,144-token sequence
#:   (15 HBM-tier layers, every layer's attention outputs kept, first step: +13.5% of 26.5 GiB;
#:   with 11% its first-step plan was 0.66 GiB under the measured 137.57 GiB). Measured on the
#:   CPU (tests/test_plan_accuracy.py), a recomputed layer's backward holds more than this line
#:   counts: 22h + 4q + 4kv + 12i + 4 per head + 8 B per token (the MLP's backward holds its gate,
#:   up and activation outputs, the product's gradient and both factors' gradients: 12i, not
#:   6i), 38% over the line for Qwen3-1.7B's shape; the plan's sum covers that elsewhere on
#:   most rows, as the fused loss's chunk and the LM head's lines, counted beside it, are freed
#:   before any layer's backward. Before: speed8b-1524 (Llama-3.1-8B, Liger, 64k micro-batches)
#:   +10.6%.
#: * MoE working set (routed experts), 5%, for the audited families
#:   (``ModelShape.moe_working_set_audited``; the others keep the kind of the dense line): counts
#:   the experts' whole MLP backward (8i), not the dense line's 6i, so the dense line's 14% (its
#:   12i-vs-6i gap) does not apply. Measured on the CPU (``MOE_BYTES_PER_SLOT_HIDDEN``): a
#:   recomputed OLMoE / Qwen3-MoE / Mixtral / GraniteMoE / Qwen2-MoE layer's backward within
#:   0.96-1.04x of the line. The matrix's OLMoE cells at 131,072 and 262,144 tokens
#:   (4ced842) peaked 0.94-0.99x of it once the fused loss's and LM head's lines, freed before
#:   any layer's backward, are set aside; with 14% they were planned 10.4% and 14.4% high.
#: * kept activations, 5%: matrixds-1656 (Qwen2.5-3B at 64k tokens, 15 layers keeping theirs:
#:   +4.3% of 65.2 GiB once the working set has its error), where the sum of the kept and the
#:   recomputed layers' lines covered it; 13% where the kept layers are the model's last and the
#:   plan holds their backward apart from the recomputed layers' (``kept_phases_apart``): 45
#:   such rows, the worst the matrix's Qwen3-1.7B at 131,072 tokens (d53f3e3, a first-step row
#:   with only its reserved peak: +13.0% of 45.8 GiB); the rows with an allocated peak are
#:   planned -0.9% to +5.8% of it (4ae9c4f: Qwen3-1.7B and H2O-Danube-1.8B at 4k-128k).
#: * kept attention outputs: exact, no longer an estimate kind (the fused kernel's output and
#:   its fp32 log-sum-exp per head, the tensors the CPU tracker measures; every H200 row under).
#: * segment cache, 13%: no H200 row has one (long7b-0759's segments of 2 with bf16 boundaries
#:   cache none); measured on the CPU with the live-tensor tracker (6 Llama layers, 256-token
#:   MLP tiles, 2,048 and 4,096 tokens; segments of 2, 3, 4 and 6, fp32 and bf16 boundaries):
#:   the step's peak at or under the plan's lines for every length but 6 with bf16 boundaries,
#:   2h per token over there, 13% of its 16h cache line.
#: * attention masks, 3%: counted from the tensors transformers makes and measured on the CPU
#:   (tests/test_plan_attention.py, exact there); the matrix's Phi-3 at 131,072 tokens (window
#:   2,047: 48 GiB of masks, first step) +2.04% once the working set has its 14%: what that
#:   row's recompute holds beyond its working-set line (see above), set against its masks.
#:
#: Not comparable, so not used (shown in the table): the rows recorded before their runs planned
#: themselves (before d822e80: no expandable segments), data-parallel rows before 3b07ee1
#: (a non-owner rank then held streamed layers' gradients to backward's end, since fixed), the
#: matrix's cells that ran out of GPU memory and were run again by the watchdog (H2O-Danube and
#: Phi-3 at 32,768 tokens: each of their layers keeping activations under SDPA with a sliding
#: window holds its own additive mask, 2 GiB, which their plans did not count; re-planned with
#: ``kept_attention_lines`` their 22 and 10 kept layers come to 182 and 160 GiB, over the whole
#: GPU they filled), and Gemma-2-2B at 4,096 tokens, whose reserved peak is 1.2 GiB over its
#: live tensors (measured on the CPU).
#: long7b-0759's host peak is under its plan for the same kind of reason (an engine bug since
#: fixed, marked in the table); its GPU peak is comparable and is under the plan (-10% tiled).
#: Eager attention has no H200 row: its bytes are counted from the tensors transformers makes
#: and measured on the CPU (exact there); 2% stands for what the CPU does not show (allocator
#: rounding of the s x s blocks).
ESTIMATE_ERRORS: dict[str, float] = {
    TILED_WORKING_SET_KIND: 0.19,
    WORKING_SET_KIND: 0.14,
    PEAK_WORKING_SET_KIND: 0.04,
    MOE_WORKING_SET_KIND: 0.05,
    KEPT_ACTIVATIONS_KIND: 0.05,
    KEPT_APART_KIND: 0.13,
    SEGMENT_CACHE_KIND: 0.13,
    FULL_LOGITS_KIND: UNMEASURED_ERROR,
    ROUTER_AUX_KIND: UNMEASURED_ERROR,
    ADAPTER_KIND: UNMEASURED_ERROR,
    MASK_KIND: 0.03,
    EAGER_SCORES_KIND: 0.02,
    # Counted from the tensors transformers makes and measured on the CPU (exact there:
    # tests/test_plan_attention.py); no H200 row. The masks' 3% for what the CPU does not show.
    INDEXER_KIND: 0.03,
    # Measured on the CPU tracker (dev/carried_plan_fit.py); no GPU row yet.
    CARRIED_KIND: 0.05,
}


def estimate_line(name: str, nbytes: int, kind: str) -> MemoryLine:
    """A line estimating framework temporaries: its kind's measured error comes with it."""
    return MemoryLine(name, nbytes, kind, ESTIMATE_ERRORS[kind])


# ==== the recompute working set ====================================================================
#: Bytes per token of a layer's backward on top of its saved input, untiled MLP: the recomputed
#: attention half (bf16 norm output, q and the attention output (2q each, q = heads x head_dim),
#: o-proj output, post-norm output; fp32 mid-layer residual and post-norm input) and the fp32
#: gradients flowing in and out: 22h + 4q (26h where q = h, as in every calibration run). A 1.5B
#: layer at a 512k-token sequence went out of memory with 8 B (the earlier estimate) planned.
#: Calibrated on untiled runs (4k-token sequences: 21 H200 runs planned 0.5-9.9% above measured).
ATTN_SIDE_BYTES_PER_TOKEN_HIDDEN = 22
ATTN_SIDE_BYTES_PER_TOKEN_QUERY = 4

#: The same with the MLP in tiles (long sequences), where a layer's backward peaks inside the
#: MLP's tile loop with every per-token tensor of the attention half alive. Itemized from the
#: CPU allocator's live blocks at that peak (torch.profiler memory events, bf16 autocast,
#: Qwen2.5-1.5B's layer at 2k and 4k tokens: 43.4 B/token/h, the saved input's fp32 cast-back
#: included, which the boundary line counts): the layer-output gradient (fp32, 4h); the saves
#: re-made for backward: the first norm's fp32 product (4h), q/k/v's own bf16 casts of its
#: output (3 x 2h), q after RoPE cast for attention (2q), the attention output (2q), the fp32
#: mid-layer residual (4h), the second norm's fp32 product (4h) and its output, the tiled MLP's
#: saved input (4h); the MLP output's gradient in bf16 (2h) and the input gradient the tiles fill
#: (fp32, 4h). Plus k and v after RoPE (2 x 2kv): 32h + 4q + 4kv (36h + 4kv where q = h). With
#: 26h the H200 runs at 1,048,576 tokens (1.5B) and 524,288 (3B) peaked 19.8% and 10.5% above
#: their plans. Re-measured for this change with a live-tensor tracker on the CPU (every storage
#: an op makes until it is freed; Llama layers, 9 shapes with q from h/2 to 2h, kv from q/8 to
#: q): 30h + 4q + 4kv + 4 per head (the log-sum-exp), per token of the sequence.
TILED_BYTES_PER_TOKEN_HIDDEN = 32
TILED_BYTES_PER_TOKEN_QUERY = 4
TILED_BYTES_PER_TOKEN_KV = 4

#: Per-head q/k norms (Qwen3, Gemma3, OLMo2, ...), per token, in either MLP mode: each norm's
#: saved fp32 input and bf16 product re-made for backward (4 + 2 B per element of q and of k)
#: and its fp32 scale per head: 6q + 6kv + 4 x (heads + kv heads). Measured as the difference
#: of Qwen3 and Llama layers of the same widths (the tracker above, 9 shapes, 2,048 and 4,096
#: tokens, tiled and untiled): exact wherever q <= 1.5h. Where q is larger (Qwen3-0.6B,
#: Qwen3-4B: q = 2h and 1.6h) the layer instead peaks inside the q norm's own backward, with
#: its fp32 temporaries (q-sized) alive: 10h + 24q per token, MLP tiles or not, also measured
#: (q = 2h and 4h); Gemma3's keeps k's fp32 norm product too (+4kv). The working set is the
#: larger of the two. Qwen3-8B at one 262,144-token sequence: 30,880 B/token, 7.5 GiB (the
#: backward recompute that asked 6 GiB with 2.9 GiB free, planned with 0.30 GiB left, without).
QK_NORM_BYTES_PER_TOKEN_QUERY = 6
#: Their weights bound in fp32, as stock's (``ModelShape.qk_norm_fp32_output``), Llama-style q/k
#: norms return fp32 q and k (RoPE then rotates fp32; attention takes bf16 casts, so the saved set
#: is unchanged): per element of q and of k, 2 B more. Measured on the CPU tracker at 14 Qwen3
#: shapes: the forward's peak grows by exactly 2q + 2kv; a recomputed layer's backward by 0
#: where the MLP is its peak, by 296-592 B (less than 2q + 2kv) where the q norm's backward is
#: (q = 4h, kv = h). Added to both working sets.
QK_NORM_FP32_OUTPUT_BYTES_PER_TOKEN = 2
QK_NORM_BYTES_PER_TOKEN_KV = 6
QK_NORM_BYTES_PER_TOKEN_HEAD = 4
QK_NORM_PEAK_BYTES_PER_TOKEN_HIDDEN = 10
QK_NORM_PEAK_BYTES_PER_TOKEN_QUERY = 24

#: Gemma-2/3's layer (norms before and after attention and the MLP, computing in fp32): its
#: post-attention and post-MLP norms each re-make their fp32 input and product (2 x 8h) and an
#: fp32 scale (2 x 4 B) and the fp32 sum they feed is one more 4h: 20h + 8 per token; with
#: Gemma3's per-head q/k norms, which keep fp32 products, 2q + 2kv more than Qwen3's. Measured
#: as Gemma2 - Llama and Gemma3 - Qwen3 with the same widths (exact at h = 256 and 512). Their
#: GELU-tanh MLP holds 8 instead of 6 B per intermediate element (measured untiled: 8i).
GEMMA_NORMS_BYTES_PER_TOKEN_HIDDEN = 20
GEMMA_NORMS_BYTES_PER_TOKEN = 8
GEMMA_QK_NORMS_BYTES_PER_TOKEN = 2
GEMMA_MLP_BYTES_PER_TOKEN_INTER = 8
MLP_BYTES_PER_TOKEN_INTER = 6

#: Untiled, a gated MLP's backward is the recomputed layer's peak, with the whole layer's saves
#: alive: its gate, up and activation outputs, the product's gradient and both factors'
#: gradients (12i, Gemma's GELU-tanh 14i), and besides the attention half the attention's k and
#: v (4kv) and log-sum-exp (4 per head) and 8 B: 22h + 4q + 4kv + 12i + 4 per head + 8. Measured
#: so on the CPU live-tensor tracker (Llama, Mistral, Qwen2, Granite) and exactly so on the
#: H200 (Phi-3-mini-wide layers, 190,600 B/token at 16k-32k tokens under SDPA and under
#: FlexAttention alike; tests/test_gpu.py::test_working_set_on_gpu_phi3). The lines above
#: (22h + 4q + 6i) are 1.3-1.5x below it: the plan's sum covered that with the fused loss's
#: lines, freed before any layer's backward, until the working set outgrew them (Phi-3-mini at
#: 131,072 tokens: 3.2 GiB over its expected peak, 1.0 over its bound). Families audited against
#: it (``ModelShape.peak_working_set_audited``: within 4% on the tracker, Cohere's 3.6% at the
#: tiny widths the largest underestimate, its kind's error; ERNIE 4.5's and Helium's were 3.4%
#: until their RoPE's cos/sin copies were counted, now exact) use it; others keep the lines
#: above (non-gated MLPs hold less; some gated families more: hf/family_memory.py names them).
GATED_MLP_PEAK_BYTES_PER_TOKEN_INTER = 12
GEMMA_MLP_PEAK_BYTES_PER_TOKEN_INTER = 14
GATED_MLP_PEAK_BYTES_PER_TOKEN_KV = 4
GATED_MLP_PEAK_BYTES_PER_HEAD = 4
GATED_MLP_PEAK_BYTES_PER_TOKEN = 8

#: What a recomputed layer's measured backward peak (untiled gated MLP, PyTorch SDPA) holds less
#: than the line above, per token, where the layer's saves are smaller. Measured on the CPU with
#: Inductor's own kernels (the profiler's allocation timeline, which sees into compiled code;
#: dev/working_set_probe.py: Llama layers at 7 widths, q from h to 2h, kv from q/4 to q, i from 3h
#: to 4h, exact at 6 and 1.3% under at one; Qwen3-1.7B's layer):
#:
#: * compiled norms keep no fp32 normalized product (2 x 4h), and per-head q/k norms keep their
#:   bf16 input only (4q + 4kv);
#: * autocast_kernels' shared casts hold one bf16 cast per normed input
#:   (``shared_cast_saving_per_token``);
#: * a layer whose attention output is kept (its own line) re-makes neither the output nor its
#:   fp32 log-sum-exp (2q + 4 per head).
#:
#: Qwen3-1.7B's layer with compiled kernels, shared casts and its output kept: 92,264 B/token
#: against 143,528 counted before (0.64x). On the H200 the validation matrix's Qwen3-1.7B at
#: 262,144 tokens (4ae9c4f, that layout) needed 124.75 GiB, planned 137.29 without these and
#: 126.28 with them. Kept whole:
#:
#: * FlexAttention, eager attention and masked SDPA: the matrix's H2O-Danube-1.8B at 262,144
#:   tokens (FlexAttention, compiled kernels, shared casts) needed 8 kB per token more than these
#:   would leave, and at 131,072 (SDPA with its window's mask, every output kept) its reserved
#:   peak would put the masks' line 3.2% over;
#: * Liger-Kernel's norms: the CPU cannot run them, and with the 8h off the H200's Llama-3.1-8B
#:   at 64k micro-batches under Liger (speed8b-1524, 131,072 tokens a step) would be planned
#:   under its peak (131.83 GiB bound, 132.84 measured).
FUSED_NORMS_BYTES_PER_TOKEN_HIDDEN = 8
FUSED_QK_NORMS_BYTES_PER_TOKEN = 4
KEPT_OUTPUT_BYTES_PER_TOKEN_QUERY = 2
KEPT_OUTPUT_BYTES_PER_HEAD = 4


#: A kept layer's backward (no recompute) at its peak, per token, beyond its saves: its MLP's
#: gradients (gate, up and their product's, and the input's, 4 x intermediate in all). Measured
#: on the CPU tracker (Llama and Qwen3 layers at h 64-128, i 2.5h-3.5h, 512 and 1,024 tokens;
#: Qwen2, Mistral, Phi-3, SmolLM3, Seed-OSS and ERNIE 4.5 at h 64):
#: each kept layer's backward phase grew by exactly 4i per token over its start, where a
#: recomputed layer's grew by the whole gated-MLP peak line.
KEPT_BACKWARD_BYTES_PER_TOKEN_INTER = 4

#: The fused loss's chunk at its peak, per logit (tests/test_plan_accuracy.py): bf16 logits,
#: their fp32 copy and the fp32 log-probabilities; soft-capped logits keep the tanh output too.
LOSS_BYTES_PER_LOGIT = 10
SOFTCAPPED_LOSS_BYTES_PER_LOGIT = 12

#: Routed MoE experts (``ModelShape.experts_per_token`` k): transformers' grouped experts gather
#: each token's hidden state once per chosen expert (fp32, 4h), cast it (2h), and make the down
#: projection, its weighted and its re-ordered copy (2h each) per token and choice, plus the
#: sort's and gather's indices and weights; the expert MLP's gate/up products are as a dense
#: one's of width k x expert width (the shape's intermediate size). Measured on the CPU
#: live-tensor tracker (OLMoE layers, k of 1-8, h of 64-256, expert widths 32-128, 8 and 16
#: experts): a recomputed layer's backward holds k x (10h + 56) + 8i B per token where the MLP
#: line counted 6i, up to 2.5x the line at k = 8. Untiled: MLP tiles leave MoE blocks whole. At
#: OLMoE-1B-7B's widths and 262,144 tokens that is 44 GiB more: the matrix's cell planned without
#: it ran out of GPU memory twice (asked 8 GiB, one (tokens x k) x h bf16 tensor) and trained only
#: after the watchdog moved 4 HBM-tier layers to the host.
MOE_BYTES_PER_SLOT_HIDDEN = 10
MOE_BYTES_PER_SLOT = 56
MOE_BYTES_PER_TOKEN_INTER = 8
#: Experts wider than about twice the hidden size (Mixtral's 3.5x) peak elsewhere: in the grouped
#: expert MLP's backward, where per token and chosen expert its gate/up product (4i), the
#: gated product and its gradient (2i each), the activation (2i) and the intermediate's
#: gradient (2i) are alive with the cast of the gathered hidden state (2h), as a dense gated
#: MLP's backward peak (12i). Measured on the CPU live-tensor tracker (Mixtral and OLMoE, hidden
#: 256, expert widths 1,024-2,048, k of 1-4 over 8-16 experts): the whole step was 1.09-1.33x
#: the plan with the line above alone. The working set is the larger of the two.
MOE_WIDE_BYTES_PER_SLOT_HIDDEN = 2
MOE_WIDE_BYTES_PER_TOKEN_INTER = 12
#: Routing weights kept in fp32 (``ModelShape.fp32_routing_weights``: Mixtral, GraniteMoE): the
#: weighted expert outputs, their re-ordered copies and gradients are fp32, 8h more per token
#: and chosen expert (the same tracker: 1.00x the line with it, 1.2-1.45x without).
MOE_FP32_ROUTING_BYTES_PER_SLOT_HIDDEN = 8
#: A shared expert (``ModelShape.shared_expert_size`` s): a gated MLP on every token, 8 B per
#: element of its width (as the routed experts' 8i), and its output, gate and sum with the
#: routed ones, 20h (measured on Qwen2-MoE layers, h 32-64, s 16-64; GLM-4-MoE's and dots1's,
#: without the gate, hold less: planned high).
MOE_SHARED_BYTES_PER_INTER = 8
MOE_SHARED_BYTES_PER_HIDDEN = 20


#: Less per MLP token with Liger-Kernel's fused SwiGLU: no SiLU output tensor (2i; its
#: kept-activation audit drops the same tensor, 82,486 B/token measured on the H200 against
#: 82,488 counted). Without it the plans of Liger runs sat up to 10.1% above their measured peaks
#: (speed8b-attn-1524); with it +1.8% to +8.6% (plan_vs_measured.md). The fused RMSNorm's missing
#: fp32 products (8h) are not taken off: with them too the 7B's one 131,072-token micro-batch
#: (liger128k-1157) would be planned 0.4% below its measured peak. (Liger's q/k norms are not
#: measured either: the per-head norm terms stay whole.)
FUSED_SWIGLU_BYTES_PER_TOKEN_INTER = 2

#: With MLP tiles and fused layer kernels (compiled or Liger-Kernel), less per token of the
#: sequence: the fused RMSNorms keep no fp32 normalized products (2 x 4h in the tiled line).
#: Measured on the H200 (tests/test_gpu.py::test_tiled_working_set_on_gpu, Qwen2.5-7B-wide
#: layers): 113,048 B/token for both kernel sets against the line's 131,072, 5.0h less; 4h taken
#: off (the products' half), so the line stays above what was measured.
FUSED_TILED_BYTES_PER_TOKEN_HIDDEN = 4

#: The tiled line where the recomputed layer's attention output is kept (keep_attention_outputs,
#: its own line) and the layer runs fused kernels: the recompute does not make the output nor
#: what only its kernel call needed, 4h + 2q per token less. On the CPU scale model of the H200's
#: base262k, chain262k and exact524k rows (dev/long_plan_probe.py, Liger-like kernels, peaks
#: within 1-2% of the rows' allocated ones; docs/long_context.md, "The plan's long-context
#: over-estimate") the kept case held 20h + 2q + 4kv with autocast_kernels' shared casts, 4h
#: under this line; that 4h is not taken off, as the H200's own measurement of the fused line
#: without kept outputs (27h, above) sits 3h over what the same model gives for it.
KEPT_OUTPUT_TILED_BYTES_PER_TOKEN_HIDDEN = 4
KEPT_OUTPUT_TILED_BYTES_PER_TOKEN_QUERY = 2
#: Attention's backward in a tiled layer on CUDA (the same scale model plus what the CPU cannot
#: see: the fused kernels' fp32 dq accumulator and dK/dV expanded for grouped heads, ~8q):
#: 10h + 14q + 8kv per token; the working set is the larger of it and the MLP tile loop's.
ATTN_BACKWARD_BYTES_PER_TOKEN_HIDDEN = 10
ATTN_BACKWARD_BYTES_PER_TOKEN_QUERY = 14
ATTN_BACKWARD_BYTES_PER_TOKEN_KV = 8


def _kv_heads(shape: ModelShape) -> int:
    kv = shape.kv_size or shape.hidden_size
    return kv // shape.head_dim if shape.head_dim else 0


def working_set_line(
    shape: ModelShape,
    t: int,
    tile: int,
    every_layer_recomputed: bool = True,
    keeps_attention_output: bool = False,
    shared_casts: bool = False,
) -> MemoryLine:
    """A layer's recompute working set: attention-side tensors scale with the micro-batch, the
    MLP's (tokens x intermediate) ones with the tile when MLP tiling is on; per-head q/k norms
    and Gemma's extra norms add their re-made saves (or, q much wider than h, the q norm's own
    backward is the peak). With ``every_layer_recomputed`` and an untiled gated MLP, the
    measured peak of that MLP's backward (``GATED_MLP_PEAK_*``), less what fused norms,
    ``shared_casts`` and a kept attention output spare under SDPA (``_peak_saves_less``); else
    the earlier line, which the plan's sum with the loss's lines covers."""
    h, inter = shape.hidden_size, shape.intermediate_size
    kv = shape.kv_size or h
    heads, q = _query_width(shape)
    k = shape.experts_per_token
    mlp_t = min(t, tile) if tile > 0 and not k else t
    # Untiled, a gated MLP's backward is the peak, with the attention's saves alive.
    mlp_peak = every_layer_recomputed and _is_measured_peak(shape, t, tile)
    if mlp_peak:
        mlp_i = (
            GEMMA_MLP_PEAK_BYTES_PER_TOKEN_INTER
            if shape.gemma_norms
            else GATED_MLP_PEAK_BYTES_PER_TOKEN_INTER
        )
    else:
        mlp_i = GEMMA_MLP_BYTES_PER_TOKEN_INTER if shape.gemma_norms else MLP_BYTES_PER_TOKEN_INTER
    mlp_i -= FUSED_SWIGLU_BYTES_PER_TOKEN_INTER if shape.fused_layer_kernels else 0
    tiled = mlp_t < t
    if tiled and shape.peak_working_set_audited and not k:
        # A tile of a gated MLP's backward is counted as the untiled MLP's peak per token (12i;
        # Gemma's 14i), under Liger's fused SwiGLU too: on the H200 (Qwen2.5-7B's layers, tiles
        # of 16,384 tokens, dev/long_peak_probe.py) six tile x 2i blocks were live at the first
        # layer backward's peak, where this line counted 4i. A layer's backward grew by less per
        # tile token (tests/test_gpu.py::test_mlp_tile_term_on_gpu: 7.5i with PyTorch's kernels,
        # over the 6i counted before; 5.5i compiled; 3.5i Liger's): 12i bounds both.
        mlp_i = (
            GEMMA_MLP_PEAK_BYTES_PER_TOKEN_INTER
            if shape.gemma_norms
            else GATED_MLP_PEAK_BYTES_PER_TOKEN_INTER
        )
    routed, shared, wide_experts = 0, shape.shared_expert_size, False
    if k:  # routed experts: their whole MLP (8i), per chosen expert, the shared expert
        mlp_i = MOE_BYTES_PER_TOKEN_INTER
        slot_h = MOE_BYTES_PER_SLOT_HIDDEN
        slot_h += MOE_FP32_ROUTING_BYTES_PER_SLOT_HIDDEN if shape.fp32_routing_weights else 0
        # Wide experts: the larger candidate is the expert MLP backward's peak (the same
        # attention side and norms in both).
        wide_h, wide_i = MOE_WIDE_BYTES_PER_SLOT_HIDDEN, MOE_WIDE_BYTES_PER_TOKEN_INTER
        wide_experts = k * wide_h * h + wide_i * inter > k * slot_h * h + mlp_i * inter
        if wide_experts:
            slot_h, mlp_i = wide_h, wide_i
        routed = k * (slot_h * h + MOE_BYTES_PER_SLOT)
        if shared:
            routed += MOE_SHARED_BYTES_PER_INTER * shared + MOE_SHARED_BYTES_PER_HIDDEN * h
    if tiled:
        what, kind = f"MLP in tiles of {mlp_t} tokens", TILED_WORKING_SET_KIND
        per_h = TILED_BYTES_PER_TOKEN_HIDDEN
        per_q = TILED_BYTES_PER_TOKEN_QUERY
        per_h -= FUSED_TILED_BYTES_PER_TOKEN_HIDDEN if shape.fused_layer_kernels else 0
        if keeps_attention_output and shape.fused_layer_kernels and not k:
            # The layer's attention output is kept (its own line) and not re-made.
            per_h -= KEPT_OUTPUT_TILED_BYTES_PER_TOKEN_HIDDEN
            per_q = KEPT_OUTPUT_TILED_BYTES_PER_TOKEN_QUERY
            what += ", attention output kept"
        per = per_h * h + per_q * q + TILED_BYTES_PER_TOKEN_KV * kv
        label = f"{per_h}h + {per_q}q + {TILED_BYTES_PER_TOKEN_KV}kv"
    else:
        what = "untiled MLP" + (", its backward's peak" if mlp_peak else "")
        kind = PEAK_WORKING_SET_KIND if mlp_peak else WORKING_SET_KIND
        per = ATTN_SIDE_BYTES_PER_TOKEN_HIDDEN * h + ATTN_SIDE_BYTES_PER_TOKEN_QUERY * q
        label = f"{ATTN_SIDE_BYTES_PER_TOKEN_HIDDEN}h + {ATTN_SIDE_BYTES_PER_TOKEN_QUERY}q"
        if mlp_peak:
            per += GATED_MLP_PEAK_BYTES_PER_TOKEN_KV * kv + GATED_MLP_PEAK_BYTES_PER_TOKEN
            per += GATED_MLP_PEAK_BYTES_PER_HEAD * max(heads, 1)
            label += (
                f" + {GATED_MLP_PEAK_BYTES_PER_TOKEN_KV}kv + {GATED_MLP_PEAK_BYTES_PER_HEAD} x "
                f"{max(heads, 1)} heads + {GATED_MLP_PEAK_BYTES_PER_TOKEN}"
            )
            less, spared = _peak_saves_less(shape, keeps_attention_output, shared_casts)
            if less:
                per -= less
                label += f" - {less} ({', '.join(spared)})"
    if shape.fused_layer_kernels:
        what += ", fused SwiGLU"
    if routed:
        kind = MOE_WORKING_SET_KIND if shape.moe_working_set_audited else kind
        what += f", {k} routed experts per token"
        what += ", peak in the wide experts' MLP backward" if wide_experts else ""
        label += f" + {k} x ({slot_h}h + {MOE_BYTES_PER_SLOT})"
        if shared:
            label += f" + {MOE_SHARED_BYTES_PER_INTER} x {shared} + {MOE_SHARED_BYTES_PER_HIDDEN}h (shared)"
    norms = 0
    if shape.qk_norm:
        norms += QK_NORM_BYTES_PER_TOKEN_QUERY * q + QK_NORM_BYTES_PER_TOKEN_KV * kv
        norms += QK_NORM_BYTES_PER_TOKEN_HEAD * (heads + _kv_heads(shape))
        if shape.qk_norm_fp32_output:
            norms += QK_NORM_FP32_OUTPUT_BYTES_PER_TOKEN * (q + kv)
    if shape.gemma_norms:
        norms += GEMMA_NORMS_BYTES_PER_TOKEN_HIDDEN * h + GEMMA_NORMS_BYTES_PER_TOKEN
        if shape.qk_norm:
            norms += GEMMA_QK_NORMS_BYTES_PER_TOKEN * (q + kv)
    if norms:
        which = "Gemma's norms" if shape.gemma_norms else "per-head q/k norms"
        label += f" + {norms} of {which}"
    if shape.extra_working_set_bytes_per_token:
        norms += shape.extra_working_set_bytes_per_token
        label += f" + {shape.extra_working_set_bytes_per_token} of {shape.extra_working_set_what}"
    if shape.rope_saved_bytes_per_token:
        norms += shape.rope_saved_bytes_per_token
        label += f" + {shape.rope_saved_bytes_per_token} of the RoPE's own cos/sin copies"
    nbytes = t * (per + norms + routed) + mlp_t * mlp_i * inter
    mlp = f" + tile x {mlp_i}i"
    if shape.qk_norm:
        peak = QK_NORM_PEAK_BYTES_PER_TOKEN_HIDDEN * h + QK_NORM_PEAK_BYTES_PER_TOKEN_QUERY * q
        peak += 4 * kv if shape.gemma_norms else 0
        fp32_out = QK_NORM_FP32_OUTPUT_BYTES_PER_TOKEN if shape.qk_norm_fp32_output else 0
        peak += fp32_out * (q + kv)
        if t * peak > nbytes:
            what += ", peak in the q norm's backward"
            nbytes, mlp = t * peak, ""
            label = (
                f"{QK_NORM_PEAK_BYTES_PER_TOKEN_HIDDEN}h + {QK_NORM_PEAK_BYTES_PER_TOKEN_QUERY}q"
                + (" + 4kv" if shape.gemma_norms else "")
                + (f" + {fp32_out}(q + kv)" if fp32_out else "")
            )
    if tiled and not k:
        # Attention's backward, the other candidate peak of a tiled layer: CUDA's fused kernels
        # hold an fp32 dq accumulator and dK/dV expanded to the query heads there, which the
        # CPU tracker cannot see.
        attention_peak = t * (
            ATTN_BACKWARD_BYTES_PER_TOKEN_HIDDEN * h
            + ATTN_BACKWARD_BYTES_PER_TOKEN_QUERY * q
            + ATTN_BACKWARD_BYTES_PER_TOKEN_KV * kv
        )
        if attention_peak > nbytes:
            what += ", peak in attention's backward"
            nbytes, mlp = attention_peak, ""
            label = (
                f"{ATTN_BACKWARD_BYTES_PER_TOKEN_HIDDEN}h + {ATTN_BACKWARD_BYTES_PER_TOKEN_QUERY}q"
                f" + {ATTN_BACKWARD_BYTES_PER_TOKEN_KV}kv"
            )
    line = estimate_line(
        f"one layer's backward working set (estimate, {what}: tokens x ({label}){mlp} B)",
        nbytes,
        kind,
    )
    if k and shape.dense_mlp_size:
        # An MoE model's dense layers run a gated MLP of their own width, whose backward peaks
        # as the audited dense families' does: the larger layer.
        dense = dataclasses.replace(
            shape, experts_per_token=0, intermediate_size=shape.dense_mlp_size,
            shared_expert_size=0, dense_mlp_size=0, peak_working_set_audited=True,
        )  # fmt: skip
        dense_line = working_set_line(
            dense, t, tile, every_layer_recomputed, keeps_attention_output, shared_casts
        )
        if dense_line.nbytes > line.nbytes:
            return dataclasses.replace(dense_line, name=f"{dense_line.name} (the dense layers)")
    return line


def tiled_weight_grad_line(shape: ModelShape, dtype: torch.dtype) -> MemoryLine:
    """The tiled MLP's weight gradients during a layer's backward: the fp32 sums over the tiles
    and one tile's gradients in the compute dtype (``tiling``: bf16 tile gradients are summed in
    fp32 and rounded once), for the gate, up and down projections."""
    numel = 3 * shape.hidden_size * shape.intermediate_size
    per = 4 + itemsize(dtype)
    return MemoryLine(
        f"tiled MLP weight gradients (fp32 sums + one tile's, {per} B x {numel / 1e6:.0f} M "
        "weights)",
        per * numel,
        TILED_WEIGHT_GRADS_KIND,
    )


def _peak_saves_less(
    shape: ModelShape, keeps_attention_output: bool, shared_casts: bool
) -> tuple[int, list[str]]:
    """Bytes per token a recomputed layer's measured backward peak holds less than the gated-MLP
    peak line, and what spares them (``FUSED_NORMS_BYTES_PER_TOKEN_HIDDEN``): PyTorch SDPA
    without a mask (no sliding window, none always passed), non-Gemma layers, as measured."""
    masked = shape.sliding_window > 0 or shape.sdpa_explicit_mask
    if not shape.sdpa_attention or shape.gemma_norms or masked:
        return 0, []
    h, kv = shape.hidden_size, shape.kv_size or shape.hidden_size
    heads, q = _query_width(shape)
    less, spared = 0, []
    if shape.compiled_norms:
        less += FUSED_NORMS_BYTES_PER_TOKEN_HIDDEN * h
        less += FUSED_QK_NORMS_BYTES_PER_TOKEN * (q + kv) if shape.qk_norm else 0
        spared.append("fused norms")
    if shared_casts and (cast := shared_cast_saving_per_token(shape)):
        less += cast
        spared.append("one bf16 cast per normed input")
    if keeps_attention_output:
        less += KEPT_OUTPUT_BYTES_PER_TOKEN_QUERY * q + KEPT_OUTPUT_BYTES_PER_HEAD * max(heads, 1)
        spared.append("attention output kept")
    return less, spared


def _is_measured_peak(shape: ModelShape, t: int, tile: int) -> bool:
    """Whether the working-set line is a layer backward's measured peak: untiled MLPs of the
    audited dense families (``GATED_MLP_PEAK_BYTES_PER_TOKEN_INTER``)."""
    untiled = not (0 < tile < t)
    return shape.peak_working_set_audited and untiled and not shape.experts_per_token


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
        ATTENTION_OUTPUTS_KIND,
    )


def shares_input_casts(options: ResolvedOptions, dtype: torch.dtype) -> bool:
    """Whether the layers run with autocast_kernels' shared input casts (a 16-bit compute
    dtype: autocast on; the option on)."""
    return bool(options.autocast_kernels) and dtype in (torch.bfloat16, torch.float16)


def shared_cast_saving_per_token(shape: ModelShape) -> int:
    """Bytes per token a kept layer's saved casts shrink by with shared input casts: the
    normed inputs' readers (``normed_input_linears``, 5 for q/k/v and gate/up) cast once per
    input (2) instead of once per linear, 2h each. Measured on the CPU: a kept layer's saved
    tensors exactly this much less (tests/test_keep_activations.py); on the H200 the validation
    matrix's kept-layer cells (Qwen3-1.7B and H2O-Danube-1.8B at 4k-32k, every layer kept,
    compiled kernels) peaked 8.5h per token and kept layer under plans that counted a cast per
    linear (95.21 GiB against 110.58 for the same plan before the shared casts).

    A recomputed layer's backward peak holds the same 6h less (tests/test_plan_accuracy.py); the
    gated-MLP peak line takes it off under SDPA without a mask (``_peak_saves_less``). Under
    FlexAttention it stays: the H200's H2O-Danube-1.8B at 262,144 tokens (every layer
    recomputed, shared casts) needed 118.44 GiB against 125.35 planned with a cast per linear,
    less than the casts and compiled norms together would take off."""
    return 2 * shape.hidden_size * max(0, shape.normed_input_linears - 2)


def kept_activation_bytes_per_token(shape: ModelShape, shared_casts: bool = False) -> int:
    """Bytes a decoder layer's autograd graph saves per token when it is not recomputed.

    Counted for a pre-norm attention + gated-MLP layer (Llama/Qwen2 family) under bf16 autocast
    with an fp32 residual stream, on top of the saved layer input (a boundary activation,
    counted there), as audited with ``saved_tensors_hooks`` (tests/test_keep_activations.py):
    each RMSNorm saves its fp32 normalized product (2 x 4h) and the second one its fp32 input,
    the mid-layer residual (4h); the q/k/v and gate/up projections each save their own bf16 cast
    of the normalized input (5 x 2h); attention saves its bf16 q (2q, q = heads x head_dim,
    usually h), rotated k and v (4kv) and output, which o_proj saves as its input (2q: the same
    storage); the MLP saves the gate and up outputs, the SiLU output and their product (4 x 2i).
    Llama's RoPE saves nothing per layer: its products are with cos/sin, which need no gradient,
    so only the (shared) tables are kept; a family whose RoPE function makes its own copies of
    them keeps those (``ModelShape.rope_saved_bytes_per_token``). Per token besides:
    attention's fp32 log-sum-exp per head and the two norms' fp32 scales (4 x heads + 8). With
    per-head q/k norms (Qwen3), each saves its input cast to fp32, its bf16 output and a scale
    per head: 6q + 6kv + 4 x (heads + kv heads).

    Not per token, so not here: the s x s tensors a kept layer's attention saves (under SDPA
    with a sliding window shorter than the sequence its own additive copy of the mask,
    sequences x s^2 x 2 B; under eager attention its probabilities, sequences x heads x s^2 x
    6 B), which ``kept_attention_lines`` counts per kept layer (measured on the CPU,
    tests/test_plan_accuracy.py). Before that line the validation matrix's H2O-Danube and
    Phi-3 at 32,768 tokens kept 22 and 10 layers, 44 and 20 GiB more than planned, and ran out
    of GPU memory.
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
        # (Gemma-2's layer has the same four norms but no per-head ones; it is not audited.)
        total += 16 * h + 8 + (2 * q + 2 * kv if shape.qk_norm else 0)
    if shape.fused_layer_kernels:
        # Liger's RMSNorm saves its input and scale, not the fp32 normalized product (8h for
        # the two layer norms; per-head q/k norms keep their bf16 input instead of an fp32 copy
        # and a bf16 output: 4q + 4kv); its SwiGLU saves gate and up but not the SiLU output
        # (2i; down_proj still saves the product as its input). Measured on the H200 for a
        # Qwen2.5-1.5B-wide layer: 82,486 B/token against 82,488 counted here.
        total -= 8 * h + 2 * i + (4 * q + 4 * kv if shape.qk_norm else 0)
    if shared_casts:  # one bf16 cast per normed input instead of one per linear
        total -= shared_cast_saving_per_token(shape)
    return max(0, total + shape.rope_saved_bytes_per_token + shape.extra_kept_bytes_per_token)


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


@dataclass(frozen=True)
class SegmentPeak:
    """The checkpoint segment whose backward holds the most of the offloaded boundary buffers,
    the segment's cached inputs and the kept attention outputs (``segment_peak``)."""

    first: int  # the segment's layers, first..last
    last: int
    #: Whether ``last`` keeps its attention output (its backward's working set is smaller).
    last_keeps_output: bool
    #: fp32 layer inputs alive beyond the two offload buffers (in use + prefetched), which the
    #: chain's cached inputs replace while the segment's backward runs (never both alive).
    cache_beyond_buffers: int
    #: Forward-kept attention outputs still alive there: those of the kept layers up to ``last``
    #: (each is freed as its layer's backward passes).
    kept_outputs: int
    #: The chain's own kept outputs (``chain_attention_outputs``), for layers without
    #: forward-kept ones: the chain reads those.
    chain_outputs: int


def _segments(n_layers: int, every: int) -> list[tuple[int, int]]:
    """The checkpoint segments (first, last layer) of ``n_layers`` layers in segments of
    ``every``, as the engine forms them."""
    k = min(max(1, every), n_layers)
    return [(first, min(first + k, n_layers) - 1) for first in range(0, n_layers, k)]


def segment_peak(
    shape: ModelShape,
    options: ResolvedOptions,
    attention_layers: int,
    chain_layers: int,
    output_bytes_per_token: int,
    kept_output_saving: int = 0,
    chain_counts: Mapping[int, int] | None = None,
) -> SegmentPeak:
    """Offloaded fp32 boundaries, every layer recomputed: the segment s (first..last) maximizing
    max(2, len(s) - 1) layer inputs (the two offload buffers, or the chain's cached inputs,
    never alive together) + the kept attention outputs of layers <= last + the chain's own
    outputs, less ``kept_output_saving`` (per token) where the segment's last layer, whose
    backward is the segment's peak, keeps its own output (its working set is smaller by that).
    The plan once summed all three at one peak; on the CPU scale model of the H200's base262k
    row (dev/long_plan_probe.py) that was 74 GiB where 60 were alive together.
    ``chain_counts``: per segment (its first layer), how many of its chain's last layers keep
    their outputs (default: ``chain_layers`` each)."""
    peaks = _segment_peaks(
        shape, options, attention_layers, output_bytes_per_token, kept_output_saving,
        chain_counts if chain_counts is not None else {},
        chain_layers,
    )  # fmt: skip
    return max(peaks, key=lambda p: p[1])[0]


def _segment_peaks(
    shape: ModelShape,
    options: ResolvedOptions,
    attention_layers: int,
    output_bytes_per_token: int,
    kept_output_saving: int,
    chain_counts: Mapping[int, int],
    chain_default: int,
) -> list[tuple[SegmentPeak, int]]:
    """Each segment's joint term (``segment_peak``) and its bytes per token, in layer order."""
    kept_from = shape.num_layers - min(max(0, attention_layers), shape.num_layers)
    return [
        _segment_term(
            shape,
            first,
            last,
            kept_from,
            chain_counts.get(first, chain_default),
            output_bytes_per_token,
            kept_output_saving,
        )  # fmt: skip
        for first, last in _segments(shape.num_layers, options.checkpoint_every)
    ]


def _segment_term(
    shape: ModelShape,
    first: int,
    last: int,
    kept_from: int,
    chain_count: int,
    output_bytes_per_token: int,
    kept_output_saving: int,
) -> tuple[SegmentPeak, int]:
    """One segment's joint term and its bytes per token: layers ``kept_from`` on keep their
    forward outputs, the chain keeps ``chain_count`` of its last layers' (reading the
    forward-kept ones)."""
    inputs = max(2, last - first)
    kept = max(0, last - kept_from + 1)
    chain_span = range(max(first, last - min(chain_count, last - first)), last)
    chain = sum(1 for i in chain_span if i < kept_from)
    per_token = inputs * 4 * shape.residual_width + (kept + chain) * output_bytes_per_token
    per_token -= kept_output_saving if last >= kept_from else 0
    return SegmentPeak(first, last, last >= kept_from, inputs - 2, kept, chain), per_token


def _chain_layers(shape: ModelShape, options: ResolvedOptions) -> int:
    """How many of a segment chain's last layers keep their attention outputs as asked (only
    PyTorch SDPA's fused kernels' outputs are kept)."""
    return options.chain_attention_layers if shape.sdpa_attention else 0


def chain_output_counts(
    shape: ModelShape,
    options: ResolvedOptions,
    attention_layers: int,
    output_bytes_per_token: int,
    kept_output_saving: int = 0,
) -> dict[int, int]:
    """Per checkpoint segment (its first layer): how many of its chain's last layers keep their
    attention outputs. ``chain_attention_outputs`` (N) sets the step's joint peak; a segment
    below that peak (no forward-kept outputs alive yet at its backward: the early layers) keeps
    more, up to all its chain layers, as long as it stays at or under the peak: the same peak,
    fewer attention kernels run again. Offloaded fp32 boundaries only (``segment_peak``'s
    accounting); {} where there is no chain to keep outputs."""
    n = _chain_layers(shape, options)
    if n <= 0:
        return {}
    uniform = _segment_peaks(
        shape, options, attention_layers, output_bytes_per_token, kept_output_saving, {}, n
    )
    peak = max(b for _, b in uniform)
    kept_from = shape.num_layers - min(max(0, attention_layers), shape.num_layers)
    counts = {}
    for seg, _ in uniform:
        count = n
        while count < seg.last - seg.first:
            _, more = _segment_term(
                shape, seg.first, seg.last, kept_from, count + 1, output_bytes_per_token,
                kept_output_saving,
            )  # fmt: skip
            if more > peak:
                break
            count += 1
        counts[seg.first] = count
    return counts


def joint_peak_lines(peak: SegmentPeak, t: int, h: int, per_token: int) -> list[MemoryLine]:
    """The boundary buffers and the kept attention outputs at ``peak`` (the segment cache and
    the chain's outputs are the caller's lines, at the same segment)."""
    lines = [
        MemoryLine(
            f"boundary activations offloaded to host; in HBM: 2 (in use + prefetched), or the "
            f"chain's cached inputs in their place (peak at layers {peak.first}-{peak.last})",
            2 * t * h * 4,
            BOUNDARY_KIND,
        )
    ]
    if peak.kept_outputs:
        lines.append(
            MemoryLine(
                f"attention outputs kept for the recompute, alive at that segment's backward: "
                f"{peak.kept_outputs} layers x {t} tokens x {per_token} B",
                peak.kept_outputs * t * per_token,
                ATTENTION_OUTPUTS_KIND,
            )
        )
    return lines


def boundary_activation_bytes(shape: ModelShape, step: StepShape, options: ResolvedOptions) -> int:
    """Every saved layer input (the residual stream: fp32, or its bf16-rounded copy) for one
    micro-batch: one per layer, or one per checkpoint segment."""
    b = options.boundary_bytes_per_element
    return (
        step.micro_batch_tokens * shape.residual_width * b * saved_boundary_layers(shape, options)
    )


def saved_layers_label(shape: ModelShape, options: ResolvedOptions) -> str:
    n = saved_boundary_layers(shape, options)
    if n == shape.num_layers:
        return f"{n} layers"
    return f"{n} saved (1 per {options.checkpoint_every} of {shape.num_layers} layers)"


def boundary_dtype_label(options: ResolvedOptions) -> str:
    b = options.boundary_bytes_per_element
    return {4: "fp32", 2: "bf16"}.get(b, f"{b} B")


#: Bytes per element of one layer's eager attention (heads x s x s per sequence) at its peak, in
#: its backward: the fp32 softmax output saved for backward, the gradient of the probabilities
#: cast back to fp32 and the softmax backward's fp32 result (4 + 4 + 4 B); soft-capped logits
#: (Gemma-2) add the tanh output saved in the compute dtype. The forward's peak is lower (the
#: fp32 scores plus mask and the fp32 softmax output, 8 B), and the recompute re-makes the same
#: saves before this backward. Measured on the CPU with the live-tensor tracker (Llama and
#: Gemma-2 layers, bf16 autocast, 512 to 2,048 tokens, 1 and 2 sequences: exact), as
#: tests/test_plan_attention.py does. On CUDA the same step holds 4 B more per element (the
#: H200's allocator peak, ``dev/family_plan_sweep.py --device cuda --attn eager``: Llama and
#: Qwen3 16.0 B, Gemma-2 18.0 soft-capped, at 8,192 and 16,384 tokens; 12 was 1.3x under):
#: the plan, made for the GPU, counts CUDA's.
EAGER_SCORE_BYTES_CPU = 12
EAGER_SCORE_BYTES = 16


def sliding_layer_indices(shape: ModelShape) -> list[int]:
    """The layers that attend through the sliding window: ``shape.sliding_layers`` where it
    is known (one flag per layer), else every layer when a window is set (exact where every
    layer slides, an upper bound for mixed models), else none."""
    if shape.sliding_window <= 0:
        return []
    flags = shape.sliding_layers
    if len(flags) != shape.num_layers:
        return list(range(shape.num_layers))
    return [i for i, on in enumerate(flags) if on]


def sdpa_window_mask(shape: ModelShape, step: StepShape) -> bool:
    """Whether SDPA attends with an explicit s x s mask: sliding-window layers and a sequence
    at least as long as the window (shorter ones, and full attention, run ``is_causal``), or a
    family that always passes one (``ModelShape.sdpa_explicit_mask``)."""
    if shape.attn_implementation != "sdpa":
        return False
    if shape.sdpa_explicit_mask:
        return True
    return shape.sliding_window > 0 and step.seq_len >= shape.sliding_window


def sdpa_masked_layers(shape: ModelShape) -> list[int]:
    """The layers SDPA runs with that mask: every one where the family always passes a mask,
    else the sliding-window layers."""
    if shape.sdpa_explicit_mask:
        return list(range(shape.num_layers))
    return sliding_layer_indices(shape)


def _unused_window_mask(shape: ModelShape, step: StepShape, impl: str = "sdpa") -> bool:
    """Whether ``impl`` attention gets a sliding-window mask made for no layer."""
    return (
        shape.unused_window_mask_from >= 0
        and shape.attn_implementation == impl
        and step.seq_len >= shape.unused_window_mask_from
    )


#: A sliding-window mask made for no layer (``ModelShape.unused_window_mask_from``): the bool
#: s x s mask and, while ``sdpa_mask`` makes it, two more bool temporaries of its size (its two
#: comparisons, before their ``&``). Measured on the CPU live-tensor tracker (Qwen2-MoE, 4,096
#: tokens: 2.0 B per element over the plan) and on the H200 (16,384 tokens: 2.8 B).
UNUSED_WINDOW_MASK_BYTES = 3


#: DeepSeek-V3.2's sparse-attention indexer (``ModelShape.indexer_heads``), in every layer's
#: forward and recompute (under no_grad, nothing saved), per sequence and element of s x s, in
#: the compute dtype (autocast runs its fp32 products in it): its peak is
#: ``indexer_elements_per_score`` elements (for more than one sequence, the key broadcast to
#: every query by ``matmul``, its head_dim, beside the heads' scores; then the scores and their
#: scaled ReLU, two per head).
#: Then the layer's bool top-k mask, its negation and the attention mask combined with it
#: (``INDEXER_MASK_BYTES``). Its additive copy for SDPA is the explicit mask's line. Measured on
#: the CPU (tests/test_plan_attention.py).
INDEXER_MASK_BYTES = 3


def indexer_elements_per_score(shape: ModelShape, sequences: int) -> int:
    """Elements per sequence and s x s element at the sparse-attention indexer's peak, for
    ``sequences`` per micro-batch: ``matmul`` copies the key broadcast to every query only for
    more than one (one sequence's batch dimension folds away)."""
    heads = shape.indexer_heads
    if not heads:
        return 0
    return max(shape.indexer_head_dim + heads, 2 * heads) if sequences > 1 else 2 * heads


#: FlexAttention's ``BlockMask`` (``attn_implementation="flex_attention"``): which
#: ``FLEX_BLOCK`` x ``FLEX_BLOCK`` tiles of s x s attend, as four int32 index tensors of
#: sequences x (s / FLEX_BLOCK)^2 (kv and q order, partial and full tiles): 16 B per tile, no
#: s x s tensor (transformers builds it with ``create_block_mask(_compile=True)``).
FLEX_BLOCK = 128
FLEX_BLOCK_MASK_BYTES = 16


#: Bytes per element (sequence x head x s x s) a layer that keeps its activations holds of its
#: eager attention until its backward: the fp32 softmax output (saved by the softmax) and its
#: cast to the compute dtype (saved by the product with v; none in fp32 runs, where the cast is
#: the same tensor); soft-capped logits (Gemma-2) add the tanh output in the compute dtype.
#: Measured on the CPU with the live-tensor tracker (Llama, Mistral, Gemma-2 and Gemma-3
#: layers, bf16 and fp32, 1 and 2 sequences of 512 tokens: exact; tests/test_plan_accuracy.py).
EAGER_KEPT_SOFTMAX_BYTES = 4


def eager_kept_bytes_per_element(shape: ModelShape, dtype: torch.dtype) -> int:
    """``EAGER_KEPT_SOFTMAX_BYTES`` plus the compute-dtype probabilities (bf16 runs), the
    soft-capping's tanh output and the family's saved fp32 copies of its scores (XGLM's clamp:
    10 B in bf16, measured). Its compute-dtype copies (GPT-J's, BLOOM's, MPT's) are temporaries
    of the backward, not saved: a kept layer does not hold them (BLOOM and MPT 6 B, measured)."""
    isz = itemsize(dtype)
    cast = isz if dtype != torch.float32 else 0
    saved_fp32 = 4 * shape.eager_score_copies[1]
    return EAGER_KEPT_SOFTMAX_BYTES + cast + (isz if shape.attn_softcapping else 0) + saved_fp32


def kept_attention_lines(
    shape: ModelShape, step: StepShape, dtype: torch.dtype, kept_layers: Sequence[int]
) -> list[MemoryLine]:
    """The s x s tensors each layer that keeps its activations saves until its backward (the
    mask made once per forward and a recomputed layer's copies are ``attention_mask_lines``').

    * SDPA with a window shorter than the sequence: each kept *sliding* layer's additive copy
      of the bool mask in the compute dtype, sequences x s^2 (full-attention layers run
      ``is_causal``: none). 2 GiB per kept layer at one 32,768-token sequence in bf16: the
      validation matrix's H2O-Danube and Phi-3 at 32,768 tokens kept 22 and 10 layers planned
      without it and ran out of GPU memory.
    * eager attention: every kept layer's probabilities, sequences x heads x s^2 x
      ``eager_kept_bytes_per_element`` (6 B in bf16, 8 soft-capped); the fp32 masks are shared.

    Measured on the CPU with the live-tensor tracker (tests/test_plan_accuracy.py: exact).
    """
    if not kept_layers:
        return []
    s = step.seq_len
    seqs = max(1, step.micro_batch_tokens // max(1, s))
    if sdpa_window_mask(shape, step):
        n = len(set(kept_layers) & set(sdpa_masked_layers(shape)))
        if not n:
            return []
        which = "masked" if shape.sdpa_explicit_mask else "sliding-window"
        return [
            estimate_line(
                f"that mask as SDPA's additive mask, saved by each of the {n} {which} "
                f"layers keeping activations ({n} x {seqs} x {s}^2 x {itemsize(dtype)} B)",
                n * seqs * s * s * itemsize(dtype),
                MASK_KIND,
            )
        ]
    if shape.attn_implementation == "eager":
        n, heads = len(kept_layers), _query_width(shape)[0] or 1
        per = eager_kept_bytes_per_element(shape, dtype)
        capped = " and the soft-capping's tanh" if shape.attn_softcapping else ""
        capped += " and the saved fp32 scores" if shape.eager_score_copies[1] else ""
        return [
            estimate_line(
                f"eager attention probabilities saved by each of the {n} layers keeping "
                f"activations (fp32 softmax, its compute-dtype copy{capped}: {n} x {seqs} x "
                f"{heads} heads x {s}^2 x {per} B)",
                n * seqs * heads * s * s * per,
                EAGER_SCORES_KIND,
            )
        ]
    return []


def attention_mask_lines(
    shape: ModelShape, step: StepShape, dtype: torch.dtype, kept_layers: Sequence[int] = ()
) -> list[MemoryLine]:
    """The s x s tensors attention makes (none for SDPA's ``is_causal`` path or flash attention;
    FlexAttention's block masks, (s / 128)^2 tiles).

    * eager attention: every mask a layer uses (full, sliding) as an fp32 additive mask of
      sequences x s x s (the dtype of the fp32 embedding output), made once per forward and
      held by the layers until their backward; and one layer's scores and probabilities
      (``EAGER_SCORE_BYTES`` per element and head).
    * SDPA with sliding-window layers and a sequence at least as long as the window: a bool s x s
      mask made once per forward (one for the batch: an expanded view), which SDPA converts into
      an additive mask in the compute dtype of sequences x s x s for each layer, saved by the
      attention node until the layer's backward (and the kernel with a mask is not flash
      attention's: the memory-efficient one, no s x s of its own). A recomputed layer saves it
      only while it is in backward (one such copy, when some sliding layer is recomputed).

    Then ``kept_attention_lines`` for the layers (indices) ``kept_layers`` that keep their
    activations. Padded micro-batches and packed sequences with position ids make a mask under
    SDPA too; the plan does not know the data and counts none for them.
    """
    impl, s = shape.attn_implementation, step.seq_len
    seqs = max(1, step.micro_batch_tokens // max(1, s))
    lines: list[MemoryLine] = []
    sliding = shape.sliding_window > 0
    if impl == "eager":
        # (A sliding mask made for no layer is one more fp32 mask.)
        sliding_mask = sliding or _unused_window_mask(shape, step, "eager")
        masks = int(shape.full_attention_layers) + int(sliding_mask)
        which = " and ".join(
            w for w, on in (("full", shape.full_attention_layers), ("sliding", sliding_mask)) if on
        )
        lines.append(
            estimate_line(
                f"attention masks (eager: {which}, fp32, {seqs} sequence(s) x {s}^2 x 4 B each, "
                "made once per forward)",
                masks * seqs * s * s * 4,
                MASK_KIND,
            )
        )
        heads = _query_width(shape)[0] or 1
        per = EAGER_SCORE_BYTES + (itemsize(dtype) if shape.attn_softcapping else 0)
        in_dtype, in_fp32 = shape.eager_score_copies
        per += in_dtype * itemsize(dtype) + in_fp32 * 4
        capped = ", soft-capped" if shape.attn_softcapping else ""
        capped += f", compute-dtype copies of the scores: {in_dtype}" if in_dtype else ""
        capped += f", fp32 copies of the scores: {in_fp32}" if in_fp32 else ""
        lines.append(
            estimate_line(
                f"eager attention of one layer (scores, fp32 softmax and its gradient{capped}: "
                f"{seqs} x {heads} heads x {s}^2 x {per} B)",
                seqs * heads * s * s * per,
                EAGER_SCORES_KIND,
            )
        )
    elif sdpa_window_mask(shape, step):
        what = (
            "the family's explicit causal mask (SDPA"
            if shape.sdpa_explicit_mask
            else f"sliding-window attention mask (SDPA, window {shape.sliding_window}"
        )
        lines.append(
            estimate_line(
                f"{what}: bool, {s}^2 x 1 B, made once per forward)",
                s * s,
                MASK_KIND,
            )
        )
        if set(sdpa_masked_layers(shape)) - set(kept_layers):
            lines.append(
                estimate_line(
                    f"that mask as SDPA's additive mask in one recomputed layer ({seqs} x {s}^2 "
                    f"x {itemsize(dtype)} B)",
                    seqs * s * s * itemsize(dtype),
                    MASK_KIND,
                )
            )
    elif impl == "flex_attention":
        masks = int(shape.full_attention_layers) + int(sliding)
        tiles = -(-s // FLEX_BLOCK)
        lines.append(
            estimate_line(
                f"FlexAttention block masks ({masks}, {seqs} sequence(s) x {tiles}^2 tiles of "
                f"{FLEX_BLOCK}^2 x {FLEX_BLOCK_MASK_BYTES} B each, made once per forward)",
                masks * seqs * tiles * tiles * FLEX_BLOCK_MASK_BYTES,
                MASK_KIND,
            )
        )
    if shape.indexer_heads:
        elements = indexer_elements_per_score(shape, seqs)
        per = elements * itemsize(dtype) + INDEXER_MASK_BYTES
        lines.append(
            estimate_line(
                f"sparse-attention indexer of one layer ({shape.indexer_heads} heads of "
                f"{shape.indexer_head_dim}: {seqs} x {s}^2 x ({elements} x {itemsize(dtype)} + "
                f"{INDEXER_MASK_BYTES}) B while it picks the keys)",
                seqs * s * s * per,
                INDEXER_KIND,
            )
        )
    if _unused_window_mask(shape, step):
        lines.append(
            estimate_line(
                f"sliding-window mask the family's forward makes for no layer (bool, {seqs} x "
                f"{s}^2 x {UNUSED_WINDOW_MASK_BYTES} B while made)",
                seqs * s * s * UNUSED_WINDOW_MASK_BYTES,
                MASK_KIND,
            )
        )
    return lines + kept_attention_lines(shape, step, dtype, kept_layers)


#: Bytes per (row, top-k slot, expert) of transformers' router load-balancing loss before 5.16,
#: whose rows are every routing layer's tokens concatenated: the int64 one-hot of the top-k
#: experts, its fp32 copy and, with an attention mask, that mask expanded to the one-hot's shape
#: (int64) and their fp32 product. Besides, per row and expert: the layers' router logits, their
#: concatenation and its softmax (saved for backward) in the compute dtype and the mask expanded
#: to the probabilities' shape (int64) with its product (the compute dtype); per row and slot the
#: top-k values and int64 indices.
ROUTER_ONE_HOT_BYTES = 24
ROUTER_ROW_EXPERT_BYTES = 8
ROUTER_ROW_SLOT_BYTES = 8

#: Per token and expert, one layer's turn of the layer-by-layer loss (5.16 on) beside the router
#: logits and softmax outputs every layer keeps: the probabilities' fp32 copy, the masked
#: product, top-k's outputs and the expert counts (at most 10 B measured).
ROUTER_LAYER_BYTES = 12


def router_aux_loss_lines(
    shape: ModelShape, step: StepShape, dtype: torch.dtype
) -> list[MemoryLine]:
    """The router aux loss's temporaries, where the training loss adds one
    (``ModelShape.router_aux_loss``): the routing layers' router logits (tokens x experts each, in
    the compute dtype), held from their layer's forward to the loss, and what transformers'
    ``load_balancing_loss_func`` makes of them. Before transformers 5.16 it one-hot encodes every
    layer's top-k choices at once (int64, layers x tokens x k x experts): 52 GiB for OLMoE-1B-7B
    at 262,144 tokens with an attention mask. From 5.16 it goes layer by layer, keeping each
    layer's softmax for backward (1.2 GiB there). Measured on the CPU with the live-tensor
    tracker (5.10's and 5.24's function, bf16 and fp32, 1 to 8 layers, k of 1 to 8, with and
    without a mask: at most 96% of the line, 80-96% with eight layers and a mask;
    tests/test_plan_accuracy.py measures the installed one)."""
    if not shape.router_aux_loss:
        return []
    t, isz = step.micro_batch_tokens, itemsize(dtype)
    layers = shape.router_layers or shape.num_layers
    e, k = shape.num_experts, shape.experts_per_token
    rows = layers * t
    if shape.router_aux_one_hot:
        per_row = (
            e * (4 * isz + ROUTER_ROW_EXPERT_BYTES)
            + k * (ROUTER_ROW_SLOT_BYTES + isz)
            + ROUTER_ONE_HOT_BYTES * k * e
        )
        return [
            estimate_line(
                f"router aux loss (one-hot over all {layers} routing layers at once: {layers} x "
                f"{t} tokens x ({k} x {e} experts x {ROUTER_ONE_HOT_BYTES} + ...) B)",
                rows * per_row,
                ROUTER_AUX_KIND,
            )
        ]
    return [
        estimate_line(
            f"router aux loss (router logits and their softmax of {layers} routing layers: "
            f"{layers} x {t} tokens x {e} experts x {2 * isz} B, one layer's temporaries)",
            rows * e * 2 * isz + t * e * ROUTER_LAYER_BYTES,
            ROUTER_AUX_KIND,
        )
    ]


def fused_loss_runs(shape: ModelShape, options: ResolvedOptions) -> bool:
    """Whether training runs the fused, chunked LM head + loss: the model's head and loss allow
    it (``ModelShape.fused_loss``) and the run leaves ``fused_loss`` on."""
    return shape.fused_loss and options.fused_loss


def mlp_tile(shape: ModelShape, options: ResolvedOptions) -> int:
    """The MLP tile the layers run (tokens; 0: untiled): ``mlp_tile_tokens`` where tiles apply
    to the model's MLPs (``ModelShape.mlp_tileable``)."""
    return options.mlp_tile_tokens if shape.mlp_tileable else 0


def loss_chunk_tokens(shape: ModelShape, step: StepShape, options: ResolvedOptions) -> int:
    """Tokens per chunk of the fused loss as the run makes them: ``loss_chunk_tokens``, else
    about 2 GiB of fp32 logits (``default_chunk_tokens``), at most the micro-batch."""
    chunk = options.loss_chunk_tokens or default_chunk_tokens(shape.vocab_size)
    return min(chunk, step.micro_batch_tokens)


def loss_phase_apart(
    shape: ModelShape, step: StepShape, options: ResolvedOptions, kept: int
) -> bool:
    """Whether the plan holds the fused loss's phase (and a non-tied embedding's gradient, made
    after the last layer's backward) apart from a layer's backward, as the larger of the two:
    a dense layer with fused kernels, MLP tiles or (Liger-Kernel's) untiled with its measured
    peak, every layer recomputed (``kept`` layers keep their activations), one micro-batch per
    step (with more, the first micro-batch's head and embedding gradients are alive in the next
    one's backward). See ``activation_lines``."""
    t, tile = step.micro_batch_tokens, mlp_tile(shape, options)
    tiled_fused = 0 < tile < t and shape.fused_layer_kernels
    # Liger-Kernel's (fused kernels, norms not this library's compiled ones).
    liger = shape.fused_layer_kernels and not shape.compiled_norms
    return (
        fused_loss_runs(shape, options)
        and (tiled_fused or (liger and _is_measured_peak(shape, t, tile)))
        and step.grad_accum == 1
        and not kept
        and not shape.experts_per_token
    )


def embedding_grad_apart_bytes(
    shape: ModelShape, step: StepShape | None, options: ResolvedOptions, kept: int
) -> int:
    """A non-tied embedding's fp32 gradient when it is planned as its own phase
    (``loss_phase_apart``), else 0: the non-layer parameters' line then leaves it out."""
    apart = (
        step is not None
        and not shape.tied_embeddings
        and not shape.frozen_embedding
        and loss_phase_apart(shape, step, options, kept)
    )
    return 4 * shape.vocab_size * shape.hidden_size if apart else 0


def _joint_segment_peak(options: ResolvedOptions, kept_layers: int) -> bool:
    """Whether the plan counts the boundary buffers, the segment cache and the kept attention
    outputs at one segment's joint peak (``segment_peak``): offloaded fp32 boundaries, every
    layer recomputed."""
    return (
        options.offload_activations and options.boundary_bytes_per_element >= 4 and not kept_layers
    )


def segment_chain_counts(
    shape: ModelShape,
    step: StepShape,
    options: ResolvedOptions,
    dtype: torch.dtype,
    kept_layers: int = 0,
    attention_layers: int = 0,
) -> dict[int, int]:
    """Per checkpoint segment (its first layer), how many of its chain's last layers keep their
    attention outputs, as the plan counts them and the engine keeps them: filled per segment up
    to the joint peak where the plan counts one (``chain_output_counts``), else
    ``chain_attention_outputs`` each; {} without chain outputs."""
    n = _chain_layers(shape, options)
    if n <= 0:
        return {}
    if not _joint_segment_peak(options, kept_layers):
        return {first: n for first, _ in _segments(shape.num_layers, options.checkpoint_every)}
    shared = shares_input_casts(options, dtype)
    _, saving = _kept_output_working_set(
        shape, step.micro_batch_tokens, mlp_tile(shape, options), shared_casts=shared
    )
    per_token = attention_output_bytes_per_token(shape, dtype)
    return chain_output_counts(shape, options, attention_layers, per_token, saving)


def _kept_output_working_set(
    shape: ModelShape,
    t: int,
    tile: int,
    work: MemoryLine | None = None,
    shared_casts: bool = False,
) -> tuple[MemoryLine, int]:
    """Every layer recomputed: the working-set line of a layer that keeps its attention output,
    and the bytes per token it holds less than ``work``, the line of one that does not (made
    here when not given)."""
    if work is None:
        work = working_set_line(shape, t, tile, shared_casts=shared_casts)
    work_kept = working_set_line(
        shape, t, tile, keeps_attention_output=True, shared_casts=shared_casts
    )
    return work_kept, (work.nbytes - work_kept.nbytes) // max(t, 1)


def kept_phases_apart(
    shape: ModelShape, step: StepShape, options: ResolvedOptions, kept_layers: Sequence[int]
) -> bool:
    """Whether the layers keeping activations are the model's last (every layer in HBM), so
    that their backward ends before any recomputed layer's, whose measured peak (an untiled
    dense gated MLP of an audited family) the plan then holds apart from theirs (where every
    layer keeps its activations, none is recomputed)."""
    return (
        bool(kept_layers)
        and max(kept_layers) == shape.num_layers - 1
        and fused_loss_runs(shape, options)
        and not shape.experts_per_token
        and not shape.gemma_norms  # (a kept GeGLU layer's backward is not measured)
        and _is_measured_peak(shape, step.micro_batch_tokens, mlp_tile(shape, options))
    )


def kept_activations_line(
    shape: ModelShape,
    step: StepShape,
    options: ResolvedOptions,
    dtype: torch.dtype,
    kept: int,
    kind: str = KEPT_ACTIVATIONS_KIND,
) -> MemoryLine:
    """The saves of ``kept`` layers that keep their activations (no recompute)."""
    # A kept layer's graph holds its fp32 input itself, also where the boundary line counts it
    # rounded to bf16.
    shared = shares_input_casts(options, dtype)
    per_token = (
        kept_activation_bytes_per_token(shape, shared)
        + (4 - options.boundary_bytes_per_element) * shape.residual_width
    )
    casts = ", one bf16 cast per normed input" if shared else ""
    return estimate_line(
        f"kept activations of {kept} HBM-tier layers (no recompute{casts}): "
        f"{step.micro_batch_tokens} tokens x {per_token} B each (estimate)",
        kept * step.micro_batch_tokens * per_token,
        kind,
    )


def adapter_activation_line(shape: ModelShape, step: StepShape, dtype: torch.dtype) -> MemoryLine:
    """What PEFT adapters add to a recomputed layer's backward (``ModelShape.adapter_*``, read
    from each method's adapter layers by hf/adapter_memory.py; every layer under PEFT is
    recomputed: a frozen layer cannot join the HBM tier), beside the working-set line, which
    counts the base's linears as trained.

    What they save for their gradients, alive through the layer's backward: per token, in the
    compute dtype and in fp32 (LoRA: each adapted linear's own cast of its input and its A
    output) and 1 B per dropout mask element (CUDA's fused dropout); per forward, the
    weight-sized tensors some methods make and save (a delta weight, a rotated weight: every
    adapted linear's). Then the larger of two moments: the MLP's backward, with the adapters'
    largest per-token temporary (a dropout's fp32 input gradient, DoRA's fp32 output gradients)
    and, where a method hands an MLP input projection's output back in fp32, the gated MLP's
    backward in fp32 (its 6 width-sized tensors at 4 B, not the compute dtype's); or the largest
    weight-sized temporary, in an adapted linear's recompute or its own backward (after the
    MLP's peak). And the adapters' compute-dtype weight copies (autocast's cache, alive through
    the forward and the loss).

    Measured on the CPU with the live-tensor tracker (tests/test_plan_accuracy.py; CUDA's
    dropout in place of the CPU's, which keeps an fp32 noise tensor instead of the mask): LoRA
    at three Llama shapes, with every linear or some adapted, ranks 8 to 128, with and without
    dropout, a layer's backward grows by this per token less 4h, or by less (a frozen base's
    linears keep no input for a weight gradient); every other method (all linears of a tiny
    Llama adapted, DoRA too, 1,024 and 2,048 tokens) a whole step at 0.78-0.98x its plan's lines
    that cover it; one adapted linear's saved tensors exactly these terms, its weight-sized
    temporaries within 1% (dev/adapter_memory_probe.py)."""
    t, isz = step.micro_batch_tokens, itemsize(dtype)
    elements, fp32 = shape.adapter_token_elements, shape.adapter_token_fp32
    masks, mlp = shape.adapter_token_masks, shape.adapter_fp32_mlp_width
    w_elements, w_fp32 = shape.adapter_weight_elements, shape.adapter_weight_fp32
    per_forward = isz * w_elements + 4 * w_fp32
    saved = t * (isz * elements + 4 * fp32 + masks) + per_forward
    widened = 6 * (4 - isz) if isz < 4 else 0  # (in fp32 runs the MLP is fp32 anyway)
    peak_elements, peak_fp32 = shape.adapter_token_peak
    token_peak = t * (isz * peak_elements + 4 * peak_fp32 + widened * mlp)
    weight_elements, weight_fp32 = shape.adapter_weight_peak
    weight_peak = isz * weight_elements + 4 * weight_fp32
    copies = 0 if dtype == torch.float32 else isz * shape.adapter_numel
    what = f"{isz} B x {elements}" + (f" + 4 B x {fp32}" if fp32 else "")
    what += f" + masks {masks}" if masks else ""
    if peak_elements or peak_fp32 or (widened and mlp):
        what += " + peak " + " + ".join(
            term
            for term, n in (
                (f"{isz} B x {peak_elements}", peak_elements),
                (f"4 B x {peak_fp32}", peak_fp32),
                (f"fp32 MLP {widened} B x {mlp}", widened * mlp),
            )
            if n
        )
    forward = f" + per forward {per_forward / 2**20:.1f} MiB" if per_forward else ""
    forward += (
        f" + or the largest weight-sized temporary {weight_peak / 2**20:.1f} MiB"
        if weight_peak > token_peak
        else ""
    )
    return estimate_line(
        f"PEFT adapters ({shape.adapter_methods or 'lora'}): {t} tokens x ({what}){forward}"
        + (" (estimate)" if dtype == torch.float32 else " + their weight copies (estimate)"),
        saved + max(token_peak, weight_peak) + copies,
        ADAPTER_KIND,
    )


def activation_lines(
    shape: ModelShape,
    step: StepShape,
    options: ResolvedOptions,
    dtype: torch.dtype,
    kept_layers: Sequence[int] = (),
    attention_layers: int = 0,
) -> list[MemoryLine]:
    """Per-micro-batch activation costs (micro-batches run one after another); the s x s
    tensors attention saves in ``kept_layers`` (the layers keeping their activations) too, and
    the attention outputs the last ``attention_layers`` recomputed layers keep."""
    isz = itemsize(dtype)
    t, h, v = step.micro_batch_tokens, shape.hidden_size, shape.vocab_size
    r = shape.residual_width  # (what a layer hands the next: h, or several streams of it)
    hid = "hidden" if r == h else f"{shape.residual_streams} x hidden"
    tile = mlp_tile(shape, options)  # (0 where the MLPs run untiled)
    lines = []
    b = options.boundary_bytes_per_element
    # Saved narrower than the fp32 residual stream: backward recomputes each layer from its
    # saved input cast back to fp32, one more tokens x hidden x 4 B tensor while it runs.
    cast_back = 4 if b < 4 else 0
    per_token = attention_output_bytes_per_token(shape, dtype)
    chain_layers = _chain_layers(shape, options)
    # A layer's backward working set (layers keeping activations: the earlier, summed
    # calibration, see the loss's lines), and where the layer keeps its attention output.
    shared = shares_input_casts(options, dtype)
    apart = kept_phases_apart(shape, step, options, kept_layers)
    kept = None
    if kept_layers:
        kind = KEPT_APART_KIND if apart else KEPT_ACTIVATIONS_KIND
        kept = kept_activations_line(shape, step, options, dtype, len(kept_layers), kind)
    work = working_set_line(shape, t, tile, not len(kept_layers), shared_casts=shared)
    joint = None
    if _joint_segment_peak(options, len(kept_layers)):
        work_kept, saving = _kept_output_working_set(shape, t, tile, work, shared_casts=shared)
        counts = chain_output_counts(shape, options, attention_layers, per_token, saving)
        joint = segment_peak(
            shape, options, attention_layers, chain_layers, per_token, saving, counts
        )
        work = work_kept if joint.last_keeps_output else work
    elif (
        not kept_layers
        and attention_layers >= shape.num_layers
        and _is_measured_peak(shape, t, tile)
    ):
        # Every layer keeps its attention output: whichever layer's backward peaks keeps its own.
        work, _ = _kept_output_working_set(shape, t, tile, work, shared_casts=shared)
    if joint is not None:
        lines += joint_peak_lines(joint, t, r, per_token)
    elif not options.offload_activations:
        lines.append(
            MemoryLine(
                f"boundary activations ({boundary_dtype_label(options)}): {t} tokens x {hid} x "
                f"{b} B x {saved_layers_label(shape, options)}",
                boundary_activation_bytes(shape, step, options),
                BOUNDARY_KIND,
            )
        )
        if cast_back:
            lines.append(
                MemoryLine(
                    "boundary activation of the recomputing layer cast back to fp32",
                    t * r * cast_back,
                    BOUNDARY_KIND,
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
                2 * t * r * b + t * r * cast_back,
                BOUNDARY_KIND,
            )
        )
    if shape.head_dim:
        # The rotary embedding's cos and sin for the micro-batch, in the dtype of the embedding
        # output (fp32: the non-layer parameters are fp32): one tensor pair (one per attention
        # layer type where the model makes several) that every layer saves by reference (never
        # offloaded), alive from the embedding to the last backward.
        width = shape.rope_table_elements or shape.head_dim
        what = (
            f"{width} channels of the layer types' tables"
            if shape.rope_table_elements
            else f"head_dim {shape.head_dim}"
        )
        lines.append(
            MemoryLine(
                f"RoPE cos/sin tables (fp32): {t} tokens x {what} x 2 x 4 B",
                t * width * 2 * 4,
                ROPE_KIND,
            )
        )
    if shape.carried_bytes_per_token:
        # Handed to the layers besides the residual stream (``ModelShape.carried_what``) and
        # saved by those that read them: never offloaded or chained, alive through the step.
        lines.append(
            estimate_line(
                f"{shape.carried_what}: {t} tokens x {shape.carried_bytes_per_token} B, saved "
                "through the step",
                t * shape.carried_bytes_per_token,
                CARRIED_KIND,
            )
        )
    if joint is None:
        cached_layers = segment_cache_layers(shape, options)
        what = f"up to {cached_layers} recomputed layer inputs"
    else:
        cached_layers = joint.cache_beyond_buffers
        what = f"{cached_layers} recomputed layer inputs beyond the two offload buffers"
    cached = cached_layers * t * r * 4
    if cached:
        lines.append(
            estimate_line(
                f"checkpoint segment backward: {what} (fp32, {t} tokens x {hid} x 4 B) cached",
                cached,
                SEGMENT_CACHE_KIND,
            )
        )
    # The attention outputs a segment chain keeps for its last layers' recompute
    # (``chain_attention_outputs``): alive from the chain to those layers' backward.
    if joint is None:
        if attention_layers:
            lines.append(attention_output_line(shape, step, dtype, attention_layers))
        chain_count, which = chain_layers, "up to "
    else:
        chain_count, which = joint.chain_outputs, "that segment's "
    chain_attention = chain_count * t * per_token
    if chain_attention:
        lines.append(
            MemoryLine(
                f"checkpoint segment backward: attention outputs of {which}{chain_count} chain "
                f"layers kept for their recompute ({t} tokens x {per_token} B each)",
                chain_attention,
                ATTENTION_OUTPUTS_KIND,
            )
        )
    lines.append(work)
    work_at = len(lines) - 1
    if 0 < tile < t and not shape.experts_per_token:
        weight_grads = tiled_weight_grad_line(shape, dtype)
        lines.append(weight_grads)
        work = MemoryLine(work.name, work.nbytes + weight_grads.nbytes, work.kind, work.error)
    # The hidden-state gradient a layer's backward takes in (fp32, from the layer above or the
    # loss) is alive when that backward starts, so the working set (a layer's growth above its
    # start) leaves it out. A middle layer's backward has the freed boundary of the layer above
    # to make up for it; the last layer's backward starts with every boundary alive (the CPU
    # tracker: 4h B per token over the plan for Llama-like families without this line,
    # tests/test_plan_accuracy.py). The joint segment peak (offloaded fp32 boundaries) is
    # checked on the whole step instead: on the CPU scale model of the H200's long rows its
    # lines are 12% above the live activations, this gradient among them
    # (dev/long_plan_probe.py; the H200 524,288-token row peaked 7% under its expected peak).
    incoming_grad = t * r * 4 if joint is None else 0
    if incoming_grad:
        lines.append(
            MemoryLine(
                f"hidden-state gradient a layer's backward takes in (fp32): {t} tokens x {hid} "
                "x 4 B",
                incoming_grad,
                BOUNDARY_KIND,
            )
        )
    # Their gradients, summed over the layers that read them while the layers' backward runs.
    carried_grad = t * shape.carried_grad_bytes_per_token
    if carried_grad:
        lines.append(
            estimate_line(
                f"gradients of the {shape.carried_what}: {t} tokens x "
                f"{shape.carried_grad_bytes_per_token} B, in the layers' backward",
                carried_grad,
                CARRIED_KIND,
            )
        )
    if shape.adapter_activations:
        lines.append(adapter_activation_line(shape, step, dtype))
    lines += attention_mask_lines(shape, step, dtype, kept_layers)
    if fused_loss_runs(shape, options):
        # The loss's phase ends before any layer's backward starts: at its peak a chunk's bf16
        # logits, their fp32 copy (log_softmax(dtype=float32) makes it from bf16 on CUDA too)
        # and the fp32 log-probabilities, 10 B per logit (12 soft-capped: Gemma's), measured on
        # the CPU (tests/test_plan_accuracy.py), and the fp32 hidden-state gradient it fills,
        # which the last layer's backward then takes in (its own line counts it there). The
        # GPU holds the larger of this phase and a layer's backward (its working set and the
        # segment's recomputed inputs), not both: where the working set is the measured peak
        # (untiled gated MLPs) or a tiled dense layer's with fused kernels, every layer
        # recomputed (on the H200, Qwen2.5-7B's layers with Liger's kernels at 65,536 and
        # 131,072 tokens, tiles, segments of 4, offload: the loss phase peaked 8 and 10 GiB
        # under the first layer backward, whose live blocks held no logit chunk;
        # dev/long_peak_probe.py; the fused kernels' tiled working set is 14% under its line,
        # tests/test_gpu.py). Untiled with Liger's kernels too: 62 H200 rows (Llama-3.1-8B,
        # Qwen2.5-7B and 14B at 65,536- and 131,072-token micro-batches) peaked 4.5-9.2% under
        # the summed plan and 0.7-3.5% under this one (plan_vs_measured.md). Elsewhere
        # (PyTorch's and the compiled kernels: Llama-3.1-8B's 64k rows with them peaked 1-2%
        # over this one; PyTorch's tiled working set measured 8% over its line and its 1M-token
        # 1.5B and 512k-token 3B runs needed the sum; MoE, non-gated MLPs; layers keeping
        # activations, whose backward has its own unmeasured temporaries; gradient
        # accumulation, whose head and embedding gradients outlive the micro-batch: a 2 x 64k
        # Liger row peaked 3% over this one) the sum keeps covering it, as before.
        chunk = loss_chunk_tokens(shape, step, options)
        per_logit = SOFTCAPPED_LOSS_BYTES_PER_LOGIT if shape.gemma_norms else LOSS_BYTES_PER_LOGIT
        head_copy = 0 if dtype == torch.float32 else v * h * isz
        hidden_grad = t * h * 4
        head_grad = 0 if shape.frozen_head else v * h * 4  # (a frozen head gets none)
        backward_phase = work.nbytes + cached + chain_attention + incoming_grad + carried_grad
        if loss_phase_apart(shape, step, options, len(kept_layers)):
            # The head's compute copy and the loss's fp32 weight gradient are gone by then too
            # (its live blocks at the first layer backward held neither; the parameter's own
            # gradient is the non-layer line's). The phase peaks either in the chunk loop
            # (chunk, head copy, the fp32 weight gradient it sums) or in the loss's backward
            # (the saved fp32 weight gradient and a scaled copy of the hidden-state gradient),
            # with the saved hidden-state gradient alive through both.
            forward_part = chunk * v * per_logit + head_copy + head_grad
            loss_phase = max(forward_part, head_grad + hidden_grad) + hidden_grad
            lines.append(
                MemoryLine(
                    f"fused loss phase (a {chunk}-token chunk x vocab x {per_logit} B, LM head "
                    f"copy, fp32 weight and hidden-state grads): {loss_phase / 2**30:.2f} GiB, "
                    "never alive with a layer's backward; the part beyond it",
                    max(0, loss_phase - backward_phase),
                    LOSS_KIND,
                )
            )
            embed_grad = embedding_grad_apart_bytes(shape, step, options, len(kept_layers))
            if embed_grad:
                # Made when backward reaches the embedding, after the last layer's: with it the
                # first layer's input gradient (fp32), nothing of a layer's backward.
                end_phase = embed_grad + hidden_grad
                lines.append(
                    MemoryLine(
                        f"embedding's fp32 gradient (made after the layers' backward): "
                        f"{embed_grad / 2**30:.2f} GiB + the input gradient, never alive with a "
                        "layer's backward; the part beyond it",
                        max(0, end_phase - backward_phase),
                        LOSS_KIND,
                    )
                )
            return lines + router_aux_loss_lines(shape, step, dtype)
        if work.kind == PEAK_WORKING_SET_KIND:
            loss_phase = chunk * v * per_logit + hidden_grad
            loss = MemoryLine(
                f"fused loss chunk ({chunk} tokens x vocab x {per_logit} B) + hidden-state grad "
                f"(fp32): {loss_phase / 2**30:.2f} GiB, never alive with a layer's backward; "
                "the part beyond it",
                max(0, loss_phase - backward_phase),
                LOSS_KIND,
            )
            head = MemoryLine(
                "LM head compute copy + fp32 weight grad", head_copy + head_grad, LOSS_KIND
            )
        else:
            loss = MemoryLine(
                f"fused loss chunk: {chunk} tokens x vocab fp32 logits + softmax grad",
                chunk * v * (4 + isz),
                LOSS_KIND,
            )
            # (The hidden-state gradient: its own line above where there is one.)
            head = MemoryLine(
                "LM head compute copy + fp32 weight grad"
                + ("" if incoming_grad else " + hidden-state grad"),
                head_copy + head_grad + (0 if incoming_grad else hidden_grad),
                LOSS_KIND,
            )
        lines += [loss, head]
        if kept is not None and apart:
            # The kept layers are the model's last: their backward (and the loss's before it)
            # ends before any recomputed layer's starts, and frees their saves. The GPU holds
            # the larger of that phase (the kept saves and the loss's lines or a kept layer's
            # MLP gradients) and a recomputed layer's backward (its measured peak), not both.
            loss_part = loss.nbytes + head.nbytes
            kept_backward = KEPT_BACKWARD_BYTES_PER_TOKEN_INTER * shape.intermediate_size * t
            if kept_backward > loss_part:
                lines.append(
                    MemoryLine(
                        f"a kept layer's backward: its MLP's gradients, {t} tokens x "
                        f"{KEPT_BACKWARD_BYTES_PER_TOKEN_INTER}i B, beyond the loss's lines",
                        kept_backward - loss_part,
                        LOSS_KIND,
                    )
                )
            first = kept.nbytes + max(loss_part, kept_backward)
            peak = working_set_line(shape, t, tile, shared_casts=shared)
            if len(kept_layers) == shape.num_layers:
                lines[work_at] = MemoryLine(
                    "one layer's backward working set: none, every layer keeps its activations",
                    0,
                    peak.kind,
                    peak.error,
                )
            else:
                lines[work_at] = MemoryLine(
                    f"{peak.name.removesuffix(')')}: {peak.nbytes / 2**30:.2f} GiB, never alive "
                    "with the kept layers' activations; the part beyond them and the loss's "
                    "lines)",
                    max(0, peak.nbytes - first),
                    peak.kind,
                    peak.error,
                )
    else:
        # The model's own forward materializes the logits and upcasts them for the loss (the
        # fused loss turned off, or not used: a LoRA-adapted or quantized head, a loss of the
        # user's): the compute-dtype logits, an fp32 copy and the fp32 log-probabilities, whose
        # gradient replaces them in backward (the matrix's unfused OLMoE rows: within the line).
        why = "the fused loss turned off" if shape.fused_loss else "no fused loss for this model"
        lines.append(
            estimate_line(
                f"full logits ({why}; estimate)",
                t * v * (isz + 4 + 4),
                FULL_LOGITS_KIND,
            )
        )
    if kept is not None:
        lines.append(kept)
    return lines + router_aux_loss_lines(shape, step, dtype)
