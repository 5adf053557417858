"""GPU long-run parity (issue 21): bf16 streamed training stays inside stock's own spread.

For three families (dense Llama; Gemma2 with soft-capped attention and logits and a sliding
window; Qwen3-MoE with the router aux loss in the loss), 150 steps on the bundled corpus from the
same initial weights, four runs: stock (batch 8), two stock rounding twins (the equivalent
batchings 4 x accum 2 and 2 x accum 4) and HFMegaTrainer (every layer streamed). With d(a, b) = loss(a) / loss(b) - 1 per step (``benchmarks/loss_curves.py``):

* the stock band: ``band_mean`` = max over the three pairs of stock runs of mean over all steps
  of |d|;
* the streamed deviation: ``dev_mean`` = mean over the three stock runs of streamed's mean |d|
  against each; it must stay within 1.5x the band;
* the drift: streamed's mean signed d over the last 15 steps, averaged over the three stock
  runs; it must stay within 2x ``band_tail``, the pairs' largest mean |d| over those steps.

Why two batchings, not one and stock repeated as before: where the GPU kernels are
deterministic the repeat is bitwise stock (Gemma-2's eager attention on the H200 at 246d4a7),
and the band was one pair, one draw of a chaotic spread.

Why the mean and every pair, not the max over steps of one twin vs stock as before: two runs
that differ only in rounding diverge chaotically, and a max over 150 steps of that divergence
is one excursion. The same code gave Llama 1.69x that max band on one H200 call and 0.99x on
the next (the tail's sign flipping between them). The mean over all steps averages the
step-to-step part of the noise, and every pair (band) and every stock run (deviation) uses each
run several times instead of once. On simulated curves (AR(1) divergence of growing amplitude,
unchanged code) the 90% range of the ratio narrows from 0.65-1.27x to 0.74-1.13x where the
divergence decorrelates within ~10 steps; where it is a slow walk (each run about one random
offset) it stays as wide as the max's, and only more stock runs would narrow it. A systematic
error still shows: a one-sided offset (the fused loss rounding differently from autocast, ~3x
the band by the max) moves every step, so it moves the mean, and averaging over the stock runs
does not shrink it. The old max-based numbers are printed too, for continuity with
docs/benchmarks.md.

Run with ``python3 -m pytest tests/test_gpu_parity.py -o addopts="" -q -s`` (skipped without
CUDA).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import loss_curves as lc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = 150
SEQ = 512  # 144 rows of the bundled corpus: ~8 epochs in 150 steps of 8 rows
BATCH = 8
TAIL = 15
# PyTorch's attention kernel, pinned for every run. The fused kernels' backward (cuDNN, flash,
# memory-efficient) does not repeat bitwise on the H200: at 9172470 stock run twice in one
# process first differed at step 9 and streamed at step 50, while with the math kernel both
# repeated over 150 steps (dev/repeat_probe.py, --sdpa-backend math). That noise is stock's as
# much as ours, but it is drawn anew in every run, so the ratio to the band moved between calls
# (Llama 0.51x, 1.69x, then two passes on unchanged code). With the math kernel every run is a
# fixed function of its code: the test then measures the engine's rounding against the
# batching twins', and a failure repeats.
SDPA = "math"
# Absolute floor on the limits. It only matters where the band comes out degenerate
# (batch-invariant kernels could make the stock runs nearly equal). The old floor, 1e-3 on a max
# over steps, becomes 2.5e-4 on a mean: the max of |d| runs ~4x its mean (3.6-4.7x between bf16
# stock twins on the CPU, 2.8-4x in simulation); 1e-3 would bind at the ~3e-4-8e-4 band_means
# that the measured max bands (1.1e-3-2.9e-3 for Llama) imply and loosen the limit.
FLOOR = 2.5e-4
BAND_ACCUMS = (2, 4)  # the twins: batch 4 x accum 2 and 2 x accum 4
DEV_FACTOR = 1.5
# The drift's factor is 2, not the deviation's 1.5, and its band is the pairs' tail mean |d|:
# neither band_mean (as before) nor a pair's |signed| tail mean. 15 adjacent steps of a chaotic
# divergence are strongly correlated (a stock twin's tail mean was 0.47x its max over steps on the
# first H200 measurement): a tail mean is about one sample, not 15. band_mean averages the early
# steps, before the runs have diverged, and understates the tail's spread (1.3-2x); a pair's
# signed tail mean is near 0 whenever its curves cross there. Simulated, unchanged code (the
# curves above) fails the drift check against band_mean in 20-47% of runs, against the largest
# |signed| pair in ~24%, 1.5x band_tail in 3-12%, 2x band_tail in 1-7%. 2x band_tail is on the
# scale of the old drift limit (0.6-1.3x the max band), so this is no loosening, and an offset
# over the whole run also fails dev_mean; the drift check is for one that only opens up late.
DRIFT_FACTOR = 2.0


def inside_band(p: lc.Parity) -> tuple[bool, bool]:
    """(deviation inside, drift inside): the test's two checks, apart so that the CPU tests can
    run them on made-up curves (tests/test_loss_curves.py)."""
    return (
        p.dev_mean <= max(DEV_FACTOR * p.band_mean, FLOOR),
        abs(p.drift) <= max(DRIFT_FACTOR * p.band_tail, FLOOR),
    )


# Gemma2 with its soft-capping applied (eager attention in every run) had been 7.30x the band
# on the H200 at c403b1d and 3.08x against three batching twins at 246d4a7. The cause was the
# residual-stream norm weights, bound as their bf16 copy with gradients rounded to bf16 where
# stock runs them in fp32; bound at their fp32 master values (engine.bind_exact) it was 0.98x
# (drift 0.92x), Llama 0.51x and Qwen3-MoE 0.44x on the H200 (2026-12-02).
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
def test_streamed_bf16_inside_stock_band(family, tmp_path):
    config = lc.build_config(family, "small", SEQ)
    losses = lc.run_all(
        config, lc.default_runs(BATCH, band_accums=BAND_ACCUMS), steps=STEPS, seq_len=SEQ,
        bf16=True, cpu=False, out_dir=tmp_path, sdpa=SDPA,
    )  # fmt: skip
    p = lc.parity(losses, lc.STREAMED, tail=TAIL)
    twins = (lc.REFERENCE, *(lc.band_run_name(k) for k in BAND_ACCUMS))
    assert p.twins == twins, p  # three pairs in the band
    # The old, max-based numbers: printed only, for continuity with docs/benchmarks.md.
    s = lc.summarize(losses, tail=TAIL)
    band_max = max(s[t]["max_rel"] for t in twins[1:])
    dev_max = s[lc.STREAMED]["max_rel"]
    ratio_max = dev_max / band_max if band_max > 0 else float("inf")
    twin_tails = ", ".join(f"{s[t]['tail_signed']:+.3e}" for t in twins[1:])
    msg = (
        f"{family}: streamed mean rel diff {p.dev_mean:.3e} = {p.ratio:.2f}x stock band_mean "
        f"{p.band_mean:.3e}; streamed drift over the last {TAIL} steps {p.drift:+.3e} = "
        f"{p.drift_ratio:.2f}x band_tail {p.band_tail:.3e} | max-based: streamed {dev_max:.3e} = "
        f"{ratio_max:.2f}x band {band_max:.3e}, tail vs stock {s[lc.STREAMED]['tail_signed']:+.3e} "
        f"(twins' {twin_tails}); "
        f"loss {losses['stock'][0]:.3f} -> {losses['stock'][-1]:.3f}"
    )
    print(msg)
    # The runs really trained (a stuck run would agree trivially).
    assert losses["stock"][-1] < losses["stock"][0] - 2.0, msg
    dev_ok, drift_ok = inside_band(p)
    assert dev_ok, msg
    assert drift_ok, msg


def test_streamed_bf16_repeats_bitwise(tmp_path):
    """The streamed run is a fixed function of its code once the attention kernel is: the
    streams, events and host threads add no nondeterminism of their own. A race between the
    host update, the weight prefetch and the gradient copies would show here as a first step
    that differs (at e90dc3c streamed ran apart at step 34 on the default kernel, and this
    case named the kernel, not the engine)."""
    config = lc.build_config("llama", "small", SEQ)
    runs = [lc.RunSpec(f"streamed-{tag}", True, BATCH) for tag in "ab"]
    losses = lc.run_all(
        config, runs, steps=STEPS, seq_len=SEQ, bf16=True, cpu=False, out_dir=tmp_path, sdpa=SDPA
    )
    a, b = losses["streamed-a"], losses["streamed-b"]
    first = lc.first_differing_step(a, b)
    assert len(a) == STEPS and first is None, f"the second run first differs at step {first}"
