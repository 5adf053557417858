"""The cost of an atomic, manifested save of a 7B model on the GPU machine (issue 23).

Streams the Qwen2.5-7B config (random init straight into the host store, HBM tier off), then:
the plain write of its fp32 safetensors (``write_streamed_pretrained``), the manifest over those
files (sha256 + fsync, ``write_manifest``), the full atomic save (``save_streamed_pretrained``:
write, manifest, publish) and ``verify_folder``. (A save over an existing folder needs twice the
disk, more than the GPU machine's 64 GiB holds at 7B.) One JSON line per
measurement on stdout.

    python3 dev/save7b.py /tmp/save7b
"""

from __future__ import annotations

import json
import shutil
import sys
import time

import torch
from transformers import AutoConfig

from hf_megatrain import init_streamed_model
from hf_megatrain.core.publish import verify_folder, write_manifest
from hf_megatrain.hf.checkpoint import save_streamed_pretrained, write_streamed_pretrained


def timed(name: str, fn) -> None:
    t0 = time.perf_counter()
    out = fn()
    print(
        json.dumps(
            {
                "what": name,
                "seconds": round(time.perf_counter() - t0, 2),
                "detail": str(out)[:200] if out is not None else "",
            }
        ),
        flush=True,
    )


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/save7b"
    shutil.rmtree(root, ignore_errors=True)
    cfg = AutoConfig.from_pretrained("benchmarks/configs/qwen2.5-7b")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # As a 7B run on 128 GiB of host RAM trains: HBM tier, no gradient slots (no clipping).
    model = init_streamed_model(
        cfg, device=device, bf16=True, resident_layers="auto", clipping=False
    )
    plain = f"{root}/plain"
    timed(
        "write_streamed_pretrained (no staging, no manifest)",
        lambda: write_streamed_pretrained(model, plain),
    )
    timed("write_manifest over it (sha256 + fsync)", lambda: write_manifest(plain)["total_bytes"])
    shutil.rmtree(plain)
    final = f"{root}/final"
    timed("save_streamed_pretrained, new folder", lambda: save_streamed_pretrained(model, final))
    timed("verify_folder", lambda: verify_folder(final))
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
