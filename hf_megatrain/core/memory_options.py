"""The engine's memory options as one value, and the enumeration of the sets a run could add.

When a plan does not fit, the planner (``plan_search``) asks which options the run does not use
yet would make it fit, and advises the lightest such set (``lightest_fit``). Lightness is a cost
per option, in this order: MLP sequence tiles and an HBM tier without bf16 weight copies (exact;
a few more kernel launches; a cast of each tier layer's fp32 master on the copy stream, beside
the previous layer's compute, when it runs), boundary
activation offload and fp32-master streaming (exact; PCIe copies overlapped with compute, twice
the H2D bytes of a streamed layer for the latter), checkpoint segments of k layers (exact;
(k-1)/k of a layer forward more per layer, so longer segments cost more), bf16 boundary
activations (approximate gradients), no gradient clipping (changes the training itself). This
module only enumerates; the planner says what fits.

A :class:`MemoryOptions` names :class:`~hf_megatrain.core.options.EngineOptions` fields, plus
``no_clip``: gradient clipping off, a training setting rather than an engine option. What a set
adds over another is an :class:`~hf_megatrain.core.plan_types.OptionChanges`, which advice
carries and each layer spells in its own names.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from .options import ResolvedOptions, default_of
from .plan_types import OptionChanges, OptionNamer

#: Tile length the advice proposes for MLP sequence tiling (tokens).
ADVICE_TILE_TOKENS = 16384
#: Checkpoint segment lengths the search tries.
SEGMENT_LENGTHS = (2, 3, 4, 6, 8)
#: ``boundary_dtype`` values of a set: saved layer inputs kept as they are, or rounded to bf16.
EXACT_BOUNDARIES, BF16_BOUNDARIES = "input", "bfloat16"

_COST = {
    "mlp_tile_tokens": 2,
    "hbm_cast_weights": 3,
    "offload_activations": 4,
    "stream_fp32_master": 4,
    "boundary_dtype": 20,
    "no_clip": 40,
}


def _segment_cost(k: int) -> int:
    # Recompute grows with k; at the long sequences segments are for, a layer forward is far
    # dearer than the PCIe bytes of offload or fp32-master streaming.
    return 6 * k if k > 1 else 0


@dataclass(frozen=True)
class MemoryOptions:
    """Which memory options a run uses: engine option fields (in the order advice lists
    them), and ``no_clip`` for gradient clipping off."""

    # The engine options' own defaults (a set over nothing is the default run).
    mlp_tile_tokens: int = default_of("mlp_tile_tokens")
    offload_activations: bool = default_of("offload_activations")
    stream_fp32_master: bool = default_of("stream_fp32_master")
    checkpoint_every: int = default_of("checkpoint_every")
    boundary_dtype: str = default_of("boundary_dtype")
    no_clip: bool = False
    # Last, so that sets spelled by position keep their meaning.
    hbm_cast_weights: bool = default_of("hbm_cast_weights")

    @classmethod
    def of(cls, options: ResolvedOptions) -> MemoryOptions:
        """The memory options a run with ``options`` uses."""
        return cls(
            mlp_tile_tokens=options.mlp_tile_tokens,
            offload_activations=options.offload_activations,
            stream_fp32_master=options.stream_fp32_master,
            checkpoint_every=options.checkpoint_every,
            boundary_dtype=(
                BF16_BOUNDARIES if options.boundary_bytes_per_element <= 2 else EXACT_BOUNDARIES
            ),
            no_clip=not options.clipping,
            hbm_cast_weights=options.hbm_cast_weights,
        )

    def cost(self, base: MemoryOptions) -> int:
        """How heavy the options turned on over ``base`` are (see the module docstring)."""
        total = sum(c for name, c in _COST.items() if getattr(self, name) != getattr(base, name))
        if self.checkpoint_every != base.checkpoint_every:
            total += _segment_cost(self.checkpoint_every)
        return total

    def changes(self, base: MemoryOptions) -> OptionChanges:
        """The options turned on over ``base``: engine option fields -> values, and clipping."""
        changed = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "no_clip" and getattr(self, f.name) != getattr(base, f.name)
        }
        return OptionChanges(changed, clipping_off=self.no_clip and not base.no_clip)

    def describe(self, base: MemoryOptions, namer: OptionNamer | None = None) -> str:
        """The options turned on over ``base``, in ``namer``'s spelling (default: field
        names)."""
        return self.changes(base).render(namer)

    def applied(self, options: ResolvedOptions) -> ResolvedOptions:
        """``options`` (a run's resolved options) with this set in effect."""
        changes = self.changes(MemoryOptions.of(options))
        engine = options.options.with_(**changes.options) if changes.options else options.options
        return options.resolved_again(
            engine, clipping=options.clipping and not changes.clipping_off
        )


def candidates(base: MemoryOptions, micro_batch_tokens: int) -> list[MemoryOptions]:
    """Every set of options not in ``base`` yet (``base`` kept), lightest first."""
    choices: list[list[dict]] = []
    if not base.mlp_tile_tokens and micro_batch_tokens > ADVICE_TILE_TOKENS:
        choices.append([{}, {"mlp_tile_tokens": ADVICE_TILE_TOKENS}])
    for name in ("hbm_cast_weights", "offload_activations", "stream_fp32_master"):
        if not getattr(base, name):
            choices.append([{}, {name: True}])
    if base.boundary_dtype != BF16_BOUNDARIES:
        choices.append([{}, {"boundary_dtype": BF16_BOUNDARIES}])
    if not base.no_clip:
        choices.append([{}, {"no_clip": True}])
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


__all__ = [
    "ADVICE_TILE_TOKENS",
    "BF16_BOUNDARIES",
    "EXACT_BOUNDARIES",
    "SEGMENT_LENGTHS",
    "MemoryOptions",
    "candidates",
    "lightest_fit",
]
