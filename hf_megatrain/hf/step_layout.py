"""Which rows a run's optimizer steps take, and whether a resume at another layout (processes,
sequence-parallel degree, batch size, gradient accumulation) trains as a run that had used that
layout from the start.

The sampler's order of the rows does not depend on the layout (accelerate seeds it alike for
every process count). Rank r of W takes the per-device batches r, r + W, ... of that order; a
sequence-parallel group of N ranks trains its members' batches one after the other (N times as
many items, each a 1/N shard of every row), and the Trainer's gradient accumulation counts those
items. So with G = W / N groups, a step trains ``rows_per_step`` = batch x accumulation x G rows,
and they are the next run of that many rows of the order when G is 1 or the accumulation is a
multiple of N (``in_order``); otherwise a step takes each group's part of a round of batches, in
an order that depends on N. An epoch trains every row (padded, the repeats masked, under data
parallelism), or, with ``dataloader_drop_last`` (turned on by sequence parallelism), only whole
rounds of W batches (``epoch_rows``).

A resume counts its data position in steps of its own layout (the Trainer skips global_step x
accumulation of its batches). From a checkpoint saved at another layout it therefore trains as an
uninterrupted run at the new layout exactly when both take the same rows in every step up to the
checkpoint and the epochs agree (``layout_change``); else rows are skipped or trained twice (and
the epoch's step count, which an epoch-based run's schedule is laid out over, differs). Measured
on the CPU with tests/sp_worker.py (32 rows, batch 2, accumulation 2): 2 ranks sharing each
sequence resumed in 1 process, and the reverse, equal the uninterrupted runs; resumed at 2
data-parallel ranks (8 rows a step instead of 4) step 3 trains rows 16-23 of the order, and rows
8-15 are never trained in that epoch, exactly as the stock Trainer resumes at another world size.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any

#: Where a checkpoint's manifest records its layout (``saved_from``, see core/publish.py).
MANIFEST_KEY = "step_layout"
#: Where it records the run-defining arguments other than the layout's (``run_arguments``).
RUN_ARGUMENTS_KEY = "run_arguments"

#: TrainingArguments that define a run: the update, the objective, the steps' rows and their
#: order. A resume with others is another run (``cli_resume.check_same_run``, where the layout's
#: may change together as ``layout_change`` allows); every data-parallel rank runs with the same
#: (``trainer.check_same_on_every_rank``).
RUN_DEFINING_ARGUMENTS = (
    "learning_rate",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "seed",
    "data_seed",
    "bf16",
    # (Found by an audit: a resume at another --label_smoothing_factor trained on silently.)
    "label_smoothing_factor",
    "neftune_noise_alpha",
    "optim",
    "optim_args",
    "train_sampling_strategy",
    "dataloader_drop_last",
)


#: Of ``RUN_DEFINING_ARGUMENTS``, those the layout holds (``StepLayout``; checked apart).
LAYOUT_ARGUMENTS = ("per_device_train_batch_size", "gradient_accumulation_steps",
                    "dataloader_drop_last")  # fmt: skip
#: Those a resume takes from the saved optimizer and scheduler state, whatever the arguments
#: say (the scheduler's base learning rates, AdamW's parameter groups).
RESTORED_ARGUMENTS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon")


def plain_value(value: Any) -> Any:
    """``value`` as JSON gives it back (an enum as its value, anything else JSON lacks as text):
    what a record compares equal to after a round trip through a file."""
    if isinstance(value, enum.Enum):
        value = value.value
    return json.loads(json.dumps(value, default=str))


def run_arguments(args: Any) -> dict[str, Any]:
    """``args``' run-defining arguments other than the layout's, as JSON values."""
    return {
        k: plain_value(getattr(args, k, None))
        for k in RUN_DEFINING_ARGUMENTS
        if k not in LAYOUT_ARGUMENTS
    }


def run_argument_changes(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What a resume under ``now`` does with the arguments that differ from ``saved`` (a
    checkpoint's ``run_arguments``), in words; None where none differs."""
    diffs = [k for k in now if k in saved and saved[k] != now[k]]
    if not diffs:
        return None
    listed = ", ".join(f"{k}={saved[k]!r} (this run: {now[k]!r})" for k in diffs)
    kept = [k for k in diffs if k in RESTORED_ARGUMENTS]
    applied = [k for k in diffs if k not in RESTORED_ARGUMENTS]
    what = []
    if kept:
        what.append(f"the saved optimizer and scheduler state keep {', '.join(kept)} as saved")
    if applied:
        what.append(f"{', '.join(applied)} take{'s' if len(applied) == 1 else ''} this run's value")
    return f"it was saved by a run with {listed}: {'; '.join(what)}"


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """How a run takes its rows: its processes, the ranks sharing each sequence, the rows of a
    rank's batch, the batches (items) accumulated per step, and whether an epoch's incomplete
    last round of batches is dropped."""

    world_size: int
    sequence_parallel: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    dataloader_drop_last: bool = False

    @classmethod
    def of(cls, args, sequence_parallel: int) -> StepLayout:
        """The layout of a run with TrainingArguments ``args`` (after the trainer adjusted them)."""
        return cls(
            world_size=int(args.world_size),
            sequence_parallel=int(sequence_parallel),
            per_device_train_batch_size=int(args.per_device_train_batch_size),
            gradient_accumulation_steps=int(args.gradient_accumulation_steps),
            dataloader_drop_last=bool(args.dataloader_drop_last),
        )

    @classmethod
    def from_record(cls, record: Any) -> StepLayout | None:
        """The layout ``record`` (``record()``'s dict, or a CLI run record) describes; None when
        it lacks a field or holds another type."""
        if not isinstance(record, dict):
            return None
        try:
            return cls(
                world_size=int(record["world_size"]),
                sequence_parallel=int(record.get("sequence_parallel") or 1),
                per_device_train_batch_size=int(record["per_device_train_batch_size"]),
                gradient_accumulation_steps=int(record["gradient_accumulation_steps"]),
                dataloader_drop_last=bool(record.get("dataloader_drop_last", False)),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def groups(self) -> int:
        """Sequence-parallel groups (data parallel to each other); ranks, without it."""
        return max(1, self.world_size // self.sequence_parallel)

    @property
    def rows_per_step(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.groups

    @property
    def in_order(self) -> bool:
        """Whether each step trains the next ``rows_per_step`` rows of the sampler's order."""
        return self.groups == 1 or self.gradient_accumulation_steps % self.sequence_parallel == 0

    def epoch_rows(self, rows: int) -> int:
        """How many of ``rows`` rows an epoch trains (the rest: an incomplete round dropped)."""
        if not self.dataloader_drop_last:
            return rows  # the last batch partial, or padded with masked repeats
        batches = rows // self.per_device_train_batch_size
        return (batches - batches % self.world_size) * self.per_device_train_batch_size

    def processes(self) -> str:
        return processes(self.world_size)

    def describe(self) -> str:
        sp = f", sequence_parallel={self.sequence_parallel}" if self.sequence_parallel > 1 else ""
        return self.processes() + sp

    def describe_batches(self) -> str:
        """``describe`` with each rank's batch and accumulation."""
        return (
            f"batch {self.per_device_train_batch_size} x accumulation "
            f"{self.gradient_accumulation_steps} on {self.describe()}"
        )


def processes(count: int) -> str:
    """``count`` processes, in words."""
    return f"{count} process{'es' if count != 1 else ''}"


def layout_change(
    saved: StepLayout,
    now: StepLayout,
    rows: int | None = None,
    step: int = 0,
    max_steps: int = -1,
) -> str | None:
    """Why a run saved at layout ``saved`` and resumed at ``now`` from its step ``step`` would
    not train as a run at ``now`` from the start would (None: it would, step for step).

    ``rows``: the training rows (None: unknown, e.g. a stream; the epochs are then not compared);
    ``max_steps`` the run's (0 or less: its length is epochs, whose step count sets the learning
    rate schedule)."""
    if saved == now:
        return None
    for layout in (saved, now):
        if layout.world_size % layout.sequence_parallel:
            return (
                f"{layout.processes()} cannot form groups of {layout.sequence_parallel} ranks "
                "sharing each sequence"
            )
    had, has = saved.rows_per_step, now.rows_per_step
    if had != has:
        return (
            f"a step trained {had} rows there and would train {has} here, and the data position "
            "is counted in steps of the new size: rows would be skipped or trained twice"
        )
    for layout in (saved, now):
        if not layout.in_order:
            return (
                f"with {layout.groups} groups of {layout.sequence_parallel} ranks sharing each "
                f"sequence and gradient_accumulation_steps={layout.gradient_accumulation_steps}, "
                f"not a multiple of {layout.sequence_parallel}, a step takes its rows in another "
                "order than at the other layout"
            )
    if rows is None:
        return None
    had, has = saved.epoch_rows(rows), now.epoch_rows(rows)
    common = min(had, has) // now.rows_per_step  # the first steps, the same at both layouts
    if had != has and (max_steps <= 0 or step > common):
        return (
            f"an epoch of the {rows} rows trained {had} of them there and would train {has} "
            "here, so the epochs have other steps: dataloader_drop_last, which sequence "
            "parallelism turns on, drops an incomplete last round of batches"
        )
    return None


def processes_keeping_steps(
    saved: StepLayout, now: StepLayout, rows: int | None = None, step: int = 0, max_steps: int = -1
) -> int | None:
    """The process count at ``now``'s sequence-parallel degree (and batch, accumulation) that
    resumes ``saved`` step for step (its groups kept), where that is not ``now``'s own; else
    None."""
    size = now.sequence_parallel * saved.groups
    kept = dataclasses.replace(now, world_size=size)
    if size == now.world_size or layout_change(saved, kept, rows, step, max_steps) is not None:
        return None
    return size


def _saved_from(checkpoint: str) -> dict | None:
    """What ``checkpoint``'s manifest records it was saved from (``saved_from``, see
    core/publish.py); None where there is none (an older version's, or no manifest)."""
    from ..core.publish import MANIFEST_NAME  # noqa: PLC0415

    try:
        with open(os.path.join(checkpoint, MANIFEST_NAME), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None  # (an unreadable manifest is reported when the checkpoint is verified)
    saved_from = manifest.get("saved_from") if isinstance(manifest, dict) else None
    return saved_from if isinstance(saved_from, dict) else None


def saved_layout(checkpoint: str) -> StepLayout | None:
    """The layout ``checkpoint`` was saved at, from its manifest (None: not recorded, e.g. saved
    by an older version, or no manifest)."""
    saved_from = _saved_from(checkpoint)
    return None if saved_from is None else StepLayout.from_record(saved_from.get(MANIFEST_KEY))


def saved_run_arguments(checkpoint: str) -> dict[str, Any] | None:
    """The run-defining arguments ``checkpoint`` was saved with (``run_arguments``), from its
    manifest (None: not recorded, or no manifest)."""
    record = (_saved_from(checkpoint) or {}).get(RUN_ARGUMENTS_KEY)
    return record if isinstance(record, dict) else None


__all__ = [
    "LAYOUT_ARGUMENTS",
    "MANIFEST_KEY",
    "RESTORED_ARGUMENTS",
    "RUN_ARGUMENTS_KEY",
    "StepLayout",
    "layout_change",
    "plain_value",
    "processes",
    "processes_keeping_steps",
    "run_argument_changes",
    "run_arguments",
    "saved_layout",
    "saved_run_arguments",
]
