"""FlexAttention within its kernels' 32-bit offsets (hf/flex_offsets.py), on the CPU with the limit
lowered to tiny sizes and a reference attention standing in for the kernels: every tensor the
inner call gets stays within the limit, and the joined result equals one call without a limit
(outputs, log-sum-exp and gradients). tests/test_gpu_attention.py runs the real kernels past
2**31."""

from __future__ import annotations

import math

import pytest
import torch

from hf_megatrain.hf import flex_offsets
from hf_megatrain.hf.flex_offsets import flex_attention_within_offsets, head_chunks, max_offset


def _reference(limit: int | None):
    """Causal attention with transformers' FlexAttention signature and return layout (batch x
    tokens x heads x head_dim, log-sum-exp batch x heads x tokens); with ``limit``, it asserts
    that every tensor it is given stays within it, as the kernels need."""
    calls = []

    def inner(module, query, key, value, attention_mask, scaling=None, s_aux=None, **kwargs):
        if limit is not None:
            for t in (query, key, value):
                assert max_offset(t) <= limit, (t.shape, t.stride())
        calls.append((query.shape[1], key.shape[1]))
        group = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(group, dim=1)
        v = value.repeat_interleave(group, dim=1)
        scores = query @ k.transpose(-1, -2) * (scaling or query.shape[-1] ** -0.5)
        s = query.shape[2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        if s_aux is not None:  # a per-head bias stands in for sinks: proves the slicing
            scores = scores + s_aux.view(1, -1, 1, 1)
        lse = scores.logsumexp(-1)
        out = scores.softmax(-1) @ v
        return out.transpose(1, 2).contiguous(), lse

    return inner, calls


def _run(inner, q, k, v, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = flex_attention_within_offsets(inner, None, q, k, v, None, scaling=0.25, **kwargs)
    (out.square().sum() + lse.sum()).backward()
    return out, lse, q.grad, k.grad, v.grad


# (id, batch, query heads, key/value heads, tokens, head_dim, limit, calls expected)
CASES = [
    ("whole groups", 1, 8, 2, 16, 4, 4 * 64 - 1, [(4, 1)] * 2),
    ("three heads of a group of four", 1, 8, 2, 16, 4, 3 * 64 - 1, [(3, 1), (1, 1)] * 2),
    ("two rows: two heads of one row at a time", 2, 4, 4, 16, 4, 128 - 1, [(2, 2)] * 4),
    ("within the limit: one call", 1, 8, 2, 16, 4, 8 * 64 - 1, [(8, 2)]),
]


@pytest.mark.parametrize(
    "batch,q_heads,kv_heads,tokens,head_dim,limit,calls",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_head_chunks_equal_one_call(monkeypatch, batch, q_heads, kv_heads, tokens, head_dim,
                                    limit, calls):  # fmt: skip
    torch.manual_seed(0)
    q = torch.randn(batch, q_heads, tokens, head_dim, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, tokens, head_dim, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, tokens, head_dim, dtype=torch.float64)
    sinks = torch.randn(q_heads, dtype=torch.float64)
    whole = _run(_reference(None)[0], q, k, v, s_aux=sinks)
    monkeypatch.setattr(flex_offsets, "INDEX_LIMIT", limit)
    inner, got_calls = _reference(limit)
    chunked = _run(inner, q, k, v, s_aux=sinks)
    assert got_calls == calls
    # float64 and the same operations per head: only summation order may differ.
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_a_strided_view_past_the_limit_is_made_contiguous(monkeypatch):
    """Phi-3's case: values are a view of the fused qkv output, whose token stride spans q, k and
    v; the view's own elements fit, its offsets do not."""
    torch.manual_seed(0)
    heads, tokens, dim = 2, 16, 4
    qkv = torch.randn(1, tokens, 3 * heads * dim, dtype=torch.float64)
    q, k, v = (
        qkv[..., i * heads * dim : (i + 1) * heads * dim]
        .view(1, tokens, heads, dim)
        .transpose(1, 2)
        for i in range(3)
    )
    limit = heads * tokens * dim - 1  # the view's numel fits; its offsets reach 3x further
    assert max_offset(v) > limit
    whole = _run(_reference(None)[0], q, k, v)
    monkeypatch.setattr(flex_offsets, "INDEX_LIMIT", limit)
    inner, calls = _reference(limit)
    got = _run(inner, q, k, v)
    assert calls == [(heads, heads)]  # contiguous copies fit: one call
    for a, b in zip(whole, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_a_head_past_the_limit_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.setattr(flex_offsets, "INDEX_LIMIT", 63)
    q = k = v = torch.zeros(1, 2, 32, 4)
    with pytest.raises(ValueError, match="32-bit offsets.*Train shorter rows"):
        flex_attention_within_offsets(_reference(None)[0], None, q, k, v, None)


def test_head_chunks_cover_every_head_once():
    for q_heads, kv_heads, fit in [(28, 4, 5), (28, 4, 14), (32, 8, 3), (12, 2, 1), (40, 8, 40)]:
        chunks = head_chunks(q_heads, kv_heads, 8, 8, fit * 64 - 1)
        heads = [h for a, b in chunks for h in range(a, b)]
        assert heads == list(range(q_heads)), (q_heads, kv_heads, fit, chunks)
        group = q_heads // kv_heads
        for a, b in chunks:
            assert b - a <= fit
            # a chunk is whole groups, or heads of one group (one key/value head)
            assert (a % group == 0 and (b - a) % group == 0) or a // group == (b - 1) // group


def test_install_registers_the_guard_under_transformers_name():
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    flex_offsets.install()
    guarded = ALL_ATTENTION_FUNCTIONS["flex_attention"]
    assert guarded is not flex_attention_forward
    assert guarded.__doc__ == flex_attention_within_offsets.__doc__
    flex_offsets.install()  # idempotent
    assert ALL_ATTENTION_FUNCTIONS["flex_attention"] is guarded
    assert math.isclose(flex_offsets.INDEX_LIMIT, 2**31 - 1)
