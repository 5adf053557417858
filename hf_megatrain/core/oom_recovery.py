"""Room after a step ran out of GPU memory: what to give up, chosen from what the step holds.

The memory plan runs a few percent high on average but is an estimate; when a step still runs
out of GPU memory (another process took memory, an allocator pattern the plan does not model),
the trainer frees the failed step and asks :func:`choose_relief` what to give up, in the
reverse of the order in which the plan filled HBM (``plan_search``: at long micro-batches the
attention outputs first, then the HBM tier, then kept activations; below that the tier first):
the last filled is the first given back. HBM-tier layers leave through
``builder.move_to_host_tier``. Every choice is exact: the step's results do not change, only
its speed.

Once nothing is left in HBM to give up (every layer streamed, none keeping activations or
attention outputs), :func:`choose_memory_options` picks the next exact memory options to switch
on in the live run, from the plan's lines where the run has a plan: MLP sequence tiles,
activation offload, longer checkpoint segments (``LIVE_MEMORY_OPTIONS``: how a step holds its
activations; the host store's layout is fixed once built, and bf16 boundaries or clipping off
would change the results).

Evaluation and the optimizer step hold no activations (an evaluation forward runs under
``no_grad``; the optimizer step runs after backward has freed them): there only the HBM tier's
layers free room, so ``weights_only`` gives up tier layers alone, in the same order (its last
layers first). Giving up attention outputs or the activations of layers staying in the tier
would slow training and free nothing there.

No ``transformers`` import here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .memory_options import MemoryOptions, candidates

#: Room made beyond the allocation that failed: the rest of the step allocates more after it.
RELIEF_HEADROOM_BYTES = 2**30

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_TRIED = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")


def oom_request_bytes(message: str) -> int | None:
    """The size of the allocation a CUDA out-of-memory error reports, or None."""
    found = _TRIED.search(message)
    return None if found is None else int(float(found.group(1)) * _UNITS[found.group(2)])


@dataclass(frozen=True)
class StepHoldings:
    """What a step keeps in HBM that it could do without (sizes in bytes; None: unknown).

    ``tier``: the HBM-tier layers as ``(index, device bytes)``, in layer order. ``kept``: how
    many of them keep their activations, and the bytes each such layer holds for a micro-batch.
    ``attention``: recomputed layers keeping their attention outputs, and the bytes of each.
    ``attention_first``: the plan filled attention outputs before the tier (long micro-batches).
    """

    tier: list[tuple[int, int]]
    kept: int = 0
    kept_bytes: int | None = None
    attention: int = 0
    attention_bytes: int | None = None
    attention_first: bool = False


@dataclass(frozen=True)
class Relief:
    """What to give up: the counts that remain, and the HBM-tier layers to move to the host."""

    kept: int
    attention: int
    to_host: list[int] = field(default_factory=list)
    #: Bytes this frees (a lower bound: sizes unknown count as 0).
    freed_bytes: int = 0

    def describe(self, before: StepHoldings) -> str:
        parts = []
        if self.to_host:
            first, last = self.to_host[0], self.to_host[-1]
            which = f"layer {first}" if first == last else f"layers {first}-{last}"
            parts.append(f"{which} moved from the HBM tier to the host tier")
        if self.kept != before.kept:
            parts.append(f"layers keeping their activations {before.kept} -> {self.kept}")
        if self.attention != before.attention:
            parts.append(f"layers keeping attention outputs {before.attention} -> {self.attention}")
        return "; ".join(parts)


def choose_relief(
    holdings: StepHoldings, need_bytes: int | None, weights_only: bool = False
) -> Relief | None:
    """The least to give up for ``need_bytes`` more room, or None when nothing is left.

    Items go in the reverse of the plan's fill order, one at a time, until their sizes cover
    ``need_bytes``. With ``need_bytes`` None (unknown), or after an item of unknown size, the
    attempt stops at that item: if the step runs out of memory again, the next attempt gives up
    the next one.

    ``weights_only``: for work that holds no activations (evaluation, the optimizer step), only
    HBM-tier layers, the last first; the layers keeping activations are the tier's last, so such
    a layer gives them up with its place in the tier (it streams and recomputes from then on)."""
    kept, attention = holdings.kept, holdings.attention
    tier = list(holdings.tier)
    to_host: list[int] = []

    def items():
        """Each give-up in order, as the bytes it frees (None: unknown)."""
        nonlocal kept, attention
        if weights_only:
            while tier:
                kept = max(kept - 1, 0)
                idx, nbytes = tier.pop()
                to_host.insert(0, idx)
                yield nbytes
            return
        order = ("kept", "tier", "attention") if holdings.attention_first else (
            "attention", "kept", "tier"
        )  # fmt: skip
        for kind in order:
            if kind == "kept":
                while kept:
                    kept -= 1
                    yield holdings.kept_bytes
            elif kind == "attention":
                while attention:
                    attention -= 1
                    yield holdings.attention_bytes
            else:
                # keep_activations keeps the last tier layers: those leave the tier last.
                while len(tier) > kept:
                    idx, nbytes = tier.pop()
                    to_host.insert(0, idx)
                    yield nbytes

    freed = 0
    given = False
    for nbytes in items():
        given = True
        freed += nbytes or 0
        if need_bytes is None or nbytes is None or freed >= need_bytes:
            break
    if not given:
        return None
    return Relief(kept=kept, attention=attention, to_host=to_host, freed_bytes=freed)


#: The memory options the watchdog switches on in a live run, between steps: they change how a
#: step holds its activations, exactly.
LIVE_MEMORY_OPTIONS = frozenset({"mlp_tile_tokens", "offload_activations", "checkpoint_every"})


def choose_memory_options(
    base: MemoryOptions,
    micro_batch_tokens: int,
    need_bytes: int | None,
    peak_bytes: Callable[[MemoryOptions], int | None] | None = None,
) -> MemoryOptions | None:
    """The memory options to run with once a step ran out of GPU memory with nothing left in
    HBM to give up: ``base`` (the run's) with more of ``LIVE_MEMORY_OPTIONS`` on, or None when
    none is left that would help.

    ``peak_bytes(o)``: the plan's expected GPU peak with options ``o`` (None where ``o`` does
    not fit the host: offloaded activations live there). With it, the lightest set planned to
    free ``need_bytes`` (unknown: any), else the set planned to free the most; a set the plan
    says frees nothing is never chosen. Without a plan, the lightest set: one more rung at each
    out-of-memory, as :func:`choose_relief` gives up one item at a time."""
    live = []
    for o in candidates(base, micro_batch_tokens):
        changes = o.changes(base)
        if set(changes.options) <= LIVE_MEMORY_OPTIONS and not changes.clipping_off:
            live.append(o)
    if peak_bytes is None:
        return live[0] if live else None
    now = peak_bytes(base)
    if now is None:
        return live[0] if live else None
    freed = [(o, now - peak) for o in live if (peak := peak_bytes(o)) is not None]
    freed = [(o, f) for o, f in freed if f > 0]
    if not freed:
        return None
    enough = next((o for o, f in freed if f >= (need_bytes or 1)), None)
    # (max keeps the first, lightest, of equals)
    return enough if enough is not None else max(freed, key=lambda of: of[1])[0]


__all__ = [
    "LIVE_MEMORY_OPTIONS",
    "RELIEF_HEADROOM_BYTES",
    "Relief",
    "StepHoldings",
    "choose_memory_options",
    "choose_relief",
    "oom_request_bytes",
]
