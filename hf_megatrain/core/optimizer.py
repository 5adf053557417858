"""AdamW over the host store (streamed layers) and over resident parameters.

Semantics are those of ``torch.optim.AdamW`` as the HF Trainer builds it: two param groups (decay,
no-decay), ``lr``/``betas``/``eps``/``weight_decay`` read from ``param_groups`` at every step (so any
LR scheduler drives it), global-norm clipping over every gradient. Streamed layers update on the CPU
with torch's fused AdamW kernel over contiguous flat slices of the host store; resident parameters
(embeddings, final norm, LM head) update with the fused kernel on their own device.

Clipping: ``clip_grad_norm_`` computes the global norm once; the coefficient reaches the host update
as the fused kernel's ``grad_scale`` (grad / (1/coef)), which saves a full pass over the host
gradients. It differs from an in-place ``grad *= coef`` by at most one rounding of the scale.

Parameters without a gradient: as torch's AdamW skips a parameter whose ``grad`` is None (no
decay, no moment update, its own step count unchanged), this one skips a streamed layer's slot
that no micro-batch gave a gradient (``StreamingEngine.gradless_slots``: a frozen slot, an
indexer that only picks positions). Its slice is split off into a segment of its own, with its
own step count from then on (saved with the moments where it differs from the layer's).

Non-finite values: a step marked non-finite (:meth:`HostAdamW.mark_nonfinite`, e.g. by the trainer
for a NaN loss, or by :meth:`HostAdamW.grad_norm` for a NaN/inf norm) is skipped by ``step()``:
nothing is updated, its gradients are dropped and ``step_was_skipped`` is set (the Trainer then
leaves the LR schedule where it is). Eager updates check each layer's gradient before updating
it; once one layer of a step updated, a later non-finite one cannot be skipped consistently and
``step()`` raises :class:`NonFiniteError`.

Out of GPU memory: ``step()`` makes every allocation it needs (the resident parameters' moments,
at the first step) before it changes any weight, and counts what it has applied
(``updates_applied``), so that a step that fails can be told apart from one that partly applied;
``forget_step`` drops a step none of which was applied, to run it again from its first
micro-batch (``hf/trainer.py``'s out-of-memory watchdog).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adam import adam as _adam_functional

from . import exact_adamw
from .engine.gradients import SecondGradientError
from .engine.updates import background_threads
from .grad_norm import squared_norm
from .host_store import LayerStore
from .plan_arithmetic import DEVICE_WIDEN_NUMEL
from .prefault import Prefault, default_threads
from .streaming import StreamingEngine

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Training met a non-finite (NaN or inf) loss or gradient it cannot, or must not, skip."""


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite.

    One fp32 sum (NaN and inf propagate; a single streaming pass, about a tenth of an AdamW
    update's time on the CPU), confirmed element by element only when the sum is not finite (a
    sum of huge finite values can overflow). On a GPU that confirmation costs a transient bool
    copy: call it there only where a sync is acceptable.
    """
    flat = t.detach().reshape(-1)
    if flat.numel() == 0 or bool(torch.isfinite(flat.sum())):
        return True
    return bool(torch.isfinite(flat).all())


#: Elements per fused AdamW call on the CPU (a compact gradient widened to fp32: 8 MiB, in cache).
#: A multiple of the fused kernel's work units (64 bytes, vectors of up to 16 floats), so its
#: vector/scalar split falls where it would in one call over the slice: bitwise the same update.
WIDEN_CHUNK = 1 << 21
_widen = threading.local()  # per updating thread: its fp32 widening buffer


def _widen_buffer(numel: int) -> torch.Tensor:
    buf = getattr(_widen, "buffer", None)
    if buf is None:
        buf = _widen.buffer = torch.empty(WIDEN_CHUNK, dtype=torch.float32)
    return buf[:numel]


def _adamw_slice(
    seg: _Segment,
    grad: torch.Tensor,
    scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    kw: dict,
) -> None:
    """The fused AdamW (torch's functional) on ``seg``'s store elements with their fp32 ``grad``
    (on the compute device: one call per slice)."""
    _adam_functional(
        [seg.store.master[seg.start : seg.end]],
        [grad[seg.start : seg.end]],
        [seg.store.exp_avg[seg.start : seg.end]],
        [seg.store.exp_avg_sq[seg.start : seg.end]],
        [],
        [seg.step],
        fused=True,
        grad_scale=None if scale is None else scale.clone(),
        found_inf=found_inf,
        **kw,
    )


def _adamw_host_chunks(
    seg: _Segment,
    grad: torch.Tensor,
    scale: torch.Tensor | None,
    kw: dict,
    state: dict[str, torch.Tensor] | None = None,
) -> None:
    """The fused AdamW on ``seg``'s host store elements, ``WIDEN_CHUNK`` at a time, each chunk's
    stream copy rounded from its new masters while they are in cache.

    The step count advances once for the slice, as torch's functional AdamW advances it before
    its one kernel call; each chunk then calls that kernel directly (the functional's Python
    costs more than a chunk's kernel launch, and a large model makes thousands per step).

    ``state`` (a device update): the layer's master, moments and gradient staged on a device
    (``WeightStreamer``), updated there instead by ``exact_adamw.adamw_``, which rounds as the
    CPU kernel does (whichever device updates a layer, the result is the same); the caller
    casts the new master for the GPU and copies master and moments back."""
    hyper = {k: v for k, v in kw.items() if k != "decoupled_weight_decay"}  # (the "w" in adamw)
    store = seg.store
    seg.step.add_(1)
    if state is None:
        master, exp_avg, exp_avg_sq = store.master, store.exp_avg, store.exp_avg_sq
        chunk = WIDEN_CHUNK
    else:
        master, exp_avg, exp_avg_sq = state["master"], state["exp_avg"], state["exp_avg_sq"]
        chunk = state["widen"].numel()
        exact = {k: float(hyper[k]) for k in ("lr", "beta1", "beta2", "weight_decay", "eps")}
    for a in range(seg.start, seg.end, chunk):
        b = min(a + chunk, seg.end)
        if grad.dtype == torch.float32:
            part = grad[a:b]
        elif state is None:  # a compact slot: the fused kernel takes fp32 gradients only
            part = store.widen_grad(a, b, _widen_buffer(b - a))
        else:
            part = store.widen_grad(a, b, state["widen"][: b - a], grad, state["fp32_grad"])
        if state is not None:
            exact_adamw.adamw_(
                master[a:b], part, exp_avg[a:b], exp_avg_sq[a:b], step=float(seg.step),
                grad_scale=scale, **exact,
            )  # fmt: skip
            continue
        torch._fused_adamw_(
            [master[a:b]], [part], [exp_avg[a:b]], [exp_avg_sq[a:b]], [], [seg.step],
            grad_scale=scale, found_inf=None, **hyper,
        )  # fmt: skip
        store.refresh_stream_copy(a, b)


#: Layer stores whose moments an optimizer has owned (and may have written).
_STORES_WITH_AN_OPTIMIZER: weakref.WeakSet = weakref.WeakSet()


@dataclass
class _Segment:
    layer: int
    store: LayerStore
    start: int
    end: int
    step: torch.Tensor  # fp32 scalar, what the fused kernel increments

    def split(self, cuts: Iterable[int]) -> list[_Segment]:
        """This segment cut at ``cuts`` (inside it), each part with a copy of its step count."""
        bounds = [self.start, *sorted({c for c in cuts if self.start < c < self.end}), self.end]
        if len(bounds) == 2:
            return [self]
        return [
            _Segment(self.layer, self.store, a, b, self.step.clone())
            for a, b in zip(bounds, bounds[1:])
        ]


def _slot_segment_bounds(store: LayerStore, positions: Iterable[int]) -> set[tuple[int, int]]:
    """The ``(start, end)`` element ranges of ``store``'s slots at ``positions``."""
    return {
        (slot.offset, slot.offset + slot.numel)
        for slot in (store.slots[i] for i in positions)
        if slot.numel
    }


#: ``HostAdamW.state_dict()``'s entry for the streamed layers' AdamW state.
STREAMED_STATE_KEY = "megatrain_streamed_layers"


def adamw_setting_errors(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> list[tuple[str, float, str]]:
    """``(setting, value, valid range and why)`` of each AdamW setting that cannot train: those
    ``torch.optim.AdamW`` refuses (NaN included), a zero eps and a negative weight decay."""
    refused = "torch.optim.AdamW refuses others"
    checks = (
        ("lr", lr, f">= 0 ({refused})", lr >= 0),
        ("beta1", betas[0], f"in [0, 1) ({refused})", 0 <= betas[0] < 1),
        ("beta2", betas[1], f"in [0, 1) ({refused})", 0 <= betas[1] < 1),
        ("eps", eps, f">= 0 ({refused})", eps >= 0),
        # AdamW takes eps=0, but every weight whose gradient is 0 (an embedding row of a token
        # the step did not see) then updates by 0/0: NaN weights after the first step.
        ("eps", eps, "> 0 (0 makes NaN weights: 0/0 where a gradient is 0)", eps != 0),
        # (The Trainer's parameter groups pass it where AdamW's own check does not look.)
        (
            "weight_decay",
            weight_decay,
            ">= 0 (a negative decay grows the weights)",
            weight_decay >= 0,
        ),
    )
    return [(name, value, valid) for name, value, valid, ok in checks if not ok]


class HostAdamW(torch.optim.Optimizer):
    """AdamW whose streamed-layer state lives in the host store.

    Args:
        engine: the streaming engine whose stores hold masters, moments and gradients.
        resident: ``(name, parameter, decay)`` for parameters that live as real ``nn.Parameter``s.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        overlap_update: run the streamed layers' update on a CPU thread that overlaps the next
            forward pass (layer i is streamed in once its update is done). ``None``: on CUDA
            only (on CPU the thread would compete with compute for the same cores).
        update_threads: intra-op threads of an update running beside the training thread (the
            overlapped or eager one); 0: torch's intra-op thread count.
        device_update_lead: where the overlapped update falls behind the next forward, the GPU
            updates the layers it has not started within this many layers ahead of the forward
            (``EngineOptions.device_update_lead``); 0: never. One process, CUDA, gradient slots.
            It allocates HBM staging (``WeightStreamer.enable_device_updates``): the trainer
            passes it where the memory plan counted that (``MemoryPlan.device_updates``).
    """

    def __init__(
        self,
        engine: StreamingEngine,
        resident: Iterable[tuple[str, torch.nn.Parameter, bool]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        overlap_update: bool | None = None,
        update_threads: int = 0,
        device_update_lead: int = 0,
    ) -> None:
        if errors := adamw_setting_errors(lr, betas, eps, weight_decay):
            raise ValueError(
                "hf_megatrain: invalid AdamW setting: "
                + "; ".join(f"{name}={value} (must be {valid})" for name, value, valid in errors)
            )
        self.engine = engine
        self.overlap_update = overlap_update
        self.update_threads = update_threads
        self.device_update_lead = device_update_lead if engine.dp is None else 0
        if self.device_update_lead and engine.is_cuda:
            # Only with a GPU kernel that rounds as the CPU's (checked here, logged if not):
            # which layers the GPU takes depends on timing, the result must not.
            if not exact_adamw.matches_cpu_adamw(engine.device):
                self.device_update_lead = 0
        resident = list(resident)
        self.resident_names = {id(p): n for n, p, _ in resident}
        decay_params: list[torch.Tensor] = [p for _, p, d in resident if d]
        no_decay_params: list[torch.Tensor] = [p for _, p, d in resident if not d]
        segments: list[list[_Segment]] = [[], []]  # decay, no-decay
        self._streamed_ids: set[int] = set()
        for idx, store in enumerate(engine.stores):
            if not getattr(store, "trainable", True):
                continue  # frozen: no moments, never updated
            if not getattr(store, "owned", True):
                continue  # data parallel: another rank owns and updates this layer
            if store in _STORES_WITH_AN_OPTIMIZER:
                # A new optimizer over a store an earlier one stepped or loaded into (a second
                # trainer on the same streamed model): it starts from zero moments, as a new
                # torch AdamW does. The first one finds the store's fresh zeros (not rewritten:
                # that would touch every page of the moments before the first step).
                store.exp_avg.zero_()
                store.exp_avg_sq.zero_()
            _STORES_WITH_AN_OPTIMIZER.add(store)
            # Frozen slots (``TensorSlot.trainable``) get segments of their own from the start:
            # never updated, they are split off here rather than at the first step.
            frozen = [i for i, slot in enumerate(store.slots) if not slot.trainable]
            cuts = {c for bound in _slot_segment_bounds(store, frozen) for c in bound}
            for decay, start, end in store.segments():
                step = torch.zeros((), dtype=torch.float32, device=store.master.device)
                for seg in _Segment(idx, store, start, end, step).split(cuts):
                    view = store.master[seg.start : seg.end]
                    (decay_params if decay else no_decay_params).append(view)
                    self._streamed_ids.add(id(view))
                    segments[0 if decay else 1].append(seg)
        pairs = [
            ({"params": decay_params, "weight_decay": weight_decay}, segments[0]),
            ({"params": no_decay_params, "weight_decay": 0.0}, segments[1]),
        ]
        pairs = [(group, segs) for group, segs in pairs if group["params"]]
        # self._segments[i] holds the host-store slices of param_groups[i].
        self._segments = [segs for _, segs in pairs]
        super().__init__(
            [group for group, _ in pairs],
            dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
        )
        self._clip_coef: torch.Tensor | None = None
        # Splitting segments (``_layer_jobs``) runs on the eager update's thread and, for the
        # HBM tier, on the backward's: one at a time.
        self._segments_lock = threading.Lock()
        # Data parallel: the streamed layers this rank updates (it publishes each one's new
        # version), and whether the replicated parameters' gradients are averaged this step.
        self._owned_layers = [
            idx
            for idx, store in enumerate(engine.stores)
            if getattr(store, "trainable", True)
            and getattr(store, "owned", True)
            and not store.resident
        ]
        self._resident_synced = False
        self.eager = False
        self.eager_updates = 0
        self._eager_done: set[int] = set()
        # The hyper-parameters this step's eager updates read (at its first one), and whether a
        # change of them before step() was reported.
        self._eager_hyper: list[dict] | None = None
        self._eager_hyper_warned = False
        self._eager_thread: threading.Thread | None = None
        self._eager_queue: queue.Queue | None = None
        self._eager_error: BaseException | None = None
        # What accelerate's AcceleratedOptimizer would provide; the Trainer reads these.
        self._is_accelerate_prepared = True
        self.step_was_skipped = False
        #: Why this step's update must not be applied ("loss", "gradient norm", ...) or None.
        self.nonfinite: str | None = None
        #: Steps skipped for non-finite values, and why the last one was.
        self.skipped_steps = 0
        self.last_skip_reason: str | None = None
        # Eager updates of this step: layers updated, layers found non-finite (host-side check),
        # and HBM-tier layers' on-device non-finite flags (their fused update skipped itself).
        self._eager_updated: list[int] = []
        self._eager_bad: list[int] = []
        self._eager_flags: list[tuple[int, torch.Tensor]] = []
        #: Parts ``step()`` has applied, ever (a parameter group's resident parameters, a streamed
        #: layer; a layer left to the update thread counts when handed to it): unchanged across
        #: a ``step()`` call that raised means nothing of that step was applied.
        self.updates_applied = 0
        # The host moments' pages, mapped in while the first forward and backward run (the
        # first update would otherwise fault each page in itself, several times slower).
        owned = [engine.stores[idx] for idx in self._owned_layers]
        # Device updates copy master and moments over PCIe: only of stores pinned whole (the
        # builder pins those of the plan's device updates), or each copy would block the
        # training thread.
        if self.device_update_lead and engine.is_cuda and any(s.update_state_pinned for s in owned):
            # Widened in chunks of 64 MiB: few launches per layer (the training thread's).
            engine.enable_device_updates(DEVICE_WIDEN_NUMEL)
        # (Stores pinned whole were mapped in by their registration.)
        unmapped = [s for s in owned if not s.update_state_pinned]
        self.prefault = Prefault(
            [r for store in unmapped for r in store.moment_ranges()], default_threads(), unmapped
        )

    # ---- gradient norm and clipping -----------------------------------------------------------
    def _resident_with_grad(self) -> list[torch.Tensor]:
        return [
            p
            for group in self.param_groups
            for p in group["params"]
            if id(p) not in self._streamed_ids and p.grad is not None
        ]

    def _sync_resident_grads(self) -> None:
        """Data parallel: average the replicated parameters' gradients over the ranks (once)."""
        if self.engine.dp is None or self._resident_synced:
            return
        self._resident_synced = True
        grads = [p.grad for p in self._resident_with_grad()]
        if grads:
            self.engine.dp.all_reduce_mean_(grads)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of every gradient of this step (streamed and resident).

        Under data parallel a collective (every rank calls it and gets the same norm).
        """
        self.engine.finish_grads()
        self._sync_resident_grads()
        total_sq = self.engine.grad_sq_sum().to(torch.float32)
        resident = self._resident_with_grad()
        if resident:
            squares = torch.stack([squared_norm(p.grad) for p in resident])
            total_sq = total_sq.to(squares.device) + squares.sum()
        norm = total_sq.sqrt()
        if not bool(torch.isfinite(norm)):
            self.mark_nonfinite("gradient norm")
        return norm

    # ---- non-finite values --------------------------------------------------------------------
    def mark_nonfinite(self, what: str) -> None:
        """This step saw a non-finite ``what``: ``step()`` will skip its update."""
        if self.nonfinite is None:
            self.nonfinite = what

    def pending_nonfinite(self) -> str | None:
        """Why this step's update will be skipped (None: it will apply), once every eager
        update of the step has finished.

        Raises :class:`NonFiniteError` when the step cannot be skipped consistently: with eager
        updates, some layers already updated when another layer's gradient (or the global norm)
        turned out non-finite.
        """
        self._finish_eager()
        for idx, flag in self._eager_flags:  # HBM-tier eager updates: one sync, here
            (self._eager_bad if bool(flag) else self._eager_updated).append(idx)
        self._eager_flags = []
        if self._eager_bad:
            self.mark_nonfinite(f"gradient of layer {self._eager_bad[0]}")
        if self.nonfinite is not None and self._eager_updated:
            bad = sorted(self._eager_bad)
            what = (
                f"the gradient of layer(s) {', '.join(map(str, bad))}"
                if bad
                else f"the {self.nonfinite}"
            )
            updated = sorted(self._eager_updated)
            self._eager_updated, self._eager_bad = [], []
            raise NonFiniteError(
                f"{what} is non-finite (NaN/inf) but layer(s) {', '.join(map(str, updated))} "
                "already updated with this step's gradients during backward (eager updates): "
                "the step cannot be skipped consistently. Train with gradient clipping "
                "(max_grad_norm > 0) or eager_update=False to have such steps skipped, or lower "
                "the learning rate."
            )
        return self.nonfinite

    def _skip_step(self) -> None:
        """Drop this step's gradients and leave every weight, moment and step count as is."""
        self.engine.reset_grads()
        for p in self._resident_with_grad():
            p.grad = None
        self.skipped_steps += 1
        self.last_skip_reason = self.nonfinite
        self.step_was_skipped = True
        self._end_step()

    def _end_step(self) -> None:
        self.nonfinite = None
        self._clip_coef = None
        self._resident_synced = False
        self._eager_done = set()
        self._eager_hyper = None
        self._eager_updated, self._eager_bad, self._eager_flags = [], [], []

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Same contract as ``torch.nn.utils.clip_grad_norm_``: returns the pre-clip norm."""
        if self.eager:
            # The layers updated during backward, before any norm existed: clipping now would
            # scale only the resident parameters' update.
            raise RuntimeError(
                "hf_megatrain: gradient clipping cannot be combined with eager layer updates "
                "(each layer already updated during backward): train without clipping, or with "
                "the options eager_update=False and host_grads=True."
            )
        norm = self.grad_norm()
        # torch.nn.utils.clip_grad_norm_ uses exactly this coefficient.
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self._resident_with_grad():
            p.grad.mul_(coef.to(p.grad.device))
        self._clip_coef = coef
        return norm

    # ---- the update ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - same contract as torch.optim.Optimizer.step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.engine.finish_grads()
        self._sync_resident_grads()
        self._finish_eager()
        self._check_eager_hyper()
        self.engine.wait_updates()
        self.engine.wait_weight_copies()
        if self.pending_nonfinite() is not None:
            self._skip_step()
            return loss
        self.step_was_skipped = False
        # The weights' version after this step (data parallel: published per owned layer).
        version = self.engine.weights_version + 1
        scale_by_device = None
        if self._clip_coef is not None:
            grad_scale = (1.0 / self._clip_coef.double()).float()
            # One device->host read here, not one per layer on the update thread.
            scale_by_device = {"cpu": grad_scale.cpu(), grad_scale.device.type: grad_scale}
        # Hyper-parameters are read now: the scheduler changes lr right after this call.
        jobs = self._layer_jobs(skip=self._eager_done)
        # Every allocation before the first update: out of GPU memory, nothing is applied yet.
        for group in self.param_groups:
            self._init_resident_state(group)
        for group in self.param_groups:
            self._step_resident(group, self._hyper(group))

        def update_layer(idx: int) -> None:
            self.apply_layer_update(jobs[idx], scale_by_device, self.engine.final_grad(idx))
            self.engine.publish_update(idx, version)

        for idx in self._owned_layers:
            if idx not in jobs:  # no gradient, or already updated eagerly: final now
                self.engine.publish_update(idx, version, rederived=False)

        # The device tier updates right here on the GPU (fast); host layers go to the CPU.
        for idx in sorted(jobs):
            if self.engine.stores[idx].resident:
                update_layer(idx)
                self.updates_applied += 1
        layers = [i for i in sorted(jobs) if not self.engine.stores[i].resident]
        self.engine.reset_grads()
        self.engine.invalidate_weights()
        self.engine.weights_version = version
        self._end_step()
        self.updates_applied += len(layers)
        overlap = self.engine.is_cuda if self.overlap_update is None else self.overlap_update
        if overlap:
            # Layer i's update finishes before layer i streams in for the next forward; where
            # the CPU falls behind it, the GPU may take layers over (``device_update_lead``).
            self.engine.start_updates(
                update_layer, layers, self.update_threads,
                device_update=functools.partial(self._device_job, jobs, scale_by_device),
                lead=self._device_lead(), claimable=self._device_claimable,
            )  # fmt: skip
        else:
            for idx in layers:
                update_layer(idx)
        return loss

    def _device_job(
        self, jobs: dict, scale_by_device: dict | None, idx: int
    ) -> Callable[[dict | None], None]:
        """Layer ``idx``'s update as a function of its state staged on the device (None: in
        place on the host store, a CPU engine's device)."""

        def run(state: dict | None) -> None:
            if state is None:
                self.apply_layer_update(jobs[idx], scale_by_device, self.engine.final_grad(idx))
                return
            dev = state["master"].device
            for seg, kw in jobs[idx]:
                scale = None
                if scale_by_device is not None:
                    scale = scale_by_device.get(dev.type)
                    if scale is None:  # (a norm computed elsewhere: one small copy)
                        scale = scale_by_device[dev.type] = scale_by_device["cpu"].to(dev)
                _adamw_host_chunks(seg, state["grad"], scale, kw, state)

        return run

    def _device_lead(self) -> int:
        """This step's ``device_update_lead``: 0 while the GPU's AdamW would round apart from the
        CPU's (the check is cached; ``torch.set_flush_denormal`` may change that at any time)."""
        if not self.device_update_lead or not self.engine.is_cuda:
            return self.device_update_lead
        return self.device_update_lead if exact_adamw.matches_cpu_adamw(self.engine.device) else 0

    def _device_claimable(self, idx: int) -> bool:
        """Whether the device may take layer ``idx``'s update: its state is pinned (CUDA)."""
        store = self.engine.stores[idx]
        return store.grad is not None and (not self.engine.is_cuda or store.update_state_pinned)

    def _layer_jobs(
        self, only: int | None = None, skip: set[int] = frozenset()
    ) -> dict[int, list[tuple[_Segment, dict]]]:
        """Per streamed layer with a gradient: its slices and the hyper-parameters to use (the
        slices of parameters without a gradient left out)."""
        with self._segments_lock:
            layers = {
                seg.layer
                for segments in self._segments
                for seg in segments
                if (only is None or seg.layer == only) and seg.layer not in skip
            }
            layers = {idx for idx in layers if self.engine.layer_has_grad(idx)}
            gradless: dict[int, set[tuple[int, int]]] = {}
            for idx in sorted(layers):
                positions = self.engine.gradless_slots(idx)
                if positions:
                    gradless[idx] = _slot_segment_bounds(self.engine.stores[idx], positions)
                    self._split_layer(idx, gradless[idx])
            jobs: dict[int, list[tuple[_Segment, dict]]] = {}
            for group, segments in zip(self.param_groups, self._segments):
                kw = self._hyper(group)
                for seg in segments:
                    skipped = (seg.start, seg.end) in gradless.get(seg.layer, ())
                    if seg.layer in layers and not skipped:
                        jobs.setdefault(seg.layer, []).append((seg, kw))
            return jobs

    def _split_layer(self, idx: int, bounds: Iterable[tuple[int, int]]) -> None:
        """Give the element ranges ``bounds`` of layer ``idx`` segments of their own (under
        ``_segments_lock``, or before any update runs). The param groups keep their views of
        the ranges as they were (torch's optimizer reads only their hyper-parameters)."""
        cuts = {c for bound in bounds for c in bound}
        for g, segments in enumerate(self._segments):
            parts = [seg.split(cuts) if seg.layer == idx else [seg] for seg in segments]
            if any(len(p) > 1 for p in parts):
                # (A new list, not edited in place: an eager update's thread may read it.)
                self._segments[g] = [part for p in parts for part in p]

    @staticmethod
    def apply_layer_update(
        jobs: list[tuple[_Segment, dict]],
        scale_by_device: dict | None,
        grad: torch.Tensor,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """AdamW on one layer's slices, then its stream copy re-derived from the new masters.
        ``grad`` is its flat gradient (store or staging): fp32, or bf16 from a compact slot.

        On the CPU the update is memory bound, so it runs chunk by chunk through the cache
        (``_adamw_host_chunks``): a compact gradient is widened to fp32 as the update reads it,
        and each chunk's new masters are rounded into the stream copy while they are still in
        cache (one pass over the masters in DRAM instead of two). On a device: one fused call
        per slice."""

        def scale_for(seg: _Segment) -> torch.Tensor | None:
            return (
                None if scale_by_device is None else scale_by_device[seg.store.master.device.type]
            )

        if grad.device.type != "cpu":
            for seg, kw in jobs:
                _adamw_slice(seg, grad, scale_for(seg), found_inf, kw)
            jobs[0][0].store.refresh_stream_copy()
            return
        if found_inf is not None:
            raise ValueError("hf_megatrain: host updates check finiteness before they run")
        for seg, kw in jobs:
            _adamw_host_chunks(seg, grad, scale_for(seg), kw)

    # ---- eager updates (no clipping) ----------------------------------------------------------
    def enable_eager_updates(self) -> None:
        """Update each layer as soon as its gradient of the step is final, during backward.

        Only valid without gradient clipping: with clipping, no update may start before the
        global norm is known. A streamed layer's update then runs on a CPU thread while the
        backward of the layers below it continues; HBM-tier layers update on the GPU in place.
        """
        self.eager = True
        self.engine.on_grad_final = self.on_layer_grad_final

    def on_layer_grad_final(self, idx: int, event) -> None:
        if self._clip_coef is not None:
            raise RuntimeError("hf_megatrain: eager updates cannot be combined with clipping")
        if idx in self._eager_done:
            raise SecondGradientError(idx)  # (on CUDA the second gradient arrives here)
        self._eager_done.add(idx)
        if self._eager_hyper is None:
            self._eager_hyper = [self._hyper(group) for group in self.param_groups]
        store = self.engine.stores[idx]
        if not self.engine.is_cuda or store.resident:
            self._eager_update(idx)
            return
        if self._eager_thread is None:
            self._eager_queue = queue.Queue()
            n_threads = background_threads(self.update_threads)
            self._eager_thread = threading.Thread(
                target=self._eager_worker,
                args=(self._eager_queue, n_threads),
                name="megatrain-eager",
                # It only ends on step()'s sentinel: were it not a daemon, a run that raises
                # between a layer's eager update and step() would hang at interpreter exit,
                # the main thread's exception printed but the process never returning.
                daemon=True,
            )
            self._eager_thread.start()
        self._eager_queue.put((idx, event))

    def _eager_update(self, idx: int) -> None:
        try:
            jobs = self._layer_jobs(only=idx)
            if idx in jobs and self.nonfinite is not None:
                return  # the step is already skipped: only consume the gradient
            if idx in jobs:
                grad = self.engine.final_grad(idx)
                found_inf = None
                if grad.device.type == "cpu":
                    if not all_finite(grad):
                        self._eager_bad.append(idx)
                        self.mark_nonfinite(f"gradient of layer {idx}")
                        return
                    self._eager_updated.append(idx)
                else:
                    # HBM tier: no sync inside backward. The fused kernel skips the update (and
                    # its step count) itself when the flag is set; pending_nonfinite reads it.
                    found_inf = (~torch.isfinite(grad.sum())).to(torch.float32)
                    self._eager_flags.append((idx, found_inf))
                self.apply_layer_update(jobs[idx], None, grad, found_inf)
                self.engine.publish_update(idx, self.engine.weights_version + 1)
                self.eager_updates += 1
        finally:
            # Also after a failure: a staging buffer never freed would stall the backward.
            self.engine.grad_consumed(idx)

    def _eager_worker(self, q: queue.Queue, n_threads: int) -> None:
        torch.set_num_threads(n_threads)
        while True:
            item = q.get()
            if item is None:
                return
            idx, event = item
            try:
                if event is not None:
                    event.synchronize()  # the gradient has reached the host store
                self._eager_update(idx)
            except BaseException as exc:  # noqa: BLE001 - re-raised in step()
                self._eager_error = exc
            finally:
                self.engine.grad_consumed(idx)  # idempotent; frees a staging buffer

    def _finish_eager(self) -> None:
        if self._eager_thread is not None:
            self._eager_queue.put(None)
            self._eager_thread.join()
            self._eager_thread = None
        if self._eager_error is not None:
            err, self._eager_error = self._eager_error, None
            raise RuntimeError("hf_megatrain: an eager layer update failed") from err

    def _check_eager_hyper(self) -> None:
        """Warn (once a run) where the learning rate or another AdamW setting changed between
        this step's first eager update and step(): the layers updated during backward used the
        old values, the rest use the new ones (found by an audit: a callback's
        on_pre_optimizer_step setting the lr, followed by the stock optimizer, silently not by
        the streamed layers)."""
        before = self._eager_hyper
        if before is None or self._eager_hyper_warned:
            return
        now = [self._hyper(group) for group in self.param_groups]
        # Per group, the settings that changed (float(): a scheduler may hold a 0-d tensor).
        diffs = [[k for k in a if float(a[k]) != float(b[k])] for a, b in zip(before, now)]
        changed = sorted({k for keys in diffs for k in keys})
        if not changed:
            return
        self._eager_hyper_warned = True
        # (The first group where they differ: groups may hold other rates.)
        a, b = next((a, b) for a, b, keys in zip(before, now, diffs) if keys)
        was = ", ".join(f"{k}={float(a[k]):g}" for k in changed)
        new = ", ".join(f"{k}={float(b[k]):g}" for k in changed)
        logger.warning(
            "hf_megatrain: %s changed after this step's backward began updating the streamed "
            "layers (eager updates, without clipping): they used %s, the other parameters use "
            "%s (e.g. set in a callback's on_pre_optimizer_step). Change it before the step "
            "(on_step_begin), or train with the option eager_update=False (or with clipping)",
            " and ".join(changed),
            was,
            new,
        )

    def wait(self) -> None:
        """Block until background updates have finished (before reading or saving weights)."""
        self._finish_eager()
        self.engine.wait_updates()

    @staticmethod
    def _hyper(group: dict) -> dict:
        beta1, beta2 = group["betas"]
        return dict(
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
            decoupled_weight_decay=True,
        )

    def _init_resident_state(self, group: dict) -> None:
        """The AdamW state of the group's resident parameters with a gradient, made at their
        first step (whole or not at all: a failed allocation leaves none)."""
        for p in group["params"]:
            if id(p) in self._streamed_ids or p.grad is None or self.state[p]:
                continue
            self.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }

    def _step_resident(self, group: dict, kw: dict) -> None:
        params, grads, m, v, steps = [], [], [], [], []
        for p in group["params"]:
            if id(p) in self._streamed_ids or p.grad is None:
                continue
            state = self.state[p]
            params.append(p)
            grads.append(p.grad)
            m.append(state["exp_avg"])
            v.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            _adam_functional(params, grads, m, v, [], steps, fused=True, **kw)
            self.updates_applied += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.engine.reset_grads()
        self._resident_synced = False

    def forget_step(self) -> None:
        """Drop the step in progress (its gradients, clipping coefficient and non-finite marks)
        so that it can run again from its first micro-batch, e.g. after it ran out of GPU memory
        before ``step()`` applied any of it. Refused once a layer of it updated eagerly (running
        it again would update that layer twice)."""
        self.wait()
        if self._eager_done:
            raise RuntimeError(
                f"hf_megatrain: layer(s) {', '.join(map(str, sorted(self._eager_done)))} already "
                "updated with this step's gradients (eager updates): the step cannot run again"
            )
        self.zero_grad(set_to_none=True)
        self._end_step()

    def rebind_layers(self, layers: Iterable[int]) -> None:
        """Follow layers whose store the engine replaced (``StreamingEngine.replace_stores``,
        between steps): their slices now update the new store's master and moments, on its
        device, with the step counts carried over."""
        layers = set(layers)
        old = {
            seg.layer: seg.store for segs in self._segments for seg in segs if seg.layer in layers
        }
        for group in self.param_groups:
            params = group["params"]
            for pos, p in enumerate(params):
                if id(p) not in self._streamed_ids:
                    continue
                for idx, store in old.items():
                    # (A group's view of a layer's range, found by address: the same range of
                    # the new store's master.)
                    start = (p.data_ptr() - store.master.data_ptr()) // store.master.element_size()
                    if 0 <= start < store.master.numel():
                        view = self.engine.stores[idx].master[start : start + p.numel()]
                        self._streamed_ids.discard(id(p))
                        params[pos] = view
                        self._streamed_ids.add(id(view))
                        break
        for segments in self._segments:
            for seg in segments:
                if seg.layer in layers:
                    seg.store = self.engine.stores[seg.layer]
                    seg.step = seg.step.to(seg.store.master.device)
        self._owned_layers = sorted(
            set(self._owned_layers) | {i for i in layers if not self.engine.stores[i].resident}
        )

    # ---- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict (the resident parameters' state and the param groups)
        and, under ``STREAMED_STATE_KEY``, the streamed layers' AdamW state: per layer this
        process updates, its moments (views of the store, no copy) and step count.

        torch's own covers only parameters it holds state for: without the streamed layers,
        ``torch.save(optimizer.state_dict())`` kept no moments of any streamed layer. Under data
        parallel each rank's holds the layers it owns (``load_state_dict`` takes it back on the
        same layout)."""
        out = super().state_dict()
        steps, _ = self.streamed_state()  # (after any pending update)
        slot_steps = self.slot_steps()
        layers = {
            i: {"exp_avg": store.exp_avg, "exp_avg_sq": store.exp_avg_sq, "step": steps.get(i, 0.0)}
            for i, store in enumerate(self.engine.stores)
            if store.exp_avg is not None
        }
        for i, per_slot in slot_steps.items():
            layers[i]["slot_steps"] = per_slot
        out[STREAMED_STATE_KEY] = {"num_layers": len(self.engine.stores), "layers": layers}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (into the layer stores and the resident
        parameters' state); one without the streamed layers' state is refused, as loading it
        would keep every streamed layer's moments as they are without a word."""
        streamed = state_dict.get(STREAMED_STATE_KEY)
        if streamed is None:
            raise ValueError(
                "hf_megatrain: this optimizer state dict holds no streamed layer's AdamW state "
                "(not one from HostAdamW.state_dict(), e.g. a stock optimizer's): resume from a "
                "checkpoint of this trainer instead"
            )
        stores = self.engine.stores
        layers = streamed["layers"]
        expected = [i for i, store in enumerate(stores) if store.exp_avg is not None]
        problem = None
        if streamed["num_layers"] != len(stores):
            problem = f"{streamed['num_layers']} layers, the model has {len(stores)}"
        elif sorted(layers) != expected:
            problem = f"the state of layers {sorted(layers)}, this process updates {expected}"
        else:
            bad = [i for i in expected if layers[i]["exp_avg"].shape != stores[i].exp_avg.shape]
            problem = f"layer {bad[0]}'s moments of another size" if bad else None
        if problem is None:
            # (torch's own check, made before anything is loaded: raised after the streamed
            # state was copied in, it would leave this optimizer half loaded)
            sizes = [len(g["params"]) for g in state_dict.get("param_groups", [])]
            if sizes != [len(g["params"]) for g in self.param_groups]:
                problem = (
                    f"param groups of {sizes} parameters, this optimizer's have "
                    f"{[len(g['params']) for g in self.param_groups]} (another model or layout)"
                )
        if problem is not None:
            raise ValueError(f"hf_megatrain: the optimizer state dict holds {problem}")
        self.wait()
        with torch.no_grad():
            for i in expected:
                stores[i].exp_avg.copy_(layers[i]["exp_avg"])
                stores[i].exp_avg_sq.copy_(layers[i]["exp_avg_sq"])
        self.load_streamed_state(
            {i: float(layers[i]["step"]) for i in expected},
            {},
            {i: layers[i]["slot_steps"] for i in expected if "slot_steps" in layers[i]},
        )
        super().load_state_dict({k: v for k, v in state_dict.items() if k != STREAMED_STATE_KEY})

    def streamed_state(self) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
        """Step counts per layer and resident moments by name (streamed moments live in the store).

        A layer's step count is its most updated slot's; :meth:`slot_steps` has those that
        differ."""
        self.wait()
        steps = {
            idx: max(float(seg.step.item()) for seg in segs)
            for idx, segs in self._segments_by_layer().items()
        }
        tensors = {}
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in self._streamed_ids or not self.state.get(p):
                    continue
                name = self.resident_names[id(p)]
                st = self.state[p]
                tensors[f"{name}.exp_avg"] = st["exp_avg"]
                tensors[f"{name}.exp_avg_sq"] = st["exp_avg_sq"]
                tensors[f"{name}.step"] = st["step"].reshape(1)
        return steps, tensors

    def slot_steps(self) -> dict[int, list[float]]:
        """Per layer whose slots' step counts differ (some went without a gradient in some
        step): each slot's step count, in ``store.slots`` order."""
        self.wait()
        out: dict[int, list[float]] = {}
        for idx, segs in self._segments_by_layer().items():
            steps = [(seg.start, seg.end, float(seg.step.item())) for seg in segs]
            if len({n for _, _, n in steps}) < 2:
                continue
            out[idx] = [
                next((n for a, b, n in steps if a <= slot.offset < b), 0.0)
                for slot in self.engine.stores[idx].slots
            ]
        return out

    def _segments_by_layer(self) -> dict[int, list[_Segment]]:
        by_layer: dict[int, list[_Segment]] = {}
        for segments in self._segments:
            for seg in segments:
                by_layer.setdefault(seg.layer, []).append(seg)
        return by_layer

    def load_streamed_state(
        self,
        steps: dict[int, float],
        tensors: Mapping[str, torch.Tensor],
        slot_steps: dict[int, Sequence[float]] | None = None,
    ) -> None:
        """Restore :meth:`streamed_state`'s step counts and resident moments, and
        :meth:`slot_steps`' (where some slots' differ from their layer's)."""
        for segments in self._segments:
            for seg in segments:
                seg.step.fill_(steps.get(seg.layer, 0.0))
        for idx, per_slot in (slot_steps or {}).items():
            store = self.engine.stores[idx]
            apart = {i: float(n) for i, n in enumerate(per_slot) if float(n) != steps.get(idx, 0.0)}
            bounds = _slot_segment_bounds(store, apart)
            self._split_layer(idx, bounds)
            by_bounds = {(s.offset, s.offset + s.numel): n for s, n in zip(store.slots, per_slot)}
            for segments in self._segments:
                for seg in segments:
                    if seg.layer == idx and (seg.start, seg.end) in bounds:
                        seg.step.fill_(float(by_bounds[(seg.start, seg.end)]))
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in self._streamed_ids:
                    continue
                name = self.resident_names[id(p)]
                if f"{name}.exp_avg" not in tensors:
                    continue
                self.state[p] = {
                    "step": tensors[f"{name}.step"]
                    .reshape(())
                    .to(torch.float32)
                    .to(p.device)
                    .clone(),
                    "exp_avg": tensors[f"{name}.exp_avg"].to(p.device, torch.float32).clone(),
                    "exp_avg_sq": tensors[f"{name}.exp_avg_sq"].to(p.device, torch.float32).clone(),
                }
