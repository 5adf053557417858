"""Atomic publication and manifests (issue 23): a reader sees the old set or the new set, and a
missing, truncated or corrupt file is an error naming it, on resume and in ``hf-megatrain verify``."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from hf_megatrain.cli import main as cli_main
from hf_megatrain.core import publish as pub
from hf_megatrain.core.publish import MANIFEST_NAME, IntegrityError

from .helpers import mega_params, mounted_tmpfs, run_trainer, tiny_config, tiny_model


def _write(folder, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        p = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)


def _read(folder) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(root, n)
            out[os.path.relpath(p, folder)] = open(p, "rb").read()
    return out


OLD = {"a.bin": b"old-a", "sub/b.bin": b"old-b", "model-00001-of-00002.safetensors": b"o"}
NEW = {"a.bin": b"new-a" * 10, "sub/b.bin": b"new-b"}


def _save(target, files, keep=None):
    with pub.staged_folder(str(target), keep=keep) as tmp:
        _write(tmp, files)


def _sets(target) -> dict[str, bytes]:
    return {k: v for k, v in _read(target).items() if k != MANIFEST_NAME}


def test_swap_publishes_whole_folder_with_manifest(tmp_path):
    target = tmp_path / "out"
    _save(target, OLD)
    assert _sets(target) == OLD
    _save(target, NEW)
    assert _sets(target) == NEW  # the old shard name is gone: no keep
    manifest = json.loads((target / MANIFEST_NAME).read_text())
    assert sorted(manifest["files"]) == ["a.bin", "sub/b.bin"]
    assert manifest["files"]["a.bin"]["size"] == 50
    assert pub.verify_folder(str(target)).files == 2
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temp or aside folder left


def test_keep_carries_other_entries(tmp_path):
    target = tmp_path / "out"
    _save(target, {**OLD, "checkpoint-2/x": b"ck", "README.md": b"mine"})
    from hf_megatrain.hf.checkpoint import keep_beside_model

    _save(target, NEW, keep=keep_beside_model)
    got = _sets(target)
    assert got == {**NEW, "checkpoint-2/x": b"ck", "README.md": b"mine"}  # stale shard dropped
    assert pub.verify_folder(str(target)).unlisted == 2


def test_symlinked_target_is_published_where_it_points(tmp_path):
    """An output folder given as a symbolic link (to a bigger disk): the model lands in the
    link's target, the link stays a link, and checkpoints beside the model stay there too."""
    from hf_megatrain.hf.checkpoint import keep_beside_model

    real = tmp_path / "disk" / "target"
    _save(real, {**OLD, "checkpoint-2/x": b"ck"})
    (tmp_path / "links").mkdir()
    link = tmp_path / "links" / "out"
    link.symlink_to(real, target_is_directory=True)
    _save(link, NEW, keep=keep_beside_model)
    assert link.is_symlink() and os.path.realpath(link) == str(real)
    assert _sets(real) == {**NEW, "checkpoint-2/x": b"ck"}
    assert os.listdir(tmp_path / "links") == ["out"]  # nothing hidden left beside the link
    assert sorted(os.listdir(tmp_path / "disk")) == ["target"]


@pytest.fixture
def mount_point(tmp_path):
    """A tmpfs mounted at a folder (a container volume as an output dir)."""
    with mounted_tmpfs(tmp_path / "volume", "16M") as point:
        yield point


def test_mount_point_target_keeps_its_checkpoints(mount_point):
    """An output folder that is a mount point cannot be renamed and a folder beside it is on
    another disk: the new set is built inside it, its files move in, and the checkpoints beside
    the model are neither copied off the volume nor deleted."""
    from hf_megatrain.hf.checkpoint import keep_beside_model

    _save(mount_point, {**OLD, "checkpoint-2/x": b"ck", "checkpoint-4/y": b"ck4"})
    inode = os.stat(mount_point / "checkpoint-2" / "x").st_ino
    _save(mount_point, NEW, keep=keep_beside_model)
    assert _sets(mount_point) == {**NEW, "checkpoint-2/x": b"ck", "checkpoint-4/y": b"ck4"}
    assert os.stat(mount_point / "checkpoint-2" / "x").st_ino == inode  # left in place
    assert pub.verify_folder(str(mount_point)).files == 2
    assert not [n for n in os.listdir(mount_point) if n.startswith(".")]
    assert sorted(os.listdir(mount_point.parent)) == ["volume"]  # nothing built beside it


@pytest.fixture
def unwritable_parent(tmp_path):
    """A folder ``parent/out`` that is writable while ``parent`` is not (a cluster's
    /scratch/USER under a /scratch users cannot write): as root ``chattr +i`` on the parent
    (root ignores modes), else mode 0555; skipped where neither applies."""
    import subprocess

    parent = tmp_path / "parent"
    (parent / "out").mkdir(parents=True)
    root = os.geteuid() == 0
    if root:
        try:
            done = subprocess.run(["chattr", "+i", str(parent)], capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            pytest.skip("cannot run chattr here")
        if done.returncode != 0:
            pytest.skip(f"chattr +i failed: {done.stderr.decode(errors='replace').strip()}")
    else:
        parent.chmod(0o555)
    try:
        yield parent / "out"
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(parent)], capture_output=True, timeout=30)
        else:
            parent.chmod(0o755)


def test_target_with_unwritable_parent_is_built_inside(unwritable_parent, caplog):
    """No folder can be made beside the target: the new set is built inside it and its files
    moved in (as for a mount point), kept entries left in place, and a warning says the save
    is not atomic. Before, every save into such an output folder failed."""
    from hf_megatrain.hf.checkpoint import keep_beside_model

    target = unwritable_parent
    _write(target, {"checkpoint-2/x": b"ck", "notes.txt": b"mine"})
    with caplog.at_level("WARNING", logger="hf_megatrain"):
        _save(target, OLD, keep=keep_beside_model)
        _save(target, NEW, keep=keep_beside_model)
    assert _sets(target) == {**NEW, "checkpoint-2/x": b"ck", "notes.txt": b"mine"}
    assert pub.verify_folder(str(target)).files == 2
    assert not [n for n in os.listdir(target) if n.startswith(".")]
    assert "is not writable" in caplog.text and "not atomic" in caplog.text


def test_target_holding_the_working_folder_keeps_it(tmp_path, monkeypatch):
    """A target that is (or holds) the process's working folder: its files are replaced in
    place, so the working folder is still the target afterwards, not a deleted old copy
    (a swap would move the folder itself away)."""
    target = tmp_path / "out"
    _save(target, OLD)
    (target / "runs" / "deeper").mkdir(parents=True)
    for cwd in (target, target / "runs" / "deeper"):
        monkeypatch.chdir(cwd)
        inode = os.stat(target).st_ino
        _save(target, NEW, keep=lambda name: name == "runs")
        assert os.stat(target).st_ino == inode  # the same folder
        assert os.path.samefile(os.getcwd(), cwd) and os.listdir(".") is not None
        assert _sets(target)["a.bin"] == NEW["a.bin"]
        assert pub.verify_folder(str(target)).manifest
    # A checkpoint published over one that holds the working folder (the trainer's publish).
    staged = tmp_path / "staged"
    _write(staged, NEW)
    monkeypatch.chdir(target)
    pub.publish(str(staged), str(target))
    assert os.path.samefile(os.getcwd(), target) and _read(target) == NEW


def test_ctrl_c_while_files_move_in_finishes_the_set(tmp_path, monkeypatch):
    """Ctrl-C while a set built inside its target (a mount point, the working folder) moves in
    one file at a time: the moves finish and then the interrupt is raised. Before, it stopped
    after the first file and the staging with the rest was deleted: a mixed set without a
    manifest that from_pretrained loaded (found by an audit on a tmpfs output folder)."""
    import signal

    target = tmp_path / "out"
    _save(target, OLD)
    monkeypatch.chdir(target)  # (built inside: files moved in one by one)
    real = os.replace
    sent = []

    def replace(src, dst):
        if not sent and os.path.dirname(dst) == str(target):  # (the first file moved in)
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, delivered at the next bytecode
        return real(src, dst)

    monkeypatch.setattr(pub.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        _save(target, NEW)
    assert sent and _sets(target) == NEW
    assert pub.verify_folder(str(target)).manifest
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("exchange", [True, False])
@pytest.mark.parametrize("fail_at", range(6))
def test_interrupted_swap_leaves_old_or_new(tmp_path, monkeypatch, exchange, fail_at):
    """An exception standing in for a kill at each rename/removal of a swap: what a reader
    finds (after recovery) is exactly the old or exactly the new set."""
    target = tmp_path / "out"
    _save(target, OLD)
    if not exchange:
        monkeypatch.setattr(pub, "exchange_paths", lambda a, b: False)
    calls = {"n": 0}

    class Killed(BaseException):
        pass

    def hook(real):
        def f(*a, **k):
            calls["n"] += 1
            if calls["n"] == fail_at + 1:
                raise Killed
            return real(*a, **k)

        return f

    for name in ("rename", "replace"):
        monkeypatch.setattr(pub.os, name, hook(getattr(os, name)))
    monkeypatch.setattr(pub.shutil, "rmtree", hook(shutil.rmtree))
    monkeypatch.setattr(pub, "exchange_paths", hook(pub.exchange_paths))
    # A kill skips the cleanup of the except clause: run the steps without it.
    monkeypatch.setattr(pub, "recover", lambda t: [])
    temp = pub.new_temp_path(str(target))
    os.makedirs(temp)
    _write(temp, NEW)
    try:
        pub.write_manifest(temp)
        pub.publish(temp, str(target))
    except Killed:
        pass
    monkeypatch.undo()
    pub.recover(str(target))
    got = _sets(target)
    assert got in (OLD, NEW)
    pub.verify_folder(str(target))
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_recover_restores_aside_copy(tmp_path):
    target = tmp_path / "out"
    _save(target, OLD)
    os.rename(target, pub.aside_path(str(target)))
    os.makedirs(pub.new_temp_path(str(target)))
    assert any("restored" in line for line in pub.recover(str(target)))
    assert _sets(target) == OLD and sorted(os.listdir(tmp_path)) == ["out"]


def test_failed_write_keeps_old_set(tmp_path):
    """A full disk: the old set stays, the partial copy goes, and the error says so in the
    library's words (ENOSPC kept for callers that read errno)."""
    target = tmp_path / "out"
    _save(target, OLD)
    with pytest.raises(pub.DiskFullError, match="ran out of space.*partial copy was removed") as e:
        with pub.staged_folder(str(target)) as tmp:
            _write(tmp, {"a.bin": b"partial"})
            raise OSError(28, "No space left on device")
    assert e.value.errno == 28 and str(target) in str(e.value)
    assert _sets(target) == OLD and sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("free_mib, full", [(1, True), (10_000, False)])
def test_a_writer_that_does_not_say_why_is_judged_by_the_free_space(
    tmp_path, monkeypatch, free_mib, full
):
    """torch.save's writer says only "file write failed": with the disk (nearly) full that is
    a full disk; with room left the writer's own error is raised as it is."""
    target = tmp_path / "out"
    _save(target, OLD)
    monkeypatch.setattr(pub, "free_disk_bytes", lambda path: free_mib << 20)
    error = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    with pytest.raises(pub.DiskFullError if full else RuntimeError) as e:
        with pub.staged_folder(str(target)) as tmp:
            _write(tmp, {"a.bin": b"partial"})
            raise error
    assert (e.value is error) != full
    assert _sets(target) == OLD and sorted(os.listdir(tmp_path)) == ["out"]


# ---- trainer checkpoints and saved models -------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("integrity")
    model = tiny_model(tiny_config("llama"))
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
    _, full = run_trainer(copy.deepcopy(model), tmp, "full", True, **kw)
    full.save_model(str(tmp / "saved"))
    return model, tmp, kw, mega_params(full)


def test_checkpoint_has_manifest_and_final_trainer_state(trained):
    _, tmp, _, _ = trained
    ckpt = tmp / "full" / "checkpoint-4"
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    assert "trainer_state.json" in manifest["files"]
    assert "megatrain_optimizer/meta.json" in manifest["files"]
    assert "scheduler.pt" in manifest["files"]
    assert pub.verify_folder(str(ckpt)).files == len(manifest["files"])
    assert ".megatrain-staging" not in (ckpt / "trainer_state.json").read_text()
    assert not (tmp / "full" / ".megatrain-staging").exists()


def test_saved_model_is_one_set_with_tokenizer_args_and_manifest(trained):
    _, tmp, _, params = trained
    saved = tmp / "saved"
    manifest = json.loads((saved / MANIFEST_NAME).read_text())
    assert "training_args.bin" in manifest["files"] and "config.json" in manifest["files"]
    weights = load_file(str(saved / "model.safetensors"))
    for k, v in params.items():
        if k in weights:
            torch.testing.assert_close(weights[k], v, rtol=0, atol=0)
    assert cli_main(["verify", str(saved)]) == 0


def _copy_ckpt(tmp, name):
    dst = tmp / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(tmp / "full" / "checkpoint-2", dst)
    return dst


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "corrupt": (_flip_byte, IntegrityError, "corrupt"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-7]), IntegrityError, "truncated"),
    "missing": (os.remove, FileNotFoundError, "missing"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("rel", ["model.safetensors", "megatrain_optimizer/layer_00001.safetensors",
                                 "trainer_state.json"])  # fmt: skip
def test_damaged_checkpoint_is_refused_naming_the_file(trained, damage, rel, capsys):
    model, tmp, kw, _ = trained
    ckpt = _copy_ckpt(tmp, f"bad-{damage}-{rel.replace('/', '_')}")
    fn, exc, word = DAMAGE[damage]
    fn(ckpt / rel)
    with pytest.raises(exc, match=rf"{rel}.*{word}|{rel} is {word}"):
        run_trainer(copy.deepcopy(model), tmp, "refused", True, resume=str(ckpt), **kw)
    with pytest.raises(SystemExit) as e:
        cli_main(["verify", str(ckpt)])
    msg = str(e.value)
    assert msg.startswith("hf-megatrain: error: ") and rel in msg and word in msg
    assert "\n" not in msg


def test_missing_optimizer_file_allowed_by_option(trained):
    model, tmp, kw, _ = trained
    ckpt = _copy_ckpt(tmp, "no-opt-layer")
    os.remove(ckpt / "megatrain_optimizer" / "layer_00001.safetensors")
    with pytest.raises(FileNotFoundError, match="cannot resume from .*layer_00001.* missing"):
        run_trainer(copy.deepcopy(model), tmp, "refused2", True, resume=str(ckpt), **kw)
    logs, trainer = run_trainer(
        copy.deepcopy(model), tmp, "allowed", True, resume=str(ckpt),
        megatrain_resume_without_optimizer_state=True, **kw,
    )  # fmt: skip
    assert trainer.state.global_step == 4 and len(logs) == 2


def test_folder_without_manifest_loads_with_warning(trained, caplog, capsys):
    model, tmp, kw, params = trained
    ckpt = _copy_ckpt(tmp, "no-manifest")
    os.remove(ckpt / MANIFEST_NAME)
    with caplog.at_level("WARNING", logger="hf_megatrain"):
        _, resumed = run_trainer(copy.deepcopy(model), tmp, "resumed", True, resume=str(ckpt), **kw)
    assert "no megatrain_manifest.json" in caplog.text
    got = mega_params(resumed)
    for k, v in params.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    capsys.readouterr()
    assert cli_main(["verify", str(ckpt)]) == 2
    assert "no manifest" in capsys.readouterr().out


def test_verify_ok_line(trained, capsys):
    _, tmp, _, _ = trained
    assert cli_main(["verify", str(tmp / "full" / "checkpoint-4")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("hf-megatrain: OK ") and "verified" in out[0]


def test_verify_missing_path(tmp_path):
    with pytest.raises(SystemExit, match="hf-megatrain: error: .*not a folder"):
        cli_main(["verify", str(tmp_path / "nope")])


@pytest.mark.parametrize("rel", ["megatrain_optimizer/layer_00001.safetensors",
                                 "megatrain_optimizer/resident.safetensors"])  # fmt: skip
def test_unverified_truncated_optimizer_file_is_named(trained, rel):
    """A checkpoint without a manifest (an older version's) whose optimizer file is truncated
    or missing: the CLI's completeness check finds it (a resume then skips that checkpoint, as
    for a missing file), and loading it is refused naming the file, not with safetensors' own
    error."""
    from hf_megatrain.cli_resume import checkpoint_problem

    model, tmp, kw, _ = trained
    for how, cut in (
        ("truncated", lambda p: p.write_bytes(p.read_bytes()[:-9])),
        ("missing", os.remove),
    ):
        ckpt = _copy_ckpt(tmp, f"no-manifest-{how}-{rel.replace('/', '_')}")
        os.remove(ckpt / MANIFEST_NAME)
        cut(ckpt / rel)
        problem = checkpoint_problem(str(ckpt))
        if how == "truncated" or rel.endswith("resident.safetensors"):
            # (Which layers have a file is not recorded: a frozen layer has none.)
            assert problem is not None and problem.state_only, how
            assert problem.reason.startswith(f"{rel} is {how}"), problem.reason
        with pytest.raises(
            (ValueError, FileNotFoundError), match=f"hf_megatrain: .*{rel} is {how}"
        ):
            run_trainer(copy.deepcopy(model), tmp, "refused3", True, resume=str(ckpt), **kw)


def test_completeness_check_says_truncated_or_altered(trained):
    """The CLI's completeness check (a size against the manifest) says "truncated" only for a
    file shorter than the manifest lists (a kill or a full disk cut it off) and "altered" for
    one edited after the save, with both sizes."""
    from hf_megatrain.cli_resume import checkpoint_problem

    _, tmp, _, _ = trained
    rel = "trainer_state.json"
    for how, change in (
        ("truncated", lambda p: p.write_bytes(p.read_bytes()[:-5])),
        ("altered", lambda p: p.write_bytes(p.read_bytes() + b"\n\n\n")),
    ):
        ckpt = _copy_ckpt(tmp, f"size-{how}")
        want = (ckpt / rel).stat().st_size
        change(ckpt / rel)
        have = (ckpt / rel).stat().st_size
        problem = checkpoint_problem(str(ckpt))
        assert problem is not None and not problem.state_only
        assert problem.reason == f"{rel} is {how}: {have} bytes, the manifest says {want}"
