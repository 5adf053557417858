"""GPU long-run parity (issue 21): bf16 streamed training stays inside stock's own spread.

For three families (dense Llama; Gemma2 with soft-capped attention and logits and a sliding
window; Qwen3-MoE with the router aux loss in the loss), 150 steps on the bundled corpus from the
same initial weights:

* the stock band: max over steps of |loss(other) / loss(stock, batch 8) - 1| for two other stock
  runs that differ from it only in rounding (batch 4 x accum 2, and the same run again: GPU
  kernels are not deterministic), measured in the same test on the same GPU. One such run alone
  is a noisy band: the same stock code gave Gemma2 bands of 1.3e-2 and 3.5e-3 on two calls;
* the streamed deviation: the same measure for HFMegaTrainer (every layer streamed) vs stock.

The streamed deviation must stay within 1.5x the band, and the mean signed difference over the
last 15 steps within the band (no one-sided drift). Run with
``python3 -m pytest tests/test_gpu_parity.py -o addopts="" -q -s`` (skipped without CUDA).
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
# Absolute floor on the limits: bf16 resolves 2^-8 relative; a loss difference under 1e-3 is
# below a quarter of that. It only matters where the band comes out degenerate (batch-invariant
# kernels would make the two stock runs equal), not at the ~5e-3 bands measured (issue 21).
FLOOR = 1e-3


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
def test_streamed_bf16_inside_stock_band(family, tmp_path):
    config = lc.build_config(family, "small", SEQ)
    losses = lc.run_all(
        config, lc.default_runs(BATCH, repeat_stock=True), steps=STEPS, seq_len=SEQ, bf16=True, cpu=False,
        out_dir=tmp_path,
    )  # fmt: skip
    s = lc.summarize(losses, tail=TAIL)
    band = max(s[lc.BAND_RUN]["max_rel"], s["stock-repeat"]["max_rel"])
    dev = s[lc.STREAMED]["max_rel"]
    drift = s[lc.STREAMED]["tail_signed"]
    ratio = dev / band if band > 0 else float("inf")
    msg = (
        f"{family}: streamed max rel diff {dev:.3e} = {ratio:.2f}x stock band {band:.3e}; "
        f"streamed mean signed diff over the last {TAIL} steps {drift:+.3e} "
        f"(stock-accum's {s[lc.BAND_RUN]['tail_signed']:+.3e}); "
        f"loss {losses['stock'][0]:.3f} -> {losses['stock'][-1]:.3f}"
    )
    print(msg)
    # The runs really trained (a stuck run would agree trivially).
    assert losses["stock"][-1] < losses["stock"][0] - 2.0, msg
    assert dev <= max(1.5 * band, FLOOR), msg
    assert abs(drift) <= max(band, FLOOR), msg
