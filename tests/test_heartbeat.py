"""``StepHeartbeat``: a line while an optimizer step runs long (found by an audit: a
continued-pretraining recipe's step on CPU ran over 10 minutes with the progress bar at 0%
and nothing else written)."""

from __future__ import annotations

import time
import types

import pytest
from transformers import TrainerCallback

from hf_megatrain import HFMegaTrainer, MegaTrainArguments, StepHeartbeat

from .helpers import common_args, make_data, tiny_config, tiny_model


class _SlowMicroBatches(TrainerCallback):
    """Each micro-batch of a step takes ``seconds`` longer (a long step, made on purpose)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_substep_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def _train(tmp_path, *callbacks, steps: int = 2) -> None:
    args = MegaTrainArguments(
        output_dir=str(tmp_path),
        **common_args(max_steps=steps, gradient_accumulation_steps=2),
    )
    model = tiny_model(tiny_config("llama"))
    trainer = HFMegaTrainer(
        model=model, args=args, train_dataset=make_data(16), callbacks=list(callbacks)
    )
    trainer.train()


def test_a_long_step_gets_lines_naming_its_micro_batch_and_the_last_step(tmp_path):
    lines: list[str] = []
    beat, slow = StepHeartbeat(every_s=0.1, write=lines.append), _SlowMicroBatches(0.5)
    # (the heartbeat first: its micro-batch count moves before the slow callback sleeps)
    _train(tmp_path, beat, slow)
    assert any(ln.startswith("hf-megatrain: step 1 of 2 running 0m 00s (micro-batch 2 of 2)")
               for ln in lines), lines  # fmt: skip
    assert any(ln.startswith("hf-megatrain: step 2 of 2 running") and "step 1 took 0m 0" in ln
               for ln in lines), lines  # fmt: skip
    # One line per ``every_s`` at most: each step ran ~0.5 s, the lines ~0.1 s apart.
    assert len(lines) <= 2 * 11
    # Trained again: its first step has no step before it (not the last training's step 2).
    lines.clear()
    _train(tmp_path / "again", beat, slow)
    first = [ln for ln in lines if ln.startswith("hf-megatrain: step 1 of 2 running")]
    assert first and not any("took" in ln for ln in first), lines


class _Fails(TrainerCallback):
    def on_substep_end(self, args, state, control, **kwargs):
        raise RuntimeError("a step that fails")


def test_a_failed_training_stops_the_heartbeat(tmp_path):
    """No ``on_train_end`` comes when training raises: HFMegaTrainer.train stops the thread,
    which would otherwise report the failed step as running, a line a minute."""
    lines: list[str] = []
    beat = StepHeartbeat(every_s=0.05, write=lines.append)
    with pytest.raises(RuntimeError, match="a step that fails"):
        _train(tmp_path, beat, _Fails())
    assert not beat.running
    seen = len(lines)
    time.sleep(0.3)
    assert len(lines) == seen


def test_short_steps_and_other_ranks_write_nothing(tmp_path):
    lines: list[str] = []
    beat = StepHeartbeat(every_s=60, write=lines.append)
    _train(tmp_path, beat)
    assert lines == [] and not beat.running
    beat = StepHeartbeat(every_s=0.01, write=lines.append)
    args = types.SimpleNamespace(gradient_accumulation_steps=1)
    state = types.SimpleNamespace(is_world_process_zero=False, global_step=0, max_steps=3)
    beat.on_train_begin(args, state, None)
    assert not beat.running
    beat.on_step_begin(args, state, None)
    time.sleep(0.1)
    beat.on_step_end(args, state, None)
    beat.on_train_end(args, state, None)
    assert lines == []


def test_line_without_micro_batches_or_a_step_count():
    beat = StepHeartbeat()
    args = types.SimpleNamespace(gradient_accumulation_steps=1)
    state = types.SimpleNamespace(is_world_process_zero=True, global_step=6, max_steps=-1)
    beat.on_step_begin(args, state, None)
    assert beat.line(3725) == "hf-megatrain: step 7 running 1h 02m 05s"
    with pytest.raises(ValueError, match="every_s must be positive"):
        StepHeartbeat(every_s=0)


class _Twin(TrainerCallback):
    """Rank 1 of a data-parallel run, simulated: it moves with this rank (``moves``), or stops
    where it is."""

    def __init__(self, peers, moves: bool) -> None:
        self.peers, self.moves, self.micro = peers, moves, 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.micro = 0
        if self.moves or state.global_step == 0:
            self.peers.post(state.global_step + 1, 0)

    def on_substep_end(self, args, state, control, **kwargs):
        self.micro += 1
        if self.moves:
            self.peers.post(state.global_step + 1, self.micro)


@pytest.mark.parametrize("moves", [False, True])
def test_rank_zeros_line_names_a_rank_that_has_not_moved(tmp_path, moves):
    """Found by an audit: a stuck (not dead) data-parallel rank left the others waiting in a
    collective for its 30 minutes, the heartbeat saying only that the step ran long. Every rank
    posts its progress to the launch's store; rank 0's line names those behind it that have not
    moved for ``every_s`` (here a real TCPStore, rank 1 simulated in this process)."""
    import datetime  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    from hf_megatrain.hf.heartbeat import PeerProgress  # noqa: PLC0415

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))  # fmt: skip
    lines: list[str] = []
    beat = StepHeartbeat(every_s=0.2, write=lines.append, peers=PeerProgress(server, 0, 2))
    twin = _Twin(PeerProgress(server, 1, 2), moves)
    _train(tmp_path, twin, beat, _SlowMicroBatches(0.5))
    named = [ln for ln in lines if "; rank 1 has not moved for" in ln]
    if moves:
        assert lines and not named, lines
    else:
        assert named and all(ln.endswith("(at micro-batch 1 of step 1)") for ln in named), lines
