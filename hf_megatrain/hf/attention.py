"""Which attention implementation a streamed model runs: engine option ``attention``.

PyTorch SDPA cannot soft-cap attention logits (Gemma-2's ``attn_logit_softcapping``): a model
run under it is silently inexact, and eager attention, exact, materializes every layer's
s x s scores. Sliding-window layers under SDPA with rows at least as long as the window attend
through an explicit s x s mask. FlexAttention (``attn_implementation="flex_attention"``) applies
the cap in its ``score_mod`` and the window as a block-sparse ``BlockMask``: no s x s tensor.
So "auto" switches such models to it, on CUDA (it has no CPU backward), deciding from config
attributes and class flags only (:func:`choose_attention`, one pure function that the trainer,
the streamed loaders and ``hf-megatrain plan`` share), before the memory plan is made: the plan
then counts FlexAttention's tensors, not an s x s one.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from . import flex_offsets
from .layer_configs import head_dims
from .loss import unwrap_peft
from .model import attends_in_chunks, attention_windows

logger = logging.getLogger(__name__)

FLEX = "flex_attention"

#: The implementations "auto" may replace: transformers' defaults. Any other one (flash
#: attention, a hub kernel, FlexAttention itself) was asked for and is kept.
SWITCHABLE = ("sdpa", "eager")

#: FlexAttention's Triton kernels need query/key and value heads at least this wide.
FLEX_MIN_HEAD_DIM = 16
#: ... and at most this wide: on an H100 (torch 2.11, ``dev/flex_head_probe.py``) a compiled
#: training step ran at 128 and 256, and at 512 (Gemma 4's full-attention heads) failed to
#: compile (its forward's blocks asked 256 KiB of shared memory, 227 KiB there).
FLEX_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttentionFacts:
    """What :func:`choose_attention` decides from: the model's current implementation, its
    class's flags and its (text) config's attention attributes."""

    impl: str
    model_class: str
    supports_flex: bool
    supports_sdpa: bool
    #: ``attn_logit_softcapping`` is set.
    softcapping: bool
    #: Window of the sliding-window layers, or Llama 4's attention chunk (0: neither).
    sliding_window: int
    #: Narrowest attention head (query/key or value); 0 when unknown.
    head_dim: int
    #: Attention dropout probability (FlexAttention refuses dropout in training).
    dropout: float = 0.0
    #: What ``sliding_window`` is, in the reasons: "sliding window" or "attention chunk".
    window_kind: str = "sliding window"
    #: Widest attention head of any layer (0: as ``head_dim``).
    widest_head_dim: int = 0

    @classmethod
    def of_model(cls, model: nn.Module) -> AttentionFacts:
        """The facts of a transformers model (under a PEFT wrapper: its base model)."""
        base = unwrap_peft(model)
        config = base.config
        return cls._of(config, type(base), getattr(config, "_attn_implementation", None))

    @classmethod
    def of_config(cls, config, impl: str | None = None) -> AttentionFacts:
        """The facts of the causal LM ``AutoModelForCausalLM`` builds for ``config``, running
        ``impl`` (default: the config's, else transformers' default for the class)."""
        from transformers.models.auto.modeling_auto import (  # noqa: PLC0415
            MODEL_FOR_CAUSAL_LM_MAPPING,
        )

        model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
        return cls._of(config, model_class, impl or getattr(config, "_attn_implementation", None))

    @classmethod
    def _of(cls, config, model_class, impl: str | None) -> AttentionFacts:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        supports_sdpa = bool(getattr(model_class, "_supports_sdpa", False))
        window, _ = attention_windows(text)
        heads = getattr(text, "num_attention_heads", None) or 0
        # Every layer's (Gemma 4's full-attention layers have their own): the narrowest says.
        dims = head_dims(text) or [text.hidden_size // heads if heads else 0]
        widths = [*dims, getattr(text, "v_head_dim", None) or min(dims)]
        dropout = max(
            float(getattr(text, name, 0.0) or 0.0) for name in ("attention_dropout", "attn_pdrop")
        )
        return cls(
            # transformers' default where none is set yet: SDPA where the class has it.
            impl=impl or ("sdpa" if supports_sdpa else "eager"),
            model_class=getattr(model_class, "__name__", type(config).__name__),
            supports_flex=bool(getattr(model_class, "_supports_flex_attn", False)),
            supports_sdpa=supports_sdpa,
            softcapping=bool(getattr(text, "attn_logit_softcapping", None)),
            sliding_window=int(window or 0),
            head_dim=int(min(widths)),
            widest_head_dim=int(max(widths)),
            dropout=dropout,
            window_kind="attention chunk" if attends_in_chunks(text) else "sliding window",
        )


@dataclass(frozen=True)
class AttentionChoice:
    """The attention implementation a streamed model runs, and why."""

    impl: str
    why: str

    def log_line(self) -> str:
        return f"hf_megatrain: attention: {self.impl} ({self.why})"


def choose_attention(
    setting: str,
    facts: AttentionFacts,
    device: torch.device | str,
    seq_len: int | None,
    *,
    sequence_parallel: int = 1,
) -> AttentionChoice:
    """The ``attention`` option resolved for a model (``facts``) on ``device`` training rows of
    ``seq_len`` tokens (None: unknown).

    "auto" switches to FlexAttention when the model runs sdpa or eager attention and either its
    attention logits are soft-capped, or it has sliding-window layers and ``seq_len`` is at
    least the window (SDPA's s x s mask), or it runs eager because its class has no SDPA; and
    FlexAttention can run it: a CUDA device, no sequence parallelism (which wraps the model's
    attention function by name), a class that supports it, heads of at least 16 and no
    attention dropout. Otherwise, and with "model", the model's own implementation."""
    impl = facts.impl
    if setting == "model":
        return AttentionChoice(impl, "the model's, as asked (attention 'model')")
    if impl not in SWITCHABLE:
        return AttentionChoice(impl, "the model's, as given; only sdpa and eager are switched")
    window = facts.sliding_window
    if facts.softcapping:
        reason = "soft-capped attention logits: " + (
            "SDPA drops the cap" if impl == "sdpa" else "eager makes s x s scores"
        )
    elif window and seq_len is not None and seq_len >= window:
        reason = (
            f"{facts.window_kind} {window} <= sequence {seq_len}: {impl} would make an s x s mask"
        )
    elif impl == "eager" and not facts.supports_sdpa:
        reason = f"{facts.model_class} has no SDPA: eager makes s x s scores"
    elif window and seq_len is None:
        return AttentionChoice(
            impl, f"the model's; {facts.window_kind} {window}, row length unknown"
        )
    else:
        return AttentionChoice(impl, "the model's")
    kind = torch.device(device).type
    why_not = None
    if kind != "cuda":
        why_not = f"no CUDA device ({kind}): FlexAttention has no CPU backward"
    elif sequence_parallel > 1:
        why_not = "sequence parallelism wraps the model's attention"
    elif not facts.supports_flex:
        why_not = f"{facts.model_class} has no FlexAttention"
    elif facts.head_dim and facts.head_dim < FLEX_MIN_HEAD_DIM:
        why_not = f"heads of {facts.head_dim} < {FLEX_MIN_HEAD_DIM}: too narrow for its kernels"
    elif facts.widest_head_dim > FLEX_MAX_HEAD_DIM:
        why_not = (
            f"heads of {facts.widest_head_dim} > {FLEX_MAX_HEAD_DIM}: wider than its kernels' "
            "blocks fit in shared memory"
        )
    elif facts.dropout > 0:
        why_not = f"attention dropout {facts.dropout:g}: FlexAttention has none"
    if why_not:
        return AttentionChoice(impl, f"the model's; {reason}, but {why_not}")
    return AttentionChoice(FLEX, reason)


def apply_attention(
    model: nn.Module,
    setting: str,
    device: torch.device | str,
    seq_len: int | None,
    *,
    sequence_parallel: int = 1,
) -> AttentionChoice:
    """Resolve ``attention`` for ``model`` (before it is streamed: the memory plan reads
    ``config._attn_implementation``) and switch it (``set_attn_implementation``, on the base
    model under a PEFT wrapper; every sub-config follows); logs one line saying which and why."""
    base = unwrap_peft(model)
    facts = AttentionFacts.of_model(base)
    choice = choose_attention(setting, facts, device, seq_len, sequence_parallel=sequence_parallel)
    before = base.config._attn_implementation
    if choice.impl != before:
        problem = None
        try:
            base.set_attn_implementation(choice.impl)
        except (AttributeError, ImportError, ValueError) as e:
            problem = str(e).splitlines()[0]
        now = base.config._attn_implementation
        if now != choice.impl:  # transformers declined (its check of the class's code)
            why = problem or f"transformers kept {type(base).__name__}'s"
            choice = AttentionChoice(now, f"the model's; {choice.impl} not set: {why}")
    if choice.impl == FLEX:  # its kernels' 32-bit offsets, at any row length (flex_offsets)
        flex_offsets.install()
    # SDPA left on soft-capped logits trains another model than the checkpoint's: say so louder.
    inexact = choice.impl == "sdpa" and facts.softcapping
    logger.log(logging.WARNING if inexact else logging.INFO, choice.log_line())
    return choice


def planned_attention(
    shape, config, setting: str, seq_len: int | None, device="cuda", *, sequence_parallel: int = 1
):
    """``(shape, choice)``: a ``ModelShape`` of ``config`` (``hf.model.model_shape_from_config``)
    with the attention ``setting`` would choose for rows of ``seq_len`` on ``device`` (with
    ``sequence_parallel`` ranks sharing each row), as the trainer would switch the model before
    its memory plan (a plan is for a GPU: CUDA)."""
    facts = AttentionFacts.of_config(config, shape.attn_implementation)
    choice = choose_attention(setting, facts, device, seq_len, sequence_parallel=sequence_parallel)
    if choice.impl != shape.attn_implementation:
        shape = dataclasses.replace(
            shape, attn_implementation=choice.impl, sdpa_attention=choice.impl == "sdpa"
        )
    return shape, choice


__all__ = [
    "FLEX",
    "FLEX_MAX_HEAD_DIM",
    "FLEX_MIN_HEAD_DIM",
    "SWITCHABLE",
    "AttentionChoice",
    "AttentionFacts",
    "apply_attention",
    "choose_attention",
    "planned_attention",
]
