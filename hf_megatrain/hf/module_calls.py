"""``nn.Module`` calls on a streamed model: ``state_dict()`` and ``load_state_dict()`` read and
write its layer stores; moves, casts and copies answer in one line.

A streamed decoder layer's parameters are meta placeholders: its weights live in the layer's
store (the fp32 master; on the device for HBM-tier layers). Left alone, ``model.state_dict()``
returns the placeholders (``torch.save`` of it writes no weights; ``save_pretrained`` fails
inside torch, "Cannot copy out of meta tensor") and ``load_state_dict`` copies into them as a
no-op: both lose data without saying so. With these hooks, on each streamed layer (so also a
layer's or a block's own ``state_dict()``):

- ``state_dict()`` holds the layer's weights as views of its store's master (no copy; on the
  device for HBM-tier layers), after any pending optimizer update has written them;
- ``load_state_dict()`` writes the given values into the master and re-derives the compute copy
  the layer streams; the optimizer's moments are left as they are, as stock's load leaves them;
- in-place writes into the ``state_dict()`` views reach the compute copy before the layer next
  runs (``StreamingEngine.watch_master``);
- in-place writes into the placeholders themselves (``p.mul_()`` over ``model.parameters()``)
  change nothing: :func:`written_placeholders` finds them (the trainer refuses the next step).

On the model: ``apply(fn)`` (an init function) sees the streamed layers' parameters as their fp32
masters, and what it writes streams; ``zero_grad()`` also clears the streamed layers' gradients
(accumulated in the engine, not on the placeholders).

The other ``nn.Module`` calls that would reach the placeholders or the store answer in one line:
``.to()`` / ``.cuda()`` / ``.cpu()`` to where the model already is, in its dtype, do nothing (they
failed inside torch, "Cannot copy out of meta tensor"); a move or cast (``.half()``, ``.to(bf16)``)
is refused, on every submodule, before a tensor is touched (it cast the resident weights the
optimizer updates in fp32, silently); so are ``copy.deepcopy`` and pickling (they failed on the
store's shared memory).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


def install_module_calls(
    model: nn.Module,
    layers: Sequence[nn.Module],
    device: torch.device,
    state_of: Callable[[nn.Module], Any],
) -> None:
    """Hook ``model`` and each of its streamed ``layers`` (in store order); ``device``: where
    the model computes (its resident parameters' device); ``state_of``: the model's streamed
    state (``hf.model.streamed_state``), looked up per call: the OOM watchdog may have moved a
    layer to another store."""
    ref = weakref.ref(model)
    for i, layer in enumerate(layers):
        layer.register_state_dict_post_hook(functools.partial(_read_layer, ref, state_of, i))
        layer.register_load_state_dict_pre_hook(functools.partial(_write_layer, ref, state_of, i))
        # (The load's own copy into the placeholders, meta to meta, counts as no write.)
        layer.register_load_state_dict_post_hook(_record_placeholder_versions)
        _record_placeholder_versions(layer)
        layer.apply = functools.partial(_apply_bound, layer.apply, ref, state_of, {i: layer})
    model.apply = functools.partial(
        _apply_bound, model.apply, ref, state_of, dict(enumerate(layers))
    )
    model.zero_grad = functools.partial(_zero_grad, model.zero_grad, ref, state_of)
    for name in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
        # (transformers' checkpointing would recompute a layer outside the engine, whose weights
        # are meta placeholders there: the engine recomputes the streamed layers itself.)
        if hasattr(model, name):
            setattr(model, name, _checkpointing_ignored)
    for module in model.modules():
        # Instance attributes: torch's .to() / .half() / .cuda() all go through _apply, on every
        # module (``model.model.half()`` must be refused before it casts the embedding).
        module._apply = functools.partial(_apply_in_place, module._apply, device)
    for module in (model, *layers):
        # Copy and pickle look these up on the object.
        module.__deepcopy__ = _refuse_copy
        module.__reduce_ex__ = _refuse_copy
    _watch_foreign_optimizers(layers)


def _record_placeholder_versions(layer: nn.Module, *_: Any) -> None:
    layer._megatrain_placeholder_versions = {
        name: p._version for name, p in layer.named_parameters() if p.is_meta
    }


def written_placeholders(layers: Sequence[nn.Module]) -> list[tuple[int, str]]:
    """``(layer index, parameter name)`` of each streamed layer placeholder written in place
    since it was streamed (``p.mul_(0.9)`` over ``model.parameters()``, a foreign optimizer's
    step): a meta tensor holds no data, so such a write changed no weight. (Writes through
    ``model.state_dict()``'s views or ``load_state_dict`` reach the store and are not listed;
    nor is a write through ``p.data``, which has a version counter of its own.)"""
    written = []
    for i, layer in enumerate(layers):
        versions = getattr(layer, "_megatrain_placeholder_versions", {})
        for name, p in layer.named_parameters():
            if p.is_meta and p._version != versions.get(name, p._version):
                written.append((i, name))
    return written


#: id -> weak reference of each streamed layer's placeholder parameters that train.
_PLACEHOLDERS: dict[int, weakref.ref] = {}
_STEP_HOOK: list = []  # the global optimizer-step hook, once registered


def _watch_foreign_optimizers(layers: Sequence[nn.Module]) -> None:
    """Refuse, at its first step, a torch optimizer over a streamed model's parameters: it sees
    the layers' placeholders, not their weights, and left the decoder layers untrained without
    a word (found by an audit: ``torch.optim.AdamW(model.parameters())`` in a loop of one's
    own). The engine's AdamW (``HostAdamW``, ``streamed_optimizer``) is exempt."""
    for layer in layers:
        for p in layer.parameters():
            if p.is_meta and p.requires_grad:
                key = id(p)
                _PLACEHOLDERS[key] = weakref.ref(p, lambda _, key=key: _PLACEHOLDERS.pop(key, None))
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: PLC0415

        _STEP_HOOK.append(register_optimizer_step_pre_hook(_foreign_step))
        # torch's clipping over a streamed model's parameters sees no gradient for the
        # placeholders: it clipped by the norm of the other parameters, silently (found by an
        # audit). Wrapped where callers look them up at call time, accelerate's too (its
        # clip_grad_norm_ leaves out parameters without a gradient before torch sees them;
        # found by a later audit). A name imported before this module was is not reached.
        for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_"):
            clip = getattr(torch.nn.utils.clip_grad, name, None)
            if clip is not None:
                checked = _checked_clip(clip, f"torch.nn.utils.{name}")
                setattr(torch.nn.utils, name, checked)
                setattr(torch.nn.utils.clip_grad, name, checked)
        from accelerate import Accelerator  # noqa: PLC0415

        for name in ("clip_grad_norm_", "clip_grad_value_"):
            method = getattr(Accelerator, name)
            setattr(Accelerator, name, _checked_clip(method, f"accelerate's {name}", method=True))


def _any_placeholder(parameters) -> bool:
    """Whether ``parameters`` hold a streamed layer's trainable placeholder."""
    for p in parameters:
        ref = _PLACEHOLDERS.get(id(p))
        if ref is not None and ref() is p and p.requires_grad:
            return True
    return False


def _foreign_step(optimizer, args, kwargs) -> None:
    from ..core.optimizer import HostAdamW  # noqa: PLC0415

    if isinstance(optimizer, HostAdamW) or not _PLACEHOLDERS:
        return
    for group in optimizer.param_groups:
        if _any_placeholder(group["params"]):
            raise ValueError(
                f"hf_megatrain: {type(optimizer).__name__} was given a streamed model's "
                "parameters: its decoder layers' are placeholders (their weights live in "
                "the host store), so its step would leave the layers untrained. Use "
                "hf_megatrain.streamed_optimizer(model, lr=...) (the engine's AdamW), or "
                "HFMegaTrainer"
            )


def _checked_clip(clip, what: str, method: bool = False):
    """``clip`` (a clipping function, or a method with ``method``), refusing a streamed model's
    trainable placeholders: their gradients live in the engine, so the norm would leave the
    decoder layers out."""

    @functools.wraps(clip)
    def checked(*args, **kwargs):
        head, rest = (args[:1], list(args[1:])) if method else ((), list(args))
        parameters = rest.pop(0) if rest else kwargs.pop("parameters")
        if _PLACEHOLDERS:
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            if _any_placeholder(parameters):
                raise ValueError(
                    f"hf_megatrain: {what} was given a streamed model's parameters: its decoder "
                    "layers' are placeholders whose gradients live in the engine, so the norm "
                    "(and the clipping) would leave those layers out. Use the engine's AdamW's "
                    "optimizer.clip_grad_norm_(max_norm) (hf_megatrain.streamed_optimizer; the "
                    "whole model's norm), or HFMegaTrainer with max_grad_norm"
                )
        return clip(*head, parameters, *rest, **kwargs)

    return checked


def _checkpointing_ignored(*args, **kwargs) -> None:
    """``gradient_checkpointing_enable`` of a streamed model (peft's
    ``prepare_model_for_kbit_training`` calls it): a no-op, said once."""
    if not _checkpointing_ignored.said:
        _checkpointing_ignored.said = True
        logger.info(
            "hf_megatrain: gradient_checkpointing_enable() is ignored on a streamed model: its "
            "layers recompute in the engine (checkpoint segments)"
        )


_checkpointing_ignored.said = False


def _apply_in_place(apply, device: torch.device, fn, *args, **kwargs):
    """``nn.Module._apply`` of a streamed model: ``fn`` (the conversion of ``.to()``, ``.half()``,
    ``.cuda()`` ...) tried on a probe tensor; one that changes nothing is a no-op, any other is
    refused before it touches a tensor."""
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    try:
        out = fn(probe)
    except Exception:  # noqa: BLE001 - a conversion that does not apply to a tensor: let torch say
        return apply(fn, *args, **kwargs)
    if out is None:  # share_memory_() and the like: in place, nothing converted
        return apply(fn, *args, **kwargs)
    if out.dtype == probe.dtype and out.device == probe.device:
        return apply.__self__  # where and as it already is: nothing to do
    raise ValueError(
        f"hf_megatrain: a streamed model stays on {device} in fp32 (its layers' weights live in "
        f"the layer stores, the optimizer updates the resident ones in fp32): moving or casting "
        f"it (to {out.device} / {str(out.dtype).removeprefix('torch.')}) is not possible. For "
        "inference elsewhere or in another dtype, save it (save_pretrained) and load that with "
        "from_pretrained; bf16 compute is the bf16=True of its training arguments"
    )


def _refuse_copy(*args, **kwargs):
    raise TypeError(
        "hf_megatrain: a streamed model cannot be copied or pickled (its weights live in the "
        "layer stores, in shared host memory): save it with save_pretrained (or "
        "trainer.save_model) and load a second copy with from_pretrained or "
        "hf_megatrain.load_streamed_model"
    )


def _layer_store(ref: weakref.ref, state_of, index: int):
    model = ref()
    state = None if model is None else state_of(model)
    return (None, None) if state is None else (state, state.store.layers[index])


def _read_layer(ref, state_of, index, module, state_dict, prefix, local_metadata) -> None:
    state, store = _layer_store(ref, state_of, index)
    if store is None:
        return
    state.engine.wait_all_weights()
    for rel, view in store.param_views(store.master).items():
        if prefix + rel in state_dict:
            state_dict[prefix + rel] = view.detach()
    # The views may be written in place, as a module's state_dict() tensors may: the layer's
    # compute copy then follows before it next runs.
    state.engine.watch_master(index)


def _zero_grad(zero_grad, ref, state_of, set_to_none: bool = True) -> None:
    """``model.zero_grad()``: the resident parameters' gradients, and the streamed layers'
    (accumulated in the engine, not on their placeholders), as stock's clears them all."""
    zero_grad(set_to_none=set_to_none)
    model = ref()
    state = None if model is None else state_of(model)
    if state is None or not state.engine.has_grads():
        # (After an optimizer step, which drops them itself: the trainer's call each step then
        # leaves the engine alone while the step's host updates still run.)
        return
    if state.engine.finals_sent():
        raise RuntimeError(
            "hf_megatrain: model.zero_grad() with eager layer updates, after a backward whose "
            "layers already updated: their gradients were applied as they came (call it "
            "before backward, or train with eager_update=False)"
        )
    state.engine.reset_grads()


#: Stores whose placeholders are bound to their masters now (nested ``apply`` calls).
_BOUND: set[int] = set()


def _apply_bound(apply, ref, state_of, layers: dict[int, nn.Module], fn) -> nn.Module:
    """``module.apply(fn)`` (an init function, ``model.apply(model._init_weights)``): ``fn``
    sees each streamed layer's parameters as its fp32 master (not the meta placeholders, where
    its writes were lost) and what it writes is what the layer streams from then on."""
    model = ref()
    state = None if model is None else state_of(model)
    if state is None:
        return apply(fn)
    stores = {i: state.store.layers[i] for i in layers}
    todo = {i: layer for i, layer in layers.items() if id(stores[i]) not in _BOUND}
    if not todo:
        return apply(fn)
    if state.engine.dp is not None:
        raise ValueError(
            "hf_megatrain: apply() on a data-parallel streamed model: the layers' weights are "
            "shared between the ranks; change them before streaming, or load them with "
            "hf_megatrain.load_streamed_model(path)"
        )
    state.engine.wait_all_weights()
    state.engine.wait_weight_copies()  # no H2D copy may still read a compute copy
    bound: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter, torch.Tensor, str]] = []
    for i, layer in todo.items():
        _BOUND.add(id(stores[i]))
        for rel, view in stores[i].param_views(stores[i].master).items():
            owner, _, name = rel.rpartition(".")
            module = layer.get_submodule(owner)
            placeholder = module._parameters[name]
            master = nn.Parameter(view.detach(), requires_grad=placeholder.requires_grad)
            module._parameters[name] = master
            bound.append((module, name, placeholder, master, view, f"layer {i}'s {rel}"))
    try:
        result = apply(fn)
    finally:
        replaced = []
        for module, name, placeholder, master, view, what in bound:
            now = module._parameters.get(name)
            module._parameters[name] = placeholder
            if now is not master:  # fn assigned a new parameter: its value goes to the master
                if now is None or tuple(now.shape) != tuple(view.shape):
                    replaced.append(what)
                else:
                    with torch.no_grad():
                        view.copy_(now.detach())
        with torch.no_grad():
            for i in todo:
                _BOUND.discard(id(stores[i]))
                stores[i].refresh_stream_copy()
        state.engine.invalidate_weights()
    if replaced:
        raise ValueError(
            f"hf_megatrain: apply() removed or reshaped {', '.join(replaced)} of a streamed "
            "model, whose layers' shapes are fixed by their stores: their weights were kept"
        )
    return result


def _write_layer(
    ref, state_of, index, module, state_dict, prefix, local_metadata, strict, missing,
    unexpected, errors,
) -> None:  # fmt: skip
    state, store = _layer_store(ref, state_of, index)
    if store is None:
        return
    views = {prefix + rel: view for rel, view in store.param_views(store.master).items()}
    given = [k for k in views if k in state_dict and isinstance(state_dict[k], torch.Tensor)]
    if not given:
        return
    if local_metadata.get("assign_to_params_buffers", False):
        raise ValueError(
            "hf_megatrain: load_state_dict(assign=True) would replace the placeholders of a "
            "streamed layer, whose weights live in its layer store: call it with assign=False "
            "(the default), which writes the values into the store"
        )
    if state.engine.dp is not None:
        raise ValueError(
            "hf_megatrain: load_state_dict on a data-parallel streamed model: the layers' "
            "weights are shared between the ranks; load them before training starts, "
            "with hf_megatrain.load_streamed_model(path), or resume from a checkpoint"
        )
    # Only tensors of the right shape are written: torch reports the others (size mismatch)
    # after this hook, and the load then raises with this layer unchanged.
    fits = [k for k in given if tuple(state_dict[k].shape) == tuple(views[k].shape)]
    if len(fits) < len(given):
        return
    state.engine.wait_all_weights()
    state.engine.wait_weight_copies()  # no H2D copy may still read the compute copy
    with torch.no_grad():
        for key in fits:
            value = state_dict[key]
            views[key].copy_(value.detach())  # to the store's dtype and device
            # What the placeholder's own load then copies: nothing (meta to meta), no warning.
            state_dict[key] = value.detach().to("meta")
    store.refresh_stream_copy()
    state.engine.invalidate_weights()


__all__ = ["install_module_calls", "written_placeholders"]
