"""Checkpoint segments: which layers follow a leader, and what re-running a segment needs.

With ``checkpoint_every = k > 1`` only the first layer of each run of k (the leader) saves its
residual-stream input; the backward of the segment's last layer re-runs the segment's forward
from the leader's input (``segment_input``), and the inputs it produces feed the followers'
backward one by one (k - 1 extra layer forwards per segment, bitwise the saved inputs).
``SegmentTracker`` decides which layers follow as the forward runs; the rest of this module
holds what a re-run needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten

from .recompute import KeptAttention, attention_output_cache


def tensor_sig(t: torch.Tensor) -> tuple:
    """What identifies a tensor handed from one layer to the next, unmodified."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version)


class SegmentEntry:
    """What re-running one layer of a checkpoint segment (under no_grad) needs: its non-tensor
    arguments, autograd-Function spec, RNG state, and for each tensor input where it comes from:
    ``("link", None)`` the previous layer's output ``link_out`` (a follower's residual input),
    ``("handle", h)`` an offload handle (the host copy), ``("tensor", t)`` a detached alias of
    what the layer's ctx saved. No ctx and no graph-connected tensor: no reference cycles."""

    __slots__ = (
        "layer", "flat_args", "spec", "tensor_pos", "rng", "keys", "sources", "cast_back",
        "out_sigs", "link_out", "input_requires_grad", "kept_attention", "keeps_attention",
    )  # fmt: skip

    def __init__(self, layer, ctx, sources: list, out_sigs: list) -> None:
        self.layer = layer
        self.flat_args = ctx.flat_args
        self.spec = ctx.spec
        self.tensor_pos = ctx.tensor_pos
        self.rng = ctx.rng
        self.keys = ctx.keys
        self.sources = sources
        self.cast_back = dict(ctx.cast_back)
        self.out_sigs = out_sigs
        self.link_out: int | None = None
        self.input_requires_grad = list(ctx.input_requires_grad)
        # The attention outputs this layer's forward kept for its recompute: the chain reads
        # them too (``KeptAttention.peek``) instead of running the kernel. Where the forward
        # kept none, whether the chain may keep them: it recomputes with the early stop.
        recompute = getattr(ctx, "recompute", None)
        self.kept_attention: KeptAttention | None = None if recompute is None else recompute[5]
        self.keeps_attention = recompute is not None and recompute[5] is None


class Segment:
    """A checkpoint segment's layers (leader first) and, during its backward, the cached
    inputs of followers that the chain recomputed (position -> tensor)."""

    __slots__ = ("entries", "cache", "attention", "done")

    def __init__(self) -> None:
        self.entries: list[SegmentEntry] = []
        self.cache: dict[int, torch.Tensor] = {}
        # Position -> the attention outputs the chain kept (``recompute.KeptAttention``), for
        # that layer's own recompute.
        self.attention: dict[int, KeptAttention] = {}
        self.done = False

    def take_attention(self, pos: int) -> KeptAttention | None:
        """The kept attention outputs of the layer at ``pos`` for its recompute (once), or None."""
        return self.attention.pop(pos, None)

    def clear(self) -> None:
        self.entries.clear()
        self.cache.clear()
        self.attention.clear()
        self.done = True


class SegmentTracker:
    """The segment the forward is filling, and backward's weight-prefetch hints.

    ``is_large(t)`` says whether a tensor counts as a large activation (the residual stream at
    training sizes), as for offload.
    """

    def __init__(
        self,
        n_layers: int,
        every: int,
        is_large: Callable[[torch.Tensor], bool],
        chain_attention: int = 0,
        chain_attention_by_segment: Mapping[int, int] | None = None,
    ) -> None:
        self._n_layers = n_layers
        self._every = every
        self._is_large = is_large
        #: How many of a chain's last layers keep their attention outputs for their recompute.
        self.chain_attention = max(0, chain_attention)
        # Per segment (its first layer), where the plan fills segments below its peak.
        self._chain_by_segment = dict(chain_attention_by_segment or {})
        self._open: Segment | None = None
        # Layer i's backward prefetches this layer's weights when it is not i - 1: the leader
        # of the segment below, whose chain runs next.
        self._backward_next: dict[int, int] = {}

    def chain_count(self, first: int) -> int:
        """How many of the chain's last layers keep their attention outputs in the segment that
        starts at layer ``first``."""
        return max(0, self._chain_by_segment.get(first, self.chain_attention))

    @property
    def every(self) -> int:
        """The segment length k (1: every layer saves its input, no segments)."""
        return self._every

    @property
    def enabled(self) -> bool:
        return self._every > 1

    @property
    def open_segment(self) -> Segment | None:
        """The segment the next layer may join (None: it starts a new one)."""
        return self._open

    def follow(
        self, idx: int, inputs: list[torch.Tensor], residual_shapes: set[tuple[int, ...]]
    ) -> tuple[Segment, int, int] | None:
        """Whether layer ``idx`` may skip saving its residual-stream input (a follower).

        It may when it is not at a segment start (``idx % every``), the open segment ends with
        layer ``idx - 1``, and one of its inputs is a large activation of the shape of one of its
        outputs that is, unmodified, an output of layer ``idx - 1`` (so that re-running ``idx -
        1`` reproduces it). Returns ``(segment, input index, output index of the previous
        layer)``, or None: the layer saves its inputs and starts a segment.
        """
        k = self._every
        seg = self._open
        if k <= 1 or idx % k == 0 or seg is None or seg.done or not seg.entries:
            return None
        last = seg.entries[-1]
        if last.layer.index != idx - 1:
            return None
        for pos, t in enumerate(inputs):
            if tuple(t.shape) not in residual_shapes or not self._is_large(t):
                continue
            sig = tensor_sig(t)
            for o, out_sig in enumerate(last.out_sigs):
                if out_sig == sig:
                    return seg, pos, o
        return None

    def add(self, entry: SegmentEntry, follow) -> tuple[Segment, int]:
        """Register a layer's forward in its segment; returns ``(segment, position in it)``."""
        idx = entry.layer.index
        self._backward_next.pop(idx + 1, None)
        if follow is None:
            seg = self._open = Segment()
        else:
            seg, _, entry.link_out = follow
            # Layer idx - 1 is no longer its segment's last layer; layer idx + 1's backward
            # (if it is a leader) runs before this segment's chain, which starts at the leader.
            self._backward_next.pop(idx, None)
            self._backward_next[idx + 1] = seg.entries[0].layer.index
        seg.entries.append(entry)
        if (idx + 1) % self._every == 0 or idx + 1 >= self._n_layers:
            self._open = None  # complete: nothing else attaches to it
        return seg, len(seg.entries) - 1

    def backward_hint(self, idx: int) -> int | None:
        """The layer whose weights layer ``idx``'s backward should prefetch when not ``idx - 1``."""
        return self._backward_next.get(idx)

    def close(self) -> None:
        """The next layer starts a new segment (e.g. after a layer that keeps its graph)."""
        self._open = None

    def reset(self) -> None:
        """Forget the open segment and the backward prefetch hints."""
        self._open = None
        self._backward_next.clear()


def segment_input(seg: Segment | None, pos: int) -> torch.Tensor:
    """The residual-stream input of the follower at ``pos`` of ``seg``, for its backward.

    From the cache when an earlier chain made it; otherwise re-runs the segment's layers from
    the leader to ``pos - 1`` under no_grad, from the leader's saved input (cast back from the
    boundary dtype, as its own recompute does), each layer with its own weights (streamed
    through the engine), small inputs, arguments and RNG state: the forward's computation
    again, so the result is the forward's tensor bit for bit. The inputs of the followers in
    between are cached for their backward (each takes its own and drops it).
    """
    x = None if seg is None else seg.cache.pop(pos, None)
    if x is not None:
        return x
    if seg is None or seg.done or pos >= len(seg.entries):
        raise RuntimeError(
            "hf_megatrain: a checkpoint segment's saved state is gone (its leader's backward "
            "already ran): backward twice through the same graph (retain_graph) is not "
            "supported with the option checkpoint_every > 1"
        )
    entries = seg.entries
    engine = entries[0].layer.engine
    keep_from = pos - engine.segments.chain_count(entries[0].layer.index)
    prev = None
    with torch.no_grad():
        for q in range(pos):
            e = entries[q]
            args, t = list(e.flat_args), None
            for k, (kind, val) in enumerate(e.sources):
                if kind == "link":
                    t = prev
                elif kind == "handle":
                    t = engine.fetch_activation(val, prefetch=False)
                else:
                    t = val
                if k in e.cast_back:
                    t = t.to(e.cast_back[k])
                args[e.tensor_pos[k]] = t
            prev = None
            weights = engine.acquire(e.layer.index, entries[q + 1].layer.index)
            tick = engine.timeline.start("recompute", e.layer.index) if engine.timeline else None
            with engine.restored_rng(e.rng):
                if e.kept_attention is not None:
                    out = _run_under_grad(e, weights, args, e.kept_attention.peek())
                elif q >= keep_from and e.keeps_attention:
                    forward_ctx, seg.attention[q] = attention_output_cache()
                    out = _run_under_grad(e, weights, args, forward_ctx)
                else:
                    out, _, _ = e.layer.run(weights, args, e.spec, leaves=False, keys=e.keys)
            if tick is not None:
                engine.timeline.end(tick)
            engine.release(e.layer.index)
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            prev = outs[entries[q + 1].link_out].detach()
            del out, outs
            args = t = None  # (the leader's fetched or cast-back input goes here)
            if q + 1 < pos:
                seg.cache[q + 1] = prev
    return prev


def _discard(_: torch.Tensor) -> None:
    return None


def _unreadable(_: None) -> torch.Tensor:
    raise RuntimeError("hf_megatrain: a segment chain's graph is not differentiable")


def _run_under_grad(e: SegmentEntry, weights: torch.Tensor, args: list, mode):
    """Re-run one chain layer as its recompute will (under grad, on leaves requiring grad as the
    forward's did, so that the fused attention kernel makes the same call, log-sum-exp
    included) inside ``mode``: capturing that kernel's outputs for the recompute, or handing
    back those the forward kept. The graph saves nothing. Returns the output."""
    args = list(args)
    for pos, req in zip(e.tensor_pos, e.input_requires_grad):
        if isinstance(args[pos], torch.Tensor):
            args[pos] = args[pos].detach().requires_grad_(req)
    with torch.enable_grad(), saved_tensors_hooks(_discard, _unreadable), mode:
        out, _, _ = e.layer.run(weights, args, e.spec, leaves=e.layer.trainable, keys=e.keys)
    return out
