"""When a layer's weights may stream in: after its host update, and (data parallel) after its
owner has published the step's version."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from ..distributed import DataParallel
from ..host_store import LayerStore


def host_update_rate(before: tuple[float, int], after: tuple[float, int]) -> float | None:
    """The CPU AdamW's rate in G parameters/s between two readings of
    ``UpdateScheduler.cpu_update_totals``; None where no layer update finished between them."""
    seconds = after[0] - before[0]
    return (after[1] - before[1]) / seconds / 1e9 if seconds > 0 else None


def background_threads(requested: int = 0) -> int:
    """Intra-op threads for a host update that runs beside the training thread: ``requested``,
    or (0) torch's intra-op count, the synchronous update's. (Leaving the training thread a core
    of its own was measured on the H200 host: no faster.)"""
    return requested if requested > 0 else torch.get_num_threads()


class UpdateScheduler:
    """The background host optimizer update and the weight versions layers must reach.

    The next forward streams layer ``i`` in as soon as its update is done, so the CPU AdamW step
    overlaps the next step's GPU work.
    """

    def __init__(self, stores: list[LayerStore], data_parallel: DataParallel | None) -> None:
        self._stores = stores
        self._dp = data_parallel
        # Optimizer steps this rank has taken: the version a layer's shared weights must reach
        # before it streams in (data parallel only). Advanced by the optimizer.
        self.weights_version = 0
        # Host-side readiness of each layer's stream copy while the update thread runs.
        self._ready: list[threading.Event] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: Seconds the training thread has blocked on host updates (a layer's, its data-parallel
        #: owner's, or the whole update at the next step): where the CPU AdamW set the pace. The GPU
        #: runs the work already queued meanwhile, so it idles at most this long.
        self.blocked_s = 0.0
        # Layers the device took over from a CPU update that fell behind (``claim_ahead``).
        self._claim_lock = threading.Lock()
        self._claims: set[int] = set()  # layers the CPU thread or the device took, this step
        self._device_jobs: dict[int, Callable[[dict], None]] = {}
        self._device_update: Callable[[int], Callable[[dict], None]] | None = None
        self._layers: list[int] = []
        self._lead = 0
        self._claimable: Callable[[int], bool] | None = None
        # The CPU thread's pace: seconds per parameter of its last updates (None before one),
        # and the layer it is on with its start time.
        self._cpu_s_per_param: float | None = None
        self._cpu_current: tuple[int, float] | None = None
        #: Host-layer updates the device took over, in all.
        self.device_updates = 0
        #: Seconds the CPU thread spent in layer updates and the parameters it updated, in all
        #: (one tuple, replaced whole: a reader on another thread sees both of one moment).
        #: Their ratio is the host AdamW's rate, which the host's memory bandwidth sets.
        self.cpu_update_totals: tuple[float, int] = (0.0, 0)

    def start(
        self,
        update_layer: Callable[[int], None],
        layers: list[int],
        n_threads: int = 0,
        device_update: Callable[[int], Callable[[dict], None]] | None = None,
        lead: int = 0,
        claimable: Callable[[int], bool] | None = None,
    ) -> None:
        """Run ``update_layer(i)`` for ``layers`` in order on a CPU thread with ``n_threads``
        intra-op threads (0: ``background_threads()``); the other layers are ready.

        ``device_update(i)`` (one process only): the update of layer ``i`` as a function of its
        state on the compute device. Where the forward reaches layer ``j`` (``claim_ahead``)
        while the CPU has not started a layer within ``lead`` layers after ``j`` (and
        ``claimable(i)``), that layer is claimed for the device instead: the CPU thread skips
        it, and the weight streamer runs it when it loads the layer (``take_device_update``).
        """
        self.wait()
        ready = [threading.Event() for _ in self._stores]
        pending = set(layers)
        for i, ev in enumerate(ready):
            if i not in pending:
                ev.set()

        # A new thread does not inherit the intra-op thread count set on the main thread (an
        # OpenMP runtime gives a fresh native thread its default team size): set it explicitly,
        # or the fused CPU AdamW may run on far fewer cores than the synchronous path.
        n_threads = n_threads or background_threads()
        claims: set[int] = set()  # under self._claim_lock
        self._claims = claims
        self._layers = list(layers)
        self._device_update = device_update if self._dp is None and lead > 0 else None
        self._lead = lead
        self._claimable = claimable
        self._cpu_current = None  # the thread below has not started a layer yet

        def work() -> None:
            torch.set_num_threads(n_threads)
            try:
                for i in layers:
                    with self._claim_lock:
                        if i in claims:
                            continue  # the device took it
                        claims.add(i)
                        start = time.perf_counter()
                        self._cpu_current = (i, start)
                    update_layer(i)
                    seconds = time.perf_counter() - start
                    self._cpu_pace(i, seconds)
                    spent, updated = self.cpu_update_totals
                    self.cpu_update_totals = (spent + seconds, updated + self._numel(i))
                    ready[i].set()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread
                self._error = exc
            finally:
                for ev in ready:
                    ev.set()

        self._ready = ready
        # Not a daemon: interpreter exit waits for it instead of killing it inside a torch op.
        self._thread = threading.Thread(target=work, name="megatrain-adamw")
        self._thread.start()

    def _numel(self, idx: int) -> int:
        return max(1, getattr(self._stores[idx], "numel", 1))

    def _cpu_pace(self, idx: int, seconds: float) -> None:
        rate = seconds / self._numel(idx)
        prev = self._cpu_s_per_param
        # Half the weight on the newest layer: a few updates follow a change of pace (the
        # first update's page faults, another process on the host).
        self._cpu_s_per_param = rate if prev is None else 0.5 * (prev + rate)

    def _cpu_done_s(self, k: int) -> float:
        """Seconds until the CPU thread will have updated layer ``k`` at its measured pace: the
        rest of the layer it is on and every unclaimed layer after it up to ``k``. Under the
        claim lock, with the pace known."""
        rate = self._cpu_s_per_param
        cur = self._cpu_current
        total, after = 0.0, cur is None
        for i in self._layers:
            if cur is not None and i == cur[0]:
                elapsed = time.perf_counter() - cur[1]
                total += max(0.0, self._numel(i) * rate - elapsed)
                after = True
            elif after and i not in self._claims:
                total += self._numel(i) * rate
            if i == k:
                break
        return total

    def claim_ahead(self, idx: int, slack_s: Callable[[int], float | None] | None = None) -> None:
        """The forward has layer ``idx``'s weights: claim for the device the layers within
        ``lead`` after it that the CPU update has not started (it has fallen behind).

        ``slack_s(k)``: the seconds before the device starts layer ``k`` (``pace.ForwardPace``;
        None where not known). With it and the CPU's measured pace, a layer is claimed only
        where the CPU would finish it later than that: a takeover moves the layer's state
        across PCIe twice, which costs the forward where the CPU would have been in time."""
        if self._device_update is None or self._ready is None:
            return
        with self._claim_lock:
            for k in self._layers:
                if idx < k <= idx + self._lead and k not in self._claims:
                    if self._claimable is not None and not self._claimable(k):
                        continue
                    slack = None if slack_s is None else slack_s(k)
                    if (
                        slack is not None
                        and self._cpu_s_per_param is not None
                        and self._cpu_done_s(k) <= slack
                    ):
                        continue  # the CPU will have it in time
                    self._claims.add(k)
                    self._device_jobs[k] = self._device_update(k)
                    self._ready[k].set()
                    self.device_updates += 1

    def take_device_update(self, idx: int) -> Callable[[dict], None] | None:
        """The device update claimed for layer ``idx`` (once), or None: the caller runs it on
        the layer's state before the layer's weights are read."""
        with self._claim_lock:
            return self._device_jobs.pop(idx, None)

    def pending_device_updates(self) -> list[int]:
        """Layers claimed for the device whose update has not been taken yet."""
        with self._claim_lock:
            return sorted(self._device_jobs)

    def wait(self) -> None:
        """Block until the background update (if any) is done; re-raise its error."""
        if self._thread is not None:
            if self._thread.is_alive():
                self._timed(self._thread.join)
            else:
                self._thread.join()
            self._thread = None
            self._ready = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("hf_megatrain: the host optimizer update failed") from err

    def wait_layer(self, idx: int) -> None:
        """Block until layer ``idx``'s weights may be read: updated here and (DP) published."""
        if self._ready is not None:
            if not self._ready[idx].is_set():
                self._timed(self._ready[idx].wait)
            if self._error is not None:
                self.wait()
        if self.owned_elsewhere(idx) and not self._dp.is_published(idx, self.weights_version):
            self._timed(lambda: self._dp.wait_published(idx, self.weights_version))

    def _timed(self, wait: Callable[[], object]) -> None:
        start = time.perf_counter()
        wait()
        self.blocked_s += time.perf_counter() - start

    def layer_ready(self, idx: int) -> bool:
        """Whether ``wait_layer(idx)`` would return at once (nothing pending for the layer)."""
        if self._ready is not None and not self._ready[idx].is_set():
            return False
        return not self.owned_elsewhere(idx) or self._dp.is_published(idx, self.weights_version)

    def owned_elsewhere(self, idx: int) -> bool:
        """Whether another data-parallel rank updates layer ``idx``'s shared weights."""
        store = self._stores[idx]
        return (
            self._dp is not None
            and not store.resident
            and store.trainable
            and not self._dp.owns(idx)
        )

    def publish(self, idx: int, version: int) -> None:
        """Owner side: layer ``idx``'s shared weights hold optimizer step ``version``."""
        if self._dp is not None and not self._stores[idx].resident:
            self._dp.publish(idx, version)

    def wait_all(self) -> None:
        """Block until every layer's weights are final: local and (under DP) remote updates."""
        self.wait()
        for idx in range(len(self._stores)):
            if self.owned_elsewhere(idx):
                self._dp.wait_published(idx, self.weights_version)
