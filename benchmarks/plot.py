#!/usr/bin/env python3
"""Plot tokens/s from benchmarks/results/results.csv: one panel per model, bars per system,
grouped by tokens per optimizer step. Failed runs show their status instead of a bar.

    python3 benchmarks/plot.py [--csv PATH] [--out PNG] [--gpu SUBSTR] [--tag TAG]

matplotlib is an optional dependency (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
SYSTEM_ORDER = ["megatrain", "deepspeed", "stock"]


def load_rows(path: Path, gpu: str | None = None, tag: str | None = None) -> list[dict]:
    """Latest row per (model, seq_len, tokens_per_step, system), after the filters."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if gpu:
        rows = [r for r in rows if gpu.lower() in r.get("gpu", "").lower()]
    if tag:
        rows = [r for r in rows if r.get("tag") == tag]
    latest: dict[tuple, dict] = {}
    for r in sorted(rows, key=lambda r: r["date"]):  # ISO dates sort chronologically
        latest[(r["model"], r["seq_len"], r["tokens_per_step"], r["system"])] = r
    return list(latest.values())


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: the GPU machine and CI have no display
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    systems = [s for s in SYSTEM_ORDER if any(r["system"] == s for r in rows)]
    systems += sorted({r["system"] for r in rows} - set(systems))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.5), squeeze=False)
    width = 0.8 / max(len(systems), 1)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        groups = sorted({(int(r["tokens_per_step"]), int(r["seq_len"])) for r in mine})
        for si, system in enumerate(systems):
            for gi, (tps, seq) in enumerate(groups):
                match = [
                    r
                    for r in mine
                    if r["system"] == system
                    and int(r["tokens_per_step"]) == tps
                    and int(r["seq_len"]) == seq
                ]
                if not match:
                    continue
                r, x = match[0], gi + (si - (len(systems) - 1) / 2) * width
                if r["status"] == "ok" and r["tokens_per_s"]:
                    value = float(r["tokens_per_s"])
                    ax.bar(x, value, width, color=f"C{si}")
                    ax.annotate(f"{value / 1e3:.1f}k", (x, value), ha="center", va="bottom",
                                fontsize=7)  # fmt: skip
                else:
                    ax.annotate(r["status"].split(" (")[0], (x, 0), ha="center", va="bottom",
                                rotation=90, fontsize=7, color=f"C{si}")  # fmt: skip
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{_tokens(tps)}\n(seq {seq})" for tps, seq in groups])
        ax.set_title(model)
        ax.set_xlabel("tokens per optimizer step")
        ax.set_ylabel("tokens/s")
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(len(systems))]
    fig.legend(handles, systems, loc="upper right")
    gpus = sorted({r.get("gpu", "") for r in rows})
    fig.suptitle("Training throughput, " + ", ".join(gpus), x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 0.9, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--csv", type=Path, default=BENCH_DIR / "results" / "results.csv")
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "tokens_per_s.png")
    p.add_argument("--gpu", help="keep rows whose gpu contains this text")
    p.add_argument("--tag", help="keep rows of this sweep tag")
    a = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot.py needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 1
    rows = load_rows(a.csv, a.gpu, a.tag)
    if not rows:
        print(f"no rows in {a.csv} after filters", file=sys.stderr)
        return 1
    plot(rows, a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
