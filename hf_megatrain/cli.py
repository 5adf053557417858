"""``hf-megatrain``: the command line.

``hf-megatrain train`` with no argument trains the embedded default (a ~3M-parameter Llama-style
model on bundled English text, with a bundled BPE tokenizer) through :class:`HFMegaTrainer`, saves
a Hugging Face checkpoint, reloads it with ``AutoModelForCausalLM.from_pretrained`` and prints its
eval loss and a greedy sample. Every setting can come from a recipe YAML (``--recipe``) and be
overridden by a flag; user mistakes end in one ``hf-megatrain: error: ...`` line, not a traceback.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import os
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .cli_common import CLIError
from .cli_common import config_from_json as _config_from_json
from .cli_common import is_main_process as _is_main_process
from .cli_common import say as _say
from .cli_common import setup_logging as _setup_logging
from .cli_plan import add_plan_parser as _add_plan_parser
from .cli_plan import run_plan as run_plan
from .cli_verify import add_verify_parser as _add_verify_parser
from .cli_verify import run_verify as run_verify
from .core.options import EngineOptions, OptionError
from .option_flags import add_option_arguments, options_from_mapping
from .text import DATA_DIR as DATA_DIR
from .text import DEFAULT_CONFIG as DEFAULT_CONFIG
from .text import DEFAULT_CORPUS as DEFAULT_CORPUS
from .text import DEFAULT_TOKENIZER as DEFAULT_TOKENIZER
from .text import DataError, build_chunks, has_tokenizer_files, read_texts, split_chunks, use_bf16
from .text import load_tokenizer as _load_tokenizer_file

#: ``--attn`` values: the model's ``attn_implementation``. flash_attention_2 only where the
#: optional flash-attn package is installed (it cannot be built on every machine).
ATTENTION_BACKENDS = ("sdpa", "flex_attention", "flash_attention_2", "eager")

# Models above this size are not reloaded for the final check unless asked: a second full fp32
# copy in host RAM next to the host store could exhaust it.
_AUTO_VERIFY_MAX_PARAMS = 2_000_000_000


@dataclass
class TrainOptions:
    """Every setting of ``hf-megatrain train``; recipe YAML keys are these field names and the
    engine option fields (:class:`~hf_megatrain.core.options.EngineOptions`)."""

    model_path: str | None = None  # checkpoint folder or Hub repo id (continued training)
    config: str | None = None  # a config.json: random init (default: the bundled one)
    tokenizer: str | None = None  # tokenizer.json or a folder (default: model's, else bundled)
    data: str | None = None  # text file or folder of .txt (default: bundled corpus)
    output_dir: str = "outputs/hf-megatrain-default"
    seq_len: int = 128
    batch_size: int = 8
    grad_accum: int = 1
    max_steps: int = 500
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    lr_scheduler: str = "cosine"
    precision: str = "auto"  # auto (bf16 on a bf16-capable GPU, else fp32) | bf16 | fp32
    eval_fraction: float = 0.05
    max_eval_chunks: int = 64
    logging_steps: int = 10
    seed: int = 0
    sample_prompt: str = 'The "if" statement'
    max_new_tokens: int = 40
    verify: bool | None = None  # None: reload and check unless the model is very large
    progress_bar: bool = True
    attn: str = "sdpa"  # one of ATTENTION_BACKENDS
    liger: bool = False  # Liger-Kernel's fused RMSNorm / RoPE / SwiGLU (CUDA; use_liger_kernel)
    # The engine's options (``--<field-name>`` flags, recipe keys of the same names).
    engine: EngineOptions = field(default_factory=EngineOptions)
    # Filled in by the CLI (not recipe keys).
    source: dict[str, str] = field(default_factory=dict, repr=False)


_OPTION_NAMES = {f.name for f in fields(TrainOptions)} - {"source", "engine"}
_ENGINE_NAMES = set(EngineOptions.field_names())


# ---- argument parsing ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-megatrain",
        description="Train decoder LLMs larger than the GPU with hf_megatrain.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    t = sub.add_parser(
        "train",
        help="train a model (no argument: the embedded CPU-sized default)",
        description="Train with HFMegaTrainer. Precedence: flags > --recipe YAML > defaults. "
        "With no argument: a ~3M-parameter Llama-style model on bundled text, a few minutes "
        "on a laptop CPU.",
    )
    # Every default is None so that only flags the user typed override the recipe.
    g = t.add_argument_group("what to train")
    g.add_argument("--recipe", help="YAML file whose keys are these options (recipes/*.yaml)")
    src = g.add_mutually_exclusive_group()
    src.add_argument(
        "--model-path",
        help="Hub-format checkpoint folder, or a Hub repo id (org/name: the Hugging Face cache "
        "first, else downloaded unless HF_HUB_OFFLINE=1), to continue training",
    )
    src.add_argument("--config", help="model config.json to train from random init")
    g.add_argument("--tokenizer", help="tokenizer.json file or tokenizer folder")
    g.add_argument("--data", help="a text file, or a folder of .txt files (searched recursively)")
    g.add_argument("--output-dir", help="where the final checkpoint is written")

    h = t.add_argument_group("hyper-parameters")
    h.add_argument("--seq-len", type=int, help="tokens per training sequence")
    h.add_argument("--batch-size", type=int, help="sequences per micro-batch")
    h.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    h.add_argument("--max-steps", type=int, help="optimizer steps")
    h.add_argument("--lr", type=float, help="peak learning rate")
    h.add_argument("--warmup-steps", type=int)
    h.add_argument("--weight-decay", type=float)
    h.add_argument("--max-grad-norm", type=float)
    h.add_argument("--lr-scheduler", help="Trainer lr_scheduler_type (cosine, linear, ...)")
    h.add_argument("--eval-fraction", type=float, help="share of chunks held out (0 to 0.5)")
    h.add_argument("--max-eval-chunks", type=int, help="cap on held-out sequences evaluated")
    h.add_argument("--seed", type=int)

    p = t.add_argument_group("precision (bf16: bf16 compute, fp32 masters and AdamW states)")
    prec = p.add_mutually_exclusive_group()
    prec.add_argument("--bf16", dest="precision", action="store_const", const="bf16")
    prec.add_argument("--fp32", dest="precision", action="store_const", const="fp32")
    # Accepted only to refuse it with an explanation instead of "unrecognized argument".
    prec.add_argument("--fp16", dest="precision", action="store_const", const="fp16",
                      help=argparse.SUPPRESS)  # fmt: skip

    o = t.add_argument_group("output")
    o.add_argument("--logging-steps", type=int)
    o.add_argument("--sample-prompt", help="prompt of the greedy sample printed at the end")
    o.add_argument("--max-new-tokens", type=int)
    o.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reload the checkpoint with from_pretrained, print its eval loss and a sample "
        "(default: on below 2B parameters)",
    )
    o.add_argument("--no-progress-bar", dest="progress_bar", action="store_const", const=False)
    e = t.add_argument_group("model")
    e.add_argument(
        "--attn",
        help="attention: sdpa (default: cuDNN / flash kernels of PyTorch), flex_attention, "
        "flash_attention_2 (needs flash-attn), eager",
    )
    e.add_argument(
        "--liger",
        action="store_const",
        const=True,
        help="Liger-Kernel's fused RMSNorm / RoPE / SwiGLU Triton kernels (the Trainer's "
        "use_liger_kernel; CUDA, pip install 'hf_megatrain[liger]')",
    )
    add_option_arguments(t.add_argument_group("engine options (memory tiers, long sequences)"))
    _add_plan_parser(sub)
    _add_verify_parser(sub)
    return parser


def _load_recipe(path: str) -> dict[str, Any]:
    import yaml  # noqa: PLC0415 - PyYAML comes with transformers

    p = Path(path)
    if not p.is_file():
        raise CLIError(f"recipe file not found: {path}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise CLIError(f"recipe {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise CLIError(f"recipe {path} must be a mapping of option: value")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        # Recipes may spell precision as a flag, like the command line does.
        if name in ("bf16", "fp32", "fp16"):
            if value:
                out["precision"] = name
            continue
        if name not in _OPTION_NAMES and name not in _ENGINE_NAMES:
            known = ", ".join(sorted(_OPTION_NAMES | _ENGINE_NAMES))
            raise CLIError(f"recipe {path}: unknown key '{key}'. Known keys: {known}")
        out[name] = value
    return out


def resolve_options(ns: argparse.Namespace) -> TrainOptions:
    """Merge defaults < recipe < flags, coerce types, and validate values."""
    opts = TrainOptions()
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}
    if ns.recipe:
        for k, v in _load_recipe(ns.recipe).items():
            merged[k] = v
            source[k] = "recipe"
    for name in _OPTION_NAMES | _ENGINE_NAMES:
        v = getattr(ns, name, None)
        if v is not None:
            merged[name] = v
            source[name] = "flag"
    if merged.get("model_path") and merged.get("config"):
        raise CLIError("give either model_path (continue a checkpoint) or config (random init)")
    for f in fields(TrainOptions):
        if f.name not in merged:
            continue
        value = merged[f.name]
        default = getattr(opts, f.name)
        try:
            if value is None or f.name in ("verify",):
                pass
            elif isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ValueError
            elif isinstance(default, int):
                if isinstance(value, bool) or float(value) != int(float(value)):
                    raise ValueError
                value = int(float(value))
            elif isinstance(default, float):
                value = float(value)  # YAML reads "3e-4" as a string
            else:
                value = str(value)
        except (TypeError, ValueError):
            raise CLIError(f"{f.name}: invalid value {value!r}") from None
        setattr(opts, f.name, value)
    try:
        opts.engine = options_from_mapping(merged)
    except OptionError as e:
        raise CLIError(_flag_message(str(e))) from None
    opts.source = source
    _validate(opts)
    return opts


def _flag_message(message: str) -> str:
    """An options message with field names spelled as this command's flags."""
    for name in sorted(_ENGINE_NAMES, key=len, reverse=True):
        message = message.replace(f"{name}=", f"--{name.replace('_', '-')} ")
    return message


def _validate(opts: TrainOptions) -> None:
    if opts.attn not in ATTENTION_BACKENDS:
        raise CLIError(f"attn: {opts.attn!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if opts.attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise CLIError(
            "attn: flash_attention_2 needs the flash-attn package (CUDA; pip install "
            "'hf_megatrain[flash-attn]'); sdpa, the default, runs PyTorch's fused kernels"
        )
    prec = opts.precision.lower()
    if prec == "fp16":
        raise CLIError(
            "fp16 is not supported: it needs a loss scaler the streamed engine does not run. "
            "Use --bf16 (bf16 compute with fp32 master weights and AdamW states) or --fp32."
        )
    if prec not in ("auto", "bf16", "fp32"):
        raise CLIError(f"precision must be auto, bf16 or fp32 (got {opts.precision!r})")
    opts.precision = prec
    for name in ("seq_len", "batch_size", "grad_accum", "max_steps", "logging_steps"):
        if getattr(opts, name) < 1:
            raise CLIError(f"{name.replace('_', '-')} must be at least 1")
    if opts.seq_len < 2:
        raise CLIError("seq-len must be at least 2")
    if opts.lr <= 0 or not math.isfinite(opts.lr):
        raise CLIError("lr must be a positive number")
    if not 0.0 <= opts.eval_fraction <= 0.5:
        raise CLIError("eval-fraction must be between 0 and 0.5")
    if opts.warmup_steps < 0 or opts.max_new_tokens < 0 or opts.max_eval_chunks < 1:
        raise CLIError("warmup-steps and max-new-tokens must be >= 0, max-eval-chunks >= 1")
    if opts.model_path is not None and not _is_hub_repo_id(opts.model_path):
        # A Hub repo id (org/name, no such local path) is resolved when the model is loaded:
        # from the Hugging Face cache, else downloaded (hf/hub.py checks its files then).
        p = Path(opts.model_path)
        if not p.is_dir():
            raise CLIError(
                f"model path not found (need a Hub-format checkpoint folder or a Hub repo id "
                f"such as Qwen/Qwen2.5-7B): {p}"
            )
        if not (p / "config.json").is_file():
            raise CLIError(f"{p} has no config.json: not a Hub-format checkpoint folder")
        if not any(p.glob("*.safetensors")):
            raise CLIError(f"{p} has no *.safetensors weights (only safetensors are read)")
    if opts.config is not None:
        p = Path(opts.config)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise CLIError(f"config file not found: {opts.config}")
        opts.config = str(p)
    if opts.tokenizer is not None and not Path(opts.tokenizer).exists():
        raise CLIError(f"tokenizer not found: {opts.tokenizer}")
    if opts.data is not None and not Path(opts.data).exists():
        raise CLIError(f"data not found: {opts.data}")
    out = Path(opts.output_dir)
    if out.exists() and not out.is_dir():
        raise CLIError(f"output-dir exists and is not a folder: {opts.output_dir}")
    # Made now, not by the Trainer after the model is built (minutes for a large one), and
    # checked writable: the run must not fail, or train for hours, with nowhere to save.
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"output-dir cannot be created: {opts.output_dir} ({e.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise CLIError(f"output-dir is not writable: {opts.output_dir}")


# ---- model and tokenizer ------------------------------------------------------------------------
def _is_hub_repo_id(path: str) -> bool:
    from .hf.hub import looks_like_repo_id  # noqa: PLC0415

    return looks_like_repo_id(path)


def _model_folder(opts: TrainOptions) -> str:
    """The local folder of --model-path: itself, or a Hub repo id's cached (or downloaded)
    snapshot; both the tokenizer and the weights come from it."""
    from .hf.hub import ModelNotFoundError, resolve_model_folder  # noqa: PLC0415

    try:
        return resolve_model_folder(opts.model_path)
    except ModelNotFoundError as e:
        raise CLIError(str(e).removeprefix("hf_megatrain: ")) from None


def load_tokenizer(opts: TrainOptions):
    """The run's tokenizer: --tokenizer, else the model's own, else the bundled one."""
    if opts.tokenizer is not None:
        return _load_tokenizer_file(opts.tokenizer)
    if opts.model_path is not None:
        folder = _model_folder(opts)
        if not has_tokenizer_files(folder):
            raise CLIError(
                f"{opts.model_path} has no tokenizer files: pass --tokenizer (the bundled one "
                "does not match a pretrained model's vocabulary)"
            )
        return _load_tokenizer_file(folder)
    if opts.config is not None and (Path(opts.config).parent / "tokenizer.json").is_file():
        return _load_tokenizer_file(Path(opts.config).parent)
    return _load_tokenizer_file(None)


def _loader_arguments(opts: TrainOptions, bf16: bool) -> dict:
    """What both streamed loaders take: the run's engine options and, for the memory plan, its
    step (the micro-batch split) and clipping, as the trainer would pass them."""
    from .core.options import StepShape  # noqa: PLC0415
    from .hf.long_context import liger_layer_kernel_arguments  # noqa: PLC0415

    step = None
    if opts.engine.resident_layers != "0":
        step = StepShape(opts.seq_len, opts.batch_size * opts.seq_len, opts.grad_accum)
    return dict(
        options=opts.engine,
        bf16=bf16,
        attn_implementation=opts.attn,
        step=step,
        clipping=opts.max_grad_norm > 0,
        # The plan must know about Liger's kernels as the trainer will.
        **liger_layer_kernel_arguments(opts.liger),
    )


def build_model(opts: TrainOptions, tokenizer, bf16: bool):
    """The model in streamed form: loaded into the host store, or random init then streamed."""
    import torch  # noqa: PLC0415
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    from . import SUPPORTED_MODEL_TYPES, load_streamed_model  # noqa: PLC0415

    if opts.model_path is not None:
        folder = _model_folder(opts)
        cfg = AutoConfig.from_pretrained(folder, local_files_only=True)
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise CLIError(
                f"{opts.model_path}: model_type {cfg.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _check_vocab(cfg, tokenizer)
        return load_streamed_model(folder, **_loader_arguments(opts, bf16))
    cfg = _config_from_json(opts.config or str(DEFAULT_CONFIG))
    _check_vocab(cfg, tokenizer)
    if not _init_in_store():
        from .hf.loading import attention_for  # noqa: PLC0415

        torch.manual_seed(opts.seed)
        # Materialized on CPU in fp32, then HFMegaTrainer moves its decoder layers into the store.
        return AutoModelForCausalLM.from_config(
            cfg, dtype=torch.float32, attn_implementation=attention_for(cfg, opts.attn)
        )
    # On a GPU: each decoder layer is initialized straight into its host-store master (on the
    # GPU, then copied), so a config whose fp32 copy would not fit next to the store still
    # starts, and fast; with resident_layers "auto" the plan sizes the HBM tier for this run.
    from .hf.loading import init_streamed_model  # noqa: PLC0415

    return init_streamed_model(cfg, seed=opts.seed, **_loader_arguments(opts, bf16))


def _init_in_store() -> bool:
    """Random init straight into the host store (``init_streamed_model``): on a GPU, where
    the layers are initialized on the device, fast, and the model never exists as a whole."""
    import torch  # noqa: PLC0415

    return torch.cuda.is_available()


def _check_vocab(cfg, tokenizer) -> None:
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise CLIError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab}"
        )


# ---- the run ------------------------------------------------------------------------------------
def _end_process_group() -> None:
    """Tear down a data-parallel launch's process group before interpreter exit.

    Left to interpreter shutdown, the collective library's threads may be destroyed while still
    joinable, aborting a finished run ("terminate called without an active exception").
    """
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _check_launch() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    # Data parallel shares the host store between the ranks through host shared memory.
    if world > 1 and local != world:
        raise CLIError(
            f"launched with {world} processes, {local} on this host: data parallel runs on one "
            "host only (use --num_machines 1, one process per GPU)."
        )


def _mean_loss(model, rows: list[dict], batch_size: int, device) -> float:
    """Token-weighted mean next-token loss of ``model`` over ``rows`` (all the same length)."""
    import torch  # noqa: PLC0415

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            ids = torch.stack([r["input_ids"] for r in rows[i : i + batch_size]]).to(device)
            out = model(input_ids=ids, labels=ids, use_cache=False)
            n = ids.shape[0] * (ids.shape[1] - 1)
            total += float(out.loss) * n
            count += n
    return total / max(count, 1)


def _dir_size_mb(path: str, suffix: str) -> tuple[int, float]:
    files = [f for f in Path(path).iterdir() if f.name.endswith(suffix)]
    return len(files), sum(f.stat().st_size for f in files) / 1e6


def run_train(opts: TrainOptions) -> dict[str, Any]:
    """Run one training job; return a summary (losses, paths, timings) for callers and tests."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, default_data_collator  # noqa: PLC0415

    from . import HFMegaTrainer, MegaTrainArguments  # noqa: PLC0415
    from .hf.arguments import as_arguments  # noqa: PLC0415
    from .hf.long_context import liger_layer_kernel_arguments  # noqa: PLC0415

    t_start = time.perf_counter()
    _check_launch()
    _setup_logging()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    bf16 = use_bf16(opts.precision)
    if opts.liger and not cuda:
        raise CLIError("liger: Liger-Kernel's Triton kernels need a CUDA GPU; drop --liger here")

    tokenizer = load_tokenizer(opts)
    docs = read_texts(opts.data)
    chunks = build_chunks(tokenizer, docs, opts.seq_len)
    train_rows, eval_rows = split_chunks(chunks, opts.eval_fraction, opts.seed)
    eval_rows = eval_rows[: opts.max_eval_chunks]
    model = build_model(opts, tokenizer, bf16)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = model.config
    what = opts.model_path or ("random init from " + (opts.config or "the bundled config"))
    world = int(os.environ.get("WORLD_SIZE", "1"))  # data-parallel processes, one per GPU
    tokens_per_step = opts.seq_len * opts.batch_size * opts.grad_accum * world
    _say(
        f"hf-megatrain: {cfg.model_type} {n_params / 1e6:.1f}M params, "
        f"{cfg.num_hidden_layers} layers ({what})\n"
        f"  data: {len(docs)} file(s) -> {len(train_rows)} train / {len(eval_rows)} eval "
        f"sequences of {opts.seq_len} tokens ({opts.data or 'bundled corpus'})\n"
        f"  {opts.max_steps} steps x {tokens_per_step} tokens "
        f"(batch {opts.batch_size} x grad-accum {opts.grad_accum}"
        + (f" x {world} processes" if world > 1 else "")
        + f"), lr {opts.lr:g}, "
        f"{'bf16 compute, fp32 masters' if bf16 else 'fp32'} on {device.type}"
    )
    if opts.max_steps * opts.batch_size * opts.grad_accum > 20 * len(train_rows):
        _say("  note: more than 20 epochs over this data; expect the model to memorize it")

    try:
        args = MegaTrainArguments(
            output_dir=opts.output_dir,
            per_device_train_batch_size=opts.batch_size,
            per_device_eval_batch_size=opts.batch_size,
            gradient_accumulation_steps=opts.grad_accum,
            max_steps=opts.max_steps,
            learning_rate=opts.lr,
            warmup_steps=opts.warmup_steps,
            weight_decay=opts.weight_decay,
            max_grad_norm=opts.max_grad_norm,
            lr_scheduler_type=opts.lr_scheduler,
            logging_steps=opts.logging_steps,
            logging_first_step=True,
            bf16=bf16,
            use_cpu=not cuda,
            # The CLI writes one final checkpoint itself; intermediate ones would only cost time.
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            seed=opts.seed,
            disable_tqdm=not opts.progress_bar,
            **as_arguments(opts.engine),
            # The layer kernels: training batches use hf_megatrain's chunked loss.
            **liger_layer_kernel_arguments(opts.liger),
        )
    except ValueError as e:
        raise CLIError(f"invalid training setting: {e}") from None
    trainer = HFMegaTrainer(
        model=model,
        args=args,
        train_dataset=train_rows,
        eval_dataset=eval_rows or None,
        processing_class=tokenizer,
        # Rows are equal-length tensors: stack them. (With a tokenizer the Trainer would pick a
        # padding collator that returns a BatchEncoding instead of a dict.)
        data_collator=default_data_collator,
    )
    t_train = time.perf_counter()
    train_out = trainer.train()
    train_s = time.perf_counter() - t_train
    logs = [h for h in trainer.state.log_history if "loss" in h]
    eval_loss = trainer.evaluate()["eval_loss"] if eval_rows else None
    if eval_loss is not None and not math.isfinite(eval_loss):
        raise CLIError(
            f"the final eval loss is {eval_loss}: training diverged (try a lower --lr); the "
            "model was not saved"
        )
    trainer.save_model(opts.output_dir)
    trainer.accelerator.wait_for_everyone()  # rank 0 wrote the checkpoint
    if not _is_main_process():
        # Data parallel: the report and the reload check are rank 0's.
        return {"output_dir": os.path.abspath(opts.output_dir), "n_params": n_params}
    n_shards, mb = _dir_size_mb(opts.output_dir, ".safetensors")
    out = os.path.abspath(opts.output_dir)
    _say(
        f"\nhf-megatrain: trained {opts.max_steps} steps in {train_s:.1f} s "
        f"(final train loss {logs[-1]['loss'] if logs else float('nan'):.4f}"
        + (f", eval loss {eval_loss:.4f}" if eval_loss is not None else "")
        + f").\nSaved {n_shards} safetensors shard(s), {mb:.1f} MB, and the tokenizer to {out}\n"
        "Load it with:\n"
        "  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f'  model = AutoModelForCausalLM.from_pretrained("{out}")\n'
        f'  tokenizer = AutoTokenizer.from_pretrained("{out}")\n'
        f"Continue training it with: hf-megatrain train --model-path {out} --data <your text>"
    )
    result: dict[str, Any] = {
        "output_dir": out,
        "n_params": n_params,
        "train_loss": train_out.training_loss,
        "log_history": list(trainer.state.log_history),
        "eval_loss": eval_loss,
        "train_seconds": train_s,
    }

    verify = opts.verify if opts.verify is not None else n_params <= _AUTO_VERIFY_MAX_PARAMS
    if verify:
        # Free the host store first: the check loads a second, ordinary copy of the model.
        del trainer, model
        gc.collect()
        reloaded = AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, local_files_only=True
        )
        reloaded.to(device).eval()
        if eval_rows:
            reloaded_loss = _mean_loss(reloaded, eval_rows, opts.batch_size, device)
            result["reloaded_eval_loss"] = reloaded_loss
            _say(
                f"\nCheck: AutoModelForCausalLM.from_pretrained loaded the checkpoint; its eval "
                f"loss is {reloaded_loss:.4f} (perplexity {math.exp(min(reloaded_loss, 50)):.1f})"
                + (" vs" if eval_loss is not None else "")
                + (f" {eval_loss:.4f} from the streamed model" if eval_loss is not None else "")
            )
            if not math.isfinite(reloaded_loss):
                raise RuntimeError("the reloaded checkpoint gives a non-finite loss")
        if opts.max_new_tokens > 0 and opts.sample_prompt:
            enc = tokenizer(opts.sample_prompt, return_tensors="pt", add_special_tokens=False)
            with torch.no_grad():
                gen = reloaded.generate(
                    **enc.to(device),
                    max_new_tokens=opts.max_new_tokens,
                    do_sample=False,
                    # A minutes-old model loops on its most frequent tokens; blocking repeated
                    # trigrams keeps the greedy sample readable without sampling noise.
                    no_repeat_ngram_size=3,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            sample = tokenizer.decode(gen[0], skip_special_tokens=True)
            result["sample"] = sample
            _say(
                f"Greedy sample ({opts.max_new_tokens} new tokens, no repeated trigrams):"
                f"\n---\n{sample}\n---"
            )
    else:
        _say(
            f"\n(Skipped reloading a {n_params / 1e9:.1f}B-parameter model for the final check; "
            "pass --verify to force it.)"
        )
    _say(f"hf-megatrain: done in {time.perf_counter() - t_start:.1f} s")
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hf-megatrain`` and ``python3 -m hf_megatrain``."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command not in ("train", "plan", "verify"):
        parser.print_help()
        return 2
    try:
        if ns.command == "verify":
            return run_verify(ns)
        if ns.command == "plan":
            run_plan(ns)
            return 0
        opts = resolve_options(ns)
        from . import InsufficientHostMemoryError, UnsupportedModelError  # noqa: PLC0415
        from .core.optimizer import NonFiniteError  # noqa: PLC0415

        try:
            run_train(opts)
        except NonFiniteError as e:
            # Training stopped on NaN/inf (megatrain_nonfinite), or a save refused such weights.
            raise CLIError(str(e).removeprefix("hf_megatrain: ")) from None
        except (InsufficientHostMemoryError, ValueError) as e:
            # The library's refusals (unsupported model, host RAM, a setting checked against
            # the model such as resident layers beyond its count) say "hf_megatrain: ..."; any
            # other ValueError is a bug to show.
            ours = not isinstance(e, ValueError) or isinstance(e, UnsupportedModelError)
            if not ours and not str(e).startswith("hf_megatrain: "):
                raise
            raise CLIError(str(e).removeprefix("hf_megatrain: ")) from None
        finally:
            _end_process_group()
    except (CLIError, DataError) as e:
        # A string SystemExit prints one line on stderr and exits with status 1.
        raise SystemExit(f"hf-megatrain: error: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit("hf-megatrain: interrupted") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
