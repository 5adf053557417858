"""Every supported family's whole streamed step, measured against the plan (CPU or GPU).

For each model type in ``SUPPORTED_MODEL_TYPES``: its tiny test config (tests/helpers.py), one
streamed forward, fused loss and backward of one ``--tokens``-token sequence under the live-tensor
tracker of tests/test_plan_accuracy.py (the loss's fp32 product as on CUDA), against the plan's
lines for that step that the tracker can see: boundary activations, RoPE tables, masks and
attention, the working set, the fused loss and the LM head, plus the non-layer parameters' fp32
gradients (inside the plan's 16 B/param line). Not counted: parameters and optimizer state
(exact lines), the GPU's stream and gradient buffers (none on the CPU), the slack. A ratio over
1 + the lines' error margin is a family whose activations the plan under-counts on the CPU; the
GPU's kernels can differ (SDPA's CPU math path with a mask makes s x s scores its CUDA kernels
do not; so does multi-head latent attention's, whose value width differs from the query's:
DeepSeek 2.3x here at hidden 256, 0.86x on the H200), so it is a lead to check on the GPU, not
a GPU measurement. Small steps read a little high besides: the layer's weight gradients, made
one weight at a time (a down projection's in bf16 at the MLP backward's peak), are in the GPU's
gradient-buffer line, not counted here (Llama-like families 0.99-1.00x at hidden 256, 2,048
tokens, since the plan counts the fp32 hidden-state gradient the last layer's backward takes
in: 1.04-1.06x before, 4h B per token of it; 0.93-0.96x on the H200 with every line).

    python3 dev/family_plan_sweep.py --tokens 4096 [--widths 256,4,2,64,1024] [--markdown FILE] \
        [model_type ...]

``--widths`` (hidden, heads, kv heads, head_dim, MLP width) sets every family's widths: at the tiny
configs' hidden 32 a layer's own terms hide under the constant parts (OLMo 2 at 1.01x there was
1.37x at hidden 256, before its fitted term).

``--device cuda`` runs the same step on the GPU instead (second step measured, after a first
that allocates what persists): the allocator's peak over what was allocated before the step,
against the same lines plus the GPU-only ones (stream and gradient buffers).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_megatrain.core.chunked_loss as chunked_loss  # noqa: E402
from hf_megatrain import SUPPORTED_MODEL_TYPES  # noqa: E402
from hf_megatrain.hf.attention import AttentionFacts  # noqa: E402
from tests.helpers import stock_aux_loss_trains, tiny_config  # noqa: E402
from tests.test_plan_accuracy import _cuda_fp32_gemm, family_config, step_vs_plan  # noqa: E402

#: Soft-capped families: SDPA has no soft-capping, they run eager.
EAGER = {"gemma2"}


def sweep_one(
    model_type: str, tokens: int, device: str = "cpu", attn: str = "", widths: tuple = ()
) -> dict:
    layers = 2 if model_type == "gemma3_text" else 3  # its tiny config's two layer types
    if widths:  # the family's own terms show only at real-ish widths (hidden 32 hides them)
        cfg = family_config(model_type, *widths, layers=layers, keep_window=True,
                            positions=2 * tokens)  # fmt: skip
    else:
        cfg = tiny_config(model_type, num_hidden_layers=layers, max_position_embeddings=2 * tokens)
    if getattr(cfg, "output_router_logits", False) and not stock_aux_loss_trains(model_type):
        cfg.output_router_logits = False  # this transformers cannot compute it (GraniteMoE < 5.24)
    # The loaders' choice: SDPA where the model class has it (BLOOM and MPT do not: eager).
    has_sdpa = AttentionFacts.of_config(cfg).supports_sdpa
    attn = attn or ("eager" if model_type in EAGER or not has_sdpa else "sdpa")
    return step_vs_plan(cfg, tokens, attn, device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_types", nargs="*", help="default: every supported family")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--attn", default="", help="attention for every family (default: the loaders')")
    ap.add_argument(
        "--widths", default="", help="h,heads,kv_heads,head_dim,i (default: the tiny config's)"
    )
    args = ap.parse_args(argv)
    if args.device == "cpu":
        chunked_loss.add_product_fp32 = _cuda_fp32_gemm
    rows = [
        "| family | measured MB | planned MB | margin MB | ratio | |",
        "|---|---|---|---|---|---|",
    ]
    for mt in args.model_types or list(SUPPORTED_MODEL_TYPES):
        t0 = time.time()
        try:
            widths = tuple(int(v) for v in args.widths.split(",")) if args.widths else ()
            r = sweep_one(mt, args.tokens, args.device, args.attn, widths)
        except Exception as exc:  # noqa: BLE001  (a family that fails is a row)
            print(f"{mt}: error {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            rows.append(f"| {mt} | error: {type(exc).__name__} | | | | |")
            continue
        ratio = r["measured"] / r["planned"]
        under = "under" if r["measured"] > r["planned"] + r["margin"] else ""
        print(f"{mt}: measured {r['measured'] / 1e6:.2f} MB, planned {r['planned'] / 1e6:.2f} "
              f"(+{r['margin'] / 1e6:.2f}), ratio {ratio:.2f} {under} ({time.time() - t0:.0f} s)",
              flush=True)  # fmt: skip
        rows.append(
            f"| {mt} | {r['measured'] / 1e6:.2f} | {r['planned'] / 1e6:.2f} | "
            f"{r['margin'] / 1e6:.2f} | {ratio:.2f} | {under} |"
        )
    if args.markdown:
        what = "the CUDA allocator" if args.device == "cuda" else "the CPU tracker"
        head = (f"# Plan vs {what}, every family, one {args.tokens}-token sequence\n\n"
                f"`python3 dev/family_plan_sweep.py --tokens {args.tokens} --device "
                f"{args.device}{' --widths ' + args.widths if args.widths else ''} --markdown "
                f"{args.markdown}` (torch {torch.__version__}). See "
                "the script's docstring for what is compared.\n\n")  # fmt: skip
        args.markdown.write_text(head + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
