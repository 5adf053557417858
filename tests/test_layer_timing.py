"""LayerTimeline: gaps are counted between consecutive layers of one pass, not across passes."""

from __future__ import annotations

import pytest

from hf_megatrain.core import layer_timing
from hf_megatrain.core.layer_timing import LayerTimeline

from .helpers import run_trainer, tiny_config, tiny_model


class _Clock:
    """The host clock the CPU timeline reads, advanced by hand: exact, whatever the load."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(layer_timing, "time", fake)
    return fake


def _span(clock: _Clock, tl: LayerTimeline, phase: str, layer: int, busy_s: float) -> None:
    tok = tl.start(phase, layer)
    clock.sleep(busy_s)
    tl.end(tok)


def test_gaps_within_a_pass_only(clock):
    tl = LayerTimeline()
    _span(clock, tl, "forward", 0, 0.01)
    clock.sleep(0.03)  # a gap between forward layers: counted
    _span(clock, tl, "forward", 1, 0.01)
    clock.sleep(0.05)  # forward -> backward (the loss): not a gap between layers
    _span(clock, tl, "backward", 1, 0.01)
    clock.sleep(0.002)
    _span(clock, tl, "backward", 0, 0.01)
    s = tl.summary()
    assert s["passes"] == 4
    assert s["layer_ms"] == pytest.approx(40)
    assert s["gap_ms"] == pytest.approx(32)  # the forward and backward gaps, not the switch
    assert s["between_passes_ms"] == pytest.approx(50)  # which is counted apart
    assert s["largest_gap_before"] == "forward layer 1"
    assert set(s["gap_ms_by_phase"]) == {"forward", "backward"}
    assert s["gap_ms_by_phase"]["forward"] == pytest.approx(30)
    assert s["gap_ms_by_phase"]["backward"] == pytest.approx(2)
    assert [where for _, where in s["largest_gaps"]] == ["forward layer 1", "backward layer 0"]
    assert s["span_ms"] >= s["layer_ms"] + s["gap_ms"]
    assert LayerTimeline().summary()["passes"] == 0


def test_recompute_is_compute_inside_the_backward_pass(clock):
    """A segment chain's recompute interval is layer work of the backward pass: the time around
    it is a backward gap, and it is not one itself."""
    tl = LayerTimeline()
    _span(clock, tl, "backward", 3, 0.01)
    clock.sleep(0.03)  # waiting before the chain: a backward gap
    _span(clock, tl, "recompute", 0, 0.04)
    _span(clock, tl, "backward", 1, 0.01)
    s = tl.summary()
    assert s["recompute_ms"] == pytest.approx(40)
    assert s["layer_ms"] == pytest.approx(60)
    by_phase = s["layer_ms_by_phase"]
    assert by_phase["recompute"] == pytest.approx(40)
    assert by_phase["backward"] == pytest.approx(20)
    assert sum(by_phase.values()) == pytest.approx(s["layer_ms"])
    assert set(s["gap_ms_by_phase"]) == {"backward"}
    assert s["gap_ms"] == pytest.approx(30)
    assert s["largest_gap_before"] == "recompute layer 0"


def test_engine_records_every_layer_pass(tmp_path):
    """With a timeline set, each streamed layer's forward and backward leave one interval."""
    model = tiny_model(tiny_config("llama", num_hidden_layers=3))
    _, trainer = run_trainer(model, tmp_path, "t", mega=True, max_steps=1)
    engine = trainer.megatrain.engine
    engine.timeline = LayerTimeline()
    trainer.args.max_steps = 1
    trainer.train()
    spans = [(phase, layer) for phase, layer, _, _ in engine.timeline.spans]
    assert spans == [("forward", i) for i in range(3)] + [("backward", i) for i in (2, 1, 0)]


def test_engine_records_segment_chains_as_recompute(tmp_path):
    """Segments of 2: each follower's backward first re-runs its leader's forward (the chain),
    recorded as a recompute interval of the leader."""
    from .test_checkpoint_segments import _train

    def timed(trainer) -> None:
        trainer.megatrain.engine.timeline = LayerTimeline()

    model = tiny_model(tiny_config("llama", num_hidden_layers=4))
    _, trainer = _train(model, tmp_path, "t", 2, steps=1, setup=timed)
    timeline = trainer.megatrain.engine.timeline
    spans = [(phase, layer) for phase, layer, _, _ in timeline.spans]
    assert spans == [("forward", i) for i in range(4)] + [
        ("recompute", 2), ("backward", 3), ("backward", 2),
        ("recompute", 0), ("backward", 1), ("backward", 0),
    ]  # fmt: skip
    assert timeline.summary()["recompute_ms"] > 0
