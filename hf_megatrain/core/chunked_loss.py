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

On CUDA with 16-bit logits (no soft-cap) one Triton kernel per chunk does the fp32 log-softmax,
the target's log-probability and the scaled, rounded logit gradient, written over the logits:
two reads and one write of the chunk's logits where PyTorch's ops (upcast, softmax, exp,
subtract, scale, round) make about seven passes over fp32 copies; measured 7.1 ms -> ~1 ms per
4k-token chunk at a 128k vocabulary on the H200. The same arithmetic in the same order per
logit as the stock loss's CUDA kernels, with CUDA's own expf and logf (libdevice: Triton's
tl.exp is ex2.approx, several fp32 ulps off for the log-probabilities' range); only the fp32 row
sum is reduced in another order (a few fp32 ulps before the bf16 rounding). Engine option
``fused_loss_kernel`` (default on); elsewhere PyTorch's ops.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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


def add_product_fp32(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
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


@functools.cache
def _softmax_grad_kernel():
    """The Triton kernel of :func:`_softmax_grad_in_place`, or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    try:  # CUDA's own expf / logf: tl.exp is ex2.approx.f32 (several fp32 ulps off)
        from triton.language.extra import libdevice
    except ImportError:
        try:
            from triton.language.extra.cuda import libdevice
        except ImportError:
            return None

    @triton.jit
    def softmax_grad(
        logits, stride, targets, picked, inv_divisor, n_cols, ignore_index,
        BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        target = tl.load(targets + row)
        # Online max and sum of exp(x - max) in fp32 (one pass), as log_softmax's reduction.
        m = float("-inf")
        d = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            d = d * libdevice.exp(m - m_new) + tl.sum(libdevice.exp(x - m_new), 0)
            m = m_new
        log_d = libdevice.log(d)
        valid = target != ignore_index
        safe = tl.where(valid, target, 0)
        # A target outside the vocabulary reads nothing: its loss is NaN (the Trainer's
        # non-finite check reports it) where PyTorch's gather would raise a device assert.
        inside = (safe >= 0) & (safe < n_cols)
        x_t = tl.load(base + safe, mask=inside, other=float("nan")).to(tl.float32)
        tl.store(picked + row, tl.where(valid, (x_t - m) - log_d, 0.0))
        if WRITE_GRAD:
            inv = tl.load(inv_divisor)
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < n_cols
                x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
                # The stock loss's log_softmax backward, gO - exp(logp) * sum(gO) with gO = -inv
                # at the target: exp(logp) * inv, minus inv at the target (the compiler may fuse
                # the two into one fma, as nvcc may ATen's), rounded to the logits' dtype.
                g = libdevice.exp((x - m) - log_d) * inv
                g = tl.where(cols == safe, g - inv, g)
                tl.store(base + cols, g.to(logits.dtype.element_ty), mask=mask)

    return triton, softmax_grad


def _softmax_grad_in_place(
    logits: torch.Tensor, targets: torch.Tensor, inv_divisor: torch.Tensor, write_grad: bool
) -> torch.Tensor:
    """Each row's log-probability of its target (0 for ignored rows), and with ``write_grad``
    the logits overwritten by ``(softmax - onehot) * inv_divisor`` in their dtype (rows of
    ignored targets as the PyTorch path leaves them, for the products to mask out)."""
    triton, kernel = _softmax_grad_kernel()
    n, v = logits.shape
    targets = targets.contiguous()  # read by offset
    picked = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        block = min(32768, triton.next_power_of_2(v))
        with torch.cuda.device(logits.device):
            kernel[(n,)](
                logits, logits.stride(0), targets, picked, inv_divisor, v, IGNORE_INDEX,
                BLOCK=block, WRITE_GRAD=write_grad, num_warps=32 if block >= 32768 else 8,
            )  # fmt: skip
    return picked


def _kernel_applies(logits: torch.Tensor, softcap: float | None, use_kernel: bool) -> bool:
    return (
        use_kernel
        and softcap is None
        and logits.is_cuda
        and logits.dtype in (torch.bfloat16, torch.float16)
        and logits.stride(1) == 1
        and _softmax_grad_kernel() is not None
    )


def logit_gradient(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_divisor: torch.Tensor,
    *,
    softcap: float | None = None,
    write_grad: bool = True,
    kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's part of the loss: the sum of its rows' target log-probabilities (fp32, from
    the ``(tokens, vocab)`` compute-dtype ``logits``, soft-capped first when ``softcap`` is
    given; rows whose target is ``IGNORE_INDEX`` add 0), and with ``write_grad`` the gradient
    of the summed token losses times ``inv_divisor`` (a 0-d fp32 tensor) with respect to the
    logits, rounded to their dtype. Rows of ignored targets hold values for the caller to mask
    out. ``kernel``: the one-pass Triton kernel where it applies (CUDA, 16-bit logits, no
    soft-cap), which writes the gradient over ``logits``; else PyTorch's ops. Pass the logits
    as the only reference to them (``logit_gradient(h @ w.t(), ...)``): PyTorch's ops free them
    as soon as their fp32 copy exists (the plan's 10 B per logit, 12 soft-capped)."""
    if _kernel_applies(logits, softcap, kernel):
        picked = _softmax_grad_in_place(logits, targets, inv_divisor, write_grad).sum()
        return picked, logits if write_grad else None
    dtype = logits.dtype
    capped = None
    if softcap is not None:
        # In the compute dtype, as the model's own forward caps its (bf16) logits.
        capped = torch.tanh(logits / softcap)
        logits = capped * softcap
    # log-softmax in fp32 from the compute-dtype logits, as the stock loss computes it (the
    # bf16 input is cast to an fp32 copy first: 4 B per logit while it runs).
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    del logits
    # The stock loss's own reduction (cross_entropy's nll_loss, summed), so that one chunk's
    # loss is stock's to the bit, not a sum in another order.
    picked = -torch.nn.functional.nll_loss(
        logp, targets, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    safe = torch.where(targets != IGNORE_INDEX, targets, 0)
    if not write_grad:
        return picked, None
    # d(sum of token losses)/d logits, in place, in the order of the stock loss's log_softmax
    # backward (gO - exp(logp) * sum(gO), gO = -inv at the target): exp(logp) * inv, then minus
    # inv at the target. (softmax - onehot) * inv rounds the target's entry differently in ~15%
    # of rows.
    grad = logp.exp_().mul_(inv_divisor)
    grad[torch.arange(grad.shape[0], device=grad.device), safe] -= inv_divisor
    g = grad.to(dtype)
    del grad, logp
    if capped is not None:
        # Back through cap * tanh(logits / cap), op by op in the compute dtype.
        g = torch.ops.aten.tanh_backward(g * softcap, capped) / softcap
    return picked, g


@dataclass(frozen=True)
class LogitMap:
    """What a family's forward does to its head's output ``hidden @ W.T (+ bias)`` before the
    loss, op by op in the compute dtype as the forward does: ``* scale`` (Cohere's
    ``logit_scale``), ``/ divide_by`` (Granite's ``logits_scaling``), then ``softcap *
    tanh(x / softcap)`` (Gemma's ``final_logit_softcapping``). None: not done."""

    scale: float | None = None
    divide_by: float | None = None
    softcap: float | None = None

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        """The scaled logits (the soft-cap is :func:`logit_gradient`'s)."""
        if self.scale is not None:
            logits = logits * self.scale
        if self.divide_by is not None:
            logits = logits / self.divide_by
        return logits

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        """The scaled logits' gradient taken back to the head's output, as autograd's
        ``DivBackward`` / ``MulBackward`` do it (one rounding each)."""
        if self.divide_by is not None:
            grad = grad / self.divide_by
        if self.scale is not None:
            grad = grad * self.scale
        return grad


def _head_logits(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, logit_map: LogitMap
) -> torch.Tensor:
    """One chunk's logits before the soft-cap, as the model's head makes them (``F.linear``
    is the head's own op; the intermediate is freed as each step's result exists)."""
    return logit_map.forward(torch.nn.functional.linear(h, w, b))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor, logit_map, chunk, compute_dtype,
                use_kernel):  # fmt: skip
        n = hidden.shape[0]
        cd = compute_dtype or hidden.dtype
        w = weight.to(cd)
        b = bias.to(cd) if bias is not None else None
        need_h = hidden.requires_grad
        need_w = weight.requires_grad
        need_b = bias is not None and bias.requires_grad
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = None  # fp32, made by the first chunk's product
        grad_bias = None  # fp32, summed over the chunks
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        if divisor is None:
            divisor = (targets != IGNORE_INDEX).sum().clamp(min=1)
        divisor = torch.as_tensor(divisor, device=hidden.device).to(torch.float32)
        # d loss / d (summed token losses): the stock loss's division, applied before rounding.
        # A divisor of 0 (a step with no trainable token) divides nothing: zero gradients, as
        # the stock loss's (its ignored rows get none), where 1/0 made them NaN.
        inv_divisor = torch.where(divisor > 0, 1.0 / divisor, torch.zeros_like(divisor))
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            h = hidden[start:end].to(cd)
            t = targets[start:end]
            # The logits' only reference is the callee's (freed once their fp32 copy exists).
            picked, g = logit_gradient(
                _head_logits(h, w, b, logit_map), t, inv_divisor, softcap=logit_map.softcap,
                write_grad=need_h or need_w or need_b, kernel=use_kernel,
            )  # fmt: skip
            loss_sum -= picked
            if g is None:
                continue
            g = logit_map.backward(g)
            if need_b:
                # Ignored rows hold values (the products below mask them out): zeroed for the
                # bias's sum, in place, as the stock loss's zero gradient rows.
                g.masked_fill_((t == IGNORE_INDEX)[:, None], 0)
                part = g.sum(0, dtype=torch.float32)
                grad_bias = part if grad_bias is None else grad_bias.add_(part)
            # Ignored rows are masked out of the two (tokens x hidden) products instead of an
            # extra pass over the (tokens x vocab) gradient.
            keep = (t != IGNORE_INDEX)[:, None].to(cd)
            if need_h:
                grad_hidden[start:end] = ((g @ w) * keep).to(hidden.dtype)
            if need_w:
                grad_weight = add_product_fp32(grad_weight, g.t(), h * keep)
            del g  # before the next chunk's logits: one chunk's gradient alive at a time
        if need_w and grad_weight is None:  # no tokens
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        elif need_w and cd != torch.float32:
            grad_weight = grad_weight.to(cd).float()  # one rounding, as autocast's GEMM output
        if need_b and grad_bias is None:  # no tokens
            grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        elif need_b and cd != torch.float32:
            grad_bias = grad_bias.to(cd).float()  # one rounding, as autocast's bf16 sum
        saved = (grad_hidden, grad_weight, grad_bias)
        ctx.save_for_backward(*(x for x in saved if x is not None))
        ctx.need = (need_h, need_w, need_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return loss_sum / divisor

    @staticmethod
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        scale = grad_out  # the stored gradients already hold 1/divisor
        grads = [
            (saved.pop(0) * scale).to(dtype) if need else None
            for need, dtype in zip(ctx.need, ctx.dtypes, strict=True)
        ]
        return grads[0], grads[1], grads[2], None, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    divisor: torch.Tensor | float | None = None,
    softcap: float | None = None,
    chunk_tokens: int | None = None,
    compute_dtype: torch.dtype | None = None,
    kernel: bool = True,
    bias: torch.Tensor | None = None,
    logit_scale: float | None = None,
    logits_scaling: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets`` without materializing
    logits.

    Args:
        hidden: ``(N, H)`` final hidden states.
        weight: ``(V, H)`` LM-head weight.
        targets: ``(N,)`` token ids, ``-100`` ignored (already shifted for causal LM).
        divisor: the loss is ``sum / divisor``; ``None`` means the number of non-ignored targets
            (a mean), an explicit value reproduces the Trainer's ``num_items_in_batch`` scaling.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` (Gemma-style).
        chunk_tokens: tokens per chunk (default: about 2 GiB of fp32 logits).
        compute_dtype: dtype of the head matmuls (bf16 under mixed precision).
        kernel: the one-pass Triton kernel where it applies (CUDA, 16-bit logits, no
            soft-cap); False: PyTorch's ops everywhere.
        bias: ``(V,)`` the LM head's bias (Phi's, GPT-J's), if it has one.
        logit_scale: if set, logits are multiplied by it (Cohere's ``logit_scale``).
        logits_scaling: if set, logits are divided by it (Granite's ``logits_scaling``).
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
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not match weight {tuple(weight.shape)}")
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    logit_map = LogitMap(scale=logit_scale, divide_by=logits_scaling, softcap=softcap)
    if not torch.is_grad_enabled():
        # (an evaluation: the head's weight still requires grad, but no backward will come,
        # so no chunk writes a gradient; the forward runs without grad mode either way)
        hidden, weight = hidden.detach(), weight.detach()
        bias = bias.detach() if bias is not None else None
    return _ChunkedLinearCrossEntropy.apply(
        hidden, weight, bias, targets, divisor, logit_map, chunk, compute_dtype, kernel
    )
