"""GPU: engine option ``attention`` at its default ("auto") switches models to FlexAttention,
which trains like exact eager attention (skipped without CUDA; the choice itself is tested on
the CPU in tests/test_attention_choice.py).

Gemma-2 with soft-capped attention logits and a sliding window shorter than the rows, Mistral
with such a window, and gpt-oss (no SDPA: eager otherwise; attention sinks and a window): the
streamed run, attention left at "auto", against the stock Trainer with the model forced to
eager attention, the exact reference for the cap, the window and the sinks. fp32, 4 steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Gemma2Config, GptOssConfig, MistralConfig

from .helpers import make_data, run_trainer, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SEQ, WINDOW = 32, 8
# Heads of 32 (FlexAttention's Triton kernels need 16 or more). initializer_range 0.2 makes the
# attention peaked enough that the cap and the window change the loss visibly (see _effect).
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             max_position_embeddings=64, initializer_range=0.2)  # fmt: skip
ALTERNATING = ["sliding_attention", "full_attention"]


def _config(family: str, **changes):
    if family == "gemma2":
        kw = dict(query_pre_attn_scalar=32, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                  final_logit_softcapping=30.0)  # fmt: skip
        return Gemma2Config(**SHAPE, **{**kw, **changes})
    if family == "mistral":
        return MistralConfig(**SHAPE, **{"sliding_window": WINDOW, **changes})
    kw = dict(sliding_window=WINDOW, layer_types=ALTERNATING, num_local_experts=4,
              num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)  # fmt: skip
    return GptOssConfig(**SHAPE, **{**kw, **changes})


def _eager_loss(config, batch) -> float:
    model = tiny_model(config)  # seeded: the same weights for every config of a family
    model.set_attn_implementation("eager")
    with torch.no_grad():
        return float(model(**batch).loss)


#: Relative tolerance of loss and gradient norm. Both runs are fp32 (no TF32: the defaults):
#: FlexAttention's Triton kernel computes the softmax online over 128-token blocks with exp2,
#: eager attention does a matmul, an fp32 softmax and a matmul. Same arithmetic, other summation
#: order and rounding: ~1e-6 relative per step, which 4 AdamW steps keep well below 1e-4.
#: Dropping the cap or the window moves the first loss by 2.6e-3 or more at these shapes
#: (checked first, > 20x this).
TOL = 1e-4


@pytest.mark.parametrize("family", ["gemma2", "mistral", "gpt_oss"])
@pytest.mark.parametrize(
    "options",
    [{}, {"megatrain_resident_layers": 0}],
    ids=["defaults", "every-layer-streamed"],  # (streamed layers re-run FlexAttention)
)
def test_auto_flex_attention_trains_like_eager(tmp_path, family, options):
    data = make_data(8, seq=SEQ)
    batch = {k: torch.stack([r[k] for r in data[:2]]) for k in ("input_ids", "labels")}
    base = _eager_loss(_config(family), batch)
    # What the reference is exact about matters at this shape: without the window (or the
    # cap) the loss is another one.
    effects = {"window": _eager_loss(_config(family, sliding_window=SEQ * 2), batch)}
    if family == "gemma2":
        effects["cap"] = _eager_loss(_config(family, attn_logit_softcapping=None), batch)
    for what, loss in effects.items():
        assert abs(loss / base - 1) > 20 * TOL, what

    model = tiny_model(_config(family))
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    kw = dict(data=data, max_steps=4, learning_rate=1e-3, use_cpu=False)
    stock, _ = run_trainer(reference, tmp_path, "stock", mega=False, **kw)
    # Attention at its default; PyTorch's layer kernels so that attention is the difference.
    mega, trainer = run_trainer(
        model, tmp_path, "mega", mega=True, megatrain_layer_kernels="torch", **options, **kw
    )
    assert trainer.model.config._attn_implementation == "flex_attention"
    # The memory plan was made for FlexAttention, and keeps none of its outputs (SDPA's only:
    # the recompute of a streamed layer runs FlexAttention again).
    plan = trainer.megatrain.plan
    assert plan.shape.attn_implementation == "flex_attention" and plan.attention_layers == 0
    assert len(stock) == len(mega) == 4
    for a, b in zip(stock, mega):
        assert b["loss"] == pytest.approx(a["loss"], rel=TOL)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=TOL)
    assert len({round(x["loss"], 6) for x in mega}) > 1  # it trained
