"""Argument handling the Python recipes (``recipes/sft.py``, ``recipes/lora.py``) share.

Both take a model from a Hub checkpoint (``--model-path``) or, at a real size without weights,
from a config with random init (``--config``, bundled tokenizer); both choose the precision the
same way as ``hf-megatrain train``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def add_model_args(parser: argparse.ArgumentParser, config_help: str) -> None:
    """``--model-path`` | ``--config``, ``--attn``, ``--bf16`` | ``--fp32``, ``--seed``."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model-path", help="Hub-format checkpoint folder (default: bundled config)")
    src.add_argument("--config", help=config_help)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "flex_attention"])
    prec = parser.add_mutually_exclusive_group()
    prec.add_argument("--bf16", dest="precision", action="store_const", const="bf16",
                      help="bf16 compute, fp32 masters (default on a bf16-capable GPU)")  # fmt: skip
    prec.add_argument("--fp32", dest="precision", action="store_const", const="fp32",
                      help="fp32 compute (default on the CPU)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)


def run_recipe(main: Callable[[], object], prog: str) -> None:
    """Run a recipe's ``main``: the library's refusals (host RAM, the memory plan, the data, the
    model path, a setting) end in one line, as ``hf-megatrain``'s do, not in a traceback."""
    from . import InsufficientHostMemoryError, UnsupportedModelError  # noqa: PLC0415
    from .core.distributed import DataParallelError  # noqa: PLC0415
    from .core.options import OptionError  # noqa: PLC0415
    from .core.plan_types import MemoryPlanError  # noqa: PLC0415
    from .text import DataError  # noqa: PLC0415

    ours = (InsufficientHostMemoryError, UnsupportedModelError, DataParallelError,
            MemoryPlanError, OptionError, DataError)  # fmt: skip
    try:
        main()
    except (*ours, ValueError, FileNotFoundError) as e:
        # (any other ValueError or FileNotFoundError is a bug to show)
        if not isinstance(e, ours) and not str(e).startswith("hf_megatrain: "):
            raise
        raise SystemExit(f"{prog}: error: {str(e).removeprefix('hf_megatrain: ')}") from None


def check_model_path(path: str | None) -> None:
    """``--model-path`` found (a local folder, or a Hub repo id in the cache or downloaded)
    before the tokenizer is read from it: a missing folder said "tokenizer not found"."""
    from .hf.hub import resolve_model_folder  # noqa: PLC0415

    if path is not None:
        resolve_model_folder(path)


def model_config(path: str, parser: argparse.ArgumentParser):
    """The config of ``--config`` (a config.json, or a folder holding one); usage errors exit."""
    from transformers import AutoConfig  # noqa: PLC0415

    from .hf.families import model_family, unsupported_model_type  # noqa: PLC0415

    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        parser.error(
            f"--config {path}: "
            + ("the folder has no config.json" if p.is_dir() else "no such file or folder")
        )
    try:
        # A folder as given: peft then finds its config.json when it saves the adapters.
        cfg = AutoConfig.from_pretrained(str(p if p.is_dir() else file))
    except (OSError, ValueError) as e:
        parser.error(f"--config {path}: not a model config ({e})")
    if model_family(cfg.model_type) is None:
        parser.error(unsupported_model_type(f"--config {path}", cfg.model_type))
    return cfg


def check_vocab(cfg, tokenizer, what: str) -> None:
    """Every token id of ``tokenizer`` must index the model's embedding."""
    # The bundled tokenizer has 4096 tokens, ids 0..4095: below the vocab of every real-size
    # config (Qwen2.5: 152064, Llama 3: 128256), so a random-init model of that shape trains on
    # it; only its first 4096 embedding rows are ever looked up. A smaller vocab cannot.
    if len(tokenizer) > cfg.vocab_size:
        raise SystemExit(
            f"{what}: the bundled tokenizer has {len(tokenizer)} tokens (ids up to "
            f"{len(tokenizer) - 1}) but the config's vocab_size is {cfg.vocab_size}: its "
            "embedding cannot look them up. Use a config with vocab_size >= "
            f"{len(tokenizer)}."
        )
