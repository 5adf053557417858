"""Device updates with deterministic takeovers (diagnostic, GPU): whether the GPU's AdamW path
itself moves bf16 training, or only the timing that decides which layers it takes.

``benchmarks/loss_curves.py`` runs as given, with the update scheduler patched for every
streamed run whose ``device_update_lead`` is above 0:

* the CPU thread, from its second layer of each step on, waits until the forward has claimed
  (``UpdateScheduler.claim_ahead``, with a lead over every layer), so it cannot race the claim;
* the CPU's pace never looks fast enough (``_cpu_done_s`` = inf): every claimable layer (those
  pinned whole) goes to the device, every step.

Two such runs bitwise equal: the device path is deterministic given its layers (no race); then
their distance to stock against the band is what the GPU AdamW's roundings alone do. Two such
runs apart: something in the device path depends on timing.

    python3 dev/device_update_probe.py --family gemma2 --size small --seq-len 512 --steps 150 \
        --bf16 --band-accums 2,4 --no-plot --out /tmp/probe \
        --variant alla:device_update_lead=2 --variant allb:device_update_lead=2
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import loss_curves  # noqa: E402
from hf_megatrain.core.engine.updates import UpdateScheduler  # noqa: E402

_start = UpdateScheduler.start
_claim_ahead = UpdateScheduler.claim_ahead
_wait = UpdateScheduler.wait
_ALL = 10**6  # a lead over every layer


def _start_forced(self, update_layer, layers, n_threads=0, device_update=None, lead=0,
                  claimable=None):  # fmt: skip
    if device_update is None or lead <= 0 or not layers:
        return _start(self, update_layer, layers, n_threads, device_update, lead, claimable)
    claimed = threading.Event()
    self._probe_claimed = claimed
    first = layers[0]

    def gated(i: int) -> None:
        # After its first layer (whose readiness the forward waits for), this thread waits
        # until the forward has claimed: it then holds one more layer, the second, which is
        # not claimable (the pinned ones are the later half).
        if i != first:
            claimed.wait(60)
        update_layer(i)

    return _start(self, gated, layers, n_threads, device_update, _ALL, claimable)


def _claim_forced(self, idx, slack_s=None):
    _claim_ahead(self, idx, slack_s)
    ev = getattr(self, "_probe_claimed", None)
    if ev is not None:
        ev.set()


def _wait_forced(self):
    ev = getattr(self, "_probe_claimed", None)
    if ev is not None:  # no forward follows the last step: release the held thread
        ev.set()
    return _wait(self)


UpdateScheduler.start = _start_forced
UpdateScheduler.wait = _wait_forced
UpdateScheduler.claim_ahead = _claim_forced
UpdateScheduler._cpu_done_s = lambda self, k: float("inf")

if __name__ == "__main__":
    loss_curves.main(sys.argv[1:])
