"""The copy/compute overlap analysis on the profiler traces recorded on the H200."""

import glob
import os

import pytest

from benchmarks.trace_overlap import analyze, load_events

TRACES = sorted(
    glob.glob(
        os.path.join(
            os.path.dirname(__file__), "..", "benchmarks", "results", "traces", "*.json.gz"
        )
    )
)


@pytest.mark.parametrize("path", TRACES, ids=os.path.basename)
def test_recorded_traces_show_overlap(path):
    report = analyze(load_events(path))
    # Copies ran on their own streams, concurrently with compute kernels in backward.
    assert report["copy_streams"] and set(report["copy_streams"]).isdisjoint(
        report["kernel_streams"]
    )
    assert report["h2d_backward"].copies >= 4 and report["h2d_backward"].fraction > 0.5
    assert report["d2h"].copies >= 4 and report["d2h"].fraction > 0.5


def test_analyze_on_synthetic_events():
    events = [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 100, "tid": 7},
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy HtoD (Pinned -> Device)",
            "ts": 50,
            "dur": 100,
            "tid": 9,
        },
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy DtoH (Device -> Pinned)",
            "ts": 200,
            "dur": 100,
            "tid": 10,
        },
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy HtoD (Pinned -> Device)",
            "ts": 210,
            "dur": 60,
            "tid": 9,
        },
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 240, "dur": 100, "tid": 7},
    ]
    r = analyze(events)
    assert r["h2d_forward"].copies == 1 and r["h2d_forward"].fraction == pytest.approx(0.5)
    assert r["h2d_backward"].copies == 1 and r["h2d_backward"].fraction == pytest.approx(0.5)
    assert r["d2h"].fraction == pytest.approx(0.6)
