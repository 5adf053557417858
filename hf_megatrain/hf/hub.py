"""A model given as a local folder or a Hugging Face Hub repo id, resolved to a local folder.

The Hugging Face cache is looked at first (no network); only a repo id that is not cached is
downloaded, and only when the Hub is not offline (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``).
Only what the loaders read is fetched: the config, the safetensors weights and the tokenizer
files (no ``.bin`` / ``.pt`` / ``.gguf`` copies, no subfolders).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: What a model folder needs: config, safetensors weights (and their index), tokenizer files.
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
]
#: Subfolders (onnx/, original/, ...) and Mistral's duplicate consolidated weights are not read.
IGNORE_PATTERNS = ["*/*", "consolidated*"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
_TRUE = {"1", "ON", "YES", "TRUE"}


class ModelNotFoundError(FileNotFoundError):
    """A model that is neither a local folder nor a usable Hub repo (message: one line)."""


def looks_like_repo_id(path_or_id: str) -> bool:
    """``org/name`` with Hub characters, and no such local path."""
    s = str(path_or_id)
    if os.path.exists(s) or ".." in s or s.endswith((".", "-")):
        return False
    return bool(_REPO_ID.match(s))


def hub_offline() -> bool:
    """Whether the Hub must not be reached: ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").upper() in _TRUE:
            return True
    try:
        from huggingface_hub import constants  # noqa: PLC0415
    except ImportError:  # pragma: no cover - a dependency of transformers
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def resolve_model_folder(path_or_id: str | os.PathLike, revision: str | None = None) -> str:
    """The local folder of a model given as a folder or a Hub repo id (``org/name``).

    An existing folder is returned as is. A repo id is taken from the Hugging Face cache when
    it is there, else downloaded (with progress) unless the Hub is offline. Raises
    :class:`ModelNotFoundError` (one line) for a path that does not exist and is no repo id, a
    repo id neither cached nor downloadable, or a repo without safetensors weights.
    """
    s = os.fspath(path_or_id)
    if os.path.isdir(s):
        return s
    if not looks_like_repo_id(s):
        raise ModelNotFoundError(
            f"hf_megatrain: model path not found (need a Hub-format checkpoint folder or a Hub "
            f"repo id such as Qwen/Qwen2.5-7B): {s}"
        )
    from huggingface_hub import snapshot_download  # noqa: PLC0415

    kwargs = dict(
        repo_id=s, revision=revision, allow_patterns=ALLOW_PATTERNS,
        ignore_patterns=IGNORE_PATTERNS,
    )  # fmt: skip
    at = f" (revision {revision})" if revision else ""
    try:
        folder = snapshot_download(**kwargs, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached, or an incomplete cached snapshot
        folder = None
    if folder is None:
        if hub_offline():
            raise ModelNotFoundError(
                f"hf_megatrain: {s}{at} is not a local folder and not in the Hugging Face cache, "
                "and the Hub is offline (HF_HUB_OFFLINE=1): download it first with "
                f"`huggingface-cli download {s}` or pass a local folder"
            )
        try:
            folder = snapshot_download(**kwargs)
        except Exception as e:  # noqa: BLE001 - any Hub failure: one line for the user
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelNotFoundError(
                f"hf_megatrain: {s}{at} is not a local folder and could not be downloaded from "
                f"the Hugging Face Hub ({type(e).__name__}: {first})"
            ) from e
    p = Path(folder)
    if not (p / "config.json").is_file():
        raise ModelNotFoundError(
            f"hf_megatrain: Hub repo {s}{at} has no config.json: not a transformers model"
        )
    if not any(p.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"hf_megatrain: Hub repo {s}{at} has no *.safetensors weights (only safetensors are "
            "read; .bin/.pt/.gguf are not)"
        )
    return str(p)
