"""What the host AdamW update costs on this machine, per way of running it.

The streamed layers' CPU update must finish layer by layer ahead of the next forward; where it
does not, the GPU waits (the 8B's and 14B's forward gaps at 64k tokens/step). This times the
update's memory-bound loop on one layer-sized store (fp32 master and moments, a bf16 gradient
slot, a bf16 stream copy), the way ``core/optimizer.py`` runs it, over:

* the store's pages: 4 KiB in a shared anonymous mapping (``mmap.mmap(-1, n)``'s default, as the
  library maps its stores: shmem, which gets no transparent huge pages where ``shmem_enabled``
  is ``never``, as on the GPU machine), or a private anonymous mapping with transparent huge
  pages asked for (``MADV_HUGEPAGE``; ``thp``). On the 2-core CPU machine (2026-12-07, 134M
  parameters): the same update rate (0.42 against 0.45 G/s) and a slower first touch (3.4 s
  against 2.0 s to write three buffers, 2.0 against 0.7 s for the first update): not adopted
  without a GPU machine's measurement;
* the chunk the bf16 gradient is widened in (elements per fused AdamW call);
* the stream copy re-derived after the whole layer, or per chunk while the chunk is in cache;
* intra-op threads;
* the fused kernel called directly (the library's way) or through torch's functional AdamW.

Also the first update over fresh moments (page faults on first touch), and after faulting them
in ahead with ``MADV_POPULATE_WRITE``. Prints one line per
variant and writes them as JSON (``--json``)::

    python3 dev/host_update_probe.py --numel 268435456 --json $OUT/host_update_probe.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.optim.adam import adam

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # (Linux; Python 3.13 names it)

HYPER = dict(
    amsgrad=False, beta1=0.9, beta2=0.95, lr=1e-4, weight_decay=0.1, eps=1e-8, maximize=False,
    capturable=False, differentiable=False, decoupled_weight_decay=True,
)  # fmt: skip


def read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "n/a"


class Store:
    """One layer's host state in one anonymous mapping, as ``LayerStore`` lays it out."""

    def __init__(self, numel: int, huge: bool) -> None:
        self.numel = numel
        nbytes = numel * (2 + 2 + 4 + 4 + 4)  # stream copy, bf16 grad, master, 2 moments
        if huge:  # (a shared mapping is shmem: its huge pages follow shmem_enabled instead)
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            self.region = mmap.mmap(-1, nbytes, flags=flags)
            self.region.madvise(mmap.MADV_HUGEPAGE)
        else:
            self.region = mmap.mmap(-1, nbytes)
        raw = torch.frombuffer(self.region, dtype=torch.uint8, count=nbytes)
        off = 0

        def take(dtype: torch.dtype) -> torch.Tensor:
            nonlocal off
            t = raw[off : off + numel * dtype.itemsize].view(dtype)
            off += numel * dtype.itemsize
            return t

        self.stream, self.grad = take(torch.bfloat16), take(torch.bfloat16)
        self.master, self.exp_avg, self.exp_avg_sq = (take(torch.float32) for _ in range(3))
        # The master and the slots are written before any update (the load, the backward); the
        # moments stay untouched until the first update, as in training.
        self.master.normal_()
        self.stream.copy_(self.master)
        self.grad.normal_()
        self.step = torch.zeros(())
        self.moments_at = numel * (2 + 2 + 4)  # byte offset of exp_avg

    def populate_moments(self) -> float:
        """Fault the moments' pages in ahead of the first update, content kept
        (``MADV_POPULATE_WRITE``, Linux >= 5.14); seconds taken, NaN where unsupported."""
        start = -(-self.moments_at // mmap.PAGESIZE) * mmap.PAGESIZE
        t = time.perf_counter()
        try:
            self.region.madvise(MADV_POPULATE_WRITE, start, len(self.region) - start)
        except OSError:
            return float("nan")
        return time.perf_counter() - t

    def update(
        self, chunk: int, fused_refresh: bool, buf: torch.Tensor, direct: bool = True
    ) -> None:
        """``direct``: the fused kernel called per chunk with the step advanced once (as
        ``core/optimizer.py`` does); else torch's functional AdamW per chunk, the step count
        reset before each call."""
        before = self.step.clone()
        if direct:
            self.step.add_(1)
        for a in range(0, self.numel, chunk):
            b = min(a + chunk, self.numel)
            wide = buf[: b - a]
            wide.copy_(self.grad[a:b])
            state = [self.master[a:b]], [wide], [self.exp_avg[a:b]], [self.exp_avg_sq[a:b]]
            if direct:
                torch._fused_adamw_(
                    *state, [], [self.step], lr=HYPER["lr"], beta1=HYPER["beta1"],
                    beta2=HYPER["beta2"], weight_decay=HYPER["weight_decay"], eps=HYPER["eps"],
                    amsgrad=False, maximize=False,
                )  # fmt: skip
            else:
                self.step.copy_(before)
                adam(*state, [], [self.step], fused=True, grad_scale=None, found_inf=None, **HYPER)
            if fused_refresh:
                self.stream[a:b].copy_(self.master[a:b])
        if not fused_refresh:
            self.stream.copy_(self.master)


def timed(reps: int, fn, *args) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 28, help="parameters of the layer store")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n_threads = torch.get_num_threads()
    info = {
        "cpus": os.cpu_count(),
        "torch_threads": n_threads,
        "cpu": platform.processor() or read("/proc/cpuinfo").split("model name")[-1][:60],
        "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
        "thp_shmem": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "numel": args.numel,
    }
    print(json.dumps(info), flush=True)
    rows = []

    def record(**row) -> None:
        row["gparam_per_s"] = round(args.numel / row["median_s"] / 1e9, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)

    for huge in (False, True):
        t = time.perf_counter()
        store = Store(args.numel, huge)  # (the master, stream copy and gradient written)
        record(pages="thp" if huge else "4k", what="allocate and write 3 of 5 buffers",
               median_s=time.perf_counter() - t)  # fmt: skip
        buf = torch.empty(1 << 23)
        t = time.perf_counter()
        store.update(1 << 21, True, buf)  # the first update: the moments' pages fault in
        first = time.perf_counter() - t
        record(pages="thp" if huge else "4k", what="first update", median_s=first)
        smaps = read("/proc/meminfo")
        anon_huge = next((ln for ln in smaps.splitlines() if ln.startswith("AnonHugePages")), "")
        print(f"  {anon_huge}", flush=True)
        for chunk in (1 << 20, 1 << 21, 1 << 22, 1 << 23):
            for fused in (False, True):
                times = timed(args.reps, store.update, chunk, fused, buf)
                record(
                    pages="thp" if huge else "4k", what="update", chunk=chunk,
                    refresh="per chunk" if fused else "after", threads=n_threads,
                    median_s=statistics.median(times),
                )  # fmt: skip
        times = timed(args.reps, store.update, 1 << 21, True, buf, False)
        record(
            pages="thp" if huge else "4k", what="update, functional AdamW per chunk",
            chunk=1 << 21, refresh="per chunk", threads=n_threads,
            median_s=statistics.median(times),
        )  # fmt: skip
        for threads in (n_threads - 1, n_threads // 2):
            torch.set_num_threads(threads)
            times = timed(args.reps, store.update, 1 << 21, True, buf)
            record(
                pages="thp" if huge else "4k", what="update", chunk=1 << 21,
                refresh="per chunk", threads=threads, median_s=statistics.median(times),
            )  # fmt: skip
        torch.set_num_threads(n_threads)
        del store
    # Moments faulted in ahead (one thread, content kept), then the first update over them.
    store = Store(args.numel, False)
    populate_s = store.populate_moments()
    record(pages="4k", what="populate moments (MADV_POPULATE_WRITE, 1 thread)", median_s=populate_s)
    t = time.perf_counter()
    store.update(1 << 21, True, torch.empty(1 << 23))
    record(pages="4k", what="first update after populate", median_s=time.perf_counter() - t)
    del store
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
