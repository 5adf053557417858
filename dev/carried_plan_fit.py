"""Gemma 4's per-layer inputs and shared keys/values, and Gemma 3n's AltUp streams, against their
plan lines, on the CPU tracker.

One streamed step of one sequence (tests/test_plan_accuracy.py's ``step_vs_plan``: the live
tensors' peak against the plan's lines the tracker sees) for Gemma 4 text configs with and
without per-layer inputs (``hidden_size_per_layer_input``) and KV-sharing layers
(``num_kv_shared_layers``), over layer counts, widths and lengths: the per-element bytes of
``hf/family_memory.py`` (PER_LAYER_INPUT_*, SHARED_KV_*) were read from these runs, and each
ratio should stay under 1 + the lines' error margin. ``--gemma3n``: Gemma 3n text configs
(AltUp's 4 streams, LAuReL of rank 64, the first ``sparse`` layers' activation sparsity), which
``ALTUP_BYTES_PER_STREAM_ELEMENT`` was read from (with the streams in the boundary lines, the
step was 1.14-1.47x its plan without that term).

    python3 dev/carried_plan_fit.py [L,ple,tokens,hidden,kv_shared[,wide] ...]
    python3 dev/carried_plan_fit.py --gemma3n [L,ple,tokens,hidden,kv_shared,sparse ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_gemma4 import gemma3n_tracker_config, gemma4_tracker_config  # noqa: E402
from tests.test_plan_accuracy import step_vs_plan  # noqa: E402

GEMMA3N = [
    "8,64,2048,256,4,2", "8,64,2048,256,0,0", "4,64,2048,256,0,0", "8,64,2048,384,4,2",
    "8,64,1024,256,4,2", "8,64,2048,512,4,2", "4,32,4096,256,0,0", "4,64,4096,384,0,0",
    "8,128,2048,320,4,2",
]  # fmt: skip
DEFAULT = [
    "8,0,2048,256,0", "8,64,1024,256,0", "8,64,2048,256,0", "8,128,2048,256,0",
    "4,64,2048,256,0", "8,64,2048,384,0", "8,0,2048,256,4", "8,64,2048,256,4",
    "8,64,2048,256,4,1", "12,32,2048,320,8,1",
]  # fmt: skip


def main(argv: list[str]) -> int:
    gemma3n = "--gemma3n" in argv
    argv = [a for a in argv if a != "--gemma3n"]
    for item in argv or (GEMMA3N if gemma3n else DEFAULT):
        v = [int(x) for x in item.split(",")]
        layers, per_layer, tokens, hidden, shared = v[:5]
        extra = v[5] if len(v) > 5 else 0
        if gemma3n:
            cfg = gemma3n_tracker_config(layers, per_layer, tokens, hidden, shared, extra)
        else:
            cfg = gemma4_tracker_config(layers, per_layer, tokens, hidden, shared, bool(extra))
        r = step_vs_plan(cfg, tokens, "sdpa")
        m, p, e = r["measured"], r["planned"], r["margin"]
        print(
            f"layers {layers} per-layer {per_layer} tokens {tokens} hidden {hidden} shared "
            f"{shared} {'sparse' if gemma3n else 'wide'} {extra}: measured {m / 2**20:.2f} MiB, planned {p / 2**20:.2f} "
            f"(+{e / 2**20:.2f} margin): {m / p:.3f}x, {'inside' if m <= p + e else 'OVER'}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
