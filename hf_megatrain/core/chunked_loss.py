"""Fused, chunked LM head + cross-entropy: full logits never exist.

For N tokens and a vocabulary V the logits take N*V floats (152k x 512k tokens would be 159 GB in
bf16, twice that once upcast for the loss). Here the tokens are processed in chunks: for each
chunk the logits are computed, turned into the loss contribution and, in the same pass, into the
gradients for the hidden states and the LM-head weight, then freed. Backward only scales the
stored gradients by the incoming scalar. Peak memory is one chunk of logits.

Numerics follow HF training under autocast step by step, so that bf16 training stays inside the
stock Trainer's own run-to-run band (issue 21): the head matmul runs in the compute dtype (its
output rounded to it), the loss in fp32, the logit gradient is scaled by 1/divisor *before* it is
rounded to the compute dtype (as the stock loss's ``sum / num_items_in_batch`` backward does),
the two backward matmuls run in the compute dtype, and the weight gradient, summed in fp32 over
the chunks, is rounded once to the compute dtype (autocast's bf16 GEMM writes it in bf16).
Measured on the H200 (25M Llama, 150 bf16 steps): with the gradient kept in fp32 and scaled
after the matmuls instead, streamed vs stock drifted to 3.2x stock's band; the HF loss path
stayed at 0.93x.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def default_chunk_tokens(vocab_size: int, budget_bytes: int = 2 * 2**30) -> int:
    """Tokens per chunk so one chunk of fp32 logits takes about ``budget_bytes``."""
    return max(256, budget_bytes // (4 * max(vocab_size, 1)))


#: Whether ``torch.mm`` / ``torch.addmm`` take ``out_dtype`` for these operands (CUDA, torch >=
#: 2.8), per op; found on first use.
_OUT_DTYPE_OK: dict[str, bool] = {}


def _fp32_gemm(op: str, *args: torch.Tensor) -> torch.Tensor | None:
    """``torch.<op>(*args, out_dtype=float32)``, or None where that is not supported."""
    if _OUT_DTYPE_OK.get(op) is False:
        return None
    try:
        out = getattr(torch, op)(*args, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        if _OUT_DTYPE_OK.get(op):  # it worked before: a real error
            raise
        _OUT_DTYPE_OK[op] = False
        return None
    _OUT_DTYPE_OK[op] = True
    return out


def _add_product_fp32(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc + a @ b`` in fp32 (``a @ b`` alone when ``acc`` is None).

    On CUDA with compute-dtype operands the GEMM writes fp32 itself (``out_dtype``), and
    accumulates into the fp32 sum where ``addmm`` allows: one read and one write of the
    (vocab x hidden) sum per chunk instead of a compute-dtype product, its fp32 copy and the
    add (about 2.5x the traffic, per chunk). The chunk's product is then not rounded to the
    compute dtype first (closer to fp32; not bitwise the product-then-add path the CPU keeps).
    """
    if a.is_cuda and a.dtype != torch.float32:
        if acc is not None:
            out = _fp32_gemm("addmm", acc, a, b)
            if out is not None:
                return out
        product = _fp32_gemm("mm", a, b)
        if product is not None:
            return product if acc is None else acc.add_(product)
    product = (a @ b).float()
    return product if acc is None else acc.add_(product)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, divisor, softcap, chunk, compute_dtype):
        n = hidden.shape[0]
        cd = compute_dtype or hidden.dtype
        w = weight.to(cd)
        need_h = hidden.requires_grad
        need_w = weight.requires_grad
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = None  # fp32, made by the first chunk's product
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        if divisor is None:
            divisor = (targets != IGNORE_INDEX).sum().clamp(min=1)
        divisor = torch.as_tensor(divisor, device=hidden.device).to(torch.float32)
        # d loss / d (summed token losses): the stock loss's division, applied before rounding.
        inv_divisor = 1.0 / divisor
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            h = hidden[start:end].to(cd)
            t = targets[start:end]
            logits = h @ w.t()
            capped = None
            if softcap is not None:
                # In the compute dtype, as the model's own forward caps its (bf16) logits.
                capped = torch.tanh(logits / softcap)
                logits = capped * softcap
            # log-softmax in fp32 from the compute-dtype logits, as the stock loss computes it
            # (the bf16 input is cast to an fp32 copy first: 4 B per logit while it runs).
            logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            del logits
            valid = t != IGNORE_INDEX
            safe_t = torch.where(valid, t, 0)
            picked = logp.gather(1, safe_t[:, None]).squeeze(1)
            loss_sum -= torch.where(valid, picked, 0.0).sum()
            if not (need_h or need_w):
                continue
            # d(sum of token losses)/d logits = softmax - onehot, in place. Ignored rows are
            # left in it and masked out of the two (tokens x hidden) products instead: no
            # extra pass over the (tokens x vocab) gradient.
            grad = logp.exp_()
            grad[torch.arange(end - start, device=grad.device), safe_t] -= 1.0
            g = grad.mul_(inv_divisor).to(cd)
            if capped is not None:
                # Back through cap * tanh(logits / cap), op by op in the compute dtype.
                g = torch.ops.aten.tanh_backward(g * softcap, capped) / softcap
            del grad, logp, capped
            keep = valid[:, None].to(cd)
            if need_h:
                grad_hidden[start:end] = ((g @ w) * keep).to(hidden.dtype)
            if need_w:
                grad_weight = _add_product_fp32(grad_weight, g.t(), h * keep)
            del g  # before the next chunk's logits: one chunk's gradient alive at a time
        if need_w and grad_weight is None:  # no tokens
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        elif need_w and cd != torch.float32:
            grad_weight = grad_weight.to(cd).float()  # one rounding, as autocast's GEMM output
        ctx.save_for_backward(*(x for x in (grad_hidden, grad_weight) if x is not None))
        ctx.need = (need_h, need_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss_sum / divisor

    @staticmethod
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        scale = grad_out  # the stored gradients already hold 1/divisor
        need_h, need_w = ctx.need
        gh = (saved.pop(0) * scale).to(ctx.dtypes[0]) if need_h else None
        gw = (saved.pop(0) * scale).to(ctx.dtypes[1]) if need_w else None
        return gh, gw, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    divisor: torch.Tensor | float | None = None,
    softcap: float | None = None,
    chunk_tokens: int | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``targets`` without materializing logits.

    Args:
        hidden: ``(N, H)`` final hidden states.
        weight: ``(V, H)`` LM-head weight.
        targets: ``(N,)`` token ids, ``-100`` ignored (already shifted for causal LM).
        divisor: the loss is ``sum / divisor``; ``None`` means the number of non-ignored targets
            (a mean), an explicit value reproduces the Trainer's ``num_items_in_batch`` scaling.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` (Gemma-style).
        chunk_tokens: tokens per chunk (default: about 2 GiB of fp32 logits).
        compute_dtype: dtype of the head matmuls (bf16 under mixed precision).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(
            "chunked_linear_cross_entropy wants hidden (N, H), weight (V, H), targets (N,)"
        )
    if hidden.shape[0] != targets.shape[0] or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"targets {tuple(targets.shape)}"
        )
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    return _ChunkedLinearCrossEntropy.apply(
        hidden, weight, targets, divisor, softcap, chunk, compute_dtype
    )
