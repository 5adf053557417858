"""Fused layer kernels by ``torch.compile``: the decoder layers' RMSNorm, SwiGLU gate and RoPE,
each compiled by Inductor into one Triton kernel forward and one backward.

Without them each of these is a chain of elementwise PyTorch ops, every one a pass over
(tokens x hidden) or (tokens x intermediate) memory: at 64k tokens per step they cost an 8B
model about a sixth of its step (the gap Liger-Kernel's hand-written kernels close). Compiled,
they need no extra package. The functions below restate the families' own arithmetic
(``LlamaRMSNorm.forward``, ``LlamaMLP.forward``'s gate, ``apply_rotary_pos_emb``) as functions
of tensors only: the streamed layer's weights are bound per call, so a compiled function must
take them as inputs (a compiled module would be guarded on its instance: one compile per layer).
tests/test_compiled_kernels.py checks each against the family's module, per family.
"""

from __future__ import annotations

import contextvars
import importlib.util
import logging
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from .layers import find_decoder_layers

logger = logging.getLogger(__name__)

#: Families whose norms, MLPs and RoPE are the ones restated here (Llama's, copied verbatim by
#: the others in transformers).
COMPILED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

#: The ``torch.compile`` backend. Tests on the CPU set "aot_eager": the same traced graphs and
#: saved tensors as Inductor's, without a C++ build per graph (half a minute each there).
COMPILE_BACKEND = "inductor"

_SILU_ACTS = ("silu", "swish")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` as a function of tensors."""
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: ``act_fn(gate_proj(x)) * up_proj(x)`` with SiLU."""
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary(q, k, cos, sin, unsqueeze_dim: int = 1):
    """``apply_rotary_pos_emb`` of the families here."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


_COMPILED: dict[tuple, object] = {}


def compiled(fn):
    """``fn`` compiled (once per backend), with a shape per token count avoided: the token
    dimensions are marked dynamic where a call passes them (``_dynamic``)."""
    key = (fn, COMPILE_BACKEND)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, backend=COMPILE_BACKEND, fullgraph=True)
    return _COMPILED[key]


def _dynamic(t: torch.Tensor, *dims: int) -> torch.Tensor:
    # Token counts change between micro-batches, MLP tiles and evaluation: one graph for all
    # (maybe_: a dimension of size 1 stays specialized without an error).
    for d in dims:
        torch._dynamo.maybe_mark_dynamic(t, d)
    return t


def _norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    shape = hidden_states.shape
    # One 2-D graph for the hidden-size norms and the per-head q/k norms alike.
    flat = _dynamic(hidden_states.reshape(-1, shape[-1]), 0)
    return compiled(rms_norm)(flat, self.weight, self.variance_epsilon).reshape(shape)


def _swiglu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    shape = gate.shape
    flat = [_dynamic(t.reshape(-1, shape[-1]), 0) for t in (gate, up)]
    return self.down_proj(compiled(silu_mul)(*flat).reshape(shape))


# Set while a patched attention module runs: the family's RoPE function is a module global, so
# its compiled stand-in (installed there, as Liger-Kernel installs its own) serves only the
# models whose kernels were asked for; any other model of the family keeps the original.
_ROTARY_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("compiled_rotary", default=False)


def _attention_forward(self: nn.Module, *args, **kwargs):
    token = _ROTARY_ON.set(True)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _ROTARY_ON.reset(token)


def _rotary_dispatch(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not _ROTARY_ON.get() or args or kwargs.get("unsqueeze_dim", 1) != 1:
            return original(q, k, cos, sin, *args, **kwargs)
        _dynamic(q, 0, 2), _dynamic(k, 0, 2), _dynamic(cos, 0, 1), _dynamic(sin, 0, 1)
        return compiled(rotary)(q, k, cos, sin)

    apply_rotary_pos_emb.original = original
    return apply_rotary_pos_emb


def compile_available(device: torch.device | str) -> tuple[bool, str]:
    """Whether Inductor can build kernels for ``device``: Triton for CUDA (PyTorch's CUDA wheels
    ship it), a C++ compiler for the CPU (slow to build: never chosen automatically there)."""
    kind = torch.device(device).type
    if kind == "cuda":
        if importlib.util.find_spec("triton") is None:
            return False, "Triton is not installed"
        return True, "Triton"
    if kind == "cpu":
        return True, "C++"
    return False, f"torch.compile's Inductor has no kernels for {kind}"


def is_compiled_forward(module: nn.Module | None) -> bool:
    """Whether ``module`` runs a forward of this file (also under MLP tiling)."""
    if module is None:
        return False
    forward = module.__dict__.get("forward")
    forward = getattr(forward, "forward_impl", forward)  # TiledTokenwise
    func = getattr(forward, "__func__", forward)
    return getattr(func, "__module__", None) == __name__


def _is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def _is_swiglu(module: nn.Module, act: str | None) -> bool:
    return act in _SILU_ACTS and all(
        isinstance(getattr(module, n, None), nn.Linear)
        for n in ("gate_proj", "up_proj", "down_proj")
    )


def apply_compiled_kernels(model: nn.Module, model_type: str | None) -> int:
    """Patch the compiled forwards onto every RMSNorm and SwiGLU MLP of the decoder layers and
    the final norm (instances, like Liger-Kernel), and the family's RoPE function (its module's
    global, as Liger-Kernel does: the attention forward looks it up per call). Returns how many
    modules were patched."""
    if model_type not in COMPILED_MODEL_TYPES:
        raise ValueError(
            f"hf_megatrain: megatrain_layer_kernels='compiled' has no kernels for model_type "
            f"{model_type!r} (it knows {', '.join(sorted(COMPILED_MODEL_TYPES))})"
        )
    prefix, layers = find_decoder_layers(model)
    base = model.get_submodule(prefix.rpartition(".")[0])
    config = getattr(model, "config", None)
    act = getattr(getattr(config, "get_text_config", lambda: config)(), "hidden_act", None)
    count = 0
    roots = [*layers, getattr(base, "norm", None)]
    for root in (r for r in roots if r is not None):
        for module in root.modules():
            if _is_rms_norm(module):
                module.forward = types.MethodType(_norm_forward, module)
                count += 1
            elif _is_swiglu(module, act):
                module.forward = types.MethodType(_swiglu_forward, module)
                count += 1
    if layers:
        modeling = sys.modules.get(type(layers[0]).__module__)
        current = getattr(modeling, "apply_rotary_pos_emb", None)
        if getattr(current, "original", None) is None and (
            getattr(current, "__module__", None) == modeling.__name__
        ):  # the family's own function, not one Liger-Kernel (or another patch) put there
            modeling.apply_rotary_pos_emb = _rotary_dispatch(current)
        if getattr(modeling.apply_rotary_pos_emb, "original", None) is not None:
            for layer in layers:
                attention = getattr(layer, "self_attn", None)
                if attention is not None:
                    attention.forward = types.MethodType(_attention_forward, attention)
    logger.info("hf_megatrain: %d norms and MLPs run torch.compile'd kernels", count)
    return count
