"""Fused chunked LM loss for HF causal LMs: the model's own base forward, then the head+loss fused.

Used for training batches that carry labels, on the architectures whose ``*ForCausalLM.forward``
is exactly ``lm_head(base(...))`` (the head's bias included; then Cohere's logit scale,
Granite's logit scaling or Gemma's final soft-capping) followed by HF's ``ForCausalLMLoss``: shifted labels, ``-100`` ignored, ``sum / num_items_in_batch`` when the
Trainer passes it, else the mean over non-ignored tokens. MoE families whose forward then adds the
router load-balancing ("aux") loss when ``output_router_logits`` is on (Mixtral, Qwen2/3-MoE,
OLMoE, gpt-oss, Qwen3-Next) get it added here the same way, from their own
``load_balancing_loss_func``. Evaluation keeps the model's own forward.

The output has no logits until they are read: ``outputs.logits``, ``outputs["logits"]`` or a
positional read (``outputs[1]``) computes them then from the final hidden states, as the model's
forward does (a ``compute_loss`` override adding a term on the logits, or logging from them).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import fields

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from ..core.chunked_loss import IGNORE_INDEX, LogitMap, chunked_linear_cross_entropy
from .families import SUPPORTED_MODEL_TYPES, model_family

logger = logging.getLogger(__name__)

#: Every supported family: each one's causal-LM loss is plain cross-entropy over
#: the head's output on the hidden states (``get_output_embeddings()``: ``lm_head``, BioGPT's
#: ``output_projection``; its bias included: Phi's, GPT-J's), then the maps below and Gemma's
#: final soft-capping, which the chunked loss computes too; a family whose loss is something
#: else (Llama 4's, Doge's) is not supported. The MoE ones add their router aux loss, when it is on,
#: exactly as their forward does (see ``load_balancing_loss_function``); the aux-free
#: DeepSeek-style ones have none. tests/test_chunked_loss.py checks each against the model's own
#: loss, aux loss on and off.
FUSED_LOSS_MODEL_TYPES = frozenset(SUPPORTED_MODEL_TYPES)
#: Families whose forward multiplies the head's logits by ``model.logit_scale`` (Cohere) ...
LOGIT_SCALE_MODEL_TYPES = {"cohere", "cohere2", "cohere2_moe"}
#: ... or divides them by ``config.logits_scaling`` (Granite, Granite-MoE, Granite 4.0 hybrid).
LOGITS_SCALING_MODEL_TYPES = {
    "granite",
    "granitemoe",
    "granitemoeshared",
    "granite_swa",
    "granitemoe_swa",
    "granitemoehybrid",
}
#: ... or multiplies them by a config value: HyperCLOVA X's muP ``logits_scaling``, Falcon-H1's
#: ``lm_head_multiplier`` (family -> the config attribute).
LOGITS_MULTIPLY_CONFIG_ATTRIBUTE = {
    "hyperclovax": "logits_scaling",
    "falcon_h1": "lm_head_multiplier",
}
#: Families whose forward divides the hidden states by ``config.logits_scaling`` before the head
#: (MiniCPM3): the fused loss divides them the same way, the same op on the same tensor.
HIDDEN_SCALING_MODEL_TYPES = {"minicpm3"}

#: The ``*ForCausalLM`` attributes an MoE family's forward passes to its router aux loss.
_ROUTER_AUX_ATTRS = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")


def unwrap_peft(model):
    """The transformers model under a PEFT wrapper (LoRA modules live inside it)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_of(causal_lm) -> torch.nn.Module | None:
    """The decoder stack a ``*ForCausalLM`` calls: the attribute its ``base_model_prefix``
    names (``model``, GPT-2's ``transformer``), else ``model`` (Llama 4's class names
    ``language_model``, its multimodal checkpoints' prefix, but holds ``model``)."""
    base = getattr(causal_lm, getattr(causal_lm, "base_model_prefix", "") or "", None)
    if not isinstance(base, torch.nn.Module) or base is causal_lm:
        base = getattr(causal_lm, "model", None)
    return base if isinstance(base, torch.nn.Module) else None


def load_balancing_loss_function(model) -> Callable | None:
    """The router load-balancing loss an MoE family's forward adds when ``output_router_logits``
    is on: its modeling module's ``load_balancing_loss_func``, where the model has the attributes
    that forward passes it (``num_experts``, ``num_experts_per_tok``, ``router_aux_loss_coef``).
    None for families without one (dense, the aux-free DeepSeek-style MoE)."""
    model = unwrap_peft(model)
    module = sys.modules.get(type(model).__module__)
    fn = getattr(module, "load_balancing_loss_func", None)
    if callable(fn) and all(getattr(model, a, None) is not None for a in _ROUTER_AUX_ATTRS):
        return fn
    return None


def router_aux_loss_on(model) -> bool:
    """Whether the model's training loss adds its router aux loss: the config turns it on and
    the family's forward has one (``load_balancing_loss_function``)."""
    on = getattr(unwrap_peft(model).config, "output_router_logits", False)
    return bool(on) and load_balancing_loss_function(model) is not None


def _linear_head(head) -> bool:
    """Whether ``head`` computes ``F.linear(x, head.weight, head.bias)`` and nothing else: a
    plain ``nn.Linear`` (a subclass may quantize or adapt), also behind PEFT's modules_to_save
    wrapper, which hands ``weight`` and ``bias`` to the copy that runs. Not a LoRA-adapted head:
    the fused loss would drop its adapter's term (and train it not at all)."""
    try:
        from peft.utils.other import ModulesToSaveWrapper  # noqa: PLC0415
    except ImportError:  # (peft is optional for the library's core use)
        ModulesToSaveWrapper = ()  # noqa: N806
    if isinstance(head, ModulesToSaveWrapper):
        if not head.active_adapters:  # (its forward then runs the original module)
            return type(head.original_module) is torch.nn.Linear
        return type(head.modules_to_save[head.active_adapters[0]]) is torch.nn.Linear
    return type(head) is torch.nn.Linear


def supports_fused_loss(model) -> bool:
    """Whether training may run ``fused_causal_lm_forward`` instead of the model's forward (the
    memory plan's ``ModelShape.fused_loss`` is this too)."""
    if _tuner_changes_loss(model):
        return False
    model = unwrap_peft(model)
    config = model.config
    return (
        model_family(config.model_type) in FUSED_LOSS_MODEL_TYPES
        and _linear_head(model.get_output_embeddings())
        and decoder_of(model) is not None
        # A model-specific loss (set by the user) is theirs to keep.
        and getattr(config, "loss_type", None) in (None, "ForCausalLM", "ForCausalLMLoss")
        # A router aux loss turned on is added here only where the family's own is found.
        and (not getattr(config, "output_router_logits", False) or router_aux_loss_on(model))
    )


def _tuner_changes_loss(model) -> bool:
    """Whether ``model`` is a PEFT model whose forward runs its tuner's own forward, which may
    add to the loss (AdaLoRA's orthogonal regularization, under a task type's PeftModel, e.g.
    ``PeftModelForCausalLM``; a plain ``PeftModel`` calls the base model, past the tuner): the
    fused loss, which calls the base model directly, would drop it (found by an audit: AdaLoRA
    trained without it, silently)."""
    try:
        from peft import PeftModel  # noqa: PLC0415
        from peft.tuners.tuners_utils import BaseTuner  # noqa: PLC0415
    except ImportError:
        return False
    tuner = getattr(model, "base_model", None)
    return (
        isinstance(model, PeftModel)
        and type(model).forward is not PeftModel.forward
        and isinstance(tuner, BaseTuner)
        and type(tuner).forward is not BaseTuner.forward
    )


def fused_causal_lm_forward(
    model,
    compute_dtype: torch.dtype | None,
    chunk_tokens: int | None = None,
    *,
    loss_kernel: bool = True,
    **kwargs,
) -> CausalLMOutputWithPast | MoeCausalLMOutputWithPast:
    """The model's training loss on ``kwargs`` (its forward's arguments, ``labels`` included):
    its base model's forward, then the LM head and cross-entropy fused in chunks (no logits
    returned), plus the router aux loss where the model's forward adds one."""
    model = unwrap_peft(model)
    labels = kwargs.pop("labels")
    num_items = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    logits_to_keep = kwargs.pop("logits_to_keep", 0)
    kwargs.pop("return_dict", None)
    balance = load_balancing_loss_function(model)
    router = False
    if balance is not None:
        # As the family's forward: the argument, else the config; the base model records the
        # layers' router logits then.
        router = kwargs.pop("output_router_logits", None)
        if router is None:
            router = getattr(model.config, "output_router_logits", False)
        if router:
            kwargs["output_router_logits"] = True
    outputs = decoder_of(model)(**kwargs)
    hidden = outputs.last_hidden_state
    model_type = model_family(model.config.model_type)
    if model_type in HIDDEN_SCALING_MODEL_TYPES:
        hidden = hidden / model.config.logits_scaling
        # The unscaled states are no longer needed (the division saves nothing): one hidden-sized
        # tensor alive through the loss, as the plan counts, not two.
        outputs["last_hidden_state"] = None
    if shift_labels is None:
        # Same shift as transformers' ForCausalLMLoss: position t predicts label t+1.
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    if num_items is not None and torch.is_tensor(num_items):
        num_items = num_items.to(hidden.device)
    # The family's maps of the head's output, for the loss and for logits read later alike.
    logit_map = _family_logit_map(model, model_type)
    head = model.get_output_embeddings()  # (``lm_head``; BioGPT's ``output_projection``)
    loss = chunked_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        targets,
        divisor=num_items,
        softcap=logit_map.softcap,
        chunk_tokens=chunk_tokens,
        compute_dtype=compute_dtype,
        kernel=loss_kernel,
        bias=head.bias,
        logit_scale=logit_map.scale,
        logits_scaling=logit_map.divide_by,
    )
    make_logits = _logits_maker(model, hidden, compute_dtype, logits_to_keep, logit_map)
    if balance is not None:
        aux_loss = None
        if router:
            aux_loss = balance(
                outputs.router_logits,
                model.num_experts,
                model.num_experts_per_tok,
                kwargs.get("attention_mask"),
            )
            loss = loss + model.router_aux_loss_coef * aux_loss.to(loss.device)
        return _LazyMoeOutput.of(
            make_logits,
            loss=loss,
            aux_loss=aux_loss,
            hidden_states=getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
            router_logits=getattr(outputs, "router_logits", None),
        )
    return _LazyCausalLMOutput.of(
        make_logits,
        loss=loss,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
    )


def _family_logit_map(model, model_type: str | None) -> LogitMap:
    """What ``model``'s forward does to its head's output (``model_type``: its family)."""
    config = model.config
    scale = None
    if model_type in LOGIT_SCALE_MODEL_TYPES:
        scale = model.logit_scale
    elif model_type in LOGITS_MULTIPLY_CONFIG_ATTRIBUTE:
        scale = getattr(config, LOGITS_MULTIPLY_CONFIG_ATTRIBUTE[model_type])
    return LogitMap(
        scale=scale,
        divide_by=config.logits_scaling if model_type in LOGITS_SCALING_MODEL_TYPES else None,
        softcap=getattr(config, "final_logit_softcapping", None),
    )


def _logits_maker(
    model,
    hidden: torch.Tensor,
    compute_dtype: torch.dtype | None,
    logits_to_keep,
    logit_map: LogitMap,
) -> Callable[[], torch.Tensor]:
    """What computes the logits the model's own forward returns from ``hidden``, its base's
    output (still in the autograd graph: a loss term on them trains the model as stock's does):
    the head (under the run's autocast, as the forward ran), then the family's maps in the same
    ops (``logit_map``; Gemma's soft-cap as ``/ cap``, ``tanh``, ``* cap``)."""
    device_type = hidden.device.type
    softcap = logit_map.softcap

    def make() -> torch.Tensor:
        _warn_logits_read()
        keep = logits_to_keep
        h = hidden[:, slice(-keep, None) if isinstance(keep, int) else keep, :]
        autocast = compute_dtype is not None and compute_dtype != torch.float32
        with torch.autocast(device_type, dtype=compute_dtype, enabled=autocast):
            logits = logit_map.forward(model.get_output_embeddings()(h))
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
        return logits

    return make


@functools.cache
def _warn_logits_read() -> None:
    """Once per process: logits read from a training forward cost memory the plan left out."""
    logger.warning(
        "hf_megatrain: the logits of a fused-loss forward (training, or an evaluation that "
        "keeps the loss only) were read (a compute_loss that uses "
        "outputs.logits): computed from the final hidden states, tokens x vocab of them, which "
        "the memory plan does not count (the fused loss never makes them)"
    )


class _LazyLogits:
    """A model output whose ``logits`` are computed the first time they are read, by attribute,
    key or position (reading by position needs them: they are the second entry), and then kept
    as an ordinary entry in the field order of the output class."""

    @classmethod
    def of(cls, make_logits: Callable[[], torch.Tensor], **values):
        out = cls(**values)
        out.__dict__["_make_logits"] = make_logits
        return out

    @property
    def logits(self) -> torch.Tensor | None:
        make = self.__dict__.pop("_make_logits", None)
        if make is not None:
            self["logits"] = make()  # (sets the attribute too, through the setter)
            for field in fields(self):  # the entries in the order of the class's fields
                if field.name in self.keys():
                    self.move_to_end(field.name)
        return self.__dict__.get("logits")

    @logits.setter
    def logits(self, value: torch.Tensor | None) -> None:
        self.__dict__["logits"] = value

    def __getitem__(self, k):
        if k == "logits" or not isinstance(k, str):
            self.logits  # noqa: B018 - computed now
        return super().__getitem__(k)

    def __contains__(self, key) -> bool:
        return (key == "logits" and "_make_logits" in self.__dict__) or super().__contains__(key)


class _LazyCausalLMOutput(_LazyLogits, CausalLMOutputWithPast):
    pass


class _LazyMoeOutput(_LazyLogits, MoeCausalLMOutputWithPast):
    pass
