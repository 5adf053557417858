"""How fast the SDPA backends run one long causal GQA attention on this GPU (issue 21's 524k
step is ~87% attention): forward with grad (the kernel that also returns the log-sum-exp),
forward without grad (a checkpoint chain's), and backward, per backend and length.

    python3 dev/attention_speed_probe.py [--tokens 131072,262144,524288] [--heads 28 --kv-heads 4]

TFLOP/s are at the MFU's count: forward 2 T^2 H D (causal: half of 4 T^2 H D), backward twice
that. One JSON line per case on stdout.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "default": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
}


def _time(fn, reps: int) -> float:
    fn()  # warm-up (plan build, autotune)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def probe(tokens: int, heads: int, kv_heads: int, head_dim: int, backend: str) -> dict:
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, heads, tokens, head_dim, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, kv_heads, tokens, head_dim, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, kv_heads, tokens, head_dim, device=dev, dtype=dt, requires_grad=True)
    gqa = heads != kv_heads

    def attn():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    ctx = sdpa_kernel([BACKENDS[backend]]) if BACKENDS[backend] else torch.enable_grad()
    fwd_flops = 2.0 * tokens * tokens * heads * head_dim
    reps = max(1, int(2 * 524288**2 / tokens**2))
    row: dict = {"tokens": tokens, "heads": heads, "kv_heads": kv_heads, "backend": backend}
    try:
        with ctx:
            row["fwd_s"] = _time(lambda: attn(), reps)
            with torch.no_grad():
                row["fwd_nograd_s"] = _time(lambda: attn(), reps)
            out = attn()
            grad = torch.randn_like(out)
            row["bwd_s"] = _time(
                lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), reps
            )
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                attn()
                torch.cuda.synchronize()
            names = {e.name for e in p.events() if "attention" in e.name.lower()}
            row["kernel"] = sorted(names)[:2]
    except RuntimeError as e:
        row["error"] = str(e).splitlines()[0][:200]
        return row
    row["fwd_tflops"] = round(fwd_flops / row["fwd_s"] / 1e12, 1)
    row["fwd_nograd_tflops"] = round(fwd_flops / row["fwd_nograd_s"] / 1e12, 1)
    row["bwd_tflops"] = round(2 * fwd_flops / row["bwd_s"] / 1e12, 1)
    row["fwd_bwd_tflops"] = round(3 * fwd_flops / (row["fwd_s"] + row["bwd_s"]) / 1e12, 1)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", default="131072,262144,524288")
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--backends", default="default,cudnn,flash")
    a = p.parse_args()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}))
    for tokens in map(int, a.tokens.split(",")):
        for backend in a.backends.split(","):
            print(json.dumps(probe(tokens, a.heads, a.kv_heads, a.head_dim, backend)), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
