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

Several nodes (multi-node data parallel, e.g. ``torchrun --nnodes N`` or ``accelerate launch
--num_machines N``): every node keeps a whole host store, shared by its ranks as above, and the
same layer owners (by *local* rank). A layer's gradient is reduced within the node to its owner
(as above), then all-reduced among the owners of that layer on every node (one process group per
local rank); each node's owner then runs the same AdamW update on its node's copy, so the copies
stay bitwise equal (the all-reduce hands every owner the same sum; the update is deterministic).
Node membership comes from the launcher (``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``),
not from host names, so two launches on one machine behave as two nodes (tests do that); every
node must run the same number of ranks. Why this design and what it costs: docs/design.md
("Multi-node data parallel and its scaling model").

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
    """A data-parallel setup hf_megatrain cannot run (unequal nodes, too many ranks, ...)."""


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def launch_layout_error(
    world_size: int, local_world_size: int, nodes: int | None = None
) -> str | None:
    """Why a launch of ``world_size`` processes, ``local_world_size`` of them on this node,
    cannot run data parallel (``None``: it can). For launchers' early checks (trainer, CLI).
    ``nodes``: how many nodes the launcher started (default: torchrun's ``GROUP_WORLD_SIZE``
    where set): every node then judges the layout alone, so none waits for a refused one."""
    if nodes is None:
        nodes = _int_env("GROUP_WORLD_SIZE")
    if world_size <= 1 or (local_world_size == world_size and nodes in (None, 1)):
        return None
    if (
        local_world_size < 1
        or world_size % local_world_size
        or (nodes is not None and nodes * local_world_size != world_size)
    ):
        on = f" on {nodes} nodes" if nodes else ""
        return (
            f"hf_megatrain: data parallel needs the same number of processes on every node, but "
            f"{world_size} processes were launched{on} with {local_world_size} on this node; "
            "launch as many on each node (--nproc_per_node / --num_processes divisible by "
            "--num_machines)."
        )
    return None


@dataclass
class DataParallel:
    """The process group hf_megatrain runs data parallel over, and who owns which layer.

    Args:
        rank: this process's global rank.
        world_size: number of ranks, all nodes together.
        local_world_size: ranks per node (each node runs as many; they share its host store).
        group: the ``torch.distributed`` group of all ranks (``None``: the default group).
        node: this rank's node (``rank // local_world_size`` unless given).
        local_rank: this rank's index on its node (``rank % local_world_size`` unless given).
        node_ranks: the global ranks of this node, by local rank (contiguous unless given).
        node_group: the group of this node's ranks (``None``: ``group``, a single node).
        cross_group: the group of this local rank on every node, the owners of the same layers
            (``None``: a single node).

    ``owners[i]`` is the *local* rank that owns layer ``i`` on every node (-1: replicated).
    ``bytes_reduced`` counts the payload bytes this rank has put into each kind of gradient
    collective ("node": reductions to a layer's owner within the node, "cross": all-reduces
    among the layer's owners across nodes, "replicated": all-reduces of replicated gradients
    over all ranks).
    """

    rank: int
    world_size: int
    local_world_size: int
    group: dist.ProcessGroup | None = None
    node: int | None = None
    local_rank: int | None = None
    node_ranks: list[int] | None = None
    node_group: dist.ProcessGroup | None = None
    cross_group: dist.ProcessGroup | None = None
    owners: list[int] = field(default_factory=list)
    bytes_reduced: dict[str, int] = field(
        default_factory=lambda: {"node": 0, "cross": 0, "replicated": 0}
    )
    _versions: torch.Tensor | None = field(default=None, repr=False)
    _regions: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        problem = launch_layout_error(self.world_size, self.local_world_size)
        if problem:
            raise DataParallelError(problem)
        n = self.local_world_size
        if self.node is None:
            self.node = self.rank // n
        if self.local_rank is None:
            self.local_rank = self.rank % n
        if self.node_ranks is None:
            self.node_ranks = [self.node * n + r for r in range(n)]

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_environment(cls, device: torch.device | str) -> DataParallel | None:
        """The data-parallel setup of this launch, or ``None`` for a single process.

        Uses the initialized default process group (accelerate / the Trainer create it). When a
        launcher started several processes (``WORLD_SIZE > 1``) but nobody initialized the group
        yet (a model streamed before its ``TrainingArguments`` exist), it is initialized here the
        way accelerate would: NCCL for CUDA devices, gloo for CPU; accelerate then adopts it.
        Nodes are the launcher's (see :func:`launch_layout`); with several, the groups of each
        node's ranks and of each local rank across nodes are created here (collective).
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
        rank, world = dist.get_rank(), dist.get_world_size()
        nodes = launch_layout(world)  # node -> its global ranks, by local rank
        mine = next(n for n, ranks in enumerate(nodes) if rank in ranks)
        node_group = cross_group = None
        if len(nodes) > 1:
            # Every rank creates every group, in the same order (torch.distributed's rule).
            for n, ranks in enumerate(nodes):
                g = dist.new_group(ranks)
                if n == mine:
                    node_group = g
            for r in range(len(nodes[0])):
                g = dist.new_group([ranks[r] for ranks in nodes])
                if r == nodes[mine].index(rank):
                    cross_group = g
        dp = cls(
            rank,
            world,
            len(nodes[0]),
            node=mine,
            local_rank=nodes[mine].index(rank),
            node_ranks=list(nodes[mine]),
            node_group=node_group,
            cross_group=cross_group,
        )
        if len(nodes) > 1 and rank == 0:
            logger.info(
                "hf_megatrain: data parallel over %d nodes x %d processes (a host store per "
                "node; layer gradients reduced within each node, then across nodes)",
                len(nodes),
                len(nodes[0]),
            )
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
        """Give each streamed layer an owner (local rank), balancing the bytes of optimizer state.

        ``None`` marks a replicated layer (HBM tier: every rank keeps and updates its own copy;
        its owner is -1). Greedy in layer order onto the least-loaded rank (lowest rank on
        ties): with equal layers that is round-robin, so the ranks' background updates of
        consecutive layers run side by side and the next forward finds layers ready in order.
        Every node gets the same owners (the same local ranks): its own copy of each layer.
        """
        n = len(layer_numels)
        ranks = self.local_world_size
        if n < ranks:
            raise DataParallelError(
                f"hf_megatrain: {ranks} data-parallel ranks per node but the model has {n} "
                f"decoder layer{'s' if n != 1 else ''}; every rank must be able to own a layer. "
                "Use fewer processes per node."
            )
        load = [0] * ranks
        owners = []
        for numel in layer_numels:
            if numel is None:
                owners.append(-1)
                continue
            r = min(range(ranks), key=lambda k: (load[k], k))
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
        """Host RAM a node's ranks together take for these streamed layers (shared + owned).

        Every rank checks this same total against its host's free memory before anything is
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
        """The local rank that owns ``layer`` (on every node; -1: replicated)."""
        return self.owners[layer]

    def owner_rank(self, layer: int) -> int:
        """The global rank of ``layer``'s owner on this node."""
        return self.node_ranks[self.owners[layer]]

    def owns(self, layer: int) -> bool:
        return self.owners[layer] == self.local_rank

    # ---- shared host memory ------------------------------------------------------------------
    def allocate_shared(self, sizes: Sequence[int]) -> list[torch.Tensor | None]:
        """One shared host region holding a page-aligned ``uint8`` buffer per nonzero size.

        Collective: every rank calls it with the same sizes and gets views of the same memory
        (its node's: each node has its own region).
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

    def is_published(self, layer: int, version: int) -> bool:
        """Whether the owner of ``layer`` has published step ``version`` (or later), now."""
        versions = self._versions
        return versions is None or int(versions[layer]) >= version

    def wait_published(self, layer: int, version: int) -> None:
        """Block until the owner of ``layer`` has published step ``version`` (or later)."""
        if self.is_published(layer, version):
            return
        versions = self._versions
        deadline = time.monotonic() + PUBLISH_TIMEOUT_S
        pause = 2e-5
        while int(versions[layer]) < version:
            if time.monotonic() > deadline:
                raise DataParallelError(
                    f"hf_megatrain: rank {self.rank} waited {PUBLISH_TIMEOUT_S:.0f} s for rank "
                    f"{self.owner_rank(layer)} to publish layer {layer}'s update of step {version}; "
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
        """Sum ``flat`` over the node's ranks into the owner's copy (others' become undefined).

        With several nodes the owner then calls :meth:`all_reduce_across_nodes` on it.
        """
        self.bytes_reduced["node"] += flat.numel() * flat.element_size()
        group = self.node_group if self.node_group is not None else self.group
        return dist.reduce(
            flat, dst=self.owner_rank(layer), op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )

    def all_reduce_across_nodes(self, flat: torch.Tensor, async_op: bool = False):
        """Owner: sum a layer's node-reduced gradient with the other nodes' owners of the layer.

        Every owner gets the same sum (so the nodes' copies stay equal). ``None`` (nothing to
        wait for) on a single node.
        """
        if self.cross_group is None:
            return None
        self.bytes_reduced["cross"] += flat.numel() * flat.element_size()
        return dist.all_reduce(
            flat, op=dist.ReduceOp.SUM, group=self.cross_group, async_op=async_op
        )

    def sum_over_owners_(self, tensor: torch.Tensor) -> None:
        """Sum, over all ranks, a value each rank computed over the layers it owns (in place).

        Every node's owners hold the same reduced gradients: only node 0's count, so each layer
        is counted once and every rank gets the same total.
        """
        if self.node != 0:
            tensor.zero_()
        self.all_reduce_sum(tensor)

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_reduce_mean_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Average ``tensors`` in place over all ranks (replicated parameters' gradients)."""
        self.bytes_reduced["replicated"] += sum(t.numel() * t.element_size() for t in tensors)
        works = [self.all_reduce_sum(t, async_op=True) for t in tensors]
        for w in works:
            w.wait()
        inv = 1.0 / self.world_size
        for t in tensors:
            t.mul_(inv)

    def broadcast_object(self, obj, src: int = 0, group: dist.ProcessGroup | None = None):
        """``obj`` of global rank ``src`` on every rank of ``group`` (default: all ranks)."""
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group if group is not None else self.group)
        return box[0]


def process_group_size() -> int:
    """Processes in the initialized default process group (1 where there is none)."""
    import torch.distributed as dist  # noqa: PLC0415

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _int_env(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.strip().lstrip("-").isdigit() else None


def launch_layout(world: int) -> list[list[int]]:
    """The launch's nodes, each as its global ranks by local rank (collective).

    Membership comes from the launcher: ``GROUP_RANK`` (torchrun's node rank; ``accelerate
    launch`` runs torchrun and sets it too) with ``LOCAL_RANK``, else ``LOCAL_WORLD_SIZE``
    (contiguous ranks per node), else the hosts' identities. So two torchrun launches with
    ``--nnodes 2`` on one machine are two nodes, each with its own shared host store. Nodes are
    ordered by their lowest global rank (node 0 holds rank 0). Every rank gathers every rank's
    view and decides alike: an unusable layout fails on all of them, none is left waiting.
    """
    mine = (_int_env("GROUP_RANK"), _int_env("LOCAL_RANK"), _int_env("LOCAL_WORLD_SIZE"))
    views: list = [None] * world
    dist.all_gather_object(views, (*mine, _host_identity()))
    if all(v[0] is not None and v[1] is not None for v in views):
        how = "GROUP_RANK and LOCAL_RANK"
        keys = [(v[0], v[1]) for v in views]
    elif all(v[2] for v in views) and len({v[2] for v in views}) == 1 and world % views[0][2] == 0:
        how = "LOCAL_WORLD_SIZE"
        n = views[0][2]
        keys = [(r // n, r % n) for r in range(world)]
    else:
        how = "the hosts' identities"
        hosts = list(dict.fromkeys(v[3] for v in views))
        count: dict[int, int] = {}
        keys = []
        for v in views:
            node = hosts.index(v[3])
            keys.append((node, count.get(node, 0)))
            count[node] = count.get(node, 0) + 1
    by_node: dict[int, dict[int, int]] = {}
    for r, (node, local) in enumerate(keys):
        by_node.setdefault(node, {})[local] = r
    sizes = {node: len(ranks) for node, ranks in sorted(by_node.items())}
    equal = len(set(sizes.values())) == 1
    numbered = all(sorted(ranks) == list(range(len(ranks))) for ranks in by_node.values())
    if len(set(keys)) != world or not equal or not numbered:
        raise DataParallelError(
            "hf_megatrain: data parallel needs the same number of processes on every node, with "
            f"local ranks 0..n-1 on each; this launch has {world} processes, per node (from "
            f"{how}) {sizes}. Launch as many on each node (torchrun --nproc_per_node, accelerate "
            "--num_processes divisible by --num_machines)."
        )
    nodes = [[ranks[i] for i in range(len(ranks))] for ranks in by_node.values()]
    return sorted(nodes, key=min)


def _host_identity() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{os.uname().nodename}/{boot}"


def _open_shared_region(nbytes: int, dp: DataParallel) -> mmap.mmap:
    """A ``MAP_SHARED`` mapping of ``nbytes`` of the same memory in every rank of a node
    (collective over all ranks; each node's local rank 0 creates its node's region)."""
    info = None
    fd = -1
    leader = dp.node_ranks[0]
    if dp.rank == leader:
        # memfd: anonymous shared memory, limited by RAM (and the cgroup), not by /dev/shm's size.
        fd = os.memfd_create("hf_megatrain_store", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        info = (os.getpid(), fd, _host_identity())
    pid, remote_fd, host = dp.broadcast_object(info, src=leader, group=dp.node_group)
    error = None
    if dp.rank != leader:
        try:
            if host != _host_identity():
                raise OSError(
                    f"rank {leader}, local rank 0 of its node, runs on another host ({host})"
                )
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
            f"({'; '.join(errors)}). The ranks of one node (as the launcher numbers them: "
            "GROUP_RANK / LOCAL_RANK) must run on one host, as the same user, in one PID "
            "namespace (e.g. one container)."
        )
    try:
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        # The leaders' descriptors must stay open until every rank has opened its own.
        dp.barrier()
        os.close(fd)


__all__ = [
    "DataParallel",
    "DataParallelError",
    "PUBLISH_TIMEOUT_S",
    "launch_layout",
    "launch_layout_error",
    "process_group_size",
]
