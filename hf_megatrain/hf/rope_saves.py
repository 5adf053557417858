"""What a family's RoPE function keeps for the backward, per layer: measured, not assumed.

Llama's ``apply_rotary_pos_emb`` multiplies q and k by the model's shared cos/sin tables, which
need no gradient: its backward keeps views of those tables, nothing per layer. Families that
re-lay the tables out inside the function (ERNIE 4.5, Helium and GLM repeat-interleave half of
them; others slice or widen them) make new cos/sin tensors at every call, and the products
save those: per recomputed or kept layer, 8 B per token and rotary channel in fp32. The CPU
tracker found them as 2h per token over the working-set line at ERNIE 4.5's and Helium's widths
(3.4% at head_dim h / 4, 4.8% with compiled norms: over the line's 4% error).

``rope_saved_bytes_per_token`` calls the family's own function once, on a few tokens at the
model's real head widths, and counts the bytes its autograd graph saves that are not its
inputs' storage (``saved_tensors_hooks``). A model on the ``meta`` device works: only the
rotary table's width is read from it.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .layers import find_decoder_layers
from .scoped_globals import original_global

#: Tokens of the probe call: its saves scale with the tokens (one sequence).
_PROBE_TOKENS = 8


def _rotary_width(model: nn.Module) -> int:
    """Channels of the model's cos/sin tables (2 x its rotary embedding's ``inv_freq``), 0 when
    it has none."""
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor) and inv_freq.dim() == 1:
            return 2 * inv_freq.shape[0]
    return 0


def rope_table_elements(model: nn.Module) -> int:
    """Channels per token of every cos table the model's forward makes for a micro-batch (as
    many again for sin), where its rotary embedding makes one per attention layer type (Gemma 3
    and 4, OLMo 3, Mellum, ...: a ``<type>_inv_freq`` buffer each, Gemma 4's full-attention
    table twice as wide as its sliding one): their sum. 0 where it makes one table (the plan
    takes head_dim)."""
    for module in model.modules():
        widths = [
            2 * buf.shape[0]
            for name, buf in module.named_buffers(recurse=False)
            if name.endswith("_inv_freq") and "original" not in name and buf.dim() == 1
        ]
        if widths:
            return sum(widths)
    return 0


def rope_saved_bytes_per_token(
    model: nn.Module, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes per token that one call of the family's ``apply_rotary_pos_emb`` (q and k of
    ``heads`` and ``kv_heads`` heads of ``head_dim`` in ``dtype``, fp32 cos/sin tables as the
    engine's fp32 residual stream makes them) saves for its backward beyond its inputs: what
    each recomputed or kept layer holds besides the planned lines. 0 where the family has no
    such function or it does not take ``(q, k, cos, sin)``."""
    _, layers = find_decoder_layers(model)
    modeling = sys.modules.get(type(layers[0]).__module__) if layers else None
    fn = original_global(modeling, "apply_rotary_pos_emb") if modeling else None
    width = _rotary_width(model)
    if not callable(fn) or not (width and heads and kv_heads and head_dim):
        return 0
    t = _PROBE_TOKENS
    q = torch.zeros(1, heads, t, head_dim, dtype=dtype, requires_grad=True)
    k = torch.zeros(1, kv_heads, t, head_dim, dtype=dtype, requires_grad=True)
    cos, sin = torch.ones(1, t, width), torch.zeros(1, t, width)
    inputs = {x.untyped_storage().data_ptr() for x in (q, k, cos, sin)}
    saved: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        storage = x.untyped_storage()
        if storage.data_ptr() not in inputs:
            saved[storage.data_ptr()] = storage.nbytes()
        return x

    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            fn(q, k, cos, sin)
    except Exception:  # noqa: BLE001 - the family's own code: another signature, a partial rotation
        return 0  # (its attention calls it its own way): nothing known to add
    return -(-sum(saved.values()) // t)
