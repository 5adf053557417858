"""Saved layer inputs: which are large, which are rounded to the boundary dtype, and the host
buffers they are offloaded to between forward and backward.

Offloaded inputs go to one host buffer per layer and input, reused every step; backward fetches
them back on the H2D stream and prefetches the next ones while a layer recomputes.
"""

from __future__ import annotations

import torch

from ..host_store import PinnedBuffer


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class ActivationHandle:
    """One offloaded input: its host copy, the D2H event it waits for, and a fetch in flight."""

    __slots__ = ("layer", "host", "event", "device", "ready")

    def __init__(self, layer: int, host: torch.Tensor, event) -> None:
        self.layer = layer
        self.host = host
        self.event = event
        self.device: torch.Tensor | None = None
        self.ready = None


class ActivationStash:
    """Offload and precision of the residual-stream inputs that layers save for backward."""

    def __init__(
        self,
        device: torch.device,
        *,
        offload: bool,
        boundary_dtype: torch.dtype | None,
        h2d: torch.cuda.Stream | None,
        d2h: torch.cuda.Stream | None,
    ) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._offload = offload
        # None keeps a saved input's dtype; torch.bfloat16 saves it rounded (half the bytes in
        # HBM, or on the host and over PCIe when offloaded) and backward recomputes the layer
        # from it cast back. The forward is unchanged; the gradients become an approximation.
        self._boundary_dtype = boundary_dtype
        self._h2d, self._d2h = h2d, d2h
        # Size from which a floating layer input counts as a large activation (the hidden
        # states at training sizes, not ids or small masks): what offload moves and what the
        # boundary dtype may round. Tests lower it for tiny shapes.
        self.min_numel = 1 << 20
        self._host: dict[tuple[int, int], PinnedBuffer] = {}
        self._handles: dict[tuple[int, int], ActivationHandle] = {}
        # The input whose D2H copy was issued last and the copy's event (``_release_copied``).
        self._in_copy: tuple[torch.Tensor, torch.cuda.Event] | None = None

    @property
    def offload_enabled(self) -> bool:
        return self._offload

    def set_offload(self, offload: bool) -> None:
        """Offload from the next step on, or not (between steps: nothing saved is held)."""
        if self._handles:
            raise RuntimeError("hf_megatrain: activation offload changed while inputs are saved")
        self._offload = offload

    @property
    def boundary_dtype(self) -> torch.dtype | None:
        return self._boundary_dtype

    # ---- the rules ------------------------------------------------------------------------------
    def is_large(self, t: torch.Tensor) -> bool:
        """A floating layer input of at least ``min_numel`` elements (not ids/masks)."""
        return t.is_floating_point() and t.numel() >= self.min_numel

    def should_offload(self, t: torch.Tensor, residual_shapes: set[tuple[int, ...]]) -> bool:
        """Whether layer input ``t`` goes to host memory: a large activation of the residual
        stream (the shape of one of the layer's floating outputs). Other large inputs are the
        same tensor for every layer (RoPE cos/sin, tokens x head_dim, fp32: 512 MiB at 512k
        tokens): each saved reference shares one device copy, where offloading would store a
        host copy per layer (14 GiB over the plan in a 7B run at 524,288 tokens)."""
        return self._offload and tuple(t.shape) in residual_shapes and self.is_large(t)

    def save_dtype(
        self, t: torch.Tensor, residual_shapes: set[tuple[int, ...]]
    ) -> torch.dtype | None:
        """The narrower dtype to save layer input ``t`` in for the recompute, or None (as is).

        Only the residual stream is rounded: a large activation (as offload decides) of the
        shape of one of the layer's floating outputs (``residual_shapes``), so that rope cos/sin
        (tokens x head_dim, over the size threshold at long context) and masks stay exact.
        """
        bd = self._boundary_dtype
        if bd is None or tuple(t.shape) not in residual_shapes or not self.is_large(t):
            return None
        return bd if t.element_size() > _itemsize(bd) else None

    # ---- offload and fetch ----------------------------------------------------------------------
    def offload(self, idx: int, k: int, t: torch.Tensor) -> ActivationHandle:
        """Copy input ``k`` of layer ``idx`` to its host buffer; return the handle for backward."""
        nbytes = t.numel() * t.element_size()
        buf = self._host.get((idx, k))
        if buf is None or buf.nbytes < nbytes:
            buf = self._host[(idx, k)] = PinnedBuffer(nbytes, pin=self._cuda)
        host = buf.view(tuple(t.shape), t.dtype)
        event = None
        if self._cuda:
            compute = torch.cuda.current_stream(self._device)
            self._release_copied(compute)
            stale = self._handles.get((idx, k))
            if stale is not None and stale.device is not None:
                compute.wait_event(stale.ready)  # a prefetch never fetched: dropped below
            self._d2h.wait_stream(compute)
            with torch.cuda.stream(self._d2h):
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._d2h)
            self._in_copy = (t, event)
        else:
            host.copy_(t)
        handle = ActivationHandle(idx, host, event)
        self._handles[(idx, k)] = handle
        return handle

    def _release_copied(self, compute: torch.cuda.Stream) -> None:
        """Free the input whose offload copy was issued last, in the compute stream's order.

        The compute stream waits for the copy, so its next kernels, the only ones that can
        reuse the memory, run after it. ``record_stream`` instead kept the block from reuse
        until the copy stream passed the point where the host freed it; the host runs layers
        ahead of the GPU, so every input freed in that lead piled up (14 x 1.5 GiB at Phi-3
        128k, 20 GiB reserved over allocated at 256k). Called at the next offload: that
        layer's kernels are queued, so the copy runs beside them.
        """
        if self._in_copy is not None:
            compute.wait_event(self._in_copy[1])
            self._in_copy = None

    def _start_fetch(self, handle: ActivationHandle) -> None:
        if handle.device is not None:
            return
        host = handle.host
        if not self._cuda:
            handle.device = host.clone()
            return
        # Allocated from the compute stream's pool, where backward frees it, in stream order
        # after waiting for ``ready`` (fetch, reset). No ``record_stream``: its deferred free
        # piles blocks up while the host runs ahead (``_release_copied``). The copy waits for
        # the compute work queued so far, the last that may have used this memory; the layer
        # queued next still overlaps it.
        compute = torch.cuda.current_stream(self._device)
        dev = torch.empty(host.shape, dtype=host.dtype, device=self._device)
        self._h2d.wait_stream(compute)
        with torch.cuda.stream(self._h2d):
            if handle.event is not None:
                self._h2d.wait_event(handle.event)
            dev.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._h2d)
        handle.device, handle.ready = dev, ready

    def fetch(self, handle: ActivationHandle) -> torch.Tensor:
        """The offloaded tensor back on the device, usable on the current stream.

        The host copy stays: a segment's chain fetches its leader's input, and the leader's own
        backward fetches it again.
        """
        self._start_fetch(handle)
        dev = handle.device
        if self._cuda:
            compute = torch.cuda.current_stream(self._device)
            self._release_copied(compute)  # backward began: the forward's last copy
            compute.wait_event(handle.ready)
        handle.device = None
        return dev

    def prefetch(self, idx: int) -> None:
        """Start copying layer ``idx``'s offloaded inputs back to the device."""
        for (layer, _), other in list(self._handles.items()):
            if layer == idx:
                self._start_fetch(other)

    def reset(self) -> None:
        """Forget the step's saved inputs (a failed step): fetched device copies are freed; the
        host buffers stay for reuse."""
        if self._cuda:
            compute = torch.cuda.current_stream(self._device)
            self._release_copied(compute)
            for handle in self._handles.values():
                if handle.device is not None:
                    compute.wait_event(handle.ready)  # a fetch's copy into it may still run
        self._handles.clear()

    # ---- what is held ---------------------------------------------------------------------------
    def offloaded(self) -> dict[tuple[int, int], torch.Tensor]:
        """The latest host copy of each offloaded input, by ``(layer, input index)``."""
        return {key: h.host for key, h in self._handles.items()}

    def host_buffers(self) -> dict[tuple[int, int], PinnedBuffer]:
        """The host buffer of each ``(layer, input index)`` that was ever offloaded."""
        return dict(self._host)

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the offload buffers hold."""
        return sum(b.nbytes for b in self._host.values())
