"""How much of the PCIe copy time of a streamed step overlaps compute kernels, and where the
GPU time goes by kernel family (chrome trace).

    python3 benchmarks/trace_overlap.py [--top N] trace.json[.gz]

``--top N`` also lists the N kernels with the most summed time.

Layer-sized copies (> 50 us) are split into phases at the first gradient D2H copy: before it,
the forward (whose H2D copies wait for the host AdamW update of the same layer when the update
overlaps the forward), from it on, the backward (prefetch of layer i-1 while layer i recomputes,
gradients of layer i draining while layer i-1 computes).
"""

from __future__ import annotations

import gzip
import json
import sys
from dataclasses import dataclass


@dataclass
class PhaseOverlap:
    copies: int
    copy_ms: float
    overlapped_ms: float

    @property
    def fraction(self) -> float:
        return self.overlapped_ms / self.copy_ms if self.copy_ms else 0.0


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _spans(events, pred, min_us: float = 0.0) -> list[tuple[float, float, object]]:
    out = []
    for e in events:
        if e.get("ph") == "X" and pred(e) and float(e.get("dur", 0)) > min_us:
            start = float(e["ts"])
            out.append((start, start + float(e["dur"]), e.get("tid")))
    return sorted(out, key=lambda x: x[0])


def _overlap(span, kernels) -> float:
    s, e, _ = span
    total = 0.0
    for ks, ke, _ in kernels:
        if ks >= e:
            break
        if ke > s:
            total += min(e, ke) - max(s, ks)
    return total


def _busy_and_gaps(kernels, top: int = 5) -> tuple[float, list[tuple[float, float]]]:
    """Fraction of the kernel span with some kernel running (any stream), and the largest idle
    gaps as (start offset ms, length ms)."""
    if not kernels:
        return 0.0, []
    t0 = kernels[0][0]
    busy, gaps = 0.0, []
    cur_s, cur_e = kernels[0][0], kernels[0][1]
    for s, e, _ in kernels[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(((cur_e - t0) / 1e3, (s - cur_e) / 1e3))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = cur_e - t0
    gaps.sort(key=lambda g: -g[1])
    return busy / span, gaps[:top]


# Kernel families by name, first match wins (cuDNN's SDPA kernels also carry "sm90", so
# attention is tested before the GEMMs). Used to set two systems' steps side by side: where the
# GPU time of each goes, not only how busy it is.
KERNEL_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("optimizer", ("adam", "multi_tensor")),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "sm90_")),
    ("loss", ("cross_entropy", "softmax", "nll_loss")),
    ("copy/cast", ("copy", "catarray", "fill")),
    ("reduce/norm", ("reduce_kernel", "norm")),
    ("elementwise", ("elementwise",)),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, keys in KERNEL_CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


def kernel_ms_by_category(events: list[dict]) -> dict[str, float]:
    """Summed kernel time (ms) per family, largest first (overlapping kernels both count)."""
    out: dict[str, float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            c = kernel_category(e.get("name", ""))
            out[c] = out.get(c, 0.0) + float(e.get("dur", 0)) / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def heaviest_kernels(events: list[dict], top: int = 25) -> list[tuple[str, int, float]]:
    """The ``top`` kernel names by summed time: (name cut to 100 characters, calls, ms)."""
    out: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            entry = out.setdefault(e.get("name", "")[:100], [0, 0.0])
            entry[0] += 1
            entry[1] += float(e.get("dur", 0)) / 1e3
    ranked = sorted(out.items(), key=lambda kv: -kv[1][1])[:top]
    return [(name, int(calls), ms) for name, (calls, ms) in ranked]


def analyze(events: list[dict]) -> dict:
    kernels = _spans(events, lambda e: e.get("cat") == "kernel")
    h2d = _spans(events, lambda e: "Memcpy HtoD" in e.get("name", ""), 50)
    d2h = _spans(events, lambda e: "Memcpy DtoH" in e.get("name", ""), 50)
    backward_start = d2h[0][0] if d2h else float("inf")

    def phase(spans) -> PhaseOverlap:
        return PhaseOverlap(
            len(spans),
            sum(e - s for s, e, _ in spans) / 1e3,
            sum(_overlap(x, kernels) for x in spans) / 1e3,
        )

    busy, gaps = _busy_and_gaps(kernels)
    return {
        "gpu_busy_fraction": busy,
        "largest_gaps_ms": gaps,
        "kernel_streams": sorted({t for _, _, t in kernels}, key=str),
        "copy_streams": sorted({t for _, _, t in h2d + d2h}, key=str),
        "h2d_forward": phase([x for x in h2d if x[0] < backward_start]),
        "h2d_backward": phase([x for x in h2d if x[0] >= backward_start]),
        "d2h": phase(d2h),
        "kernel_busy_ms": sum(e - s for s, e, _ in kernels) / 1e3,
        "kernel_ms_by_category": {k: round(v, 2) for k, v in kernel_ms_by_category(events).items()},
        "span_ms": (max(e for _, e, _ in kernels) - kernels[0][0]) / 1e3 if kernels else 0.0,
    }


def main(argv: list[str]) -> None:
    top = 0
    if argv[:1] == ["--top"]:
        top, argv = int(argv[1]), argv[2:]
    for path in argv:
        events = load_events(path)
        r = analyze(events)
        print(path)
        print(f"  kernel streams {r['kernel_streams']}, copy streams {r['copy_streams']}")
        print(f"  GPU span {r['span_ms']:.1f} ms, kernels busy {r['kernel_busy_ms']:.1f} ms")
        print(f"  GPU busy (any kernel running) {100 * r['gpu_busy_fraction']:.1f}% of the span")
        cats = ", ".join(f"{k} {v:.1f}" for k, v in r["kernel_ms_by_category"].items())
        print(f"  kernel ms by family: {cats}")
        for at, length in r["largest_gaps_ms"]:
            print(f"    idle gap {length:8.2f} ms at +{at:.1f} ms")
        for key in ("h2d_forward", "h2d_backward", "d2h"):
            p = r[key]
            print(
                f"  {key:13s} {p.copies:3d} copies, {p.copy_ms:7.2f} ms, "
                f"{100 * p.fraction:5.1f}% overlapped with compute"
            )
        for name, calls, ms in heaviest_kernels(events, top) if top else []:
            print(f"  {ms:9.1f} ms {calls:6d} x  {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
