"""Compile the fused loss's Triton kernel for Hopper (sm_90) without a GPU; count its PTX ops.

    pip install --target /tmp/tritonpkg triton==3.6.0   # the GPU machine's Triton
    PYTHONPATH=/tmp/tritonpkg python3 dev/loss_kernel_ptx.py [--out kernel.ptx]

Checks what the kernel's arithmetic compiles to before a GPU call: CUDA's expf (libdevice)
shows as a range reduction around ``ex2.approx.ftz.f32``; ``tl.exp`` would be a bare
``ex2.approx.f32`` of ``x * log2(e)``.
"""

from __future__ import annotations

import argparse
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hf_megatrain.core.chunked_loss import _softmax_grad_kernel

SIGNATURE = {
    "logits": "*bf16", "stride": "i64", "targets": "*i64", "picked": "*fp32",
    "inv_divisor": "*fp32", "n_cols": "i32", "ignore_index": "i32",
    "BLOCK": "constexpr", "WRITE_GRAD": "constexpr",
}  # fmt: skip
OPS = ("ex2.approx.f32", "ex2.approx.ftz.f32", "lg2.approx.f32", "fma.rn.f32", "mul.f32", "sub.f32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the PTX here")
    parser.add_argument("--block", type=int, default=4096, help="the kernel's BLOCK")
    args = parser.parse_args()
    _, kernel = _softmax_grad_kernel()
    src = ASTSource(kernel, SIGNATURE, constexprs={"BLOCK": args.block, "WRITE_GRAD": True})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    text = ptx.asm["ptx"]
    if args.out:
        open(args.out, "w").write(text)
    for op in OPS:
        count = len(re.findall(re.escape(op) + r"(?![.\w])", text))
        print(f"{op:20s} {count}")


if __name__ == "__main__":
    main()
