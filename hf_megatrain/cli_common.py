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
from typing import Any


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


def world_size() -> int:
    """Data-parallel processes of the launch (one per GPU; 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def say(msg: str) -> None:
    # Under a data-parallel launch every rank runs this code: one report, from rank 0.
    if is_main_process():
        print(msg, flush=True)


def config_from_json(path: str):
    from transformers import AutoConfig  # noqa: PLC0415

    from .hf.families import model_family, text_model_type, unsupported_model_type  # noqa: PLC0415

    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CLIError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict) or "model_type" not in d:
        # (Found by an audit: a list read as "model_type None is not supported".)
        what = "has no model_type" if isinstance(d, dict) else f"holds a {type(d).__name__}"
        raise CLIError(
            f"{path} is not a model config: it {what} (a config.json is a JSON object with a "
            '"model_type", as save_pretrained writes it)'
        )
    model_type = d.pop("model_type")
    if model_family(model_type) is None:
        text = text_model_type({**d, "model_type": model_type})
        raise CLIError(unsupported_model_type(path, model_type, "", text))
    layers = d.get("num_hidden_layers", d.get("n_layer"))
    if isinstance(layers, int) and layers < 1:
        raise CLIError(f"{path}: num_hidden_layers is {layers}; a model needs at least 1 layer")
    check_config_sizes(d, path)  # before the config divides by them (head_dim)
    # A field the family's config derives (a read-only property: Falcon's head_dim) cannot be
    # set: said before transformers logs the whole config and raises an AttributeError.
    derived = _derived_fields(model_type, d)
    if derived:
        raise CLIError(
            f"{path}: invalid config: {', '.join(derived)} cannot be set in a {model_type} "
            "config (the family's config derives it from the other fields)"
        )
    try:
        cfg = AutoConfig.for_model(model_type, **d)
    except (*CONFIG_ERRORS, ArithmeticError, AttributeError) as e:
        raise CLIError(f"{path}: invalid config: {error_summary(e)}") from None
    check_config_sizes(cfg, path)  # and the sizes it derives, under every alias
    return cfg


def _derived_fields(model_type: str, values: dict) -> list[str]:
    """The keys of ``values`` that ``model_type``'s config class derives (read-only
    properties), which it cannot take."""
    from transformers import CONFIG_MAPPING  # noqa: PLC0415

    cls = CONFIG_MAPPING[model_type]
    return [
        key
        for key in values
        if isinstance(getattr(cls, key, None), property) and getattr(cls, key).fset is None
    ]


#: Config sizes that must be at least 1 where set (None: the family's own default or derived).
#: A 0 or a negative one failed far from the config: a TypeError in the host store, a "negative
#: dimension" from torch.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "n_embd",
    "n_head",
    "n_inner",
    "n_positions",
)


def check_config_sizes(config: Any, where: str) -> None:
    """Refuse a size field of ``config`` (a config or its JSON dict) below 1, naming it."""
    from .hf.layer_configs import layer_values  # noqa: PLC0415

    for name in SIZE_FIELDS:
        if isinstance(config, dict):
            values = [config.get(name)]
        else:  # (every layer's where set per layer: Gemma 4's head widths)
            values = layer_values(config, name)
        for value in values:
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                raise CLIError(f"{where}: {name} is {value}; it must be at least 1")


def check_config_builds(config: Any, where: str) -> None:
    """Build ``config``'s model on ``meta`` (nothing allocated) and refuse one that cannot be
    built in one line, as ``plan`` does, instead of a traceback from inside transformers."""
    from .hf.model import UnsupportedModelError, meta_model  # noqa: PLC0415

    try:
        meta_model(config)
    except UnsupportedModelError as e:
        raise CLIError(f"{where}: {str(e).removeprefix('hf_megatrain: ')}") from None
    # meta_model lets these through (torch asserts a padding index within the vocabulary)
    except (ArithmeticError, LookupError, AttributeError, AssertionError) as e:
        raise CLIError(
            f"{where}: could not build {config.model_type} from this config: {error_summary(e)}"
        ) from None


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
