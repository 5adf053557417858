"""``hf-megatrain train`` killed mid-run and re-run into the same output folder resumes from the
last complete checkpoint, bit-exactly: a local JSONL chat dataset and a streaming dataset.

The killed run is a real process that SIGKILLs itself right after an optimizer step that follows a
checkpoint (no chance to flush or clean up); the re-run is the same command line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from hf_megatrain.cli import DEFAULT_CONFIG, main
from hf_megatrain.text import DATA_DIR, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
STEPS, SAVE_STEPS, KILL_AT = 6, 2, 5  # killed after step 5: checkpoint-4 is the last one

# A minimal chat template (the bundled tokenizer has none; a Hub chat model brings its own).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
)

_KILLED_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from transformers import TrainerCallback
    from hf_megatrain import HFMegaTrainer
    from hf_megatrain.cli import main

    class KillAfterStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == int(os.environ["KILL_AT"]):
                os.kill(os.getpid(), signal.SIGKILL)

    init = HFMegaTrainer.__init__

    def init_with_kill(self, *a, **kw):
        init(self, *a, **kw)
        self.add_callback(KillAfterStep())

    HFMegaTrainer.__init__ = init_with_kill
    torch.set_num_threads(1)  # as tests/conftest.py sets it for the in-process runs
    main(sys.argv[1:])
    """
)


def _tiny_config(path: Path) -> Path:
    cfg = json.loads(DEFAULT_CONFIG.read_text())
    cfg.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16)  # fmt: skip
    path.write_text(json.dumps(cfg))
    return path


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _argv(root: Path, out: Path, data_flags: list[str]) -> list[str]:
    return [
        "train", "--config", str(_tiny_config(root / "config.json")), *data_flags,
        "--max_steps", str(STEPS), "--save_steps", str(SAVE_STEPS), "--seq_len", "32",
        "--per_device_train_batch_size", "2", "--logging_steps", "1", "--max_new_tokens", "0",
        "--disable_tqdm", "true", "--fp32", "--output_dir", str(out),
    ]  # fmt: skip


def _chat_flags(root: Path) -> list[str]:
    tok = load_tokenizer(None)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(root / "chat-tokenizer")
    data = root / "chat.jsonl"
    data.write_text((DATA_DIR / "chat.jsonl").read_text())
    return ["--dataset_name", str(data), "--tokenizer", str(root / "chat-tokenizer")]


def _streaming_flags(root: Path) -> list[str]:
    paras = (DATA_DIR / "corpus.txt").read_text().split("\n\n")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in paras[:400] if p.strip()))
    return ["--dataset_name", str(data), "--streaming", "--shuffle_buffer", "64",
            "--max_eval_sequences", "4"]  # fmt: skip


@pytest.mark.parametrize("kind", ["jsonl-chat", "streaming"])
def test_killed_run_resumes_bit_exactly(tmp_path, capsys, kind):
    flags = (_chat_flags if kind == "jsonl-chat" else _streaming_flags)(tmp_path)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(_argv(tmp_path, whole, flags)) == 0

    env = dict(os.environ, KILL_AT=str(KILL_AT), PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-c", _KILLED_CHILD, *_argv(tmp_path, killed, flags)[0:]],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == -9, r.stderr[-2000:]  # SIGKILL, mid-run
    assert sorted(p.name for p in killed.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not (killed / "model.safetensors").exists()  # the final model was never written

    capsys.readouterr()
    assert main(_argv(tmp_path, killed, flags)) == 0  # the same command, re-run
    said = capsys.readouterr().out
    assert f"resuming from {killed / 'checkpoint-4'}" in said
    assert "trained 2 steps (from step 4)" in said
    assert "note: that checkpoint trained on rows of" not in said  # the same --seq_len
    a, b = _weights(whole), _weights(killed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bit-exact: same data, same arithmetic

    # The logged losses of the resumed steps equal the uninterrupted run's.
    def losses(folder: Path) -> dict[int, float]:
        state = json.loads((folder / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
        return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}

    assert losses(whole) == losses(killed)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path]:
    """One uninterrupted run (checkpoints 2, 4 and 6, the final model) on the bundled corpus;
    tests resume copies of it."""
    root = tmp_path_factory.mktemp("finished")
    out = root / "run"
    assert main(_argv(root, out, ["--max_eval_sequences", "4"])) == 0
    return root, out


def _copy(finished: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A copy of the finished run's folder, and its command line (the same config file)."""
    root, out = finished
    shutil.copytree(out, tmp_path / "run")
    return root, tmp_path / "run", ["--max_eval_sequences", "4"]


def _files(folder: Path) -> dict[str, int]:
    return {f.name: f.stat().st_mtime_ns for f in folder.iterdir() if f.is_file()}


def test_a_finished_run_run_again_trains_nothing(finished, tmp_path, capsys):
    """The same command again after it finished: its last checkpoint is at --max_steps and the
    model is saved, so nothing is trained and the saved model is left as it is (the Trainer
    would train one step past --max_steps from there and replace it)."""
    root, out, flags = _copy(finished, tmp_path)
    before = _files(out)
    capsys.readouterr()
    assert main(_argv(root, out, flags)) == 0
    said = capsys.readouterr().out
    assert (
        f"already holds this run's final model (saved at step {STEPS} of --max_steps {STEPS}; "
        f"its last checkpoint is checkpoint-{STEPS})"
    ) in said
    assert _files(out) == before


def test_a_shorter_run_into_a_longer_runs_folder_is_refused(finished, tmp_path):
    """Found by an audit: --max_steps below the folder's newest checkpoint (a longer run's:
    its schedule ran to a later end) exited 0 saying the folder held "this run's final model
    (saved at step 6 of --max_steps 4)". Refused in one line, nothing written."""
    root, out, flags = _copy(finished, tmp_path)
    before = _files(out)
    argv = _argv(root, out, flags)
    argv[argv.index("--max_steps") + 1] = str(STEPS - 2)
    with pytest.raises(SystemExit) as e:
        main(argv)
    said = str(e.value)
    assert said.startswith("hf-megatrain: error: ") and "\n" not in said
    assert f"checkpoint-{STEPS} is at step {STEPS}, past --max_steps {STEPS - 2}" in said
    assert f"--max_steps {STEPS} or more" in said and "another --output_dir" in said
    assert _files(out) == before


def test_a_config_edited_since_the_checkpoint_is_refused_before_the_model_is_built(
    finished, tmp_path
):
    """Found by an audit: --config's file edited between the run and its resume failed only
    when the weights were loaded into the new model (built first: minutes for a large one),
    naming a tensor's shape. Refused from the checkpoint's config, naming the fields."""
    root, out, flags = _copy(finished, tmp_path)
    (out / "model.safetensors").unlink()  # (not finished: the run resumes)
    argv = _argv(root, out, flags)
    cfg = json.loads((root / "config.json").read_text())
    cfg.update(hidden_size=48, rope_theta=cfg.get("rope_theta", 10000.0) * 2)
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        main(argv)
    said = str(e.value)
    assert said.startswith("hf-megatrain: error: cannot resume from ") and "\n" not in said
    assert "its model config differs from this run's: hidden_size 32 (this run: 48)" in said
    assert "rope_theta" in said and "Restore the config" in said


def test_a_config_whose_token_ids_the_trainer_aligned_resumes(finished, tmp_path, capsys):
    """Found by an audit: a --config whose special-token ids differ from the tokenizer's (the
    Trainer sets them to the tokenizer's before the first save, so every checkpoint records
    those) was refused on the rerun the CLI itself advises ("eos_token_id 0 (this run: 2)"),
    after any kill. Token ids shape no weight: the run resumes."""
    root, out, flags = _copy(finished, tmp_path)
    (out / "model.safetensors").unlink()  # (killed after checkpoint-4: the run resumes)
    shutil.rmtree(out / "checkpoint-6")
    argv = _argv(root, out, flags)  # (it writes the config file: the ids are edited after)
    cfg = json.loads((root / "config.json").read_text())
    saved = json.loads((out / "checkpoint-4" / "config.json").read_text())
    cfg.update(eos_token_id=saved["eos_token_id"] + 5, pad_token_id=None, bos_token_id=7)
    (root / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert f"resuming from {out / 'checkpoint-4'}" in said and "trained 2 steps" in said


def _flip_bytes(path: Path, text: bool = False) -> None:
    """Alter ``path`` in place, its size unchanged: a JSON file made invalid, else 16 bytes."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2
    data[at : at + 16] = b"#" * 16 if text else bytes(b ^ 0xFF for b in data[at : at + 16])
    path.write_bytes(bytes(data))


def test_a_damaged_final_model_is_written_again(finished, tmp_path, capsys):
    """The same command again after it finished, its final model altered on disk (same size):
    the model is not taken as done; it is written again from the last checkpoint, equal to the
    uninterrupted run's."""
    root, out, flags = _copy(finished, tmp_path)
    whole = {k: v.clone() for k, v in _weights(out).items()}  # (not views of the file altered)
    _flip_bytes(out / "model.safetensors")
    capsys.readouterr()
    assert main(_argv(root, out, flags)) == 0
    said = capsys.readouterr().out
    assert "already holds" not in said
    assert "model.safetensors is corrupt" in said and f"again from checkpoint-{STEPS}" in said
    after = _weights(out)
    assert after.keys() == whole.keys()
    for name in whole:
        assert torch.equal(after[name], whole[name]), name


def test_an_altered_trainer_state_is_refused_in_one_line(finished, tmp_path):
    """The resume point is read from the newest checkpoint's trainer_state.json before the
    trainer checks the checkpoint: that file made invalid JSON (same size) is named in one
    error line, not a traceback from json."""
    root, out, flags = _copy(finished, tmp_path)
    (out / "model.safetensors").unlink()  # (not finished: the run resumes)
    _flip_bytes(out / f"checkpoint-{STEPS}" / "trainer_state.json", text=True)
    with pytest.raises(SystemExit) as e:
        main(_argv(root, out, flags))
    said = str(e.value)
    assert said.startswith("hf-megatrain: error: ") and "\n" not in said
    assert f"checkpoint-{STEPS}/trainer_state.json is corrupt" in said
    # The way on: the checkpoint before it, named.
    assert f"--resume_from_checkpoint {out / f'checkpoint-{STEPS - SAVE_STEPS}'}" in said


def test_an_altered_checkpoint_names_the_one_before_it(finished, tmp_path):
    """A weight file of the newest checkpoint altered on disk (same size: taken as complete) is
    refused when the trainer checks its sha256, in one line naming the checkpoint before it;
    resuming from that one as named trains on to the uninterrupted run's weights."""
    root, out, flags = _copy(finished, tmp_path)
    whole = {k: v.clone() for k, v in _weights(out).items()}
    (out / "model.safetensors").unlink()  # (not finished: the run resumes)
    _flip_bytes(out / f"checkpoint-{STEPS}" / "model.safetensors")
    with pytest.raises(SystemExit) as e:
        main(_argv(root, out, flags))
    said = str(e.value)
    earlier = out / f"checkpoint-{STEPS - SAVE_STEPS}"
    assert "model.safetensors is corrupt" in said and "\n" not in said
    assert f"--resume_from_checkpoint {earlier}" in said
    shutil.rmtree(out / f"checkpoint-{STEPS}")
    assert main(_argv(root, out, flags) + ["--resume_from_checkpoint", str(earlier)]) == 0
    after = _weights(out)
    for name in whole:
        assert torch.equal(after[name], whole[name]), name


def test_altered_optimizer_state_offers_the_weights(finished, tmp_path):
    """An optimizer file of the only usable checkpoint altered on disk: the refusal offered
    only a new --output_dir (found by an audit); it now offers to start a new run from the
    checkpoint's weights, which --model_path checks against the manifest in turn."""
    root, out, flags = _copy(finished, tmp_path)
    (out / "model.safetensors").unlink()  # (not finished: the run resumes)
    for n in range(SAVE_STEPS, STEPS, SAVE_STEPS):
        shutil.rmtree(out / f"checkpoint-{n}", ignore_errors=True)  # none earlier to name
    ckpt = out / f"checkpoint-{STEPS}"
    _flip_bytes(ckpt / "megatrain_optimizer" / "layer_00001.safetensors")
    with pytest.raises(SystemExit) as e:
        main(_argv(root, out, flags))
    said = str(e.value)
    assert "layer_00001.safetensors is corrupt" in said and "\n" not in said
    assert f"start a new run from its weights: --model_path {ckpt} with a new --output_dir" in said
    again = _argv(root, tmp_path / "again", flags) + ["--model_path", str(ckpt)]
    again[again.index("--config") : again.index("--config") + 2] = []  # (the checkpoint's)
    assert main(again) == 0


def test_a_rerun_clears_a_killed_publish_of_the_final_model(finished, tmp_path, capsys):
    """A kill after the final model's folders were exchanged leaves the old set in a hidden
    folder beside the output folder (hard links to checkpoints since rotated away): the next
    run clears it, also when it finds the run done and saves nothing."""
    root, out, flags = _copy(finished, tmp_path)
    leftover = tmp_path / f".{out.name}.megatrain-new-{os.getpid()}-0"
    shutil.copytree(out / f"checkpoint-{STEPS}", leftover)
    assert main(_argv(root, out, flags)) == 0
    assert "already holds" in capsys.readouterr().out
    assert not leftover.exists()


def test_a_kill_between_the_renames_of_a_publish_restores_the_old_folder(
    finished, tmp_path, capsys
):
    """Where the filesystem cannot exchange two folders in one step (NFS, Lustre, some FUSE),
    the publish renames the output folder aside, then the new one in. Killed between the two
    (found by an audit): the re-run's argument check made the output folder again, empty, so
    the recovery took it for the new set and deleted the aside copy with every checkpoint, and
    the run trained again from step 0. The folder is now made only after the recovery, and an
    empty folder never beats the aside copy: the run resumes from its last checkpoint."""
    from hf_megatrain.core import publish

    root, out, flags = _copy(finished, tmp_path)
    whole = {k: v.clone() for k, v in _weights(out).items()}
    (out / "model.safetensors").unlink()  # (not finished: the publish was still to come)
    os.rename(out, publish.aside_path(str(out)))  # killed right after the first rename
    capsys.readouterr()
    assert main(_argv(root, out, flags)) == 0
    said = capsys.readouterr().out
    assert f"finished the run from {out / f'checkpoint-{STEPS}'}" in said, said
    assert (out / f"checkpoint-{STEPS}").is_dir()
    assert not os.path.lexists(publish.aside_path(str(out)))
    after = _weights(out)
    for name in whole:
        assert torch.equal(after[name], whole[name]), name
    # The same left behind by hand with an empty output folder made since: restored as well.
    os.rename(out, publish.aside_path(str(out)))
    out.mkdir()
    assert any("restored" in line for line in publish.recover(str(out)))
    assert (out / f"checkpoint-{STEPS}").is_dir()


@pytest.mark.parametrize("how", ["automatic", "explicit"])
def test_a_checkpoint_at_max_steps_finishes_the_run(finished, tmp_path, capsys, how):
    """Resuming from a checkpoint already at --max_steps trains nothing (no checkpoint-7): the
    final model is written from its weights, as the uninterrupted run wrote it. The final
    model deleted, the "already holds this run's final model" line is not claimed."""
    root, out, flags = _copy(finished, tmp_path)
    whole = _weights(out)
    for f in out.iterdir():
        if f.is_file():
            f.unlink()
    argv = _argv(root, out, flags)
    if how == "explicit":
        argv += ["--resume_from_checkpoint", str(out / f"checkpoint-{STEPS}")]
    capsys.readouterr()
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "already holds" not in said
    assert f"checkpoint-{STEPS} is at step {STEPS} of --max_steps {STEPS}: nothing is left" in said
    assert f"finished the run from {out / f'checkpoint-{STEPS}'} (step {STEPS}" in said
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert sorted(_files(out)) == sorted(_files(finished[1]))  # the files of the whole run
    after = _weights(out)
    assert after.keys() == whole.keys()
    for name in whole:
        assert torch.equal(after[name], whole[name]), name


def test_an_extended_run_killed_before_its_final_save_writes_it_on_rerun(
    finished, tmp_path, capsys
):
    """A finished run extended with a larger --max_steps and killed after its last checkpoint
    was published but before the final model was: the folder holds the shorter run's final
    model beside checkpoint-8. The re-run must not take that model for this run's (its
    manifest records step 6): it writes the final model from checkpoint-8."""
    root, out, flags = _copy(finished, tmp_path)

    def longer(folder: Path) -> list[str]:
        argv = _argv(root, folder, flags)
        argv[argv.index("--max_steps") + 1] = str(STEPS + 2)
        return argv

    extended = tmp_path / "extended"
    shutil.copytree(out, extended)
    assert main(longer(extended)) == 0
    # The killed state: the extension's checkpoint-8 published, the final model still step 6's.
    shutil.copytree(extended / f"checkpoint-{STEPS + 2}", out / f"checkpoint-{STEPS + 2}")
    capsys.readouterr()
    assert main(longer(out)) == 0
    said = capsys.readouterr().out
    assert "already holds" not in said
    assert f"is at step {STEPS + 2} of --max_steps {STEPS + 2}: nothing is left" in said
    assert f"(the one in {out} is step {STEPS}'s)" in said
    final, want = _weights(out), _weights(out / f"checkpoint-{STEPS + 2}")
    assert final.keys() == want.keys()
    for name in want:
        assert torch.equal(final[name], want[name]), name
    capsys.readouterr()
    assert main(longer(out)) == 0  # and now it is done
    assert "already holds this run's final model (saved at step 8" in capsys.readouterr().out


# The worst eval loss counts as the best: checkpoint-2, not the last one.
_BEST_FLAGS = ["--max_eval_sequences", "4", "--eval_strategy", "steps", "--eval_steps", "2",
               "--load_best_model_at_end", "true", "--metric_for_best_model", "eval_loss",
               "--greater_is_better", "true"]  # fmt: skip


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_load_best_model_at_end_is_kept_by_a_rerun(tmp_path, capsys):
    """--load_best_model_at_end: a run killed after training (its final model not written)
    finishes on re-run with the BEST checkpoint's weights, as the uninterrupted run's final
    model; a finished run whose last checkpoint the Trainer deleted at the end (it does under
    --save_total_limit 1, keeping only the best) trains nothing when run again."""
    out = tmp_path / "run"
    argv = _argv(tmp_path, out, _BEST_FLAGS)
    assert main(argv) == 0
    best = out / "checkpoint-2"
    assert best.is_dir() and (out / f"checkpoint-{STEPS}").is_dir()
    assert _same_weights(out, best) and not _same_weights(out, out / f"checkpoint-{STEPS}")
    # Killed after training: no final model.
    for f in out.iterdir():
        if f.is_file():
            f.unlink()
    capsys.readouterr()
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert _same_weights(out, best)
    assert f"the final model is the best checkpoint, {best}" in said
    capsys.readouterr()
    assert main(argv) == 0
    assert "already holds this run's final model" in capsys.readouterr().out
    # The end of a --save_total_limit 1 run: only the best checkpoint is left.
    shutil.rmtree(out / f"checkpoint-{STEPS}")
    before = _files(out)
    capsys.readouterr()
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "already holds this run's final model" in said and "trained" not in said
    assert _files(out) == before


def test_output_dir_holding_the_working_folder(tmp_path, monkeypatch, capsys):
    """--output_dir . (a job script working in its run folder): the final save replaces the
    files in that folder rather than swapping the folder away, so the run ends normally and
    the working folder is still the run folder, with the user's files, the model and the
    checkpoints; a re-run finds them (before, the run crashed after its save and left its
    caller in a deleted folder)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    argv = _argv(tmp_path, Path("."), ["--max_eval_sequences", "4"])
    argv[argv.index("--max_steps") + 1] = "2"
    monkeypatch.chdir(run)
    assert main(argv) == 0
    assert os.path.samefile(os.getcwd(), run)
    names = set(os.listdir("."))
    assert {"notes.txt", "model.safetensors", "checkpoint-2", "megatrain_manifest.json"} <= names
    assert "Saved 1 safetensors shard(s)" in capsys.readouterr().out
    assert main(argv) == 0
    assert f"{run} already holds this run's final model" in capsys.readouterr().out


def test_resume_with_other_run_arguments_is_refused(finished, tmp_path, capsys):
    """A resume continues the run its checkpoint was trained in: another learning rate or data
    is refused with each difference named (the saved scheduler would keep the old rate, the data
    position would apply to other rows); a larger --max_steps extends the run, and another
    --seq_len trains with a note (a run may go on at a longer context)."""
    root, out, flags = _copy(finished, tmp_path)
    ckpt = out / f"checkpoint-{STEPS}"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    record = state["stateful_callbacks"]["RunShape"]["args"]
    assert record["seq_len"] == 32 and record["learning_rate"] == 3e-3
    longer = _argv(root, out, flags)
    longer[longer.index("--max_steps") + 1] = str(STEPS + 2)
    data = tmp_path / "other.txt"
    data.write_text((DATA_DIR / "corpus.txt").read_text()[:20000])
    msg = _error(longer + ["--lr", "1e-4", "--dataset_name", str(data), "--seq_len", "16"])
    assert (
        f"cannot resume from {ckpt}: it was trained with --learning_rate 0.003 (this run: 0.0001)"
    ) in msg
    assert f"--dataset_name the bundled corpus (this run: {data})" in msg
    assert "--seq_len" not in msg
    assert "Pass the checkpoint's values to continue that run, or pass a new --output_dir" in msg
    # The objective too (found by an audit: another label smoothing trained on silently).
    smoothed = _error(longer + ["--label_smoothing_factor", "0.1"])
    assert "--label_smoothing_factor 0 (this run: 0.1)" in smoothed, smoothed
    # The same data file edited in place (found by an audit: resumed silently, on other rows);
    # the same content under a new modification time resumes.
    edited = tmp_path / "edited.txt"
    text = (DATA_DIR / "corpus.txt").read_text()
    edited.write_text(text)
    other = tmp_path / "edited-run"
    assert (
        main(_argv(root, other, ["--dataset_name", str(edited), "--max_eval_sequences", "4"])) == 0
    )
    (other / "model.safetensors").unlink()  # (not finished: the run resumes)
    again = _argv(root, other, ["--dataset_name", str(edited), "--max_eval_sequences", "4"])
    again[again.index("--max_steps") + 1] = str(STEPS + 2)  # (trains on: reads rows)
    edited.write_text(text[len(text) // 2 :] + text[: len(text) // 2])  # reordered
    msg = _error(again)
    assert "its training rows differ from this run's" in msg and "\n" not in msg, msg
    edited.write_text(text)
    assert main(again) == 0
    # A checkpoint of an older version recorded only seq_len: the scheduler's rate is read.
    state["stateful_callbacks"]["RunShape"]["args"] = {"seq_len": 32}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "megatrain_manifest.json").unlink()  # (the edited file no longer matches it)
    assert "--learning_rate 0.003 (this run: 0.0001)" in _error(longer + ["--lr", "1e-4"])
    capsys.readouterr()
    assert main(longer + ["--logging_steps", "10"]) == 0  # no step of this run logged
    said = capsys.readouterr().out
    assert f"trained 2 steps (from step {STEPS})" in said
    assert "nan" not in said and "mean train loss" in said
    assert "note: that checkpoint trained on rows of" not in said


def test_resume_at_another_process_count_with_the_same_rows_per_step(finished, tmp_path, capsys):
    """Found by an audit: a 2-process checkpoint (batch 1 per process) could not be resumed by
    1 process at batch 2 (the same rows in every step, as the trainer resumes it): the batch
    was refused, and with the checkpoint's batch the process count. They may now change
    together where every step trains the same rows; a batch alone changing is still refused."""
    root, out, flags = _copy(finished, tmp_path)
    ckpt = out / f"checkpoint-{STEPS}"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    record = state["stateful_callbacks"]["RunShape"]["args"]
    assert record["per_device_train_batch_size"] == 2 and record["world_size"] == 1
    record.update(world_size=2, per_device_train_batch_size=1)  # as 2 processes saved it
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "megatrain_manifest.json").unlink()  # (the edited file no longer matches it)
    longer = _argv(root, out, flags)
    longer[longer.index("--max_steps") + 1] = str(STEPS + 2)
    capsys.readouterr()
    assert main(longer) == 0
    assert f"trained 2 steps (from step {STEPS})" in capsys.readouterr().out
    # The same checkpoint, its process count as this run's: the batch alone changed.
    record.update(world_size=1)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (out / "model.safetensors").unlink()
    shutil.rmtree(out / f"checkpoint-{STEPS + 2}", ignore_errors=True)
    msg = _error(_argv(root, out, flags) + ["--resume_from_checkpoint", str(ckpt)])
    assert "--per_device_train_batch_size 1 (this run: 2)" in msg, msg


def test_resume_at_another_seq_len_trains_and_says_what_changes(finished, tmp_path, capsys):
    root, out, flags = _copy(finished, tmp_path)
    argv = _argv(root, out, flags)
    argv[argv.index("--max_steps") + 1] = str(STEPS + 1)
    argv[argv.index("--seq_len") + 1] = "16"
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert (
        "note: that checkpoint trained on rows of 32 tokens and this run uses --seq_len 16" in said
    )
    assert f"trained 1 step (from step {STEPS})" in said


def _error(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert isinstance(e.value.code, str), e.value.code
    assert e.value.code.startswith("hf-megatrain: error:") and "\n" not in e.value.code
    return e.value.code


@pytest.mark.parametrize("lost", ["megatrain_optimizer/layer_00001.safetensors", "scheduler.pt"])
def test_incomplete_checkpoints_are_skipped_or_refused(finished, tmp_path, capsys, lost):
    """A checkpoint missing a file, and an empty checkpoint folder: automatic resume picks the
    newest complete one and names those it skipped; naming the incomplete one is refused in one
    line that names the file and the flag allowing a resume without optimizer state."""
    root, out, flags = _copy(finished, tmp_path)
    (out / f"checkpoint-{STEPS}" / lost).unlink()
    (out / "checkpoint-99").mkdir()
    argv = _argv(root, out, flags)
    msg = _error(argv + ["--resume_from_checkpoint", str(out / f"checkpoint-{STEPS}")])
    assert f"checkpoint-{STEPS}: {lost} is missing; pass --resume-without-optimizer-state" in msg
    assert "empty folder; resume from a complete checkpoint" in _error(
        argv + ["--resume_from_checkpoint", str(out / "checkpoint-99")]
    )
    capsys.readouterr()
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert (
        f"skipped incomplete checkpoint-99 (empty folder), checkpoint-{STEPS} ({lost} is "
        f"missing); resuming from {out / 'checkpoint-4'}"
    ) in said
    assert "trained 2 steps (from step 4)" in said
    assert (out / f"checkpoint-{STEPS}" / lost).is_file()  # written again, complete


def test_only_incomplete_checkpoints_are_refused(finished, tmp_path, capsys):
    root, out, flags = _copy(finished, tmp_path)
    for ckpt in out.glob("checkpoint-*"):
        (ckpt / "scheduler.pt").unlink()
    msg = _error(_argv(root, out, flags))
    assert f"{out} holds no complete checkpoint: checkpoint-6 (scheduler.pt is missing)" in msg
    assert "pass --resume-without-optimizer-state to resume from checkpoint-6 anyway" in msg
    # With the flag: the resume line names what it takes (found by an audit: it said
    # "optimizer, scheduler" whatever was missing).
    shutil.rmtree(out / "checkpoint-6")
    (out / "model.safetensors").unlink()
    capsys.readouterr()
    assert main(_argv(root, out, flags) + ["--resume-without-optimizer-state"]) == 0
    said = capsys.readouterr().out
    assert f"{out / 'checkpoint-4'} (its weights, optimizer, data position, RNG)" in said


def test_a_resume_from_an_older_checkpoint_moves_the_later_saves_aside(finished, tmp_path, capsys):
    """Resumed by hand from checkpoint-4 of a finished run (checkpoints 4 and 6, the final model
    of step 6) and killed in step 5: the command run again without --resume_from_checkpoint (as
    a requeued job runs it) must go on from checkpoint-4. It took the earlier run's checkpoint-6
    and called the run finished (found by an audit), as the stock Trainer's newest-checkpoint
    resume does. The later saves are moved, not deleted, into a folder that is itself an
    output_dir."""
    root, out, flags = _copy(finished, tmp_path)
    earlier = _weights(out)
    argv = _argv(root, out, flags)
    env = dict(os.environ, KILL_AT=str(KILL_AT), PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-c", _KILLED_CHILD, *argv, "--resume_from_checkpoint",
         str(out / "checkpoint-4")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == -9, r.stderr[-2000:]
    said = r.stdout + r.stderr
    assert "saves past that step (checkpoint-6, the final model of step 6)" in said
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]
    assert not (out / "model.safetensors").exists()
    aside = out / "_superseded-after-step-4"
    assert sorted(p.name for p in aside.glob("checkpoint-*")) == ["checkpoint-6"]
    moved = _weights(aside)
    assert moved.keys() == earlier.keys()
    assert all(torch.equal(moved[k], earlier[k]) for k in moved)

    capsys.readouterr()
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert f"resuming from {out / 'checkpoint-4'}" in said
    assert "trained 2 steps (from step 4)" in said
    # The moved folder goes on as an output_dir of its own (its checkpoint-6, 2 steps more).
    longer = _argv(root, aside, flags)
    longer[longer.index("--max_steps") + 1] = str(STEPS + 2)
    capsys.readouterr()
    assert main(longer) == 0
    assert f"trained 2 steps (from step {STEPS})" in capsys.readouterr().out


_TERMINATED_CHILD = _KILLED_CHILD.replace("signal.SIGKILL", "signal.SIGTERM").replace(
    "\nmain(sys.argv[1:])", "\nsys.exit(main(sys.argv[1:]))"
)


def test_sigterm_saves_a_checkpoint_and_the_rerun_resumes_bit_exactly(tmp_path, capsys):
    """A SIGTERM (a scheduler preempting the job) during step 2 makes the run save
    checkpoint-3 at the end of step 3, off the --save_steps grid, and exit with status 143
    (not 0: the job is not done) without writing the final model; the same command then
    resumes from it, bit-exactly as an uninterrupted run."""
    flags = _chat_flags(tmp_path)
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert main(_argv(tmp_path, whole, flags)) == 0
    env = dict(os.environ, KILL_AT="2", PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-c", _TERMINATED_CHILD, *_argv(tmp_path, stopped, flags)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 143, r.stderr[-2000:]
    assert f"stopped by SIGTERM after step 3 of this run; saved {stopped / 'checkpoint-3'}" in (
        r.stdout
    )
    assert sorted(p.name for p in stopped.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert not (stopped / "model.safetensors").exists()
    capsys.readouterr()
    assert main(_argv(tmp_path, stopped, flags)) == 0  # the same command, re-run
    said = capsys.readouterr().out
    assert f"resuming from {stopped / 'checkpoint-3'}" in said
    assert "trained 3 steps (from step 3)" in said
    a, b = _weights(whole), _weights(stopped)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_sigterm_after_training_still_saves_the_final_model(tmp_path):
    """A SIGTERM that arrives once training is done (during the final eval or save) lets the
    final model be saved, skips the reload check and exits 0: the run is complete."""
    child = _TERMINATED_CHILD.replace(
        "def on_step_end(self, args, state, control, **kw):\n        if state.global_step == "
        'int(os.environ["KILL_AT"]):',
        "def on_train_end(self, args, state, control, **kw):\n        if True:",
    )
    assert "on_train_end" in child
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-c", child, *_argv(tmp_path, out, _chat_flags(tmp_path))],
        env=dict(os.environ, KILL_AT="0", PYTHONPATH=str(REPO)),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "SIGTERM: training is done; saving the final model" in r.stderr
    assert "the final model is saved; the reload check is skipped" in r.stdout
    assert (out / "megatrain_manifest.json").is_file()
    assert _weights(out)  # the final model, loadable


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])
def test_save_on_sigterm_in_a_script(tmp_path, signame):
    """The callback alone, as a script uses it with HFMegaTrainer: a SIGTERM (or SIGUSR1, what
    SLURM sends ahead of a time limit) during step 2 ends training at that step's end with
    checkpoint-2 saved (save_strategy 'no' notwithstanding); the previous handlers are back
    afterwards."""
    import signal

    from transformers import TrainerCallback

    from hf_megatrain import HFMegaTrainer, MegaTrainArguments, SaveOnSigterm

    from .helpers import common_args, make_data, tiny_config, tiny_model

    class TermInStep2(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1:  # (the step being run is the second)
                os.kill(os.getpid(), getattr(signal, signame))

    before = {name: signal.getsignal(getattr(signal, name)) for name in ("SIGTERM", "SIGUSR1")}
    stop = SaveOnSigterm()
    args = MegaTrainArguments(
        output_dir=str(tmp_path / "run"), **common_args(max_steps=6, save_strategy="no")
    )
    trainer = HFMegaTrainer(
        model=tiny_model(tiny_config("llama")), args=args, train_dataset=make_data(),
        callbacks=[stop, TermInStep2()],
    )  # fmt: skip
    trainer.train()
    assert stop.stopped_at == trainer.state.global_step == 2
    assert stop.received == getattr(signal, signame)
    assert (tmp_path / "run" / "checkpoint-2" / "trainer_state.json").is_file()
    for name, handler in before.items():
        assert signal.getsignal(getattr(signal, name)) is handler, name


def test_sigterm_during_evaluation_saves_the_finished_step_at_once(tmp_path):
    """A SIGTERM during the evaluation after step 2 (a scheduler's grace period is often ~30 s)
    stops the evaluation at its next batch and saves checkpoint-2 at once: no more evaluation
    batches and no step 3 (found by an audit: the whole evaluation ran, then another step)."""
    import signal

    from transformers import TrainerCallback

    from hf_megatrain import HFMegaTrainer, MegaTrainArguments, SaveOnSigterm

    from .helpers import common_args, make_data, tiny_config, tiny_model

    class TermInEvaluation(TrainerCallback):
        batches = 0

        def on_prediction_step(self, args, state, control, **kw):
            self.batches += 1
            if self.batches == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    stop, term = SaveOnSigterm(), TermInEvaluation()
    args = MegaTrainArguments(
        output_dir=str(tmp_path / "run"),
        **common_args(
            max_steps=6, save_strategy="no", eval_strategy="steps", eval_steps=2,
            per_device_eval_batch_size=1,
        ),
    )  # fmt: skip
    trainer = HFMegaTrainer(
        model=tiny_model(tiny_config("llama")), args=args, train_dataset=make_data(),
        eval_dataset=make_data(8, seed=3), callbacks=[stop, term],
    )  # fmt: skip
    trainer.train()
    assert term.batches == 1  # of the 8 the evaluation has
    assert stop.stopped_at == trainer.state.global_step == 2
    saved = json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["global_step"] == 2
    assert not list((tmp_path / "run").glob("checkpoint-3"))


_TERM_IN_EVALUATION_CHILD = (
    _KILLED_CHILD.replace(
        "def on_step_end(self, args, state, control, **kw):",
        "def on_prediction_step(self, args, state, control, **kw):",
    )
    .replace(
        "os.kill(os.getpid(), signal.SIGKILL)",
        "self.__class__.on_prediction_step = lambda *a, **k: None; os.kill(os.getpid(), signal.SIGTERM)",
    )
    .replace("\nmain(sys.argv[1:])", "\nsys.exit(main(sys.argv[1:]))")
)
assert (
    "on_prediction_step" in _TERM_IN_EVALUATION_CHILD and "SIGKILL" not in _TERM_IN_EVALUATION_CHILD
)


def test_a_sigterm_in_the_last_evaluation_is_finished_by_the_rerun(tmp_path, capsys, caplog):
    """SIGTERM in the evaluation after the last step, under --load_best_model_at_end (the worst
    loss counts as best): checkpoint-6 is saved with that evaluation owed, and the re-run, which
    has nothing left to train, runs it before it picks the best checkpoint: the final model is
    the uninterrupted run's (found by an audit: it took checkpoint-2's weights, another best)."""
    flags = [*_BEST_FLAGS, "--per_device_eval_batch_size", "1"]
    whole, out = tmp_path / "whole", tmp_path / "run"
    assert main(_argv(tmp_path, whole, flags)) == 0
    env = dict(os.environ, KILL_AT=str(STEPS), PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-c", _TERM_IN_EVALUATION_CHILD, *_argv(tmp_path, out, flags)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 143, r.stderr[-2000:]
    assert "the evaluation is stopped; saving checkpoint-6" in r.stderr
    assert not (out / "model.safetensors").exists()
    capsys.readouterr()
    assert main(_argv(tmp_path, out, flags)) == 0
    assert "nothing is left to train" in capsys.readouterr().out
    assert "running that evaluation now" in caplog.text  # (the log's stream may be another)
    assert _same_weights(whole, out)


class _Saves(TrainerCallback):
    """Checkpoint saves, by step."""

    def __init__(self):
        self.steps = []

    def on_save(self, args, state, control, **kw):
        self.steps.append(state.global_step)


def test_an_evaluation_a_sigterm_stopped_is_run_on_resume(tmp_path):
    """SIGTERM in step 2's evaluation: checkpoint-2 is saved once (found by an audit: twice, the
    Trainer's end-of-epoch call evaluated and saved again), and the resume runs that evaluation
    first, so that the logged evaluations, the best checkpoint (the worst loss counts as best:
    every evaluation decides), a reduce_lr_on_plateau schedule and the final weights are the
    uninterrupted run's (found by an audit: the evaluation was never run, and another
    checkpoint was called best)."""
    import signal

    from transformers import TrainerCallback

    from hf_megatrain import HFMegaTrainer, MegaTrainArguments, SaveOnSigterm

    from .helpers import common_args, make_data, mega_params, tiny_config, tiny_model

    class TermInEvaluation(TrainerCallback):
        def on_prediction_step(self, args, state, control, **kw):
            if state.global_step == 2 and not getattr(self, "sent", False):
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)

    def trainer(name: str, *callbacks):
        args = MegaTrainArguments(
            output_dir=str(tmp_path / name),
            **common_args(
                max_steps=6, save_strategy="steps", save_steps=2, eval_strategy="steps",
                eval_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                greater_is_better=True, per_device_eval_batch_size=4, warmup_steps=0,
                lr_scheduler_type="reduce_lr_on_plateau",
                lr_scheduler_kwargs={"patience": 0, "factor": 0.5},
            ),
        )  # fmt: skip
        return HFMegaTrainer(
            model=tiny_model(tiny_config("llama")), args=args, train_dataset=make_data(),
            eval_dataset=make_data(8, seed=3), callbacks=[SaveOnSigterm(), *callbacks],
        )  # fmt: skip

    def evaluations(t) -> list[tuple[int, float]]:
        return [(h["step"], h["eval_loss"]) for h in t.state.log_history if "eval_loss" in h]

    whole = trainer("whole")
    whole.train()
    saves = _Saves()
    stopped = trainer("run", TermInEvaluation(), saves)
    stopped.train()
    assert saves.steps == [2]
    resumed = trainer("run")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert evaluations(resumed) == evaluations(whole)
    assert [s for s, _ in evaluations(whole)] == [2, 4, 6]
    # The evaluation's loss steps the plateau schedule (measured: without the owed evaluation
    # the resumed run kept 1e-2 where the uninterrupted run halved it after step 4).
    rates = [h["learning_rate"] for h in resumed.state.log_history if "learning_rate" in h]
    assert rates == [h["learning_rate"] for h in whole.state.log_history if "learning_rate" in h]
    assert min(rates) < max(rates)
    best = os.path.basename(resumed.state.best_model_checkpoint)
    assert best == os.path.basename(whole.state.best_model_checkpoint)
    a, b = mega_params(whole), mega_params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same best weights loaded at the end


@pytest.mark.parametrize("at", [2, 8], ids=["mid-epoch", "epoch-end"])
def test_a_sigterm_in_a_step_under_epoch_evaluation(tmp_path, at):
    """eval_strategy="epoch", a SIGTERM during step 2 (mid-epoch) or step 8 (the epoch's last):
    one save (found by an audit: the Trainer's call after the epoch loop breaks evaluated,
    which stopped at once, and saved again, recording an evaluation the uninterrupted run never
    runs). At the epoch's end that evaluation is the uninterrupted run's and stays owed. Either
    way the resumed run's evaluations, learning rates and weights equal the uninterrupted run's
    (16 rows at batch 2: 8 steps an epoch, 2 epochs)."""
    import signal

    from hf_megatrain import HFMegaTrainer, MegaTrainArguments, SaveOnSigterm
    from hf_megatrain.hf.preemption import evaluation_owed

    from .helpers import common_args, make_data, mega_params, tiny_config, tiny_model

    class TermInStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == at - 1 and not hasattr(self, "sent"):
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)

    def trainer(name: str, *callbacks):
        args = MegaTrainArguments(
            output_dir=str(tmp_path / name),
            **common_args(
                max_steps=16, save_strategy="epoch", eval_strategy="epoch", warmup_steps=0,
                load_best_model_at_end=True, metric_for_best_model="eval_loss",
                per_device_eval_batch_size=4, lr_scheduler_type="reduce_lr_on_plateau",
                lr_scheduler_kwargs={"patience": 0, "factor": 0.5},
            ),
        )  # fmt: skip
        return HFMegaTrainer(
            model=tiny_model(tiny_config("llama")), args=args, train_dataset=make_data(16),
            eval_dataset=make_data(8, seed=3), callbacks=[SaveOnSigterm(), *callbacks],
        )  # fmt: skip

    def logged(t, key: str) -> list:
        return [(h["step"], h[key]) for h in t.state.log_history if key in h]

    whole = trainer("whole")
    whole.train()
    saves = _Saves()
    trainer("run", TermInStep(), saves).train()
    assert saves.steps == [at]
    checkpoint = str(tmp_path / "run" / f"checkpoint-{at}")
    assert evaluation_owed(checkpoint) == (at == 8)
    resumed = trainer("run")
    resumed.train(resume_from_checkpoint=checkpoint)
    assert logged(resumed, "eval_loss") == logged(whole, "eval_loss")
    assert logged(resumed, "learning_rate") == logged(whole, "learning_rate")
    a, b = mega_params(whole), mega_params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
