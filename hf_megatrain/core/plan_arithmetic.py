"""The memory plan's arithmetic: every GPU and host cost of a tier split as a named line, the PCIe
bytes of a step, and the per-layer placements.

Two tiers per layer:

* ``hbm``: the layer's whole state on the GPU (fp32 master, grad, two AdamW moments = 16 B/param,
  plus the compute-dtype copy, 2 B/param in bf16 runs); it never crosses PCIe and updates with
  the GPU AdamW. The engine requires these to be the *leading* layers.
* ``host``: the layer's state in the host store (``layer_store_bytes``); on the GPU it only
  occupies the shared double buffer while it streams through.

Two run settings change the host tier's bytes per parameter (bf16 runs; fp32 runs have no
separate stream copy either way):

* gradients (``ResolvedOptions.host_grads``): with clipping on (or eager updates off) every host
  layer keeps an fp32 gradient slot until the step's global norm is known (18 B/param); with
  eager updates (no clipping) no slot exists and final gradients pass through a pinned staging
  ring of ``GRAD_STAGING_SLOTS`` layers (14 B/param). The slot is bf16 (2 B/param less) where
  one backward of one process makes the whole gradient (``ResolvedOptions.host_grad_dtype``).
  HBM-tier layers keep their fp32 gradient either way (the GPU AdamW reads it in place).
* ``stream_fp32_master``: no bf16 copy in the store (2 B/param less); the fp32 master crosses
  PCIe (4 instead of 2 B/param H2D) into one fp32 device staging buffer and is cast there.

Pure arithmetic on a :class:`ModelShape` (no allocation). Lines marked "estimate" model framework
temporaries, not buffers this library owns. Which split to take is ``plan_search``'s business;
how a plan is shown, ``plan_report``'s.
"""

from __future__ import annotations

import functools

import torch

from .activation_memory import (
    activation_lines,
    boundary_activation_bytes,
    boundary_dtype_label,
    embedding_grad_apart_bytes,
    saved_layers_label,
)
from .engine.staging import GRAD_STAGING_SLOTS
from .host_store import device_layer_bytes, device_tier_bytes, layer_store_bytes
from .options import ResolvedOptions, StepShape, size_bytes
from .plan_types import HBM, HOST, LayerPlacement, MemoryLine, ModelShape, itemsize

GIB = 2**30
#: Measured pinned PCIe Gen5 x16 copy rate on the target H200 machine (one direction).
PCIE_BYTES_PER_S = 55e9
#: HBM of the target H200, used when no GPU is present to measure.
H200_HBM_BYTES = 139 * GIB
#: Host RAM kept free for the Python process, CUDA context, dataloader and page cache churn.
DEFAULT_HOST_MARGIN = 4 * GIB
#: Resident memory of a training process before any model memory: Python, torch, transformers,
#: the CUDA context. Measured on the H200 runs as peak RSS minus the host store: 1.8 GiB (7B) and
#: 1.7 GiB (8B); the runs with no host-tier layer, whose peak RSS is all baseline, 1.67-2.02 GiB
#: (44 rows of results.csv and the validation matrix; OLMoE's sit highest, 1.90-2.02, a part that
#: depends on the model and is not modelled): the value that puts both ends within 9.6%. Part of
#: DEFAULT_HOST_MARGIN; the rest of the margin is headroom, not a prediction.
PROCESS_BASELINE = 1874 * 2**20
#: Name prefix of the host line that is headroom rather than expected use.
SAFETY_MARGIN_LINE = "safety margin"
#: Name prefix of the host line for a save's copies (a cost of every run that saves).
SAVE_LINE = "a save's copies beyond the store"
#: The caching allocator's fragmentation with expandable segments (core/allocator.py): memory
#: reserved but not allocated at the peak. Measured in the two out-of-memory reports of
#: hf_megatrain runs with expandable segments: 96 MiB (h200-i, c8a4bff) and 363 MiB (dp-0950,
#: 2631216); without them the stock runs showed 3-31 GiB. Part of the slack line.
ALLOCATOR_FRAGMENTATION = 512 * 2**20
#: The slack line's least: temporaries no line models (cuBLAS workspaces, small per-layer
#: tensors) on plans whose estimates are all exact or small.
GPU_SLACK_MIN = 1 * GIB
#: GPU memory NCCL takes outside PyTorch's allocator once a data-parallel rank's communicator is
#: up (after the plan measured the free HBM): the 2-GPU H200 run's out-of-memory report showed
#: 1.57 GiB held outside PyTorch, the CUDA context's ~0.5 GiB of it already gone before the plan.
NCCL_BUFFER_BYTES = 1 * GIB
#: Name of that line: memory outside PyTorch's allocator, so not in max_memory_reserved.
NCCL_LINE = "NCCL communicator buffers (estimate, outside PyTorch's allocator)"
#: Name prefix of the slack line.
SLACK_LINE = "allocator slack"
#: ``MemoryLine.kind`` of the GPU lines this module makes (the activation lines' kinds are
#: ``activation_memory``'s). All exact but NCCL's (a measured amount outside PyTorch's
#: allocator, so outside the measured peaks) and the slack itself.
PARAMS_KIND = "parameters"
#: The start of the GPU line of the non-layer parameters' state (embedding, norm, head).
NON_LAYER_PARAMS_LINE = "non-layer params (embed/norm/head)"
STREAM_BUFFERS_KIND = "stream buffers"
GRADS_KIND = "gradient buffers"
NCCL_KIND = "NCCL buffers"
RESERVE_KIND = "fixed reserve"
SLACK_KIND = "slack"


def host_bytes_per_param(
    dtype: torch.dtype,
    host_grads: bool = True,
    stream_fp32_master: bool = False,
    grad_dtype: torch.dtype = torch.float32,
) -> int:
    """Host-store bytes per parameter of a trainable host-tier layer: fp32 master + 2 moments,
    the gradient slot when held, the compute-dtype copy unless the master streams."""
    copy = 0 if dtype == torch.float32 or stream_fp32_master else itemsize(dtype)
    return 12 + (itemsize(grad_dtype) if host_grads else 0) + copy


def grad_dtype_label(grad_dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(grad_dtype, str(grad_dtype))


def h2d_bytes_per_param(dtype: torch.dtype, stream_fp32_master: bool = False) -> int:
    """Bytes per parameter a host layer moves H2D each time it streams in."""
    return 4 if stream_fp32_master else itemsize(dtype)


def total(lines: list[MemoryLine]) -> int:
    return sum(line.nbytes for line in lines)


def gpu_lines(
    shape: ModelShape,
    step: StepShape | None,
    options: ResolvedOptions,
    dtype: torch.dtype,
    n_hbm: int,
    reserve_bytes: int,
    kept: int = 0,
    ranks: int = 1,
    attention_layers: int = 0,
) -> list[MemoryLine]:
    """GPU costs with the first ``n_hbm`` layers in the HBM tier, ``kept`` of them keeping
    their activations (no recompute) and ``attention_layers`` recomputed ones their attention
    kernel's outputs; per GPU when ``ranks`` > 1 (data parallel). Without a ``step``,
    ``reserve_bytes`` stands for every activation, logit and resident parameter."""
    isz = itemsize(dtype)
    dt = "bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch.")
    hbm = shape.layer_numels[:n_hbm]
    host = shape.layer_numels[n_hbm:]
    max_host = max(host, default=0)
    # The host layers' gradients: of those that train (a frozen LoRA base makes none).
    trained = shape.trained_numels(n_hbm)
    max_trained = max(trained, default=0)
    cast = options.hbm_cast_weights and dtype != torch.float32
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
    # A non-tied embedding's gradient planned as its own phase leaves this line (see there).
    embed_grad = embedding_grad_apart_bytes(shape, step, options, kept)
    frozen = shape.frozen_non_layer_numel
    lines = [
        MemoryLine(
            f"{NON_LAYER_PARAMS_LINE}: fp32 param+grad+2 moments, 16 B/param"
            + (f"; {frozen / 1e6:.1f}M frozen: fp32 only, 4 B/param" if frozen else "")
            + (" (the embedding's gradient below)" if embed_grad else ""),
            16 * (shape.non_layer_numel - frozen) + 4 * frozen - embed_grad,
            PARAMS_KIND,
        ),
        MemoryLine(
            f"HBM-tier layers ({len(hbm)}): fp32 master+grad+2 moments, {tier_copy}",
            device_tier_bytes(hbm, dtype, n_cast),
            PARAMS_KIND,
        ),
    ]
    if shape.adapter_numel:
        # Real parameters of the layers, placed on the GPU with the non-layer ones
        # (hf/model.py ``_place_resident``) and updated by the GPU AdamW; their layers' buffers
        # (BOFT's permutations, VeRA's projections) placed there too.
        buffers = shape.adapter_buffer_bytes
        lines.append(
            MemoryLine(
                f"LoRA adapters of the layers ({shape.adapter_numel / 1e6:.1f}M params, "
                "resident): fp32 param+grad+2 moments, 16 B/param"
                + (f"; their buffers {buffers / 2**20:.1f} MiB" if buffers else ""),
                16 * shape.adapter_numel + buffers,
                PARAMS_KIND,
            )
        )
    lines += [
        MemoryLine(
            f"stream double buffer: 2 x largest {'streamed or cast' if n_cast else 'host'} layer "
            f"x {isz} B",
            2 * max_slot * isz,
            STREAM_BUFFERS_KIND,
        ),
    ]
    if options.stream_fp32_master and dtype != torch.float32 and max_host:
        lines.append(
            MemoryLine(
                "fp32 master H2D staging (cast to the stream buffer on the GPU)",
                4 * max_host,
                STREAM_BUFFERS_KIND,
            )
        )
    if (
        options.device_updates
        and ranks == 1
        and options.host_grads
        and device_updates_pay(sum(trained), sum(hbm), step)
    ):
        lines.append(device_update_line(max_trained, options, dtype, shape.hidden_size))
    ga = step.grad_accum if step is not None else 1
    if ga > 1:
        # Non-final micro-batches keep every host layer's gradient on the GPU (one D2H per step).
        lines.append(
            MemoryLine(
                f"fp32 grad accumulators of host layers (grad-accum {ga} > 1), 4 B/param",
                4 * sum(trained),
                GRADS_KIND,
            )
        )
    elif ranks > 1:
        # Each layer's gradient is reduced to its owner rank: the owner's drain to the host
        # (~2 in flight) and the other ranks' buffers until the reduction has read them
        # (REDUCES_IN_FLIGHT in core/streaming.py).
        lines.append(
            MemoryLine(
                "fp32 grads reducing to their owner rank / draining to host (~4 layers)",
                4 * max_trained * 4,
                GRADS_KIND,
            )
        )
    else:
        # Each layer's gradient leaves on the D2H stream right away; ~2 can be in flight.
        lines.append(
            MemoryLine(
                "fp32 grads draining to host (~2 layers in flight)",
                2 * max_trained * 4,
                GRADS_KIND,
            )
        )
    if ranks > 1:
        lines.append(MemoryLine(NCCL_LINE, NCCL_BUFFER_BYTES, NCCL_KIND))
    if step is None:
        lines.append(
            MemoryLine(
                "reserve for activations, logits, resident params (fixed)",
                reserve_bytes,
                RESERVE_KIND,
            )
        )
        return lines
    # The kept layers are the tier's last ``kept`` (``MemoryPlan.kept_layer_indices``): their
    # attention's saved s x s tensors (sliding-window masks, eager probabilities) are counted
    # per kept layer among the attention lines.
    kept_layers = range(n_hbm - kept, n_hbm) if kept else range(0)
    lines += _activation_lines(shape, step, options, dtype, kept_layers, attention_layers)
    lines.append(slack_line(lines))
    return lines


@functools.lru_cache(maxsize=512)
def _activation_lines(
    shape: ModelShape,
    step: StepShape,
    options: ResolvedOptions,
    dtype: torch.dtype,
    kept_layers: range,
    attention_layers: int,
) -> tuple[MemoryLine, ...]:
    """``activation_lines``, once per distinct argument set: the searches size the tier by
    trying every layer count, and the activations do not depend on it (only on which layers
    keep theirs), so without this a 400-layer plan recomputed them ~10**5 times (43 s)."""
    return tuple(activation_lines(shape, step, options, dtype, kept_layers, attention_layers))


#: fp32 elements of a device update's buffer for widening a compact gradient, per fused AdamW
#: call (the optimizer's; defined here, as the planner imports no optimizer).
DEVICE_WIDEN_NUMEL = 1 << 24


#: The name every plan's device-update staging line starts with (``MemoryPlan.device_updates``).
DEVICE_UPDATE_LINE = "device-update staging"
#: The slowest host AdamW measured on the H200 machine (parameters per second: 2.2-3.8 G per
#: machine start, ``dev/host_update_probe.py``) and the layers' model FLOP rate at 64k-token
#: steps there (~450 T/s): the two rates that decide whether the CPU update keeps up.
HOST_ADAMW_SLOW_PARAMS_PER_S = 2.2e9
GPU_LAYER_FLOPS_PER_S = 450e12


def device_updates_pay(host_numel: int, hbm_numel: int, step: StepShape | None) -> bool:
    """Whether a run stages device updates (``device_update_lead``): where the CPU AdamW of the
    host layers, on the slowest host measured, outlasts the next forward up to the last of them.
    The update starts when the backward ends and overlaps the whole forward (HBM tier first, at
    ~2 x tokens FLOPs per parameter); it falls behind when host_numel / R exceeds
    (host_numel + hbm_numel) x 2 x tokens / F, i.e. when the host tier's share of the layer
    parameters exceeds 2 x tokens x R / F (0.64 at 64k tokens: Qwen2.5-14B's 33 of 48 layers
    stage, Llama-3.1-8B's 18 of 32 do not; none from ~102k tokens on). Measured on the H200: the
    14B at 64k on an update of 8 threads went from 383 to 400 model TFLOP/s; the 8B, whose
    update keeps up, lost 9% to the layers taken over, so it must not stage. The run stages
    what its plan counted (``MemoryPlan.device_updates``)."""
    if step is None or host_numel <= 0:
        return False
    share = host_numel / (host_numel + hbm_numel)
    tokens = step.micro_batch_tokens
    return share > 2 * tokens * HOST_ADAMW_SLOW_PARAMS_PER_S / GPU_LAYER_FLOPS_PER_S


def device_update_line(
    max_host: int, options: ResolvedOptions, dtype: torch.dtype, hidden: int
) -> MemoryLine:
    """The staging of a host layer's update the GPU takes over (``device_update_lead``): fp32
    moments and gradient of the largest host layer, its fp32 master unless fp32-master
    streaming's staging holds it, a widening buffer, and the norm weights' fp32 gradients."""
    grad = itemsize(options.host_grad_dtype(dtype))
    master = 0 if options.stream_fp32_master and dtype != torch.float32 else 4
    per_param = 8 + grad + master
    return MemoryLine(
        f"{DEVICE_UPDATE_LINE} (GPU AdamW of a host layer the CPU falls behind on): largest "
        f"host layer x {per_param} B ({'' if master else 'master in the fp32 staging, '}2 fp32 "
        f"moments, {grad_dtype_label(options.host_grad_dtype(dtype))} grad) + widening buffer",
        per_param * max_host + 4 * DEVICE_WIDEN_NUMEL + 4 * 4 * hidden,
        STREAM_BUFFERS_KIND,
    )


def slack_line(lines: list[MemoryLine]) -> MemoryLine:
    """The plan's margin: the allocator's measured fragmentation plus every line's bytes times
    its kind's largest measured underestimate (``MemoryLine.error``), at least
    ``GPU_SLACK_MIN``. Its name says which lines it covers, and by how much."""
    by_kind: dict[str, int] = {}
    for line in lines:
        if line.margin:
            by_kind[line.kind] = by_kind.get(line.kind, 0) + line.margin
    errors = {line.kind: line.error for line in lines if line.margin}
    covered = ALLOCATOR_FRAGMENTATION + sum(by_kind.values())
    parts = ", ".join(f"{kind} +{errors[kind]:.0%}" for kind in by_kind)
    floor = " (min 1 GiB)" if covered < GPU_SLACK_MIN else ""
    return MemoryLine(
        f"{SLACK_LINE}: fragmentation {ALLOCATOR_FRAGMENTATION / GIB:.1f} GiB + measured "
        f"errors{': ' + parts if parts else ' (none)'}{floor}",
        max(GPU_SLACK_MIN, covered),
        SLACK_KIND,
    )


def host_lines(
    shape: ModelShape,
    step: StepShape | None,
    options: ResolvedOptions,
    dtype: torch.dtype,
    n_hbm: int,
    margin: int,
    input_model_bytes: int = 0,
    ranks: int = 1,
) -> list[MemoryLine]:
    """Host costs. ``ranks`` data-parallel processes of one host share the layer store (masters
    and stream copies in shared memory, each gradient and moment on one owner rank: one store in
    all) but each has its own process, staging ring and offloaded activations."""
    host_grads, stream_master = options.host_grads, options.stream_fp32_master
    grad_dtype = options.host_grad_dtype(dtype)
    host = shape.layer_numels[n_hbm:]
    per_rank = f" x {ranks} ranks" if ranks > 1 else ""
    offload = []
    if step is not None and options.offload_activations:
        b = options.boundary_bytes_per_element
        offload.append(
            MemoryLine(
                f"offloaded boundary activations (pinned, {boundary_dtype_label(options)}): "
                f"tokens x hidden x {b} B x {saved_layers_label(shape, options)}{per_rank}",
                ranks * boundary_activation_bytes(shape, step, options),
            )
        )
    parts = ["fp32 master/2 moments"]
    if host_grads:
        parts.append(f"{grad_dtype_label(grad_dtype)} grad")
    if dtype != torch.float32 and not stream_master:
        parts.append("bf16 copy" if dtype == torch.bfloat16 else "stream copy")
    b = host_bytes_per_param(dtype, host_grads, stream_master, grad_dtype)
    store = dict(hold_grad=host_grads, stream_master=stream_master, grad_dtype=grad_dtype)
    frozen = sum(shape.layer_frozen_numel(i) for i in range(n_hbm, shape.num_layers))
    if frozen:
        f = host_bytes_per_param(dtype, False, stream_master) - 8  # (master + copy only)
        what = f"; frozen params {frozen / 1e9:.2f}B: fp32 master + copy, {f} B/param"
    else:
        what = ""
    lines = offload + [
        MemoryLine(
            f"host-tier layers ({len(host)}): {' + '.join(parts)}, {b} B/param{what}",
            sum(host_layer_bytes(shape, i, dtype, store) for i in range(n_hbm, shape.num_layers)),
        )
    ]
    trained = shape.trained_numels(n_hbm)
    if not host_grads and any(trained):
        lines.append(
            MemoryLine(
                f"pinned grad staging ring: {GRAD_STAGING_SLOTS} x largest host layer x 4 B"
                f"{per_rank}",
                ranks * GRAD_STAGING_SLOTS * 4 * max(trained),
            )
        )
    if input_model_bytes:
        # A model handed over materialized on the host is moved into the store layer by layer,
        # each layer's own tensors freed once copied: the host peaks either before the move
        # (the whole model) or after it (the store plus the not-yet-placed non-layer tensors).
        store = total(lines)
        whole = max(shape.total_numel, 1)
        non_layer = input_model_bytes * shape.non_layer_numel // whole
        lines.append(
            MemoryLine(
                f"model passed in on the host (moved into the store layer by layer){per_rank}",
                ranks * max(non_layer, input_model_bytes - store),
            )
        )
    save = save_line(shape, options, n_hbm)
    if save is not None and input_model_bytes:
        # The input model is moved into the store before the first step, a save comes after:
        # never alive together, so only the part of a save beyond that line adds.
        beyond = max(0, save.nbytes - lines[-1].nbytes)
        save = MemoryLine(f"{save.name}, beyond the line above (not at the same time)", beyond)
    if save is not None and save.nbytes:
        lines.append(save)
    baseline = min(PROCESS_BASELINE, margin)
    return lines + [
        MemoryLine(
            f"process baseline (Python, torch, CUDA context; measured){per_rank}",
            ranks * baseline,
        ),
        MemoryLine(f"{SAFETY_MARGIN_LINE} (headroom, not expected use)", margin - baseline),
    ]


def save_line(shape: ModelShape, options: ResolvedOptions, n_hbm: int) -> MemoryLine | None:
    """The most host RAM a save (a checkpoint, the final model) copies beyond the store, at
    once: the GPU's tensors a shard at a time (or one larger tensor: the embedding's, an
    HBM-tier layer's largest), an HBM-tier layer's moments, the reverted pieces of fused
    weights that are not contiguous (a shard at a time), a bf16 export's rounded copy."""
    shard = size_bytes(options.options.max_shard_size)
    parts: list[tuple[int, str]] = []
    if options.cuda:
        # A shard (or one larger tensor), of no more than the GPU holds.
        on_gpu = 4 * (shape.non_layer_numel + sum(shape.layer_numels[:n_hbm]))
        tensor = shape.vocab_size * shape.hidden_size
        if n_hbm:
            tensor = max(tensor, shape.largest_layer_param_numel)
        largest = min(max(shard, 4 * tensor), on_gpu)
        parts.append((largest, "GPU tensors, a shard at a time"))
        if n_hbm:
            moments = 8 * max(shape.layer_trained_numel(i) for i in range(n_hbm))
            parts.append((moments, "an HBM-tier layer's moments"))
    if shape.save_copy_numel:
        tensor = max(shard, 4 * shape.largest_layer_param_numel)
        parts.append((min(4 * shape.save_copy_numel, tensor), "fused weights' pieces made whole"))
    if options.options.export_dtype == "bfloat16":
        rounded = 2 * shape.total_numel
        parts.append((rounded, "the final model rounded to bf16"))
    if not parts:
        return None
    nbytes, what = max(parts)
    return MemoryLine(f"{SAVE_LINE} (largest: {what})", nbytes)


def host_layer_bytes(shape: ModelShape, i: int, dtype: torch.dtype, store: dict) -> int:
    """Host-store bytes of layer ``i`` in the host tier: its frozen parameters' (a frozen
    store: fp32 master and compute-dtype copy) and the others' (``store``: the trainable
    store's mode, ``layer_store_bytes``' keywords)."""
    n, frozen = shape.layer_numels[i], shape.layer_frozen_numel(i)
    trainable = layer_store_bytes(n - frozen, dtype, True, **store) if n > frozen else 0
    if not frozen:
        return trainable
    return trainable + layer_store_bytes(frozen, dtype, False, stream_master=store["stream_master"])


def pcie_bytes(
    shape: ModelShape,
    step: StepShape | None,
    options: ResolvedOptions,
    dtype: torch.dtype,
    n_hbm: int,
) -> tuple[int, int]:
    """(H2D, D2H) bytes per optimizer step.

    Host layers stream in for the forward and again for the backward recompute of every
    micro-batch. The double buffer still holds the last two host layers when backward starts,
    and after a backward the first two host layers for the next micro-batch's forward (the first
    forward of a step must reload: the optimizer changed the weights). Gradients leave once per
    step.

    Checkpoint segments of k layers: a segment's backward streams its layers but the last for
    the chain, then each layer for its own backward; the last two chain layers are still in the
    double buffer then, so layers 0..k-3 of each segment stream in once more.
    """
    isz = h2d_bytes_per_param(dtype, options.stream_fp32_master)
    host = list(shape.layer_numels[n_hbm:])
    if not host:
        return 0, 0
    ga = step.grad_accum if step is not None else 1
    kept = min(2, len(host))
    saved_backward = sum(host[-kept:]) * isz
    saved_forward = sum(host[:kept]) * isz
    h2d = ga * 2 * sum(host) * isz - ga * saved_backward - (ga - 1) * saved_forward
    k = options.checkpoint_every if step is not None else 1
    n = shape.num_layers
    again = [i for s in range(0, n, k) for i in range(s, min(s + k, n) - 2) if i >= n_hbm]
    h2d += ga * sum(shape.layer_numels[i] for i in again) * isz
    trained = sum(shape.trained_numels(n_hbm))
    return h2d, itemsize(options.host_grad_dtype(dtype)) * trained


def layer_placements(
    shape: ModelShape, options: ResolvedOptions, dtype: torch.dtype, n_hbm: int, n_cast: int
) -> list[LayerPlacement]:
    """Each layer's tier and bytes; ``n_cast``: how many leading HBM-tier layers keep no
    compute-dtype copy."""
    store = dict(
        hold_grad=options.host_grads,
        stream_master=options.stream_fp32_master,
        grad_dtype=options.host_grad_dtype(dtype),
    )
    return [
        LayerPlacement(i, n, HBM, device_layer_bytes(n, dtype, i >= n_cast), 0)
        if i < n_hbm
        else LayerPlacement(i, n, HOST, 0, host_layer_bytes(shape, i, dtype, store))
        for i, n in enumerate(shape.layer_numels)
    ]


__all__ = [
    "ALLOCATOR_FRAGMENTATION",
    "DEFAULT_HOST_MARGIN",
    "GIB",
    "GPU_SLACK_MIN",
    "H200_HBM_BYTES",
    "NCCL_BUFFER_BYTES",
    "NCCL_LINE",
    "PCIE_BYTES_PER_S",
    "PROCESS_BASELINE",
    "SAFETY_MARGIN_LINE",
    "SLACK_LINE",
    "gpu_lines",
    "DEVICE_UPDATE_LINE",
    "GPU_LAYER_FLOPS_PER_S",
    "HOST_ADAMW_SLOW_PARAMS_PER_S",
    "device_update_line",
    "device_updates_pay",
    "h2d_bytes_per_param",
    "grad_dtype_label",
    "host_bytes_per_param",
    "host_layer_bytes",
    "host_lines",
    "layer_placements",
    "pcie_bytes",
    "slack_line",
    "total",
]
