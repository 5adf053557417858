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
``--kept`` fits a kept layer's saved tensors over the plan's kept count the same way (eight
widths, the constant bounding all): the rows of ``FITTED_KEPT_RESIDUALS``.

    python3 dev/family_working_set_fit.py olmo2 phi gptj
    python3 dev/family_working_set_fit.py --check --widths 320,5,1,64,1280 olmo2
    python3 dev/family_working_set_fit.py --kept olmo2 stablelm
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_megatrain.core.activation_memory import (  # noqa: E402
    kept_activation_bytes_per_token,
    working_set_line,
)
from tests.test_keep_activations import kept_layer_saved_bytes  # noqa: E402
from tests.test_plan_accuracy import family_config, recomputed_layer_growth  # noqa: E402

#: (hidden, heads, kv heads, head_dim, intermediate): families whose head_dim is hidden / heads
#: take these heads at that width.
WIDTHS = [
    (256, 4, 2, 64, 768), (256, 8, 2, 64, 768), (256, 4, 4, 64, 768), (256, 4, 2, 64, 1024),
    (384, 6, 2, 64, 768), (512, 8, 4, 64, 1536),
]  # fmt: skip
#: Widths the working-set fit does not see (the held-out test's and one more); ``--kept`` bounds
#: its constant over them too.
HELD_OUT = [(320, 5, 1, 64, 1280), (640, 10, 2, 64, 1792)]


def measure_kept(model_type: str, widths) -> dict:
    """Per-token saves of a kept layer (the growth from 64 to 128 tokens: per-layer constants
    cancel), with the shared casts, the plan's count and its family term."""
    cfg = family_config(model_type, *widths, layers=1)
    cfg._attn_implementation = "sdpa"
    saved = {t: kept_layer_saved_bytes(cfg, True, t) for t in (64, 128)}
    shape = saved[128][1]
    return {
        "h": shape.hidden_size, "q": shape.num_heads * shape.head_dim, "kv": shape.kv_size,
        "i": shape.intermediate_size, "measured": (saved[128][0] - saved[64][0]) / 64,
        "line": kept_activation_bytes_per_token(shape, shared_casts=True),
        "family": shape.extra_kept_bytes_per_token,
    }  # fmt: skip


def measure(model_type: str, widths, kernels: str = "torch") -> dict:
    """Per-token growth of the middle layer's backward, the plan's line and its family term,
    under ``kernels`` (PyTorch's or the compiled ones)."""
    cfg = family_config(model_type, *widths)
    grown = {t: recomputed_layer_growth(cfg, kernels, t, keep_outputs=False) for t in (512, 1024)}
    shape = grown[1024][1]
    lines = {
        t: working_set_line(shape, t, 0, keeps_attention_output=False, shared_casts=True)
        for t in (512, 1024)
    }
    return {
        "h": shape.hidden_size, "q": shape.num_heads * shape.head_dim, "kv": shape.kv_size,
        "i": shape.intermediate_size,
        "measured": (grown[1024][0] - grown[512][0]) / 512,
        "line": (lines[1024].nbytes - lines[512].nbytes) / 512,
        "family": shape.extra_working_set_bytes_per_token,
    }  # fmt: skip


def fit(coef_rows: list[dict], bound_rows: list[dict]) -> tuple[list[float], int]:
    """Quarter-byte least-squares coefficients of (h, q, kv, i) for the residual over the line
    without the family's term, from ``coef_rows``, and the constant that bounds ``bound_rows``."""

    def xy(rows):
        x = np.array([[r["h"], r["q"], r["kv"], r["i"], 1.0] for r in rows])
        return x, np.array([r["measured"] - (r["line"] - r["family"]) for r in rows])

    x, y = xy(coef_rows)
    coef = np.round(np.linalg.lstsq(x, y, rcond=None)[0][:4] * 4) / 4
    xb, yb = xy(bound_rows)
    return coef.tolist(), int(np.ceil(np.max(yb - xb[:, :4] @ coef)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_types", nargs="+")
    p.add_argument("--check", action="store_true", help="only planned / measured, no fit")
    p.add_argument("--widths", action="append", default=[], help="h,heads,kv_heads,head_dim,i")
    p.add_argument("--kept", action="store_true", help="a kept layer's saves, not the working set")
    p.add_argument("--kernels", choices=("torch", "compiled"), default="torch")
    a = p.parse_args()
    widths = [tuple(int(v) for v in w.split(",")) for w in a.widths]
    widths = widths or (WIDTHS + HELD_OUT if a.kept else WIDTHS)
    torch._dynamo.config.recompile_limit = 256
    for model_type in a.model_types:
        if a.kept:
            rows = [measure_kept(model_type, w) for w in widths]
        else:
            rows = [measure(model_type, w, a.kernels) for w in widths]
        if not a.check:
            if a.kept:  # saved bytes are linear in the widths: fit on the six, bound all
                coef, const = fit(rows[: len(WIDTHS)], rows)
            else:  # the MLP's regime (3x the hidden size or more), as real models have
                regime = [r for r in rows if r["i"] >= 3 * r["h"]]
                coef, const = fit(regime, regime)
            row = ", ".join(f"{c:g}" for c in coef)
            print(f'    "{model_type}": ({row}, {const}),')
        for r in rows:
            ratio = r["line"] / r["measured"]
            print(
                f"  {model_type} h {r['h']} q {r['q']} kv {r['kv']} i {r['i']}: measured "
                f"{r['measured']:.0f} B/token, planned {r['line']:.0f} ({ratio:.3f})"
            )


if __name__ == "__main__":
    main()
