"""The trainer's out-of-memory watchdog: a step that runs out of GPU memory is freed, room is
made (``core.oom_recovery``) and the step runs again from its first micro-batch, with the same
inputs and random state, so the run's results are those of a step that never failed. An
evaluation batch or an optimizer step that runs out of it is handled alike (``hf/trainer.py``),
with ``make_room_for_weights``: that work holds no activations, so only HBM-tier layers go.

``StepReplay`` keeps what running a step again needs (each micro-batch's inputs and RNG state);
``make_room`` frees the failed step and gives up HBM holdings; ``PeakLog`` records the first
steps' measured GPU peaks beside the plan's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..core.activation_memory import (
    attention_output_bytes_per_token,
    kept_activation_bytes_per_token,
    shares_input_casts,
)
from ..core.builder import move_to_host_tier
from ..core.memory_options import ADVICE_TILE_TOKENS, MemoryOptions
from ..core.oom_recovery import (
    RELIEF_HEADROOM_BYTES,
    StepHoldings,
    choose_memory_options,
    choose_relief,
    oom_request_bytes,
)
from ..core.plan_arithmetic import GIB
from ..core.plan_search import ATTENTION_FIRST_TOKENS, plan_every_layer_streamed
from ..core.plan_types import MemoryPlanError
from ..core.rng import RngState, rng_state, set_rng_state
from .arguments import ARGUMENT_NAMER
from .long_context import install_mlp_tiling, tileable_mlp
from .model import find_decoder_layers, keep_activations, keep_attention_outputs, streamed_state

logger = logging.getLogger(__name__)


@dataclass
class _MicroBatch:
    inputs: Any
    num_items_in_batch: Any
    rng: RngState


class StepReplay:
    """The micro-batches of the optimizer step in progress (inputs and RNG state at their
    start), so that the step can run again from its first micro-batch."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._step: int | None = None
        self._batches: list[_MicroBatch] = []

    def record(self, step: int, inputs: Any, num_items_in_batch: Any) -> None:
        """Called at the start of each micro-batch of optimizer step ``step``."""
        if step != self._step:
            self._step, self._batches = step, []
        self._batches.append(_MicroBatch(inputs, num_items_in_batch, rng_state(self._device)))

    @property
    def earlier(self) -> list[_MicroBatch]:
        """The step's micro-batches before the current one."""
        return self._batches[:-1]

    def batches(self, step: int) -> list[_MicroBatch]:
        """Every micro-batch recorded for optimizer step ``step`` (none: another step's)."""
        return list(self._batches) if step == self._step else []

    @property
    def current(self) -> _MicroBatch:
        return self._batches[-1]

    def restore_rng(self, batch: _MicroBatch) -> None:
        set_rng_state(batch.rng, self._device)


def _holdings(model: nn.Module) -> StepHoldings:
    """What the streamed ``model``'s step holds in HBM that it could give up."""
    state = streamed_state(model)
    layers = [layer.forward for layer in find_decoder_layers(model)[1]]
    tier = [
        (i, store.device_nbytes) for i, store in enumerate(state.engine.stores) if store.resident
    ]
    kept = sum(1 for layer in layers if layer.keep_graph)
    attention = sum(1 for layer in layers if layer.keep_attention)
    plan = state.plan
    kept_bytes = attention_bytes = None
    first = False
    if plan is not None and plan.step is not None:
        tokens = plan.step.micro_batch_tokens
        shared = plan.options is not None and shares_input_casts(plan.options, plan.compute_dtype)
        kept_bytes = tokens * kept_activation_bytes_per_token(plan.shape, shared)
        attention_bytes = tokens * attention_output_bytes_per_token(plan.shape, plan.compute_dtype)
        first = tokens >= ATTENTION_FIRST_TOKENS
    return StepHoldings(tier, kept, kept_bytes, attention, attention_bytes, first)


def make_room(
    model: nn.Module, optimizer: Any, message: str, step: int, micro_batch_tokens: int = 0
) -> str:
    """Free the failed step of ``model`` and give up enough HBM holdings for the allocation
    ``message`` (the out-of-memory error's text) reports, plus headroom; once none is left,
    switch on the next exact memory options (:func:`switch_on_memory_options`, for micro-batches
    of ``micro_batch_tokens`` where the run has no plan). Returns what was done, in words;
    raises ``MemoryPlanError`` when nothing is left to give up or switch on."""
    optimizer.zero_grad(set_to_none=True)  # resident gradients of the failed micro-batches
    streamed_state(model).engine.abort_step()
    nothing = (
        "no HBM-tier layer, kept activations or attention outputs, and no exact memory option "
        "(MLP tiles, activation offload, longer checkpoint segments) the plan says would free "
        "GPU memory. Make the step smaller (fewer tokens per micro-batch: "
        "per_device_train_batch_size, the row length) or allow approximate options "
        "(`hf-megatrain plan` shows what fits)."
    )
    done = _give_up(model, optimizer, message, f"step {step}", weights_only=False)
    if done is None:
        switched = switch_on_memory_options(model, message, micro_batch_tokens)
        if switched is None:
            raise _nothing_left(f"step {step}", message, nothing)
        done = f"step {step} {switched}"
    return done


def switch_on_memory_options(model: nn.Module, message: str, micro_batch_tokens: int) -> str | None:
    """Switch on the exact memory options ``core.oom_recovery.choose_memory_options`` picks for
    the streamed ``model`` (between steps, after the failed one was freed), for the allocation
    ``message`` reports plus headroom: from the plan's lines for its step where the run has a
    plan (which is then replaced by the plan of the new options), else the next rung. Returns
    what was done, in words, or None when nothing is left to switch on."""
    state = streamed_state(model)
    options, plan = state.options, state.plan
    if options is None:
        return None
    need, what = _asked(message)
    running = base = MemoryOptions.of(options)
    tileable = any(tileable_mlp(layer) is not None for layer in find_decoder_layers(model)[1])
    if not tileable:
        base = replace(base, mlp_tile_tokens=ADVICE_TILE_TOKENS)  # (no candidate adds tiles)
    planned = plan is not None and plan.step is not None
    tokens = plan.step.micro_batch_tokens if planned else micro_batch_tokens

    def peak_bytes(o: MemoryOptions) -> int | None:
        trial = plan_every_layer_streamed(plan, options, o)
        return trial.gpu_peak_estimate if trial.host_total <= trial.host_available else None

    chosen = choose_memory_options(base, tokens, need, peak_bytes if planned else None)
    if chosen is None:
        return None
    changes = chosen.changes(base).options
    if not tileable:
        chosen = replace(chosen, mlp_tile_tokens=running.mlp_tile_tokens)
    if "mlp_tile_tokens" in changes:
        install_mlp_tiling(model, changes["mlp_tile_tokens"])
    state.engine.change_activation_options(
        offload_activations=changes.get("offload_activations"),
        checkpoint_every=changes.get("checkpoint_every"),
    )
    if planned:
        state.plan = plan_every_layer_streamed(plan, options, chosen)
    state.options = chosen.applied(options)
    turned = chosen.describe(running, ARGUMENT_NAMER)
    how = (
        f"the plan expects a peak of {state.plan.gpu_peak_estimate / GIB:.2f} GiB with them"
        if planned
        else "no plan for this step: one option at a time"
    )
    return (
        f"ran {what} with nothing left in HBM to give up; turned on {turned} ({how}; a resume "
        "starts from the run's arguments again: set them there to skip this)"
    )


def make_room_for_weights(
    model: nn.Module, optimizer: Any | None, message: str, where: str, nothing: str
) -> str:
    """Give up HBM-tier layers (``choose_relief(weights_only=True)``) for work that holds no
    activations and ran out of GPU memory: an evaluation batch, the optimizer step. The caller
    has freed the failed work (and kept what it runs again with). ``where`` names the work in
    the messages (e.g. "evaluation", "step 3's optimizer step"); ``nothing`` is what to do when
    no tier layer is left (``MemoryPlanError``). ``optimizer`` None: none exists yet."""
    done = _give_up(model, optimizer, message, where, weights_only=True)
    if done is None:
        raise _nothing_left(where, message, nothing)
    return done


def _asked(message: str) -> tuple[int | None, str]:
    """The room to make for the allocation the out-of-memory ``message`` reports (with
    headroom; None where it does not say), and the failure in words."""
    asked = oom_request_bytes(message)
    need = None if asked is None else asked + RELIEF_HEADROOM_BYTES
    what = "out of GPU memory" + ("" if asked is None else f" (asked {asked / GIB:.2f} GiB)")
    return need, what


def _nothing_left(where: str, message: str, nothing: str) -> MemoryPlanError:
    need, what = _asked(message)
    return MemoryPlanError(
        f"hf_megatrain: {where} ran {what} with nothing left to give up: {nothing}",
        tier="gpu",
        needed=need or 0,
        available=0,
    )


def _give_up(
    model: nn.Module, optimizer: Any | None, message: str, where: str, weights_only: bool
) -> str | None:
    """Give up the HBM holdings ``choose_relief`` picks; what was done, in words, or None
    where nothing is left to give up."""
    state = streamed_state(model)
    engine = state.engine
    if engine.is_cuda:
        torch.cuda.empty_cache()
    need, what = _asked(message)
    before = _holdings(model)
    relief = choose_relief(before, need, weights_only=weights_only)
    if relief is None:
        return None
    if relief.to_host:
        release = None if optimizer is None else optimizer.rebind_layers
        move_to_host_tier(engine, relief.to_host, state.options, release)
    if relief.kept != before.kept:
        keep_activations(model, relief.kept)
    if relief.attention != before.attention or relief.to_host or relief.kept != before.kept:
        keep_attention_outputs(model, relief.attention)
    return f"{where} ran {what}; made room: {relief.describe(before)}"


class PeakLog:
    """The measured GPU peak (allocator reserved) of the first steps, beside the plan's."""

    STEPS = 3

    def __init__(self, device: torch.device, planned_bytes: int | None) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        self._planned = planned_bytes
        #: ``(step, peak bytes)`` of the first steps.
        self.peaks: list[tuple[int, int]] = []

    def plan_changed(self) -> None:
        """The HBM holdings changed after the plan (the watchdog made room): peaks from now on
        are not the plan's to compare with."""
        self._planned = None

    def step_done(self, step: int) -> None:
        if not self._cuda or len(self.peaks) >= self.STEPS or step < 1:
            return
        if self.peaks and self.peaks[-1][0] == step:
            return
        peak = torch.cuda.max_memory_reserved(self._device)
        self.peaks.append((step, peak))
        planned = self._planned
        if planned:
            logger.info(
                "hf_megatrain: step %d GPU peak %.2f GiB (plan %.2f GiB, %+.1f%%)",
                step,
                peak / GIB,
                planned / GIB,
                100 * (planned - peak) / peak,
            )
        else:
            logger.info("hf_megatrain: step %d GPU peak %.2f GiB", step, peak / GIB)


__all__ = [
    "PeakLog",
    "StepReplay",
    "make_room",
    "make_room_for_weights",
    "switch_on_memory_options",
]
