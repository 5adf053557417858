"""A resume continues the same run: missing optimizer or scheduler state is an error naming the
file, unless ``resume_without_optimizer_state`` allows starting them afresh."""

from __future__ import annotations

import copy
import os
import shutil

import pytest

from .helpers import run_trainer, tiny_config, tiny_model


@pytest.mark.parametrize("missing", ["megatrain_optimizer", "scheduler.pt"])
def test_resume_with_missing_state(tmp_path, missing):
    model = tiny_model(tiny_config("llama"))
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
    run_trainer(copy.deepcopy(model), tmp_path, "full", True, **kw)
    ckpt = tmp_path / "full" / "checkpoint-2"
    gone = ckpt / missing
    shutil.rmtree(gone) if gone.is_dir() else os.remove(gone)

    with pytest.raises(FileNotFoundError, match=f"cannot resume from .*{missing}.* missing"):
        run_trainer(copy.deepcopy(model), tmp_path, "refused", True, resume=str(ckpt), **kw)
    # Allowed explicitly: the run goes on to its last step.
    logs, trainer = run_trainer(
        copy.deepcopy(model), tmp_path, "allowed", True, resume=str(ckpt),
        megatrain_resume_without_optimizer_state=True, **kw,
    )  # fmt: skip
    assert trainer.state.global_step == 4 and len(logs) == 2


def test_resume_from_a_stock_trainer_checkpoint_names_its_optimizer_file(tmp_path):
    """A checkpoint of the stock Trainer holds optimizer.pt, which hf_megatrain cannot read:
    the refusal says so and names the option that resumes without it (before, it said only
    that megatrain_optimizer is missing); the CLI's completeness check says the same."""
    from hf_megatrain.cli_resume import checkpoint_problem

    model = tiny_model(tiny_config("llama"))
    kw = dict(max_steps=2, save_strategy="steps", save_steps=2)
    run_trainer(copy.deepcopy(model), tmp_path, "stock", False, **kw)
    ckpt = tmp_path / "stock" / "checkpoint-2"
    assert (ckpt / "optimizer.pt").is_file()
    with pytest.raises(FileNotFoundError) as e:
        run_trainer(copy.deepcopy(model), tmp_path, "refused", True, resume=str(ckpt), **kw)
    msg = str(e.value)
    assert f"{ckpt / 'optimizer.pt'} is the stock Trainer's optimizer state" in msg
    assert "megatrain_resume_without_optimizer_state=True" in msg
    problem = checkpoint_problem(str(ckpt))
    assert problem is not None and problem.state_only
    assert "optimizer.pt is the stock Trainer's optimizer state" in problem.reason
