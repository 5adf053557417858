"""Checkpoint folders as the Hub has them, loaded by ``load_streamed_model``.

Each folder is a tiny model's ``save_pretrained``, then altered: stored dtypes, config dtype
fields, tied / untied heads, base-model saves, legacy names, broken or pickled weights, custom
code, unsupported families. A folder ``from_pretrained`` loads gives the same logits (and, for a
few, the same training steps as the stock Trainer); any other is refused in one line, before
the host store is allocated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DogeConfig

from hf_megatrain import UnsupportedModelError, load_streamed_model
from hf_megatrain.hf import loading
from hf_megatrain.hf.checkpoint import host_state_dict

from .helpers import assert_logs_match, run_trainer, tiny_config, tiny_model


def _ids(vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))


def _logits(model, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _save(path: Path, arch: str = "llama", dtype=None, shard=None, **overrides) -> Path:
    model = tiny_model(tiny_config(arch, **overrides))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(path), **({} if shard is None else {"max_shard_size": shard}))
    return path


def _edit_config(path: Path, **fields) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in fields.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(file: Path, edit) -> None:
    sd = load_file(str(file))
    edit(sd)
    save_file(sd, str(file), metadata={"format": "pt"})


def _shard_of(path: Path, key: str) -> Path:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][key]


def _assert_same_as_from_pretrained(path: Path) -> None:
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    streamed = load_streamed_model(str(path), device="cpu", bf16=False)
    ids = _ids(ref.config.vocab_size)
    torch.testing.assert_close(_logits(streamed, ids), _logits(ref, ids), rtol=0, atol=0)


# ---- folders from_pretrained loads: the same model ------------------------------------------
@pytest.mark.parametrize(
    "dtype,shard,tie,config_dtype",
    [
        (torch.bfloat16, None, True, None),
        (torch.bfloat16, "20KB", False, "float16"),  # config.json's dtype is not the stored one
        (torch.float16, "20KB", True, None),
        (torch.float16, None, False, "bfloat16"),
        (torch.float32, None, True, "bfloat16"),
    ],
)
def test_stored_dtypes_and_layouts_load_as_from_pretrained(
    tmp_path, dtype, shard, tie, config_dtype
):
    path = _save(tmp_path / "ckpt", dtype=dtype, shard=shard, tie_word_embeddings=tie)
    if config_dtype is not None:  # the legacy field, or transformers 5's
        _edit_config(path, dtype=config_dtype, torch_dtype=config_dtype)
    _assert_same_as_from_pretrained(path)


@pytest.mark.parametrize("same_values", [False, True])
def test_tied_config_with_lm_head_in_the_checkpoint(tmp_path, same_values):
    """config.json ties the head, the file holds ``lm_head.weight`` too. Different values:
    from_pretrained does not tie them (a warning) and neither may the loader; before, both keys
    were written into the one tied tensor and the head overwrote the embedding. Equal values (as
    .bin conversions have): tied."""
    path = _save(tmp_path / "ckpt", tie_word_embeddings=True)
    file = path / "model.safetensors"
    assert "lm_head.weight" not in load_file(str(file))

    def add_head(sd):
        emb = sd["model.embed_tokens.weight"]
        sd["lm_head.weight"] = emb.clone() if same_values else torch.randn_like(emb)

    _edit_tensors(file, add_head)
    _assert_same_as_from_pretrained(path)
    streamed = load_streamed_model(str(path), device="cpu", bf16=False)
    head, emb = streamed.lm_head.weight, streamed.get_input_embeddings().weight
    assert (head is emb) == same_values
    assert streamed.config.tie_word_embeddings == same_values


@pytest.mark.parametrize("arch", ["llama", "falcon", "bloom", "mpt"])
def test_a_base_model_checkpoint_loads_as_from_pretrained(tmp_path, arch):
    """Saved from the base model (``LlamaModel``, ``FalconModel``: no ``model.`` /
    ``transformer.`` prefix) with a tied head: from_pretrained adds the model's own
    ``base_model_prefix``; the loader only knew ``model.`` and refused Falcon, BLOOM and MPT."""
    model = tiny_model(tiny_config(arch, tie_word_embeddings=True))
    model.base_model.save_pretrained(str(tmp_path / "base"))
    keys = load_file(str(tmp_path / "base" / "model.safetensors"))
    assert not any(k.startswith(model.base_model_prefix + ".") for k in keys)
    _assert_same_as_from_pretrained(tmp_path / "base")


def test_legacy_expert_and_head_names_load_as_from_pretrained(tmp_path):
    """Mixtral's per-expert ``block_sparse_moe.experts.N.w1`` (fused on load by transformers 5)
    and GPT-NeoX's ``embed_out`` (renamed to ``lm_head``)."""
    mixtral = _save(tmp_path / "mixtral", "mixtral", dtype=torch.bfloat16, shard="20KB")
    index = json.loads((mixtral / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.block_sparse_moe.experts.1.w3.weight" in index
    _assert_same_as_from_pretrained(mixtral)
    neox = _save(tmp_path / "neox", "gpt_neox")
    assert "embed_out.weight" in load_file(str(neox / "model.safetensors"))
    _assert_same_as_from_pretrained(neox)


def test_a_multimodal_llama4_checkpoint_loads_its_text_model(tmp_path, caplog):
    """Llama 4's Hub checkpoints are ``Llama4ForConditionalGeneration``'s: the text model under
    ``language_model.``, a vision tower and a projector beside it. ``from_pretrained`` builds
    ``Llama4ForCausalLM`` and skips the other towers; so do the loaders (the check before
    allocating and the store's read), logging what they skip. A stray tensor of the text model's
    own is still refused."""
    import logging  # noqa: PLC0415

    from transformers import Llama4Config, Llama4ForConditionalGeneration  # noqa: PLC0415

    text = {k: v for k, v in tiny_config("llama4_text").to_dict().items()
            if k not in ("model_type", "architectures", "transformers_version")}  # fmt: skip
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32, vision_output_dim=32, projector_input_dim=32,
                  projector_output_dim=32, image_size=28, patch_size=14)  # fmt: skip
    torch.manual_seed(0)
    Llama4ForConditionalGeneration(
        Llama4Config(text_config=text, vision_config=vision)
    ).save_pretrained(str(tmp_path / "mm"))
    keys = load_file(str(tmp_path / "mm" / "model.safetensors"))
    assert any(k.startswith("vision_model.") for k in keys)
    assert any(k.startswith("language_model.model.layers.") for k in keys)
    with caplog.at_level(logging.INFO, logger="hf_megatrain"):
        _assert_same_as_from_pretrained(tmp_path / "mm")
    assert "other towers (multi_modal_projector, vision_model)" in caplog.text
    # Its text config tying the head while the file holds a different one: untied, as
    # from_pretrained leaves them (the text model reads the text config's flag).
    cfg = json.loads((tmp_path / "mm" / "config.json").read_text())
    cfg["text_config"]["tie_word_embeddings"] = True
    (tmp_path / "mm" / "config.json").write_text(json.dumps(cfg))
    streamed = load_streamed_model(str(tmp_path / "mm"), device="cpu", bf16=False)
    assert streamed.lm_head.weight is not streamed.get_input_embeddings().weight
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "mm"), dtype=torch.float32)
    ids = _ids(ref.config.vocab_size)
    torch.testing.assert_close(_logits(streamed, ids), _logits(ref, ids), rtol=0, atol=0)
    _edit_tensors(tmp_path / "mm" / "model.safetensors",
                  lambda sd: sd.update({"language_model.model.extra.weight": torch.zeros(2)}))  # fmt: skip
    with pytest.raises(ValueError, match="language_model.model.extra.weight"):
        load_streamed_model(str(tmp_path / "mm"), device="cpu", bf16=False)


@pytest.mark.parametrize(
    "arch,dtype,tie", [("llama", torch.bfloat16, True), ("qwen3_moe", torch.float16, False)]
)
def test_a_loaded_checkpoint_trains_as_the_stock_trainer(tmp_path, arch, dtype, tie):
    path = _save(tmp_path / "ckpt", arch, dtype=dtype, shard="20KB", tie_word_embeddings=tie)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    stock, _ = run_trainer(ref, tmp_path, "stock", False, max_steps=2)
    streamed = load_streamed_model(str(path), device="cpu", bf16=False)
    mega, _ = run_trainer(streamed, tmp_path, "mega", True, max_steps=2)
    assert_logs_match(stock, mega)


def test_saved_output_round_trip(tmp_path):
    """Train 2 steps, save_model, load it: the same fp32 weights and logits; 2 more steps from
    the loaded folder are the stock Trainer's 2 steps from the same folder."""
    path = _save(tmp_path / "ckpt", shard="20KB")
    _, trainer = run_trainer(
        load_streamed_model(str(path), device="cpu", bf16=False), tmp_path, "a", True, max_steps=2
    )
    trainer.save_model(str(tmp_path / "saved"))
    trained = {k: v.clone() for k, v in host_state_dict(trainer.model).items()}
    loaded = load_streamed_model(str(tmp_path / "saved"), device="cpu", bf16=False)
    got = host_state_dict(loaded)
    assert sorted(got) == sorted(trained)
    for k, v in trained.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    ids = _ids()
    torch.testing.assert_close(_logits(loaded, ids), _logits(trainer.model, ids), rtol=0, atol=0)
    mega, _ = run_trainer(loaded, tmp_path, "b", True, max_steps=2)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32)
    stock, _ = run_trainer(ref, tmp_path, "c", False, max_steps=2)
    assert_logs_match(stock, mega)


# ---- folders that are refused: one line, before the store is allocated ----------------------
def _drop(key):
    return lambda sd: sd.pop(key)


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


KEY = "model.layers.1.mlp.up_proj.weight"
Q = "model.layers.0.self_attn.q_proj.weight"
BROKEN = {
    "missing tensor": (
        lambda p: _edit_tensors(_shard_of(p, KEY), _drop(KEY)),
        rf"lacks 1 tensors, e.g. \['{KEY}'\]",
    ),
    "unexpected tensor": (
        lambda p: _edit_tensors(
            _shard_of(p, KEY), lambda sd: sd.__setitem__("model.layers.1.extra", torch.zeros(2))
        ),
        r"1 checkpoint tensors in .* do not match the LlamaForCausalLM model, e.g. "
        r"\['model.layers.1.extra'\]",
    ),
    "shape mismatch": (
        lambda p: _edit_tensors(_shard_of(p, Q), lambda sd: sd.__setitem__(Q, sd[Q][:-1])),
        rf"{Q} \(model-\d+-of-\d+.safetensors\) has shape \(31, 32\), the model expects "
        r"\(32, 32\)",
    ),
    "truncated shard": (
        lambda p: _truncate(_shard_of(p, KEY)),
        r"model-\d+-of-\d+.safetensors is not a readable safetensors file",
    ),
    "corrupt shard": (
        lambda p: _shard_of(p, KEY).write_bytes(b"not a safetensors file" * 4),
        r"model-\d+-of-\d+.safetensors is not a readable safetensors file",
    ),
    "index names a missing shard": (
        lambda p: _shard_of(p, KEY).unlink(),
        r"shard\(s\) listed in model.safetensors.index.json are missing: \['model-",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoints_are_refused_before_allocating(tmp_path, monkeypatch, case):
    alter, message = BROKEN[case]
    path = _save(tmp_path / "ckpt", shard="20KB")
    alter(path)
    monkeypatch.setattr(loading, "streamed_skeleton", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(ValueError, match=message) as err:
        load_streamed_model(str(path), device="cpu", bf16=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("sharded", [False, True])
def test_pickled_weights_are_refused_unread(tmp_path, monkeypatch, sharded):
    """``pytorch_model.bin`` (and its sharded form): never unpickled; the message says how to
    convert them."""
    model = tiny_model(tiny_config("llama"))
    model.config.save_pretrained(str(tmp_path))
    sd = model.state_dict()
    if sharded:
        names = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
        keys = list(sd)
        halves = {names[0]: keys[: len(keys) // 2], names[1]: keys[len(keys) // 2 :]}
        for name, part in halves.items():
            torch.save({k: sd[k] for k in part}, tmp_path / name)
        weight_map = {k: name for name, part in halves.items() for k in part}
        (tmp_path / "pytorch_model.bin.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    else:
        torch.save(sd, tmp_path / "pytorch_model.bin")
    AutoModelForCausalLM.from_pretrained(str(tmp_path))  # a folder transformers loads
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(loading, "streamed_skeleton", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(ValueError, match=r"holds PyTorch pickle weights \(pytorch_model") as err:
        load_streamed_model(str(tmp_path), device="cpu", bf16=False)
    assert "save_pretrained" in str(err.value) and "\n" not in str(err.value)


QUANTIZATION = {
    # from_pretrained: "The model's quantization config ... has no `quant_method` attribute".
    "empty": ({}, ValueError, r"quantization_config \{\} has no quant_method"),
    "no method": ({"bits": 4}, ValueError, r"\{\"bits\": 4\} has no quant_method"),
    # from_pretrained quantizes these (bitsandbytes without a quant_method, by its flags).
    "bnb flags": ({"load_in_4bit": True}, UnsupportedModelError, r"\(bitsandbytes_4bit\)"),
    "known method": ({"quant_method": "fp8"}, UnsupportedModelError, r"checkpoint \(fp8\)"),
}


@pytest.mark.parametrize("case", list(QUANTIZATION))
def test_quantization_config_refused_as_from_pretrained_refuses(tmp_path, monkeypatch, case):
    """config.json's ``quantization_config`` read as transformers reads it: ``{}`` (or any
    without a quant_method) is an error in ``from_pretrained``, and was loaded here; a method
    transformers quantizes with is a quantized checkpoint. One line, before the store."""
    quant, error, message = QUANTIZATION[case]
    path = _save(tmp_path / "ckpt")
    _edit_config(path, quantization_config=quant)
    if error is ValueError:
        with pytest.raises(ValueError, match="quant_method"):
            AutoModelForCausalLM.from_pretrained(str(path))
    monkeypatch.setattr(loading, "streamed_skeleton", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(error, match=message) as err:
        load_streamed_model(str(path), device="cpu", bf16=False)
    assert str(err.value).startswith("hf_megatrain: ") and "\n" not in str(err.value)


def test_unknown_quantization_method_loads_as_from_pretrained(tmp_path, caplog):
    """A quant_method transformers does not know: ``from_pretrained`` warns, skips the
    quantization and loads the weights as stored; so does the loader (it refused the folder as
    a quantized checkpoint)."""
    path = _save(tmp_path / "ckpt", dtype=torch.bfloat16)
    _edit_config(path, quantization_config={"quant_method": "my_own_int3"})
    with caplog.at_level("WARNING", logger="hf_megatrain.hf.loading"):
        _assert_same_as_from_pretrained(path)
    assert "unknown quantization type 'my_own_int3'" in caplog.text


def test_quantization_config_not_a_mapping_refused_in_one_line(tmp_path, monkeypatch):
    """Transformers' config class fails on it with a traceback (AttributeError in to_dict)."""
    path = _save(tmp_path / "ckpt")
    _edit_config(path, quantization_config="int4")
    monkeypatch.setattr(loading.AutoConfig, "from_pretrained", lambda *a, **k: pytest.fail("cfg"))
    with pytest.raises(ValueError, match=r'quantization_config is "int4", not a mapping') as err:
        load_streamed_model(str(path), device="cpu", bf16=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case", ["unknown type", "custom code", "doge"])
def test_unsupported_model_types_are_refused_in_one_line(tmp_path, monkeypatch, case):
    """An architecture transformers does not know, custom code (``auto_map``, which
    transformers would prompt to run), and one it knows that is not streamed: all an
    ``UnsupportedModelError`` listing the supported families, before transformers builds a
    config (its errors span lines)."""
    if case == "doge":
        cfg = DogeConfig(
            vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
        )  # fmt: skip
        tiny_model(cfg).save_pretrained(str(tmp_path))
    else:
        _save(tmp_path)
        auto_map = {"AutoConfig": "c.MyConfig", "AutoModelForCausalLM": "m.MyForCausalLM"}
        _edit_config(
            tmp_path, model_type="my_arch", auto_map=auto_map if "custom" in case else None
        )
    monkeypatch.setattr(loading.AutoConfig, "from_pretrained", lambda *a, **k: pytest.fail("cfg"))
    with pytest.raises(UnsupportedModelError) as err:
        load_streamed_model(str(tmp_path), device="cpu", bf16=False)
    msg = str(err.value)
    assert "\n" not in msg and "is not supported" in msg and "llama, " in msg
    assert ("auto_map" in msg) == (case == "custom code")


def test_cli_refuses_custom_code_in_one_line_without_a_prompt(tmp_path, capsys):
    """``--model_path`` of a custom-code folder: before, transformers' tokenizer and config
    loaders printed "Do you wish to run the custom code? [y/N]" (waiting for an answer on a
    terminal) and the error suggested trust_remote_code, which cannot help."""
    from hf_megatrain.cli import main  # noqa: PLC0415
    from hf_megatrain.text import load_tokenizer  # noqa: PLC0415

    _save(tmp_path / "ckpt")
    load_tokenizer(None).save_pretrained(str(tmp_path / "ckpt"))
    auto_map = {"AutoConfig": "c.MyConfig", "AutoModelForCausalLM": "m.MyForCausalLM"}
    _edit_config(tmp_path / "ckpt", model_type="my_arch", auto_map=auto_map)
    with pytest.raises(SystemExit) as err:
        main(["train", "--model-path", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "o")])
    msg = str(err.value.code)
    assert "\n" not in msg and "model_type 'my_arch' (custom code" in msg, msg
    out = capsys.readouterr()
    assert "Do you wish to run the custom code" not in out.out + out.err


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_saved_model_keeps_its_use_cache(tmp_path, use_cache):
    """Found by an audit: streaming turns config.use_cache off (training must not write a cache
    through the shared layer templates) and every saved config.json recorded that. The model
    saves the value it came with."""
    from hf_megatrain import save_streamed_pretrained

    tiny_model(tiny_config("llama", use_cache=use_cache)).save_pretrained(tmp_path / "in")
    model = load_streamed_model(str(tmp_path / "in"), device="cpu", bf16=False)
    assert model.config.use_cache is False
    save_streamed_pretrained(model, str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["use_cache"] is use_cache
    assert model.config.use_cache is False  # (still training without one)
