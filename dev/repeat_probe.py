"""Whether a training run repeats bitwise on this machine: each run twice in one process.

    python3 dev/repeat_probe.py --family llama --steps 150 [--stock] \
        [--variant NAME:field=value,...] [--sdpa-backend flash|efficient|cudnn|math] \
        [--deterministic] [--out DIR]

Trains the streamed run (every layer streamed, the engine's defaults), each ``--variant`` (a
streamed run with those engine options, as ``benchmarks/loss_curves.py --variant``) and with
``--stock`` the stock Trainer, each twice from the same initial weights on the parity test's
data, and prints for each pair the first step whose loss differs and the largest relative
difference. ``--sdpa-backend`` pins PyTorch's attention kernel for every run, and
``--deterministic`` turns on ``torch.use_deterministic_algorithms`` (warn only) with cuBLAS's
deterministic workspace: a pair that repeats only with one of them names the source. A run
whose kernels and schedule are deterministic repeats bitwise; one that does not moves the
parity test's ratio from call to call (issue 21).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import loss_curves as lc  # noqa: E402


def first_difference(a: list[float], b: list[float]) -> dict:
    diffs = [abs(x / y - 1.0) for x, y in zip(a, b)]
    first = lc.first_differing_step(a, b)
    return {"first_step": first, "max_rel": max(diffs), "equal": first is None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="llama", choices=lc.FAMILIES)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--stock", action="store_true", help="repeat the stock run too")
    ap.add_argument("--no-streamed", action="store_true", help="leave out the default pair")
    ap.add_argument("--variant", action="append", default=[], help="NAME:field=value,...")
    ap.add_argument("--sdpa-backend", choices=lc.SDPA_BACKENDS)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="on the CPU (checks the script)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/repeat_probe"))
    a = ap.parse_args()
    if a.deterministic:  # (before CUDA starts: cuBLAS reads it once)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)
    pairs = [] if a.no_streamed else [lc.RunSpec("streamed", True, a.batch)]
    pairs += [lc.RunSpec(**{**vars(lc.parse_variant(v)), "batch": a.batch}) for v in a.variant]
    if a.stock:
        pairs.append(lc.RunSpec("stock", False, a.batch))
    runs = [
        lc.RunSpec(**{**vars(spec), "name": f"{spec.name}-{tag}"}) for spec in pairs for tag in "ab"
    ]
    config = lc.build_config(a.family, "small", a.seq_len)
    losses = lc.run_all(
        config, runs, steps=a.steps, seq_len=a.seq_len, bf16=True, cpu=a.cpu, out_dir=a.out,
        sdpa=a.sdpa_backend,
    )  # fmt: skip
    result = {
        "family": a.family, "steps": a.steps, "sdpa_backend": a.sdpa_backend,
        "deterministic": a.deterministic,
        "pairs": {s.name: first_difference(losses[f"{s.name}-a"], losses[f"{s.name}-b"])
                  for s in pairs},
    }  # fmt: skip
    print(json.dumps(result))
    a.out.mkdir(parents=True, exist_ok=True)
    parts = [a.family, a.sdpa_backend, "det" if a.deterministic else "", *(s.name for s in pairs)]
    tag = "-".join(filter(None, parts))
    (a.out / f"repeat-{tag}.json").write_text(json.dumps({**result, "losses": losses}))


if __name__ == "__main__":
    main()
