"""The one road to a streamed model's state: (layer layout, options, step) -> stores + engine.

Both the loaders and the trainer reach the engine through :func:`build_streamed_state` (via
``hf.model.prepare_streamed_model``). It decides the HBM tier (the memory plan), refuses what host
RAM cannot hold before allocating anything, allocates each layer's store (handing it to ``fill``
at once, so a materialized model's layer can be released before the next store exists) and builds
the engine with every setting it needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from . import exact_adamw
from .allocator import prefer_expandable_segments
from .distributed import DataParallel
from .host_store import (
    DeviceLayerStore,
    FrozenLayerStore,
    HostStore,
    LayerStore,
    TensorSlot,
    available_host_bytes,
    frozen_layer_bytes,
    layer_store_bytes,
    planned_host_bytes,
)
from .options import EngineOptions, ResolvedOptions, StepShape
from .plan_types import ModelShape, OptionNamer
from .planner import (
    MemoryPlan,
    add_margin_only_advice,
    auto_fit_changes,
    longest_auto_fit_row,
    plan_with_auto_fit,
)
from .streaming import GRAD_STAGING_SLOTS, StreamingEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerLayout:
    """One decoder layer's streamed parameters, as the store lays them out."""

    slots: list[TensorSlot]
    numel: int
    decay_numel: int
    #: Every streamed parameter is trainable (the store keeps optimizer state); False for a
    #: frozen base under LoRA adapters.
    trainable: bool


@dataclass
class StreamedState:
    """What the builder made: the stores (HBM tier first), the engine and the plan behind them."""

    stores: list[LayerStore | DeviceLayerStore]
    engine: StreamingEngine
    n_resident: int
    plan: MemoryPlan | None
    #: The options the state was built with: the caller's, plus the memory options ``auto_fit``
    #: turned on for a planned step that did not fit as asked.
    options: ResolvedOptions | None = None
    #: The options the caller asked for (before ``auto_fit`` and the builder's own changes).
    asked: EngineOptions | None = None


def build_streamed_state(
    layers: Sequence[LayerLayout],
    options: ResolvedOptions,
    device: torch.device | str,
    compute_dtype: torch.dtype,
    *,
    fill: Callable[[int, LayerStore | DeviceLayerStore], None],
    shape: ModelShape | None = None,
    step: StepShape | None = None,
    input_model_bytes: int = 0,
    preserve_rng: bool = False,
    namer: OptionNamer | None = None,
) -> StreamedState:
    """Plan, check, allocate and wire the streamed state of ``layers``.

    ``fill(i, store)`` writes layer ``i``'s initial weights into its new store (or leaves it for a
    checkpoint load). ``shape`` and ``step`` let the plan size activations line by line (else
    ``options.hbm_reserve_gb`` stands for them). ``input_model_bytes``: what the caller holds
    materialized in host RAM meanwhile. ``namer`` spells options in the plan's log and warnings
    as the caller's users write them.
    """
    if compute_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"hf_megatrain: compute dtype {compute_dtype} is not supported; use bf16 or fp32."
        )
    device = torch.device(device)
    asked = options.options
    # Data parallel (several processes launched): layer weights in host memory shared by the
    # ranks, each layer's gradient and moments only on its owner (distributed.py). Set up first,
    # so that "cuda" means this rank's GPU before anything (the planner) touches one.
    dp = DataParallel.from_environment(device)
    if dp is not None and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dp is not None and options.single_backward:
        # The ranks' gradients are averaged in fp32: no compact gradient slots.
        options = replace(options, single_backward=False)
    if device.type == "cuda":
        prefer_expandable_segments()  # before the HBM tier and the stream buffers are allocated
    trainable = [layer.trainable for layer in layers]
    n_resident, plan = resident_layer_count(
        layers, options, device, compute_dtype, shape, step, input_model_bytes, dp, namer
    )
    # Checked only where the plan stages device updates (no start-up work for other runs); where
    # the GPU's AdamW may not take them (logged), planned again: no staging, no stores pinned.
    if plan is not None and plan.device_updates and not exact_adamw.matches_cpu_adamw(device):
        options = options.without_device_updates()
        n_resident, plan = resident_layer_count(
            layers, options, device, compute_dtype, shape, step, input_model_bytes, dp, namer
        )
    if plan is not None and plan.options is not None:
        options = plan.options  # with the memory options auto_fit turned on
    # The HBM tier holds optimizer state: only leading fully trainable layers qualify.
    n_resident = next((i for i, t in enumerate(trainable[:n_resident]) if not t), n_resident)

    host_grads, stream_master = options.host_grads, options.stream_fp32_master
    grad_dtype = options.host_grad_dtype(compute_dtype)
    needed = sum(
        layer_store_bytes(layer.numel, compute_dtype, layer.trainable, hold_grad=host_grads,
                          stream_master=stream_master, grad_dtype=grad_dtype)
        for layer in layers[n_resident:]
    )  # fmt: skip
    shared: list = [None] * len(layers)
    if dp is not None:
        dp.assign_owners([None if i < n_resident else lay.numel for i, lay in enumerate(layers)])
        needed = dp.host_bytes(
            [lay.numel for lay in layers[n_resident:]], trainable[n_resident:], compute_dtype,
            host_grads, stream_master,
        )  # fmt: skip
    if not host_grads and device.type == "cuda":
        # The engine's pinned gradient staging ring (per process).
        staged = [lay.numel for lay in layers[n_resident:] if lay.trainable]
        needed += GRAD_STAGING_SLOTS * 4 * max(staged, default=0)
    if device.type != "cuda" and shape is not None:
        # On a CPU the embeddings, head and norms train in host RAM too: their gradient and
        # AdamW moments (12 B per trained parameter) are still to come (found by an audit: a
        # 150k vocabulary's were left out, and such a run was killed instead of refused).
        needed += 12 * (shape.non_layer_numel - shape.frozen_non_layer_numel)
    # Refuse before allocating anything if host RAM cannot hold the store.
    HostStore.check_fits(needed, options.host_memory_limit_bytes)
    if dp is not None:
        shared = dp.allocate_layer_buffers(
            [None if i < n_resident else lay.numel for i, lay in enumerate(layers)],
            compute_dtype,
            stream_master,
        )

    pin = options.pin_memory and device.type == "cuda"
    # With hbm_cast_weights only the tier's layers that will keep their activations keep a
    # compute-dtype copy (their kept graph holds the weights); the others are cast on use.
    n_kept = options.keep_activation_layers
    if n_kept is None:
        n_kept = plan.kept_layers if plan is not None else 0
    first_kept = n_resident - min(n_kept, n_resident)
    # Device updates (the plan counted their staging): the later half of the host layers, where
    # a CPU update behind the forward falls furthest behind, keep their whole store pinned, so
    # the GPU can copy master and moments in and out of it.
    host_layers = [i for i in range(n_resident, len(layers)) if layers[i].trainable]
    takeover = set()
    if plan is not None and plan.device_updates and dp is None:
        takeover = set(host_layers[len(host_layers) // 2 :])
    stores: list[LayerStore | DeviceLayerStore] = []
    for i, layer in enumerate(layers):
        if i < n_resident:
            # The first layers go to the HBM tier: the forward runs them while the CPU is still
            # updating the streamed ones.
            store = DeviceLayerStore(
                layer.slots, layer.numel, layer.decay_numel, compute_dtype, device,
                compute_copy=not options.hbm_cast_weights or i >= first_kept,
            )  # fmt: skip
        else:
            store = LayerStore(
                layer.slots,
                layer.numel,
                layer.decay_numel,
                compute_dtype,
                pin,
                trainable=layer.trainable,
                shared=shared[i],
                owned=dp is None or dp.owns(i),
                hold_grad=host_grads,
                stream_master=stream_master,
                grad_dtype=grad_dtype,
                pin_update_state=i in takeover,
            )
        fill(i, store)
        stores.append(store)
    if dp is not None:
        dp.barrier()  # every owner has written its layers' initial weights
    engine = StreamingEngine(
        stores,
        device,
        compute_dtype,
        preserve_rng=preserve_rng,
        data_parallel=dp,
        offload_activations=options.offload_activations,
        boundary_dtype=options.boundary_dtype,
        checkpoint_every=options.checkpoint_every,
        recompute_early_stop=options.recompute_early_stop,
        autocast_kernels=options.autocast_kernels,
        chain_attention_outputs=options.chain_attention_layers,
        chain_attention_by_segment=None if plan is None else plan.chain_output_counts,
    )
    return StreamedState(
        stores=stores,
        engine=engine,
        n_resident=n_resident,
        plan=plan,
        options=options,
        asked=asked,
    )


def build_frozen_state(
    layers: Sequence[LayerLayout],
    device: torch.device | str,
    compute_dtype: torch.dtype,
    *,
    fill: Callable[[int, FrozenLayerStore], None],
    pin_memory: bool = True,
    host_memory_limit_bytes: int | None = None,
) -> StreamedState:
    """Streamed state of a model that is never trained (a DPO reference): every layer streams
    from a ``FrozenLayerStore`` (its weights in the compute dtype, no master, gradient or moments).

    No HBM tier and no data parallel sharing: each process holds its own copy. Refuses before
    allocating anything when host RAM cannot hold it; ``fill(i, store)`` writes layer ``i``.
    """
    if compute_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"hf_megatrain: compute dtype {compute_dtype} is not supported; use bf16 or fp32."
        )
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    HostStore.check_fits(
        sum(frozen_layer_bytes(layer.numel, compute_dtype) for layer in layers),
        host_memory_limit_bytes,
    )
    pin = pin_memory and device.type == "cuda"
    stores: list[LayerStore | DeviceLayerStore] = []
    for i, layer in enumerate(layers):
        store = FrozenLayerStore(layer.slots, layer.numel, layer.decay_numel, compute_dtype, pin)
        fill(i, store)
        stores.append(store)
    engine = StreamingEngine(stores, device, compute_dtype)
    return StreamedState(stores=stores, engine=engine, n_resident=0, plan=None)


def device_free_bytes(device: torch.device) -> int:
    """What this process can still allocate on ``device``: the driver's free memory plus the
    blocks PyTorch's caching allocator holds free (reserved, not allocated). The driver alone
    does not count the cache: after an earlier model or tensor of the process was freed, the
    plan saw its memory as taken (two trainers in one notebook, one test after another)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def resident_layer_count(
    layers: Sequence[LayerLayout],
    options: ResolvedOptions,
    device: torch.device,
    compute_dtype: torch.dtype,
    shape: ModelShape | None,
    step: StepShape | None,
    input_model_bytes: int,
    dp: DataParallel | None,
    namer: OptionNamer | None = None,
) -> tuple[int, MemoryPlan | None]:
    """How many leading layers keep their whole state in HBM, and the plan that decided it
    (its ``options``: the ones to build with).

    A count asks for exactly that many; with the step known (on a GPU) it is still planned
    around, so that keep_activations "auto" fills the HBM the count leaves. "auto": the planner's
    choice from the free device memory and available host RAM. The plan's table is logged. A
    planned step that does not fit gets the memory options ``auto_fit`` allows, or is refused
    (``MemoryPlanError``, with what would fit) before anything is allocated.
    """
    n = len(layers)
    asked = options.resident_layers
    if asked == 0 and (step is None or device.type != "cuda"):
        return 0, None
    count = None
    if asked != "auto":
        count = int(asked)
        if count > n:
            raise ValueError(f"hf_megatrain: resident_layers={count} but the model has {n} layers")
        if shape is None or step is None or device.type != "cuda":
            return count, None
    elif device.type != "cuda":
        return 0, None
    free = device_free_bytes(device)
    if shape is not None:
        # What the store holds frozen (a LoRA base: no gradient or moments), layer by layer.
        frozen = tuple(0 if layer.trainable else layer.numel for layer in layers)
        shape = replace(shape, frozen_layer_numels=frozen if any(frozen) else ())
    if shape is None or step is None:
        # Only the layer sizes are known here; the reserve covers everything else.
        shape = ModelShape(
            layer_numels=tuple(layer.numel for layer in layers),
            non_layer_numel=0,
            hidden_size=0,
            vocab_size=0,
            intermediate_size=0,
            name="streamed model",
            frozen_layer_numels=tuple(0 if layer.trainable else layer.numel for layer in layers),
        )
        step = None
    placement = dict(
        hbm_layers=count,
        reserve_bytes=options.hbm_reserve_bytes if step is None else 0,
        input_model_bytes=input_model_bytes,
        ranks=1 if dp is None else dp.local_world_size,  # the ranks sharing this host
    )
    # (Within host_memory_limit_gb where set: the store is then held to it.)
    host = planned_host_bytes(available_host_bytes(), options.host_memory_limit_bytes)
    where = dict(hbm_bytes=free, host_bytes=host, **placement)
    # (The plan's tier takes only the leading trainable layers: ``ModelShape.tier_layers``.)
    plan, as_asked = plan_with_auto_fit(shape, step, options, compute_dtype, **where)
    if step is not None and not plan.fits and options.auto_fit != "off":
        logger.info("hf_megatrain: memory plan (resident_layers=%r)\n%s", asked, plan.table(namer))
        # Nothing auto_fit allows fits: refused before allocating, with what would fit.
        problem = plan.problems[0]
        longest = longest_auto_fit_row(shape, step, options, compute_dtype, multiple=4096, **where)
        rows = step.micro_batch_tokens // step.seq_len
        problem.extend(
            f"The longest rows that fit ({rows} per micro-batch, auto_fit={options.auto_fit!r}): "
            f"{longest} tokens."
            if longest
            else "Not even 4096-token rows fit this way."
        )
        add_margin_only_advice(plan, options, **placement)
        plan.check(namer)
    if as_asked is not None:
        logger.warning(
            "hf_megatrain: the step (%d tokens per micro-batch) does not fit with the memory "
            "options as given; turning on %s (auto_fit=%r: exact options only, unless "
            "'approximate')",
            step.micro_batch_tokens,
            auto_fit_changes(plan, as_asked).render(namer),
            options.auto_fit,
        )
    logger.info("hf_megatrain: memory plan (resident_layers=%r)\n%s", asked, plan.table(namer))
    # Host shortfalls are refused by HostStore.check_fits (which honours the host limit); a GPU
    # shortfall means no layer goes to HBM. With the step known and auto_fit off, the plan may
    # say the activations themselves do not fit: warn now, with what would fit.
    if step is not None:
        for problem in (p for p in plan.problems if p.tier == "gpu"):
            logger.warning(
                "%s (planned before training: it may run out of GPU memory)",
                problem.message(namer),
            )
    return plan.n_hbm, plan


def move_to_host_tier(
    engine: StreamingEngine,
    layers: Sequence[int],
    options: ResolvedOptions,
    release: Callable[[list[int]], None] | None = None,
) -> int:
    """Move HBM-tier ``layers`` (the tier's last ones) into new host stores, between steps:
    fp32 master and AdamW moments copied, the compute-dtype copy re-derived; the engine's
    buffers follow (``StreamingEngine.replace_stores``), after ``release(layers)``, where the
    caller drops its own references to the old stores (``HostAdamW.rebind_layers``). Refuses
    (``InsufficientHostMemoryError``) before allocating when host RAM cannot hold them.
    Returns the device bytes released."""
    stores = engine.stores
    tier = [i for i, s in enumerate(stores) if s.resident]
    layers = sorted(layers)
    if not layers:
        return 0
    if layers != tier[len(tier) - len(layers) :]:
        raise ValueError(
            f"hf_megatrain: layers {layers} are not the HBM tier's last ({tier}): the tier must "
            "stay the leading layers"
        )
    host_grads, stream_master = options.host_grads, options.stream_fp32_master
    grad_dtype = options.host_grad_dtype(engine.compute_dtype)
    HostStore.check_fits(
        sum(
            layer_store_bytes(stores[i].numel, engine.compute_dtype, True, hold_grad=host_grads,
                              stream_master=stream_master, grad_dtype=grad_dtype)
            for i in layers
        ),
        options.host_memory_limit_bytes,
    )  # fmt: skip
    pin = options.pin_memory and engine.is_cuda
    moved: dict[int, LayerStore] = {}
    released = 0
    for i in layers:
        old = stores[i]
        new = LayerStore(
            old.slots, old.numel, old.decay_numel, engine.compute_dtype, pin,
            hold_grad=host_grads, stream_master=stream_master, grad_dtype=grad_dtype,
        )  # fmt: skip
        new.master.copy_(old.master)
        new.exp_avg.copy_(old.exp_avg)
        new.exp_avg_sq.copy_(old.exp_avg_sq)
        new.refresh_stream_copy()
        moved[i] = new
        released += old.device_nbytes
    del old  # the engine and ``release`` drop the other references: the HBM is freed
    engine.replace_stores(moved, release)
    return released


__all__ = [
    "LayerLayout",
    "StreamedState",
    "build_frozen_state",
    "build_streamed_state",
    "move_to_host_tier",
    "resident_layer_count",
]
