"""Is the fused loss's LM-head weight gradient the stock GEMM's, bit for bit? (CUDA)

    python3 dev/loss_gemm_probe.py

From one bf16 logit gradient ``g`` (tokens x vocab) and hidden states ``h`` (tokens x hidden),
the weight gradient three ways: the stock loss's (autograd through ``h @ W.T`` under bf16: the
``(h.T @ g).T`` GEMM written in bf16), the fused loss's on CUDA (``g.T @ h`` written in fp32 by
``out_dtype``, then rounded once to bf16) and the plain ``g.T @ h`` bf16 GEMM. Prints the share
of entries where each differs from stock's, at one chunk and at the parity test's shape.
"""

from __future__ import annotations

import torch

from hf_megatrain.core.chunked_loss import add_product_fp32


def stock_weight_grad(h: torch.Tensor, g: torch.Tensor, vocab: int) -> torch.Tensor:
    w = torch.zeros(vocab, h.shape[1], device=h.device, dtype=torch.bfloat16, requires_grad=True)
    (h @ w.t()).backward(g)
    return w.grad


def main() -> None:
    torch.manual_seed(0)
    for tokens, hidden, vocab in ((4096, 768, 4096), (4096, 4096, 32768), (512, 1024, 8192)):
        h = torch.randn(tokens, hidden, device="cuda").bfloat16()
        g = (torch.randn(tokens, vocab, device="cuda") * 1e-4).bfloat16()
        stock = stock_weight_grad(h, g, vocab)
        fused = add_product_fp32(None, g.t(), h).to(torch.bfloat16)
        plain = g.t() @ h
        for name, got in (("fused (fp32 out, one rounding)", fused), ("plain g.T @ h", plain)):
            share = (got != stock).float().mean().item()
            print(f"{tokens} x {hidden} x {vocab}: {name}: {share:.2e} of entries differ")


if __name__ == "__main__":
    main()
