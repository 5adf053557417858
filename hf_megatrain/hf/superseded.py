"""Saves past the checkpoint a run resumes from, moved out of its way.

A run resumed from ``checkpoint-N`` continues from step N on its own course. Checkpoints past N
in its ``output_dir`` (and a final model saved past N) are what an earlier run did after N: left
where they are, the next resume (which takes the newest checkpoint) and ``save_total_limit``'s
rotation (which orders checkpoints by step number) take them for this run's. Found by an audit:
resumed by hand from checkpoint-20 beside a finished run's checkpoint-30 and -40, killed after
writing its own checkpoint-30, the rerun resumed from the other run's checkpoint-40, silently;
the stock Trainer does the same. They are moved, never deleted, into a folder of their own
(``_superseded-after-step-N``: a leading underscore, which the Trainer's Hub uploads skip),
laid out as an output_dir: its checkpoints can still be resumed from by hand.

The moves are journaled: the list goes into the new folder first (``MOVING.json``, each entry
with its device and inode), and a kill half way is finished by the next run's
``finish_pending_moves`` before it picks a checkpoint (a half-done move left the earlier run's
older later checkpoints to be resumed from; found by an audit), moving only the entries that
are still the ones listed.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import NamedTuple

from ..core.publish import MANIFEST_NAME, IntegrityError, fsync_dir, read_manifest

logger = logging.getLogger("hf_megatrain")

#: The Trainer's checkpoint folders (transformers.trainer_utils.PREFIX_CHECKPOINT_DIR).
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
SUPERSEDED_PREFIX = "_superseded-after-step-"
_JOURNAL = "MOVING.json"


def checkpoint_step(checkpoint: str) -> int | None:
    """The optimizer step ``checkpoint`` was saved at: its trainer state's ``global_step``, else
    its ``checkpoint-N`` name; None where neither says."""
    try:
        with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as f:
            step = json.load(f).get("global_step")
        if isinstance(step, int):
            return step
    except (OSError, ValueError, AttributeError):
        pass
    match = _CHECKPOINT_RE.match(os.path.basename(os.path.normpath(checkpoint)))
    return int(match.group(1)) if match else None


class LaterSaves(NamedTuple):
    """The saves of an output_dir past a step."""

    checkpoints: list[str]  # checkpoint-N folder names, N above the step (complete or not)
    model_files: list[str]  # a final model saved past the step: its files, its manifest last
    model_step: int | None  # the step that model was saved at (its manifest's saved_from)


def later_saves(output_dir: str, step: int) -> LaterSaves:
    """The saves in ``output_dir`` past ``step`` (see :class:`LaterSaves`)."""
    if not os.path.isdir(output_dir):
        return LaterSaves([], [], None)
    found = sorted(
        (int(m.group(1)), e.name)
        for e in os.scandir(output_dir)
        if (m := _CHECKPOINT_RE.match(e.name)) and e.is_dir(follow_symlinks=False)
    )
    checkpoints = [name for n, name in found if n > step]
    try:
        manifest = read_manifest(output_dir)
    except IntegrityError:
        manifest = None  # (unreadable: its files are the user's to judge, not a later save)
    saved_at = ((manifest or {}).get("saved_from") or {}).get("global_step")
    model: list[str] = []
    if isinstance(saved_at, int) and saved_at > step:
        listed = [n for n in manifest["files"] if os.sep not in n and "/" not in n]
        model = [n for n in listed if os.path.isfile(os.path.join(output_dir, n))]
        model.append(MANIFEST_NAME)
    return LaterSaves(checkpoints, model, saved_at if model else None)


def _free_name(output_dir: str, step: int) -> str:
    base = os.path.join(output_dir, f"{SUPERSEDED_PREFIX}{step}")
    path, n = base, 1
    while os.path.lexists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def _identity(path: str) -> list[int] | None:
    """What tells ``path``'s entry from one written under its name later (device and inode: a
    publish makes a new folder or file); None where nothing is there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return [st.st_dev, st.st_ino]


def _move(output_dir: str, aside: str, names: dict[str, list[int] | None]) -> None:
    """Move each named entry that is still the one the journal names (a run since may have
    written a new one under the name: found by an audit, a replay crashed on it or would have
    taken it) and not moved yet; then drop the journal."""
    for name, identity in names.items():
        source, target = os.path.join(output_dir, name), os.path.join(aside, name)
        if identity is not None and _identity(source) == identity and not os.path.lexists(target):
            os.rename(source, target)
    fsync_dir(aside)
    fsync_dir(output_dir)
    os.remove(os.path.join(aside, _JOURNAL))
    fsync_dir(aside)


def finish_pending_moves(output_dir: str) -> list[str]:
    """Finish the moves a kill interrupted in ``output_dir`` (their journals); returns the
    folders moved into. To call before choosing a checkpoint to resume from."""
    if not os.path.isdir(output_dir):
        return []
    done = []
    for entry in sorted(os.scandir(output_dir), key=lambda e: e.name):
        journal = os.path.join(entry.path, _JOURNAL)
        if not entry.name.startswith(SUPERSEDED_PREFIX) or not os.path.isfile(journal):
            continue
        try:
            with open(journal, encoding="utf-8") as f:
                names = {
                    n: identity
                    for n, identity in json.load(f)["names"].items()
                    if os.path.basename(n) == n
                }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # (written before its renames began: nothing of it was moved)
        _move(output_dir, entry.path, names)
        logger.warning(
            "hf_megatrain: finished moving %s's saves past step %s into %s (a kill had "
            "interrupted it)",
            output_dir,
            entry.name[len(SUPERSEDED_PREFIX) :],
            entry.path,
        )
        done.append(entry.path)
    return done


def set_aside_later_saves(output_dir: str, checkpoint: str) -> str | None:
    """Move the saves of ``output_dir`` past ``checkpoint``'s step (see the module docstring)
    into a new ``_superseded-after-step-N`` folder in it, with one log line; returns that
    folder, None where there was nothing to move. The journal first, then the checkpoints, then
    the final model's manifest before its files (a final model whose manifest lists files gone
    is never left)."""
    step = checkpoint_step(checkpoint)
    if step is None:
        return None
    finish_pending_moves(output_dir)
    checkpoints, model, model_step = later_saves(output_dir, step)
    if not checkpoints and not model:
        return None
    aside = _free_name(output_dir, step)
    os.makedirs(aside)
    order = checkpoints + [MANIFEST_NAME] * bool(model) + [n for n in model if n != MANIFEST_NAME]
    names = {n: _identity(os.path.join(output_dir, n)) for n in order}  # (in order: dicts keep it)
    journal = os.path.join(aside, _JOURNAL)
    with open(journal + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"step": step, "names": names}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(journal + ".tmp", journal)
    fsync_dir(aside)
    _move(output_dir, aside, names)
    moved = checkpoints + [f"the final model of step {model_step}"] * bool(model)
    logger.warning(
        "hf_megatrain: resuming from %s (step %d) while %s holds saves past that step (%s), which "
        "the next resume and save_total_limit's rotation would take for this run's: moved, not "
        "deleted, to %s (delete it if you do not need them)",
        checkpoint,
        step,
        output_dir,
        ", ".join(moved),
        aside,
    )
    return aside


__all__ = [
    "SUPERSEDED_PREFIX",
    "LaterSaves",
    "checkpoint_step",
    "finish_pending_moves",
    "later_saves",
    "set_aside_later_saves",
]
