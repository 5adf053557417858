"""CPU tests of benchmarks/loss_curves.py: a tiny fp32 run of every curve, its CSV and PNG."""

from __future__ import annotations

import csv
import importlib.util

import pytest

from benchmarks import loss_curves

HAS_MPL = importlib.util.find_spec("matplotlib") is not None
STEPS = 8


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("loss_curves")
    # lr 3e-3: the warm-up (10 steps) still moves the weights enough in 8 steps that rounding
    # differences between the batchings reach the loss.
    argv = ["--family", "llama", "--tiny", "--steps", str(STEPS), "--seq-len", "32", "--fp32",
            "--device", "cpu", "--lr", "3e-3", "--seed-run", "--out", str(out)]  # fmt: skip
    summary = loss_curves.main(argv if HAS_MPL else [*argv, "--no-plot"])
    return out, summary


def test_csv_has_every_run_and_step(tiny_run):
    out, summary = tiny_run
    with (out / "loss_curves.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    runs = ["stock", "stock-accum", "stock-seed", "streamed"]
    assert list(summary) == runs
    for run in runs:
        steps = [int(r["step"]) for r in rows if r["run"] == run]
        assert steps == list(range(1, STEPS + 1)), run
        assert all(float(r["loss"]) > 0 for r in rows if r["run"] == run)


def test_streamed_matches_stock_in_fp32_and_band_is_not_trivial(tiny_run):
    _, s = tiny_run
    # fp32, same CPU kernels: as tests/test_equivalence.py's assert_logs_match (rel 1e-5), the
    # only differences are the global-norm summation order and the fused clip scale.
    assert s["streamed"]["max_rel"] <= 1e-5, s
    # The band run sums the same rows' gradients in two micro-batches: different rounding, so it
    # must differ from stock (else the band the GPU test scales by would be degenerate), but only
    # at rounding level.
    assert 0 < s["stock-accum"]["max_rel"] <= 1e-5, s
    # Another data order is a different run: far outside rounding.
    assert s["stock-seed"]["max_rel"] > 1e-3, s
    assert s["stock"] == {"max_rel": 0.0, "tail_signed": 0.0}


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib not installed (pip install matplotlib)")
def test_png_written(tiny_run):
    out, _ = tiny_run
    png = out / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(HAS_MPL, reason="matplotlib is installed")
def test_missing_matplotlib_fails_before_training(tmp_path, capsys):
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        loss_curves.main(["--tiny", "--fp32", "--device", "cpu", "--out", str(tmp_path)])
    assert not (tmp_path / "loss_curves.csv").exists()


def test_summary_math():
    losses = {"stock": [2.0, 4.0], "stock-accum": [2.0, 4.4], "streamed": [1.0, 4.0]}
    s = loss_curves.summarize(losses, tail=1)
    assert s["stock-accum"]["max_rel"] == pytest.approx(0.1)
    assert s["stock-accum"]["tail_signed"] == pytest.approx(0.1)
    assert s["streamed"]["max_rel"] == pytest.approx(0.5)
    assert s["streamed"]["tail_signed"] == 0.0


def test_odd_batch_and_bf16_on_cpu_are_refused(tmp_path):
    with pytest.raises(ValueError, match="even"):
        loss_curves.default_runs(7)
    with pytest.raises(SystemExit, match="needs a GPU"):
        loss_curves.main(["--tiny", "--bf16", "--device", "cpu", "--no-plot"])
