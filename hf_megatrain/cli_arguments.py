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

from .cli_common import CLIError
from .core.options import EngineOptions, OptionError
from .option_flags import add_option_arguments, flag_name, options_from_mapping

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
            "help": "attention: sdpa (PyTorch's cuDNN / flash kernels), flex_attention, "
            "flash_attention_2 (needs flash-attn), eager; on CUDA, --attention auto (the "
            "default) runs sdpa or eager as flex_attention where the model soft-caps its "
            "attention or slides a window shorter than the rows (--attention model keeps this)",
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
    for action in parser._actions:
        if "--verify" in action.option_strings:
            # HfArgumentParser gives an Optional[bool] no bare form: "--verify" alone means yes.
            action.nargs, action.const = "?", True
    parser.set_defaults(**TRAIN_DEFAULTS)


def _type_of(parser: argparse.ArgumentParser, dest: str):
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return action.type
    raise KeyError(dest)


def _known_keys(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions if a.option_strings} | set(ALIASES)


def load_recipe(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """A recipe's keys as argument destinations (aliases resolved), unknown keys refused."""
    import yaml  # noqa: PLC0415 - PyYAML comes with transformers

    p = Path(path)
    if not p.is_file():
        raise CLIError(f"recipe file not found: {path}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise CLIError(f"recipe {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise CLIError(f"recipe {path} must be a mapping of argument: value")
    known = _known_keys(parser) - {"recipe", "help"}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name == "precision":  # the first CLI's key: auto | bf16 | fp32
            name, value = _PRECISION_KEYS.get(str(value).lower(), ("bf16", value))
        if name not in known:
            raise CLIError(
                f"recipe {path}: unknown key '{key}' (keys are the argument names of "
                "'hf-megatrain train --help', with underscores)"
            )
        if name in ALIASES:
            dest, const = ALIASES[name]
            name, value = dest, (value if const is None else (const if value else None))
            if value is None:
                continue
        out[name] = value
    return out


def _typed(argv: list[str], parser: argparse.ArgumentParser) -> set[str]:
    """Destinations of the flags typed in ``argv``."""
    typed = {t.split("=", 1)[0] for t in argv if t.startswith("-")}
    return {a.dest for a in parser._actions if typed.intersection(a.option_strings)}


def _refuse_opposite_flags(argv: list[str], parser: argparse.ArgumentParser) -> None:
    """A yes and a no for one setting both typed (--bf16 --fp32, --packing --no_packing):
    argparse would silently keep the last one. The same flag twice stays last-wins."""
    seen: dict[str, tuple[str, Any]] = {}
    for token in argv:
        flag = token.split("=", 1)[0]
        action = parser._option_string_actions.get(flag) if flag.startswith("--") else None
        if action is None or action.const is None:
            continue  # not a switch: a value flag, or not a flag at all
        first, const = seen.setdefault(action.dest, (flag, action.const))
        if const != action.const:
            raise CLIError(f"{first} and {flag} contradict each other: give only one of them")


def _coerce(parser: argparse.ArgumentParser, values: dict[str, Any]) -> dict[str, Any]:
    """Recipe values through the flags' own types (YAML reads 3e-4 as a string)."""
    by_dest = {a.dest: a for a in parser._actions if a.option_strings}
    out = {}
    for k, v in values.items():
        action = by_dest.get(k)
        kind = getattr(action, "type", None)
        if kind is not None and isinstance(v, str):
            try:
                v = kind(v)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                raise CLIError(f"{k}: invalid value {v!r}") from None
        elif kind in (int, float) and v is not None:
            if isinstance(v, bool) or (kind is int and float(v) != int(v)):
                raise CLIError(f"{k}: invalid value {v!r}")
            v = kind(v)
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
    try:
        training = MegaTrainArguments(**training_values, **as_arguments(engine))
    except (ValueError, OptionError) as e:
        raise CLIError(f"invalid training setting: {e}") from None
    return TrainSettings(model_args, data_args, training, engine, source)


def _build(cls: type, values: dict[str, Any]):
    kw = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.init and f.name in values}
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:
        raise CLIError(str(e).removeprefix("hf_megatrain: ")) from None


def flag_message(message: str) -> str:
    """An options message with field names spelled as this command's flags."""
    for name in sorted(EngineOptions.field_names(), key=len, reverse=True):
        message = message.replace(f"{name}=", f"{flag_name(name)} ")
    return message


def _check(model: ModelArguments, data, training: dict[str, Any]) -> None:
    """User mistakes found before anything is built (a large model takes minutes to load)."""
    import importlib.util  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from .hf.hub import looks_like_repo_id  # noqa: PLC0415

    if model.model_path and model.config:
        raise CLIError("give either --model_path (continue a checkpoint) or --config (random init)")
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
    strategy = training.get("eval_strategy", "no")
    if getattr(strategy, "value", strategy) != "no" and data.max_eval_sequences == 0:
        raise CLIError("--eval_strategy needs evaluation rows: --max_eval_sequences must be > 0")
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps"):
        if training.get(name, 1) < 1:
            raise CLIError(f"{name} must be at least 1")
    lr = training.get("learning_rate", 1.0)
    if lr <= 0 or not math.isfinite(lr):
        raise CLIError("learning_rate must be a positive number")
    if not 0.0 <= data.eval_fraction <= 0.5:
        raise CLIError("eval_fraction must be between 0 and 0.5")
    if training.get("max_steps", -1) == 0 or (
        training.get("max_steps", -1) < 0 and training.get("num_train_epochs", 1) <= 0
    ):
        raise CLIError("nothing to train: pass --max_steps N or --num_train_epochs > 0")
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
    if model.tokenizer is not None and not Path(model.tokenizer).exists():
        raise CLIError(f"tokenizer not found: {model.tokenizer}")
    if training.get("push_to_hub"):
        from huggingface_hub import constants  # noqa: PLC0415

        if constants.HF_HUB_OFFLINE:
            raise CLIError("--push_to_hub needs the Hub, but HF_HUB_OFFLINE is set")
    if not str(training.get("output_dir") or "").strip():
        raise CLIError("output_dir is empty: pass --output_dir FOLDER")
    out = Path(training["output_dir"])
    if out.exists() and not out.is_dir():
        raise CLIError(f"output_dir exists and is not a folder: {out}")
    # Made now, not by the Trainer after the model is built (minutes for a large one), and
    # checked writable: the run must not fail, or train for hours, with nowhere to save.
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"output_dir cannot be created: {out} ({e.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise CLIError(f"output_dir is not writable: {out}")


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
    "load_recipe",
    "parse_train_arguments",
]
