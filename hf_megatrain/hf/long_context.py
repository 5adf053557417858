"""Long-context switches for a streamed HF model: sequence tiling of the decoder layers' MLPs."""

from __future__ import annotations

import logging

from torch import nn

from ..core.tiling import TiledTokenwise
from .model import find_decoder_layers

logger = logging.getLogger(__name__)

# Token-wise feed-forward sub-modules by attribute name (MoE blocks route per token too, but
# their router outputs are recorded for the aux loss: left untiled).
_MLP_ATTRS = ("mlp",)
_MOE_MARKERS = ("experts", "gate")


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
            if not isinstance(mlp.forward, TiledTokenwise):
                mlp.forward = TiledTokenwise(mlp, tile_tokens)
                count += 1
    logger.info("hf_megatrain: MLPs of %d layers tiled by %d tokens", count, tile_tokens)
    return count
