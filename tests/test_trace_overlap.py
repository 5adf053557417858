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
    if report["h2d_forward"].copies < 4:
        # Stock runs copy nothing; a run with one streamed layer (7B at 8k) has no stream of
        # copies to overlap. The overlap claim is about runs that stream several layers.
        pytest.skip(f"{report['h2d_forward'].copies} weight copies in the forward")
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


def test_kernel_families():
    from benchmarks.trace_overlap import kernel_category, kernel_ms_by_category

    assert kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma") == "attention"
    assert kernel_category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert kernel_category("multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert kernel_category("vectorized_elementwise_kernel<8, bfloat16_copy_kernel_cuda>") == (
        "copy/cast"
    )
    assert kernel_category("reduce_kernel<512, 1, ReduceOp<float, NormTwoOps>>") == "reduce/norm"
    assert kernel_category("elementwise_kernel<128, 4, BinaryFunctor<float>>") == "elementwise"
    assert kernel_category("some_new_kernel") == "other"
    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_a", "ts": 0, "dur": 2000},
        {"ph": "X", "cat": "kernel", "name": "nvjet_b", "ts": 5000, "dur": 1000},
        {"ph": "X", "cat": "kernel", "name": "fused_adam", "ts": 9000, "dur": 500},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 0, "dur": 9000},
    ]
    assert kernel_ms_by_category(events) == {"gemm": 3.0, "optimizer": 0.5}
