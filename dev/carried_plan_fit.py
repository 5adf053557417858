"""Gemma 4's per-layer inputs and shared keys/values against their plan lines, on the CPU tracker.

One streamed step of one sequence (tests/test_plan_accuracy.py's ``step_vs_plan``: the live
tensors' peak against the plan's lines the tracker sees) for Gemma 4 text configs with and
without per-layer inputs (``hidden_size_per_layer_input``) and KV-sharing layers
(``num_kv_shared_layers``), over layer counts, widths and lengths: the per-element bytes of
``hf/family_memory.py`` (PER_LAYER_INPUT_*, SHARED_KV_*) were read from these runs, and each
ratio should stay under 1 + the lines' error margin.

    python3 dev/carried_plan_fit.py [L,ple,tokens,hidden,kv_shared[,wide] ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import gemma4_config  # noqa: E402
from tests.test_plan_accuracy import step_vs_plan  # noqa: E402

DEFAULT = [
    "8,0,2048,256,0", "8,64,1024,256,0", "8,64,2048,256,0", "8,128,2048,256,0",
    "4,64,2048,256,0", "8,64,2048,384,0", "8,0,2048,256,4", "8,64,2048,256,4",
    "8,64,2048,256,4,1", "12,32,2048,320,8,1",
]  # fmt: skip


def config(layers: int, per_layer: int, tokens: int, hidden: int, shared: int, wide: bool):
    """Gemma 4 text at these widths: 3 sliding layers (one kv head of 64) per full one (one of
    128), MLP 4 x hidden (doubled in the KV-sharing layers with ``wide``)."""
    types = (["sliding_attention"] * 3 + ["full_attention"]) * (layers // 4)
    return gemma4_config(
        hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, global_head_dim=128,
        num_global_key_value_heads=1, sliding_window=512, attention_k_eq_v=False,
        layer_types=types, max_position_embeddings=2 * tokens, num_kv_shared_layers=shared,
        hidden_size_per_layer_input=per_layer, vocab_size_per_layer_input=4096,
        use_double_wide_mlp=wide,
    )  # fmt: skip


def main(argv: list[str]) -> int:
    for item in argv or DEFAULT:
        v = [int(x) for x in item.split(",")]
        layers, per_layer, tokens, hidden, shared = v[:5]
        wide = bool(v[5]) if len(v) > 5 else False
        r = step_vs_plan(config(layers, per_layer, tokens, hidden, shared, wide), tokens, "sdpa")
        m, p, e = r["measured"], r["planned"], r["margin"]
        print(
            f"layers {layers} per-layer {per_layer} tokens {tokens} hidden {hidden} shared "
            f"{shared} wide {int(wide)}: measured {m / 2**20:.2f} MiB, planned {p / 2**20:.2f} "
            f"(+{e / 2**20:.2f} margin): {m / p:.3f}x, {'inside' if m <= p + e else 'OVER'}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
