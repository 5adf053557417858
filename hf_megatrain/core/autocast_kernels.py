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
- autograd sums the widened gradients of q/k/v (gate/up) in fp32 as separate kernels: widen,
  widen, add, widen, add (2.7 ms for q/k/v, 1.5 for gate/up on a kernel trace of the 8B's step).
  Here the gradients of one shared cast are summed in autograd's own order of arrival in two
  kernels (the first two widened and added, then each later one added widened): 1.1 and 0.45 ms.

Every value is the same: a cast rounds as autocast's, a widening is exact, the add is one fp32
add of the same operands; the autograd graph has one node where autocast had its cast (one per
consumer, so gradients still meet in fp32 in autograd's own order: ``_CastGradSum`` hands the
sum to autograd at the last consumer's gradient, and leaves the summing to autograd where the
fp32 input has other uses, whose gradients autograd would interleave). Without Triton (the CPU)
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

    @triton.jit
    def add_two_widened(a, b, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(a + offs, mask=mask).to(tl.float32)
        y = tl.load(b + offs, mask=mask).to(tl.float32)
        tl.store(out + offs, x + y, mask=mask)

    return triton, widen, add_widened, add_two_widened


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


def add_two_widened(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a.float() + b.float()`` for two narrow floats of one shape: exact widenings and one
    fp32 add, as autograd sums two widened gradients; one kernel for contiguous CUDA tensors."""
    if not (_triton_ok(a) and _triton_ok(b)) or a.shape != b.shape:
        return a.float() + b.float()
    out = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    _launch(_kernels()[3], a, b, out)
    return out


class _CastGradSum:
    """The gradients of one shared cast's consumers, summed as autograd would sum them.

    autograd adds each consumer's widened gradient into the fp32 input's buffer as it arrives:
    ``((g1 + g2) + g3)`` in fp32, in the order the consumers' nodes run. Here the same sums run
    in fewer kernels and the total goes to autograd with the last consumer's gradient (the
    others hand back none). Which consumers' nodes run in this backward is autograd's own answer
    (``torch._C._will_engine_execute_node``, as ``torch.autograd.graph.register_multi_grad_hook``
    asks it): a consumer whose output reaches no loss, or which ``torch.autograd.grad`` prunes,
    is not waited for. Where the input has uses other than these casts (``other_uses``), their
    gradients would fall between the consumers' in autograd's buffer, so each consumer hands back
    its own widened gradient, as autocast's casts do; so it does in a backward that builds a
    graph (``create_graph``: the sums here are not differentiable). Each backward (graph task)
    sums apart: one started inside another, or beside it in another thread, keeps its own."""

    def __init__(self) -> None:
        self.nodes: list[weakref.ref] = []
        self.other_uses = False
        # graph task id -> [consumers still to come, the first gradient (narrow) until the
        # second comes, then the fp32 sum]; an entry goes when its backward's last one came.
        self._tasks: dict[int, list] = {}

    def add_consumer(self, out: torch.Tensor) -> None:
        self.nodes.append(weakref.ref(out.grad_fn))

    def arrive(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The gradient the arriving consumer hands autograd for the fp32 input."""
        if self.other_uses or len(self.nodes) < 2 or torch.is_grad_enabled():
            return widen(grad)
        task = torch._C._current_graph_task_id()
        state = self._tasks.get(task)
        if state is None:
            will_run = torch._C._will_engine_execute_node
            waiting = sum(1 for r in self.nodes if (n := r()) is not None and will_run(n))
            state = self._tasks[task] = [waiting, None]
        state[0] -= 1
        partial = state[1]
        if partial is None:
            if state[0] == 0:
                del self._tasks[task]
                return widen(grad)
            state[1] = grad
            return None
        if partial.dtype == torch.float32:
            add_widened(partial, grad, out=partial)
        else:
            state[1] = add_two_widened(partial, grad)
        if state[0] > 0:
            return None
        del self._tasks[task]
        return state[1]


class _SharedCast(torch.autograd.Function):
    """One consumer's view of the shared cast of ``x``: autograd sees one node per consumer, as
    with autocast's own casts; backward hands on that consumer's gradient widened, or the sum of
    all of them (``_CastGradSum``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cast: list, grads: _CastGradSum) -> torch.Tensor:
        ctx.grads = grads
        return cast[0].detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.grads.arrive(grad), None, None


class _AddWidened(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.b_dtype = b.dtype
        return add_widened(a, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # As autograd's add: the gradient as it is for each, rounded to the narrow operand's dtype.
        return grad, grad.to(ctx.b_dtype) if ctx.needs_input_grad[1] else None


def _joins_graph(result: object) -> bool:
    if isinstance(result, torch.Tensor):
        return result.requires_grad
    return isinstance(result, (list, tuple)) and any(_joins_graph(r) for r in result)


_ADDS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}


class AutocastKernels(TorchFunctionMode):
    """Shared input casts for ``F.linear`` and one-kernel mixed adds, under an active autocast
    to ``dtype`` on ``device_type`` (enter it inside that autocast)."""

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.device_type = device_type
        self.dtype = dtype
        # id(fp32 input) -> (weak ref to it, its version, [its cast], its consumers' gradient
        # sum); an entry goes with its input.
        self._casts: dict[int, tuple[weakref.ref, int, list, _CastGradSum]] = {}

    def _shared_cast(self, x: torch.Tensor) -> torch.Tensor:
        key = id(x)
        entry = self._casts.get(key)
        if entry is None or entry[0]() is not x or entry[1] != x._version:
            casts = self._casts
            ref = weakref.ref(x, lambda _, key=key: casts.pop(key, None))
            with torch.no_grad():
                entry = (ref, x._version, [x.to(self.dtype)], _CastGradSum())
            casts[key] = entry
        if not (torch.is_grad_enabled() and x.requires_grad):
            return entry[2][0]
        out = _SharedCast.apply(x, entry[2], entry[3])
        entry[3].add_consumer(out)
        return out

    def _note_other_uses(self, args: tuple, kwargs: dict) -> None:
        """A shared cast's input passed to anything else whose result joins the graph: its
        gradient then gets other terms, which autograd must interleave itself."""
        for arg in (*args, *kwargs.values()):
            for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                entry = self._casts.get(id(t)) if isinstance(t, torch.Tensor) else None
                if entry is not None and entry[0]() is t:
                    entry[3].other_uses = True

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
                        if not torch.compiler.is_compiling():
                            self._note_other_uses((a,), {})
                        return _AddWidened.apply(a, b)
                    return add_widened(a, b)
        result = func(*args, **kwargs)
        # Not inside a compiled region, which dynamo traces with this mode: its tensors have no
        # ids to look up, and reading the table there would make dynamo guard on its keys (the
        # ids of live inputs: a recompile per call, then its recompile limit). The compiled
        # kernels (norms, RoPE, activations) take no linear's input.
        if not torch.compiler.is_compiling() and self._casts and _joins_graph(result):
            self._note_other_uses(args, kwargs)
        return result
