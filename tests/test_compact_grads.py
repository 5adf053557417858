"""Compact (bf16) host gradient slots: a step of one backward pass of one process makes each
streamed layer's gradient in bf16 (its norm weights' in fp32), so a bf16 slot plus a small fp32
side buffer holds it exactly in 2 instead of 4 bytes per parameter. Each run here is compared
bit for bit with the fp32-slot layout (``compact_host_grads=False``) on the same tiny model."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_megatrain import HFMegaTrainer, MegaTrainArguments, init_streamed_model
from hf_megatrain.core.host_store import PAGE, LayerStore, layer_store_bytes, layout_slots
from hf_megatrain.core.options import EngineOptions, StepShape
from hf_megatrain.core.planner import ModelShape, plan_memory
from hf_megatrain.hf.model import streamed_state

from .helpers import common_args, make_data, mega_params, run_trainer, tiny_config, tiny_model


def _host_layers(trainer) -> list:
    return [s for s in trainer.megatrain.store.layers if not s.resident]


def _losses_norms(logs) -> tuple[list, list]:
    return [r["loss"] for r in logs], [r["grad_norm"] for r in logs]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "qwen3_moe"])
def test_compact_slots_train_bit_for_bit_like_fp32_slots(tmp_path, arch):
    """bf16, clipping on, 4 steps: the same losses, norms and fp32 weights, bitwise. Qwen3's
    per-head q/k norms and Gemma-2's four norms per layer compute in fp32: their gradients take
    the side buffer (rounded into the bf16 slot they would move the norm weights)."""
    model = tiny_model(tiny_config(arch))
    if arch == "qwen3_moe":
        model.config._experts_implementation = "eager"  # (as in test_norm_weights)
    kw = dict(max_steps=4, bf16=True, learning_rate=1e-3, max_grad_norm=0.5)
    wide_logs, wide = run_trainer(
        copy.deepcopy(model), tmp_path, "fp32", mega=True, megatrain_compact_host_grads=False,
        **kw,
    )  # fmt: skip
    logs, compact = run_trainer(model, tmp_path, "bf16", mega=True, **kw)
    assert all(s.grad.dtype == torch.float32 for s in _host_layers(wide))
    layers = _host_layers(compact)
    assert layers and all(s.grad.dtype == torch.bfloat16 for s in layers)
    # Each store is what the plan's host line counts for it (bf16 copy + slot + fp32 state).
    bf16 = torch.bfloat16
    assert [s.nbytes for s in layers] == [
        layer_store_bytes(s.numel, bf16, grad_dtype=bf16) for s in layers
    ]
    assert [s.nbytes for s in _host_layers(wide)] == [
        layer_store_bytes(s.numel, bf16) for s in _host_layers(wide)
    ]
    # The norm weights' slots are the side buffer's, sized to them.
    norms = sum(s.numel for s, _ in layers[0].fp32_grad_slots)
    assert norms > 0 and layers[0].fp32_grad.numel() == norms
    assert _losses_norms(logs) == _losses_norms(wide_logs)
    got, same = mega_params(compact), mega_params(wide)
    for name, value in same.items():
        assert torch.equal(got[name], value), name


def test_accumulating_runs_keep_fp32_slots(tmp_path):
    """Two micro-batches per step sum in fp32: the slots stay fp32 (and training matches the
    explicit fp32 layout bitwise)."""
    model = tiny_model(tiny_config("llama", num_hidden_layers=3))
    kw = dict(max_steps=3, bf16=True, gradient_accumulation_steps=2, per_device_train_batch_size=1)
    logs, trainer = run_trainer(copy.deepcopy(model), tmp_path, "ga2", mega=True, **kw)
    assert all(s.grad.dtype == torch.float32 for s in _host_layers(trainer))
    assert not trainer.megatrain_options.compact_host_grads
    wide_logs, _ = run_trainer(
        model, tmp_path, "wide", mega=True, megatrain_compact_host_grads=False, **kw
    )
    assert _losses_norms(logs) == _losses_norms(wide_logs)


def test_fp32_runs_keep_fp32_slots(tmp_path):
    _, trainer = run_trainer(tiny_model(tiny_config("llama")), tmp_path, "fp32", mega=True,
                             max_steps=1)  # fmt: skip
    assert all(s.grad.dtype == torch.float32 for s in _host_layers(trainer))


def test_model_streamed_for_one_micro_batch_refuses_accumulation(tmp_path):
    """A model streamed for steps of one micro-batch (bf16 slots) and a trainer that accumulates
    two: refused when the trainer is made, naming the fix, before any step."""
    config = tiny_config("llama", num_hidden_layers=2)
    model = init_streamed_model(config, device="cpu", bf16=True, step=StepShape(16, 32, 1))
    assert any(s.compact_grad for s in streamed_state(model).store.layers)
    args = MegaTrainArguments(
        output_dir=str(tmp_path / "out"),
        **common_args(bf16=True, gradient_accumulation_steps=2, per_device_train_batch_size=1),
    )
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2.*compact_host_grads"):
        HFMegaTrainer(model=model, args=args, train_dataset=make_data())


def test_store_bytes_and_plan_lines():
    """16 B/param with a bf16 slot and the bf16 copy (18 with an fp32 slot); the plan's host line,
    mode line and D2H bytes follow the step: compact at grad-accum 1, fp32 at 2."""
    n = 10 * PAGE
    bf16 = torch.bfloat16
    assert layer_store_bytes(n, bf16, grad_dtype=bf16) == 16 * n
    assert layer_store_bytes(n, bf16) == 18 * n
    assert layer_store_bytes(n, bf16, stream_master=True, grad_dtype=bf16) == 14 * n
    shape = ModelShape(
        layer_numels=(n,) * 4, non_layer_numel=0, hidden_size=64, vocab_size=128,
        intermediate_size=128, name="tiny",
    )  # fmt: skip
    for ga, grad_bytes in ((1, 2), (2, 4)):
        step = StepShape(512, 512, ga)
        options = EngineOptions(resident_layers="0").resolve(
            clipping=True, cuda=True, single_backward=ga == 1
        )
        plan = plan_memory(shape, step, options, bf16, 2**40, 2**40, hbm_layers=0)
        host = next(line for line in plan.host_lines if line.name.startswith("host-tier"))
        assert host.nbytes == 4 * layer_store_bytes(
            n, bf16, grad_dtype=options.host_grad_dtype(bf16)
        )
        assert plan.host_bytes_per_param == 14 + grad_bytes
        assert plan.d2h_bytes_per_step == grad_bytes * 4 * n
        assert ("bf16 grad" in plan.table()) == (ga == 1)


def test_widen_grad_puts_fp32_slots_back_over_any_range():
    """``widen_grad`` over ranges that start, end or cut inside a norm weight's slot: the bf16
    slot widened, the fp32 slots' elements from their side buffer."""
    slots, numel, decay = layout_slots(
        [("q.weight", (8, 8), True), ("norm.weight", (8,), False), ("k.weight", (4, 8), True),
         ("post_norm.weight", (8,), False)]
    )  # fmt: skip
    store = LayerStore(slots, numel, decay, torch.bfloat16, pin=False, grad_dtype=torch.bfloat16)
    assert store.compact_grad and store.fp32_grad is None
    store.hold_fp32_grads(["norm.weight", "post_norm.weight"])
    g = torch.Generator().manual_seed(0)
    store.grad.copy_(torch.randn(numel, generator=g))
    store.fp32_grad.copy_(torch.randn(store.fp32_grad.numel(), generator=g))
    expected = store.grad.float()
    for slot, pos in store.fp32_grad_slots:
        expected[slot.offset : slot.offset + slot.numel] = store.fp32_grad[pos : pos + slot.numel]
    norm = next(s for s in slots if s.name == "norm.weight")
    cuts = [0, 3, norm.offset - 1, norm.offset + 3, norm.offset + norm.numel + 2, numel]
    for start in cuts:
        for end in cuts:
            if start < end:
                got = store.widen_grad(start, end, torch.empty(end - start))
                assert torch.equal(got, expected[start:end]), (start, end)


@pytest.mark.parametrize("compact", [True, False], ids=["bf16-slots", "fp32-slots"])
def test_chunked_update_matches_one_call_per_slice(tmp_path, monkeypatch, compact):
    """The CPU update runs chunk by chunk (a compact gradient widened per chunk, each chunk's
    stream copy rounded while in cache); chunks of 64 elements cut the larger slots, and each
    fused call counts the step once: bitwise the same training as one fused call per slice (two
    steps, so the step count's bias correction is checked too), and every stream copy is its
    master rounded to bf16. The chunk stays a multiple of the fused kernel's 16-element work
    units: its vector/scalar split then falls where one call's would (chunks of 7 moved it and
    differed by an ulp)."""
    import hf_megatrain.core.optimizer as optimizer

    model = tiny_model(tiny_config("qwen3", num_hidden_layers=2))
    kw = dict(max_steps=2, bf16=True, learning_rate=1e-3, megatrain_compact_host_grads=compact)
    # Larger than any slice here (checked below): one fused call per slice. (Not 2^40: the
    # widening buffer is allocated at this size where a thread has none yet, 4 TiB, which a
    # fresh test worker then failed to allocate.)
    monkeypatch.setattr(optimizer, "WIDEN_CHUNK", 1 << 22)
    whole_logs, whole = run_trainer(copy.deepcopy(model), tmp_path, "whole", mega=True, **kw)
    monkeypatch.setattr(optimizer, "WIDEN_CHUNK", 64)
    logs, chunked = run_trainer(model, tmp_path, "chunked", mega=True, **kw)
    layers = _host_layers(chunked)
    assert layers and all(s.compact_grad == compact for s in layers)
    assert 64 * 100 < max(s.numel for s in layers) < 1 << 22  # many chunks a layer; or one
    assert _losses_norms(logs) == _losses_norms(whole_logs)
    got, same = mega_params(chunked), mega_params(whole)
    for name, value in same.items():
        assert torch.equal(got[name], value), name
    for store in layers:
        assert torch.equal(store.stream, store.master.to(torch.bfloat16))
