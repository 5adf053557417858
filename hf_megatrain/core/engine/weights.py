"""Layer weights on the compute device: two slots, filled on the H2D stream one layer ahead.

CUDA events, never a device-wide synchronize, order the copy stream against compute. On the CPU
the store's stream copy is used as is (cast when the fp32 master is what streams).

Exact parameters: in mixed precision the stock Trainer computes with fp32 parameters and
autocast rounds only what its kernels cast (matmul weights). Parameters that no autocast kernel
casts (residual-stream norm weights) it uses at their fp32 values and gives fp32 gradients. For
those (``exact_names``, set by the model integration) each slot carries a small fp32 buffer,
filled from the fp32 master beside the compute-dtype copy: the values stock computes with, not
the compute-dtype copy's rounding of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..host_store import LayerStore
from .pace import ForwardPace


def uses_slot(store: LayerStore) -> bool:
    """Whether a layer runs from a stream buffer slot: streamed layers, and HBM-tier layers that
    keep no compute-dtype copy (cast into the slot from their fp32 master)."""
    return not store.resident or store.casts_on_use


class WeightStreamer:
    """Double-buffered compute-dtype layer weights on the device.

    ``wait_ready(i)`` blocks until layer ``i``'s host copy may be read (its update is done);
    ``is_ready(i)`` says whether it would block. ``h2d`` is the copy stream (CUDA), shared with
    the activation fetches.

    A layer's prefetch (its copy started while the layer before it computes) waits for nothing:
    when the next layer's host update is still running, the prefetch is left to that layer's own
    ``acquire`` (counted in ``deferred_prefetches``). Blocking there instead would hold back the
    launch of the current layer, whose weights are ready, until the next one's update finished:
    the GPU would wait for one update more than it must wherever the CPU AdamW step, which
    overlaps the forward, runs behind it.
    """

    def __init__(
        self,
        stores: list[LayerStore],
        device: torch.device,
        compute_dtype: torch.dtype,
        wait_ready: Callable[[int], None],
        h2d: torch.cuda.Stream | None,
        exact_names: dict[int, tuple[str, ...]] | None = None,
        is_ready: Callable[[int], bool] | None = None,
        take_device_update: Callable[[int], Callable[[dict | None], None] | None] | None = None,
        claim_ahead: Callable[..., None] | None = None,
    ) -> None:
        self._stores = stores
        self._is_ready = is_ready
        self._take_device_update = take_device_update
        self._claim_ahead = claim_ahead
        # Device updates (``enable_device_updates``): staging buffers, the stream that writes
        # updated state back to the host, and the last write-back of each layer.
        self._update_stage: dict[str, torch.Tensor] | None = None
        self._writeback: torch.cuda.Stream | None = None
        self._stage_written: torch.cuda.Event | None = None
        # The last write-back has read the staged master: fp32-master streaming shares that
        # buffer (``enable_device_updates``), and its next load must not overwrite it before.
        self._stage_master_read: torch.cuda.Event | None = None
        self._host_written: dict[int, torch.cuda.Event] = {}
        self._slot_written: list[torch.cuda.Event | None] = [None, None]
        # Where the compute stream is in the forward (device updates: claim only the layers the
        # CPU would deliver late).
        self._pace = ForwardPace()
        self.deferred_prefetches = 0
        # Layer -> names of its exact parameters (read when a layer loads: the caller may add
        # entries after construction, and the mapping outlives a rebuild for new stores).
        self._exact_names = exact_names if exact_names is not None else {}
        self._exact_buffers: list[torch.Tensor | None] = [None, None]
        self._device = device
        self._dtype = compute_dtype
        self._wait_ready = wait_ready
        self._cuda = device.type == "cuda"
        # Host layers whose fp32 master is what streams (no compute-dtype copy in the store).
        cast = [s for s in stores if not s.resident and s.stream.dtype != compute_dtype]
        self.streams_fp32_master = bool(cast)
        self.h2d_bytes = 0  # every H2D byte of weights, the exact parameters' included
        self.exact_h2d_bytes = 0  # of which the exact parameters' fp32 values
        if not self._cuda:
            return
        max_numel = max((s.numel for s in stores if uses_slot(s)), default=0)
        self._buffers = [
            torch.empty(max_numel, dtype=compute_dtype, device=device) for _ in range(2)
        ]
        # fp32-master streaming: the master lands here (H2D stream) and is cast into a
        # compute-dtype buffer on the same stream, so the copies stay ordered.
        self._stage = (
            torch.empty(max(s.numel for s in cast), dtype=torch.float32, device=device)
            if cast
            else None
        )
        self._h2d = h2d
        self._slot_layer: list[int | None] = [None, None]
        self._slot_ready: list[torch.cuda.Event | None] = [None, None]
        self._slot_free: list[torch.cuda.Event | None] = [None, None]
        self._active: int | None = None
        self._last_slot: int | None = None  # the slot acquired last
        # HBM-tier layers without a compute-dtype copy are cast from their fp32 master on the
        # copy stream, after this event: the masters' last write (construction, the optimizer
        # step's GPU AdamW, a checkpoint load) on the compute stream.
        self._masters_written = torch.cuda.Event()
        self._masters_written.record(torch.cuda.current_stream(device))
        # The slot buffers were allocated on the compute stream: the caching allocator may have
        # handed out memory that kernels still queued there (a step the watchdog aborted, work
        # before a rebuild) last used. A slot's first copy waits for this point of that stream.
        self._allocated = torch.cuda.Event()
        self._allocated.record(torch.cuda.current_stream(device))

    def _slot_of(self, idx: int) -> int | None:
        for s in (0, 1):
            if self._slot_layer[s] == idx:
                return s
        return None

    def _load(self, idx: int) -> int:
        """Make sure layer ``idx`` is (being) copied into a device slot; return the slot."""
        slot = self._slot_of(idx)
        if slot is not None:
            return slot
        # The other slot than the one in use, or than the last one used: a layer loaded at its
        # own acquire (a deferred prefetch) must not overwrite the layer just released, whose
        # kernels may still run (the copy would wait for them instead of overlapping them).
        busy = self._active if self._active is not None else self._last_slot
        slot = 0 if busy is None else 1 - busy
        store = self._stores[idx]
        exact = self._exact_slots(idx)
        buf = self._exact_buffer(slot) if exact and not store.resident else None
        self._wait_ready(idx)
        job = self._take(idx)
        free = self._slot_free[slot]
        with torch.cuda.stream(self._h2d):
            self._h2d.wait_event(free if free is not None else self._allocated)
            if self._slot_written[slot] is not None:  # a write-back still reads this slot
                self._h2d.wait_event(self._slot_written[slot])
            if idx in self._host_written:  # a device update's write-back of this layer
                self._h2d.wait_event(self._host_written[idx])
            dst = self._buffers[slot][: store.numel]
            if job is not None:
                self._update_on_device(idx, job, dst)
            elif store.resident:
                # HBM tier without a compute-dtype copy: a device-side cast, no PCIe.
                self._h2d.wait_event(self._masters_written)
                dst.copy_(store.master)
            elif store.stream.dtype != dst.dtype:
                # fp32-master streaming: the master crosses PCIe and is cast here, on the copy
                # stream (the single staging buffer is reused in this stream's order).
                stage = self._stage[: store.numel]
                if self._stage_master_read is not None:
                    self._h2d.wait_event(self._stage_master_read)
                stage.copy_(store.stream, non_blocking=True)
                dst.copy_(stage)
            else:
                dst.copy_(store.stream, non_blocking=True)
            if not store.resident and exact:
                # The device update's new master is on the device already.
                master = store.master if job is None else self._update_stage["master"]
                pos = 0
                for s in exact:  # a few hidden-sized fp32 vectors per layer
                    buf[pos : pos + s.numel].copy_(
                        master[s.offset : s.offset + s.numel], non_blocking=True
                    )
                    pos += s.numel
            ready = torch.cuda.Event()
            ready.record(self._h2d)
        self._slot_written[slot] = None
        if job is not None:
            self._write_back(idx, ready, dst, slot)
        if not store.resident and job is None:
            self.h2d_bytes += store.numel * store.stream.element_size()
            exact_bytes = 4 * sum(s.numel for s in exact)
            self.h2d_bytes += exact_bytes
            self.exact_h2d_bytes += exact_bytes
        self._slot_layer[slot] = idx
        self._slot_ready[slot] = ready
        return slot

    def _exact_slots(self, idx: int) -> list:
        """Layer ``idx``'s exact parameters' slots (none in fp32 runs, where the master is what
        runs, and for frozen stores, which keep no fp32 master)."""
        names = self._exact_names.get(idx)
        store = self._stores[idx]
        if not names or self._dtype == torch.float32 or store.master.dtype != torch.float32:
            return []
        return [s for s in store.slots if s.name in names]

    def _exact_buffer(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s fp32 buffer, sized for the largest streamed layer's exact parameters
        (made on first use, outside the copy stream: like the weight slots, its reuse is
        ordered by the slot's events)."""
        buf = self._exact_buffers[slot]
        if buf is None:
            numel = max(
                (sum(s.numel for s in self._exact_slots(i)) for i, st in enumerate(self._stores)
                 if not st.resident),
                default=0,
            )  # fmt: skip
            buf = self._exact_buffers[slot] = torch.empty(
                max(numel, 1), dtype=torch.float32, device=self._device
            )
            # Made on the compute stream mid-step: its memory may be what kernels still queued
            # there last used. Its first fill (copy stream) waits for them; without this the
            # fill could land before them and be overwritten (the first step only, with layers
            # running ahead of the first streamed one: OLMoE's first loss came out NaN).
            self._h2d.wait_stream(torch.cuda.current_stream(self._device))
        return buf

    def exact_params(self, idx: int) -> dict[str, torch.Tensor] | None:
        """Name -> fp32 value of layer ``idx``'s exact parameters, usable on the current stream
        after ``acquire(idx)`` until ``release(idx)``; None when the layer has none."""
        exact = self._exact_slots(idx)
        if not exact:
            return None
        store = self._stores[idx]
        if not self._cuda or store.resident:
            # The fp32 master is where the layer computes (host on the CPU, HBM for the tier).
            return {
                s.name: store.master[s.offset : s.offset + s.numel].view(s.shape) for s in exact
            }
        slot = self._slot_of(idx)
        if slot is None:
            raise RuntimeError(f"hf_megatrain: layer {idx}'s exact parameters read before acquire")
        buf, views, pos = self._exact_buffers[slot], {}, 0
        for s in exact:
            views[s.name] = buf[pos : pos + s.numel].view(s.shape)
            pos += s.numel
        return views

    def _prefetch(self, next_idx: int | None) -> None:
        if next_idx is None or not 0 <= next_idx < len(self._stores):
            return
        if not uses_slot(self._stores[next_idx]) or self._slot_of(next_idx) is not None:
            return
        if self._is_ready is not None and not self._is_ready(next_idx):
            self.deferred_prefetches += 1  # its acquire loads it (see the class docstring)
            return
        self._load(next_idx)

    def acquire(self, idx: int, next_idx: int | None) -> torch.Tensor:
        """Flat compute-dtype weights of layer ``idx`` usable on the current stream; starts the
        copy of ``next_idx`` (the layer that runs next) so it overlaps this layer's compute."""
        store = self._stores[idx]
        if not self._cuda:
            self._wait_ready(idx)
            job = self._take(idx)
            if job is not None:
                job(None)  # on the CPU the host state is where the update runs
            self._claim(idx)
            if store.stream.dtype != self._dtype:
                # fp32-master streaming on the CPU: the same cast the GPU does after its copy.
                return store.stream.to(self._dtype)
            return store.stream
        if not uses_slot(store):
            # HBM tier: already on the device and updated there; still prefetch the next one.
            self._claim(idx)
            self._prefetch(next_idx)
            return store.stream
        slot = self._load(idx)
        self._active = self._last_slot = slot
        torch.cuda.current_stream(self._device).wait_event(self._slot_ready[slot])
        self._claim(idx)
        self._prefetch(next_idx)
        return self._buffers[slot][: store.numel]

    def release(self, idx: int) -> None:
        """Mark the end of the work that reads layer ``idx``'s device slot."""
        if not self._cuda:
            return
        slot = self._slot_of(idx)
        if slot is None:
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self._device))
        self._slot_free[slot] = ev
        if self._active == slot:
            self._active = None

    @property
    def h2d(self) -> torch.cuda.Stream | None:
        """The copy stream (None on the CPU)."""
        return self._h2d if self._cuda else None

    # ---- device updates --------------------------------------------------------------------------
    def _take(self, idx: int) -> Callable[[dict | None], None] | None:
        return None if self._take_device_update is None else self._take_device_update(idx)

    def _claim(self, idx: int) -> None:
        if self._claim_ahead is None:
            return
        if not self._cuda or self._update_stage is None:
            self._claim_ahead(idx)
            return
        # The layer's kernels start once the compute stream passes this mark.
        mark = torch.cuda.Event(enable_timing=True)
        mark.record(torch.cuda.current_stream(self._device))
        self._pace.layer_started(idx, mark)
        self._claim_ahead(idx, self._pace.slack_s)

    def enable_device_updates(self, widen_numel: int) -> None:
        """Allocate what a device update of a host layer needs (CUDA): fp32 master and moments
        of the largest host layer, its gradient (the slot's dtype, and the fp32 part beside a
        compact slot) and an fp32 buffer of ``widen_numel`` to widen a compact gradient in."""
        if not self._cuda or self._update_stage is not None:
            return
        host = [
            s for s in self._stores
            if not s.resident and s.exp_avg is not None and s.grad is not None
        ]  # fmt: skip
        if not host:
            return
        numel = max(s.numel for s in host)
        grad_bytes = max(s.grad.numel() * s.grad.element_size() for s in host)
        fp32_grad = max((s.fp32_grad.numel() for s in host if s.fp32_grad is not None), default=0)
        dev = self._device
        if self._stage is not None and self._stage.numel() >= numel:
            master = self._stage  # fp32-master streaming's staging buffer: also in stream order
        else:
            master = torch.empty(numel, dtype=torch.float32, device=dev)
        self._update_stage = {
            "master": master,
            "exp_avg": torch.empty(numel, dtype=torch.float32, device=dev),
            "exp_avg_sq": torch.empty(numel, dtype=torch.float32, device=dev),
            "grad": torch.empty(grad_bytes, dtype=torch.uint8, device=dev),
            "fp32_grad": torch.empty(max(fp32_grad, 1), dtype=torch.float32, device=dev),
            "widen": torch.empty(widen_numel, dtype=torch.float32, device=dev),
        }
        self._writeback = torch.cuda.Stream(dev)
        # Allocated on the compute stream: their use (copy stream) waits for its work so far.
        self._stage_allocated = torch.cuda.Event()
        self._stage_allocated.record(torch.cuda.current_stream(dev))

    @property
    def device_updates_enabled(self) -> bool:
        return self._update_stage is not None or not self._cuda

    def _staged_state(self, idx: int) -> dict[str, torch.Tensor]:
        """Layer ``idx``'s master, moments and gradient copied into the staging buffers (on the
        current stream, the copy stream)."""
        store, stage = self._stores[idx], self._update_stage
        n = store.numel
        self._h2d.wait_event(self._stage_allocated)
        if self._stage_written is not None:  # the last write-back has read the buffers
            self._h2d.wait_event(self._stage_written)
        state = {
            "master": stage["master"][:n],
            "exp_avg": stage["exp_avg"][:n],
            "exp_avg_sq": stage["exp_avg_sq"][:n],
            "grad": stage["grad"][: n * store.grad.element_size()].view(store.grad.dtype),
            "fp32_grad": None,
            "widen": stage["widen"],
        }
        for key in ("master", "exp_avg", "exp_avg_sq", "grad"):
            state[key].copy_(getattr(store, key), non_blocking=True)
        nbytes = n * (12 + store.grad.element_size())
        if store.fp32_grad is not None:
            state["fp32_grad"] = stage["fp32_grad"][: store.fp32_grad.numel()]
            state["fp32_grad"].copy_(store.fp32_grad, non_blocking=True)
            nbytes += 4 * store.fp32_grad.numel()
        self.h2d_bytes += nbytes
        return state

    def _update_on_device(self, idx: int, job: Callable[[dict | None], None], dst) -> None:
        """Run layer ``idx``'s claimed update on its staged state and cast the new master into
        ``dst`` (the layer's slot), all on the copy stream."""
        state = self._staged_state(idx)
        job(state)
        dst.copy_(state["master"])

    def _write_back(self, idx: int, updated: torch.cuda.Event, dst, slot: int | None) -> None:
        """Copy layer ``idx``'s updated master and moments (and compute-dtype copy, where the
        store keeps one) from the staging buffers back to its host store, after ``updated``."""
        store, stage, n = self._stores[idx], self._update_stage, self._stores[idx].numel
        with torch.cuda.stream(self._writeback):
            self._writeback.wait_event(updated)
            store.master.copy_(stage["master"][:n], non_blocking=True)
            if stage["master"] is self._stage:
                # The shared buffer is free for the next fp32-master load from here (not only
                # once the moments are back too).
                self._stage_master_read = torch.cuda.Event()
                self._stage_master_read.record(self._writeback)
            for key in ("exp_avg", "exp_avg_sq"):
                getattr(store, key).copy_(stage[key][:n], non_blocking=True)
            if store.stream.data_ptr() != store.master.data_ptr():
                store.stream.copy_(dst, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._writeback)
        self._stage_written = done
        self._host_written[idx] = done
        if slot is not None:
            self._slot_written[slot] = done

    def flush_device_updates(self, layers: list[int]) -> None:
        """Run the claimed device updates of ``layers`` that no load has run yet, and wait until
        every device update's result is back in the host stores (before the host state is read
        or rewritten: a checkpoint, the next optimizer step)."""
        for idx in layers:
            job = self._take(idx)
            if job is None:
                continue
            if not self._cuda:
                job(None)
                continue
            with torch.cuda.stream(self._h2d):
                if idx in self._host_written:
                    self._h2d.wait_event(self._host_written[idx])
                # No slot to cast into: a buffer of its own, read by the write-back.
                cast = torch.empty(self._stores[idx].numel, dtype=self._dtype, device=self._device)
                self._update_on_device(idx, job, cast)
                updated = torch.cuda.Event()
                updated.record(self._h2d)
            self._write_back(idx, updated, cast, None)
            cast.record_stream(self._writeback)
        if self._writeback is not None:
            self._writeback.synchronize()

    def invalidate(self) -> None:
        """The host copies changed (optimizer step, load): forget what the slots hold."""
        if self._cuda:
            self._h2d.synchronize()  # no copy from the old host copy may still be in flight
            self._slot_layer = [None, None]
            self._masters_written.record(torch.cuda.current_stream(self._device))

    def wait_copies(self) -> None:
        """Block until no H2D copy reads the host stream copies (before they are rewritten) and
        no device update writes them back."""
        if self._cuda:
            self._h2d.synchronize()
            if self._writeback is not None:
                self._writeback.synchronize()
