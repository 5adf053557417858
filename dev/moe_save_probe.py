"""Host RAM a save of a 7B MoE takes beyond its store, on the GPU machine (2026-12-07: the revert
of fused experts made views instead of copies). Streams the OLMoE-1B-7B config (random init
straight into the host store, HBM tier auto, no clipping: no gradient slots), then writes its
fp32 safetensors (``write_streamed_pretrained``) and prints one JSON line: the peak RSS growth
during the write against the plan's save line (``plan_arithmetic.save_line``, where the tree
has it) and the seconds. Run it from a tree's root; a tree before the change gives the old cost.

    python3 dev/moe_save_probe.py /tmp/moesave [config]
"""

from __future__ import annotations

import json
import shutil
import sys
import time

import torch
from transformers import AutoConfig

from hf_megatrain import init_streamed_model
from hf_megatrain.hf.checkpoint import write_streamed_pretrained
from hf_megatrain.hf.model import model_shape, streamed_state


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/moesave"
    name = sys.argv[2] if len(sys.argv) > 2 else "benchmarks/configs/olmoe-1b-7b-0924"
    shutil.rmtree(root, ignore_errors=True)
    cfg = AutoConfig.from_pretrained(name)
    t0 = time.perf_counter()
    model = init_streamed_model(
        cfg,
        device="cuda" if torch.cuda.is_available() else "cpu",
        bf16=True,
        resident_layers="auto",
        clipping=False,
    )
    init_s = time.perf_counter() - t0
    state = streamed_state(model)
    n_hbm = sum(1 for s in state.store.layers if s.master.is_cuda)
    planned = None
    try:
        from hf_megatrain.core.plan_arithmetic import save_line

        line = save_line(model_shape(model), state.options, n_hbm)
        planned = round(line.nbytes / 2**30, 2) if line is not None else 0.0
    except (ImportError, AttributeError, TypeError) as e:
        planned = f"n/a ({type(e).__name__})"
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_mib("VmRSS")
    t0 = time.perf_counter()
    write_streamed_pretrained(model, root)
    seconds = time.perf_counter() - t0
    grew = (_status_mib("VmHWM") - before) / 1024
    files = sum(p.stat().st_size for p in __import__("pathlib").Path(root).glob("*.safetensors"))
    print(
        json.dumps(
            {
                "config": name,
                "hbm_tier_layers": n_hbm,
                "init_s": round(init_s, 1),
                "save_s": round(seconds, 1),
                "files_gib": round(files / 2**30, 2),
                "host_growth_gib": round(grew, 2),
                "planned_save_line_gib": planned,
                "rss_before_gib": round(before / 1024, 2),
                "torch": torch.__version__,
            }
        ),
        flush=True,
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
