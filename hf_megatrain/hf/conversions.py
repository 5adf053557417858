"""transformers' weight conversions (``from_pretrained`` fuses some checkpoint tensors, e.g. MoE
experts into ``gate_up_proj`` / ``down_proj``; ``save_pretrained`` reverts them): which a model
has, and how a save reverts them without copying them."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
from collections.abc import Iterator

import torch
from torch import nn


def conversions(model: nn.Module) -> tuple[list, type | None]:
    """``model``'s weight conversions as ``from_pretrained`` applies them, and the class of
    those that only rename (``[], None`` on versions without them)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: PLC0415
        from transformers.core_model_loading import WeightRenaming  # noqa: PLC0415
    except ImportError:
        return [], None
    return get_model_conversion_mapping(model), WeightRenaming


#: Set while a save reverts fused weights (``reverts_as_views``): transformers' ``Chunk``, the
#: revert of ``Concatenate`` (MoE experts' gate and up projections fused on load), hands out
#: its pieces as views instead of contiguous copies.
_CHUNK_VIEWS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hf_megatrain_chunk_views", default=False
)


def _install_chunk_views() -> bool:
    """Wrap transformers' ``Chunk.convert`` once so that under ``_CHUNK_VIEWS`` it returns the
    chunks as views (outside it, and for any input it does not expect, it runs as it is)."""
    try:
        from transformers.core_model_loading import Chunk  # noqa: PLC0415
    except ImportError:
        return False
    if getattr(Chunk.convert, "hf_megatrain_views", False):
        return True
    original = Chunk.convert

    @functools.wraps(original)
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        if not _CHUNK_VIEWS.get() or len(input_dict) != 1:
            return original(self, input_dict, source_patterns, target_patterns, **kwargs)
        tensors = next(iter(input_dict.values()))
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        targets = self.get_target_patterns(target_patterns, **kwargs)
        return dict(zip(targets, torch.chunk(tensor, len(targets), dim=self.dim)))

    convert.hf_megatrain_views = True
    Chunk.convert = convert
    return True


@contextlib.contextmanager
def reverts_as_views() -> Iterator[None]:
    """While a save runs: the revert of fused weights makes views, not copies.

    transformers' ``save_pretrained`` reverts the whole state dict at once before it writes a
    shard, and its ``Chunk`` makes each half of a fused ``gate_up_proj`` contiguous: a copy of
    2/3 of every layer's experts, all alive together (23.8 GB for OLMoE). As views, the halves
    split per expert (``SplitModulelist``) are contiguous slices of the fused tensor, written
    from where they are; a piece that is not contiguous is still made so, by the writer, one
    shard at a time. The files are the same bytes."""
    _install_chunk_views()
    token = _CHUNK_VIEWS.set(True)
    try:
        yield
    finally:
        _CHUNK_VIEWS.reset(token)


def save_revert_copy_numel(model: nn.Module) -> int:
    """Elements of ``model``'s parameters that a save copies while reverting its fused weights to
    the checkpoint's layout (``reverts_as_views``): the reverted pieces that are not
    contiguous, which the writer copies a shard at a time (0 for every MoE family transformers
    fuses today: their pieces are contiguous slices). Found by reverting meta tensors of the
    parameters' shapes."""
    found, renaming = conversions(model)
    converting = [t for t in found if not isinstance(t, renaming)]
    if not converting:
        return 0
    try:
        from transformers.core_model_loading import revert_weight_conversion  # noqa: PLC0415
    except ImportError:
        return 0
    targets = [
        re.compile(re.escape(p).replace(r"\*", r"\d+"))
        for t in converting
        for p in getattr(t, "target_patterns", ())
    ]
    meta = {
        name: torch.empty(p.shape, dtype=p.dtype, device="meta")
        for name, p in model.named_parameters()
        if any(r.search(name) for r in targets)
    }
    with reverts_as_views():
        reverted = revert_weight_conversion(model, meta)
    return sum(t.numel() for t in reverted.values() if not t.is_contiguous())
