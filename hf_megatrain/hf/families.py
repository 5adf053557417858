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


def unsupported_model_type(what: str, model_type: object, note: str = "") -> str:
    """The one-line refusal of a config whose ``model_type`` no supported family trains."""
    return (
        f"{what}: model_type {model_type!r}{note} is not supported. Supported decoder "
        "architectures: "
        f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))} (and the types transformers builds with "
        "their model classes)."
    )
