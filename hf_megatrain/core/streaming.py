"""Streaming execution of weightless layer skeletons.

``StreamingEngine`` moves each layer's compute-dtype weights from the host store to one of two GPU
buffers on its own H2D stream (prefetching the next layer while the current one computes), and
drains fp32 gradients back to the host store on a D2H stream. CUDA events, never a device-wide
synchronize, order the streams in the steady state. On CPU the very same code path runs: the
"device buffer" is the host stream copy itself and copies vanish.

The layers that drive it (``StreamedLayer`` and its autograd ``Function``) are in
``streamed_layer.py``; this module holds the engine: weight buffers and streams, boundary
activations (offload, bf16 rounding), checkpoint-segment bookkeeping, gradients, RNG.

Checkpoint segments (``StreamingEngine.checkpoint_every = k > 1``): only the first layer of each
run of k (the leader) saves its residual-stream input; the backward of the segment's last layer
re-runs the leader..second-to-last layers under no_grad from the leader's saved input and caches
the inputs they make for the followers' backward (``segments.segment_input``). Bitwise the same inputs
as saving them, for k - 1 extra layer forwards per segment.

No ``transformers`` import here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .distributed import DataParallel
from .grad_norm import squared_norm
from .host_store import LayerStore, PinnedBuffer
from .layer_timing import LayerTimeline
from .segments import Segment, SegmentEntry, tensor_sig

#: Pinned host buffers (each the size of the largest host layer's fp32 gradient) through which
#: final gradients reach the eager CPU update when the stores hold no gradient slot. Two let one
#: layer's D2H copy land while the previous layer's update reads the other; more would only let
#: the backward run further ahead of a CPU update that bounds the step anyway.
GRAD_STAGING_SLOTS = 2
#: Data parallel: gradient reductions a rank that does not own their layers keeps buffers for
#: (the planner counts them beside the owner's draining ones).
REDUCES_IN_FLIGHT = 2


#: ``boundary_dtype`` names: the saved layer input kept as is, or rounded to bf16.
BOUNDARY_DTYPES: dict[str, torch.dtype | None] = {
    "input": None,
    "float32": None,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_boundary_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``StreamingEngine.boundary_dtype`` from a name (``BOUNDARY_DTYPES``) or a dtype."""
    if name is None or name == torch.float32:
        return None
    if name == torch.bfloat16:
        return name
    if isinstance(name, str) and name.lower() in BOUNDARY_DTYPES:
        return BOUNDARY_DTYPES[name.lower()]
    raise ValueError(
        f"hf_megatrain: boundary dtype {name!r} is not one of {', '.join(BOUNDARY_DTYPES)} "
        "('input' and 'float32' keep the saved layer inputs as they are, 'bfloat16' rounds them)"
    )


def _uses_slot(store) -> bool:
    """Whether a layer runs from a stream buffer slot: streamed layers, and HBM-tier layers that
    keep no compute-dtype copy (cast into the slot from their fp32 master)."""
    return not store.resident or store.casts_on_use


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class StreamingEngine:
    """Double-buffered layer weights on the compute device, gradients back to the host store."""

    def __init__(
        self,
        stores: list[LayerStore],
        device: torch.device,
        compute_dtype: torch.dtype,
        preserve_rng: bool = False,
        data_parallel: DataParallel | None = None,
    ) -> None:
        self.stores = stores
        # Data parallel (see core/distributed.py): streamed layers' gradients are reduced to
        # their owner, replicated (HBM-tier) ones all-reduced; weights of layers another rank
        # owns are streamed once that rank has published their update.
        self.dp = data_parallel
        # Optimizer steps this rank has taken: the version a layer's shared weights must reach
        # before it streams in (data parallel only).
        self.weights_version = 0
        self._pending_reduces: list[tuple[Any, torch.Tensor]] = []
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.preserve_rng = preserve_rng
        self.is_cuda = self.device.type == "cuda"
        self.autocast = compute_dtype != torch.float32
        # Gradient accumulation: with ``sync_grads`` False (a non-final micro-batch) gradients stay
        # in fp32 device accumulators; the final micro-batch drains them to the host store.
        self.sync_grads = True
        self._grad_acc: dict[int, torch.Tensor] = {}
        self._grad_on_host = [False] * len(stores)
        self._grad_sq: torch.Tensor | None = None
        self._d2h_events: list[torch.cuda.Event] = []
        self._grad_sq_exact = True
        # Host layers stored without a gradient slot (eager updates, no clipping): their final
        # gradient is handed to the update in a staging buffer (see ``final_grad``).
        staged = [s for s in stores if self._needs_staging(s)]
        self.grad_staging = bool(staged)
        self._staged: dict[int, tuple[int | None, torch.Tensor]] = {}
        # Host layers whose fp32 master is what streams (no compute-dtype copy in the store).
        cast = [s for s in stores if not s.resident and s.stream.dtype != compute_dtype]
        self.streams_fp32_master = bool(cast)
        if self.is_cuda:
            max_numel = max((s.numel for s in stores if _uses_slot(s)), default=0)
            self._buffers = [
                torch.empty(max_numel, dtype=compute_dtype, device=self.device) for _ in range(2)
            ]
            # fp32-master streaming: the master lands here (H2D stream) and is cast into a
            # compute-dtype buffer on the same stream, so the copies stay ordered.
            self._h2d_stage = (
                torch.empty(max(s.numel for s in cast), dtype=torch.float32, device=self.device)
                if cast
                else None
            )
            self._grad_ring: list[torch.Tensor] = []
            self._ring_free: list[threading.Event] = []
            self._ring_next = 0
            if staged:
                numel = max(s.numel for s in staged)
                pin = any(getattr(s, "pinned", False) for s in stores)
                self._ring_buffers = [
                    PinnedBuffer(numel * 4, pin=pin) for _ in range(GRAD_STAGING_SLOTS)
                ]
                self._grad_ring = [b.view((numel,), torch.float32) for b in self._ring_buffers]
                self._ring_free = [threading.Event() for _ in self._grad_ring]
                for ev in self._ring_free:
                    ev.set()
            self._h2d = torch.cuda.Stream(self.device)
            self._d2h = torch.cuda.Stream(self.device)
            self._slot_layer: list[int | None] = [None, None]
            self._slot_ready: list[torch.cuda.Event | None] = [None, None]
            self._slot_free: list[torch.cuda.Event | None] = [None, None]
            self._active_slot: int | None = None
            # HBM-tier layers without a compute-dtype copy are cast from their fp32 master on
            # the copy stream, after this event: the masters' last write (construction, the
            # optimizer step's GPU AdamW, a checkpoint load) on the compute stream.
            self._masters_written = torch.cuda.Event()
            self._masters_written.record(torch.cuda.current_stream(self.device))
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        # Host-side readiness of each layer's stream copy while a background optimizer update
        # runs (see ``HostAdamW``): a layer is copied to the device only once it is updated.
        self._update_ready: list[threading.Event] | None = None
        self._update_thread: threading.Thread | None = None
        self._update_error: BaseException | None = None
        # Boundary activation offload: layer inputs of at least ``offload_min_numel`` elements go
        # to host buffers (one per layer and input, reused every step) instead of staying on the
        # device until backward; backward prefetches layer i-1's while layer i recomputes.
        # Set by HostAdamW.enable_eager_updates: called with (layer, D2H event or None) when a
        # layer's gradient of the step is final (last micro-batch), still inside backward.
        self.on_grad_final: Callable[[int, Any], None] | None = None
        self.offload_activations = False
        # Set to a ``LayerTimeline`` (CUDA) to record each layer pass's compute interval.
        self.timeline: LayerTimeline | None = None
        # Size from which a floating layer input counts as a large activation (the hidden
        # states at training sizes, not ids or small masks): what offload moves and what
        # ``boundary_dtype`` may round.
        self.offload_min_numel = 1 << 20
        # Precision of the saved residual-stream input (see ``boundary_save_dtype``): None keeps
        # its dtype; torch.bfloat16 saves it rounded (half the bytes in HBM, or on the host and
        # over PCIe when offloaded) and backward recomputes the layer from it cast back. The
        # forward is unchanged; the gradients become an approximation.
        self.boundary_dtype: torch.dtype | None = None
        self._act_host: dict[tuple[int, int], PinnedBuffer] = {}
        self._act_handles: dict[tuple[int, int], dict] = {}
        # Checkpoint segments: with ``checkpoint_every = k > 1`` only the first layer (leader)
        # of each run of k decoder layers saves its residual-stream input; the others
        # (followers) get theirs in backward by re-running the segment's forward from the
        # leader's (``segments.segment_input``). ``_open_segment`` is the segment the forward is filling;
        # ``_backward_next[i]`` the layer whose weights layer i's backward should prefetch when
        # it is not i - 1 (the leader of the segment below, whose chain runs next).
        self.checkpoint_every = 1
        # Recompute into the forward's graph and stop after the last saved tensor (recompute.py);
        # False re-runs the whole layer into a graph of its own (the before/after switch).
        self.recompute_early_stop = True
        self._open_segment: Segment | None = None
        self._backward_next: dict[int, int] = {}

    # ---- background host updates ------------------------------------------------------------
    def start_updates(self, update_layer: Callable[[int], None], layers: list[int]) -> None:
        """Run ``update_layer(i)`` for ``layers`` in order on a CPU thread.

        Layers not listed are ready at once. The next forward pass streams layer ``i`` in as soon
        as its update is done, so the CPU AdamW step overlaps the next step's GPU work.
        """
        self.wait_updates()
        ready = [threading.Event() for _ in self.stores]
        pending = set(layers)
        for i, ev in enumerate(ready):
            if i not in pending:
                ev.set()

        # A new thread does not inherit the intra-op thread count set on the main thread (an
        # OpenMP runtime gives a fresh native thread its default team size): set it explicitly,
        # or the fused CPU AdamW may run on far fewer cores than the synchronous path.
        n_threads = torch.get_num_threads()

        def work() -> None:
            torch.set_num_threads(n_threads)
            try:
                for i in layers:
                    update_layer(i)
                    ready[i].set()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread
                self._update_error = exc
            finally:
                for ev in ready:
                    ev.set()

        self._update_ready = ready
        # Not a daemon: interpreter exit waits for it instead of killing it inside a torch op.
        self._update_thread = threading.Thread(target=work, name="megatrain-adamw")
        self._update_thread.start()

    def _wait_update(self, idx: int) -> None:
        if self._update_ready is not None:
            self._update_ready[idx].wait()
            if self._update_error is not None:
                self.wait_updates()
        if self._owned_elsewhere(idx):
            self.dp.wait_published(idx, self.weights_version)

    def _owned_elsewhere(self, idx: int) -> bool:
        """Whether another data-parallel rank updates layer ``idx``'s shared weights."""
        store = self.stores[idx]
        return (
            self.dp is not None and not store.resident and store.trainable and not self.dp.owns(idx)
        )

    def publish_update(self, idx: int, version: int) -> None:
        """Owner side: layer ``idx``'s shared weights hold optimizer step ``version``."""
        if self.dp is not None and not self.stores[idx].resident:
            self.dp.publish(idx, version)

    def wait_all_weights(self) -> None:
        """Block until every layer's weights are final: local and (under DP) remote updates."""
        self.wait_updates()
        for idx in range(len(self.stores)):
            if self._owned_elsewhere(idx):
                self.dp.wait_published(idx, self.weights_version)

    def wait_updates(self) -> None:
        """Block until the background update (if any) is done; re-raise its error."""
        if self._update_thread is not None:
            self._update_thread.join()
            self._update_thread = None
            self._update_ready = None
        if self._update_error is not None:
            err, self._update_error = self._update_error, None
            raise RuntimeError("hf_megatrain: the host optimizer update failed") from err

    # ---- boundary activations ----------------------------------------------------------------
    def is_large_activation(self, t: torch.Tensor) -> bool:
        """A floating layer input of at least ``offload_min_numel`` elements (not ids/masks)."""
        return t.is_floating_point() and t.numel() >= self.offload_min_numel

    def should_offload(self, t: torch.Tensor, residual_shapes: set[tuple[int, ...]]) -> bool:
        """Whether layer input ``t`` goes to host memory: a large activation of the residual
        stream (the shape of one of the layer's floating outputs). Other large inputs are the
        same tensor for every layer (RoPE cos/sin, tokens x head_dim, fp32: 512 MiB at 512k
        tokens): each saved reference shares one device copy, where offloading would store a
        host copy per layer (14 GiB over the plan in a 7B run at 524,288 tokens)."""
        return (
            self.offload_activations
            and tuple(t.shape) in residual_shapes
            and self.is_large_activation(t)
        )

    def boundary_save_dtype(
        self, t: torch.Tensor, residual_shapes: set[tuple[int, ...]]
    ) -> torch.dtype | None:
        """The narrower dtype to save layer input ``t`` in for the recompute, or None (as is).

        Only the residual stream is rounded: a large activation (as offload decides) of the
        shape of one of the layer's floating outputs (``residual_shapes``), so that rope cos/sin
        (tokens x head_dim, over the size threshold at long context) and masks stay exact.
        """
        bd = self.boundary_dtype
        if bd is None or tuple(t.shape) not in residual_shapes or not self.is_large_activation(t):
            return None
        return bd if t.element_size() > _itemsize(bd) else None

    def offload_activation(self, idx: int, k: int, t: torch.Tensor) -> dict:
        """Copy input ``k`` of layer ``idx`` to its host buffer; return the handle for backward."""
        nbytes = t.numel() * t.element_size()
        buf = self._act_host.get((idx, k))
        if buf is None or buf.nbytes < nbytes:
            buf = self._act_host[(idx, k)] = PinnedBuffer(nbytes, pin=self.is_cuda)
        host = buf.view(tuple(t.shape), t.dtype)
        event = None
        if self.is_cuda:
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._d2h):
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._d2h)
            t.record_stream(self._d2h)  # the device tensor lives until the copy is done
        else:
            host.copy_(t)
        handle = {"layer": idx, "host": host, "event": event, "device": None, "ready": None}
        self._act_handles[(idx, k)] = handle
        return handle

    def _start_fetch(self, handle: dict) -> None:
        if handle["device"] is not None:
            return
        host = handle["host"]
        if not self.is_cuda:
            handle["device"] = host.clone()
            return
        with torch.cuda.stream(self._h2d):
            if handle["event"] is not None:
                self._h2d.wait_event(handle["event"])
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            dev.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._h2d)
        handle["device"], handle["ready"] = dev, ready

    def fetch_activation(self, handle: dict, prefetch: bool = True) -> torch.Tensor:
        """The offloaded tensor back on the device; starts prefetching the previous layer's
        (and, with checkpoint segments, those of the segment leader whose chain runs next).

        The host copy stays: a segment's chain fetches its leader's input, and the leader's
        own backward fetches it again.
        """
        self._start_fetch(handle)
        dev = handle["device"]
        if self.is_cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(handle["ready"])
            dev.record_stream(compute)
        handle["device"] = None
        if prefetch:
            self.prefetch_activations(handle["layer"] - 1)
            hint = self._backward_next.get(handle["layer"])
            if hint is not None:
                self.prefetch_activations(hint)
        return dev

    def prefetch_activations(self, idx: int) -> None:
        """Start copying layer ``idx``'s offloaded inputs back to the device."""
        for (layer, _), other in list(self._act_handles.items()):
            if layer == idx:
                self._start_fetch(other)

    # ---- checkpoint segments -----------------------------------------------------------------
    def _segment_follow(
        self, idx: int, inputs: list[torch.Tensor], residual_shapes: set[tuple[int, ...]]
    ) -> tuple[Segment, int, int] | None:
        """Whether layer ``idx`` may skip saving its residual-stream input (a follower).

        It may when it is not at a segment start (``idx % checkpoint_every``), the segment being
        filled ends with layer ``idx - 1``, and one of its inputs is a large activation of the
        shape of one of its outputs that is, unmodified, an output of layer ``idx - 1`` (so that
        re-running ``idx - 1`` reproduces it). Returns ``(segment, input index, output index of
        the previous layer)``, or None: the layer saves its inputs and starts a segment.
        """
        k = self.checkpoint_every
        seg = self._open_segment
        if k <= 1 or idx % k == 0 or seg is None or seg.done or not seg.entries:
            return None
        last = seg.entries[-1]
        if last.layer.index != idx - 1:
            return None
        for pos, t in enumerate(inputs):
            if tuple(t.shape) not in residual_shapes or not self.is_large_activation(t):
                continue
            sig = tensor_sig(t)
            for o, out_sig in enumerate(last.out_sigs):
                if out_sig == sig:
                    return seg, pos, o
        return None

    def _segment_add(self, entry: SegmentEntry, follow) -> tuple[Segment, int]:
        """Register a layer's forward in its segment; returns ``(segment, position in it)``."""
        idx = entry.layer.index
        self._backward_next.pop(idx + 1, None)
        if follow is None:
            seg = self._open_segment = Segment()
        else:
            seg, _, entry.link_out = follow
            # Layer idx - 1 is no longer its segment's last layer; layer idx + 1's backward
            # (if it is a leader) runs before this segment's chain, which starts at the leader.
            self._backward_next.pop(idx, None)
            self._backward_next[idx + 1] = seg.entries[0].layer.index
        seg.entries.append(entry)
        if (idx + 1) % self.checkpoint_every == 0 or idx + 1 >= len(self.stores):
            self._open_segment = None  # complete: nothing else attaches to it
        return seg, len(seg.entries) - 1

    def break_segment(self) -> None:
        """The next layer starts a new segment (e.g. after a layer that keeps its graph)."""
        self._open_segment = None

    def reset_segments(self) -> None:
        """Forget the segment being filled and the backward prefetch hints."""
        self._open_segment = None
        self._backward_next.clear()

    # ---- weights ----------------------------------------------------------------------------
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
        slot = 0 if self._active_slot is None else 1 - self._active_slot
        store = self.stores[idx]
        self._wait_update(idx)
        free = self._slot_free[slot]
        with torch.cuda.stream(self._h2d):
            if free is not None:
                self._h2d.wait_event(free)
            dst = self._buffers[slot][: store.numel]
            if store.resident:
                # HBM tier without a compute-dtype copy: a device-side cast, no PCIe.
                self._h2d.wait_event(self._masters_written)
                dst.copy_(store.master)
            elif store.stream.dtype != dst.dtype:
                # fp32-master streaming: the master crosses PCIe and is cast here, on the copy
                # stream (the single staging buffer is reused in this stream's order).
                stage = self._h2d_stage[: store.numel]
                stage.copy_(store.stream, non_blocking=True)
                dst.copy_(stage)
            else:
                dst.copy_(store.stream, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._h2d)
        if not store.resident:
            self.h2d_bytes += store.numel * store.stream.element_size()
        self._slot_layer[slot] = idx
        self._slot_ready[slot] = ready
        return slot

    def acquire(self, idx: int, next_idx: int | None) -> torch.Tensor:
        """Flat compute-dtype weights of layer ``idx`` usable on the current stream.

        Also starts the copy of ``next_idx`` (the layer that runs after this one) into the other
        buffer, so it overlaps this layer's compute.
        """
        store = self.stores[idx]
        if not self.is_cuda:
            self._wait_update(idx)
            if store.stream.dtype != self.compute_dtype:
                # fp32-master streaming on the CPU: the same cast the GPU does after its copy.
                return store.stream.to(self.compute_dtype)
            return store.stream
        if not _uses_slot(store):
            # HBM tier: already on the device and updated there; still prefetch the next one.
            if next_idx is not None and 0 <= next_idx < len(self.stores):
                if _uses_slot(self.stores[next_idx]):
                    self._load(next_idx)
            return store.stream
        slot = self._load(idx)
        self._active_slot = slot
        torch.cuda.current_stream(self.device).wait_event(self._slot_ready[slot])
        if next_idx is not None and 0 <= next_idx < len(self.stores):
            if _uses_slot(self.stores[next_idx]):
                self._load(next_idx)
        return self._buffers[slot][: store.numel]

    def release(self, idx: int) -> None:
        """Mark the end of the work that reads layer ``idx``'s device buffer."""
        if not self.is_cuda:
            return
        slot = self._slot_of(idx)
        if slot is None:
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._slot_free[slot] = ev
        if self._active_slot == slot:
            self._active_slot = None

    def invalidate_weights(self) -> None:
        """The host copies changed (optimizer step, load): forget what the device buffers hold."""
        if self.is_cuda:
            self._h2d.synchronize()  # no copy from the old host copy may still be in flight
            self._slot_layer = [None, None]
            self._masters_written.record(torch.cuda.current_stream(self.device))

    def wait_weight_copies(self) -> None:
        """Block until no H2D copy reads the host stream copies (before the optimizer rewrites them)."""
        if self.is_cuda:
            self._h2d.synchronize()

    # ---- gradients --------------------------------------------------------------------------
    def add_grads(self, idx: int, grads: list[torch.Tensor | None]) -> None:
        """Accumulate layer ``idx``'s parameter gradients (one per slot, any float dtype)."""
        store = self.stores[idx]
        if self.dp is not None:
            self._add_grads_dp(idx, store, grads)
            return
        if store.resident or (not self.is_cuda and store.grad is not None):
            # Gradients accumulate in place where the store keeps them (host RAM on CPU runs,
            # HBM for the device tier); nothing to drain.
            first = not self._grad_on_host[idx]
            self._grad_on_host[idx] = True
            self._scatter_add(store, store.grad, grads, first)
            if self.sync_grads and self.on_grad_final is not None:
                self.on_grad_final(idx, None)
            return
        acc = self._accumulate(idx, store, grads)
        if acc is not None:
            self._drain(idx, acc)

    def _accumulate(
        self, idx: int, store: LayerStore, grads: list[torch.Tensor | None]
    ) -> torch.Tensor | None:
        """Add a micro-batch's gradient to the layer's fp32 device accumulator.

        Returns the accumulator once the step's last micro-batch is in (``sync_grads``), for the
        caller to drain or reduce; before that it stays in ``_grad_acc`` and None is returned.
        """
        acc = self._grad_acc.pop(idx, None)
        first = acc is None
        if first:
            # The first write covers every slot: only the alignment gaps need zeros.
            acc = torch.empty(store.numel, dtype=torch.float32, device=self.device)
            self._zero_gaps(store, acc)
        self._scatter_add(store, acc, grads, first)
        if self.sync_grads:
            return acc
        self._grad_acc[idx] = acc
        return None

    def _add_grads_dp(self, idx: int, store: LayerStore, grads: list[torch.Tensor | None]) -> None:
        """Data parallel: accumulate locally, reduce once the step's last micro-batch is done."""
        if self._grad_on_host[idx]:
            raise RuntimeError(
                f"hf_megatrain: layer {idx} got a second gradient in one optimizer step; data "
                "parallel reduces each layer once per step and needs the trainer's "
                "gradient-accumulation flags"
            )
        if store.resident:
            # Replicated (HBM tier): accumulate in place, all-reduce (average) at the last
            # micro-batch; every rank then updates its replica identically.
            first = idx not in self._grad_acc
            self._grad_acc[idx] = store.grad
            self._scatter_add(store, store.grad, grads, first)
            if self.sync_grads:
                del self._grad_acc[idx]
                self.dp.all_reduce_mean_([store.grad])
                self._grad_on_host[idx] = True
                if self.on_grad_final is not None:
                    self.on_grad_final(idx, None)
            return
        acc = self._accumulate(idx, store, grads)
        if acc is not None:
            self._reduce_to_owner(idx, acc)

    def _reduce_to_owner(self, idx: int, acc: torch.Tensor) -> None:
        """Sum ``acc`` over the ranks into the owner, who averages it into its host gradient.

        On CUDA the reduction runs on the collective library's stream (issued after this
        layer's backward, it overlaps the backward of the layers below); only the owner's D2H
        stream waits for it, and only the owner copies the gradient to the host.
        """
        store = self.stores[idx]
        dp = self.dp
        mine = dp.owns(idx)
        inv = 1.0 / dp.world_size
        self._grad_on_host[idx] = True
        if not self.is_cuda:
            dp.reduce_to_owner(acc, idx, async_op=False)
            if mine:
                if store.grad is None:
                    acc.mul_(inv)
                    self._stage_cpu(idx, acc)
                    return
                torch.mul(acc, inv, out=store.grad)
                if self.on_grad_final is not None:
                    self.on_grad_final(idx, None)
            return
        work = dp.reduce_to_owner(acc, idx, async_op=True)
        if not mine:
            # Keep the buffer alive until the reduction has read it, but no longer: held until
            # backward ends, every rank would keep the fp32 gradients of the layers the others
            # own in HBM (half the streamed layers on 2 GPUs; 26.3B ran out of memory so).
            # Waiting on an older reduction makes the compute stream, not the host, wait for
            # it; issued layers ago, it is done in practice.
            self._pending_reduces.append((work, acc))
            while len(self._pending_reduces) > REDUCES_IN_FLIGHT:
                self._pending_reduces.pop(0)[0].wait()
            return
        # No grad slot: the reduced gradient goes to a staging buffer. Taken after the
        # reduction was issued, so waiting for a free one never holds up the other ranks.
        dest = store.grad if store.grad is not None else self._take_staging(idx, store.numel)
        with torch.cuda.stream(self._d2h):
            work.wait()  # the D2H stream (current here) waits for the reduction, not the host
            acc.mul_(inv)
            # The running norm is summed on this stream too: on the compute stream it would
            # read ``sq`` before this stream has written it.
            sq = torch.linalg.vector_norm(acc).square()
            self._grad_sq = sq if self._grad_sq is None else self._grad_sq + sq
            dest.copy_(acc, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._d2h)
        acc.record_stream(self._d2h)
        self._d2h_events.append(ev)
        self.d2h_bytes += acc.numel() * 4
        if self.on_grad_final is not None:
            self.on_grad_final(idx, ev)

    @staticmethod
    def _zero_gaps(store: LayerStore, flat: torch.Tensor) -> None:
        """Zero what no slot covers in ``flat`` (alignment gaps, the tail)."""
        end = 0
        for slot in sorted(store.slots, key=lambda s: s.offset):
            if slot.offset > end:
                flat[end : slot.offset].zero_()
            end = max(end, slot.offset + slot.numel)
        if end < flat.numel():
            flat[end:].zero_()

    @staticmethod
    def _scatter_add(
        store: LayerStore, flat: torch.Tensor, grads: list[torch.Tensor | None], first: bool
    ) -> None:
        """Add each slot's gradient into ``flat``; ``first``: the step's first, so write it.

        Writing (a converting copy: 6 bytes per bf16 element) instead of zeroing and adding (4 +
        10) cuts the pass's memory traffic by more than half. The alignment gaps between slots
        are never written: zero from allocation, they stay zero.
        """
        for slot, g in zip(store.slots, grads):
            dst = flat[slot.offset : slot.offset + slot.numel]
            if g is None:
                if first:
                    dst.zero_()
            elif first:
                dst.copy_(g.reshape(-1))
            else:
                dst.add_(g.reshape(-1))

    # ---- gradient staging (host stores without a grad slot) ----------------------------------
    @staticmethod
    def _needs_staging(store) -> bool:
        return (
            not store.resident
            and store.trainable
            and store.owned
            and not getattr(store, "holds_grad", True)
        )

    def _no_slot_check(self, idx: int) -> None:
        # (Data parallel marks the layer's gradient as arrived before staging it; a second one
        # is refused earlier there, in ``_add_grads_dp``.)
        if self.on_grad_final is None:
            raise RuntimeError(
                f"hf_megatrain: layer {idx}'s host store has no gradient slot (built for eager "
                "updates), so its gradient must be consumed as soon as it is final, but no eager "
                "optimizer is attached (HostAdamW.enable_eager_updates). Build the model with "
                "host_grads=True to hold gradients until step()."
            )
        if self.dp is None and self._grad_on_host[idx]:
            raise RuntimeError(
                f"hf_megatrain: layer {idx} got a second gradient in one step, but its host "
                "store has no gradient slot to add it to (eager updates need the trainer's "
                "gradient-accumulation flags)"
            )

    def _stage_cpu(self, idx: int, grad: torch.Tensor) -> None:
        """CPU: the final gradient already is in host memory; the update reads it in place."""
        self._no_slot_check(idx)
        sq = squared_norm(grad)
        self._grad_sq = sq if self._grad_sq is None else self._grad_sq + sq
        self._grad_on_host[idx] = True
        self._staged[idx] = (None, grad)
        self.on_grad_final(idx, None)

    def _take_staging(self, idx: int, numel: int) -> torch.Tensor:
        """The next staging buffer, once the update that read it last has finished.

        A host-side wait (a ``threading.Event`` set by ``grad_consumed``), never a device
        synchronization: the GPU keeps running the work already queued.
        """
        self._no_slot_check(idx)
        slot = self._ring_next
        self._ring_next = (slot + 1) % len(self._grad_ring)
        self._ring_free[slot].wait()
        self._ring_free[slot].clear()
        view = self._grad_ring[slot][:numel]
        self._staged[idx] = (slot, view)
        return view

    def final_grad(self, idx: int) -> torch.Tensor:
        """Layer ``idx``'s final fp32 gradient of the step on the host (flat).

        The store's slot, or, without one, the staging buffer it was copied to (read it after
        the event ``on_grad_final`` passed, then call ``grad_consumed``).
        """
        store = self.stores[idx]
        if store.grad is not None:
            return store.grad
        staged = self._staged.get(idx)
        if staged is None:
            raise RuntimeError(
                f"hf_megatrain: layer {idx} holds no gradient: its host store has no gradient "
                "slot (eager updates), and the staged gradient was already consumed. Clipping, "
                "a second optimizer step or reading gradients after the update need "
                "host_grads=True (megatrain_host_grads)."
            )
        return staged[1]

    def grad_consumed(self, idx: int) -> None:
        """The update has read layer ``idx``'s staged gradient: its buffer may be reused."""
        staged = self._staged.pop(idx, None)
        if staged is not None and staged[0] is not None:
            self._ring_free[staged[0]].set()

    def _drain(self, idx: int, acc: torch.Tensor) -> None:
        store = self.stores[idx]
        if not self.is_cuda:  # only host stores without a grad slot drain on the CPU
            self._stage_cpu(idx, acc)
            return
        sq = torch.linalg.vector_norm(acc).square()
        self._grad_sq = sq if self._grad_sq is None else self._grad_sq + sq
        compute = torch.cuda.current_stream(self.device)
        if store.grad is None:
            dest = self._take_staging(idx, store.numel)
        elif self._grad_on_host[idx]:
            # A second drain in one optimizer step (backward without the trainer's sync flag):
            # add on the host, after the first drain's copy has landed. Correct, not fast; the
            # trainer never takes this path. The running norm no longer matches: recompute it.
            if self.on_grad_final is not None:
                raise RuntimeError(
                    f"hf_megatrain: layer {idx} got a second gradient in one step with eager "
                    "updates on; they need the trainer's gradient-accumulation flags"
                )
            self._grad_sq_exact = False
            for ev in self._d2h_events:
                ev.synchronize()
            self._d2h_events.clear()
            store.grad.add_(acc.to("cpu"))
            return
        else:
            dest = store.grad
        self._d2h.wait_stream(compute)
        with torch.cuda.stream(self._d2h):
            dest.copy_(acc, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._d2h)
        acc.record_stream(self._d2h)
        self._d2h_events.append(ev)
        self.d2h_bytes += acc.numel() * 4
        self._grad_on_host[idx] = True
        if self.on_grad_final is not None:
            self.on_grad_final(idx, ev)

    def finish_grads(self) -> None:
        """Drain leftover accumulators and wait for every D2H copy: host grads are then final."""
        for idx in sorted(self._grad_acc):
            acc = self._grad_acc.pop(idx)
            if self.dp is None:
                self._drain(idx, acc)
            elif self.stores[idx].resident:
                self.dp.all_reduce_mean_([acc])
                self._grad_on_host[idx] = True
            else:
                self._reduce_to_owner(idx, acc)
        for work, _ in self._pending_reduces:
            work.wait()
        self._pending_reduces.clear()
        for ev in self._d2h_events:
            ev.synchronize()
        self._d2h_events.clear()

    def layer_has_grad(self, idx: int) -> bool:
        """Whether layer ``idx`` received a gradient this step (else the optimizer skips it)."""
        return self._grad_on_host[idx]

    def grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares of all layer gradients (call after ``finish_grads``).

        Under data parallel, every rank gets the same global sum: each rank's owned layers
        are summed over the ranks, the replicated (HBM-tier) layers are counted once. So it is
        a collective: every rank must call it.
        """
        # The running sum covers every streamed layer on CUDA, and on the CPU when the stores
        # hold no gradient slot (it is the only record of those gradients once consumed).
        running = (
            self._grad_sq is not None
            and (self.is_cuda or self.grad_staging)
            and self._grad_sq_exact
        )
        streamed = torch.zeros((), dtype=torch.float32)
        replicated = torch.zeros((), dtype=torch.float32, device=self.device)
        for idx, store in enumerate(self.stores):
            if not self._grad_on_host[idx] or store.grad is None:
                continue
            if store.resident:
                replicated += squared_norm(store.grad)
            elif not running:
                streamed += squared_norm(store.grad).cpu()
        streamed = self._grad_sq if running else streamed.to(self.device)
        if self.dp is not None:
            streamed = streamed.clone()
            self.dp.all_reduce_sum(streamed)
        return streamed + replicated

    def has_grads(self) -> bool:
        return any(self._grad_on_host) or bool(self._grad_acc)

    def reset_grads(self) -> None:
        self.reset_segments()
        for idx in list(self._staged):
            self.grad_consumed(idx)  # e.g. after a failed update: its buffer is free again
        self._grad_acc.clear()
        self._grad_on_host = [False] * len(self.stores)
        self._grad_sq = None
        self._grad_sq_exact = True
        self._pending_reduces.clear()

    # ---- rng ----------------------------------------------------------------------------------
    def rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if not self.preserve_rng:
            return None
        cuda_state = torch.cuda.get_rng_state(self.device) if self.is_cuda else None
        return torch.get_rng_state(), cuda_state

    @contextlib.contextmanager
    def restored_rng(self, state) -> Iterator[None]:
        if state is None:
            yield
            return
        devices = [self.device] if self.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(state[0])
            if state[1] is not None:
                torch.cuda.set_rng_state(state[1], self.device)
            yield

    def compute_context(self) -> contextlib.AbstractContextManager:
        if self.autocast:
            return torch.autocast(self.device.type, dtype=self.compute_dtype)
        return contextlib.nullcontext()
