"""The host update beside the training thread: its thread count, and the moments' pages mapped
in ahead of the first update (content kept)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import sys
import threading
import time
import weakref

import pytest
import torch

from hf_megatrain.core.engine.updates import UpdateScheduler, background_threads
from hf_megatrain.core.host_store import LayerStore, layout_slots
from hf_megatrain.core.optimizer import HostAdamW
from hf_megatrain.core.options import EngineOptions, OptionError
from hf_megatrain.core.prefault import Prefault
from hf_megatrain.core.streaming import StreamingEngine


def _store(n: int = 3 << 20) -> LayerStore:
    slots, numel, decay = layout_slots([("w", (n,), True), ("b", (7,), False)])
    return LayerStore(slots, numel, decay, torch.bfloat16, pin=False)


def _resident_pages(addr: int, nbytes: int) -> int:
    """Pages of ``[addr, addr + nbytes)`` mapped in (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = addr - addr % page
    pages = -(-(addr + nbytes - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    rc = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec)
    assert rc == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec)


def _threads_seen(n_threads: int) -> list[int]:
    sched = UpdateScheduler([_store(16), _store(16)], None)
    seen: list[int] = []
    sched.start(lambda i: seen.append(torch.get_num_threads()), [0, 1], n_threads)
    sched.wait()
    return seen


def test_update_thread_runs_with_the_threads_asked_for():
    total = torch.get_num_threads()
    assert background_threads() == total
    assert background_threads(3) == 3
    # A fresh native thread starts with the OpenMP runtime's default team: the count is set
    # inside it, as asked (0: the training thread's own count).
    assert _threads_seen(0) == [total] * 2
    assert _threads_seen(1) == [1, 1]


def test_host_update_threads_option():
    assert EngineOptions().host_update_threads == 0
    with pytest.raises(OptionError, match="host_update_threads"):
        EngineOptions(host_update_threads=-1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise/mincore: Linux")
def test_prefault_maps_the_moments_in_and_keeps_their_content():
    store = _store()
    ranges = store.moment_ranges()
    assert [n for _, n in ranges] == [store.numel * 4] * 2
    assert _resident_pages(*ranges[1]) == 0  # fresh anonymous memory: nothing mapped yet
    store.exp_avg[: 1 << 20].copy_(torch.arange(1 << 20, dtype=torch.float32))
    before = store.exp_avg.clone()
    job = Prefault(ranges, threads=2, owners=[store])
    job.join(timeout=60)
    if not job.supported:
        pytest.skip("kernel without MADV_POPULATE_WRITE (Linux < 5.14)")
    assert job.populated_bytes >= sum(n for _, n in ranges)
    for addr, nbytes in ranges:
        assert _resident_pages(addr, nbytes) == -(-nbytes // mmap.PAGESIZE)
    assert torch.equal(store.exp_avg, before)
    assert not store.exp_avg_sq.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise/mincore: Linux")
def test_optimizer_prefaults_its_streamed_layers_only():
    stores = [_store(1 << 16), _store(1 << 16)]
    engine = StreamingEngine(stores, torch.device("cpu"), torch.bfloat16)
    opt = HostAdamW(engine, [], lr=1e-3)
    opt.prefault.join(timeout=60)
    if not opt.prefault.supported:
        pytest.skip("kernel without MADV_POPULATE_WRITE (Linux < 5.14)")
    want = sum(n for s in stores for _, n in s.moment_ranges())
    assert opt.prefault.populated_bytes == want


def test_prefault_lets_its_stores_go_once_done():
    store = _store(1 << 16)
    alive = weakref.ref(store)
    job = Prefault(store.moment_ranges(), threads=2, owners=[store])
    job.join(timeout=60)
    del store
    gc.collect()
    assert alive() is None  # held while the threads could reach its pages, not after


def test_waits_for_the_host_update_are_counted():
    sched = UpdateScheduler([_store(16), _store(16)], None)
    release = threading.Event()

    def update(i: int) -> None:
        if i == 1:
            release.wait(10)

    sched.start(update, [0, 1])
    sched.wait_layer(0)  # (layer 0's update returns at once; a wait for it may be counted)
    before = sched.blocked_s
    threading.Timer(0.2, release.set).start()
    sched.wait_layer(1)  # blocks until the timer lets layer 1's update end
    assert sched.blocked_s - before >= 0.15
    sched.wait()
    after = sched.blocked_s
    sched.wait_layer(1)  # nothing pending: not a wait
    assert sched.blocked_s == after


def test_update_thread_counts_its_seconds_and_parameters():
    """The CPU thread's time and parameters per layer it updated (their ratio: the host's rate,
    which bench rows record apart from the step time)."""
    stores = [_store(16), _store(1024), _store(64)]
    sched = UpdateScheduler(stores, None)
    sched.start(lambda i: time.sleep(0.02), [0, 1], 1)  # (layer 2 has nothing to update)
    sched.wait()
    seconds, params = sched.cpu_update_totals
    assert params == stores[0].numel + stores[1].numel and seconds >= 0.04
    sched.start(lambda i: time.sleep(0.02), [2], 1)
    sched.wait()
    seconds, params = sched.cpu_update_totals
    assert params == sum(s.numel for s in stores) and seconds >= 0.06
