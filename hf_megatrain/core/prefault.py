"""Fault the host optimizer state's pages in from background threads, content kept.

A layer store's moments are fresh anonymous memory: the kernel maps each 4 KiB page on its first
write, which is the first optimizer update. That update then runs several times slower than
later ones (on the H200 host, 8x for a 268M-parameter layer: 14B at 64k spent ~19 s of its first
updated step in page faults). ``MADV_POPULATE_WRITE`` (Linux >= 5.14) maps the pages ahead and
keeps what they hold, so it is safe beside a running update, after a checkpoint load, and on pages
already present (a no-op there). The threads run while the first forward and backward keep the
CPU mostly idle; whatever they have not reached by the first update, the update faults in itself.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import queue
import sys
import threading
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # <linux/mman.h>
#: Bytes per madvise call: small enough to spread one layer over the threads.
PIECE = 256 << 20


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise  # a foreign call: the GIL is released
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class Prefault:
    """Populates ``ranges`` (``(address, nbytes)``, in the order given) on daemon threads.

    ``owners``: the objects whose memory the ranges are (the layer stores); held until the work
    ends, so no range is unmapped, and its addresses reused, while a thread may still reach it.
    Daemon threads: interpreter exit does not wait for them (the call never changes contents).
    """

    def __init__(
        self, ranges: Iterable[tuple[int, int]], threads: int, owners: Iterable[object] = ()
    ) -> None:
        self._owners: list[object] | None = list(owners)
        self._pieces: queue.Queue[tuple[int, int] | None] = queue.Queue()
        self.populated_bytes = 0
        self.supported = True
        self._lock = threading.Lock()
        self._stop = threading.Event()
        for addr, nbytes in ranges:
            start = addr - addr % mmap.PAGESIZE
            end = addr + nbytes
            for a in range(start, end, PIECE):
                self._pieces.put((a, min(a + PIECE, end) - a))
        self._threads = [
            threading.Thread(target=self._work, name=f"megatrain-prefault-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        self._madvise = _madvise()
        if self._pieces.empty():
            self._threads = []
        elif self._madvise is None:
            self.supported = False
            self._threads = []
        self._running = len(self._threads)
        if not self._threads:
            self._owners = None
        for t in self._threads:
            self._pieces.put(None)
            t.start()

    def _work(self) -> None:
        try:
            self._populate()
        finally:
            with self._lock:
                self._running -= 1
                if not self._running:
                    self._owners = None  # the stores may go now

    def _populate(self) -> None:
        while not self._stop.is_set():
            piece = self._pieces.get()
            if piece is None:
                return
            addr, nbytes = piece
            if self._madvise(addr, nbytes, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                # EINVAL: a kernel without MADV_POPULATE_WRITE. Anything else (ENOMEM: the
                # range went away): nothing to do for the rest either.
                self.supported = err != 22
                self._stop.set()
                logger.debug("hf_megatrain: prefault stopped (errno %d)", err)
                return
            with self._lock:
                self.populated_bytes += nbytes

    def join(self, timeout: float | None = None) -> None:
        """Wait for the threads (tests; a run never needs to)."""
        for t in self._threads:
            t.join(timeout)


def default_threads() -> int:
    """A quarter of torch's intra-op threads (this process's share of the cores, also under data
    parallel), 1 to 8: page zeroing is bound by memory bandwidth, and the training thread and
    its data loading keep theirs."""
    return max(1, min(8, torch.get_num_threads() // 4))
