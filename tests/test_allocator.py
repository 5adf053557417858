"""The CUDA allocator setting: applied by default, never over the user's own configuration."""

import torch

from hf_megatrain.core import allocator


def test_expandable_segments_applied_unless_user_configured(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert allocator.prefer_expandable_segments() is True
    assert calls == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert allocator.prefer_expandable_segments() is False
    assert calls == ["expandable_segments:True"]  # the user's setting stays in force
