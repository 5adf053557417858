"""The out-of-memory watchdog beyond the training step (issue 20): an evaluation batch or an
optimizer step that runs out of GPU memory gives up HBM-tier layers (that work holds no
activations) and runs again, once per relief, with results equal to a run that never failed;
what cannot run again exactly is refused with what to do.

On the CPU the failure is injected through public hooks, raising CUDA's out-of-memory error once:
a decoder layer's forward hook during evaluation (``no_grad``), the optimizer's step pre-hook (the
update has not started), its step post-hook (the update is applied), or a function mode on the
gradient norm's ``torch.linalg.vector_norm``. The HBM tier exists on the CPU too when a count is
asked (``megatrain_resident_layers=2``).
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import TrainerCallback

from hf_megatrain import HFMegaTrainer, MegaTrainArguments
from hf_megatrain.core.oom_recovery import StepHoldings, choose_relief
from hf_megatrain.core.planner import MemoryPlanError
from hf_megatrain.hf.model import find_decoder_layers, streamed_state

from .helpers import (
    common_args,
    make_data,
    mega_params,
    run_accumulating_trainer,
    run_trainer,
    tiny_config,
    tiny_model,
)

OOM_TEXT = (
    "CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 139.72 GiB "
    "of which 1.50 MiB is free."
)
#: Without the size: each relief gives up one item (one HBM-tier layer here).
OOM_NO_SIZE = "CUDA out of memory."

EVAL = make_data(6, seed=3)  # eval batch 4: two batches, the second partial


def _config():
    # Dropout on: a step that runs again must draw the same random numbers as the first time.
    return tiny_config("llama", attention_dropout=0.2)


def _tier(trainer) -> list[bool]:
    return [s.resident for s in streamed_state(trainer.model).engine.stores]


def _assert_same_weights(trainer, clean) -> None:
    want, got = mega_params(clean), mega_params(trainer)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


# ---- what to give up ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("need", "expected"),
    [
        # Only tier layers, the last first; kept activations go with their layer (the kept
        # layers are the tier's last); attention outputs stay.
        (5, (1, 2, [2], 10)),
        (15, (0, 2, [1, 2], 20)),
        (100, (0, 2, [0, 1, 2], 30)),
        (None, (1, 2, [2], 10)),
    ],
)
def test_relief_without_activations_gives_up_tier_layers_only(need, expected):
    held = StepHoldings(
        tier=[(0, 10), (1, 10), (2, 10)], kept=2, kept_bytes=3, attention=2, attention_bytes=2
    )
    relief = choose_relief(held, need, weights_only=True)
    assert (relief.kept, relief.attention, relief.to_host, relief.freed_bytes) == expected
    assert choose_relief(StepHoldings(tier=[], kept=0, attention=2), 1, weights_only=True) is None


# ---- evaluation ---------------------------------------------------------------------------------
class _EvalOutOfMemory:
    """Makes decoder layer ``layer`` raise CUDA's out-of-memory error at its forward calls
    under ``no_grad`` (evaluation batches) numbered ``at``."""

    def __init__(self, model, layer: int, at: set[int], message: str = OOM_TEXT) -> None:
        self.calls, self.at, self.fired, self.message = 0, at, 0, message
        find_decoder_layers(model)[1][layer].register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if torch.is_grad_enabled():
            return None
        self.calls += 1
        if self.calls in self.at:
            self.fired += 1
            raise torch.OutOfMemoryError(self.message)
        return None


def _eval_trainer(model, tmp_path, name, **overrides):
    kw = dict(per_device_eval_batch_size=4, megatrain_resident_layers=2)
    kw.update(overrides)
    args = MegaTrainArguments(output_dir=str(tmp_path / name), **common_args(**kw))
    return HFMegaTrainer(model=model, args=args, eval_dataset=EVAL)


@pytest.mark.parametrize("how", ["evaluate", "predict"])
def test_an_evaluation_batch_that_runs_out_of_memory_runs_again(how, tmp_path, caplog):
    """Out of memory in the second evaluation batch: the HBM tier moves to the host (2 MiB
    asked + 1 GiB headroom is more than the tiny tier holds) and the batch runs again; the
    metrics (and, predicting, every logit) equal an evaluation that never failed, bit for bit."""
    model = tiny_model(_config())

    def run(trainer):
        if how == "evaluate":
            return trainer.evaluate()
        out = trainer.predict(EVAL)
        return out.metrics, torch.as_tensor(out.predictions)

    clean = run(_eval_trainer(copy.deepcopy(model), tmp_path, "clean"))
    faulty = copy.deepcopy(model)
    fault = _EvalOutOfMemory(faulty, layer=1, at={2})
    trainer = _eval_trainer(faulty, tmp_path, "faulty")
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
        got = run(trainer)
    assert fault.fired == 1 and fault.calls == 3  # batch 2 ran twice
    assert "evaluation ran out of GPU memory (asked 0.00 GiB)" in caplog.text
    assert "layers 0-1 moved from the HBM tier to the host tier" in caplog.text
    assert "running the evaluation batch again" in caplog.text
    assert _tier(trainer) == [False, False]
    if how == "evaluate":
        for key in ("eval_loss", "epoch"):
            if key in clean:
                assert got[key] == clean[key], key
    else:
        assert got[0]["test_loss"] == clean[0]["test_loss"]
        assert torch.equal(got[1], clean[1])


def test_evaluation_during_training_recovers_and_training_goes_on_the_same(tmp_path, caplog):
    """The first of two evaluations during training runs out of memory, one HBM-tier layer per
    relief (no size in the error): layer 1 moves, the batch fails again, layer 0 moves, it runs.
    Both evaluations, and the training after them (losses, gradient norms, final weights, with
    the optimizer following the moved layers), equal the run that never failed."""
    model = tiny_model(_config())
    kw = dict(
        eval_dataset=EVAL,
        per_device_eval_batch_size=4,
        eval_strategy="steps",
        eval_steps=2,
        max_steps=4,
        gradient_accumulation_steps=2,
        megatrain_resident_layers=2,
    )
    from .helpers import LogRecorder

    clean_rec, rec = LogRecorder(), LogRecorder()
    _, clean = run_trainer(copy.deepcopy(model), tmp_path, "clean", True, recorder=clean_rec, **kw)
    faulty = copy.deepcopy(model)
    # Call 1: the first batch; call 2: that batch again after the first relief.
    fault = _EvalOutOfMemory(faulty, layer=0, at={1, 2}, message=OOM_NO_SIZE)
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
        _, trainer = run_trainer(faulty, tmp_path, "faulty", True, recorder=rec, **kw)
    assert fault.fired == 2
    assert caplog.text.count("evaluation ran out of GPU memory;") == 2
    assert "layer 1 moved from the HBM tier to the host tier" in caplog.text
    assert "layer 0 moved from the HBM tier to the host tier" in caplog.text
    assert _tier(trainer) == [False, False]
    assert [r["eval_loss"] for r in rec.eval_logs] == [r["eval_loss"] for r in clean_rec.eval_logs]
    assert len(rec.eval_logs) == 2
    assert [r["loss"] for r in rec.logs] == [r["loss"] for r in clean_rec.logs]
    assert [r["grad_norm"] for r in rec.logs] == [r["grad_norm"] for r in clean_rec.logs]
    _assert_same_weights(trainer, clean)


def test_evaluation_with_nothing_left_to_give_up_is_a_clear_error(tmp_path):
    model = tiny_model(_config())
    _EvalOutOfMemory(model, layer=0, at={1})
    trainer = _eval_trainer(model, tmp_path, "bare", megatrain_resident_layers=0)
    with pytest.raises(MemoryPlanError, match="evaluation ran out of GPU memory .*nothing left"):
        trainer.evaluate()


def test_evaluation_without_recovery_propagates_the_error(tmp_path):
    model = tiny_model(_config())
    _EvalOutOfMemory(model, layer=0, at={1})
    trainer = _eval_trainer(model, tmp_path, "off", megatrain_oom_recovery=False)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.evaluate()
    assert _tier(trainer) == [True, True]


# ---- the optimizer step -------------------------------------------------------------------------
class _StepOutOfMemoryOnce(TrainerCallback):
    """Makes the optimizer's ``step()`` raise CUDA's out-of-memory error at its ``at``-th call,
    from a step pre-hook (before any update) or a step post-hook (after the whole update)."""

    def __init__(self, at: int, where: str = "pre", message: str = OOM_TEXT) -> None:
        self.at, self.where, self.message = at, where, message
        self.calls = self.fired = 0

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        register = (
            optimizer.register_step_pre_hook
            if self.where == "pre"
            else optimizer.register_step_post_hook
        )
        register(self._hook)

    def _hook(self, optimizer, args, kwargs):
        self.calls += 1
        if self.calls == self.at:
            self.fired += 1
            raise torch.OutOfMemoryError(self.message)


class _NormOutOfMemoryOnce(TorchFunctionMode):
    """Raises CUDA's out-of-memory error at the first ``torch.linalg.vector_norm`` once armed
    (the gradient norm: the tiny model's forward and backward call none on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed, self.fired = False, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.armed and func is torch.linalg.vector_norm:
            self.armed = False
            self.fired += 1
            raise torch.OutOfMemoryError(OOM_TEXT)
        return func(*args, **(kwargs or {}))


class _ArmAtStep(TrainerCallback):
    def __init__(self, mode: _NormOutOfMemoryOnce, step: int) -> None:
        self.mode, self.step = mode, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            self.mode.armed = True


MODES = {
    # Clipping: nothing updates before the step's end.
    "clipped": dict(max_grad_norm=0.5),
    # No clipping, updates after backward all the same.
    "unclipped": dict(max_grad_norm=0.0, megatrain_eager_update=False),
    # No clipping, each layer updates during backward; step() updates the resident parameters.
    "eager": dict(max_grad_norm=0.0),
}


def _assert_same_run(logs, clean_logs, trainer, clean) -> None:
    assert len(logs) == len(clean_logs) == 4
    assert [r["loss"] for r in logs] == [r["loss"] for r in clean_logs]
    assert [r.get("grad_norm") for r in logs] == [r.get("grad_norm") for r in clean_logs]
    assert [r["learning_rate"] for r in logs] == [r["learning_rate"] for r in clean_logs]
    _assert_same_weights(trainer, clean)


def _clean_and_faulty(model, tmp_path, caplog, options, callbacks=(), fault=None, faulty=None):
    """The run without failures, then, from the same initial weights (``faulty``: that model,
    instrumented; default a copy of ``model``), the run with ``callbacks`` and the ``fault``
    mode active, its warnings in ``caplog``: ``(clean logs, clean trainer, logs, trainer)``."""
    clean_logs, clean = run_accumulating_trainer(copy.deepcopy(model), tmp_path, "clean", **options)
    faulty = copy.deepcopy(model) if faulty is None else faulty
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"), fault or contextlib.nullcontext():
        logs, trainer = run_accumulating_trainer(
            faulty, tmp_path, "faulty", list(callbacks), **options
        )
    return clean_logs, clean, logs, trainer


@pytest.mark.parametrize("mode", list(MODES))
def test_an_optimizer_step_that_runs_out_of_memory_runs_again(mode, tmp_path, caplog):
    """Step 2's update runs out of memory before applying anything: the HBM tier moves to the
    host and the update runs once more (without eager updates after the step's micro-batches
    ran again, the moved layers' gradients being gone). Losses, gradient norms, learning rates
    and final weights are bit-equal to the run that never failed: no update lost or doubled."""
    fault = _StepOutOfMemoryOnce(at=2)
    clean_logs, clean, logs, trainer = _clean_and_faulty(
        tiny_model(_config()), tmp_path, caplog, MODES[mode], [fault]
    )
    assert fault.fired == 1 and fault.calls == 4 + 1  # step 2's update ran twice
    assert "step 2's optimizer step ran out of GPU memory (asked 0.00 GiB)" in caplog.text
    assert "layers 0-1 moved from the HBM tier to the host tier" in caplog.text
    again = "running the optimizer step again" if mode == "eager" else "first micro-batch"
    assert again in caplog.text
    assert _tier(trainer) == [False, False]
    _assert_same_run(logs, clean_logs, trainer, clean)


@pytest.mark.parametrize("mode", ["clipped", "unclipped"])
def test_a_gradient_norm_that_runs_out_of_memory_runs_again(mode, tmp_path, caplog):
    """Out of memory computing step 3's gradient norm (clipping, or the logged norm): the step's
    micro-batches run again for the gradients the moved layers lost, then the norm; same run."""
    mode_ = _NormOutOfMemoryOnce()
    clean_logs, clean, logs, trainer = _clean_and_faulty(
        tiny_model(_config()), tmp_path, caplog, MODES[mode], [_ArmAtStep(mode_, 3)], mode_
    )
    part = "gradient clipping" if mode == "clipped" else "gradient norm"
    assert mode_.fired == 1
    assert f"step 3's {part} ran out of GPU memory" in caplog.text
    assert "first micro-batch" in caplog.text
    _assert_same_run(logs, clean_logs, trainer, clean)


def test_a_micro_batch_run_again_for_the_update_can_make_room_too(tmp_path, caplog):
    """One relief per attempt (no size in the errors): step 2's update fails, layer 1 moves;
    a micro-batch run again for it fails in backward, the training step's relief moves layer
    0; the step's micro-batches and its update then run. Same run as without failures."""
    from .test_oom_recovery import _OutOfMemoryOnce

    model = tiny_model(_config())
    faulty = copy.deepcopy(model)
    # Forward calls 1-4 are steps 1-2's micro-batches; 5 is step 2's first, run again.
    layer_fault = _OutOfMemoryOnce(faulty, layer=0, at=5, where="backward")
    step_fault = _StepOutOfMemoryOnce(at=2, message=OOM_NO_SIZE)
    clean_logs, clean, logs, trainer = _clean_and_faulty(
        model, tmp_path, caplog, MODES["clipped"], [step_fault], faulty=faulty
    )
    assert step_fault.fired == layer_fault.fired == 1
    assert "step 2's optimizer step ran out of GPU memory; made room: layer 1 moved" in caplog.text
    assert "step 2 ran out of GPU memory (asked 0.00 GiB); made room: layer 0 moved" in caplog.text
    assert caplog.text.count("then its optimizer step") == 2
    _assert_same_run(logs, clean_logs, trainer, clean)


class _MomentsOutOfMemory(TorchFunctionMode):
    """Raises CUDA's out-of-memory error where the first step allocates the AdamW moments of
    the resident 1-D parameters (the final norm: the no-decay group, updated after the decay
    group's embeddings and LM head), once armed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed, self.fired = False, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.armed and func is torch.zeros_like and args[0].dim() == 1:
            self.armed = False
            self.fired += 1
            raise torch.OutOfMemoryError(OOM_TEXT)
        return func(*args, **(kwargs or {}))


class _ArmBeforeFirstUpdate(TrainerCallback):
    def __init__(self, mode: _MomentsOutOfMemory) -> None:
        self.mode = mode

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == 0:
            self.mode.armed = True


@pytest.mark.parametrize("mode", ["clipped", "eager"])
def test_the_first_steps_moments_that_do_not_fit_run_again(mode, tmp_path, caplog):
    """The first update allocates the resident parameters' AdamW moments; out of memory there,
    nothing is updated yet (every allocation comes before the first update), so the update
    runs again after making room: the same run."""
    fault = _MomentsOutOfMemory()
    clean_logs, clean, logs, trainer = _clean_and_faulty(
        tiny_model(_config()), tmp_path, caplog, MODES[mode], [_ArmBeforeFirstUpdate(fault)], fault
    )
    assert fault.fired == 1
    assert "step 1's optimizer step ran out of GPU memory" in caplog.text
    _assert_same_run(logs, clean_logs, trainer, clean)


class _EvaluateMidStep(TrainerCallback):
    """Evaluates after the first micro-batch of step 1 (its gradients held)."""

    trainer = None

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step == 0:
            self.trainer.evaluate()


def test_evaluation_in_the_middle_of_a_step_is_not_given_room(tmp_path):
    """A callback evaluating between micro-batches: moving HBM-tier layers would drop the
    step's gradients, so an evaluation batch out of memory there is refused, not recovered."""
    from .helpers import one_gpu

    model = tiny_model(_config())
    _EvalOutOfMemory(model, layer=0, at={1})
    callback = _EvaluateMidStep()
    kw = dict(max_steps=1, gradient_accumulation_steps=2, megatrain_resident_layers=2)
    args = one_gpu(MegaTrainArguments(output_dir=str(tmp_path / "mid"), **common_args(**kw)))
    trainer = HFMegaTrainer(
        model=model,
        args=args,
        train_dataset=make_data(),
        eval_dataset=EVAL,
        callbacks=[callback],
    )
    callback.trainer = trainer
    with pytest.raises(MemoryPlanError, match="in the middle of an optimizer step"):
        trainer.train()
    assert _tier(trainer) == [True, True]


def test_an_update_already_applied_is_not_applied_again(tmp_path):
    """Out of memory after step() applied the update (a step post-hook): running it again
    would apply it twice, so the run stops with what to do."""
    model = tiny_model(_config())
    with pytest.raises(MemoryPlanError, match="after part of its update was already applied"):
        run_accumulating_trainer(
            model, tmp_path, "applied", [_StepOutOfMemoryOnce(at=2, where="post")]
        )


def test_an_eager_step_whose_norm_runs_out_of_memory_is_refused(tmp_path):
    """Eager updates: the layers updated during backward; the norm needs the gradients that
    moving HBM-tier layers would drop, and running the step again would update them twice."""
    model = tiny_model(_config())
    mode_ = _NormOutOfMemoryOnce()
    with mode_, pytest.raises(MemoryPlanError, match="already updated during backward"):
        run_accumulating_trainer(model, tmp_path, "eager", [_ArmAtStep(mode_, 2)], **MODES["eager"])
    assert mode_.fired == 1


def test_an_optimizer_step_with_nothing_left_to_give_up_is_a_clear_error(tmp_path):
    model = tiny_model(_config())
    with pytest.raises(MemoryPlanError, match="optimizer step ran out .*nothing left to give up"):
        run_accumulating_trainer(
            model, tmp_path, "bare", [_StepOutOfMemoryOnce(at=1)], megatrain_resident_layers=0
        )


def test_an_optimizer_step_without_recovery_propagates_the_error(tmp_path):
    model = tiny_model(_config())
    with pytest.raises(torch.OutOfMemoryError):
        run_accumulating_trainer(
            model, tmp_path, "off", [_StepOutOfMemoryOnce(at=1)], megatrain_oom_recovery=False
        )
