"""CPU tests of benchmarks/loss_curves.py: a tiny fp32 run of every curve, its CSV and PNG; the
parity statistics (and tests/test_gpu_parity.py's checks) on made-up curves."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io

import pytest

from benchmarks import loss_curves
from tests.test_gpu_parity import FLOOR, inside_band

HAS_MPL = importlib.util.find_spec("matplotlib") is not None
STEPS = 8


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("loss_curves")
    # lr 3e-3: the warm-up (10 steps) still moves the weights enough in 8 steps that rounding
    # differences between the batchings reach the loss.
    argv = ["--family", "llama", "--tiny", "--steps", str(STEPS), "--seq-len", "32", "--fp32",
            "--device", "cpu", "--lr", "3e-3", "--seed-run", "--out", str(out)]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = loss_curves.main(argv if HAS_MPL else [*argv, "--no-plot"])
    print(printed.getvalue())
    return out, summary, printed.getvalue()


def test_csv_has_every_run_and_step(tiny_run):
    out, summary, _ = tiny_run
    with (out / "loss_curves.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    runs = ["stock", "stock-accum", "stock-accum4", "stock-seed", "streamed"]
    assert list(summary) == runs
    for run in runs:
        steps = [int(r["step"]) for r in rows if r["run"] == run]
        assert steps == list(range(1, STEPS + 1)), run
        assert all(float(r["loss"]) > 0 for r in rows if r["run"] == run)


def test_streamed_matches_stock_in_fp32_and_band_is_not_trivial(tiny_run):
    _, s, _ = tiny_run
    # fp32, same CPU kernels: as tests/test_equivalence.py's assert_logs_match (rel 1e-5), the
    # only differences are the global-norm summation order and the fused clip scale.
    assert s["streamed"]["max_rel"] <= 1e-5, s
    # The band run sums the same rows' gradients in two micro-batches: different rounding, so it
    # must differ from stock (else the band the GPU test scales by would be degenerate), but only
    # at rounding level.
    assert 0 < s["stock-accum"]["max_rel"] <= 1e-5, s
    assert 0 < s["stock-accum4"]["max_rel"] <= 1e-5, s
    # Another data order is a different run: far outside rounding.
    assert s["stock-seed"]["max_rel"] > 1e-3, s
    assert s["stock"] == {"max_rel": 0.0, "tail_signed": 0.0}


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib not installed (pip install matplotlib)")
def test_png_written(tiny_run):
    out, _, _ = tiny_run
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


def test_parity_of_the_tiny_run_from_its_csv(tiny_run):
    out, _, printed = tiny_run
    losses: dict[str, list[float]] = {}
    with (out / "loss_curves.csv").open(newline="") as f:
        for r in csv.DictReader(f):
            losses.setdefault(r["run"], []).append(float(r["loss"]))
    p = loss_curves.parity(losses)
    # The two equivalent batchings and stock (no stock-repeat: CPU kernels are deterministic);
    # stock-seed is not a twin.
    assert p.twins == ("stock", "stock-accum", "stock-accum4")
    assert p.tail == 1  # 10% of 8 steps, rounded up
    assert 0 < p.band_mean <= 1e-5 and p.dev_mean <= 1e-5, p
    assert "band_mean=" in printed and "stock-seed not in the band" in printed, printed
    (streamed,) = [line for line in printed.splitlines() if line.strip().startswith("streamed")]
    assert "dev_mean=" in streamed and "drift=" in streamed, printed
    (seed,) = [line for line in printed.splitlines() if line.strip().startswith("stock-seed")]
    assert "dev_mean=" not in seed, printed


# Made-up curves: a falling loss and relative offsets on it.
BASE = [8.0, 7.0, 6.0, 5.5, 5.0, 4.8, 4.6, 4.4, 4.2, 4.0]
ALT = [(-1) ** i * 1e-3 for i in range(len(BASE))]  # +1e-3, -1e-3, ...: noise, no drift


def scaled(curve: list[float], rel: float | list[float]) -> list[float]:
    """curve * (1 + rel) per step."""
    rels = rel if isinstance(rel, list) else [rel] * len(curve)
    return [x * (1 + r) for x, r in zip(curve, rels)]


def noisy_twins() -> dict[str, list[float]]:
    """Three stock twins: stock, and +/-1e-3 alternating around it in opposite phases."""
    return {
        "stock": BASE,
        "stock-accum": scaled(BASE, ALT),
        "stock-repeat": scaled(BASE, [-x for x in ALT]),
    }


def test_mean_abs_and_tail_signed():
    run, ref = [1.1, 2.0, 2.7], [1.0, 2.0, 3.0]  # d = +0.1, 0, -0.1
    assert loss_curves.mean_abs(run, ref) == pytest.approx(0.2 / 3)
    assert loss_curves.tail_signed(run, ref, 2) == pytest.approx(-0.05)
    assert loss_curves.tail_signed(run, ref, 3) == pytest.approx(0.0, abs=1e-15)
    assert loss_curves.mean_abs(ref, ref) == 0.0
    assert loss_curves.default_tail(150) == 15 and loss_curves.default_tail(8) == 1


def test_identical_stock_runs_give_a_zero_band_and_the_floor_decides():
    losses = {"stock": BASE, "stock-accum": list(BASE), "stock-repeat": list(BASE)}
    same = loss_curves.parity({**losses, "streamed": list(BASE)}, tail=4)
    assert (same.band_mean, same.band_tail, same.dev_mean, same.drift) == (0.0, 0.0, 0.0, 0.0)
    assert same.ratio == 0.0 and inside_band(same) == (True, True)
    # Under the floor: inside though the band is 0 (the ratio is infinite).
    tiny = loss_curves.parity({**losses, "streamed": scaled(BASE, 1e-4)}, tail=4)
    assert tiny.dev_mean == pytest.approx(1e-4) and tiny.drift == pytest.approx(1e-4)
    assert tiny.ratio == float("inf") and inside_band(tiny) == (True, True)
    # Over it: both checks fail.
    over = loss_curves.parity({**losses, "streamed": scaled(BASE, 2 * FLOOR)}, tail=4)
    assert inside_band(over) == (False, False)


def test_band_is_the_largest_pair_and_a_constant_offset_fails():
    losses = {**noisy_twins(), "streamed": scaled(BASE, 1e-2)}
    p = loss_curves.parity(losses, tail=4)
    assert p.twins == ("stock", "stock-accum", "stock-repeat")
    # Pairs: stock vs each twin 1e-3 per step; the twins vs each other ~2e-3 (opposite phases).
    assert p.band_mean == pytest.approx(2e-3, rel=1e-3)
    assert p.band_tail == pytest.approx(2e-3, rel=1e-3)
    assert loss_curves.stock_band(losses, 4) == (p.band_mean, p.band_tail)
    # +1% on every step: ~1e-2 against every twin, one-sided.
    assert p.dev_mean == pytest.approx(1e-2, rel=1e-3)
    assert p.drift == pytest.approx(1e-2, rel=1e-3)
    assert p.ratio == pytest.approx(5.0, rel=2e-3)
    assert inside_band(p) == (False, False)
    # The old measure saw the same run at 10x stock-accum's max: both agree on a real offset.
    s = loss_curves.summarize(losses, tail=4)
    assert s["streamed"]["max_rel"] / s["stock-accum"]["max_rel"] == pytest.approx(10.0)


def test_an_offset_that_opens_late_fails_the_drift_only():
    # +1e-2 on the last 2 of 10 steps. Over all steps: 2e-3 against stock, 2.8e-3 against each
    # noisy twin (their 1e-3 on the other 8), 1.27x the band; over the last 4: 5e-3 one-sided,
    # 2.5x the tail band.
    late = [0.0] * 8 + [1e-2, 1e-2]
    p = loss_curves.parity({**noisy_twins(), "streamed": scaled(BASE, late)}, tail=4)
    assert p.dev_mean == pytest.approx(7.6e-3 / 3, rel=1e-3)
    assert p.drift == pytest.approx(5e-3, rel=1e-3)
    assert inside_band(p) == (True, False)


def test_a_stock_twin_as_streamed_is_inside():
    twins = noisy_twins()
    p = loss_curves.parity({**twins, "streamed": list(twins["stock-accum"])}, tail=4)
    # 1e-3 against stock, 0 against itself, ~2e-3 against stock-repeat: half the band.
    assert p.dev_mean == pytest.approx(1e-3, rel=1e-3)
    assert p.ratio == pytest.approx(0.5, rel=1e-3)
    assert abs(p.drift) < 1e-6  # alternating: no drift
    assert inside_band(p) == (True, True)
    # A one-sided twin (stock-accum +2e-3 on every step, stock-repeat = stock) as streamed:
    # its drift is stock's own, 2/3 of the band.
    one_sided = {"stock": BASE, "stock-accum": scaled(BASE, 2e-3), "stock-repeat": list(BASE)}
    q = loss_curves.parity({**one_sided, "streamed": scaled(BASE, 2e-3)}, tail=4)
    assert q.band_mean == pytest.approx(2e-3) and q.band_tail == pytest.approx(2e-3)
    assert q.dev_mean == pytest.approx(4e-3 / 3) and q.drift == pytest.approx(4e-3 / 3)
    assert inside_band(q) == (True, True)


def test_seed_run_is_not_in_the_band():
    losses = {**noisy_twins(), "streamed": scaled(BASE, 1e-2)}
    with_seed = {**losses, "stock-seed": scaled(BASE, 0.1)}  # another data order: far off
    p, q = loss_curves.parity(losses, tail=4), loss_curves.parity(with_seed, tail=4)
    assert q == p and "stock-seed" not in q.twins
    assert inside_band(q) == (False, False)  # with the seed run as a twin it would pass
    # Two twins are enough (the CPU run has no stock-repeat); one is no band.
    two = loss_curves.parity({k: losses[k] for k in ("stock", "stock-accum", "streamed")}, tail=4)
    assert two.band_mean == pytest.approx(1e-3) and two.dev_mean == pytest.approx(1e-2, rel=1e-3)
    with pytest.raises(ValueError, match="two of stock"):
        loss_curves.parity({"stock": BASE, "stock-seed": BASE, "streamed": BASE})


def test_band_batchings_are_twins_and_must_divide_the_batch():
    runs = loss_curves.default_runs(8, band_accums=(2, 4, 8))
    assert [(r.name, r.batch, r.accum) for r in runs if not r.streamed] == [
        ("stock", 8, 1), ("stock-accum", 4, 2), ("stock-accum4", 2, 4), ("stock-accum8", 1, 8)
    ]  # fmt: skip
    for name in ("stock", "stock-accum", "stock-accum4", "stock-accum8", "stock-repeat"):
        assert loss_curves.is_stock_twin(name), name
    for name in ("stock-seed", "streamed", "stock-accumx", "hbm"):
        assert not loss_curves.is_stock_twin(name), name
    # Every twin pairs with every other: a band of the three batchings' largest pair.
    losses = {"stock": BASE, "stock-accum": scaled(BASE, 1e-3), "stock-accum4": scaled(BASE, -2e-3)}
    assert loss_curves.stock_band(losses, 4)[0] == pytest.approx(3e-3, rel=1e-2)
    # The max-based band (the plot's shading): the twins' largest max against stock.
    summary = loss_curves.summarize({**losses, "streamed": scaled(BASE, 5e-3)})
    assert loss_curves.max_band(summary) == pytest.approx(2e-3)
    for bad in ((), (3,), (1,)):
        with pytest.raises(ValueError, match="band"):
            loss_curves.default_runs(8, band_accums=bad)


def test_odd_batch_and_bf16_on_cpu_are_refused(tmp_path):
    with pytest.raises(ValueError, match="even"):
        loss_curves.default_runs(7)
    with pytest.raises(SystemExit, match="needs a GPU"):
        loss_curves.main(["--tiny", "--bf16", "--device", "cpu", "--no-plot"])


def test_optim_twin_is_stock_with_the_other_adamw_kernel(tmp_path, monkeypatch):
    """``--optim-twin``: one more stock twin trained by torch's other AdamW kernel (fused vs
    foreach), in the band; in fp32 it follows stock to rounding."""
    used = {}

    class Recording(loss_curves.Trainer):
        def __init__(self, *a, args=None, **kw):
            used[args.output_dir.rsplit("/", 1)[-1]] = str(getattr(args.optim, "value", args.optim))
            super().__init__(*a, args=args, **kw)

    monkeypatch.setattr(loss_curves, "Trainer", Recording)
    argv = ["--family", "llama", "--tiny", "--steps", "3", "--seq-len", "32", "--fp32",
            "--device", "cpu", "--lr", "3e-3", "--band-accums", "2", "--optim-twin",
            "--no-plot", "--out", str(tmp_path)]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        summary = loss_curves.main(argv)
    other = loss_curves.other_adamw()
    assert used[loss_curves.OPTIM_RUN] == other != used["stock"]
    assert loss_curves.is_stock_twin(loss_curves.OPTIM_RUN)
    assert summary[loss_curves.OPTIM_RUN]["max_rel"] < 1e-5


def _grad_band_probe():
    spec = importlib.util.spec_from_file_location("grad_band_probe", "dev/grad_band_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grad_band_probe_reads_every_runs_step_gradient(tmp_path):
    """The probe's gradients are the runs' real ones: in fp32 on the CPU the accumulation twin
    differs from stock by fp32 rounding only (> 0: the probe sees a rounding change, < 1e-5
    relative), streamed too (host and HBM-tier layers), at the initial weights and at stock's
    after 2 steps."""
    probe = _grad_band_probe()
    out = probe.main(
        ["--tiny", "--seq-len", "32", "--batch", "4", "--fp32", "--batches", "1",
         "--at-steps", "0,2", "--steps", "4", "--band-accums", "2", "--out", str(tmp_path),
         "--variant", "hbm:resident_layers=1"]
    )  # fmt: skip
    for step in (0, 2):
        runs = out[step]
        assert set(runs) == {"stock", "stock-accum", "streamed", "hbm"}
        assert runs["stock"]["all"]["err"] == 0.0  # stock in fp32 is the fp32 reference
        assert 0 < runs["stock-accum"]["all"]["err"] < 1e-5
        assert runs["streamed"]["all"]["err"] < 1e-5
        assert runs["hbm"]["all"]["err"] < 1e-5  # an HBM-tier layer's gradient is read too
        assert set(runs["streamed"]) == {*probe.GROUPS, "all"}
    assert (tmp_path / "grad_band_probe.json").exists()
