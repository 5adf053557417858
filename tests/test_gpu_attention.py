"""GPU: engine option ``attention`` at its default ("auto") switches models to FlexAttention,
which trains like exact eager attention (skipped without CUDA; the choice itself is tested on
the CPU in tests/test_attention_choice.py).

Gemma-2 with soft-capped attention logits and a sliding window shorter than the rows, Mistral
with such a window, gpt-oss (no SDPA: eager otherwise; attention sinks and a window) and Gemma 3n
(a window, its keys and values shared, AltUp's streams; not yet run on a GPU): the
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
    if family == "gemma3n_text":  # (3 layers: the last reuses the first's keys and values)
        from transformers import CONFIG_MAPPING  # noqa: PLC0415

        kw = dict(SHAPE, num_hidden_layers=3, sliding_window=WINDOW,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  num_kv_shared_layers=1, hidden_size_per_layer_input=8,
                  vocab_size_per_layer_input=128, laurel_rank=4, altup_num_inputs=4,
                  activation_sparsity_pattern=[0.0] * 3)  # fmt: skip
        return CONFIG_MAPPING["gemma3n_text"](**{**kw, **changes})
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


@pytest.mark.parametrize("family", ["gemma2", "mistral", "gpt_oss", "gemma3n_text"])
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


# Scores of unit-variance q and k over 64-128 dims at this scale have a deviation of 4-6: a peaked
# attention, whose query gradient is well conditioned (near-uniform attention over 65,536 keys
# makes it a small difference of large sums: 6% apart between two exact kernels at scale 0.1).
SCALE = 0.5


def _flex_against_sdpa(q, k, v) -> list[float]:
    """Relative error (norm of the difference over the reference's) of FlexAttention run through
    the offset guard against PyTorch SDPA on contiguous copies: the output, then the
    gradients of q, k and v under one random output gradient."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_megatrain.hf import flex_offsets

    flex_offsets.install()
    module = torch.nn.Module().train()  # transformers' function reads module.training only
    ins = [t.detach().requires_grad_() for t in (q, k, v)]
    out, _ = ALL_ATTENTION_FUNCTIONS["flex_attention"](module, *ins, None, scaling=SCALE)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = [out.detach().float()] + [t.grad.float() for t in ins]
    del out, ins
    ref_ins = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    ref = torch.nn.functional.scaled_dot_product_attention(
        *ref_ins, scale=SCALE, enable_gqa=group > 1
    ).transpose(1, 2)
    ref.backward(grad)
    want = [ref.detach().float()] + [t.grad.float() for t in ref_ins]
    return [((a - b).norm() / b.norm()).item() for a, b in zip(got, want, strict=True)]


def test_flex_attention_past_32_bit_offsets_strided():
    """FlexAttention's kernels address their tensors with int32 offsets (pytorch#190857): the
    matrix's Phi-3-mini cell at 262,144 tokens (values a view of the fused qkv output, offsets to
    2.4G) had a non-finite step, then an illegal memory access. Through the guard a value view
    whose token stride spans 16,384 elements at 262,144 tokens (offsets to 4.3G; made
    contiguous) computes what SDPA does on contiguous copies. bf16 inputs and outputs, fp32
    accumulation in both kernels: 2% relative error allows their summation orders and bf16
    roundings (2**-8 each); a wrapped offset reads other memory, off by the order of the values.
    Measured on the H200 at 1faa6f2: 8e-5 (output) to 1.2e-3."""
    from hf_megatrain.hf.flex_offsets import INDEX_LIMIT, max_offset

    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    tokens, heads, dim = 262144, 4, 64
    q = torch.randn(1, heads, tokens, dim, device=dev, dtype=bf16)
    k = torch.randn(1, heads, tokens, dim, device=dev, dtype=bf16)
    wide = torch.randn(1, tokens, 16384, device=dev, dtype=bf16)
    v = wide[..., : heads * dim].view(1, tokens, heads, dim).transpose(1, 2)
    assert max_offset(v) > INDEX_LIMIT >= v.numel()
    errors = _flex_against_sdpa(q, k, v)
    print("flex vs sdpa (strided values past 2**31): " + ", ".join(f"{e:.2e}" for e in errors))
    assert max(errors) < 2e-2, errors


def _guarded_flex(q, k, v, grad):
    """Output and q/k/v gradients of FlexAttention through the offset guard."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_megatrain.hf import flex_offsets

    flex_offsets.install()
    ins = [t.detach().requires_grad_() for t in (q, k, v)]
    out, _ = ALL_ATTENTION_FUNCTIONS["flex_attention"](
        torch.nn.Module().train(), *ins, None, scaling=SCALE
    )
    out.backward(grad)
    return [out.detach()] + [t.grad for t in ins]


def test_flex_attention_past_32_bit_offsets_heads():
    """10 rows x 32 query heads (8 key/value heads) x 65,536 tokens x 128: 2.7G elements per
    query tensor, past 2**31, run by the guard per row. Its outputs and gradients equal the
    kernel's on each row alone (tensors within the limit, so passed through unchanged: the same
    compiled kernel on the same values; 1e-3 relative allows a different schedule, a wrapped
    offset is off by the order of the values), and on the last row, which the whole
    tensor's offsets reach past 2**31 for, as on the first. (At 1faa6f2 this compared against
    SDPA on the whole batch: outputs and value gradients agreed within 3e-3, query and key
    gradients were 6% apart at scale 0.1 and 60% at 0.5, SDPA's own kernel past 2**31 elements
    being suspect as well; this compares within the limit instead, and the first row against
    SDPA, where neither kernel is near it.)"""
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    rows, heads, kv_heads, tokens, dim = 10, 32, 8, 65536, 128
    q = torch.randn(rows, heads, tokens, dim, device=dev, dtype=bf16)
    k = torch.randn(rows, kv_heads, tokens, dim, device=dev, dtype=bf16)
    v = torch.randn(rows, kv_heads, tokens, dim, device=dev, dtype=bf16)
    assert q.numel() > 2**31
    grad = torch.randn(rows, tokens, heads, dim, device=dev, dtype=bf16)
    whole = _guarded_flex(q, k, v, grad)
    for r in (0, rows - 1):
        alone = _guarded_flex(
            q[r : r + 1].clone(), k[r : r + 1].clone(), v[r : r + 1].clone(), grad[r : r + 1]
        )
        for a, b in zip(whole, alone, strict=True):
            err = ((a[r : r + 1].float() - b.float()).norm() / b.float().norm()).item()
            assert err < 1e-3, (r, err)
        del alone
    errors = _flex_against_sdpa(q[:1].clone(), k[:1].clone(), v[:1].clone())
    print("flex vs sdpa (one row of 32/8 heads x 65,536): " + ", ".join(f"{e:.2e}" for e in errors))
    assert max(errors) < 2e-2, errors
