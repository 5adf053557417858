"""Kept graphs whose saved tensors wait in host memory.

An HBM-tier layer that keeps its forward graph (no recompute in backward) holds every tensor
autograd saves, about a layer's whole activations, in HBM from its forward to its backward. With
its saves offloaded, those tensors go to pinned host buffers on a copy stream of their own while
the forward runs on, and come back, prefetched while the layer before it in backward runs: the
recompute is spared at the cost of PCIe traffic, which the forward's HBM-tier layers and the
backward leave mostly idle, and host RAM instead of HBM.

What is not offloaded: small tensors, non-floating ones, tensors that overlap or have gaps, and
any tensor sharing storage with what the caller excludes (the layer's weights, inputs and
resident parameters, which live on the device anyway).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable, Iterator

import torch

from ..host_store import PinnedBuffer


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive storage slots from its offset
    (a permutation of a contiguous tensor): then its memory is one block to copy."""
    expected = 1
    for size, stride in sorted((s, st) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class SavedTensor:
    """One offloaded saved tensor: its host copy, the D2H event, a fetch in flight."""

    __slots__ = ("layer", "host", "event", "shape", "stride", "device", "ready")

    def __init__(self, layer: int, host: torch.Tensor, event, shape, stride) -> None:
        self.layer = layer
        self.host = host  # flat
        self.event = event
        self.shape, self.stride = shape, stride
        self.device: torch.Tensor | None = None  # flat, once fetched
        self.ready = None


class SavedTensorOffload:
    """Offload of kept graphs' saved tensors to pinned host buffers (``saving``), their fetch
    back in backward (``prefetch``; unpacking waits for it) and their release (``release``).

    ``max_in_flight_bytes``: device bytes of saves besides the running layer's: in forward
    those whose D2H copy may still run (past that the compute stream waits for the oldest copy,
    and the next kernels reuse its memory only after it), in backward those fetched ahead of
    their layer. Host buffers are kept per layer and save index, reused every step.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        min_numel: int = 1 << 20,
        max_in_flight_bytes: int = 8 << 30,
    ) -> None:
        self._device = torch.device(device)
        self._cuda = self._device.type == "cuda"
        self.min_numel = min_numel
        self.max_in_flight_bytes = max_in_flight_bytes
        # Streams of their own: a layer's saves (GiBs) queued on the weight or gradient streams
        # would hold back the next layer's weights.
        self._h2d = torch.cuda.Stream(self._device) if self._cuda else None
        self._d2h = torch.cuda.Stream(self._device) if self._cuda else None
        self._host: dict[tuple[int, int], PinnedBuffer] = {}
        self._saved: dict[int, list[SavedTensor]] = {}
        # Device tensors whose D2H copy may still run: (tensor, event, bytes), oldest first.
        self._pending: deque[tuple[torch.Tensor, object, int]] = deque()
        self._pending_bytes = 0
        #: Bytes copied to the host, in all (D2H) and back (H2D).
        self.d2h_bytes = 0
        self.h2d_bytes = 0

    # ---- forward: pack ------------------------------------------------------------------------
    @contextlib.contextmanager
    def saving(self, idx: int, exclude: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Offload the tensors autograd saves for layer ``idx`` while the block runs (its
        forward, under grad). ``exclude``: tensors whose storage stays on the device."""
        keep = {t.untyped_storage().data_ptr() for t in exclude if isinstance(t, torch.Tensor)}
        saved = self._saved[idx] = []
        # A tensor saved by several ops (a normed input read by three projections) is copied
        # once; its reference is held to the block's end so its address names it alone.
        seen: dict[tuple, tuple[torch.Tensor, SavedTensor]] = {}

        def pack(t: torch.Tensor):
            if (
                t.device != self._device
                or not t.is_floating_point()
                or t.numel() < self.min_numel
                or t.untyped_storage().data_ptr() in keep
                or not _dense(t)
            ):
                return t
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
            hit = seen.get(key)
            if hit is not None:
                return hit[1]
            s = self._offload(idx, len(saved), t)
            saved.append(s)
            seen[key] = (t, s)
            return s

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield
        seen.clear()

    def _offload(self, idx: int, n: int, t: torch.Tensor) -> SavedTensor:
        numel = t.numel()
        nbytes = numel * t.element_size()
        buf = self._host.get((idx, n))
        if buf is None or buf.nbytes < nbytes:
            buf = self._host[(idx, n)] = PinnedBuffer(nbytes, pin=self._cuda)
        host = buf.view((numel,), t.dtype)
        # The block from the offset, in storage order (``_dense``).
        flat = t.as_strided((numel,), (1,), t.storage_offset())
        event = None
        if self._cuda:
            compute = torch.cuda.current_stream(self._device)
            self._reap()
            self._d2h.wait_stream(compute)
            with torch.cuda.stream(self._d2h):
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._d2h)
            self._pending.append((t, event, nbytes))
            self._pending_bytes += nbytes
            while self._pending_bytes > self.max_in_flight_bytes and len(self._pending) > 1:
                old, old_event, old_bytes = self._pending.popleft()
                compute.wait_event(old_event)  # the memory's next user runs after the copy
                self._pending_bytes -= old_bytes
                del old
        else:
            host.copy_(flat)
        self.d2h_bytes += nbytes
        return SavedTensor(idx, host, event, tuple(t.shape), tuple(t.stride()))

    def _reap(self) -> None:
        """Drop the device tensors whose copy has finished (no stream waits: it is done)."""
        while self._pending and self._pending[0][1].query():
            self._pending_bytes -= self._pending.popleft()[2]

    def drain(self) -> None:
        """The compute stream waits for every D2H copy still running; their memory is freed in
        its order (backward begins: the forward's copies are all issued)."""
        if not self._pending:
            return
        compute = torch.cuda.current_stream(self._device)
        while self._pending:
            compute.wait_event(self._pending.popleft()[1])
        self._pending_bytes = 0

    # ---- backward: fetch and unpack -----------------------------------------------------------
    def _start_fetch(self, s: SavedTensor) -> None:
        if s.device is not None:
            return
        self.h2d_bytes += s.host.numel() * s.host.element_size()
        if not self._cuda:
            s.device = s.host.clone()
            return
        # Allocated from the compute stream's pool, where the backward frees it after waiting
        # for ``ready``; the copy waits for the compute work queued so far (the last that may
        # have used this memory).
        compute = torch.cuda.current_stream(self._device)
        dev = torch.empty_like(s.host, device=self._device)
        self._h2d.wait_stream(compute)
        with torch.cuda.stream(self._h2d):
            self._h2d.wait_event(s.event)
            dev.copy_(s.host, non_blocking=True)
            s.ready = torch.cuda.Event()
            s.ready.record(self._h2d)
        s.device = dev

    def _unpack(self, s):
        if not isinstance(s, SavedTensor):
            return s
        if self._cuda:
            self.drain()
        self._start_fetch(s)
        if self._cuda:
            torch.cuda.current_stream(self._device).wait_event(s.ready)
        return s.device.as_strided(s.shape, s.stride)

    def prefetch(self, idx: int, running: int | None = None) -> bool:
        """Start copying layer ``idx``'s offloaded saves back, where they fit beside what is
        fetched already for layers other than ``running`` (the layer whose backward runs) within
        ``max_in_flight_bytes``; else its backward fetches them. Returns whether they are (being)
        fetched; False also when the layer has none."""
        saved = self._saved.get(idx)
        if not saved:
            return False
        if all(s.device is not None for s in saved):
            return True
        ahead = sum(
            s.host.nbytes
            for layer, group in self._saved.items()
            if layer not in (idx, running)
            for s in group
            if s.device is not None
        )
        if ahead + sum(s.host.nbytes for s in saved) > self.max_in_flight_bytes:
            return False
        if self._cuda:
            self.drain()
        for s in saved:
            self._start_fetch(s)
        return True

    def release(self, idx: int) -> None:
        """Layer ``idx``'s backward is done: free its fetched saves (in the compute stream's
        order, after any fetch that was never unpacked)."""
        saved = self._saved.pop(idx, None)
        if not saved:
            return
        for s in saved:
            if s.device is not None and self._cuda:
                torch.cuda.current_stream(self._device).wait_event(s.ready)
            s.device = None

    def reset(self) -> None:
        """Forget the step's saves (a failed step); the host buffers stay for reuse."""
        if self._cuda:
            self.drain()
        for idx in list(self._saved):
            self.release(idx)

    # ---- what is held --------------------------------------------------------------------------
    def layers(self) -> list[int]:
        """Layers whose saves wait in host memory now."""
        return sorted(i for i, s in self._saved.items() if s)

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the buffers hold."""
        return sum(b.nbytes for b in self._host.values())


__all__ = ["SavedTensor", "SavedTensorOffload"]
