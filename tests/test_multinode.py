"""Multi-node data parallel on CPU (gloo): 2 nodes x 2 processes equal 1 process.

One machine plays two nodes. Node membership comes from the launcher, not from host names
(``core/distributed.py: launch_layout``), so two torchrun launches on one machine, each
``--nnodes 2 --node_rank K --nproc_per_node 2`` against one rendezvous, are two nodes: each
gets ``GROUP_RANK=K``, its ranks ``LOCAL_RANK`` 0..1, and each node's local rank 0 creates its
own shared host store. By hand::

    for K in 0 1; do
      torchrun --nnodes 2 --node_rank $K --nproc_per_node 2 --rdzv_backend c10d \\
          --rdzv_endpoint 127.0.0.1:29500 --rdzv_id demo tests/dp_worker.py --out /tmp/mn &
    done; wait

(or static rendezvous: ``--master_addr 127.0.0.1 --master_port 29500`` instead of the three
``--rdzv_*`` flags). ``accelerate launch --num_machines 2 --machine_rank K --main_process_ip
127.0.0.1 --main_process_port 29500 --num_processes 4`` starts the same torchrun workers; what
they read is plain environment (``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

A process costs ~9 s of imports on these 2 cores, so the module starts 5 (1 + 2x2) once, side
by side: each trains from scratch (4 steps, checkpoint at step 2), then, in the same process,
resumes from the other launch's step-2 checkpoint (1 process from the 2x2 one, 2x2 from the
single process's). The single process uses the per-rank batch x 4 and the same gradient
accumulation: with accelerate's sharding (rank r takes every world-th per-device batch of the
same permutation), every run sees the same rows in every step.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_megatrain.core import distributed
from hf_megatrain.core.distributed import DataParallel, DataParallelError, launch_layout_error
from hf_megatrain.hf.checkpoint import save_optimizer_state

from .helpers import assert_close_weights as _assert_close_weights
from .helpers import assert_same_training_logs as _assert_same_logs
from .helpers import saved_weights as _weights
from .helpers import tiny_config, tiny_model

WORKER = Path(__file__).with_name("dp_worker.py")
ROOT = WORKER.parent.parent
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
#: Global batch per micro-batch: 1 row per rank x 4 ranks, or 4 rows in one process.
COMMON = ("--grad-accum", "2", "--steps", "4")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(out: Path, multinode: bool, *extra: str) -> list:
    """Start one training: 1 process, or 2 "nodes" of 2 (two torchrun launches, c10d
    rendezvous). Returns the Popen objects with their logs."""
    out.mkdir(parents=True, exist_ok=True)
    batch = 1 if multinode else WORLD
    args = [str(WORKER), "--out", str(out), "--per-device-batch", str(batch), *COMMON, *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not multinode:
        cmds = [[sys.executable, *args]]
    else:
        meet = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{_free_port()}"]
        meet += ["--rdzv_id", f"mn-{out.name}"]
        cmds = [
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES)]
            + ["--node_rank", str(k), "--nproc_per_node", str(PER_NODE), *meet, *args]
            for k in range(NODES)
        ]
    procs = []
    for i, cmd in enumerate(cmds):
        log = open(out / f"launch{i}.log", "w")  # noqa: SIM115 - closed in _finish
        popen = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        procs.append((out, i, popen, log))
    return procs


def _finish(procs: list, timeout: float = 400) -> None:
    """Wait for every launch; on a failure or the timeout, kill the others' process groups (a
    run waiting for a failed run's checkpoint would otherwise wait for it)."""
    deadline = time.monotonic() + timeout
    running = list(procs)
    failed = []
    while running and not failed and time.monotonic() < deadline:
        time.sleep(0.2)
        for item in list(running):
            out, i, proc, _ = item
            if proc.poll() is not None:
                running.remove(item)
                if proc.returncode != 0:
                    failed.append(f"{out.name} launch {i}: rc {proc.returncode}")
    for out, i, proc, _ in running:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: torchrun's workers too
        proc.wait()
        if not failed:
            failed.append(f"{out.name} launch {i}: timeout after {timeout:.0f} s")
    for *_, log in procs:
        log.close()
    logs = "\n".join(
        f"--- {out.name} launch {i}:\n" + (out / f"launch{i}.log").read_text()[-4000:]
        for out, i, proc, _ in procs
        if proc.returncode != 0
    )
    assert not failed, "; ".join(failed) + "\n" + logs


def _reports(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _assert_nodes_agree(reports: list[dict]) -> None:
    """Every rank of every node logged the same values and sees bitwise the same weights (its
    node's host store and its own replicated parameters)."""
    assert [(r["node"], r["local_rank"]) for r in reports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({r["weights_digest"] for r in reports}) == 1
    for r in reports[1:]:
        _assert_same_logs(reports[0]["logs"], r["logs"], rel=0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """1 process and 2x2 from scratch; then each resumed at step 2 from the other's checkpoint."""
    root = tmp_path_factory.mktemp("multinode")
    ckpt = {name: str(root / name / "run" / "checkpoint-2") for name in ("single", "multi")}
    then = {
        "single": ("--then-resume", ckpt["multi"], str(root / "s_from_m")),
        "multi": ("--then-resume", ckpt["single"], str(root / "m_from_s")),
    }
    procs = []
    for name in ("single", "multi"):
        procs += _start(root / name, name == "multi", "--save-steps", "2", *then[name])
    _finish(procs)
    return (
        root,
        _reports(root / "single", 1),
        _reports(root / "multi", WORLD),
        _reports(root / "s_from_m", 1),
        _reports(root / "m_from_s", WORLD),
    )


def test_two_nodes_equal_single_process(runs):
    root, single, multi, _, _ = runs
    assert all(r["world_size"] == WORLD and r["num_nodes"] == NODES for r in multi)
    # Owners are local ranks, the same on both nodes: each node holds a whole copy.
    assert all(r["owners"] == [0, 1, 0, 1] for r in multi)
    assert len(single[0]["logs"]) == 4
    _assert_same_logs(single[0]["logs"], multi[0]["logs"])
    _assert_nodes_agree(multi)
    # The final model (written by rank 0 from node 0's store) is the single process's.
    _assert_close_weights(_weights(root / "single" / "final"), _weights(root / "multi" / "final"))
    # Each node holds one store: a rank's private part is its owned layers' grad + moments,
    # as on one host with 2 processes (half the single process's private store, by layers).
    per_layer = single[0]["private_bytes"] // 4  # fp32: grad, master, 2 moments
    assert all(r["private_bytes"] == 2 * 3 * per_layer // 4 for r in multi)
    assert all(r["moment_bytes"] == single[0]["moment_bytes"] // 2 for r in multi)


def test_reduce_bytes_per_step(runs):
    """What each rank puts into the gradient collectives per optimizer step (payload bytes)."""
    _, single, multi, _, _ = runs
    steps = len(multi[0]["logs"])
    # One layer's fp32 gradient (4 layers), and the flags of its parameters that got one (a
    # float each, after the gradient: a parameter no rank gave one is skipped, as under DDP).
    layer_grad = single[0]["moment_bytes"] // 2 // 4
    layer_grad += 4 * len(list(tiny_model(tiny_config("llama")).model.layers[0].parameters()))
    for r in multi:
        b = {k: v // steps for k, v in r["bytes_reduced"].items()}
        # Within the node: every layer's gradient, once per step (reduce to its owner).
        assert b["node"] == 4 * layer_grad
        # Across nodes: only the owner's layers (2 of 4): each node sends one model gradient.
        assert b["cross"] == 2 * layer_grad
        assert b["replicated"] > 0  # embeddings, final norm, LM head: all-reduced over all 4
    print(
        f"\nper optimizer step and rank: {multi[0]['bytes_reduced']['node'] // steps} B "
        f"reduced in the node, {multi[0]['bytes_reduced']['cross'] // steps} B across nodes, "
        f"{multi[0]['bytes_reduced']['replicated'] // steps} B replicated"
    )


def test_checkpoint_written_once_and_equal_to_single(runs):
    root, *_ = runs
    ck_multi = root / "multi" / "run" / "checkpoint-2"
    ck_single = root / "single" / "run" / "checkpoint-2"
    _assert_close_weights(_weights(ck_single), _weights(ck_multi))
    opt_m, opt_s = ck_multi / "megatrain_optimizer", ck_single / "megatrain_optimizer"
    names = sorted(p.name for p in opt_s.glob("*.safetensors"))
    assert names == sorted(p.name for p in opt_m.glob("*.safetensors"))
    for name in names:
        a, b = load_file(str(opt_s / name)), load_file(str(opt_m / name))
        assert sorted(a) == sorted(b)
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6, msg=f"{name}:{key}")
    # One RNG state per rank (the Trainer's per-process files), nothing else per node.
    assert sorted(p.name for p in ck_multi.glob("rng_state_*")) == [
        f"rng_state_{r}.pth" for r in range(WORLD)
    ]


def test_resume_across_process_counts(runs):
    """2x2 checkpoint -> 1 process, and 1-process checkpoint -> 2x2: each continues as the
    uninterrupted run (steps 3-4 logged alike, same final weights)."""
    root, single, multi, s_from_m, m_from_s = runs
    assert len(s_from_m[0]["logs"]) == len(m_from_s[0]["logs"]) == 2
    for resumed in (s_from_m, m_from_s):
        _assert_same_logs(single[0]["logs"][2:], resumed[0]["logs"])
        _assert_same_logs(multi[0]["logs"][2:], resumed[0]["logs"])
    _assert_nodes_agree(m_from_s)
    final = _weights(root / "single" / "final")
    _assert_close_weights(final, _weights(root / "s_from_m" / "final"))
    _assert_close_weights(final, _weights(root / "m_from_s" / "final"))


# ---- no processes: layout rules ----------------------------------------------------------------
def test_launch_layout_errors_and_owners(monkeypatch):
    assert launch_layout_error(4, 2) is None and launch_layout_error(4, 4) is None
    assert launch_layout_error(1, 1) is None
    # Found by an audit: 1 + 2 processes on 2 nodes; the node of 1 passed (3 % 1 == 0) and
    # waited in the process group's set-up for the refused one (30 minutes). With the node
    # count torchrun gives every node, each refuses on its own.
    for local in (1, 2):
        assert "3 processes were launched on 2 nodes" in launch_layout_error(3, local, nodes=2)
    assert launch_layout_error(4, 2, nodes=2) is None
    assert launch_layout_error(2, 2, nodes=1) is None
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert launch_layout_error(3, 1) is not None and launch_layout_error(4, 2) is None
    monkeypatch.delenv("GROUP_WORLD_SIZE")
    with pytest.raises(DataParallelError, match="same number of processes on every node"):
        DataParallel(rank=0, world_size=3, local_world_size=2)
    dp = DataParallel(rank=3, world_size=4, local_world_size=2)
    assert (dp.node, dp.local_rank, dp.node_ranks, dp.num_nodes) == (1, 1, [2, 3], 2)
    dp.assign_owners([10, 10, 10])  # 2 ranks per node: 3 layers are enough
    assert dp.owners == [0, 1, 0] and dp.owns(1) and dp.owner_rank(1) == 3
    with pytest.raises(DataParallelError, match="every rank must be able to own a layer"):
        DataParallel(rank=0, world_size=8, local_world_size=4).assign_owners([10, 10, 10])


def _layout(monkeypatch, views: list[tuple]) -> list[list[int]]:
    """``launch_layout`` as every rank would compute it from these gathered views."""

    def gather(out, _obj, group=None):
        out[:] = views

    monkeypatch.setattr(distributed.dist, "all_gather_object", gather)
    return distributed.launch_layout(len(views))


def test_launch_layout_from_the_launcher(monkeypatch):
    host = "machine/boot"
    # GROUP_RANK / LOCAL_RANK win over host names (one machine, two nodes), ranks in any order;
    # nodes are ordered by their lowest rank.
    views = [(1, 0, 2, host), (0, 0, 2, host), (1, 1, 2, host), (0, 1, 2, host)]
    assert _layout(monkeypatch, views) == [[0, 2], [1, 3]]
    # Only LOCAL_WORLD_SIZE: contiguous ranks per node.
    views = [(None, None, 2, host)] * 4
    assert _layout(monkeypatch, views) == [[0, 1], [2, 3]]
    # Nothing from the launcher: the hosts' identities.
    views = [(None, None, None, h) for h in ("a", "b", "a", "b")]
    assert _layout(monkeypatch, views) == [[0, 2], [1, 3]]
    # Unequal nodes are refused on every rank alike.
    views = [(0, 0, 3, host), (0, 1, 3, host), (0, 2, 3, host), (1, 0, 1, host)]
    with pytest.raises(DataParallelError, match=r"per node \(from GROUP_RANK and LOCAL_RANK\)"):
        _layout(monkeypatch, views)


def test_optimizer_state_written_by_node_zero_only(tmp_path):
    """Nodes other than 0 hold the same moments as node 0 and write nothing."""
    waited = []
    dp = DataParallel(rank=2, world_size=4, local_world_size=2)
    optimizer = types.SimpleNamespace(
        wait=lambda: waited.append(True), engine=types.SimpleNamespace(dp=dp)
    )
    save_optimizer_state(optimizer, str(tmp_path))
    assert waited and not any(tmp_path.iterdir())
