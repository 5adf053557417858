"""Per-layer compute intervals of a training step, from CUDA events on the compute stream.

A CUPTI kernel trace (``torch.profiler``) slows the host side of a streamed step enough to open
gaps that an unprofiled step does not have. Two CUDA events per layer pass cost microseconds, so
the step they time is the step being measured. An interval starts once the compute stream may
run the layer (after it waited for the layer's weights, see ``StreamingEngine.acquire``) and ends
after its last kernel (backward: after its gradient accumulation), so the time between one
layer's end and the next one's start, within a forward or a backward pass, is time the compute
stream sat without layer work: waiting for weights, for the host (Python, CPU updates) or
running something else (between passes: the loss, the optimizer). A checkpoint segment's chain
(its followers' inputs re-made in the backward) leaves ``recompute`` intervals of its own, so it
counts as compute, not as the gap before the follower's backward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class _HostMark:
    """A host clock reading with ``torch.cuda.Event``'s ``elapsed_time`` (CPU runs: no stream)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: _HostMark) -> float:
        return (other.t - self.t) * 1e3


def _mark():
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return _HostMark()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


#: The pass each phase's intervals belong to (a chain's recompute runs inside the backward).
_PASS = {"recompute": "backward"}


@dataclass
class LayerTimeline:
    """Collects ``(phase, layer, start, end)`` events; read with ``summary`` after a sync."""

    spans: list[tuple[str, int, object, object]] = field(default_factory=list)

    def start(self, phase: str, layer: int) -> tuple[str, int, object]:
        return phase, layer, _mark()

    def end(self, token: tuple[str, int, object]) -> None:
        self.spans.append((*token, _mark()))

    def summary(self) -> dict:
        """Milliseconds of layer compute and of the gaps between consecutive layers of a pass.

        Call after the device is synchronized. Phases are ``forward``, ``backward`` and
        ``recompute`` (a checkpoint segment's chain re-running its leading layers' forward
        inside the backward pass: compute, not a gap). ``gap_ms`` sums, over consecutive
        intervals of the same pass (the backward pass holds backward and recompute intervals),
        the idle time between them; the switch between passes (the loss, the next micro-batch)
        is not a gap between layers (``between_passes_ms`` sums those switches apart).
        ``gap_ms_by_phase`` splits ``gap_ms`` by pass and ``recompute_ms`` is the chains' part
        of ``layer_ms`` (``layer_ms_by_phase`` splits it by phase); ``largest_gaps`` lists the 8 largest with the interval each came before
        (where a gap sits says what it waited for: an HBM-tier layer waits for no weight copy).
        """
        if not self.spans:
            return {"layer_ms": 0.0, "gap_ms": 0.0, "largest_gap_ms": 0.0, "passes": 0}
        layer_ms = sum(s.elapsed_time(e) for _, _, s, e in self.spans)
        recompute_ms = sum(s.elapsed_time(e) for p, _, s, e in self.spans if p == "recompute")
        compute_by_phase: dict[str, float] = {}
        for p, _, s, e in self.spans:
            compute_by_phase[p] = compute_by_phase.get(p, 0.0) + s.elapsed_time(e)
        gaps: list[tuple[float, str]] = []
        by_phase: dict[str, float] = {}
        between = 0.0  # from one pass's last layer to the next pass's first (the loss, ...)
        for prev, cur in zip(self.spans, self.spans[1:]):
            if _PASS.get(prev[0], prev[0]) != _PASS.get(cur[0], cur[0]):
                between += max(0.0, prev[3].elapsed_time(cur[2]))
                continue
            gap = max(0.0, prev[3].elapsed_time(cur[2]))
            gaps.append((gap, f"{cur[0]} layer {cur[1]}"))
            pass_ = _PASS.get(cur[0], cur[0])
            by_phase[pass_] = by_phase.get(pass_, 0.0) + gap
        largest = sorted(gaps, key=lambda g: -g[0])[:8]
        first, last = self.spans[0][2], self.spans[-1][3]
        return {
            "layer_ms": layer_ms,
            "recompute_ms": recompute_ms,
            "layer_ms_by_phase": compute_by_phase,
            "gap_ms": sum(g for g, _ in gaps),
            "gap_ms_by_phase": by_phase,
            "between_passes_ms": between,
            "largest_gap_ms": largest[0][0] if largest else 0.0,
            "largest_gap_before": largest[0][1] if largest else None,
            "largest_gaps": [[round(g, 3), where] for g, where in largest],
            "span_ms": first.elapsed_time(last),
            "passes": len(self.spans),
        }
