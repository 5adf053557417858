"""The longest trainable sequence per model and system, from the one-sequence rows of a CSV.

    python3 benchmarks/longest_table.py [results.csv] [--markdown OUT.md]

A row counts when it trained one sequence per optimizer step (``seq_len == tokens_per_step``,
micro-batch 1, no accumulation). Per (model, system): the longest sequence that trained
(status ok) and the shortest that ran out of GPU or host memory (``oom-*``, or ``killed``
by the host's OOM killer; timeouts say nothing about memory), each with its sweep tag, so the table says how tight the measured bound is. For hf_megatrain it also gives
the memory planner's ceiling on the H200 (139.3 GiB free HBM, 124 GiB host RAM) with every
long-context option on (MLP tiles of 16k, bf16 boundaries offloaded to host, checkpoint
segments of 2, no clipping, fp32 masters streamed): a plan, labelled as one, not a run.
hf_megatrain's exact rows (fp32 boundary activations, clipping on: no bf16 boundaries or
no-clip in the command or in what auto_fit turned on) get a line of their own, with the
ceiling of its defaults (auto_fit exact, the layer kernels a CUDA run picks).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR.parent) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR.parent))

from benchmarks.report import H200_FREE_HBM_GIB, table_main  # noqa: E402

#: The (model, system) key of hf_megatrain's exact rows.
EXACT = "megatrain-hbm exact"
SYSTEM_NAMES = {
    "megatrain-hbm": "hf_megatrain",
    EXACT: "hf_megatrain, exact (fp32 boundaries, clipping on)",
    "megatrain": "hf_megatrain (all streamed)",
    "stock": "stock in-GPU",
    "deepspeed": "DeepSpeed ZeRO-3 offload",
}
H200_HOST_GIB = 124.0
#: What makes a row approximate, in its command or in the options auto_fit turned on.
APPROXIMATE_FLAGS = ("--bf16-boundaries", "--boundary-dtype bfloat16", "--boundary-dtype bf16",
                     "--no-clip")  # fmt: skip


def _options(row: dict) -> str:
    """The memory options a row ran with: its command's flags and what auto_fit turned on
    (the note's ``auto-fit: ...`` part)."""
    auto_fit = row.get("note", "").partition("auto-fit:")[2].partition(";")[0]
    return f"{row.get('command', '')} {auto_fit}"


def is_exact(row: dict) -> bool:
    """An hf_megatrain row trained with fp32 boundaries and clipping on."""
    return not any(flag in _options(row) for flag in APPROXIMATE_FLAGS)


def _one_sequence(row: dict) -> bool:
    try:
        return (
            int(row["seq_len"]) == int(row["tokens_per_step"])
            and int(row.get("micro_batch") or 1) == 1
            and int(row.get("grad_accum") or 1) == 1
        )
    except ValueError:
        return False


def _no_runs() -> dict:
    """A (model, system) entry before any row: no longest ok, no shortest failed."""
    return {"ok": None, "ok_tag": "", "ok_hbm": "", "failed": None, "fail": ""}


def longest(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """Per (model, system): longest ok sequence and shortest failed one, with their tags."""
    out: dict[tuple[str, str], dict] = {}
    for row in rows:
        if not _one_sequence(row) or not row.get("status"):
            continue
        keys = [(row["model"], row["system"])]
        if row["system"] == "megatrain-hbm" and is_exact(row):
            keys.append((row["model"], EXACT))
        for key in keys:
            _count(out.setdefault(key, _no_runs()), row)
    # A failure at or below a success is not a bound (a run with fewer memory options on).
    for entry in out.values():
        if (
            entry["ok"] is not None
            and entry["failed"] is not None
            and entry["failed"] <= entry["ok"]
        ):
            entry.update(failed=None, fail="")
    return out


def _count(entry: dict, row: dict) -> None:
    """Let one row's outcome move its entry's longest ok or shortest failed sequence."""
    seq = int(row["seq_len"])
    if row["status"] == "ok":
        if entry["ok"] is None or seq > entry["ok"]:
            entry.update(ok=seq, ok_tag=row.get("tag", ""), ok_hbm=row.get("peak_hbm_gib", ""))
        return
    if not row["status"].startswith(("oom", "killed")):
        return  # a timeout or an error says nothing about memory (killed: host OOM killer)
    if row["system"].startswith("megatrain") and "--offload-activations" not in _options(row):
        return  # hf_megatrain with its long-context memory options off: not its limit
    if entry["failed"] is None or seq < entry["failed"]:
        entry.update(failed=seq, fail=f"{row['status']} ({row.get('tag', '')})")


def planned_ceiling(model: str) -> int:
    """The planner's longest single sequence for ``model`` with every long-context option."""
    import torch

    from benchmarks import bench
    from hf_megatrain.core.options import EngineOptions
    from hf_megatrain.core.planner import GIB, max_seq_len
    from hf_megatrain.hf.model import model_shape_from_config

    shape = model_shape_from_config(bench.load_model_config(model), model)
    options = EngineOptions(
        mlp_tile_tokens=16384,
        offload_activations=True,
        boundary_dtype="bfloat16",
        checkpoint_every=2,
        stream_fp32_master=True,
    ).resolve(clipping=False, cuda=True, single_backward=True)
    return max_seq_len(
        shape,
        1,
        options,
        torch.bfloat16,
        int(H200_FREE_HBM_GIB * GIB),
        int(H200_HOST_GIB * GIB),
        multiple=16384,
    )


def planned_exact_ceiling(model: str) -> int:
    """The longest single sequence ``model``'s defaults train exactly on the H200: auto_fit
    exact, clipping on, the layer kernels a CUDA run picks (``plan``'s own shape)."""
    import torch

    from benchmarks import bench
    from hf_megatrain.cli_plan import planned_kernel_shape
    from hf_megatrain.core.options import EngineOptions, StepShape
    from hf_megatrain.core.planner import GIB, longest_auto_fit_row

    shape, _ = planned_kernel_shape(bench.load_model_config(model), model)
    longest_tried = 1 << 23  # the search's upper end: 8M tokens
    return longest_auto_fit_row(
        shape,
        StepShape(longest_tried, longest_tried, 1),
        # One sequence per step on one GPU: one backward, so bf16 gradient slots.
        EngineOptions().resolve(clipping=True, cuda=True, single_backward=True),
        torch.bfloat16,
        int(H200_FREE_HBM_GIB * GIB),
        int(H200_HOST_GIB * GIB),
        multiple=16384,
    )


def _k(n: int | None) -> str:
    return "" if n is None else f"{n:,}"


def markdown(
    table: dict[tuple[str, str], dict],
    plans: dict[str, int],
    exact_plans: dict[str, int] | None = None,
) -> str:
    """The table; ``plans``: each model's planned ceiling with every long-context option,
    ``exact_plans``: with its defaults, exactly (the exact line's)."""
    exact_plans = exact_plans or {}
    lines = [
        "One sequence per optimizer step; measured rows of results.csv (sweep tags), and the "
        "planner's ceiling for hf_megatrain (H200: 139.3 GiB HBM, 124 GiB host; MLP tiles, bf16 "
        "boundaries offloaded, segments of 2, no clipping, fp32 masters streamed). The exact "
        "lines count only runs with fp32 boundaries and clipping on; their ceiling is the "
        "defaults' (auto_fit exact).",
        "",
        "| model | system | longest trained (tokens) | sweep | shortest failed (tokens) | how "
        "| planner's ceiling |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = dict(table)
    for model in plans:  # a model with no hf_megatrain run still gets its planned ceiling
        rows.setdefault((model, "megatrain-hbm"), _no_runs())
    for model in exact_plans:
        rows.setdefault((model, EXACT), _no_runs())
    ceilings = {"megatrain-hbm": plans, EXACT: exact_plans}
    for (model, system), e in sorted(rows.items()):
        plan = _k(ceilings.get(system, {}).get(model))
        how = e["fail"]
        if e["failed"] is None and e["ok"] is not None:
            # No longer run failed: the longest trained one is a lower bound, said as such.
            how = f"none longer run (peak HBM {e['ok_hbm'] or '?'} GiB at the longest)"
        lines.append(
            f"| {model} | {SYSTEM_NAMES.get(system, system)} | {_k(e['ok']) or 'none'} | "
            f"{e['ok_tag']} | {_k(e['failed'])} | {how} | {plan} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    def render(path: Path) -> str:
        with path.open(newline="") as f:
            table = longest(list(csv.DictReader(f)))
        models = sorted({m for m, _ in table})
        return markdown(
            table,
            {m: planned_ceiling(m) for m in models},
            {m: planned_exact_ceiling(m) for m, s in table if s == EXACT},
        )

    return table_main(__doc__, render, argv)


if __name__ == "__main__":
    sys.exit(main())
