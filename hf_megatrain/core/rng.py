"""The random state work draws from (the CPU's and a CUDA device's), to run that work again with
the same random numbers: a recompute in backward (dropout masks, router jitter, adapters' noise)
or a step replayed after running out of memory."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

RngState = tuple[torch.Tensor, "torch.Tensor | None"]


def rng_state(device: torch.device) -> RngState:
    """The CPU's and (on a CUDA ``device``) the device's random state."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: RngState, device: torch.device) -> None:
    """Make ``state`` (``rng_state``'s) the current random state."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@contextlib.contextmanager
def replayed_rng(state: RngState | None, device: torch.device) -> Iterator[None]:
    """Inside: the random state ``state`` (None: the current one, untouched); after: the random
    state from before, as if nothing inside had drawn."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        set_rng_state(state, device)
        yield
