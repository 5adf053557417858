"""Where the device is in a layer pass, and how long one of its layers takes there.

The training thread launches a layer's kernels well before the device runs them, so the layer
it acquires says little about how soon the device will need the next ones. ``ForwardPace``
reads that from marks recorded on the compute stream as each layer starts (CUDA events): the
last layer whose mark has completed is where the device is, and the shortest interval between
consecutive layers' marks is a layer's compute time (a longer one includes a wait for weights).
The update scheduler compares it with the host update's own pace to take over only the layers
the CPU would deliver late (``UpdateScheduler.claim_ahead``).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class Mark(Protocol):
    """What ``torch.cuda.Event`` offers: whether the stream has passed it, and the milliseconds
    from it to a later one."""

    def query(self) -> bool: ...

    def elapsed_time(self, other: Mark) -> float: ...


class ForwardPace:
    """Marks of the layers of the current pass, in launch order.

    ``layer_started(idx, mark)`` for each layer as it is launched (the index rising by one
    within a pass; a lower index starts a new pass). ``slack_s(k)`` is the time the device will
    take before it starts layer ``k`` of this pass: the layers between where it is and ``k``,
    at the measured time per layer. None until one interval has been measured.
    """

    #: Intervals kept for the layer time (the shortest of them is used).
    SAMPLES = 16

    def __init__(self) -> None:
        self._pending: deque[tuple[int, int, Mark]] = deque()  # (pass, layer, mark), launched
        self._pass = 0
        self._last_launched: int | None = None
        self._first_of_pass: int | None = None
        self._done: tuple[int, int, Mark] | None = None  # the last completed mark
        self._intervals: deque[float] = deque(maxlen=self.SAMPLES)

    def layer_started(self, idx: int, mark: Mark) -> None:
        if self._last_launched is None or idx != self._last_launched + 1:
            self._pass += 1
            self._first_of_pass = idx
        self._last_launched = idx
        self._pending.append((self._pass, idx, mark))
        # Consume the marks the device has passed here too: where nothing asks for the slack
        # (every host update done, no claim to weigh) they would pile up, two per layer and step.
        self._advance()

    def _advance(self) -> None:
        # Marks complete in stream order: stop at the first one the device has not passed.
        while self._pending and self._pending[0][2].query():
            cur = self._pending.popleft()
            prev = self._done
            if prev is not None and prev[0] == cur[0] and prev[1] + 1 == cur[1]:
                self._intervals.append(prev[2].elapsed_time(cur[2]) / 1e3)
            self._done = cur

    @property
    def layer_s(self) -> float | None:
        """Seconds of one layer's compute (the shortest recent interval), None before any."""
        self._advance()
        return min(self._intervals) if self._intervals else None

    def position(self) -> int | None:
        """The last layer of the current pass the device has started (one before the pass's
        first while it has started none of it); None outside a pass."""
        self._advance()
        if self._first_of_pass is None:
            return None
        if self._done is not None and self._done[0] == self._pass:
            return self._done[1]
        return self._first_of_pass - 1

    def slack_s(self, k: int) -> float | None:
        """Seconds before the device starts layer ``k`` of the current pass (0 when it already
        has), or None where the pace is not known yet."""
        layer_s = self.layer_s
        pos = self.position()
        if layer_s is None or pos is None:
            return None
        # The device is somewhere inside layer ``pos``: count it as done (the early side).
        return max(0, k - pos - 1) * layer_s
