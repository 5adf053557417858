"""Module-global patches confined to the models that asked for them.

A family's attention looks its RoPE function up in its modeling module at every call, so fused
kernels for it (Liger-Kernel's, the compiled ones) are installed there, as a module global. Liger
also replaces the module's norm and MLP classes, and its fused loss replaces a class's forward:
left in place, every model of the family built later in the process would run Liger's kernels
too (a stock twin compared with the streamed model, a model asked to run PyTorch's kernels), and
the memory plan of such a model would count kernels nobody asked for.

``confine_global_patches(model)`` wraps a patching call: afterwards the modeling modules' globals
and classes' forwards are as they were, and each replaced *function* is served through a
dispatcher that runs the replacement only while one of ``model``'s attention modules runs
(``scope_global``; a context variable, so threads and other models see the original).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import types
from collections.abc import Callable, Iterable, Iterator

from torch import nn

from .layers import UnsupportedModelError, find_decoder_layers

#: (module name, global name) -> the function that global runs in the current call stack.
_ACTIVE: contextvars.ContextVar[dict[tuple[str, str], Callable] | None] = contextvars.ContextVar(
    "hf_megatrain_scoped_globals", default=None
)
# Instance attributes of a scoped module (plain attributes: a deepcopy of the module, e.g. a DPO
# reference, keeps its scope; the bound inner forward is re-bound to the copy).
_BINDINGS = "_hf_megatrain_scoped_globals"
_INNER = "_hf_megatrain_inner_forward"


def _dispatcher(key: tuple[str, str], original: Callable) -> Callable:
    def dispatch(*args, **kwargs):
        active = _ACTIVE.get() or {}
        fn = active.get(key)
        if fn is None:
            return original(*args, **kwargs)
        # A replacement that calls the module's global itself (a wrapper of "what was there")
        # reaches the original, not itself again.
        token = _ACTIVE.set({**active, key: None})
        try:
            return fn(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    dispatch.__name__ = getattr(original, "__name__", key[1])
    dispatch.__doc__ = getattr(original, "__doc__", None)
    dispatch.original = original
    dispatch.scoped_key = key
    return dispatch


def original_global(module: types.ModuleType, name: str):
    """``module.<name>`` as the module defines it (under a dispatcher: what runs outside scopes)."""
    current = getattr(module, name, None)
    return getattr(current, "original", current) if _is_dispatcher(current) else current


def _is_dispatcher(obj) -> bool:
    return getattr(obj, "scoped_key", None) is not None


def _scoped_forward(self: nn.Module, *args, **kwargs):
    token = _ACTIVE.set({**(_ACTIVE.get() or {}), **getattr(self, _BINDINGS)})
    try:
        inner = getattr(self, _INNER)
        if inner is not None:
            return inner(*args, **kwargs)
        return type(self).forward(self, *args, **kwargs)
    finally:
        _ACTIVE.reset(token)


def scope_global(
    module: types.ModuleType, name: str, replacement: Callable, scopes: Iterable[nn.Module]
) -> None:
    """Make ``module.<name>`` run ``replacement`` while one of ``scopes`` runs its forward and
    the module's own function everywhere else."""
    current = getattr(module, name)
    key = (module.__name__, name)
    if not _is_dispatcher(current):
        setattr(module, name, _dispatcher(key, current))
    for scope in scopes:
        bindings = scope.__dict__.get(_BINDINGS)
        if bindings is None:
            bindings = {}
            scope.__dict__[_BINDINGS] = bindings
            scope.__dict__[_INNER] = scope.__dict__.get("forward")
            scope.forward = types.MethodType(_scoped_forward, scope)
        bindings[key] = replacement


def attention_scopes(model: nn.Module) -> list[nn.Module]:
    """Where a family's RoPE global is called: each decoder layer's attention (``self_attn``),
    else the layer itself."""
    try:
        _, layers = find_decoder_layers(model)
    except (UnsupportedModelError, AttributeError):  # not a decoder LM: nothing to scope to
        return []
    return [getattr(layer, "self_attn", None) or layer for layer in layers]


def _modeling_modules() -> list[types.ModuleType]:
    return [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("transformers.models.") and m is not None
    ]


def _class_forwards(modules: list[types.ModuleType]) -> dict[type, object]:
    return {
        cls: cls.__dict__.get("forward")
        for m in modules
        for cls in list(vars(m).values())
        if isinstance(cls, type) and cls.__module__ == m.__name__
    }


@contextlib.contextmanager
def confine_global_patches(model: nn.Module) -> Iterator[None]:
    """Undo, on exit, what the wrapped code changed in the loaded ``transformers.models``
    modules: replaced classes and other values get their originals back, replaced classes'
    forwards too, and replaced functions run only inside ``model``'s attention modules
    (``scope_global``). Instance patches of ``model``'s own modules stay."""
    modules = _modeling_modules()
    before = {m.__name__: dict(vars(m)) for m in modules}
    forwards = _class_forwards(modules)
    try:
        yield
    finally:
        scopes: list[nn.Module] | None = None
        for m in modules:
            for name, old in before[m.__name__].items():
                new = getattr(m, name, None)
                if new is old:
                    continue
                setattr(m, name, old)
                if isinstance(new, types.FunctionType) and isinstance(old, types.FunctionType):
                    scopes = attention_scopes(model) if scopes is None else scopes
                    if scopes:
                        scope_global(m, name, new, scopes)
        for cls, forward in forwards.items():
            if cls.__dict__.get("forward") is not forward:
                if forward is None:
                    delattr(cls, "forward")
                else:
                    cls.forward = forward


__all__ = [
    "attention_scopes",
    "confine_global_patches",
    "original_global",
    "scope_global",
]
