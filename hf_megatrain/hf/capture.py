"""Divert transformers' output recorders (``OutputRecorder`` hooks) around streamed layers.

transformers 5.x records per-layer outputs (MoE router logits, attention weights) with forward hooks
that append into a context-local dict. Inside a streamed layer those hooks would record tensors made
under ``no_grad``, so the router auxiliary loss would lose its gradient. ``RecorderCapture`` swaps in
a private collector while a layer runs and hands the recorded tensors, now outputs of the streamed
autograd Function, back to the model's own collector.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _find_collector_var():
    for mod_name in ("transformers.utils.output_capturing", "transformers.utils.generic"):
        try:
            mod = __import__(mod_name, fromlist=["_active_collector"])
        except ImportError:
            continue
        var = getattr(mod, "_active_collector", None)
        if var is not None and hasattr(var, "get") and hasattr(var, "set"):
            return var
    return None


_COLLECTOR = _find_collector_var()


def recorder_capture_available() -> bool:
    return _COLLECTOR is not None


class RecorderCapture:
    """``OutputCapture`` implementation over transformers' ``_active_collector``."""

    # Recorded by hooks on the decoder layer itself: those see the streamed Function's output.
    _LAYER_LEVEL_KEYS = ("hidden_states",)

    def active_keys(self) -> tuple[str, ...]:
        if _COLLECTOR is None:
            return ()
        outer = _COLLECTOR.get()
        if not outer:
            return ()
        return tuple(k for k in outer if not k.startswith("_") and k not in self._LAYER_LEVEL_KEYS)

    @contextlib.contextmanager
    def capturing(self, keys: tuple[str, ...]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        pairs: list[tuple[str, torch.Tensor]] = []
        private = {k: [] for k in keys}
        token = _COLLECTOR.set(private)
        try:
            yield pairs
        finally:
            _COLLECTOR.reset(token)
            for k in keys:
                pairs.extend((k, t) for t in private[k] if isinstance(t, torch.Tensor))

    def publish(self, keys: list[str], tensors: list[torch.Tensor]) -> None:
        outer = _COLLECTOR.get() if _COLLECTOR is not None else None
        if outer is None:
            return
        for k, t in zip(keys, tensors):
            if k in outer:
                outer[k].append(t)
