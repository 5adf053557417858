"""The arguments of ``hf-megatrain train``: ``HfArgumentParser`` over the trainer's own dataclasses.

Flags come from three dataclasses and one options type, none re-declared here:

- :class:`ModelArguments` (what to train: a checkpoint or a config, tokenizer, attention) and the
  final check after training;
- :class:`~hf_megatrain.training_data.DataArguments` (a Hub dataset or local files, streaming,
  packing, sequence length);
- ``transformers.TrainingArguments``: every flag of the Trainer (``--report_to``,
  ``--save_steps``, ``--resume_from_checkpoint``, ``--eval_strategy``, ``--push_to_hub`` ...);
- :class:`~hf_megatrain.core.options.EngineOptions`: the engine's ``--<field-name>`` flags.

``--recipe FILE.yaml`` holds the same names as keys (TRL / axolotl style: a flat mapping); a flag
typed on the command line overrides it. A few short spellings of the embedded default's flags
(``--lr``, ``--batch-size``, ``--data``, ``--fp32`` ...) are aliases of the Trainer's names.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cli_common import CLIError, check_config_builds, config_from_json, world_size
from .core.options import EngineOptions, OptionError, option_value, switch_value
from .option_flags import (
    DefaultOnceHelpFormatter,
    add_option_arguments,
    flag_message,
    options_from_mapping,
)

#: ``--attn`` values: the model's ``attn_implementation``. flash_attention_2 only where the
#: optional flash-attn package is installed (it cannot be built on every machine).
ATTENTION_BACKENDS = ("sdpa", "flex_attention", "flash_attention_2", "eager")


@dataclass
class ModelArguments:
    """What to train, and the check after training."""

    model_path: str | None = field(
        default=None,
        metadata={
            "help": "Hub-format checkpoint folder, or a Hub repo id (org/name: the Hugging Face "
            "cache first, else downloaded unless HF_HUB_OFFLINE=1), to continue training"
        },
    )
    config: str | None = field(
        default=None,
        metadata={
            "help": "a model config.json (or a folder holding one) to train from random init "
            "(default: the bundled ~3M-parameter Llama-style config)"
        },
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "tokenizer.json file or tokenizer folder (default: the model's own, else the "
            "bundled one)"
        },
    )
    attn: str = field(
        default="sdpa",
        metadata={
            "help": "the model's attention implementation: sdpa (PyTorch's cuDNN / flash "
            "kernels), flex_attention, flash_attention_2 (needs flash-attn), eager. (A separate "
            "engine option, --attention, is 'auto' by default: on CUDA it runs sdpa or eager as "
            "flex_attention where the model soft-caps its attention or slides a window shorter "
            "than the rows; --attention model always keeps --attn's choice.)",
            "choices": list(ATTENTION_BACKENDS),
        },
    )
    verify: bool | None = field(
        default=None,
        metadata={
            "help": "after training, reload the saved model with from_pretrained and print its "
            "eval loss and a greedy sample (default: on below 2B parameters)"
        },
    )
    sample_prompt: str = field(
        default='The "if" statement',
        metadata={"help": "prompt of the greedy sample printed at the end"},
    )
    max_new_tokens: int = field(
        default=40, metadata={"help": "tokens of the greedy sample (0: no sample)"}
    )


#: The embedded default run (README's first command) where it differs from the Trainer's
#: defaults: a ~3M-parameter model trained in a few CPU minutes, checkpointing as it goes.
TRAIN_DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/hf-megatrain-default",
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 8,
    "max_steps": 500,
    "learning_rate": 3e-3,
    "warmup_steps": 20,
    "weight_decay": 0.1,
    "lr_scheduler_type": "cosine",
    "logging_steps": 10,
    "logging_first_step": True,
    "seed": 0,
    # Intermediate checkpoints by default (a killed run resumes from the last one); two kept
    # so that one complete checkpoint survives while the next is written.
    "save_strategy": "steps",
    "save_steps": 500,
    "save_total_limit": 2,
    "report_to": "none",
    # None: bf16 on a bf16-capable GPU, else fp32 (see text.use_bf16).
    "bf16": None,
}

#: Short spellings kept from the first CLI: alias -> (destination, constant or None).
ALIASES: dict[str, tuple[str, Any]] = {
    "lr": ("learning_rate", None),
    "batch_size": ("per_device_train_batch_size", None),
    "grad_accum": ("gradient_accumulation_steps", None),
    "lr_scheduler": ("lr_scheduler_type", None),
    "data": ("dataset_name", None),
    "max_eval_chunks": ("max_eval_sequences", None),
    "liger": ("use_liger_kernel", True),
    "fp32": ("bf16", False),
    "no_progress_bar": ("disable_tqdm", True),
    "no_verify": ("verify", False),
}

#: The first CLI's recipe key ``precision``: its value as (argument, value).
_PRECISION_KEYS = {
    "auto": ("bf16", None),
    "bf16": ("bf16", True),
    "fp32": ("bf16", False),
    "fp16": ("fp16", True),
}

#: ``--resume_from_checkpoint`` values that mean "the newest checkpoint in --output_dir".
RESUME_LAST = ("last", "true", "latest")


@dataclass
class TrainSettings:
    """Everything ``hf-megatrain train`` was told, parsed and checked."""

    model: ModelArguments
    data: Any  # training_data.DataArguments
    training: Any  # hf.arguments.MegaTrainArguments
    engine: EngineOptions
    #: Where each setting came from when not a default: "flag" or "recipe".
    source: dict[str, str] = field(default_factory=dict)


def _dataclasses() -> list[type]:
    from transformers import TrainingArguments  # noqa: PLC0415

    from .training_data import DataArguments  # noqa: PLC0415

    return [ModelArguments, DataArguments, TrainingArguments]


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Fill ``parser`` (an ``HfArgumentParser`` of :func:`_dataclasses`) with the rest."""
    parser.add_argument(
        "--recipe",
        metavar="FILE.yaml",
        help="YAML mapping of these arguments (underscored names, e.g. learning_rate: 1e-5); "
        "flags override it",
    )
    short = parser.add_argument_group("short spellings")
    for alias, (dest, const) in ALIASES.items():
        flag = "--" + alias.replace("_", "-")
        what = f"--{dest}" if const is None else f"--{dest} {const}"
        kw: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": f"= {what}"}
        if const is None:
            kw["type"] = _type_of(parser, dest)
        else:
            kw.update(action="store_const", const=const)
        short.add_argument(flag, **kw)
    add_option_arguments(parser.add_argument_group("engine options (memory tiers, long sequences)"))
    if issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter):
        parser.formatter_class = DefaultOnceHelpFormatter  # each default said once
    for action in parser._actions:
        if "--verify" in action.option_strings:
            # HfArgumentParser gives an Optional[bool] no bare form: "--verify" alone means yes.
            action.nargs, action.const = "?", True
    parser.set_defaults(**TRAIN_DEFAULTS)


def _action_of(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return action
    raise KeyError(dest)


def _type_of(parser: argparse.ArgumentParser, dest: str):
    return _action_of(parser, dest).type


def _as_typed(parser: argparse.ArgumentParser, dest: str, value: Any) -> Any:
    """A recipe value as its flag's type reads it (``_parsed``: YAML reads 1e-3 as text, 0.001
    as a float, both the same learning rate); booleans as they are."""
    return value if isinstance(value, bool) else _parsed(_action_of(parser, dest), str(value))


def _switch_names(parser: argparse.ArgumentParser) -> dict[str, tuple[str, Any]]:
    """Switches named other than their setting (``--no_packing`` sets ``packing`` False), as
    ``ALIASES`` entries: a recipe key ``no_packing: true`` is the flag typed."""
    names = {}
    for action in parser._actions:
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            for option in action.option_strings:
                name = option.lstrip("-").replace("-", "_")
                if name != action.dest:
                    names[name] = (action.dest, action.const)
    return names


def _unique_keys_loader():
    """PyYAML's safe loader, refusing a key given twice in one mapping (it keeps the last)."""
    import yaml  # noqa: PLC0415 - PyYAML comes with transformers

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # (<<: *base: merged by the safe loader, explicit keys first)
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key '{key}' is given twice", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep)

    return Loader


def load_recipe(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """A recipe's keys as argument destinations (aliases resolved), unknown keys refused, and
    two keys for one setting with different values refused (as two such flags are)."""
    import yaml  # noqa: PLC0415 - PyYAML comes with transformers

    p = Path(path)
    if not p.is_file():
        raise CLIError(f"recipe file not found: {path}")
    try:
        loader = _unique_keys_loader()  # (a SafeLoader)
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=loader) or {}
    except yaml.YAMLError as e:
        raise CLIError(f"recipe {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise CLIError(f"recipe {path} must be a mapping of argument: value")
    aliases = {**_switch_names(parser), **ALIASES}
    known = ({a.dest for a in parser._actions if a.option_strings} | set(aliases)) - {
        "recipe",
        "help",
    }
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # setting -> the key and value that set it, as written
    for key, value in data.items():
        written = f"{key}: {value}"
        name = str(key).replace("-", "_")
        if name == "precision":  # the first CLI's key: auto | bf16 | fp32
            name, value = _PRECISION_KEYS.get(str(value).lower(), ("bf16", value))
        if name not in known:
            raise CLIError(
                f"recipe {path}: unknown key '{key}' (keys are the argument names of "
                "'hf-megatrain train --help', with underscores)"
            )
        if name in aliases:
            dest, const = aliases[name]
            if const is not None:  # a switch (no_packing: true): on sets the constant
                on = switch_value(value)
                if on is None:  # (found by an audit: any non-empty text, 'false' too, was on)
                    raise CLIError(f"recipe {path}: '{written}' is a switch: give true or false")
                value = const if on else None
            name = dest
            if value is None:
                continue
        if name in given and _as_typed(parser, name, out[name]) != _as_typed(parser, name, value):
            raise CLIError(
                f"recipe {path}: '{given[name]}' and '{written}' set the same setting: give only "
                "one of them"
            )
        given[name] = written
        out[name] = value
    return out


def _typed(argv: list[str], parser: argparse.ArgumentParser) -> set[str]:
    """Destinations of the flags typed in ``argv``."""
    typed = {t.split("=", 1)[0] for t in argv if t.startswith("-")}
    return {a.dest for a in parser._actions if typed.intersection(a.option_strings)}


def _refuse_opposite_flags(argv: list[str], parser: argparse.ArgumentParser) -> None:
    """A yes and a no for one setting both typed (--bf16 --fp32, --packing --no_packing):
    argparse would silently keep the last one. Compared by the values they set, so flags that
    agree (--bf16 false --fp32) pass. The same flag twice stays last-wins."""
    seen: dict[str, list[tuple[Any, str, Any]]] = {}
    given: dict[str, list[tuple[str, str, str | None]]] = {}
    for i, token in enumerate(argv):
        flag = token.split("=", 1)[0]
        action = parser._option_string_actions.get(flag) if flag.startswith("--") else None
        if action is not None and not _is_switch(action) and action.nargs is None:
            # Two names of one value flag (--lr and --learning_rate, --data and --dataset_name)
            # with different values: which was meant is not known.
            value = (
                token.split("=", 1)[1] if "=" in token else next(iter(argv[i + 1 : i + 2]), None)
            )
            name = flag.lstrip("-").replace("-", "_")
            for other, first, before in given.setdefault(action.dest, []):
                if other != name and _parsed(action, before) != _parsed(action, value):
                    raise CLIError(
                        f"{first} {before} and {flag} {value} set the same setting: give only "
                        "one of them"
                    )
            given[action.dest].append((name, flag, value))
            continue
        if action is None or not _is_switch(action):
            continue  # a value flag, or not a flag at all
        value = _switch_value(action, flag, token, argv[i + 1 : i + 2])
        # One flag, however spelled (--no_packing, --no-packing); a BooleanOptionalAction is
        # two flags (--offload-activations, --no-offload-activations) in one action.
        same = (action, value) if isinstance(action, argparse.BooleanOptionalAction) else action
        for other, first, before in seen.setdefault(action.dest, []):
            if other != same and before != value:
                raise CLIError(f"{first} and {flag} contradict each other: give only one of them")
        seen[action.dest].append((same, flag, value))


def _parsed(action: argparse.Action, value: str | None) -> Any:
    """``value`` as the flag's type reads it (1e-3 and 0.001 agree); the text where it fails."""
    try:
        return action.type(value) if callable(action.type) and value is not None else value
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return value


def _is_switch(action: argparse.Action) -> bool:
    """A flag that can stand alone for a setting (--fp32, --packing, --no-offload-activations)."""
    return isinstance(action, argparse.BooleanOptionalAction) or action.const is not None


def _switch_value(action: argparse.Action, flag: str, token: str, rest: list[str]) -> Any:
    """The value that ``token`` (``rest``: the next token) sets, as argparse parses it."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return not flag.startswith("--no-")
    given = token.split("=", 1)[1] if "=" in token else None
    if given is None and action.nargs == "?" and rest and not rest[0].startswith("-"):
        given = rest[0]  # "--bf16 false": argparse takes the next token as the value
    if given is None:
        return action.const
    try:
        return action.type(given) if action.type is not None else given
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return given  # (argparse has refused it already)


def _coerce(parser: argparse.ArgumentParser, values: dict[str, Any]) -> dict[str, Any]:
    """Recipe values through the flags' own types (YAML reads 3e-4 as a string)."""
    by_dest = {a.dest: a for a in parser._actions if a.option_strings}
    out = {}
    for k, v in values.items():
        if k in EngineOptions.field_names():
            try:  # (the options' own reading: `auto_fit: off` is a YAML boolean)
                out[k] = option_value(k, v)
            except OptionError as e:
                raise CLIError(str(e)) from None
            continue
        action = by_dest.get(k)
        kind = getattr(action, "type", None)
        if kind in (int, float) and v is not None and not isinstance(v, str):
            if isinstance(v, bool) or (kind is int and float(v) != int(v)):
                raise CLIError(f"{k}: invalid value {v!r}")
            v = kind(v)
        elif kind is not None and isinstance(v, (str, int, float)):
            # Any other scalar as the text it was typed as: YAML reads `dataset_name: 2024` (a
            # folder) as an int, `resume_from_checkpoint: true` as a bool.
            try:
                v = kind(v if isinstance(v, str) else str(v))
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                raise CLIError(f"{k}: invalid value {v!r}") from None
        out[k] = v
    return out


def parse_train_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> TrainSettings:
    """Defaults < recipe < flags; then the three dataclasses and the engine options, checked."""
    import torch  # noqa: PLC0415

    from .hf.arguments import MegaTrainArguments, as_arguments  # noqa: PLC0415
    from .text import use_bf16  # noqa: PLC0415

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--recipe")
    recipe_path = pre.parse_known_args(argv)[0].recipe
    recipe = _coerce(parser, load_recipe(recipe_path, parser)) if recipe_path else {}
    if recipe:
        parser.set_defaults(**recipe)
    ns = parser.parse_args(argv)
    values = vars(ns)
    values.pop("recipe", None)
    _refuse_opposite_flags(argv, parser)
    typed = _typed(argv, parser)
    source = {k: "recipe" for k in recipe} | {k: "flag" for k in typed}

    engine_values = {k: values.pop(k) for k in EngineOptions.field_names()}
    try:
        # The recipe's engine keys are parser defaults by now: the namespace holds them.
        engine = options_from_mapping({k: v for k, v in engine_values.items() if v is not None})
    except OptionError as e:
        raise CLIError(flag_message(str(e))) from None

    if values.get("fp16"):
        raise CLIError(
            "fp16 is not supported: it needs a loss scaler the streamed engine does not run. "
            "Use --bf16 (bf16 compute with fp32 master weights and AdamW states) or --fp32."
        )
    if values["bf16"] is None:
        values["bf16"] = use_bf16("auto")
    if values.get("num_train_epochs") is not None and "num_train_epochs" in source:
        if "max_steps" not in source:
            values["max_steps"] = -1  # epochs asked for: the default step count no longer rules
    if not torch.cuda.is_available():
        values["use_cpu"] = True
        if values.get("use_liger_kernel"):
            raise CLIError(
                "use_liger_kernel: Liger-Kernel's Triton kernels need a CUDA GPU; drop --liger"
            )
        if engine.layer_kernels == "liger":
            raise CLIError(
                "--layer-kernels liger: Liger-Kernel's Triton kernels need a CUDA GPU; use auto"
            )

    model_cls, data_cls, training_cls = _dataclasses()
    model_args = _build(model_cls, values)
    data_args = _build(data_cls, values)
    training_values = {
        f.name: values[f.name]
        for f in dataclasses.fields(training_cls)
        if f.init and f.name in values
    }
    _check(model_args, data_args, training_values)
    if engine.plan_seq_len is not None and engine.plan_seq_len < data_args.seq_len:
        raise CLIError(
            f"--plan-seq-len {engine.plan_seq_len} is shorter than --seq_len "
            f"{data_args.seq_len}, the length of every row this command trains on: a plan for "
            "shorter rows does not hold for them (leave --plan-seq-len unset to plan for "
            "--seq_len, or give a longer length to plan for)"
        )
    from .hf.trainer import SHARDING_UNSUPPORTED  # noqa: PLC0415

    if training_values.get("deepspeed") or training_values.get("fsdp"):
        # (before TrainingArguments, which imports deepspeed and reads its JSON first)
        raise CLIError(flag_message(SHARDING_UNSUPPORTED))
    try:
        training = MegaTrainArguments(**training_values, **as_arguments(engine))
    except (ValueError, OptionError) as e:
        raise CLIError(f"invalid training setting: {e}") from None
    from .core.distributed import DataParallelError  # noqa: PLC0415
    from .hf.trainer import check_training_arguments  # noqa: PLC0415

    try:
        # What the trainer would refuse after the data and the model are loaded: now.
        check_training_arguments(training)
    except (ValueError, DataParallelError) as e:
        # (the Trainer's own arguments are this command's flags too: --max_grad_norm)
        trainer_flags = [f.name for f in dataclasses.fields(type(training))]
        message = str(e).removeprefix("hf_megatrain: ")
        raise CLIError(flag_message(message, argument_flags=trainer_flags)) from None
    return TrainSettings(model_args, data_args, training, engine, source)


def _build(cls: type, values: dict[str, Any]):
    kw = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.init and f.name in values}
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:
        raise CLIError(str(e).removeprefix("hf_megatrain: ")) from None


def _check(model: ModelArguments, data, training: dict[str, Any]) -> None:
    """User mistakes found before anything is built (a large model takes minutes to load)."""
    import importlib.util  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from .hf.hub import looks_like_repo_id  # noqa: PLC0415

    if model.model_path and model.config:
        raise CLIError("give either --model_path (continue a checkpoint) or --config (random init)")
    label_names = training.get("label_names")
    if label_names and list(label_names) != ["labels"]:
        raise CLIError(
            f"--label_names {' '.join(label_names)}: this command's rows carry their labels as "
            "'labels' (evaluation would find none); drop --label_names"
        )
    if model.attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise CLIError(
            "attn: flash_attention_2 needs the flash-attn package (CUDA; pip install "
            "'hf_megatrain[flash-attn]'); sdpa, the default, runs PyTorch's fused kernels"
        )
    if model.attn == "flex_attention" and not torch.cuda.is_available():
        raise CLIError(
            "attn: flex_attention has no backward on a CPU in PyTorch; use sdpa (the default) "
            "or eager here"
        )
    if data.seq_len < 2:
        raise CLIError("seq_len must be at least 2")
    _check_eval_rows(data, training)
    for name in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",  # (it failed in the final evaluate, after training)
        "gradient_accumulation_steps",
        "logging_steps",
    ):
        if training.get(name, 1) < 1:
            raise CLIError(f"{name} must be at least 1")
    for name in ("seed", "data_seed"):
        # numpy's seed range: the Trainer seeds numpy with it (a negative seed failed deep in
        # the data loader, as "could not read" the data).
        seed = training.get(name)
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise CLIError(f"{name} must be an integer from 0 to {MAX_SEED}, not {seed}")
    _check_report_to(training.get("report_to"))
    lr = training.get("learning_rate", 1.0)
    if lr <= 0 or not math.isfinite(lr):
        raise CLIError("learning_rate must be a positive number")
    if not 0.0 <= data.eval_fraction <= 0.5:
        raise CLIError("eval_fraction must be between 0 and 0.5")
    if training.get("max_steps", -1) == 0 or (
        training.get("max_steps", -1) < 0 and training.get("num_train_epochs", 1) <= 0
    ):
        raise CLIError("nothing to train: pass --max_steps N or --num_train_epochs > 0")
    if training.get("max_steps", -1) < -1:
        raise CLIError(
            f"max_steps must be a positive number of steps (or -1: train --num_train_epochs), "
            f"not {training['max_steps']}"
        )
    if training.get("max_steps", -1) <= 0 and data.streaming:
        raise CLIError("--streaming needs --max_steps: a stream has no length to count epochs by")
    if model.max_new_tokens < 0:
        raise CLIError("max_new_tokens must be >= 0")
    if model.model_path is not None and not looks_like_repo_id(model.model_path):
        # A Hub repo id (org/name, no such local path) is resolved when the model is loaded.
        p = Path(model.model_path)
        if p.is_file():
            raise CLIError(_model_path_is_a_file(p))
        if not p.is_dir():
            raise CLIError(
                f"model path not found (need a Hub-format checkpoint folder or a Hub repo id "
                f"such as Qwen/Qwen2.5-7B): {p}"
            )
        if not (p / "config.json").is_file():
            raise CLIError(f"{p} has no config.json: not a Hub-format checkpoint folder")
        if not any(p.glob("*.safetensors")):
            raise CLIError(f"{p} has no *.safetensors weights (only safetensors are read)")
        _check_weight_files(p)
    if model.config is not None:
        p = Path(model.config)
        if p.suffix in (".yaml", ".yml"):
            raise CLIError(
                f"--config takes a model config.json; a YAML of arguments goes to --recipe "
                f"{model.config}"
            )
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise CLIError(f"config file not found: {model.config}")
        model.config = str(p)
        # Read and built on meta now (a large config: seconds), not after the data is
        # tokenized: a bad size or any construction error is one line before any work.
        check_config_builds(config_from_json(model.config), model.config)
    if model.tokenizer is not None and not Path(model.tokenizer).exists():
        raise CLIError(f"tokenizer not found: {model.tokenizer}")
    if training.get("push_to_hub"):
        _check_hub_access(training.get("hub_token"))
    if not str(training.get("output_dir") or "").strip():
        raise CLIError("output_dir is empty: pass --output_dir FOLDER")
    out = Path(training["output_dir"])
    _check_name_length(out)
    if out.exists() and not out.is_dir():
        raise CLIError(f"output_dir exists and is not a folder: {out}")
    # Its parent made now, not by the Trainer after the model is built (minutes for a large
    # one), and checked writable: the run must not fail, or train for hours, with nowhere to
    # save. The folder itself is made once the run holds it (``cli_train.run_train``): a final
    # model's publish killed half way may have left it renamed aside, to be restored first.
    parent = out.absolute().parent
    # (Found by an audit: a file on the path read as "File exists".)
    blocking = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise CLIError(f"output_dir cannot be created: {out} ({blocking} is a file, not a folder)")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"output_dir cannot be created: {out} ({e.strerror})") from None
    if not os.access(out if out.exists() else parent, os.W_OK | os.X_OK):
        raise CLIError(f"output_dir is not writable: {out}")
    if (
        model.model_path is not None
        and Path(model.model_path).is_dir()  # (not a Hub repo id)
        and os.path.realpath(out) == os.path.realpath(model.model_path)
    ):
        raise CLIError(
            f"output_dir is the folder the model is loaded from ({model.model_path}): the "
            "trained model would overwrite the weights it starts from; pass another --output_dir"
        )


def _check_name_length(out: Path) -> None:
    """Refuses an output folder whose path has a name too long for its file system, or whose
    own name (its real path's: saves and the lock go beside that) leaves no room for the names
    staged beside it (``publish.STAGED_NAME_EXTRA`` bytes more): the run would train, then fail
    at its final save."""
    from .core.publish import STAGED_NAME_EXTRA  # noqa: PLC0415

    real = Path(os.path.realpath(out))
    parents = [p for p in real.parents if _exists(p)]
    try:
        name_max = os.pathconf(parents[0] if parents else "/", "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    name_max = name_max if name_max > 0 else 255
    longest = max(real.parts[1:] or [""], key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(longest)) > name_max:
        raise CLIError(
            f"output_dir has a name of {len(os.fsencode(longest))} bytes, past this file "
            f"system's {name_max}-byte limit: pass a shorter --output_dir name"
        )
    size = len(os.fsencode(real.name))
    if size + STAGED_NAME_EXTRA > name_max:
        raise CLIError(
            f"output_dir's name is {size} bytes: saves are staged beside it under names up to "
            f"{STAGED_NAME_EXTRA} bytes longer, past this file system's {name_max}-byte limit; "
            "pass a shorter --output_dir name"
        )


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except OSError:  # (a name too long for the file system)
        return False


#: The largest --seed / --data_seed: numpy's seeds are 32-bit.
MAX_SEED = 2**32 - 1


def _wants_eval(training: dict[str, Any]) -> str | None:
    """The flag that asks for evaluation rows (None: nothing does)."""
    strategy = training.get("eval_strategy", "no")
    strategy = getattr(strategy, "value", strategy)
    if strategy != "no":
        return f"--eval_strategy {strategy}"
    save = training.get("save_strategy")
    if getattr(save, "value", save) == "best":
        return "--save_strategy best"
    if training.get("load_best_model_at_end"):
        return "--load_best_model_at_end"
    if training.get("metric_for_best_model") is not None:
        return "--metric_for_best_model"
    return None


def _check_eval_rows(data, training: dict[str, Any]) -> None:
    """Evaluation asked for where the data can have no eval rows: the Trainer refused it only
    once the model was built ("didn't pass an eval_dataset")."""
    wants = _wants_eval(training)
    if wants is None:
        return
    if data.max_eval_sequences == 0:
        raise CLIError(f"{wants} needs evaluation rows: --max_eval_sequences must be > 0")
    name = data.dataset_name
    # Local files and the bundled corpus have one split (train): without --eval_fraction no
    # row is held out. A Hub dataset may have its own eval split: known once loaded.
    local = name is None or Path(name).expanduser().exists()
    if data.eval_fraction == 0 and data.dataset_eval_split is None and local:
        raise CLIError(
            f"{wants} needs evaluation rows, but --eval_fraction is 0 and "
            f"{name or 'the bundled corpus'} has no eval split: set --eval_fraction above 0 "
            "(e.g. 0.05), or --eval_strategy no"
        )


def _check_report_to(report_to: Any) -> None:
    """``--report_to`` against transformers' integrations (it refused an unknown name only
    once the model was built)."""
    from transformers.integrations.integration_utils import (  # noqa: PLC0415
        INTEGRATION_TO_CALLBACK,
    )

    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if names in (["all"], ["none"]):
        return
    for name in names:
        if name not in INTEGRATION_TO_CALLBACK:
            raise CLIError(
                f"--report_to {name}: not a known integration; choose from "
                f"{', '.join(INTEGRATION_TO_CALLBACK)}, or all or none"
            )


def _check_hub_access(hub_token: str | None) -> None:
    """--push_to_hub: the Hub reachable and a token at hand, checked as the dataset loader
    checks the Hub; the Trainer would find out with a traceback once the model is built."""
    from huggingface_hub import constants  # noqa: PLC0415

    from . import training_data  # noqa: PLC0415

    if constants.HF_HUB_OFFLINE:
        raise CLIError("--push_to_hub needs the Hub, but HF_HUB_OFFLINE is set")
    unreachable = training_data.hub_unreachable()
    if unreachable:
        raise CLIError(
            f"--push_to_hub needs the Hub, and {unreachable} (connect, or drop --push_to_hub "
            "and upload the saved folder later)"
        )
    import huggingface_hub  # noqa: PLC0415

    if not hub_token and not huggingface_hub.get_token():
        raise CLIError(
            "--push_to_hub needs a Hub token: run 'hf auth login', set HF_TOKEN, or pass "
            "--hub_token"
        )


def check_batch_size(batch: int, num_train_rows: int | None, world: int = 1) -> None:
    """Refuse a per-device batch larger than the training rows each process reads: every step
    would see all of them, not the batch (and the tokens per step) that was asked for.
    ``num_train_rows`` None (streaming): nothing to check."""
    if num_train_rows is None:
        return
    per_process = num_train_rows // max(world, 1)
    if batch > per_process:
        rows = f"{num_train_rows} training rows"
        if world > 1:
            rows += f" ({per_process} rows per process, {world} processes)"
        raise CLIError(
            f"--per_device_train_batch_size {batch} is more than the {rows}: a step would read "
            f"each row once, not {batch}; use at most {per_process}, or more data"
        )


def check_loaded_data(settings: TrainSettings, data: Any) -> None:
    """What can be checked only once the data is loaded (``data``: a ``TrainingData``), before
    the model is built: a batch beyond the rows, and evaluation asked for where a Hub dataset
    turned out to have no eval split (the Trainer refused that once the model was built)."""
    world = world_size()
    check_batch_size(settings.training.per_device_train_batch_size, data.num_train_rows, world)
    args = settings.training
    given_metric = "metric_for_best_model" in settings.source
    wants = _wants_eval(
        {
            "eval_strategy": args.eval_strategy,
            "save_strategy": args.save_strategy,
            "load_best_model_at_end": args.load_best_model_at_end,
            # Only a given one: the arguments set it themselves for some schedulers.
            "metric_for_best_model": args.metric_for_best_model if given_metric else None,
        }
    )
    if wants is not None and data.eval is None:
        raise CLIError(
            f"{wants} needs evaluation rows, but {settings.data.dataset_name or 'the data'} has no "
            "eval split and --eval_fraction is 0: set --eval_fraction above 0 (e.g. 0.05), "
            "name one with --dataset_eval_split, or --eval_strategy no"
        )


def _model_path_is_a_file(p: Path) -> str:
    """The message for a --model_path that names a file (it exists: "not found" would mislead)."""
    hint = ""
    if p.name == "config.json":
        # The likely intent: that folder, or random init from this config.
        hint = (
            f" (to continue that checkpoint: --model_path {p.parent}; to train from random "
            f"init with this config: --config {p})"
        )
    return (
        f"--model_path {p} is a file: it takes a Hub repo id (such as Qwen/Qwen2.5-7B) or a "
        f"checkpoint folder holding config.json and *.safetensors weights{hint}"
    )


def _check_weight_files(folder: Path) -> None:
    """``check_checkpoint_files``'s refusal as the CLI's one line."""
    from .hf.checkpoint import check_checkpoint_files  # noqa: PLC0415

    try:
        check_checkpoint_files(str(folder))
    except ValueError as e:
        raise CLIError(str(e).removeprefix("hf_megatrain: ")) from None


__all__ = [
    "ALIASES",
    "ATTENTION_BACKENDS",
    "ModelArguments",
    "TRAIN_DEFAULTS",
    "TrainSettings",
    "add_train_arguments",
    "check_batch_size",
    "check_loaded_data",
    "load_recipe",
    "parse_train_arguments",
]
