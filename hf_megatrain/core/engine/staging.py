"""Final gradients of host layers stored without a gradient slot (eager updates, no clipping):
handed to the update in a staging buffer, freed once the update has read it."""

from __future__ import annotations

import threading

import torch

from ..host_store import LayerStore, PinnedBuffer

#: Pinned host buffers (each the size of the largest host layer's fp32 gradient) through which
#: final gradients reach the eager CPU update when the stores hold no gradient slot. Two let one
#: layer's D2H copy land while the previous layer's update reads the other; more would only let
#: the backward run further ahead of a CPU update that bounds the step anyway.
GRAD_STAGING_SLOTS = 2


def needs_staging(store: LayerStore) -> bool:
    """A trainable host layer this rank owns whose store holds no gradient slot."""
    return (
        not store.resident
        and store.trainable
        and store.owned
        and not getattr(store, "holds_grad", True)
    )


class GradStaging:
    """A ring of pinned buffers (CUDA) and the staged gradient of each layer until consumed.

    On the CPU a final gradient already is in host memory: it is staged in place, no ring.
    """

    def __init__(self, stores: list[LayerStore], cuda: bool) -> None:
        staged = [s for s in stores if needs_staging(s)]
        self.enabled = bool(staged)
        self._staged: dict[int, tuple[int | None, torch.Tensor]] = {}
        self._buffers: list[PinnedBuffer] = []
        self._ring: list[torch.Tensor] = []
        self._free: list[threading.Event] = []
        self._next = 0
        if cuda and staged:
            numel = max(s.numel for s in staged)
            pin = any(getattr(s, "pinned", False) for s in stores)
            self._buffers = [PinnedBuffer(numel * 4, pin=pin) for _ in range(GRAD_STAGING_SLOTS)]
            self._ring = [b.view((numel,), torch.float32) for b in self._buffers]
            self._free = [threading.Event() for _ in self._ring]
            for ev in self._free:
                ev.set()

    def take(self, idx: int, numel: int) -> torch.Tensor:
        """The next ring buffer for layer ``idx``, once the update that read it last is done.

        A host-side wait (a ``threading.Event`` set by ``consumed``), never a device
        synchronization: the GPU keeps running the work already queued.
        """
        slot = self._next
        self._next = (slot + 1) % len(self._ring)
        self._free[slot].wait()
        self._free[slot].clear()
        view = self._ring[slot][:numel]
        self._staged[idx] = (slot, view)
        return view

    def hold(self, idx: int, grad: torch.Tensor) -> None:
        """Stage ``grad`` in place (CPU: it already is in host memory)."""
        self._staged[idx] = (None, grad)

    def get(self, idx: int) -> torch.Tensor | None:
        staged = self._staged.get(idx)
        return None if staged is None else staged[1]

    def consumed(self, idx: int) -> None:
        """The update has read layer ``idx``'s staged gradient: its buffer may be reused."""
        staged = self._staged.pop(idx, None)
        if staged is not None and staged[0] is not None:
            self._free[staged[0]].set()

    def release_all(self) -> None:
        """Free every staged buffer (e.g. after a failed update)."""
        for idx in list(self._staged):
            self.consumed(idx)

    # ---- what is held ---------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """Ring buffers allocated (0 on the CPU or when no layer needs staging)."""
        return len(self._ring)

    @property
    def buffers(self) -> tuple[PinnedBuffer, ...]:
        return tuple(self._buffers)

    def all_free(self) -> bool:
        """Whether no ring buffer waits for an update to read it."""
        return all(ev.is_set() for ev in self._free)
