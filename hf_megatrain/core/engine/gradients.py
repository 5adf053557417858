"""Layer gradients from backward to where the update reads them.

Micro-batches accumulate in fp32 device accumulators; the step's last one (``sync``) drains
each layer's to the host store on the D2H stream, or to a staging buffer when the store has no
gradient slot. Under data parallel, streamed layers' gradients are reduced to their owner (within
the node; with several nodes the owners of a layer then all-reduce it across nodes) and
replicated (HBM-tier) ones all-reduced. A running sum of squares follows the drains, so the
global norm needs no second pass over the host gradients.

Which parameters got no gradient in a step (``gradless_slots``: frozen slots, and parameters
that take no part in the loss, such as an indexer whose scores only pick top-k positions) is
recorded too: torch's AdamW skips those, and so does the engine's. Under data parallel a
parameter is gradless only where no rank gave it a gradient (as DDP leaves a globally unused
parameter's gradient None): the flags travel with the gradient's reduction, one per slot after
its elements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..autocast_kernels import add_widened, widen
from ..distributed import DataParallel
from ..grad_norm import squared_norm
from ..host_store import LayerStore
from .staging import GradStaging

#: Data parallel: gradient reductions a rank that does not own their layers keeps buffers for
#: (the planner counts them beside the owner's draining ones).
REDUCES_IN_FLIGHT = 2


def zero_gaps(store: LayerStore, flat: torch.Tensor) -> None:
    """Zero what no slot covers in ``flat`` (alignment gaps, the tail)."""
    end = 0
    for slot in sorted(store.slots, key=lambda s: s.offset):
        if slot.offset > end:
            flat[end : slot.offset].zero_()
        end = max(end, slot.offset + slot.numel)
    if end < flat.numel():
        flat[end:].zero_()


def scatter_add(
    store: LayerStore, flat: torch.Tensor, grads: list[torch.Tensor | None], first: bool
) -> None:
    """Add each slot's gradient into ``flat``; ``first``: the step's first, so write it.

    Writing (a converting copy: 6 bytes per bf16 element) instead of zeroing and adding (4 + 10)
    cuts the pass's memory traffic by more than half. The alignment gaps between slots are never
    written: zero from allocation, they stay zero.
    """
    for slot, g in zip(store.slots, grads):
        dst = flat[slot.offset : slot.offset + slot.numel]
        if g is None:
            if first:
                dst.zero_()
        elif first:
            widen(g, out=dst)
        else:
            add_widened(dst, g, out=dst)


def _write_flags(flags: torch.Tensor, got: list[bool]) -> None:
    """Write 1 for each slot that got a gradient, 0 for the others, on ``flags``' device (no
    copy from host memory: on a GPU that would wait for the compute stream)."""
    flags.fill_(1.0)
    for i, g in enumerate(got):
        if not g:
            flags[i].fill_(0.0)


class SecondGradientError(RuntimeError):
    """A layer's gradient arrived again after it was final, with no gradient slot to add it to
    (eager updates): the model ran forward and backward twice in one micro-batch."""

    def __init__(self, layer: int, eager_off: str = "eager_update=False") -> None:
        self.layer = layer
        super().__init__(
            f"hf_megatrain: layer {layer} got a second gradient in one micro-batch: the model "
            "ran forward and backward twice (two forwards in compute_loss, two backward calls "
            "in training_step). Without gradient clipping each layer updates as soon as its "
            "gradient is final (eager updates) and keeps no gradient to add a second one to: "
            f"set {eager_off} (gradients held until the step, one more gradient slot per "
            "parameter in host RAM) or clip gradients."
        )


class GradientSink:
    """Accumulates, drains (or reduces) and accounts for the layers' fp32 gradients.

    ``sync``: this micro-batch is the step's last (else gradients stay in device accumulators).
    ``on_final(layer, D2H event or None)``: called when a layer's gradient of the step is final,
    still inside backward (set by ``HostAdamW.enable_eager_updates``).
    """

    def __init__(
        self,
        stores: list[LayerStore],
        device: torch.device,
        data_parallel: DataParallel | None,
        d2h: torch.cuda.Stream | None,
    ) -> None:
        self._stores = stores
        self._device = device
        self._cuda = device.type == "cuda"
        self._dp = data_parallel
        self._d2h = d2h
        self.sync = True
        self.on_final: Callable[[int, Any], None] | None = None
        #: Layers whose final gradient of this step went to ``on_final`` (eager updates).
        self.finals_sent = 0
        self.staging = GradStaging(stores, self._cuda)
        self.d2h_bytes = 0
        self._acc: dict[int, torch.Tensor] = {}
        self._on_host = [False] * len(stores)
        self._sq: torch.Tensor | None = None
        self._sq_exact = True
        self._d2h_events: list[torch.cuda.Event] = []
        self._pending_reduces: list[tuple[Any, torch.Tensor]] = []
        # Per layer, per slot: whether a micro-batch of this step gave it a gradient here, and
        # (data parallel, where some slot got none here) the flags summed over the ranks.
        self._got: dict[int, list[bool]] = {}
        self._got_any_rank: dict[int, torch.Tensor] = {}

    # ---- backward's side ------------------------------------------------------------------------
    def add(self, idx: int, grads: list[torch.Tensor | None]) -> None:
        """Accumulate layer ``idx``'s parameter gradients (one per slot, any float dtype)."""
        store = self._stores[idx]
        got = [g is not None for g in grads]
        before = self._got.get(idx)
        self._got[idx] = got if before is None else [a or b for a, b in zip(before, got)]
        if self._dp is not None:
            self._add_dp(idx, store, grads)
            return
        if store.resident or (not self._cuda and store.grad is not None):
            # Gradients accumulate in place where the store keeps them (host RAM on CPU runs,
            # HBM for the device tier); nothing to drain.
            first = not self._on_host[idx]
            if not first or not self.sync:
                self._check_accumulates(idx, store)
            self._on_host[idx] = True
            scatter_add(store, store.grad, grads, first)
            if store.fp32_grad_slots:
                # A compact slot: the fp32 gradients (norm weights) also go where they stay exact.
                by_name = {slot.name: g for slot, g in zip(store.slots, grads)}
                for slot, pos in store.fp32_grad_slots:
                    g = by_name[slot.name]
                    dst = store.fp32_grad[pos : pos + slot.numel]
                    if g is None:
                        dst.zero_()
                    else:
                        dst.copy_(g.reshape(-1))
            if self.sync and self.on_final is not None:
                self._final(idx, None)
            return
        acc = self._accumulate(idx, store, grads)
        if acc is not None:
            self._drain(idx, acc)

    def _accumulate(
        self, idx: int, store: LayerStore, grads: list[torch.Tensor | None]
    ) -> torch.Tensor | None:
        """Add a micro-batch's gradient to the layer's fp32 device accumulator.

        Returns the accumulator once the step's last micro-batch is in (``sync``), for the
        caller to drain or reduce; before that it stays in ``_acc`` and None is returned. Under
        data parallel it holds one more element per slot, past the gradient: its flag
        (``_reduce_to_owner``).
        """
        if not self.sync:
            self._check_accumulates(idx, store)
        acc = self._acc.pop(idx, None)
        first = acc is None
        if first:
            # The first write covers every slot: only the alignment gaps need zeros.
            flags = len(store.slots) if self._dp is not None else 0
            acc = torch.empty(store.numel + flags, dtype=torch.float32, device=self._device)
            zero_gaps(store, acc)
        scatter_add(store, acc, grads, first)
        if self.sync:
            return acc
        self._acc[idx] = acc
        return None

    @staticmethod
    def _check_accumulates(idx: int, store: LayerStore) -> None:
        """A compact (bf16) gradient slot holds one backward's gradient exactly, not a sum."""
        if store.compact_grad:
            raise RuntimeError(
                f"hf_megatrain: layer {idx} got gradients from more than one backward pass in "
                "one optimizer step, but its host store keeps a bf16 gradient slot, which is "
                "exact only for one backward of one process (compact_host_grads, chosen for a "
                "step of one micro-batch). Stream the model for the run's gradient accumulation "
                "(its StepShape), or with compact_host_grads=False."
            )

    def _add_sq(self, sq: torch.Tensor) -> None:
        self._sq = sq if self._sq is None else self._sq + sq

    def _drain(self, idx: int, acc: torch.Tensor) -> None:
        store = self._stores[idx]
        if not self._cuda:  # only host stores without a grad slot drain on the CPU
            self._stage_cpu(idx, acc)
            return
        self._add_sq(torch.linalg.vector_norm(acc).square())
        compute = torch.cuda.current_stream(self._device)
        if store.grad is None:
            dest = self._take_staging(idx, store.numel)
        elif self._on_host[idx]:
            self._check_accumulates(idx, store)
            # A second drain in one optimizer step (backward without the trainer's sync flag):
            # add on the host, after the first drain's copy has landed. Correct, not fast; the
            # trainer never takes this path. The running norm no longer matches: recompute it.
            if self.on_final is not None:
                raise SecondGradientError(idx)
            self._sq_exact = False
            for ev in self._d2h_events:
                ev.synchronize()
            self._d2h_events.clear()
            store.grad.add_(acc.to("cpu"))
            return
        else:
            dest = store.grad
        fp32_part = None
        if dest.dtype != acc.dtype:
            # A compact slot: the one backward made this gradient in bf16 (but for parameters
            # computing in fp32, which go to the store's fp32 side buffer), so the narrowing
            # copy is exact, and it halves the bytes crossing PCIe.
            if store.fp32_grad_slots:
                fp32_part = torch.cat(
                    [
                        acc[slot.offset : slot.offset + slot.numel]
                        for slot, _ in store.fp32_grad_slots
                    ]
                )
            acc = acc.to(dest.dtype)
        self._d2h.wait_stream(compute)
        with torch.cuda.stream(self._d2h):
            dest.copy_(acc, non_blocking=True)
            if fp32_part is not None:
                store.fp32_grad.copy_(fp32_part, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._d2h)
        acc.record_stream(self._d2h)
        self.d2h_bytes += acc.numel() * acc.element_size()
        if fp32_part is not None:
            fp32_part.record_stream(self._d2h)
            self.d2h_bytes += fp32_part.numel() * 4
        self._d2h_events.append(ev)
        self._on_host[idx] = True
        if self.on_final is not None:
            self._final(idx, ev)

    # ---- data parallel --------------------------------------------------------------------------
    def _add_dp(self, idx: int, store: LayerStore, grads: list[torch.Tensor | None]) -> None:
        """Accumulate locally, reduce once the step's last micro-batch is done."""
        if self._on_host[idx]:
            raise RuntimeError(
                f"hf_megatrain: layer {idx} got a second gradient in one optimizer step; data "
                "parallel reduces each layer once per step and needs the trainer's "
                "gradient-accumulation flags"
            )
        if store.resident:
            # Replicated (HBM tier): accumulate in place, all-reduce (average) at the last
            # micro-batch; every rank then updates its replica identically.
            first = idx not in self._acc
            self._acc[idx] = store.grad
            scatter_add(store, store.grad, grads, first)
            if self.sync:
                del self._acc[idx]
                self._all_reduce_replicated(idx, store)
                self._on_host[idx] = True
                if self.on_final is not None:
                    self._final(idx, None)
            return
        acc = self._accumulate(idx, store, grads)
        if acc is not None:
            self._reduce_to_owner(idx, acc)

    def _reduce_to_owner(self, idx: int, acc: torch.Tensor) -> None:
        """Sum ``acc`` over the ranks into the owner, who averages it into its host gradient.

        Within the node first (to the owner), then, with several nodes, among the layer's owners
        of every node (they all get the same sum). On CUDA both run on the collective library's
        streams (issued after this layer's backward, they overlap the backward of the layers
        below); only the owner's D2H stream waits for them, and only the owner copies the
        gradient to the host. ``acc`` ends with the slots' gradient flags (1: this rank gave
        the slot a gradient), summed with the gradient; the owner keeps them where it got no
        gradient for some slot itself.
        """
        store = self._stores[idx]
        dp = self._dp
        mine = dp.owns(idx)
        inv = 1.0 / dp.world_size
        self._on_host[idx] = True
        grad, flags = acc[: store.numel], acc[store.numel :]
        got = self._got.get(idx, [])
        _write_flags(flags, got)
        keep_flags = mine and not all(got)
        if not self._cuda:
            dp.reduce_to_owner(acc, idx, async_op=False)
            if mine:
                dp.all_reduce_across_nodes(acc)
                if keep_flags:
                    self._got_any_rank[idx] = flags.clone()
                if store.grad is None:
                    grad.mul_(inv)
                    self._stage_cpu(idx, grad)
                    return
                torch.mul(grad, inv, out=store.grad)
                if self.on_final is not None:
                    self._final(idx, None)
            return
        work = dp.reduce_to_owner(acc, idx, async_op=True)
        if not mine:
            # Keep the buffer alive until the reduction has read it, but no longer: held until
            # backward ends, every rank would keep the fp32 gradients of the layers the others
            # own in HBM (half the streamed layers on 2 GPUs; 26.3B ran out of memory so).
            # Waiting on an older reduction makes the compute stream, not the host, wait for it;
            # issued layers ago, it is done in practice.
            self._pending_reduces.append((work, acc))
            while len(self._pending_reduces) > REDUCES_IN_FLIGHT:
                self._pending_reduces.pop(0)[0].wait()
            return
        # No grad slot: the reduced gradient goes to a staging buffer. Taken after the
        # reduction was issued, so waiting for a free one never holds up the other ranks.
        dest = store.grad if store.grad is not None else self._take_staging(idx, store.numel)
        with torch.cuda.stream(self._d2h):
            work.wait()  # the D2H stream (current here) waits for the reduction, not the host
            # Issued from the D2H stream, the cross-node all-reduce starts once the node's
            # reduction is done; the D2H stream then waits for it in turn.
            across = dp.all_reduce_across_nodes(acc, async_op=True)
            if across is not None:
                across.wait()
            grad.mul_(inv)
            # The running norm is summed on this stream too: on the compute stream it would
            # read ``sq`` before this stream has written it.
            self._add_sq(torch.linalg.vector_norm(grad).square())
            dest.copy_(grad, non_blocking=True)
            if keep_flags:  # (read once this layer's D2H event has passed)
                host_flags = torch.empty(flags.numel(), pin_memory=True)
                self._got_any_rank[idx] = host_flags.copy_(flags, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._d2h)
        acc.record_stream(self._d2h)
        self._d2h_events.append(ev)
        self.d2h_bytes += grad.numel() * 4
        if self.on_final is not None:
            self._final(idx, ev)

    def _all_reduce_replicated(self, idx: int, store) -> None:
        """Average a replicated layer's gradient over the ranks, with its slots' flags."""
        got = self._got.get(idx, [])
        flags = torch.empty(len(got), device=self._device)
        _write_flags(flags, got)
        self._dp.all_reduce_mean_([store.grad, flags])
        if not all(got):
            # (Read by gradless_slots: a sync, only where this rank gave a slot no gradient.)
            self._got_any_rank[idx] = flags

    # ---- staging (host stores without a grad slot) ----------------------------------------------
    def _no_slot_check(self, idx: int) -> None:
        # (Data parallel marks the layer's gradient as arrived before staging it; a second one
        # is refused earlier there, in ``_add_dp``.)
        if self.on_final is None:
            raise RuntimeError(
                f"hf_megatrain: layer {idx}'s host store has no gradient slot (built for eager "
                "updates), so its gradient must be consumed as soon as it is final, but no eager "
                "optimizer is attached (HostAdamW.enable_eager_updates). Build the model with "
                "host_grads=True to hold gradients until step()."
            )
        if self._dp is None and self._on_host[idx]:
            raise SecondGradientError(idx)

    def _stage_cpu(self, idx: int, grad: torch.Tensor) -> None:
        """CPU: the final gradient already is in host memory; the update reads it in place."""
        self._no_slot_check(idx)
        self._add_sq(squared_norm(grad))
        self._on_host[idx] = True
        self.staging.hold(idx, grad)
        self._final(idx, None)

    def _take_staging(self, idx: int, numel: int) -> torch.Tensor:
        self._no_slot_check(idx)
        return self.staging.take(idx, numel)

    # ---- the update's side ----------------------------------------------------------------------
    def final_grad(self, idx: int) -> torch.Tensor:
        """Layer ``idx``'s final gradient of the step on the host (flat): fp32, or bf16 from a
        compact slot (``LayerStore.widen_grad`` reads it with its fp32 parts).

        The store's slot, or, without one, the staging buffer it was copied to (read it after
        the event ``on_final`` passed, then call ``consumed``).
        """
        store = self._stores[idx]
        if store.grad is not None:
            return store.grad
        staged = self.staging.get(idx)
        if staged is None:
            raise RuntimeError(
                f"hf_megatrain: layer {idx} holds no gradient: its host store has no gradient "
                "slot (eager updates), and the staged gradient was already consumed. Clipping, "
                "a second optimizer step or reading gradients after the update need "
                "the host_grads=True option."
            )
        return staged

    def consumed(self, idx: int) -> None:
        """The update has read layer ``idx``'s staged gradient: its buffer may be reused."""
        self.staging.consumed(idx)

    def finish(self) -> None:
        """Drain leftover accumulators and wait for every D2H copy: host grads are then final."""
        for idx in sorted(self._acc):
            acc = self._acc.pop(idx)
            if self._dp is None:
                self._drain(idx, acc)
            elif self._stores[idx].resident:
                self._all_reduce_replicated(idx, self._stores[idx])
                self._on_host[idx] = True
            else:
                self._reduce_to_owner(idx, acc)
        for work, _ in self._pending_reduces:
            work.wait()
        self._pending_reduces.clear()
        for ev in self._d2h_events:
            ev.synchronize()
        self._d2h_events.clear()

    def layer_has_grad(self, idx: int) -> bool:
        """Whether layer ``idx`` received a gradient this step (else the optimizer skips it)."""
        return self._on_host[idx]

    def gradless_slots(self, idx: int) -> frozenset[int]:
        """Positions (in ``store.slots``) of layer ``idx``'s parameters no micro-batch of this
        step gave a gradient (under data parallel: on no rank), once its gradient is final."""
        got = self._got.get(idx)
        if got is None or all(got):
            return frozenset()
        if idx in self._got_any_rank:  # (a rank's gradient: the slot got one)
            got = [bool(f > 0) for f in self._got_any_rank[idx].tolist()]
        return frozenset(i for i, g in enumerate(got) if not g)

    def has_grads(self) -> bool:
        return any(self._on_host) or bool(self._acc)

    def sq_sum(self) -> torch.Tensor:
        """Sum of squares of all layer gradients (call after ``finish``).

        Under data parallel, every rank gets the same global sum: each rank's owned layers are
        summed over the ranks (each layer once, however many nodes hold a copy), the replicated
        (HBM-tier) layers are counted once. So it is a collective: every rank must call it.
        """
        # The running sum covers every streamed layer on CUDA, and on the CPU when the stores
        # hold no gradient slot (it is the only record of those gradients once consumed).
        running = self._sq is not None and (self._cuda or self.staging.enabled) and self._sq_exact
        streamed = torch.zeros((), dtype=torch.float32)
        replicated = torch.zeros((), dtype=torch.float32, device=self._device)
        for idx, store in enumerate(self._stores):
            if not self._on_host[idx] or store.grad is None:
                continue
            if store.resident:
                replicated += squared_norm(store.grad)
            elif not running:
                grad = store.grad
                if store.compact_grad:  # (CPU runs) widened, its fp32 parts from their buffer
                    grad = store.widen_grad(0, store.numel, torch.empty(store.numel))
                streamed += squared_norm(grad).cpu()
        streamed = self._sq if running else streamed.to(self._device)
        if self._dp is not None:
            streamed = streamed.clone()
            self._dp.sum_over_owners_(streamed)
        return streamed + replicated

    @property
    def d2h(self) -> torch.cuda.Stream | None:
        """The copy stream (None on the CPU)."""
        return self._d2h

    def _final(self, idx: int, event) -> None:
        self.finals_sent += 1
        self.on_final(idx, event)

    def reset(self) -> None:
        """Forget the step's gradients (the next backward starts a new step)."""
        self.finals_sent = 0
        self.staging.release_all()  # e.g. after a failed update: its buffer is free again
        self._acc.clear()
        self._on_host = [False] * len(self._stores)
        self._got.clear()
        self._got_any_rank.clear()
        self._sq = None
        self._sq_exact = True
        self._pending_reduces.clear()
