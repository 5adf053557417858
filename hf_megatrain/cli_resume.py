"""Resuming ``hf-megatrain train``: which checkpoint, whether it is complete, and whether it
continues the same run.

Every checkpoint the CLI writes records the arguments that define its run (the ``RunShape``
callback's state in ``trainer_state.json``, listed in the checkpoint's manifest). A resume with
other values would not continue that run: the saved scheduler keeps the old learning rate, and
the saved data position would be applied to other rows. So it is refused, naming each difference.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from .cli_common import CONFIG_ERRORS, CLIError, world_size
from .hf.step_layout import RUN_DEFINING_ARGUMENTS, plain_value

#: The stateful callback's name in trainer_state.json (the name it has had since it recorded
#: only ``seq_len``: older checkpoints are read the same way).
RECORD_NAME = "RunShape"
_SCHEDULER_NAME = "scheduler.pt"
_OPTIMIZER_DIR = "megatrain_optimizer"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_RESUME_FLAG = "--resume-without-optimizer-state"

#: TrainingArguments whose change makes a resumed run another run. --max_steps and
#: --num_train_epochs may change: that is how a run is extended.
_TRAINING_KEYS = RUN_DEFINING_ARGUMENTS
_MODEL_KEYS = ("model_path", "config", "tokenizer")
#: Recorded and allowed to change: a run may go on at a longer (or shorter) row length, e.g. to
#: extend its context; ``seq_len_note`` says what changes.
_ALLOWED_CHANGES = ("seq_len",)
#: How the steps take their rows (processes, ranks per sequence, batch, accumulation): they may
#: change together where every step still trains the same rows (``check_same_run``).
_LAYOUT_KEYS = (
    "world_size",
    "sequence_parallel",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "dataloader_drop_last",
)
#: Values that name files: compared as absolute paths (a re-run from another folder is the same).
_PATH_KEYS = ("model_path", "config", "tokenizer", "dataset_name")
#: What a None value means, for the message.
_DEFAULT_WORDS = {
    "dataset_name": "the bundled corpus",
    "config": "the bundled config",
    "tokenizer": "the model's own",
    "model_path": "none (random init)",
}


# ---- the run's record ---------------------------------------------------------------------
def run_record(settings) -> dict[str, Any]:
    """The arguments that define ``settings``' run, as JSON values."""
    t, data, model = settings.training, settings.data, settings.model
    record = {k: plain_value(getattr(t, k, None)) for k in _TRAINING_KEYS}
    record |= {f.name: plain_value(getattr(data, f.name)) for f in dataclasses.fields(data)}
    record |= {k: getattr(model, k) for k in _MODEL_KEYS}
    for key in _PATH_KEYS:
        if record.get(key) is not None and os.path.exists(record[key]):
            record[key] = os.path.abspath(record[key])
    record["world_size"] = world_size()
    # Ranks sharing each sequence: with WORLD_SIZE, the rows of a step and the data position.
    record["sequence_parallel"] = settings.engine.sequence_parallel
    return record


def record_callback(record: dict[str, Any]):
    """A callback whose state (``record``) every checkpoint keeps in its trainer_state.json."""
    from transformers.trainer_callback import ExportableState, TrainerCallback  # noqa: PLC0415

    class RunShape(TrainerCallback, ExportableState):
        def __init__(self, **record: Any) -> None:
            self.record = record

        def state(self) -> dict:
            return {"args": self.record, "attributes": {}}

    return RunShape(**record)


def saved_record(checkpoint: str) -> dict[str, Any]:
    """What ``checkpoint``'s run was trained with: its record, and for checkpoints written
    before the record had everything, what the scheduler and trainer state say."""
    state = _read_json(Path(checkpoint) / "trainer_state.json")
    saved = (state.get("stateful_callbacks") or {}).get(RECORD_NAME)
    saved = saved[0] if isinstance(saved, list) and saved else saved
    record = dict(saved.get("args", {})) if isinstance(saved, dict) else {}
    if "learning_rate" not in record:
        lr = _scheduler_base_lr(checkpoint)
        if lr is not None:
            record["learning_rate"] = lr
    if "per_device_train_batch_size" not in record and state.get("train_batch_size"):
        record["per_device_train_batch_size"] = state["train_batch_size"]
    return record


def _read_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def _scheduler_base_lr(checkpoint: str) -> float | None:
    """The learning rate the saved scheduler restores (its ``base_lrs``)."""
    path = os.path.join(checkpoint, _SCHEDULER_NAME)
    if not os.path.isfile(path):
        return None
    import torch  # noqa: PLC0415

    try:
        base = torch.load(path, weights_only=True).get("base_lrs") or []
    except Exception:  # noqa: BLE001 - an unreadable scheduler is reported when it is loaded
        return None
    return float(base[0]) if base else None


def _elsewhere(explicit: bool) -> str:
    """How to start another run instead of resuming (the checkpoint named, or found)."""
    if explicit:
        return "drop --resume_from_checkpoint and pass a new --output_dir"
    return "pass a new --output_dir"


def check_same_run(checkpoint: str, settings, explicit: bool) -> None:
    """Refuse a resume whose run-defining arguments differ from ``checkpoint``'s.

    The processes and the ranks sharing each sequence may change together where every step
    still trains the same rows (``hf.step_layout.layout_change``, the check the trainer makes
    for a resume at another sequence-parallel degree): e.g. 2 processes sharing each sequence
    resumed by 1 process on whole sequences."""
    from .hf.step_layout import (  # noqa: PLC0415
        StepLayout,
        layout_change,
        processes,
        processes_keeping_steps,
    )

    saved, now = saved_record(checkpoint), run_record(settings)
    before, after = StepLayout.from_record(saved), StepLayout.from_record(now)
    problem = None if before is None or after is None else layout_change(before, after)
    diffs = [  # in run_record's order
        k
        for k in now
        if k in saved
        and saved[k] != now[k]
        and k not in _ALLOWED_CHANGES
        and (k not in _LAYOUT_KEYS or before is None or after is None or problem is not None)
    ]
    if not diffs:
        return
    listed = ", ".join(
        f"{_flag(k)} {_shown(k, saved[k])} (this run: {_shown(k, now[k])})" for k in diffs
    )
    why = f"; {problem}" if problem is not None and set(diffs) & set(_LAYOUT_KEYS) else ""
    size = None
    if before is not None and after is not None and "sequence_parallel" in diffs:
        size = processes_keeping_steps(before, after)
    other = (
        f" (--sequence-parallel {after.sequence_parallel} on {processes(size)} continues it too)"
        if size
        else ""
    )
    elsewhere = _elsewhere(explicit)
    raise CLIError(
        f"cannot resume from {checkpoint}: it was trained with {listed}{why}. Pass the "
        f"checkpoint's value{'s' if len(diffs) > 1 else ''} to continue that run{other}, or "
        f"{elsewhere} to start another (--model_path {checkpoint} starts it from those weights)"
    )


#: Config keys a save writes or a load sets that do not define the model.
_CONFIG_RUNTIME_KEYS = frozenset(
    {"_name_or_path", "dtype", "torch_dtype", "transformers_version", "architectures",
     "use_cache", "_commit_hash", "attn_implementation", "_attn_implementation_autoset"}
)  # fmt: skip


def check_same_config(checkpoint: str, config, explicit: bool) -> None:
    """Refuse a resume whose model config (``config``, a ``PretrainedConfig``) differs from
    ``checkpoint``'s: a config file edited since the run started. Without this the weights
    fail to load, after the model is built (minutes for a large one), naming a tensor."""
    from transformers import AutoConfig  # noqa: PLC0415

    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        return
    try:
        saved = AutoConfig.from_pretrained(checkpoint, local_files_only=True).to_dict()
    except CONFIG_ERRORS:
        return  # (a damaged checkpoint is the trainer's checks' to name)
    now = config.to_dict()
    diffs = [
        k
        for k in sorted(set(saved) | set(now))
        if k not in _CONFIG_RUNTIME_KEYS
        # (the Trainer sets the special-token ids to the tokenizer's before the first save:
        # they differ from a --config file's without anything edited, and shape no weight)
        and not k.endswith("_token_id")
        and saved.get(k) != now.get(k)
    ]
    if not diffs:
        return
    shown = ", ".join(f"{k} {saved.get(k)!r} (this run: {now.get(k)!r})" for k in diffs[:6])
    more = f" and {len(diffs) - 6} more" if len(diffs) > 6 else ""
    raise CLIError(
        f"cannot resume from {checkpoint}: its model config differs from this run's: "
        f"{shown}{more}. Restore the config to continue that run, or {_elsewhere(explicit)} to "
        "start another"
    )


#: The record's key for the train rows' identity (``training_data.rows_digest``).
ROWS_KEY = "rows_digest"


def check_same_rows(checkpoint: str, digest: str | None, seq_len: int, explicit: bool) -> None:
    """Refuse a resume whose train rows are not ``checkpoint``'s (its data files edited,
    reordered or replaced since; the path alone is compared by ``check_same_run``). Not
    compared at another ``seq_len`` (allowed: the rows change with it) or when streaming."""
    saved = saved_record(checkpoint)
    if digest is None or saved.get(ROWS_KEY) in (None, digest) or saved.get("seq_len") != seq_len:
        return
    elsewhere = _elsewhere(explicit)
    raise CLIError(
        f"cannot resume from {checkpoint}: its training rows differ from this run's (the data "
        "under the same name was edited, reordered or replaced since: the data position it "
        "resumes at would apply to other rows). Restore that data to continue the run, or "
        f"{elsewhere} to start another (--model_path {checkpoint} starts it from those weights)"
    )


def seq_len_note(checkpoint: str, seq_len: int) -> str | None:
    """What changes when a run resumes from ``checkpoint`` at another ``seq_len``; None: the
    same length (or not recorded)."""
    saved = saved_record(checkpoint).get("seq_len")
    if saved is None or saved == seq_len:
        return None
    return (
        f"note: that checkpoint trained on rows of {saved} tokens and this run uses --seq_len "
        f"{seq_len}: the tokens per step change, and the data position it resumes at counts rows "
        "of the new length"
    )


def _flag(key: str) -> str:
    if key == "sequence_parallel":
        return "--sequence-parallel"
    return "WORLD_SIZE (processes)" if key == "world_size" else f"--{key}"


def _shown(key: str, value: Any) -> str:
    if value is None:
        return _DEFAULT_WORDS.get(key, "none")
    return f"{value:g}" if isinstance(value, float) else str(value)


# ---- complete checkpoints -----------------------------------------------------------------
@dataclasses.dataclass
class Incomplete:
    """Why a checkpoint cannot be resumed from."""

    reason: str
    #: Only optimizer or scheduler state is missing: --resume-without-optimizer-state allows it.
    state_only: bool


def is_optimizer_state(rel: str) -> bool:
    """Whether a checkpoint's file ``rel`` (its path inside the folder) is optimizer or
    scheduler state, not weights."""
    return rel == _SCHEDULER_NAME or rel.startswith(f"{_OPTIMIZER_DIR}/")


def checkpoint_problem(folder: str, allow_missing_state: bool = False) -> Incomplete | None:
    """The first missing or truncated file of checkpoint ``folder`` (None: complete). Sizes
    against its manifest only: the trainer checks every file's sha256 when it loads them."""
    from .core.publish import IntegrityError, read_manifest  # noqa: PLC0415

    if not any(os.scandir(folder)):
        return Incomplete("empty folder", False)
    try:
        manifest = read_manifest(folder)
    except IntegrityError as e:
        return Incomplete(str(e).removeprefix("hf_megatrain: "), False)
    if manifest is None:
        return _unlisted_problem(folder, allow_missing_state)
    return listed_files_problem(folder, manifest, allow_missing_state)


def listed_files_problem(
    folder: str, manifest: dict, allow_missing_state: bool = False
) -> Incomplete | None:
    """The first file ``manifest`` lists that ``folder`` lacks or holds at another size."""
    for rel, entry in sorted(manifest["files"].items()):
        path = os.path.join(folder, *rel.split("/"))
        if not os.path.isfile(path):
            if allow_missing_state and is_optimizer_state(rel):
                continue
            return Incomplete(f"{rel} is missing", is_optimizer_state(rel))
        have, want = os.path.getsize(path), int(entry["size"])
        if have != want:
            # Shorter: cut off by a kill or a full disk; otherwise altered after the save.
            what = "truncated" if have < want else "altered"
            return Incomplete(
                f"{rel} is {what}: {have} bytes, the manifest says {want}", is_optimizer_state(rel)
            )
    return None


def _unlisted_problem(folder: str, allow_missing_state: bool) -> Incomplete | None:
    """``checkpoint_problem`` for a checkpoint without a manifest (an older version's)."""
    from .hf.checkpoint import (  # noqa: PLC0415
        check_checkpoint_files,
        optimizer_state_problem,
        stock_optimizer_note,
    )

    if not os.path.isfile(os.path.join(folder, "trainer_state.json")):
        return Incomplete("trainer_state.json is missing", False)
    try:
        check_checkpoint_files(folder)
    except ValueError as e:
        return Incomplete(str(e).removeprefix("hf_megatrain: "), False)
    for rel in (f"{_OPTIMIZER_DIR}/meta.json", _SCHEDULER_NAME):
        if not allow_missing_state and not os.path.isfile(os.path.join(folder, rel)):
            note = stock_optimizer_note(folder) if rel != _SCHEDULER_NAME else ""
            # (The note names the file by its path: relative here, as the reason's other files.)
            note = note.replace(os.path.join(folder, ""), "", 1)
            return Incomplete(f"{rel} is missing{note}", True)
    # No manifest says their sizes: a truncated optimizer file is found by reading its header.
    if os.path.isfile(os.path.join(folder, _OPTIMIZER_DIR, "meta.json")):
        problem = optimizer_state_problem(folder)
        if problem is not None:
            return Incomplete(problem, True)
    return None


def _checkpoints(output_dir: str) -> list[str]:
    """``checkpoint-N`` folders of ``output_dir``, newest first."""
    if not os.path.isdir(output_dir):
        return []
    found = [
        (int(m.group(1)), e.path)
        for e in os.scandir(output_dir)
        if (m := _CHECKPOINT_RE.match(e.name)) and e.is_dir()
    ]
    return [path for _, path in sorted(found, reverse=True)]


def earlier_complete(checkpoint: str, allow_missing_state: bool) -> str | None:
    """The newest complete checkpoint beside ``checkpoint`` that is older than it (files and
    sizes against its manifest), None if there is none."""
    output_dir, name = os.path.split(os.path.abspath(checkpoint))
    step = _CHECKPOINT_RE.match(name)
    if step is None:
        return None
    older = [p for p in _checkpoints(output_dir) if _step_of(p) < int(step.group(1))]
    return next((p for p in older if checkpoint_problem(p, allow_missing_state) is None), None)


def _step_of(path: str) -> int:
    return int(os.path.basename(path).split("-")[1])


def checkpoints_after(output_dir: str, step: int) -> list[str]:
    """The ``checkpoint-N`` folders of ``output_dir`` with N above ``step``, complete or not."""
    return [p for p in _checkpoints(output_dir) if _step_of(p) > step]


def _way_on(problem: Incomplete) -> str:
    if problem.state_only:
        return (
            f"pass {_RESUME_FLAG} to resume with AdamW moments at zero and the learning-rate "
            "schedule restarted, or resume from a complete checkpoint"
        )
    return "resume from a complete checkpoint"


def newest_complete(output_dir: str, allow_missing_state: bool) -> tuple[str | None, list[str]]:
    """The newest complete checkpoint in ``output_dir`` and, one per newer incomplete one,
    ``"checkpoint-N (why)"``. Incomplete ones only: refused (training afresh would publish
    new checkpoints among them)."""
    skipped: list[str] = []
    usable = None  # the newest one that lacks only its optimizer state
    for path in _checkpoints(output_dir):
        problem = checkpoint_problem(path, allow_missing_state)
        if problem is None:
            return path, skipped
        skipped.append(f"{os.path.basename(path)} ({problem.reason})")
        if problem.state_only and usable is None:
            usable = os.path.basename(path)
    if skipped:
        way = (
            f"pass {_RESUME_FLAG} to resume from {usable} anyway (AdamW moments at zero, the "
            "learning-rate schedule restarted), or "
            if usable
            else "move them out of the way, or "
        )
        raise CLIError(
            f"{output_dir} holds no complete checkpoint: {', '.join(skipped)}; {way}pass a new "
            "--output_dir"
        )
    return None, []


def check_complete(checkpoint: str, allow_missing_state: bool) -> None:
    """Refuse an explicitly named checkpoint that cannot be resumed from, naming the file."""
    problem = checkpoint_problem(checkpoint, allow_missing_state)
    if problem is not None:
        raise CLIError(f"cannot resume from {checkpoint}: {problem.reason}; {_way_on(problem)}")


def resume_checkpoint(
    value: str | None, output_dir: str, allow_missing_state: bool = False
) -> tuple[str | None, list[str]]:
    """The checkpoint to resume from, and the newer incomplete ones skipped on the way.

    ``value`` None resumes from the newest complete ``checkpoint-N`` in ``output_dir`` if there
    is one (a re-run of a killed command continues it); "last" insists on one; anything else is
    a checkpoint folder, which must be complete.
    """
    from .cli_arguments import RESUME_LAST  # noqa: PLC0415

    if value is None or value.lower() in RESUME_LAST:
        # Publication is atomic (core/publish.py), but files can still go missing afterwards.
        last, skipped = newest_complete(output_dir, allow_missing_state)
        if last is None and value is not None:
            raise CLIError(f"--resume_from_checkpoint {value}: no checkpoint-N in {output_dir}")
        return last, skipped
    if not Path(value).is_dir():
        raise CLIError(f"--resume_from_checkpoint: no such checkpoint folder: {value}")
    if not (Path(value) / "trainer_state.json").is_file() and any(Path(value).iterdir()):
        inside = _checkpoints(value)
        hint = f"; the newest checkpoint in it is {inside[0]}" if inside else ""
        raise CLIError(
            f"--resume_from_checkpoint {value} is not a Trainer checkpoint (no "
            f"trainer_state.json){hint}"
        )
    check_complete(value, allow_missing_state)
    return value, []


__all__ = [
    "check_complete",
    "check_same_run",
    "checkpoint_problem",
    "checkpoints_after",
    "listed_files_problem",
    "newest_complete",
    "record_callback",
    "resume_checkpoint",
    "run_record",
    "saved_record",
]
