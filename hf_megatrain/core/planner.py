"""Memory planner: decide, before anything is allocated, where each decoder layer's state lives.

The facade of four modules:

* ``plan_types``: the inputs and the plan's parts (:class:`ModelShape`, its lines and layer
  placements, :class:`MemoryPlanError`) and how messages name options (:class:`OptionNamer`).
* ``plan_arithmetic`` (with ``activation_memory``): every GPU and host cost of a tier split as a
  named line, the PCIe bytes of a step; the tiers themselves are described there.
* ``plan_search``: :func:`plan_memory` (how many layers go to HBM, keep activations or attention
  outputs; the advice search for a plan that does not fit), and what fits on a machine
  (:func:`max_micro_batch_sequences`, :func:`max_seq_len`, :func:`max_num_layers`).
* ``plan_report``: :class:`MemoryPlan` itself, its table, the problems' and notes' wording.

The planner is pure arithmetic on a :class:`ModelShape` (no ``transformers`` import, no
allocation) so the CLI can plan a 70B model on a laptop and the builder can plan before it
allocates. It reads the step (:class:`~hf_megatrain.core.options.StepShape`) and the run's
engine options (:class:`~hf_megatrain.core.options.ResolvedOptions`).
"""

from __future__ import annotations

from .activation_memory import (
    ATTN_SIDE_BYTES_PER_TOKEN_HIDDEN,
    boundary_activation_bytes,
    kept_activation_bytes_per_token,
    saved_boundary_layers,
    segment_cache_layers,
)
from .options import ALL_LAYERS, parse_attention_layers
from .plan_arithmetic import (
    DEFAULT_HOST_MARGIN,
    GIB,
    GPU_SLACK_MIN,
    H200_HBM_BYTES,
    NCCL_BUFFER_BYTES,
    NCCL_LINE,
    PCIE_BYTES_PER_S,
    PROCESS_BASELINE,
    SAFETY_MARGIN_LINE,
    h2d_bytes_per_param,
    host_bytes_per_param,
)
from .plan_report import (
    BF16_BOUNDARIES_ADVICE,
    NOTHING_FITS_ADVICE,
    MemoryPlan,
    margin_only_advice,
    segment_advice,
)
from .plan_search import (
    PLANNED_OPTIONS,
    SEGMENT_ADVICE_LENGTHS,
    add_margin_only_advice,
    auto_fit_changes,
    fits_allowing_auto_fit,
    fitting_options,
    longest_auto_fit_row,
    margin_only_options,
    max_micro_batch_sequences,
    max_num_layers,
    max_seq_len,
    plan_memory,
    plan_with_auto_fit,
    recompute_flops,
)
from .plan_types import (
    FIELD_NAMER,
    HBM,
    HOST,
    LayerPlacement,
    MemoryLine,
    MemoryPlanError,
    Message,
    ModelShape,
    OptionChanges,
    OptionNamer,
)

__all__ = [
    "ALL_LAYERS",
    "ATTN_SIDE_BYTES_PER_TOKEN_HIDDEN",
    "BF16_BOUNDARIES_ADVICE",
    "DEFAULT_HOST_MARGIN",
    "FIELD_NAMER",
    "GIB",
    "GPU_SLACK_MIN",
    "H200_HBM_BYTES",
    "HBM",
    "HOST",
    "LayerPlacement",
    "MemoryLine",
    "MemoryPlan",
    "MemoryPlanError",
    "Message",
    "ModelShape",
    "NCCL_BUFFER_BYTES",
    "NCCL_LINE",
    "NOTHING_FITS_ADVICE",
    "OptionChanges",
    "OptionNamer",
    "PCIE_BYTES_PER_S",
    "PLANNED_OPTIONS",
    "PROCESS_BASELINE",
    "SAFETY_MARGIN_LINE",
    "SEGMENT_ADVICE_LENGTHS",
    "auto_fit_changes",
    "boundary_activation_bytes",
    "add_margin_only_advice",
    "fits_allowing_auto_fit",
    "fitting_options",
    "margin_only_advice",
    "margin_only_options",
    "h2d_bytes_per_param",
    "host_bytes_per_param",
    "kept_activation_bytes_per_token",
    "longest_auto_fit_row",
    "max_micro_batch_sequences",
    "max_num_layers",
    "max_seq_len",
    "parse_attention_layers",
    "plan_memory",
    "plan_with_auto_fit",
    "recompute_flops",
    "saved_boundary_layers",
    "segment_advice",
    "segment_cache_layers",
]
