"""Load a Hub-format checkpoint folder straight into the host store.

The model is built on ``meta`` (no weight is materialized), its decoder layers get host-store
buffers, and the safetensors files are read tensor by tensor into those buffers: peak host RSS
stays close to the store's own size, never store + full model.
"""

from __future__ import annotations

import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM, Trainer

from .checkpoint import load_weights_into_store
from .model import prepare_streamed_model


def load_streamed_model(
    path: str,
    device: torch.device | str | None = None,
    bf16: bool = True,
    pin_memory: bool = True,
    host_memory_limit_gb: float | None = None,
    resident_layers: int | str = 0,
    **config_overrides,
):
    """Build ``AutoModelForCausalLM`` for ``path`` in streamed form and load its weights.

    Args:
        path: a local folder with ``config.json`` and safetensors weights (Hub layout).
        device: compute device; default ``cuda`` when available, else ``cpu``.
        bf16: stream bf16 weights (fp32 masters and moments either way); ``False`` for fp32.
        pin_memory: register the PCIe-facing host buffers as pinned memory on CUDA.
        host_memory_limit_gb: refuse (before allocating) if the store needs more host RAM.
        resident_layers: leading layers kept wholly in HBM (int or "auto"); see
            ``MegaTrainArguments.megatrain_resident_layers``.
        config_overrides: set on the config before the model is built (e.g. attn_implementation).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    attn = config_overrides.pop("attn_implementation", "sdpa")
    config = AutoConfig.from_pretrained(path, **config_overrides)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn, dtype=torch.float32
        )
    # Under init_empty_weights the LM head is not tied to the embedding yet; tie it now, or a
    # tied checkpoint (which stores only the embedding) would leave the head without weights.
    model.tie_weights()
    prepare_streamed_model(
        model,
        device=device,
        compute_dtype=torch.bfloat16 if bf16 else torch.float32,
        decay_names=set(Trainer.get_decay_parameter_names(None, model)),
        pin_memory=pin_memory,
        host_memory_limit_bytes=None
        if host_memory_limit_gb is None
        else int(host_memory_limit_gb * 2**30),
        resident_layers=resident_layers,
    )
    load_weights_into_store(model, path)
    return model
