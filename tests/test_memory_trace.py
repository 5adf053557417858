"""benchmarks/memory_trace.py: replaying an allocator trace finds the reserved peak and splits
it per stream into live and cached-but-free memory."""

from __future__ import annotations

from benchmarks.memory_trace import summarize

GIB = 2**30


def _ev(action, size, stream, addr=0, where=None):
    frames = [{"filename": f"/x/hf_megatrain/{where}.py", "line": 1, "name": "f"}] if where else []
    return {"action": action, "size": size, "stream": stream, "addr": addr, "frames": frames}


def test_peak_is_split_into_live_and_cached_per_stream():
    trace = [
        _ev("segment_map", 4 * GIB, 1),
        _ev("alloc", 4 * GIB, 1, addr=10, where="fetch"),
        _ev("free_completed", 4 * GIB, 1, addr=10),
        # the compute stream cannot reuse the copy stream's free 4 GiB: it maps 3 more
        _ev("segment_map", 3 * GIB, 0),
        _ev("alloc", 3 * GIB, 0, addr=20, where="layer"),
        _ev("segment_unmap", 4 * GIB, 1),
    ]
    lines = summarize(trace)
    assert lines[0].endswith("peak mapped 7.00 GiB at event 4")
    assert "stream 0x0: mapped 3.00 GiB, live 3.00 GiB, cached free 0.00 GiB" in lines
    assert "stream 0x1: mapped 4.00 GiB, live 0.00 GiB, cached free 4.00 GiB" in lines
    growth = lines[lines.index(next(x for x in lines if x.startswith("mapping growth"))) + 1 :]
    assert "stream 0x1 alloc 4.00 GiB fetch.py:1:f" in growth[0]
    assert "stream 0x0 alloc 3.00 GiB layer.py:1:f" in growth[1]


def test_no_growth_says_so():
    assert summarize([_ev("alloc", 1, 0, addr=1)])[-1] == "no segment was mapped while recording"
