"""``HFMegaTrainer``: a ``transformers.Trainer`` that streams decoder layers from host RAM.

The overrides live in ``MegaTrainerMixin`` so they compose with other ``Trainer`` subclasses
(TRL's ``SFTTrainer``: ``hf_megatrain.integrations.trl``). The override set is deliberately
small. The training loop, ``compute_loss`` (with its ``num_items_in_batch`` semantics),
``evaluate``, callbacks, schedulers and dataloaders are the Trainer's own. What changes: where the
model lives (``_move_model_to_device``, ``_wrap_model``), the optimizer (``create_optimizer``),
gradient norm and clipping, and how weights and optimizer state are saved and restored (through
the host store, as HF safetensors). Training steps, evaluation batches (``prediction_step``) and
the optimizer step that run out of GPU memory go through the out-of-memory watchdog
(``oom_watchdog.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import shutil
import time
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import BatchSampler
from transformers import Trainer, TrainerState, TrainingArguments

from ..core.distributed import DataParallelError, launch_layout_error, process_group_size
from ..core.engine.gradients import SecondGradientError
from ..core.engine.updates import host_update_rate
from ..core.host_store import InsufficientHostMemoryError, process_memory_bytes
from ..core.memory_options import SEGMENT_LENGTHS
from ..core.optimizer import adamw_setting_errors
from ..core.options import (
    EXPORT_DTYPES,
    EngineOptions,
    OptionError,
    ResolvedOptions,
    StepShape,
    device_update_hint,
    unused_option_notes,
)
from ..core.plan_types import MemoryPlanError
from ..core.publish import (
    DiskFullError,
    disk_full_message,
    out_of_disk_space,
    publish,
    recover,
    verify_folder,
    write_manifest,
)
from ..core.rng import rng_state, set_rng_state
from .arguments import (
    ARGUMENT_NAMER,
    MegaTrainArguments,
    argument_name,
    engine_options,
    in_argument_names,
)
from .attention import apply_attention
from .checkpoint import (
    OPTIMIZER_STATE_DIR,
    has_optimizer_state,
    load_optimizer_state,
    load_weights_into_store,
    save_optimizer_state,
    staged_model_folder,
    stock_optimizer_note,
    write_streamed_pretrained,
)
from .flops import active_params, model_flops_utilization
from .guards import (
    IGNORE_INDEX,
    NonFiniteError,
    check_batch,
    check_model_dtype,
    check_model_has_values,
    check_weights_finite,
    learned_position_limit,
    warn_half_precision_model,
)
from .heartbeat import StepHeartbeat
from .long_context import apply_layer_kernels, apply_liger_kernels, install_mlp_tiling
from .loss import fused_causal_lm_forward, router_aux_loss_on, supports_fused_loss, unwrap_peft
from .model import (
    _is_peft,
    check_supported,
    disable_gradient_checkpointing,
    find_decoder_layers,
    host_adamw,
    prepare_streamed_model,
    refuse_changes_since_streaming,
    runs_liger,
    streamed_state,
)
from .module_calls import written_placeholders
from .oom_watchdog import (
    PeakLog,
    StepReplay,
    make_room,
    make_room_for_weights,
)
from .preemption import EvaluationStopped, SaveOnSigterm, evaluation_owed
from .sequence_parallel import setup_sequence_parallel
from .step_layout import (
    MANIFEST_KEY,
    RUN_ARGUMENTS_KEY,
    RUN_DEFINING_ARGUMENTS,
    StepLayout,
    layout_change,
    processes,
    processes_keeping_steps,
    run_argument_changes,
    run_arguments,
    saved_layout,
    saved_run_arguments,
)
from .superseded import finish_pending_moves, set_aside_later_saves

logger = logging.getLogger(__name__)

#: The line said before an evaluation a signal stopped is run (``evaluation_owed``).
_OWED_EVALUATION = (
    "hf_megatrain: %s was saved when a signal stopped its step's evaluation: running that "
    "evaluation now"
)

_SUPPORTED_OPTIMS = {"adamw_torch", "adamw_torch_fused"}
_SCHEDULER_NAME = "scheduler.pt"


class StreamedModelWrapper(nn.Module):
    """What the Trainer calls: the HF model under the run's autocast, never with a KV cache.

    Returning this from ``_wrap_model`` keeps ``accelerator.prepare`` (and DDP/DataParallel) off
    the model, while ``Trainer.model`` stays the user's own HF model.
    """

    def __init__(
        self,
        model: nn.Module,
        compute_dtype: torch.dtype,
        device: torch.device,
        fused_loss: bool = True,
        loss_chunk_tokens: int | None = None,
        fused_loss_kernel: bool = True,
    ) -> None:
        super().__init__()
        self.module = model
        self.compute_dtype = compute_dtype
        self.device_type = torch.device(device).type
        self.fused_loss = fused_loss and supports_fused_loss(model)
        self.loss_chunk_tokens = loss_chunk_tokens
        self.fused_loss_kernel = fused_loss_kernel
        #: An evaluation that keeps the loss only (no logits for metrics): set by the trainer.
        self.loss_only = False

    @contextlib.contextmanager
    def loss_only_evaluation(self, loss_only: bool):
        """Within: an evaluation batch whose logits nobody reads gets the fused loss too (a
        long row's tokens x vocab logits were the evaluation's peak, past training's)."""
        before, self.loss_only = self.loss_only, bool(loss_only)
        try:
            yield
        finally:
            self.loss_only = before

    def _call(self, *args, **kwargs):
        if (
            self.fused_loss
            and not args
            # TRL's SFTTrainer asks the model for its own fused LM head (per-token log-probs,
            # no full logits either): its forward must receive that call unchanged.
            and "fused_lm_head" not in kwargs
            and ((self.module.training and torch.is_grad_enabled()) or self.loss_only)
            and kwargs.get("labels") is not None
        ):
            # Training (or a loss-only evaluation) with labels: full logits never exist (see
            # hf/loss.py; read anyway, they are computed then).
            return fused_causal_lm_forward(
                self.module,
                self.compute_dtype,
                self.loss_chunk_tokens,
                loss_kernel=self.fused_loss_kernel,
                **kwargs,
            )
        return self.module(*args, **kwargs)

    def _get_name(self) -> str:
        # The Trainer names the model it calls (``unwrap_model(model)._get_name()``) to decide
        # whether label smoothing shifts the labels (causal LMs): the wrapped model's name, as
        # stock under PEFT (its base model's).
        return unwrap_peft(self.module)._get_name()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The model's own: it also clears the streamed layers' gradients (``module_calls``),
        # which the Trainer's model.zero_grad() before the first step must drop.
        self.module.zero_grad(set_to_none=set_to_none)

    def forward(self, *args, **kwargs):
        kwargs["use_cache"] = False
        if self.compute_dtype == torch.float32:
            return self._call(*args, **kwargs)
        with torch.autocast(self.device_type, dtype=self.compute_dtype):
            return self._call(*args, **kwargs)


def _rotate_checkpoints(trainer: Trainer, run_dir: str) -> None:
    """``save_total_limit`` rotation of ``run_dir`` (the best checkpoint is always kept)."""
    try:
        from transformers.trainer_utils import rotate_checkpoints  # noqa: PLC0415
    except ImportError:  # transformers < 5.2x: a Trainer method
        trainer._rotate_checkpoints(use_mtime=True, output_dir=run_dir)
        return
    rotate_checkpoints(
        output_dir=run_dir,
        save_total_limit=trainer.args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        use_mtime=True,
    )


def _host_memory_gib() -> tuple[float | None, float | None]:
    """(current RSS, peak RSS) of this process in GiB, from /proc (None where unavailable)."""
    rss, hwm = process_memory_bytes("VmRSS"), process_memory_bytes("VmHWM")
    if rss is None or hwm is None:
        return None, None
    return round(rss / 2**30, 2), round(hwm / 2**30, 2)


def _warn_plan_without_liger(model: nn.Module) -> None:
    """A model streamed by a loader whose memory plan did not know about Liger's kernels: the
    plan over-counts their activations (safe, but fewer layers in HBM than would fit). A plan
    without a workload (a fixed reserve for activations) counts no activations at all."""
    state = streamed_state(model)
    plan = state.plan if state is not None else None
    if plan is not None and plan.step is not None and not plan.shape.fused_layer_kernels:
        logger.warning(
            "hf_megatrain: use_liger_kernel=True, but the model was streamed with a memory plan "
            "made without Liger-Kernel's fused kernels (it over-counts their activations: fewer "
            "HBM-tier layers than would fit). Pass use_liger_kernel=True and the same "
            "liger_kernel_config to init_streamed_model / load_streamed_model."
        )


def _setup_args(args: TrainingArguments) -> None:
    """Refuse what the engine cannot run and adjust what it replaces (idempotent)."""
    check_training_arguments(args)
    # Newer transformers renamed the flag to activation_checkpointing and keep
    # gradient_checkpointing as a mirror set once in __post_init__: turn both off (TRL's configs
    # default it on).
    names = [n for n in ("gradient_checkpointing", "activation_checkpointing") if hasattr(args, n)]
    if any(getattr(args, n) for n in names):
        logger.info(
            "hf_megatrain: gradient_checkpointing ignored; streamed layers always recompute"
        )
        for n in names:
            setattr(args, n, False)
    # One process drives one GPU; the Trainer would otherwise scale batches by n_gpu and
    # wrap the model in DataParallel.
    if args.n_gpu > 1 and args.world_size == 1:
        logger.warning(
            "hf_megatrain: %d GPUs visible, training uses one; for data parallel over all of "
            "them launch with `accelerate launch --num_processes %d` "
            "(recipes/accelerate/multi_gpu.yaml)",
            args.n_gpu,
            args.n_gpu,
        )
    args._n_gpu = 1
    if args.dataloader_pin_memory and args.device.type == "cpu":
        # Pinned batches serve only a copy to a GPU (torch warns where there is none).
        args.dataloader_pin_memory = False


#: The TrainingArguments behind each AdamW setting.
_ADAMW_ARGUMENTS = {
    "lr": "learning_rate",
    "beta1": "adam_beta1",
    "beta2": "adam_beta2",
    "eps": "adam_epsilon",
    "weight_decay": "weight_decay",
}


def _check_scheduler(args: TrainingArguments) -> None:
    """Build the LR schedule on a stand-in optimizer now: a type that needs settings from
    ``lr_scheduler_kwargs`` (``cosine_with_min_lr``: min_lr) fails here, not at train()."""
    from transformers import get_scheduler  # noqa: PLC0415

    # (The run's rate: the polynomial schedule checks its lr_end against it.)
    stand_in = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=args.learning_rate or 1.0)
    steps = max(args.max_steps, 10)
    try:
        get_scheduler(
            args.lr_scheduler_type, optimizer=stand_in,
            num_warmup_steps=args.get_warmup_steps(steps), num_training_steps=steps,
            scheduler_specific_kwargs=args.lr_scheduler_kwargs,
        )  # fmt: skip
    except (ValueError, TypeError, KeyError) as e:
        kind = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
        raise ValueError(
            f"hf_megatrain: lr_scheduler_type='{kind}' with lr_scheduler_kwargs="
            f"{args.lr_scheduler_kwargs or {}}: {e}"
        ) from None


#: Why a run with fsdp or deepspeed is refused (the trainer's and the CLI's words).
SHARDING_UNSUPPORTED = (
    "fsdp and deepspeed are not supported: the engine streams the layers and runs the optimizer "
    "itself (data parallel: accelerate launch --num_processes N; sequence parallel: "
    "megatrain_sequence_parallel)"
)


#: The arguments (ids) already warned about per-process token averaging.
_SAID_TOKENS: set[int] = set()


def check_training_arguments(args: TrainingArguments) -> None:
    """Refuse (``ValueError``, "hf_megatrain: ...") the arguments this trainer cannot run,
    before any model is streamed: the command line calls it when it parses them."""
    world = args.world_size
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # A node's ranks share its host store (core/distributed.py): as many ranks on every node.
    problem = launch_layout_error(world, local_world)
    if problem:
        raise DataParallelError(problem)
    if world > 1 and not args.average_tokens_across_devices and id(args) not in _SAID_TOKENS:
        _SAID_TOKENS.add(id(args))  # (once per arguments: the trainer checks them again)
        # (found by an audit: only the partial last batch's warning said a step differs)
        logger.warning(
            "hf_megatrain: average_tokens_across_devices=False: each process divides its loss "
            "by its own token count, so every step whose processes hold unequal token counts "
            "(rows of unequal length, labels -100) trains otherwise than one process would, as "
            "with the stock Trainer. Leave it on for one process's training."
        )
    if world > local_world and getattr(args, "save_on_each_node", False):
        raise DataParallelError(
            "hf_megatrain: save_on_each_node=True is not supported across nodes: checkpoints are "
            "written once, by node 0, into a folder every node reads on resume (a shared "
            "filesystem). Leave save_on_each_node off."
        )
    if args.fp16 or getattr(args, "fp16_full_eval", False):
        raise ValueError(
            "hf_megatrain: fp16 is not supported (it needs a loss scaler the streamed engine does "
            "not run). Use bf16=True (bf16 compute, fp32 master weights and AdamW states) or fp32."
        )
    if getattr(args, "bf16_full_eval", False):
        raise ValueError(
            "hf_megatrain: bf16_full_eval would cast the fp32 masters to bf16; evaluation already "
            "computes in bf16 when bf16=True. Leave bf16_full_eval off."
        )
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in _SUPPORTED_OPTIMS:
        raise ValueError(
            f"hf_megatrain: optim='{optim}' is not supported; the host optimizer implements "
            f"AdamW exactly ({', '.join(sorted(_SUPPORTED_OPTIMS))})."
        )
    betas = (args.adam_beta1, args.adam_beta2)
    if errors := adamw_setting_errors(
        args.learning_rate, betas, args.adam_epsilon, args.weight_decay
    ):
        raise ValueError(
            "hf_megatrain: "
            + "; ".join(
                f"{_ADAMW_ARGUMENTS[name]}={value} must be {valid}" for name, value, valid in errors
            )
        )
    if getattr(args, "fsdp", None) or getattr(args, "deepspeed", None):
        raise ValueError(f"hf_megatrain: {SHARDING_UNSUPPORTED}")
    _check_scheduler(args)
    if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best" and (
        args.metric_for_best_model is None
    ):
        raise ValueError(
            "hf_megatrain: save_strategy='best' needs metric_for_best_model (the metric whose "
            "best value decides which checkpoint is saved, e.g. eval_loss)"
        )
    # Refuses invalid engine options, and host_grads=False where the update needs the grads.
    _run_options(args, engine_options(args))


def _refuse_own_optimizer(optimizer: Any, optimizer_cls_and_kwargs: Any) -> None:
    """Refuse an optimizer given to the Trainer (``optimizers=(opt, sched)`` or
    ``optimizer_cls_and_kwargs``): the streamed layers' weights live in the host store, which
    only the engine's own AdamW updates. Ignored, it would train with other settings than the
    ones asked for; used, it would fail inside the first step."""
    from ..core.optimizer import HostAdamW  # noqa: PLC0415

    given = []
    if optimizer is not None and not isinstance(optimizer, HostAdamW):
        given.append(f"optimizers=({type(optimizer).__name__}, ...)")
    if optimizer_cls_and_kwargs is not None:
        given.append(f"optimizer_cls_and_kwargs=({optimizer_cls_and_kwargs[0].__name__}, ...)")
    if given:
        raise ValueError(
            f"hf_megatrain: {' and '.join(given)} is not supported: the streamed layers' weights "
            "live in the host store and are updated by the engine's own AdamW (optim="
            f"{'/'.join(sorted(_SUPPORTED_OPTIMS))}), configured by the TrainingArguments "
            "(learning_rate, adam_beta1/2, adam_epsilon, weight_decay). Leave the optimizer to "
            "the trainer; a scheduler alone (optimizers=(None, scheduler)) is not refused."
        )


def _clipping(args: TrainingArguments) -> bool:
    return args.max_grad_norm is not None and args.max_grad_norm > 0


def _run_options(args: TrainingArguments, options: EngineOptions) -> ResolvedOptions:
    """``options`` resolved for this run (its clipping, its device), errors in argument names."""
    try:
        return options.resolve(
            clipping=_clipping(args),
            cuda=torch.device(args.device).type == "cuda",
            single_backward=args.gradient_accumulation_steps == 1 and args.world_size == 1,
        )
    except OptionError as e:
        message = in_argument_names(str(e))
        if _clipping(args):
            message = message.replace("the run clips", f"max_grad_norm={args.max_grad_norm} clips")
        raise OptionError(f"hf_megatrain: {message}") from None


def _options_of_streamed(state, args: TrainingArguments) -> EngineOptions:
    """The options of a model streamed before the trainer: its own, with the run-time ones from
    ``args``. A non-default argument that contradicts how the model was streamed is an error."""
    model_opts = state.options.options
    mine = engine_options(args)
    default = EngineOptions()
    clash = [
        f"{argument_name(n)}={getattr(mine, n)!r} (the model has {getattr(model_opts, n)!r})"
        for n in EngineOptions.field_names()
        if n not in EngineOptions.run_time_fields()
        and getattr(mine, n) != getattr(default, n)
        and getattr(mine, n) != getattr(model_opts, n)
    ]
    if clash:
        raise ValueError(
            "hf_megatrain: the model was streamed (load_streamed_model / init_streamed_model) "
            f"with other engine options than the trainer's arguments: {'; '.join(clash)}. Pass "
            "the same options when streaming it, or leave these arguments at their defaults."
        )
    # An argument left at (or set to) its default cannot be told apart: say which of the
    # options the model was streamed with rule over such arguments (what auto_fit turned on
    # was logged when it was streamed).
    asked = state.asked or model_opts
    overruled = [
        n
        for n in EngineOptions.field_names()
        if n not in EngineOptions.run_time_fields()
        and getattr(mine, n) == getattr(default, n) != getattr(asked, n)
    ]
    if overruled:
        logger.warning(
            "hf_megatrain: the model was streamed with %s: those are used (the trainer's %s "
            "at the default)",
            ", ".join(f"{n}={getattr(asked, n)!r}" for n in overruled),
            ", ".join(argument_name(n) for n in overruled),
        )
    run_time = {n: getattr(mine, n) for n in EngineOptions.run_time_fields()}
    # The store's layout is fixed: whether it can hold gradients is checked against the engine.
    return model_opts.with_(host_grads=None, **run_time)


def _first_row_length(dataset: Any) -> int | None:
    """Tokens in the dataset's first row, when it is indexable and has ``input_ids``."""
    if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return None
    try:
        if len(dataset) == 0:
            return None
        ids = dataset[0]["input_ids"]
        return int(ids.shape[-1]) if hasattr(ids, "shape") else len(ids)
    except Exception:  # any dataset shape we cannot read: plan with the fixed reserve
        return None


def _plan_step(args: TrainingArguments, options: EngineOptions, dataset: Any) -> StepShape | None:
    """The micro-batch split the memory plan is made for (None: unknown, the HBM tier uses the
    reserve): it sizes the HBM tier ('auto'), keep_activations 'auto' and auto_fit.

    Per rank: with sequence_parallel=N each rank's layers run on seq_len / N tokens of every row
    (its shard), so the plan sizes activations for that (the row length is the global one)."""
    seq_len = options.plan_seq_len or _first_row_length(dataset)
    if not seq_len:
        return None
    seq_len = -(-seq_len // options.sequence_parallel)  # this rank's shard of a row
    return StepShape(
        seq_len=seq_len,
        micro_batch_tokens=args.per_device_train_batch_size * seq_len,
        grad_accum=args.gradient_accumulation_steps,
    )


def _warn_attention_outputs_unused(model: nn.Module, options: ResolvedOptions) -> None:
    """keep_attention_outputs keeps PyTorch SDPA's fused kernel outputs only: say so when the
    model's attention does not run through them or no layer uses the early stop."""
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    if options.chain_attention_outputs and attn != "sdpa":
        # (found by an audit: said for keep_attention_outputs only)
        logger.warning(
            "hf_megatrain: megatrain_chain_attention_outputs has no effect here: "
            "attn_implementation=%r does not run PyTorch SDPA's fused kernels (the chains' "
            "recompute runs attention again)",
            attn,
        )
    if options.attention_output_layers == 0 and options.keep_attention_outputs == "off":
        return
    if options.keep_attention_outputs == "auto":
        # The default: the plan keeps none where they cannot be used (no SDPA, layers that
        # re-run whole): nothing was asked for, nothing to warn about.
        return
    why = None
    if attn != "sdpa":
        why = f"attn_implementation={attn!r} does not run PyTorch SDPA's fused kernels"
    elif not options.recompute_early_stop:
        why = "megatrain_recompute_early_stop=False re-runs whole layers"
    elif options.boundary_dtype is not None:
        why = "layers whose inputs are saved rounded (megatrain_boundary_dtype) re-run whole"
    if why:
        logger.warning(
            "hf_megatrain: megatrain_keep_attention_outputs has no effect here: %s (the "
            "recompute runs attention again)",
            why,
        )


def _check_grad_mode(state, args: TrainingArguments, run: ResolvedOptions) -> None:
    """A model streamed without gradient slots (for eager updates) cannot train a run whose
    update needs every layer's gradient held (clipping, or eager updates off); one streamed with
    bf16 slots cannot train a run that accumulates gradients over micro-batches or processes."""
    if state.engine.grad_staging and not run.eager_update:
        why = (
            f"max_grad_norm={args.max_grad_norm} clips gradients"
            if run.clipping
            else "megatrain_eager_update=False"
        )
        raise ValueError(
            "hf_megatrain: the model's host store was built without gradient slots "
            f"(host_grads=False, for eager updates), but {why}, which needs every layer's "
            "gradient held until step(). Stream the model with clipping=True (or "
            "host_grads=True), or train with max_grad_norm=0 and megatrain_eager_update=True."
        )
    if any(store.compact_grad for store in state.engine.stores) and not run.single_backward:
        raise ValueError(
            "hf_megatrain: the model's host store was built with bf16 gradient slots, exact only "
            "for one backward of one process per optimizer step (a StepShape with grad_accum=1), "
            f"but this run has gradient_accumulation_steps={args.gradient_accumulation_steps} "
            f"and {args.world_size} process(es). Stream the model with this run's StepShape, or "
            "with compact_host_grads=False."
        )


def _check_data_parallel(state, args: TrainingArguments) -> None:
    """The streamed model must have been prepared for this launch's number of processes, and
    every process must run as many steps (each step's gradients are reduced over all of them)."""
    accelerator_config = getattr(args, "accelerator_config", None)
    uneven = getattr(accelerator_config, "even_batches", True) is False
    if args.world_size > 1 and uneven and not args.dataloader_drop_last:
        raise DataParallelError(
            "hf_megatrain: accelerator_config even_batches=False gives the processes unequal "
            "numbers of batches where an epoch's last batch is partial, and every step reduces "
            "its gradients over all of them (the ones with fewer batches would wait forever). "
            "Keep even_batches (the rows it repeats into a partial last batch are masked), or "
            "set dataloader_drop_last=True."
        )
    dp = state.engine.dp
    have = 1 if dp is None else dp.world_size
    if have != args.world_size:
        raise DataParallelError(
            f"hf_megatrain: the model was streamed for {have} process(es) but the trainer runs "
            f"{args.world_size}; stream it inside the launched processes (load_streamed_model / "
            "init_streamed_model / HFMegaTrainer after `accelerate launch` started them)."
        )


#: TrainingArguments every data-parallel rank must run with alike: the run's, and the steps
#: and the collective saves and evaluations.
SAME_ON_EVERY_RANK = (
    *RUN_DEFINING_ARGUMENTS,
    "max_steps",
    "num_train_epochs",
    "save_strategy",
    "save_steps",
    "eval_strategy",
    "eval_steps",
)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_same_on_every_rank(args: TrainingArguments, train_dataset: Any) -> None:
    """Refuse, on every rank at once, a launch whose ranks (nodes launched apart) were given
    different training arguments or train rows (found by an audit: another learning rate on one
    node trained its copy of the layers apart, silently; another --max_steps hung at the end).
    A collective: every rank of the default process group calls it."""
    import torch.distributed as dist  # noqa: PLC0415

    from .data_identity import rows_identity  # noqa: PLC0415

    if process_group_size() < 2:
        return
    mine = {k: repr(getattr(args, k, None)) for k in SAME_ON_EVERY_RANK}
    mine["train rows"] = rows_identity(train_dataset)
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    differ = [
        f"{k} ({', '.join(f'rank {r}: {v[k]}' for r, v in enumerate(views))})"
        for k in mine
        if len({v[k] for v in views}) > 1
    ]
    if differ:
        raise DataParallelError(
            "hf_megatrain: the data-parallel ranks were launched with different settings: "
            f"{'; '.join(differ)}. Launch every node with the same command and data"
        )


def _rows_of(dataset: Any) -> int | None:
    """The number of rows of a map-style ``dataset`` (None: a stream, or no length)."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    try:
        return len(dataset)
    except TypeError:
        return None


def last_batch_rows(loader: Any, world: int) -> tuple[int, int] | None:
    """How accelerate's ``even_batches`` filled the last global batch of an epoch of ``loader``
    (a prepared data-parallel dataloader, read when it yields that batch): ``(real, per_rank)``,
    the data's rows in the global batch and each rank's share of it. The global batch is the
    real rows, then rows repeated from the epoch's start, cut into ``world`` consecutive shares:
    rank r's share holds ``clamp(real - r * per_rank, 0, per_rank)`` real rows, first.
    ``real == per_rank * world`` where the last batch is full; ``(0, 0)`` where no row is ever
    repeated (``drop_last``, ``even_batches=False``); None where the layout is unknown (a
    loader or sampler accelerate did not shard, a stream without a length)."""
    from accelerate.data_loader import (  # noqa: PLC0415
        BatchSamplerShard,
        DataLoaderDispatcher,
        DataLoaderShard,
        IterableDatasetShard,
        SkipBatchSampler,
    )

    if isinstance(loader, DataLoaderDispatcher):
        # Rank 0 fetched ``remainder`` rows for the last global batch; every rank gets a slice
        # of ceil(remainder / world) rows of them followed by the epoch's first rows.
        if loader._drop_last:
            return (0, 0)
        if loader.remainder <= 0:
            return None
        return loader.remainder, -(-loader.remainder // world)
    if not isinstance(loader, DataLoaderShard):
        return None
    shard = loader.sampler if isinstance(loader.sampler, BatchSampler) else loader.batch_sampler
    while isinstance(shard, SkipBatchSampler):  # a resume's skipped batches
        shard = shard.batch_sampler
    dataset = loader.dataset
    try:
        if isinstance(shard, BatchSamplerShard) and shard.batch_size is not None:
            # A map-style dataset: the rows are the indices of the sampler the shard batches.
            if shard.drop_last or not shard.even_batches:
                return (0, 0)
            total = shard.batch_size * (1 if shard.split_batches else shard.num_processes)
            rows = len(shard.batch_sampler.sampler)
        elif isinstance(dataset, IterableDatasetShard):
            # Every rank iterates the stream and keeps its slice of each global batch.
            if dataset.drop_last:
                return (0, 0)
            total = dataset.batch_size * (1 if dataset.split_batches else dataset.num_processes)
            rows = len(dataset.dataset)
        else:
            return None
    except (AttributeError, TypeError):  # a sampler or stream without a length
        return None
    return rows % total or total, total // world


def _weights_only_note(checkpoint: str, missing: list[str]) -> str:
    """Why a checkpoint lacks its optimizer and scheduler state, where it is one that
    ``save_only_model=True`` wrote (no optimizer, scheduler or RNG state: weights only)."""
    sched = os.path.join(checkpoint, _SCHEDULER_NAME)
    rng = any(name.startswith("rng_state") for name in os.listdir(checkpoint))
    if sched not in missing or len(missing) < 2 or rng:
        return ""
    return " (a weights-only checkpoint, as save_only_model=True writes; stock goes on silently)"


class MegaTrainerMixin:
    """Every ``HFMegaTrainer`` override, for composing with other ``Trainer`` subclasses.

    Put it first among the bases, before a ``transformers.Trainer`` subclass:
    ``class MyTrainer(MegaTrainerMixin, SomeTrainer)`` (``HFMegaTrainer`` is
    ``(MegaTrainerMixin, Trainer)``; :class:`hf_megatrain.integrations.trl.MegaSFTTrainer` is
    ``(MegaTrainerMixin, SFTTrainer)``).

    The model is streamed (decoder layers into the host store) before the next class's
    ``__init__`` runs, so it never sees a materialized model it could place on the GPU. When the
    next class still transforms the model itself (it gets a ``peft_config`` to wrap it with
    adapters, or a model name to load, or the class sets ``_megatrain_prepare_late``), streaming
    waits for the final model instead: it happens at the start of ``Trainer.__init__``, the first
    point where the mixin sees that model, before the Trainer places or inspects it.
    """

    #: Stream the model only once ``Trainer.__init__`` receives it (see the class docstring).
    _megatrain_prepare_late: bool = False

    def __init__(
        self, model: nn.Module | str | None = None, args: TrainingArguments | None = None, *a, **kw
    ):
        if kw.get("model_init") is not None:
            # The Trainer calls model_init again at every train() (hyperparameter search): a new
            # model each time, which would have to be streamed again under the running trainer.
            raise ValueError(
                f"hf_megatrain: model_init is not supported by {type(self).__name__} (the "
                "Trainer builds a new model from it at every train(), for hyperparameter "
                "search); pass model=, and build a new trainer per trial."
            )
        if model is None:
            raise ValueError(f"hf_megatrain: {type(self).__name__} needs a model")
        if args is None:
            args = self._megatrain_default_args(model)
        _setup_args(args)
        # By keyword before streaming (a large model takes a while); positionally, below.
        optimizers = kw.get("optimizers") or (None, None)
        _refuse_own_optimizer(optimizers[0], kw.get("optimizer_cls_and_kwargs"))
        if kw.get("peft_config") is not None and streamed_state(model) is not None:
            # The adapters would be built over the meta placeholders of the streamed layers.
            raise ValueError(
                "hf_megatrain: with peft_config, pass a materialized model (e.g. "
                "AutoModelForCausalLM.from_pretrained), not an already streamed one: the adapters "
                "are added first and the model is streamed afterwards."
            )
        self._megatrain_pending = (
            self._megatrain_prepare_late
            or kw.get("peft_config") is not None
            or not isinstance(model, nn.Module)
        )
        # Trainer(model, args, data_collator, train_dataset, ...): the dataset sizes the plan.
        self._megatrain_dataset = kw.get("train_dataset", a[1] if len(a) > 1 else None)
        if not self._megatrain_pending:
            self._megatrain_prepare(model, args)
        if a:
            # Positional extras follow Trainer's own order (model, args, data_collator, ...).
            super().__init__(model, args, *a, **kw)
        else:
            # By keyword: trainers whose second parameter is not ``args`` (TRL's DPOTrainer:
            # ref_model, GRPOTrainer: reward_funcs) get it in the right place.
            super().__init__(model, args=args, **kw)
        _refuse_own_optimizer(
            getattr(self, "optimizer", None), getattr(self, "optimizer_cls_and_kwargs", None)
        )
        if getattr(self.args, "use_liger_kernel", False):
            # Trainers that patch Liger in __init__ (older transformers) replaced the MLP
            # tiling's forward: tile the (fused) forward again.
            install_mlp_tiling(self.model, self.megatrain_options.mlp_tile_tokens)

    def _megatrain_default_args(self, model: nn.Module | str) -> TrainingArguments:
        return MegaTrainArguments(output_dir="tmp_trainer")

    def _megatrain_prepare(self, model: nn.Module, args: TrainingArguments) -> None:
        """Stream ``model`` and build what the Trainer will call (``StreamedModelWrapper``)."""
        compute_dtype = torch.bfloat16 if args.bf16 else torch.float32
        device = args.device
        # First: streaming and the checks below are collectives or plan from these arguments,
        # which ranks given others would split or hang in.
        check_same_on_every_rank(args, getattr(self, "_megatrain_dataset", None))
        state = streamed_state(model)
        if state is None:
            check_supported(model)  # (before anything reads its config)
            check_model_dtype(model)  # before streaming rounds it to fp32 masters
            warn_half_precision_model(model, bool(args.bf16))
            check_model_has_values(model)
            options = engine_options(args)
            run = _run_options(args, options)  # refuses what cannot run, in argument names
            step = _plan_step(args, options, getattr(self, "_megatrain_dataset", None))
            # Before streaming: the memory plan counts the fused kernels' smaller activations
            # and the chosen attention's tensors.
            apply_attention(
                model, options.attention, device, step.seq_len if step else None,
                sequence_parallel=options.sequence_parallel,
            )  # fmt: skip
            apply_layer_kernels(
                model,
                options.layer_kernels,
                device,
                use_liger_kernel=getattr(args, "use_liger_kernel", False),
                liger_kernel_config=getattr(args, "liger_kernel_config", None),
            )
            prepare_streamed_model(
                model,
                device,
                compute_dtype,
                options,
                decay_names=self._megatrain_decay_names(model, args),
                step=step,
                clipping=run.clipping,
                single_backward=run.single_backward,
            )
            # The model's options: these, plus the memory options auto_fit turned on.
            run = _run_options(args, streamed_state(model).options.options)
        else:
            if state.frozen:
                raise ValueError(
                    "hf_megatrain: the model streams frozen (frozen_streamed_copy / "
                    "load_streamed_model(trainable=False): weights only, for a reference model) "
                    "and cannot be trained; stream it trainable."
                )
            engine = state.engine
            if engine.compute_dtype != compute_dtype or engine.device.type != device.type:
                # (Found by an audit: bf16 weights trained with fp32 arguments ran in neither
                # precision, silently; the reverse failed deep in the recompute.)
                raise ValueError(
                    f"hf_megatrain: the model streams {_dtype_name(engine.compute_dtype)} weights "
                    f"on {engine.device.type}, but the training arguments compute in "
                    f"{_dtype_name(compute_dtype)} (bf16={bool(args.bf16)}) on {device.type}: "
                    "stream it with the run's precision and device (load_streamed_model("
                    f"..., bf16={bool(args.bf16)}), or pass bf16="
                    f"{engine.compute_dtype == torch.bfloat16} in the training arguments)"
                )
            # (Liger's kernels already in, chosen by the loader: not applied twice, which would
            # replace the MLP tiling installed over them.)
            if getattr(args, "use_liger_kernel", False) and not runs_liger(model):
                _warn_plan_without_liger(model)
                apply_liger_kernels(model, getattr(args, "liger_kernel_config", None))
            run = _run_options(args, _options_of_streamed(state, args))
            refuse_changes_since_streaming(model, state)
            disable_gradient_checkpointing(model)
            self._megatrain_check_decay_names(model, args, state)
        self.megatrain = streamed_state(model)
        #: The engine options of this run (resolved: see ``EngineOptions.resolve``).
        self.megatrain_options = run
        _check_data_parallel(self.megatrain, args)
        # Ulysses (DeepSpeed's): attention wrapped now; batches sharded in get_train_dataloader.
        self._megatrain_sp = setup_sequence_parallel(model, args, run.options.sequence_parallel)
        _check_grad_mode(self.megatrain, args, run)
        _warn_attention_outputs_unused(model, run)
        if getattr(args, "torch_compile", False):
            # The Trainer compiles the model it prepares with accelerate; the wrapper is never
            # prepared (a whole-model graph cannot span layers that stream in and out).
            logger.warning(
                "hf_megatrain: torch_compile=True is not applied: the model is not compiled as a "
                "whole, its decoder layers stream through the device one at a time. On CUDA the "
                "layers' RMSNorm, RoPE and SwiGLU are fused by default (Liger-Kernel or "
                "torch.compile; megatrain_layer_kernels='compiled' compiles them for any family)."
            )
        for note in unused_option_notes(run, len(self.megatrain.engine.stores)):
            logger.warning("hf_megatrain: %s", note)
        self._wrapper = StreamedModelWrapper(
            model,
            compute_dtype,
            device,
            fused_loss=run.fused_loss,
            loss_chunk_tokens=run.loss_chunk_tokens,
            fused_loss_kernel=run.fused_loss_kernel,
        )
        self._tokens_since_log = 0
        self._time_of_log = time.perf_counter()
        #: The row length (tokens) of the last micro-batch this process's layers ran on: the
        #: local shard's under sequence parallelism.
        self.last_seq_len = 0
        self._host_wait_at_log = 0.0
        self._gpu_updates_at_log = 0
        self._cpu_update_at_log: tuple[float, int] = (0.0, 0)
        # The slow-host hint: said once, after two log intervals in a row have it.
        self._device_update_hinted = False
        self._device_update_hint_seen = False
        self._megatrain_pending = False
        # Non-finite guard: consecutive skipped steps; batches checked; warnings given once.
        self._megatrain_skips_in_row = 0
        self._megatrain_batches_checked = 0
        self._megatrain_warned: set[str] = set()
        # Rows longer than a learned position table are refused (the lookup fails inside).
        self._megatrain_position_limit = learned_position_limit(model)
        self._megatrain_in_step = False
        # Without eager updates: whether this step's losses were finite, on the device (read at
        # the step's end, where the gradient norm syncs anyway).
        self._megatrain_loss_finite: torch.Tensor | None = None
        # The out-of-memory watchdog: the step's micro-batches, to run it again after making room.
        self._megatrain_replay = StepReplay(self.megatrain.engine.device)
        self._megatrain_replay_step: int | None = None
        self._megatrain_eager_before = 0
        self._megatrain_checked = None  # the optimizer _megatrain_check_run last passed
        # The optimizer step's parts (clipping, norm, update) done so far, for its step: run again
        # after the step's micro-batches when one ran out of GPU memory.
        self._megatrain_parts_step: int | None = None
        self._megatrain_parts_done: list[tuple[str, Any]] = []
        plan = self.megatrain.plan
        self._megatrain_peaks = PeakLog(
            self.megatrain.engine.device,
            plan.gpu_total if plan is not None and plan.step is not None else None,
        )

    def _megatrain_decay_names(self, model: nn.Module, args: TrainingArguments) -> set[str]:
        """The parameters that get weight decay: this trainer's ``get_decay_parameter_names``
        (a subclass may override it, as with the stock Trainer). Called while the trainer is
        built (the model streams inside ``__init__``)."""
        if "args" not in self.__dict__:  # (an override may read it; Trainer.__init__ sets it)
            self.args = args
        try:
            return set(self.get_decay_parameter_names(model))
        except AttributeError as e:
            raise ValueError(
                f"hf_megatrain: {type(self).__name__}.get_decay_parameter_names failed while the "
                f"trainer was being built ({e}): {type(self).__name__} streams the model inside "
                "__init__ and needs the weight-decay set then. Set what the override reads "
                "before calling super().__init__()."
            ) from None

    def _megatrain_check_decay_names(self, model: nn.Module, args: TrainingArguments, state):
        """A model streamed before this trainer keeps the weight-decay set it was streamed with
        (in its layer stores): refused where this trainer decays another set of trainable
        parameters (an override, or a model streamed with other ``decay_names``)."""
        if not args.weight_decay:
            return  # (no decay: the set changes nothing)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        wanted = self._megatrain_decay_names(model, args) & trainable
        have = state.decay_names() & trainable
        if wanted != have:
            differ = sorted(wanted ^ have)
            raise ValueError(
                f"hf_megatrain: weight_decay={args.weight_decay} would decay another set of "
                f"parameters ({type(self).__name__}.get_decay_parameter_names: {len(wanted)}) "
                f"than the model was streamed with ({len(have)}; {len(differ)} differ, e.g. "
                f"{differ[0]}), fixed in its layer stores: pass the materialized model to the "
                "trainer, which streams it with the trainer's set."
            )

    def _megatrain_check_run(self) -> None:
        """What the trainer was built for still holds at train(): the engine's own AdamW (a
        subclass's create_optimizer or an assigned ``trainer.optimizer`` cannot replace it) and
        the clipping the streamed model was prepared for."""
        from ..core.optimizer import HostAdamW  # noqa: PLC0415

        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and not isinstance(optimizer, HostAdamW):
            inner = type(getattr(optimizer, "optimizer", optimizer))  # (accelerate's wrapper)
            raise ValueError(
                f"hf_megatrain: the optimizer is {inner.__module__}.{inner.__qualname__} (set by a "
                "create_optimizer override or assigned to trainer.optimizer): the streamed "
                "layers' weights live in the host store and only the engine's own AdamW updates "
                "them. Leave create_optimizer to the trainer, configured by the TrainingArguments "
                "(learning_rate, adam_beta1/2, adam_epsilon, weight_decay)."
            )
        if _clipping(self.args) and self.megatrain_options.eager_update:
            raise ValueError(
                f"hf_megatrain: max_grad_norm={self.args.max_grad_norm}, but the trainer was "
                "built for a run without clipping (its layers update during the backward, "
                "before any global gradient norm): set max_grad_norm in the TrainingArguments "
                "before building the trainer, not on trainer.args afterwards."
            )

    def create_accelerator_and_postprocess(self) -> None:
        # Trainer.__init__ calls this first, with ``self.model`` / ``self.args`` the final ones
        # (after e.g. SFTTrainer's PEFT wrapping or args conversion) and before it places,
        # inspects or wraps the model: the point to stream a model whose preparation waited.
        if getattr(self, "_megatrain_pending", False):
            if not isinstance(self.model, nn.Module):
                raise ValueError(f"hf_megatrain: {type(self).__name__} needs a model")
            _setup_args(self.args)
            self._megatrain_prepare(self.model, self.args)
        super().create_accelerator_and_postprocess()

    def train(self, *args: Any, **kwargs: Any):
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if self.args.should_save:  # (a kill during a set-aside: before any save or resume)
            finish_pending_moves(self.args.output_dir)
        self.accelerator.wait_for_everyone()
        if resume is True:
            from transformers.trainer_utils import get_last_checkpoint  # noqa: PLC0415

            resume = get_last_checkpoint(self.args.output_dir)  # (None: the Trainer says so)
        # The stock Trainer builds its optimizer here and follows what changed since it was
        # built; the streamed stores were laid out then (found by an audit: a decoder layer
        # frozen in between trained on, silently).
        refuse_changes_since_streaming(
            self.model,
            self.megatrain,
            f"make such changes before building the {type(self).__name__} (it streams the "
            "model), or build a new one",
        )
        owed = self._megatrain_stopped_at = None
        if isinstance(resume, (str, os.PathLike)) and resume:
            self._megatrain_check_layout(os.fspath(resume))
            self._megatrain_check_resumed_run(os.fspath(resume))
            owed = os.fspath(resume) if evaluation_owed(os.fspath(resume)) else None
        # A signal stopped the resumed step's evaluation: it runs first, where the Trainer runs
        # eval_on_start's (the checkpoint's weights, state and optimizer loaded; see _evaluate).
        self._megatrain_owed_evaluation = owed
        self._megatrain_best_loaded = None  # the weights train from here on
        # (Where the stock Trainer prepares the model: an evaluation after this reports no
        # model_preparation_time unless one before it did, as stock.)
        self._megatrain_model_prepared = True
        self._megatrain_check_run()  # (an optimizer given before train(); clipping)
        # (The arguments changed for this call, restored whatever it ends with.)
        eval_on_start = self.args.eval_on_start
        self.args.eval_on_start = eval_on_start or owed is not None
        # Liger kernels went in when the model was streamed (before the MLP tiling); the
        # Trainer's own application at the start of train() would undo the tiling.
        liger = getattr(self.args, "use_liger_kernel", False)
        if liger:
            self.args.use_liger_kernel = False
        try:
            result = super().train(*args, **kwargs)
            try:  # (after the last step: said, not raised, so that the run can still be saved)
                self._megatrain_refuse_placeholder_writes()
            except ValueError as err:
                logger.warning("%s", err)
            return result
        finally:
            self.args.eval_on_start = eval_on_start
            if liger:
                self.args.use_liger_kernel = True
            # (First: a failed host update re-raised below must not leave it reporting.)
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, StepHeartbeat):
                    callback.stop()
            # The last optimizer step may still be updating the host store on its thread:
            # finish it so weights are final (and no thread outlives the run).
            self.megatrain.engine.wait_updates()

    def hyperparameter_search(self, *args: Any, **kwargs: Any):
        # The Trainer's search builds a new model from model_init for every trial (refused in
        # __init__); without this it asked to install a search backend first.
        raise ValueError(
            f"hf_megatrain: hyperparameter_search is not supported by {type(self).__name__}: it "
            "builds a new model from model_init for every trial, and the trainer streams the one "
            "model it is given. Build the model and a new trainer inside each trial instead (e.g. "
            "an Optuna objective that calls train() and returns the metric)."
        )

    def _megatrain_layout(self) -> StepLayout:
        """How this run's steps take their rows (recorded in each checkpoint's manifest)."""
        return StepLayout.of(self.args, self.megatrain_options.options.sequence_parallel)

    def _megatrain_check_resumed_run(self, checkpoint: str) -> None:
        """Warn of a resume whose run-defining arguments differ from ``checkpoint``'s (found by an
        audit: a changed learning rate was dropped, a changed max_grad_norm or bf16 applied,
        both silently, as the stock Trainer resumes). Such a run is one no uninterrupted run
        trains; ``hf-megatrain train`` refuses it. Also where the router aux loss of an MoE
        model (computed per micro-batch) meets another batch x accumulation layout."""
        problems = []
        saved = saved_run_arguments(checkpoint)
        if saved is not None:
            change = run_argument_changes(saved, run_arguments(self.args))
            if change is not None:
                problems.append(change)
        before, now = saved_layout(checkpoint), self._megatrain_layout()
        if before is not None and router_aux_loss_on(self.model):
            shape = ("per_device_train_batch_size", "gradient_accumulation_steps", "world_size")
            if any(getattr(before, k) != getattr(now, k) for k in shape):
                problems.append(
                    f"it was saved at {before.describe_batches()} and resumes at "
                    f"{now.describe_batches()}: the router aux loss is computed per "
                    "micro-batch, so another layout trains another objective from here"
                )
        if problems:
            logger.warning(
                "hf_megatrain: resuming %s: %s. No uninterrupted run trains like this (the stock "
                "Trainer resumes the same way; `hf-megatrain train` refuses it)",
                checkpoint,
                "; ".join(problems),
            )

    def _megatrain_check_layout(self, checkpoint: str) -> None:
        """Refuse to resume ``checkpoint`` at another sequence-parallel degree unless the run
        goes on as one at this layout from the start would (``layout_change``). Another world
        size alone is resumed as the Trainer resumes it (its data position counted in steps of
        the new size), with a warning where that skips or repeats rows."""
        saved = saved_layout(checkpoint)
        if saved is None or self.args.ignore_data_skip:
            return  # not recorded (an older checkpoint); or no data position carried over
        now = self._megatrain_layout()
        rows = _rows_of(self.train_dataset)
        try:
            with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as f:
                step = int(json.load(f).get("global_step") or 0)
        except (OSError, ValueError, AttributeError, TypeError):
            return  # not a Trainer checkpoint: the Trainer's own resume says so
        max_steps = self.args.max_steps
        problem = layout_change(saved, now, rows, step, max_steps)
        if problem is None:
            return
        if saved.sequence_parallel == now.sequence_parallel:
            logger.warning(
                "hf_megatrain: resuming %s, saved on %s, on %s as the Trainer resumes at another "
                "world size: %s",
                checkpoint,
                saved.describe(),
                now.describe(),
                problem,
            )
            return
        size = processes_keeping_steps(saved, now, rows, step, max_steps)
        other = (
            f" (or megatrain_sequence_parallel={now.sequence_parallel} on {processes(size)})"
            if size
            else ""
        )
        raise ValueError(
            f"hf_megatrain: cannot resume {checkpoint} at megatrain_sequence_parallel="
            f"{now.sequence_parallel} on {now.processes()}: it was saved at "
            f"megatrain_sequence_parallel={saved.sequence_parallel} on "
            f"{saved.processes()}, and {problem}. Resume it at "
            f"megatrain_sequence_parallel={saved.sequence_parallel} on "
            f"{saved.processes()}{other}, or with ignore_data_skip=True (the epoch starts "
            "over at this layout), or train a new run from its weights"
        )

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        sp = getattr(self, "_megatrain_sp", None)
        if sp is not None and self.args.world_size > 1:
            layout = last_batch_rows(loader, self.args.world_size)
            if layout is None or layout[0] < layout[1] * self.args.world_size:
                self._megatrain_warn_repeats(
                    "sequence_parallel",
                    "under sequence parallelism the repeated rows are not masked",
                )
        # Sequence parallelism: each rank gets its shard of every row of its group's batches.
        return loader if sp is None else sp.wrap_dataloader(loader, self.args.device)

    # ---- the partial last global batch of an epoch ----------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self.args.world_size > 1 and getattr(self, "_megatrain_sp", None) is None:
            # Each batch as it leaves the loader (while the loader still tells whether it is the
            # epoch's last), before the Trainer counts its label tokens for num_items_in_batch.
            epoch_iterator = map(lambda batch: self._megatrain_unrepeat(batch)[0], epoch_iterator)
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _megatrain_unrepeat(self, batch: Any) -> tuple[Any, bool]:
        """``batch`` with the rows accelerate's ``even_batches`` repeated into the epoch's (or
        the evaluation's) partial last global batch masked (every label -100): no loss, no
        gradient, and not counted in the Trainer's ``num_items_in_batch``, the real target
        tokens of all ranks (gathered), by which every rank's loss is divided, so N processes
        compute what one process computes on the real rows. Returns ``(batch, masked)``:
        ``masked`` where the batch is such a last batch (the same on every rank, even where this
        rank's rows are all real); other batches are returned as they are.

        Where the loss is not divided by the gathered count (``average_tokens_across_devices``
        off, a model without ``num_items_in_batch``), a rank of repeated rows only would divide
        by no token: the rows are left in and counted, as by the stock Trainer, and a warning
        says so once; likewise where the padding or the rows cannot be known. Every decision
        here is the same on every rank (the evaluation reduces over the ranks when masked)."""
        loader = self.accelerator.gradient_state.active_dataloader
        if loader is None or not loader.end_of_dataloader:
            return batch, False
        world = self.accelerator.num_processes
        layout = last_batch_rows(loader, world)
        if layout is None:
            self._megatrain_warn_repeats(
                "layout", "the loader's padding is unknown here (a stream without a length?)"
            )
            return batch, False
        real, per_rank = layout
        if real == per_rank * world:
            return batch, False  # a full last batch (or drop_last): nothing repeated
        keys = []
        if isinstance(batch, Mapping):
            keys = [k for k in (*self.label_names, "shift_labels") if torch.is_tensor(batch.get(k))]
        if not keys or any(batch[k].dim() == 0 or batch[k].shape[0] != per_rank for k in keys):
            self._megatrain_warn_repeats(
                "rows", f"the batch has no labels of {per_rank} rows to mask (packed rows?)"
            )
            return batch, False
        if not (
            self.args.average_tokens_across_devices
            and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)
        ):
            self._megatrain_warn_repeats(
                "num_items",
                "the loss is divided by each process's own token count "
                "(average_tokens_across_devices=False, or a model without num_items_in_batch)",
            )
            return batch, False
        mine = max(0, min(per_rank, real - self.accelerator.process_index * per_rank))
        for key in keys if mine < per_rank else ():
            labels = batch[key].clone()
            labels[mine:] = IGNORE_INDEX
            batch[key] = labels
        if "masked" not in self._megatrain_warned:
            self._megatrain_warned.add("masked")
            logger.info(
                "hf_megatrain: a last global batch of %d rows for %d processes: the rows "
                "accelerate's even_batches repeated to fill it are masked (labels -100)",
                real,
                world,
            )
        return batch, True

    def _megatrain_warn_repeats(self, key: str, why: str) -> None:
        if f"repeats-{key}" in self._megatrain_warned:
            return
        self._megatrain_warned.add(f"repeats-{key}")
        logger.warning(
            "hf_megatrain: the last global batch of an epoch is (or may be) partial, and "
            "accelerate's even_batches fills the processes' shares with rows repeated from the "
            "epoch's start; %s, so they are trained and evaluated on as by the stock Trainer "
            "and that batch's step or evaluation differs from one process. "
            "dataloader_drop_last=True drops the partial batch instead (docs/design.md, 'What "
            "is exact').",
            why,
        )

    # ---- placement and wrapping ---------------------------------------------------------------
    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # Resident parts were placed when the model was streamed; layers never move as a whole.
        return None

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        return self._wrapper

    @property
    def streamed_model(self) -> nn.Module:
        """The module each training and evaluation step calls: the model with its layers
        streamed and, where on, the fused chunked loss (``fused_loss``) in place of logits."""
        return self._wrapper

    # ---- optimizer ---------------------------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None):
        if self.optimizer is None:
            args = self.args
            self.optimizer = host_adamw(
                self.megatrain,
                self.megatrain_options,
                lr=args.learning_rate,
                betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon,
                weight_decay=args.weight_decay,
            )
            # The Trainer calls optimizer.step() itself: through the out-of-memory watchdog.
            # (A bound method: LR schedulers wrap optimizer.step through its __func__.)
            self._megatrain_plain_step = self.optimizer.step

            def guarded_step(optimizer, closure=None):
                return self._megatrain_optimizer_call("step", closure)

            self.optimizer.step = types.MethodType(guarded_step, self.optimizer)
        return self.optimizer

    def _clip_grad_norm(self, model):
        return self._megatrain_optimizer_call("clip")

    def _get_grad_norm(self, model, grad_norm=None):
        return self._megatrain_optimizer_call("norm", grad_norm)

    def _megatrain_optimizer_part(self, part: str, arg: Any = None) -> Any:
        """One part of the optimizer step, in the order the Trainer calls them: "clip" (returns
        the pre-clip norm), "norm" (the norm, ``arg`` when clipping computed it, and the step's
        non-finite check) and "step" (the update; ``arg`` its closure)."""
        if part == "clip":
            self._megatrain_read_loss_check()
            return self.optimizer.clip_grad_norm_(self.args.max_grad_norm)
        if part == "norm":
            self._megatrain_read_loss_check()
            grad_norm = self.optimizer.grad_norm() if arg is None else arg
            # The Trainer calls this at every optimizer step, right before optimizer.step().
            self._megatrain_nonfinite_check()
            return grad_norm
        return self._megatrain_plain_step(arg)

    # ---- non-finite guard ---------------------------------------------------------------------
    def _megatrain_read_loss_check(self) -> None:
        """The step's deferred loss check (no eager updates): a non-finite loss skips the step,
        reported as the loss, not as the gradient norm it also made non-finite."""
        finite, self._megatrain_loss_finite = self._megatrain_loss_finite, None
        if finite is not None and not bool(finite):
            self.optimizer.mark_nonfinite("loss")

    def _megatrain_nonfinite_check(self) -> None:
        """Decide this step's fate: apply it, skip it (HostAdamW.step then updates nothing), or
        stop the run (megatrain_nonfinite, megatrain_nonfinite_max_skips)."""
        opt = self.optimizer
        step = self.state.global_step + 1
        try:
            reason = opt.pending_nonfinite()
        except NonFiniteError as e:
            raise NonFiniteError(f"hf_megatrain: step {step}: {e}") from None
        dp = self.megatrain.engine.dp
        if dp is not None:
            # Every rank skips or applies the same steps (the replicas must stay equal).
            flag = torch.tensor(float(reason is not None), device=self.megatrain.engine.device)
            dp.all_reduce_sum(flag)
            if reason is None and float(flag) > 0:
                reason = "loss or gradient norm on another rank"
                opt.mark_nonfinite(reason)
        if reason is None:
            self._megatrain_skips_in_row = 0
            return
        run = self.megatrain_options
        if run.nonfinite == "stop":
            raise NonFiniteError(
                f"hf_megatrain: non-finite (NaN/inf) {reason} at step {step}; stopping "
                "(megatrain_nonfinite='stop'). Lower the learning rate, check the data, or set "
                "megatrain_nonfinite='skip' to skip such steps."
            )
        self._megatrain_skips_in_row += 1
        if self._megatrain_skips_in_row >= run.nonfinite_max_skips:
            raise NonFiniteError(
                f"hf_megatrain: non-finite (NaN/inf) {reason} at step {step}: "
                f"{self._megatrain_skips_in_row} steps in a row had non-finite values "
                f"(megatrain_nonfinite_max_skips={run.nonfinite_max_skips}); the run has "
                "diverged. Lower the learning rate or check the data; resume from the last "
                "checkpoint."
            )
        logger.warning(
            "hf_megatrain: step %d skipped: non-finite (NaN/inf) %s; no weight, moment or "
            "schedule changed (%d skipped in a row, the run stops at %d)",
            step,
            reason,
            self._megatrain_skips_in_row,
            run.nonfinite_max_skips,
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if not self._megatrain_in_step:
            return out  # evaluation
        loss = out[0] if return_outputs else out
        finite = torch.isfinite(loss.detach()).all()
        # A step with no trainable token: the loss is 0/0 (NaN) and every gradient 0, and the
        # stock Trainer applies the step (found by an audit: it was skipped as non-finite, and
        # every step after it differed). (Compared where the count is: no copy, no sync.)
        if isinstance(num_items_in_batch, int) and num_items_in_batch == 0:
            finite = torch.ones_like(finite)
        elif torch.is_tensor(num_items_in_batch):
            finite = finite | (num_items_in_batch == 0).to(finite.device, non_blocking=True)
        if not self.megatrain_options.eager_update:
            # Nothing updates before the step's end: keep the check on the device and read it
            # there (``_megatrain_read_loss_check``), not with a host sync per micro-batch.
            seen = self._megatrain_loss_finite
            self._megatrain_loss_finite = finite if seen is None else seen & finite
            return out
        if bool(finite):
            return out
        step = self.state.global_step + 1
        if self.megatrain_options.nonfinite == "stop":
            raise NonFiniteError(
                f"hf_megatrain: non-finite (NaN/inf) loss at step {step}; stopping "
                "(megatrain_nonfinite='stop'). Lower the learning rate, check the data, or set "
                "megatrain_nonfinite='skip' to skip such steps."
            )
        self.optimizer.mark_nonfinite("loss")
        if self.megatrain.engine.dp is not None:
            return out  # every rank runs its backward (collectives); all skip the update
        # No backward through the model for this micro-batch (eager updates would run inside
        # it): the Trainer back-propagates into a detached stand-in instead.
        loss = torch.full_like(loss.detach(), float("nan")).requires_grad_()
        return (loss, *out[1:]) if return_outputs else loss

    # ---- the step -----------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        # Bad inputs are refused before any work (shapes every batch; token values once).
        check_batch(
            inputs,
            getattr(self.model, "config", None),
            check_values=self._megatrain_batches_checked < 1,
            warned=self._megatrain_warned,
            position_limit=self._megatrain_position_limit,
        )
        self._megatrain_batches_checked += 1
        if self.optimizer is not self._megatrain_checked:
            self._megatrain_check_run()  # (create_optimizer ran inside train(): before any work)
            self._megatrain_checked = self.optimizer
        if self.optimizer.nonfinite == "loss" and self.megatrain.engine.dp is None:
            # An earlier micro-batch of this step had a non-finite loss: the step is skipped,
            # the rest of its micro-batches need not run.
            return torch.tensor(float("nan"), device=self.args.device)
        # Non-final micro-batches keep layer gradients on the device; the final one drains them.
        sync = bool(self.accelerator.sync_gradients)
        step = self.state.global_step + 1  # the optimizer step this micro-batch belongs to
        self._megatrain_peaks.step_done(step - 1)
        if step != self._megatrain_replay_step:
            self._megatrain_eager_before = getattr(self.optimizer, "eager_updates", 0)
            self._megatrain_refuse_placeholder_writes()
        self._megatrain_replay_step = step
        self._megatrain_replay.record(step, inputs, num_items_in_batch)
        # A Mapping, not just a dict: collators return BatchEncoding.
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        if ids is not None:
            self._tokens_since_log += ids.numel()
            self.last_seq_len = ids.shape[-1]
        self._megatrain_in_step = True
        try:
            # Each recovery gives up at least one item (a layer's kept activations, its
            # attention outputs, or the layer's place in the HBM tier): bounded by 3 per layer;
            # then each switches on more memory options (at most one rung per option length).
            rungs = len(SEGMENT_LENGTHS) + 2
            for attempt in range(3 * len(self.megatrain.engine.stores) + rungs + 2):
                failure = None
                try:
                    if attempt:
                        self._megatrain_run_again(model)
                    self.megatrain.engine.sync_grads = sync
                    return self._megatrain_training_step(model, inputs, num_items_in_batch)
                except SecondGradientError as err:
                    eager_off = ARGUMENT_NAMER.setting("eager_update", False)
                    raise SecondGradientError(err.layer, eager_off) from None
                except torch.OutOfMemoryError as err:
                    # (Data parallel: the other ranks wait in this step's collectives.)
                    if not self.megatrain_options.oom_recovery or self.megatrain.engine.dp:
                        raise
                    failure = str(err)
                # Outside the except clause: the failed step's graph (held by the traceback's
                # frames) is gone before room is made.
                self._megatrain_recover(failure, step, ids.numel() if ids is not None else 0)
            raise RuntimeError("hf_megatrain: the step kept running out of GPU memory")
        finally:
            self._megatrain_in_step = False

    def _megatrain_refuse_placeholder_writes(self) -> None:
        """Stop where something wrote into a streamed layer's placeholder parameters in place
        since the last step (a callback's ``p.mul_()`` over ``model.parameters()``): the write
        changed no weight, and the run would go on as if it had (found by an audit)."""
        layers = find_decoder_layers(self.model)[1]
        written = written_placeholders(layers)
        if not written:
            return
        prefix = self.megatrain.layers_prefix
        names = [f"{prefix}.{i}.{name}" for i, name in written]
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise ValueError(
            f"hf_megatrain: {names[0]}{more} was written in place through the model's "
            "parameters (e.g. p.mul_() over model.parameters() in a callback), which changed "
            "no weight: a streamed decoder layer's parameters are placeholders on the meta "
            "device, and its weights live in the host store. Write them through "
            "model.state_dict() (its tensors are views of the store: "
            "model.state_dict()[name].mul_(0.9)) or model.load_state_dict()."
        )

    def _megatrain_recover(self, message: str, step: int, micro_batch_tokens: int) -> None:
        """Free the failed step and make room (``oom_watchdog.make_room``); one log line."""
        self.optimizer.wait()  # eager updates of the failed backward, if any, are done
        if getattr(self.optimizer, "eager_updates", 0) != self._megatrain_eager_before:
            raise MemoryPlanError(
                f"hf_megatrain: step {step} ran out of GPU memory after some layers were already "
                "updated during backward (eager updates: no gradient clipping), so it cannot run "
                "again. Resume from the last checkpoint with fewer HBM-tier layers "
                "(megatrain_resident_layers) or with gradient clipping on.",
                tier="gpu",
                needed=0,
                available=0,
            )
        done = make_room(self.model, self.optimizer, message, step, micro_batch_tokens)
        self._megatrain_kept = None  # the layers keeping activations changed
        self._megatrain_peaks.plan_changed()
        logger.warning(
            "hf_megatrain: %s; running the step again from its first micro-batch (same data and "
            "random state)",
            done,
        )

    def _megatrain_run_again(self, model) -> None:
        """Run the step's earlier micro-batches again (their losses were already counted)."""
        replay = self._megatrain_replay
        for batch in replay.earlier:
            replay.restore_rng(batch)
            self.megatrain.engine.sync_grads = False
            self._megatrain_training_step(model, batch.inputs, batch.num_items_in_batch)
        replay.restore_rng(replay.current)

    # ---- out of memory in the optimizer step ----------------------------------------------------
    def _megatrain_optimizer_call(self, part: str, arg: Any = None) -> Any:
        """``part`` of the optimizer step (``_megatrain_optimizer_part``) with the watchdog.

        Out of GPU memory, room is made (HBM-tier layers to the host tier) and the part runs
        again exactly once per relief. Without eager updates nothing was applied before the
        optimizer step's end, and moving layers drops their gradients: the step's micro-batches
        run again first (recorded inputs and random state: the same gradients; their losses were
        already counted), then the parts already done, then this one. With eager updates the
        layers already updated during backward; only a failed ``step()`` runs again (it updates
        the resident parameters, whose gradients stay). A ``step()`` that applied part of its
        update before failing, or a norm whose layer gradients are gone, is refused."""
        step = self.state.global_step + 1
        if step != self._megatrain_parts_step:
            self._megatrain_parts_step, self._megatrain_parts_done = step, []
        opt = self.optimizer
        rerun = False
        for _ in range(3 * len(self.megatrain.engine.stores) + 2):
            failure, before, in_rerun = None, opt.updates_applied, rerun
            try:
                if rerun:
                    self._megatrain_run_step_again(step)
                    in_rerun = False
                    for done, done_arg in self._megatrain_parts_done:
                        self._megatrain_optimizer_part(done, done_arg)
                result = self._megatrain_optimizer_part(part, arg)
            except torch.OutOfMemoryError as err:
                # (Data parallel: the other ranks wait in this step's collectives.)
                if not self.megatrain_options.oom_recovery or self.megatrain.engine.dp:
                    raise
                failure = str(err)
            else:
                self._megatrain_parts_done.append((part, arg))
                return result
            # Outside the except clause: the traceback's frames are gone before room is made.
            rerun = self._megatrain_recover_optimizer(failure, step, part, before, in_rerun)
        raise RuntimeError("hf_megatrain: the optimizer step kept running out of GPU memory")

    def _megatrain_recover_optimizer(
        self, message: str, step: int, part: str, before: int, in_rerun: bool
    ) -> bool:
        """Make room after ``part`` of step ``step``'s optimizer step (or, ``in_rerun``, a
        micro-batch run again for it) ran out of GPU memory; one log line. Returns whether the
        step's micro-batches must run again before the part."""
        opt = self.optimizer
        opt.wait()  # eager or background updates in flight are done
        where = f"step {step}'s " + {"clip": "gradient clipping", "norm": "gradient norm"}.get(
            part, "optimizer step"
        )
        if opt.updates_applied != before:
            raise MemoryPlanError(
                f"hf_megatrain: {where} ran out of GPU memory after part of its update was "
                "already applied, so it cannot run again without applying that part twice. "
                "Resume from the last checkpoint with fewer HBM-tier layers "
                "(megatrain_resident_layers) or more GPU memory free.",
                tier="gpu",
                needed=0,
                available=0,
            )
        eager = opt.eager  # layers update during backward (no clipping)
        if eager and part != "step":
            raise MemoryPlanError(
                f"hf_megatrain: {where} ran out of GPU memory after the layers were already "
                "updated during backward (eager updates: no gradient clipping); giving up "
                "HBM-tier layers drops the gradients the norm needs, and running the step again "
                "would update those layers twice. Resume from the last checkpoint with fewer "
                "HBM-tier layers (megatrain_resident_layers), or train with gradient clipping "
                "(max_grad_norm > 0: nothing updates before the step's end, so it can run again).",
                tier="gpu",
                needed=0,
                available=0,
            )
        if not eager:
            opt.forget_step()  # gradients, clipping coefficient, non-finite marks
            self._megatrain_loss_finite = None
            self.megatrain.engine.abort_step()
        if in_rerun:
            # A micro-batch ran out of memory: the training step's holdings and order.
            done = make_room(self.model, opt, message, step)
        else:
            done = make_room_for_weights(
                self.model,
                opt,
                message,
                where,
                "no HBM-tier layer (the optimizer step holds only what the memory plan counts "
                "besides activations: the resident parameters with their gradients and AdamW "
                "moments, the layer weight buffers). Free the GPU memory other processes hold "
                "(`hf-megatrain plan` shows what the run needs).",
            )
        self._megatrain_kept = None  # the layers keeping activations changed
        self._megatrain_peaks.plan_changed()
        if eager:
            logger.warning(
                "hf_megatrain: %s; running the optimizer step again (the layers updated during "
                "backward keep their update; the resident parameters update now)",
                done,
            )
        else:
            logger.warning(
                "hf_megatrain: %s; running the step again from its first micro-batch (same data "
                "and random state), then its optimizer step",
                done,
            )
        return not eager

    def _megatrain_run_step_again(self, step: int) -> None:
        """Run every micro-batch of optimizer step ``step`` again, the last one syncing (their
        losses were already counted; the step's gradients are made again, the same)."""
        batches = self._megatrain_replay.batches(step)
        if not batches:
            raise RuntimeError(f"hf_megatrain: no micro-batch of step {step} to run again")
        self._megatrain_in_step = True
        try:
            for i, batch in enumerate(batches):
                self._megatrain_replay.restore_rng(batch)
                self.megatrain.engine.sync_grads = i == len(batches) - 1
                self._megatrain_training_step(self._wrapper, batch.inputs, batch.num_items_in_batch)
        finally:
            self._megatrain_in_step = False

    # ---- evaluation ----------------------------------------------------------------------------
    def evaluation_loop(self, *args: Any, **kwargs: Any):
        # The stock Trainer prepares the model with accelerate at its first evaluation before
        # any training (train() prepares it otherwise), times that as model_preparation_time and
        # reports it in that and every later evaluation's metrics. The streamed model is never
        # prepared (``_wrap_model`` returns its wrapper, built with the trainer): the same
        # metric keys, with the time of what stands for the preparation here.
        if not getattr(self, "_megatrain_model_prepared", False):
            start = time.time()
            self._wrap_model(self.model, training=False)
            self.model_preparation_time = round(time.time() - start, 4)
            self._megatrain_model_prepared = True
        self._megatrain_in_eval_loop = True
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self._megatrain_in_eval_loop = False

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's log / evaluate / save after a step; a SIGTERM during its evaluation
        (``EvaluationStopped``) saves the finished step's checkpoint at once and stops. The
        checkpoint records the evaluation as still asked for (``evaluation_owed``): a resume
        from it runs the evaluation first."""
        stop = next(
            (c for c in self.callback_handler.callbacks if isinstance(c, SaveOnSigterm)), None
        )
        step, state = self.state.global_step, self.state
        if getattr(self, "_megatrain_stopped_at", None) == step:
            # Saved at this step already (a signal stopped the run): the Trainer's call after
            # the epoch loop breaks must neither save again (found by audits: written twice)
            # nor evaluate (the epoch's evaluation ran, or was stopped, with that save).
            self.control.should_evaluate = self.control.should_save = False
            self.control.should_log = False
            return None
        if stop is not None and stop.requested and stop.stopped_at == step:
            # The run stops after this step. Where the uninterrupted run evaluates right after
            # it (eval_strategy "epoch" at the epoch's end or the last step), that evaluation
            # comes before the stop's save, as there (or stops at once, recorded as owed).
            epoch_end = state.epoch is not None and float(state.epoch).is_integer()
            if self.args.eval_strategy == "epoch" and (epoch_end or step >= state.max_steps):
                self.control.should_evaluate = True
        self._megatrain_after_step = True  # (an evaluation here may stop: prediction_step)
        try:
            result = super()._maybe_log_save_evaluate(*args, **kwargs)
            if stop is not None and stop.stopped_at == step:  # (saved: on_step_end asked it)
                self._megatrain_stopped_at = step
            return result
        except EvaluationStopped:
            pass
        finally:
            self._megatrain_after_step = False
        bound = inspect.signature(super()._maybe_log_save_evaluate).bind(*args, **kwargs)
        logger.warning(
            "hf_megatrain: %s during evaluation: the evaluation is stopped; saving checkpoint-%d "
            "(its step is complete), then stopping",
            stop.received.name,
            self.state.global_step,
        )
        self._save_checkpoint(bound.arguments["model"], bound.arguments["trial"])
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        self.control.should_evaluate = self.control.should_log = False
        self.control.should_training_stop = True
        stop.stopped_at = self._megatrain_stopped_at = self.state.global_step
        return None

    def _evaluate(self, trial: Any, ignore_keys_for_eval: Any, skip_scheduler: bool = False):
        checkpoint = getattr(self, "_megatrain_owed_evaluation", None)
        if checkpoint is None:
            return super()._evaluate(trial, ignore_keys_for_eval, skip_scheduler)
        # The evaluation a signal stopped (``train``): run as the uninterrupted run ran it at
        # this step (its metrics logged, the best metric, a ReduceLROnPlateau step), then the
        # checkpoint saved again as that run saved it (the RNG state it records: the
        # checkpoint's, which the Trainer loads again before the next step).
        self._megatrain_owed_evaluation = None
        logger.warning(_OWED_EVALUATION, checkpoint)
        self._load_rng_state(checkpoint)
        metrics = super()._evaluate(trial, ignore_keys_for_eval, skip_scheduler=False)
        self._determine_best_metric(metrics=metrics, trial=trial)
        self._save_checkpoint(self.model_wrapped, trial)
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        return metrics

    def evaluate_stopped_step(self, checkpoint: str) -> TrainerState:
        """Run the evaluation a signal stopped before ``checkpoint`` was saved
        (``evaluation_owed``) on its weights, for a run that ends there (its step is
        ``max_steps``): its state with that evaluation logged and the best metric and best
        checkpoint (where it exists) decided, as the uninterrupted run decided them. The
        checkpoint itself is not written again."""
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        self._load_from_checkpoint(checkpoint)
        logger.warning(_OWED_EVALUATION, checkpoint)
        metrics = self.evaluate()
        self._determine_best_metric(metrics=metrics, trial=None)
        best = self.state.best_global_step
        path = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), f"checkpoint-{best}")
        if best and os.path.isdir(path):
            self.state.best_model_checkpoint = path
        return self.state

    # ---- out of memory in evaluation ----------------------------------------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The Trainer's evaluation batch with the watchdog: out of GPU memory, HBM-tier layers
        move to the host tier (an evaluation forward holds no activations to give up) and the
        batch runs again, once per relief, with the same inputs and random state: the same
        outputs, which the evaluation loop had not taken yet. Data parallel: the rows
        ``even_batches`` repeated into a partial last batch are masked (``_megatrain_unrepeat``)."""
        if getattr(self, "_megatrain_after_step", False) and any(
            isinstance(c, SaveOnSigterm) and c.stops_evaluation
            for c in self.callback_handler.callbacks
        ):
            raise EvaluationStopped  # (not in eval_on_start's evaluation: no step to save)
        state = getattr(self, "megatrain", None)
        if state is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        masked = False
        if self.args.world_size > 1 and getattr(self, "_megatrain_in_eval_loop", False):
            # The evaluation's partial last batch: rows even_batches repeated out of the loss.
            inputs, masked = self._megatrain_unrepeat(inputs)
        loss, logits, labels = self._megatrain_prediction_step(
            model, inputs, prediction_loss_only, ignore_keys
        )
        if masked and loss is not None:
            # Each rank's loss is its real tokens' loss sum x world / all ranks' real tokens;
            # the loop repeats it eval_batch_size times per rank and keeps the first R values
            # of the gathered ones (R rows are real), which weighs the ranks unlike their rows.
            # Every rank reports the batch's loss over all its real tokens instead: the mean
            # over the ranks, which the R values then carry as one process's batch of R rows.
            loss = self.accelerator.reduce(loss, reduction="mean")
        return loss, logits, labels

    def _megatrain_prediction_step(self, model, inputs, prediction_loss_only, ignore_keys):
        state = self.megatrain
        rng = rng_state(state.engine.device)
        wrapper = model if isinstance(model, StreamedModelWrapper) else None
        for _ in range(len(state.engine.stores) + 1):
            failure = None
            try:
                with (
                    wrapper.loss_only_evaluation(prediction_loss_only)
                    if wrapper is not None
                    else contextlib.nullcontext()
                ):
                    return super().prediction_step(
                        model, inputs, prediction_loss_only, ignore_keys=ignore_keys
                    )
            except torch.OutOfMemoryError as err:
                if not self.megatrain_options.oom_recovery or state.engine.dp:
                    raise
                failure = str(err)
            self._megatrain_recover_eval(failure)
            set_rng_state(rng, state.engine.device)
        raise RuntimeError("hf_megatrain: the evaluation batch kept running out of GPU memory")

    def _megatrain_recover_eval(self, message: str) -> None:
        engine = self.megatrain.engine
        if engine.has_grads():
            # (The Trainer evaluates between optimizer steps; a callback may not.)
            raise MemoryPlanError(
                "hf_megatrain: evaluation ran out of GPU memory in the middle of an optimizer "
                "step (its gradients are held), so no HBM-tier layer can move to the host tier "
                "without losing them. Evaluate between optimizer steps (the Trainer's "
                "eval_strategy does), or with a smaller per_device_eval_batch_size.",
                tier="gpu",
                needed=0,
                available=0,
            )
        if self.optimizer is not None:
            self.optimizer.wait()
        engine.abort_step()  # the failed batch's weight slots
        done = make_room_for_weights(
            self.model,
            self.optimizer,
            message,
            "evaluation",
            "no HBM-tier layer (an evaluation forward holds no activations to give up). Evaluate "
            "with a smaller per_device_eval_batch_size or shorter rows, or with "
            "prediction_loss_only / eval_accumulation_steps so fewer logits stay on the GPU.",
        )
        self._megatrain_kept = None  # the layers keeping activations changed
        self._megatrain_peaks.plan_changed()
        logger.warning("hf_megatrain: %s; running the evaluation batch again (same inputs)", done)

    def _megatrain_training_step(self, model, inputs, num_items_in_batch=None):
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        if ids is not None:
            self.fit_kept_activations(ids.numel())
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        except (NotImplementedError, RuntimeError) as err:
            if "meta tensor" not in str(err):
                raise
            # (Found by an audit: an L2 penalty over model.parameters() in compute_loss failed
            # inside autograd.)
            raise ValueError(
                "hf_megatrain: the step read a meta tensor's data: a streamed decoder layer's "
                "parameters (model.parameters(), named_parameters()) are placeholders on the "
                "meta device, and only the layer's own forward sees its weights. Losses or "
                "penalties computed from them (e.g. an L2 term over model.parameters() in "
                "compute_loss) cannot run here; for a decay of the weights use weight_decay "
                f"(AdamW's, applied to the host masters). ({err})"
            ) from err

    def fit_kept_activations(self, tokens: int) -> None:
        """Recompute every layer for a micro-batch larger than the plan sized kept activations for.

        "auto" keeps activations of as many HBM-tier layers as the planned micro-batch leaves room
        for (its row length is the first example's unless megatrain_plan_seq_len says); a longer
        batch would need more than the plan holds free. Such a micro-batch recomputes like a
        streamed layer (same results), and the next one that fits keeps them again.
        """
        plan = self.megatrain.plan
        if plan is None or plan.step is None or not plan.kept_layers:
            return
        kept = getattr(self, "_megatrain_kept", None)
        if kept is None:  # the layers that keep activations, found once
            layers = [layer.forward for layer in find_decoder_layers(self.model)[1]]
            kept = self._megatrain_kept = [layer for layer in layers if layer.keep_graph]
        over = tokens > plan.step.micro_batch_tokens
        if over and not getattr(self, "_megatrain_warned_kept", False):
            self._megatrain_warned_kept = True
            logger.warning(
                "hf_megatrain: a micro-batch of %d tokens is larger than the %d the memory plan "
                "sized kept activations for; such micro-batches recompute every layer (set "
                "megatrain_plan_seq_len to the longest row to plan for it)",
                tokens,
                plan.step.micro_batch_tokens,
            )
        for layer in kept:
            layer.keep_graph = not over

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.megatrain_options.log_throughput and "loss" in logs:
            logs.update(self._throughput_logs())
        skipped = getattr(self.optimizer, "skipped_steps", 0)
        if skipped and "loss" in logs:
            logs["nonfinite_skipped"] = skipped  # steps skipped so far in this run
        super().log(logs, *args, **kwargs)

    @property
    def attention_row_len(self) -> int:
        """The row length each token of the last micro-batch attended over: the whole row, N
        times the local shard under sequence parallelism (each rank attends for its tokens over
        the whole row with 1/N of the heads: the same FLOPs per local token as whole rows)."""
        sp = getattr(self, "_megatrain_sp", None)
        return self.last_seq_len * (1 if sp is None else sp.size)

    def _throughput_logs(self) -> dict[str, float]:
        """tokens/s, model TFLOP/s, MFU, waits for the host update and memory since the last
        log, for the Trainer's logs."""
        out: dict[str, float] = {}
        now = time.perf_counter()
        elapsed = now - self._time_of_log
        if elapsed > 0 and self._tokens_since_log:
            # Every data-parallel rank processes as many tokens: report the whole job's rate
            # (and MFU per GPU below).
            world = max(int(self.args.world_size), 1)
            tps = self._tokens_since_log * world / elapsed
            out["tokens_per_s"] = round(tps, 1)
            # Model FLOPs as in the benchmarks (hf/flops.py): 6 x the parameters a token runs
            # through, plus causal attention for MFU (recompute not counted: it is overhead).
            n_params = self._active_params()
            out["model_tflops"] = float(f"{6 * n_params * tps / 1e12:.4g}")
            peak = self.megatrain_options.peak_tflops
            if self.megatrain.engine.is_cuda and peak:
                out["mfu"] = model_flops_utilization(
                    self.model.config, n_params, tps, world, peak, self.attention_row_len
                )
        self._tokens_since_log = 0
        self._time_of_log = now
        # Seconds the training thread waited for the host AdamW since the last log: > 0 where
        # the CPU update, not the GPU, set the pace (host memory bandwidth).
        waited = self.megatrain.engine.host_wait_s
        out["host_update_wait_s"] = round(waited - self._host_wait_at_log, 3)
        self._hint_device_updates(waited - self._host_wait_at_log, elapsed)
        self._host_wait_at_log = waited
        # Host-layer updates the GPU took over from a CPU update that fell behind the forward.
        on_gpu = self.megatrain.engine.device_updates
        out["host_updates_on_gpu"] = on_gpu - self._gpu_updates_at_log
        self._gpu_updates_at_log = on_gpu
        # The host AdamW's rate over the layer updates its thread ran since the last log (the
        # machine's memory bandwidth: what host_update_wait_s follows).
        totals = self.megatrain.engine.host_update_seconds
        if (rate := host_update_rate(self._cpu_update_at_log, totals)) is not None:
            out["host_update_gparams_s"] = round(rate, 3)
        self._cpu_update_at_log = totals
        rss, hwm = _host_memory_gib()
        if rss is not None:
            out["host_rss_gib"] = rss
            out["host_peak_gib"] = hwm
        if self.megatrain.engine.is_cuda:
            out["hbm_peak_gib"] = round(torch.cuda.max_memory_reserved(self.args.device) / 2**30, 2)
        return out

    def _hint_device_updates(self, waited_s: float, elapsed_s: float) -> None:
        """Once per run: ``device_update_hint``'s advice, where two log intervals in a row
        have it (the first steps' waits can be start-up's)."""
        if self._device_update_hinted:
            return
        hint = device_update_hint(
            self.megatrain_options, waited_s, elapsed_s, int(self.args.world_size)
        )
        previous, self._device_update_hint_seen = self._device_update_hint_seen, hint is not None
        if hint is not None and previous:
            self._device_update_hinted = True
            logger.warning("hf_megatrain: %s", hint)

    def _active_params(self) -> int:
        if not hasattr(self, "_n_active_params"):
            self._n_active_params = active_params(self.model)  # meta placeholders count too
        return self._n_active_params

    # ---- saving --------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        check_weights_finite(self.model, output_dir)  # a NaN/inf model is never written
        if getattr(self, "_megatrain_in_checkpoint", False):
            # A checkpoint's staging folder: published whole, with its manifest, afterwards.
            # Always the fp32 masters, so a resume from it continues bit for bit.
            self._megatrain_write_model(output_dir, torch.float32)
            return
        logger.info("hf_megatrain: saving model to %s", output_dir)
        # Model, tokenizer and training_args.bin are written into one hidden folder beside
        # output_dir and swapped in together (other entries of output_dir are kept).
        export = EXPORT_DTYPES[self.megatrain_options.export_dtype]
        # The manifest records which step (and which checkpoint's weights, after
        # load_best_model_at_end) the model is: a re-run of the CLI compares it with its
        # newest checkpoint to know whether the final model is still to be written.
        saved_from = {
            "global_step": self.state.global_step,
            "weights_from": getattr(self, "_megatrain_best_loaded", None),
        }
        with staged_model_folder(output_dir, saved_from) as folder:
            self._megatrain_write_model(folder, export)

    def _megatrain_write_model(self, folder: str, dtype: torch.dtype) -> None:
        write_streamed_pretrained(self.model, folder, self.megatrain_options.max_shard_size, dtype)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(folder)
        torch.save(self.args, os.path.join(folder, "training_args.bin"))

    def _save_checkpoint(self, model, trial) -> None:
        """Write the checkpoint under a staging name and publish it when complete.

        Every file (weights, optimizer state, scheduler, RNG and a trainer_state.json that names
        the final folder) is written in staging, fsynced and listed in the manifest; then the
        folder is renamed (swapped, over an existing one) into place and nothing in it is
        rewritten. ``get_last_checkpoint`` (and resume) only ever see complete folders.
        """
        real_get_output_dir = self._get_output_dir
        run_dir = real_get_output_dir(trial=trial)
        staging_root = os.path.join(run_dir, ".megatrain-staging")
        name = f"checkpoint-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        staged = os.path.join(staging_root, name)
        dp = self.megatrain.engine.dp
        # Data parallel: every rank writes into the staging folder (its owned layers' optimizer
        # state, its RNG state); rank 0 alone clears it before and publishes it after.
        if dp is None or dp.rank == 0:
            recover(final)  # a swap of this checkpoint killed half way
            shutil.rmtree(staged, ignore_errors=True)
        if dp is not None:
            dp.barrier()
        self._get_output_dir = lambda trial=None: staging_root
        self._megatrain_in_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        except BaseException as err:
            code = None
            if dp is None and isinstance(err, Exception):
                code = out_of_disk_space(err, staged)
            if dp is None or dp.rank == 0:
                shutil.rmtree(staging_root, ignore_errors=True)
            if code is not None:
                # (Found by an audit: the run stopped inside safetensors' writer.)
                then = "resume from the newest complete checkpoint"
                raise DiskFullError(code, disk_full_message(final, code, then)) from err
            raise
        finally:
            del self._get_output_dir
            self._megatrain_in_checkpoint = False
        # The Trainer looked for the best checkpoint in the staging root: point it at run_dir
        # (the current step's folder is published below).
        if self.state.best_global_step:
            best = os.path.join(run_dir, f"checkpoint-{self.state.best_global_step}")
            if self.state.best_global_step == self.state.global_step or os.path.isdir(best):
                self.state.best_model_checkpoint = best
        if dp is not None:
            dp.barrier()  # every rank's files are in staging
        if dp is None or dp.rank == 0:
            try:
                if self.args.should_save:
                    # trainer_state.json as published: final paths, before the manifest.
                    self.state.save_to_json(os.path.join(staged, "trainer_state.json"))
                # The layout its steps took their rows at and the other run-defining
                # arguments: a resume with others is checked against them
                # (_megatrain_check_layout, _megatrain_check_resumed_run).
                record = {
                    MANIFEST_KEY: self._megatrain_layout().record(),
                    RUN_ARGUMENTS_KEY: run_arguments(self.args),
                }
                write_manifest(staged, record)
                publish(staged, final)
            finally:
                shutil.rmtree(staging_root, ignore_errors=True)
        if dp is not None:
            dp.barrier()  # rank 0 has published the checkpoint
        if self.args.should_save:
            # The Trainer rotated checkpoints inside the staging root, where there are none:
            # apply save_total_limit to the real run directory now that the new one is there.
            _rotate_checkpoints(self, run_dir)
        if getattr(self, "_megatrain_push_pending", False):
            self._megatrain_push_pending = False
            super()._push_from_checkpoint(final)  # (the published folder, manifest included)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # The Trainer pushes from inside _save_checkpoint, where the checkpoint is still in
        # its staging folder: that push uploaded the staging folder (optimizer state
        # included) with the model, and pointed last-checkpoint at a folder renamed away
        # (found by an audit). It waits for the publish (_save_checkpoint).
        if getattr(self, "_megatrain_in_checkpoint", False):
            self._megatrain_push_pending = True
            return
        super()._push_from_checkpoint(checkpoint_folder)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.megatrain.engine.dp is not None:
            # Each rank writes the optimizer state of the layers it owns.
            save_optimizer_state(self.optimizer, output_dir, self.megatrain_options.max_shard_size)
        if not self.args.should_save:
            return
        if self.megatrain.engine.dp is None:
            save_optimizer_state(self.optimizer, output_dir, self.megatrain_options.max_shard_size)
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))

    # ---- loading -------------------------------------------------------------------------------
    def _megatrain_verify(self, checkpoint: str, allow_missing_state: bool) -> list[str]:
        """Check ``checkpoint`` against its manifest before reading it; returns the optimizer /
        scheduler files it lacks where ``allow_missing_state`` lets them be missing."""
        recover(checkpoint)  # a swap of this folder killed half way: the complete set back
        optional = (
            (lambda rel: rel == _SCHEDULER_NAME or rel.startswith(f"{OPTIMIZER_STATE_DIR}/"))
            if allow_missing_state
            else None
        )
        result = verify_folder(checkpoint, allow_missing=optional)
        if not result.manifest:
            logger.warning(
                "hf_megatrain: %s has no megatrain_manifest.json (saved by an older version or "
                "not by hf_megatrain): its files are loaded unverified",
                checkpoint,
            )
        return result.missing

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # Missing optimizer / scheduler files are judged (error or allowed) in
        # _load_optimizer_and_scheduler, with or without a manifest.
        self._megatrain_missing_state = self._megatrain_verify(resume_from_checkpoint, True)
        # Verified: the saves past it in the output_dir are set aside (never before a refusal;
        # found by an audit). hf_megatrain/hf/superseded.py.
        if self.args.should_save:
            set_aside_later_saves(self.args.output_dir, resume_from_checkpoint)
        self.accelerator.wait_for_everyone()  # (before any rank reads the output_dir)
        if _is_peft(self.model):
            # Adapter checkpoints: the adapters are ordinary resident parameters, loaded by
            # the Trainer's own PEFT path; the frozen base in the store is unchanged.
            return super()._load_from_checkpoint(resume_from_checkpoint, self.model)
        logger.info("hf_megatrain: loading weights from %s", resume_from_checkpoint)
        load_weights_into_store(self.model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # (Right after create_optimizer, before a resume loads state into the optimizer.)
        self._megatrain_check_run()
        self._megatrain_checked = self.optimizer
        if checkpoint is None:
            return
        sched = os.path.join(checkpoint, _SCHEDULER_NAME)
        # Files the manifest lists but the folder lacks (verified in _load_from_checkpoint).
        listed = getattr(self, "_megatrain_missing_state", None) or []
        gone_opt = [os.path.join(checkpoint, r) for r in listed if r != _SCHEDULER_NAME]
        folder = os.path.join(checkpoint, OPTIMIZER_STATE_DIR)
        if len(gone_opt) > 2:
            # (Named one by one they made a line of ~900 characters, found by an audit.)
            gone = "the whole folder" if not os.path.isdir(folder) else f"e.g. {gone_opt[0]}"
            gone_opt = [f"{folder} ({gone}: {len(gone_opt)} files its manifest lists)"]
        has_opt = has_optimizer_state(checkpoint) and not gone_opt
        missing = [] if has_opt else gone_opt or [folder]
        missing += [] if os.path.isfile(sched) else [sched]
        if missing and not self.megatrain_options.resume_without_optimizer_state:
            raise FileNotFoundError(
                f"hf_megatrain: cannot resume from {checkpoint}: {' and '.join(missing)} "
                f"missing{stock_optimizer_note(checkpoint) if not has_opt else ''}"
                f"{_weights_only_note(checkpoint, missing)}. Resume from "
                "a complete checkpoint, or set "
                "megatrain_resume_without_optimizer_state=True to go on with AdamW moments at "
                "zero and the learning-rate schedule restarted."
            )
        if missing:
            logger.warning(
                "hf_megatrain: resuming without %s (megatrain_resume_without_optimizer_state): "
                "what is missing starts afresh",
                " and ".join(missing),
            )
        if has_opt:
            load_optimizer_state(self.optimizer, checkpoint, self.megatrain.full_name)
        if os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        logger.info("hf_megatrain: loading best model from %s", best)
        self._megatrain_verify(best, allow_missing_state=True)  # the weights must be intact
        if _is_peft(self.model):
            super()._load_from_checkpoint(best, self.model)
        else:
            load_weights_into_store(self.model, best)
        self._megatrain_best_loaded = os.path.basename(os.path.normpath(best))


class HFMegaTrainer(MegaTrainerMixin, Trainer):
    """Drop-in ``Trainer`` for decoder LLMs larger than the GPU.

    ``model`` is a ``*ForCausalLM`` model of a supported architecture, either materialized (its
    decoder layers are moved into the host store here) or already streamed, e.g. loaded with
    :func:`hf_megatrain.load_streamed_model`. ``args`` may be a :class:`MegaTrainArguments` or a
    plain ``TrainingArguments``.
    """


__all__ = [
    "HFMegaTrainer",
    "InsufficientHostMemoryError",
    "MegaTrainerMixin",
    "StreamedModelWrapper",
]
