"""The memory plan (:class:`MemoryPlan`) and how it is reported: its table, its problems with
their advice, its notes.

:class:`MemoryPlan` lives here, above ``plan_arithmetic`` (its host bytes per parameter, the
safety-margin line) and beside the table it renders, so the planner's modules import in one
direction: ``plan_types`` <- ``activation_memory`` <- ``plan_arithmetic`` and ``memory_options``
<- ``plan_report`` <- ``plan_search`` <- ``planner``.

Problems and notes are :class:`~hf_megatrain.core.plan_types.Message` values: they name engine
options structurally, and the layer that shows them picks the spelling with an
:class:`~hf_megatrain.core.plan_types.OptionNamer` (field names here, training arguments in the
HF layer, flags in ``hf-megatrain plan``). The table's own lines never name an option.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .activation_memory import (
    EAGER_SCORES_KIND,
    MASK_KIND,
    boundary_activation_bytes,
    saved_boundary_layers,
    segment_chain_counts,
)
from .engine.staging import GRAD_STAGING_SLOTS
from .host_store import format_bytes
from .memory_options import BF16_BOUNDARIES, MemoryOptions
from .options import ResolvedOptions, StepShape
from .plan_arithmetic import (
    ALLOCATOR_FRAGMENTATION,
    DEVICE_UPDATE_LINE,
    GIB,
    NON_LAYER_PARAMS_LINE,
    PCIE_BYTES_PER_S,
    SAFETY_MARGIN_LINE,
    SAVE_LINE,
    SLACK_KIND,
    grad_dtype_label,
    host_bytes_per_param,
)
from .plan_types import (
    HBM,
    HOST,
    LayerPlacement,
    MemoryLine,
    MemoryPlanError,
    Message,
    ModelShape,
    OptionChanges,
    OptionNamer,
    last_recomputed,
    option,
    setting,
)


@dataclass
class MemoryPlan:
    """Where each layer's state lives and every GPU and host cost, as named lines."""

    shape: ModelShape
    step: StepShape | None  # None: only a fixed HBM reserve stands for activations
    compute_dtype: torch.dtype
    hbm_available: int
    host_available: int
    layers: list[LayerPlacement]
    gpu_lines: list[MemoryLine]
    host_lines: list[MemoryLine]
    h2d_bytes_per_step: int
    d2h_bytes_per_step: int
    notes: list[Message] = field(default_factory=list)
    problems: list[MemoryPlanError] = field(default_factory=list)
    # The options planned for (None only for plans built by hand).
    options: ResolvedOptions | None = None
    # Host-store mode: gradient slots held until step end (clipping, or eager updates off) or
    # eager updates without them; fp32 masters streamed instead of a compute-dtype copy.
    host_grads: bool = True
    stream_fp32_master: bool = False
    # The gradient slots' dtype: bf16 where one backward of one process makes the gradient.
    host_grad_dtype: torch.dtype = torch.float32
    # The last ``kept_layers`` HBM-tier layers keep their forward activations for backward
    # instead of recomputing the layer (see ``kept_activation_bytes_per_token``).
    kept_layers: int = 0
    # Data-parallel processes of one host the host lines are for (GPU lines: per GPU).
    ranks: int = 1
    # HBM-tier layers that do not keep their activations keep no compute-dtype copy either and
    # are cast from their fp32 master into a stream buffer when they run (16 instead of 18
    # B/param in bf16 runs); the kept ones keep theirs (their graph holds the weights).
    hbm_cast_weights: bool = False
    # Recomputed layers (the last ones) that keep their attention kernel's outputs, and why that
    # many (the table's words; "" when nothing is to be said).
    attention_layers: int = 0
    attention_why: str = ""
    # Set when the plan does not fit: the shortest checkpoint segment length that would make it
    # fit (None: none tried does, or bf16 boundaries already would).
    checkpoint_every_fit: int | None = None
    # Set when the plan does not fit: whether it would with bf16 boundary activations.
    bf16_boundaries_fit: bool = False
    # Set when the plan does not fit: the lightest set of memory options not used yet that would
    # make it fit (``memory_options.lightest_fit``), when neither of the two above is advised.
    options_fit: MemoryOptions | None = None
    # The option changes the advice names (any of the three above), structured.
    advice: OptionChanges | None = None

    @property
    def device_updates(self) -> bool:
        """Whether the plan counts the staging of device updates (``device_update_lead``): the
        run allocates it, and the GPU may take over host-layer updates, only then."""
        return any(line.name.startswith(DEVICE_UPDATE_LINE) for line in self.gpu_lines)

    @property
    def kept_layer_indices(self) -> list[int]:
        return list(range(self.n_hbm - self.kept_layers, self.n_hbm))

    @property
    def attention_layer_indices(self) -> list[int]:
        kept = set(self.kept_layer_indices)
        recomputed = [p.index for p in self.layers if p.index not in kept]
        return last_recomputed(recomputed, self.attention_layers)

    @property
    def chain_output_counts(self) -> dict[int, int]:
        """Per checkpoint segment (its first layer): how many of its chain's last layers keep
        their attention outputs (``activation_memory.segment_chain_counts``; {}: none)."""
        if self.step is None or self.options is None:
            return {}
        return segment_chain_counts(
            self.shape, self.step, self.options, self.compute_dtype, self.kept_layers,
            self.attention_layers,
        )  # fmt: skip

    @property
    def host_bytes_per_param(self) -> int:
        """Host-store bytes per parameter of a trainable host-tier layer (page rounding aside)."""
        return host_bytes_per_param(
            self.compute_dtype, self.host_grads, self.stream_fp32_master, self.host_grad_dtype
        )

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
    def gpu_peak_estimate(self) -> int:
        """The GPU peak the run should reach (torch's max reserved): every GPU line but the
        slack's margin for the estimate lines' measured errors. The allocator's fragmentation,
        which reserved memory includes, stays. ``gpu_total`` is the bound a fit is judged by."""
        slack = sum(line.nbytes for line in self.gpu_lines if line.kind == SLACK_KIND)
        return self.gpu_total - slack + min(slack, ALLOCATOR_FRAGMENTATION)

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
    def host_step_peak_estimate(self) -> int:
        """``host_peak_estimate`` of a run that saves nothing (a benchmark's): without the line
        for a save's copies."""
        save = sum(ln.nbytes for ln in self.host_lines if ln.name.startswith(SAVE_LINE))
        return self.host_peak_estimate - save

    @property
    def fits(self) -> bool:
        return not self.problems

    def check(self, namer: OptionNamer | None = None) -> MemoryPlan:
        """Raise the first problem (GPU before host), its message in ``namer``'s spelling
        (default: option field names); else return self."""
        if self.problems:
            problem = self.problems[0]
            raise problem if namer is None else problem.named(namer)
        return self

    def table(self, namer: OptionNamer | None = None) -> str:
        """The plan as a table; notes and problems name options in ``namer``'s spelling."""
        return render_table(self, namer)


#: When not even every memory option together makes a plan fit.
NOTHING_FITS_ADVICE = (
    "No combination of the memory options (MLP tiles, an HBM tier without bf16 copies, "
    "activation offload, fp32-master streaming, checkpoint segments of up to 8 layers, bf16 "
    "boundaries, no clipping) makes it fit on this machine."
)

#: Problem advice when only the boundary activations' precision stands between a plan and a fit.
BF16_BOUNDARIES_ADVICE = Message.of(
    "With bf16 boundary activations (",
    setting("boundary_dtype", BF16_BOUNDARIES),
    ": each layer's saved input rounded to bf16, half the bytes) this plan fits; the forward is "
    "unchanged, but backward recomputes each layer from the rounded input (relative error "
    "<= 2^-9 per element), so gradients are slightly approximate.",
)


def segment_advice(k: int) -> Message:
    """Problem advice when checkpoint segments of ``k`` layers make the plan fit."""
    return Message.of(
        f"With checkpoint segments of {k} layers (",
        setting("checkpoint_every", k),
        f": one layer in {k} saves its input, the others are recomputed from it in backward, "
        f"{k - 1}/{k} of a layer forward more per layer, exact) this plan fits.",
    )


def options_advice(changes: OptionChanges) -> Message:
    """Problem advice when the option set ``changes`` makes the plan fit."""
    return Message.of("With ", changes.render, " this plan fits.")


def margin_only_advice(fitted: MemoryPlan, options: ResolvedOptions) -> Message:
    """Problem advice when the plan ``fitted`` (exact options over ``options``) fits by its
    expected GPU peak but not by its bound (``plan_search.margin_only_options``)."""
    changes = MemoryOptions.of(fitted.options).changes(MemoryOptions.of(options))
    margin = fitted.gpu_total - fitted.gpu_peak_estimate
    return Message.of(
        "Exact options whose expected GPU peak fits: with ",
        changes.render,
        " and ",
        setting("auto_fit", "off"),
        f" the plan expects {format_bytes(fitted.gpu_peak_estimate)} of the "
        f"{format_bytes(fitted.hbm_available)} free; only its margin for the estimates' worst "
        f"measured errors ({format_bytes(margin)}) does not fit. The plan cannot promise that "
        "run; it may still train.",
    )


def hbm_cast_note(n_cast: int, n_copy: int) -> Message:
    """Note: HBM-tier layers without bf16 copies would put more layers in HBM."""
    return Message.of(
        "with ",
        setting("hbm_cast_weights", True),
        f" (HBM-tier layers without bf16 copies, 16 B/param) {n_cast} layers fit in HBM "
        f"instead of {n_copy}.",
    )


def mode_line(
    dtype: torch.dtype,
    host_grads: bool,
    stream_fp32_master: bool,
    grad_dtype: torch.dtype = torch.float32,
) -> str:
    """The table's line on the host store's bytes per parameter and why."""
    # A compact slot: one backward of one process makes the whole gradient in bf16.
    compact = " (exact: one backward makes it)" if grad_dtype != torch.float32 else ""
    grads = (
        f"{grad_dtype_label(grad_dtype)} grad slot{compact} held until the step's norm is known "
        "(clipping on)"
        if host_grads
        else f"eager updates, no grad slot (grads pass a {GRAD_STAGING_SLOTS}-layer staging ring)"
    )
    weights = (
        "fp32 masters stream (cast on GPU)"
        if stream_fp32_master and dtype != torch.float32
        else "fp32 masters stream"
        if dtype == torch.float32
        else "bf16 stream copy"
    )
    b = host_bytes_per_param(dtype, host_grads, stream_fp32_master, grad_dtype)
    return f"host tier {b} B/param: {grads}; {weights}"


# ==== problems and advice ===========================================================================
def add_problems(plan: MemoryPlan, fixed_gpu_lines: list[MemoryLine]) -> None:
    """The plan's problems (GPU before host), with the advice its flags already carry."""
    gpu_needed = plan.gpu_total
    if gpu_needed > plan.hbm_available:
        what = (
            "even with every layer streamed from host, the GPU part"
            if plan.n_hbm == 0
            else f"with {plan.n_hbm} layers in HBM, the GPU part"
        )
        big = max(fixed_gpu_lines, key=lambda line: line.nbytes)
        # What no step size or option changes: the non-layer parameters' state (HBM-resident).
        params = sum(
            ln.nbytes for ln in fixed_gpu_lines if ln.name.startswith(NON_LAYER_PARAMS_LINE)
        )
        if params > plan.hbm_available:
            advice = Message.of(
                "The non-layer parameters (embedding, LM head, final norm), whose fp32 state "
                f"stays in HBM, alone need {format_bytes(params)}, whatever the step: this model "
                "needs a GPU with more memory."
            )
        elif plan.step is not None:
            advice = Message.of(
                "Use fewer tokens per micro-batch (more gradient accumulation) or a shorter "
                "sequence."
            )
        else:
            advice = Message.of(
                "Lower the HBM reserve (", option("hbm_reserve_gb"), ") or stream every layer."
            )
        plan.problems.append(
            MemoryPlanError(
                Message.of(
                    f"hf_megatrain: {what} needs {format_bytes(gpu_needed)} of GPU memory but "
                    f"only {format_bytes(plan.hbm_available)} is free (largest item: {big.name}, "
                    f"{format_bytes(big.nbytes)}). ",
                    advice,
                    _boundary_advice(plan),
                    _attention_advice(plan),
                ),
                "gpu",
                gpu_needed,
                plan.hbm_available,
                _bf16_changes(plan),
            )
        )
    host_needed = plan.host_total
    # Nothing but the process: its baseline, the margin and a save's copies.
    process_only = not any(
        line.nbytes for line in plan.host_lines[:-2] if not line.name.startswith(SAVE_LINE)
    )
    if host_needed > plan.host_available and process_only:
        # Every layer in HBM, nothing offloaded: the process alone does not fit, which no
        # option changes.
        plan.problems.append(
            MemoryPlanError(
                Message.of(
                    f"hf_megatrain: the process needs {format_bytes(host_needed)} of host RAM "
                    f"(every layer in HBM, none streamed: the process baseline, a save's "
                    f"copies and the {format_bytes(plan.host_lines[-1].nbytes)} margin) but only "
                    f"{format_bytes(plan.host_available)} is available. Use a machine with more "
                    "RAM."
                ),
                "host",
                host_needed,
                plan.host_available,
            )
        )
    elif host_needed > plan.host_available:
        plan.problems.append(
            MemoryPlanError(
                Message.of(
                    f"hf_megatrain: the host store needs {format_bytes(host_needed)} of host RAM "
                    f"({plan.n_host} streamed layers + "
                    f"{format_bytes(plan.host_lines[-1].nbytes)} margin; {plan.n_hbm} layers "
                    f"already moved to HBM, which is full) but only "
                    f"{format_bytes(plan.host_available)} is available. Use a machine with more "
                    "RAM or GPU memory, fewer tokens per micro-batch (frees HBM for layers), "
                    f"{_slimmer_store_advice(plan)}",
                    _boundary_option(plan),
                    "or a smaller model.",
                    _boundary_advice(plan),
                ),
                "host",
                host_needed,
                plan.host_available,
                _bf16_changes(plan),
            )
        )


def _attention_advice(plan: MemoryPlan) -> str:
    """Eager attention's s x s tensors in a plan that does not fit: no memory option shrinks
    them; only another attention implementation or a shorter sequence does."""
    eager = sum(ln.nbytes for ln in plan.gpu_lines if ln.kind in (EAGER_SCORES_KIND, MASK_KIND))
    if plan.shape.attn_implementation != "eager" or not eager:
        return ""
    if plan.shape.attn_softcapping:
        other = (
            "'flash_attention_2' or 'flex_attention' (they apply the logit soft-capping; 'sdpa' "
            "refuses it)"
        )
    else:
        other = "'sdpa' or 'flash_attention_2'"
    return (
        f" Attention runs eager (attn_implementation='eager'): {format_bytes(eager)} of it are "
        "s x s scores and masks, which no memory option shrinks; only another attention "
        f"implementation, {other}, or a shorter sequence does."
    )


def _bf16_changes(plan: MemoryPlan) -> OptionChanges | None:
    return OptionChanges({"boundary_dtype": BF16_BOUNDARIES}) if plan.bf16_boundaries_fit else None


def _boundary_advice(plan: MemoryPlan) -> Message | str:
    return Message.of(" ", BF16_BOUNDARIES_ADVICE) if plan.bf16_boundaries_fit else ""


def _boundary_option(plan: MemoryPlan) -> Message | str:
    """bf16 boundaries as one more host-RAM option, when the activations are offloaded there
    and halving them alone is not enough (else ``_boundary_advice`` says it fits)."""
    step, options = plan.step, plan.options
    if plan.bf16_boundaries_fit or step is None or options is None:
        return ""
    if not options.offload_activations or options.boundary_bytes_per_element <= 2:
        return ""
    saved = boundary_activation_bytes(plan.shape, step, options) // 2
    return Message.of(
        "bf16 boundary activations (",
        setting("boundary_dtype", BF16_BOUNDARIES),
        f": {format_bytes(saved)} less, slightly approximate gradients), ",
    )


def _slimmer_store_advice(plan: MemoryPlan) -> str:
    """The host-store options this plan does not use yet, as advice."""
    out = ""
    if plan.host_grads:
        saved = plan.host_grad_dtype.itemsize
        out += f"no clipping (eager updates keep no host gradient: {saved} B/param less), "
    if not plan.stream_fp32_master and plan.compute_dtype != torch.float32:
        out += "fp32-master streaming (no bf16 copy: 2 B/param less, 2x H2D bytes), "
    return out


def advise(plan: MemoryPlan, changes: OptionChanges, text: Message | str) -> None:
    """Append ``text`` (advice naming ``changes``) to every problem of the plan."""
    plan.advice = changes
    for problem in plan.problems:
        problem.extend(text, changes)


def advise_options(plan: MemoryPlan, found: MemoryOptions, base: MemoryOptions) -> None:
    """The lightest option set ``found`` over ``base`` makes the plan fit: say so."""
    plan.options_fit = found
    changes = found.changes(base)
    advise(plan, changes, options_advice(changes))


def advise_segments(plan: MemoryPlan, k: int) -> None:
    """Checkpoint segments of ``k`` layers make the plan fit: say so."""
    plan.checkpoint_every_fit = k
    advise(plan, OptionChanges({"checkpoint_every": k}), segment_advice(k))


def advise_nothing_fits(plan: MemoryPlan, gpu_fit: OptionChanges | None = None) -> None:
    """No option set fits both tiers. ``gpu_fit``: the lightest that fits the GPU part alone
    (then the host is the tier no option fixes: its problem goes first, the one raised)."""
    if gpu_fit is None:
        for problem in plan.problems:
            problem.extend(NOTHING_FITS_ADVICE)
        return
    plan.problems.sort(key=lambda p: p.tier != "host")
    for problem in plan.problems:
        if problem.tier == "gpu":
            problem.extend(
                Message.of(
                    "With ",
                    gpu_fit.render,
                    " the GPU part fits; the host RAM is what no option makes fit.",
                )
            )
        else:
            problem.extend(NOTHING_FITS_ADVICE)


# ==== notes =========================================================================================
def add_notes(plan: MemoryPlan) -> None:
    step, options = plan.step, plan.options
    k = options.checkpoint_every if options is not None else 1
    if step is not None and k > 1:
        plan.notes.append(
            Message.of(
                f"checkpoint segments of {k} layers: {saved_boundary_layers(plan.shape, options)}"
                f" of {plan.shape.num_layers} layer inputs saved; the others are recomputed in "
                f"backward ({k - 1} extra layer forwards per segment, {k - 1}/{k} of a layer "
                "forward per layer)."
            )
        )
    if step is not None and step.grad_accum > 1 and plan.n_host:
        plan.notes.append(
            Message.of(
                f"grad-accum {step.grad_accum} > 1 keeps an fp32 gradient accumulator of every "
                "host layer on the GPU (4 B/param) until the step's last micro-batch."
            )
        )
    if step is not None:
        plan.notes.append(
            Message.of(
                "the working-set, kept-activation, attention and logit lines estimate framework "
                "temporaries; the slack adds each one's largest measured underestimate "
                "(benchmarks/results/plan_vs_measured.md) to the allocator's fragmentation. "
                "Parameter, buffer and optimizer-state lines are exact."
            )
        )
    else:
        plan.notes.append(
            Message.of(
                "workload unknown: a fixed reserve stands for activations, logits and the "
                "resident non-layer params."
            )
        )
    if plan.n_host and plan.n_hbm == 0 and plan.fits:
        plan.notes.append(
            Message.of("no layer fits in HBM next to the activations; all layers stream.")
        )
    if step is not None and not plan.shape.kept_bytes_audited and not plan.kept_layers:
        plan.notes.append(
            Message.of(
                "kept activations not planned: what this layer family saves for backward is not "
                "audited; a layer count in ",
                option("keep_activations"),
                " keeps some on an estimate.",
            )
        )


# ==== the table =====================================================================================
def _gib(n: int) -> str:
    return f"{n / GIB:9.2f}"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _ranges(indices: list[int]) -> str:
    """Layer indices as runs ("0-11, 14-31"): the recomputed layers keeping attention outputs
    skip the tier's layers that keep their activations."""
    if not indices:
        return "none"
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def render_table(plan: MemoryPlan, namer: OptionNamer | None = None) -> str:
    """The plan as a table; notes and problems spell options with ``namer``."""
    s, step = plan.shape, plan.step
    dt = "bf16" if plan.compute_dtype == torch.bfloat16 else "fp32"
    width = 84
    widths = f", hidden {s.hidden_size}, vocab {s.vocab_size}" if s.hidden_size else ""
    out = [
        f"hf-megatrain memory plan: {s.name} ({_params(s.total_numel)} params, "
        f"{s.num_layers} layers{widths}), {dt} compute",
    ]
    if step is not None:
        out.append(
            f"step: {step.tokens_per_step} tokens = {step.grad_accum} micro-batch(es) of "
            f"{step.micro_batch_tokens} tokens (seq {step.seq_len})"
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
    if plan.attention_layers or plan.attention_why:
        why = f" ({plan.attention_why})" if plan.attention_why else ""
        kept = (
            f"{plan.attention_layers} layers, {_ranges(plan.attention_layer_indices)}"
            if plan.attention_layers
            else "none"
        )
        out.append(f"attention outputs kept for the recompute: {kept}{why}")
    out.append(
        mode_line(
            plan.compute_dtype, plan.host_grads, plan.stream_fp32_master, plan.host_grad_dtype
        )
    )
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
        if lines is plan.gpu_lines:
            expected = "expected peak (the total less the margin for measured errors)"
            out.append(f"  {expected:<{width - 11}}{_gib(plan.gpu_peak_estimate)}")
        out.append(f"  {'available (' + status + ')':<{width - 11}}{_gib(avail)}")
    secs = max(plan.h2d_bytes_per_step, plan.d2h_bytes_per_step) / PCIE_BYTES_PER_S
    out.append("")
    out.append(
        f"PCIe per optimizer step: H2D {plan.h2d_bytes_per_step / 1e9:.2f} GB "
        f"({'fp32 masters' if plan.stream_fp32_master else 'weights'}), "
        f"D2H {plan.d2h_bytes_per_step / 1e9:.2f} GB "
        f"({grad_dtype_label(plan.host_grad_dtype)} grads); "
        f"~{secs:.2f} s at {PCIE_BYTES_PER_S / 1e9:.0f} GB/s per direction"
    )
    for note in plan.notes:
        text = note.render(namer) if isinstance(note, Message) else str(note)
        out.append(f"note: {text}")
    for problem in plan.problems:
        out.append(f"PROBLEM: {problem.message(namer).removeprefix('hf_megatrain: ')}")
    return "\n".join(out)


__all__ = [
    "BF16_BOUNDARIES_ADVICE",
    "MemoryPlan",
    "NOTHING_FITS_ADVICE",
    "add_notes",
    "add_problems",
    "advise",
    "advise_nothing_fits",
    "advise_options",
    "advise_segments",
    "hbm_cast_note",
    "mode_line",
    "options_advice",
    "render_table",
    "segment_advice",
]
