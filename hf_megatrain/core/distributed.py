"""Data parallel across the GPUs (or CPU processes) of one host.

One process per device; every rank streams every layer through its own device, on its own shard
of the batch. What is *not* replicated is the host state of the streamed layers:

* **Shared weights.** The fp32 masters and the compute-dtype stream copies of all streamed layers
  live once per host, in one ``MAP_SHARED`` memory region (a ``memfd`` created by rank 0 and
  opened by the other ranks through ``/proc/<pid>/fd``; unlike ``/dev/shm`` it is not capped by
  a container's small tmpfs). Every rank streams its weights from there; each rank registers the
  stream copies as pinned memory in its own address space.
* **Owned optimizer state.** Each streamed layer has one owner rank (``owner(i)``). Only the
  owner holds the layer's fp32 gradient and AdamW moments and runs its CPU update, which writes
  the shared master and stream copy in place: the new weights are visible to every rank with no
  copy.
* **Readiness.** A small array of per-layer versions sits at the start of the shared region: the
  owner sets ``version[i] = t`` once layer ``i`` holds the weights after optimizer step ``t``,
  and a rank about to stream layer ``i`` for step ``t + 1`` waits for it. So the owner's
  background update of step ``t`` overlaps every rank's forward of step ``t + 1``, layer by layer,
  exactly as the single-process engine overlaps its own update.
* **Gradients** are reduced layer by layer to the owner (``reduce``, sum then divided by the
  world size: DDP's averaging) as soon as the layer's backward is done, on the collective
  library's stream, so the reduction of layer ``i`` overlaps the backward of layer ``i - 1``.
  Parameters that stay on the device (embeddings, final norm, LM head, LoRA adapters, HBM-tier
  layers) are replicated: their gradients are all-reduced (averaged) and every rank runs the
  same update on them.

Single host only: the shared region needs every rank on one machine.

No ``transformers`` import here.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
#: How long a rank waits for a layer's owner to publish its update before giving up (seconds).
#: As long as the default process-group timeout: a dead owner surfaces as an error, not a hang.
PUBLISH_TIMEOUT_S = 1800.0


class DataParallelError(RuntimeError):
    """A data-parallel setup hf_megatrain cannot run (multi-node, too many ranks, ...)."""


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass
class DataParallel:
    """The process group hf_megatrain runs data parallel over, and who owns which layer.

    Args:
        rank: this process's rank in ``group``.
        world_size: number of ranks.
        local_world_size: ranks on this host (must equal ``world_size``: single host only).
        group: the ``torch.distributed`` process group (``None``: the default group).
    """

    rank: int
    world_size: int
    local_world_size: int
    group: dist.ProcessGroup | None = None
    owners: list[int] = field(default_factory=list)
    _versions: torch.Tensor | None = field(default=None, repr=False)
    _regions: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.local_world_size != self.world_size:
            raise DataParallelError(
                f"hf_megatrain: data parallel runs on one host only (the ranks share the host "
                f"store through shared memory), but {self.world_size} processes were launched "
                f"with {self.local_world_size} on this host. Launch them all on one machine."
            )

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_environment(cls, device: torch.device | str) -> DataParallel | None:
        """The data-parallel setup of this launch, or ``None`` for a single process.

        Uses the initialized default process group (accelerate / the Trainer create it). When a
        launcher started several processes (``WORLD_SIZE > 1``) but nobody initialized the group
        yet (a model streamed before its ``TrainingArguments`` exist), it is initialized here the
        way accelerate would: NCCL for CUDA devices, gloo for CPU; accelerate then adopts it.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
        if world <= 1:
            return None
        device = torch.device(device)
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            if device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend=backend)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or _count_local_ranks()
        dp = cls(dist.get_rank(), dist.get_world_size(), local_world)
        dp._set_cpu_threads()
        return dp

    def _set_cpu_threads(self) -> None:
        # Launchers default OMP_NUM_THREADS to 1 per process when they start several; the host
        # AdamW would then run on one core. Give each rank its share of the host's cores.
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cpus = os.cpu_count() or 1
        share = max(1, cpus // self.local_world_size)
        if torch.get_num_threads() == 1 and share > 1:
            torch.set_num_threads(share)
            logger.info(
                "hf_megatrain: rank %d uses %d CPU threads (%d cores / %d ranks; set "
                "OMP_NUM_THREADS > 1 to choose)",
                self.rank,
                share,
                cpus,
                self.local_world_size,
            )

    # ---- layer ownership ---------------------------------------------------------------------
    def assign_owners(self, layer_numels: Sequence[int | None]) -> None:
        """Give each streamed layer an owner rank, balancing the bytes of optimizer state.

        ``None`` marks a replicated layer (HBM tier: every rank keeps and updates its own copy;
        its owner is -1). Greedy in layer order onto the least-loaded rank (lowest rank on
        ties): with equal layers that is round-robin, so the ranks' background updates of
        consecutive layers run side by side and the next forward finds layers ready in order.
        """
        n = len(layer_numels)
        if n < self.world_size:
            raise DataParallelError(
                f"hf_megatrain: {self.world_size} data-parallel ranks but the model has {n} "
                "decoder layers; every rank must be able to own a layer. Use fewer processes."
            )
        load = [0] * self.world_size
        owners = []
        for numel in layer_numels:
            if numel is None:
                owners.append(-1)
                continue
            r = min(range(self.world_size), key=lambda k: (load[k], k))
            owners.append(r)
            load[r] += numel
        self.owners = owners

    def host_bytes(
        self,
        numels: Sequence[int],
        trainable: Sequence[bool],
        stream_dtype: torch.dtype,
        hold_grad: bool = True,
        stream_master: bool = False,
    ) -> int:
        """Host RAM all ranks together take for these streamed layers (shared + owned parts).

        Every rank checks this same total against the host's free memory before anything is
        allocated, so the ranks refuse together instead of one of them running out later.
        """
        from .host_store import owned_layer_bytes, shared_layer_bytes  # noqa: PLC0415

        header = _round_up(max(len(self.owners), 1) * 8, PAGE)
        return header + sum(
            shared_layer_bytes(n, stream_dtype, stream_master) + owned_layer_bytes(n, t, hold_grad)
            for n, t in zip(numels, trainable)
        )

    def allocate_layer_buffers(
        self, numels: Sequence[int | None], stream_dtype: torch.dtype, stream_master: bool = False
    ) -> list[torch.Tensor | None]:
        """Shared buffers for the layers' stream copies and masters (``None`` numel: none).

        Collective. Layer ``i``'s buffer is what ``LayerStore(shared=...)`` expects.
        """
        from .host_store import shared_layer_bytes  # noqa: PLC0415

        return self.allocate_shared(
            [0 if n is None else shared_layer_bytes(n, stream_dtype, stream_master) for n in numels]
        )

    def owner(self, layer: int) -> int:
        return self.owners[layer]

    def owns(self, layer: int) -> bool:
        return self.owners[layer] == self.rank

    # ---- shared host memory ------------------------------------------------------------------
    def allocate_shared(self, sizes: Sequence[int]) -> list[torch.Tensor | None]:
        """One shared host region holding a page-aligned ``uint8`` buffer per nonzero size.

        Collective: every rank calls it with the same sizes and gets views of the same memory.
        The region starts with the per-layer version array (see the module docstring).
        """
        header = _round_up(max(len(sizes), 1) * 8, PAGE)
        offsets = []
        total = header
        for size in sizes:
            offsets.append(total)
            total += _round_up(size, PAGE)
        mm = _open_shared_region(total, self)
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=total)
        self._regions.append(mm)  # keeps the mapping alive as long as this object
        self._versions = raw[: len(sizes) * 8].view(torch.int64)
        return [raw[off : off + size] if size else None for off, size in zip(offsets, sizes)]

    def publish(self, layer: int, version: int) -> None:
        """Owner: layer ``layer``'s shared weights now hold the result of step ``version``."""
        # A single aligned 8-byte store, after the update's writes (the fused kernel's worker
        # threads have joined): a rank that reads the new version then reads the new weights.
        self._versions[layer] = version

    def wait_published(self, layer: int, version: int) -> None:
        """Block until the owner of ``layer`` has published step ``version`` (or later)."""
        versions = self._versions
        if versions is None or int(versions[layer]) >= version:
            return
        deadline = time.monotonic() + PUBLISH_TIMEOUT_S
        pause = 2e-5
        while int(versions[layer]) < version:
            if time.monotonic() > deadline:
                raise DataParallelError(
                    f"hf_megatrain: rank {self.rank} waited {PUBLISH_TIMEOUT_S:.0f} s for rank "
                    f"{self.owner(layer)} to publish layer {layer}'s update of step {version}; "
                    "that rank probably failed (see its log)."
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    # ---- collectives -------------------------------------------------------------------------
    def barrier(self) -> None:
        if dist.get_backend(self.group) == "nccl":
            # Without device_ids NCCL guesses the device from the rank and warns.
            dist.barrier(group=self.group, device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier(group=self.group)

    def reduce_to_owner(self, flat: torch.Tensor, layer: int, async_op: bool):
        """Sum ``flat`` over the ranks into the owner's copy (others' copies become undefined)."""
        return dist.reduce(
            flat, dst=self.owner(layer), op=dist.ReduceOp.SUM, group=self.group, async_op=async_op
        )

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_reduce_mean_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Average ``tensors`` in place over the ranks (replicated parameters' gradients)."""
        works = [self.all_reduce_sum(t, async_op=True) for t in tensors]
        for w in works:
            w.wait()
        inv = 1.0 / self.world_size
        for t in tensors:
            t.mul_(inv)

    def broadcast_object(self, obj, src: int = 0):
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]


def _count_local_ranks() -> int:
    """Ranks on this host, from their host identities (when the launcher did not say)."""
    ident = _host_identity()
    idents: list = [None] * dist.get_world_size()
    dist.all_gather_object(idents, ident)
    return sum(1 for x in idents if x == ident)


def _host_identity() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{os.uname().nodename}/{boot}"


def _open_shared_region(nbytes: int, dp: DataParallel) -> mmap.mmap:
    """A ``MAP_SHARED`` mapping of ``nbytes`` of the same memory in every rank (collective)."""
    info = None
    fd = -1
    if dp.rank == 0:
        # memfd: anonymous shared memory, limited by RAM (and the cgroup), not by /dev/shm's size.
        fd = os.memfd_create("hf_megatrain_store", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        info = (os.getpid(), fd, _host_identity())
    pid, remote_fd, host = dp.broadcast_object(info)
    error = None
    if dp.rank != 0:
        try:
            if host != _host_identity():
                raise OSError(f"rank 0 runs on another host ({host})")
            fd = os.open(f"/proc/{pid}/fd/{remote_fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            error = f"rank {dp.rank}: {e}"
    # Everyone reports before anyone raises, so no rank is left waiting in a collective.
    errors: list = [None] * dp.world_size
    dist.all_gather_object(errors, error, group=dp.group)
    errors = [e for e in errors if e]
    if errors:
        if fd >= 0:
            os.close(fd)
        raise DataParallelError(
            "hf_megatrain: the data-parallel ranks could not share the host store "
            f"({'; '.join(errors)}). All ranks must run on one host, as the same user, in one "
            "PID namespace (e.g. one container)."
        )
    try:
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        # Rank 0's descriptor must stay open until every rank has opened its own.
        dp.barrier()
        os.close(fd)


__all__ = ["DataParallel", "DataParallelError", "PUBLISH_TIMEOUT_S"]
