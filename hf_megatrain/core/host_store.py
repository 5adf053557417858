"""Host-resident parameter store: per decoder layer, page-aligned flat buffers.

Each streamed layer owns one anonymous ``mmap`` region (page aligned by construction) laid out as

    [ stream copy (compute dtype) | grad (fp32 or bf16) | master (fp32) | exp_avg | exp_avg_sq ]

The first two parts are what crosses PCIe (weights H2D, gradients D2H), so only they are registered
with ``cudaHostRegister`` when CUDA is present: registering an existing page-aligned buffer is ~10x
cheaper than ``torch.empty(pin_memory=True)`` and avoids the caching host allocator's power-of-two
rounding. In fp32 runs the master itself is what streams, so no separate stream copy exists.

Two options shrink a trainable layer (bf16 runs: 18 B/param by default):

* ``hold_grad=False`` (eager updates, no clipping): no fp32 grad slot. Each layer's final gradient
  passes through a small ring of pinned staging buffers owned by the streaming engine and is
  consumed by the layer's update right away; nothing waits for a global norm. 14 B/param.
* ``stream_master=True``: no compute-dtype copy; the fp32 master itself crosses PCIe (twice the
  H2D bytes) and is cast on the GPU. 16 B/param, 12 B/param together with ``hold_grad=False``.
* ``grad_dtype=torch.bfloat16`` (a step's gradient is one backward of one process, made in bf16):
  the grad slot holds it exactly in 2 B/param instead of 4.

Within a layer, parameters that get weight decay are laid out first, then the ones that do not, so
the optimizer updates each group with one fused call over a contiguous slice.

This module is deliberately free of ``transformers`` imports.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import resource
import weakref
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from .process_status import status_field

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_FP32 = 4


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (a fixed GiB would print a
    small store as "0.00 GiB", hiding how far apart needed and available are)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


class InsufficientHostMemoryError(MemoryError):
    """Raised before any allocation when the host store would not fit in host RAM."""


def process_memory_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (``VmSize``, ``VmRSS``, ``VmHWM``) in bytes; None
    where /proc does not say."""
    value = status_field(field)  # (in kB)
    return int(value) * 1024 if value is not None and value.isdigit() else None


def available_host_bytes() -> int:
    """Bytes of host RAM this process can still take: MemAvailable, capped by a cgroup limit
    and by the process's address-space limit (RLIMIT_AS)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    # A per-process address-space limit (ulimit -v, a scheduler's h_vmem): the OS refuses
    # mappings past it however much RAM is free.
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        avail = min(avail, max(soft - (process_memory_bytes("VmSize") or 0), 0))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
            if raw.isdigit():
                limit = int(raw)
                used_path = path.replace("memory.max", "memory.current").replace(
                    "limit_in_bytes", "usage_in_bytes"
                )
                with open(used_path) as f:
                    used = int(f.read().strip())
                avail = min(avail, max(limit - used, 0))
        except (OSError, ValueError):
            continue
    return avail


def anonymous_map(nbytes: int) -> mmap.mmap:
    """``nbytes`` of anonymous host memory; the OS refusing them (out of memory, or a process
    limit such as ulimit -v) is an :class:`InsufficientHostMemoryError`, not mmap's traceback."""
    try:
        return mmap.mmap(-1, nbytes)
    except OSError as e:
        if e.errno != errno.ENOMEM:
            raise
        raise InsufficientHostMemoryError(
            f"hf_megatrain: the OS refused {nbytes / 2**30:.2f} GiB of host memory for the host "
            "store (out of memory, or a process limit such as ulimit -v): free host RAM, raise "
            "the limit, or plan the run with host_memory_limit_gb (--host-memory-limit-gb)"
        ) from None


def planned_host_bytes(available: int, limit_bytes: int | None) -> int:
    """The host RAM a memory plan counts on: what is ``available``, at most the run's
    ``host_memory_limit_gb`` (``limit_bytes``) where one is set, as the host store is then held
    to it (``HostStore.check_fits``)."""
    return available if limit_bytes is None else min(available, limit_bytes)


@dataclass(frozen=True)
class TensorSlot:
    """Where one named parameter lives inside its layer's flat buffers."""

    name: str  # name relative to the layer module, e.g. "self_attn.q_proj.weight"
    shape: tuple[int, ...]
    offset: int  # in elements
    numel: int
    decay: bool
    #: False: a frozen parameter (``requires_grad=False``) in a layer that trains: it streams
    #: with the layer, never gets a gradient and is never updated.
    trainable: bool = True


def layout_slots(
    named_shapes: Iterable[tuple[str, tuple[int, ...], bool]],
    frozen: Collection[str] = (),
) -> tuple[list[TensorSlot], int, int]:
    """Lay out ``(name, shape, decay)`` entries: decay parameters first, then no-decay ones;
    those named in ``frozen`` get slots that do not train (``TensorSlot.trainable``).

    Returns ``(slots, total_numel, decay_numel)``. Offsets are aligned to 16 elements (64 bytes
    in fp32) so every parameter view starts on a cache line and vectorized kernels stay aligned.
    """
    entries = list(named_shapes)
    ordered = [e for e in entries if e[2]] + [e for e in entries if not e[2]]
    slots: list[TensorSlot] = []
    offset = 0
    decay_numel = 0
    for name, shape, decay in ordered:
        numel = 1
        for d in shape:
            numel *= d
        slots.append(TensorSlot(name, tuple(shape), offset, numel, decay, name not in frozen))
        offset = _round_up(offset + numel, 16)
        if decay:
            decay_numel = offset
    return slots, offset, decay_numel


def _stream_copy_bytes(numel: int, stream_dtype: torch.dtype, stream_master: bool) -> int:
    """Bytes of a separate compute-dtype copy (none in fp32 runs or when the master streams)."""
    if stream_dtype == torch.float32 or stream_master:
        return 0
    return _round_up(numel * stream_dtype.itemsize, PAGE)


def layer_store_bytes(
    numel: int,
    stream_dtype: torch.dtype,
    trainable: bool = True,
    hold_grad: bool = True,
    stream_master: bool = False,
    grad_dtype: torch.dtype = torch.float32,
) -> int:
    """Host bytes one layer of ``numel`` parameters takes (what ``LayerStore`` allocates)."""
    stream = _stream_copy_bytes(numel, stream_dtype, stream_master)
    fp32 = _round_up(numel * _FP32, PAGE)
    if not trainable:
        return stream + fp32
    grad = _round_up(numel * grad_dtype.itemsize, PAGE) if hold_grad else 0
    return stream + grad + 3 * fp32


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last-error slot after a failed (non-sticky) runtime call.

    torch checks ``cudaGetLastError`` after kernel launches, so a failed ``cudaHostRegister``
    would otherwise surface later as an unrelated error. torch does not bind that function, so
    call it from the already-loaded libcudart.
    """
    import ctypes  # noqa: PLC0415

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


def _cuda_register(ptr: int, nbytes: int) -> bool:
    if not torch.cuda.is_available() or nbytes == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    code = int(err.value) if hasattr(err, "value") else int(err)
    if code != 0:
        _clear_cuda_error()
        logger.warning("cudaHostRegister failed (error %s); streaming from pageable memory", code)
        return False
    return True


def _cuda_unregister(ptr: int) -> None:
    err = torch.cuda.cudart().cudaHostUnregister(ptr)
    if (int(err.value) if hasattr(err, "value") else int(err)) != 0:
        _clear_cuda_error()


class PinnedBuffer:
    """A page-aligned host buffer, registered as pinned memory when CUDA is present.

    For data that crosses PCIe outside the layer stores (offloaded activations). Registered
    memory makes ``non_blocking`` copies real DMA transfers that overlap compute.
    """

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = _round_up(max(nbytes, 1), PAGE)
        self._mmap = anonymous_map(self.nbytes)
        self.raw = torch.frombuffer(self._mmap, dtype=torch.uint8, count=self.nbytes)
        ptr = self.raw.data_ptr()
        self.pinned = pin and _cuda_register(ptr, self.nbytes)
        self._finalizer = weakref.finalize(self, _cuda_unregister, ptr) if self.pinned else None

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        return self.raw[: numel * dtype.itemsize].view(dtype).view(shape)


class _FlatLayerState:
    """Views over one layer's flat buffers (shared by the host and the device tier)."""

    master: torch.Tensor
    stream: torch.Tensor
    # Whether the layer runs from a device-side cast of its fp32 master (HBM tier without a
    # compute-dtype copy); host stores stream instead.
    casts_on_use = False
    # Whether the gradient slot holds the compute dtype (``LayerStore`` says per store).
    compact_grad = False

    def __init__(
        self, slots: list[TensorSlot], numel: int, decay_numel: int, stream_dtype: torch.dtype
    ) -> None:
        self.slots = slots
        self.numel = numel
        self.decay_numel = decay_numel
        self.stream_dtype = stream_dtype

    def param_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name -> shaped view of ``flat`` (any of this layer's flat buffers)."""
        return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots}

    def segments(self) -> list[tuple[bool, int, int]]:
        """``(decay, start, end)`` of the contiguous decay and no-decay ranges (empty ones dropped)."""
        segs = [(True, 0, self.decay_numel), (False, self.decay_numel, self.numel)]
        return [s for s in segs if s[2] > s[1]]

    def refresh_stream_copy(self, start: int = 0, end: int | None = None) -> None:
        """Re-derive the compute-dtype copy of elements ``start:end`` (default: all) from the
        fp32 master (no-op in fp32 runs)."""
        if self.stream is not self.master:
            self.stream[start:end].copy_(self.master[start:end])


class DeviceLayerStore(_FlatLayerState):
    """A layer whose whole state lives on the compute device (the HBM tier).

    Same layout and views as ``LayerStore``: fp32 master, moments and grad, plus the compute-dtype
    copy the layer runs with. Nothing crosses PCIe for it and its AdamW update runs on the device.

    ``compute_copy=False`` (bf16 runs): no persistent compute-dtype copy (16 instead of 18 B/param,
    as stock training keeps); ``stream`` is the fp32 master, which the engine casts into its stream
    buffer each time the layer runs, as autocast casts fp32 weights in stock training.
    """

    resident = True
    trainable = True  # frozen layers always stream (their state is small on the host)
    holds_grad = True  # the GPU AdamW reads the gradient accumulated in place
    fp32_grad_slots = ()  # its fp32 gradient accumulates in place, whatever the step
    owned = True  # under data parallel every rank keeps (and updates) its own replica
    pinned = False
    nbytes = 0  # host bytes
    shared_nbytes = 0

    def __init__(
        self,
        slots: list[TensorSlot],
        numel: int,
        decay_numel: int,
        stream_dtype: torch.dtype,
        device: torch.device,
        compute_copy: bool = True,
    ) -> None:
        super().__init__(slots, numel, decay_numel, stream_dtype)
        self.master = torch.zeros(numel, dtype=torch.float32, device=device)
        self.grad = torch.zeros(numel, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros(numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.float32, device=device)
        separate = stream_dtype != torch.float32 and compute_copy
        self.stream = (
            torch.zeros(numel, dtype=stream_dtype, device=device) if separate else self.master
        )
        self.device_nbytes = device_layer_bytes(numel, stream_dtype, compute_copy)

    @property
    def casts_on_use(self) -> bool:
        """Whether the layer runs from a cast of its fp32 master (no compute-dtype copy)."""
        return self.stream is self.master and self.stream_dtype != torch.float32

    def close(self) -> None:
        pass


def device_layer_bytes(numel: int, stream_dtype: torch.dtype, compute_copy: bool = True) -> int:
    """Device bytes one ``DeviceLayerStore`` takes."""
    copy = compute_copy and stream_dtype != torch.float32
    return numel * (16 + (stream_dtype.itemsize if copy else 0))


def device_tier_bytes(numels: Sequence[int], stream_dtype: torch.dtype, uncopied: int) -> int:
    """``device_layer_bytes`` summed over layers of ``numels``, the first ``uncopied`` without a
    compute copy: in two C-level sums (the planner sizes the tier by trying every count)."""
    copy = stream_dtype.itemsize if stream_dtype != torch.float32 else 0
    return 16 * sum(numels) + copy * sum(numels[uncopied:])


def shared_layer_bytes(numel: int, stream_dtype: torch.dtype, stream_master: bool = False) -> int:
    """Bytes of one layer in a data-parallel shared region: stream copy (bf16 runs) + fp32 master."""
    return _stream_copy_bytes(numel, stream_dtype, stream_master) + _round_up(numel * _FP32, PAGE)


def owned_layer_bytes(numel: int, trainable: bool = True, hold_grad: bool = True) -> int:
    """Private host bytes of a layer's owner under data parallel: fp32 grad and two moments."""
    return (2 + (1 if hold_grad else 0)) * _round_up(numel * _FP32, PAGE) if trainable else 0


class LayerStore(_FlatLayerState):
    """Flat host buffers of one streamed layer: stream copy, grad, fp32 master and AdamW moments.

    By default the layer owns one private buffer holding everything. Under data parallel
    (``shared`` given) the stream copy and the fp32 master are views of ``shared``, a buffer in
    memory shared by every rank of the host, and only the layer's owner (``owned``) allocates
    the private fp32 gradient and moments; other ranks hold no optimizer state for it
    (``grad`` / ``exp_avg`` / ``exp_avg_sq`` are ``None``).

    ``hold_grad=False``: no gradient slot (``grad`` is ``None`` and ``holds_grad`` False); the
    engine stages the layer's final gradient for an eager update instead. ``grad_dtype``: the
    slot's dtype (fp32 unless one backward makes the whole gradient in the compute dtype).
    ``stream_master=True``: no compute-dtype copy; ``stream`` is the fp32 master, cast to the
    compute dtype on the device. ``pin_update_state``: with ``pin``, register the whole store,
    master and moments included (a device update copies them over PCIe), not only the
    PCIe-facing prefix; registering fresh memory maps it in, so this costs start-up time.
    """

    resident = False

    def __init__(
        self,
        slots: list[TensorSlot],
        numel: int,
        decay_numel: int,
        stream_dtype: torch.dtype,
        pin: bool,
        trainable: bool = True,
        shared: torch.Tensor | None = None,
        owned: bool = True,
        hold_grad: bool = True,
        stream_master: bool = False,
        grad_dtype: torch.dtype = torch.float32,
        pin_update_state: bool = False,
    ) -> None:
        super().__init__(slots, numel, decay_numel, stream_dtype)
        self.trainable = trainable
        self.owned = owned
        self.shared_nbytes = 0
        # Whether this layer's optimizer state includes a gradient slot (only meaningful for a
        # trainable layer this rank owns).
        self.holds_grad = hold_grad
        stream_bytes = _stream_copy_bytes(numel, stream_dtype, stream_master)
        separate_stream = stream_bytes > 0
        fp32_bytes = _round_up(numel * _FP32, PAGE)
        self.grad: torch.Tensor | None = None
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self._finalizers: list[weakref.finalize] = []
        if shared is not None:
            if grad_dtype != torch.float32:
                raise ValueError(
                    "hf_megatrain: data parallel averages gradients in fp32: shared layer "
                    "stores keep fp32 gradient slots"
                )
            self._init_shared(shared, numel, stream_bytes, fp32_bytes, pin)
            return
        if not owned:
            raise ValueError("hf_megatrain: a layer store without a shared buffer must be owned")
        # A frozen layer (e.g. the base under LoRA adapters) needs no grad and no moments.
        total = layer_store_bytes(
            numel, stream_dtype, trainable, hold_grad, stream_master, grad_dtype
        )
        grad_bytes = _round_up(numel * grad_dtype.itemsize, PAGE)
        self._mmap = anonymous_map(max(total, PAGE))
        raw = torch.frombuffer(self._mmap, dtype=torch.uint8, count=total) if total else None

        def view(start: int, dtype: torch.dtype) -> torch.Tensor:
            nbytes = numel * dtype.itemsize
            return raw[start : start + nbytes].view(dtype)

        cursor = 0
        if separate_stream:
            self.stream = view(0, stream_dtype)
            cursor = stream_bytes
        if trainable and hold_grad:
            self.grad = view(cursor, grad_dtype)
            cursor += grad_bytes
            self.master = view(cursor, torch.float32)
            self.exp_avg = view(cursor + fp32_bytes, torch.float32)
            self.exp_avg_sq = view(cursor + 2 * fp32_bytes, torch.float32)
            # The PCIe-facing prefix: stream copy and grad (+ the master when it is the stream).
            pinned_bytes = stream_bytes + grad_bytes + (0 if separate_stream else fp32_bytes)
        elif trainable:
            # No grad slot: the gradient never lands here (the engine stages it).
            self.master = view(cursor, torch.float32)
            self.exp_avg = view(cursor + fp32_bytes, torch.float32)
            self.exp_avg_sq = view(cursor + 2 * fp32_bytes, torch.float32)
            pinned_bytes = stream_bytes if separate_stream else fp32_bytes
        else:
            self.master = view(cursor, torch.float32)
            pinned_bytes = stream_bytes if separate_stream else fp32_bytes
        if not separate_stream:
            self.stream = self.master
        if pin_update_state and trainable and hold_grad:
            pinned_bytes = total  # the master and moments cross PCIe too (device updates)
        self.pinned = pin and self._register(raw.data_ptr() if raw is not None else 0, pinned_bytes)
        self.update_state_pinned = self.pinned and pinned_bytes == total
        self.nbytes = total

    # ---- a compact (bf16) gradient slot ----------------------------------------------------------
    #: Gradients of parameters that compute at their fp32 master values (``hold_fp32_grads``),
    #: kept exactly beside a compact slot: ``fp32_grad`` and, per such slot, its position there.
    fp32_grad: torch.Tensor | None = None
    fp32_grad_slots: tuple[tuple[TensorSlot, int], ...] = ()
    #: Whether the whole store is pinned (``pin_update_state``): a device update may copy its
    #: master and moments in and out. Shared (data parallel) stores: never.
    update_state_pinned: bool = False

    #: The host mapping this store made for itself (None: a shared store's non-owner view).
    _mmap: mmap.mmap | None = None

    @property
    def mapped_bytes(self) -> int:
        """Host bytes this store mapped for itself (what it costs the host beyond a shared
        buffer; a frozen or owned store maps at least a page)."""
        return 0 if self._mmap is None else len(self._mmap)

    @property
    def compact_grad(self) -> bool:
        """Whether the gradient slot holds the compute dtype (one backward's gradient, exactly)."""
        return self.grad is not None and self.grad.dtype != torch.float32

    def moment_ranges(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of the AdamW moments in host memory (none for a frozen layer):
        what ``core.prefault`` maps in ahead of the first update."""
        return [
            (t.data_ptr(), t.numel() * t.element_size())
            for t in (self.exp_avg, self.exp_avg_sq)
            if t is not None and t.numel()
        ]

    def hold_fp32_grads(self, names: Iterable[str]) -> None:
        """Parameters ``names`` get fp32 gradients (they compute at their fp32 master values:
        norm weights in bf16 runs): beside a compact slot, a small fp32 buffer holds theirs."""
        if not self.compact_grad:
            return
        wanted = set(names)
        placed, pos = [], 0
        for slot in self.slots:
            if slot.name in wanted:
                placed.append((slot, pos))
                pos += slot.numel
        self.fp32_grad_slots = tuple(placed)
        self.fp32_grad = torch.zeros(pos, dtype=torch.float32, pin_memory=self.pinned)

    def widen_grad(
        self,
        start: int,
        end: int,
        out: torch.Tensor,
        grad: torch.Tensor | None = None,
        fp32_grad: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Elements ``start:end`` of the layer's gradient in fp32, written into ``out``; from
        ``grad`` / ``fp32_grad`` where given (copies of the slot and its fp32 part on a device)."""
        grad = self.grad if grad is None else grad
        fp32_grad = self.fp32_grad if fp32_grad is None else fp32_grad
        out.copy_(grad[start:end])
        for slot, pos in self.fp32_grad_slots:
            a, b = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if a < b:
                out[a - start : b - start].copy_(
                    fp32_grad[pos + a - slot.offset : pos + b - slot.offset]
                )
        return out

    def _init_shared(
        self, shared: torch.Tensor, numel: int, stream_bytes: int, fp32_bytes: int, pin: bool
    ) -> None:
        needed = stream_bytes + fp32_bytes
        if shared.numel() < needed:
            raise ValueError(f"hf_megatrain: shared layer buffer of {shared.numel()} < {needed} B")
        self.shared_nbytes = needed
        if stream_bytes:
            self.stream = shared[: numel * self.stream_dtype.itemsize].view(self.stream_dtype)
        self.master = shared[stream_bytes : stream_bytes + numel * _FP32].view(torch.float32)
        if not stream_bytes:
            self.stream = self.master
        # Each process registers the shared stream copy in its own address space.
        self.pinned = pin and self._register(shared.data_ptr(), stream_bytes or fp32_bytes)
        self.nbytes = 0
        if not (self.trainable and self.owned):
            return
        total = owned_layer_bytes(numel, True, self.holds_grad)
        self._mmap = anonymous_map(total)
        raw = torch.frombuffer(self._mmap, dtype=torch.uint8, count=total)
        cursor = 0
        if self.holds_grad:
            self.grad = raw[: numel * _FP32].view(torch.float32)
            cursor = fp32_bytes
            if pin:  # the gradient crosses PCIe (D2H)
                self._register(raw.data_ptr(), fp32_bytes)
        self.exp_avg = raw[cursor : cursor + numel * _FP32].view(torch.float32)
        cursor += fp32_bytes
        self.exp_avg_sq = raw[cursor : cursor + numel * _FP32].view(torch.float32)
        self.nbytes = total

    def _register(self, ptr: int, nbytes: int) -> bool:
        if not _cuda_register(ptr, nbytes):
            return False
        # Unregister before the mapping can be unmapped and its address reused: a reused address
        # that is still registered makes the next cudaHostRegister fail.
        self._finalizers.append(weakref.finalize(self, _cuda_unregister, ptr))
        return True

    def close(self) -> None:
        for fin in self._finalizers:
            fin()
        self.pinned = False
        self.update_state_pinned = False


def frozen_layer_bytes(numel: int, stream_dtype: torch.dtype) -> int:
    """Host bytes of one ``FrozenLayerStore``: its weights in the compute dtype, nothing else."""
    return _round_up(numel * stream_dtype.itemsize, PAGE)


class FrozenLayerStore(LayerStore):
    """A layer that is never trained (a DPO reference): its weights in the compute dtype only.

    No fp32 master, gradient or moments: ``master`` and ``stream`` are one compute-dtype buffer,
    so a write through ``param_views(store.master)`` (a checkpoint load, a copy) rounds to the
    compute dtype once, as ``refresh_stream_copy`` does for a trainable layer's stream copy.
    """

    trainable = False
    owned = True
    holds_grad = False

    def __init__(
        self,
        slots: list[TensorSlot],
        numel: int,
        decay_numel: int,
        stream_dtype: torch.dtype,
        pin: bool,
    ) -> None:
        _FlatLayerState.__init__(self, slots, numel, decay_numel, stream_dtype)
        self.shared_nbytes = 0
        self.grad = self.exp_avg = self.exp_avg_sq = None
        self._finalizers = []
        self.nbytes = frozen_layer_bytes(numel, stream_dtype)
        self._mmap = anonymous_map(max(self.nbytes, PAGE))
        raw = torch.frombuffer(self._mmap, dtype=torch.uint8, count=max(self.nbytes, PAGE))
        self.master = self.stream = raw[: numel * stream_dtype.itemsize].view(stream_dtype)
        self.pinned = pin and self._register(raw.data_ptr(), self.nbytes)


class HostStore:
    """All streamed layers' host state, plus the accounting needed to refuse early."""

    def __init__(self, layers: list[LayerStore | DeviceLayerStore]) -> None:
        self.layers = layers

    @staticmethod
    def check_fits(needed_bytes: int, limit_bytes: int | None = None) -> None:
        """Raise ``InsufficientHostMemoryError`` before anything is allocated if RAM is short."""
        avail = available_host_bytes() if limit_bytes is None else limit_bytes
        if needed_bytes > avail:
            raise InsufficientHostMemoryError(
                f"hf_megatrain: the host store needs {format_bytes(needed_bytes)} of host RAM "
                "(a trained parameter's fp32 master, 2 AdamW moments, gradient and stream "
                "copy, unless eager updates / fp32-master streaming leave some out; a frozen "
                f"one's weights only), but only "
                f"{format_bytes(avail)} is available. Use a machine with more RAM, a smaller "
                f"model, or freeze part of the model."
            )

    @property
    def nbytes(self) -> int:
        """Host bytes this process allocated for the layers (its private part under DP)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def shared_nbytes(self) -> int:
        """Bytes of the layers in host memory shared by the data-parallel ranks (0 otherwise)."""
        return sum(getattr(layer, "shared_nbytes", 0) for layer in self.layers)

    @property
    def numel(self) -> int:
        return sum(layer.numel for layer in self.layers)

    def close(self) -> None:
        for layer in self.layers:
            layer.close()
