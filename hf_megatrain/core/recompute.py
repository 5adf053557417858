"""Recompute into the forward's own graph, stopping once the last saved tensor is re-made.

A streamed layer that does not keep its activations builds its autograd graph in forward, but
every tensor autograd saves for backward becomes a placeholder (``PlaceholderSaves.recording``):
no activation memory is held. Backward re-runs the layer only until the last saved tensor has
been re-made (``PlaceholderSaves.refill``) and stops there: in a decoder layer the MLP's down
projection (a third of its MLP FLOPs: autograd saves that GEMM's inputs before it runs) and the
residual add never run a second time. The forward's graph is then differentiated as it is.

This is what ``torch.utils.checkpoint`` (non-reentrant, early stop) does for the stock Trainer's
gradient checkpointing; the engine keeps its own version because a streamed layer's recompute
inputs are its own (offloaded to the host, rounded to bf16, re-made from a segment's chain) and
its weights are bound again as they arrive. The pairing of saved tensors is by order, as in
torch, and checked: the recompute must save the same shapes and dtypes in the same order.

``attention_output_cache`` (a layer's ``keep_attention``, option ``keep_attention_outputs``) goes one step further for
attention: the fused SDPA kernel's outputs (the attention output and its log-sum-exp) are kept
from the forward and handed back in the recompute instead of running the kernel again, through two
dispatch modes below autograd (as torch's selective checkpointing, which cannot hand the outputs
back twice): a checkpoint segment's chain, which re-runs a layer before that layer's recompute,
reads them too (``KeptAttention.peek``). The attention node is still re-created in the
recompute, so its saves pair with the forward's placeholders as before; only the kernel is
skipped. Memory: per layer and token, heads x head_dim in the compute dtype and 4 B per head.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only


class _StopRecompute(Exception):
    """Raised from the pack hook once the recompute has re-made every saved tensor."""


class _Slot:
    """Placeholder autograd keeps in place of one saved tensor (weakly referenced); the refill
    puts the tensor in it, so the tensor goes with the placeholder, when autograd has used (and
    released) the saved variable that holds it. No weakref callback: a Ctrl-C that arrives while
    one runs is printed and lost (a WeakKeyDictionary's, as here before)."""

    __slots__ = ("value", "__weakref__")

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None


# The running refill's saves still to re-make, per thread (CUDA backward runs on the autograd
# engine's device thread).
_refill = threading.local()


def refill_remaining() -> int | None:
    """How many saved tensors the refill running on this thread still has to re-make before it
    stops (None: no refill runs). An autograd Function whose own saves are exactly that many may
    skip its computation: the recompute stops as soon as they are packed, right after the
    Function returns, so its output is never read (``tiling._TiledFunction``)."""
    return getattr(_refill, "remaining", None)


class PlaceholderSaves:
    """The tensors one layer's forward graph saves: placeholders in forward, refilled in backward."""

    def __init__(self) -> None:
        self._slots: list[weakref.ref[_Slot]] = []
        self._meta: list[tuple[torch.Size, torch.dtype]] = []

    def __len__(self) -> int:
        return len(self._slots)

    def _unpack(self, slot: _Slot) -> torch.Tensor:
        if slot.value is None:
            raise RuntimeError(
                "hf_megatrain: a streamed layer's saved tensor was read before the layer was "
                "recomputed (or read twice): its backward must run once, through the layer's "
                "autograd Function"
            )
        return slot.value

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Ops run inside save placeholders instead of tensors (run the layer's forward in it)."""

        def pack(t: torch.Tensor) -> _Slot:
            slot = _Slot()
            self._slots.append(weakref.ref(slot))
            self._meta.append((t.shape, t.dtype))
            return slot

        with saved_tensors_hooks(pack, self._unpack):
            yield

    def refill(self, run: Callable[[], object]) -> None:
        """Call ``run`` (the layer's forward again, with grad enabled) until it has re-made every
        tensor the forward saved, in the same order; the rest of it does not run."""
        n = len(self._slots)
        if n == 0:
            return
        count = 0

        def pack(t: torch.Tensor) -> None:
            nonlocal count
            k = count
            count += 1
            _refill.remaining = n - count
            shape, dtype = self._meta[k]
            if t.shape != shape or t.dtype != dtype:
                raise RuntimeError(
                    f"hf_megatrain: a streamed layer's recompute differs from its forward: saved "
                    f"tensor {k} is {tuple(t.shape)} {t.dtype}, forward saved {tuple(shape)} "
                    f"{dtype} (the layer must run the same ops for the same inputs; "
                    "the option recompute_early_stop=False re-runs whole layers instead)"
                )
            slot = self._slots[k]()
            if slot is not None:
                slot.value = t
            if count == n:
                raise _StopRecompute
            # The recompute's own graph is never differentiated: its saves hold nothing.

        def unpack(_: None) -> torch.Tensor:
            raise RuntimeError("hf_megatrain: the recompute graph is not differentiable")

        outer = getattr(_refill, "remaining", None)
        _refill.remaining = n
        try:
            with saved_tensors_hooks(pack, unpack):
                run()
        except _StopRecompute:
            return
        finally:
            _refill.remaining = outer
        raise RuntimeError(
            f"hf_megatrain: a streamed layer's recompute saved {count} tensors, its forward {n} "
            "(the layer must run the same ops for the same inputs; "
            "the option recompute_early_stop=False re-runs whole layers instead)"
        )


def release_storage(tensors: list[torch.Tensor]) -> None:
    """Point graph leaves at a one-element stand-in of the same shape: the graph keeps the leaf
    objects (gradients are taken with respect to them) but not their memory: a layer input kept
    alive until backward would undo its offload or bf16 rounding, a weight the stream buffer."""
    stand_ins: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        if key not in stand_ins:
            stand_ins[key] = torch.empty((), dtype=t.dtype, device=t.device)
        t.data = stand_ins[key].expand(t.shape)


@functools.cache
def _sdpa_kernels() -> frozenset:
    """The fused attention kernels ``F.scaled_dot_product_attention`` dispatches to (those this
    torch build has): CUDA flash / memory-efficient / cuDNN, the CPU flash kernel. Looked up
    once: every kept layer's forward, chain and recompute reads the set."""
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    return frozenset(
        getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)
    )


def _alias(out):
    """Fresh views of a kernel's output tensors: autograd above the mode attaches its history to
    the tensors an op returns, so the kept ones must never be those."""
    return tree_map_only(torch.Tensor, torch.Tensor.detach, out)


class KeptAttention:
    """The fused attention kernels' outputs of one layer call, in call order, from the forward
    (``capture``) to the recompute (``replay``, once) and before it any segment chain
    (``peek``, which leaves them in place)."""

    def __init__(self) -> None:
        self.kernels = _sdpa_kernels()
        self.outputs: list = []

    def capture(self) -> contextlib.AbstractContextManager:
        return _Capture(self)

    def replay(self) -> contextlib.AbstractContextManager:
        return _Replay(self, consume=True)

    def peek(self) -> contextlib.AbstractContextManager:
        return _Replay(self, consume=False)


class _KernelMode(TorchDispatchMode):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled layer kernels run as compiled, as under torch's own SAC modes


class _Capture(_KernelMode):
    def __init__(self, kept: KeptAttention) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.kept.kernels:
            self.kept.outputs.append(_alias(out))
        return out


class _Replay(_KernelMode):
    def __init__(self, kept: KeptAttention, consume: bool) -> None:
        super().__init__()
        self.kept = kept
        self.consume = consume
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in self.kept.kernels:
            return func(*args, **(kwargs or {}))
        k, self.calls = self.calls, self.calls + 1
        out = self.kept.outputs[k] if k < len(self.kept.outputs) else None
        if out is None:
            raise RuntimeError(
                "hf_megatrain: a recomputed layer called the fused attention kernel more often "
                "than its forward did, or its kept outputs were already used (backward twice "
                "through one graph): the option keep_attention_outputs='off' recomputes them"
            )
        if self.consume:
            self.kept.outputs[k] = None
        return _alias(out)


def attention_output_cache() -> tuple[contextlib.AbstractContextManager, KeptAttention]:
    """``(forward context, kept outputs)`` for one layer call: run its forward in the context
    and its recompute (``PlaceholderSaves.refill``) in ``kept.replay()``; the fused attention
    kernels then run once. An attention that does not go through these kernels (math fallback
    with an explicit mask on some backends, flex attention, flash-attn) is recomputed as before.

    The replay hands back what the forward's kernel returned whatever the recompute's arguments:
    both must make the same call. The early-stop path does (the same ops on leaves with the
    same ``requires_grad``, both under grad). A forward without grad would not: the cuDNN and
    memory-efficient kernels compute the log-sum-exp only when an input requires grad, so the
    whole-layer recompute (forward without a graph) does not use this."""
    kept = KeptAttention()
    return kept.capture(), kept
