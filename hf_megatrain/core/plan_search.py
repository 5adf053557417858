"""The memory plan's searches: how many layers go to HBM (and keep activations or attention
outputs), what fits on a machine (micro-batch, sequence, model depth), and, for a plan that does
not fit, the lightest set of memory options that would.

Every plan is the arithmetic of ``plan_arithmetic`` on one tier split; the searches only try
splits and option sets. ``plan_report`` words the result.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from itertools import accumulate

import torch

from .memory_options import BF16_BOUNDARIES, MemoryOptions, candidates, lightest_fit
from .options import ALL_LAYERS, ResolvedOptions, StepShape, planned_options
from .plan_arithmetic import (
    DEFAULT_HOST_MARGIN,
    PARAMS_KIND,
    gpu_lines,
    host_lines,
    layer_placements,
    pcie_bytes,
    total,
)
from .plan_report import (
    MemoryPlan,
    add_notes,
    add_problems,
    advise_nothing_fits,
    advise_options,
    advise_segments,
    hbm_cast_note,
    margin_only_advice,
)
from .plan_types import MemoryLine, ModelShape, OptionChanges

#: The engine options (``EngineOptions`` fields) a plan depends on, marked ``planned`` in their
#: metadata (``hf-megatrain plan`` takes each as a flag): the host-store mode and the RAM it may
#: use, the HBM tier (``resident_layers``: the caller's ``hbm_layers``), what shapes activations
#: and the loss, the kernels and attention (through the model shape), the device updates'
#: staging, the ranks sharing a sequence (the step's shard), which options auto_fit may add.
PLANNED_OPTIONS = planned_options()

#: Micro-batch tokens from which "auto" attention outputs take HBM before the tier (see _plan).
ATTENTION_FIRST_TOKENS = 65536

#: Segment lengths the advice tries when a plan does not fit (the shortest that fits is named).
SEGMENT_ADVICE_LENGTHS = (2, 3, 4, 6, 8)


def plan_memory(
    shape: ModelShape,
    step: StepShape | None,
    options: ResolvedOptions,
    compute_dtype: torch.dtype,
    hbm_bytes: int,
    host_bytes: int,
    *,
    hbm_layers: int | None = None,
    reserve_bytes: int = 0,
    input_model_bytes: int = 0,
    ranks: int = 1,
    host_margin_bytes: int = DEFAULT_HOST_MARGIN,
) -> MemoryPlan:
    """Plan the tiers. Never raises for lack of memory: check ``plan.fits`` or call ``check()``.

    Args:
        shape: the model's parameter counts and widths.
        step: the step's token split; ``None`` when unknown (the builder's "auto" before it
            knows the batch): then ``reserve_bytes`` stands for activations, logits and the
            resident non-layer params.
        options: the run's resolved engine options. The planner reads the host-store mode
            (``host_grads``, ``stream_fp32_master``), the HBM tier's (``hbm_cast_weights``,
            ``keep_activation_layers``: a count, or None for as many as the HBM left after the
            tier holds, which needs a ``step``; layer state comes first), and what shapes
            activations (``mlp_tile_tokens``, ``offload_activations``,
            ``boundary_bytes_per_element``, ``checkpoint_every``, ``attention_output_layers``).
        compute_dtype: ``torch.bfloat16`` or ``torch.float32``.
        hbm_bytes: free GPU memory to plan into; host_bytes: available host RAM.
        hbm_layers: force this many leading layers into HBM (default: as many as fit).
        input_model_bytes: bytes of a model handed over materialized on the host (0 for a meta
            skeleton that is loaded or initialized straight into the store).
        ranks: data-parallel processes on this host (one GPU each): the GPU plan is per GPU
            (HBM-tier layers are replicated), the host plan holds the shared store once and
            each rank's own process, staging ring and offloaded activations.
        host_margin_bytes: host RAM kept free (process baseline plus headroom).
    """
    return _plan(
        shape, step, options, compute_dtype, hbm_bytes, host_bytes, hbm_layers=hbm_layers,
        reserve_bytes=reserve_bytes, input_model_bytes=input_model_bytes, ranks=ranks,
        host_margin_bytes=host_margin_bytes, keep=options.keep_activation_layers, advise=True,
    )  # fmt: skip


def _plan(
    shape: ModelShape,
    step: StepShape | None,
    options: ResolvedOptions,
    compute_dtype: torch.dtype,
    hbm_bytes: int,
    host_bytes: int,
    *,
    hbm_layers: int | None,
    reserve_bytes: int,
    input_model_bytes: int,
    ranks: int,
    host_margin_bytes: int,
    keep: int | None,
    advise: bool,
) -> MemoryPlan:
    """``plan_memory`` with the kept-activation count ``keep`` given apart from the options (the
    searches plan without kept activations, which only fill room and never decide a fit), and
    the advice search on or off."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks} must be >= 1")
    if compute_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"compute dtype {compute_dtype} is not supported; use bf16 or fp32")
    n = shape.num_layers

    # Recomputed layers keeping their attention kernel's outputs: asked for as a count (or all),
    # part of sizing the tier; "auto" (None): see ``attention_first`` below.
    attn_ask = options.attention_output_layers if step is not None else 0
    why_none = ""  # why none is kept although asked for (or "auto")
    if attn_ask != 0 and options.boundary_bytes_per_element != 4:
        attn_ask, why_none = 0, "layers with rounded inputs re-run whole"
    elif attn_ask != 0 and not shape.sdpa_attention:
        attn_ask, why_none = 0, "attention does not run through PyTorch SDPA"

    # The order in which the "auto" options take HBM is the measured-fastest one. At micro-batches
    # of ATTENTION_FIRST_TOKENS or more, attention outputs come first, then the HBM tier, then
    # kept activations: Llama-3.1-8B at 64k tokens on one H200 (Liger) trained at 461 model
    # TFLOP/s with 13 tier layers + every recomputed layer's attention outputs, against 451 with
    # the 18 tier layers those bytes would hold instead and 456 with 12 + one layer keeping its
    # activations; 16 tier layers + attention outputs were no faster than 13 (there compute
    # hides the streaming of the other layers, while each attention output saves a kernel run).
    # Below that the tier comes first (a micro-batch too short to hide PCIe and the CPU update)
    # and attention outputs fill what the tier and kept activations leave (measured +0.2% and
    # +1.2% for the 7B at 8k and 16k). "auto" never makes a plan that fits without it not fit:
    # the count planned first is the largest that keeps GPU and host RAM within bounds.
    attention_first = (
        attn_ask is None and step is not None and step.micro_batch_tokens >= ATTENTION_FIRST_TOKENS
    )
    first = 0  # the attention outputs "auto" plans before the tier

    def attn_fixed(kept: int) -> int:
        if attn_ask is None:
            return min(first, n - kept)
        return n - kept if attn_ask == ALL_LAYERS else min(attn_ask, n - kept)

    def gpu(k: int, kept: int = 0, attn: int | None = None) -> list[MemoryLine]:
        return gpu_lines(
            shape, step, options, compute_dtype, k, reserve_bytes, kept, ranks,
            attn_fixed(kept) if attn is None else attn,
        )  # fmt: skip

    if hbm_layers is not None and not 0 <= hbm_layers <= n:
        raise ValueError(f"hbm_layers={hbm_layers} but the model has {n} layers")

    # The tier holds optimizer state: only the leading layers that train join it, a pinned count
    # too (a frozen LoRA base: none; the builder makes the same cut).
    most = shape.tier_layers

    # No line is negative, the non-layer parameters' line (under LoRA the resident adapters'
    # too) changes with neither the tier nor the attention outputs, and a tier layer's own
    # state is at least 16 B/param: a count whose tier state and non-layer parameters alone are
    # over the GPU cannot fit, so the scan below starts under those (the "what fits" search
    # plans shapes of thousands of small layers: minutes otherwise). Once per plan.
    top = most
    if hbm_layers is None:
        non_layer = sum(ln.nbytes for ln in gpu(0, 0, 0) if ln.kind == PARAMS_KIND)
        tier_params = list(accumulate(shape.layer_numels[:most], initial=0))
        top = bisect_right(tier_params, max(hbm_bytes - non_layer, -1) // 16) - 1

    def tier(attn: int) -> int:
        if hbm_layers is not None:
            return min(hbm_layers, most)
        # Largest prefix that fits. Not monotone in k, even where layers are alike: an all-HBM
        # plan drops the stream buffers, the device-update staging goes once the host's share
        # is small enough (``device_updates_pay``) and the host accumulators shrink with it; so
        # try every count instead of stopping at the first miss.
        return next((k for k in range(top, -1, -1) if total(gpu(k, 0, attn)) <= hbm_bytes), 0)

    if attention_first:

        def fits_first(attn: int) -> bool:
            k = tier(attn)  # a smaller tier streams more layers: host RAM must hold them
            host = host_lines(
                shape, step, options, compute_dtype, k, host_margin_bytes, input_model_bytes,
                ranks,
            )  # fmt: skip
            return total(gpu(k, 0, attn)) <= hbm_bytes and total(host) <= host_bytes

        if fits_first(0):
            first = _largest(fits_first, n)
    n_hbm = tier(attn_fixed(0))
    cast = options.hbm_cast_weights and compute_dtype != torch.float32
    if step is None or (keep is None and options.offload_activations):
        kept = 0  # (offload is for runs whose activations do not fit: nothing to keep)
    elif keep is None and not shape.kept_bytes_audited:
        kept = 0
    elif keep is None:
        kept = next((k for k in range(n_hbm, 0, -1) if total(gpu(n_hbm, k)) <= hbm_bytes), 0)
    else:
        if not 0 <= keep <= n_hbm:
            raise ValueError(
                f"hf_megatrain: keep_activations={keep}: only the {n_hbm} HBM-tier layers can "
                "keep their activations"
            )
        kept = keep
    attn = attn_fixed(kept)
    if attn_ask is None:
        # And the HBM still left: more layers keeping them only adds HBM, the largest count.
        attn = max(attn, _largest(lambda a: total(gpu(n_hbm, kept, a)) <= hbm_bytes, n - kept))
    gpu_plan = gpu(n_hbm, kept, attn)
    h2d, d2h = pcie_bytes(shape, step, options, compute_dtype, n_hbm)
    plan = MemoryPlan(
        shape=shape,
        step=step,
        compute_dtype=compute_dtype,
        hbm_available=hbm_bytes,
        host_available=host_bytes,
        layers=layer_placements(shape, options, compute_dtype, n_hbm, n_hbm - kept if cast else 0),
        gpu_lines=gpu_plan,
        host_lines=host_lines(
            shape, step, options, compute_dtype, n_hbm, host_margin_bytes, input_model_bytes, ranks
        ),
        h2d_bytes_per_step=h2d,
        d2h_bytes_per_step=d2h,
        options=options,
        host_grads=options.host_grads,
        host_grad_dtype=options.host_grad_dtype(compute_dtype),
        stream_fp32_master=options.stream_fp32_master,
        kept_layers=kept,
        ranks=ranks,
        hbm_cast_weights=cast,
        attention_layers=attn,
        attention_why=_attention_why(options, step, attn, n - kept, attention_first, why_none),
    )
    fixed_gpu_lines = gpu(0) if hbm_layers is None else gpu_plan
    add_problems(plan, fixed_gpu_lines)
    if not advise:
        return plan

    def replan(other: ResolvedOptions, other_keep: int | None) -> MemoryPlan:
        """The same run and machine with other options, without advice."""
        return _plan(
            shape, step, other, compute_dtype, hbm_bytes, host_bytes, hbm_layers=hbm_layers,
            reserve_bytes=reserve_bytes, input_model_bytes=input_model_bytes, ranks=ranks,
            host_margin_bytes=host_margin_bytes, keep=other_keep, advise=False,
        )  # fmt: skip

    if not plan.problems or step is None:
        add_notes(plan)
        if hbm_layers is None:  # (a forced tier size is not the planner's to second-guess)
            _note_hbm_cast(plan, lambda cast: replan(cast, keep))
        return plan

    def fits_with(other: ResolvedOptions) -> bool:
        # Without kept activations, which never decide a fit.
        return replan(other, 0).fits

    def fits_engine(**changes: object) -> bool:
        engine = options.options.with_(**changes)
        return fits_with(options.resolved_again(engine))

    base = MemoryOptions.of(options)

    def fits_options(o: MemoryOptions) -> bool:
        return fits_with(o.applied(options))

    # Exact, cheap options first: when MLP tiles, the cast HBM tier, activation offload or
    # fp32-master streaming (alone or together) make it fit, that is the advice, before
    # anything approximate (bf16 boundaries) or slower (checkpoint segments) is considered.
    def cheap(o: MemoryOptions) -> bool:
        return (o.checkpoint_every, o.boundary_dtype, o.no_clip) == (
            base.checkpoint_every, base.boundary_dtype, base.no_clip,
        )  # fmt: skip

    exact = lightest_fit(lambda o: cheap(o) and fits_options(o), base, step.micro_batch_tokens)
    if exact is not None:
        advise_options(plan, exact, base)
        add_notes(plan)
        return plan
    if options.boundary_bytes_per_element > 2:
        # Would bf16 boundary activations (half the bytes) make it fit? Then the advice says so.
        plan.bf16_boundaries_fit = fits_engine(boundary_dtype=BF16_BOUNDARIES)
        if plan.bf16_boundaries_fit:
            plan.advice = OptionChanges({"boundary_dtype": BF16_BOUNDARIES})
            plan.problems.clear()
            add_problems(plan, fixed_gpu_lines)
    if not plan.bf16_boundaries_fit:
        # Would checkpoint segments (fewer saved layer inputs) make it fit? The advice says so.
        for k in SEGMENT_ADVICE_LENGTHS:
            if options.checkpoint_every < k < n and fits_engine(checkpoint_every=k):
                advise_segments(plan, k)
                break
    if not plan.bf16_boundaries_fit and plan.checkpoint_every_fit is None:
        # No single option is enough: the lightest combination of those not used yet.
        found = lightest_fit(fits_options, base, step.micro_batch_tokens)
        if found is not None:
            advise_options(plan, found, base)
        else:
            # Both tiers short: where options fit the GPU alone, the host is what nothing
            # fixes, and the refusal names it first.
            def gpu_fits(o: MemoryOptions) -> bool:
                return all(p.tier != "gpu" for p in replan(o.applied(options), 0).problems)

            gpu_only = None
            if any(p.tier == "host" for p in plan.problems):
                gpu_only = lightest_fit(gpu_fits, base, step.micro_batch_tokens)
            advise_nothing_fits(plan, gpu_only.changes(base) if gpu_only is not None else None)
    add_notes(plan)
    return plan


def fitting_options(
    plan: MemoryPlan,
    options: ResolvedOptions,
    *,
    approximate: bool = False,
    **where: int | None,
) -> ResolvedOptions | None:
    """For a planned step that does not fit: ``options`` plus the lightest set of memory options
    it does not use yet that makes the same run fit, or None.

    Only exact options (MLP tiles, the HBM tier without bf16 copies, activation offload,
    fp32-master streaming, checkpoint segments) unless ``approximate`` (then bf16 boundary
    activations too); never gradient clipping off, which changes the training itself.
    ``where``: the plan's own keyword arguments (``plan_memory``'s: ``hbm_layers``, ``ranks``,
    ...)."""
    step = plan.step
    if step is None:
        return None
    fits = _allowed_fit(
        plan.shape, step, options, plan.compute_dtype, plan.hbm_available, plan.host_available,
        approximate, **where,
    )  # fmt: skip
    found = lightest_fit(fits, MemoryOptions.of(options), step.micro_batch_tokens)
    return None if found is None else found.applied(options)


def _allowed_fit(
    shape: ModelShape,
    step: StepShape,
    options: ResolvedOptions,
    dtype: torch.dtype,
    hbm: int,
    host: int,
    approximate: bool,
    **where: int | None,
) -> Callable[[MemoryOptions], bool]:
    """Whether a memory option set over ``options`` is one auto_fit may turn on and fits."""
    base = MemoryOptions.of(options)

    def fits(o: MemoryOptions) -> bool:
        allowed = _auto_fit_allows(o, base, approximate)
        return allowed and _fits(shape, step, o.applied(options), dtype, hbm, host, **where)

    return fits


def _auto_fit_allows(o: MemoryOptions, base: MemoryOptions, approximate: bool) -> bool:
    """Whether auto_fit may run set ``o`` over ``base``: clipping as asked, and boundaries as
    asked unless ``approximate``."""
    return o.no_clip == base.no_clip and (approximate or o.boundary_dtype == base.boundary_dtype)


def fits_allowing_auto_fit(
    shape: ModelShape,
    step: StepShape,
    options: ResolvedOptions,
    dtype: torch.dtype,
    hbm: int,
    host: int,
    ranks: int = 1,
    **where: int | None,
) -> bool:
    """Whether the run fits as asked or with a set of memory options ``options.auto_fit`` may
    turn on (which set does not matter: the heaviest are tried first, the likeliest to fit)."""
    if _fits(shape, step, options, dtype, hbm, host, ranks, **where):
        return True
    if options.auto_fit == "off":
        return False
    fits = _allowed_fit(
        shape, step, options, dtype, hbm, host, options.auto_fit == "approximate", ranks=ranks,
        **where,
    )  # fmt: skip
    heaviest_first = reversed(candidates(MemoryOptions.of(options), step.micro_batch_tokens))
    return any(fits(o) for o in heaviest_first)


def margin_only_options(
    plan: MemoryPlan, options: ResolvedOptions, **where: int | None
) -> MemoryPlan | None:
    """For a planned step that no exact option set fits: the plan with the lightest set of exact
    memory options over ``options`` whose GPU side fits by its expected peak (its bound less the
    margin for the estimate lines' measured errors) and whose host side fits, or None.

    The plan cannot promise such a run (the margin is each kind's worst underestimate measured),
    but it may train: worth naming to a user the plan refuses. ``where``: as for
    :func:`fitting_options`."""
    step = plan.step
    if step is None:
        return None
    base = MemoryOptions.of(options)
    args = dict(
        hbm_layers=None, reserve_bytes=0, input_model_bytes=0, ranks=1,
        host_margin_bytes=DEFAULT_HOST_MARGIN,
    ) | where  # fmt: skip

    def planned(o: MemoryOptions) -> MemoryPlan:
        return _plan(
            plan.shape, step, o.applied(options), plan.compute_dtype, plan.hbm_available,
            plan.host_available, keep=0, advise=False, **args,
        )  # fmt: skip

    def fits_expected(o: MemoryOptions) -> bool:
        if not _auto_fit_allows(o, base, approximate=False):
            return False
        trial = planned(o)
        return (
            trial.gpu_peak_estimate <= trial.hbm_available
            and trial.host_total <= trial.host_available
        )

    found = lightest_fit(fits_expected, base, step.micro_batch_tokens)
    return None if found is None else planned(found)


def plan_every_layer_streamed(
    plan: MemoryPlan, options: ResolvedOptions, memory: MemoryOptions
) -> MemoryPlan:
    """``plan``'s step on its machine with the memory options ``memory`` over ``options``, every
    layer streamed and nothing else held in HBM for speed (no kept activations, attention
    outputs or chain outputs): the run as the out-of-memory watchdog leaves it once it has
    given all those up (``oom_recovery.choose_memory_options`` compares such plans)."""
    bare = options.options.with_(
        keep_activations="off", keep_attention_outputs="off", chain_attention_outputs=0
    )
    return _plan(
        plan.shape, plan.step, memory.applied(options.resolved_again(bare)), plan.compute_dtype,
        plan.hbm_available, plan.host_available, hbm_layers=0, reserve_bytes=0,
        input_model_bytes=0, ranks=1, host_margin_bytes=DEFAULT_HOST_MARGIN, keep=0, advise=False,
    )  # fmt: skip


def add_margin_only_advice(plan: MemoryPlan, options: ResolvedOptions, **where: int | None) -> None:
    """A plan refused although auto_fit is on: its first problem names the exact options that
    fit by its expected peak (:func:`margin_only_options`), when there are some."""
    if plan.fits or options.auto_fit == "off":
        return
    found = margin_only_options(plan, options, **where)
    if found is not None:
        plan.problems[0].extend(margin_only_advice(found, options))


def recompute_flops(plan: MemoryPlan) -> float:
    """The layer FLOPs a planned step runs beyond one forward and one backward: each recomputed
    layer's forward again in backward (the attention kernel not, where its outputs are kept) and
    each checkpoint segment's chain (its layers but the last, forward again; the kernel not
    where the forward or the chain keeps its outputs). Dense layer FLOPs 2 x tokens x
    parameters, causal attention's 2 x tokens x sequence x heads x head_dim (``auto_fit``'s
    speed model: at the lengths it acts, the step is bound by the GPU's compute). The MLP tiles'
    recompute skip (``tiling``) is not counted: it holds for some families only."""
    step, shape, options = plan.step, plan.shape, plan.options
    if step is None:
        return 0.0
    attention = _attention_flops(plan)
    t = step.micro_batch_tokens
    kept = set(plan.kept_layer_indices)
    kept_outputs = set(plan.attention_layer_indices)
    k = max(1, options.checkpoint_every)
    chain = plan.chain_output_counts  # per segment (its first layer)
    total = 0.0
    for i_layer, numel in enumerate(shape.layer_numels):
        if i_layer in kept:
            continue
        dense = 2.0 * t * numel
        total += dense
        total += 0.0 if i_layer in kept_outputs else attention
        if _is_chain_layer(i_layer, k, shape.num_layers):
            first = i_layer - i_layer % k
            last = min(first + k, shape.num_layers) - 1
            chain_kept = i_layer >= last - chain.get(first, 0)
            total += dense + (0.0 if i_layer in kept_outputs or chain_kept else attention)
    return total


def _attention_flops(plan: MemoryPlan) -> float:
    """One layer's causal attention forward (``recompute_flops``'s speed model)."""
    step, shape = plan.step, plan.shape
    if step is None:
        return 0.0
    h = shape.hidden_size
    q = (shape.num_heads * shape.head_dim) if shape.num_heads and shape.head_dim else h
    return 2.0 * step.micro_batch_tokens * step.seq_len * q


def _chain_layers_without_outputs(plan: MemoryPlan) -> int:
    """Layers a segment chain re-runs whose attention outputs the forward does not keep: what
    chain-kept outputs could spare at most (none without segments)."""
    k, n_layers = max(1, plan.options.checkpoint_every), plan.shape.num_layers
    if k <= 1 or not plan.shape.sdpa_attention:
        return 0
    kept = set(plan.attention_layer_indices) | set(plan.kept_layer_indices)
    return sum(1 for i in range(n_layers) if _is_chain_layer(i, k, n_layers) and i not in kept)


def _is_chain_layer(i: int, every: int, n_layers: int) -> bool:
    """Whether layer ``i`` is re-run by its checkpoint segment's chain (segments of ``every``:
    every layer of one but its last)."""
    return every > 1 and i % every != every - 1 and i != n_layers - 1


#: Option sets within this fraction of the least recompute are equal to ``auto_fit``: the
#: lightest of them (``MemoryOptions.cost``) is taken.
RECOMPUTE_TIE = 0.02


def _fastest_fit(plans: list[MemoryPlan], flops: list[float]) -> MemoryPlan:
    """Of fitting plans, lightest first, and their ``recompute_flops``: the lightest whose
    recompute is within ``RECOMPUTE_TIE`` of the least (of one forward and backward's FLOPs)."""
    step = plans[0].step
    scale = 6.0 * step.micro_batch_tokens * sum(plans[0].shape.layer_numels) if step else 1.0
    least = min(flops)
    return next(p for p, f in zip(plans, flops) if f - least <= RECOMPUTE_TIE * scale)


def plan_with_auto_fit(
    shape: ModelShape,
    step: StepShape | None,
    options: ResolvedOptions,
    compute_dtype: torch.dtype,
    hbm_bytes: int,
    host_bytes: int,
    **where: int | None,
) -> tuple[MemoryPlan, MemoryPlan | None]:
    """``plan_memory`` with ``options.auto_fit`` applied: a planned step that does not fit as
    asked is planned again with the lightest set of memory options it allows
    (:func:`fitting_options`). Returns the plan to run (its ``options``: what to build with) and,
    when auto_fit changed the options, the plan as asked (else None). A plan that still does not
    fit is returned as is: ``check()`` raises its problem, with what would fit.

    The device updates' staging only speeds up a slow host: a step that fits in no way auto_fit
    allows with it is planned without it (``device_update_lead`` 0 in its options, and a note)
    before it is refused."""
    plan, as_asked = _auto_fitted(
        shape, step, options, compute_dtype, hbm_bytes, host_bytes, **where
    )
    if plan.fits or not plan.device_updates:
        return plan, as_asked
    bare = options.without_device_updates()
    plan_bare, as_asked_bare = _auto_fitted(
        shape, step, bare, compute_dtype, hbm_bytes, host_bytes, **where
    )
    if not plan_bare.fits:
        return plan, as_asked
    plan_bare.notes.append(
        f"without the device updates' staging (device_update_lead={options.device_update_lead} "
        "asked): the step fits only without it"
    )
    return plan_bare, as_asked_bare


def _auto_fitted(
    shape: ModelShape, step: StepShape | None, options: ResolvedOptions, *machine, **where
) -> tuple[MemoryPlan, MemoryPlan | None]:
    """:func:`plan_with_auto_fit` with the options' device updates as they are (``machine``:
    its compute dtype, HBM and host bytes)."""
    compute_dtype, hbm_bytes, host_bytes = machine
    plan = plan_memory(shape, step, options, compute_dtype, hbm_bytes, host_bytes, **where)
    if step is None or plan.fits or options.auto_fit == "off":
        return plan, None
    approximate = options.auto_fit == "approximate"
    fitted = fitting_options(plan, options, approximate=approximate, **where)
    if fitted is None:
        return plan, None
    # Every fitting set, lightest first, segments it turns on with their chains' outputs; the one
    # with the least recompute runs (within a tie).
    base, lightest = MemoryOptions.of(options), MemoryOptions.of(fitted)
    args = dict(
        hbm_layers=None, reserve_bytes=0, input_model_bytes=0, ranks=1,
        host_margin_bytes=DEFAULT_HOST_MARGIN,
    ) | where  # fmt: skip

    def replan(ro: ResolvedOptions) -> MemoryPlan:  # (no advice: only whether it fits, and how)
        return _plan(
            shape, step, ro, compute_dtype, hbm_bytes, host_bytes,
            keep=ro.keep_activation_layers, advise=False, **args,
        )  # fmt: skip

    fits = []
    for o in candidates(base, step.micro_batch_tokens):
        lighter = o.cost(base) < lightest.cost(base)  # (lighter ones do not fit)
        if lighter or not _auto_fit_allows(o, base, approximate):
            continue
        trial = replan(o.applied(options))
        if trial.fits:
            fits.append(trial)
    # Segments auto_fit turns on keep their chains' outputs too: searched where that could beat
    # the least recompute found (each such output spares at most one attention forward).
    flops = [recompute_flops(p) for p in fits]
    least = min(flops, default=0.0)
    bound = [
        f - _chain_layers_without_outputs(p) * _attention_flops(p) for p, f in zip(fits, flops)
    ]
    for i in sorted(range(len(fits)), key=bound.__getitem__):
        if bound[i] >= least:
            break
        if fits[i].options.checkpoint_every != base.checkpoint_every:
            fits[i], flops[i] = _with_chain_outputs(fits[i], flops[i], replan)
            least = min(least, flops[i])
    chosen = _fastest_fit(fits, flops) if fits else None
    options_to_run = fitted if chosen is None else chosen.options
    return plan_memory(
        shape, step, options_to_run, compute_dtype, hbm_bytes, host_bytes, **where
    ), plan


def _with_chain_outputs(
    chosen: MemoryPlan, flops: float, replan: Callable[[ResolvedOptions], MemoryPlan]
) -> tuple[MemoryPlan, float]:
    """Segments auto_fit turned on or lengthened: unless ``chain_attention_outputs`` is set,
    their chains also keep the attention outputs of as many of their layers as cut the
    recompute most while the step still fits (identical gradients; they may crowd out
    forward-kept outputs, which save more each, so the count is chosen by ``recompute_flops``,
    not the most that fit). ``flops``: ``chosen``'s recompute; returns the plan and its."""
    options = chosen.options
    if options is None or not chosen.shape.sdpa_attention or options.chain_attention_outputs:
        return chosen, flops
    if not _chain_layers_without_outputs(chosen):
        return chosen, flops  # (the chains read the forward's outputs: nothing to keep)
    best, least = chosen, flops
    for n in range(1, options.checkpoint_every):
        trial = replan(options.resolved_again(options.options.with_(chain_attention_outputs=n)))
        if trial.options is None or trial.options.chain_attention_layers != n:
            break  # (the early-stop recompute off or inputs saved rounded: no chain outputs)
        if not trial.fits:
            break  # (more outputs hold more at the peak)
        trial_flops = recompute_flops(trial)
        if trial_flops < least:
            best, least = trial, trial_flops
    return best, least


def longest_auto_fit_row(
    shape: ModelShape,
    step: StepShape,
    options: ResolvedOptions,
    compute_dtype: torch.dtype,
    hbm_bytes: int,
    host_bytes: int,
    *,
    multiple: int = 1024,
    **where: int | None,
) -> int:
    """The longest row (a multiple of ``multiple`` tokens, the step's rows per micro-batch and
    accumulation kept) that fits with what ``options.auto_fit`` may turn on; 0 if none."""
    rows = max(1, step.micro_batch_tokens // step.seq_len)

    def fits(k: int) -> bool:  # (whether some allowed set fits; which one runs does not matter)
        seq = k * multiple
        trial = StepShape(seq, seq * rows, step.grad_accum)
        return fits_allowing_auto_fit(
            shape, trial, options, compute_dtype, hbm_bytes, host_bytes, **where
        )

    return _largest(fits, max(1, step.seq_len // multiple)) * multiple


def auto_fit_changes(fitted: MemoryPlan, asked: MemoryPlan) -> OptionChanges:
    """The memory options auto_fit turned on (``plan_with_auto_fit``'s two plans), with the
    segment chains' kept attention outputs where it chose some."""
    changes = MemoryOptions.of(fitted.options).changes(MemoryOptions.of(asked.options))
    chain = fitted.options.options.chain_attention_outputs
    if chain == asked.options.options.chain_attention_outputs:
        return changes
    return OptionChanges(
        {**changes.options, "chain_attention_outputs": chain}, changes.clipping_off
    )


def _attention_why(
    options: ResolvedOptions,
    step: StepShape | None,
    attn: int,
    recomputed: int,
    first: bool,
    why_none: str,
) -> str:
    """Why the plan keeps ``attn`` of the ``recomputed`` layers' attention outputs (the table's
    words: no option names)."""
    if step is None:
        return ""
    if why_none:
        return why_none
    if options.attention_output_layers is not None:
        return "as asked" if attn else ""
    if first:
        limit = "every recomputed layer" if attn == recomputed else "as many as HBM and RAM hold"
        return (
            f"auto, {limit}; planned before the HBM tier: at micro-batches of "
            f"{ATTENTION_FIRST_TOKENS} tokens or more they save more time than HBM-tier layers"
        )
    return (
        f"auto, in the HBM the tier and kept activations leave (micro-batches under "
        f"{ATTENTION_FIRST_TOKENS} tokens: the tier first)"
    )


def _note_hbm_cast(plan: MemoryPlan, replan: Callable[[ResolvedOptions], MemoryPlan]) -> None:
    """A plan that fits with some layers streamed, HBM-tier layers with bf16 copies: say when
    the tier without them (16 instead of 18 B/param) would hold more layers. ``replan``: the
    same run with other options."""
    options = plan.options
    if options is None or not plan.fits or not plan.n_host:
        return
    if plan.hbm_cast_weights or plan.compute_dtype == torch.float32:
        return
    cast = options.options.with_(hbm_cast_weights=True)
    alt = replan(options.resolved_again(cast))
    if alt.fits and alt.n_hbm > plan.n_hbm:
        plan.notes.append(hbm_cast_note(alt.n_hbm, plan.n_hbm))


# ==== what fits =====================================================================================
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


def _fits(
    shape: ModelShape,
    step: StepShape,
    options: ResolvedOptions,
    dtype: torch.dtype,
    hbm: int,
    host: int,
    ranks: int = 1,
    *,
    hbm_layers: int | None = None,
    reserve_bytes: int = 0,
    input_model_bytes: int = 0,
    host_margin_bytes: int = DEFAULT_HOST_MARGIN,
    keep: int = 0,
) -> bool:
    """Whether the run fits (``plan_memory``'s arguments; no advice searched) with ``keep``
    layers keeping their activations: 0 but where the run pins a count (``_pinned``), as
    kept activations "auto" only fill the HBM a plan leaves and never decide what fits."""
    try:
        plan = _plan(
            shape, step, options, dtype, hbm, host, hbm_layers=hbm_layers,
            reserve_bytes=reserve_bytes, input_model_bytes=input_model_bytes, ranks=ranks,
            host_margin_bytes=host_margin_bytes, keep=keep, advise=False,
        )  # fmt: skip
    except ValueError:
        if not keep:
            raise
        return False  # (fewer tier layers than the count: the run is refused)
    if not plan.fits and plan.device_updates:  # (training drops the staging where it must)
        bare = options.without_device_updates()
        return _fits(
            shape, step, bare, dtype, hbm, host, ranks, hbm_layers=hbm_layers,
            reserve_bytes=reserve_bytes, input_model_bytes=input_model_bytes,
            host_margin_bytes=host_margin_bytes, keep=keep,
        )  # fmt: skip
    return plan.fits


def max_micro_batch_sequences(
    shape: ModelShape,
    seq_len: int,
    grad_accum: int,
    options: ResolvedOptions,
    compute_dtype: torch.dtype,
    hbm_bytes: int,
    host_bytes: int,
    ranks: int = 1,
    *,
    limit: int = 1 << 20,
    allow_auto_fit: bool = False,
    hbm_layers: int | None = None,
) -> int:
    """Most sequences of ``seq_len`` per micro-batch that fit (0: not even one); with
    ``allow_auto_fit``, with whatever options ``options.auto_fit`` may turn on. ``hbm_layers``:
    the HBM tier the run pins (``plan_memory``'s); a kept-activation count it pins is
    ``options``'."""
    fits = fits_allowing_auto_fit if allow_auto_fit else _fits
    pinned = _pinned(options, hbm_layers)
    return _largest(
        lambda m: fits(
            shape, StepShape(seq_len, m * seq_len, grad_accum), options, compute_dtype,
            hbm_bytes, host_bytes, ranks, **pinned,
        ),
        limit,
    )  # fmt: skip


def _pinned(options: ResolvedOptions, hbm_layers: int | None) -> dict[str, int | None]:
    """What the searches of what fits plan with as the run pins it, as training would: the HBM
    tier's layer count and the count of them keeping their activations."""
    return dict(hbm_layers=hbm_layers, keep=options.keep_activation_layers or 0)


def max_seq_len(
    shape: ModelShape,
    grad_accum: int,
    options: ResolvedOptions,
    compute_dtype: torch.dtype,
    hbm_bytes: int,
    host_bytes: int,
    ranks: int = 1,
    *,
    multiple: int = 1024,
    limit: int = 1 << 26,
    allow_auto_fit: bool = False,
    hbm_layers: int | None = None,
) -> int:
    """Longest sequence (a multiple of ``multiple``, one per micro-batch) that fits; 0 if none;
    ``allow_auto_fit``, ``hbm_layers``: as for :func:`max_micro_batch_sequences`."""
    fits = fits_allowing_auto_fit if allow_auto_fit else _fits
    pinned = _pinned(options, hbm_layers)
    m = _largest(
        lambda k: fits(
            shape, StepShape(k * multiple, k * multiple, grad_accum), options, compute_dtype,
            hbm_bytes, host_bytes, ranks, **pinned,
        ),
        limit // multiple,
    )  # fmt: skip
    return m * multiple


def max_num_layers(
    shape: ModelShape,
    step: StepShape,
    options: ResolvedOptions,
    compute_dtype: torch.dtype,
    hbm_bytes: int,
    host_bytes: int,
    ranks: int = 1,
    *,
    limit: int = 4096,
    allow_auto_fit: bool = False,
    hbm_layers: int | None = None,
) -> int:
    """Most layers of this family's layer shape that fit (same widths, vocab, step);
    ``allow_auto_fit``, ``hbm_layers``: as for :func:`max_micro_batch_sequences` (a model with
    fewer layers than the run pins to its tier or keeping activations is refused: the count is
    searched from there)."""
    fits = fits_allowing_auto_fit if allow_auto_fit else _fits
    pinned = _pinned(options, hbm_layers)
    least = max(hbm_layers or 0, pinned["keep"])
    return _largest(
        lambda n: fits(
            shape.with_num_layers(max(n, least)), step, options, compute_dtype, hbm_bytes,
            host_bytes, ranks, **pinned,
        ),
        limit,
    )  # fmt: skip


__all__ = [
    "ATTENTION_FIRST_TOKENS",
    "PLANNED_OPTIONS",
    "SEGMENT_ADVICE_LENGTHS",
    "auto_fit_changes",
    "add_margin_only_advice",
    "fits_allowing_auto_fit",
    "fitting_options",
    "margin_only_options",
    "longest_auto_fit_row",
    "max_micro_batch_sequences",
    "max_num_layers",
    "max_seq_len",
    "plan_every_layer_streamed",
    "plan_memory",
    "plan_with_auto_fit",
    "recompute_flops",
]
