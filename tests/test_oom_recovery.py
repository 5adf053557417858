"""The out-of-memory watchdog: a step that runs out of GPU memory is freed, room is made (kept
activations, attention outputs, then HBM-tier layers moved to the host tier) and the step runs
again from its first micro-batch; the run ends exactly as one that never failed.

On the CPU the failure is injected through public module hooks: a decoder layer raises the error
CUDA's allocator raises (``torch.OutOfMemoryError``, its message) once, in its forward or in its
backward. The HBM tier exists on the CPU too when a count is asked (``resident_layers=2``).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import TrainerCallback

from hf_megatrain.core.memory_options import (
    ADVICE_TILE_TOKENS,
    SEGMENT_LENGTHS,
    MemoryOptions,
    candidates,
)
from hf_megatrain.core.oom_recovery import (
    LIVE_MEMORY_OPTIONS,
    StepHoldings,
    choose_memory_options,
    choose_relief,
    oom_request_bytes,
)
from hf_megatrain.core.options import StepShape
from hf_megatrain.core.plan_search import plan_every_layer_streamed
from hf_megatrain.core.planner import GIB, MemoryPlanError, plan_memory
from hf_megatrain.hf.model import find_decoder_layers, model_shape, streamed_state

from .helpers import mega_params, run_accumulating_trainer, tiny_config, tiny_model

OOM_TEXT = (
    "CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 139.72 GiB "
    "of which 1.50 MiB is free."
)


def test_request_size_is_read_from_the_error():
    assert oom_request_bytes(OOM_TEXT) == 2 * 2**20
    assert oom_request_bytes("CUDA out of memory. Tried to allocate 6.00 GiB.") == 6 * 2**30
    assert oom_request_bytes("something else") is None


@pytest.mark.parametrize(
    ("first", "need", "expected"),
    [
        # Short micro-batches: the plan filled the tier first, attention outputs last; those go
        # first, then kept activations, then tier layers (the last ones).
        (False, 3, (1, 0, [], 4)),
        (False, 7, (0, 0, [], 7)),
        (False, 15, (0, 0, [2], 17)),
        (False, 25, (0, 0, [1, 2], 27)),
        # Long micro-batches: attention outputs were filled before the tier; they go last.
        (True, 5, (0, 2, [2], 13)),
        (True, 100, (0, 0, [0, 1, 2], 37)),
        # Unknown size: one item per attempt.
        (False, None, (1, 1, [], 2)),
    ],
)
def test_relief_gives_up_in_the_reverse_of_the_plans_fill_order(first, need, expected):
    held = StepHoldings(
        tier=[(0, 10), (1, 10), (2, 10)],
        kept=1,
        kept_bytes=3,
        attention=2,
        attention_bytes=2,
        attention_first=first,
    )
    relief = choose_relief(held, need)
    assert (relief.kept, relief.attention, relief.to_host, relief.freed_bytes) == expected
    assert relief.freed_bytes >= (need or 0) or relief.to_host == [0, 1, 2]


def test_relief_is_none_when_nothing_is_held():
    assert choose_relief(StepHoldings(tier=[]), 1) is None


def test_kept_layers_leave_the_tier_only_after_their_activations():
    """keep_activations keeps the tier's last layers: a layer leaves only once nothing of it is
    kept (the tier never shrinks below the kept count)."""
    held = StepHoldings(tier=[(0, 10), (1, 10)], kept=2, kept_bytes=None)
    relief = choose_relief(held, None)
    assert relief.kept == 1 and relief.to_host == []


class _OutOfMemoryOnce:
    """Makes decoder layer ``layer`` raise CUDA's out-of-memory error at its ``at``-th forward
    call (or at each call in ``at``, a set), or in the backward of that call's output
    (``where="backward"``)."""

    def __init__(self, model, layer: int, at: int | set[int], where: str = "forward") -> None:
        self.calls, self.where, self.fired = 0, where, 0
        self.at = at if isinstance(at, set) else {at}
        find_decoder_layers(model)[1][layer].register_forward_hook(self._hook)

    def _raise(self, *_):
        self.fired += 1
        raise torch.OutOfMemoryError(OOM_TEXT)

    def _hook(self, module, args, output):
        if not torch.is_grad_enabled():
            return None
        self.calls += 1
        if self.calls not in self.at:
            return None
        if self.where == "forward":
            self._raise()
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.register_hook(self._raise)
        return None


def _config(arch: str = "llama"):
    # Dropout on: the step's second run must draw the same random numbers as the first.
    return tiny_config(arch, attention_dropout=0.2)


@pytest.mark.parametrize(
    "arch, where",
    [
        ("llama", "forward"),
        ("llama", "backward"),
        ("qwen3_moe", "forward"),
        ("qwen3_moe", "backward"),
    ],
)
def test_a_step_that_runs_out_of_memory_runs_again_with_the_same_result(
    arch, where, tmp_path, caplog
):
    """Out of memory in the second micro-batch of step 2: the watchdog frees the step, moves the
    HBM tier to the host (2 MiB asked + 1 GiB headroom is more than the tiny tier holds) and runs
    the step again from its first micro-batch. Losses, gradient norms and final weights are
    bit-equal to the run that never failed; with an MoE's router aux loss too (the failed
    attempt's recorded router logits must not reach the loss)."""
    model = tiny_model(_config(arch))
    clean_logs, clean = run_accumulating_trainer(copy.deepcopy(model), tmp_path, "clean")
    faulty = copy.deepcopy(model)
    # One forward call per micro-batch (recomputes run without the module's hooks), 2
    # micro-batches per step: call 4 is step 2's second micro-batch.
    fault = _OutOfMemoryOnce(faulty, layer=1, at=4, where=where)
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
        logs, trainer = run_accumulating_trainer(faulty, tmp_path, "faulty")
    assert fault.fired == 1
    assert "step 2 ran out of GPU memory (asked 0.00 GiB)" in caplog.text
    assert "layers 0-1 moved from the HBM tier to the host tier" in caplog.text
    assert "running the step again from its first micro-batch" in caplog.text
    assert not any(s.resident for s in streamed_state(trainer.model).engine.stores)
    assert [r.get("loss") for r in logs] == [r.get("loss") for r in clean_logs]
    assert [r.get("grad_norm") for r in logs] == [r.get("grad_norm") for r in clean_logs]
    want, got = mega_params(clean), mega_params(trainer)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_without_recovery_the_error_propagates(tmp_path):
    model = tiny_model(_config())
    _OutOfMemoryOnce(model, layer=0, at=3)
    with pytest.raises(torch.OutOfMemoryError):
        run_accumulating_trainer(model, tmp_path, "off", megatrain_oom_recovery=False)


class _EveryInputLarge(TrainerCallback):
    """Tiny shapes: every floating layer input counts as a large activation (offloaded)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        streamed_state(model).engine.offload_min_numel = 1


def test_with_nothing_in_hbm_memory_options_are_switched_on(tmp_path, caplog):
    """All layers streamed, nothing kept: each out-of-memory switches on the next exact memory
    option (no plan on the CPU: one rung at a time, activation offload, then segments of 2) and
    the step runs again. Losses, gradient norms and final weights are bit-equal to the run that
    never failed (the offloaded inputs come back as they left; a segment's follower recomputes
    from its leader's input with the same kernels)."""
    model = tiny_model(_config())
    clean_logs, clean = run_accumulating_trainer(
        copy.deepcopy(model), tmp_path, "clean", megatrain_resident_layers=0
    )
    faulty = copy.deepcopy(model)
    # Calls 3 and 4: step 2's first micro-batch, and its first run again.
    fault = _OutOfMemoryOnce(faulty, layer=1, at={3, 4})
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
        logs, trainer = run_accumulating_trainer(
            faulty, tmp_path, "faulty", [_EveryInputLarge()], megatrain_resident_layers=0
        )
    assert fault.fired == 2
    # (The tiny rows' hidden states counted as large: they were offloaded.)
    assert streamed_state(trainer.model).engine.activations.host_buffers()
    assert "turned on megatrain_offload_activations=True" in caplog.text
    assert "turned on megatrain_checkpoint_every=2" in caplog.text
    assert caplog.text.count("running the step again from its first micro-batch") == 2
    engine = streamed_state(trainer.model).engine
    assert engine.offload_activations and engine.checkpoint_every == 2
    assert [r.get("loss") for r in logs] == [r.get("loss") for r in clean_logs]
    assert [r.get("grad_norm") for r in logs] == [r.get("grad_norm") for r in clean_logs]
    want, got = mega_params(clean), mega_params(trainer)
    for name in want:
        assert torch.equal(got[name], want[name]), name


class _PlannedStep(TrainerCallback):
    """Gives the CPU run the plan a CUDA run has for its step (the planner is arithmetic): the
    watchdog then chooses from the plan's lines."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        streamed = streamed_state(model)
        step = StepShape(micro_batch_tokens=2 * 16, seq_len=16, grad_accum=2)
        self.options = streamed.options
        self.plan = streamed.plan = plan_memory(
            model_shape(model), step, streamed.options, torch.float32, 64 * GIB, 64 * GIB
        )


def test_with_a_plan_the_options_switched_on_are_the_plans(tmp_path, caplog):
    """Where the run has a plan for its step, the watchdog turns on the set the plan says frees
    the most (none frees the 1 GiB headroom of a tiny model) in one go, logs the plan's new
    peak, and the plan and options become those of the options now on; results as before."""
    model = tiny_model(_config())
    clean_logs, clean = run_accumulating_trainer(
        copy.deepcopy(model), tmp_path, "clean", megatrain_resident_layers=0
    )
    faulty = copy.deepcopy(model)
    fault = _OutOfMemoryOnce(faulty, layer=1, at=3)
    planned = _PlannedStep()
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
        logs, trainer = run_accumulating_trainer(
            faulty, tmp_path, "faulty", [planned], megatrain_resident_layers=0
        )
    assert fault.fired == 1
    state, before = streamed_state(trainer.model), planned.options
    now = MemoryOptions.of(state.options)
    assert now != MemoryOptions.of(before)
    assert set(now.changes(MemoryOptions.of(before)).options) <= LIVE_MEMORY_OPTIONS
    assert state.engine.offload_activations == now.offload_activations
    assert state.engine.checkpoint_every == now.checkpoint_every
    bare = plan_every_layer_streamed(planned.plan, before, MemoryOptions.of(before))
    assert state.plan.gpu_peak_estimate < bare.gpu_peak_estimate
    assert f"the plan expects a peak of {state.plan.gpu_peak_estimate / GIB:.2f} GiB" in caplog.text
    assert caplog.text.count("with nothing left in HBM to give up") == 1  # (all at once)
    # (Not saved with the checkpoints: found by an audit, a resume runs out of memory again.)
    assert "a resume starts from the run's arguments again: set them there" in caplog.text
    assert [r.get("loss") for r in logs] == [r.get("loss") for r in clean_logs]
    want, got = mega_params(clean), mega_params(trainer)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_nothing_left_to_give_up_or_switch_on_is_a_clear_error(tmp_path):
    """All layers streamed, nothing kept, offload on and the longest segments: the step is
    refused with what to change."""
    model = tiny_model(_config())
    _OutOfMemoryOnce(model, layer=0, at=3)
    with pytest.raises(MemoryPlanError, match="nothing left to give up"):
        run_accumulating_trainer(
            model,
            tmp_path,
            "bare",
            megatrain_resident_layers=0,
            megatrain_offload_activations=True,
            megatrain_checkpoint_every=max(SEGMENT_LENGTHS),
        )


def _fake_peaks(freed: dict[tuple[str, object], int], now: int = 100):
    """A plan's expected peak per option set: ``now`` less what each option turned on frees."""

    def peak(o: MemoryOptions) -> int:
        return now - sum(f for (name, value), f in freed.items() if getattr(o, name) == value)

    return peak


@pytest.mark.parametrize(
    ("need", "expected"),
    [
        # The lightest set that frees the need: tiles (cost 2) before offload (4).
        (10, {"mlp_tile_tokens": ADVICE_TILE_TOKENS}),
        (25, {"offload_activations": True}),
        (35, {"mlp_tile_tokens": ADVICE_TILE_TOKENS, "offload_activations": True}),
        # No set frees that much: the one that frees the most.
        (10_000, {"mlp_tile_tokens": ADVICE_TILE_TOKENS, "offload_activations": True,
                  "checkpoint_every": 8}),
    ],
)  # fmt: skip
def test_memory_options_chosen_from_the_plan(need, expected):
    freed = {("mlp_tile_tokens", ADVICE_TILE_TOKENS): 10, ("offload_activations", True): 25}
    freed |= {("checkpoint_every", k): 5 * k for k in SEGMENT_LENGTHS}
    chosen = choose_memory_options(MemoryOptions(), 1 << 20, need, _fake_peaks(freed))
    assert chosen.changes(MemoryOptions()).options == expected


def test_memory_options_never_approximate_or_fixed_at_build():
    """Only how activations are held changes in a live run: not bf16 boundaries or clipping
    (results), nor fp32-master streaming or the HBM tier's casts (the host store's layout), even
    where the plan says only those would free memory; a set freeing nothing is not chosen."""
    freed = {("boundary_dtype", "bfloat16"): 50, ("no_clip", True): 50}
    freed |= {("stream_fp32_master", True): 50, ("hbm_cast_weights", True): 50}
    assert choose_memory_options(MemoryOptions(), 1 << 20, 1, _fake_peaks(freed)) is None
    # Without a plan: the lightest live set (tiles only past a tile's length of tokens).
    assert choose_memory_options(MemoryOptions(), 1 << 20, None).mlp_tile_tokens
    small = choose_memory_options(MemoryOptions(), 4096, None)
    assert small.changes(MemoryOptions()).options == {"offload_activations": True}

    # A set the host cannot hold (the plan's peak None) is not chosen.
    def host_short(o: MemoryOptions) -> int | None:
        return None if o.offload_activations else 100

    assert choose_memory_options(MemoryOptions(), 4096, 1, host_short) is None


def test_memory_options_from_a_real_plan():
    """Qwen2.5-7B at one 131,072-token sequence on an H200's plan, every layer streamed: the
    chosen set is planned to free the need, and no lighter live set is."""
    from .test_memory_options import HBM, HOST, _shape, opts  # noqa: PLC0415

    shape = _shape("qwen2.5-7b")
    step = StepShape(micro_batch_tokens=131_072, seq_len=131_072, grad_accum=1)
    options = opts()
    plan = plan_memory(shape, step, options, torch.bfloat16, HBM, HOST)

    def peak(o: MemoryOptions) -> int | None:
        trial = plan_every_layer_streamed(plan, options, o)
        return trial.gpu_peak_estimate if trial.host_total <= trial.host_available else None

    base = MemoryOptions.of(options)
    need = 4 * GIB
    chosen = choose_memory_options(base, step.micro_batch_tokens, need, peak)
    assert peak(base) - peak(chosen) >= need
    lighter = [
        o for o in candidates(base, step.micro_batch_tokens) if o.cost(base) < chosen.cost(base)
    ]
    live = [o for o in lighter if set(o.changes(base).options) <= LIVE_MEMORY_OPTIONS]
    assert all(peak(o) is None or peak(base) - peak(o) < need for o in live)


def test_a_step_with_eager_updates_already_applied_is_not_run_again(tmp_path):
    """No clipping: layers update during backward; after some did, the step cannot run again
    without applying their update twice, so it stops with what to do instead."""
    model = tiny_model(_config())
    _OutOfMemoryOnce(model, layer=0, at=3, where="backward")
    with pytest.raises(MemoryPlanError, match="already updated during backward"):
        run_accumulating_trainer(
            model,
            tmp_path,
            "eager",
            max_grad_norm=0.0,
            gradient_accumulation_steps=1,
            megatrain_resident_layers=0,
        )
