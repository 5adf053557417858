"""Slimmer host stores: no gradient slot under eager updates, fp32-master streaming.

Both change where bytes live, not the arithmetic: each run here is compared with the stock
Trainer or with the default store layout on the same tiny model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_megatrain import HFMegaTrainer, MegaTrainArguments, prepare_streamed_model
from hf_megatrain.core.host_store import PAGE, LayerStore, layer_store_bytes, layout_slots
from hf_megatrain.core.options import EngineOptions, StepShape
from hf_megatrain.core.planner import (
    ModelShape,
    host_bytes_per_param,
    plan_memory,
)

from .helpers import (
    assert_logs_match,
    common_args,
    make_data,
    mega_params,
    run_trainer,
    stock_params,
    tiny_config,
    tiny_model,
)

NO_CLIP = dict(max_grad_norm=0.0)


def _round(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def _host_layers(trainer) -> list:
    return [s for s in trainer.megatrain.store.layers if not s.resident]


def _assert_same_params(trainer, other) -> None:
    """Two streamed trainers' parameters, bitwise."""
    a, b = mega_params(trainer), mega_params(other)
    for k in b:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("ga", [1, 2], ids=["ga1", "ga2"])
def test_no_grad_slot_matches_stock_and_slot_path(tmp_path, ga):
    model = tiny_model(tiny_config("llama", num_hidden_layers=3))
    kw = dict(NO_CLIP, gradient_accumulation_steps=ga)
    stock, stock_trainer = run_trainer(copy.deepcopy(model), tmp_path, "stock", mega=False, **kw)
    held, held_trainer = run_trainer(
        copy.deepcopy(model), tmp_path, "held", mega=True, megatrain_host_grads=True, **kw
    )
    slim, trainer = run_trainer(model, tmp_path, "slim", mega=True, **kw)
    # Default with clipping off: no grad slot in any host layer; the old layout on request.
    assert trainer.megatrain.engine.grad_staging
    assert all(s.grad is None and not s.holds_grad for s in _host_layers(trainer))
    assert all(s.grad is not None for s in _host_layers(held_trainer))
    assert trainer.optimizer.eager_updates == 5 * 3
    # grad_norm is still logged: it comes from the running sum taken as each gradient passed.
    assert_logs_match(stock, slim)
    # Against the slot path: the same gradients (same accumulation order into a zeroed fp32
    # buffer) through the same fused AdamW calls, so losses and weights are bitwise equal. The
    # norm sums the same per-layer squares, but in backward order (running sum) instead of
    # layer order: one fp32 rounding apart (observed 8e-8 relative).
    assert [r["loss"] for r in slim] == [r["loss"] for r in held]
    assert [r["grad_norm"] for r in slim] == pytest.approx([r["grad_norm"] for r in held], rel=1e-6)
    got, same = mega_params(trainer), mega_params(held_trainer)
    for k, v in same.items():
        assert torch.equal(got[k], v), k
    for k, v in stock_params(stock_trainer.model).items():
        # fp32, same kernels in the same per-layer order as the stock AdamW (see test_eager_update).
        assert got[k].allclose(v, rtol=1e-4, atol=1e-6), k


def test_store_bytes_per_param(tmp_path):
    """The mmap of each host layer is exactly the claimed parts (page rounded), nothing more."""
    slots, numel, decay = layout_slots([("w", (1000, 37), True), ("b", (37,), False)])
    f32 = _round(numel * 4)
    bf = _round(numel * 2)
    cases = [
        # (compute dtype, hold_grad, stream_master) -> bytes: bf16 18 / 14 / 16 / 12 B/param.
        (torch.bfloat16, True, False, bf + 4 * f32),
        (torch.bfloat16, False, False, bf + 3 * f32),
        (torch.bfloat16, True, True, 4 * f32),
        (torch.bfloat16, False, True, 3 * f32),
        (torch.float32, False, False, 3 * f32),
    ]
    for dtype, hold, master, nbytes in cases:
        store = LayerStore(
            slots, numel, decay, dtype, pin=False, hold_grad=hold, stream_master=master
        )
        assert store.mapped_bytes == store.nbytes == nbytes, (dtype, hold, master)
        assert layer_store_bytes(numel, dtype, True, hold, master) == nbytes
        assert (store.grad is not None) == hold
        # fp32-master streaming (or an fp32 run): the stream *is* the master.
        assert (store.stream is store.master) == (master or dtype == torch.float32)
        views = [store.master, store.exp_avg, store.exp_avg_sq] + ([store.grad] if hold else [])
        ptrs = sorted(v.data_ptr() for v in views)
        assert len(set(ptrs)) == len(ptrs)  # distinct, non-overlapping slots
    for dtype, hold, master, _ in cases:
        expect = 12 + 4 * hold + (2 if dtype == torch.bfloat16 and not master else 0)
        assert host_bytes_per_param(dtype, hold, master) == expect

    # And through the trainer: a bf16 run without clipping holds master + 2 moments + bf16 copy.
    trainer = HFMegaTrainer(
        model=tiny_model(tiny_config("llama")),
        args=MegaTrainArguments(
            output_dir=str(tmp_path / "o"), **common_args(bf16=True, **NO_CLIP)
        ),
        train_dataset=make_data(4),
    )
    for s in _host_layers(trainer):
        assert s.mapped_bytes == _round(s.numel * 2) + 3 * _round(s.numel * 4)


def test_fp32_master_streaming_matches_default_bf16(tmp_path):
    """bf16 on CPU: casting the fp32 master at acquire equals streaming the refreshed bf16 copy."""
    model = tiny_model(tiny_config("qwen2"))
    kw = dict(bf16=True, gradient_accumulation_steps=2)
    base, base_trainer = run_trainer(copy.deepcopy(model), tmp_path, "base", mega=True, **kw)
    got, trainer = run_trainer(
        model, tmp_path, "master", mega=True, megatrain_stream_fp32_master=True, **kw
    )
    layers = _host_layers(trainer)
    assert trainer.megatrain.engine.streams_fp32_master
    assert all(s.stream is s.master and s.stream.dtype == torch.float32 for s in layers)
    # Clipping on (the helpers' default): the grad slot stays, the bf16 copy goes: 16 B/param.
    assert all(s.mapped_bytes == 4 * _round(s.numel * 4) for s in layers)
    # Exact: both round the same fp32 master to bf16 once (round-to-nearest-even, copy_ on the
    # host vs .to() at acquire), so every bf16 weight, loss and update is bitwise the same.
    assert [r["loss"] for r in got] == [r["loss"] for r in base]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in base]
    _assert_same_params(trainer, base_trainer)


def test_both_options_together_match_stock(tmp_path):
    """12 B/param (bf16): no grad slot and no bf16 copy; same training as the default store."""
    model = tiny_model(tiny_config("llama"))
    kw = dict(bf16=True, **NO_CLIP)
    base, _ = run_trainer(copy.deepcopy(model), tmp_path, "base", mega=True, **kw)
    got, trainer = run_trainer(
        model, tmp_path, "slim", mega=True, megatrain_stream_fp32_master=True, **kw
    )
    assert all(s.mapped_bytes == 3 * _round(s.numel * 4) for s in _host_layers(trainer))
    # Bitwise: the same bf16 weights (see above) and the same eager fp32 updates.
    assert [r["loss"] for r in got] == [r["loss"] for r in base]


def test_refused_combinations(tmp_path):
    data = make_data(4)

    def args(**kw):
        return MegaTrainArguments(output_dir=str(tmp_path / "o"), **common_args(**kw))

    # No grad slot requested while clipping (or deferred updates) needs every gradient held.
    with pytest.raises(ValueError, match="megatrain_host_grads=False needs eager layer updates"):
        HFMegaTrainer(model=tiny_model(tiny_config("llama")), args=args(megatrain_host_grads=False))
    with pytest.raises(ValueError, match="megatrain_eager_update=False"):
        HFMegaTrainer(
            model=tiny_model(tiny_config("llama")),
            args=args(megatrain_host_grads=False, megatrain_eager_update=False, **NO_CLIP),
        )
    # A model streamed without slots (load/init_streamed_model(host_grads=False)), then clipped.
    streamed = prepare_streamed_model(
        tiny_model(tiny_config("llama")), "cpu", torch.float32, host_grads=False, clipping=False
    )
    with pytest.raises(ValueError, match="built without gradient slots.*max_grad_norm=0.5"):
        HFMegaTrainer(model=streamed, args=args(), train_dataset=data)
    # The same model trains without clipping.
    trainer = HFMegaTrainer(model=streamed, args=args(max_steps=1, **NO_CLIP), train_dataset=data)
    trainer.train()
    # Clipping after eager updates would only scale the resident parameters: refused.
    with pytest.raises(RuntimeError, match="clipping cannot be combined with eager"):
        trainer.optimizer.clip_grad_norm_(1.0)
    # The staged gradient was consumed by its update: nothing left to read.
    with pytest.raises(RuntimeError, match="holds no gradient"):
        trainer.megatrain.engine.final_grad(0)


def test_no_slot_without_eager_optimizer_is_refused():
    """Engine level: a no-slot store's final gradient needs an eager consumer."""
    model = prepare_streamed_model(
        tiny_model(tiny_config("llama")), "cpu", torch.float32, host_grads=False, clipping=False
    )
    ids = torch.randint(0, 100, (1, 8))
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(RuntimeError, match="no eager optimizer is attached"):
        loss.backward()


# ---- planner -------------------------------------------------------------------------------------
def test_planner_modes_arithmetic():
    numel, n = 1 << 20, 4
    shape = ModelShape((numel,) * n, 0, 8, 16, 32)
    step = StepShape(8, 8, 1)

    def opts(hold: bool, master: bool):
        # Clipping holds host gradients; without it eager updates need none.
        engine = EngineOptions(stream_fp32_master=master, keep_activations="off")
        return engine.resolve(clipping=hold, cuda=True)

    plans = {
        (hold, master): plan_memory(
            shape, step, opts(hold, master), torch.bfloat16, 1 << 40, 1 << 40, hbm_layers=0
        )
        for hold in (True, False)
        for master in (False, True)
    }
    for (hold, master), plan in plans.items():
        layer_line = next(x for x in plan.host_lines if x.name.startswith("host-tier layers"))
        assert layer_line.nbytes == n * layer_store_bytes(numel, torch.bfloat16, True, hold, master)
        assert f"{plan.host_bytes_per_param} B/param" in layer_line.name
        ring = [x for x in plan.host_lines if "staging ring" in x.name]
        # No slot: a 2-layer pinned fp32 staging ring instead (per process).
        assert [x.nbytes for x in ring] == ([] if hold else [2 * 4 * numel])
        stage = [x for x in plan.gpu_lines if "H2D staging" in x.name]
        assert [x.nbytes for x in stage] == ([4 * numel] if master else [])
        # Forward 4 + backward 4 minus the 2 kept: 2 B/param, or 4 when the fp32 master streams.
        assert plan.h2d_bytes_per_step == 6 * numel * (4 if master else 2)
        assert plan.d2h_bytes_per_step == 4 * n * numel
        assert ("no grad slot" in plan.table()) == (not hold)
    per_param = {k: p.host_bytes_per_param for k, p in plans.items()}
    assert per_param == {(True, False): 18, (False, False): 14, (True, True): 16, (False, True): 12}


def test_planner_qwen14b_fits_without_clipping():
    """The capacity target: Qwen2.5-14B, 16k tokens/step at seq 4096, 1x H200 + 125 GiB host."""
    from transformers import Qwen2Config

    from hf_megatrain.hf.model import model_shape_from_config

    # Qwen2.5-14B's config.json values (as in benchmarks/configs/qwen2.5-14b).
    cfg = Qwen2Config(
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False,
    )  # fmt: skip
    shape = model_shape_from_config(cfg, "qwen2.5-14b")
    assert 14.7e9 < shape.total_numel < 14.8e9
    step = StepShape.from_step(4096, 16384)
    gib = 2**30

    def plan(clipping: bool, **changes):
        # No device-update staging (a clipped run's GPU line, tests/test_device_updates.py):
        # the store modes compared here change the host side only.
        o = EngineOptions(keep_activations="off", device_update_lead=0, **changes).resolve(
            clipping=clipping, cuda=True
        )
        return plan_memory(shape, step, o, torch.bfloat16, 139 * gib, 125 * gib)

    clip = plan(True)
    eager = plan(False)
    both = plan(False, stream_fp32_master=True)
    assert not clip.fits and clip.problems[0].tier == "host"
    assert "no clipping" in str(clip.problems[0])
    assert eager.fits and both.fits
    # Same GPU side for the gradient mode (the HBM tier keeps its gradients either way).
    assert eager.n_hbm == clip.n_hbm and eager.gpu_total == clip.gpu_total
    assert both.host_total < eager.host_total < clip.host_total


def _tier(trainer):
    return [s for s in trainer.megatrain.engine.stores if s.resident]


@pytest.mark.parametrize("ga", [1, 2], ids=["ga1", "ga2"])
def test_hbm_cast_weights_match_compute_copies(tmp_path, ga):
    """bf16 on CPU, 2 of 3 layers in the HBM tier: casting their fp32 master when they run
    equals running their refreshed bf16 copy (the same rounding of the same master), bitwise."""
    model = tiny_model(tiny_config("qwen2", num_hidden_layers=3))
    kw = dict(bf16=True, gradient_accumulation_steps=ga, megatrain_resident_layers="2")
    base, base_trainer = run_trainer(
        copy.deepcopy(model), tmp_path, "copy", mega=True, megatrain_keep_activations="off", **kw
    )
    got, trainer = run_trainer(
        model, tmp_path, "cast", mega=True, megatrain_hbm_cast_weights=True, **kw
    )
    tier = _tier(trainer)
    assert len(tier) == 2 and all(s.casts_on_use and s.stream is s.master for s in tier)
    assert not any(s.casts_on_use for s in _tier(base_trainer))
    # No bf16 copy: 16 instead of 18 bytes per parameter.
    assert all(s.device_nbytes == 16 * s.numel for s in tier)
    assert all(s.device_nbytes == 18 * s.numel for s in _tier(base_trainer))
    # Off the GPU "auto" keeps no graph (no plan): every tier layer is cast on use.
    assert not any(layer.forward.keep_graph for layer in trainer.model.model.layers)
    assert [r["loss"] for r in got] == [r["loss"] for r in base]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in base]
    _assert_same_params(trainer, base_trainer)


def test_hbm_cast_weights_keep_copies_for_kept_layers(tmp_path):
    """The tier's layers that keep their activations keep their bf16 copy (the kept graph holds
    the weights); the others are cast on use. Training is the same as the bf16-copy tier's."""
    from hf_megatrain.hf.model import keep_activations  # noqa: PLC0415

    model = tiny_model(tiny_config("llama", num_hidden_layers=3))
    kw = dict(bf16=True, megatrain_resident_layers="2", megatrain_keep_activations="1")
    base, base_trainer = run_trainer(copy.deepcopy(model), tmp_path, "copy", mega=True, **kw)
    got, trainer = run_trainer(
        model, tmp_path, "cast", mega=True, megatrain_hbm_cast_weights=True, **kw
    )
    assert [s.casts_on_use for s in _tier(trainer)] == [True, False]
    assert [layer.forward.keep_graph for layer in trainer.model.model.layers] == [
        False, True, False,
    ]  # fmt: skip
    assert [r["loss"] for r in got] == [r["loss"] for r in base]
    _assert_same_params(trainer, base_trainer)
    # Only the layer with a copy can keep: asking for both is refused, clearly.
    with pytest.raises(ValueError, match="megatrain_hbm_cast_weights off"):
        keep_activations(trainer.model, "2")
    # fp32 runs have no compute-dtype copy to drop: the option changes nothing there.
    fp32 = HFMegaTrainer(
        model=tiny_model(tiny_config("llama", num_hidden_layers=3)),
        args=MegaTrainArguments(
            output_dir=str(tmp_path / "f"),
            **common_args(megatrain_resident_layers="2", megatrain_hbm_cast_weights=True),
        ),
        train_dataset=make_data(4),
    )
    assert not any(s.casts_on_use for s in _tier(fp32))


def test_hbm_cast_weights_with_long_context_options(tmp_path):
    """The set auto_fit turns on for a host-bound long step (Qwen2.5-14B at 64k on one H200:
    the cast tier, fp32-master streaming, MLP tiles, checkpoint segments; activation offload
    beside them in other plans) trains bitwise as the bf16-copy tier with the same options: a
    segment's recompute chain casts its tier layers again, the same rounding of the same
    master. bf16 on CPU, 2 of 4 layers in the tier, segments of 2 (one in the tier, one
    streamed), clipping on."""
    model = tiny_model(tiny_config("qwen2", num_hidden_layers=4))
    kw = dict(
        bf16=True,
        megatrain_resident_layers="2",
        megatrain_stream_fp32_master=True,
        megatrain_mlp_tile_tokens=8,
        megatrain_checkpoint_every=2,
        megatrain_offload_activations=True,
    )
    base, base_trainer = run_trainer(copy.deepcopy(model), tmp_path, "copy", mega=True, **kw)
    got, trainer = run_trainer(
        model, tmp_path, "cast", mega=True, megatrain_hbm_cast_weights=True, **kw
    )
    assert all(s.casts_on_use for s in _tier(trainer)) and len(_tier(trainer)) == 2
    assert not any(s.casts_on_use for s in _tier(base_trainer))
    assert [r["loss"] for r in got] == [r["loss"] for r in base]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in base]
    _assert_same_params(trainer, base_trainer)


def test_fresh_gradient_accumulator_has_zero_gaps():
    """A layer's first gradient is written, not added, into an uninitialized fp32 accumulator:
    every slot is covered by the write and the alignment gaps and tail are zeroed, so the flat
    buffer (its norm, its AdamW update) sees exactly zeros outside the parameters."""
    from types import SimpleNamespace

    from hf_megatrain.core.engine.gradients import scatter_add, zero_gaps

    slots, numel, _ = layout_slots([("a", (3, 5), True), ("b", (7,), False), ("c", (2, 2), True)])
    store = SimpleNamespace(slots=slots)
    flat = torch.full((numel + 9,), float("nan"))
    zero_gaps(store, flat)
    by_name = {"a": torch.ones(3, 5, dtype=torch.bfloat16), "b": None, "c": torch.full((2, 2), 2.0)}
    grads = [by_name[s.name] for s in slots]
    scatter_add(store, flat, grads, first=True)
    want = torch.zeros(numel + 9)
    for slot, g in zip(slots, grads):
        if g is not None:
            want[slot.offset : slot.offset + slot.numel] = g.reshape(-1).float()
    assert torch.equal(flat, want)
    assert sum(s.numel for s in slots) < numel  # the layout has gaps to zero
