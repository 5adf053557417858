"""A SIGTERM (a scheduler preempting or timing out the job) turned into a checkpoint.

``SaveOnSigterm`` is a ``TrainerCallback``: from ``on_train_begin`` (or inside its
``handling()`` context, which can reach past the end of training) a SIGTERM, or a SIGUSR1 (what
SLURM's ``--signal=USR1@SECONDS`` sends ahead of a time limit), no longer kills the process. The
running optimizer step finishes, the Trainer saves a checkpoint at it (off the ``save_steps``
grid, whatever ``save_strategy`` says) and stops; ``stopped_at`` says at which step and
``received`` which signal. A second signal stops at once, as without the callback. Under data
parallel the request is all-reduced at each step's end, so every rank stops at the same step
(the ranks' checkpoint save is collective) and ``received`` is the signal a rank got on every
rank. ``hf-megatrain train`` uses it; in a script::

    trainer = HFMegaTrainer(model, args, train_dataset=rows, callbacks=[SaveOnSigterm()])
    trainer.train()  # a SIGTERM: checkpoint-N, then train() returns
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from ..core.distributed import process_group_size

logger = logging.getLogger(__name__)

#: The signals handled by default: termination, and the early warning schedulers can send.
DEFAULT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name)
)


class EvaluationStopped(Exception):  # noqa: N818 - a stop, not an error
    """Raised out of an evaluation batch during training after a SIGTERM (one process): the
    step before the evaluation is complete, so ``HFMegaTrainer`` saves its checkpoint at once
    instead of finishing the evaluation and one more step (a scheduler's grace period before
    SIGKILL is often ~30 s; found by an audit)."""


def evaluation_owed(checkpoint: str) -> bool:
    """Whether ``checkpoint`` was saved when a signal stopped its step's evaluation
    (``EvaluationStopped``): its Trainer control state, saved with it, still asks for that
    evaluation. A checkpoint saved on the Trainer's own path is written after its step's
    evaluation, which clears the request. The evaluation is owed to the run: its metrics, the
    best checkpoint and a ReduceLROnPlateau schedule depend on it (found by an audit: a resumed
    run under load_best_model_at_end picked another best checkpoint than the uninterrupted run)."""
    try:
        with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as f:
            control = json.load(f)["stateful_callbacks"]["TrainerControl"]
        control = control[-1] if isinstance(control, list) else control
        return control["args"]["should_evaluate"] is True
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


class SaveOnSigterm(TrainerCallback):
    """Save a checkpoint at the end of the running step on SIGTERM (or SIGUSR1), then stop
    training."""

    def __init__(self, signals: tuple[int, ...] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.requested = False
        self.received: signal.Signals | None = None  # the first signal that arrived
        self.stopped_at: int | None = None
        self.training_done = False
        self._previous: dict | None = None  # the handlers these replaced (None: not installed)
        self._own = False  # installed by on_train_begin (not by handling())

    # ---- the signal handler -----------------------------------------------------------------
    def _handle(self, signum, frame) -> None:
        if self.requested:  # the second one: stop now, as without the handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = True
        self.received = signal.Signals(signum)
        what = (
            "training is done; saving the final model, then stopping"
            if self.training_done
            else "saving a checkpoint at the end of this step, then stopping"
        )
        logger.warning(
            "hf_megatrain: %s: %s (send it again to stop at once)", self.received.name, what
        )

    def _install(self) -> bool:
        if self._previous is not None or threading.current_thread() is not threading.main_thread():
            return False  # (installed already; signal handlers are the main thread's)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.signals}
        return True

    def _uninstall(self) -> None:
        if self._previous is not None:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous = None

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """The handler from here to the end of the block (e.g. through a final save after
        training), instead of from ``on_train_begin`` to ``on_train_end``."""
        installed = self._install()
        try:
            yield
        finally:
            if installed:
                self._uninstall()

    @property
    def stops_evaluation(self) -> bool:
        """Whether an evaluation during training should stop now: a signal arrived, training
        is not done, and this is one process (data-parallel ranks evaluate in collectives, and
        stop together at a step's end)."""
        return self.requested and not self.training_done and process_group_size() < 2

    # ---- the Trainer's side -----------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._own = self._install()

    def on_step_end(self, args, state, control, **kwargs):
        requested = self.requested
        if process_group_size() > 1:
            # The signal's number (0: none), so that every rank says which one stopped the
            # run (found by an audit: the ranks that got none failed on ``received`` None).
            gpu = dist.get_backend() == "nccl"
            number = float(self.received.value) if self.received is not None else 0.0
            flag = torch.tensor(
                [max(number, float(requested))], device=args.device if gpu else "cpu"
            )
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            number = flag.item()
            requested = requested or number > 0
            if self.received is None and number > 1:
                self.received = signal.Signals(int(number))  # another rank's
        if requested:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.training_done = True
        if self._own:
            self._own = False
            self._uninstall()
