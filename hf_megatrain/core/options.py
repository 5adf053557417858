"""Every engine knob, once: :class:`EngineOptions`, and the step shape, :class:`StepShape`.

``EngineOptions`` is the single source of each knob's name, type, default, help text and
validation. Everything else is a projection of it: ``MegaTrainArguments`` gets one training
argument per field (``hf/arguments.py``), the ``hf-megatrain`` CLI, ``plan``, the benchmarks and
the recipes get one command-line flag per field (``option_flags.py``), recipe YAML keys are the
field names. A new knob is a new field here, its use, and its test.

Rules that combine knobs with each other or with the run (gradient clipping, the device) live in
one place, :meth:`EngineOptions.resolve`, which returns :class:`ResolvedOptions`: the concrete
values the builder, planner, engine and optimizer use.

No ``transformers`` import here, and no argument or flag names: messages name option fields
and the upper layers translate them into their own spelling.
"""

from __future__ import annotations

import functools
import math
import typing
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

import torch


class OptionError(ValueError):
    """An engine option has an invalid value; the message names the option field."""


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": " ".join(text.split()), **extra}


#: The prefix of every option's name as a training argument (``megatrain_checkpoint_every``; the
#: HF layer's ``MegaTrainArguments``); messages written for the Trainer use it.
ARGUMENT_PREFIX = "megatrain_"

#: ``boundary_dtype`` spellings: the saved layer input kept as is, or rounded to bf16.
BOUNDARY_DTYPES: dict[str, torch.dtype | None] = {
    "input": None,
    "float32": None,
    "fp32": None,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

#: ``export_dtype`` values: the dtype of the final model's floating-point tensors on disk.
EXPORT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

#: ``layer_kernels`` values: the fastest fused kernels that apply, Liger-Kernel's, ones built by
#: torch.compile, PyTorch's eager ops.
LAYER_KERNELS = ("auto", "liger", "compiled", "torch")

#: ``attention`` values: switch the model's attention to FlexAttention where it avoids s x s
#: tensors or applies what SDPA cannot (``hf/attention.py``), or keep the model's.
ATTENTION_CHOICES = ("auto", "model")

#: ``auto_fit`` values: which memory options a run that does not fit may turn on by itself.
AUTO_FIT_MODES = ("exact", "approximate", "off")

#: ``nonfinite`` values: skip the step's update, or stop the run.
NONFINITE_POLICIES = ("skip", "stop")

#: ``ResolvedOptions.attention_output_layers``: every recomputed layer.
ALL_LAYERS = -1


@dataclass(frozen=True)
class EngineOptions:
    """The streaming engine's options: memory tiers, recompute, long context, host store, logs.

    Field metadata: ``help`` (shown by every generated parser); optionally ``choices``,
    ``bare_value`` (the value of a bare command-line switch) and ``run_time`` (the option acts
    while training, not when the model is streamed: a model streamed earlier takes it from the
    trainer's arguments) and ``planned`` (the memory plan depends on it: ``hf-megatrain plan``
    takes it as a flag). Values are checked on construction (:class:`OptionError` naming the
    field); cross-option and run-level rules are applied by :meth:`resolve`.
    """

    # ---- host store ---------------------------------------------------------------------------
    pin_memory: bool = field(
        default=True,
        metadata=_help(
            """Register the host store's PCIe-facing buffers (stream copy, gradients) as pinned
            memory when CUDA is present, so copies run at full PCIe bandwidth and overlap compute.
            Turn off only to debug."""
        ),
    )
    host_memory_limit_gb: float | None = field(
        default=None,
        metadata=_help(
            """Host RAM (GiB) the host store may use. Default: what the OS reports as available
            (MemAvailable, capped by a cgroup limit). The run is refused before any allocation
            when the store does not fit.""",
            planned=True,
        ),
    )
    max_shard_size: str = field(
        default="2GB",
        metadata=_help(
            """Largest safetensors shard written by save_model and checkpoints (e.g. 2GB, 500MB,
            1GiB); also of the resident optimizer state's files. Shards are serialized one at a
            time, each copying its GPU tensors to the host, so this (or the largest tensor, the
            embedding's, where larger) bounds the extra host RAM a save needs; the plan's host
            side counts it.""",
            run_time=True,
        ),
    )
    export_dtype: str = field(
        default="float32",
        metadata=_help(
            """dtype of the final model written by save_model (and by hf-megatrain train's
            output folder); config.json records it. 'float32' (default) writes the fp32 masters
            as they are, the trained weights exactly; 'bfloat16' writes them rounded to bf16,
            half the bytes on disk (the rounded copy, 2 bytes/param, is held in host RAM while
            the save runs). Checkpoints written for resuming (checkpoint-N) always keep the
            fp32 masters, so a resume stays bit-exact.""",
            choices=tuple(EXPORT_DTYPES),
            run_time=True,
        ),
    )
    stream_fp32_master: bool = field(
        default=False,
        metadata=_help(
            """bf16 runs: keep no bf16 copy of host-tier layers in host RAM; stream the fp32
            master (twice the H2D bytes) into an fp32 GPU staging buffer and cast it to bf16 on
            the GPU's copy stream. 2 bytes/param less host RAM, for when host RAM, not PCIe, is
            the limit. Same weights: the cast rounds exactly as the host copy does. No effect in
            fp32 runs.""",
            planned=True,
        ),
    )
    host_grads: bool | None = field(
        default=None,
        metadata=_help(
            """Keep an fp32 gradient slot (4 bytes/param) in every host-tier layer store. Default
            (None): only when the update needs the step's gradients held, i.e. with gradient
            clipping on or eager_update off; with eager updates each layer's final gradient passes
            through a ring of 2 pinned staging buffers into its CPU update instead (14 instead of
            18 bytes/param in bf16 runs). True: always keep it. False: never (refused with
            clipping on or eager_update off).""",
            planned=True,
        ),
    )
    compact_host_grads: bool = field(
        default=True,
        metadata=_help(
            """bf16 runs whose optimizer step takes its gradients from one backward pass of one
            process (gradient accumulation 1, no data parallel): the host-tier gradient slot
            holds bf16, 2 instead of 4 bytes/param (and half the D2H bytes). Exact: that backward
            computes each layer's gradient in bf16, so the slot holds it bit for bit; the update
            widens it to fp32 as it reads it. Runs that accumulate or reduce gradients in fp32
            keep fp32 slots. False: always fp32 slots.""",
            planned=True,
        ),
    )
    # ---- HBM tier -----------------------------------------------------------------------------
    resident_layers: str = field(
        # "auto" by default: layers in HBM skip PCIe and the CPU update; every measured headline
        # run used the tier (bench.py's megatrain-hbm). On a CPU it is 0, as it always was.
        default="auto",
        metadata=_help(
            """Decoder layers whose whole state (fp32 master, AdamW moments, grad, compute copy:
            18 bytes/param in bf16 runs) lives in HBM instead of host RAM; they never cross PCIe
            and update with the fused GPU AdamW. 'auto' (default) for as many as fit on a GPU
            (none on a CPU): the memory planner sizes activations, loss and resident embeddings
            for the micro-batch (batch size x plan_seq_len tokens), or, when that length is
            unknown, reserves hbm_reserve_gb for them. An integer for that many; 0 streams
            every layer.""",
            bool_values=("0", "auto"),
            planned=True,
        ),
    )
    plan_seq_len: int | None = field(
        default=None,
        metadata=_help(
            """Tokens per training row that the memory plan (resident_layers 'auto' or a count)
            sizes activations for. Default: the length of the first training example (its
            input_ids) when the dataset is indexable; otherwise hbm_reserve_gb is used."""
        ),
    )
    hbm_reserve_gb: float = field(
        default=48.0,
        metadata=_help(
            """HBM (GiB) kept free for activations, logits and resident embeddings when
            resident_layers is 'auto' and the row length is unknown (see plan_seq_len)."""
        ),
    )
    hbm_cast_weights: bool = field(
        default=False,
        metadata=_help(
            """bf16 runs: HBM-tier layers keep no bf16 copy of their weights, only the fp32
            master, gradient and moments (16 instead of 18 bytes/param, what stock training
            keeps), so more layers fit in HBM; each is cast from its master into a stream buffer
            on the GPU's copy stream when it runs. Same weights. The tier's layers that keep their
            activations (keep_activations) keep their bf16 copy. No effect in fp32 runs.""",
            planned=True,
        ),
    )
    keep_activations: str = field(
        default="auto",
        metadata=_help(
            """HBM-tier layers that keep their forward activations for backward instead of saving
            only their input and recomputing the layer (identical results, no recompute). 'auto':
            as many as the HBM left after the layer tier holds (needs the memory plan: a known
            row length and a GPU; the last layers of the tier are chosen), else none. An integer:
            that many (at most the HBM-tier layer count). 'off' or 0: recompute every layer.
            Streamed layers always recompute: their GPU buffer is reused by the next layer.""",
            bool_values=("off", "auto"),
            planned=True,
        ),
    )
    keep_attention_outputs: str = field(
        default="auto",
        metadata=_help(
            """Layers recomputed in backward that keep the fused attention kernel's outputs (SDPA's
            output and log-sum-exp) from forward, so their recompute does not run attention's
            forward again: identical gradients, heads x head_dim compute-dtype values plus 4 B per
            head per token and layer in HBM. 'auto' (default): as many of the last recomputed
            layers as the memory plan has HBM for (planned before the HBM tier at micro-batches
            of 64k tokens or more, where they are worth more than tier layers; after the tier and
            kept activations below that); none without a plan (CPU, unknown row length) or with
            attention outside SDPA. 'off'; 'all' (every recomputed layer); or a count (the last N
            recomputed layers). Needs recompute_early_stop; attention that does not run through
            PyTorch SDPA's fused kernels is recomputed as before.""",
            # Given without a value (a bare command-line switch), the option means every layer.
            bare_value="all",
            bool_values=("off", "all"),
            planned=True,
        ),
    )
    # ---- recompute and long context -----------------------------------------------------------
    recompute_early_stop: bool = field(
        default=True,
        metadata=_help(
            """A recomputed layer re-runs in backward only until the last tensor its backward
            needs is re-made, as torch's checkpointing does: the MLP's down projection and the
            residual add are not run twice. Identical gradients either way; False re-runs the
            whole layer (for comparisons). Layers whose inputs are saved rounded (boundary_dtype
            bfloat16) always re-run whole.""",
            planned=True,
        ),
    )
    autocast_kernels: bool = field(
        default=True,
        metadata=_help(
            """bf16 runs: the layers' autocast work in fewer, vectorized kernels, bitwise the
            same: a linear's fp32 input is cast to bf16 once per tensor (not once per linear,
            as autocast does for q/k/v and gate/up), each cast's gradient is widened back to
            fp32 and each fp32 + bf16 residual add is made by one vectorized Triton kernel
            (PyTorch's dtype-converting kernels are not vectorized). False: autocast and
            PyTorch's kernels as they are (for comparisons).""",
            planned=True,
        ),
    )
    checkpoint_every: int = field(
        default=1,
        metadata=_help(
            """Checkpoint segments of k decoder layers (k >= 1; 1 = off): only the first layer of
            each run of k saves its residual-stream input; the others get theirs in backward by
            re-running the segment's forward from it. Memory: ceil(layers / k) saved inputs
            instead of one per layer, plus up to k - 1 fp32 layer inputs in HBM during a segment's
            backward. Compute: (k - 1) / k of a layer forward more per layer. Exact.""",
            planned=True,
        ),
    )
    chain_attention_outputs: int = field(
        default=0,
        metadata=_help(
            """With checkpoint segments (checkpoint_every > 1): the chain that re-makes a
            segment's inputs in backward runs its layers' attention again; keep the fused SDPA
            kernel's outputs of up to this many of them (the last ones, whose backward comes
            first) for their own recompute, which then skips the kernel. Identical gradients;
            HBM while the segment's backward runs: heads x head_dim compute-dtype values plus 4 B
            per head per token and kept layer. For long sequences, where attention dominates
            (at most checkpoint_every - 1 count). 0: off. Needs recompute_early_stop and inputs
            saved as they are (boundary_dtype input); attention outside PyTorch SDPA's fused
            kernels is recomputed as before. With activation offload (fp32 boundaries) this sets
            the step's peak, and segments whose backward holds less (no forward-kept outputs
            alive yet) keep more, up to all their chain layers, under that peak. Where auto_fit
            turns on or lengthens segments and this is 0, it picks the count (the least
            recompute that fits).""",
            planned=True,
        ),
    )
    mlp_tile_tokens: int = field(
        default=0,
        metadata=_help(
            """Run each decoder layer's dense MLP in tiles of this many tokens of the
            micro-batch (its rows' tokens in order; forward and backward recompute), so its
            (tokens x intermediate) intermediates exist for one tile at a time: for long
            sequences or large micro-batches. 0 = off.""",
            planned=True,
        ),
    )
    offload_activations: bool = field(
        default=False,
        metadata=_help(
            """Keep each decoder layer's saved input (the boundary hidden states) in pinned host
            memory instead of HBM between forward and backward; backward prefetches layer i-1's
            input while layer i recomputes. For sequences whose boundary activations do not fit
            in HBM.""",
            planned=True,
        ),
    )
    auto_fit: str = field(
        default="exact",
        metadata=_help(
            """When the memory plan of the step (known on a GPU with a known row length) does
            not fit: 'exact' (default) turns on the set of exact memory options that makes it
            fit with the least recompute (MLP tiles, hbm_cast_weights, activation offload,
            fp32-master streaming, checkpoint segments and their chains' kept attention
            outputs; the same results, some more time; the lightest of near-equals) and logs
            what it chose; 'approximate' may also save
            boundary activations rounded to bf16; 'off' trains with the options as given
            (warning that it may run out of memory). When
            nothing allowed fits, the run is refused before anything is allocated, with what
            would fit.""",
            choices=AUTO_FIT_MODES,
            bool_values=("off", "exact"),
            planned=True,
        ),
    )
    oom_recovery: bool = field(
        default=True,
        metadata=_help(
            """When a training step runs out of GPU memory anyway: free the step, make room (the
            HBM-tier layers' kept activations and attention outputs first, then HBM-tier layers
            moved to the host tier), log it in one line and run the step again from its first
            micro-batch with the same data and random state (same results). An evaluation batch
            or the optimizer step that runs out moves HBM-tier layers and runs again the same
            way, or stops with what to do where a redo would apply an update twice. Off: the
            error propagates.""",
            run_time=True,
        ),
    )
    boundary_dtype: str = field(
        default="input",
        metadata=_help(
            """Precision of each decoder layer's saved input (the residual stream kept for the
            backward recompute). 'input' (or 'float32'): kept as is, exact. 'bfloat16': saved
            rounded to bf16 (half the bytes in HBM, or in host RAM and over PCIe with
            offload_activations); the forward and the loss are unchanged, but backward recomputes
            each layer from its rounded input, so gradients are approximate (1e-3 to 3e-3
            relative). No effect on inputs already in bf16.""",
            choices=tuple(BOUNDARY_DTYPES),
            planned=True,
        ),
    )
    sequence_parallel: int = field(
        default=1,
        metadata=_help(
            """Ranks that share one sequence (Ulysses sequence parallelism, DeepSpeed's
            implementation; pip install deepspeed): each of N consecutive ranks holds seq_len / N
            tokens of every layer's activations, and attention all-to-alls heads across them
            (query and key/value heads divisible by N, or N divisible by the key/value heads;
            SDPA or flash attention, no sliding window). The launch's processes must be a
            multiple of N; the groups of N are data parallel to each other. 1 = off.""",
            run_time=True,
            planned=True,
        ),
    )
    fused_loss: bool = field(
        default=True,
        metadata=_help(
            """In training, fuse the LM head with the cross-entropy and process tokens in chunks so
            full logits never exist (exact loss and gradients, HF's num_items_in_batch
            semantics). Applies to the families whose loss is cross-entropy over the LM head (an
            MoE family's router aux loss added as its forward adds it); evaluation uses the
            model's own forward.""",
            run_time=True,
            planned=True,
        ),
    )
    fused_loss_kernel: bool = field(
        default=True,
        metadata=_help(
            """bf16 runs on CUDA: each chunk of the fused loss turns its logits into the token
            losses and the rounded logit gradient in one Triton kernel (two reads and one write
            of the logits instead of about seven passes over fp32 copies); the same arithmetic
            per logit, the row sums reduced in another order. Not with a logit soft-cap (Gemma).
            False: PyTorch's ops (for comparisons).""",
            run_time=True,
        ),
    )
    layer_kernels: str = field(
        default="auto",
        metadata=_help(
            """Kernels of the decoder layers' RMSNorm, RoPE and SwiGLU. 'auto' (default), on
            CUDA: for the llama, mistral, qwen2 and qwen3 families Liger-Kernel's fused Triton
            kernels when the liger_kernel package is installed (pip install
            'hf_megatrain[liger]'), else the same three fused by torch.compile (Inductor,
            compiled on the first step), also for any family whose every layer norm and MLP
            they reproduce exactly (Granite, SmolLM3, Seed-OSS, EXAONE 4, Hunyuan); PyTorch's
            eager ops otherwise. The memory plan counts
            what the fused kernels save. 'liger': Liger's, for any family Liger-Kernel patches
            (an error without the package or CUDA); the Trainer's use_liger_kernel=True asks for
            this too. 'compiled': the torch.compile'd ones for any family, on the modules whose
            arithmetic they reproduce (probed when applied; also on the CPU, slow to build
            there). 'torch': neither. Fused kernels round at other points than PyTorch's eager
            ops (bf16-level differences), like the stock Trainer's use_liger_kernel.""",
            choices=LAYER_KERNELS,
            planned=True,
        ),
    )
    attention: str = field(
        default="auto",
        metadata=_help(
            """Attention implementation of the decoder layers. 'auto' (default), on a CUDA
            device: a model running 'sdpa' or 'eager' attention is switched to PyTorch's
            FlexAttention ('flex_attention', compiled by torch.compile on the first step) where
            that is exact or avoids s x s tensors: soft-capped attention logits (Gemma-2: SDPA
            cannot apply the cap, eager attention materializes every layer's s x s scores),
            sliding-window layers with rows at least as long as the window (SDPA would attend
            through an s x s mask; FlexAttention skips the blocks outside the window), or a
            class without SDPA (eager's s x s scores). Only where the model class supports
            FlexAttention, heads are at least 16 wide and attention dropout is off. Kept on a
            CPU (FlexAttention has no CPU backward), under sequence parallelism, and when the
            model was given another implementation (e.g. 'flash_attention_2'). The memory plan
            counts the chosen implementation; one log line says which and why. 'model': always
            the model's own implementation.""",
            choices=ATTENTION_CHOICES,
            planned=True,
        ),
    )
    loss_chunk_tokens: int | None = field(
        default=None,
        metadata=_help(
            """Tokens per chunk of the fused loss. Default: about 2 GiB of fp32 logits per chunk
            (3.5k tokens at a 152k vocabulary).""",
            run_time=True,
            planned=True,
        ),
    )
    # ---- optimizer ----------------------------------------------------------------------------
    overlap_optimizer: bool | None = field(
        default=None,
        metadata=_help(
            """Run the host AdamW update of step t on a CPU thread while step t+1's forward runs;
            layer i streams in as soon as its update is done. Exact (same arithmetic, same order
            per layer). Default: on with CUDA, off on CPU.""",
            run_time=True,
            planned=True,
        ),
    )
    host_update_threads: int = field(
        default=0,
        metadata=_help(
            """CPU threads of the host AdamW update when it runs beside the GPU work (the
            overlapped or eager update). 0: torch's intra-op thread count. Lower it to leave
            cores to other work (data loading workers): the update is bound by host memory
            bandwidth, so a few threads fewer cost little (on the H200 host, 15 threads of 16
            trained the 8B and 14B at 64k as fast, within the noise).""",
            run_time=True,
        ),
    )
    device_update_lead: int = field(
        default=2,
        metadata=_help(
            """For a host whose CPU AdamW is slower than the forward it overlaps (where
            ``host_update_wait_s`` stays above zero): the GPU updates the host layers the CPU
            has not started within this many layers ahead of the forward; 0: never. Their fp32
            master, moments and gradient cross PCIe into a staging buffer (HBM: 12-14 B per
            parameter of the largest host layer), a GPU AdamW that rounds exactly as the CPU's
            updates them (checked against it at start-up; where it does not, device updates
            stay off, logged), and master and moments go back: the same training whichever
            device updated a layer. Only where the plan counts the staging (the host tier's
            share of the layer parameters outruns the forward); the later half of the host
            layers qualifies, their stores pinned whole at start-up. On an 8-thread update it
            took the 14B at 64k from 383 to 400 model TFLOP/s. CUDA, one process, gradient
            clipping on.""",
            run_time=True,
            planned=True,
        ),
    )
    eager_update: bool = field(
        default=True,
        metadata=_help(
            """With gradient clipping off, update each layer as soon as its gradient of the step is
            final, during the backward of the layers below it (nothing waits for a global norm).
            Same arithmetic as the update after backward.""",
            run_time=True,
            planned=True,
        ),
    )
    # ---- resume -------------------------------------------------------------------------------
    resume_without_optimizer_state: bool = field(
        default=False,
        metadata=_help(
            """Resuming from a checkpoint that lacks its optimizer state (AdamW moments) or its
            learning-rate scheduler state is an error naming the missing file: a resume must
            continue the same run. True resumes anyway, with the moments at zero and the schedule
            restarted, and says so in the log.""",
            run_time=True,
        ),
    )
    # ---- non-finite values ----------------------------------------------------------------------
    nonfinite: str = field(
        default="skip",
        metadata=_help(
            """What a training step with a non-finite (NaN or inf) loss or gradient norm does.
            'skip': the step's update is not applied (weights, AdamW moments and step counts of
            every tier untouched, its gradients dropped, the learning-rate schedule not advanced,
            as for a mixed-precision overflow), counted in the logs (nonfinite_skipped) with one
            warning; nonfinite_max_skips such steps in a row stop the run with an error. 'stop':
            the first one stops the run with an error naming the step and what was non-finite.
            A non-finite loss is caught before its backward. With eager updates (no clipping)
            each layer's gradient is checked before its update: a layer found non-finite after
            other layers of the step already updated stops the run whatever this option says
            (a consistent skip is impossible then).""",
            choices=NONFINITE_POLICIES,
            run_time=True,
        ),
    )
    nonfinite_max_skips: int = field(
        default=3,
        metadata=_help(
            """With nonfinite 'skip': this many consecutive skipped steps stop the run with an
            error (a run that keeps producing NaN has diverged). At least 1.""",
            run_time=True,
        ),
    )
    # ---- logs ---------------------------------------------------------------------------------
    log_throughput: bool = field(
        default=True,
        metadata=_help(
            """Add tokens_per_s, model_tflops (6 * active params * tokens/s: an MoE's top-k
            experts), mfu (with causal attention FLOPs within each layer's window, on CUDA),
            host_rss_gib / host_peak_gib and hbm_peak_gib to the training logs.""",
            run_time=True,
        ),
    )
    peak_tflops: float = field(
        default=989.0,
        metadata=_help(
            """Dense bf16 peak of the GPU in TFLOP/s, the denominator of the logged MFU (989 =
            H100/H200 SXM datasheet).""",
            run_time=True,
        ),
    )

    def __post_init__(self) -> None:
        # Values coming from YAML or argparse may be ints for "str" knobs (resident_layers: 4).
        for name in ("layer_kernels", "attention"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, getattr(self, name).strip().lower())
        for name in ("resident_layers", "keep_activations", "keep_attention_outputs", "auto_fit"):
            value = option_value(name, getattr(self, name))
            object.__setattr__(self, name, str(value).strip().lower())
        _check_types(self)
        _check_values(self)

    # ---- projections ---------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def run_time_fields(cls) -> tuple[str, ...]:
        """Options read while training (the others are fixed when the model is streamed)."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("run_time"))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every option's default, by field name."""
        return {f.name: f.default for f in fields(cls)}

    def changed(self, base: EngineOptions | None = None) -> dict[str, Any]:
        """The options whose value differs from ``base`` (default: the defaults)."""
        base = base if base is not None else EngineOptions()
        return {
            n: getattr(self, n) for n in self.field_names() if getattr(self, n) != getattr(base, n)
        }

    def with_(self, **changes: Any) -> EngineOptions:
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)

    # ---- the derived rules ---------------------------------------------------------------------
    def resolve(
        self, *, clipping: bool, cuda: bool, single_backward: bool = False
    ) -> ResolvedOptions:
        """The concrete settings for a run that clips gradients (``clipping``) on a CUDA device
        (``cuda``) or not; ``single_backward``: each optimizer step's gradients come from one
        backward pass of one process (gradient accumulation 1, no data parallel). Raises
        :class:`OptionError` for combinations that cannot run."""
        eager = not clipping and self.eager_update
        if self.host_grads is None:
            host_grads = not eager
        elif not self.host_grads and not eager:
            why = (
                "the run clips gradients: every layer's gradient must be held until the global "
                "norm is known"
                if clipping
                else "eager_update=False: the update after backward reads every layer's held "
                "gradient"
            )
            raise OptionError(
                f"host_grads=False needs eager layer updates, but {why}. Turn clipping off with "
                "eager_update on, or leave host_grads unset."
            )
        else:
            host_grads = self.host_grads
        attention = parse_attention_layers(self.keep_attention_outputs)
        boundary = parse_boundary_dtype(self.boundary_dtype)
        return ResolvedOptions(
            options=self,
            clipping=clipping,
            cuda=cuda,
            eager_update=eager,
            host_grads=host_grads,
            single_backward=single_backward,
            overlap_optimizer=cuda if self.overlap_optimizer is None else self.overlap_optimizer,
            boundary_dtype=boundary,
            # Layers that re-run whole (no early stop) keep nothing of their attention.
            attention_output_layers=attention if self.recompute_early_stop else 0,
            keep_activation_layers=parse_keep_activations(self.keep_activations),
            resident_layers=parse_resident_layers(self.resident_layers),
        )


@functools.cache
def _engine_field_set() -> frozenset[str]:
    """EngineOptions' field names, once: ``ResolvedOptions`` reads raw options through them
    (the planner's searches do so tens of thousands of times a second)."""
    return frozenset(EngineOptions.field_names())


@dataclass(frozen=True)
class ResolvedOptions:
    """:class:`EngineOptions` with every derived rule applied, for one run."""

    options: EngineOptions
    clipping: bool
    cuda: bool
    #: Layers update during backward as their gradient becomes final (no clipping).
    eager_update: bool
    #: Host-tier stores hold a gradient slot.
    host_grads: bool
    #: Each optimizer step's gradients come from one backward pass of one process.
    single_backward: bool
    overlap_optimizer: bool
    #: Saved residual-stream inputs rounded to this dtype (None: kept as they are).
    boundary_dtype: torch.dtype | None
    #: Recomputed layers keeping attention outputs: a count, ``ALL_LAYERS``, None for the plan's.
    attention_output_layers: int | None
    #: HBM-tier layers keeping their activations: a count, None for the plan's ("auto").
    keep_activation_layers: int | None
    #: HBM-tier layers: a count, or "auto" for the plan's.
    resident_layers: int | str

    def __getattr__(self, name: str) -> Any:
        # Every raw option reads through (``resolved.mlp_tile_tokens``); derived ones above win.
        if name != "options" and name in _engine_field_set():
            return getattr(self.options, name)
        raise AttributeError(name)

    @property
    def compact_host_grads(self) -> bool:
        """The host gradient slots hold the compute dtype (see :meth:`host_grad_dtype`): the
        option, where the run holds gradients and each step is one backward of one process."""
        return self.host_grads and self.single_backward and self.options.compact_host_grads

    def host_grad_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the host-tier gradient slots: the compute dtype where one backward of
        one process makes the whole gradient in it (bf16 runs, ``compact_host_grads``), so the
        slot holds it exactly; fp32 where gradients are accumulated or reduced in fp32."""
        if self.compact_host_grads and compute_dtype.itemsize < 4:
            return compute_dtype
        return torch.float32

    def resolved_again(
        self, engine: EngineOptions, *, clipping: bool | None = None
    ) -> ResolvedOptions:
        """``engine`` resolved for this run (its device and backward; ``clipping`` if given)."""
        return engine.resolve(
            clipping=self.clipping if clipping is None else clipping,
            cuda=self.cuda,
            single_backward=self.single_backward,
        )

    def without_device_updates(self) -> ResolvedOptions:
        """This run with ``device_update_lead`` 0 (no staging planned, no stores pinned)."""
        return self.resolved_again(self.options.with_(device_update_lead=0))

    @property
    def chain_attention_layers(self) -> int:
        """Layers of a checkpoint segment's chain whose attention outputs its backward keeps
        (``chain_attention_outputs``, at most ``checkpoint_every - 1``): none without segments,
        without the early-stop recompute or with inputs saved rounded (layers re-run whole)."""
        k = self.options.checkpoint_every
        if k <= 1 or not self.options.recompute_early_stop or self.boundary_dtype is not None:
            return 0
        return min(self.options.chain_attention_outputs, k - 1)

    @property
    def device_updates_possible(self) -> bool:
        """Whether this run could let the GPU take over host-layer updates: CUDA, an update
        after backward that overlaps the next forward (clipping, no eager updates). Data
        parallel turns them off in the engine."""
        return self.cuda and self.overlap_optimizer and not self.eager_update

    @property
    def device_updates(self) -> bool:
        """The GPU may take over host-layer updates the overlapped CPU update has not reached
        (``device_update_lead`` above 0, where ``device_updates_possible``)."""
        return self.device_updates_possible and self.options.device_update_lead > 0

    @property
    def boundary_bytes_per_element(self) -> int:
        """Bytes per element of a saved fp32 boundary activation (2 when rounded to bf16)."""
        return 4 if self.boundary_dtype is None else self.boundary_dtype.itemsize

    @property
    def host_memory_limit_bytes(self) -> int | None:
        gb = self.options.host_memory_limit_gb
        return None if gb is None else int(gb * 2**30)

    @property
    def hbm_reserve_bytes(self) -> int:
        return int(self.options.hbm_reserve_gb * 2**30)


@dataclass(frozen=True)
class StepShape:
    """One optimizer step: ``grad_accum`` micro-batches of ``micro_batch_tokens`` tokens, in
    sequences of ``seq_len`` tokens."""

    seq_len: int
    micro_batch_tokens: int
    grad_accum: int = 1

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch_tokens", "grad_accum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OptionError(f"{name}={value!r} must be an integer >= 1")

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch_tokens * self.grad_accum

    @classmethod
    def from_step(
        cls,
        seq_len: int,
        tokens_per_step: int,
        micro_batch_tokens: int | None = None,
        grad_accum: int | None = None,
    ) -> StepShape:
        """Resolve the split of a step; by default the whole step is one micro-batch."""
        if seq_len < 2 or tokens_per_step < 1:
            # (A sequence of one token has no next token to predict: no loss; found by an
            # audit, where train refused it and plan did not.)
            raise OptionError("seq_len must be at least 2 and tokens_per_step at least 1")
        if micro_batch_tokens is not None and micro_batch_tokens < 1:
            raise OptionError("micro_batch_tokens must be at least 1")
        if grad_accum is not None and grad_accum < 1:
            raise OptionError("grad_accum must be at least 1")
        if micro_batch_tokens is None:
            ga = grad_accum or 1
            if tokens_per_step % ga:
                raise OptionError(
                    f"tokens_per_step {tokens_per_step} does not split into {ga} micro-batches"
                )
            micro_batch_tokens = tokens_per_step // ga
        if tokens_per_step % micro_batch_tokens:
            raise OptionError(
                f"tokens_per_step {tokens_per_step} is not a multiple of micro_batch_tokens "
                f"{micro_batch_tokens}"
            )
        ga = tokens_per_step // micro_batch_tokens
        if grad_accum is not None and grad_accum != ga:
            raise OptionError(
                f"grad_accum {grad_accum} x micro_batch_tokens {micro_batch_tokens} != "
                f"tokens_per_step {tokens_per_step}"
            )
        if micro_batch_tokens < seq_len:
            raise OptionError(
                f"a micro-batch of {micro_batch_tokens} tokens (tokens_per_step / grad_accum) is "
                f"shorter than one sequence of seq_len {seq_len}: raise tokens_per_step to at "
                "least seq_len"
            )
        if micro_batch_tokens % seq_len:
            raise OptionError(
                f"a micro-batch of {micro_batch_tokens} tokens (tokens_per_step / grad_accum) is "
                f"not a whole number of sequences of seq_len {seq_len}"
            )
        return cls(seq_len=seq_len, micro_batch_tokens=micro_batch_tokens, grad_accum=ga)


# ---- parsing of the str-valued knobs ------------------------------------------------------------
def parse_attention_layers(value: object) -> int | None:
    """``keep_attention_outputs`` as a layer count: "off" 0, "all" ``ALL_LAYERS``, "auto" None."""
    text = str(value).strip().lower()
    named = {"off": 0, "false": 0, "none": 0, "": 0, "all": ALL_LAYERS, "true": ALL_LAYERS}
    if text == "auto":
        return None
    if text in named:
        return named[text]
    if text.isdigit():
        return int(text)
    raise OptionError(
        f"keep_attention_outputs={value!r}: use 'off', 'all', 'auto' or a layer count"
    )


def parse_keep_activations(value: object) -> int | None:
    """``keep_activations`` as a layer count ("off" 0), or None for "auto"."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if text in ("off", "none", "false", ""):
        return 0
    if text.isdigit():
        return int(text)
    raise OptionError(f"keep_activations={value!r}: use 'auto', 'off' or a layer count >= 0")


def parse_resident_layers(value: object) -> int | str:
    """``resident_layers`` as a count, or "auto"."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if text.isdigit():
        return int(text)
    raise OptionError(f"resident_layers={value!r} is neither an integer >= 0 nor 'auto'")


def parse_boundary_dtype(value: object) -> torch.dtype | None:
    """``boundary_dtype`` (a name of ``BOUNDARY_DTYPES`` or a dtype) as the dtype saved inputs
    are rounded to, or None (kept as they are)."""
    if value is None or value == torch.float32:
        return None
    if value == torch.bfloat16:
        return torch.bfloat16
    if isinstance(value, str) and value.lower() in BOUNDARY_DTYPES:
        return BOUNDARY_DTYPES[value.lower()]
    raise OptionError(
        f"boundary_dtype={value!r} is not one of {', '.join(BOUNDARY_DTYPES)} ('input' and "
        "'float32' keep the saved layer inputs as they are, 'bfloat16' rounds them)"
    )


# ---- validation ---------------------------------------------------------------------------------
def field_types() -> dict[str, Any]:
    """Each option's type, evaluated (``bool | None`` etc.), for generated parsers."""
    return typing.get_type_hints(EngineOptions)


#: How config files (YAML 1.1 reads on/off/yes/no as booleans) and JSON write a switch.
_BOOL_WORDS = {"true": True, "on": True, "yes": True, "false": False, "off": False, "no": False}


def switch_value(value: Any) -> bool | None:
    """A switch as a config file writes it (a boolean, or true/false, on/off, yes/no in any
    case); None where ``value`` is none of those."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _BOOL_WORDS.get(value.strip().lower())
    return None


def value_type(hint: Any) -> type:
    """An option's type without its None: ``int | None`` -> ``int``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def option_value(name: str, value: Any) -> Any:
    """``value`` for option ``name`` as a config file (YAML, JSON) or a caller writes it, in the
    option's type: numbers written as text (YAML reads ``3e-4`` as a string), an integral float
    for an int, a word for a switch, a number for a text option (``resident_layers: 4``) and a
    boolean for a text option that has a value meaning off and one meaning on
    (``auto_fit: off``, which YAML reads as False). One conversion for every front door (recipe
    files, ``options_from_mapping``, the Python API); the checks that follow say what is wrong."""
    if value is None:
        return None
    field_ = next(f for f in fields(EngineOptions) if f.name == name)
    kind = value_type(field_types()[name])
    if kind is bool:
        on = switch_value(value)
        return value if on is None else on
    if kind in (int, float):
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            return value  # (refused by the type check, naming the option)
        try:
            number = float(value)
        except ValueError:
            raise OptionError(f"{name}={value!r} must be {kind.__name__}") from None
        if kind is int:
            if not number.is_integer():
                raise OptionError(f"{name}={value!r} must be an integer")
            return int(number)
        return number if isinstance(value, str) else value
    if isinstance(value, bool):
        words = field_.metadata.get("bool_values")
        if words is None:
            choices = field_.metadata.get("choices")
            said = f"one of {', '.join(choices)}" if choices else "its value as text"
            raise OptionError(f"{name}={value!r} is a switch's value: give {said}")
        return words[value]
    if isinstance(value, (int, float)):
        return str(value)
    return value


def _check_types(opts: EngineOptions) -> None:
    for name, hint in field_types().items():
        value = getattr(opts, name)
        allowed = typing.get_args(hint) if typing.get_origin(hint) is not None else (hint,)
        if value is None and type(None) in allowed:
            continue
        if bool in allowed:
            ok = isinstance(value, bool)
        elif int in allowed:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif float in allowed:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok:
                object.__setattr__(opts, name, float(value))
        else:
            ok = isinstance(value, str)
        if not ok:
            want = " or ".join(getattr(t, "__name__", str(t)) for t in allowed)
            raise OptionError(f"{name}={value!r} must be {want}")


def _check_values(opts: EngineOptions) -> None:
    if opts.host_memory_limit_gb is not None and not (
        math.isfinite(opts.host_memory_limit_gb) and opts.host_memory_limit_gb > 0
    ):
        raise OptionError(
            f"host_memory_limit_gb={opts.host_memory_limit_gb!r} must be a positive number of GiB"
        )
    if not (math.isfinite(opts.hbm_reserve_gb) and opts.hbm_reserve_gb >= 0):
        raise OptionError(f"hbm_reserve_gb={opts.hbm_reserve_gb!r} must be >= 0")
    if not (math.isfinite(opts.peak_tflops) and opts.peak_tflops > 0):
        raise OptionError(f"peak_tflops={opts.peak_tflops!r} must be a positive number")
    if opts.checkpoint_every < 1:
        raise OptionError(
            f"checkpoint_every={opts.checkpoint_every} must be an integer >= 1 (1 saves every "
            "decoder layer's input; k > 1 saves every k-th and recomputes the rest)"
        )
    if opts.chain_attention_outputs < 0:
        raise OptionError(
            f"chain_attention_outputs={opts.chain_attention_outputs} must be an integer >= 0 "
            "(0: off; N: keep the attention outputs of up to N layers of a segment's chain)"
        )
    if opts.sequence_parallel < 1:
        raise OptionError(
            f"sequence_parallel={opts.sequence_parallel} must be an integer >= 1 (1: off; N: "
            "N ranks share each sequence)"
        )
    if opts.mlp_tile_tokens < 0:
        raise OptionError(f"mlp_tile_tokens={opts.mlp_tile_tokens} must be >= 0 (0: off)")
    if opts.host_update_threads < 0:
        raise OptionError(
            f"host_update_threads={opts.host_update_threads} must be >= 0 (0: torch's intra-op "
            "thread count)"
        )
    if opts.device_update_lead < 0:
        raise OptionError(
            f"device_update_lead={opts.device_update_lead} must be >= 0 (0: the CPU updates "
            "every host layer)"
        )
    for name in ("plan_seq_len", "loss_chunk_tokens"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            raise OptionError(f"{name}={value} must be >= 1 (or unset)")
    if opts.nonfinite not in NONFINITE_POLICIES:
        raise OptionError(
            f"nonfinite={opts.nonfinite!r} must be one of {', '.join(NONFINITE_POLICIES)}"
        )
    if opts.nonfinite_max_skips < 1:
        raise OptionError(f"nonfinite_max_skips={opts.nonfinite_max_skips} must be >= 1")
    parse_resident_layers(opts.resident_layers)
    parse_keep_activations(opts.keep_activations)
    parse_attention_layers(opts.keep_attention_outputs)
    parse_boundary_dtype(opts.boundary_dtype)
    if opts.auto_fit not in AUTO_FIT_MODES:
        raise OptionError(f"auto_fit={opts.auto_fit!r} must be one of {', '.join(AUTO_FIT_MODES)}")
    if opts.layer_kernels not in LAYER_KERNELS:
        raise OptionError(
            f"layer_kernels={opts.layer_kernels!r} must be one of {', '.join(LAYER_KERNELS)}"
        )
    if opts.attention not in ATTENTION_CHOICES:
        raise OptionError(
            f"attention={opts.attention!r} must be one of {', '.join(ATTENTION_CHOICES)}"
        )
    if opts.export_dtype not in EXPORT_DTYPES:
        raise OptionError(
            f"export_dtype={opts.export_dtype!r} must be one of {', '.join(EXPORT_DTYPES)}"
        )
    if not _is_size(opts.max_shard_size):
        raise OptionError(
            f"max_shard_size={opts.max_shard_size!r}: give a size such as '2GB' or '500MB'"
        )


_SIZE_UNITS = ("KIB", "MIB", "GIB", "TIB", "KB", "MB", "GB", "TB", "B")


def size_bytes(text: str | int) -> int:
    """Bytes of a size such as '2GB' or '500MiB' (as ``max_shard_size`` takes it: KB, MB, GB
    are powers of 1000, KiB, MiB, GiB of 1024), or of an int."""
    if isinstance(text, int):
        return text
    t = text.strip().upper()
    if t.isdigit():
        return int(t)
    for unit in _SIZE_UNITS:
        if t.endswith(unit):
            power = "BKMGT".index(unit[0])  # (B: 0)
            base = 1024 if unit.endswith("IB") else 1000
            return int(float(t[: -len(unit)]) * base**power)
    raise ValueError(f"{text!r} is not a size such as '2GB' or '500MB'")


def _is_size(text: str) -> bool:
    try:
        return size_bytes(text) > 0
    except ValueError:
        return False


def planned_options() -> tuple[str, ...]:
    """The options the memory plan depends on (field metadata ``planned``), in field order."""
    return tuple(f.name for f in fields(EngineOptions) if f.metadata.get("planned"))


def default_of(name: str) -> Any:
    """The default of option ``name`` (KeyError for an unknown name)."""
    for f in fields(EngineOptions):
        if f.name == name:
            return f.default if f.default is not MISSING else None
    raise KeyError(name)


def unused_option_notes(run: ResolvedOptions, n_layers: int) -> list[str]:
    """Options set to something this run cannot use, each with why (said once at start; the
    run goes on without them)."""
    o, notes = run.options, []
    if o.checkpoint_every > max(n_layers, 1):
        notes.append(
            f"checkpoint_every={o.checkpoint_every} is more than the model's {n_layers} layers: "
            "one segment of them all"
        )
    # A chain recomputes the layers of its segment after the first: checkpoint_every - 1, or
    # the model's layers - 1 where one segment holds them all.
    chain = min(run.chain_attention_layers, max(n_layers - 1, 0))
    if o.chain_attention_outputs > chain:
        if not run.chain_attention_layers:
            why = (
                "no checkpoint segment chain recomputes with the early stop from inputs saved "
                "as they are (checkpoint_every > 1, recompute_early_stop, boundary_dtype input)"
            )
        elif chain < run.chain_attention_layers:
            why = f"at most the model's {n_layers} layers - 1 = {chain} layers in its one segment"
        else:
            why = f"at most checkpoint_every - 1 = {o.checkpoint_every - 1} layers"
        notes.append(f"chain_attention_outputs={o.chain_attention_outputs} keeps {chain}: {why}")
    # (Not for the default, which applies wherever device updates are possible.)
    default_lead = EngineOptions.__dataclass_fields__["device_update_lead"].default
    if o.device_update_lead not in (0, default_lead) and not run.device_updates_possible:
        notes.append(
            f"device_update_lead={o.device_update_lead} has no effect: device updates need "
            "CUDA and an update after backward (gradient clipping on, no eager updates)"
        )
    return notes


def device_update_hint(
    run: ResolvedOptions, waited_s: float, elapsed_s: float, world_size: int = 1
) -> str | None:
    """Advice for a run whose training thread waited ``waited_s`` of ``elapsed_s`` for the host
    AdamW: where that is over a fifth and the GPU may not take layers over but could
    (``device_update_lead`` 0, ``device_updates_possible``, one process), the option that lets
    it; else None."""
    if (
        elapsed_s <= 0
        or waited_s <= 0.2 * elapsed_s
        or run.options.device_update_lead > 0
        or not run.device_updates_possible
        or world_size > 1
    ):
        return None
    return (
        f"the training thread waited {waited_s:.1f} of the last {elapsed_s:.1f} s for the host "
        "AdamW (this host's CPU update is slower than the forward it overlaps); "
        "with megatrain_device_update_lead=2 (CLI: --device-update-lead 2) the GPU may update "
        "the host layers the CPU has not reached, where the plan counts its staging (the same "
        "training: its AdamW rounds as the CPU's)"
    )


__all__ = [
    "ALL_LAYERS",
    "ATTENTION_CHOICES",
    "AUTO_FIT_MODES",
    "BOUNDARY_DTYPES",
    "LAYER_KERNELS",
    "NONFINITE_POLICIES",
    "EngineOptions",
    "OptionError",
    "ResolvedOptions",
    "StepShape",
    "device_update_hint",
    "field_types",
    "option_value",
    "value_type",
    "parse_attention_layers",
    "parse_boundary_dtype",
    "parse_keep_activations",
    "parse_resident_layers",
    "unused_option_notes",
]
