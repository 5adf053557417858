"""Memory planner: decide, before anything is allocated, where each decoder layer's state lives.

Two tiers per layer:

* ``hbm``: the layer's whole state on the GPU (fp32 master, grad, two AdamW moments = 16 B/param,
  plus the compute-dtype copy, 2 B/param in bf16 runs); it never crosses PCIe and updates with
  the GPU AdamW. The engine requires these to be the *leading* layers.
* ``host``: the layer's state in the host store (``layer_store_bytes``); on the GPU it only
  occupies the shared double buffer while it streams through.

Two run settings change the host tier's bytes per parameter (bf16 runs; fp32 runs have no
separate stream copy either way):

* gradients: with clipping on (or eager updates off) every host layer keeps an fp32 gradient
  slot until the step's global norm is known (18 B/param); with eager updates (no clipping)
  no slot exists and final gradients pass through a pinned staging ring of
  ``GRAD_STAGING_SLOTS`` layers (14 B/param). HBM-tier layers keep their gradient either way
  (the GPU AdamW reads it in place: 18 B/param).
* ``stream_fp32_master``: no bf16 copy in the store (2 B/param less); the fp32 master crosses
  PCIe (4 instead of 2 B/param H2D) into one fp32 device staging buffer and is cast there.

The planner is pure arithmetic on a :class:`ModelShape` (no ``transformers`` import, no
allocation) so the CLI can plan a 70B model on a laptop and the trainer can plan before it
allocates. Every GPU and host cost is a named line of the plan, so the printed table says where
the bytes go. Lines marked "estimate" model framework temporaries, not buffers this library owns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from .activation_memory import (
    ATTN_SIDE_BYTES_PER_TOKEN_HIDDEN,
    activation_lines,
    attention_output_line,
    boundary_activation_bytes,
    boundary_dtype_label,
    kept_activation_bytes_per_token,
    saved_boundary_layers,
    saved_layers_label,
    segment_cache_layers,
)
from .host_store import device_layer_bytes, format_bytes, layer_store_bytes
from .memory_options import MemoryOptions, lightest_fit
from .plan_types import (
    ALL_LAYERS,
    MemoryLine,
    ModelShape,
    Workload,
    last_recomputed,
    parse_attention_layers,
)
from .plan_types import itemsize as _itemsize
from .streaming import GRAD_STAGING_SLOTS

__all__ = [
    "ALL_LAYERS",
    "ATTN_SIDE_BYTES_PER_TOKEN_HIDDEN",
    "GIB",
    "LayerPlacement",
    "MemoryLine",
    "MemoryPlan",
    "MemoryPlanError",
    "ModelShape",
    "Workload",
    "boundary_activation_bytes",
    "kept_activation_bytes_per_token",
    "max_micro_batch_sequences",
    "max_num_layers",
    "max_seq_len",
    "parse_attention_layers",
    "plan_memory",
    "saved_boundary_layers",
    "segment_cache_layers",
]

GIB = 2**30
#: Measured pinned PCIe Gen5 x16 copy rate on the target H200 machine (one direction).
PCIE_BYTES_PER_S = 55e9
#: HBM of the target H200, used when no GPU is present to measure.
H200_HBM_BYTES = 139 * GIB
#: Host RAM kept free for the Python process, CUDA context, dataloader and page cache churn.
DEFAULT_HOST_MARGIN = 4 * GIB
#: Resident memory of a training process before any model memory: Python, torch, transformers,
#: the CUDA context. Measured on the H200 runs as peak RSS minus the host store: 1.8 GiB (7B) and
#: 1.7 GiB (8B). Part of DEFAULT_HOST_MARGIN; the rest of the margin is headroom, not a prediction.
PROCESS_BASELINE = 1792 * 2**20
#: Name prefix of the host line that is headroom rather than expected use.
SAFETY_MARGIN_LINE = "safety margin"
#: GPU slack for the caching allocator and temporaries the lines do not model. With expandable
#: segments (core/allocator.py) the measured H200 peaks (max_memory_reserved) of five runs (7B
#: and 8B at 64k tokens, 1.5B at a 128k sequence, 14B at 16k in two store layouts) came out
#: 0.5-7.5% under the modelled lines alone; 5% slack put the 14B plans 10.5% over the measured
#: peak, 3% keeps every run over its measurement (by 3.4-8.4%).
GPU_SLACK_FRACTION = 0.03
#: GPU memory NCCL takes outside PyTorch's allocator once a data-parallel rank's communicator is
#: up (after the plan measured the free HBM): the 2-GPU H200 run's out-of-memory report showed
#: 1.57 GiB held outside PyTorch, the CUDA context's ~0.5 GiB of it already gone before the plan.
NCCL_BUFFER_BYTES = 1 * GIB
#: Name of that line: memory outside PyTorch's allocator, so not in max_memory_reserved.
NCCL_LINE = "NCCL communicator buffers (estimate, outside PyTorch's allocator)"
GPU_SLACK_MIN = 1 * GIB

HBM = "hbm"
HOST = "host"


class MemoryPlanError(MemoryError):
    """The model/workload does not fit; raised before any allocation.

    ``tier`` is ``"gpu"`` or ``"host"``; ``needed`` / ``available`` are bytes.
    """

    def __init__(self, message: str, tier: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.tier = tier
        self.needed = needed
        self.available = available


@dataclass(frozen=True)
class LayerPlacement:
    index: int
    numel: int
    tier: str  # HBM or HOST
    gpu_bytes: int  # persistent GPU bytes of this layer's own state (0 for host layers)
    host_bytes: int


@dataclass
class MemoryPlan:
    shape: ModelShape
    workload: Workload | None  # None: only a fixed HBM reserve stands for activations
    compute_dtype: torch.dtype
    hbm_available: int
    host_available: int
    layers: list[LayerPlacement]
    gpu_lines: list[MemoryLine]
    host_lines: list[MemoryLine]
    h2d_bytes_per_step: int
    d2h_bytes_per_step: int
    notes: list[str] = field(default_factory=list)
    problems: list[MemoryPlanError] = field(default_factory=list)
    # Host-store mode: gradient slots held until step end (clipping) or eager updates without
    # them; fp32 masters streamed instead of a compute-dtype copy.
    hold_grads: bool = True
    stream_fp32_master: bool = False
    # The last ``kept_layers`` HBM-tier layers keep their forward activations for backward
    # instead of recomputing the layer (see ``kept_activation_bytes_per_token``).
    kept_layers: int = 0
    # Data-parallel processes of one host the host lines are for (GPU lines: per GPU).
    ranks: int = 1
    # HBM-tier layers that do not keep their activations keep no compute-dtype copy either and
    # are cast from their fp32 master into a stream buffer when they run (16 instead of 18
    # B/param in bf16 runs); the kept ones keep theirs (their graph holds the weights).
    hbm_cast_weights: bool = False
    # Recomputed layers (the last ones) that keep their attention kernel's outputs.
    attention_layers: int = 0

    @property
    def kept_layer_indices(self) -> list[int]:
        return list(range(self.n_hbm - self.kept_layers, self.n_hbm))

    @property
    def attention_layer_indices(self) -> list[int]:
        kept = set(self.kept_layer_indices)
        recomputed = [p.index for p in self.layers if p.index not in kept]
        return last_recomputed(recomputed, self.attention_layers)

    # Set when the plan does not fit: the shortest checkpoint segment length that would make it
    # fit (None: none tried does, or bf16 boundaries already would).
    checkpoint_every_fit: int | None = None
    # Set when the plan does not fit: whether it would with bf16 boundary activations.
    bf16_boundaries_fit: bool = False
    # Set when the plan does not fit: the lightest set of memory options not used yet that would
    # make it fit (``memory_options.lightest_fit``), when neither of the two above is advised.
    options_fit: MemoryOptions | None = None

    @property
    def host_bytes_per_param(self) -> int:
        """Host-store bytes per parameter of a trainable host-tier layer (page rounding aside)."""
        return host_bytes_per_param(self.compute_dtype, self.hold_grads, self.stream_fp32_master)

    @property
    def n_hbm(self) -> int:
        return sum(1 for p in self.layers if p.tier == HBM)

    @property
    def n_host(self) -> int:
        return len(self.layers) - self.n_hbm

    @property
    def gpu_total(self) -> int:
        return sum(line.nbytes for line in self.gpu_lines)

    @property
    def host_total(self) -> int:
        return sum(line.nbytes for line in self.host_lines)

    @property
    def host_peak_estimate(self) -> int:
        """The host peak the run should reach: every host line but the safety margin."""
        return sum(
            ln.nbytes for ln in self.host_lines if not ln.name.startswith(SAFETY_MARGIN_LINE)
        )

    @property
    def fits(self) -> bool:
        return not self.problems

    def check(self) -> MemoryPlan:
        """Raise the first problem (GPU before host) as a ``MemoryPlanError``; else return self."""
        if self.problems:
            raise self.problems[0]
        return self

    def table(self) -> str:
        return _render_table(self)


# ---- the arithmetic -------------------------------------------------------------------------------
def host_bytes_per_param(
    dtype: torch.dtype, hold_grads: bool = True, stream_fp32_master: bool = False
) -> int:
    """Host-store bytes per parameter of a trainable host-tier layer: fp32 master + 2 moments,
    the fp32 gradient slot when held, the compute-dtype copy unless the master streams."""
    copy = 0 if dtype == torch.float32 or stream_fp32_master else _itemsize(dtype)
    return 12 + (4 if hold_grads else 0) + copy


def h2d_bytes_per_param(dtype: torch.dtype, stream_fp32_master: bool = False) -> int:
    """Bytes per parameter a host layer moves H2D each time it streams in."""
    return 4 if stream_fp32_master else _itemsize(dtype)


def _mode_line(dtype: torch.dtype, hold_grads: bool, stream_fp32_master: bool) -> str:
    grads = (
        "fp32 grad slot held until the step's norm is known (clipping on)"
        if hold_grads
        else f"eager updates, no grad slot (grads pass a {GRAD_STAGING_SLOTS}-layer staging ring)"
    )
    weights = (
        "fp32 masters stream (cast on GPU)"
        if stream_fp32_master and dtype != torch.float32
        else "fp32 masters stream"
        if dtype == torch.float32
        else "bf16 stream copy"
    )
    b = host_bytes_per_param(dtype, hold_grads, stream_fp32_master)
    return f"host tier {b} B/param: {grads}; {weights}"


def _gpu_lines(
    shape: ModelShape,
    workload: Workload | None,
    dtype: torch.dtype,
    n_hbm: int,
    reserve_bytes: int,
    stream_fp32_master: bool = False,
    kept: int = 0,
    ranks: int = 1,
    hbm_cast_weights: bool = False,
    attention_layers: int = 0,
) -> list[MemoryLine]:
    """GPU costs with the first ``n_hbm`` layers in the HBM tier, ``kept`` of them keeping
    their activations (no recompute) and ``attention_layers`` recomputed ones their attention
    kernel's outputs; per GPU when ``ranks`` > 1 (data parallel)."""
    isz = _itemsize(dtype)
    dt = "bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch.")
    hbm = shape.layer_numels[:n_hbm]
    host = shape.layer_numels[n_hbm:]
    max_host = max(host, default=0)
    cast = hbm_cast_weights and dtype != torch.float32
    # Cast on use: the tier's layers that do not keep activations (the first n_hbm - kept).
    n_cast = n_hbm - kept if cast else 0
    # Layers that run from a stream buffer: streamed ones, and HBM-tier ones cast on use.
    max_slot = max(max_host, max(hbm[:n_cast], default=0))
    tier_copy = (
        f"{dt} copy"
        if not n_cast
        else "cast to bf16 on use"
        if n_cast == n_hbm
        else f"cast to bf16 on use but the {kept} keeping activations ({dt} copy)"
    )
    lines = [
        MemoryLine(
            "non-layer params (embed/norm/head): fp32 param+grad+2 moments, 16 B/param",
            16 * shape.non_layer_numel,
        ),
        MemoryLine(
            f"HBM-tier layers ({len(hbm)}): fp32 master+grad+2 moments, {tier_copy}",
            sum(device_layer_bytes(n, dtype, i >= n_cast) for i, n in enumerate(hbm)),
        ),
        MemoryLine(
            f"stream double buffer: 2 x largest {'streamed or cast' if n_cast else 'host'} layer "
            f"x {isz} B",
            2 * max_slot * isz,
        ),
    ]
    if stream_fp32_master and dtype != torch.float32 and max_host:
        lines.append(
            MemoryLine(
                "fp32 master H2D staging (cast to the stream buffer on the GPU)", 4 * max_host
            )
        )
    ga = workload.grad_accum if workload is not None else 1
    if ga > 1:
        # Non-final micro-batches keep every host layer's gradient on the GPU (one D2H per step).
        lines.append(
            MemoryLine(
                f"fp32 grad accumulators of host layers (grad-accum {ga} > 1), 4 B/param",
                4 * sum(host),
            )
        )
    elif ranks > 1:
        # Each layer's gradient is reduced to its owner rank: the owner's drain to the host
        # (~2 in flight) and the other ranks' buffers until the reduction has read them
        # (REDUCES_IN_FLIGHT in core/streaming.py).
        lines.append(
            MemoryLine(
                "fp32 grads reducing to their owner rank / draining to host (~4 layers)",
                4 * max_host * 4,
            )
        )
    else:
        # Each layer's gradient leaves on the D2H stream right away; ~2 can be in flight.
        lines.append(
            MemoryLine("fp32 grads draining to host (~2 layers in flight)", 2 * max_host * 4)
        )
    if ranks > 1:
        lines.append(MemoryLine(NCCL_LINE, NCCL_BUFFER_BYTES))
    if workload is None:
        lines.append(
            MemoryLine("reserve for activations, logits, resident params (fixed)", reserve_bytes)
        )
        return lines
    lines += activation_lines(shape, workload, dtype)
    if attention_layers:
        lines.append(attention_output_line(shape, workload, dtype, attention_layers))
    if kept:
        # A kept layer's graph holds its fp32 input itself, also where the boundary line
        # counts it rounded to bf16.
        per_token = (
            kept_activation_bytes_per_token(shape)
            + (4 - workload.boundary_bytes_per_element) * shape.hidden_size
        )
        lines.append(
            MemoryLine(
                f"kept activations of {kept} HBM-tier layers (no recompute): "
                f"{workload.micro_batch_tokens} tokens x {per_token} B each (estimate)",
                kept * workload.micro_batch_tokens * per_token,
            )
        )
    modelled = sum(line.nbytes for line in lines)
    lines.append(
        MemoryLine(
            f"allocator slack + unmodelled temporaries ({GPU_SLACK_FRACTION:.0%}, min 1 GiB)",
            max(GPU_SLACK_MIN, int(modelled * GPU_SLACK_FRACTION)),
        )
    )
    return lines


def _host_lines(
    shape: ModelShape,
    workload: Workload | None,
    dtype: torch.dtype,
    n_hbm: int,
    margin: int,
    hold_grads: bool = True,
    stream_fp32_master: bool = False,
    input_model_bytes: int = 0,
    ranks: int = 1,
) -> list[MemoryLine]:
    """Host costs. ``ranks`` data-parallel processes of one host share the layer store (masters
    and stream copies in shared memory, each gradient and moment on one owner rank: one store in
    all) but each has its own process, staging ring and offloaded activations."""
    host = shape.layer_numels[n_hbm:]
    per_rank = f" x {ranks} ranks" if ranks > 1 else ""
    offload = []
    if workload is not None and workload.offload_activations:
        b = workload.boundary_bytes_per_element
        offload.append(
            MemoryLine(
                f"offloaded boundary activations (pinned, {boundary_dtype_label(workload)}): "
                f"tokens x hidden x {b} B x {saved_layers_label(shape, workload)}{per_rank}",
                ranks * boundary_activation_bytes(shape, workload),
            )
        )
    parts = ["fp32 master/2 moments"]
    if hold_grads:
        parts.append("fp32 grad")
    if dtype != torch.float32 and not stream_fp32_master:
        parts.append("bf16 copy" if dtype == torch.bfloat16 else "stream copy")
    b = host_bytes_per_param(dtype, hold_grads, stream_fp32_master)
    lines = offload + [
        MemoryLine(
            f"host-tier layers ({len(host)}): {' + '.join(parts)}, {b} B/param",
            sum(layer_store_bytes(n, dtype, True, hold_grads, stream_fp32_master) for n in host),
        )
    ]
    if not hold_grads and host:
        lines.append(
            MemoryLine(
                f"pinned grad staging ring: {GRAD_STAGING_SLOTS} x largest host layer x 4 B"
                f"{per_rank}",
                ranks * GRAD_STAGING_SLOTS * 4 * max(host),
            )
        )
    if input_model_bytes:
        # A model handed over materialized on the host is moved into the store layer by layer,
        # each layer's own tensors freed once copied: the host peaks either before the move
        # (the whole model) or after it (the store plus the not-yet-placed non-layer tensors).
        store = sum(line.nbytes for line in lines)
        total = max(shape.total_numel, 1)
        non_layer = input_model_bytes * shape.non_layer_numel // total
        lines.append(
            MemoryLine(
                f"model passed in on the host (moved into the store layer by layer){per_rank}",
                ranks * max(non_layer, input_model_bytes - store),
            )
        )
    baseline = min(PROCESS_BASELINE, margin)
    return lines + [
        MemoryLine(
            f"process baseline (Python, torch, CUDA context; measured){per_rank}",
            ranks * baseline,
        ),
        MemoryLine(f"{SAFETY_MARGIN_LINE} (headroom, not expected use)", margin - baseline),
    ]


def _pcie_bytes(
    shape: ModelShape,
    workload: Workload | None,
    dtype: torch.dtype,
    n_hbm: int,
    stream_fp32_master: bool = False,
) -> tuple[int, int]:
    """(H2D, D2H) bytes per optimizer step.

    Host layers stream in for the forward and again for the backward recompute of every
    micro-batch. The double buffer still holds the last two host layers when backward starts,
    and after a backward the first two host layers for the next micro-batch's forward (the first
    forward of a step must reload: the optimizer changed the weights). Gradients leave once per step.

    Checkpoint segments of k layers: a segment's backward streams its layers but the last for
    the chain, then each layer for its own backward; the last two chain layers are still in the
    double buffer then, so layers 0..k-3 of each segment stream in once more.
    """
    isz = h2d_bytes_per_param(dtype, stream_fp32_master)
    host = list(shape.layer_numels[n_hbm:])
    if not host:
        return 0, 0
    ga = workload.grad_accum if workload is not None else 1
    kept = min(2, len(host))
    saved_backward = sum(host[-kept:]) * isz
    saved_forward = sum(host[:kept]) * isz
    h2d = ga * 2 * sum(host) * isz - ga * saved_backward - (ga - 1) * saved_forward
    k = workload.checkpoint_every if workload is not None else 1
    n = shape.num_layers
    again = [i for s in range(0, n, k) for i in range(s, min(s + k, n) - 2) if i >= n_hbm]
    h2d += ga * sum(shape.layer_numels[i] for i in again) * isz
    return h2d, 4 * sum(host)


def _layer_placements(
    shape: ModelShape, dtype: torch.dtype, n_hbm: int, n_cast: int, **store_kw: bool
) -> list[LayerPlacement]:
    """``n_cast``: how many leading HBM-tier layers keep no compute-dtype copy."""
    return [
        LayerPlacement(i, n, HBM, device_layer_bytes(n, dtype, i >= n_cast), 0)
        if i < n_hbm
        else LayerPlacement(i, n, HOST, 0, layer_store_bytes(n, dtype, True, **store_kw))
        for i, n in enumerate(shape.layer_numels)
    ]


def _total(lines: list[MemoryLine]) -> int:
    return sum(line.nbytes for line in lines)


def plan_memory(
    shape: ModelShape,
    workload: Workload | None,
    compute_dtype: torch.dtype,
    hbm_bytes: int,
    host_bytes: int,
    *,
    hbm_layers: int | None = None,
    reserve_bytes: int = 0,
    host_margin_bytes: int = DEFAULT_HOST_MARGIN,
    hold_grads: bool = True,
    stream_fp32_master: bool = False,
    input_model_bytes: int = 0,
    keep_activation_layers: int | None = 0,
    ranks: int = 1,
    hbm_cast_weights: bool = False,
    _advise: bool = True,
) -> MemoryPlan:
    """Plan the tiers. Never raises for lack of memory: check ``plan.fits`` or call ``check()``.

    Args:
        shape: the model's parameter counts and widths.
        workload: the step's token split; ``None`` when unknown (the trainer's "auto" before it
            knows the batch): then ``reserve_bytes`` stands for activations, logits and the
            resident non-layer params.
        compute_dtype: ``torch.bfloat16`` or ``torch.float32``.
        hbm_bytes: free GPU memory to plan into; host_bytes: available host RAM.
        hbm_layers: force this many leading layers into HBM (default: as many as fit).
        hold_grads: host layers keep an fp32 gradient slot (clipping on, or eager updates off);
            ``False``: eager updates without it (see the module docstring).
        stream_fp32_master: host layers keep no compute-dtype copy; the fp32 master streams.
        input_model_bytes: bytes of a model handed over materialized on the host (0 for a meta
            skeleton that is loaded or initialized straight into the store).
        keep_activation_layers: how many HBM-tier layers keep their activations instead of
            recomputing in backward; ``None``: as many as the HBM left after the tier holds
            (needs a ``workload``). Layer state comes first: the tier is sized before this.
        ranks: data-parallel processes on this host (one GPU each): the GPU plan is per GPU
            (HBM-tier layers are replicated), the host plan holds the shared store once and
            each rank's own process, staging ring and offloaded activations.
        hbm_cast_weights: HBM-tier layers that do not keep their activations keep no
            compute-dtype copy either (bf16 runs: 16 instead of 18 B/param, as stock training);
            each is cast into a stream buffer when it runs. The kept ones keep their copy.
    """
    if ranks < 1:
        raise ValueError(f"ranks={ranks} must be >= 1")
    if compute_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"compute dtype {compute_dtype} is not supported; use bf16 or fp32")
    n = shape.num_layers

    # Recomputed layers keeping their attention kernel's outputs: asked for as a count (or all),
    # part of sizing the tier; "auto" (None) fills what the tier and kept activations leave.
    attn_ask = workload.attention_output_layers if workload is not None else 0
    if workload is not None and workload.boundary_bytes_per_element != 4:
        attn_ask = 0  # layers with rounded inputs re-run whole: nothing kept

    def attn_fixed(kept: int) -> int:
        if attn_ask is None:
            return 0
        return n - kept if attn_ask == ALL_LAYERS else min(attn_ask, n - kept)

    def gpu(k: int, kept: int = 0, attn: int | None = None) -> list[MemoryLine]:
        return _gpu_lines(
            shape, workload, compute_dtype, k, reserve_bytes, stream_fp32_master, kept, ranks,
            hbm_cast_weights, attn_fixed(kept) if attn is None else attn,
        )  # fmt: skip

    if hbm_layers is not None:
        if not 0 <= hbm_layers <= n:
            raise ValueError(f"hbm_layers={hbm_layers} but the model has {n} layers")
        n_hbm = hbm_layers
    else:
        # Largest prefix that fits. Not monotone in k (an all-HBM plan drops the stream buffers),
        # so try every count instead of stopping at the first miss.
        n_hbm = next((k for k in range(n, -1, -1) if _total(gpu(k)) <= hbm_bytes), 0)
    cast = hbm_cast_weights and compute_dtype != torch.float32
    if workload is None or (keep_activation_layers is None and workload.offload_activations):
        kept = 0  # (offload is for runs whose activations do not fit: nothing to keep)
    elif keep_activation_layers is None and not shape.kept_bytes_audited:
        kept = 0
    elif keep_activation_layers is None:
        kept = next((k for k in range(n_hbm, 0, -1) if _total(gpu(n_hbm, k)) <= hbm_bytes), 0)
    else:
        if not 0 <= keep_activation_layers <= n_hbm:
            raise ValueError(
                f"keep_activation_layers={keep_activation_layers}: only the {n_hbm} HBM-tier "
                "layers can keep their activations"
            )
        kept = keep_activation_layers
    if attn_ask is None:
        # More layers keeping them only adds HBM: the largest count that fits.
        attn = _largest(lambda a: _total(gpu(n_hbm, kept, a)) <= hbm_bytes, n - kept)
    else:
        attn = attn_fixed(kept)
    gpu_lines = gpu(n_hbm, kept, attn)
    store_kw = dict(hold_grad=hold_grads, stream_master=stream_fp32_master)
    host_lines = _host_lines(
        shape,
        workload,
        compute_dtype,
        n_hbm,
        host_margin_bytes,
        hold_grads,
        stream_fp32_master,
        input_model_bytes,
        ranks,
    )
    h2d, d2h = _pcie_bytes(shape, workload, compute_dtype, n_hbm, stream_fp32_master)
    plan = MemoryPlan(
        shape=shape,
        workload=workload,
        compute_dtype=compute_dtype,
        hbm_available=hbm_bytes,
        host_available=host_bytes,
        layers=_layer_placements(
            shape, compute_dtype, n_hbm, n_hbm - kept if cast else 0, **store_kw
        ),
        gpu_lines=gpu_lines,
        host_lines=host_lines,
        h2d_bytes_per_step=h2d,
        d2h_bytes_per_step=d2h,
        hold_grads=hold_grads,
        stream_fp32_master=stream_fp32_master,
        kept_layers=kept,
        ranks=ranks,
        hbm_cast_weights=cast,
        attention_layers=attn,
    )
    fixed_gpu_lines = gpu(0) if hbm_layers is None else gpu_lines
    _add_problems(plan, fixed_gpu_lines)

    def fits_with(other: Workload, **store: bool) -> bool:
        """Whether the same run fits with another workload / host-store mode (for the advice)."""
        return plan_memory(
            shape,
            other,
            compute_dtype,
            hbm_bytes,
            host_bytes,
            hbm_layers=hbm_layers,
            reserve_bytes=reserve_bytes,
            host_margin_bytes=host_margin_bytes,
            hold_grads=store.get("hold_grads", hold_grads),
            stream_fp32_master=store.get("stream_fp32_master", stream_fp32_master),
            input_model_bytes=input_model_bytes,
            ranks=ranks,
            hbm_cast_weights=hbm_cast_weights,
            _advise=False,
        ).fits

    base = (
        _current_options(workload, hold_grads, stream_fp32_master) if workload is not None else None
    )

    def fits_options(o: MemoryOptions) -> bool:
        return fits_with(_options_workload(workload, o), **_options_store(o))

    if plan.problems and _advise and base is not None:
        # Exact, cheap options first: when MLP tiles, activation offload or fp32-master
        # streaming (alone or together) make it fit, that is the advice, before anything
        # approximate (bf16 boundaries) or slower (checkpoint segments) is considered.
        def cheap(o: MemoryOptions) -> bool:
            return (o.checkpoint_every, o.bf16_boundaries, o.no_clip) == (
                base.checkpoint_every, base.bf16_boundaries, base.no_clip,
            )  # fmt: skip

        exact = lightest_fit(
            lambda o: cheap(o) and fits_options(o), base, workload.micro_batch_tokens
        )
        if exact is not None:
            _advise_options(plan, exact, base)
            _add_notes(plan)
            return plan

    if plan.problems and workload is not None and workload.boundary_bytes_per_element > 2:
        # Would bf16 boundary activations (half the bytes) make it fit? Then the advice says so.
        bf16 = replace(workload, boundary_bytes_per_element=2)
        plan.bf16_boundaries_fit = fits_with(bf16)
        if plan.bf16_boundaries_fit:
            plan.problems.clear()
            _add_problems(plan, fixed_gpu_lines)
    if plan.problems and _advise and workload is not None and not plan.bf16_boundaries_fit:
        # Would checkpoint segments (fewer saved layer inputs) make it fit? The advice says so.
        for k in SEGMENT_ADVICE_LENGTHS:
            if k <= workload.checkpoint_every or k >= n:
                continue
            if fits_with(replace(workload, checkpoint_every=k)):
                plan.checkpoint_every_fit = k
                for problem in plan.problems:
                    problem.args = (f"{problem.args[0]} {_segment_advice(k)}",)
                break
    if (
        plan.problems
        and _advise
        and base is not None
        and not plan.bf16_boundaries_fit
        and plan.checkpoint_every_fit is None
    ):
        # No single option is enough: the lightest combination of those not used yet.
        found = lightest_fit(fits_options, base, workload.micro_batch_tokens)
        if found is not None:
            _advise_options(plan, found, base)
        else:
            for problem in plan.problems:
                problem.args = (f"{problem.args[0]} {NOTHING_FITS_ADVICE}",)
    _add_notes(plan)
    if (
        _advise
        and plan.fits
        and not cast
        and compute_dtype != torch.float32
        and hbm_layers is None
        and plan.n_host
    ):
        # The HBM tier without bf16 copies (16 instead of 18 B/param): say when it holds more.
        alt = plan_memory(
            shape, workload, compute_dtype, hbm_bytes, host_bytes, reserve_bytes=reserve_bytes,
            host_margin_bytes=host_margin_bytes, hold_grads=hold_grads,
            stream_fp32_master=stream_fp32_master, input_model_bytes=input_model_bytes,
            keep_activation_layers=keep_activation_layers, ranks=ranks, hbm_cast_weights=True,
            _advise=False,
        )  # fmt: skip
        if alt.fits and alt.n_hbm > plan.n_hbm:
            plan.notes.append(
                f"with megatrain_hbm_cast_weights (plan --hbm-cast-weights: HBM-tier layers "
                f"without bf16 copies, 16 B/param) {alt.n_hbm} layers fit in HBM instead of "
                f"{plan.n_hbm}."
            )
    return plan


def _current_options(workload: Workload, hold_grads: bool, stream_fp32_master: bool):
    return MemoryOptions(
        mlp_tile_tokens=workload.mlp_tile_tokens,
        offload_activations=workload.offload_activations,
        stream_fp32_master=stream_fp32_master,
        checkpoint_every=workload.checkpoint_every,
        bf16_boundaries=workload.boundary_bytes_per_element <= 2,
        no_clip=not hold_grads,
    )


def _options_workload(workload: Workload, o: MemoryOptions) -> Workload:
    return replace(
        workload,
        mlp_tile_tokens=o.mlp_tile_tokens,
        offload_activations=o.offload_activations,
        checkpoint_every=o.checkpoint_every,
        boundary_bytes_per_element=2 if o.bf16_boundaries else workload.boundary_bytes_per_element,
    )


def _options_store(o: MemoryOptions) -> dict[str, bool]:
    return {"hold_grads": not o.no_clip, "stream_fp32_master": o.stream_fp32_master}


def _advise_options(plan: MemoryPlan, found: MemoryOptions, base: MemoryOptions) -> None:
    plan.options_fit = found
    advice = f"With {found.describe(base)} this plan fits."
    for problem in plan.problems:
        problem.args = (f"{problem.args[0]} {advice}",)


#: When not even every memory option together makes a plan fit.
NOTHING_FITS_ADVICE = (
    "No combination of the memory options (MLP tiles, activation offload, fp32-master "
    "streaming, checkpoint segments of up to 8 layers, bf16 boundaries, no clipping) makes it "
    "fit on this machine."
)

#: Segment lengths the advice tries when a plan does not fit (the shortest that fits is named).
SEGMENT_ADVICE_LENGTHS = (2, 3, 4, 6, 8)


def _segment_advice(k: int) -> str:
    return (
        f"With checkpoint segments of {k} layers (megatrain_checkpoint_every={k}, plan "
        f"--checkpoint-every {k}: one layer in {k} saves its input, the others are recomputed "
        f"from it in backward, {k - 1}/{k} of a layer forward more per layer, exact) "
        "this plan fits."
    )


#: Problem advice when only the boundary activations' precision stands between a plan and a fit.
BF16_BOUNDARIES_ADVICE = (
    "With bf16 boundary activations (megatrain_boundary_dtype='bfloat16', plan "
    "--bf16-boundaries: each layer's saved input rounded to bf16, half the bytes) this plan "
    "fits; the forward is unchanged, but backward recomputes each layer from the rounded input "
    "(relative error <= 2^-9 per element), so gradients are slightly approximate."
)


def _add_problems(plan: MemoryPlan, fixed_gpu_lines: list[MemoryLine]) -> None:
    gpu_needed = plan.gpu_total
    if gpu_needed > plan.hbm_available:
        what = (
            "even with every layer streamed from host, the GPU part"
            if plan.n_hbm == 0
            else f"with {plan.n_hbm} layers in HBM, the GPU part"
        )
        big = max(fixed_gpu_lines, key=lambda line: line.nbytes)
        advice = (
            "Use fewer tokens per micro-batch (more gradient accumulation) or a shorter sequence."
            if plan.workload is not None
            else "Lower the HBM reserve (megatrain_hbm_reserve_gb) or stream every layer."
        )
        plan.problems.append(
            MemoryPlanError(
                f"hf_megatrain: {what} needs {format_bytes(gpu_needed)} of GPU memory but only "
                f"{format_bytes(plan.hbm_available)} is free (largest item: {big.name}, "
                f"{format_bytes(big.nbytes)}). {advice}{_boundary_advice(plan)}",
                "gpu",
                gpu_needed,
                plan.hbm_available,
            )
        )
    host_needed = plan.host_total
    if host_needed > plan.host_available:
        plan.problems.append(
            MemoryPlanError(
                f"hf_megatrain: the host store needs {format_bytes(host_needed)} of host RAM "
                f"({plan.n_host} streamed layers + {format_bytes(plan.host_lines[-1].nbytes)} "
                f"margin; {plan.n_hbm} layers already moved to HBM, which is full) but only "
                f"{format_bytes(plan.host_available)} is available. Use a machine with more RAM "
                f"or GPU memory, fewer tokens per micro-batch (frees HBM for layers), "
                f"{_slimmer_store_advice(plan)}{_boundary_option(plan)}or a smaller model."
                f"{_boundary_advice(plan)}",
                "host",
                host_needed,
                plan.host_available,
            )
        )


def _boundary_advice(plan: MemoryPlan) -> str:
    return f" {BF16_BOUNDARIES_ADVICE}" if plan.bf16_boundaries_fit else ""


def _boundary_option(plan: MemoryPlan) -> str:
    """bf16 boundaries as one more host-RAM option, when the activations are offloaded there
    and halving them alone is not enough (else ``_boundary_advice`` says it fits)."""
    wl = plan.workload
    if plan.bf16_boundaries_fit or wl is None or not wl.offload_activations:
        return ""
    if wl.boundary_bytes_per_element <= 2:
        return ""
    saved = boundary_activation_bytes(plan.shape, wl) // 2
    return (
        f"bf16 boundary activations (megatrain_boundary_dtype='bfloat16': "
        f"{format_bytes(saved)} less, slightly approximate gradients), "
    )


def _slimmer_store_advice(plan: MemoryPlan) -> str:
    """The host-store options this plan does not use yet, as advice."""
    out = ""
    if plan.hold_grads:
        out += "no clipping (eager updates keep no host gradient: 4 B/param less), "
    if not plan.stream_fp32_master and plan.compute_dtype != torch.float32:
        out += "fp32-master streaming (no bf16 copy: 2 B/param less, 2x H2D bytes), "
    return out


def _add_notes(plan: MemoryPlan) -> None:
    wl = plan.workload
    if wl is not None and wl.checkpoint_every > 1:
        k = wl.checkpoint_every
        plan.notes.append(
            f"checkpoint segments of {k} layers: {saved_boundary_layers(plan.shape, wl)} of "
            f"{plan.shape.num_layers} layer inputs saved; the others are recomputed in backward "
            f"({k - 1} extra layer forwards per segment, {k - 1}/{k} of a layer forward per "
            "layer)."
        )
    if wl is not None and wl.grad_accum > 1 and plan.n_host:
        plan.notes.append(
            f"grad-accum {wl.grad_accum} > 1 keeps an fp32 gradient accumulator of every host "
            "layer on the GPU (4 B/param) until the step's last micro-batch."
        )
    if wl is not None:
        plan.notes.append(
            "recompute working set, loss temporaries and slack are estimates; parameter, "
            "buffer and optimizer-state lines are exact."
        )
    else:
        plan.notes.append(
            "workload unknown: a fixed reserve stands for activations, logits and the resident "
            "non-layer params."
        )
    if plan.n_host and plan.n_hbm == 0 and plan.fits:
        plan.notes.append("no layer fits in HBM next to the activations; all layers stream.")
    if wl is not None and not plan.shape.kept_bytes_audited and not plan.kept_layers:
        plan.notes.append(
            "kept activations not planned: what this layer family saves for backward is not "
            "audited; a layer count in megatrain_keep_activations keeps some on an estimate."
        )


# ---- what fits ----------------------------------------------------------------------------------
def _largest(fits: Callable[[int], bool], limit: int) -> int:
    """Largest ``m`` in ``[1, limit]`` with ``fits(m)`` (monotone: fits for all smaller), else 0."""
    if limit < 1 or not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):  # doubling keeps the number of plans logarithmic
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _fits(shape: ModelShape, wl: Workload, dtype: torch.dtype, hbm: int, host: int, **kw) -> bool:
    return plan_memory(shape, wl, dtype, hbm, host, _advise=False, **kw).fits


def max_micro_batch_sequences(
    shape: ModelShape,
    seq_len: int,
    grad_accum: int,
    compute_dtype: torch.dtype,
    hbm_bytes: int,
    host_bytes: int,
    limit: int = 1 << 20,
    mlp_tile_tokens: int = 0,
    offload_activations: bool = False,
    boundary_bytes_per_element: int = 4,
    checkpoint_every: int = 1,
    attention_output_layers: int | None = 0,
    **kw,
) -> int:
    """Most sequences of ``seq_len`` per micro-batch that fit (0: not even one)."""
    return _largest(
        lambda m: _fits(
            shape, Workload(
                seq_len, m * seq_len, grad_accum, mlp_tile_tokens, offload_activations,
                boundary_bytes_per_element, checkpoint_every, attention_output_layers,
            ),
            compute_dtype, hbm_bytes,
            host_bytes, **kw,
        ),
        limit,
    )  # fmt: skip


def max_seq_len(
    shape: ModelShape,
    grad_accum: int,
    compute_dtype: torch.dtype,
    hbm_bytes: int,
    host_bytes: int,
    multiple: int = 1024,
    limit: int = 1 << 26,
    mlp_tile_tokens: int = 0,
    offload_activations: bool = False,
    boundary_bytes_per_element: int = 4,
    checkpoint_every: int = 1,
    attention_output_layers: int | None = 0,
    **kw,
) -> int:
    """Longest sequence (a multiple of ``multiple``, one per micro-batch) that fits; 0 if none."""
    m = _largest(
        lambda k: _fits(
            shape, Workload(
                k * multiple, k * multiple, grad_accum, mlp_tile_tokens, offload_activations,
                boundary_bytes_per_element, checkpoint_every, attention_output_layers,
            ),
            compute_dtype, hbm_bytes,
            host_bytes, **kw,
        ),
        limit // multiple,
    )  # fmt: skip
    return m * multiple


def max_num_layers(
    shape: ModelShape,
    workload: Workload,
    compute_dtype: torch.dtype,
    hbm_bytes: int,
    host_bytes: int,
    limit: int = 4096,
    **kw,
) -> int:
    """Most layers of this family's layer shape that fit (same widths, vocab, workload)."""
    return _largest(
        lambda n: _fits(
            shape.with_num_layers(n), workload, compute_dtype, hbm_bytes, host_bytes, **kw
        ),
        limit,
    )


# ---- rendering --------------------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / GIB:9.2f}"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _ranges(indices: list[int]) -> str:
    if not indices:
        return "none"
    return f"{indices[0]}-{indices[-1]}" if len(indices) > 1 else str(indices[0])


def _render_table(plan: MemoryPlan) -> str:
    s, wl = plan.shape, plan.workload
    dt = "bf16" if plan.compute_dtype == torch.bfloat16 else "fp32"
    width = 84
    widths = f", hidden {s.hidden_size}, vocab {s.vocab_size}" if s.hidden_size else ""
    out = [
        f"hf-megatrain memory plan: {s.name} ({_params(s.total_numel)} params, "
        f"{s.num_layers} layers{widths}), {dt} compute",
    ]
    if wl is not None:
        out.append(
            f"step: {wl.tokens_per_step} tokens = {wl.grad_accum} micro-batch(es) of "
            f"{wl.micro_batch_tokens} tokens (seq {wl.seq_len})"
        )
    hbm_idx = [p.index for p in plan.layers if p.tier == HBM]
    host_idx = [p.index for p in plan.layers if p.tier == HOST]
    out.append(
        f"layers: {plan.n_hbm} in HBM ({_ranges(hbm_idx)}), "
        f"{plan.n_host} streamed from host ({_ranges(host_idx)})"
    )
    if plan.ranks > 1:
        out.append(
            f"data parallel: {plan.ranks} ranks, one GPU each; GPU lines are per GPU (HBM-tier "
            "layers replicated), host lines for the whole host (one shared store)"
        )
    if plan.kept_layers:
        out.append(
            f"activations kept, no recompute: layers {_ranges(plan.kept_layer_indices)}; "
            "the others recompute in backward"
        )
    if plan.attention_layers:
        out.append(
            f"attention outputs kept for the recompute: layers "
            f"{_ranges(plan.attention_layer_indices)}"
        )
    out.append(_mode_line(plan.compute_dtype, plan.hold_grads, plan.stream_fp32_master))
    for title, lines, total, avail in (
        ("GPU (HBM)", plan.gpu_lines, plan.gpu_total, plan.hbm_available),
        ("host RAM", plan.host_lines, plan.host_total, plan.host_available),
    ):
        out.append("")
        out.append(f"{title:<{width - 9}}{'GiB':>9}")
        for line in lines:
            out.append(f"  {line.name:<{width - 11}}{_gib(line.nbytes)}")
        gap = abs(avail - total) / GIB
        status = f"fits, {gap:.2f} GiB left" if total <= avail else f"DOES NOT FIT: {gap:.2f} short"
        out.append(f"  {'total':<{width - 11}}{_gib(total)}")
        out.append(f"  {'available (' + status + ')':<{width - 11}}{_gib(avail)}")
    secs = max(plan.h2d_bytes_per_step, plan.d2h_bytes_per_step) / PCIE_BYTES_PER_S
    out.append("")
    out.append(
        f"PCIe per optimizer step: H2D {plan.h2d_bytes_per_step / 1e9:.2f} GB "
        f"({'fp32 masters' if plan.stream_fp32_master else 'weights'}), "
        f"D2H {plan.d2h_bytes_per_step / 1e9:.2f} GB (fp32 grads); "
        f"~{secs:.2f} s at {PCIE_BYTES_PER_S / 1e9:.0f} GB/s per direction"
    )
    for note in plan.notes:
        out.append(f"note: {note}")
    for problem in plan.problems:
        out.append(f"PROBLEM: {str(problem).removeprefix('hf_megatrain: ')}")
    return "\n".join(out)
