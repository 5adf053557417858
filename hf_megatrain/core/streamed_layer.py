"""Decoder layers that stream: the callable installed as a layer's ``forward`` and its autograd
``Function``.

``StreamedLayer`` runs the layer's own class ``forward`` with the streamed weights bound as plain
tensors (``_reparametrize_module``: never ``param.data =``), inside a custom autograd ``Function``
that saves only the layer inputs (or, for HBM-tier layers with ``keep_graph``, the forward's
graph with its activations). Forward builds the layer's graph either way; without
``keep_graph`` its saved tensors are placeholders (``recompute.PlaceholderSaves``). Backward
re-binds the weights, re-runs the layer until the last saved tensor is re-made (the MLP's down
projection and the residual add are not run again) and takes gradients through the forward's
graph with ``torch.autograd.grad``. What each tensor input is saved as (kept, offloaded,
rounded, or not at all for a checkpoint-segment follower, whose input ``segments.segment_input``
re-makes) is one ``save_decision`` per input. The engine that moves weights, activations
and gradients is ``streaming.StreamingEngine``.

No ``transformers`` import here: model-specific output capture comes in through ``OutputCapture``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch.autograd.graph import get_gradient_edge
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from .carried import CarriedKey, bind_mappings, carry_mappings, collect_writes, write_back
from .recompute import PlaceholderSaves, attention_output_cache, release_storage
from .segments import SegmentEntry, segment_input, tensor_sig

if TYPE_CHECKING:
    from .engine.activations import ActivationStash
    from .streaming import StreamingEngine


class OutputCapture(Protocol):
    """Hook for outputs a model records from inside a layer (e.g. MoE router logits).

    Recorded tensors made while the layer runs under ``no_grad`` would carry no gradient, so they
    are diverted: ``active_keys()`` names what the model currently records, ``capturing(keys)``
    yields a list that fills with ``(key, tensor)`` pairs while the layer runs, and
    ``publish(keys, tensors)`` hands the autograd-connected versions to the model's recorder.
    """

    def active_keys(self) -> tuple[str, ...]: ...

    def capturing(
        self, keys: tuple[str, ...]
    ) -> contextlib.AbstractContextManager[list[tuple[str, torch.Tensor]]]: ...

    def publish(self, keys: list[str], tensors: list[torch.Tensor]) -> None: ...


class LayerChangedError(ValueError):
    """A streamed layer's modules were changed after it was streamed (its linear layers wrapped
    by adapters, a module replaced): the store's weights no longer bind to it (found by an
    audit: PEFT's adapters added to a streamed model failed inside torch's reparametrize)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        super().__init__(
            f"hf_megatrain: decoder layer {layer}'s modules were changed after the model was "
            "streamed (e.g. adapters wrapped its linear layers: get_peft_model or "
            "PeftModel.from_pretrained on a streamed model), so its streamed weights no longer "
            "bind to it. Add adapters to the model before it is streamed (to the materialized "
            "model handed to the trainer), or, for inference, merge them into a materialized "
            "model first (merge_and_unload)."
        )


class StreamedLayer:
    """Callable installed as a decoder layer's ``forward``: streams its weights in, runs it."""

    def __init__(
        self,
        engine: StreamingEngine,
        index: int,
        module: torch.nn.Module,
        capture: OutputCapture | None = None,
        trainable: bool = True,
        resident: list[tuple[str, torch.Tensor]] | None = None,
        fp32_params: list[str] | None = None,
    ) -> None:
        self.engine = engine
        self.index = index
        self.module = module
        self.capture = capture
        self.trainable = trainable
        # Parameters of this layer that live on the device instead of the store (e.g. LoRA
        # adapters over a streamed frozen base): ``(name relative to the layer, tensor)``. They
        # enter the autograd Function as inputs, which is how they get their gradients.
        self.resident = list(resident or [])
        # Streamed parameters bound in fp32 (the HF side names the residual-stream norm
        # weights): at their fp32 master values with fp32 gradients in mixed precision, as the
        # stock Trainer runs the parameters autocast does not cast (engine.bind_exact).
        self.fp32_params = list(fp32_params or [])
        if self.fp32_params:
            engine.bind_exact(index, self.fp32_params)
        self.forward_impl: Callable[..., Any] = type(module).forward
        # Keep the forward's autograd graph (its saved activations) for backward instead of
        # saving only the inputs and recomputing: about 7.5 FLOPs per parameter and token (8
        # less the down projection the recompute skips) become 6, for the activation memory
        # (planner: kept_activation_bytes_per_token). Only for layers whose weights stay put
        # until backward: the HBM tier (a streamed layer's device buffer is overwritten by the
        # next layer).
        self.keep_graph = False
        # Recomputed with the early stop, keep the fused attention kernel's outputs (attention
        # output, log-sum-exp) from forward to backward: the recompute does not run that kernel
        # again (recompute.attention_output_cache; planned per layer and token).
        self.keep_attention = False
        # Which of the store's slots train (read at the first run: name -> trainable).
        self._slot_trains: dict[str, bool] | None = None

    def run(
        self,
        flat_weights: torch.Tensor,
        flat_args: list,
        spec,
        leaves: bool,
        keys=(),
        resident: list[torch.Tensor] | None = None,
    ):
        """Run the layer with ``flat_weights`` (and the resident tensors) bound.

        Returns ``(output, captured (key, tensor) pairs, weight leaves)``.
        """
        store = self.engine.stores[self.index]
        params = store.param_views(flat_weights)
        exact = self.engine.exact_params(self.index) if self.fp32_params else None
        if exact:
            params.update(exact)  # fp32 master values: their leaves get fp32 gradients
        weight_leaves: list[torch.Tensor] = []
        if leaves:
            # A frozen slot's leaf needs no gradient: autograd computes none for it, as for the
            # stock model's frozen parameter.
            if self._slot_trains is None:  # (the slots are fixed once streamed: read once)
                self._slot_trains = {s.name: s.trainable for s in store.slots}
            trains = self._slot_trains
            params = {k: v.detach().requires_grad_(trains[k]) for k, v in params.items()}
            weight_leaves = list(params.values())
        for name in self.fp32_params:
            # Without exact values (a frozen layer's compute-dtype copy): an fp32 copy of them,
            # differentiable (a gradient would come back cast). Already fp32: unchanged.
            params[name] = params[name].float()
        resident = resident if resident is not None else [t for _, t in self.resident]
        params.update({name: t for (name, _), t in zip(self.resident, resident)})
        # The layer's inputs are graph leaves here; in the stock model they are the previous
        # layer's output. Autocast caches its casts of leaves that require grad, so a post-norm
        # layer (Olmo2, EXAONE 4: q/k/v read the residual stream itself) would sum their input
        # gradients in bf16 where stock sums them in fp32. An alias (no copy) is no leaf.
        flat_args = [
            t.view_as(t) if isinstance(t, torch.Tensor) and t.requires_grad else t
            for t in flat_args
        ]
        # Tensors of carried mappings follow the call's own arguments (``__call__``): the
        # layer runs on mappings filled with them, and what it writes there is an output too.
        flat_args, bound = bind_mappings(flat_args, spec.num_leaves)
        args, kwargs = tree_unflatten(flat_args, spec)
        capture_ctx = self.capture.capturing(keys) if keys else contextlib.nullcontext([])
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(_reparametrize_module(self.module, params))
            except (AttributeError, KeyError) as err:
                raise LayerChangedError(self.index) from err
            captured = stack.enter_context(capture_ctx)
            with self.engine.compute_context():
                out = self.forward_impl(self.module, *args, **kwargs)
        return out, list(captured) + collect_writes(bound), weight_leaves

    def next_index(self, backward: bool) -> int:
        return self.index - 1 if backward else self.index + 1

    def _grad_anchors(self) -> list[torch.Tensor]:
        """The Function inputs that stand for the streamed weights: the layer's own placeholder
        parameters that train (``backward(inputs=[...])`` naming any of them then asks for this
        layer's weight gradients), else an empty leaf that needs a gradient. Read per call: a
        parameter frozen since is no anchor."""
        placeholders = getattr(self, "_placeholders", None)
        if placeholders is None:  # (fixed once streamed: walked once, not per forward)
            placeholders = self._placeholders = [p for p in self.module.parameters() if p.is_meta]
        anchors = [p for p in placeholders if p.requires_grad]
        if anchors:
            return anchors
        anchor = getattr(self, "_anchor", None)
        if anchor is None:
            anchor = self._anchor = torch.empty(0, device=self.engine.device, requires_grad=True)
        return [anchor]

    def __call__(self, *args, **kwargs):
        flat_args, spec = tree_flatten((args, kwargs))
        keys = self.capture.active_keys() if self.capture is not None else ()
        if not torch.is_grad_enabled():
            weights = self.engine.acquire(self.index, self.next_index(False))
            out, captured, _ = self.run(weights, flat_args, spec, leaves=False, keys=keys)
            self.engine.release(self.index)
            if captured:
                self.capture.publish([k for k, _ in captured], [t for _, t in captured])
            return out
        # Mappings the layer may read and write for later layers: their tensors become inputs
        # and outputs of the Function (core/carried.py).
        flat_args, carried = carry_mappings(flat_args)
        tensor_pos = [i for i, x in enumerate(flat_args) if isinstance(x, torch.Tensor)]
        tensors = [flat_args[i] for i in tensor_pos]
        box: dict[str, Any] = {"keys": keys}
        if self.trainable:
            # The streamed weights are not Function inputs: when no input needs a gradient (frozen
            # embeddings, or a frozen layer before this one), autograd would never call backward
            # and this layer would get no weight gradient. A grad-requiring empty anchor input
            # keeps the node in the graph; it receives no gradient itself.
            tensors.extend(self._grad_anchors())
        box["n_anchor"] = len(tensors) - len(tensor_pos)
        tensors.extend(t for _, t in self.resident)
        results = _StreamedLayerFunction.apply(self, flat_args, spec, tensor_pos, box, *tensors)
        n_out = box["n_out"]
        out_flat = box["out_flat"]
        for pos, t in zip(box["out_tensor_pos"], results[:n_out]):
            out_flat[pos] = t
        pairs = list(zip(box["captured_keys"], results[n_out:]))
        recorded = [(k, t) for k, t in pairs if not isinstance(k, CarriedKey)]
        if recorded:
            self.capture.publish([k for k, _ in recorded], [t for _, t in recorded])
        if carried:
            writes = [(k, t) for k, t in pairs if isinstance(k, CarriedKey)]
            write_back(carried, [k for k, _ in writes], [t for _, t in writes])
        for c in carried:
            c.original = None  # (held by the Function's ctx: no path from it to its outputs)
        return tree_unflatten(out_flat, box["out_spec"])


_will_execute = getattr(torch._C, "_will_engine_execute_node", None)


def asks_weight_grads(anchor_nodes) -> bool:
    """Whether the running backward accumulates the layer's weight gradients: ``backward()``
    does, and ``backward(inputs=...)`` naming one of the layer's parameters; neither
    ``torch.autograd.grad`` (which never accumulates) nor ``backward(inputs=...)`` without them
    do (they accumulated into the engine anyway, and leaked into the next optimizer step).
    Asked of autograd's engine: will it run one of the anchors' gradient edges."""
    if not anchor_nodes or _will_execute is None:
        return True
    try:
        return any(bool(_will_execute(node)) for node in anchor_nodes)
    except RuntimeError:  # autograd.grad() with respect to an anchor: it never accumulates
        return False


def _roots(out, captured, edges: bool) -> list:
    """What backward differentiates from, one per Function output (None where no gradient
    flows): the tensors themselves, or their gradient edges (which hold no memory)."""
    produced = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
    produced += [t for _, t in captured]
    if edges:
        return [get_gradient_edge(t) if t.requires_grad else None for t in produced]
    return [t if t.requires_grad else None for t in produced]


def _detached_leaves(ctx, flat_args: list, saved: list, saved_res) -> tuple[list, list, list]:
    """Graph leaves for (re)running a layer: its tensor inputs detached (requiring grad where the
    original did) in place in a copy of ``flat_args``, and its resident parameters likewise.

    Returns ``(flat_args, grad-requiring inputs, resident leaves)``.
    """
    flat_args = list(flat_args)
    inputs = []
    for pos, t, req in zip(ctx.tensor_pos, saved, ctx.input_requires_grad):
        d = t.detach()
        if req:
            d.requires_grad_(True)
            inputs.append(d)
        flat_args[pos] = d
    res_leaves = [t.detach().requires_grad_(t.requires_grad) for t in saved_res]
    return flat_args, inputs, res_leaves


#: Where a layer input is saved for backward (``InputSave.where``).
KEEP = "keep"  # on the device, through save_for_backward
OFFLOAD = "offload"  # in a host buffer, fetched back in backward
CHAIN = "chain"  # not saved: a segment follower's residual input, re-made by the chain


class InputSave(NamedTuple):
    """The save decision for one tensor input of a layer."""

    where: str
    dtype: torch.dtype | None = None  # saved rounded to this (boundary dtype); None: as is


def save_decision(
    stash: ActivationStash, t: torch.Tensor, residual_shapes: set[tuple[int, ...]], chained: bool
) -> InputSave:
    """How layer input ``t`` is saved: not at all when it is a segment follower's chained
    input, else kept on the device or offloaded, rounded to the boundary dtype first where
    the stash's rule says so (residual-stream inputs only)."""
    if chained:
        return InputSave(CHAIN)
    where = OFFLOAD if stash.should_offload(t, residual_shapes) else KEEP
    return InputSave(where, stash.save_dtype(t, residual_shapes))


def _run_forward(ctx, layer: StreamedLayer, weights, flat_args, inputs, resident):
    """Run the layer's forward; returns ``(out, captured)``, detached from any graph it built.

    Sets ``ctx.graph`` (``keep_graph``: the graph with its activations), or ``ctx.recompute``
    (early stop: the graph with placeholders for what it saves, which backward re-makes,
    stopping after the last; recompute.py), or neither (backward builds its own graph).
    """
    engine = layer.engine
    ctx.graph = None
    ctx.recompute = None
    if not (layer.keep_graph or (engine.boundary_dtype is None and engine.recompute_early_stop)):
        # Inputs saved rounded (boundary_dtype): the recompute does not see the forward's
        # exact input, so its ops may differ where they depend on values (MoE routing) and
        # could not fill this graph's saves. No graph here; backward builds its own (also
        # with recompute_early_stop off).
        out, captured, _ = layer.run(weights, flat_args, ctx.spec, leaves=False, keys=ctx.keys)
        return out, captured
    # Build the graph on detached leaves now; backward differentiates it. Without keep_graph
    # it is held by its gradient edges and leaves, never by a tensor's memory.
    leaves = _detached_leaves(ctx, flat_args, inputs, resident)
    saves = None if layer.keep_graph else PlaceholderSaves()
    # keep_attention: the attention kernel's outputs stay from here to the recompute, which
    # then skips that kernel (recompute.attention_output_cache).
    cache = (
        attention_output_cache()
        if saves is not None and layer.keep_attention
        else (contextlib.nullcontext(), None)
    )
    with (
        torch.enable_grad(),
        saves.recording() if saves is not None else contextlib.nullcontext(),
        cache[0],
    ):
        out, captured, weight_leaves = layer.run(
            weights, leaves[0], ctx.spec, leaves=layer.trainable, keys=ctx.keys,
            resident=leaves[2],
        )  # fmt: skip
    if saves is None:
        ctx.graph = (out, captured, weight_leaves, leaves[1], leaves[2])
    else:
        roots = _roots(out, captured, edges=True)
        ctx.recompute = (saves, roots, weight_leaves, leaves[1], leaves[2], cache[1])
        release_storage(weight_leaves + leaves[1])
    out = tree_map_only(torch.Tensor, torch.Tensor.detach, out)
    return out, [(k, t.detach()) for k, t in captured]


def _save_inputs(ctx, layer: StreamedLayer, inputs, resident, outs: list[torch.Tensor]) -> None:
    """Save what backward needs to recompute the layer, by one ``save_decision`` per input.

    Saved: the layer's tensor inputs (as decided) and its resident parameters, never its
    weights. A rounded input is a copy (the forward used the input as it is; backward casts it
    back to ``ctx.cast_back``); a follower's chained input is ``ctx.from_chain`` (backward gets
    it from ``segments.segment_input``). A kept graph holds what it needs itself.
    """
    engine = layer.engine
    segments = engine.segments
    ctx.offloaded = {}
    ctx.cast_back = {}
    ctx.segment = None
    ctx.seg_pos = 0
    ctx.from_chain = None
    if ctx.graph is not None:
        if segments.enabled:
            segments.close()  # a kept layer's output is not recomputed by a chain
        return
    stash = engine.activations
    residual_shapes = (
        {tuple(x.shape) for x in outs if x.is_floating_point()}
        if stash.boundary_dtype is not None or segments.enabled or stash.offload_enabled
        else set()
    )
    follow = (
        segments.follow(layer.index, list(inputs), residual_shapes) if segments.enabled else None
    )
    keep, sources = [], []
    for k, t in enumerate(inputs):
        chained = follow is not None and k == follow[1]
        how = save_decision(stash, t, residual_shapes, chained)
        if how.where == CHAIN:
            ctx.from_chain = k
            sources.append(("link", None))
            continue
        if how.dtype is not None:
            ctx.cast_back[k] = t.dtype
            t = t.to(how.dtype)
        if how.where == OFFLOAD:
            ctx.offloaded[k] = stash.offload(layer.index, k, t)
            sources.append(("handle", ctx.offloaded[k]))
        else:
            keep.append(t)
            sources.append(("tensor", t.detach()))
    ctx.n_keep = len(keep)
    ctx.save_for_backward(*keep, *resident)
    if segments.enabled:
        entry = SegmentEntry(layer, ctx, sources, [tensor_sig(o) for o in outs])
        ctx.segment, ctx.seg_pos = segments.add(entry, follow)


class _StreamedLayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer: StreamedLayer, flat_args, spec, tensor_pos, box, *tensors):
        engine = layer.engine
        ctx.layer = layer
        # Tensors are kept only through save_for_backward (version-checked); drop other refs.
        ctx.flat_args = [None if i in set(tensor_pos) else x for i, x in enumerate(flat_args)]
        ctx.spec = spec
        ctx.tensor_pos = tensor_pos
        ctx.rng = engine.rng_state()
        ctx.keys = box["keys"]
        n_args = len(tensor_pos)
        ctx.n_anchor = box["n_anchor"]  # the anchors StreamedLayer added (0: none)
        # The anchors' gradient edges: whether a backward asks for the weight gradients.
        anchors = tensors[n_args : n_args + ctx.n_anchor]
        ctx.anchor_nodes = [get_gradient_edge(t).node for t in anchors]
        ctx.n_args = n_args
        ctx.input_requires_grad = [t.requires_grad for t in tensors[:n_args]]
        inputs, resident = tensors[:n_args], tensors[n_args + ctx.n_anchor :]
        weights = engine.acquire(layer.index, layer.next_index(False))
        tick = engine.timeline.start("forward", layer.index) if engine.timeline else None
        out, captured = _run_forward(ctx, layer, weights, flat_args, inputs, resident)
        if tick is not None:
            engine.timeline.end(tick)
        engine.release(layer.index)
        out_flat, out_spec = tree_flatten(out)
        out_tensor_pos = [i for i, x in enumerate(out_flat) if isinstance(x, torch.Tensor)]
        box["n_out"] = len(out_tensor_pos)
        box["out_flat"] = out_flat
        box["out_spec"] = out_spec
        box["out_tensor_pos"] = out_tensor_pos
        box["captured_keys"] = [k for k, _ in captured]
        outs = [out_flat[i] for i in out_tensor_pos]
        _save_inputs(ctx, layer, inputs, resident, outs)
        return tuple(outs) + tuple(t for _, t in captured)

    @staticmethod
    def backward(ctx, *grad_outputs):
        layer: StreamedLayer = ctx.layer
        engine = layer.engine
        needs_grad = ctx.input_requires_grad
        # The layer whose weights to prefetch: the one whose backward runs next, or the leader
        # of the segment below when that backward starts with a chain.
        hint = engine.segments.backward_hint(layer.index)
        next_idx = layer.next_index(True) if hint is None else hint
        if ctx.graph is not None:
            out, captured, weight_leaves, inputs, res_leaves = ctx.graph
            ctx.graph = None  # the activations go as soon as this layer's backward is done
            engine.acquire(layer.index, next_idx)  # prefetches the next layer
            tick = engine.timeline.start("backward", layer.index) if engine.timeline else None
            roots = _roots(out, captured, edges=False)
        else:
            seg, chained = ctx.segment, None
            if ctx.from_chain is not None:
                # A follower: its input is re-made from the segment leader's (see above).
                chained = segment_input(seg, ctx.seg_pos)
                if ctx.seg_pos == 1:  # the leader's backward is next: bring its input back
                    engine.prefetch_activations(seg.entries[0].layer.index)
            saved_all = ctx.saved_tensors
            kept, saved_res = iter(saved_all[: ctx.n_keep]), saved_all[ctx.n_keep :]
            saved = [
                chained
                if k == ctx.from_chain
                else engine.fetch_activation(ctx.offloaded[k])
                if k in ctx.offloaded
                else next(kept)
                for k in range(ctx.n_args)
            ]
            del chained
            # The attention outputs this layer's segment chain kept for its recompute, if any.
            chain_cached = seg.take_attention(ctx.seg_pos) if seg is not None else None
            if seg is not None:
                ctx.segment = None
                if ctx.seg_pos == 0:
                    seg.clear()  # the leader's backward is its segment's last: drop the record
            # Inputs saved rounded: recompute from them in their original dtype, so the gradient
            # returned for the input has the input's dtype (the narrow copy is dropped here).
            saved = [
                t.to(ctx.cast_back[k]) if k in ctx.cast_back else t for k, t in enumerate(saved)
            ]
            flat_args, fresh_inputs, rerun_res = _detached_leaves(
                ctx, ctx.flat_args, saved, saved_res
            )
            del saved
            weights = engine.acquire(layer.index, next_idx)
            tick = engine.timeline.start("backward", layer.index) if engine.timeline else None

            def rerun():
                return layer.run(
                    weights, flat_args, ctx.spec, leaves=layer.trainable, keys=ctx.keys,
                    resident=rerun_res,
                )  # fmt: skip

            with torch.enable_grad(), engine.restored_rng(ctx.rng):
                if ctx.recompute is not None:
                    saves, roots, weight_leaves, inputs, res_leaves, cached = ctx.recompute
                    ctx.recompute = None
                    kept = cached if cached is not None else chain_cached
                    with kept.replay() if kept is not None else contextlib.nullcontext():
                        saves.refill(rerun)
                    del cached, kept
                else:  # a graph of its own, from the whole layer again
                    out, captured, weight_leaves = rerun()
                    roots = _roots(out, captured, edges=False)
                    inputs, res_leaves = fresh_inputs, rerun_res
                    del out, captured
            del flat_args, fresh_inputs, rerun_res, rerun, chain_cached
        res_trainable = [t for t in res_leaves if t.requires_grad]
        outs, grads = [], []
        for root, g in zip(roots, grad_outputs):
            if g is not None and root is not None:
                outs.append(root)
                grads.append(g)
        if not (layer.trainable and asks_weight_grads(ctx.anchor_nodes)):
            weight_leaves = []  # (neither computed nor accumulated)
        trained = [t for t in weight_leaves if t.requires_grad]
        wrt = trained + inputs + res_trainable
        if outs and wrt:
            computed = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
        else:
            computed = [None] * len(wrt)
        engine.release(layer.index)
        if weight_leaves:
            weight_grads = iter(computed[: len(trained)])
            engine.add_grads(
                layer.index,
                [next(weight_grads) if t.requires_grad else None for t in weight_leaves],
            )
        if tick is not None:
            engine.timeline.end(tick)
        rest = iter(computed[len(trained) :])
        result = [next(rest) if req else None for req in needs_grad]
        res_grads = [next(rest) if t.requires_grad else None for t in res_leaves]
        return (None, None, None, None, None, *result, *([None] * ctx.n_anchor), *res_grads)
