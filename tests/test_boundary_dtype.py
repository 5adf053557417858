"""bf16 boundary activations: each layer's saved input rounded to bf16 for the backward recompute.

The forward is untouched (the layers still run on the fp32 residual stream), so the loss must be
bitwise the default one; only the backward recomputes from the rounded input, so the gradients
are an approximation whose size these tests bound.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_megatrain import HFMegaTrainer, MegaTrainArguments, prepare_streamed_model
from hf_megatrain.core.streamed_layer import StreamedLayer, _StreamedLayerFunction
from hf_megatrain.core.streaming import StreamingEngine, parse_boundary_dtype
from hf_megatrain.hf.arguments import engine_options
from hf_megatrain.hf.model import streamed_state

from .helpers import LogRecorder, common_args, make_data, tiny_config, tiny_model

BF16 = torch.bfloat16


def _one_step(model, boundary_dtype, monkeypatch):
    """Stream ``model`` (fp32 compute), run one forward/backward; return the loss, every
    gradient by name, and what the layers' backward saw, as (shape, dtype) pairs: the tensors
    they saved, the tensor inputs of their recompute, the input gradients they returned."""
    seen = {"saved": [], "recompute": [], "returned": []}
    in_backward = []

    def run(self, flat_weights, flat_args, spec, leaves, *a, **kw):
        if in_backward:  # the backward recompute
            seen["recompute"] += [_sig(x) for x in flat_args if isinstance(x, torch.Tensor)]
        return real_run(self, flat_weights, flat_args, spec, leaves, *a, **kw)

    def backward(ctx, *grad_outputs):
        in_backward.append(True)
        try:
            grads = real_backward(ctx, *grad_outputs)
        finally:
            in_backward.pop()
        seen["returned"] += [_sig(g) for g in grads if isinstance(g, torch.Tensor)]
        return grads

    real_run, real_backward = StreamedLayer.run, _StreamedLayerFunction.backward
    monkeypatch.setattr(StreamedLayer, "run", run)
    monkeypatch.setattr(_StreamedLayerFunction, "backward", staticmethod(backward))
    prepare_streamed_model(model, "cpu", torch.float32, boundary_dtype=boundary_dtype)
    state = streamed_state(model)
    assert state.engine.boundary_dtype == parse_boundary_dtype(boundary_dtype)
    state.engine.offload_min_numel = 1  # tiny shapes: every float input counts as large
    rows = make_data(4)
    ids = torch.stack([r["input_ids"] for r in rows])

    def pack(t):
        seen["saved"].append(_sig(t))
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {}
    for i, store in enumerate(state.store.layers):
        for rel, g in store.param_views(store.grad).items():
            grads[state.full_name(i, rel)] = g.clone()
    for name, p, _ in state.resident:
        if p.grad is not None:
            grads[name] = p.grad.clone()
    monkeypatch.undo()
    return loss.detach(), grads, seen


def _sig(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(t.shape), t.dtype


def _train(model, tmp_path, name: str, **kw):
    """Train ``model`` 5 steps with HFMegaTrainer; return ``(logs, trainer)``."""
    rec = LogRecorder()
    args = MegaTrainArguments(output_dir=str(tmp_path / name), **common_args(**kw))
    trainer = HFMegaTrainer(model=model, args=args, train_dataset=make_data(), callbacks=[rec])
    # Tiny shapes: every float layer input counts as a large activation (default: >= 1M
    # elements), so the hidden states are rounded (and offloaded) as at real sizes.
    trainer.megatrain.engine.offload_min_numel = 1
    trainer.train()
    return rec.logs, trainer


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "phi3", "qwen3_moe"])
def test_bf16_boundaries_same_forward_close_gradients(arch, monkeypatch):
    cfg = tiny_config(arch)
    model = tiny_model(cfg)
    loss, grads, seen = _one_step(copy.deepcopy(model), "input", monkeypatch)
    loss_b, grads_b, seen_b = _one_step(model, "bfloat16", monkeypatch)
    saved, saved_b = seen["saved"], seen_b["saved"]

    # The forward never sees the rounded copy: the loss is bitwise the default one.
    assert torch.equal(loss_b, loss)
    # Each layer saved its hidden-state input (batch x seq x hidden) in bf16 instead of fp32;
    # everything else it saved (rope cos/sin, masks, router outputs) kept its dtype.
    hidden = (4, make_data(1)[0]["input_ids"].numel(), cfg.hidden_size)
    n_layers = cfg.num_hidden_layers
    assert saved.count((hidden, torch.float32)) >= n_layers
    assert saved_b.count((hidden, BF16)) == n_layers
    assert saved_b.count((hidden, torch.float32)) == saved.count((hidden, torch.float32)) - n_layers
    assert sorted(x for x in saved_b if x[0] != hidden) == sorted(
        x for x in saved if x[0] != hidden
    )
    # Backward casts the saved copy back: every layer recomputes from, and returns the gradient
    # of, a fp32 hidden-state input exactly as by default. (Without the cast most layers would
    # still run, by type promotion, but would return a bf16-rounded input gradient that
    # autograd silently widens: only these dtypes show it.)
    for key in ("recompute", "returned"):
        assert seen_b[key] == seen[key], key
        assert seen_b[key].count((hidden, torch.float32)) >= n_layers, key
        assert (hidden, BF16) not in seen_b[key], key

    # Gradients: the recompute starts from inputs rounded to bf16's 8-bit mantissa (relative
    # error <= 2^-9 ~ 2e-3 per element), and a layer's backward is a smooth function of its
    # input, so the gradients move by errors of that order (observed 1e-3 to 3e-3 on these
    # models, summed over 2 layers); 2e-2 on the global norm of the difference leaves margin
    # yet is 5 orders above fp32 noise. Every parameter tensor must keep its direction
    # (cosine > 0.999): a lost or wrong cast back would scramble whole tensors.
    assert grads_b.keys() == grads.keys()
    flat = torch.cat([g.flatten() for g in grads.values()])
    flat_b = torch.cat([grads_b[k].flatten() for k in grads])
    rel = ((flat_b - flat).norm() / flat.norm()).item()
    assert 0 < rel < 2e-2  # not bitwise: the rounding really happened
    assert flat_b.norm().item() == pytest.approx(flat.norm().item(), rel=2e-2)
    for name, g in grads.items():
        if g.norm() > 0:
            cos = torch.nn.functional.cosine_similarity(g.flatten(), grads_b[name].flatten(), dim=0)
            assert cos > 0.999, (name, cos.item())
        assert grads_b[name].dtype == g.dtype == torch.float32, name


def test_bf16_boundaries_through_trainer(tmp_path):
    """megatrain_boundary_dtype reaches the engine; training stays on the default's track."""
    model = tiny_model(tiny_config("qwen2"))
    base, _ = _train(copy.deepcopy(model), tmp_path, "base")
    got, trainer = _train(model, tmp_path, "bf16", megatrain_boundary_dtype="bf16")
    assert trainer.megatrain.engine.boundary_dtype == BF16
    assert len(got) == len(base) == 5
    # Step 1's loss is a forward from the same weights: bitwise equal; its gradient is not
    # (the rounding happened). Later steps follow gradients a few 1e-3 off (see above), scaled
    # by lr 1e-2 into the weights: losses agree to ~1e-5 (observed 3e-5), norms to ~1e-3.
    assert got[0]["loss"] == base[0]["loss"]
    assert got[0]["grad_norm"] != base[0]["grad_norm"]
    for a, b in zip(base, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-2)
    # The trainer's "auto" HBM plan sizes the boundary activations in bf16 too.
    args = MegaTrainArguments(
        output_dir=str(tmp_path / "plan"),
        megatrain_resident_layers="auto",
        megatrain_plan_seq_len=16,
        megatrain_boundary_dtype="bfloat16",
        **common_args(),
    )
    run = engine_options(args).resolve(clipping=True, cuda=True)
    assert run.boundary_bytes_per_element == 2
    args.megatrain_boundary_dtype = "input"
    run = engine_options(args).resolve(clipping=True, cuda=True)
    assert run.boundary_bytes_per_element == 4


def test_bf16_boundaries_with_offload_halve_host_buffers(tmp_path):
    # Hidden 128: a micro-batch's hidden states (2 x 16 x 128) fill whole 4 KiB pages in bf16,
    # so the page-rounded host buffer shows the halving exactly.
    model = tiny_model(tiny_config("llama", num_hidden_layers=3, hidden_size=128))
    kw = dict(megatrain_boundary_dtype="bfloat16")
    on_device, _ = _train(copy.deepcopy(model), tmp_path, "dev", **kw)
    logs, trainer = _train(model, tmp_path, "off", megatrain_offload_activations=True, **kw)
    engine = trainer.megatrain.engine
    hidden = (2, make_data(1)[0]["input_ids"].numel(), model.config.hidden_size)
    hosts = engine.activations.offloaded()
    buffers = engine.activations.host_buffers()
    residual = {key: h for key, h in hosts.items() if tuple(h.shape) == hidden}
    # One hidden-state buffer per layer, in bf16: half the host (and PCIe) bytes of fp32.
    assert {layer for layer, _ in residual} == set(range(3))
    for key, h in residual.items():
        assert h.dtype == BF16
        assert buffers[key].nbytes == h.numel() * 2
    # Nothing else went to the host: the other inputs (RoPE cos/sin) stay on the device.
    assert hosts.keys() == residual.keys()
    # Offloading only moves the bf16 copy's bytes: training is bitwise that of bf16 boundaries
    # kept on the device.
    assert [(r["loss"], r["grad_norm"]) for r in logs] == [
        (r["loss"], r["grad_norm"]) for r in on_device
    ]


def test_boundary_dtype_names():
    assert parse_boundary_dtype("input") is None
    assert parse_boundary_dtype("float32") is None
    assert parse_boundary_dtype(None) is None
    assert parse_boundary_dtype("bfloat16") is BF16 and parse_boundary_dtype("BF16") is BF16
    assert parse_boundary_dtype(BF16) is BF16
    with pytest.raises(ValueError, match="not one of"):
        parse_boundary_dtype("float16")
    # The arguments refuse an unknown name before anything is built.
    with pytest.raises(ValueError, match="megatrain_boundary_dtype='fp8' is not one of"):
        MegaTrainArguments(output_dir="x", megatrain_boundary_dtype="fp8", **common_args())


def test_boundary_save_dtype_rule():
    """Only the residual stream (a large float input shaped like a layer output) is rounded,
    and only when it is wider than the boundary dtype."""
    hidden = torch.zeros(1, 1 << 10, 1 << 10)
    out = {tuple(hidden.shape)}
    keep = StreamingEngine([], torch.device("cpu"), torch.float32).activations
    assert keep.save_dtype(hidden, out) is None  # default: keep
    stash = StreamingEngine([], torch.device("cpu"), torch.float32, boundary_dtype=BF16).activations
    assert stash.save_dtype(hidden, out) is BF16
    assert stash.save_dtype(hidden.to(BF16), out) is None  # already bf16
    assert stash.save_dtype(torch.zeros(1, 1 << 10, 1 << 10), set()) is None  # cos/sin
    assert stash.save_dtype(torch.zeros(1, 4, 8), {(1, 4, 8)}) is None  # small
    ids = torch.zeros(1, 1 << 10, 1 << 10, dtype=torch.long)
    assert stash.save_dtype(ids, {tuple(ids.shape)}) is None
