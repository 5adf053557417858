"""Shared fixtures for equivalence tests: tiny configs, data, and a log-recording callback."""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import (
    ApertusConfig,
    ArceeConfig,
    AutoModelForCausalLM,
    BloomConfig,
    CohereConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    Dots1Config,
    Ernie4_5Config,
    Exaone4Config,
    FalconConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    Glm4Config,
    Glm4MoeConfig,
    GPTBigCodeConfig,
    GPTJConfig,
    GPTNeoXConfig,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeConfig,
    HeliumConfig,
    HunYuanDenseV1Config,
    Lfm2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    MptConfig,
    NemotronConfig,
    Olmo2Config,
    Olmo3Config,
    OlmoConfig,
    OlmoeConfig,
    Phi3Config,
    PhiConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    SeedOssConfig,
    SmolLM3Config,
    StableLmConfig,
    Starcoder2Config,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from hf_megatrain import HFMegaTrainer, MegaTrainArguments
from hf_megatrain.core.recompute import _sdpa_kernels

VOCAB = 128
SEQ = 16

# Shared tiny shape: 2 decoder layers, hidden 32, GQA (4 query heads, 2 kv heads).
_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


@functools.cache
def stock_aux_loss_trains(arch: str) -> bool:
    """Whether the installed transformers' own ``arch`` model computes a loss with its router aux
    loss on. transformers 5.17's GraniteMoE does not: its ``ForCausalLM.forward`` does not pass
    ``output_router_logits`` to the decoder, gets no router logits back, and fails adding the
    aux "loss" (an int 0) to the loss (``'int' object has no attribute 'to'``; 5.24 passes it).
    The stock Trainer fails the same way, so there is nothing to compare against there."""
    model = tiny_model(tiny_config(arch))
    ids = torch.arange(8).unsqueeze(0) % model.config.vocab_size
    try:
        with torch.no_grad():
            model(input_ids=ids, labels=ids)
    except AttributeError as e:
        if "'int' object has no attribute 'to'" not in str(e):
            raise  # any other failure of the stock model is a failure, not this bug
        return False
    return True


def tiny_config(arch: str, **overrides):
    """A tiny fp32 config of ``arch`` that still exercises the family's special paths.

    ``overrides`` replace entries of the shared tiny shape (e.g. ``num_hidden_layers=3``).
    """
    _BASE = {**_SHAPE, **overrides}  # noqa: N806 - reads as the shared shape below
    # Gemma-style attention: a window < SEQ (both mask paths run), soft-capped attention and
    # final logits, the embedding scale (model-level: must survive streaming).
    gemma = dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=6,
                 final_logit_softcapping=30.0, attn_logit_softcapping=50.0)  # fmt: skip
    # MoE routing with the router aux loss on: its gradient must reach the routers.
    moe = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)
    alternating = [("sliding_attention", "full_attention")[i % 2]
                   for i in range(_BASE["num_hidden_layers"])]  # fmt: skip
    # Token ids inside the tiny vocabulary where a family's defaults point beyond it.
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    builders = {
        "llama": lambda: LlamaConfig(**_BASE),
        "qwen2": lambda: Qwen2Config(**_BASE),
        "qwen3": lambda: Qwen3Config(**_BASE, head_dim=8),
        # A window shorter than the sequence so the sliding-window mask really cuts attention.
        "mistral": lambda: MistralConfig(**_BASE, sliding_window=6),
        # One sliding and one full attention layer.
        "gemma3_text": lambda: Gemma3TextConfig(
            **_BASE, **gemma, layer_types=["sliding_attention", "full_attention"]
        ),
        "phi3": lambda: Phi3Config(**_BASE, **ids),
        "qwen3_moe": lambda: Qwen3MoeConfig(
            **_BASE, **moe, head_dim=8, moe_intermediate_size=16, num_experts=4
        ),
        "mixtral": lambda: MixtralConfig(**_BASE, **moe, num_local_experts=4),
        "gemma2": lambda: Gemma2Config(**_BASE, **gemma),
        # Granite's multipliers scale embeddings, residuals, attention and logits in the
        # model's own code: all must survive streaming.
        "granite": lambda: GraniteConfig(
            **_BASE,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            logits_scaling=8.0,
            attention_multiplier=0.015,
        ),  # fmt: skip
        # Parallel attention and MLP on one LayerNorm, partial rotary, biases; multi-head only.
        "phi": lambda: PhiConfig(**{k: v for k, v in _BASE.items() if k != "num_key_value_heads"}),
        # Larger aux coefficient than the others': at 0.1 the aux term moves its router
        # gradient by 8e-4, under test_router_aux_loss_reaches_router_gradients' 1e-3 floor.
        "qwen2_moe": lambda: Qwen2MoeConfig(
            **_BASE,
            **{**moe, "router_aux_loss_coef": 0.5},
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_experts=4,
        ),  # fmt: skip
        "olmoe": lambda: OlmoeConfig(**_BASE, **moe, num_experts=4),
        # Attention sinks, alternating sliding/full layers, a biased router over fused experts.
        "gpt_oss": lambda: GptOssConfig(
            **_BASE,
            **moe,
            head_dim=8,
            num_local_experts=4,
            sliding_window=6,
            layer_types=alternating,
        ),  # fmt: skip
        # Families whose differences from Llama sit inside their layers (norm placement and
        # kind, q/k norms, biases, parallel blocks, NoPE layers, sliding windows): defaults.
        "olmo2": lambda: Olmo2Config(**_BASE, **ids),
        "olmo3": lambda: Olmo3Config(**_BASE, **ids, sliding_window=6),
        "smollm3": lambda: SmolLM3Config(**_BASE, **ids, no_rope_layer_interval=2),
        "starcoder2": lambda: Starcoder2Config(**_BASE, **ids),
        "cohere": lambda: CohereConfig(**_BASE, **ids),
        "glm4": lambda: Glm4Config(**_BASE, **ids, head_dim=8),
        "ernie4_5": lambda: Ernie4_5Config(**_BASE, **ids, head_dim=8),
        "helium": lambda: HeliumConfig(**_BASE, **ids, head_dim=8),
        "exaone4": lambda: Exaone4Config(**_BASE, **ids, sliding_window=6),
        # Seed-OSS defaults to dropout 0.1 in attention and residuals: off, as every config
        # here (test_random_layers_replay_rng covers dropout inside streamed layers).
        "seed_oss": lambda: SeedOssConfig(
            **_BASE, **ids, head_dim=8, attention_dropout=0.0, residual_dropout=0.0
        ),
    }
    # Multi-head latent attention (low-rank q/kv, split rope/nope heads) over MoE layers after
    # a dense first one, shared experts, grouped routing; one kv head per query head.
    mla = dict(
        num_key_value_heads=_BASE["num_attention_heads"], kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, n_shared_experts=1,
        moe_intermediate_size=16, first_k_dense_replace=1, num_experts_per_tok=2, n_group=1,
        topk_group=1,
    )  # fmt: skip
    mla_base = {**_BASE, **ids, **mla}
    routed = dict(n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16,
                  first_k_dense_replace=1, num_experts_per_tok=2, n_group=1, topk_group=1)  # fmt: skip
    builders |= {
        "gemma": lambda: GemmaConfig(**_BASE, **ids, head_dim=8),
        "olmo": lambda: OlmoConfig(**_BASE, **ids),
        "stablelm": lambda: StableLmConfig(**_BASE, **ids),
        "gpt_neox": lambda: GPTNeoXConfig(**_BASE, **ids),
        "nemotron": lambda: NemotronConfig(**_BASE, **ids, head_dim=8),
        "arcee": lambda: ArceeConfig(**_BASE, **ids),
        "apertus": lambda: ApertusConfig(**_BASE, **ids),
        "hunyuan_v1_dense": lambda: HunYuanDenseV1Config(**_BASE, **ids, head_dim=8),
        # Short gated convolutions in most layers, attention in the rest.
        "lfm2": lambda: Lfm2Config(**_BASE, **ids),
        "granitemoe": lambda: GraniteMoeConfig(**_BASE, **ids, **moe, num_local_experts=4),
        "glm4_moe": lambda: Glm4MoeConfig(**_BASE, **ids, **routed, head_dim=8),
        "dots1": lambda: Dots1Config(**_BASE, **ids, **routed),
        "deepseek_v2": lambda: DeepseekV2Config(**{**mla_base, "q_lora_rank": None}),
        "deepseek_v3": lambda: DeepseekV3Config(**{**mla_base, "q_lora_rank": 16}),
    }
    # GPT-style configs (layers under transformer.h / .blocks), by their own argument names.
    h, n, heads = _BASE["hidden_size"], _BASE["num_hidden_layers"], _BASE["num_attention_heads"]
    vocab, pos = _BASE["vocab_size"], _BASE["max_position_embeddings"]
    gpt = dict(vocab_size=vocab, n_embd=h, n_layer=n, n_head=heads, n_positions=pos, **ids)
    builders |= {
        # The new decoder architecture: grouped kv heads, parallel attention and MLP.
        "falcon": lambda: FalconConfig(
            vocab_size=vocab,
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_kv_heads=_BASE["num_key_value_heads"],
            new_decoder_architecture=True,
            **ids,
        ),  # fmt: skip
        "bloom": lambda: BloomConfig(
            vocab_size=vocab, hidden_size=h, n_layer=n, n_head=heads, **ids
        ),
        "mpt": lambda: MptConfig(
            vocab_size=vocab, d_model=h, n_layers=n, n_heads=heads, max_seq_len=pos, **ids
        ),
        "gptj": lambda: GPTJConfig(**gpt, rotary_dim=4),
        # Gated DeltaNet linear attention (causal convolution, recurrent state) and gated full
        # attention, over MoE layers with a shared expert (no aux loss by default).
        "qwen3_next": lambda: Qwen3NextConfig(
            **_BASE,
            **ids,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            layer_types=[("linear_attention", "full_attention")[i % 2] for i in range(n)],
        ),  # fmt: skip
        # Multi-query attention; dropout off (its defaults are 0.1, see seed_oss).
        "gpt_bigcode": lambda: GPTBigCodeConfig(
            **gpt, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
        ),
    }
    if arch in ADDED_FAMILY_OVERRIDES:
        layers = overrides.get("num_hidden_layers", _ADDED_FAMILY_LAYERS.get(arch, 2))
        return _added_family_config(arch, {**_BASE, "num_hidden_layers": layers})
    if arch not in builders:
        raise KeyError(arch)
    return builders[arch]()


#: The tiny shape's entries under the names other families' configs take (GPT-style, OPT,
#: XGLM ...), plus dropout off, a window under SEQ and small MoE routing with the router aux
#: loss on; a config takes those of its own arguments (or attribute aliases) only.
_ADDED_COMMON = dict(
    pad_token_id=0, bos_token_id=1, eos_token_id=2, head_dim=8, sliding_window=6,
    attention_dropout=0.0, hidden_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    dropout=0.0, activation_dropout=0.0, embed_dropout=0.0, layerdrop=0.0,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, output_router_logits=True,
    router_aux_loss_coef=0.1, aux_loss_coef=0.1, n_shared_experts=1, n_group=1, topk_group=1,
    first_k_dense_replace=1, expert_intermediate_size=16,
)  # fmt: skip
_MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8, num_key_value_heads=4)  # fmt: skip


def _mixed(n: int, kinds=("sliding_attention", "full_attention")) -> list[str]:
    return [kinds[i % 2] for i in range(n)]


def _cycle(n: int, kinds: tuple) -> list:
    return [kinds[i % len(kinds)] for i in range(n)]


def _linear_full(n: int) -> list[str]:
    return _mixed(n, ("linear_attention", "full_attention"))


def _dense_first(n: int) -> list[str]:
    return ["dense"] + ["sparse"] * (n - 1)


#: Gated DeltaNet widths (2 key heads, 4 value heads of 8).
_LINEAR = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
               linear_num_value_heads=4)  # fmt: skip
#: An indexer picking 4 positions per query (fewer than SEQ: some projections get no gradient).
_INDEXER = dict(index_topk=4, index_head_dim=8, index_n_heads=2)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head="auto", mamba_n_groups=2, mamba_d_state=8,
               mamba_chunk_size=4)  # fmt: skip
#: Mamba-2 head counts that must make the inner width (2 x hidden) with their head width:
#: family -> (heads, head width) names; set from the hidden size a test asks for.
_SSM_HEAD_NAMES = {"mamba2": ("num_heads", "head_dim"),
                   "nemotron_h": ("mamba_num_heads", "mamba_head_dim")}  # fmt: skip
_GRANITE = dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.5,
                attention_multiplier=0.125)  # fmt: skip


#: Families added 2026-12-06 (each checked exact against stock first by a probe of every
#: decoder type transformers has): their own settings, as functions of the layer count, that
#: turn on the family's special paths in a tiny model (three layers by default where a pattern
#: needs them).
ADDED_FAMILY_OVERRIDES: dict[str, Callable[[int], dict]] = {
    "gpt2": lambda n: dict(n_inner=64),
    # Local (window 6) and global attention layers.
    "gpt_neo": lambda n: dict(
        attention_types=[[["global", "local"], n // 2]] + ([[["global"], 1]] if n % 2 else []),
        window_size=6, num_layers=n,
    ),
    "codegen": lambda n: dict(n_inner=64, rotary_dim=4, n_ctx=64),
    "opt": lambda n: dict(ffn_dim=64, word_embed_proj_dim=32, enable_bias=True),
    "xglm": lambda n: dict(d_model=32, ffn_dim=64, num_layers=n, attention_heads=4),
    "persimmon": lambda n: dict(partial_rotary_factor=0.5),
    "glm": lambda n: dict(),
    "ministral": lambda n: dict(layer_types=_mixed(n)),
    # (Its YaRN scaling's original 8,192 positions, 16x: the table it implies.)
    "ministral3": lambda n: dict(max_position_embeddings=131072),
    "cohere2": lambda n: dict(layer_types=_mixed(n)),
    "vaultgemma": lambda n: dict(layer_types=_mixed(n)),
    "cwm": lambda n: dict(layer_types=_mixed(n)),
    "bitnet": lambda n: dict(),
    "diffllama": lambda n: dict(),
    "nanochat": lambda n: dict(),
    "granitemoeshared": lambda n: dict(),
    "hunyuan_v1_moe": lambda n: dict(),
    "exaone_moe": lambda n: dict(layer_types=_mixed(n)),
    "lfm2_moe": lambda n: dict(layer_types=_mixed(n, ("conv", "full_attention")),
                               num_dense_layers=1),
    "flex_olmo": lambda n: dict(),
    "glm4_moe_lite": lambda n: dict(**_MLA),
    "solar_open": lambda n: dict(),
    # A dense first layer, then MoE layers with a shared expert; the router's frozen
    # e_score_correction_bias streams with its layer, never updated.
    "ernie4_5_moe": lambda n: dict(moe_layer_start_index=1, moe_num_shared_experts=1),
    # Multi-head latent attention whose indexer picks 4 positions per query (fewer than SEQ):
    # its projections get no gradient, and AdamW skips them.
    "deepseek_v32": lambda n: dict(**_MLA, index_topk=4, index_head_dim=8, index_n_heads=2),
    # Multi-head latent attention; embeddings scaled by 12, residual branches by 1.4 / sqrt(n),
    # the head's input divided by hidden / 8.
    "minicpm3": lambda n: dict(**_MLA, scale_emb=12, scale_depth=1.4, dim_model_base=8),
    "biogpt": lambda n: dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                             scale_embedding=True),
    # Chunked attention (chunks of 6) on its RoPE layers with L2 q/k norms; a NoPE full-attention
    # layer in the middle whose queries are scaled by position (floor 4); a MoE layer (shared
    # expert, sigmoid top-k router) between dense ones.
    "llama4_text": lambda n: dict(
        intermediate_size_mlp=64, attention_chunk_size=6, no_rope_layers=[int(i != 1) for i in range(n)],
        interleave_moe_layer_step=2, floor_scale=4, attn_scale=0.1,
    ),
    # --- Added 2026-12-07 after a probe of every refused decoder type of transformers 5.25
    # (each exact against stock, fp32, 5 steps). Gated DeltaNet linear attention layers between
    # gated full-attention ones (Qwen3-Next's), dense and MoE.
    "qwen3_5_text": lambda n: dict(layer_types=_linear_full(n), **_LINEAR),
    "qwen3_5_moe_text": lambda n: dict(layer_types=_linear_full(n), **_LINEAR),
    "olmo_hybrid": lambda n: dict(layer_types=_linear_full(n)),
    # Kimi delta attention and latent attention; a dense first layer, then MoE.
    "kimi_linear": lambda n: dict(**_MLA, layer_types=_linear_full(n), mlp_layer_types=_dense_first(n),
                                  linear_head_dim=8, linear_num_heads=4),
    # Lightning (block linear) attention between full-attention layers, blocks of 4.
    "minimax": lambda n: dict(layer_types=_mixed(n, ("full_attention", "linear_attention")),
                              block_size=4),
    "minimax_m2": lambda n: dict(),
    "jetmoe": lambda n: dict(),
    # Jitter off: two forwards would draw other noise (test_equivalence trains it with jitter).
    "phimoe": lambda n: dict(router_jitter_noise=0.0, input_jitter_noise=0.0),
    "jais2": lambda n: dict(),
    "mellum": lambda n: dict(layer_types=_mixed(n), mlp_layer_types=_dense_first(n)),
    # Per-layer head counts and a soft-capped router.
    "laguna": lambda n: dict(layer_types=_mixed(n), mlp_layer_types=_dense_first(n),
                             num_attention_heads_per_layer=[4] * n,
                             moe_router_logit_softcapping=5.0),
    "hy_v3": lambda n: dict(mlp_layer_types=_dense_first(n)),
    # Latent attention with an indexer (the second layer shares the first's picks).
    "glm_moe_dsa": lambda n: dict(**_MLA, **_INDEXER, mlp_layer_types=_dense_first(n),
                                  indexer_types=_cycle(n, ("full", "shared", "full"))),
    "axk1": lambda n: dict(**_MLA, mlp_layer_types=_dense_first(n)),
    "axk2": lambda n: dict(**_MLA, **_INDEXER, mlp_layer_types=_dense_first(n),
                           gated_norm_rank=4),
    "youtu": lambda n: dict(**_MLA),
    "mimo_v2_flash": lambda n: dict(v_head_dim=8, layer_types=["full_attention"] + ["sliding_attention"] * (n - 1),
                                    mlp_layer_types=_dense_first(n)),
    "ctrl": lambda n: dict(dff=64),
    "openai-gpt": lambda n: dict(),
    "gpt_neox_japanese": lambda n: dict(),
    # Granite's multipliers (the head's logits divided by logits_scaling) with sliding layers.
    "granite_swa": lambda n: dict(layer_types=_mixed(n), **_GRANITE),
    "granitemoe_swa": lambda n: dict(layer_types=_mixed(n), **_GRANITE,
                                     shared_intermediate_size=16),
    # Granite's multipliers, but the logits multiplied by logits_scaling; norms after attention
    # and MLP too.
    "hyperclovax": lambda n: dict(**_GRANITE, use_post_norm=True),
    # Cohere's logit_scale; a dense first layer, then MoE with a shared expert.
    "cohere2_moe": lambda n: dict(layer_types=_mixed(n), mlp_layer_types=_dense_first(n),
                                  num_shared_experts=1, prefix_dense_intermediate_size=64),
    # Not in transformers 5.17 (skipped there).
    "bailing_hybrid": lambda n: dict(**_MLA, layer_types=_linear_full(n), mlp_layer_types=_dense_first(n),
                                     num_mtp_layers=0, layer_group_size=2),
    "lara_mini": lambda n: dict(layer_types=_cycle(n, ("linear_attention", "sliding_attention", "full_attention")),
                                **_LINEAR),
    "apertus1p5_text": lambda n: dict(max_position_embeddings=131072),
    "flint": lambda n: dict(layer_types=_mixed(n), mlp_only_layers=[0]),
    "kolibri1": lambda n: dict(layer_types=_mixed(n)),
    "minicpm5_moe": lambda n: dict(mlp_layer_types=_dense_first(n)),
    "beam": lambda n: dict(layer_types=_mixed(n), mlp_layer_types=_dense_first(n)),
    "lfm3": lambda n: dict(layer_types=_cycle(n, ("conv", "sliding_attention", "full_attention")),
                           conv_L_cache=3),
    # A full-attention layer of its own width (2 x head_dim, one kv head, keys as values: the
    # per-layer config). Its per-layer inputs and KV sharing (E2B, E4B) and its MoE variant:
    # tests/test_gemma4.py (at 4 layers, at the suite's lr 1e-2 this tiny model is chaotic).
    "gemma4_text": lambda n: dict(layer_types=["sliding_attention"] * (n - 1) + ["full_attention"],
                                  final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
                                  attention_k_eq_v=True,
                                  config_kwargs=dict(global_head_dim=16,
                                                     num_global_key_value_heads=1)),
    # Gemma 4's text model of the unified multimodal checkpoints: Gemma 4's layers, no per-layer
    # inputs; KV sharing: the last layer reuses the keys and values of the last earlier one of its
    # type, and runs a double-wide MLP (at 3 layers or more).
    "gemma4_unified_text": lambda n: dict(layer_types=_mixed(n), num_kv_shared_layers=int(n > 2),
                                          use_double_wide_mlp=True),
    # AltUp's 4 streams, LAuReL, per-layer inputs, KV sharing (at 3 layers or more, the last
    # layer reuses the first's keys and values) and the first layer's activation sparsity.
    "gemma3n_text": lambda n: dict(layer_types=_mixed(n), num_kv_shared_layers=int(n > 2),
                                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                                   laurel_rank=4, altup_num_inputs=4,
                                   activation_sparsity_pattern=[0.95] + [0.0] * (n - 1)),
    # --- Added 2026-12-07 (51st session): state-space families. Mamba-2 mixers of 4 heads of 16,
    # state 8 in 2 groups, chunks of 4 (the 16-token rows span four: the inter-chunk recurrence
    # runs); attention layers between them.
    "mamba2": lambda n: dict(head_dim=16, n_groups=2, state_size=8, chunk_size=4),
    "bamba": lambda n: dict(attn_layer_indices=[1], **_MAMBA2),
    "granitemoehybrid": lambda n: dict(layer_types=_cycle(n, ("mamba", "attention")), **_MAMBA2,
                                       **_GRANITE, shared_intermediate_size=16),
    # Mamba-2, attention and MoE layers (Nemotron 3's pattern; "mlp" layers are dense ones).
    "nemotron_h": lambda n: dict(layers_block_type=_cycle(n, ("linear_attention", "full_attention", "moe")),
                                 mamba_head_dim=16, n_groups=2, ssm_state_size=8,
                                 chunk_size=4, moe_shared_expert_intermediate_size=16),
    # Mamba-2 beside attention in every layer, with every muP multiplier off 1.
    "falcon_h1": lambda n: dict(mamba_d_ssm=None, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8,
                                mamba_chunk_size=4, mamba_rms_norm=True, lm_head_multiplier=0.5,
                                embedding_multiplier=2.0, mlp_multipliers=[0.5, 2.0],
                                key_multiplier=0.7, attention_out_multiplier=0.8,
                                attention_in_multiplier=1.2, ssm_multipliers=[0.5, 0.6, 0.7, 0.8, 0.9],
                                ssm_in_multiplier=1.3, ssm_out_multiplier=0.9),
    # Mamba-1's selective scan (state 8); Jamba's attention and MoE layers between its own.
    "mamba": lambda n: dict(state_size=8, expand=2, conv_kernel=4),
    "falcon_mamba": lambda n: dict(state_size=8, expand=2, conv_kernel=4),
    "jamba": lambda n: dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                            expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2),
}  # fmt: skip
#: Their default layer count where the family's pattern needs three.
_ADDED_FAMILY_LAYERS = {
    a: 3 for a in ("gpt_neo", "ministral", "ministral3", "cohere2", "vaultgemma", "cwm",
                   "hunyuan_v1_moe", "exaone_moe", "lfm2_moe", "glm4_moe_lite", "solar_open",
                   "llama4_text", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid",
                   "kimi_linear", "minimax", "mellum", "laguna", "hy_v3", "glm_moe_dsa", "axk1",
                   "axk2", "mimo_v2_flash", "granite_swa", "granitemoe_swa", "cohere2_moe",
                   "bailing_hybrid", "lara_mini", "flint", "kolibri1", "minicpm5_moe", "beam",
                   "lfm3", "gemma4_text", "gemma4_unified_text", "gemma3n_text", "bamba",
                   "granitemoehybrid", "nemotron_h", "jamba")
}  # fmt: skip


def gemma4_config(**overrides):
    """A tiny Gemma 4 text config: layers sliding, full, sliding, full (hidden 32, 4 heads; the
    sliding layers 2 kv heads of 8, the full ones 2 of 16, keys as values: the per-layer
    config), no per-layer inputs; ``overrides`` on top (its MoE: ``enable_moe_block=True``...)."""
    from transformers import CONFIG_MAPPING  # noqa: PLC0415

    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                 num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=6,
                 layer_types=["sliding_attention", "full_attention"] * 2,
                 final_logit_softcapping=30.0, hidden_size_per_layer_input=0, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2)  # fmt: skip
    return CONFIG_MAPPING["gemma4_text"](**{**shape, **overrides})


def _installed(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING  # noqa: PLC0415

    return model_type in CONFIG_MAPPING


#: Families whose tiny model stock itself cannot train reproducibly to the suites' 1e-5: Gemma 4
#: unified's, against itself as 1 x 2 accumulation (fp32 sums in another order), drifted
#: 1.2e-2 to 1.2 on the grad norm by step 5 at lr 1e-2 over every variant tried (head widths,
#: soft-capping, windows, with and without KV sharing; some of its q-projection elements get
#: gradients of rounding size, which AdamW turns into whole steps). Their suites are in
#: tests/test_gemma4.py: exact gradients, and training measured against stock's own spread.
TWIN_NOISE_ARCHS = frozenset({"gemma4_unified_text"})
#: The added families the installed transformers has (the GPU machine's 5.17 lacks some), but
#: those.
ADDED_ARCHS = [a for a in ADDED_FAMILY_OVERRIDES if _installed(a) and a not in TWIN_NOISE_ARCHS]


def installed_supported_types() -> list[str]:
    """The supported model types the installed transformers has, sorted."""
    from hf_megatrain import SUPPORTED_MODEL_TYPES  # noqa: PLC0415

    return sorted(a for a in SUPPORTED_MODEL_TYPES if _installed(a))


def _added_family_config(arch: str, base: dict):
    """``arch``'s tiny config from its own config class: the shared shape and
    ``_ADDED_COMMON`` where the class takes them, then ``ADDED_FAMILY_OVERRIDES[arch]``."""
    import inspect  # noqa: PLC0415

    from transformers import CONFIG_MAPPING  # noqa: PLC0415

    cls = CONFIG_MAPPING[arch]
    params = set(inspect.signature(cls.__init__).parameters)
    aliases = getattr(cls, "attribute_map", {}) or {}
    kwargs = {}
    for key, value in {**base, **_ADDED_COMMON}.items():
        if key in params:
            kwargs[key] = value
        elif aliases.get(key) in params:
            kwargs[aliases[key]] = value
    overrides = ADDED_FAMILY_OVERRIDES[arch](base["num_hidden_layers"])
    kwargs.update({k: v for k, v in overrides.items() if k in params or k in aliases})
    kwargs.update(overrides.get("config_kwargs", {}))  # (taken by **kwargs, not named)
    if arch in _SSM_HEAD_NAMES:
        heads, width = _SSM_HEAD_NAMES[arch]
        kwargs[heads] = 2 * base["hidden_size"] // kwargs[width]
    return cls(**kwargs)


ARCHS = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma3_text",
    "phi3",
    "qwen3_moe",
    "mixtral",
    "gemma2",
    "granite",
    "phi",
    "olmo2",
    "olmo3",
    "smollm3",
    "starcoder2",
    "cohere",
    "glm4",
    "ernie4_5",
    "helium",
    "exaone4",
    "seed_oss",
    "qwen2_moe",
    "olmoe",
    "gpt_oss",
    "gemma",
    "olmo",
    "stablelm",
    "gpt_neox",
    "nemotron",
    "arcee",
    "apertus",
    "hunyuan_v1_dense",
    "lfm2",
    "granitemoe",
    "glm4_moe",
    "dots1",
    "deepseek_v2",
    "deepseek_v3",
    "falcon",
    "bloom",
    "mpt",
    "gptj",
    "gpt_bigcode",
    "qwen3_next",
]
ARCHS += ADDED_ARCHS
#: The MoE families whose router aux loss is part of the training loss.
MOE_ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss", "granitemoe",
             "granitemoeshared", "flex_olmo", "ernie4_5_moe", "qwen3_5_moe_text", "minimax",
             "minimax_m2", "phimoe", "mellum", "laguna", "granitemoe_swa", "lara_mini",
             "flint", "granitemoehybrid", "jamba"]  # fmt: skip
#: MoE families balanced without an aux loss (DeepSeek-V3's bias-corrected routing).
AUX_FREE_MOE_ARCHS = ["glm4_moe", "dots1", "deepseek_v2", "deepseek_v3", "qwen3_next",
                      "hunyuan_v1_moe", "exaone_moe", "lfm2_moe", "glm4_moe_lite",
                      "solar_open", "deepseek_v32", "llama4_text", "kimi_linear", "jetmoe",
                      "hy_v3", "glm_moe_dsa", "axk1", "axk2", "mimo_v2_flash",
                      "cohere2_moe", "bailing_hybrid", "kolibri1", "minicpm5_moe", "beam",
                      "nemotron_h"]  # fmt: skip
#: State-space families (Mamba-1 and -2 mixers; their MLPs, where they have one, are not named
#: ``mlp``: the planner takes them untiled, ``ModelShape.mlp_tileable``).
SSM_ARCHS = ["mamba2", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "mamba",
             "falcon_mamba", "jamba"]  # fmt: skip
MOE_ARCHS = [a for a in MOE_ARCHS if a in ARCHS]
AUX_FREE_MOE_ARCHS = [a for a in AUX_FREE_MOE_ARCHS if a in ARCHS]


class LogRecorder(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

        self.eval_logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append(dict(logs))
        if logs and "eval_loss" in logs:
            self.eval_logs.append(dict(logs))


def class_aliases() -> list[tuple[str, str]]:
    """(model_type, family): the types the installed transformers builds with a supported
    family's model class (``model_family``), e.g. 'internlm3' as ``LlamaForCausalLM``."""
    from transformers import CONFIG_MAPPING  # noqa: PLC0415
    from transformers.models.auto.modeling_auto import (  # noqa: PLC0415
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    )

    from hf_megatrain import SUPPORTED_MODEL_TYPES  # noqa: PLC0415
    from hf_megatrain.hf.families import model_family  # noqa: PLC0415

    return sorted(
        (t, model_family(t))
        for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if t not in SUPPORTED_MODEL_TYPES
        and model_family(t)
        and t in CONFIG_MAPPING
        # (one with its own config class: gpt-sw3's is GPT-2's, whose configs say "gpt2")
        and CONFIG_MAPPING[t].model_type == t
    )


def alias_config(alias: str, shape):
    """``alias``'s own config class with the shape of the family config ``shape``."""
    from transformers import CONFIG_MAPPING  # noqa: PLC0415

    values = shape.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "_name_or_path"):
        values.pop(key, None)
    cls = CONFIG_MAPPING[alias]
    if "text_config" in (getattr(cls, "sub_configs", None) or {}):
        # A composite config (Llama 4's, as its Hub checkpoints have): the causal-LM class builds
        # its text model from the text config.
        return cls(text_config=values)
    return cls(**values)


def llama_alias() -> str:
    """A model_type transformers builds as ``LlamaForCausalLM`` (skips the test if none)."""
    import pytest  # noqa: PLC0415

    alias = next((a for a, family in class_aliases() if family == "llama"), None)
    if alias is None:
        pytest.skip("this transformers builds no other model_type as LlamaForCausalLM")
    return alias


def make_data(n: int = 32, seq: int = SEQ, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (seq,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def tiny_model(config, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def common_args(**overrides) -> dict:
    args = dict(
        per_device_train_batch_size=2,
        max_steps=5,
        logging_steps=1,
        learning_rate=1e-2,
        weight_decay=0.1,
        report_to=[],
        save_strategy="no",
        seed=0,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_grad_norm=0.5,
        use_cpu=True,
        disable_tqdm=True,
    )
    args.update(overrides)
    return args


def one_gpu(args: TrainingArguments) -> TrainingArguments:
    """Pin a stock run to one GPU, as HFMegaTrainer is: on a machine with several, the stock
    Trainer would wrap the model in DataParallel and scale the batch by the GPU count."""
    if args.n_gpu > 1:
        args._n_gpu = 1
    return args


def run_trainer(
    model,
    tmp_path,
    name: str,
    mega: bool,
    data=None,
    resume: str | None = None,
    data_collator=None,
    eval_dataset=None,
    recorder: LogRecorder | None = None,
    callbacks=(),
    **arg_overrides,
):
    """Train ``model`` (not copied) with one trainer class; return ``(logs, trainer)``.

    ``recorder``: a ``LogRecorder`` to fill (for its eval logs too); a new one by default.
    ``callbacks``: more trainer callbacks.
    """
    data = data if data is not None else make_data()
    cls, argcls = (HFMegaTrainer, MegaTrainArguments) if mega else (Trainer, TrainingArguments)
    rec = recorder if recorder is not None else LogRecorder()
    args = one_gpu(argcls(output_dir=str(tmp_path / name), **common_args(**arg_overrides)))
    trainer = cls(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=eval_dataset,
        callbacks=[rec, *callbacks],
        data_collator=data_collator,
    )
    trainer.train(resume_from_checkpoint=resume)
    return rec.logs, trainer


def run_accumulating_trainer(model, tmp_path, name: str, callbacks=(), **overrides):
    """HFMegaTrainer, 4 steps of 2 micro-batches of 2 rows, 2 layers in the HBM tier (the
    out-of-memory watchdog's tests); ``callbacks`` and ``overrides`` as for
    :func:`run_trainer`."""
    kw = dict(
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        megatrain_resident_layers=2,
    )
    kw.update(overrides)
    return run_trainer(model, tmp_path, name, True, callbacks=callbacks, **kw)


def train_both(model, tmp_path, steps: int = 5, data=None, **arg_overrides):
    """Train deep copies of ``model`` with stock Trainer and HFMegaTrainer; return both logs."""
    return [
        run_trainer(
            copy.deepcopy(model), tmp_path, name, mega, data=data, max_steps=steps, **arg_overrides
        )
        for name, mega in (("stock", False), ("mega", True))
    ]


def mega_params(trainer) -> dict[str, torch.Tensor]:
    """Full fp32 state of a trained HFMegaTrainer's model, streamed layers from the host store."""
    from hf_megatrain.hf.checkpoint import host_state_dict  # noqa: PLC0415

    return {k: v.detach().clone() for k, v in host_state_dict(trainer.model).items()}


def stock_params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_logs_match(stock: list[dict], mega: list[dict], rel: float = 1e-5) -> None:
    import pytest  # noqa: PLC0415

    assert len(stock) == len(mega) and len(stock) > 0
    for step, (a, b) in enumerate(zip(stock, mega), 1):
        # fp32 on CPU, same kernels: the differences are the summation order of the global norm
        # (per layer vs per tensor) and the clip coefficient applied as a fused-kernel grad scale
        # (one rounding); over a few steps that stays at the 1e-6 relative level.
        assert b["loss"] == pytest.approx(a["loss"], rel=rel), f"loss at step {step}"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel), f"grad_norm at {step}"
        # The LR comes from the same scheduler reading the same step count: exactly equal.
        assert b["learning_rate"] == a["learning_rate"], f"learning_rate at step {step}"


class LiveStorages(TorchDispatchMode):
    """A live-tensor tracker: the bytes of the CPU storages ops make while it is active (not
    views of storages made before), until each is freed, and their peak. Subclasses add what
    they keep per storage (``on_new``, ``forget``) and per op (``after_op``). While ``ignore``
    is above 0 nothing is counted (``offload_uncounted``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.cur = self.peak = 0
        self.ignore = 0

    def on_new(self, key: int, t: torch.Tensor, func) -> None:
        """A new storage, ``t`` its tensor, ``func`` the op that made it."""

    def forget(self, key: int) -> None:
        """Storage ``key`` was freed."""

    def after_op(self) -> None:
        self.peak = max(self.peak, self.cur)

    def _free(self, key: int) -> None:
        self.cur -= self.live.pop(key)
        self.forget(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = fast_bf16_gemm(func, args, kwargs or {})
        if self.ignore:
            return out
        for key, t in new_cpu_storages(args, kwargs, out, self.live):
            st = t.untyped_storage()
            self.live[key] = st.nbytes()
            self.cur += st.nbytes()
            self.on_new(key, t, func)
            weakref.finalize(st, self._free, key)
        self.after_op()
        return out


#: The matrix products a bf16 step runs on the CPU (``linear`` and ``matmul`` reach these).
_GEMMS = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
)


def fast_bf16_gemm(func, args, kwargs):
    """``func(*args, **kwargs)``; a bf16 matrix product on the CPU as an fp32 one rounded to bf16.

    A live-tensor tracker measures bytes: the output (bf16, contiguous, its shape) is the op's
    own, and the fp32 operands made here, inside the mode's handler, are not seen, as a real
    kernel's scratch is not. CPUs without bf16 instructions (CI's) run bf16 products ~100x
    slower than fp32 ones (365 ms against 3 ms for 1,024 x 768 x 256): most of the memory tests'
    time. The values differ from the CPU's bf16 kernel by fp32 summation order only."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if (
        func in _GEMMS
        and tensors
        and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)
    ):
        wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
        return func(*wide, **kwargs).to(torch.bfloat16)
    return func(*args, **kwargs)


class FastBf16Gemms(TorchDispatchMode):
    """bf16 matrix products on the CPU run as fp32 ones rounded to bf16 (``fast_bf16_gemm``),
    each inside a profiler scope named as the op, so an ``AllocationTimeline`` counts its output
    and drops its fp32 operands as a GEMM's own scratch. Not under torch.compile (a dispatch
    mode makes it fall back to eager)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _GEMMS:
            return func(*args, **(kwargs or {}))
        with torch.profiler.record_function(f"aten::{func._opname}"):
            return fast_bf16_gemm(func, args, kwargs or {})


def offload_uncounted(tracker) -> contextlib.AbstractContextManager:
    """While active, what activation offload allocates (its host copies: pinned host memory on a
    GPU machine, not device memory) is not counted by ``tracker``, a live-tensor tracker that
    skips the storages ops make while its ``ignore`` is above 0."""
    from hf_megatrain.core.engine.activations import ActivationStash  # noqa: PLC0415

    offload = ActivationStash.offload

    def uncounted(self, *a, **k):
        tracker.ignore += 1
        try:
            return offload(self, *a, **k)
        finally:
            tracker.ignore -= 1

    @contextlib.contextmanager
    def patched():
        ActivationStash.offload = uncounted
        try:
            yield
        finally:
            ActivationStash.offload = offload

    return patched()


def new_cpu_storages(args, kwargs, out, known) -> list[tuple[int, torch.Tensor]]:
    """``(storage key, tensor)`` for each CPU storage an op's outputs hold that is new: not one of
    its inputs', not already in ``known``, not empty (a live-tensor tracker's intake)."""
    inputs = {
        x.untyped_storage().data_ptr()
        for x in tree_flatten((args, kwargs))[0]
        if isinstance(x, torch.Tensor) and x.device.type == "cpu"
    }
    new = []
    for t in tree_flatten(out)[0]:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            continue
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in inputs or key in known or not st.nbytes() or any(k == key for k, _ in new):
            continue
        new.append((key, t))
    return new


class CountAttentionKernels(TorchDispatchMode):
    """Counts the fused SDPA kernels that actually run while it is active (outputs that the
    recompute's cache hands back, megatrain_keep_attention_outputs, never reach a mode below
    it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.kernels = set(_sdpa_kernels())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in self.kernels
        return func(*args, **(kwargs or {}))


def liger_like_mlp_forward():
    """An MLP forward that computes what the MLP's own does but is named as Liger-Kernel's
    SwiGLU forward (its module), as ``model_shape`` recognizes Liger's kernels."""

    def forward(self, x):
        return type(self).forward(self, x)

    forward.__module__ = "liger_kernel.transformers.swiglu"  # where Liger's forward lives
    return forward


def patch_mlps_as_liger(model) -> None:
    """Bind :func:`liger_like_mlp_forward` on every decoder MLP instance, as Liger binds its own."""
    forward = liger_like_mlp_forward()
    for layer in model.model.layers:
        layer.mlp.__dict__["forward"] = forward.__get__(layer.mlp, type(layer.mlp))


def simulate_liger(
    monkeypatch, *, installed: bool = True, cuda: bool = True, compiles: bool = True
) -> None:
    """Make ``layer_kernels`` decide as if liger-kernel were installed (``installed``), the
    device were CUDA (``cuda``) and torch.compile could build kernels for it (``compiles``):
    Liger's Triton kernels cannot run here, so tests pair this with a stand-in for the kernels'
    application; compiled kernels are built with the "aot_eager" backend (Inductor's graphs
    without a C++ build). Liger's own model-type table is stood in for by the families it
    patches that the tests use."""
    import hf_megatrain.hf.compiled_kernels as compiled_kernels  # noqa: PLC0415
    import hf_megatrain.hf.long_context as long_context  # noqa: PLC0415

    monkeypatch.setattr(long_context, "liger_installed", lambda: installed)
    monkeypatch.setattr(long_context, "liger_can_run_on", lambda device: cuda)
    monkeypatch.setattr(
        long_context, "liger_model_types", lambda: frozenset({"llama", "qwen2", "qwen3", "gemma"})
    )
    why = "Triton" if compiles else "Triton is not installed"
    monkeypatch.setattr(long_context, "compile_available", lambda device: (compiles, why))
    monkeypatch.setattr(compiled_kernels, "COMPILE_BACKEND", "aot_eager")


# ---- comparing a multi-process run with one process (tests/test_distributed.py, test_multinode.py)
def saved_weights(folder) -> dict[str, torch.Tensor]:
    """The tensors of ``folder/model.safetensors``."""
    from safetensors.torch import load_file  # noqa: PLC0415

    return load_file(str(folder) + "/model.safetensors")


def assert_same_training_logs(a: list[dict], b: list[dict], rel: float = 1e-5) -> None:
    """Per-step loss, grad_norm and learning rate of two runs that differ in fp32 summation order
    only (the ranks' partial gradients summed in stages, not in one pass: observed <= 2e-7
    relative). A gradient not averaged, a rank's or node's share dropped, or a layer counted
    twice in the norm shows at the 10-100% (or sqrt(2)) level."""
    import pytest  # noqa: PLC0415

    assert len(a) == len(b) > 0
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert y["loss"] == pytest.approx(x["loss"], rel=rel), f"loss at step {step}"
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=rel), f"grad_norm at {step}"
        assert y["learning_rate"] == x["learning_rate"], f"learning_rate at step {step}"


def assert_close_weights(a: dict, b: dict, atol: float = 1e-6) -> None:
    """Same ordering argument for the weights: after a few AdamW steps at lr 1e-2 they differ by
    ~1e-7; a missed or doubled update of a layer (one rank's, one node's) leaves ~1e-2."""
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=atol, msg=name)


# ---- the multi-process workers (tests/dp_worker.py, tests/sp_worker.py) ------------------------
def add_job_arguments(parser) -> None:
    """``--then-resume CHECKPOINT OUT`` and ``--jobs FILE``: more trainings in the same
    processes (a process costs ~9 s of imports on these 2 cores, a launch its rendezvous)."""
    parser.add_argument(
        "--then-resume",
        nargs=2,
        metavar=("CHECKPOINT", "OUT"),
        help="afterwards, in the same processes (imports paid once): wait for CHECKPOINT (e.g. "
        "another run's, published whole) and resume from it into OUT, without saving",
    )
    parser.add_argument(
        "--jobs",
        metavar="FILE",
        help="a JSON list of argument lists of this worker, each one training (with its own "
        "--out), run in order in the same processes instead of the other arguments",
    )


def run_jobs(run, parser, a) -> None:
    """``run(job, out, resume, save_steps)`` for ``a`` or each of its ``--jobs``, each followed
    by its ``--then-resume`` once that checkpoint exists; then the process group torn down."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import time  # noqa: PLC0415

    jobs = [a]
    if a.jobs:
        jobs = [parser.parse_args(argv) for argv in json.loads(Path(a.jobs).read_text())]
    for job in jobs:
        if not job.out:
            parser.error("--out is required (in each of --jobs)")
        run(job, job.out, job.resume, job.save_steps)
        if job.then_resume:
            checkpoint, out = job.then_resume
            deadline = time.monotonic() + 600
            while not os.path.isdir(checkpoint):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no checkpoint {checkpoint} after 600 s")
                time.sleep(0.2)
            run(job, out, checkpoint, 0)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Interpreter shutdown after a gloo launch aborts a finished rank now and then, also after
    # destroy_process_group ("terminate called without an active exception", SIGABRT: 1 launch
    # in ~60 of test_dp_eager_updates_and_hbm_tier on a 2-core machine, after training). The
    # worker's reports are on disk: leave without that shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def mounted_tmpfs(point: Path, size: str):
    """A tmpfs of ``size`` mounted at the new folder ``point`` (a container volume, a small
    disk) for the block; the test is skipped where this process may not mount."""
    import subprocess  # noqa: PLC0415

    import pytest  # noqa: PLC0415

    point.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
            capture_output=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        pytest.skip("cannot run mount here")
    if done.returncode != 0:
        pytest.skip("no permission to mount a tmpfs here")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=30)


# ---- allocation timeline: a memory tracker that sees into torch.compile'd code ---------------
# Matrix products whose CPU kernels allocate and free a buffer of their own where the CPU lacks
# native bf16 (oneDNN's fp32 output before the cast to bf16: a per-token size that depends on the
# machine); a GPU GEMM's workspace is a fixed size. Not counted by AllocationTimeline.
_GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})


def _without_scratch(events: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A GEMM's allocation events less each buffer it allocated and freed itself (a free of a
    size it allocated earlier inside it); what it returns (its output) stays."""
    kept: list[tuple[int, int]] = []
    for event in sorted(events):
        size = event[1]
        match = next((k for k in reversed(kept) if size < 0 and k[1] == -size), None)
        if match is None:
            kept.append(event)
        else:
            kept.remove(match)
    return kept


class AllocationTimeline:
    """The CPU allocator's running total over a block, from the profiler's allocation events,
    and its peak between marks (``mark(label)`` inside the block, e.g. from autograd hooks).
    Unlike a dispatch-mode tracker (``LiveStorages``), under which torch.compile falls back to
    eager, it measures compiled kernels as they run (Inductor's CPU build: its partition of
    saved tensors and its fused backward buffers)."""

    def __init__(self) -> None:
        self._events: list[tuple[int, int]] = []  # (time ns, total allocated after)
        self._marks: dict[str, int] = {}

    def __enter__(self) -> AllocationTimeline:
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from torch._C._profiler import _EventType  # noqa: PLC0415

        self._prof.__exit__(*exc)
        deltas: list[tuple[int, int]] = []  # (time ns, bytes allocated (+) or freed (-))
        first: tuple[int, int] | None = None  # the earliest event: (time, total before it)
        gemm_scratch: dict[int, list[tuple[int, int]]] = {}  # a GEMM's own events
        stack = [(e, None) for e in self._prof.profiler.kineto_results.experimental_event_tree()]
        while stack:
            e, gemm = stack.pop()
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                event = (e.start_time_ns, e.extra_fields.alloc_size)
                if first is None or event[0] < first[0]:
                    first = (event[0], e.extra_fields.total_allocated - event[1])
                (deltas if gemm is None else gemm_scratch.setdefault(gemm, [])).append(event)
            elif e.name.startswith("mark: "):
                label = e.name.removeprefix("mark: ")
                self._marks[label] = min(self._marks.get(label, 1 << 62), e.start_time_ns)
            if e.name in _GEMM_OPS and gemm is None:
                # The outermost GEMM holds what its children allocate (``FastBf16Gemms``' scope
                # runs an fp32 GEMM inside, whose output it frees).
                gemm = id(e)
            stack.extend((child, gemm) for child in e.children)
        for events in gemm_scratch.values():
            deltas += _without_scratch(events)
        deltas.sort()
        total = 0 if first is None else first[1]
        for t, size in deltas:
            total += size
            self._events.append((t, total))

    @staticmethod
    def mark(label: str) -> None:
        """Record the moment ``label`` starts (its first mark counts)."""
        from torch.profiler import record_function  # noqa: PLC0415

        with record_function(f"mark: {label}"):
            pass

    def growth(self, start: str, end: str) -> int:
        """Peak allocated between marks ``start`` and ``end`` over the total at ``start``."""
        t0, t1 = self._marks[start], self._marks[end]
        before = [total for t, total in self._events if t < t0]
        inside = [total for t, total in self._events if t0 <= t < t1]
        base = before[-1] if before else 0
        return max([base, *inside]) - base


def one_step_gradients(
    model, ids: torch.Tensor, labels: torch.Tensor, *, bf16: bool = True, accum: int = 1,
    streamed: dict | None = None, offload_min_numel: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """One step's summed loss and every gradient (fp32, by name) of a deep copy of ``model`` on
    the CPU, under bf16 autocast where ``bf16``: stock over ``accum`` equal slices of the batch,
    each loss scaled by the batch's token count as the Trainer's ``num_items_in_batch``; or,
    given ``streamed`` engine options, the streamed model through the Trainer's own wrapper (its
    fused loss), with ``offload_min_numel`` for tiny shapes."""
    from hf_megatrain import prepare_streamed_model  # noqa: PLC0415
    from hf_megatrain.hf.model import streamed_gradients, streamed_state  # noqa: PLC0415
    from hf_megatrain.hf.trainer import StreamedModelWrapper  # noqa: PLC0415

    items = int((labels[:, 1:] != -100).sum())
    dtype = torch.bfloat16 if bf16 else torch.float32
    if streamed is not None:
        model = prepare_streamed_model(copy.deepcopy(model), "cpu", dtype, **streamed)
        state = streamed_state(model)
        if offload_min_numel is not None:
            state.engine.offload_min_numel = offload_min_numel
        wrapper = StreamedModelWrapper(
            model.train(), dtype, "cpu", fused_loss=state.options.fused_loss
        )
        loss = wrapper(input_ids=ids, labels=labels, num_items_in_batch=items).loss
        loss.backward()
        return loss.detach().float(), streamed_gradients(model)
    model = copy.deepcopy(model).train()
    rows, loss = ids.shape[0] // accum, torch.zeros(())
    for k in range(accum):
        part = slice(k * rows, (k + 1) * rows)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(
                input_ids=ids[part], labels=labels[part], num_items_in_batch=items, use_cache=False
            )
        out.loss.backward()
        loss = loss + out.loss.detach().float()
    named = model.named_parameters()
    return loss, {n: p.grad.detach().float().clone() for n, p in named if p.grad is not None}


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def two_forward_trainers(*trainer_classes: type) -> list[type]:
    """Each trainer class with a compute_loss that runs the model twice in one micro-batch (as
    R-Drop or a consistency loss does): the flipped sequence's loss added at half weight."""

    def two_forwards(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        flipped = inputs["input_ids"].flip(-1)
        loss = model(**inputs).loss + 0.5 * model(input_ids=flipped, labels=flipped).loss
        return (loss, None) if return_outputs else loss

    return [type("TwoForwards", (cls,), {"compute_loss": two_forwards}) for cls in trainer_classes]
