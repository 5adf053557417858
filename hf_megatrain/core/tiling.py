"""Sequence tiling of token-wise sub-modules (MLPs): working memory bounded by the tile.

A decoder layer's MLP at 512k tokens materializes (tokens x intermediate) tensors several times
over (gate, up, activation, their gradients): tens of GB. ``TiledTokenwise`` runs the module tile
by tile along the sequence under ``no_grad`` in forward and, in backward, recomputes one tile at a
time and takes its gradients, so only one tile's intermediates ever exist. The module must be
token-wise (each output position depends only on the same input position), which holds for MLPs
and norms, never for attention.

The module's parameters are explicit inputs of the autograd Function: inside a streamed layer they
are the bound streamed tensors, and by the time backward runs the layer's binding is gone, so the
recompute re-binds them itself.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from .recompute import refill_remaining
from .rng import replayed_rng, rng_state


def run_tile(module: nn.Module, forward, names: list[str], params, x: torch.Tensor) -> torch.Tensor:
    with _reparametrize_module(module, dict(zip(names, params))):
        return forward(module, x)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """``x``'s tokens as one row, ``[1, tokens, features]``: tiles count a micro-batch's tokens
    (as the memory plan does), not each row's, so rows no longer than the tile are tiled too. A
    view where ``x`` is contiguous (a layer's hidden states are)."""
    return x.reshape(1, -1, x.shape[-1])


def _tiles(x: torch.Tensor, tile: int):
    """``x``'s tokens in tiles of ``tile`` (``_tokens``), each contiguous (an MLP may ``view``
    its input: GPT-2's Conv1D), made one at a time (a generator)."""
    return (xs.contiguous() for xs in _tokens(x).split(tile, dim=-2))


def _tiled_outputs(x: torch.Tensor, tile: int, run) -> torch.Tensor:
    """``run`` over ``x``'s tiles, written into one fresh tensor of ``x``'s leading shape: no
    list of tile outputs plus their concatenation, and no view a caller could not modify in
    place (Falcon's layer adds the attention output into the MLP's)."""
    out = flat = None
    offset = 0
    for xs in _tiles(x, tile):
        ys = run(xs)
        if out is None:
            out = ys.new_empty(*x.shape[:-1], ys.shape[-1])
            flat = _tokens(out)
        flat.narrow(-2, offset, ys.shape[-2]).copy_(ys)
        offset += ys.shape[-2]
    return out


def _token_count(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


class _TiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, forward, names, tile, x, *params):
        ctx.module, ctx.forward_fn, ctx.names, ctx.tile = module, forward, names, tile
        # Autocast is thread-local and CUDA backward runs on the autograd engine's device thread:
        # record the forward's state so the recompute casts exactly as the forward did.
        dev = x.device.type
        ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        # The random state the tiles start from: backward re-runs them in the same order from
        # it, so a module that draws (dropout, an adapter's) makes the forward's masks again.
        # (An early-stop recompute's is the forward's: its layer replays the forward's state.)
        ctx.rng = rng_state(x.device) if module.training else None
        ctx.save_for_backward(x, *params)
        if refill_remaining() == 1 + len(params):
            # An early-stop recompute whose last saves are these: it stops as soon as they are
            # packed, right after this returns, so the tiles' output is never read. (Saves of a
            # custom Function are packed only after its forward: without this every recompute
            # ran all the tiles.)
            return torch.empty_like(x)
        with torch.no_grad():
            return _tiled_outputs(x, tile, lambda xs: run_tile(module, forward, names, params, xs))

    @staticmethod
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        leaves = [p.detach().requires_grad_(p.requires_grad) for p in params]
        trainable = [p for p in leaves if p.requires_grad]
        grad_x = x.new_empty(x.shape) if x.requires_grad else None
        grad_params: list[torch.Tensor | None] = [None] * len(trainable)
        offset = 0
        grad_tiles = _tokens(grad_out).split(ctx.tile, dim=-2)
        with replayed_rng(ctx.rng, x.device):
            for xs, gs in zip(_tiles(x, ctx.tile), grad_tiles):
                xs = xs.detach().requires_grad_(x.requires_grad)
                dev, enabled, dtype = ctx.autocast
                with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
                    # On an alias: autocast caches its casts of a leaf that requires grad, and the
                    # gate and up projections would then sum their input gradients in bf16 (untiled,
                    # the input is no leaf: each cast's gradient is widened and summed in fp32).
                    out = run_tile(ctx.module, ctx.forward_fn, ctx.names, leaves, xs.view_as(xs))
                wrt = ([xs] if x.requires_grad else []) + trainable
                if not wrt:
                    break
                grads = torch.autograd.grad(out, wrt, gs, allow_unused=True)
                if x.requires_grad:
                    n = xs.shape[-2]
                    _tokens(grad_x).narrow(-2, offset, n).copy_(grads[0])
                    offset += n
                    grads = grads[1:]
                for i, g in enumerate(grads):
                    if g is None:
                        continue
                    if grad_params[i] is None:
                        # Summed over the tiles in fp32 and rounded to the parameter's dtype once
                        # (autograd casts what backward returns), as one GEMM over every token
                        # accumulates and rounds once; a bf16 sum rounded at every tile.
                        grad_params[i] = (
                            g.float() if g.dtype in (torch.bfloat16, torch.float16) else g
                        )
                    else:
                        grad_params[i].add_(g)
        it = iter(grad_params)
        param_grads = [next(it) if p.requires_grad else None for p in leaves]
        return (None, None, None, None, grad_x, *param_grads)


class TiledTokenwise:
    """Callable installed as a token-wise module's ``forward``: tiles long sequences.

    Inputs of up to ``tile_tokens`` tokens (all rows together) run the module's own forward
    unchanged; longer ones run in tiles of that many tokens, rows flattened into one.
    """

    def __init__(self, module: nn.Module, tile_tokens: int, forward_impl=None) -> None:
        """``forward_impl(module, x)`` is the forward to tile: by default the one the module has
        (a forward patched onto the instance, e.g. a fused kernel's, else its class's)."""
        if tile_tokens <= 0:
            raise ValueError(f"tile_tokens must be positive, got {tile_tokens}")
        self.module = module
        self.tile_tokens = tile_tokens
        if forward_impl is None:
            patched = module.__dict__.get("forward")
            forward_impl = getattr(patched, "__func__", None) or type(module).forward
        self.forward_impl = forward_impl

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or _token_count(x) <= self.tile_tokens:
            return self.forward_impl(self.module, x)
        # Inside a streamed layer these are the bound streamed tensors, not meta placeholders.
        named = list(self.module.named_parameters())
        names = [n for n, _ in named]
        params = [p for _, p in named]
        if not torch.is_grad_enabled():
            return _tiled_outputs(
                x, self.tile_tokens, lambda xs: self.forward_impl(self.module, xs)
            )
        return _TiledFunction.apply(
            self.module, self.forward_impl, names, self.tile_tokens, x, *params
        )
