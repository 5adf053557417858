"""The memory plan's attention terms measured on the CPU: the s x s masks transformers makes,
eager attention's scores, and the per-head q/k norms' part of the recompute working set.

A live-tensor tracker (every storage an op makes, until it is freed) runs a tiny streamed model's
forward and backward under bf16 autocast, as the engine trains on a GPU; these tensors come from
ordinary PyTorch ops (matmul, softmax, where, norms), the same allocations on either device.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM

from hf_megatrain.core.activation_memory import (
    EAGER_SCORE_BYTES,
    EAGER_SCORE_BYTES_CPU,
    EAGER_SCORES_KIND,
    ESTIMATE_ERRORS,
    MASK_KIND,
    attention_mask_lines,
)
from hf_megatrain.core.options import EngineOptions, StepShape
from hf_megatrain.core.planner import GIB, plan_memory
from hf_megatrain.hf.model import model_shape, model_shape_from_config, prepare_streamed_model

from .helpers import fast_bf16_gemm

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
BF16 = torch.bfloat16
#: Widths of the measured layers: none of them equal to a sequence length below, so a tensor
#: whose last two dimensions are (s, s) is an attention one.
WIDTHS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=2)  # fmt: skip


class LiveTensors(TorchDispatchMode):
    """Bytes of the live storages ops have made (all, and those shaped (..., s, s)) and peaks."""

    def __init__(self, seq: int, fast_gemm: bool = True) -> None:
        super().__init__()
        self.seq, self.live, self.square = seq, {}, set()
        # False: real kernels (``fast_bf16_gemm``'s fp32 operands would count as scratch).
        self.fast_gemm = fast_gemm
        self.cur = self.peak = self.square_cur = self.square_peak = 0

    def _free(self, key: int) -> None:
        n = self.live.pop(key)
        self.cur -= n
        if key in self.square:
            self.square.discard(key)
            self.square_cur -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # (The same allocations, faster.)
        out = fast_bf16_gemm(func, args, kwargs) if self.fast_gemm else func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            key = id(st)  # (storages keep their Python object while alive)
            if key in self.live or not st.nbytes():
                continue
            self.live[key] = st.nbytes()
            self.cur += st.nbytes()
            if t.dim() >= 2 and tuple(t.shape[-2:]) == (self.seq, self.seq):
                self.square.add(key)
                self.square_cur += st.nbytes()
            weakref.finalize(st, self._free, key)
            self.peak = max(self.peak, self.cur)
            self.square_peak = max(self.square_peak, self.square_cur)
        return out

    def reset_peaks(self) -> None:
        self.peak, self.square_peak = self.cur, self.square_cur


def _run(model, seq: int, seqs: int) -> dict[str, int]:
    """One streamed forward and backward; the s x s bytes alive when backward starts (the masks)
    and their peak in backward, the peak of all bytes above what backward started with."""
    ids = torch.randint(0, model.config.vocab_size, (seqs, seq))
    live = LiveTensors(seq)
    with live:
        with torch.autocast("cpu", dtype=BF16):
            out = model.model(input_ids=ids).last_hidden_state
        grad = torch.ones_like(out)
        start, masks = live.cur, live.square_cur
        live.reset_peaks()
        out.backward(grad)
    return dict(masks=masks, square_peak=live.square_peak, backward=live.peak - start)


def _streamed(cfg, attn: str, **options):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.config._attn_implementation = attn
    shape = model_shape(model)
    prepare_streamed_model(
        model, "cpu", BF16, keep_activations="off", keep_attention_outputs="off", **options
    )
    return model.train(), shape


def _config(family: str, **overrides):
    """A tiny fp32 config (its own: ``tiny_config`` fixes these families' head and window
    sizes)."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen3Config  # noqa: PLC0415

    base = dict(WIDTHS, vocab_size=128, max_position_embeddings=4096, **overrides)
    if family == "gemma2":  # soft-capped eager attention, a sliding and a full layer
        return Gemma2Config(**base, head_dim=16, query_pre_attn_scalar=16, sliding_window=128)
    if family == "mistral":  # every layer slides: SDPA gets a mask from the window on
        return MistralConfig(**base, sliding_window=128)
    if family == "qwen3":
        return Qwen3Config(**base, head_dim=base["hidden_size"] // base["num_attention_heads"])
    return LlamaConfig(**base)


#: The counted tensors are exactly the measured ones at these shapes (bitwise the same bytes).
#: The tolerance is the lines' own error (``ESTIMATE_ERRORS``, 2%): the plan's slack covers that
#: much, so a measurement within it is covered; a change in what transformers makes is not.
TOLERANCE = ESTIMATE_ERRORS[EAGER_SCORES_KIND]


@pytest.mark.parametrize("seq", [256, 512])
@pytest.mark.parametrize(
    "family, attn",
    [("llama", "eager"), ("gemma2", "eager"), ("mistral", "sdpa")],
    ids=["llama-eager", "gemma2-eager-softcap", "mistral-sdpa-window"],
)
def test_attention_lines_match_what_transformers_makes(family, attn, seq):
    """Eager attention: the fp32 masks (one per kind of layer, per sequence) alive from forward
    to backward, and one layer's scores/probabilities at its backward's peak (12 B per element
    and head, 14 soft-capped, on the CPU; the plan counts CUDA's 4 B more). SDPA with a window
    shorter than the sequence: a bool s x s mask and one layer's additive copy of it in bf16 per
    sequence."""
    seqs = 2
    model, shape = _streamed(_config(family), attn)
    assert shape.attn_implementation == attn
    step = StepShape(seq_len=seq, micro_batch_tokens=seqs * seq)
    lines = attention_mask_lines(shape, step, BF16)
    planned = {
        kind: sum(ln.nbytes for ln in lines if ln.kind == kind)
        for kind in (MASK_KIND, EAGER_SCORES_KIND)
    }
    got = _run(model, seq, seqs)
    if attn == "eager":
        masks = 2 if family == "gemma2" else 1
        assert planned[MASK_KIND] == masks * seqs * seq * seq * 4
        assert got["masks"] == pytest.approx(planned[MASK_KIND], rel=TOLERANCE)
        scores = got["square_peak"] - got["masks"]
        # The plan counts CUDA's 4 B more per element than the CPU makes (EAGER_SCORE_BYTES).
        cuda_extra = (
            seqs * shape.num_heads * seq * seq * (EAGER_SCORE_BYTES - EAGER_SCORE_BYTES_CPU)
        )
        cpu_planned = planned[EAGER_SCORES_KIND] - cuda_extra
        assert scores == pytest.approx(cpu_planned, rel=TOLERANCE)
        per = 14 if family == "gemma2" else 12
        assert cpu_planned == seqs * shape.num_heads * seq * seq * per
    else:
        (persistent, per_layer) = (ln.nbytes for ln in lines)
        assert got["masks"] == pytest.approx(persistent, rel=TOLERANCE)
        assert got["square_peak"] - got["masks"] == pytest.approx(per_layer, rel=TOLERANCE)
        assert (persistent, per_layer) == (seq * seq, seqs * seq * seq * 2)


def test_sdpa_makes_no_mask_below_the_window_or_without_one():
    """SDPA attends with ``is_causal`` (no s x s tensor) when the sequence is shorter than the
    window, and for full attention: the plan counts nothing then."""
    for family, seq in (("mistral", 96), ("llama", 256)):
        model, shape = _streamed(_config(family), "sdpa")
        assert attention_mask_lines(shape, StepShape(seq, 2 * seq), BF16) == []
        got = _run(model, seq, 2)
        assert got["masks"] == got["square_peak"] == 0


@pytest.mark.parametrize("tiles", [0, 128], ids=["untiled", "mlp-tiles"])
def test_qk_norm_working_set_term_is_measured(tiles):
    """Per-head q/k norms (Qwen3) add 6q + 6kv + 4 B per head to the recompute working set, per
    token: the plan's Qwen3 working set minus its Llama one (same widths, q = h as in Qwen3-8B)
    against the measured backward peaks' difference, per token of two lengths (so the terms that
    do not grow with the sequence cancel). Exact on the CPU; 2% tolerance as above. The plan adds
    2q + 2kv for the norms' fp32 outputs besides: the forward's peak, not this backward's
    (tests/test_plan_accuracy.py measures that)."""
    from hf_megatrain.core.activation_memory import (  # noqa: PLC0415
        QK_NORM_FP32_OUTPUT_BYTES_PER_TOKEN,
        working_set_line,
    )

    widths = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1)
    measured, planned = {}, {}
    for family in ("llama", "qwen3"):
        peaks = []
        for tokens in (1024, 2048):
            model, shape = _streamed(_config(family, **widths), "sdpa", mlp_tile_tokens=tiles)
            peaks.append(_run(model, tokens, 1)["backward"])
        measured[family] = (peaks[1] - peaks[0]) / 1024
        planned[family] = (
            working_set_line(shape, 2048, tiles).nbytes
            - working_set_line(shape, 1024, tiles).nbytes
        ) / 1024
    q, kv = 256, 128
    fp32_outputs = QK_NORM_FP32_OUTPUT_BYTES_PER_TOKEN * (q + kv)
    assert planned["qwen3"] - planned["llama"] == 6 * q + 6 * kv + 4 * (4 + 2) + fp32_outputs
    assert measured["qwen3"] - measured["llama"] == pytest.approx(
        planned["qwen3"] - planned["llama"] - fp32_outputs, rel=TOLERANCE
    )


def test_gemma2_eager_at_131072_tokens_does_not_fit_and_says_why():
    """Gemma-2-2B runs eager attention (its default, for the logit soft-capping): at one
    131,072-token sequence every layer's scores alone are 8 heads x 131072^2 x 14 B (1.75 TiB)
    and its two fp32 masks 128 GiB. The plan refuses it, and says that only another attention
    implementation (or a shorter sequence) helps; with flash attention those lines go."""
    from transformers import AutoConfig  # noqa: PLC0415

    shape = model_shape_from_config(AutoConfig.from_pretrained(CONFIGS / "gemma-2-2b"), "g2")
    assert shape.attn_implementation == "eager" and shape.attn_softcapping
    step = StepShape(seq_len=131072, micro_batch_tokens=131072)
    options = EngineOptions(keep_activations="off").resolve(clipping=True, cuda=True)
    plan = plan_memory(shape, step, options, BF16, 139 * GIB, 1 << 50)
    assert not plan.fits
    eager = next(ln for ln in plan.gpu_lines if ln.kind == EAGER_SCORES_KIND)
    assert eager.nbytes == 8 * 131072**2 * (EAGER_SCORE_BYTES + 2)
    assert next(ln for ln in plan.gpu_lines if ln.kind == MASK_KIND).nbytes == 128 * GIB
    msg = str(plan.problems[0])
    assert "largest item: eager attention of one layer" in msg
    assert "only another attention implementation, 'flash_attention_2' or 'flex_attention'" in msg
    flash = replace(shape, attn_implementation="flash_attention_2", sdpa_attention=False)
    lines = plan_memory(flash, step, options, BF16, 139 * GIB, 1 << 50).gpu_lines
    assert not [ln for ln in lines if ln.kind in (EAGER_SCORES_KIND, MASK_KIND)]


def test_a_sliding_mask_made_for_no_layer_is_planned_per_attention():
    """Qwen2-MoE's forward makes a sliding-window mask though no layer slides: under SDPA a bool
    s x s and its two temporaries (3 B per element, measured), under eager one more fp32 mask
    beside the full one; Qwen2 (dense) makes it only for sliding layers: neither."""
    from tests.helpers import tiny_config  # noqa: PLC0415

    s = 2048
    step = StepShape(seq_len=s, micro_batch_tokens=s)
    moe = model_shape_from_config(tiny_config("qwen2_moe"))
    assert moe.unused_window_mask_from == 0 and moe.sliding_window == 0
    sdpa = attention_mask_lines(moe, step, BF16)
    assert [ln.nbytes for ln in sdpa] == [3 * s * s]
    eager = attention_mask_lines(replace(moe, attn_implementation="eager"), step, BF16)
    assert sum(ln.nbytes for ln in eager if ln.kind == MASK_KIND) == 2 * s * s * 4
    dense = model_shape_from_config(tiny_config("qwen2"))
    assert dense.unused_window_mask_from == -1 and not attention_mask_lines(dense, step, BF16)


@pytest.mark.parametrize("seqs", [1, 2])
@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_sparse_attention_indexer_line_covers_what_it_makes(dtype, seqs):
    """DeepSeek-V3.2's indexer scores every query against every key per indexer head (under
    no_grad, in the compute dtype: autocast runs its fp32 products in bf16) in each layer's
    forward. Its peak: for more than one sequence, the key broadcast to every query (head_dim
    elements per s x s element) beside the heads' scores, or two copies of those (one
    sequence's ``matmul`` folds its batch dimension: no broadcast copy; planned with it, the
    DeepSeek-V3.2 of dev/family_plan_sweep.py at hidden 256 was 0.35x its plan). Fitted over
    two lengths (the queries' and keys' own per-token bytes apart), its s x s part is the
    plan's count on the CPU; the line, which adds the layer's bool masks made after it, covers
    the whole peak."""
    from hf_megatrain.core.activation_memory import (  # noqa: PLC0415
        INDEXER_KIND,
        INDEXER_MASK_BYTES,
        indexer_elements_per_score,
    )

    from .helpers import tiny_config  # noqa: PLC0415

    cfg = tiny_config("deepseek_v32")
    cfg.max_position_embeddings = 4096
    cfg.index_head_dim = 16  # (its broadcast key, 16 per s x s element, apart from 2 x 2 heads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    shape = model_shape(model)
    assert (shape.indexer_heads, shape.indexer_head_dim) == (cfg.index_n_heads, cfg.index_head_dim)
    assert shape.sdpa_explicit_mask
    live, peaks, starts = None, [], []

    def enter(module, args):
        live.reset_peaks()
        starts.append(live.cur)

    def leave(module, args, out):
        peaks.append(live.peak - starts.pop())

    for layer in model.model.layers:
        layer.self_attn.indexer.register_forward_pre_hook(enter)
        layer.self_attn.indexer.register_forward_hook(leave)
    measured = {}
    for seq in (256, 512):
        step = StepShape(seq_len=seq, micro_batch_tokens=seqs * seq)
        lines = attention_mask_lines(shape, step, dtype)
        (planned,) = (ln.nbytes for ln in lines if ln.kind == INDEXER_KIND)
        peaks.clear()
        live = LiveTensors(seq, fast_gemm=False)
        ids = torch.randint(0, cfg.vocab_size, (seqs, seq))
        with live, torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=dtype == BF16):
            model.model(input_ids=ids)
        assert len(peaks) == cfg.num_hidden_layers
        measured[seq] = max(peaks)
        assert measured[seq] <= planned
    # peak = a s^2 + b s per sequence: a from the two lengths.
    per_score = (measured[512] / 512 - measured[256] / 256) / (512 - 256) / seqs
    # The scores' elements, and at most the line's bool bytes more (one sequence, two heads:
    # the negated bool mask beside the scores while ``masked_fill`` runs, 1 B).
    expected = indexer_elements_per_score(shape, seqs) * dtype.itemsize
    assert expected * (1 - ESTIMATE_ERRORS[INDEXER_KIND]) <= per_score
    assert per_score <= expected + INDEXER_MASK_BYTES
