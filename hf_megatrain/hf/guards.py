"""Checks that turn bad inputs and non-finite weights into clear errors before any work.

- :func:`check_model_dtype`: a float64 model is refused (the engine trains fp32 masters).
- :func:`check_batch`: a training batch whose labels (or attention mask) do not match its
  input_ids, or whose token ids fall outside the vocabulary, is refused naming the tensors; rows
  longer than the model's positions get one warning.
- :func:`weights_are_finite` / :func:`check_weights_finite`: whether a streamed model's weights
  (host store, HBM tier, resident parameters) are all finite, before a checkpoint is written.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..core.optimizer import NonFiniteError, all_finite
from .model import streamed_state

logger = logging.getLogger(__name__)

#: Label value the loss ignores (HF's convention).
IGNORE_INDEX = -100


def _refuse_named(names: list[str], what: str, fix: str) -> None:
    """A ValueError naming the first of ``names`` (and how many more) unless it is empty."""
    if names:
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        raise ValueError(f"hf_megatrain: the model has {what} ({names[0]}{more}); {fix}")


def check_model_dtype(model: nn.Module) -> None:
    """Refuse a float64 model: training keeps fp32 master weights, and streaming it would
    silently round every weight to fp32."""
    _refuse_named(
        [n for n, p in model.named_parameters() if p.dtype == torch.float64],
        "float64 parameters",
        "hf_megatrain trains fp32 master weights (bf16=True computes in bf16 over them). "
        "Convert the model with model.float() first.",
    )


def warn_half_precision_model(model: nn.Module, bf16: bool) -> None:
    """Say that a model handed over in bf16 or fp16 trains as fp32 masters (found by an audit:
    TRL's ``model_init_kwargs={"dtype": "bfloat16"}`` trained as fp32, silently, where the stock
    Trainer updates the half-precision weights themselves)."""
    half = [
        (n, p.dtype)
        for n, p in model.named_parameters()
        if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)
    ]
    if half:
        compute = "bf16 under autocast (bf16=True)" if bf16 else "fp32 (bf16=False)"
        # A warning where the compute differs too (fp32 where the weights asked for bf16).
        logger.log(
            logging.INFO if bf16 else logging.WARNING,
            "hf_megatrain: the model's trainable parameters are %s (%s and %d more): they train "
            "as fp32 master weights with fp32 AdamW moments (the values upcast exactly), "
            "computing in %s; the stock Trainer would update the %s weights themselves",
            str(half[0][1]).removeprefix("torch."),
            half[0][0],
            len(half) - 1,
            compute,
            str(half[0][1]).removeprefix("torch."),
        )


def check_model_has_values(model: nn.Module) -> None:
    """Refuse a model whose parameters or buffers are on ``meta`` (built under
    ``init_empty_weights``, ``device_map="meta"``, ``model.to("meta")``): nothing would fill
    them, and it would train on uninitialized memory (its NaN steps reported as a divergence)."""
    _refuse_named(
        [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta],
        "tensors on the meta device, without values",
        "load its weights (from_pretrained), or stream it without allocating it with "
        "hf_megatrain.load_streamed_model (a checkpoint) or init_streamed_model (random init).",
    )


def _shape(t: Any) -> tuple[int, ...] | None:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def learned_position_limit(model: nn.Module) -> int | None:
    """The longest row a model with learned absolute position embeddings takes (GPTBigCode's
    ``wpe``, OPT's ``embed_positions`` less its offset): past it the embedding lookup fails
    deep inside. None for models without such a table (rotary, ALiBi)."""
    names = ("wpe", "embed_positions", "position_embeddings")
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and name.rsplit(".", 1)[-1] in names:
            return module.num_embeddings - int(getattr(module, "offset", 0) or 0)
    return None


def _positions_used(inputs: Mapping, row_tokens: int) -> int:
    """How many positions a batch's rows use: its ``position_ids``' largest + 1 where it has
    them (a device sync), else the row's length."""
    pos = inputs.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.numel() == 0:
        return row_tokens
    return int(pos.max()) + 1


def check_batch(
    inputs: Any,
    config: Any = None,
    *,
    check_values: bool = False,
    warned: set | None = None,
    position_limit: int | None = None,
) -> None:
    """Refuse a training batch the model would fail on deep inside (or silently mis-train on).

    Shapes are compared for every batch (free). ``check_values``: also compare token ids and
    labels against the vocabulary (a device sync: the trainer does it for the first batch).
    ``warned``: keys of warnings already given (each is given once). ``position_limit``: the
    longest row a learned position table takes (``learned_position_limit``).
    """
    if not isinstance(inputs, Mapping):
        return
    ids, labels, mask = inputs.get("input_ids"), inputs.get("labels"), inputs.get("attention_mask")
    ids_shape, labels_shape = _shape(ids), _shape(labels)
    if ids_shape is not None and labels_shape is not None and labels_shape != ids_shape:
        raise ValueError(
            f"hf_megatrain: the batch's labels have shape {labels_shape} but its input_ids "
            f"{ids_shape}: a causal LM needs one label per input token (the model shifts them "
            "itself; use -100 for tokens without a loss). Check the data collator / dataset "
            "columns."
        )
    mask_shape = _shape(mask)
    if ids_shape is not None and mask_shape is not None and len(mask_shape) == len(ids_shape):
        if mask_shape != ids_shape:
            raise ValueError(
                f"hf_megatrain: the batch's attention_mask has shape {mask_shape} but its "
                f"input_ids {ids_shape}; they must match."
            )
    if ids_shape is None or config is None:
        return
    warned = warned if warned is not None else set()
    max_pos = getattr(config, "max_position_embeddings", None)
    seq = ids_shape[-1]
    refusable = position_limit is not None and seq > position_limit
    if refusable or (max_pos and seq > max_pos and "positions" not in warned):
        # A padding-free batch (documents flattened into one row, position_ids restarting at
        # each) uses fewer positions than its row has tokens: what matters is the largest (a
        # device sync, only where the row's length alone would refuse or warn).
        seq = _positions_used(inputs, seq)
    if position_limit is not None and seq > position_limit:
        raise ValueError(
            f"hf_megatrain: training rows of {seq} positions are longer than the "
            f"{position_limit} positions of the model's learned position embeddings (it has no "
            f"position past them): use rows of at most {position_limit} tokens (--seq_len)"
        )
    if max_pos and seq > max_pos and "positions" not in warned:
        warned.add("positions")
        logger.warning(
            "hf_megatrain: training rows of %d positions are longer than the model's "
            "max_position_embeddings=%d: positions beyond it were never trained (and some "
            "position encodings do not extend past it); shorten the rows or extend the model's "
            "context (e.g. rope_scaling) deliberately.",
            seq,
            max_pos,
        )
    vocab = getattr(config, "vocab_size", None)
    if not check_values or not vocab or ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(
            f"hf_megatrain: the batch's input_ids range over [{lo}, {hi}] but the model's "
            f"vocab_size is {vocab}: every token id must be in [0, {vocab - 1}] (a tokenizer "
            "with more tokens than the model? resize the embeddings first)."
        )
    if labels is not None and labels.numel():
        scored = labels[labels != IGNORE_INDEX]
        if scored.numel():
            lo, hi = int(scored.min()), int(scored.max())
            if lo < 0 or hi >= vocab:
                raise ValueError(
                    f"hf_megatrain: the batch's labels range over [{lo}, {hi}] (besides "
                    f"{IGNORE_INDEX}, ignored) but the model's vocab_size is {vocab}."
                )


def nonfinite_weights(model: nn.Module) -> list[str]:
    """Names of the model's weights holding a NaN or inf: streamed layers (their fp32 masters,
    host store or HBM tier, one name per layer) and the resident parameters."""
    bad: list[str] = []
    state = streamed_state(model)
    if state is not None:
        state.engine.wait_updates()  # an overlapped update may still be writing the masters
        for i, store in enumerate(state.store.layers):
            if not all_finite(store.master):
                bad.append(f"{state.layers_prefix}.{i}")
    for name, p in model.named_parameters():
        if p.device.type != "meta" and not all_finite(p):
            bad.append(name)
    return bad


def weights_are_finite(model: nn.Module) -> bool:
    """Whether every weight of ``model`` (streamed or not) is finite."""
    return not nonfinite_weights(model)


def check_weights_finite(model: nn.Module, where: str | None = None) -> None:
    """Raise :class:`NonFiniteError` naming the non-finite weights, before writing ``where``."""
    bad = nonfinite_weights(model)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise NonFiniteError(
            f"hf_megatrain: the model's weights hold NaN/inf values ({', '.join(bad[:3])}{more})"
            + (f"; not writing {where}" if where else "")
            + ": a non-finite model is never saved. The run diverged (lower the learning rate) "
            "or the model was loaded with non-finite weights."
        )


__all__ = [
    "NonFiniteError",
    "check_batch",
    "check_model_dtype",
    "check_weights_finite",
    "nonfinite_weights",
    "warn_half_precision_model",
    "weights_are_finite",
]
