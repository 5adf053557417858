"""A resume continues the same run: missing optimizer or scheduler state is an error naming the
file, unless ``resume_without_optimizer_state`` allows starting them afresh."""

from __future__ import annotations

import copy
import json
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

    with pytest.raises(FileNotFoundError, match=f"cannot resume from .*{missing}.* missing") as e:
        run_trainer(copy.deepcopy(model), tmp_path, "refused", True, resume=str(ckpt), **kw)
    if missing == "megatrain_optimizer":
        # The folder named once, not each of its files (a line of ~900 characters before).
        assert "megatrain_optimizer (the whole folder: 4 files its manifest lists)" in str(
            e.value
        ), str(e.value)
        assert str(e.value).count("layer") < 2, str(e.value)
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


def test_resident_optimizer_state_is_written_in_shards_and_resumes_exactly(tmp_path):
    """The resident moments (embeddings, norms, head: 8.7 GB at 7B, on the GPU) were written as
    one file, which safetensors copies to the host whole, in a run whose plan may have left the
    host no room for it. They are written in files of at most ``max_shard_size``, listed in
    meta.json, and a resume from them continues bit for bit; a missing shard is named."""
    from hf_megatrain.cli_resume import checkpoint_problem

    # vocab 4096 x hidden 64: each of the embedding's and head's moments is 1 MiB.
    model = tiny_model(tiny_config("llama", vocab_size=4096))
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, megatrain_max_shard_size="1MB")
    full, _ = run_trainer(copy.deepcopy(model), tmp_path, "full", True, **kw)
    state = tmp_path / "full" / "checkpoint-2" / "megatrain_optimizer"
    shards = sorted(p.name for p in state.glob("resident*.safetensors"))
    assert len(shards) >= 4 and "resident.safetensors" not in shards, shards
    with open(state / "meta.json") as f:
        assert json.load(f)["resident_files"] == shards

    resumed, _ = run_trainer(
        copy.deepcopy(model), tmp_path, "resumed", True, resume=str(state.parent), **kw
    )
    # Bit for bit: the same losses as the run that went on without stopping.
    assert len(resumed) == 2
    assert [x["loss"] for x in resumed] == [x["loss"] for x in full[2:]]

    os.remove(state / shards[-1])
    problem = checkpoint_problem(str(state.parent))
    assert problem is not None and shards[-1] in problem.reason
