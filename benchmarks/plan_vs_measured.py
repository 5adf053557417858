"""The memory planner's peaks against the measured ones, for every hf_megatrain row of a CSV.

    python3 benchmarks/plan_vs_measured.py [results.csv] [--markdown OUT.md]

For each successful ``megatrain`` / ``megatrain-hbm`` row, the current planner plans that run
(model config, step split, engine options and the row's layer placement: its ``hbm_layers``
column, 0 for all-streamed runs, or what the fixed-reserve "auto" of older commits chose) and
its GPU total and host peak estimate are set beside the measured ``peak_hbm_gib``
(``torch.cuda.max_memory_reserved``) and ``peak_host_gib`` (VmHWM). The GPU total leaves out
what the plan puts outside PyTorch's allocator (data parallel's NCCL buffers), which
max_memory_reserved cannot see. Rows measured before the
planner was calibrated on them are calibration points, later ones tests of it: the ``commit``
column says which is which.
"""

from __future__ import annotations

import csv
import re
import sys
from dataclasses import replace
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR.parent) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR.parent))

from benchmarks.report import H200_FREE_HBM_GIB, table_main  # noqa: E402

# Reserve of the fixed-reserve "auto" placement used before plan_workload (commits <= 208ecd8).
OLD_AUTO_RESERVE_GIB = 48.0


def _flag(command: str, name: str) -> str | None:
    parts = command.split()
    return parts[parts.index(name) + 1] if name in parts else None


def _engine_options(command: str):
    """The engine options of a recorded ``bench.py`` command (its flags of the time), for the
    plan: kept activations from the row's own column, so none here."""
    from hf_megatrain.core.options import EngineOptions

    return EngineOptions(
        mlp_tile_tokens=int(_flag(command, "--mlp-tile-tokens") or 0),
        offload_activations="--offload-activations" in command,
        boundary_dtype="bfloat16" if "--bf16-boundaries" in command else "input",
        checkpoint_every=int(_flag(command, "--checkpoint-every") or 1),
        keep_attention_outputs=_flag(command, "--keep-attention-outputs") or "off",
        recompute_early_stop="--no-recompute-early-stop" not in command,
        stream_fp32_master="--stream-fp32-master" in command,
        hbm_cast_weights="--hbm-cast-weights" in command,
        keep_activations="off",
    )


def plan_row(row: dict):
    """The current planner's plan for the run a CSV row describes."""
    import torch

    from benchmarks import bench
    from hf_megatrain.core.options import EngineOptions, StepShape
    from hf_megatrain.core.planner import GIB, plan_memory
    from hf_megatrain.hf.model import model_shape_from_config

    cfg = bench.load_model_config(row["model"])
    shape = model_shape_from_config(cfg, row["model"])
    command = row.get("command", "")
    note = row.get("note", "")
    # The fused kernels' smaller kept activations: --liger, or chosen by layer_kernels "auto".
    if "--liger" in command.split() or "Liger-Kernel layer kernels" in note:
        shape = replace(shape, fused_layer_kernels=True)
    seq = int(row["seq_len"])
    micro = int(row["micro_batch"])
    step = StepShape(seq_len=seq, micro_batch_tokens=micro * seq, grad_accum=int(row["grad_accum"]))
    engine = _engine_options(command)
    attention = re.search(r"attention outputs kept: (\d+) layers", note)
    if attention:  # chosen by keep_attention_outputs "auto": the count the run kept
        engine = engine.with_(keep_attention_outputs=attention[1])
    kept = int(row.get("kept_layers") or 0)  # rows before the column kept none
    options = engine.with_(keep_activations=str(kept)).resolve(
        clipping="--no-clip" not in command, cuda=True
    )
    # Without --streamed-init the benchmark builds the fp32 model on the host first.
    input_model_bytes = 0 if "--streamed-init" in command else 4 * shape.total_numel
    hbm, host = int(H200_FREE_HBM_GIB * GIB), 1 << 50
    if row["system"] == "megatrain":
        n_hbm = 0
    elif row.get("hbm_layers"):
        n_hbm = int(row["hbm_layers"])
    else:  # older rows: the fixed-reserve "auto" decided
        old_auto = EngineOptions().resolve(clipping=True, cuda=True)
        n_hbm = plan_memory(
            shape, None, old_auto, torch.bfloat16, hbm, host,
            reserve_bytes=int(OLD_AUTO_RESERVE_GIB * GIB),
        ).n_hbm  # fmt: skip
    dp = re.search(r"-dp(\d+)$", row["system"])  # bench_dp rows: the host total of N ranks
    return plan_memory(
        shape,
        step,
        options,
        torch.bfloat16,
        hbm,
        host,
        hbm_layers=n_hbm,
        input_model_bytes=input_model_bytes,
        ranks=int(dp[1]) if dp else 1,
    )


def compare(csv_path: Path) -> list[dict]:
    from hf_megatrain.core.planner import GIB, NCCL_LINE

    out = []
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        if not row["system"].startswith("megatrain") or row["status"] != "ok":
            continue
        if not row.get("peak_hbm_gib") or row.get("gpu", "cpu") == "cpu":
            continue
        plan = plan_row(row)
        hbm, host = float(row["peak_hbm_gib"]), float(row["peak_host_gib"])
        outside = sum(ln.nbytes for ln in plan.gpu_lines if ln.name == NCCL_LINE)
        p_hbm, p_host = (plan.gpu_total - outside) / GIB, plan.host_peak_estimate / GIB
        out.append(
            dict(
                commit=row["commit"],
                tag=row.get("tag", ""),
                system=row["system"],
                model=row["model"],
                seq_len=int(row["seq_len"]),
                tokens_per_step=int(row["tokens_per_step"]),
                hbm_layers=plan.n_hbm,
                hbm_gib=hbm,
                plan_hbm_gib=p_hbm,
                hbm_err=p_hbm / hbm - 1,
                host_gib=host,
                plan_host_gib=p_host,
                host_err=p_host / host - 1,
                # The run recorded its own plan: workload-aware placement and expandable
                # segments (both from commit d822e80 on), the configuration the planner models.
                planned_run=bool(row.get("plan_hbm_gib")),
                # A measurement known to be wrong (the row's note says so): shown, not judged.
                bad_measurement="undercounted" in row.get("note", ""),
                # The engine of the run's commit did something the planner does not model (a
                # bug since fixed; the row's note says what): shown, not judged.
                superseded="engine fixed" in row.get("note", ""),
            )
        )
    return out


def markdown(results: list[dict]) -> str:
    lines = [
        "Rows marked * recorded no plan of their own: those before commit d822e80 ran before "
        "the CUDA allocator used expandable segments and before HBM placement was planned from "
        "the batch, so their HBM peaks include cached, unusable segments the planner does not "
        "model; h200-h (c8a4bff) did run with both but its row was restored from its markdown "
        "summary. Placement for old rows: the fixed-reserve 'auto' of their time. Rows marked "
        "** have a host peak known to be undercounted (first data-parallel rows: per-rank RSS "
        "minus shared RSS dropped the other rank's shared-memory moments; re-measured as the "
        "ranks' summed Pss in the dphost rows). Rows marked *** ran an engine that did "
        "something the planner does not model, since fixed (long7b-0759 at 21c5b8e: activation "
        "offload copied the RoPE cos/sin tables, the same fp32 tensor for every layer, to the "
        "host once per layer, 14 GiB at 524,288 tokens; from the next commit only the residual "
        "stream is offloaded).",
        "",
        "| commit | tag | system | model | seq | tokens/step | HBM layers | HBM GiB meas. | planned "
        "| err | host GiB meas. | planned | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['commit']}{'' if r['planned_run'] else ' *'}{' **' if r['bad_measurement'] else ''}{' ***' if r['superseded'] else ''} | {r['tag']} | {r['system']} | {r['model']} | {r['seq_len']} | "
            f"{r['tokens_per_step']} | {r['hbm_layers']} | {r['hbm_gib']:.2f} | "
            f"{r['plan_hbm_gib']:.2f} | {100 * r['hbm_err']:+.1f}% | {r['host_gib']:.2f} | "
            f"{r['plan_host_gib']:.2f} | {100 * r['host_err']:+.1f}% |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return table_main(__doc__, lambda path: markdown(compare(path)), argv)


if __name__ == "__main__":
    sys.exit(main())
