"""export_dtype: the final model written in bf16 while resume checkpoints keep the fp32 masters."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_megatrain.cli import main
from hf_megatrain.core.options import EngineOptions, OptionError
from hf_megatrain.hf.checkpoint import save_streamed_pretrained

from .helpers import assert_logs_match, mega_params, run_trainer, tiny_config, tiny_model
from .test_cli import TEXT, _fast_flags, _tiny_config


def _file_dtypes(folder: Path) -> set[torch.dtype]:
    dtypes = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes, f"no weights in {folder}"
    # safetensors names them "F32" / "BF16".
    return {{"F32": torch.float32, "BF16": torch.bfloat16}[d] for d in dtypes}


def _config_dtype(folder: Path) -> str:
    cfg = json.loads((folder / "config.json").read_text())
    return cfg.get("dtype", cfg.get("torch_dtype"))


def test_default_and_choices():
    assert EngineOptions().export_dtype == "float32"
    assert EngineOptions(export_dtype="bfloat16").export_dtype == "bfloat16"
    with pytest.raises(OptionError, match="export_dtype"):
        EngineOptions(export_dtype="float16")


def test_bf16_export_keeps_fp32_checkpoints(tmp_path):
    model = tiny_model(tiny_config("llama"))
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, megatrain_export_dtype="bfloat16")
    full_logs, full = run_trainer(copy.deepcopy(model), tmp_path, "full", True, **kw)

    # checkpoint-2 (for resuming): the fp32 masters, and config.json says so.
    ckpt = tmp_path / "full" / "checkpoint-2"
    assert _file_dtypes(ckpt) == {torch.float32}
    assert _config_dtype(ckpt) == "float32"
    # A resume from it continues bit for bit.
    resumed_logs, resumed = run_trainer(
        copy.deepcopy(model), tmp_path, "resumed", True, resume=str(ckpt), **kw
    )
    assert_logs_match(full_logs[2:], resumed_logs, rel=0)
    masters = mega_params(full)
    for name, value in mega_params(resumed).items():
        torch.testing.assert_close(value, masters[name], rtol=0, atol=0, msg=name)

    # The final model: bf16 files, recorded in config.json, the masters rounded to bf16.
    out = tmp_path / "final"
    full.save_model(str(out))
    assert _file_dtypes(out) == {torch.bfloat16}
    assert _config_dtype(out) == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(str(out))  # dtype "auto": the file's
    assert loaded.dtype == torch.bfloat16
    saved = loaded.state_dict()
    for name, value in masters.items():
        torch.testing.assert_close(saved[name], value.to(torch.bfloat16), rtol=0, atol=0, msg=name)
    # The in-memory model is untouched: its config and masters stay fp32.
    assert str(full.model.config.dtype).removeprefix("torch.") == "float32"
    for name, value in mega_params(full).items():
        assert value.dtype == torch.float32, name


def test_default_export_is_fp32(tmp_path):
    model = tiny_model(tiny_config("llama"))
    _, trainer = run_trainer(model, tmp_path, "run", True, max_steps=2)
    out = tmp_path / "final"
    trainer.save_model(str(out))
    assert _file_dtypes(out) == {torch.float32}
    assert _config_dtype(out) == "float32"
    saved = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    for name, value in mega_params(trainer).items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)


def test_cli_export_dtype(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    out = tmp_path / "out"
    cfg = _tiny_config(tmp_path / "config.json")
    argv = ["train", "--config", str(cfg), "--data", str(data), "--export-dtype", "bfloat16"]
    assert main(argv + _fast_flags(out)) == 0
    assert _file_dtypes(out) == {torch.bfloat16}
    assert _config_dtype(out) == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(str(out)).dtype == torch.bfloat16


def _weight_keys(folder: Path) -> set[str]:
    keys: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys |= set(f.keys())
    return keys


def test_bf16_export_keeps_tied_embeddings_tied(tmp_path):
    """Tied input and output embeddings are written once in bf16 too, as in fp32 and as the
    stock ``save_pretrained`` of a bf16 model writes them: the cast keeps aliases aliases (a
    per-key cast made a second copy, an extra ``lm_head.weight``)."""
    model = tiny_model(tiny_config("llama", tie_word_embeddings=True))
    _, trainer = run_trainer(model, tmp_path, "run", True, max_steps=1)
    for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        save_streamed_pretrained(trainer.model, str(tmp_path / name), dtype=dtype)
    assert "lm_head.weight" not in _weight_keys(tmp_path / "fp32")
    assert _weight_keys(tmp_path / "bf16") == _weight_keys(tmp_path / "fp32")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"))
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
