"""The refusal of a model no supported family trains: one line, naming the type the user loaded,
the closest supported types and where the full list is; for a multimodal model whose text model
is supported, how to load that text model alone (followed here: it loads every text weight)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING

from hf_megatrain import SUPPORTED_MODEL_TYPES, UnsupportedModelError, load_streamed_model
from hf_megatrain.hf import loading
from hf_megatrain.hf.families import (
    TEXT_MODEL_KEY_MAPPING,
    TEXT_MODEL_KEY_MAPPING_TYPES,
    model_family,
    text_model_type,
)
from hf_megatrain.hf.model import check_supported

from .helpers import gemma4_config, tiny_config, tiny_model

_SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
              num_key_value_heads=2, image_size=28, patch_size=14)  # fmt: skip


def _tiny_multimodal(model_type: str):
    """A tiny random multimodal model of ``model_type`` (its text model a tiny supported one)
    and its text model's ``*ForCausalLM`` class."""
    default = CONFIG_MAPPING[model_type]()
    family = model_family(default.get_text_config(decoder=True).model_type)
    text = tiny_config(family).to_dict()
    for k in ("architectures", "transformers_version"):
        text.pop(k, None)
    kw = {"text_config": text, "tie_word_embeddings": text.get("tie_word_embeddings", False)}
    for key in default.sub_configs:
        if key != "text_config" and getattr(default, key) is not None:  # (Gemma 4: optional)
            sub = getattr(default, key).to_dict()
            kw[key] = {**sub, **{k: v for k, v in _SMALL.items() if isinstance(sub.get(k), int)}}
    config = CONFIG_MAPPING[model_type](**kw)
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    torch.manual_seed(0)
    model = getattr(transformers, mapping[model_type])(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # (no weight left at a default a wrong load would also give)
    causal_lm = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return model, getattr(transformers, causal_lm[text["model_type"]])


def _refusal(fn, *args) -> str:
    with pytest.raises(UnsupportedModelError) as err:
        fn(*args)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("hf_megatrain: ")
    return msg


@pytest.mark.parametrize(
    "model_type", ["gemma3", "llava", "idefics3", "gemma4", "gemma4_unified"]
)
def test_a_multimodal_model_refusal_says_how_to_load_its_text_model(tmp_path, model_type):
    """Gemma 3, LLaVA, Idefics3 (the text weights under ``language_model.model.`` or
    ``model.text_model.``): the model object and its checkpoint folder are refused, naming the
    text model and the call that loads it alone. That call loads every text weight as the
    multimodal model holds it (the class alone, without the mapping, initializes them at random),
    passes the check, and saved, streams from the folder."""
    model, text_cls = _tiny_multimodal(model_type)
    model.save_pretrained(str(tmp_path / "mm"))
    text_type = model.config.get_text_config(decoder=True).model_type
    advice = (
        f"{text_cls.__name__}.from_pretrained(<checkpoint>, "
        "key_mapping=hf_megatrain.hf.families.TEXT_MODEL_KEY_MAPPING)"
    )
    for msg in (
        _refusal(check_supported, model),
        _refusal(loading.check_model_type, str(tmp_path / "mm")),
    ):
        assert f"model_type '{model_type}' (multimodal) is not supported" in msg
        assert f"but its text model ('{text_type}') is: load it alone with {advice}" in msg
        assert advice in msg and len(msg.split(": model_type")[1]) < 360  # past the path

    _, plain = text_cls.from_pretrained(str(tmp_path / "mm"), output_loading_info=True)
    assert plain["missing_keys"]  # why the mapping: without it the text weights are not found
    text, info = text_cls.from_pretrained(
        str(tmp_path / "mm"), key_mapping=TEXT_MODEL_KEY_MAPPING, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]
    held = next(m for m in model.modules() if m is not model and hasattr(m, "embed_tokens"))
    for name, p in text.model.state_dict().items():
        torch.testing.assert_close(p, held.state_dict()[name], rtol=0, atol=0, msg=name)
    head = model.get_output_embeddings().weight
    torch.testing.assert_close(text.lm_head.weight, head, rtol=0, atol=0)
    assert check_supported(text) == model_family(text_type)
    assert "save_pretrained(folder, save_original_format=False)" in msg
    text.save_pretrained(str(tmp_path / "text"), save_original_format=False)
    streamed = load_streamed_model(str(tmp_path / "text"), device="cpu", bf16=False)
    assert type(streamed).__name__ == text_cls.__name__
    ids = torch.randint(
        0, text.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want = text.eval()(input_ids=ids, use_cache=False).logits
        got = streamed.eval()(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_every_listed_multimodal_type_has_a_supported_text_model():
    """The types the refusal gives the loading call for: each a multimodal config of this
    transformers whose default text model is a supported family (types an older transformers
    lacks are skipped: the refusal never meets them there)."""
    for model_type in sorted(TEXT_MODEL_KEY_MAPPING_TYPES & set(CONFIG_MAPPING)):
        text = text_model_type({"model_type": model_type})
        if text is None:  # a text_config built in __init__ (LLaVA's): the default instance's
            text = CONFIG_MAPPING[model_type]().get_text_config(decoder=True).model_type
        assert model_family(text) is not None, (model_type, text)


def test_the_refusal_names_the_type_loaded_not_its_text_config():
    """AutoModelForCausalLM builds an Emu3 checkpoint as ``Emu3ForCausalLM`` on its text config
    (model_type ``emu3_text_model``, which the user never typed): the refusal names ``emu3``, the
    text config's type only as the detail."""
    config = transformers.Emu3TextConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=32, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    msg = _refusal(check_supported, transformers.Emu3ForCausalLM(config))
    assert msg.startswith(
        "hf_megatrain: Emu3ForCausalLM: model_type 'emu3' (its text model's config: "
        "'emu3_text_model') is not supported."
    )


@pytest.mark.parametrize(
    "model_type,closest",
    [
        ("Llama3", "Closest supported types: llama, "),
        ("qwen_2", "Closest supported types: qwen2, "),
    ],
)
def test_the_refusal_lists_the_closest_types_and_where_all_are(tmp_path, model_type, closest):
    """Not all the types in one line: the closest by name, and where the full list is."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    msg = _refusal(loading.check_model_type, str(tmp_path))
    assert f"model_type '{model_type}' is not supported. {closest}" in msg
    assert f"all {len(SUPPORTED_MODEL_TYPES)}: hf_megatrain.SUPPORTED_MODEL_TYPES" in msg
    assert len(msg.split(": model_type")[1]) < 300 and "biogpt" not in msg


@pytest.mark.parametrize(
    "model_type,why",
    [
        ("dbrx", "fail under bf16 autocast"),
        ("hy_v4", "top-k indices"),
        ("zaya", "MoE layers' memory"),
    ],
)
def test_a_refusal_found_by_a_probe_says_why(tmp_path, model_type, why):
    """Decoder types a probe forced past the check and found wrong or unplanned: the refusal
    says why, not only that they are missing from the list."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    msg = _refusal(loading.check_model_type, str(tmp_path))
    assert f"model_type '{model_type}' is not supported: its " in msg and why in msg
    assert f"all {len(SUPPORTED_MODEL_TYPES)}: hf_megatrain.SUPPORTED_MODEL_TYPES" in msg


@pytest.mark.skipif("gemma4_text" not in CONFIG_MAPPING, reason="transformers without Gemma 4")
@pytest.mark.parametrize(
    "setting",
    [
        dict(num_kv_shared_layers=2),
        dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=128),
    ],
)
def test_gemma4_kv_sharing_and_per_layer_inputs_are_accepted_and_planned(tmp_path, capsys, setting):
    """Gemma 4's KV sharing and per-layer input embeddings (E2B, E4B) were refused by name until
    2026-12-07 (53rd session); they stream now (tests/test_gemma4.py). The model, its folder
    and ``plan`` take them, and the plan shows what they carry past the layers."""
    from hf_megatrain.cli import main  # noqa: PLC0415

    model = tiny_model(gemma4_config(**setting))
    assert check_supported(model) == "gemma4_text"
    model.config.save_pretrained(str(tmp_path))
    loading.check_model_type(str(tmp_path))
    main(["plan", str(tmp_path), "--seq-len", "16", "--tokens-per-step", "16"])
    out = capsys.readouterr().out
    what = "shared keys and values" if "num_kv_shared_layers" in setting else "per-layer inputs"
    assert f"{what}" in out and "saved through the step" in out


def test_cli_plan_names_the_text_model_of_a_multimodal_config(tmp_path):
    from hf_megatrain.cli import main  # noqa: PLC0415

    model, _ = _tiny_multimodal("gemma3")
    model.config.save_pretrained(str(tmp_path))
    with pytest.raises(SystemExit, match=r"Gemma3ForCausalLM\.from_pretrained\(<checkpoint>"):
        main(["plan", str(tmp_path), "--seq-len", "8", "--tokens-per-step", "8"])
