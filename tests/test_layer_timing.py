"""LayerTimeline: gaps are counted between consecutive layers of one pass, not across passes."""

from __future__ import annotations

import time

import pytest

from hf_megatrain.core.layer_timing import LayerTimeline

from .helpers import run_trainer, tiny_config, tiny_model


def _span(tl: LayerTimeline, phase: str, layer: int, busy_s: float) -> None:
    tok = tl.start(phase, layer)
    time.sleep(busy_s)
    tl.end(tok)


def test_gaps_within_a_pass_only():
    tl = LayerTimeline()
    _span(tl, "forward", 0, 0.01)
    time.sleep(0.03)  # a gap between forward layers: counted
    _span(tl, "forward", 1, 0.01)
    time.sleep(0.05)  # forward -> backward (the loss): not a gap between layers
    _span(tl, "backward", 1, 0.01)
    _span(tl, "backward", 0, 0.01)
    s = tl.summary()
    assert s["passes"] == 4
    assert s["layer_ms"] == pytest.approx(40, abs=8)
    assert 30 <= s["gap_ms"] < 45  # the 30 ms forward gap, not the 50 ms switch
    assert s["largest_gap_before"] == "forward layer 1"
    assert set(s["gap_ms_by_phase"]) == {"forward", "backward"}
    assert 30 <= s["gap_ms_by_phase"]["forward"] < 45 and s["gap_ms_by_phase"]["backward"] < 8
    assert [where for _, where in s["largest_gaps"]] == ["forward layer 1", "backward layer 0"]
    assert s["span_ms"] >= s["layer_ms"] + s["gap_ms"]
    assert LayerTimeline().summary()["passes"] == 0


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
