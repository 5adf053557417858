#!/usr/bin/env python3
"""Validation matrix: model families x sequence lengths with hf_megatrain's default settings.

Each cell trains one sequence of L tokens per step (grad-accum 1) of a random-init model built
from a real Hub config, with no engine flag: bench.py's ``megatrain-hbm`` system (HBM tier
"auto", every other option at its default), ``--streamed-init``, bf16; one warm-up step, then
one measured step (``WARMUP_STEPS``, ``MEASURED_STEPS``). The peaks are the run's (both steps),
so they are the steady state's: the first optimizer update makes the resident parameters'
AdamW moments, which a one-step run's peak (before that update) lacked. Beside the reserved
peak (``peak_hbm_gib``, torch.cuda.max_memory_reserved) a row records the allocated one
(``peak_hbm_alloc_gib``, max_memory_allocated: the live tensors). The promise under test:
every cell trains or is refused before allocation with a message saying what fits; no cell runs
out of GPU memory; the planned peaks (HBM and host) are within 10% of the measured ones.

Every cell is a ``bench.py --worker`` subprocess (bench's machinery: an OOM, a kill or a timeout
becomes a row), recorded with bench's row schema plus the matrix's columns; ``status`` is one of

* ``trained``: the step ran;
* ``refused``: the library refused before allocating (``DoesNotFitError`` / ``MemoryPlanError``
  for the GPU, ``InsufficientHostMemoryError`` for host RAM), its message in ``detail``;
* ``oom-gpu``: torch's OutOfMemoryError, a broken promise; ``killed``: killed from outside (on
  these machines the host's OOM killer) or aborted (SIGABRT: a C++ exception or CUDA error);
  ``timeout``; ``error``: anything else;
* ``not run (budget)``: the ``--max-wall-s`` budget ran out before the cell's turn;
  ``cut (budget)``: the cell ran past what was left of the budget (its timeout was cut to it).
  Neither is a failure: the matrix is incomplete until those cells run.

Cells run cheapest first (an estimate from the plan: start-up, FLOPs at ``--tflops``, PCIe);
``--phase K/N`` runs the K-th of N phases of about equal estimated time, so that the matrix fits
device commands of a few minutes each. Examples::

    python3 benchmarks/validation_matrix.py --dry-run            # cells, verdicts, estimates
    python3 benchmarks/validation_matrix.py --phase 1/2 --max-wall-s 520 --results-dir out/
    python3 benchmarks/validation_matrix.py --summarize out/results.csv --markdown matrix.md
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import shlex
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR.parent) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR.parent))

from benchmarks import bench  # noqa: E402

#: family -> (config folder under benchmarks/configs/, what the family brings to the matrix).
FAMILIES: dict[str, tuple[str, str]] = {
    "qwen3": ("qwen3-1.7b", "Qwen3-1.7B: qk-norm"),
    "mistral": ("h2o-danube-1.8b", "H2O-Danube-1.8B, Mistral architecture: sliding window 4096"),
    "gemma2": ("gemma-2-2b", "Gemma-2-2B: attention and final-logit soft-capping (eager)"),
    "phi3": ("phi-3-mini-4k-instruct", "Phi-3-mini-4k (3.8B): fused qkv and gate-up"),
    "moe": ("olmoe-1b-7b-0924", "OLMoE-1B-7B (6.9B): MoE, 64 experts, top-8"),
}
SEQ_LENS = (4096, 32768, 131072, 262144)
#: bench.py's system for the library's defaults: no engine flag at all (resident_layers "auto").
SYSTEM = "megatrain-hbm"

#: The machine the verdicts and estimates are for: one H200 (free HBM at a run's start, as
#: benchmarks/report.py has it) on a 128 GiB host (what a run can take of it).
H200_HBM_GIB = 139.3
H200_HOST_GIB = 120.0
#: Estimates (rough; the per-cell timeout is twice the estimate, the budget guards the rest).
TFLOPS = 400.0  # sustained bf16 TFLOP/s of the layers' matmuls and flash attention
STARTUP_S = 15.0  # interpreter, imports, CUDA context, first-step set-up
STARTUP_S_PER_B = 2.5  # random init into the host store and pinning, per billion parameters
FIRST_STEP_S = 5.0  # allocator warm-up and kernel selection of the first step
#: Steps each cell runs: one untimed warm-up step (so the measured peak holds the resident
#: parameters' AdamW moments, made by the first update), then one measured step.
WARMUP_STEPS = 1
MEASURED_STEPS = 1
REFUSAL_S = 12.0  # a cell refused before allocation: start-up and plan only
HOST_ADAM_PARAMS_PER_S = 1.5e9  # host AdamW of the host-tier layers (not all of it overlaps)
#: Attention slower than causal flash SDPA: a materialized sliding-window mask makes SDPA take
#: its masked (memory-efficient) kernel over every block; eager attention materializes scores.
MASKED_SDPA_FACTOR = 2.0
EAGER_FACTOR = 3.0
#: FlexAttention's Triton kernels against cuDNN's causal SDPA, over the attention FLOPs its
#: block mask leaves (``window_fraction``): Gemma-2-2B's steps (head_dim 256, soft-capping, half
#: its layers with a 4,096-token window) measured 41.9 s at 131,072 tokens and 184 s at 262,144
#: (H200, e3a1a56 and 5c22eb5): 3.6x and 4.5x; H2O-Danube's (head_dim 80, every layer windowed)
#: 11.8 s at 262,144 (37aab1b): about 1.5x, so its cells are estimated high.
FLEX_FACTOR = 4.0
#: FlexAttention's kernels compile in a cell's first step (torch.compile, a cold cache): Gemma-2's
#: 131,072-token first step took 49 s longer than its second, and its 32,768-token cell ran
#: past a 90 s timeout on a fresh machine (34 s in all with the compile cache warm).
FLEX_COMPILE_S = 60.0
#: A cell starts only with this much of the budget left (else: not run (budget)).
MIN_CELL_S = 30.0

MATRIX_COLUMNS = [
    "family",
    "phase",
    "est_s",
    "wall_s",
    "verdict",
    "verdict_hbm_gib",
    "verdict_host_gib",
    "auto_fit",
    "hbm_err_pct",
    "host_err_pct",
    "detail",
]
NOT_RUN = "not run (budget)"
CUT = "cut (budget)"
BUDGET = (NOT_RUN, CUT)  # cells the budget left incomplete
FAILURES = ("oom-gpu", "killed", "timeout", "error")
#: Exception classes of the library's refusals before allocation.
REFUSALS = ("DoesNotFitError", "MemoryPlanError", "InsufficientHostMemoryError")


# ---- cells, verdicts, estimates --------------------------------------------------------------
@dataclasses.dataclass
class Cell:
    family: str
    model: str
    seq_len: int
    phase: int = 1
    params: int = 0
    fits: bool = True
    verdict: str = ""
    plan_hbm_gib: float | None = None
    plan_hbm_est_gib: float | None = None
    plan_host_gib: float | None = None
    auto_fit: str = ""
    est_s: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.family} {seq_label(self.seq_len)}"


def seq_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def parse_seq_len(text: str) -> int:
    t = text.strip().lower()
    return int(t[:-1]) * 1024 if t.endswith("k") else int(t)


_SHAPES: dict[str, Any] = {}


def model_shape(model: str):
    """The planner's ``ModelShape`` of a config as a CUDA run on this site plans it (built on
    meta, with the layer kernels ``layer_kernels="auto"`` gives the family here:
    ``cli_plan.planned_kernel_shape``), cached per model."""
    if model not in _SHAPES:
        from hf_megatrain.cli_plan import planned_kernel_shape

        _SHAPES[model], _ = planned_kernel_shape(bench.load_model_config(model), model)
    return _SHAPES[model]


def window_fraction(shape, seq_len: int) -> float:
    """The part of causal attention's FLOPs a sliding window leaves, over all layers: a windowed
    layer's query attends to at most ``shape.sliding_window`` keys against s / 2 on average
    without it; the others (``shape.sliding_layers`` False, as Gemma-2's every other layer)
    attend to all."""
    window = shape.sliding_window
    if not window or seq_len <= window:
        return 1.0
    pattern = shape.sliding_layers
    windowed = sum(pattern) / len(pattern) if pattern else 1.0
    return (1 - windowed) + windowed * min(1.0, 2 * window / seq_len)


def attention_factor(config, shape, seq_len: int) -> float:
    if (
        shape.attn_implementation == "flex_attention"
    ):  # block-sparse: it skips what the window masks
        return FLEX_FACTOR * window_fraction(shape, seq_len)
    if not shape.sdpa_attention:
        return EAGER_FACTOR
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and seq_len > window:
        return MASKED_SDPA_FACTOR
    return 1.0


def plan_cell(
    cell: Cell,
    hbm_gib: float,
    host_gib: float,
    tflops: float,
    steps: int = WARMUP_STEPS + MEASURED_STEPS,
) -> Cell:
    """Fill the cell's verdict (the planner's, for the default options on the given memory,
    with the library's automatic fitting where it has one) and its time estimate for
    ``steps`` optimizer steps (warm-up and measured)."""
    import torch

    from hf_megatrain.core import planner
    from hf_megatrain.core.options import StepShape
    from hf_megatrain.hf.attention import planned_attention
    from hf_megatrain.option_flags import flag_text

    config = bench.load_model_config(cell.model)
    options = bench.default_engine(SYSTEM).with_(plan_seq_len=cell.seq_len)
    # The attention the trainer would switch the model to before its plan (FlexAttention for
    # soft-capping and long sliding windows on CUDA).
    shape, _ = planned_attention(model_shape(cell.model), config, options.attention, cell.seq_len)
    # As the trainer resolves a cell's step (one sequence, no accumulation, one process): one
    # backward makes each step's gradients, so the host tier's bf16 gradient slot is exact.
    resolved = options.resolve(clipping=True, cuda=True, single_backward=True)
    step = StepShape.from_step(cell.seq_len, cell.seq_len)
    hbm, host = int(hbm_gib * planner.GIB), int(host_gib * planner.GIB)
    # What the trainer runs: the options as given, or those auto_fit picks when they do not fit.
    plan, asked = planner.plan_with_auto_fit(shape, step, resolved, torch.bfloat16, hbm, host)
    if asked is not None:
        changed = planner.auto_fit_changes(plan, asked).options
        cell.auto_fit = " ".join(flag_text(k, v) for k, v in changed.items())
    cell.params = shape.total_numel
    cell.fits = plan.fits
    cell.plan_hbm_gib = plan.gpu_total / planner.GIB
    cell.plan_hbm_est_gib = plan.gpu_peak_estimate / planner.GIB
    cell.plan_host_gib = plan.host_step_peak_estimate / planner.GIB  # (saves nothing)
    if plan.fits:
        cell.verdict = (
            f"fits: {plan.n_hbm}/{shape.num_layers} layers in HBM, HBM {cell.plan_hbm_est_gib:.1f} "
            f"GiB (bound {cell.plan_hbm_gib:.1f}), host {cell.plan_host_gib:.1f} GiB"
            + (f", auto-fit {cell.auto_fit}" if cell.auto_fit else "")
        )
    else:
        message = str(plan.problems[0]).removeprefix("hf_megatrain: ")
        cell.verdict = f"refuse: {message}"
    # Time: start-up, then the step's FLOPs (dense 8 x active params x tokens: forward,
    # backward, recompute; attention 2 L s^2 d forward, x4 with backward and recompute) or its
    # PCIe traffic, whichever is longer, and the host AdamW of the host-tier layers.
    billions = cell.params / 1e9
    if not plan.fits:
        cell.est_s = REFUSAL_S + billions
        return cell
    s, layers = cell.seq_len, shape.num_layers
    d_attn = (shape.num_heads * shape.head_dim) or shape.hidden_size
    attn = 8 * layers * s * s * d_attn * attention_factor(config, shape, s)
    dense = 8 * bench.config_flops(cell.model, s)[0] * s
    compute = (attn + dense) / (tflops * 1e12)
    pcie = (plan.h2d_bytes_per_step + plan.d2h_bytes_per_step) / planner.PCIE_BYTES_PER_S
    host_params = sum(shape.layer_numels[p.index] for p in plan.layers if p.tier != planner.HBM)
    compile_s = FLEX_COMPILE_S if shape.attn_implementation == "flex_attention" else 0.0
    cell.est_s = (
        STARTUP_S
        + STARTUP_S_PER_B * billions
        + FIRST_STEP_S
        + compile_s
        + max(1, steps) * (max(compute, pcie) + host_params / HOST_ADAM_PARAMS_PER_S)
    )
    return cell


def make_cells(families: list[str], seq_lens: list[int], models: dict[str, str]) -> list[Cell]:
    return [Cell(f, models[f], s) for f in families for s in seq_lens]


def assign_phases(cells: list[Cell], n: int) -> None:
    """Split the cells into ``n`` phases of about equal estimated time (longest first to the
    least loaded phase); deterministic for the same cells and estimates."""
    load = [0.0] * n
    for cell in sorted(cells, key=lambda c: (-c.est_s, c.family, c.seq_len)):
        k = min(range(n), key=lambda i: (load[i], i))
        cell.phase = k + 1
        load[k] += cell.est_s


def cheap_first(cells: list[Cell]) -> list[Cell]:
    return sorted(cells, key=lambda c: (c.est_s, c.seq_len, c.family))


# ---- running ---------------------------------------------------------------------------------
def run_config(cell: Cell, device: str, timeout_s: float, steps: int, warmup: int):
    """The bench run of a cell: the defaults (no engine option given), one sequence per step."""
    return bench.RunConfig(
        system=SYSTEM,
        model=cell.model,
        seq_len=cell.seq_len,
        tokens_per_step=cell.seq_len,
        micro_batch=1,
        steps=steps,
        warmup=warmup,
        device=device,
        timeout_s=timeout_s,
        streamed_init=True,
    )


def classify(result: dict) -> tuple[str, str]:
    """(matrix status, detail) of a worker's result."""
    status = result.get("status", "")
    if status == "ok":
        return "trained", ""
    etype = result.get("error_type", "")
    kinds = [etype, *result.get("error_bases", [])]
    message = " ".join((result.get("error") or "").split())
    message = message.removeprefix("hf_megatrain: ")
    if etype in REFUSALS or (
        "MemoryError" in kinds and (result.get("error") or "").startswith("hf_megatrain:")
    ):
        hbm = result.get("peak_hbm_gib")
        at = f" [HBM peak at refusal {hbm:.2f} GiB]" if hbm else ""
        return "refused", f"{etype}: {message}"[:600] + at
    if etype == "OutOfMemoryError" or status == "oom-gpu":
        return "oom-gpu", message[:300]
    if status.startswith("killed"):
        # SIGKILL comes from outside (the host's OOM killer on these machines); SIGABRT is the
        # worker aborting itself: an uncaught C++ exception, a CUDA error among them (the Phi-3
        # 256k cell's illegal memory access at 3e3d499). Its log says which.
        if "SIGABRT" in status or "rc -6" in status:
            return "killed", f"{status}: aborted (a C++ exception or CUDA error: see its log)"
        return "killed", f"{status}: killed from outside (host OOM killer?)"
    if status.startswith("timeout"):
        return "timeout", status
    if etype:
        return "error", f"{etype}: {message}"[:300]
    return "error", status[:300]


def _num(value: Any) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


def err_pct(planned: Any, measured: Any) -> str:
    """Planned against measured, as plan_vs_measured.py has it: planned / measured - 1, in %."""
    p, m = _num(planned), _num(measured)
    return "" if p is None or not m else f"{(p / m - 1) * 100:+.1f}"


def planned_hbm(row: dict) -> Any:
    """The planned GPU peak a row's measured one is set against: the plan's expected peak
    (``plan_hbm_est_gib``; re-planned for older rows by ``with_expected_peaks``), else its bound
    (``plan_hbm_gib``: the expected peak plus the margin for measured errors)."""
    return row.get("plan_hbm_est_gib") or row.get("plan_hbm_gib")


def rescued(row: dict) -> bool:
    """Whether the row's run ran out of GPU memory and the out-of-memory watchdog re-ran it
    (``plan_vs_measured.OOM_RECOVERED``): it trained, but the plan it ran with did not hold."""
    from benchmarks import plan_vs_measured as pvm

    key = (row.get("tag"), row.get("model"), int(row.get("seq_len") or 0), row.get("commit"))
    return key in pvm.OOM_RECOVERED


def with_expected_peaks(rows: list[dict]) -> list[dict]:
    """The rows, those trained before the plan's expected GPU peak was recorded (no
    ``plan_hbm_est_gib``) given the current planner's for their run (``plan_vs_measured.plan_row``:
    the row's placement, kept layers and attention outputs; a first-step-only row less the AdamW
    moments its one step had not made yet) and ``plan_hbm_est_from="re-planned"``. Rows of
    models without a config under benchmarks/configs stay as they are."""
    from benchmarks import plan_vs_measured as pvm
    from hf_megatrain.core.planner import GIB

    out = []
    for row in rows:
        known = (bench.CONFIG_DIR / str(row.get("model")) / "config.json").is_file()
        if row.get("status") == "trained" and not row.get("plan_hbm_est_gib") and known:
            plan = pvm.plan_row(row)
            expected = (plan.gpu_peak_estimate - pvm.first_step_absent(row, plan)) / GIB
            row = {**row, "plan_hbm_est_gib": f"{expected:.2f}", "plan_hbm_est_from": "re-planned"}
        out.append(row)
    return out


def hbm_err(row: dict) -> str:
    """A trained row's HBM error against ``planned_hbm`` (recomputed: older rows recorded it
    against the bound)."""
    return err_pct(planned_hbm(row), row.get("peak_hbm_gib"))


def matrix_row(cell: Cell, cfg, result: dict, sweep: dict, status: str, detail: str) -> dict:
    result.setdefault("params", cell.params)
    row = bench.make_row(cfg, result, sweep)
    row.update(
        status=status,
        family=cell.family,
        phase=cell.phase,
        est_s=f"{cell.est_s:.0f}",
        wall_s=f"{result['wall_s']:.1f}" if result.get("wall_s") is not None else "",
        verdict=cell.verdict,
        verdict_hbm_gib=bench._fmt(cell.plan_hbm_gib, 2),
        verdict_host_gib=bench._fmt(cell.plan_host_gib, 2),
        auto_fit=cell.auto_fit,
        hbm_err_pct=err_pct(planned_hbm(row), row["peak_hbm_gib"]) if status == "trained" else "",
        host_err_pct=(
            err_pct(row["plan_host_gib"], row["peak_host_gib"]) if status == "trained" else ""
        ),
        detail=detail,
    )
    return row


def progress_line(i: int, n: int, cell: Cell, row: dict) -> str:
    head = f"matrix: [{i}/{n}] {cell.name} ({cell.model}): {row['status']}"
    if row["status"] == NOT_RUN:
        return f"{head} (estimated {cell.est_s:.0f} s; {row['detail']})"
    head += f" in {row['wall_s']} s"
    if row["status"] == "trained":
        return (
            f"{head}; HBM plan {planned_hbm(row) or '-'} (bound {row['plan_hbm_gib'] or '-'}) / "
            f"measured {row['peak_hbm_gib'] or '-'} GiB ({row['hbm_err_pct'] or '-'}%, "
            f"allocated {row.get('peak_hbm_alloc_gib') or '-'}); "
            f"host plan {row['plan_host_gib'] or '-'} / measured {row['peak_host_gib'] or '-'} "
            f"GiB ({row['host_err_pct'] or '-'}%)"
        )
    return f"{head}: {row['detail'][:240]}"


def run_matrix(
    cells: list[Cell],
    *,
    tag: str,
    results_dir: Path,
    max_wall_s: float,
    cell_timeout_s: float | None,
    device: str = "auto",
    steps: int = MEASURED_STEPS,
    warmup: int = WARMUP_STEPS,
    argv: str = "",
) -> list[dict]:
    """Run the cells cheapest first, each in its own worker; a row per cell (the ones the budget
    left out too), appended to ``results_dir/results.csv`` as it comes, and the matrix's
    markdown rewritten after each."""
    start = time.perf_counter()
    sweep = bench.sweep_info(tag, argv)
    results_dir.mkdir(parents=True, exist_ok=True)
    csv_path = results_dir / "results.csv"
    md_path = results_dir / f"{tag}.md"
    (results_dir / "logs").mkdir(exist_ok=True)
    log_path = results_dir / "logs" / f"{tag}.log"
    ordered = cheap_first(cells)
    rows: list[dict] = []
    with log_path.open("a") as log_file:
        for i, cell in enumerate(ordered, 1):
            left = max_wall_s - (time.perf_counter() - start)
            own = max(90.0, 2 * cell.est_s) if cell_timeout_s is None else cell_timeout_s
            cfg = run_config(cell, device, max(min(own, left), 1.0), steps, warmup)
            if left < MIN_CELL_S:
                result: dict[str, Any] = {"status": NOT_RUN}
                status, detail = NOT_RUN, f"{left:.0f} s of the budget left"
            else:
                result = bench.run_subprocess(cfg, log_file)
                status, detail = classify(result)
                if status == "timeout" and left < own:
                    status, detail = CUT, f"stopped at the budget's end ({left:.0f} s left)"
            row = matrix_row(cell, cfg, result, sweep, status, detail)
            rows.append(row)
            bench.append_csv(csv_path, [row], MATRIX_COLUMNS)
            md_path.write_text(summarize(rows, title=f"Validation matrix `{tag}`"))
            print(progress_line(i, len(ordered), cell, row), flush=True)
            log_file.flush()
    print(f"matrix: wrote {csv_path}, {md_path}, {log_path}", flush=True)
    print(f"matrix: {promise_line(rows)}", flush=True)
    return rows


# ---- summary ---------------------------------------------------------------------------------
def latest_cells(rows: list[dict]) -> dict[tuple[str, int], dict]:
    """One row per (family, seq_len): the last that ran, else the last."""
    out: dict[tuple[str, int], dict] = {}
    for row in rows:
        if not row.get("family"):
            continue
        key = (row["family"], int(row["seq_len"]))
        if row["status"] not in BUDGET or key not in out or out[key]["status"] in BUDGET:
            out[key] = row
    return out


def _cell_text(row: dict) -> str:
    status = row["status"]
    if status == "trained":
        hbm = f"HBM {planned_hbm(row) or '-'} / {row.get('peak_hbm_gib') or '-'}"
        host = f"host {row.get('plan_host_gib') or '-'} / {row.get('peak_host_gib') or '-'}"
        if rescued(row):
            return f"trained after running out of GPU memory (watchdog): {hbm}"
        mark = ""
        if not row.get("plan_hbm_est_gib"):
            mark = " (bound)"
        elif row.get("plan_hbm_est_from") == "re-planned":
            mark = " (re-planned)"
        return (
            f"trained: {hbm}{mark} ({hbm_err(row) or '-'}%), "
            f"{host} ({row.get('host_err_pct') or '-'}%)"
        )
    if status == "refused":
        return f"refused (plan HBM {row.get('verdict_hbm_gib') or '-'} GiB)"
    return f"**{status}**" if status in FAILURES else status


def _steps_text(row: dict) -> str:
    """``warm-up + measured`` steps of a row (``1 + 1``), "" when not recorded."""
    warmup, steps = row.get("warmup"), row.get("steps")
    return f"{warmup} + {steps}" if warmup not in (None, "") and steps not in (None, "") else ""


def promise_line(rows: list[dict]) -> str:
    cells = list(latest_cells(rows).values())
    count = {s: sum(1 for r in cells if r["status"] == s) for s in ("trained", "refused")}
    count[NOT_RUN] = sum(1 for r in cells if r["status"] in BUDGET)
    failed = [r for r in cells if r["status"] in FAILURES]
    saved = [r for r in cells if r["status"] == "trained" and rescued(r)]
    errs = {
        "hbm": [abs(v) for r in cells if not rescued(r) and (v := _num(hbm_err(r))) is not None],
        "host": [abs(v) for r in cells if (v := _num(r.get("host_err_pct"))) is not None],
    }
    worst = {col: max(v) if v else None for col, v in errs.items()}
    off = [col for col, w in worst.items() if w is not None and w > 10]
    verdict = (
        "broken"
        if failed or off or saved
        else ("holds so far (cells not run)" if count[NOT_RUN] else "holds")
    )
    parts = ", ".join(f"max |{col} err| {w:.1f}%" for col, w in worst.items() if w is not None)
    return (
        f"promise {verdict}: {len(cells)} cells, {count['trained']} trained"
        + (f" ({len(saved)} after running out of GPU memory)" if saved else "")
        + f", {count['refused']} refused, {len(failed)} failed"
        + (f" ({', '.join(sorted({r['status'] for r in failed}))})" if failed else "")
        + f", {count[NOT_RUN]} not run (budget)"
        + (f"; {parts}" if parts else "")
    )


def summarize(rows: list[dict], title: str = "Validation matrix") -> str:
    """The matrix as markdown: family x sequence length, then one line per cell."""
    cells = latest_cells(rows)
    families = list(dict.fromkeys(f for f, _ in cells))
    lens = sorted({s for _, s in cells})
    models = {f: r["model"] for (f, _), r in cells.items()}
    commits = sorted({r.get("commit", "") for r in cells.values()} - {""})
    gpus = sorted({r.get("gpu", "") for r in cells.values()} - {""})
    tags = sorted({r.get("tag", "") for r in cells.values()} - {""})
    steps = sorted({_steps_text(r) for r in cells.values()} - {""})
    lines = [
        f"# {title}",
        "",
        f"- tags: {', '.join(tags) or '-'}; commits: {', '.join(commits) or '-'}; "
        f"GPU: {', '.join(gpus) or '-'}",
        f"- hf_megatrain defaults (bench.py system `{SYSTEM}`, no engine flag), random init "
        "(`--streamed-init`), bf16, one sequence per step, grad-accum 1; steps (warm-up + "
        f"measured): {', '.join(steps) or '-'}",
        "- a cell: status; planned / measured peak HBM (torch max reserved) and host (VmHWM) in "
        "GiB, error = planned / measured - 1; the planned HBM peak is the plan's expected one "
        "(its bound, which a fit is judged by, adds a margin for each estimate's measured error); "
        "rows recorded before the run recorded its expected peak are re-planned by the current "
        "planner for their run (marked re-planned: their placement and kept layers, on the first "
        "step's footing where only one step ran); the promise: every cell trained or refused "
        "before allocation, none ran out of GPU memory (also not one the out-of-memory watchdog "
        "rescued), every error within 10%; the cells' table adds the bound and the allocated "
        "peak (torch max allocated: the live tensors) where recorded",
        "",
        "| family (model) | " + " | ".join(seq_label(s) for s in lens) + " |",
        "|---" * (len(lens) + 1) + "|",
    ]
    for f in families:
        texts = [_cell_text(cells[f, s]) if (f, s) in cells else "" for s in lens]
        lines.append(f"| {f} ({models[f]}) | " + " | ".join(texts) + " |")
    lines += ["", f"**{promise_line(rows)}**", ""]
    lines += [
        f"- {f}: {FAMILIES[f][1]} (`benchmarks/configs/{models[f]}`)"
        for f in families
        if f in FAMILIES and FAMILIES[f][0] == models[f]
    ]
    lines += ["", "## Cells", ""]
    lines += [
        "| cell | status | wall s | step s | HBM layers | plan HBM | bound | HBM | err % | "
        "HBM alloc | plan host | host | err % | auto-fit | detail |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (f, s), r in sorted(cells.items(), key=lambda kv: (families.index(kv[0][0]), kv[0][1])):
        detail = (r.get("detail") or "").replace("|", "/")
        lines.append(
            f"| {f} {seq_label(s)} | {r['status']} | {r.get('wall_s', '')} | "
            f"{r.get('step_time_s', '')} | {r.get('hbm_layers', '')} | "
            f"{r.get('plan_hbm_est_gib', '')} | {r.get('plan_hbm_gib', '')} | "
            f"{r.get('peak_hbm_gib', '')} | {hbm_err(r) if r['status'] == 'trained' else ''} | "
            f"{r.get('peak_hbm_alloc_gib', '')} | "
            f"{r.get('plan_host_gib', '')} | "
            f"{r.get('peak_host_gib', '')} | {r.get('host_err_pct', '')} | "
            f"{r.get('auto_fit', '')} | {detail} |"
        )
    return "\n".join(lines) + "\n"


def read_rows(paths: list[Path], tags: list[str] | None) -> list[dict]:
    """The matrix rows (those with a family) of the CSVs, in order, of ``tags`` if given."""
    rows = []
    for path in paths:
        with path.open(newline="") as f:
            rows += [r for r in csv.DictReader(f) if r.get("family")]
    return [r for r in rows if not tags or r.get("tag") in tags]


# ---- command line ----------------------------------------------------------------------------
def _csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _cells(text: str) -> list[tuple[str, int]]:
    out = []
    for spec in _csv_list(text):
        family, sep, length = spec.partition(":")
        if not sep or not family:
            raise argparse.ArgumentTypeError(f"--cells {spec!r}: want FAMILY:LEN, e.g. phi3:256k")
        out.append((family, parse_seq_len(length)))
    return out


def _phase(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--phase {text!r}: want K/N, e.g. 1/2") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--phase {text!r}: need 1 <= K <= N")
    return k, n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--families",
        type=_csv_list,
        default=list(FAMILIES),
        help=f"comma list of {', '.join(FAMILIES)} (and names given by --config)",
    )
    p.add_argument(
        "--seq-lens",
        type=lambda t: [parse_seq_len(x) for x in _csv_list(t)],
        default=list(SEQ_LENS),
        help="comma list of tokens per sequence (4096 or 4k); default 4k,32k,128k,256k",
    )
    p.add_argument(
        "--cells",
        type=_cells,
        default=None,
        metavar="FAMILY:LEN,...",
        help="only these cells, e.g. mistral:32k,phi3:256k (instead of --families x --seq-lens)",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FAMILY=MODEL",
        help="the config (name under benchmarks/configs/ or a folder) a family runs; a new "
        "family name adds a family (repeatable)",
    )
    p.add_argument("--phase", type=_phase, default=(1, 1), help="K/N: the K-th of N phases")
    p.add_argument(
        "--max-wall-s", type=float, default=520.0, help="budget; later cells: not run (budget)"
    )
    p.add_argument(
        "--cell-timeout-s", type=float, help="per cell (default: twice its estimate, >= 90 s)"
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument(
        "--steps", type=int, default=MEASURED_STEPS, help="measured steps per cell (default 1)"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=WARMUP_STEPS,
        help="untimed steps first (default 1: the peak then holds the resident parameters' "
        "AdamW moments, made by the first update)",
    )
    p.add_argument("--tag", help="rows' tag (default: matrix); with --summarize: a comma list")
    p.add_argument("--results-dir", type=Path, default=bench.RESULTS_DIR / "matrix")
    p.add_argument("--dry-run", action="store_true", help="list the cells, verdicts, estimates")
    p.add_argument("--hbm-gib", type=float, default=H200_HBM_GIB, help="verdicts' free HBM")
    p.add_argument("--host-gib", type=float, default=H200_HOST_GIB, help="verdicts' host RAM")
    p.add_argument("--tflops", type=float, default=TFLOPS, help="estimates' TFLOP/s")
    p.add_argument(
        "--summarize", type=Path, nargs="+", metavar="CSV", help="write the matrix of CSV(s)"
    )
    p.add_argument("--markdown", type=Path, help="with --summarize: output (default: stdout)")
    return p


def models_from_args(a: argparse.Namespace) -> dict[str, str]:
    models = {f: m for f, (m, _) in FAMILIES.items()}
    for spec in a.config:
        family, sep, model = spec.partition("=")
        if not sep or not family or not model:
            raise SystemExit(f"bad --config {spec!r}: want FAMILY=MODEL")
        models[family] = model
    for f in a.families + [f for f, _ in a.cells or []]:
        if f not in models:
            raise SystemExit(f"unknown family {f!r}; known: {', '.join(models)}")
        bench.model_config_path(models[f])  # fail now, not in the middle of the matrix
    return models


def planned_cells(a: argparse.Namespace) -> list[Cell]:
    models = models_from_args(a)
    if a.cells:
        cells = [Cell(f, models[f], s) for f, s in a.cells]
    else:
        cells = make_cells(a.families, a.seq_lens, models)
    for cell in cells:
        plan_cell(cell, a.hbm_gib, a.host_gib, a.tflops, a.warmup + a.steps)
    assign_phases(cells, a.phase[1])
    return cells


def dry_run_text(cells: list[Cell], a: argparse.Namespace) -> str:
    lines = [
        f"matrix: {len(cells)} cells; verdicts for {a.hbm_gib:g} GiB HBM, {a.host_gib:g} GiB "
        f"host, defaults; estimates at {a.tflops:g} TFLOP/s",
        f"{'cell':<14} {'model':<24} {'params':>7} {'est s':>6} {'phase':>5}  verdict",
    ]
    for c in sorted(cells, key=lambda c: (c.phase, c.est_s, c.seq_len)):
        lines.append(
            f"{c.name:<14} {c.model:<24} {c.params / 1e9:6.2f}B {c.est_s:6.0f} {c.phase:>5}  "
            f"{c.verdict[:220]}"
        )
    n = a.phase[1]
    for k in range(1, n + 1):
        est = sum(c.est_s for c in cells if c.phase == k)
        count = sum(1 for c in cells if c.phase == k)
        lines.append(f"matrix: phase {k}/{n}: {count} cells, estimated {est:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    if a.summarize:
        rows = read_rows(a.summarize, _csv_list(a.tag) if a.tag else None)
        if not rows:
            where = ", ".join(map(str, a.summarize))
            raise SystemExit(f"no matrix rows in {where}" + (f" tagged {a.tag}" if a.tag else ""))
        text = summarize(
            with_expected_peaks(rows),
            title=f"Validation matrix `{a.tag}`" if a.tag else "Validation matrix",
        )
        if a.markdown:
            a.markdown.write_text(text)
            print(f"matrix: wrote {a.markdown}")
        else:
            print(text, end="")
        return 0
    cells = planned_cells(a)
    if a.dry_run:
        print(dry_run_text(cells, a))
        return 0
    k, n = a.phase
    mine = [c for c in cells if c.phase == k]
    est = sum(c.est_s for c in mine)
    print(
        f"matrix: phase {k}/{n}: {len(mine)} cells, estimated {est:.0f} s, budget "
        f"{a.max_wall_s:g} s",
        flush=True,
    )
    rows = run_matrix(
        mine,
        tag=a.tag or "matrix",
        results_dir=a.results_dir,
        max_wall_s=a.max_wall_s,
        cell_timeout_s=a.cell_timeout_s,
        device=a.device,
        steps=a.steps,
        warmup=a.warmup,
        argv=shlex.join(["python3", "benchmarks/validation_matrix.py", *argv]),
    )
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
