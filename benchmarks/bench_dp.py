#!/usr/bin/env python3
"""Data-parallel hf_megatrain throughput: one process per GPU, one host or several, a row in
results.csv.

The run is ``bench.py``'s megatrain run (same model build, random tokens, arguments, step timer
and measurements: ``bench.train_once``), launched with ``torchrun --nproc_per_node N``. Each rank
trains ``--tokens-per-gpu`` tokens per optimizer step, so the global step is N times that; the
row records the global tokens per step and tokens/s of the whole job, the MFU per GPU, rank 0's
peak HBM, and the host's peak RAM of all ranks together (the sum of each rank's sampled peak
proportional set size: shared host-store pages once). Its ``system`` is ``megatrain-dpN`` (``megatrain-hbm-dpN`` with the HBM
tier). Compare with a single-GPU ``bench.py`` row at ``--tokens-per-step`` = ``--tokens-per-gpu``
(same work per GPU) or = N x it (same global batch).

Example (7B-class, 64k tokens per step per GPU, 2 GPUs)::

    python3 benchmarks/bench_dp.py --nproc 2 --model qwen2.5-7b --seq-len 4096 \\
        --tokens-per-gpu 65536 --micro-batch 4 --streamed-init --steps 5 --warmup 2

Several nodes: the same command on every node, with ``--nnodes N --node-rank K --master-addr
HOST0 --master-port PORT`` (static rendezvous: node 0 holds rank 0, which writes the row there;
the other nodes only run their ranks). The row's ``system`` is then ``megatrain-dpNxG`` and its
``peak_host_gib`` the largest node's host peak (its ranks' summed Pss); its ``note`` gives the
gradient bytes each rank reduced per step within its node and across nodes
(docs/design.md, "Multi-node data parallel and its scaling model"). Two nodes on one machine
(e.g. ``--cpu`` with ``--master-addr 127.0.0.1``) run as two nodes: membership comes from the
launcher, not from host names.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench  # noqa: E402  (bench.py beside this file)


def to_run_config(a: argparse.Namespace) -> bench.RunConfig:
    """The per-rank run (what bench.py would run on one GPU)."""
    return bench.RunConfig(
        system=a.system,
        model=a.model,
        seq_len=a.seq_len,
        tokens_per_step=a.tokens_per_gpu,
        micro_batch=a.micro_batch,
        steps=a.steps,
        warmup=a.warmup,
        seed=a.seed,
        device="cuda" if not a.cpu else "cpu",
        timeout_s=a.timeout_s,
        learning_rate=a.lr,
        **bench.megatrain_options(a, a.system),
    )


def _pss_bytes() -> int:
    """This process's proportional set size: private pages plus its share of shared ones."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


class PssPeak:
    """Peak proportional set size of this process, sampled on a thread.

    Each shared page counts 1/N in each of the N ranks that map it, so the ranks' Pss add up to
    the host memory of the job with shared pages once, whichever rank allocated them (the
    per-layer moments of a rank's owned layers live in shared memory too, so "RSS minus shared
    RSS" per rank would drop them). Summing each rank's peak bounds the job's peak from above.

    Reading ``smaps_rollup`` walks the page tables of the whole mapping (hundreds of GiB of host
    store) under the process's memory-map lock: the 23.5B run that sampled every 0.5 s was 14%
    slower than the same run without sampling (dphost-0640 vs dp-0636; not isolated further).
    The host peak is the store, allocated at start and held, so a sample every few seconds sees
    it.
    """

    def __init__(self, every_s: float = 5.0) -> None:
        import threading

        self.peak = _pss_bytes()
        self._stop = threading.Event()
        self._every = every_s
        self._thread = threading.Thread(target=self._run, name="pss-peak", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self.peak = max(self.peak, _pss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _pss_bytes())
        return self.peak


def _capture_data_parallel() -> list:
    """The engine's ``DataParallel`` objects, as they are made (for their reduced-byte counts)."""
    from hf_megatrain.core.distributed import DataParallel

    made: list = []
    original = DataParallel.from_environment

    def capture(device):
        dp = original(device)
        made.append(dp)
        return dp

    DataParallel.from_environment = capture
    return made


def run_worker(a: argparse.Namespace) -> int:
    """One rank (under torchrun): train, then rank 0 writes the job's result."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not a.cpu:
        torch.cuda.set_device(local_rank)  # before anything touches a GPU
    cfg = to_run_config(a)
    made = _capture_data_parallel()
    pss = PssPeak()
    try:
        result = bench.train_once(cfg)
        code = 0
    except BaseException as exc:  # noqa: BLE001  (a failure is a row, never a crash)
        import traceback

        traceback.print_exc()
        result = {"status": bench.failure_status(exc)}
        code = 1
    if code == 0:
        world = dist.get_world_size()
        # train_once measured this rank's tokens; every rank processes as many.
        for key in ("tokens_per_s", "model_tflops"):
            result[key] *= world
        result["world_size"] = world
        dp = made[-1] if made else None
        node = 0 if dp is None else dp.node
        peaks = [None] * world
        dist.all_gather_object(peaks, (node, pss.stop()))
        per_node: dict[int, int] = {}
        for n, peak in peaks:
            per_node[n] = per_node.get(n, 0) + peak
        # The largest node's host peak (one node: the host's, as before).
        result["peak_host_gib"] = max(per_node.values()) / bench.GIB
        result["nodes"] = len(per_node)
        if dp is not None:
            steps = a.warmup + a.steps
            result["reduced_bytes_per_step"] = {k: v // steps for k, v in dp.bytes_reduced.items()}
    result.update(bench.versions())
    result.setdefault("peak_host_gib", bench.peak_host_gib())
    try:
        result["peak_hbm_gib"] = bench.peak_hbm_gib()
    except Exception:  # noqa: BLE001  (a broken CUDA context after a failure)
        result["peak_hbm_gib"] = None
    if int(os.environ.get("RANK", "0")) == 0:
        Path(a.result_json).write_text(json.dumps(result))
    print(f"bench_dp rank {os.environ.get('RANK')}: {result['status']}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # As bench.py's worker: skip interpreter teardown (process-group / CUDA teardown can hang
    # after the result is written).
    os._exit(code)


#: The launcher's options, which the workers do not take.
_LAUNCH_OPTIONS = ("--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port")


def _worker_argv(argv: list[str]) -> list[str]:
    """The workers' arguments: ours minus the launcher's (``--nproc``, ``--nnodes``, ...).

    torchrun's argparse classifies every argument, the script's too, and rejects ``--nproc`` as
    an ambiguous abbreviation of its own ``--nproc-per-node``/``--nproc_per_node`` (found on the
    2-GPU machine); the workers do not need these anyway.
    """
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _LAUNCH_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in _LAUNCH_OPTIONS)):
            out.append(arg)
    return out


def torchrun_command(a: argparse.Namespace, argv: list[str], result_json: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if a.nnodes == 1:
        cmd += ["--standalone"]
    else:
        # Static rendezvous: --node_rank is kept, so node 0 holds rank 0 (which writes the row).
        cmd += ["--nnodes", str(a.nnodes), "--node_rank", str(a.node_rank)]
        cmd += ["--master_addr", a.master_addr, "--master_port", str(a.master_port)]
    cmd += ["--nproc_per_node", str(a.nproc), str(BENCH_DIR / "bench_dp.py")]
    return cmd + _worker_argv(argv) + ["--worker", "--result-json", str(result_json)]


def _launch(a: argparse.Namespace, argv: list[str], log_file) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        result_json = Path(tmp) / "result.json"
        cmd = torchrun_command(a, argv, result_json)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(bench.REPO_ROOT), env.get("PYTHONPATH")])
        )
        log_file.write(f"\n===== {shlex.join(cmd)}\n")
        log_file.flush()
        start = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=str(bench.REPO_ROOT),
        )
        rc, timed_out = bench.wait_or_kill(proc, a.timeout_s)
        bench.kill_session(proc.pid)  # no rank may outlive the run
        if result_json.is_file():
            result = json.loads(result_json.read_text())
        elif a.node_rank != 0 and rc == 0 and not timed_out:
            result = {"status": "ok"}  # rank 0, on node 0, writes the job's result there
        else:
            tail = Path(log_file.name).read_text().splitlines()[-40:]
            result = {"status": bench.status_from_exit(rc, timed_out, a.timeout_s, tail)}
        result["wall_s"] = time.perf_counter() - start
        return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs) on this host")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (run this command on each)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (0: writes the row)")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (--nnodes > 1)")
    p.add_argument("--master-port", type=int, default=29500, help="node 0's port (--nnodes > 1)")
    p.add_argument("--system", choices=("megatrain", "megatrain-hbm"), default="megatrain")
    p.add_argument("--model", required=True, help="config name under benchmarks/configs/")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--tokens-per-gpu", type=int, default=65536, help="per optimizer step")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--timeout-s", type=float, default=900.0)
    bench.add_megatrain_options(p)
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (a smoke test of the script)")
    p.add_argument("--tag", default="dp")
    p.add_argument("--results-dir", type=Path, default=bench.RESULTS_DIR)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-json", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    if a.worker:
        return run_worker(a)
    cfg = to_run_config(a)  # validates the split before anything starts
    a.results_dir.mkdir(parents=True, exist_ok=True)
    log_path = bench.unique_path(a.results_dir, f"{dt.date.today()}-{a.tag}", ".log")
    with log_path.open("w") as log_file:
        result = _launch(a, argv, log_file)
    if a.node_rank != 0:
        # Rank 0 (node 0) measured the job and writes its row there.
        print(f"bench_dp: node {a.node_rank} done ({result['status']}); log {log_path}")
        return 0 if result["status"] == "ok" else 1
    sweep = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": bench.git_commit(),
        "gpu": bench.gpu_name_from_smi(),
        "versions": bench.versions(),
        "src_sha": bench.source_sha(),
        "tag": a.tag,
    }
    row = bench.make_row(cfg, result, sweep)
    row["system"] = f"{a.system}-dp{a.nproc}"
    if a.nnodes > 1:
        row["system"] = f"{a.system}-dp{a.nnodes}x{a.nproc}"
    row["tokens_per_step"] = a.tokens_per_gpu * a.nproc * a.nnodes
    reduced = result.get("reduced_bytes_per_step")
    if reduced:
        row["note"] = (
            f"{result.get('nodes', 1)} node(s); gradient bytes per step and rank: "
            f"{reduced['node']} in the node, {reduced['cross']} across nodes, "
            f"{reduced['replicated']} replicated"
        )
    row["command"] = shlex.join(["python3", "benchmarks/bench_dp.py", *argv])
    bench.append_csv(a.results_dir / "results.csv", [row])
    print(
        json.dumps(
            {
                k: row[k]
                for k in (
                    "system",
                    "model",
                    "tokens_per_step",
                    "tokens_per_s",
                    "mfu",
                    "peak_hbm_gib",
                    "peak_host_gib",
                    "status",
                )
            }
        )
    )
    if result.get("step_times"):
        # Every step's time, so a first step that waited for something (e.g. the host AdamW's
        # first write of fresh moment pages) shows beside the steady ones.
        times = ", ".join(f"{t:.3f}" for t in result["step_times"])
        print(f"bench_dp: step times (s, first {a.warmup} warm-up): {times}")
    print(f"bench_dp: log {log_path}")
    return 0 if result.get("status") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
