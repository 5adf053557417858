"""Model FLOPs per token (hf_megatrain.hf.flops): the numerator of logged and recorded MFU.

Dense work counts the parameters a token runs through; attention counts the keys each query
really attends to (causal, within its layer's window, none in linear-attention layers). Each
expectation here is counted independently of the module's formulas: expert sizes from the
config, keys per query by enumerating the causal (windowed) mask."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from benchmarks import bench
from hf_megatrain.hf.flops import active_params, attention_flops_per_token

from .helpers import tiny_config, tiny_model

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def _total(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _mean_keys(seq_len: int, window: int | None) -> float:
    """Keys per query of a causal row, counted: query i sees min(i + 1, window) keys."""
    keys = torch.arange(1, seq_len + 1)
    if window:
        keys = keys.clamp(max=window)
    return keys.double().mean().item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma2"])
def test_dense_models_count_every_parameter(arch):
    model = tiny_model(tiny_config(arch))
    assert active_params(model) == _total(model)


@pytest.mark.parametrize(
    "arch, experts_attr, inter_attr",
    [
        ("qwen3_moe", "num_experts", "moe_intermediate_size"),
        ("mixtral", "num_local_experts", "intermediate_size"),
        ("olmoe", "num_experts", "intermediate_size"),
        # A shared expert every token runs through: it must not be discounted.
        ("qwen2_moe", "num_experts", "moe_intermediate_size"),
        # The first layer dense (first_k_dense_replace=1): only the others have routed experts.
        ("deepseek_v3", "n_routed_experts", "moe_intermediate_size"),
    ],
)
def test_moe_tokens_run_through_top_k_experts(arch, experts_attr, inter_attr):
    cfg = tiny_config(arch)
    model = tiny_model(cfg)
    experts, top_k = getattr(cfg, experts_attr), cfg.num_experts_per_tok
    moe_layers = cfg.num_hidden_layers - (getattr(cfg, "first_k_dense_replace", 0) or 0)
    # A SwiGLU expert: gate, up (hidden x inter each) and down (inter x hidden), no biases.
    per_expert = 3 * cfg.hidden_size * getattr(cfg, inter_attr)
    unused = moe_layers * (experts - top_k) * per_expert
    assert 0 < unused < _total(model)
    assert active_params(model) == _total(model) - unused


def test_full_causal_attention_is_six_layers_hidden_seq():
    """The benchmarks' long-standing term, 6 L h s per token, for square attention."""
    cfg = tiny_config("llama")
    assert cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) == 32
    expected = 6 * cfg.num_hidden_layers * cfg.hidden_size * 4096
    assert attention_flops_per_token(cfg, 4096) == pytest.approx(expected)


@pytest.mark.parametrize("seq_len", [4096, 262144])
def test_sliding_window_counts_the_keys_the_mask_leaves(seq_len):
    cfg = tiny_config("mistral", max_position_embeddings=seq_len)
    cfg.sliding_window = 1024
    heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    counted = 6 * heads * 2 * head_dim * cfg.num_hidden_layers * _mean_keys(seq_len, 1024)
    # The formula is the continuous form of the count (w - w^2/2s against the sum of
    # min(i + 1, w) / s): they differ by half a key per query, < 0.1% at these lengths.
    assert attention_flops_per_token(cfg, seq_len) == pytest.approx(counted, rel=1e-3)
    full = attention_flops_per_token(tiny_config("llama"), seq_len)
    assert attention_flops_per_token(cfg, seq_len) < full


def test_layer_types_mix_windowed_full_and_linear_layers():
    seq_len = 8192
    gemma = tiny_config("gemma3_text")  # one sliding and one full attention layer
    assert list(gemma.layer_types) == ["sliding_attention", "full_attention"]
    gemma.sliding_window = 512
    per_key = 6 * gemma.num_attention_heads * 2 * gemma.head_dim
    counted = per_key * (_mean_keys(seq_len, 512) + _mean_keys(seq_len, None))
    assert attention_flops_per_token(gemma, seq_len) == pytest.approx(counted, rel=1e-3)
    # Qwen3-Next: linear-attention layers have no quadratic term; its full layers do.
    nxt = tiny_config("qwen3_next")
    full_layers = sum(t == "full_attention" for t in nxt.layer_types)
    assert 0 < full_layers < nxt.num_hidden_layers
    per_key = 6 * nxt.num_attention_heads * 2 * nxt.head_dim
    counted = per_key * full_layers * _mean_keys(seq_len, None)
    assert attention_flops_per_token(nxt, seq_len) == pytest.approx(counted, rel=1e-3)


def test_use_sliding_window_false_attends_fully():
    cfg = tiny_config("qwen2")
    cfg.sliding_window, cfg.use_sliding_window, cfg.layer_types = 1024, False, None
    assert attention_flops_per_token(cfg, 8192) == attention_flops_per_token(
        tiny_config("llama"), 8192
    )


def _recorded_rows():
    for name in ("results.csv", "validation_matrix.csv", "unseen_models.csv"):
        with (RESULTS / name).open(newline="") as f:
            for row in csv.DictReader(f):
                # DPO rows count their reference model's forward too: another numerator.
                if row.get("mfu") and row.get("tokens_per_s") and "dpo" not in row["system"]:
                    yield name, row


def test_no_recorded_run_claims_more_than_the_gpu_can_do():
    """Every recorded MFU is below 1 and is the model FLOPs of its run's config and length:
    a formula that counted attention a window masks, or experts a token skips, put recorded
    runs of Phi-3 and H2O-Danube at 256k above 200% and OLMoE's model TFLOP/s at 674."""
    configs = {p.name for p in (RESULTS.parent / "configs").iterdir()}
    checked = 0
    for name, row in _recorded_rows():
        if row["model"] not in configs:
            continue
        _, per_token = bench.config_flops(row["model"], int(row["seq_len"]))
        # Data-parallel rows: tokens/s of all GPUs, MFU per GPU.
        tps = float(row["tokens_per_s"]) / bench.gpus_of(row["system"])
        where = f"{name} {row['tag']} {row['model']} {row['seq_len']}"
        assert 0 < float(row["mfu"]) < 1, where
        assert float(row["mfu"]) == pytest.approx(bench.mfu(per_token, tps), rel=2e-3), where
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("arch", ["nemotron_h", "bamba", "jamba", "mamba2", "mamba"])
def test_state_space_mlp_and_moe_layers_have_no_quadratic_term(arch):
    """Only attention layers count keys: Nemotron-H's Mamba-2, MLP and MoE layers, Bamba's and
    Jamba's Mamba layers do not, and Mamba's configs (no attention heads at all) count none."""
    seq_len = 8192
    cfg = tiny_config(arch)
    attention = [t == "full_attention" for t in cfg.layer_types]
    heads = getattr(cfg, "num_attention_heads", 0)
    head_dim = getattr(cfg, "head_dim", 0) or (heads and cfg.hidden_size // heads)
    counted = 6 * heads * 2 * head_dim * sum(attention) * _mean_keys(seq_len, None)
    assert attention_flops_per_token(cfg, seq_len) == pytest.approx(counted, rel=1e-3)
    assert (counted > 0) == any(attention)
