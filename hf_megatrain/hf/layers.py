"""Where a causal LM keeps its decoder layers, and the error for models that cannot stream."""

from __future__ import annotations

from torch import nn


class UnsupportedModelError(ValueError):
    """The model cannot be streamed; the message names what is unsupported."""


#: Names of the decoder layer list: ``model.layers`` for most families, ``transformer.h`` for
#: the GPT-style ones (Falcon, BLOOM, GPT-J, GPTBigCode), ``transformer.blocks`` for MPT.
_LAYER_LIST_NAMES = ("h", "blocks")


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Locate the decoder layer list (``<base>.layers``, ``.h``, ``.blocks``) of a causal LM
    (PEFT-wrapped too): a ModuleList of ``num_hidden_layers`` modules, the outermost one."""
    n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if (name.endswith("layers") or name.rpartition(".")[2] in _LAYER_LIST_NAMES)
        and isinstance(module, nn.ModuleList)
        and (n_layers is None or len(module) == n_layers)
    ]
    if candidates:
        return min(candidates, key=lambda c: c[0].count("."))
    raise UnsupportedModelError(
        f"hf_megatrain: could not find the decoder layers (a ModuleList of num_hidden_layers "
        f"modules named '*.layers', '*.h' or '*.blocks') in {type(model).__name__}."
    )


def forward_function(module: nn.Module):
    """The function ``module``'s forward runs: one patched onto the instance (a fused kernel's),
    also under MLP tiling (``TiledTokenwise.forward_impl``), else its class's."""
    forward = module.__dict__.get("forward") or type(module).forward
    forward = getattr(forward, "forward_impl", forward)
    return getattr(forward, "__func__", forward)
