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

from hf_megatrain.core.oom_recovery import StepHoldings, choose_relief, oom_request_bytes
from hf_megatrain.core.planner import MemoryPlanError
from hf_megatrain.hf.model import find_decoder_layers, streamed_state

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
    call, or in the backward of that call's output (``where="backward"``)."""

    def __init__(self, model, layer: int, at: int, where: str = "forward") -> None:
        self.calls, self.at, self.where, self.fired = 0, at, where, 0
        find_decoder_layers(model)[1][layer].register_forward_hook(self._hook)

    def _raise(self, *_):
        self.fired += 1
        raise torch.OutOfMemoryError(OOM_TEXT)

    def _hook(self, module, args, output):
        if not torch.is_grad_enabled():
            return None
        self.calls += 1
        if self.calls != self.at:
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


def test_nothing_left_to_give_up_is_a_clear_error(tmp_path):
    """All layers streamed, nothing kept: the step is refused with what to change."""
    model = tiny_model(_config())
    _OutOfMemoryOnce(model, layer=0, at=3)
    with pytest.raises(MemoryPlanError, match="nothing left to give up"):
        run_accumulating_trainer(model, tmp_path, "bare", megatrain_resident_layers=0)


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
