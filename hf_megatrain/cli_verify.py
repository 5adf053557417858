"""``hf-megatrain verify PATH``: check a saved model or checkpoint against its manifest.

Exit status 0 and one ``OK`` line when every file listed in ``megatrain_manifest.json`` is present
with its size and sha256 (then a line naming the subfolders with manifests of their own, such as
a run's checkpoint-N beside its final model: each verified on its own); 1 with one
``hf-megatrain: error: ...`` line naming the first bad file; 2 when the folder has no manifest
(saved by an older version or not by hf_megatrain: nothing could be verified).
"""

from __future__ import annotations

import argparse
import os

from .cli_common import CLIError, say
from .core.publish import MANIFEST_NAME, IntegrityError, aside_path, verify_folder

#: Exit status of ``verify`` for a folder without a manifest.
NO_MANIFEST = 2


def add_verify_parser(sub) -> None:
    v = sub.add_parser(
        "verify",
        help="check a saved model or checkpoint folder against its manifest (sizes, sha256)",
        description="Check every file listed in PATH/megatrain_manifest.json: present, of the "
        "listed size and sha256. Exit status 0: all intact; 1: a file is missing, truncated or "
        "corrupt (named); 2: PATH has no manifest (nothing verified).",
    )
    v.add_argument("path", help="a folder written by hf_megatrain (save_model, checkpoint-N)")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


def run_verify(ns: argparse.Namespace) -> int:
    path = os.path.abspath(ns.path)
    if not os.path.exists(path) and os.path.isdir(aside_path(path)):
        raise CLIError(
            f"{path} is missing: a save over it was interrupted and left the previous version "
            f"at {aside_path(path)} (the next save or resume restores it)"
        )
    try:
        result = verify_folder(path)
    except (IntegrityError, FileNotFoundError) as e:
        raise CLIError(str(e).removeprefix("hf_megatrain: ")) from None
    if not result.manifest:
        say(f"hf-megatrain: {path}: no manifest ({MANIFEST_NAME}): nothing verified")
        return NO_MANIFEST
    extra = f", {result.unlisted} other files not in the manifest" if result.unlisted else ""
    say(f"hf-megatrain: OK {path}: {result.files} files, {_size(result.bytes)} verified{extra}")
    if result.nested:
        say(_nested_note(path, result.nested))
    return 0


def _nested_note(path: str, nested: list[str]) -> str:
    """Subfolders with their own manifest (a run's checkpoint-N): named, and how to verify
    them. Not verified here: a checkpoint holds the optimizer state, several times the model."""
    last = os.path.join(path, nested[-1])
    if len(nested) == 1:
        return (
            f"hf-megatrain: not verified here: {nested[0]}, a folder with its own manifest "
            f"(verify it with: hf-megatrain verify {last})"
        )
    shown = ", ".join(nested[:3]) + (f" and {len(nested) - 3} more" if len(nested) > 3 else "")
    return (
        f"hf-megatrain: not verified here: {len(nested)} folders with their own manifests "
        f"({shown}); verify each with: hf-megatrain verify {last}"
    )
