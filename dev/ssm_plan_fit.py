"""Fit the state-space (Mamba) layers' memory beyond the plan's shared lines (CPU, minutes).

For each model type given: its tiny test config at real models' proportions
(``tests/test_plan_accuracy.py::family_config`` and ``ssm_widths``) over a grid of mixer widths
(hidden, head width, state, groups, chunk), one streamed step of one sequence of ``T`` and ``2T``
tokens under the CPU live-tensor tracker (``step_vs_plan``), against the plan. The growth per
token of measured minus planned is what the plan misses per token; it is fitted by least
squares on the mixer's per-token sizes (``l h``: the chunk's scores per head, ``h n``: B and C
repeated to every head, ``d``: the inner width, ``g n``: B and C per group, ``h p n / l``: the
chunk states). Prints each point and the fit; ``--check`` prints planned / measured with
the plan as it stands.

    python3 dev/ssm_plan_fit.py bamba mamba2 [--tokens 1024] [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_megatrain.core.chunked_loss as chunked_loss  # noqa: E402
from tests.test_plan_accuracy import (  # noqa: E402
    _cuda_fp32_gemm,
    family_config,
    ssm_widths,
    step_vs_plan,
)

#: Families without attention layers (their classes refuse SDPA).
ATTENTIONLESS = ("mamba", "mamba2", "falcon_mamba")
#: Mamba-1's selective scan (its basis: inner x state, inner, hidden).
MAMBA1 = ("mamba", "falcon_mamba", "jamba")
#: (hidden, head width, state, groups, chunk)
GRID = [
    (256, 32, 64, 1, 64), (256, 32, 32, 1, 64), (256, 16, 64, 1, 64), (256, 32, 64, 2, 64),
    (256, 32, 64, 1, 128), (384, 32, 64, 1, 64), (512, 64, 64, 2, 128), (256, 64, 128, 1, 32),
]  # fmt: skip


def point(model_type: str, widths: tuple, tokens: int) -> dict:
    h, p, n, g, chunk = widths
    cfg = family_config(model_type, h, max(1, h // 64), 1, 64, 3 * h, layers=3,
                        positions=4 * tokens)  # fmt: skip
    ssm_widths(cfg, h, p, n, g, chunk)
    attn = "eager" if model_type in ATTENTIONLESS else "sdpa"
    small = step_vs_plan(cfg, tokens, attn)
    large = step_vs_plan(cfg, 2 * tokens, attn)
    heads = 2 * h // p
    if model_type in MAMBA1:  # the selective scan: inner width x state, inner width, hidden
        inner = cfg.intermediate_size if model_type != "jamba" else 2 * h
        basis = [inner * (n // 8), inner, h]
    else:
        basis = [chunk * heads, heads * n, 2 * h, g * n, heads * p * n / chunk]
    per_token = (large["measured"] - large["planned"]) - (small["measured"] - small["planned"])
    return {
        "basis": basis,
        "miss_per_token": per_token / tokens,
        "ratio": large["measured"] / large["planned"],
        "margin": large["margin"] / large["planned"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_types", nargs="+")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--check", action="store_true", help="planned / measured only, no fit")
    args = ap.parse_args(argv)
    chunked_loss.add_product_fp32 = _cuda_fp32_gemm
    for mt in args.model_types:
        rows = []
        for widths in GRID:
            r = point(mt, widths, args.tokens)
            rows.append(r)
            print(f"{mt} {widths}: missed {r['miss_per_token']:.0f} B/token, measured / planned "
                  f"{r['ratio']:.3f} (margin {r['margin']:.3f})", flush=True)  # fmt: skip
        if args.check:
            continue
        a = np.array([r["basis"] for r in rows], dtype=float)
        b = np.array([r["miss_per_token"] for r in rows])
        coef, *_ = np.linalg.lstsq(a, b, rcond=None)
        fit = a @ coef
        names = (
            "[inner*state, inner, hidden]"
            if mt in MAMBA1
            else "[l*heads, heads*state, inner, groups*state, states per chunk token]"
        )
        print(f"{mt}: B/token = {coef.round(3).tolist()} . {names}; worst residual "
              f"{np.max(b - fit):.0f} B/token")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
