"""Device updates: where the overlapped CPU AdamW falls behind the next forward, the device takes
over the host layers it has not started (``device_update_lead``). The claim protocol, the same
training on the CPU engine (whose "device" update runs in place, bitwise the host path's), and
the plan's staging line. The CUDA path: ``tests/test_gpu.py``."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_megatrain import prepare_streamed_model
from hf_megatrain.core.engine.pace import ForwardPace
from hf_megatrain.core.engine.updates import UpdateScheduler
from hf_megatrain.core.host_store import LayerStore
from hf_megatrain.core.optimizer import HostAdamW
from hf_megatrain.core.options import EngineOptions, OptionError, StepShape, device_update_hint
from hf_megatrain.core.plan_arithmetic import DEVICE_WIDEN_NUMEL, device_updates_pay
from hf_megatrain.core.planner import plan_memory
from hf_megatrain.hf.model import model_shape_from_config, streamed_state

CONFIGS = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"


def qwen14b_shape():
    from transformers import AutoConfig  # noqa: PLC0415

    return model_shape_from_config(AutoConfig.from_pretrained(CONFIGS / "qwen2.5-14b"), "14b")


def test_staging_where_the_host_tier_share_outruns_the_forward():
    """The host tier's share of the layer parameters against 2 x tokens x R / F (0.64 at 64k):
    the 14B's 33 of 48 host layers stage, the 8B's 18 of 32 do not; at 32k a third does; an
    unknown workload or an empty host tier never."""
    at = lambda tokens: StepShape(seq_len=4096, micro_batch_tokens=tokens)  # noqa: E731
    assert device_updates_pay(33, 15, at(65536))
    assert not device_updates_pay(18, 14, at(65536))
    assert device_updates_pay(18, 14, at(32768)) and device_updates_pay(11, 21, at(32768))
    assert not device_updates_pay(48, 0, at(131072))
    assert not device_updates_pay(33, 15, None) and not device_updates_pay(0, 48, at(4096))


def test_option_is_checked():
    # On by default: the GPU's AdamW rounds as the CPU's, so timing decides only who updates.
    assert EngineOptions().device_update_lead == 2
    assert EngineOptions().resolve(clipping=True, cuda=True).device_updates
    assert not EngineOptions(device_update_lead=0).resolve(clipping=True, cuda=True).device_updates
    with pytest.raises(OptionError, match="device_update_lead"):
        EngineOptions(device_update_lead=-1)
    lead = EngineOptions(device_update_lead=2)
    assert lead.resolve(clipping=True, cuda=True).device_updates
    assert not lead.resolve(clipping=True, cuda=False).device_updates
    assert not lead.resolve(clipping=False, cuda=True).device_updates  # eager


def _cpu_held_at_layer_zero():
    """A host update that holds layer 0 until ``gate`` is set (``started`` once it does) and
    records the layers it updates in ``on_cpu``."""
    gate, started = threading.Event(), threading.Event()
    on_cpu: list[int] = []

    def update(i: int) -> None:
        if i == 0:
            started.set()
            gate.wait(10)
        on_cpu.append(i)

    return update, gate, started, on_cpu


def test_claims_skip_the_cpu_and_go_to_the_device_once():
    """The CPU thread is busy with layer 0: the forward at layer 0 claims the next two layers
    it has not started (not layer 2, which may not be claimed); the CPU thread skips what the
    device took, and each claimed update is handed out once."""
    update, gate, started, on_cpu = _cpu_held_at_layer_zero()
    sched = UpdateScheduler([None] * 5, None)
    sched.start(
        update, [0, 1, 2, 3, 4], 1, device_update=lambda i: (lambda state: i), lead=3,
        claimable=lambda i: i != 2,
    )  # fmt: skip
    assert started.wait(10)  # the CPU thread holds layer 0
    sched.claim_ahead(0)
    assert sched.pending_device_updates() == [1, 3]
    assert sched.layer_ready(1) and sched.layer_ready(3) and not sched.layer_ready(2)
    job = sched.take_device_update(1)
    assert job is not None and job(None) == 1
    assert sched.take_device_update(1) is None
    gate.set()
    sched.wait()
    assert on_cpu == [0, 2, 4] and sched.device_updates == 2
    assert sched.pending_device_updates() == [3]  # left for whoever reads the host state


def test_claims_only_what_the_cpu_would_deliver_late():
    """With the device's slack before each layer known and the CPU's pace measured (20 ms per
    layer here), a layer is claimed only where the CPU would finish it after the device needs
    it; layers after a claimed one come sooner (the CPU skips the claimed one). Without a
    slack (no pace yet), every unstarted layer within the lead is claimed as before."""
    stores = [SimpleNamespace(numel=1000) for _ in range(5)]
    sched = UpdateScheduler(stores, None)
    sched.start(lambda i: time.sleep(0.02), [0, 1, 2, 3], 1)
    sched.wait()  # the CPU's pace: ~20 us per parameter
    update, gate, started, on_cpu = _cpu_held_at_layer_zero()
    sched.start(update, [0, 1, 2, 3, 4], 1, device_update=lambda i: lambda s: i, lead=3)
    assert started.wait(10)
    sched.claim_ahead(0, lambda k: 10.0)  # 10 s before the device needs any: the CPU is in time
    assert sched.pending_device_updates() == []
    # Layer 2 is needed now; layers 1 and 3 (then ~40 and ~60 ms of CPU work away) in 10 s.
    sched.claim_ahead(0, lambda k: 0.0 if k == 2 else 10.0)
    assert sched.pending_device_updates() == [2]
    sched.claim_ahead(0, lambda k: None)  # no slack known: every unstarted layer in the lead
    assert sched.pending_device_updates() == [1, 2, 3]
    gate.set()
    sched.wait()
    assert on_cpu == [0, 4] and sched.device_updates == 3


class _Mark:
    """A stand-in CUDA event: passed once ``done``, at time ``t`` (milliseconds)."""

    def __init__(self, t: float) -> None:
        self.t, self.done = t, False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: _Mark) -> float:
        return other.t - self.t


def test_forward_pace_reads_position_and_layer_time_from_passed_marks():
    pace = ForwardPace()
    assert pace.slack_s(3) is None and pace.position() is None
    marks = [_Mark(t) for t in (0.0, 100.0, 250.0, 360.0)]  # layer 1 waited 70 ms for weights
    for i, m in enumerate(marks):
        pace.layer_started(i, m)
    assert pace.position() == -1 and pace.layer_s is None  # none passed: before layer 0
    for m in marks[:3]:
        m.done = True
    assert pace.position() == 2
    assert pace.layer_s == pytest.approx(0.1)  # the shortest interval: compute without a wait
    assert pace.slack_s(6) == pytest.approx(0.3)  # layers 3, 4 and 5 still to run
    assert pace.slack_s(3) == 0.0
    # A new pass (the index goes back): where the device is counts from its first layer.
    pace.layer_started(0, _Mark(1000.0))
    marks[3].done = True  # the last layer of the old pass: not a position in the new one
    assert pace.position() == -1
    assert pace.slack_s(2) == pytest.approx(0.2)


def test_forward_pace_lets_go_of_passed_marks_nobody_asked_about():
    """Layers keep starting where nothing asks for the slack (every host update done): the
    marks the device has passed are not held on to (two CUDA events per layer and step)."""
    import gc
    import weakref

    pace = ForwardPace()
    refs = []
    for step in range(50):
        for i in range(4):
            mark = _Mark(float(step * 4 + i))
            mark.done = True
            refs.append(weakref.ref(mark))
            pace.layer_started(i, mark)
            del mark
    gc.collect()
    assert sum(r() is not None for r in refs) <= 2


def test_no_claims_without_a_lead_or_under_data_parallel():
    sched = UpdateScheduler([None] * 3, None)
    gate = threading.Event()
    sched.start(lambda i: gate.wait(10), [0, 1, 2], 1, device_update=lambda i: None, lead=0)
    sched.claim_ahead(0)
    gate.set()
    sched.wait()
    assert sched.device_updates == 0
    dp = UpdateScheduler([None] * 3, object())  # any data-parallel group
    dp.start(lambda i: None, [0, 1, 2], 1, device_update=lambda i: None, lead=2)
    dp.claim_ahead(0)
    dp.wait()
    assert dp.device_updates == 0


def _train(lead: int, slow: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    """3 clipped steps of a tiny Llama on the CPU engine with the overlapped update; with
    ``slow``, each host layer's update on the update thread takes 50 ms."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    prepare_streamed_model(model, device="cpu", compute_dtype=torch.float32)
    state = streamed_state(model)
    if slow:
        refresh = LayerStore.refresh_stream_copy

        def slow_refresh(self, *args, **kwargs):
            if threading.current_thread().name == "megatrain-adamw":
                time.sleep(0.05)
            return refresh(self, *args, **kwargs)

        monkeypatch.setattr(LayerStore, "refresh_stream_copy", slow_refresh)
    opt = HostAdamW(
        state.engine, state.resident, lr=1e-2, weight_decay=0.1, overlap_update=True,
        device_update_lead=lead,
    )  # fmt: skip
    data = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        loss = model(input_ids=data, labels=data).loss
        loss.backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    state.engine.wait_updates()
    monkeypatch.undo()
    stores = [s for s in state.store.layers if not s.resident]
    tensors = [t.clone() for s in stores for t in (s.master, s.exp_avg, s.exp_avg_sq)]
    tensors += [p.detach().clone() for _, p, _ in state.resident]
    return tensors, state.engine.device_updates


def test_device_updates_train_as_the_cpu_does(monkeypatch):
    """A CPU update slower than the forward: layers are taken over (on the CPU engine the
    taken-over update runs in place on the training thread); masters, moments and resident
    parameters come out bitwise those of the run where the CPU updates everything."""
    base, none = _train(0, slow=True, monkeypatch=monkeypatch)
    got, taken = _train(2, slow=True, monkeypatch=monkeypatch)
    assert none == 0 and taken > 0
    assert len(got) == len(base)
    for a, b in zip(got, base):
        assert torch.equal(a, b)


def test_plan_stages_device_updates_where_the_cpu_paces_the_forward():
    """Qwen2.5-14B at 64k tokens (the host tier holds most layers): the plan counts the staging
    (bf16 gradient, master in fp32-master streaming's staging, two fp32 moments, a widening
    buffer, the norm weights' fp32 gradients); long micro-batches, an unknown workload and
    ``device_update_lead=0`` stage none."""
    shape = qwen14b_shape()
    hbm, host = 139 * 2**30, 125 * 2**30
    fast = dict(
        checkpoint_every=2, hbm_cast_weights=True, mlp_tile_tokens=16384,
        stream_fp32_master=True, device_update_lead=2,
    )  # fmt: skip

    def plan(tokens: int | None, **kw):
        opts = EngineOptions(**{**fast, **kw}).resolve(
            clipping=True, cuda=True, single_backward=True
        )
        step = None if tokens is None else StepShape(seq_len=4096, micro_batch_tokens=tokens)
        return plan_memory(shape, step, opts, torch.bfloat16, hbm, host)

    p = plan(65536)
    assert p.device_updates and p.n_hbm * 2 <= shape.num_layers
    line = next(ln for ln in p.gpu_lines if ln.name.startswith("device-update staging"))
    largest = max(shape.layer_numels[p.n_hbm :])
    assert line.nbytes == 10 * largest + 4 * DEVICE_WIDEN_NUMEL + 16 * shape.hidden_size
    assert not plan(65536, device_update_lead=0).device_updates
    assert not plan(None).device_updates
    assert not plan(131072).device_updates  # the update keeps up with a forward this long
    # Without fp32-master streaming the master needs its own staging (14 B/param).
    copy = plan(65536, stream_fp32_master=False)
    line = next(ln for ln in copy.gpu_lines if ln.name.startswith("device-update staging"))
    assert line.nbytes == 14 * max(shape.layer_numels[copy.n_hbm :]) + 4 * DEVICE_WIDEN_NUMEL + (
        16 * shape.hidden_size
    )


def test_staging_goes_first_where_the_step_does_not_fit_with_it():
    """The staging only speeds up a slow host: on a GPU where the step fits without it (and in
    no way auto_fit allows with it) the plan drops it, with a note, before refusing the step;
    where the step does not fit either way, the plan keeps it (the refusal names the same
    lines)."""
    from hf_megatrain.core.plan_search import plan_with_auto_fit  # noqa: PLC0415

    shape = qwen14b_shape()
    step = StepShape(seq_len=4096, micro_batch_tokens=4096)

    def plan(hbm_gib: float, lead: int = 2):
        opts = EngineOptions(
            device_update_lead=lead, resident_layers=0, keep_activations="off",
            keep_attention_outputs="0", auto_fit="off",
        )  # fmt: skip
        ro = opts.resolve(clipping=True, cuda=True, single_backward=True)
        hbm = int(hbm_gib * 2**30)
        return plan_with_auto_fit(shape, step, ro, torch.bfloat16, hbm, 2**40, hbm_layers=0)[0]

    staged, bare = plan(80), plan(80, lead=0)
    assert staged.device_updates and staged.fits and bare.fits
    extra = staged.gpu_total - bare.gpu_total
    assert extra > 0
    tight = (bare.gpu_total + extra / 2) / 2**30  # fits without the staging only
    dropped = plan(tight)
    assert dropped.fits and not dropped.device_updates
    assert dropped.options.device_update_lead == 0
    assert any("fits only without it" in note for note in dropped.notes)
    refused = plan(bare.gpu_total / 2 / 2**30)
    assert not refused.fits and refused.device_updates


def test_a_host_that_sets_the_pace_gets_the_option_named():
    """Turned off, device updates are named to a run whose training thread waited over a
    fifth of the time for the host AdamW; not where the GPU cannot take over (CPU, eager
    updates), where the option is on already, under data parallel, or with short waits."""
    cuda = EngineOptions(device_update_lead=0).resolve(clipping=True, cuda=True)
    hint = device_update_hint(cuda, 3.0, 10.0)
    assert hint is not None and "device_update_lead=2" in hint and "3.0 of the last 10.0 s" in hint
    assert device_update_hint(cuda, 1.5, 10.0) is None  # a fifth or less
    assert device_update_hint(cuda, 3.0, 10.0, world_size=2) is None
    assert device_update_hint(cuda, 3.0, 0.0) is None
    off = EngineOptions(device_update_lead=0)
    assert device_update_hint(off.resolve(clipping=True, cuda=False), 3.0, 10.0) is None
    assert device_update_hint(off.resolve(clipping=False, cuda=True), 3.0, 10.0) is None
    on = EngineOptions().resolve(clipping=True, cuda=True)
    assert device_update_hint(on, 3.0, 10.0) is None
