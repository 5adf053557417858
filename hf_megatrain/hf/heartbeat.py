"""A line while one optimizer step runs long.

The Trainer's progress bar moves once per optimizer step: at long context (one 524k-token
sequence: ~9 minutes a step on an H200) or with many micro-batches on a slow machine, that is
minutes without output, and a preempting SIGTERM waits for the step's end. ``StepHeartbeat``
is a ``TrainerCallback`` whose thread writes, every ``every_s`` seconds of a step::

    hf-megatrain: step 3 of 20 running 2m 00s (micro-batch 5 of 16; step 2 took 6m 12s)

Steps shorter than ``every_s`` print nothing. Only the main process writes (under data
parallel, rank 0); there every rank posts its progress to the launch's store (torchrun's, at
``MASTER_ADDR:MASTER_PORT``), and rank 0's line names the ranks that have not moved for
``every_s`` while it waits for them (a stuck rank, not a dead one: a collective only times out
after its 30 minutes)::

    hf-megatrain: step 5 of 20 running 3m 00s (...); rank 1 has not moved for 2m 58s (at
    micro-batch 1 of step 5)

``hf-megatrain train`` uses it; in a script::

    trainer = HFMegaTrainer(model, args, train_dataset=rows, callbacks=[StepHeartbeat()])
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from ..core.distributed import process_group_size


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h {m:02d}m {s:02d}s" if hours else f"{m}m {s:02d}s"


def _write(line: str) -> None:
    """Above the Trainer's progress bar (tqdm clears and redraws it), on stderr."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    tqdm.write(line, file=sys.stderr)


class PeerProgress:
    """Where each data-parallel rank is in training, through a ``torch.distributed`` store:
    every rank posts its step and micro-batch, rank 0 reads the others' (a key per rank)."""

    PREFIX = "hf_megatrain/heartbeat/"

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size

    @classmethod
    def from_environment(cls) -> PeerProgress | None:
        """A client of the launch's store (``MASTER_ADDR:MASTER_PORT``) for a data-parallel run;
        None for one process, or where the store cannot be reached (no names, no failure)."""
        import torch.distributed as dist  # noqa: PLC0415

        if process_group_size() < 2:
            return None
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return None
        try:
            store = dist.TCPStore(host, int(port), is_master=False,
                                  timeout=datetime.timedelta(seconds=10))  # fmt: skip
        except Exception:  # noqa: BLE001 - a launcher without a reachable store
            return None
        return cls(store, dist.get_rank(), dist.get_world_size())

    def post(self, step: int, micro: int) -> None:
        """This rank is at micro-batch ``micro`` (0-based) of optimizer step ``step``."""
        self.store.set(f"{self.PREFIX}{self.rank}", f"{step} {micro} {time.time()}")

    def stalled(self, step: int, micro: int, after_s: float) -> list[str]:
        """The other ranks behind (``step``, ``micro``) that have not moved for ``after_s``."""
        now, out = time.time(), []
        for rank in range(self.world_size):
            key = f"{self.PREFIX}{rank}"
            if rank == self.rank or not self.store.check([key]):
                continue
            their_step, their_micro, at = self.store.get(key).decode().split()
            still = now - float(at)
            if (int(their_step), int(their_micro)) < (step, micro) and still >= after_s:
                out.append(
                    f"rank {rank} has not moved for {_duration(still)} (at micro-batch "
                    f"{int(their_micro) + 1} of step {their_step})"
                )
        return out


class StepHeartbeat(TrainerCallback):
    """Every ``every_s`` seconds of a running optimizer step, one line (``write``): the step,
    its micro-batch, how long it has run and how long the step before it took."""

    def __init__(
        self,
        every_s: float = 60.0,
        write: Callable[[str], None] = _write,
        peers: PeerProgress | None = None,
    ) -> None:
        if every_s <= 0:
            raise ValueError(f"StepHeartbeat: every_s must be positive, not {every_s}")
        self.every_s = float(every_s)
        self.write = write
        #: The data-parallel ranks' progress (default: found from the launch at train begin).
        self.peers = peers
        self._lock = threading.Lock()
        self._started: float | None = None  # the running step's start (monotonic), else None
        self._next_line = 0.0  # the running step's elapsed seconds at its next line
        self._step = self._max_steps = self._micro = self._micro_batches = 0
        self._last: float | None = None  # the previous step's seconds
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.peers is None:
            self.peers = PeerProgress.from_environment()
        if not state.is_world_process_zero or self._thread is not None:
            return
        self._micro_batches = max(1, int(args.gradient_accumulation_steps))
        self._last = None  # (a second train(): not the last one's final step)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="step-heartbeat", daemon=True)
        self._thread.start()

    def on_step_begin(self, args, state, control, **kwargs):
        with self._lock:
            self._started = time.monotonic()
            self._next_line = self.every_s
            self._step, self._max_steps = state.global_step + 1, state.max_steps
            self._micro = 0
        self._post()

    def on_substep_end(self, args, state, control, **kwargs):
        with self._lock:
            self._micro += 1
        self._post()

    def _post(self) -> None:
        if self.peers is None:
            return
        try:
            self.peers.post(self._step, self._micro)
        except Exception:  # noqa: BLE001 - the store gone: the line goes on without names
            self.peers = None

    def on_step_end(self, args, state, control, **kwargs):
        with self._lock:
            if self._started is not None:
                self._last = time.monotonic() - self._started
            self._started = None

    def on_train_end(self, args, state, control, **kwargs):
        self.stop()

    def stop(self) -> None:
        """End the thread (``HFMegaTrainer.train`` calls it also when training raised, where
        no ``on_train_end`` comes: a failed step would otherwise be reported as running)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = self._stop = None
        with self._lock:
            self._started = None

    @property
    def running(self) -> bool:
        """Whether its thread runs (from ``on_train_begin`` to the end of training)."""
        return self._thread is not None

    def line(self, elapsed: float) -> str:
        """What the heartbeat says ``elapsed`` seconds into the running step."""
        step = f"step {self._step}" + (f" of {self._max_steps}" if self._max_steps > 0 else "")
        notes = []
        if self._micro_batches > 1:
            notes.append(f"micro-batch {min(self._micro + 1, self._micro_batches)} of "
                         f"{self._micro_batches}")  # fmt: skip
        if self._last is not None:
            notes.append(f"step {self._step - 1} took {_duration(self._last)}")
        detail = f" ({'; '.join(notes)})" if notes else ""
        return f"hf-megatrain: {step} running {_duration(elapsed)}{detail}"

    def _beat(self) -> None:
        tick = min(5.0, self.every_s / 4)
        while not self._stop.wait(tick):
            with self._lock:
                if self._started is None:
                    continue
                elapsed = time.monotonic() - self._started
                if elapsed < self._next_line:
                    continue
                self._next_line = (elapsed // self.every_s + 1) * self.every_s
                text = self.line(elapsed)
                where = (self._step, self._micro)
            text += self._stalled(*where)
            self.write(text)

    def _stalled(self, step: int, micro: int) -> str:
        """``; rank 1 has not moved for ...`` for the ranks this one waits for, else ''."""
        if self.peers is None:
            return ""
        try:
            names = self.peers.stalled(step, micro, self.every_s)
        except Exception:  # noqa: BLE001 - the store gone: no names
            return ""
        return "".join(f"; {name}" for name in names)
