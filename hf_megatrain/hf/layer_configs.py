"""Config values that may differ per decoder layer.

transformers' heterogeneous configs (``per_layer_config``: Gemma 4's full-attention layers have
their own head width and key/value heads) raise ``AmbiguousGlobalPerLayerAttributeError`` on
the global attribute. The planner and the FLOP count read them here: per layer, or the widest
of them (a layer's working set is planned at the widest layer's).
"""

from __future__ import annotations

from typing import Any


def per_layer_attributes(config: Any) -> frozenset[str]:
    """The attributes ``config`` sets per layer (empty for a homogeneous config, and with a
    transformers that has no heterogeneous configs)."""
    try:
        names = getattr(config, "per_layer_attributes", None)
    except Exception:  # noqa: BLE001 - a config class of its own: homogeneous
        return frozenset()
    return frozenset(names or ())


def layer_values(config: Any, name: str, default: Any = None) -> list[Any]:
    """``config.<name>`` of each decoder layer: its per-layer config's where the config sets
    ``name`` per layer, else the global value (or ``default``) for every layer."""
    if name in per_layer_attributes(config):
        return [getattr(layer, name, default) for layer in config.per_layer_config]
    value = getattr(config, name, default)
    return [value] * int(getattr(config, "num_hidden_layers", 1) or 1)


def head_dims(config: Any) -> list[int]:
    """Each decoder layer's attention head width: its ``head_dim``, else ``hidden_size /
    num_attention_heads`` (0 without heads)."""
    heads = getattr(config, "num_attention_heads", 0) or 0
    fallback = config.hidden_size // heads if heads else 0
    return [d or fallback for d in layer_values(config, "head_dim")]


def attention_widths(config: Any) -> tuple[int, int]:
    """Per layer at the widest: (head_dim, key/value width = kv heads x head_dim). The query
    heads are one count for every layer (``num_attention_heads``); a config without kv heads
    has as many as queries."""
    heads = getattr(config, "num_attention_heads", 0) or 0
    dims = head_dims(config)
    kv_heads = [k or heads for k in layer_values(config, "num_key_value_heads")]
    head_dim = max(dims, default=0)
    return head_dim, max((d * k for d, k in zip(dims, kv_heads)), default=heads * head_dim)
