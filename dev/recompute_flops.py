"""Re-derive recorded rows' model TFLOP/s and MFU with hf_megatrain.hf.flops (2026-12-03).

The earlier formula counted 6 x all parameters (an MoE's unrouted experts too) and full causal
attention 6 L h s per token (layers with a sliding window too, heads x head_dim taken as h).
tokens/s is the measurement and stays; only the two derived columns change, and a changed row
says so in its note. Rows whose stored MFU is not the old formula (e.g. DPO) are left alone.

    python3 dev/recompute_flops.py benchmarks/results/results.csv benchmarks/results/validation_matrix.csv
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import bench  # noqa: E402
from hf_megatrain.hf.flops import active_params, model_flops_per_token  # noqa: E402

NOTE = "model_tflops/mfu re-derived 2026-12-03 (active experts, attention within windows)"


def main(paths: list[str]) -> None:
    cache: dict[tuple[str, int], tuple[int, int, float]] = {}
    for path in map(Path, paths):
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            fields, rows = reader.fieldnames, list(reader)
        changed = 0
        for row in rows:
            if not (row.get("mfu") and row.get("tokens_per_s")) or "H200" not in row["gpu"]:
                continue
            key = (row["model"], int(row["seq_len"]))
            if key not in cache:
                config = bench.load_model_config(row["model"])
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(config)
                total = sum(p.numel() for p in model.parameters())
                cache[key] = (total, active_params(model), model_flops_per_token(model, key[1]))
                old_attn = 6 * config.num_hidden_layers * config.hidden_size * key[1]
                cache[key] += (6 * total + old_attn,)
            total, active, per_token, old_per_token = cache[key]
            tps = float(row["tokens_per_s"])
            per_gpu = tps / bench.gpus_of(row["system"])
            old = bench.mfu(old_per_token, per_gpu)
            if abs(old - float(row["mfu"])) > 0.01 * old + 1e-4:
                print(f"left alone (not the old formula): {row['tag']} {row['system']} {key}")
                continue
            mfu, tflops = bench.mfu(per_token, per_gpu), bench.model_tflops(active, tps)
            if abs(mfu - old) <= 5e-4 * old and active == total:
                continue
            if (row["mfu"], row["model_tflops"]) == (f"{mfu:.4f}", f"{tflops:.2f}"):
                continue  # re-derived by an earlier pass
            print(
                f"{row['tag']} {row['system']} {key}: mfu {row['mfu']} -> {mfu:.4f}, "
                f"model TFLOP/s {row['model_tflops']} -> {tflops:.2f}"
            )
            row["mfu"], row["model_tflops"] = f"{mfu:.4f}", f"{tflops:.2f}"
            if NOTE not in row.get("note", ""):
                row["note"] = "; ".join(x for x in (row.get("note", ""), NOTE) if x)
            changed += 1
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
        print(f"{path}: {changed} rows re-derived")


if __name__ == "__main__":
    main(sys.argv[1:])
