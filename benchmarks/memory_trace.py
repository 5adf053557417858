"""Where the CUDA caching allocator's reserved peak comes from: a summary of its trace.

``bench.py --worker`` records the allocator's history when ``BENCH_MEMORY_TRACE`` names an output
file (a diagnostic: the history with Python stacks slows a step). The summary, written there as
text, replays the trace: memory mapped (reserved) and allocated per stream over time, the moment
mapped memory peaks, what is live and what is cached-but-free per stream then, and the allocations
that made the allocator map new memory on the way up, by size and Python frame.

Usage outside bench: ``start()`` before the work, ``write_summary(path)`` after.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

GIB = 2**30
_GROW = {"segment_map", "segment_alloc"}
_SHRINK = {"segment_unmap", "segment_free"}


def start(max_entries: int = 400_000) -> bool:
    """Record the allocator's history (with Python stacks where torch supports choosing)."""
    import torch

    if not torch.cuda.is_available():
        return False
    record = torch.cuda.memory._record_memory_history
    try:
        record(enabled="all", context="all", stacks="python", max_entries=max_entries)
    except TypeError:  # older signature
        record(True, max_entries=max_entries)
    return True


def _where(event: dict[str, Any], depth: int = 3) -> str:
    frames = [
        f"{Path(f['filename']).name}:{f['line']}:{f['name']}"
        for f in event.get("frames", [])
        if "hf_megatrain" in f.get("filename", "") or "transformers" in f.get("filename", "")
    ]
    return " < ".join(frames[:depth]) or "(no Python frame)"


def summarize(trace: list[dict[str, Any]]) -> list[str]:
    """The summary's lines from one device's trace (``_snapshot()['device_traces'][i]``)."""
    mapped: Counter[int] = Counter()
    live: Counter[int] = Counter()
    live_blocks: dict[int, dict[str, Any]] = {}
    peak_mapped, peak_at, peak_state = 0, -1, None
    growth: list[tuple[int, dict[str, Any]]] = []
    pending = 0  # mapped for the allocation recorded next (the allocator maps, then allocates)
    for i, ev in enumerate(trace):
        action, size, stream = ev["action"], ev.get("size", 0), ev.get("stream", 0)
        if action == "alloc":
            live[stream] += size
            live_blocks[ev["addr"]] = ev
            if pending:
                growth.append((pending, ev))
                pending = 0
                total = sum(mapped.values())
                if total > peak_mapped:
                    peak_mapped, peak_at = total, i
                    # growth only appends: its length marks the peak
                    peak_state = (Counter(mapped), Counter(live), dict(live_blocks), len(growth))
        elif action == "free_completed":
            live[stream] -= size
            live_blocks.pop(ev["addr"], None)
        elif action in _GROW:
            mapped[stream] += size
            pending += size
        elif action in _SHRINK:
            mapped[stream] -= size
    lines = [f"events: {len(trace)}; peak mapped {peak_mapped / GIB:.2f} GiB at event {peak_at}"]
    if peak_state is None:
        return lines + ["no segment was mapped while recording"]
    at_mapped, at_live, blocks, n_grown = peak_state
    for stream in sorted(set(at_mapped) | set(at_live)):
        m, a = at_mapped[stream], at_live[stream]
        lines.append(
            f"stream {stream:#x}: mapped {m / GIB:.2f} GiB, live {a / GIB:.2f} GiB, "
            f"cached free {(m - a) / GIB:.2f} GiB"
        )
    by_where: defaultdict[str, list[int]] = defaultdict(list)
    for ev in blocks.values():
        by_where[f"stream {ev.get('stream', 0):#x} {_where(ev)}"].append(ev["size"])
    lines.append("live at the peak, by stream and frame (GiB, count):")
    for where, sizes in sorted(by_where.items(), key=lambda kv: -sum(kv[1]))[:25]:
        lines.append(f"  {sum(sizes) / GIB:8.2f} {len(sizes):5d}  {where}")
    lines.append("mapping growth on the way to the peak, by the allocation that caused it:")
    by_cause: defaultdict[str, list[int]] = defaultdict(list)
    for size, ev in growth[:n_grown]:
        cause = f"stream {ev.get('stream', 0):#x} alloc {ev.get('size', 0) / GIB:.2f} GiB "
        by_cause[cause + _where(ev)].append(size)
    for cause, sizes in sorted(by_cause.items(), key=lambda kv: -sum(kv[1]))[:25]:
        lines.append(f"  {sum(sizes) / GIB:8.2f} {len(sizes):5d}  {cause}")
    return lines


def write_summary(path: Path | str) -> None:
    """Summarize the recorded history of every device into ``path`` and stop recording."""
    import torch

    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    lines = [
        f"max_memory_reserved {torch.cuda.max_memory_reserved() / GIB:.2f} GiB, "
        f"max_memory_allocated {torch.cuda.max_memory_allocated() / GIB:.2f} GiB"
    ]
    segments: defaultdict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    for seg in snap.get("segments", []):
        s = segments[seg.get("stream", 0)]
        s[0] += 1
        s[1] += seg["total_size"]
        s[2] += seg["allocated_size"]
    for stream, (n, total, allocated) in sorted(segments.items()):
        lines.append(
            f"at the end: stream {stream:#x}: {n} segments, {total / GIB:.2f} GiB reserved, "
            f"{allocated / GIB:.2f} GiB allocated"
        )
    for i, trace in enumerate(snap.get("device_traces", [])):
        if trace:
            lines.append(f"device {i}:")
            lines += summarize(trace)
    Path(path).write_text("\n".join(lines) + "\n")
