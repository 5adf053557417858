"""CPU tests of benchmarks/validation_matrix.py: options, the dry run's cells and verdicts, the
summary table, failure classes, and one real tiny cell through the same path as on the GPU."""

from __future__ import annotations

import csv
import re

import pytest

from benchmarks import bench
from benchmarks import validation_matrix as vm


def _args(*argv):
    return vm.build_parser().parse_args(list(argv))


def test_arguments():
    a = _args()
    assert a.families == ["qwen3", "mistral", "gemma2", "phi3", "moe"]
    assert a.seq_lens == [4096, 32768, 131072, 262144]
    assert a.phase == (1, 1) and a.tag is None and not a.dry_run
    # One warm-up step, then one measured: the peak is the steady state's (resident moments).
    assert (a.warmup, a.steps) == (vm.WARMUP_STEPS, vm.MEASURED_STEPS) == (1, 1)
    a = _args("--families", "qwen3,moe", "--seq-lens", "4k,262144", "--phase", "2/3")
    assert (a.families, a.seq_lens, a.phase) == (["qwen3", "moe"], [4096, 262144], (2, 3))
    for bad in (["--phase", "3/2"], ["--phase", "x"]):
        with pytest.raises(SystemExit):
            _args(*bad)
    a = _args("--config", "tiny=tiny-qwen2", "--families", "tiny,qwen3")
    assert vm.models_from_args(a) == {
        **{f: m for f, (m, _) in vm.FAMILIES.items()},
        "tiny": "tiny-qwen2",
    }
    with pytest.raises(SystemExit, match="unknown family"):
        vm.models_from_args(_args("--families", "nope"))
    # Single cells instead of the cross product.
    a = _args("--cells", "mistral:32k,phi3:262144", "--dry-run")
    assert a.cells == [("mistral", 32768), ("phi3", 262144)]
    assert [c.name for c in vm.planned_cells(a)] == ["mistral 32k", "phi3 256k"]
    with pytest.raises(SystemExit):
        _args("--cells", "phi3")
    with pytest.raises(SystemExit, match="unknown family"):
        vm.models_from_args(_args("--cells", "nope:4k"))
    # The cell's run: the defaults (no engine flag), one sequence per step, random init.
    cfg = vm.run_config(vm.Cell("qwen3", "qwen3-1.7b", 32768), "auto", 120, a.steps, a.warmup)
    assert cfg.system == "megatrain-hbm" and cfg.engine_args() == []
    assert (cfg.resolved_micro_batch, cfg.grad_accum, cfg.steps, cfg.warmup) == (1, 1, 1, 1)
    assert cfg.streamed_init and cfg.tokens_per_step == 32768
    assert "--steps 1 --warmup 1" in cfg.command()


def test_dry_run_lists_every_cell_with_a_verdict(capsys):
    assert vm.main(["--dry-run", "--phase", "1/2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"^\w+ \d+k ", line)]
    assert len(rows) == 20
    for family in vm.FAMILIES:
        for n in ("4k", "32k", "128k", "256k"):
            [line] = [r for r in rows if r.startswith(f"{family} {n} ")]
            assert re.search(r"\d+\s+[12]\s+(fits: \d+/\d+ layers in HBM|refuse: \S)", line), line
    assert re.search(r"phase 1/2: \d+ cells, estimated \d+ s", out)
    assert re.search(r"phase 2/2: \d+ cells, estimated \d+ s", out)
    # Estimates grow with the sequence; phases split the estimated time about evenly.
    cells = vm.planned_cells(_args("--families", "qwen3", "--phase", "1/2"))
    est = {c.seq_len: c.est_s for c in cells}
    assert est[4096] < est[32768] < est[131072] < est[262144]
    # The estimate counts both steps (warm-up and measured): one step's work more than one.
    one = vm.plan_cell(vm.Cell("qwen3", "qwen3-1.7b", 32768), 139.3, 120.0, vm.TFLOPS, steps=1)
    assert est[32768] > one.est_s
    loads = [sum(c.est_s for c in cells if c.phase == k) for k in (1, 2)]
    assert max(loads) - min(loads) <= max(est.values())


def test_classify_failures():
    assert vm.classify({"status": "ok"}) == ("trained", "")
    refusal = {
        "status": "oom-host (DoesNotFitError)",
        "error_type": "DoesNotFitError",
        "error_bases": ["MemoryError", "Exception", "BaseException"],
        "error": "hf_megatrain: needs 150 GiB of GPU memory; fits: 131072 tokens",
    }
    status, detail = vm.classify(refusal)
    assert status == "refused" and "fits: 131072 tokens" in detail
    assert not detail.startswith("hf_megatrain")
    host = {
        "status": "oom-host (needs 1 GiB, has 0 GiB)",
        "error_type": "InsufficientHostMemoryError",
    }
    assert vm.classify(host)[0] == "refused"
    oom = {"status": "oom-gpu", "error_type": "OutOfMemoryError", "error": "CUDA out of memory."}
    assert vm.classify(oom) == ("oom-gpu", "CUDA out of memory.")
    assert vm.classify({"status": "killed (rc -9)"})[0] == "killed"
    status, detail = vm.classify({"status": "killed (rc -6, SIGABRT)"})
    assert status == "killed" and "aborted" in detail and "OOM killer" not in detail
    assert vm.classify({"status": "timeout (90 s)"}) == ("timeout", "timeout (90 s)")
    assert vm.classify({"status": "error: ValueError: x", "error_type": "ValueError"})[0] == "error"
    # What the worker records of an exception (bench.failure_details).
    details = bench.failure_details(MemoryError("hf_megatrain: no"))
    assert details == {"error_type": "MemoryError", "error_bases": ["Exception", "BaseException"],
                       "error": "hf_megatrain: no"}  # fmt: skip


def _synthetic_row(family, seq_len, status, tag="synthetic", **kw):
    """A made-up row for the summarizer (test input, not a measurement)."""
    row = dict(family=family, model=f"{family}-model", seq_len=seq_len, status=status, tag=tag,
               commit="abc", gpu="test-gpu")  # fmt: skip
    row.update(kw)
    return row


def test_summarize_builds_the_table(tmp_path):
    path = tmp_path / "results.csv"
    rows = [
        _synthetic_row(
            "qwen3",
            4096,
            "trained",
            plan_hbm_gib="100.00",
            plan_hbm_est_gib="97.00",
            peak_hbm_gib="95.00",
            hbm_err_pct="+2.1",
            plan_host_gib="2.00",
            peak_host_gib="2.10",
            host_err_pct="-4.8",
            warmup="1",
            steps="1",
            peak_hbm_alloc_gib="93.25",
        ),  # fmt: skip
        _synthetic_row(
            "qwen3",
            262144,
            "refused",
            verdict_hbm_gib="180.00",
            detail="DoesNotFitError: needs 180 GiB | fits: 131072 tokens",
        ),  # fmt: skip
        _synthetic_row("moe", 4096, vm.NOT_RUN),
        _synthetic_row(
            "moe", 4096, "trained", plan_hbm_gib="50.00", peak_hbm_gib="40.00", hbm_err_pct="+25.0"
        ),  # fmt: skip  (the later run of the same cell)
        _synthetic_row("moe", 262144, "oom-gpu", detail="CUDA out of memory"),
        _synthetic_row("moe", 262144, vm.NOT_RUN),  # a ran cell is not replaced by a not-run one
        _synthetic_row("qwen3", 32768, "trained", tag="other-sweep"),
    ]
    bench.append_csv(path, rows, vm.MATRIX_COLUMNS)
    out = tmp_path / "matrix.md"
    assert vm.main(["--summarize", str(path), "--markdown", str(out), "--tag", "synthetic"]) == 0
    text = out.read_text()
    assert "| family (model) | 4k | 256k |" in text  # 32k only in the other tag
    assert (
        "| qwen3 (qwen3-model) | trained: HBM 97.00 / 95.00 (+2.1%), host 2.00 / 2.10 (-4.8%) | "
        "refused (plan HBM 180.00 GiB) |" in text
    )
    assert (
        # A row recorded before the expected peak was: set against its bound, so marked.
        "| moe (moe-model) | trained: HBM 50.00 / 40.00 (bound) (+25.0%), host - / - (-%) | "
        "**oom-gpu** |" in text
    )
    assert (
        "**promise broken: 4 cells, 2 trained, 1 refused, 1 failed (oom-gpu), 0 not run (budget); "
        "max |hbm err| 25.0%, max |host err| 4.8%**" in text
    )
    assert "DoesNotFitError: needs 180 GiB / fits: 131072 tokens" in text  # "|" escaped
    assert "steps (warm-up + measured): 1 + 1" in text
    # The cells' table: the expected peak, the bound, the reserved peak, its error, then the
    # allocated peak.
    assert "| qwen3 4k | trained |  |  |  | 97.00 | 100.00 | 95.00 | +2.1 | 93.25 | 2.00 |" in text


def test_budget_records_cells_not_run(tmp_path):
    cells = [vm.Cell("tiny", "tiny-qwen2", 256, est_s=5.0)]
    rows = vm.run_matrix(cells, tag="budget", results_dir=tmp_path, max_wall_s=0,
                         cell_timeout_s=None, device="cpu")  # fmt: skip
    assert [r["status"] for r in rows] == [vm.NOT_RUN]
    with (tmp_path / "results.csv").open() as f:
        [row] = list(csv.DictReader(f))
    assert row["status"] == vm.NOT_RUN and row["family"] == "tiny"


@pytest.mark.parametrize("cell_timeout_s, status", [(10.0, "timeout"), (None, vm.CUT)])
def test_timeout_cut_by_the_budget_is_no_failure(tmp_path, monkeypatch, cell_timeout_s, status):
    """A cell stopped by its own timeout failed; one stopped because the budget ended is cut."""
    timeouts = []

    def fake_run(cfg, log_file):  # stands in for the worker: it timed out
        timeouts.append(cfg.timeout_s)
        return {"status": f"timeout ({cfg.timeout_s:g} s)", "wall_s": cfg.timeout_s}

    monkeypatch.setattr(vm.bench, "run_subprocess", fake_run)
    cells = [vm.Cell("tiny", "tiny-qwen2", 256, est_s=5.0)]
    [row] = vm.run_matrix(cells, tag="cut", results_dir=tmp_path, max_wall_s=60,
                          cell_timeout_s=cell_timeout_s, device="cpu")  # fmt: skip
    assert row["status"] == status
    assert timeouts[0] == (10.0 if cell_timeout_s else pytest.approx(60, abs=5))


def test_tiny_cell_trains_on_cpu(tmp_path, monkeypatch, capsys):
    """One real cell through the GPU path (planner verdict, bench worker, row, markdown)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = ["--config", "tiny=tiny-qwen2", "--families", "tiny", "--seq-lens", "256",
            "--device", "cpu", "--results-dir", str(tmp_path), "--tag", "cpu-test"]  # fmt: skip
    assert vm.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"matrix: \[1/1\] tiny 256 \(tiny-qwen2\): trained in [\d.]+ s", out)
    with (tmp_path / "results.csv").open() as f:
        [row] = list(csv.DictReader(f))
    assert row["status"] == "trained" and row["family"] == "tiny" and row["tag"] == "cpu-test"
    assert row["verdict"].startswith("fits: ")
    assert (row["seq_len"], row["micro_batch"], row["grad_accum"]) == ("256", "1", "1")
    assert (row["warmup"], row["steps"]) == ("1", "1") and "--warmup 1" in row["command"]
    assert "peak_hbm_alloc_gib" in row and row["peak_hbm_alloc_gib"] == ""  # (no CUDA)
    assert float(row["tokens_per_s"]) > 0 and float(row["peak_host_gib"]) > 0
    assert row["command"].endswith("--streamed-init")  # no engine flag: the defaults
    assert "| tiny (tiny-qwen2) | trained:" in (tmp_path / "cpu-test.md").read_text()


def test_summary_replans_older_rows_and_names_rescued_cells():
    """Rows recorded before runs recorded their plan's expected GPU peak are set against the
    current planner's for their run (as plan_vs_measured has it, first-step rows on the first
    step's footing); a cell the out-of-memory watchdog rescued breaks the promise and its
    reserved peak (the whole GPU) is no error."""
    import benchmarks.plan_vs_measured as pvm

    path = bench.RESULTS_DIR / "validation_matrix.csv"
    filled = vm.with_expected_peaks(vm.read_rows([path], ["matrix-h200"]))

    def row(rows, commit, model, seq_len):
        return next(
            r
            for r in rows
            if r["commit"] == commit and r["model"] == model and int(r["seq_len"]) == seq_len
        )

    old = row(filled, "d53f3e3", "qwen3-1.7b", 131072)
    replanned = row(pvm.compare(path), "d53f3e3", "qwen3-1.7b", 131072)
    assert old["plan_hbm_est_from"] == "re-planned" and old["warmup"] == "0"
    assert float(old["plan_hbm_est_gib"]) == pytest.approx(
        replanned["expected_step1_gib"], abs=0.01
    )
    own = row(filled, "5c22eb5", "gemma-2-2b", 262144)  # recorded its own expected peak
    assert "plan_hbm_est_from" not in own and own["plan_hbm_est_gib"] == "131.90"
    saved = row(filled, "d53f3e3", "h2o-danube-1.8b", 32768)
    assert vm.rescued(saved) and not vm.rescued(own)
    line = vm.promise_line([saved])
    assert line.startswith("promise broken: 1 cells, 1 trained (1 after running out of GPU")
    assert "hbm err" not in line  # the whole GPU reserved: no error to take
    assert vm.promise_line([own]).startswith("promise holds: 1 cells, 1 trained, 0 refused")


def test_window_fraction_counts_windowed_layers():
    """FlexAttention's cells are estimated over the attention its block mask leaves: a windowed
    layer attends to at most its window, against s / 2 keys per query without one."""
    gemma2 = vm.model_shape("gemma-2-2b")  # every other layer windowed (4,096)
    danube = vm.model_shape("h2o-danube-1.8b")  # every layer windowed (4,096)
    qwen3 = vm.model_shape("qwen3-1.7b")  # no window
    assert vm.window_fraction(gemma2, 131072) == pytest.approx(0.5 + 0.5 * 8192 / 131072)
    assert vm.window_fraction(danube, 262144) == pytest.approx(8192 / 262144)
    assert vm.window_fraction(danube, 4096) == vm.window_fraction(qwen3, 262144) == 1.0


@pytest.mark.parametrize(
    "model, seq_len, hbm_gib, host_gib",
    [("qwen2.5-1.5b", 4096, 16, 30), ("olmoe-1b-7b-0924", 8192, 60, 90)],
)
def test_a_cells_verdict_is_the_plan_training_makes(model, seq_len, hbm_gib, host_gib, capsys):
    """The dry run's verdict is `hf-megatrain plan`'s (which resolves the options as training
    does): the same tier, peaks and host total. It once planned every cell with a host
    gradient slot per accumulation (one backward makes a cell's step) and without the run's
    layer kernels, and so refused cells that train (Qwen2.5-14B at one 64k sequence)."""
    from hf_megatrain.cli import build_parser
    from hf_megatrain.cli_plan import run_plan
    from hf_megatrain.core.planner import GIB

    cell = vm.plan_cell(vm.Cell("x", model, seq_len), hbm_gib, host_gib, vm.TFLOPS)
    argv = ["plan", str(bench.model_config_path(model)), "--seq-len", str(seq_len)]
    argv += ["--tokens-per-step", str(seq_len), "--hbm-gib", str(hbm_gib)]
    argv += ["--host-gib", str(host_gib), "--no-search"]
    plan = run_plan(build_parser().parse_args(argv))["plan"]
    capsys.readouterr()
    assert cell.fits and plan.fits
    assert cell.verdict.startswith(f"fits: {plan.n_hbm}/")
    assert cell.plan_hbm_est_gib == pytest.approx(plan.gpu_peak_estimate / GIB, abs=1e-9)
    assert cell.plan_host_gib == pytest.approx(plan.host_step_peak_estimate / GIB, abs=1e-9)
