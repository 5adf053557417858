"""Which model families hf_megatrain streams: the supported model types, and the types
transformers builds with one of their model classes."""

from __future__ import annotations

#: model_type -> short description; each has a tiny-config equivalence test.
SUPPORTED_MODEL_TYPES = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
    "gemma3_text": "Gemma3 (text, sliding + full attention layers)",
    "phi3": "Phi3",
    "qwen3_moe": "Qwen3-MoE (router aux loss keeps its gradient)",
    "mixtral": "Mixtral (router aux loss keeps its gradient)",
    "gemma2": "Gemma2 (sliding + full attention layers, soft-capping)",
    "granite": "Granite (embedding, residual, attention and logit multipliers)",
    "phi": "Phi (parallel attention and MLP, partial rotary)",
    "olmo2": "OLMo 2",
    "olmo3": "OLMo 3 (sliding + full attention layers)",
    "smollm3": "SmolLM3 (NoPE layers)",
    "starcoder2": "StarCoder2",
    "cohere": "Cohere / Command R (parallel attention and MLP)",
    "glm4": "GLM-4",
    "ernie4_5": "ERNIE 4.5 (dense)",
    "helium": "Helium",
    "exaone4": "EXAONE 4",
    "seed_oss": "Seed-OSS",
    "qwen2_moe": "Qwen2-MoE (shared expert; router aux loss keeps its gradient)",
    "olmoe": "OLMoE (router aux loss keeps its gradient)",
    "gpt_oss": "gpt-oss (attention sinks; bf16 checkpoints, not MXFP4; router aux loss kept)",
    "gemma": "Gemma",
    "olmo": "OLMo",
    "stablelm": "StableLM",
    "gpt_neox": "GPT-NeoX / Pythia (parallel attention and MLP)",
    "nemotron": "Nemotron",
    "arcee": "Arcee (AFM)",
    "apertus": "Apertus",
    "hunyuan_v1_dense": "Hunyuan (dense)",
    "lfm2": "LFM2 (short gated convolutions + attention)",
    "granitemoe": "Granite-MoE (router aux loss keeps its gradient)",
    "glm4_moe": "GLM-4.5 MoE (shared expert, grouped routing)",
    "dots1": "dots.llm1 (MoE, shared expert)",
    "deepseek_v2": "DeepSeek-V2 (multi-head latent attention, MoE)",
    "deepseek_v3": "DeepSeek-V3 / Kimi K2 shape (multi-head latent attention, MoE)",
    "falcon": "Falcon (new and old decoder architectures)",
    "bloom": "BLOOM (ALiBi)",
    "mpt": "MPT (ALiBi)",
    "gptj": "GPT-J (parallel attention and MLP)",
    "gpt_bigcode": "GPTBigCode / StarCoder (multi-query attention)",
    "qwen3_next": "Qwen3-Next (Gated DeltaNet linear + gated full attention, MoE)",
    "gpt2": "GPT-2 (learned positions, fused qkv Conv1D)",
    "gpt_neo": "GPT-Neo (local and global attention layers)",
    "codegen": "CodeGen (parallel attention and MLP, partial rotary)",
    "opt": "OPT (learned positions)",
    "xglm": "XGLM (sinusoidal positions, scaled embedding)",
    "persimmon": "Persimmon (q/k layer norms, partial rotary)",
    "glm": "GLM",
    "ministral": "Ministral (sliding + full attention layers)",
    "ministral3": "Ministral 3",
    "cohere2": "Cohere 2 / Command R7B (sliding + full attention layers)",
    "vaultgemma": "VaultGemma",
    "cwm": "CWM (sliding + full attention layers)",
    "bitnet": "BitNet (bf16 weights, sub-norms)",
    "diffllama": "DiffLlama (differential attention)",
    "nanochat": "nanochat",
    "granitemoeshared": "Granite-MoE with a shared expert (router aux loss keeps its gradient)",
    "hunyuan_v1_moe": "Hunyuan MoE",
    "exaone_moe": "EXAONE MoE (sliding + full attention layers)",
    "lfm2_moe": "LFM2-MoE (short gated convolutions + attention, MoE)",
    "flex_olmo": "FlexOlmo (MoE; router aux loss keeps its gradient)",
    "glm4_moe_lite": "GLM-4.7-Flash shape (multi-head latent attention, MoE)",
    "solar_open": "Solar Open (MoE, shared expert)",
    "ernie4_5_moe": "ERNIE 4.5 MoE (shared expert; frozen router statistics)",
    "deepseek_v32": "DeepSeek-V3.2 (sparse attention picked by an indexer AdamW skips, MoE)",
    "minicpm3": "MiniCPM3 (multi-head latent attention, scaled embeddings, residuals and head)",
    "biogpt": "BioGPT (learned positions, scaled embeddings, its head named output_projection)",
    "llama4_text": "Llama 4 (text: chunked attention, NoPE layers, MoE)",
    "qwen3_5_text": "Qwen3.5 (Gated DeltaNet linear + gated full attention)",
    "qwen3_5_moe_text": "Qwen3.5-MoE (Gated DeltaNet linear + gated full attention, MoE)",
    "olmo_hybrid": "OLMo Hybrid (Gated DeltaNet linear + full attention)",
    "kimi_linear": "Kimi Linear (Kimi delta attention + latent attention, MoE)",
    "minimax": "MiniMax (lightning linear + full attention, MoE)",
    "minimax_m2": "MiniMax-M2 (MoE)",
    "jetmoe": "JetMoE (mixture of attention heads and MLP experts)",
    "phimoe": "Phi-3.5-MoE (sparse mixer routing with jitter)",
    "jais2": "Jais 2",
    "mellum": "Mellum (sliding + full attention, MoE)",
    "laguna": "Laguna (per-layer head counts, soft-capped router, MoE)",
    "hy_v3": "Hunyuan V3 (MoE)",
    "glm_moe_dsa": "GLM MoE with DeepSeek sparse attention (indexer, latent attention)",
    "axk1": "A.X K1 (latent attention, MoE)",
    "axk2": "A.X K2 (latent attention with an indexer, MoE)",
    "youtu": "Youtu (latent attention)",
    "mimo_v2_flash": "MiMo-V2-Flash (sliding + full attention, MoE)",
    "ctrl": "CTRL (sinusoidal positions)",
    "openai-gpt": "OpenAI GPT (learned positions, post-norm)",
    "gpt_neox_japanese": "GPT-NeoX Japanese",
    "granite_swa": "Granite with sliding-window layers (Granite's multipliers)",
    "granitemoe_swa": "Granite-MoE with sliding-window layers (router aux loss keeps its gradient)",
    "cohere2_moe": "Cohere 2 MoE (sliding + full attention, shared expert)",
    "bailing_hybrid": "Bailing hybrid (linear + latent attention, MoE)",
    "lara_mini": "Lara mini (Gated DeltaNet linear, sliding and full attention, MoE)",
    "apertus1p5_text": "Apertus 1.5 (text)",
    "flint": "Flint (sliding + full attention, MoE)",
    "kolibri1": "Kolibri 1 (sliding + full attention, MoE)",
    "minicpm5_moe": "MiniCPM5-MoE",
    "beam": "Beam (sliding + full attention, soft-capped logits, MoE)",
    "lfm3": "LFM3 (short gated convolutions + sliding and full attention)",
    "hyperclovax": "HyperCLOVA X (muP multipliers, logits multiplied by logits_scaling)",
    "gemma4_text": "Gemma 4 (text: sliding + full attention layers of their own head widths, "
    "keys as values, soft-capped logits, MoE beside the MLP, per-layer inputs, KV sharing)",
    "gemma4_unified_text": "Gemma 4 unified (text: Gemma 4's layers, KV sharing)",
    "gemma3n_text": "Gemma 3n (text: AltUp's 4 residual streams, LAuReL, per-layer inputs, "
    "KV sharing, activation sparsity)",
    "mamba2": "Mamba-2 (chunked state-space scan)",
    "bamba": "Bamba (Mamba-2 + attention layers)",
    "granitemoehybrid": "Granite 4.0 hybrid (Mamba-2 + attention layers, MoE, Granite's multipliers)",
    "nemotron_h": "Nemotron-H / Nemotron 3 (Mamba-2, attention, MLP and MoE layers)",
    "falcon_h1": "Falcon-H1 (Mamba-2 beside attention in each layer, muP multipliers)",
    "mamba": "Mamba (selective scan)",
    "falcon_mamba": "Falcon Mamba (selective scan, normed B, C and time steps)",
    "jamba": "Jamba (Mamba + attention layers, MoE)",
}


def model_family(model_type: str | None) -> str | None:
    """The supported family a ``model_type`` trains as (None: not supported): itself, or the
    supported type whose model class transformers builds for it too (its causal-LM mapping
    builds ``internlm3`` and ``exaone`` checkpoints as ``LlamaForCausalLM``): the same modules,
    so the same streaming, memory lines and equivalence."""
    if model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    from transformers.models.auto.modeling_auto import (  # noqa: PLC0415
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal_lm,
    )

    cls = causal_lm.get(model_type) if model_type else None
    return next((t for t in SUPPORTED_MODEL_TYPES if cls and causal_lm.get(t) == cls), None)


def family_key(model_type: str | None) -> str | None:
    """The key of the per-family tables (memory lines, layer kernels) for ``model_type``: the
    supported family it trains as (``model_family``), else the type itself."""
    return model_family(model_type) or model_type


#: The ``key_mapping`` that loads a multimodal checkpoint's text model alone, with the text model's
#: own ``*ForCausalLM`` class: ``Gemma3ForCausalLM.from_pretrained(path, key_mapping=...)`` (the
#: other towers' tensors are skipped). Without it that class finds none of the checkpoint's text
#: weights (prefixed ``language_model.model.``, ``model.language_model.`` or ``model.text_model.``)
#: and initializes them at random. ``save_pretrained`` writes the keys back as the multimodal
#: checkpoint names them unless given ``save_original_format=False``.
TEXT_MODEL_KEY_MAPPING = {
    "^language_model.model.": "model.",
    "^model.language_model.": "model.",
    "^model.text_model.": "model.",
    "^language_model.lm_head.": "lm_head.",
}

#: Multimodal model types whose text model (a supported family) loads, every weight as the
#: multimodal model holds it, with ``TEXT_MODEL_KEY_MAPPING`` (checked on tiny checkpoints with
#: transformers 5.25; tests/test_family_refusals.py repeats it for a few).
TEXT_MODEL_KEY_MAPPING_TYPES = frozenset(
    """audioflamingo3 aya_vision blip-2 cohere2_vision deepseek_vl deepseek_vl_hybrid fuyu gemma3
    gemma4 gemma4_unified glmasr got_ocr2 granite_speech granite_speech_plus idefics2 idefics3
    instructblip instructblipvideo internvl janus lfm2_vl lighton_ocr llava llava_next llava_next_video
    llava_onevision llava_onevision1_5 mistral3 moss_transcribe_diarize musicflamingo omniasr
    paligemma pp_chart2table qwen2_audio qwen3_asr shieldgemma2 smolvlm vibevoice vibevoice_asr
    video_llama_3 video_llava vipllava voxtral""".split()
)

#: Why decoder types that transformers has are refused, where a probe of them found out
#: (docs/design.md, Supported architectures): the refusal says it.
REFUSAL_REASONS = {
    "dbrx": "its experts fail under bf16 autocast in transformers' own code (stock's too)",
    "doge": "its loss is not the fused loss's, and its router aux loss takes other arguments",
    "ergo": "its head computes fp32 logits (not one linear layer the fused loss can take)",
    "zaya": "its MoE layers' memory is not planned within the margin yet (the step 1.3x its plan: "
    "the convolutional attention, and the router state each layer hands the next)",
    # Their residual streams are planned (``ModelShape.residual_streams``) since 2026-12-07; the
    # rest of each was probed then (fp32 forward and gradients exact against stock for Hunyuan V4
    # and Qwen4-exp).
    "hy_v4": "its layers hand the next their sparse attention's top-k indices, which every layer "
    "saves and the plan does not count (its step grew twice the plan per layer at hidden 256)",
    "deepseek_v4": "its hyper-connection model is not measured against the plan yet (its tiny "
    "model's router aux loss fails in transformers' own code)",
    **dict.fromkeys(
        ("qwen4_exp", "qwen4_exp_text"),
        "its Gated DeltaNet layers (PyTorch fallback) beside hyper-connection streams are not "
        "planned (its step 8.9x the plan at hidden 256)",
    ),
    **dict.fromkeys(
        ("inkling", "inkling_text"), "its logits are cut to a smaller vocabulary after the head"
    ),
    **dict.fromkeys(
        ("modernbert-decoder", "cpmant"), "its head is not one linear layer the fused loss takes"
    ),
    **dict.fromkeys(
        ("dory", "inkling2_loop", "inkling2_loop_text", "hrm_text"),
        "it runs some of its layers more than once per forward",
    ),
    "longcat_flash": "each of its layers holds two attention and MLP sub-layers",
    **dict.fromkeys(("zamba", "zamba2"), "one block of its weights serves several layers"),
}  # fmt: skip

#: Where the refusal points for the whole list of supported types.
_FULL_LIST = (
    "all {n}: hf_megatrain.SUPPORTED_MODEL_TYPES (README.md, Supported families), and the types "
    "transformers builds with one of their classes (e.g. internlm3, exaone)"
)


def text_model_type(config: object) -> str | None:
    """The model_type of ``config``'s text model where it is another config's (a multimodal
    model's ``text_config``), else None. ``config``: a transformers config or a config.json
    mapping (its ``text_config``, or the default text config class of its model_type)."""
    if isinstance(config, dict):
        text = config.get("text_config")
        if isinstance(text, dict) and isinstance(text.get("model_type"), str):
            return text["model_type"]
        return _default_text_type(config.get("model_type"))
    get = getattr(config, "get_text_config", None)
    try:
        text = get(decoder=True) if get is not None else config
    except Exception:  # noqa: BLE001 - a config this version cannot split: no text model named
        return None
    return getattr(text, "model_type", None) if text is not config else None


def _default_text_type(model_type: object) -> str | None:
    """The model_type of ``model_type``'s default text config class (None: it has none)."""
    from transformers import CONFIG_MAPPING  # noqa: PLC0415

    try:
        sub = getattr(CONFIG_MAPPING[model_type], "sub_configs", None) or {}
    except (KeyError, TypeError, ValueError):
        return None
    return getattr(sub.get("text_config"), "model_type", None) or None


def outer_model_type(class_name: str, model_type: str | None) -> str | None:
    """The model_type a user loaded where transformers built ``class_name`` with that type's text
    config (AutoModelForCausalLM builds ``emu3`` as ``Emu3ForCausalLM`` on its
    ``emu3_text_model`` config); None where there is none."""
    from transformers.models.auto.modeling_auto import (  # noqa: PLC0415
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal_lm,
    )

    return next(
        (
            t
            for t, cls in causal_lm.items()
            if cls == class_name and t != model_type and _default_text_type(t) == model_type
        ),
        None,
    )


def unsupported_model_type(
    what: str, model_type: object, note: str = "", text_type: str | None = None
) -> str:
    """The one-line refusal of a config whose ``model_type`` no supported family trains.

    ``model_type``: the type the user loaded (a multimodal model's own, not its text model's);
    ``text_type``: its text model's type, where that is another (``text_model_type``). A text
    model of a supported family is named with how to load it alone; otherwise the closest
    supported types by name, and where the full list is."""
    head = f"{what}: model_type {model_type!r}{note}"
    family = model_family(text_type) if text_type and text_type != model_type else None
    if family is not None:
        from transformers.models.auto.modeling_auto import (  # noqa: PLC0415
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal_lm,
        )

        cls = causal_lm.get(text_type) or causal_lm.get(family) or "its *ForCausalLM class"
        if model_type in TEXT_MODEL_KEY_MAPPING_TYPES:
            how = (
                f"load it alone with {cls}.from_pretrained(<checkpoint>, key_mapping=hf_megatrain."
                "hf.families.TEXT_MODEL_KEY_MAPPING) and train that (for --model_path, save it "
                "with save_pretrained(folder, save_original_format=False))"
            )
        else:
            how = f"train it alone, as a {cls}"
        return (
            f"{head} (multimodal) is not supported, but its text model ({text_type!r}) is: {how}."
        )
    if text_type and text_type != model_type:
        head += f" (its text model's config: {text_type!r})"
    full = _FULL_LIST.format(n=len(SUPPORTED_MODEL_TYPES))
    why = REFUSAL_REASONS.get(model_type) or REFUSAL_REASONS.get(text_type)
    why = f": {why}" if isinstance(why, str) else ""
    return f"{head} is not supported{why}. {_closest(model_type)}; {full}."


def _closest(model_type: object) -> str:
    """The supported types closest to ``model_type`` by name (else the first few listed)."""
    import difflib  # noqa: PLC0415

    name = str(model_type).lower() if isinstance(model_type, str) else ""
    close = difflib.get_close_matches(name, SUPPORTED_MODEL_TYPES, n=5, cutoff=0.6)
    if close:
        return f"Closest supported types: {', '.join(close)}"
    return f"Supported types include {', '.join(list(SUPPORTED_MODEL_TYPES)[:6])}, ..."
