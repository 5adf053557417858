"""Whether FlexAttention's compiled kernels run a training step (forward and backward) at a head
width, on this GPU: ``attention.FLEX_MAX_HEAD_DIM`` keeps "auto" off FlexAttention above 256
(Gemma 4's full-attention heads are 512). Causal with a sliding window, bf16, GQA 4:2.

    python3 dev/flex_head_probe.py [--dims 128,256,512] [--seq 4096]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def probe(dim: int, seq: int, window: int) -> str:
    q = torch.randn(1, 4, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def sliding(b, h, qi, ki):
        return (ki <= qi) & (qi - ki < window)

    mask = create_block_mask(sliding, None, None, seq, seq, device="cuda")
    fn = torch.compile(flex_attention, dynamic=False)
    try:
        for _ in range(2):  # (the second: compiled, timed)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(q, k, v, block_mask=mask, enable_gqa=True)
            out.float().square().mean().backward()
            torch.cuda.synchronize()
        return f"ok, {1e3 * (time.perf_counter() - t0):.1f} ms forward + backward"
    except Exception as e:  # noqa: BLE001 - the probe's answer is the failure itself
        return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="128,256,512")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--window", type=int, default=1024)
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for dim in (int(d) for d in a.dims.split(",")):
        print(f"head_dim {dim}: {probe(dim, a.seq, a.window)}", flush=True)


if __name__ == "__main__":
    main()
