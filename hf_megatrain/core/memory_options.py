"""The engine's memory options as one value, and the search for the lightest set that fits.

When a plan does not fit, the planner asks which options the run does not use yet would make it
fit, and advises the lightest such set (``lightest_fit``). Lightness is a cost per option, in
this order: MLP sequence tiles (exact; a few more kernel launches), boundary activation offload
and fp32-master streaming (exact; PCIe copies overlapped with compute, twice the H2D bytes of a
streamed layer for the latter), checkpoint segments of k layers (exact; (k-1)/k of a layer
forward more per layer, so longer segments cost more), bf16 boundary activations (approximate
gradients), no gradient clipping (changes the training itself). This module only enumerates; the planner says
what fits.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

#: Tile length the advice proposes for MLP sequence tiling (tokens).
ADVICE_TILE_TOKENS = 16384
#: Checkpoint segment lengths the search tries.
SEGMENT_LENGTHS = (2, 3, 4, 6, 8)

_COST = {
    "mlp_tile_tokens": 1,
    "offload_activations": 2,
    "stream_fp32_master": 2,
    "bf16_boundaries": 10,
    "no_clip": 20,
}


def _segment_cost(k: int) -> int:
    # Recompute grows with k; at the long sequences segments are for, a layer forward is far
    # dearer than the PCIe bytes of offload or fp32-master streaming.
    return 3 * k if k > 1 else 0


@dataclass(frozen=True)
class MemoryOptions:
    """Which memory options a run uses (the trainer arguments / ``plan`` flags in ``describe``)."""

    mlp_tile_tokens: int = 0
    offload_activations: bool = False
    stream_fp32_master: bool = False
    checkpoint_every: int = 1
    bf16_boundaries: bool = False
    no_clip: bool = False

    def cost(self, base: MemoryOptions) -> int:
        """How heavy the options turned on over ``base`` are (see the module docstring)."""
        total = sum(c for name, c in _COST.items() if getattr(self, name) != getattr(base, name))
        if self.checkpoint_every != base.checkpoint_every:
            total += _segment_cost(self.checkpoint_every)
        return total

    def describe(self, base: MemoryOptions) -> str:
        """The options turned on over ``base``, as trainer arguments and ``plan`` flags."""
        changed = [
            (arg.format(v=getattr(self, name)), flag.format(v=getattr(self, name)))
            for name, arg, flag in _DESCRIPTIONS
            if getattr(self, name) != getattr(base, name)
        ]
        args = ", ".join(a for a, _ in changed)
        return f"{args} (plan {' '.join(f for _, f in changed)})"


# (field, trainer argument, ``plan`` flag), in the order the advice lists them.
_DESCRIPTIONS = (
    ("mlp_tile_tokens", "megatrain_mlp_tile_tokens={v}", "--mlp-tile-tokens {v}"),
    ("offload_activations", "megatrain_offload_activations=True", "--offload-activations"),
    ("stream_fp32_master", "megatrain_stream_fp32_master=True", "--stream-fp32-master"),
    ("checkpoint_every", "megatrain_checkpoint_every={v}", "--checkpoint-every {v}"),
    (
        "bf16_boundaries",
        "megatrain_boundary_dtype='bfloat16' (approximate gradients)",
        "--bf16-boundaries",
    ),
    ("no_clip", "max_grad_norm=0 (no gradient clipping)", "--no-clip"),
)


def candidates(base: MemoryOptions, micro_batch_tokens: int) -> list[MemoryOptions]:
    """Every set of options not in ``base`` yet (``base`` kept), lightest first."""
    choices: list[list[dict]] = []
    if not base.mlp_tile_tokens and micro_batch_tokens > ADVICE_TILE_TOKENS:
        choices.append([{}, {"mlp_tile_tokens": ADVICE_TILE_TOKENS}])
    for name in ("offload_activations", "stream_fp32_master", "bf16_boundaries", "no_clip"):
        if not getattr(base, name):
            choices.append([{}, {name: True}])
    longer = [k for k in SEGMENT_LENGTHS if k > base.checkpoint_every]
    choices.append([{}] + [{"checkpoint_every": k} for k in longer])
    out = []
    for combo in itertools.product(*choices):
        changes = {k: v for part in combo for k, v in part.items()}
        if changes:
            out.append(replace(base, **changes))
    # Stable: equal costs keep the enumeration order (fewer, earlier options first).
    return sorted(out, key=lambda o: o.cost(base))


def lightest_fit(
    fits: Callable[[MemoryOptions], bool], base: MemoryOptions, micro_batch_tokens: int
) -> MemoryOptions | None:
    """The lightest option set over ``base`` for which ``fits`` holds, or None."""
    return next((o for o in candidates(base, micro_batch_tokens) if fits(o)), None)
