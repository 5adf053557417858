"""Unit tests of the systems core: host-store layout and the host AdamW."""

from __future__ import annotations

import pytest
import torch

from hf_megatrain.core.host_store import LayerStore, format_bytes, layout_slots
from hf_megatrain.core.optimizer import HostAdamW
from hf_megatrain.core.streaming import StreamingEngine


def test_layout_slots_decay_first_and_aligned():
    entries = [
        ("norm.weight", (5,), False),
        ("q.weight", (3, 7), True),
        ("q.bias", (3,), False),
        ("k.weight", (4, 4), True),
    ]
    slots, total, decay_numel = layout_slots(entries)
    # Decay parameters first (in their original order), then the no-decay ones.
    assert [s.name for s in slots] == ["q.weight", "k.weight", "norm.weight", "q.bias"]
    assert [s.decay for s in slots] == [True, True, False, False]
    # Every start is aligned to 16 elements; sizes are the true element counts.
    assert [s.offset for s in slots] == [0, 32, 48, 64]
    assert [s.numel for s in slots] == [21, 16, 5, 3]
    # decay_numel ends the decay segment (aligned), total covers the padded last slot.
    assert decay_numel == 48
    assert total == 80
    # No two slots overlap.
    spans = sorted((s.offset, s.offset + s.numel) for s in slots)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_layout_slots_without_decay_group():
    slots, total, decay_numel = layout_slots([("a", (2,), False), ("b", (17,), False)])
    assert decay_numel == 0
    assert [s.offset for s in slots] == [0, 16]
    assert total == 48


def test_layer_store_views_and_segments():
    slots, numel, decay_numel = layout_slots([("w", (4, 8), True), ("b", (8,), False)])
    store = LayerStore(slots, numel, decay_numel, torch.float32, pin=False)
    assert store.segments() == [(True, 0, 32), (False, 32, 48)]
    views = store.param_views(store.master)
    views["w"].fill_(1.0)
    views["b"].fill_(2.0)
    assert store.master[:32].eq(1).all() and store.master[32:40].eq(2).all()
    # Buffers are page-aligned and do not alias each other.
    ptrs = [t.data_ptr() for t in (store.grad, store.master, store.exp_avg, store.exp_avg_sq)]
    assert len(set(ptrs)) == 4 and all(p % 4096 == 0 for p in ptrs)
    # fp32 runs stream the master itself; bf16 runs keep a separate, refreshed copy.
    assert store.stream is store.master
    bf = LayerStore(slots, numel, decay_numel, torch.bfloat16, pin=False)
    bf.master.normal_()
    bf.refresh_stream_copy()
    assert bf.stream.dtype == torch.bfloat16
    torch.testing.assert_close(bf.stream.float(), bf.master.bfloat16().float(), rtol=0, atol=0)


def test_format_bytes():
    assert format_bytes(512) == "512 bytes"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(int(1.5 * 2**30)) == "1.50 GiB"


def _host_and_reference(seed: int = 0):
    """Two streamed layers + two resident tensors, and the same tensors as plain parameters."""
    g = torch.Generator().manual_seed(seed)
    layer_shapes = [
        [("w1", (6, 5), True), ("b1", (6,), False), ("w2", (3, 6), True)],
        [("w", (4, 4), True), ("n", (4,), False)],
    ]
    stores, ref_layers = [], []
    for shapes in layer_shapes:
        slots, numel, decay_numel = layout_slots(shapes)
        store = LayerStore(slots, numel, decay_numel, torch.float32, pin=False)
        views = store.param_views(store.master)
        ref = {}
        for name, shape, decay in shapes:
            views[name].copy_(torch.randn(shape, generator=g))
            ref[name] = (torch.nn.Parameter(views[name].clone()), decay)
        stores.append(store)
        ref_layers.append(ref)
    engine = StreamingEngine(stores, torch.device("cpu"), torch.float32)
    resident = [
        ("emb", torch.nn.Parameter(torch.randn(8, 4, generator=g)), True),
        ("norm", torch.nn.Parameter(torch.randn(4, generator=g)), False),
    ]
    ref_resident = [(n, torch.nn.Parameter(p.detach().clone()), d) for n, p, d in resident]
    return engine, resident, ref_layers, ref_resident, g


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_host_adamw_matches_torch_adamw(max_norm):
    engine, resident, ref_layers, ref_resident, g = _host_and_reference()
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    host = HostAdamW(engine, resident, **hyper)
    ref_decay = [p for layer in ref_layers for p, d in layer.values() if d]
    ref_decay += [p for _, p, d in ref_resident if d]
    ref_no = [p for layer in ref_layers for p, d in layer.values() if not d]
    ref_no += [p for _, p, d in ref_resident if not d]
    ref = torch.optim.AdamW(
        [{"params": ref_decay, "weight_decay": 0.1}, {"params": ref_no, "weight_decay": 0.0}],
        **{k: v for k, v in hyper.items() if k != "weight_decay"},
    )
    all_ref = ref_decay + ref_no
    for step in range(6):
        # Layer 1 gets no gradient on step 2: AdamW must skip it (as torch skips grad=None).
        skip_layer1 = step == 2
        for i, layer in enumerate(ref_layers):
            grads = [torch.randn(p.shape, generator=g) for p, _ in layer.values()]
            if i == 1 and skip_layer1:
                for p, _ in layer.values():
                    p.grad = None
                continue
            by_name = {}
            for (name, (p, _)), gr in zip(layer.items(), grads):
                p.grad = gr.clone()
                by_name[name] = gr
            # The engine takes gradients in slot order (decay first), as StreamedLayer emits them.
            engine.add_grads(i, [by_name[s.name] for s in engine.stores[i].slots])
        for (_, p, _), (_, rp, _) in zip(resident, ref_resident):
            gr = torch.randn(p.shape, generator=g) * 3
            p.grad, rp.grad = gr.clone(), gr.clone()
        # A scheduler writes lr into param_groups; both must read it at every step.
        for opt in (host, ref):
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (1 - step / 10)
        if max_norm is not None:
            norm = host.clip_grad_norm_(max_norm)
            ref_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in all_ref if p.grad is not None], max_norm
            )
            # Norm over the same values in a different summation order: fp32 rounding only.
            torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
            assert norm > max_norm  # the clip path is really exercised
        else:
            ref_norm = torch.linalg.vector_norm(
                torch.cat([p.grad.reshape(-1) for p in all_ref if p.grad is not None])
            )
            torch.testing.assert_close(host.grad_norm(), ref_norm, rtol=1e-6, atol=0)
        host.step()
        ref.step()
        host.zero_grad()
        ref.zero_grad()
        for i, layer in enumerate(ref_layers):
            got = engine.stores[i].param_views(engine.stores[i].master)
            for name, (p, _) in layer.items():
                # Same fused kernel on the same values; the only difference is the clip
                # coefficient applied as the kernel's grad_scale (grad / (1/coef)) instead of an
                # in-place grad *= coef: one rounding of the gradient, ~1e-7 relative in the update.
                torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-7, msg=name)
        for (n, p, _), (_, rp, _) in zip(resident, ref_resident):
            torch.testing.assert_close(p.detach(), rp.detach(), rtol=1e-6, atol=1e-7, msg=n)
    # The step counters advanced per segment: layer 1 skipped one step.
    steps, _ = host.streamed_state()
    assert steps == {0: 6.0, 1: 5.0}


@pytest.mark.parametrize("numel", [1000, (1 << 16) * 300 + 17])  # plain and chunked
def test_squared_norm_is_accurate_on_long_cpu_buffers(numel):
    """A flat layer gradient on the CPU (the whole layer in one buffer): torch's fp32
    vector_norm of 19.7M elements is 2e-3 off; the chunked sum stays within 1e-6 of float64
    (the remainder after the last full chunk included)."""
    from hf_megatrain.core.grad_norm import squared_norm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g) * 1e-3
    exact = torch.linalg.vector_norm(x, dtype=torch.float64).square()
    got = squared_norm(x)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(got.double().item() / exact.item() - 1) < 1e-6
