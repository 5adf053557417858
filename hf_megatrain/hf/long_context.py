"""Long-context and kernel switches for a streamed HF model: sequence tiling of the decoder
layers' MLPs, and Liger-Kernel's fused Triton kernels (the Trainer's ``use_liger_kernel``)."""

from __future__ import annotations

import inspect
import logging

from torch import nn

from ..core.tiling import TiledTokenwise
from .layers import find_decoder_layers
from .loss import _unwrap

logger = logging.getLogger(__name__)

#: A ``liger_kernel_config`` of Liger's layer kernels only (fused RMSNorm, RoPE, SwiGLU), not its
#: losses: training batches with labels use hf_megatrain's chunked loss anyway.
LIGER_LAYER_KERNELS = {
    "rope": True,
    "rms_norm": True,
    "swiglu": True,
    "cross_entropy": False,
    "fused_linear_cross_entropy": False,
}


def liger_layer_kernel_arguments(enabled: bool) -> dict:
    """``use_liger_kernel`` / ``liger_kernel_config`` for Liger's layer kernels, or neither:
    the same keywords for the trainer's arguments and for a streamed loader (whose memory plan
    must know the kernels too)."""
    if not enabled:
        return {"use_liger_kernel": False, "liger_kernel_config": None}
    return {"use_liger_kernel": True, "liger_kernel_config": dict(LIGER_LAYER_KERNELS)}


# Token-wise feed-forward sub-modules by attribute name (MoE blocks route per token too, but
# their router outputs are recorded for the aux loss: left untiled).
_MLP_ATTRS = ("mlp",)
_MOE_MARKERS = ("experts", "gate")


def _takes_one_input(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes exactly one required input (what tiling splits)."""
    params = inspect.signature(module.forward).parameters.values()
    required = [
        p
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return len(required) == 1


def install_mlp_tiling(model: nn.Module, tile_tokens: int) -> int:
    """Tile every decoder layer's dense MLP along the sequence; returns how many were tiled."""
    if tile_tokens <= 0:
        return 0
    _, layers = find_decoder_layers(model)
    count = 0
    for layer in layers:
        for attr in _MLP_ATTRS:
            mlp = getattr(layer, attr, None)
            if mlp is None or any(hasattr(mlp, m) for m in _MOE_MARKERS):
                continue
            if not _takes_one_input(mlp):
                continue  # e.g. BLOOM's MLP adds the residual itself: (hidden_states, residual)
            if not isinstance(mlp.forward, TiledTokenwise):
                mlp.forward = TiledTokenwise(mlp, tile_tokens)
                count += 1
    if count:
        logger.info("hf_megatrain: MLPs of %d layers tiled by %d tokens", count, tile_tokens)
    return count


def apply_liger_kernels(model: nn.Module, kernel_config: dict | None) -> None:
    """Liger-Kernel's fused RMSNorm / RoPE / SwiGLU for the model, as the Trainer's
    ``use_liger_kernel=True`` applies them (``transformers.integrations.liger``), but before the
    model is streamed: the memory plan then counts the fused kernels' smaller saved activations,
    and MLP tiling, installed after, wraps the fused forward (the Trainer's own patching in
    ``train()`` would replace the tiling; HFMegaTrainer skips it). Training batches with labels
    keep hf_megatrain's chunked loss; Liger's fused linear cross-entropy, when configured, only
    serves the model's own forward (evaluation)."""
    try:
        from transformers.integrations.liger import apply_liger_kernel  # noqa: PLC0415
    except ImportError:  # transformers that applies Liger inline in Trainer: the same calls
        apply_liger_kernel = _apply_liger_kernel
    apply_liger_kernel(model, kernel_config)
    logger.info("hf_megatrain: Liger kernels applied (%s)", kernel_config or "defaults")


def _apply_liger_kernel(model: nn.Module, kernel_config: dict | None) -> None:
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance  # noqa: PLC0415
    except ImportError:
        raise ImportError(
            "hf_megatrain: use_liger_kernel=True needs liger-kernel (pip install "
            "'hf_megatrain[liger]')"
        ) from None
    # PEFT: patch the model under the adapters.
    _apply_liger_kernel_to_instance(model=_unwrap(model), **(kernel_config or {}))
