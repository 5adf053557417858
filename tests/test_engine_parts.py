"""The engine's settings are fixed at construction, and each layer input gets one save decision."""

from __future__ import annotations

import pytest
import torch

from hf_megatrain.core.streamed_layer import CHAIN, KEEP, OFFLOAD, InputSave, save_decision
from hf_megatrain.core.streaming import StreamingEngine

BF16 = torch.bfloat16


def _engine(**settings) -> StreamingEngine:
    return StreamingEngine([], torch.device("cpu"), torch.float32, **settings)


def test_settings_are_read_only():
    engine = _engine(
        offload_activations=True,
        boundary_dtype=BF16,
        checkpoint_every=3,
        recompute_early_stop=False,
    )
    assert engine.offload_activations and engine.boundary_dtype is BF16
    assert engine.checkpoint_every == 3 and not engine.recompute_early_stop
    for name in (
        "offload_activations",
        "boundary_dtype",
        "checkpoint_every",
        "recompute_early_stop",
    ):
        with pytest.raises(AttributeError):
            setattr(engine, name, getattr(engine, name))
    # Per-step state stays settable.
    engine.sync_grads = False
    assert not engine.sync_grads
    # float32 boundaries keep the inputs as they are.
    assert _engine(boundary_dtype=torch.float32).boundary_dtype is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_checkpoint_every_is_checked(bad):
    with pytest.raises(ValueError, match="checkpoint_every"):
        _engine(checkpoint_every=bad)


def test_save_decision_per_input():
    hidden = torch.zeros(2, 1 << 20)
    residual = {tuple(hidden.shape)}
    rope = torch.zeros(1, 1 << 21)  # large, not the residual stream
    ids = torch.zeros(2, 1 << 20, dtype=torch.long)
    plain = _engine().activations
    off = _engine(offload_activations=True).activations
    bf16 = _engine(boundary_dtype=BF16).activations
    both = _engine(offload_activations=True, boundary_dtype=BF16).activations
    assert save_decision(plain, hidden, residual, chained=False) == InputSave(KEEP)
    assert save_decision(off, hidden, residual, chained=False) == InputSave(OFFLOAD)
    assert save_decision(bf16, hidden, residual, chained=False) == InputSave(KEEP, BF16)
    assert save_decision(both, hidden, residual, chained=False) == InputSave(OFFLOAD, BF16)
    assert save_decision(both, hidden, residual, chained=True) == InputSave(CHAIN)
    for t in (rope, ids, torch.zeros(2, 8)):
        assert save_decision(both, t, residual | {tuple(ids.shape)}, False) == InputSave(KEEP)
