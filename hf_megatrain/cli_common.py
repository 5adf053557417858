"""What both ``hf-megatrain`` commands share: the one-line user error, logging, output on the
main process, and reading a bare config.json."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
from pathlib import Path


class CLIError(Exception):
    """A user mistake: reported as one line on stderr, exit status 1."""


class ShortErrors:
    """A parser mixin: no abbreviated flags (``--max_step`` is not ``--max_steps``), and an error
    as two lines (the problem, a pointer to --help), not the whole usage first (170 lines for
    ``train``); an unknown flag gets the closest known one as a suggestion."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        unknown = "unrecognized arguments: "
        if message.startswith(unknown):
            message = self._unknown_message(message.removeprefix(unknown).split())
        self.exit(2, f"{self.prog}: error: {message}\nsee {self.prog} --help\n")

    def _unknown_message(self, tokens: list[str]) -> str:
        flags = [t.split("=", 1)[0] for t in tokens if t.startswith("-")] or tokens
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(flags[0], known, n=1) if flags else []
        hint = f" (did you mean {close[0]}?)" if close else ""
        noun = "argument" if len(flags) == 1 else "arguments"
        return f"unrecognized {noun}: {' '.join(flags)}{hint}"


class Parser(ShortErrors, argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with :class:`ShortErrors`."""


def setup_logging() -> None:
    import transformers  # noqa: PLC0415

    transformers.logging.set_verbosity_warning()
    log = logging.getLogger("hf_megatrain")
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
    log.setLevel(logging.INFO)


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def say(msg: str) -> None:
    # Under a data-parallel launch every rank runs this code: one report, from rank 0.
    if is_main_process():
        print(msg, flush=True)


def config_from_json(path: str):
    from transformers import AutoConfig  # noqa: PLC0415

    from . import SUPPORTED_MODEL_TYPES  # noqa: PLC0415

    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CLIError(f"{path} is not valid JSON: {e}") from None
    model_type = d.pop("model_type", None) if isinstance(d, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CLIError(
            f"{path}: model_type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    layers = d.get("num_hidden_layers", d.get("n_layer"))
    if isinstance(layers, int) and layers < 1:
        raise CLIError(f"{path}: num_hidden_layers is {layers}; a model needs at least 1 layer")
    try:
        return AutoConfig.for_model(model_type, **d)
    except CONFIG_ERRORS as e:
        raise CLIError(f"{path}: invalid config: {error_summary(e)}") from None


def error_summary(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def _config_errors() -> tuple[type[BaseException], ...]:
    """What a config that transformers rejects raises (its strict validation: not a
    ValueError in huggingface_hub's own class)."""
    try:
        from huggingface_hub.errors import StrictDataclassError  # noqa: PLC0415
    except ImportError:
        return (TypeError, ValueError)
    return (TypeError, ValueError, StrictDataclassError)


CONFIG_ERRORS = _config_errors()
