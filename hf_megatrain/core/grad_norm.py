"""Sums of squares for gradient norms, accurate for the CPU's long flat gradient buffers."""

from __future__ import annotations

import torch

#: Elements per partial sum on the CPU: fp32 sums of 64K squares stay near 1e-7 relative.
NORM_CHUNK = 1 << 16
#: Up to this many elements torch's own norm is used, as the stock Trainer's clipping does per
#: tensor (2e-5 relative at 1M, so small models match it bit for bit); beyond, the chunked sum.
PLAIN_NORM_MAX = 1 << 20


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares of ``t``, a float32 scalar on ``t``'s device.

    On the CPU, ``torch.linalg.vector_norm`` of a flat fp32 tensor loses precision with its
    length: the squared norm of 26M elements (a layer of Qwen3-Next's 512 experts at a tiny
    width) came out 2.6e-3 low and of 233M (a 7B layer's flat gradient) 6.6e-2 low, enough to
    move a clipping coefficient. Row norms of 64K-element chunks summed in float64 stay within
    1e-6 at the same speed. CUDA reductions are tree-shaped and accurate: unchanged there.
    """
    flat = t.reshape(-1)
    if t.device.type != "cpu" or flat.numel() <= PLAIN_NORM_MAX:
        return torch.linalg.vector_norm(flat, dtype=torch.float32).square()
    full = flat.numel() // NORM_CHUNK * NORM_CHUNK
    rows = torch.linalg.vector_norm(flat[:full].view(-1, NORM_CHUNK), dim=1, dtype=torch.float32)
    sq = rows.double().square().sum()
    if full < flat.numel():
        sq = sq + torch.linalg.vector_norm(flat[full:], dtype=torch.float64).square()
    return sq.float()
