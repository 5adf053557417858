"""CUDA caching-allocator settings for streamed training."""

from __future__ import annotations

import os

import torch


def prefer_expandable_segments() -> bool:
    """Switch the CUDA caching allocator to expandable segments unless the user configured it.

    A streamed step allocates activations of very different sizes per micro-batch and layer
    (boundaries, recompute working sets, loss chunks) next to long-lived HBM-tier state; with
    fixed segments the cached-but-unusable part grew to 16 GiB of a 139 GiB H200 and a 7B run at
    64k tokens/step went out of memory with that much "reserved but unallocated". Expandable
    segments map pages into one growing range instead. Returns whether the setting was applied.
    """
    if any(os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        return False  # the user's allocator settings win
    # torch >= 2.10 has the device-generic setter (the CUDA one warns there as deprecated).
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    try:
        setter("expandable_segments:True")
    except (AttributeError, RuntimeError):  # an allocator backend without the option
        return False
    return True
