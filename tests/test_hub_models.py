"""Hub repo ids as models: load_streamed_model and ``hf-megatrain train --model-path org/name``
read the Hugging Face cache first; offline and not cached, a clear one-line error.

No network: the Hub is offline and the cache is a folder of the test, laid out as
huggingface_hub lays it out (``models--org--name/refs/main`` -> ``snapshots/<commit>/``).
"""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import constants
from transformers import AutoConfig, AutoModelForCausalLM

from hf_megatrain import load_streamed_model
from hf_megatrain.cli import DEFAULT_CONFIG, main
from hf_megatrain.hf.hub import ModelNotFoundError, looks_like_repo_id, resolve_model_folder
from hf_megatrain.text import load_tokenizer

from .helpers import tiny_config, tiny_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache under tmp_path with the Hub offline (env and the constants
    huggingface_hub read at import time)."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _cache_entry(cache, repo_id: str):
    """The snapshot folder of ``repo_id`` at ``COMMIT``, ``refs/main`` pointing at it."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    return snap


def test_repo_id_loads_from_the_cache(hub_cache):
    config = tiny_config("llama")
    stock = tiny_model(config).eval()
    stock.save_pretrained(_cache_entry(hub_cache, "org/tiny-llama"))
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    streamed = load_streamed_model("org/tiny-llama", device="cpu", bf16=False).eval()
    with torch.no_grad():
        want = stock(input_ids=ids).logits
        got = streamed(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_offline_repo_id_not_in_the_cache_is_a_clear_error(hub_cache):
    with pytest.raises(ModelNotFoundError) as err:
        load_streamed_model("org/not-cached", device="cpu", bf16=False)
    msg = str(err.value)
    assert "\n" not in msg
    assert "not in the Hugging Face cache" in msg and "HF_HUB_OFFLINE" in msg
    assert "huggingface-cli download org/not-cached" in msg


def test_cached_repo_without_safetensors_is_a_clear_error(hub_cache):
    snap = _cache_entry(hub_cache, "org/bin-only")
    tiny_config("llama").save_pretrained(snap)
    (snap / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors weights"):
        resolve_model_folder("org/bin-only")


def test_local_folders_and_not_found(tmp_path, hub_cache):
    assert resolve_model_folder(str(tmp_path)) == str(tmp_path)
    assert not looks_like_repo_id(str(tmp_path / "nope"))
    assert looks_like_repo_id("Qwen/Qwen2.5-7B")
    assert not looks_like_repo_id("a/b/c") and not looks_like_repo_id("../x")
    with pytest.raises(ModelNotFoundError, match="model path not found"):
        resolve_model_folder(str(tmp_path / "nope"))


def test_cli_trains_a_cached_repo_id(hub_cache, tmp_path):
    cfg = json.loads(DEFAULT_CONFIG.read_text())
    cfg.update(
        model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    snap = _cache_entry(hub_cache, "org/tiny-cli")
    torch.manual_seed(0)
    config = AutoConfig.for_model(**cfg)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(snap)
    load_tokenizer(None).save_pretrained(snap)  # the model's own tokenizer, from the snapshot
    data = tmp_path / "text.txt"
    data.write_text("Streaming decoder layers through the accelerator.\n\n" * 80)
    out = tmp_path / "out"
    flags = [
        "--max-steps", "1", "--seq-len", "16", "--batch-size", "2", "--logging-steps", "1",
        "--max-new-tokens", "4", "--no-progress-bar", "--output-dir", str(out),
    ]  # fmt: skip
    assert main(["train", "--model-path", "org/tiny-cli", "--data", str(data)] + flags) == 0
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 2


def test_cli_offline_repo_id_not_cached_is_one_line(hub_cache, tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        main(["train", "--model-path", "org/missing", "--output-dir", str(tmp_path / "o")])
    msg = str(err.value.code)
    assert msg.startswith("hf-megatrain: error: org/missing is not a local folder")
    assert "\n" not in msg
