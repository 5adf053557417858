"""transformers' weight conversions (``from_pretrained`` fuses some checkpoint tensors, e.g. MoE
experts into ``gate_up_proj`` / ``down_proj``; ``save_pretrained`` reverts them): which a model
has, and what their revert copies when a save writes the checkpoint's layout."""

from __future__ import annotations

import re

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


def reverts_fused_weights(model: nn.Module) -> bool:
    """Whether ``save_pretrained`` reverts a conversion of ``model``'s weights beyond renaming
    them (MoE experts fused on load: the revert splits them, with copies)."""
    found, renaming = conversions(model)
    return any(not isinstance(t, renaming) for t in found)


#: Conversion steps whose revert gives views of the fused tensor (a split of its first dim,
#: each piece contiguous): no copy. Every other step's revert is taken to copy its tensor
#: (``Concatenate``'s is ``Chunk``, which makes each chunk contiguous).
_VIEW_REVERTS = ("MergeModulelist",)


def save_revert_copy_numel(model: nn.Module) -> int:
    """Elements a ``save_pretrained`` of ``model`` copies while reverting its fused weights to
    the checkpoint's layout: its parameters whose conversion's revert copies them (Mixtral's,
    Qwen-MoE's ``gate_up_proj``: 2/3 of the experts). The revert runs over the whole state
    dict at once, so all of them are alive together during a save."""
    found, renaming = conversions(model)
    copying = [
        t
        for t in found
        if not isinstance(t, renaming)
        and any(type(op).__name__ not in _VIEW_REVERTS for op in getattr(t, "operations", ()))
    ]
    if not copying:
        return 0
    targets = [
        re.compile(re.escape(p).replace(r"\*", r"\d+"))
        for t in copying
        for p in getattr(t, "target_patterns", ())
    ]
    return sum(
        p.numel() for name, p in model.named_parameters() if any(r.search(name) for r in targets)
    )
