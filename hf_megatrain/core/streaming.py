"""Streaming execution of weightless layer skeletons.

``StreamingEngine`` moves each layer's compute-dtype weights from the host store to one of two
GPU buffers on its own H2D stream (prefetching the next layer while the current one computes),
and drains fp32 gradients back to the host store on a D2H stream. CUDA events, never a
device-wide synchronize, order the streams in the steady state. On CPU the very same code path
runs: the "device buffer" is the host stream copy itself and copies vanish.

The engine is made of parts (``engine/``): ``WeightStreamer`` (weights), ``ActivationStash``
(saved layer inputs: offload, bf16 rounding), ``SegmentTracker`` (checkpoint segments, in
``segments.py``), ``GradientSink`` (gradients, data-parallel reduce, norm) and
``UpdateScheduler`` (background host updates, weight versions). It composes them, owns the
copy streams they share, and keeps RNG preservation and the compute context. The layers that
drive it (``StreamedLayer`` and its autograd ``Function``) are in ``streamed_layer.py``.

No ``transformers`` import here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .autocast_kernels import AutocastKernels
from .distributed import DataParallel
from .engine.activations import ActivationHandle, ActivationStash
from .engine.gradients import REDUCES_IN_FLIGHT, GradientSink
from .engine.staging import GRAD_STAGING_SLOTS
from .engine.updates import UpdateScheduler
from .engine.weights import WeightStreamer
from .host_store import LayerStore
from .layer_timing import LayerTimeline
from .options import BOUNDARY_DTYPES, EngineOptions, parse_boundary_dtype
from .rng import RngState, replayed_rng, rng_state
from .segments import SegmentTracker

__all__ = [
    "BOUNDARY_DTYPES",
    "GRAD_STAGING_SLOTS",
    "REDUCES_IN_FLIGHT",
    "StreamingEngine",
    "parse_boundary_dtype",
]


#: The engine options' defaults, resolved (what an engine built without settings runs with).
_DEFAULT = EngineOptions().resolve(clipping=True, cuda=False)


def _check_segment_length(checkpoint_every: object) -> None:
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int):
        raise ValueError(f"hf_megatrain: checkpoint_every={checkpoint_every!r} is not an int")
    if checkpoint_every < 1:
        raise ValueError(f"hf_megatrain: checkpoint_every={checkpoint_every} must be >= 1")


class StreamingEngine:
    """Double-buffered layer weights on the compute device, gradients back to the host store.

    Settings are fixed at construction: ``offload_activations`` (saved residual-stream inputs
    go to host buffers until backward), ``boundary_dtype`` (None, or torch.bfloat16: saved
    residual-stream inputs rounded; the gradients become an approximation),
    ``checkpoint_every`` (k > 1: only every k-th layer saves its input, see ``segments.py``),
    ``recompute_early_stop`` (recompute into the forward's graph and stop after the last saved
    tensor, ``recompute.py``; False re-runs whole layers), ``chain_attention_outputs`` (a
    segment's chain keeps the attention outputs of its last N layers for their recompute,
    ``segments.segment_input``; the builder passes ``ResolvedOptions.chain_attention_layers``,
    0 where no recompute would use them; ``chain_attention_by_segment``: per segment, by its
    first layer, where the plan keeps more in segments below its peak,
    ``MemoryPlan.chain_output_counts``). ``data_parallel``: streamed layers'
    gradients reduced to their owner, replicated ones all-reduced, weights of layers another
    rank owns streamed once it has published their update (``distributed.py``).
    """

    def __init__(
        self,
        stores: list[LayerStore],
        device: torch.device,
        compute_dtype: torch.dtype,
        *,
        preserve_rng: bool = False,
        data_parallel: DataParallel | None = None,
        # The engine options' defaults (``options.py``); the builder passes the run's.
        offload_activations: bool = _DEFAULT.offload_activations,
        boundary_dtype: torch.dtype | None = _DEFAULT.boundary_dtype,
        checkpoint_every: int = _DEFAULT.checkpoint_every,
        recompute_early_stop: bool = _DEFAULT.recompute_early_stop,
        autocast_kernels: bool = _DEFAULT.autocast_kernels,
        chain_attention_outputs: int = _DEFAULT.chain_attention_outputs,
        chain_attention_by_segment: Mapping[int, int] | None = None,
    ) -> None:
        self.stores = stores
        self.dp = data_parallel
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.preserve_rng = preserve_rng
        self.is_cuda = self.device.type == "cuda"
        self.autocast = compute_dtype != torch.float32
        _check_segment_length(checkpoint_every)
        self._recompute_early_stop = bool(recompute_early_stop)
        self._autocast_kernels = bool(autocast_kernels)
        # The copy streams, shared: weights and activation fetches go H2D, gradient drains and
        # activation offloads D2H, each in its stream's order.
        h2d = torch.cuda.Stream(self.device) if self.is_cuda else None
        d2h = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.updates = UpdateScheduler(stores, data_parallel)
        # Layer -> parameters bound from the fp32 master (``bind_exact``).
        self._exact_names: dict[int, tuple[str, ...]] = {}
        self._device_widen_numel = 0  # device updates' staging (``enable_device_updates``)
        self.weights = self._weight_streamer(h2d)
        self.grads = GradientSink(stores, self.device, data_parallel, d2h)
        self.activations = ActivationStash(
            self.device,
            offload=bool(offload_activations),
            boundary_dtype=parse_boundary_dtype(boundary_dtype),
            h2d=h2d,
            d2h=d2h,
        )
        self.segments = SegmentTracker(
            len(stores), checkpoint_every, self.activations.is_large, chain_attention_outputs,
            chain_attention_by_segment,
        )  # fmt: skip
        # Set to a ``LayerTimeline`` (CUDA) to record each layer pass's compute interval.
        self.timeline: LayerTimeline | None = None
        # Layer -> its master's version when views of it were handed out (``watch_master``), or
        # when the optimizer last wrote it (``publish_update``).
        self._watched: dict[int, int] = {}

    # ---- settings (read-only) and per-step state ----------------------------------------------
    @property
    def offload_activations(self) -> bool:
        return self.activations.offload_enabled

    @property
    def boundary_dtype(self) -> torch.dtype | None:
        return self.activations.boundary_dtype

    @property
    def checkpoint_every(self) -> int:
        return self.segments.every

    @property
    def recompute_early_stop(self) -> bool:
        return self._recompute_early_stop

    @property
    def autocast_kernels(self) -> bool:
        return self._autocast_kernels

    @property
    def offload_min_numel(self) -> int:
        """Size from which a floating layer input counts as a large activation (tests lower it)."""
        return self.activations.min_numel

    @offload_min_numel.setter
    def offload_min_numel(self, value: int) -> None:
        self.activations.min_numel = value

    @property
    def sync_grads(self) -> bool:
        """False for a non-final micro-batch: gradients stay in fp32 device accumulators."""
        return self.grads.sync

    @sync_grads.setter
    def sync_grads(self, value: bool) -> None:
        self.grads.sync = value

    @property
    def on_grad_final(self) -> Callable[[int, Any], None] | None:
        """Called with (layer, D2H event or None) when a layer's gradient of the step is final."""
        return self.grads.on_final

    @on_grad_final.setter
    def on_grad_final(self, fn: Callable[[int, Any], None] | None) -> None:
        self.grads.on_final = fn

    @property
    def weights_version(self) -> int:
        """Optimizer steps taken: the version shared weights must reach (data parallel)."""
        return self.updates.weights_version

    @weights_version.setter
    def weights_version(self, version: int) -> None:
        self.updates.weights_version = version

    @property
    def grad_staging(self) -> bool:
        """Whether some host layer has no gradient slot (gradients pass a staging ring)."""
        return self.grads.staging.enabled

    @property
    def streams_fp32_master(self) -> bool:
        return self.weights.streams_fp32_master

    @property
    def h2d_bytes(self) -> int:
        return self.weights.h2d_bytes

    @property
    def exact_h2d_bytes(self) -> int:
        """Of ``h2d_bytes``, the fp32 values of ``bind_exact`` parameters."""
        return self.weights.exact_h2d_bytes

    @property
    def d2h_bytes(self) -> int:
        return self.grads.d2h_bytes

    @property
    def deferred_prefetches(self) -> int:
        """Layer copies left to the layer's own acquire because its host update was still
        running when the layer before it started (``WeightStreamer``)."""
        return self.weights.deferred_prefetches

    # ---- weights and updates -------------------------------------------------------------------
    def acquire(self, idx: int, next_idx: int | None) -> torch.Tensor:
        """Layer ``idx``'s flat compute-dtype weights; starts copying ``next_idx``'s."""
        if self._watched:
            self._refresh_written_masters()
        return self.weights.acquire(idx, next_idx)

    def watch_master(self, idx: int) -> None:
        """Views of layer ``idx``'s fp32 master were handed out (``state_dict()``): if they are
        written in place before the layer next runs, its compute-dtype copy is re-derived then
        and the device's copies of the layers are dropped."""
        self._watched[idx] = self.stores[idx].master._version

    def _refresh_written_masters(self) -> None:
        # In-place writes share the master's version counter with its views (so do the
        # optimizer's, but it re-derives the compute copy itself and its publish_update takes a
        # new snapshot; an update it did not publish costs one redundant cast here).
        changed = [i for i, v in self._watched.items() if self.stores[i].master._version != v]
        self._watched.clear()
        if not changed:
            return
        self.wait_all_weights()
        self.wait_weight_copies()  # no H2D copy may still read a compute copy
        with torch.no_grad():
            for idx in changed:
                self.stores[idx].refresh_stream_copy()  # (fp32: the master itself, no-op)
        self.invalidate_weights()

    def release(self, idx: int) -> None:
        """Mark the end of the work that reads layer ``idx``'s device buffer."""
        self.weights.release(idx)

    def bind_exact(self, idx: int, names: list[str] | tuple[str, ...]) -> None:
        """Layer ``idx``'s parameters ``names`` run at their fp32 master values with fp32
        gradients in mixed-precision runs, as the stock Trainer runs parameters that autocast
        does not cast (residual-stream norm weights); the rest run as the compute-dtype copy."""
        self._exact_names[idx] = tuple(names)
        if not self.stores[idx].resident:
            self.stores[idx].hold_fp32_grads(names)

    def exact_params(self, idx: int) -> dict[str, torch.Tensor] | None:
        """Name -> fp32 value of layer ``idx``'s ``bind_exact`` parameters on the device, valid
        between ``acquire(idx)`` and ``release(idx)``; None when there are none to bind (fp32
        runs: the master is what streams)."""
        return self.weights.exact_params(idx)

    def abort_step(self) -> None:
        """Forget a step that failed part-way (e.g. out of GPU memory): its gradients, the
        layers' device slots, saved activations still fetched or in flight. The host weights
        and optimizer state are untouched; the step can be run again from its start."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)  # no copy of the failed step still in flight
        self.weights.invalidate()
        self.activations.reset()
        self.reset_grads()

    def change_activation_options(
        self, *, offload_activations: bool | None = None, checkpoint_every: int | None = None
    ) -> None:
        """Hold the layers' saved inputs another way from the next step on (between steps: the
        out-of-memory watchdog, after ``abort_step``). Both ways are exact: offloaded inputs come
        back as they left, and a segment's followers are recomputed from its leader's input. New
        segments keep no chain attention outputs (those were planned for the old length)."""
        if offload_activations is not None:
            self.activations.set_offload(bool(offload_activations))
        if checkpoint_every is not None and checkpoint_every != self.segments.every:
            _check_segment_length(checkpoint_every)
            self.segments = SegmentTracker(
                len(self.stores), checkpoint_every, self.activations.is_large
            )

    def replace_stores(
        self,
        replacements: dict[int, LayerStore],
        release: Callable[[list[int]], None] | None = None,
    ) -> None:
        """Give layers new stores (between steps: an HBM-tier layer moved to the host tier).

        ``release(layers)`` is called once the engine no longer holds the old stores, for the
        caller to drop its own references (the optimizer's) before the weight slots and the
        gradient parts are rebuilt for the new sizes: on a full GPU the old stores' memory is
        what the new slots need. The update scheduler reads the same (mutated) list."""
        if self.dp is not None:
            raise RuntimeError("hf_megatrain: layer stores cannot be replaced under data parallel")
        self.wait_updates()
        self.weights.wait_copies()
        for idx, store in replacements.items():
            self.stores[idx] = store
            store.hold_fp32_grads(self._exact_names.get(idx, ()))
        h2d, h2d_bytes = self.weights.h2d, self.weights.h2d_bytes
        exact_h2d_bytes, deferred = self.weights.exact_h2d_bytes, self.weights.deferred_prefetches
        grads = self.grads
        on_final, sync, d2h, d2h_bytes = grads.on_final, grads.sync, grads.d2h, grads.d2h_bytes
        del self.weights, self.grads, grads  # their device buffers go with them
        if release is not None:
            release(list(replacements))
        if self.is_cuda:
            torch.cuda.empty_cache()
        self.weights = self._weight_streamer(h2d)
        self.weights.h2d_bytes, self.weights.exact_h2d_bytes = h2d_bytes, exact_h2d_bytes
        self.weights.deferred_prefetches = deferred
        self.grads = GradientSink(self.stores, self.device, self.dp, d2h)
        self.grads.on_final, self.grads.sync, self.grads.d2h_bytes = on_final, sync, d2h_bytes

    def _weight_streamer(self, h2d: torch.cuda.Stream | None) -> WeightStreamer:
        weights = WeightStreamer(
            self.stores, self.device, self.compute_dtype, self.updates.wait_layer, h2d,
            self._exact_names, is_ready=self.updates.layer_ready,
            take_device_update=self.updates.take_device_update,
            claim_ahead=self.updates.claim_ahead,
        )  # fmt: skip
        if self._device_widen_numel:
            weights.enable_device_updates(self._device_widen_numel)
        return weights

    def enable_device_updates(self, widen_numel: int) -> None:
        """Allocate the device's staging for host-layer updates it takes over from a CPU update
        that falls behind (``WeightStreamer.enable_device_updates``; the plan's line)."""
        self._device_widen_numel = widen_numel
        self.weights.enable_device_updates(widen_numel)

    @property
    def device_updates(self) -> int:
        """Host-layer updates the device took over from the overlapped CPU update, in all."""
        return self.updates.device_updates

    def invalidate_weights(self) -> None:
        """The host copies changed (optimizer step, load): forget what the device buffers hold."""
        self.weights.invalidate()

    def wait_weight_copies(self) -> None:
        """Block until no H2D copy reads the host stream copies (before they are rewritten)."""
        self.weights.wait_copies()

    def start_updates(
        self,
        update_layer: Callable[[int], None],
        layers: list[int],
        n_threads: int = 0,
        device_update: Callable[[int], Callable[[dict | None], None]] | None = None,
        lead: int = 0,
        claimable: Callable[[int], bool] | None = None,
    ) -> None:
        """Run ``update_layer(i)`` for ``layers`` on a CPU thread (``UpdateScheduler.start``);
        with ``device_update`` and ``lead``, the device takes over layers the CPU has not
        reached when the forward comes within ``lead`` layers of them."""
        if not self.weights.device_updates_enabled:
            device_update = None
        self.updates.start(update_layer, layers, n_threads, device_update, lead, claimable)

    @property
    def host_wait_s(self) -> float:
        """Seconds the training thread has waited for host optimizer updates, in all
        (``UpdateScheduler.blocked_s``)."""
        return self.updates.blocked_s

    @property
    def host_update_seconds(self) -> tuple[float, int]:
        """Seconds the CPU AdamW thread has spent updating host layers, and the parameters it
        updated, in all (``UpdateScheduler.cpu_update_totals``): their ratio is this host's
        rate."""
        return self.updates.cpu_update_totals

    def wait_updates(self) -> None:
        """Block until the background update (if any) is done and every layer the device took
        over is updated and back in its host store; re-raise the update's error."""
        self.updates.wait()
        self.weights.flush_device_updates(self.updates.pending_device_updates())

    def publish_update(self, idx: int, version: int, rederived: bool = True) -> None:
        """Owner side: layer ``idx``'s shared weights hold optimizer step ``version``
        (``rederived``: this call follows the update's write of them, compute copy included)."""
        if rederived and idx in self._watched:  # (its write of the master: not one outside)
            self._watched[idx] = self.stores[idx].master._version
        self.updates.publish(idx, version)

    def wait_all_weights(self) -> None:
        """Block until every layer's weights are final: local and (under DP) remote updates."""
        self.wait_updates()
        self.updates.wait_all()

    # ---- saved activations ---------------------------------------------------------------------
    def fetch_activation(self, handle: ActivationHandle, prefetch: bool = True) -> torch.Tensor:
        """The offloaded tensor back on the device; with ``prefetch``, starts fetching the
        previous layer's (and, with checkpoint segments, those of the segment leader whose
        chain runs next)."""
        dev = self.activations.fetch(handle)
        if prefetch:
            self.activations.prefetch(handle.layer - 1)
            hint = self.segments.backward_hint(handle.layer)
            if hint is not None:
                self.activations.prefetch(hint)
        return dev

    def prefetch_activations(self, idx: int) -> None:
        """Start copying layer ``idx``'s offloaded inputs back to the device."""
        self.activations.prefetch(idx)

    def reset_segments(self) -> None:
        """Forget the segment being filled and the backward prefetch hints."""
        self.segments.reset()

    # ---- gradients ------------------------------------------------------------------------------
    def add_grads(self, idx: int, grads: list[torch.Tensor | None]) -> None:
        """Accumulate layer ``idx``'s parameter gradients (one per slot, any float dtype)."""
        self.grads.add(idx, grads)

    def finish_grads(self) -> None:
        """Drain leftover accumulators and wait for every D2H copy: host grads are then final."""
        self.grads.finish()

    def final_grad(self, idx: int) -> torch.Tensor:
        """Layer ``idx``'s final fp32 gradient of the step on the host (flat)."""
        return self.grads.final_grad(idx)

    def grad_consumed(self, idx: int) -> None:
        """The update has read layer ``idx``'s staged gradient: its buffer may be reused."""
        self.grads.consumed(idx)

    def layer_has_grad(self, idx: int) -> bool:
        """Whether layer ``idx`` received a gradient this step (else the optimizer skips it)."""
        return self.grads.layer_has_grad(idx)

    def gradless_slots(self, idx: int) -> frozenset[int]:
        """Slots (positions) of layer ``idx`` that got no gradient this step: AdamW skips them."""
        return self.grads.gradless_slots(idx)

    def grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares of all layer gradients (after ``finish_grads``; a DP collective)."""
        return self.grads.sq_sum()

    def has_grads(self) -> bool:
        return self.grads.has_grads()

    def finals_sent(self) -> int:
        """Layers whose final gradient of this step went to ``on_grad_final`` (eager updates:
        they may already be updated)."""
        return self.grads.finals_sent

    def reset_grads(self) -> None:
        self.segments.reset()
        self.grads.reset()

    # ---- rng and compute context ---------------------------------------------------------------
    def rng_state(self) -> RngState | None:
        """The random state a layer's recompute replays (None: nothing in a layer draws)."""
        return rng_state(self.device) if self.preserve_rng else None

    def restored_rng(self, state: RngState | None) -> contextlib.AbstractContextManager:
        return replayed_rng(state, self.device)

    @contextlib.contextmanager
    def compute_context(self) -> Iterator[None]:
        """Where a layer computes: the run's autocast, with ``AutocastKernels`` in it when the
        option ``autocast_kernels`` is on."""
        if not self.autocast:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.compute_dtype):
            if not self._autocast_kernels:
                yield
                return
            with AutocastKernels(self.device.type, self.compute_dtype):
                yield
