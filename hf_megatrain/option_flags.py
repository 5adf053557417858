"""Command-line flags generated from :class:`~hf_megatrain.core.options.EngineOptions`.

Every engine option field ``some_name`` is the flag ``--some-name``: bool fields take
``--some-name`` / ``--no-some-name``; the others take a value of the field's type. argparse
defaults are None, so a flag the user did not type leaves the options' own default (or a recipe's
value) in place. ``hf-megatrain train``, ``hf-megatrain plan``, the benchmarks and the recipes all
use these, so an option is never declared twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterable
from typing import Any

from .core.options import (
    ARGUMENT_PREFIX,
    EngineOptions,
    OptionError,
    field_types,
    option_value,
    value_type,
)


def flag_name(field: str) -> str:
    """``checkpoint_every`` -> ``--checkpoint-every``."""
    return "--" + field.replace("_", "-")


def flag_text(field: str, value: Any) -> str:
    """How the command line spells ``field=value`` (for advice and logs)."""
    if isinstance(value, bool):
        return flag_name(field) if value else "--no-" + field.replace("_", "-")
    return f"{flag_name(field)} {value}"


def flag_message(
    message: str, names: Iterable[str] | None = None, argument_flags: Iterable[str] = ()
) -> str:
    """An options message with option field names (``names``, default every engine option;
    bare or as training arguments, ``megatrain_x``) spelled as the command's flags: a switch as
    it is typed (``host_grads=False`` -> ``--no-host-grads``), ``x=v`` as ``--x v``, a bare
    mention as ``--x``; ``argument_flags`` (the Trainer's own, ``--max_grad_norm``): ``x=v`` as
    ``--x v``."""
    names = EngineOptions.field_names() if names is None else names
    for name in sorted(names, key=len, reverse=True):
        spelled = rf"\b(?:{ARGUMENT_PREFIX})?{name}"
        for value in (False, True):
            message = re.sub(rf"{spelled}={value}\b", flag_text(name, value), message)
        message = re.sub(rf"{spelled}=", f"{flag_name(name)} ", message)
        if "_" in name:  # (a one-word name is also an ordinary word; none inside a path)
            message = re.sub(rf"(?<![-/.]){spelled}\b(?![/.]\w)", flag_name(name), message)
    for name in sorted(argument_flags, key=len, reverse=True):
        message = re.sub(rf"\b{name}=", f"--{name} ", message)
    return message


def add_option_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
) -> list[str]:
    """Add one flag per engine option (``only`` those, less ``exclude``); return the names."""
    types = field_types()
    wanted = set(only) if only is not None else None
    names = []
    for f in dataclasses.fields(EngineOptions):
        if (wanted is not None and f.name not in wanted) or f.name in exclude:
            continue
        kind = value_type(types[f.name])
        text = f.metadata.get("help", "")
        kwargs: dict[str, Any] = {"dest": f.name, "default": None}
        # The help says the default unless its text already explains it.
        text = text if "Default" in text else f"{text} (default: {f.default})"
        kwargs["help"] = text.replace("%", "%%")  # argparse formats help with %
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            kwargs["metavar"] = f.name.split("_")[-1].upper() if kind is not str else "VALUE"
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
                kwargs.pop("metavar")
            if "bare_value" in f.metadata:
                kwargs["nargs"] = "?"
                kwargs["const"] = f.metadata["bare_value"]
        parser.add_argument(flag_name(f.name), **kwargs)
        names.append(f.name)
    return names


#: A help text that names its default already: "(default: X)", "Default: ...", "Default (None)".
_SAYS_DEFAULT = re.compile(r"\bdefault\s*[:(]|%\(default\)", re.IGNORECASE)


class DefaultOnceHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``ArgumentDefaultsHelpFormatter`` (HfArgumentParser's) that adds no "(default: ...)" to
    a help that already names its default: an engine flag's argparse default is None (so that
    an untyped flag keeps the options' own default), and its help says the options' default;
    the stock formatter printed "(default: True) (default: None)"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and _SAYS_DEFAULT.search(action.help):
            return action.help
        return super()._get_help_string(action)


def options_from_namespace(
    ns: argparse.Namespace, base: EngineOptions | None = None
) -> EngineOptions:
    """``base`` (default: the defaults) with every option flag the user typed applied."""
    changes = {
        name: getattr(ns, name)
        for name in EngineOptions.field_names()
        if getattr(ns, name, None) is not None
    }
    return dataclasses.replace(base or EngineOptions(), **changes)


def options_from_mapping(
    values: dict[str, Any], base: EngineOptions | None = None
) -> EngineOptions:
    """``base`` with the option fields of ``values`` (e.g. recipe YAML keys) applied, each read
    as :func:`~hf_megatrain.core.options.option_value` reads a config file's value; other keys
    are ignored (the caller decides whether they are errors)."""
    changes = {k: option_value(k, v) for k, v in values.items() if k in EngineOptions.field_names()}
    try:
        return dataclasses.replace(base or EngineOptions(), **changes)
    except OptionError:
        raise
    except (TypeError, ValueError) as e:
        raise OptionError(str(e)) from None


__all__ = [
    "DefaultOnceHelpFormatter",
    "add_option_arguments",
    "flag_name",
    "flag_text",
    "options_from_mapping",
    "options_from_namespace",
]
