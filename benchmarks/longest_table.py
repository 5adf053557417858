"""The longest trainable sequence per model and system, from the one-sequence rows of a CSV.

    python3 benchmarks/longest_table.py [results.csv] [--markdown OUT.md]

A row counts when it trained one sequence per optimizer step (``seq_len == tokens_per_step``,
micro-batch 1, no accumulation). Per (model, system): the longest sequence that trained
(status ok) and the shortest that ran out of GPU or host memory (``oom-*``, or ``killed``
by the host's OOM killer; timeouts say nothing about memory), each with its sweep tag, so the table says how tight the measured bound is. For hf_megatrain it also gives
the memory planner's ceiling on the H200 (139.3 GiB free HBM, 124 GiB host RAM) with every
long-context option on (MLP tiles of 16k, bf16 boundaries offloaded to host, checkpoint
segments of 2, no clipping, fp32 masters streamed): a plan, labelled as one, not a run.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR.parent) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR.parent))

from benchmarks.report import H200_FREE_HBM_GIB, table_main  # noqa: E402

SYSTEM_NAMES = {
    "megatrain-hbm": "hf_megatrain",
    "megatrain": "hf_megatrain (all streamed)",
    "stock": "stock in-GPU",
    "deepspeed": "DeepSpeed ZeRO-3 offload",
}
H200_HOST_GIB = 124.0


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
        key = (row["model"], row["system"])
        entry = out.setdefault(key, _no_runs())
        seq = int(row["seq_len"])
        if row["status"] == "ok":
            if entry["ok"] is None or seq > entry["ok"]:
                entry.update(ok=seq, ok_tag=row.get("tag", ""), ok_hbm=row.get("peak_hbm_gib", ""))
        elif not row["status"].startswith(("oom", "killed")):
            continue  # a timeout or an error says nothing about memory (killed: host OOM killer)
        elif row["system"].startswith("megatrain") and "--offload-activations" not in row.get(
            "command", ""
        ):
            continue  # hf_megatrain with its long-context memory options off: not its limit
        elif entry["failed"] is None or seq < entry["failed"]:
            entry.update(failed=seq, fail=f"{row['status']} ({row.get('tag', '')})")
    # A failure at or below a success is not a bound (a run with fewer memory options on).
    for entry in out.values():
        if (
            entry["ok"] is not None
            and entry["failed"] is not None
            and entry["failed"] <= entry["ok"]
        ):
            entry.update(failed=None, fail="")
    return out


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
    ).resolve(clipping=False, cuda=True)
    return max_seq_len(
        shape,
        1,
        options,
        torch.bfloat16,
        int(H200_FREE_HBM_GIB * GIB),
        int(H200_HOST_GIB * GIB),
        multiple=16384,
    )


def _k(n: int | None) -> str:
    return "" if n is None else f"{n:,}"


def markdown(table: dict[tuple[str, str], dict], plans: dict[str, int]) -> str:
    lines = [
        "One sequence per optimizer step; measured rows of results.csv (sweep tags), and the "
        "planner's ceiling for hf_megatrain (H200: 139.3 GiB HBM, 124 GiB host; MLP tiles, bf16 "
        "boundaries offloaded, segments of 2, no clipping, fp32 masters streamed).",
        "",
        "| model | system | longest trained (tokens) | sweep | shortest failed (tokens) | how "
        "| planner's ceiling |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = dict(table)
    for model in plans:  # a model with no hf_megatrain run still gets its planned ceiling
        rows.setdefault((model, "megatrain-hbm"), _no_runs())
    for (model, system), e in sorted(rows.items()):
        plan = _k(plans.get(model)) if system == "megatrain-hbm" else ""
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
        return markdown(table, {m: planned_ceiling(m) for m in sorted({m for m, _ in table})})

    return table_main(__doc__, render, argv)


if __name__ == "__main__":
    sys.exit(main())
