"""Fault injection (issue 23): SIGKILL at seeded random points and a full disk (injected ENOSPC).

Every case ends in a resume bit-equal to the uninterrupted run, or a clear error; never a
silently wrong model. Killed runs are forked children of one server process (``python -m
tests.test_faults serve``) that imported torch and transformers once, so a trial costs well under
a second. Each child kills itself with SIGKILL at the chosen event, a seeded random pick among:

- ``step``: before one layer's AdamW update (mid optimizer step, some layers updated);
- ``ckpt``: during a checkpoint save (after a file is written, at each fsync, before publishing);
- ``final``: during ``save_model`` over an existing saved model (same events);
- ``published``: right after a checkpoint or the final model was published.

The counts (trials, cases, failures) are printed at the end of the module (``pytest -s``).
"""

from __future__ import annotations

import collections
import copy
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from hf_megatrain.core import publish as pub

from .helpers import mega_params, run_trainer, tiny_config, tiny_model

STEPS, SAVE_STEPS = 6, 2
KINDS = ("step", "ckpt", "final", "published")
SEEDS = (0, 1, 2)
TALLY = {"trials": 0, "cases": 0, "failures": 0, "outcomes": collections.Counter()}


# ---- the child's side ---------------------------------------------------------------------------
def _job(spec: dict) -> None:
    import transformers  # noqa: PLC0415
    from transformers.trainer_utils import get_last_checkpoint  # noqa: PLC0415

    from hf_megatrain import HFMegaTrainer, MegaTrainArguments  # noqa: PLC0415
    from hf_megatrain.core import optimizer as opt_mod  # noqa: PLC0415
    from hf_megatrain.hf import checkpoint as ckpt_mod  # noqa: PLC0415
    from hf_megatrain.hf import trainer as trainer_mod  # noqa: PLC0415

    from .helpers import common_args, make_data  # noqa: PLC0415

    transformers.logging.set_verbosity_error()
    events: collections.Counter = collections.Counter()
    kill = spec.get("kill")
    phase = {"now": "final"}

    def event(kind: str) -> None:
        events[kind] += 1
        if kill and kill["kind"] == kind and events[kind] == kill["at"]:
            os.kill(os.getpid(), signal.SIGKILL)

    real_update = opt_mod.HostAdamW.apply_layer_update

    def update(*a, **k):
        event("step")
        return real_update(*a, **k)

    opt_mod.HostAdamW.apply_layer_update = staticmethod(update)
    real_save_file = ckpt_mod.save_file

    def save_file(*a, **k):
        real_save_file(*a, **k)
        event(phase["now"])

    ckpt_mod.save_file = save_file
    real_fsync = os.fsync

    def fsync(fd):
        real_fsync(fd)
        event(phase["now"])

    os.fsync = fsync
    real_publish = pub.publish

    def publish(*a, **k):
        event(phase["now"])
        real_publish(*a, **k)
        event("published")

    pub.publish = publish
    trainer_mod.publish = publish
    real_ckpt = trainer_mod.MegaTrainerMixin._save_checkpoint

    def save_checkpoint(self, *a, **k):
        phase["now"] = "ckpt"
        try:
            return real_ckpt(self, *a, **k)
        finally:
            phase["now"] = "final"

    trainer_mod.MegaTrainerMixin._save_checkpoint = save_checkpoint

    out = spec["out"]
    last = get_last_checkpoint(out) if os.path.isdir(out) else None
    args = MegaTrainArguments(
        output_dir=out,
        **common_args(max_steps=spec["steps"], save_strategy="steps", save_steps=SAVE_STEPS),
    )
    trainer = HFMegaTrainer(
        model=tiny_model(tiny_config("llama")), args=args, train_dataset=make_data()
    )
    trainer.train(resume_from_checkpoint=last)
    trainer.save_model(spec["final"])
    if spec.get("count"):
        with open(spec["count"], "w") as f:
            json.dump(dict(events), f)


def _serve() -> None:
    torch.set_num_threads(1)
    import hf_megatrain  # noqa: F401, PLC0415  (imported once, before the forks)

    for line in sys.stdin:
        spec = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)  # the Trainer's prints: stdout carries the protocol
            try:
                _job(spec)
            except BaseException as e:  # a clear error: reported, not a crash of the server
                with open(spec["out"] + ".error", "w") as f:
                    f.write(f"{type(e).__name__}: {e}")
                code = 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        rc = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        print(json.dumps({"signal": sig, "rc": rc}), flush=True)


# ---- the test's side ----------------------------------------------------------------------------
class Server:
    def __init__(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.test_faults", "serve"],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, **spec) -> dict:
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the fault server died"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    server = Server()
    try:
        ref = dict(out=str(tmp / "ref"), final=str(tmp / "ref-final"), steps=STEPS)
        res = server.run(**ref, count=str(tmp / "counts.json"))
        assert res == {"signal": 0, "rc": 0}, res
        old = dict(out=str(tmp / "old"), final=str(tmp / "old-final"), steps=SAVE_STEPS)
        assert server.run(**old) == {"signal": 0, "rc": 0}
        counts = json.loads((tmp / "counts.json").read_text())
        yield dict(
            server=server,
            tmp=tmp,
            counts=counts,
            ref=_weights(ref["final"]),
            old=_weights(old["final"]),
            old_final=old["final"],
        )
    finally:
        server.close()
        print(
            f"\nfault injection: {TALLY['trials']} trials, {TALLY['cases']} cases, "
            f"{TALLY['failures']} failures; outcomes {dict(TALLY['outcomes'])}"
        )


@pytest.fixture(autouse=True)
def _tally():
    """A case counts as a failure unless it finishes."""
    TALLY["cases"] += 1
    TALLY["failures"] += 1
    yield
    TALLY["failures"] -= 1


def _verify_all(run_dir) -> None:
    for n in os.listdir(run_dir):
        if n.startswith("checkpoint-"):
            assert pub.verify_folder(os.path.join(run_dir, n)).manifest


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KINDS)
def test_sigkill_then_resume(faults, kind, seed):
    server, tmp = faults["server"], faults["tmp"]
    events = faults["counts"].get(kind, 0)
    assert events > 0, faults["counts"]
    at = random.Random(f"{kind}-{seed}").randint(1, events)
    spec = dict(out=str(tmp / f"{kind}-{seed}"), final=str(tmp / f"{kind}-{seed}-final"))
    if kind == "final":
        shutil.copytree(faults["old_final"], spec["final"])  # saved over an existing model
    TALLY["trials"] += 1
    res = server.run(**spec, steps=STEPS, kill={"kind": kind, "at": at})
    assert res["signal"] == signal.SIGKILL, (res, kind, at)
    if kind == "final":
        # What a reader finds after the kill: exactly the old model or exactly the new one.
        pub.recover(spec["final"])
        assert pub.verify_folder(spec["final"]).manifest
        got = _weights(spec["final"])
        assert _same(got, faults["old"]) or _same(got, faults["ref"]), "a mixed model"
    _verify_all(spec["out"])
    res = server.run(**spec, steps=STEPS)  # resume from the last complete checkpoint
    if res["rc"] != 0:
        err = open(spec["out"] + ".error").read()
        TALLY["outcomes"]["clear error"] += 1
        assert err.startswith(
            ("FileNotFoundError: hf_megatrain:", "IntegrityError: hf_megatrain")
        ), err
        return
    assert pub.verify_folder(spec["final"]).manifest
    assert _same(_weights(spec["final"]), faults["ref"]), f"{kind} at event {at}: weights differ"
    _verify_all(spec["out"])
    TALLY["outcomes"]["bit-equal resume"] += 1


# ---- a full disk --------------------------------------------------------------------------------
def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _safetensors_enospc(*_a, **_k):
    # (safetensors' writer, as it words an OS error: not an OSError)
    raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("at, fail", [(1, _enospc), (3, _enospc), (1, _safetensors_enospc)])
def test_enospc_in_checkpoint_keeps_previous(tmp_path, monkeypatch, at, fail):
    """The disk fills during the second checkpoint (a partial optimizer file, then ENOSPC, as an
    OSError or in safetensors' words): the save fails with the library's DiskFullError (errno
    ENOSPC, naming the checkpoint), checkpoint-2 stays intact, and resuming from it finishes
    the run bit-equal to an uninterrupted one."""
    from hf_megatrain.hf import checkpoint as ckpt_mod  # noqa: PLC0415

    model = tiny_model(tiny_config("llama"))
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
    _, ref = run_trainer(copy.deepcopy(model), tmp_path, "ref", True, **kw)
    real = ckpt_mod.save_file
    calls = {"n": 0}

    def save_file(tensors, path, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3 + at:  # 3 files per checkpoint: the second one's file number `at`
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            fail()
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(ckpt_mod, "save_file", save_file)
    TALLY["trials"] += 1
    with pytest.raises(pub.DiskFullError, match="checkpoint-4 could not be written") as e:
        run_trainer(copy.deepcopy(model), tmp_path, "full", True, **kw)
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    run = tmp_path / "full"
    assert sorted(os.listdir(run)) == ["checkpoint-2"]  # no staging, no partial checkpoint-4
    assert pub.verify_folder(str(run / "checkpoint-2")).manifest
    _, resumed = run_trainer(
        copy.deepcopy(model), tmp_path, "resumed", True, resume=str(run / "checkpoint-2"), **kw
    )
    assert _same(mega_params(resumed), mega_params(ref))
    TALLY["outcomes"]["ENOSPC: clean failure, bit-equal resume"] += 1


@pytest.mark.parametrize("at", [1, 4])
def test_enospc_in_final_save_keeps_previous_model(tmp_path, monkeypatch, at):
    """The disk fills while save_model writes over an existing model (ENOSPC at an fsync, where
    a real full disk reports delayed writes): the old model stays, whole and verified."""
    model = tiny_model(tiny_config("llama"))
    _, trainer = run_trainer(copy.deepcopy(model), tmp_path, "run", True, max_steps=1)
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    run_trainer(trainer.model, tmp_path, "run2", True, max_steps=2)  # other weights now
    real = os.fsync
    calls = {"n": 0}

    def fsync(fd):
        calls["n"] += 1
        if calls["n"] == at:
            _enospc()
        return real(fd)

    monkeypatch.setattr(pub.os, "fsync", fsync)
    TALLY["trials"] += 1
    with pytest.raises(OSError) as e:
        trainer.save_model(str(out))
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)).count("saved") == 1
    assert not [n for n in os.listdir(tmp_path) if ".megatrain-" in n]
    assert pub.verify_folder(str(out)).files == len(before) - 1
    TALLY["outcomes"]["ENOSPC: clean failure, old model intact"] += 1


# ---- other OS errors: one line, not a traceback -----------------------------------------------
@pytest.mark.parametrize(
    "code, words",
    [(errno.ENOSPC, "no space left"), (errno.EDQUOT, "disk quota exceeded"),
     (errno.EROFS, "read-only"), (errno.EIO, "input/output error"),
     (errno.EFBIG, "largest file allowed"),  # (found by an audit: ulimit -f, a traceback)
     (errno.EACCES, "permission denied"), (errno.EPERM, "operation not permitted")],
)  # fmt: skip
def test_os_errors_end_in_one_line(monkeypatch, code, words, in_a_tmp_folder):
    """The OS errors a failing disk gives (as OSError, or as safetensors' writer words them):
    one line saying what happened, what to do and that earlier checkpoints are intact."""
    from hf_megatrain import cli

    for error in (
        OSError(code, os.strerror(code), "/out/checkpoint-4/model.safetensors"),
        RuntimeError(f"Error while serializing: IoError({os.strerror(code)} (os error {code}))"),
    ):

        def fail(_settings, error=error):
            raise error

        monkeypatch.setattr(cli, "run_train", fail)
        with pytest.raises(SystemExit) as e:
            cli.main(["train", "--max_steps", "1"])
        msg = e.value.code
        assert isinstance(msg, str) and msg.startswith("hf-megatrain: error: "), msg
        assert "\n" not in msg and words in msg
        assert "Checkpoints published before the error are intact" in msg
        if isinstance(error, OSError):
            assert "(/out/checkpoint-4/model.safetensors)" in msg
    monkeypatch.setattr(
        cli, "run_train", lambda _s: (_ for _ in ()).throw(OSError(errno.EBADF, "x"))
    )
    with pytest.raises(OSError):  # another OS error is a bug to show
        cli.main(["train", "--max_steps", "1"])


def test_quota_exceeded_in_the_final_save(tmp_path, monkeypatch):
    """EDQUOT at an fsync of the final model's staging folder, in a real run: one line, the
    checkpoint intact and no staging left; the same command then finishes the run from it."""
    from hf_megatrain.cli import main

    from .test_cli_resume import _argv

    out = tmp_path / "run"
    argv = _argv(tmp_path, out, ["--max_eval_sequences", "4"])
    argv[argv.index("--max_steps") + 1] = "2"
    real = os.fsync

    def fsync(fd):
        if ".megatrain-new" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        return real(fd)

    monkeypatch.setattr(pub.os, "fsync", fsync)
    with pytest.raises(SystemExit) as e:
        main(argv)
    monkeypatch.undo()
    assert str(e.value.code).startswith("hf-megatrain: error: disk quota exceeded")
    assert sorted(os.listdir(out)) == ["checkpoint-2"]
    assert pub.verify_folder(str(out / "checkpoint-2")).manifest
    assert not [n for n in os.listdir(tmp_path) if ".megatrain-" in n]
    assert main(argv) == 0
    assert pub.verify_folder(str(out)).manifest


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    _serve()
