"""What autocast does around a streamed layer's matmuls, in fewer and faster kernels, bitwise.

A bf16 run computes the layers under autocast with the residual stream in fp32, as the stock
Trainer does. Three things then cost more HBM traffic than they need (measured on an H200,
Llama-3.1-8B at 65,536 tokens, one 64k-token layer pass):

- autocast casts a linear's fp32 input to bf16 once per linear, so q/k/v cast the same normed
  activation three times, gate/up twice (0.37 ms each); here the cast is made once per tensor
  and shared.
- The backward of each cast widens the bf16 gradient to fp32 with PyTorch's generic (unrolled,
  not vectorized) dtype-converting copy, 0.9 ms where the traffic needs ~0.35; here a
  vectorized Triton kernel does it.
- The residual add of an fp32 stream and a bf16 branch output runs PyTorch's unrolled
  mixed-dtype kernel, 1.1 ms where ~0.6 is the traffic; here a vectorized Triton kernel.

Every value is the same: a cast rounds as autocast's, a widening is exact, the add is one fp32
add of the same operands; the autograd graph has one node where autocast had its cast (one per
consumer, so gradients still meet in fp32 in autograd's own order). Without Triton (the CPU)
PyTorch's ops compute the same values; the shared cast still applies.

``AutocastKernels`` is a ``TorchFunctionMode`` the engine enters inside its autocast
(``StreamingEngine.compute_context``); it rewrites only ``F.linear`` on an fp32 input with a
compute-dtype weight, and the fp32 + compute-dtype add of two same-shaped tensors.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_BLOCK = 4096


@functools.cache
def _kernels():
    """The Triton kernels, or None where Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def widen(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask).to(tl.float32), mask=mask)

    @triton.jit
    def add_widened(a, b, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(a + offs, mask=mask)
        y = tl.load(b + offs, mask=mask).to(tl.float32)
        tl.store(out + offs, x + y, mask=mask)

    return triton, widen, add_widened


_NARROW = (torch.bfloat16, torch.float16)


def _triton_ok(narrow: torch.Tensor, *fp32: torch.Tensor) -> bool:
    """Whether the kernels apply: a bf16/fp16 operand, fp32 others, all contiguous on CUDA."""
    return (
        narrow.dtype in _NARROW
        and all(t.dtype == torch.float32 for t in fp32)
        and all(t.is_cuda and t.is_contiguous() for t in (narrow, *fp32))
        and _kernels() is not None
    )


def _launch(kernel, *tensors: torch.Tensor) -> None:
    """One elementwise pass of ``kernel`` over ``tensors`` (as many elements each)."""
    n = tensors[0].numel()
    if n:
        with torch.cuda.device(tensors[0].device):
            grid = (_kernels()[0].cdiv(n, _BLOCK),)
            kernel[grid](*tensors, n, BLOCK=_BLOCK, num_warps=8)


def widen(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x.float()`` (written into the fp32 ``out`` of as many elements, when given): exact;
    one vectorized kernel for contiguous CUDA tensors."""
    if out is None:
        if not _triton_ok(x):
            return x.float()
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    elif not _triton_ok(x, out) or out.numel() != x.numel():
        return out.copy_(x.reshape(out.shape))
    _launch(_kernels()[1], x, out)
    return out


def add_widened(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a + b`` for an fp32 ``a`` and a narrower float ``b`` of as many elements: one fp32 add
    of ``a`` and ``b`` widened, as PyTorch's type promotion computes it; into ``out`` (``a``
    itself too) when given."""
    if not _triton_ok(b, a, *([] if out is None else [out])) or a.numel() != b.numel():
        b = b.reshape(a.shape)
        return torch.add(a, b) if out is None else torch.add(a, b, out=out)
    out = torch.empty_like(a) if out is None else out
    _launch(_kernels()[2], a, b, out)
    return out


class _SharedCast(torch.autograd.Function):
    """One consumer's view of the shared cast of ``x``: autograd sees one node per consumer, as
    with autocast's own casts; backward widens that consumer's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cast: list) -> torch.Tensor:
        return cast[0].detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return widen(grad), None


class _AddWidened(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.b_dtype = b.dtype
        return add_widened(a, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # As autograd's add: the gradient as it is for each, rounded to the narrow operand's dtype.
        return grad, grad.to(ctx.b_dtype) if ctx.needs_input_grad[1] else None


_ADDS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}


class AutocastKernels(TorchFunctionMode):
    """Shared input casts for ``F.linear`` and one-kernel mixed adds, under an active autocast
    to ``dtype`` on ``device_type`` (enter it inside that autocast)."""

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.device_type = device_type
        self.dtype = dtype
        # id(fp32 input) -> (weak ref to it, its version, [its cast]); an entry goes with its input.
        self._casts: dict[int, tuple[weakref.ref, int, list]] = {}

    def _shared_cast(self, x: torch.Tensor) -> torch.Tensor:
        key = id(x)
        entry = self._casts.get(key)
        if entry is None or entry[0]() is not x or entry[1] != x._version:
            casts = self._casts
            ref = weakref.ref(x, lambda _, key=key: casts.pop(key, None))
            with torch.no_grad():
                entry = (ref, x._version, [x.to(self.dtype)])
            casts[key] = entry
        if not (torch.is_grad_enabled() and x.requires_grad):
            return entry[2][0]
        return _SharedCast.apply(x, entry[2])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_autocast_enabled(self.device_type):
            # Positional or by keyword (PEFT's HRA calls ``F.linear(input=x, weight=w, ...)``).
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if (
                isinstance(x, torch.Tensor)
                and x.dtype == torch.float32
                and x.device.type == self.device_type
                and isinstance(weight, torch.Tensor)
                and weight.dtype == self.dtype
            ):
                if args:
                    args = (self._shared_cast(x), *args[1:])
                else:
                    kwargs = {**kwargs, "input": self._shared_cast(x)}
        elif func in _ADDS and len(args) == 2 and not kwargs:
            a, b = args  # either order (__radd__ too): the fp32 operand is picked below
            if (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.shape == b.shape
                and a.device == b.device
                and a.device.type == self.device_type
            ):
                if a.dtype != torch.float32:
                    a, b = b, a
                if a.dtype == torch.float32 and b.dtype == self.dtype:
                    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
                        return _AddWidened.apply(a, b)
                    return add_widened(a, b)
        return func(*args, **kwargs)
