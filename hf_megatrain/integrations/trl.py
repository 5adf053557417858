"""TRL on a streamed model (``pip install trl``): SFT, DPO and GRPO trainers.

``MegaSFTTrainer(MegaTrainerMixin, SFTTrainer)``: SFTTrainer tokenizes the dataset, picks its
collator, wraps the model with LoRA from ``peft_config`` and computes the loss with its fused
LM head; the mixin streams the final model's decoder layers from host RAM and runs the host
AdamW, as in :class:`hf_megatrain.HFMegaTrainer`. ``MegaSFTConfig`` is ``SFTConfig`` plus the
``megatrain_*`` knobs of :class:`hf_megatrain.MegaTrainArguments`.

``MegaDPOTrainer(MegaTrainerMixin, DPOTrainer)`` (with ``MegaDPOConfig``): the same for DPO, whose
reference model streams frozen (weights only, in the compute dtype) from its own host store
instead of being a whole copy on the GPU, so DPO of a model larger than the GPU runs.
``MegaGRPOTrainer(MegaTrainerMixin, GRPOTrainer)`` (with ``MegaGRPOConfig``): GRPO on a streamed
policy, generating with transformers' ``generate``; with ``beta > 0`` the same frozen reference.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import TrainingArguments

from ..hf.arguments import MegaTrainArguments, engine_options
from ..hf.checkpoint import host_state_dict
from ..hf.loading import frozen_streamed_copy, load_streamed_model
from ..hf.model import StreamedModelState, _is_peft, streamed_state
from ..hf.trainer import MegaTrainerMixin, StreamedModelWrapper, _setup_args

try:
    import trl.trainer.dpo_trainer as _dpo_module
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
    from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model
except ImportError as e:  # an optional dependency: say how to get it
    raise ImportError(
        f"hf_megatrain.integrations.trl needs TRL: `pip install trl` (importing it failed: {e})"
    ) from e


@dataclass
class MegaSFTConfig(SFTConfig, MegaTrainArguments):
    """``SFTConfig`` with the ``megatrain_*`` fields of :class:`MegaTrainArguments`.

    SFTConfig comes first so its defaults of the shared ``TrainingArguments`` fields win (as with
    a plain ``SFTConfig``); every field keeps its ``help`` metadata for ``HfArgumentParser``.
    """


class MegaSFTTrainer(MegaTrainerMixin, SFTTrainer):
    """TRL ``SFTTrainer`` whose model's decoder layers stream from host RAM.

    Takes SFTTrainer's arguments. ``args`` may be a :class:`MegaSFTConfig`, an ``SFTConfig`` (the
    engine knobs keep their defaults) or any ``TrainingArguments`` (converted to
    ``MegaSFTConfig``, keeping its ``megatrain_*`` values). The model is streamed once SFTTrainer
    has built the final one, i.e. after it added the adapters from ``peft_config``: the frozen
    base then streams from frozen host stores and the adapters stay resident and trainable.
    """

    # SFTTrainer may still replace the model (PEFT wrapping, a model name to load, new chat-
    # template tokens resizing the embeddings): stream the one it hands to Trainer.__init__.
    _megatrain_prepare_late = True

    def __init__(self, model: Any, args: TrainingArguments | None = None, *a, **kw) -> None:
        if isinstance(args, TrainingArguments) and not isinstance(args, SFTConfig):
            # SFTTrainer would rebuild a plain SFTConfig from it and drop the megatrain_* knobs.
            values = args.to_dict()
            values["hub_token"] = args.hub_token  # to_dict hides it
            args = MegaSFTConfig(**values)
        super().__init__(model, args, *a, **kw)

    def _megatrain_default_args(self, model: Any) -> TrainingArguments:
        # SFTTrainer's own default (output dir "<model name>-SFT"), with the engine knobs.
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
        return MegaSFTConfig(f"{(name or 'model').split('/')[-1]}-SFT")


logger = logging.getLogger(__name__)

# DPOTrainer.__init__'s parameters after ``model, ref_model, args``, in order: positional
# extras are passed on by name (the mixin passes ``args`` by keyword).
_DPO_POSITIONAL = (
    "data_collator",
    "train_dataset",
    "eval_dataset",
    "processing_class",
    "compute_metrics",
    "callbacks",
    "optimizers",
    "quantization_config",
    "peft_config",
)


class _StreamedReference(StreamedModelWrapper):
    """The reference model as TRL calls it: no gradient, the run's autocast, no KV cache."""

    def forward(self, *args, **kwargs):
        with torch.no_grad():
            return super().forward(*args, **kwargs)


class _HostWeights:
    """What TRL's ``hash_module`` reads (``state_dict()``) for a streamed model: its weights
    from the host store (its own ``state_dict`` holds ``meta`` placeholders for the layers)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return host_state_dict(self.model)


@contextlib.contextmanager
def _hash_streamed_weights() -> Iterator[None]:
    """``precompute_ref_log_probs`` fingerprints the reference (or policy) with TRL's
    ``hash_module``, which would copy the ``meta`` placeholders: hash the host weights instead
    (same hash function over the same tensors)."""
    original = getattr(_dpo_module, "hash_module", None)
    if original is None:  # another TRL version: nothing to redirect
        yield
        return

    def hash_module(module: nn.Module) -> str:
        return original(_HostWeights(module) if streamed_state(module) is not None else module)

    _dpo_module.hash_module = hash_module
    try:
        yield
    finally:
        _dpo_module.hash_module = original


def _as_config(args: TrainingArguments | None, config_cls: type) -> Any:
    """``args`` as ``config_cls``, a TRL config with the megatrain_* fields (None stays None).

    An instance of the TRL config itself is kept (the engine options keep their defaults).
    """
    trl_config = config_cls.__mro__[1]  # (MegaXConfig, XConfig, ...)
    if args is None or isinstance(args, trl_config):
        return args
    # The TRL trainer would need its own config class; keep the megatrain_* knobs.
    values = args.to_dict()
    values["hub_token"] = args.hub_token  # to_dict hides it
    return config_cls(**values)


def _frozen_reference(
    model: nn.Module | str, ref_model: nn.Module | str | None, args: TrainingArguments
) -> nn.Module:
    """The reference as a frozen streamed model: ``ref_model`` (a path, a model, or one already
    streaming frozen), or a copy of ``model``'s current (initial) weights."""
    source = model if ref_model is None else ref_model
    bf16 = bool(args.bf16)
    options = engine_options(args)
    # The policy's kernels, so both compute the same way.
    liger = {
        "use_liger_kernel": bool(getattr(args, "use_liger_kernel", False)),
        "liger_kernel_config": getattr(args, "liger_kernel_config", None),
    }
    if isinstance(source, str):
        revision = (getattr(args, "model_init_kwargs", None) or {}).get("revision")
        reference = load_streamed_model(
            source, options, device=args.device, bf16=bf16, trainable=False, revision=revision,
            **liger,
        )  # fmt: skip
    elif (state := streamed_state(source)) is not None and state.frozen:
        want = torch.bfloat16 if bf16 else torch.float32
        engine = state.engine
        device = torch.device(args.device).type
        if engine.compute_dtype != want or engine.device.type != device:
            raise ValueError(
                f"hf_megatrain: ref_model streams {engine.compute_dtype} weights on "
                f"{engine.device.type}, but the run computes in {want} on {device}; stream it "
                "with the run's bf16 and device."
            )
        reference = source
    else:
        if state is not None and ref_model is not None:
            logger.warning(
                "hf_megatrain: ref_model is a trainable streamed model; its weights are copied "
                "into a frozen store (load it with load_streamed_model(..., trainable=False) "
                "to skip the copy and its optimizer-state memory)"
            )
        reference = frozen_streamed_copy(source, options, device=args.device, bf16=bf16, **liger)
    # TRL hands the reference to accelerator.prepare_model, which would move it to the device
    # as a whole: its layers' parameters are meta placeholders and its resident parts are placed.
    reference._is_accelerate_prepared = True
    return reference


def _no_sync_ref_model(args: TrainingArguments) -> None:
    if getattr(args, "sync_ref_model", False):
        raise ValueError(
            "hf_megatrain: sync_ref_model=True is not supported: the reference streams from a "
            "frozen weights-only store that is never updated; leave sync_ref_model off."
        )


def _is_peft_model(model: Any) -> bool:
    return isinstance(model, nn.Module) and _is_peft(model)


@dataclass
class MegaDPOConfig(DPOConfig, MegaTrainArguments):
    """``DPOConfig`` with the ``megatrain_*`` fields of :class:`MegaTrainArguments`.

    DPOConfig comes first so its defaults of the shared ``TrainingArguments`` fields win (as with
    a plain ``DPOConfig``: ``bf16=True``, which needs a GPU; pass ``bf16=False`` on a CPU).
    """


class MegaDPOTrainer(MegaTrainerMixin, DPOTrainer):
    """TRL ``DPOTrainer`` whose policy and reference model both stream from host RAM.

    Takes DPOTrainer's arguments. ``args`` may be a :class:`MegaDPOConfig`, a ``DPOConfig`` or
    any ``TrainingArguments`` (converted to ``MegaDPOConfig``, keeping its ``megatrain_*``
    values). The policy streams as with :class:`hf_megatrain.HFMegaTrainer`. The reference:

    * ``ref_model=None`` (full fine-tuning): a frozen streamed copy of the policy's initial
      weights, made here (:func:`hf_megatrain.frozen_streamed_copy`): decoder layers from a
      weights-only host store in the compute dtype (host RAM: 2 bytes/param in bf16, 4 in fp32;
      no gradient or AdamW moments), embeddings / norm / LM head a frozen fp32 copy on the GPU.
      In bf16 its weights are exactly the bf16 copy the policy's first forward streams.
    * ``ref_model`` a checkpoint path or Hub id: loaded frozen that way
      (``load_streamed_model(path, trainable=False)``); a model: copied frozen that way, unless
      it already streams frozen (``trainable=False``), then it is used as it is.
    * ``peft_config`` (or a PEFT model): no reference model; TRL disables the adapters, and the
      base already streams from frozen stores. ``precompute_ref_log_probs=True`` with no
      ``ref_model``: none either; the policy computes the reference log-probs before training.

    The reference runs under ``no_grad``, streamed, with the policy's device and autocast.
    ``megatrain_ref`` is its streamed state (``None`` without a reference model).
    """

    # DPOTrainer may still replace the model (PEFT wrapping, a model name to load, a "ref"
    # adapter added to a PEFT model): stream the one it hands to Trainer.__init__.
    _megatrain_prepare_late = True

    def __init__(
        self,
        model: nn.Module | str,
        ref_model: nn.Module | str | None = None,
        args: TrainingArguments | None = None,
        *a: Any,
        **kw: Any,
    ) -> None:
        if len(a) > len(_DPO_POSITIONAL):
            raise TypeError(
                f"hf_megatrain: {type(self).__name__} takes at most "
                f"{3 + len(_DPO_POSITIONAL)} positional arguments"
            )
        kw.update(zip(_DPO_POSITIONAL, a))
        if model is None:
            raise ValueError(f"hf_megatrain: {type(self).__name__} needs a model")
        args = _as_config(args, MegaDPOConfig)
        if args is None:
            args = self._megatrain_default_args(model)
        _setup_args(args)  # refuses what cannot run before a reference is built
        _no_sync_ref_model(args)
        reference = None
        if kw.get("peft_config") is not None or _is_peft_model(model):
            if ref_model is not None:
                raise ValueError(
                    "hf_megatrain: with peft_config (or a PEFT model) the reference is the frozen "
                    "streamed base with the adapters disabled; leave ref_model=None."
                )
        elif ref_model is not None or not args.precompute_ref_log_probs:
            # (precompute_ref_log_probs without ref_model: TRL runs the still initial policy
            # over the data before training, and needs no reference model.)
            reference = _frozen_reference(model, ref_model, args)
        #: The reference model's streamed state (None without a reference model).
        self.megatrain_ref: StreamedModelState | None = (
            streamed_state(reference) if reference is not None else None
        )
        hashing = _hash_streamed_weights() if args.precompute_ref_log_probs else None
        with hashing or contextlib.nullcontext():
            super().__init__(model, args, ref_model=reference, **kw)
        if reference is not None:
            # TRL calls self.ref_model(...) inside no_grad but without autocast (accelerate adds
            # it to a model it prepares): the wrapper runs the reference as the policy runs.
            self.ref_model = _StreamedReference(
                reference, self._wrapper.compute_dtype, self.args.device, fused_loss=False
            )

    def _megatrain_default_args(self, model: Any) -> TrainingArguments:
        # DPOTrainer's own default (output dir "<model name>-DPO"), with the engine knobs.
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
        return MegaDPOConfig(f"{(name or 'model').split('/')[-1]}-DPO")


@dataclass
class MegaGRPOConfig(GRPOConfig, MegaTrainArguments):
    """``GRPOConfig`` with the ``megatrain_*`` fields of :class:`MegaTrainArguments`."""


class MegaGRPOTrainer(MegaTrainerMixin, GRPOTrainer):
    """TRL ``GRPOTrainer`` on a streamed policy, generating with transformers' ``generate``.

    Takes GRPOTrainer's arguments, plus ``ref_model`` (keyword) as in :class:`MegaDPOTrainer`.
    ``beta=0`` (TRL's default) needs no reference model. With ``beta > 0`` the reference is a
    frozen streamed model (a copy of the policy's initial weights, or ``ref_model``), as for
    DPO; with ``peft_config`` TRL disables the adapters instead. Generation runs the streamed
    policy under ``no_grad`` (every decoder layer streams once per generated token: slow for
    long completions). vLLM and transformers' continuous batching are refused (both need the
    whole model on the GPU).
    """

    _megatrain_prepare_late = True

    def __init__(
        self,
        model: nn.Module | str,
        reward_funcs: Any = None,
        args: TrainingArguments | None = None,
        *a: Any,
        ref_model: nn.Module | str | None = None,
        **kw: Any,
    ) -> None:
        if a:
            raise TypeError(
                f"hf_megatrain: {type(self).__name__}: pass the arguments after args by keyword "
                "(train_dataset=..., processing_class=...)"
            )
        if model is None:
            raise ValueError(f"hf_megatrain: {type(self).__name__} needs a model")
        args = _as_config(args, MegaGRPOConfig)
        if args is None:
            args = self._megatrain_default_args(model)
        _setup_args(args)
        _no_sync_ref_model(args)
        for flag in ("use_vllm", "use_transformers_continuous_batching"):
            if getattr(args, flag, False):
                raise ValueError(
                    f"hf_megatrain: {flag}=True is not supported: it needs the whole policy on "
                    "the GPU; generation runs the streamed policy with transformers' generate."
                )
        peft = kw.get("peft_config") is not None or _is_peft_model(model)
        if peft and ref_model is not None:
            raise ValueError(
                "hf_megatrain: with peft_config (or a PEFT model) the reference is the frozen "
                "streamed base with the adapters disabled; leave ref_model=None."
            )
        beta = args.beta
        if not beta and ref_model is not None:
            raise ValueError(
                "hf_megatrain: ref_model is used only with beta > 0 (beta=0 needs no reference "
                "model); set beta or leave ref_model=None."
            )
        reference = _frozen_reference(model, ref_model, args) if beta and not peft else None
        self.megatrain_ref: StreamedModelState | None = (
            streamed_state(reference) if reference is not None else None
        )
        if reference is not None:
            # GRPOTrainer has no ref_model argument: with beta != 0 it would load a whole
            # reference from the policy's path onto the GPU. It builds none with beta == 0;
            # the streamed reference takes its place afterwards.
            args.beta = 0.0
        try:
            super().__init__(model, args=args, reward_funcs=reward_funcs, **kw)
        finally:
            args.beta = beta
        if reference is not None:
            self.beta = beta
            if args.disable_dropout:
                disable_dropout_in_model(reference)
            # As GRPOTrainer prepares its own reference (the temperature scales both).
            add_fused_lm_head(
                reference,
                temperature=self.temperature,
                cast_lm_head_to_fp32=args.cast_lm_head_to_fp32,
            )
            self.ref_model = _StreamedReference(
                reference, self._wrapper.compute_dtype, self.args.device, fused_loss=False
            )

    def _generate_single_turn(self, *args: Any, **kwargs: Any):
        # TRL unwraps self.model_wrapped for generate(): during training that is the
        # StreamedModelWrapper, not the HF model whose generate() and flags TRL needs.
        wrapped, self.model_wrapped = self.model_wrapped, self.model
        try:
            return super()._generate_single_turn(*args, **kwargs)
        finally:
            self.model_wrapped = wrapped

    def _megatrain_default_args(self, model: Any) -> TrainingArguments:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
        return MegaGRPOConfig(f"{(name or 'model').split('/')[-1]}-GRPO")


__all__ = [
    "MegaDPOConfig",
    "MegaDPOTrainer",
    "MegaGRPOConfig",
    "MegaGRPOTrainer",
    "MegaSFTConfig",
    "MegaSFTTrainer",
]
