"""``MegaTrainArguments``: ``TrainingArguments`` plus one ``megatrain_<field>`` per engine option.

The fields are generated from :class:`~hf_megatrain.core.options.EngineOptions` (name, type,
default, help): nothing here re-declares an option. :func:`engine_options` is the one place that
reads them back from any ``TrainingArguments`` (a plain one, TRL's configs: defaults where a field
is absent).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import TrainingArguments

from ..core.options import ARGUMENT_PREFIX, EngineOptions, OptionError, field_types
from ..core.plan_types import OptionNamer

#: Prefix of the engine options among the training arguments.
PREFIX = ARGUMENT_PREFIX


def argument_name(field: str) -> str:
    """``checkpoint_every`` -> ``megatrain_checkpoint_every``."""
    return PREFIX + field


def argument_text(field: str, value: Any) -> str:
    """How a ``TrainingArguments`` user spells ``field=value`` (for advice and errors)."""
    return f"{argument_name(field)}={value!r}"


#: Plan advice and problems as a ``TrainingArguments`` user writes them.
ARGUMENT_NAMER = OptionNamer(
    setting=argument_text, option=argument_name, clipping_off="max_grad_norm=0"
)


def _generated_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    types = field_types()
    out = []
    for f in dataclasses.fields(EngineOptions):
        # Only what HfArgumentParser passes to argparse: help (and choices).
        meta = {k: v for k, v in f.metadata.items() if k in ("help", "choices")}
        if "help" in meta:
            meta["help"] = meta["help"].replace("%", "%%")  # argparse formats help with %
        out.append(
            (
                argument_name(f.name),
                types[f.name],
                dataclasses.field(default=f.default, metadata=meta),
            )
        )
    return out


def _post_init(self) -> None:
    super(MegaTrainArguments, self).__post_init__()
    engine_options(self)  # an invalid engine option fails here, naming the argument


MegaTrainArguments = dataclasses.make_dataclass(
    "MegaTrainArguments",
    _generated_fields(),
    bases=(TrainingArguments,),
    namespace={
        "__doc__": """Training arguments for :class:`HFMegaTrainer`: ``TrainingArguments`` plus a
    ``megatrain_<field>`` argument for every field of
    :class:`hf_megatrain.core.options.EngineOptions` (same default and help).

    Precision: ``bf16=True`` streams bf16 weights and computes under bf16 autocast with fp32
    master weights and fp32 AdamW states; without it everything is fp32. ``fp16`` is refused.
    """,
        "__module__": __name__,
        "__post_init__": _post_init,
    },
)


def as_arguments(options: EngineOptions) -> dict[str, Any]:
    """``options`` as ``MegaTrainArguments`` keywords (``megatrain_<field>=value``)."""
    return {argument_name(n): getattr(options, n) for n in EngineOptions.field_names()}


def engine_options(args: TrainingArguments) -> EngineOptions:
    """The engine options of ``args`` (the defaults for fields it does not have)."""
    values = {
        name: getattr(args, argument_name(name))
        for name in EngineOptions.field_names()
        if hasattr(args, argument_name(name))
    }
    try:
        return EngineOptions(**values)
    except OptionError as e:
        raise OptionError(f"hf_megatrain: {in_argument_names(str(e))}") from None


def in_argument_names(message: str) -> str:
    """An options message with field names spelled as training arguments."""
    for name in sorted(EngineOptions.field_names(), key=len, reverse=True):
        message = message.replace(f"{name}=", f"{PREFIX}{name}=")
    return message.replace(f"{PREFIX}{PREFIX}", PREFIX)


__all__ = [
    "MegaTrainArguments",
    "argument_name",
    "argument_text",
    "as_arguments",
    "engine_options",
    "in_argument_names",
]
