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
