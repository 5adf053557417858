"""FlexAttention within its 32-bit element offsets.

PyTorch's FlexAttention kernels (torch 2.11-2.13) compute element offsets into query, key, value
and their gradients in int32 (pytorch/pytorch#190857; fixed upstream by #185264, not in these
releases). Past 2**31 - 1 elements from a tensor's first one, the address wraps: the kernel
reads other memory (a non-finite or silently wrong step) or faults (an illegal memory access that
kills the process). Long rows reach it in two ways:

- a strided view: families with a fused qkv projection (Phi-3) pass value heads as a view of the
  projection's output, whose token stride spans q, k and v: Phi-3-mini at 262,144 tokens reaches
  262,144 x 9,216 elements, over the limit although the value tensor itself holds 805M;
- the tensor itself: B x heads x tokens x head_dim over 2**31 (32 heads of 128 past 524,288 tokens).

:func:`flex_attention_within_offsets` wraps transformers' FlexAttention function: a tensor whose
offsets reach past the limit is made contiguous, and where a contiguous one still does, the call
runs per row and group of heads (whole key/value groups, or query heads of one group) whose
tensors stay within it, outputs joined along the head and row axes. Calls within the limit
pass through unchanged (no copy). :func:`install` registers it under transformers'
``"flex_attention"`` name, so every model running FlexAttention in this process uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.flex_attention import flex_attention_forward

#: The largest element offset FlexAttention's kernels address (int32).
INDEX_LIMIT = 2**31 - 1


def max_offset(t: torch.Tensor) -> int:
    """The largest element offset from ``t``'s first element to any of its elements."""
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n > 0)


def _within(t: torch.Tensor, limit: int) -> torch.Tensor:
    return t if max_offset(t) <= limit else t.contiguous()


def head_chunks(q_heads: int, kv_heads: int, tokens: int, head_dim: int, limit: int):
    """Query-head ranges ``(start, stop)`` of one row whose tensors (heads x tokens x head_dim,
    keys and values of the same width at most) stay within ``limit`` elements: whole key/value
    groups where one group fits, else query heads of one group at a time. Raises ``ValueError``
    when one head does not fit."""
    per_head = tokens * head_dim
    if per_head - 1 > limit:
        raise ValueError(
            f"FlexAttention addresses its tensors with 32-bit offsets: one attention head of "
            f"{tokens} tokens x {head_dim} = {per_head:,} elements exceeds 2**31. Train shorter "
            f"rows, or run an attention implementation without this limit (attention 'model' "
            f"with sdpa or flash attention)."
        )
    group = q_heads // kv_heads
    heads_fit = (limit + 1) // per_head
    if heads_fit >= group:
        step = (heads_fit // group) * group
        return [(a, min(a + step, q_heads)) for a in range(0, q_heads, step)]
    return [
        (a, min(a + heads_fit, g + group))
        for g in range(0, q_heads, group)
        for a in range(g, g + group, heads_fit)
    ]


def _part(value: Any, rows: slice, heads: slice, what: str) -> Any:
    """``value`` (a per-row/per-head tensor, a block mask, or None) for one row range and one
    query-head range; dimensions of size one broadcast and stay whole."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.dim() == 1:  # per-head sinks (s_aux)
        return value[heads]
    shape = tuple(getattr(value, "shape", (1, 1)))
    if not isinstance(value, torch.Tensor) and shape[1] > 1:
        # A BlockMask's mask_mod would see the chunk's head indices, not the model's.
        raise ValueError(
            f"FlexAttention would run in head chunks to stay within 32-bit offsets, but its "
            f"{what} differs per head; train shorter rows."
        )
    return value[rows if shape[0] > 1 else slice(None), heads if shape[1] > 1 else slice(None)]


def flex_attention_within_offsets(
    inner: Callable, module, query, key, value, attention_mask, *args, **kwargs
):
    """``inner`` (transformers' FlexAttention forward) on tensors within :data:`INDEX_LIMIT`."""
    limit = INDEX_LIMIT
    query, key, value = (_within(t, limit) for t in (query, key, value))
    batch, q_heads, _, _ = query.shape
    kv_heads = key.shape[1]
    tokens = max(query.shape[2], key.shape[2])
    head_dim = max(query.shape[-1], key.shape[-1], value.shape[-1])
    # Every tensor the kernels address (queries, keys and values, the output and their
    # gradients) holds at most this many elements: transformers repeats keys and values to
    # every query head when that count is not a power of two, so they count at query heads.
    if batch * q_heads * tokens * head_dim - 1 <= limit:
        return inner(module, query, key, value, attention_mask, *args, **kwargs)
    # A head range of several rows still spans the batch stride: chunks take one row each.
    chunks = head_chunks(q_heads, kv_heads, tokens, head_dim, limit)
    group = q_heads // kv_heads
    rows_out, rows_lse = [], []
    for r in range(batch):
        rows = slice(r, r + 1)
        outs, lses = [], []
        for start, stop in chunks:
            heads = slice(start, stop)
            kv = slice(start // group, (stop - 1) // group + 1)
            part = dict(kwargs)
            for name in ("s_aux", "position_bias"):
                if part.get(name) is not None:
                    part[name] = _part(part[name], rows, heads, name)
            out, lse = inner(
                module,
                query[rows, heads],
                key[rows, kv],
                value[rows, kv],
                _part(attention_mask, rows, heads, "attention mask"),
                *args,
                **part,
            )
            outs.append(out)
            lses.append(lse)
        # transformers returns batch x tokens x heads x head_dim, and the log-sum-exp batch x
        # heads x tokens (None on CPU).
        rows_out.append(torch.cat(outs, dim=2))
        rows_lse.append(None if any(x is None for x in lses) else torch.cat(lses, dim=1))
    lse = None if any(x is None for x in rows_lse) else torch.cat(rows_lse, dim=0)
    return torch.cat(rows_out, dim=0), lse


def _guarded(module, query, key, value, attention_mask, *args, **kwargs):
    return flex_attention_within_offsets(
        flex_attention_forward, module, query, key, value, attention_mask, *args, **kwargs
    )


_guarded.__doc__ = flex_attention_within_offsets.__doc__


def install() -> None:
    """Register the offset guard as transformers' ``"flex_attention"`` function (idempotent)."""
    AttentionInterface.register("flex_attention", _guarded)


__all__ = ["INDEX_LIMIT", "flex_attention_within_offsets", "head_chunks", "install", "max_offset"]
