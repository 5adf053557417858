"""Fit a family's recomputed-layer working set beyond the plan's shared line (CPU, a few minutes).

For each model type given: its tiny test config at six widths (hidden 256-512, the MLP 2-6x the
hidden size, five of them 3x or more: the fit's; head counts and widths varied apart where the
family allows), three streamed layers,
one sequence of 512 and 1,024 tokens, bf16 autocast, untiled, PyTorch's kernels; the middle
layer's backward per token from the profiler's allocation timeline
(``tests/test_plan_accuracy.py::recomputed_layer_growth``), against the plan's working-set line
without the family's own term. Prints, per family, the least-squares residual
``ch x h + cq x q + ckv x kv + ci x i`` (quarter bytes) and the constant that makes it an upper
bound at every width: the row of ``hf/family_memory.py::FITTED_WORKING_SET_RESIDUALS``. Then
each width's planned / measured with that row (``--check`` at other widths: the plan as it stands).

    python3 dev/family_working_set_fit.py olmo2 phi gptj
    python3 dev/family_working_set_fit.py --check --widths 320,5,1,64,1280 olmo2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_megatrain.core.activation_memory import _working_set_line  # noqa: E402
from tests.test_plan_accuracy import family_config, recomputed_layer_growth  # noqa: E402

#: (hidden, heads, kv heads, head_dim, intermediate): families whose head_dim is hidden / heads
#: take these heads at that width.
WIDTHS = [
    (256, 4, 2, 64, 768), (256, 8, 2, 64, 768), (256, 4, 4, 64, 768), (256, 4, 2, 64, 1024),
    (384, 6, 2, 64, 768), (512, 8, 4, 64, 1536),
]  # fmt: skip


def measure(model_type: str, widths) -> dict:
    """Per-token growth of the middle layer's backward, the plan's line and its family term."""
    cfg = family_config(model_type, *widths)
    grown = {t: recomputed_layer_growth(cfg, "torch", t, keep_outputs=False) for t in (512, 1024)}
    shape = grown[1024][1]
    lines = {
        t: _working_set_line(shape, t, 0, keeps_attention_output=False, shared_casts=True)
        for t in (512, 1024)
    }
    return {
        "h": shape.hidden_size, "q": shape.num_heads * shape.head_dim, "kv": shape.kv_size,
        "i": shape.intermediate_size,
        "measured": (grown[1024][0] - grown[512][0]) / 512,
        "line": (lines[1024].nbytes - lines[512].nbytes) / 512,
        "family": shape.extra_working_set_bytes_per_token,
    }  # fmt: skip


def fit(rows: list[dict]) -> tuple[list[float], int]:
    """Quarter-byte least-squares coefficients of (h, q, kv, i) for the residual over the line
    without the family's term, and the constant that bounds every row, from the rows whose MLP
    is at least 3x the hidden size (real models' 2.7-7x; at 2x the attention's phase can be the
    backward's peak instead, a second regime that one linear form would blur)."""
    rows = [r for r in rows if r["i"] >= 3 * r["h"]]
    x = np.array([[r["h"], r["q"], r["kv"], r["i"], 1.0] for r in rows])
    y = np.array([r["measured"] - (r["line"] - r["family"]) for r in rows])
    coef = np.round(np.linalg.lstsq(x, y, rcond=None)[0][:4] * 4) / 4
    return coef.tolist(), int(np.ceil(np.max(y - x[:, :4] @ coef)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_types", nargs="+")
    p.add_argument("--check", action="store_true", help="only planned / measured, no fit")
    p.add_argument("--widths", action="append", default=[], help="h,heads,kv_heads,head_dim,i")
    a = p.parse_args()
    widths = [tuple(int(v) for v in w.split(",")) for w in a.widths] or WIDTHS
    torch._dynamo.config.recompile_limit = 256
    for model_type in a.model_types:
        rows = [measure(model_type, w) for w in widths]
        if not a.check:
            coef, const = fit(rows)
            row = ", ".join(f"{c:g}" for c in coef)
            print(f'    "{model_type}": ({row}, {const}),')
        for r in rows:
            ratio = r["line"] / r["measured"]
            print(f"  {model_type} h {r['h']} q {r['q']} kv {r['kv']} i {r['i']}: measured "
                  f"{r['measured']:.0f} B/token, planned {r['line']:.0f} ({ratio:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
