"""Test-session settings shared by every test module."""

import gc
import os
import sys

import pytest
import torch

# The equivalence tests run tiny models (hidden 32, seq 16): intra-op threads only add
# synchronization, and on a shared 2-core CI machine spinning worker threads oversubscribe the
# cores (measured: the suite ran ~4x slower with 2 threads under load). Stock and streamed runs
# share this setting, so it does not affect any comparison. Not on a GPU machine: there the GPU
# tests time real pipelines whose host AdamW runs on the intra-op threads (one thread made each
# layer's update 170 ms, gating the forward of the H2D-overlap test).
if not torch.cuda.is_available():
    torch.set_num_threads(1)

# The compiled layer kernels are compiled once per static width (a run compiles each for its
# model's few widths); a test process compiles them for every tiny config of the tests that
# land on it (``--dist loadfile``: which files share a worker varies run to run). Dynamo's
# default limit of 8 recompiles per function would then fail whichever test came ninth.
torch._dynamo.config.recompile_limit = 256
torch._dynamo.config.accumulated_recompile_limit = 4096


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's addopts): one worker per CPU without CUDA; none with it.

    On CPU each worker runs one thread (above), so 2 workers on CI's 2 cores halve the suite
    (measured: 375 s against ~720 s). On a GPU machine the tests time pipelines and size
    memory on one shared device, so they run in one process there."""
    if torch.cuda.is_available():
        return 0
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _freeze_survivors() -> None:
    """Collect, then move every object left (imported modules, session state) out of the
    collector's view. Each ``Trainer.train`` starts with accelerate's ``free_memory``, a full
    ``gc.collect``: over the ~470k objects torch, transformers and peft import it took 0.25 s,
    half of a tiny equivalence test (two trainings of ~0.9 s). Frozen objects are still freed
    by reference counting; only cycles among them are never collected, so this runs where what
    is alive stays alive: after collection, and after a module's last test (its fixtures torn
    down and released, a failure's traceback dropped, then collected)."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)  # (a failed test's frames: its models and trainers)
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session) -> None:
    _freeze_survivors()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # After the protocol, not in its teardown: pytest drops the test's fixture values
    # (``item.funcargs``) only once the teardown hooks have returned.
    yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        _freeze_survivors()


@pytest.fixture
def in_a_tmp_folder(tmp_path, monkeypatch):
    """The test in its own working folder: a CLI run or argument parse without --output_dir
    makes the default folder (or its parent, outputs/) where it runs."""
    monkeypatch.chdir(tmp_path)
