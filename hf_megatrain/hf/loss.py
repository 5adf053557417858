"""Fused chunked LM loss for HF causal LMs: the model's own base forward, then the head+loss fused.

Used for training batches that carry labels, on the architectures whose ``*ForCausalLM.forward``
is exactly ``lm_head(base(...))`` (+ Gemma's final soft-capping) followed by HF's
``ForCausalLMLoss``: shifted labels, ``-100`` ignored, ``sum / num_items_in_batch`` when the
Trainer passes it, else the mean over non-ignored tokens. MoE models (whose forward adds the
router aux loss) and evaluation keep the model's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..core.chunked_loss import IGNORE_INDEX, chunked_linear_cross_entropy

#: Families whose causal-LM loss is plain cross-entropy over ``lm_head(hidden)`` (Gemma's
#: final soft-capping included): the chunked loss computes the same. Not here: heads with a
#: bias (Phi, GPT-J), logit scales (Granite, Cohere), MoE models whose loss adds the router aux
#: loss (the aux-free DeepSeek-style ones are in). tests/test_chunked_loss.py checks each
#: against the model's own loss.
FUSED_LOSS_MODEL_TYPES = {
    "llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3", "gemma2", "olmo2", "olmo3",
    "smollm3", "starcoder2", "glm4", "ernie4_5", "helium", "exaone4", "seed_oss", "gemma",
    "olmo", "stablelm", "gpt_neox", "nemotron", "arcee", "apertus", "hunyuan_v1_dense", "lfm2",
    "glm4_moe", "dots1", "deepseek_v2", "deepseek_v3", "falcon", "bloom", "mpt", "gpt_bigcode",
    "qwen3_next",
}  # fmt: skip


def _unwrap(model):
    """The transformers model under a PEFT wrapper (LoRA modules live inside it)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def supports_fused_loss(model) -> bool:
    model = _unwrap(model)
    config = model.config
    return (
        config.model_type in FUSED_LOSS_MODEL_TYPES
        and getattr(model, "lm_head", None) is not None
        and getattr(model, model.base_model_prefix, None) is not None
        # A model-specific loss (set by the user) is theirs to keep.
        and getattr(config, "loss_type", None) in (None, "ForCausalLM", "ForCausalLMLoss")
        # An MoE family's router aux loss, when turned on (Qwen3-Next's is off by default), is
        # added by the model's own forward.
        and not getattr(config, "output_router_logits", False)
    )


def fused_causal_lm_forward(
    model,
    compute_dtype: torch.dtype | None,
    chunk_tokens: int | None = None,
    **kwargs,
) -> CausalLMOutputWithPast:
    model = _unwrap(model)
    labels = kwargs.pop("labels")
    num_items = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    kwargs.pop("logits_to_keep", None)
    kwargs.pop("return_dict", None)
    base = getattr(model, model.base_model_prefix)
    outputs = base(**kwargs)
    hidden = outputs.last_hidden_state
    if shift_labels is None:
        # Same shift as transformers' ForCausalLMLoss: position t predicts label t+1.
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    if num_items is not None and torch.is_tensor(num_items):
        num_items = num_items.to(hidden.device)
    loss = chunked_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        model.lm_head.weight,
        targets,
        divisor=num_items,
        softcap=getattr(model.config, "final_logit_softcapping", None),
        chunk_tokens=chunk_tokens,
        compute_dtype=compute_dtype,
    )
    return CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
    )
