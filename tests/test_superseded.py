"""Saves past the checkpoint a run resumes from, moved aside (hf_megatrain/hf/superseded.py):
what moves, a kill half way through the moves, and a refused resume that moves nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hf_megatrain.core.publish import IntegrityError, read_manifest, write_manifest
from hf_megatrain.hf.superseded import (
    SUPERSEDED_PREFIX,
    finish_pending_moves,
    later_saves,
    set_aside_later_saves,
)

from .helpers import make_data, run_trainer, tiny_config, tiny_model

REPO = Path(__file__).resolve().parents[1]


def _output_dir(root: Path, steps=(2, 4, 6), final_step: int | None = 6) -> Path:
    """An output_dir as a run leaves it: checkpoint-N folders (a trainer state each) and a final
    model whose manifest records the step it was saved at."""
    out = root / "out"
    for n in steps:
        ckpt = out / f"checkpoint-{n}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": n}))
    if final_step is not None:
        (out / "model.safetensors").write_bytes(b"weights")
        (out / "config.json").write_text("{}")
        write_manifest(str(out), {"global_step": final_step})
    (out / "notes.txt").write_text("the user's own file")
    return out


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_the_saves_past_the_resumed_step_move_and_nothing_else(tmp_path):
    out = _output_dir(tmp_path)
    aside = Path(set_aside_later_saves(str(out), str(out / "checkpoint-2")))
    assert aside == out / f"{SUPERSEDED_PREFIX}2"
    assert _names(out) == ["_superseded-after-step-2", "checkpoint-2", "notes.txt"]
    assert _names(aside) == [
        "checkpoint-4", "checkpoint-6", "config.json", "megatrain_manifest.json",
        "model.safetensors",
    ]  # fmt: skip
    assert read_manifest(str(aside))["saved_from"] == {"global_step": 6}  # (no journal left)
    # Again from the same step: nothing left to move, no second folder.
    assert set_aside_later_saves(str(out), str(out / "checkpoint-2")) is None
    assert _names(out) == ["_superseded-after-step-2", "checkpoint-2", "notes.txt"]


@pytest.mark.parametrize("final_step", [4, None])
def test_a_final_model_not_past_the_step_stays(tmp_path, final_step):
    """The final model of the resumed step (an extension of a finished run) is this run's own
    past: it stays, and only later checkpoints move."""
    out = _output_dir(tmp_path, steps=(2, 4, 6), final_step=final_step)
    assert later_saves(str(out), 4) == (["checkpoint-6"], [], None)
    set_aside_later_saves(str(out), str(out / "checkpoint-4"))
    assert (out / "config.json").exists() == (final_step is not None)
    assert _names(out / f"{SUPERSEDED_PREFIX}4") == ["checkpoint-6"]


_KILLED_MOVE = textwrap.dedent(
    """
    import os, signal, sys
    from hf_megatrain.hf.superseded import set_aside_later_saves

    rename, moved = os.rename, []

    def rename_then_die(src, dst):
        rename(src, dst)
        moved.append(src)
        if len(moved) == int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGKILL)

    os.rename = rename_then_die
    set_aside_later_saves(sys.argv[1], sys.argv[2])
    """
)


@pytest.mark.parametrize("after", [1, 3])
def test_a_move_killed_half_way_is_finished_before_a_checkpoint_is_picked(tmp_path, after):
    """SIGKILL after the first (or third) rename: the older of the later checkpoints was left
    behind for the next resume to take (found by an audit). The journal names what is left;
    ``finish_pending_moves`` completes it, as the next run does before choosing a checkpoint."""
    out = _output_dir(tmp_path)
    r = subprocess.run(
        [sys.executable, "-c", _KILLED_MOVE, str(out), str(out / "checkpoint-2"), str(after)],
        env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == -9, r.stderr[-2000:]
    left = {"checkpoint-6", "model.safetensors"} & set(_names(out))
    assert left  # killed with later saves still in place
    aside = out / f"{SUPERSEDED_PREFIX}2"
    # A run since (a script's train() that did not finish the move) wrote its own checkpoint-4:
    # the replay leaves it (found by an audit: it crashed on the name, or would have taken it).
    (out / "checkpoint-4").mkdir()
    (out / "checkpoint-4" / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    assert finish_pending_moves(str(out)) == [str(aside)]
    assert _names(out) == ["_superseded-after-step-2", "checkpoint-2", "checkpoint-4", "notes.txt"]
    assert "MOVING.json" not in _names(aside) and "checkpoint-6" in _names(aside)
    assert finish_pending_moves(str(out)) == []


def test_a_refused_resume_moves_nothing(tmp_path):
    """A damaged checkpoint named to ``train(resume_from_checkpoint=...)`` is refused before its
    later saves are moved (found by an audit: they were moved, then the resume failed)."""
    cfg = tiny_config("llama")
    data = make_data(16)
    _, trainer = run_trainer(
        tiny_model(cfg), tmp_path, "run", mega=True, data=data, max_steps=4, save_strategy="steps",
        save_steps=2,
    )  # fmt: skip
    trainer.save_model()
    out = tmp_path / "run"
    before = _names(out)
    assert "checkpoint-4" in before and "model.safetensors" in before
    weights = out / "checkpoint-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(IntegrityError):
        run_trainer(
            tiny_model(cfg), tmp_path, "run", mega=True, data=data, max_steps=4,
            save_strategy="steps", save_steps=2, resume=str(out / "checkpoint-2"),
        )  # fmt: skip
    assert _names(out) == before


def test_hub_pushes_take_the_published_checkpoint(tmp_path, monkeypatch):
    """push_to_hub with hub_strategy="checkpoint": every upload lists the published folders,
    never the checkpoint's staging folder (found by an audit: the fp32 optimizer state went up
    with the model at every save, and last-checkpoint pointed at a folder renamed away)."""
    import concurrent.futures

    import transformers.trainer

    uploads = []

    class Api:
        def create_repo(self, *args, **kwargs):
            return type("Repo", (), {"repo_id": "me/tiny"})()

        def upload_folder(self, repo_id, folder_path, path_in_repo=None, **kwargs):
            root = Path(folder_path)
            uploads.append(
                (path_in_repo, sorted(str(p.relative_to(root)) for p in root.rglob("*")))
            )
            done = concurrent.futures.Future()
            done.set_result(None)
            return done

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: Api(), raising=False)
    run_trainer(
        tiny_model(tiny_config("llama")), tmp_path, "run", mega=True, data=make_data(8),
        max_steps=4, save_strategy="steps", save_steps=2, push_to_hub=True,
        hub_model_id="me/tiny", hub_strategy="checkpoint",
    )  # fmt: skip
    last = [files for where, files in uploads if where == "last-checkpoint"]
    assert last and all("megatrain_manifest.json" in files for files in last)
    assert not any(".megatrain-staging" in f for _, files in uploads for f in files)
