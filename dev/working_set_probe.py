"""A recomputed layer's untiled backward per token on the CPU, against the plan's working-set line.

Three streamed layers of a Llama or Qwen3 config of the given widths, one sequence, bf16 autocast,
untiled MLP, every layer recomputed; the middle layer's backward phase (from its output's gradient
to its input's) measured from the profiler's allocation timeline (tests/test_plan_accuracy.py,
``recomputed_layer_growth``), which, unlike a dispatch-mode tracker, sees into torch.compile'd
kernels: ``--kernels compiled`` builds Inductor's own CPU kernels (a C++ compiler is needed; the partition
of saved tensors is Inductor's, as on the GPU). The growth between two token counts, per token,
cancels what does not scale with tokens (the weights' gradients). Qwen3-1.7B's widths:

    python3 dev/working_set_probe.py --family qwen3 --hidden 2048 --inter 6144 --heads 16 \
        --kv-heads 8 --head-dim 128 --tokens 2048,4096 --kernels torch,compiled

printed per kernel set, autocast_kernels (shared casts) and kept attention outputs: measured and
planned bytes per token and their ratio.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_megatrain.hf.compiled_kernels as compiled_kernels  # noqa: E402
from hf_megatrain.core.activation_memory import working_set_line  # noqa: E402
from tests.test_plan_accuracy import recomputed_layer_growth  # noqa: E402


def config(a: argparse.Namespace):
    from transformers import LlamaConfig, Qwen3Config

    cls = Qwen3Config if a.family == "qwen3" else LlamaConfig
    return cls(
        vocab_size=96, hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=3,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        max_position_embeddings=2 * max(a.tokens),
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=["llama", "qwen3"], default="llama")
    for name, default in [("hidden", 256), ("inter", 768), ("heads", 4), ("kv-heads", 2),
                          ("head-dim", 64)]:  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--tokens", default="512,1024", help="two token counts")
    p.add_argument("--kernels", default="torch,compiled")
    a = p.parse_args()
    a.tokens = [int(t) for t in a.tokens.split(",")]
    torch._dynamo.config.cache_size_limit = 64
    compiled_kernels.COMPILE_BACKEND = "inductor"
    small, large = a.tokens
    cfg = config(a)
    for kernels, shared, keep in itertools.product(
        a.kernels.split(","), (False, True), (False, True)
    ):
        grown = {t: recomputed_layer_growth(cfg, kernels, t, shared, keep) for t in (small, large)}
        shape = grown[large][1]
        measured = (grown[large][0] - grown[small][0]) / (large - small)
        lines = [
            working_set_line(shape, t, 0, keeps_attention_output=keep, shared_casts=shared)
            for t in (small, large)
        ]
        planned = (lines[1].nbytes - lines[0].nbytes) / (large - small)
        print(
            f"{a.family} {kernels:8s} shared casts {shared!s:5s} output kept {keep!s:5s}: "
            f"measured {measured:.0f} B/token, planned {planned:.0f} ({measured / planned:.3f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
