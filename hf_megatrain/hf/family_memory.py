"""What each model family's layers hold in memory beyond the planner's shared lines, measured.

The plan's activation lines (``core/activation_memory.py``) count a Llama-like layer. Families
measured against them on the CPU trackers (tests/test_plan_accuracy.py,
tests/test_keep_activations.py) and on the H200 are marked here as audited, or carry their own
terms: fitted residuals per family, MoE and eager-attention specifics. ``hf/model.py`` reads them
into the ``ModelShape`` it builds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

#: Families whose kept-activation bytes the planner counts exactly (or, Phi-3, 2% high), checked
#: against autograd's saved tensors (tests/test_keep_activations.py); Gemma3 too, with its own
#: terms, unless Liger's kernels replace its layers'. Qwen3-MoE saves 25% more and Mixtral 11%
#: (router and expert dispatch, data-dependent): for those "auto" keeps none, as for the families
#: not measured or off the count (Gemma2, Cohere, Phi, GPT-J, ...; others are fitted below).
KEPT_BYTES_AUDITED_MODEL_TYPES = frozenset(
    {"llama", "qwen2", "qwen3", "mistral", "phi3", "granite", "smollm3", "seed_oss", "ernie4_5",
     "helium"}
)  # fmt: skip

#: Families whose kept layers' saved tensors differ from the shared count by a residual fitted
#: per family (``dev/family_working_set_fit.py --kept``; tests/test_keep_activations.py checks
#: them; 0: the count exactly), at eight widths (hidden 256-640, MLP 2-4x; the plan's count
#: equal to the saves or up to 0.3% above).
#: Fitted with autocast_kernels' shared input casts (the default; without them the count is
#: higher than the saves for these). With it their kept activations are planned exactly, so
#: "auto" keeps layers for them too; not under Liger's or the compiled kernels (their saves are
#: measured for the families above only). Not Cohere, GPT-J or Phi: their parallel attention
#: and MLP read one normed input, 2h per token more than the count without shared casts. (h, q,
#: kv, i, per token) B.
FITTED_KEPT_RESIDUALS: dict[str, tuple[float, float, float, float, int]] = {
    "apertus": (-1, -1, 0, 3, 0),
    "arcee": (-2, 0, 0, -4, 0),
    "exaone4": (0, 0, 0, 0, 0),
    "gemma": (0, 0, 0, 0, 0),
    "glm4": (10, 2, 0, 0, 8),
    "hunyuan_v1_dense": (0, 8, 8, 0, 48),
    "olmo": (-4, -4, 0, 0, 8),
    "olmo2": (3, 3, 2, 0, -16),
    # Non-gated MLPs, LayerNorm: they save less than the count (0.53-0.84x of it).
    "gpt_neox": (-4, -4, -4, -4, 8),
    "nemotron": (-10, 2, 0, -4, 8),
    "stablelm": (-3, -3, 0, 0, 8),
    "starcoder2": (-5, -5, 0, -4, 8),
}

#: Gemma 2-4 (3n, 4 unified): four fp32 norms per layer (and a GELU-tanh MLP), with working-set
#: terms of their own (``ModelShape.gemma_norms``).
GEMMA_NORM_MODEL_TYPES = frozenset(
    {"gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text"}
)

#: MoE families whose routed-experts working set the planner counts within 5% (the CPU
#: live-tensor tracker, tests/test_plan_accuracy.py; OLMoE's H200 cells 0.94-0.99x); the others
#: plan it with the dense line's larger error. Mixtral and GraniteMoE keep their routing weights
#: in fp32 (``MOE_FP32_ROUTING_MODEL_TYPES``: the weighted expert outputs and their gradients are
#: fp32, 8h more per token and chosen expert); Qwen2-MoE's shared expert is counted apart
#: (``ModelShape.shared_expert_size``).
MOE_WORKING_SET_AUDITED_MODEL_TYPES = frozenset(
    {"olmoe", "qwen3_moe", "mixtral", "granitemoe", "qwen2_moe"}
)
MOE_FP32_ROUTING_MODEL_TYPES = frozenset({"mixtral", "granitemoe"})
#: MoE families whose layers run every expert on every token, the router's scores zeroing the
#: unpicked ones' input (Llama 4 as transformers has it: the tokens repeated once per expert,
#: one batched matmul): their working set counts all experts, not the routed ones.
EVERY_EXPERT_MODEL_TYPES = frozenset({"llama4_text"})
#: Dense families whose recomputed layer's backward the working set's measured-peak line
#: (``activation_memory.GATED_MLP_PEAK_*``) is within 4% of (the CPU tracker; Phi-3 exactly on
#: the H200 too). Others measured off it (GLM-4 +44%, Hunyuan +24%, OLMo2 +17%; non-gated MLPs
#: and sliding-window families below or with s x s terms of their own) keep the earlier line.
#: LFM2's attention layers are within 1% of it (its MLP width is the module's, not the config's).
#: Ministral, Ministral 3, CWM and Cohere 2 hold what Llama's and Cohere's layers do (measured
#: 2026-12-06: on the earlier line their whole step was 1.31-1.33x its plan plus margin).
PEAK_WORKING_SET_AUDITED_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "smollm3", "cohere", "ernie4_5",
     "helium", "seed_oss", "gemma", "gemma3_text", "lfm2", "ministral", "ministral3", "cwm",
     "cohere2"}
)  # fmt: skip

#: Families whose eager attention keeps one more compute-dtype copy of its scores beside the fp32
#: softmax: BLOOM's and MPT's own ALiBi product (``baddbmm``), gpt-oss's scores concatenated with
#: its sinks. 14 B per element and head at the backward's peak where the eager line counts 12
#: (the CPU tracker, 4,096 tokens: BLOOM 1.14x, MPT 1.09x, gpt-oss 1.13x the plan without it).
#: GPT-J's eager attention as transformers 5.17 has it (no SDPA there) holds 1.5-1.6 B per
#: element more than the line: 1.09x the plan without it on the H200 at hidden 768 and 1,024
#: (16,384 tokens, CUDA allocator); newer transformers give GPT-J SDPA, where no eager line is
#: planned. CodeGen's and GPT-Neo's attention is GPT-J's there too (CodeGen has no SDPA in 5.17,
#: GPT-Neo none in 5.25): on the H100 at hidden 1,024 (2026-12-06, 16,384 tokens) CodeGen 1.05x
#: and GPT-Neo 1.09x the plan without the copy (0.89 and 1.47 B per element and head over it;
#: GPT-Neo 1.50 at hidden 768); where CodeGen's class has SDPA (5.25) and a user still asks for
#: eager, the copy plans high. XGLM's eager attention clamps its masked fp32 scores with
#: ``torch.max``, which saves them: one fp32 copy (1.21x the plan without it there, 3.63 B per
#: element and head over; 1.05x on the CPU tracker). (compute-dtype copies, fp32 copies).
EAGER_SCORE_COPIES: dict[str, tuple[int, int]] = {
    **{t: (1, 0) for t in ("bloom", "mpt", "gpt_oss", "gptj", "codegen", "gpt_neo")},
    "xglm": (0, 1),
    # Granite SWA's attention (eager only) holds 3.2 B per element and head more than the line
    # on the CPU tracker (its step 1.16x the plan at hidden 256 and 384, 2,048 tokens); an fp32
    # copy bounds it. Granite-MoE SWA runs the same attention: on the H100 (2026-12-07, hidden
    # 1,024, 16,384 tokens) 1.12x its plan without the copy, 0.93x with it (at hidden 768 too).
    "granite_swa": (0, 1),
    "granitemoe_swa": (0, 1),
    # GPT-NeoX Japanese's eager attention: BLOOM's baddbmm into a compute-dtype buffer (the H100
    # as above: 1.09x its plan without the copy, 0.79 of one over the line; 0.97-0.98x with it).
    "gpt_neox_japanese": (1, 0),
}

#: Per token, what a family's own decoder layer holds in its recomputed backward beyond the
#: working-set line's terms, from its widths (h hidden, q query, kv key/value, i MLP). Measured on
#: the CPU live-tensor tracker (``dev/family_plan_sweep.py``: three widths each, 2,048 tokens;
#: coefficients rounded up) and seen on the H200 at 16,384 tokens (GLM-4 1.16x the plan without
#: it at tiny widths, 1.7x at GLM-4-9B's by the fit):
#:
#: * GLM-4: its post-attention and post-MLP norms and the fused gate/up split: 28h + 4q + 4kv + 4i;
#: * LFM2 with short-convolution layers: 12h (its attention layers are the audited peak line's);
#: * Qwen3-Next's Gated DeltaNet layers under transformers' PyTorch fallback (no
#:   flash-linear-attention): 13 B per element of the key width (heads x dim) and 113 of the
#:   value width, per token (Qwen3-Next-80B's: 432 KiB per token, 16 GiB per 32k; fla's kernels
#:   hold less: planned high with them).
#: The other dense families whose layers the lines under-count, fitted by
#: ``dev/family_working_set_fit.py`` (the CPU allocation timeline, a recomputed middle layer's
#: backward per token, fitted at five widths with the MLP 3-6x the hidden size, as real models
#: have, and within 1.6% at a sixth with 2x; coefficients in quarter bytes, the constant the
#: largest residual; two held-out widths within 0.2%): a recomputed layer's
#: backward held 1.12-1.73x the working-set line (OLMo 2 and 3: 1.50x; Hunyuan: 1.73x; Apertus:
#: 1.66x; GPT-J: 1.37x; Phi: 1.36x), which at long context is more than the other lines' margin
#: covers. (h, q, kv, i, per token) B; never below 0.
FITTED_WORKING_SET_RESIDUALS: dict[str, tuple[float, float, float, float, int]] = {
    "apertus": (-4, -4, 2, 12, 40),
    "arcee": (-6, 0, 4, 4, 40),
    "exaone4": (5, 5, 2, 2, 36),
    "gptj": (-4.75, -4.75, -4.75, 8, 232),
    "hunyuan_v1_dense": (-6, 8, 12, 6, 88),
    "nemotron": (-14, 2, 4, 4, 48),
    "olmo": (-7, -7, 4, 6, 48),
    "olmo2": (8, 8, 6, 2, 4),
    "olmo3": (8, 8, 6, 2, 4),
    "phi": (-8, -8, 4, 8, 40),
    "stablelm": (-6, -6, 4, 6, 48),
    # Fitted 2026-12-06 (their whole step 1.12-2.54x its plan plus margin before): GLM's fused
    # gate/up split; BitNet's sub-norms and its weights' and activations' quantize-dequantize
    # copies; DiffLlama's two softmax maps per head and their difference; nanochat's ReLU^2 MLP;
    # GPT-2's and CodeGen's tanh-GELU MLPs (1.17x and 1.33x).
    "bitnet": (1, 1, 4, 24, 44),
    "codegen": (-6.75, -6.75, -6.75, 9.25, 1752),
    "diffllama": (-4, 12.25, 8, 6, -16),
    "glm": (-6, 2, 4, 6, 40),
    "gpt2": (-3.25, -3.25, -3.25, 8, -16),
    "nanochat": (-8, -8, 2, 4, 40),
    # Fitted 2026-12-07 for families added that day whose whole step the CPU tracker measured
    # over its plan plus margin (dev/family_plan_sweep.py at hidden 256, 2,048 tokens: Jais 2
    # 1.12x, Apertus 1.5 2.15x, Beam 1.65x, LFM3 1.37x, MiniMax 1.45x, Qwen3.5
    # 1.46x, OLMo Hybrid 1.55x). The fit's middle layer is a full-attention layer for Qwen3.5
    # and OLMo Hybrid (their Gated DeltaNet layers take Qwen3-Next's term, the larger one
    # counts) and a lightning-attention layer for MiniMax.
    "jais2": (-14, 0, 4, 4, 48),
    "apertus1p5_text": (-4, -4, 2, 24, 40),
    "beam": (6, 8, 6, 12, 6),
    "lfm3": (24, 0, 2, 2, 60),
    "minimax": (29, 53.25, -12, -6, 7124),
    "olmo_hybrid": (8, 8, 6, 2, 4),
    "qwen3_5_text": (-6, 8, 6, 6, 40),
    # HyperCLOVA X's norms after attention and MLP (its step 1.57x its plan at hidden 256 and
    # 384 before).
    "hyperclovax": (24, 0, 4, 2, 44),
}


def kept_bytes_audited(model_type: str, fused_kernels: bool) -> bool:
    """Whether the plan's kept-activation count is audited for ``model_type``'s layers, with
    Liger's or the compiled kernels (``fused_kernels``) running or not: the Llama family's
    either way; Gemma3's and the fitted families' under PyTorch's kernels only (the fused
    count is the Llama family's)."""
    if model_type in KEPT_BYTES_AUDITED_MODEL_TYPES:
        return True
    return model_type in ("gemma3_text", *FITTED_KEPT_RESIDUALS) and not fused_kernels


def fitted_bytes(row: tuple | None, h: int, q: int, kv: int, i: int) -> int:
    """A fitted residual row ``(ch, cq, ckv, ci, const)`` at these widths (0 without one)."""
    if row is None:
        return 0
    ch, cq, ckv, ci, const = row
    return math.ceil(ch * h + cq * q + ckv * kv + ci * i) + const


#: B per token and MLP element that a recomputed layer of these families (non-gated MLPs with
#: xIELU, ReLU-squared or tanh-GELU activations) held on the H200 beyond the CPU-fitted
#: residual: `dev/family_plan_sweep.py --device cuda --widths 1024,8,2,128,4096 --tokens 16384`
#: (2026-12-05) measured their whole step 1.41x (Apertus), 1.50x (Arcee), 1.49x (Nemotron) and
#: 1.64x (Phi) the plan; the excess per token over the MLP width, rounded up. CUDA autocast runs
#: pow, tanh, exp, expm1 and softplus in fp32 where the CPU's does not: Apertus's xIELU so ran in
#: fp32 on the GPU, and since its alphas are bound in fp32 (as stock's) on the CPU too, which
#: then holds 12 of its 13 (traced for Apertus only). nanochat's ReLU^2 (a pow): 1.34-1.37x its
#: plan on the H100 (2026-12-06, hidden 768 and 1,024, 8,192 and 16,384 tokens), 13.8 B per token
#: and MLP element more at both widths. GPT-2 and CodeGen run Phi's activation (``gelu_new``,
#: its pow in fp32): Phi's 15; with it GPT-2 was 0.79x its plan on the H100 (hidden 1,024).
#: Persimmon runs nanochat's ReLU^2 (``torch.square``, a pow) in the same non-gated MLP: 1.29x its
#: plan there without a term (7.6 B per token and MLP element over it, tree 421c99e; 0.78x with
#: it on another start, whose step measured 7% less), where the CPU tracker finds its plan
#: 1.06-1.28x above its layer; nanochat's measured 14 bounds it from above.
#: Jais 2's ReLU^2 (``relu2``, a pow) in its non-gated MLP: 1.31x its plan on the H100
#: (2026-12-07, hidden 1,024, 16,384 tokens) with its CPU-fitted row alone, 7.7 B per token and
#: MLP element over it; nanochat's 14 bounds it from above, as Persimmon's (0.82-0.84x with it,
#: hidden 768 and 1,024).
#: Families without a fitted residual take the term alone (``FAMILY_WORKING_SET_EXTRA``).
CUDA_ACTIVATION_EXTRA_PER_INTER: dict[str, int] = {"apertus": 13, "arcee": 11, "nemotron": 10,
                                                   "phi": 15, "nanochat": 14, "gpt2": 15,
                                                   "codegen": 15, "persimmon": 14,
                                                   "jais2": 14}  # fmt: skip


#: Gemma 3n's AltUp term (``FAMILY_WORKING_SET_EXTRA``) per stream element and token.
ALTUP_BYTES_PER_STREAM_ELEMENT = 34


def _fitted_residual(model_type: str) -> tuple[str, Callable[[Any, int, int, int, int], int]]:
    row = FITTED_WORKING_SET_RESIDUALS[model_type]
    cuda = CUDA_ACTIVATION_EXTRA_PER_INTER.get(model_type, 0)
    return (
        f"{model_type}'s own layer (measured)",
        lambda cfg, h, q, kv, i: max(0, fitted_bytes(row, h, q, kv, i)) + cuda * i,
    )


def _cuda_activation(model_type: str) -> tuple[str, Callable[[Any, int, int, int, int], int]]:
    per_inter = CUDA_ACTIVATION_EXTRA_PER_INTER[model_type]
    return (
        f"{model_type}'s MLP activation (fp32 under CUDA autocast)",
        lambda cfg, h, q, kv, i: per_inter * i,
    )


#: Families whose fitted residual is their layers' own (OLMo's norms after attention and MLP),
#: held by their Gated DeltaNet layers too: added to the DeltaNet term, not compared with it.
#: OLMo Hybrid's step on the CPU tracker: 1.15x its plan with the larger of the two.
_DELTANET_LAYER_RESIDUAL_MODEL_TYPES = frozenset({"olmo_hybrid"})


def _gated_deltanet(model_type: str) -> Callable[[Any, int, int, int, int], int]:
    """Qwen3-Next's Gated DeltaNet term where the model has such layers, or the family's fitted
    residual for its other layers where that is larger (the plan counts the largest layer)."""
    row = FITTED_WORKING_SET_RESIDUALS.get(model_type)
    both = model_type in _DELTANET_LAYER_RESIDUAL_MODEL_TYPES

    def term(cfg, h: int, q: int, kv: int, i: int) -> int:
        other = max(0, fitted_bytes(row, h, q, kv, i))
        if "linear_attention" not in (getattr(cfg, "layer_types", None) or ()):
            return other
        linear = (
            13 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
            + 113 * cfg.linear_num_value_heads * cfg.linear_value_head_dim
        )
        return linear + other if both else max(linear, other)

    return term


#: A Mamba-2 mixer's widths under each family's config names: (heads, head width, state,
#: groups, chunk).
_MAMBA2_NAMES = (
    ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_chunk_size"),
    ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "chunk_size"),
    ("num_heads", "head_dim", "state_size", "n_groups", "chunk_size"),
)
#: Families whose every layer holds a Mamba-2 mixer (Falcon-H1's beside its attention); the
#: others have one where ``layer_types`` says "linear_attention" or "mamba".
_EVERY_LAYER_SSM_MODEL_TYPES = frozenset({"mamba2", "falcon_h1", "mamba", "falcon_mamba"})
#: Mamba-1 mixers' (inner width, state) config names: Mamba's and Falcon Mamba's; Jamba's inner
#: width is ``mamba_expand`` x hidden.
_MAMBA1_NAMES = {"mamba": ("intermediate_size", "state_size"),
                 "falcon_mamba": ("intermediate_size", "state_size")}  # fmt: skip


def _has_ssm_layers(model_type: str, cfg) -> bool:
    if model_type in _EVERY_LAYER_SSM_MODEL_TYPES:
        return True
    kinds = list(getattr(cfg, "layer_types", None) or ())
    kinds += list(getattr(cfg, "layers_block_type", None) or ())
    return any(k in ("linear_attention", "mamba") for k in kinds)


def _mamba2_mixer(model_type: str) -> Callable[[Any, int, int, int, int], int]:
    """Per token, what a Mamba-2 mixer's chunked scan holds in its recomputed backward beyond
    the working-set line, under transformers' PyTorch implementation (no mamba-ssm kernels:
    planned high with them). ``dev/ssm_plan_fit.py`` (the CPU tracker, Bamba at eight mixer
    widths: hidden 256-512, heads of 16-64, state 32-128, 1-2 groups, chunks of 32-128) fitted
    12.1 B per chunk position and head (the scores, decay and masked products of each chunk),
    20.5 per head and state element (B and C repeated to every head), 28.6 per inner element,
    8.4 per group and state element and 5.5 per chunk-state element per token; rounded up,
    the term bounds every point (2-7% above). transformers before 5.25 (the GPU machine's 5.17)
    multiplied and summed in broadcast products instead of einsums, whose intermediates hold a
    chunk position x head x state (the scores' product) or a head x width x state (the states'
    output product) per token: the same fit there measured 7.7-7.9 B per element of the larger
    (15.7 per chunk position, head and state where the states' product is twice the size): 8
    per element of the larger, on top of the einsum term (the step 1.05-1.15x over the points;
    12.3x the plan without it on the H100 at hidden 1,024, 1,024 tokens)."""

    def term(cfg, h: int, q: int, kv: int, i: int) -> int:
        if not _has_ssm_layers(model_type, cfg):
            return 0
        fields = cfg.to_dict()
        names = next(n for n in _MAMBA2_NAMES if n[0] in fields and n[2] in fields)
        heads, width, state, groups, chunk = (int(getattr(cfg, n)) for n in names)
        inner = heads * width
        einsum = (13 * chunk * heads + 21 * heads * state + 29 * inner + 9 * groups * state
                  + math.ceil(6 * inner * state / chunk))  # fmt: skip
        if _einsum_chunk_scan():
            return einsum
        return einsum + 8 * max(chunk * heads * state, inner * state)

    return term


def _mamba1_mixer(model_type: str) -> Callable[[Any, int, int, int, int], int]:
    """Per token, Mamba-1's selective scan under transformers' PyTorch implementation (no
    mamba-ssm kernels): its discretized A and B and their products, inner width x state fp32
    each. ``dev/ssm_plan_fit.py`` (the CPU tracker, Mamba at eight widths: hidden 256-512, inner
    width 3x, state 4-16) fitted 30.0 B per inner and state element on top of the line (the same
    on transformers 5.17 and 5.25); the inner width's and hidden's terms came out negative (the
    line's MLP and attention, which a Mamba layer does not have), left out: an upper bound."""

    def term(cfg, h: int, q: int, kv: int, i: int) -> int:
        if not _has_ssm_layers(model_type, cfg):
            return 0
        if model_type in _MAMBA1_NAMES:
            inner_name, state_name = _MAMBA1_NAMES[model_type]
            inner, state = getattr(cfg, inner_name), getattr(cfg, state_name)
        else:  # Jamba
            inner, state = cfg.mamba_expand * cfg.hidden_size, cfg.mamba_d_state
        return 30 * int(inner) * int(state)

    return term


@functools.cache
def _einsum_chunk_scan() -> bool:
    """Whether the installed transformers' Mamba-2 chunk scan contracts with einsums (5.25 on)."""
    import transformers  # noqa: PLC0415
    from packaging.version import Version  # noqa: PLC0415

    return Version(transformers.__version__) >= Version("5.25")


FAMILY_WORKING_SET_EXTRA: dict[str, tuple[str, Callable[[Any, int, int, int, int], int]]] = {
    **{t: _fitted_residual(t) for t in FITTED_WORKING_SET_RESIDUALS},
    **{
        t: _cuda_activation(t)
        for t in CUDA_ACTIVATION_EXTRA_PER_INTER
        if t not in FITTED_WORKING_SET_RESIDUALS
    },
    "glm4": ("GLM-4's extra norms", lambda cfg, h, q, kv, i: 28 * h + 4 * q + 4 * kv + 4 * i),
    # Llama 4's MoE layers repeat each token once per expert and scale the copies by the router's
    # scores before the experts' batched matmul (their outputs summed back): per token, two
    # compute-dtype copies of the hidden state per expert beyond the experts' MLP width (counted
    # as ``EVERY_EXPERT_MODEL_TYPES``). The CPU tracker (2,048 tokens, hidden 256-384, 4-16
    # experts, MLP 2-4x hidden) measured the step 0.90-1.06x the plan without it, 1.6-2.0 B per
    # expert and hidden element over it at 16 experts; 4 B bounds both copies in bf16.
    "llama4_text": (
        "Llama 4's per-expert copies of the tokens",
        lambda cfg, h, q, kv, i: 4 * h * int(getattr(cfg, "num_local_experts", 0) or 0),
    ),
    # MiniCPM3's latent attention (its q/k heads 1.5x its value heads, the low-rank q and kv
    # projections and their norms, the per-head k built from the shared RoPE part) and scaled
    # residuals: measured on the H100 (2026-12-06, dev/family_plan_sweep.py --device cuda, hidden
    # 768 and 1,024 with 6 and 8 heads of value width 128, 8,192 and 16,384 tokens) 34.1 and
    # 44.3 kB per token over the line (its step 1.11-1.18x the plan); rounded up.
    # Youtu's dense latent-attention layers are MiniCPM3's: the CPU tracker measured the same
    # bytes for both at hidden 256 (234.14 MB, 2,048 tokens; the other latent-attention families,
    # DeepSeek-V3's MoE layers, read 2.4x their plan there and 0.86x on the H200).
    **{
        t: (
            "MiniCPM3's latent attention",
            lambda cfg, h, q, kv, i: (
                40 * cfg.num_attention_heads * cfg.v_head_dim + 8 * cfg.kv_lora_rank
            ),
        )
        for t in ("minicpm3", "youtu")
    },
    # AltUp's predictions and corrections of its 4 hidden-state streams (and the model's
    # projections into and out of them), fitted on the CPU tracker (dev/carried_plan_fit.py
    # --gemma3n): bytes per stream element.
    "gemma3n_text": (
        "Gemma 3n's AltUp streams",
        lambda cfg, h, q, kv, i: ALTUP_BYTES_PER_STREAM_ELEMENT * cfg.altup_num_inputs * h,
    ),
    "lfm2": (
        "LFM2's short-convolution layers",
        lambda cfg, h, q, kv, i: (
            12 * h if "conv" in (getattr(cfg, "layer_types", None) or ()) else 0
        ),
    ),
    # Qwen3.5's, OLMo Hybrid's and Lara mini's Gated DeltaNet are Qwen3-Next's (the same
    # recurrence and convolution; their q/k/v/z projections split, not fused).
    **{
        t: ("the Gated DeltaNet layers (PyTorch fallback)", _gated_deltanet(t))
        for t in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini")
    },
    **{
        t: ("the Mamba-2 layers (PyTorch fallback)", _mamba2_mixer(t))
        for t in ("mamba2", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1")
    },
    **{
        t: ("the Mamba layers' selective scan (PyTorch fallback)", _mamba1_mixer(t))
        for t in ("mamba", "falcon_mamba", "jamba")
    },
}


#: Per element of Gemma 4's per-layer inputs (tokens x layers x ``hidden_size_per_layer_input``,
#: fp32: the resident embedding's output promotes their sum), bytes alive through the step: the
#: inputs themselves (each layer saves its slice, a view that holds them all) and the fp32 input
#: and normed output its prelude's RMSNorm saves; and bytes in the layers' backward: the
#: gradient summing the layers' slices and the one a layer's slice gradient is copied into
#: before it is added. Measured on the CPU tracker (dev/carried_plan_fit.py).
PER_LAYER_INPUT_SAVED_BYTES = 12
PER_LAYER_INPUT_GRAD_BYTES = 10
#: Per element of the keys and values layers store for later layers to reuse: up to fp32 (a key
#: after RoPE is, in bf16 training), held from the storing layer's forward to its backward, and
#: their gradient summed over the layers that read them plus the one a reading layer adds.
SHARED_KV_SAVED_BYTES = 8
SHARED_KV_GRAD_BYTES = 8


def carried_tensor_bytes(text_cfg: Any, layers: Any) -> tuple[int, int, str]:
    """Bytes per token the model's forward hands its layers besides the residual stream, alive
    through the step and in the layers' backward (``ModelShape.carried_bytes_per_token``,
    ``carried_grad_bytes_per_token``), and what they are: Gemma 4's per-layer inputs, and the
    keys and values the storing layers of a model whose later layers reuse them hand on
    (their widths read from the storing layers' key projections)."""
    saved = grad = 0
    what = []
    per_layer = int(getattr(text_cfg, "hidden_size_per_layer_input", 0) or 0)
    if per_layer:
        elements = per_layer * len(layers)
        saved += PER_LAYER_INPUT_SAVED_BYTES * elements
        grad += PER_LAYER_INPUT_GRAD_BYTES * elements
        what.append(f"per-layer inputs ({len(layers)} x {per_layer})")
    attentions = [getattr(layer, "self_attn", None) for layer in layers]
    if any(getattr(a, "is_kv_shared_layer", False) for a in attentions):
        width = sum(
            2 * a.k_proj.out_features
            for a in attentions
            if getattr(a, "store_full_length_kv", False) and hasattr(a, "k_proj")
        )
        saved += SHARED_KV_SAVED_BYTES * width
        grad += SHARED_KV_GRAD_BYTES * width
        what.append(f"shared keys and values ({width} channels)")
    return saved, grad, " and ".join(what)
