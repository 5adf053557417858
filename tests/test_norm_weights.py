"""Residual-stream norm weights bound in fp32 (hf/model.py ``_residual_norm_weights``)."""

from __future__ import annotations

import pytest
import torch

from hf_megatrain.core.streamed_layer import StreamedLayer

from .helpers import mega_params, run_trainer, tiny_config, tiny_model


def _train(tmp_path, arch: str, name: str):
    """Two bf16 steps; the dtypes the first layer's norms were bound with, the trainer's
    losses and parameters, and the first layer's fp32 parameter names."""
    model = tiny_model(tiny_config(arch))
    bound: list[torch.dtype] = []
    layer = model.model.layers[0]
    norms = [layer.input_layernorm] + ([layer.self_attn.q_norm] if arch == "qwen3_moe" else [])
    for norm in norms:
        norm.register_forward_pre_hook(lambda m, a: bound.append(m.weight.dtype))
    logs, trainer = run_trainer(model, tmp_path, name, mega=True, max_steps=2, bf16=True)
    return bound, [r["loss"] for r in logs], mega_params(trainer), layer.forward.fp32_params


@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text", "qwen3_moe"])
def test_fp32_norm_weights_change_no_value(tmp_path, monkeypatch, arch):
    """In bf16 the residual-stream RMSNorm weights are bound as fp32 copies of their bf16
    values (one fp32 multiply with the fp32 stream instead of a casting one, as in stock
    training): bitwise the same training as binding the bf16 copy. Per-head q/k norms (Qwen3,
    on bf16 activations) stay as they are."""
    bound, losses, params, names = _train(tmp_path, arch, "fp32")
    assert bound[0] == torch.float32 and "input_layernorm.weight" in names
    assert not any("q_norm" in n or "k_norm" in n for n in names)
    if arch == "qwen3_moe":
        assert bound[1] == torch.bfloat16

    init = StreamedLayer.__init__
    monkeypatch.setattr(
        StreamedLayer, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "fp32_params": []})
    )
    bound_bf16, losses_bf16, params_bf16, _ = _train(tmp_path, arch, "bf16")
    assert bound_bf16[0] == torch.bfloat16
    assert losses == losses_bf16
    for k, v in params_bf16.items():
        assert torch.equal(params[k], v), k
