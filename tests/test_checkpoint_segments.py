"""Checkpoint segments: only every k-th decoder layer saves its residual-stream input.

The other layers (followers) get theirs in backward by re-running the segment's forward from
the leader's saved input. That re-run is the forward's computation again (same kernels, same
inputs, same weights), so on the CPU in fp32 losses, gradient norms and weights must be bitwise
those of saving every layer's input (k=1).
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from hf_megatrain import HFMegaTrainer, MegaTrainArguments, prepare_streamed_model
from hf_megatrain.core.options import EngineOptions, OptionError, StepShape
from hf_megatrain.core.planner import (
    ModelShape,
    boundary_activation_bytes,
    plan_memory,
    saved_boundary_layers,
)
from hf_megatrain.hf.arguments import engine_options
from hf_megatrain.hf.model import streamed_state

from .helpers import (
    ARCHS,
    CountAttentionKernels,
    LogRecorder,
    common_args,
    make_data,
    mega_params,
    tiny_config,
    tiny_model,
)
from .test_keep_activations import _count_layer_forwards

BF16 = torch.bfloat16


def _train(model, tmp_path, name: str, k: int, steps: int = 3, setup=None, **kw):
    """Train ``model`` with HFMegaTrainer and ``megatrain_checkpoint_every=k``."""
    rec = LogRecorder()
    args = MegaTrainArguments(
        output_dir=str(tmp_path / name),
        **common_args(max_steps=steps, megatrain_checkpoint_every=k, **kw),
    )
    trainer = HFMegaTrainer(model=model, args=args, train_dataset=make_data(), callbacks=[rec])
    # Tiny shapes: every float layer input counts as a large activation (default: >= 1M
    # elements), so the hidden states are left unsaved (and offloaded) as at real sizes.
    trainer.megatrain.engine.offload_min_numel = 1
    if setup is not None:
        setup(trainer)
    trainer.train()
    return rec.logs, trainer


def _track(logs):
    return [(r["loss"], r["grad_norm"]) for r in logs]


def _assert_same_training(logs, trainer, ref_logs, ref):
    assert len(logs) == len(ref_logs) > 0
    assert _track(logs) == _track(ref_logs)  # bitwise, not approx
    got, want = mega_params(trainer), mega_params(ref)
    assert got.keys() == want.keys()
    for name, v in want.items():
        assert torch.equal(got[name], v), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("ga,offload", [(1, False), (2, True)], ids=["ga1-device", "ga2-offload"])
def test_segments_train_bitwise_like_every_layer(tmp_path, arch, k, ga, offload):
    model = tiny_model(tiny_config(arch, num_hidden_layers=4))
    kw = dict(gradient_accumulation_steps=ga, megatrain_offload_activations=offload)
    ref_logs, ref = _train(copy.deepcopy(model), tmp_path, "k1", 1, **kw)
    logs, trainer = _train(model, tmp_path, f"k{k}", k, **kw)
    assert trainer.megatrain.engine.checkpoint_every == k
    _assert_same_training(logs, trainer, ref_logs, ref)


@pytest.mark.parametrize(
    "cfg_kw,kw",
    [({"attention_dropout": 0.1}, {}), ({}, {"megatrain_mlp_tile_tokens": 8})],
    ids=["dropout", "mlp-tiling"],
)
def test_segments_with_dropout_and_mlp_tiles(tmp_path, cfg_kw, kw):
    """Dropout: the chain re-runs each layer with that layer's forward RNG state (the engine
    preserves it when the config has dropout), so the recomputed masks are the forward's.
    MLP tiling: the chain runs the tiled MLP as the forward did."""
    model = tiny_model(tiny_config("llama", num_hidden_layers=4, **cfg_kw))
    ref_logs, ref = _train(copy.deepcopy(model), tmp_path, "k1", 1, **kw)
    logs, trainer = _train(model, tmp_path, "k3", 3, **kw)
    assert trainer.megatrain.engine.preserve_rng == bool(cfg_kw)
    _assert_same_training(logs, trainer, ref_logs, ref)


def test_segments_with_clipping_off_and_eager_updates(tmp_path):
    """Eager per-layer updates during backward (no clipping, no host grad slot) still see the
    same gradients: the chain streams layer weights that are not updated until their own
    gradient is final (the leader's backward comes last in its segment)."""
    model = tiny_model(tiny_config("llama", num_hidden_layers=3))
    kw = dict(max_grad_norm=0.0, megatrain_offload_activations=True)
    ref_logs, ref = _train(copy.deepcopy(model), tmp_path, "k1", 1, **kw)
    logs, trainer = _train(model, tmp_path, "k2", 2, **kw)
    _assert_same_training(logs, trainer, ref_logs, ref)


def test_segments_with_bf16_boundaries(tmp_path):
    """Only the leaders' inputs are saved (rounded to bf16, offloaded); followers recompute
    from the rounded leader input in fp32. The forward is untouched (step 1's loss bitwise the
    default); the gradients are as approximate as with bf16 boundaries on every layer."""
    model = tiny_model(tiny_config("qwen2", num_hidden_layers=4, hidden_size=128))
    kw = dict(megatrain_offload_activations=True)
    exact, _ = _train(copy.deepcopy(model), tmp_path, "fp32", 1, **kw)
    every, _ = _train(
        copy.deepcopy(model), tmp_path, "bf16-k1", 1, megatrain_boundary_dtype="bfloat16", **kw
    )
    logs, trainer = _train(model, tmp_path, "bf16-k2", 2, megatrain_boundary_dtype="bf16", **kw)
    engine = trainer.megatrain.engine
    assert engine.boundary_dtype == BF16 and engine.checkpoint_every == 2
    hidden = (2, make_data(1)[0]["input_ids"].numel(), model.config.hidden_size)
    residual = {key: h for key, h in engine.activations.offloaded().items() if h.shape == hidden}
    assert {layer for layer, _ in residual} == {0, 2}  # leaders only
    assert all(h.dtype == BF16 for h in residual.values())
    assert logs[0]["loss"] == every[0]["loss"] == exact[0]["loss"]
    assert logs[0]["grad_norm"] != exact[0]["grad_norm"]  # the rounding happened
    for ref in (every, exact):
        for a, b in zip(ref, logs):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-2)


def _expected_forwards(n_layers: int, k: int, kept: frozenset[int] = frozenset()) -> dict:
    """Forward runs of each layer per micro-batch: the forward, the backward recompute (none for
    a kept layer), and one chain run for every layer of a segment but its last (the chain that
    the segment's last layer starts re-makes the inputs of all the others' successors)."""
    counts, segment = {}, []

    def close():
        for i in segment:
            counts[i] = 2 + (i != segment[-1])
        segment.clear()

    for i in range(n_layers):
        if i in kept:
            close()
            counts[i] = 1
            continue
        if i % k == 0:
            close()
        segment.append(i)
    close()
    return counts


def test_expected_forwards_formula():
    assert _expected_forwards(4, 1) == {0: 2, 1: 2, 2: 2, 3: 2}
    assert _expected_forwards(4, 2) == {0: 3, 1: 2, 2: 3, 3: 2}
    assert _expected_forwards(4, 3) == {0: 3, 1: 3, 2: 2, 3: 2}
    assert _expected_forwards(4, 2, frozenset({1})) == {0: 2, 1: 1, 2: 3, 3: 2}
    # Extra forwards per segment of k layers: k - 1, i.e. (k - 1) / k per layer.
    for k in (2, 4, 8):
        extra = sum(_expected_forwards(8 * k, k).values()) - 2 * 8 * k
        assert extra == 8 * (k - 1)


@pytest.mark.parametrize("k", [2, 3])
def test_followers_recomputed_from_chain(tmp_path, k):
    """Followers run their forward from the chain, not from a saved input: count the layer
    forwards, and check that only leaders have an offloaded hidden-state buffer."""
    n_layers, ga = 4, 2
    model = tiny_model(tiny_config("llama", num_hidden_layers=n_layers))
    kw = dict(gradient_accumulation_steps=ga, megatrain_offload_activations=True)
    _, trainer = _train(model, tmp_path, "warm", k, steps=1, **kw)
    counts = _count_layer_forwards(trainer.model)
    trainer.args.max_steps = 2
    trainer.train()
    n_micro = 2 * ga
    assert counts == {i: n * n_micro for i, n in _expected_forwards(n_layers, k).items()}
    engine = trainer.megatrain.engine
    hidden = (2, make_data(1)[0]["input_ids"].numel(), model.config.hidden_size)
    leaders = set(range(0, n_layers, k))
    offloaded = engine.activations.offloaded()
    residual = {layer for (layer, _), h in offloaded.items() if h.shape == hidden}
    assert residual == leaders
    # Only the residual stream is offloaded: the other inputs (RoPE cos/sin, one tensor shared
    # by every layer) stay on the device, saved by reference.
    assert all(h.shape == hidden for h in offloaded.values())
    # Evaluation (no_grad) runs each layer once and builds no segment.
    counts.clear()
    engine.reset_segments()
    trainer.model.eval()
    ids = torch.stack([r["input_ids"] for r in make_data(2)])
    with torch.no_grad():
        trainer.model(input_ids=ids)
    assert counts == dict.fromkeys(range(n_layers), 1)
    assert engine.segments.open_segment is None


def test_segments_with_kept_layers(tmp_path):
    """A layer that keeps its graph is never a follower and ends its segment: the next layer
    saves its input (here layer 1 is kept, so layer 0 is a segment of one)."""
    model = tiny_model(tiny_config("llama", num_hidden_layers=4))
    tier = dict(megatrain_resident_layers="2", megatrain_keep_activations="1")
    ref_logs, ref = _train(copy.deepcopy(model), tmp_path, "k1", 1, **tier)
    logs, trainer = _train(model, tmp_path, "k2", 2, **tier)
    assert [layer.forward.keep_graph for layer in trainer.model.model.layers] == [
        False, True, False, False,
    ]  # fmt: skip
    _assert_same_training(logs, trainer, ref_logs, ref)
    counts = _count_layer_forwards(trainer.model)
    trainer.args.max_steps = 1
    trainer.train()
    assert counts == _expected_forwards(4, 2, frozenset({1}))


def _stream(model, k: int, **options):
    prepare_streamed_model(model, "cpu", torch.float32, checkpoint_every=k, **options)
    engine = streamed_state(model).engine
    assert engine.checkpoint_every == k
    engine.offload_min_numel = 1
    model.train()
    ids = torch.stack([r["input_ids"] for r in make_data(2)])
    return engine, ids


def _one_step(model, k: int, offload: bool = False):
    """One forward/backward on the streamed ``model``: loss, layer grads, resident grads."""
    engine, ids = _stream(model, k, offload_activations=offload)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    state = streamed_state(model)
    grads = torch.cat([store.grad.clone() for store in state.store.layers])
    resident = [p.grad.clone() for _, p, _ in state.resident if p.grad is not None]
    return loss.detach(), grads, resident


@pytest.mark.parametrize("arch", ARCHS)
def test_segments_bitwise_every_arch(arch, monkeypatch):
    """Per-layer masks (Gemma3's sliding/full layers), MoE router outputs, fused projections:
    one step with k=2 is bitwise k=1, and every follower's input did come from a chain."""
    from hf_megatrain.core import streamed_layer  # noqa: PLC0415

    n_layers = 2 if arch == "gemma3_text" else 4  # (Gemma3's config lists 2 layer types)
    model = tiny_model(tiny_config(arch, num_hidden_layers=n_layers))
    ref = _one_step(copy.deepcopy(model), 1)
    chains = []
    real = streamed_layer.segment_input
    monkeypatch.setattr(
        streamed_layer, "segment_input", lambda seg, pos: chains.append(pos) or real(seg, pos)
    )
    got = _one_step(model, 2, offload=True)
    assert chains == [1] * (n_layers // 2)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert len(got[2]) == len(ref[2]) and all(map(torch.equal, got[2], ref[2]))


def test_only_leaders_save_the_hidden_state(monkeypatch):
    """What the layers' Functions save: with bf16 boundaries the saved hidden states are the
    only bf16 tensors saved, one per leader (4 layers, k=2: 2), none kept for followers; and
    the chain's recomputed inputs are fp32, the original input dtype."""
    from hf_megatrain.core import streamed_layer  # noqa: PLC0415

    model = tiny_model(tiny_config("llama", num_hidden_layers=4))
    engine, ids = _stream(model, 2, boundary_dtype="bfloat16")
    saved = []
    made = []
    real = streamed_layer.segment_input

    def segment_input(seg, pos):
        x = real(seg, pos)
        made.append((pos, x.dtype, tuple(x.shape)))
        return x

    monkeypatch.setattr(streamed_layer, "segment_input", segment_input)
    segments = []
    real_add = engine.segments.add

    def segment_add(entry, follow):
        seg, pos = real_add(entry, follow)
        segments.append(seg)
        return seg, pos

    monkeypatch.setattr(engine.segments, "add", segment_add)

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    hidden = (2, ids.shape[1], model.config.hidden_size)
    assert saved.count((hidden, BF16)) == 2
    assert len({id(seg) for seg in segments}) == 2 and engine.segments.open_segment is None
    loss.backward()
    assert made == [(1, torch.float32, hidden), (1, torch.float32, hidden)]
    # Each leader's backward dropped its segment's record (no tensor outlives the backward).
    assert all(seg.done and not seg.entries and not seg.cache for seg in segments)


def test_backward_twice_is_refused():
    model = tiny_model(tiny_config("llama", num_hidden_layers=2))
    _, ids = _stream(model, 2)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_checkpoint_every_validation_and_plumbing(tmp_path):
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="megatrain_checkpoint_every"):
            MegaTrainArguments(
                output_dir=str(tmp_path / "bad"), megatrain_checkpoint_every=bad, **common_args()
            )
    args = MegaTrainArguments(
        output_dir=str(tmp_path / "plan"),
        megatrain_resident_layers="auto",
        megatrain_plan_seq_len=16,
        megatrain_checkpoint_every=4,
        **common_args(),
    )
    assert engine_options(args).resolve(clipping=True, cuda=True).checkpoint_every == 4


def test_planner_counts_saved_inputs_and_segment_cache():
    # 7B's shape at 448k tokens: with every fp32 layer input offloaded the host store is short,
    # and a segment length makes it fit.
    h, i, kv, t, n = 3584, 18944, 512, 458752, 28
    shape = ModelShape((233_000_000,) * n, 1_090_000_000, h, 152_064, i, kv_size=kv)
    step = StepShape(seq_len=t, micro_batch_tokens=t)

    def opts(**changes):
        # No clipping (no host gradient slots), fp32 masters streamed, nothing kept.
        engine = EngineOptions(keep_activations="off", stream_fp32_master=True, **changes)
        return engine.resolve(clipping=False, cuda=True)

    for k in (1, 2, 3, 4, 28, 40):
        o = opts(checkpoint_every=k)
        assert saved_boundary_layers(shape, o) == math.ceil(n / k)
        assert boundary_activation_bytes(shape, step, o) == t * h * 4 * math.ceil(n / k)
    hbm, host = 139 * 2**30, 124 * 2**30
    off = opts(mlp_tile_tokens=16384, offload_activations=True)
    p1 = plan_memory(shape, step, off, BF16, hbm, host)
    off4 = opts(mlp_tile_tokens=16384, offload_activations=True, checkpoint_every=4)
    p4 = plan_memory(shape, step, off4, BF16, hbm, host)
    # Host: the offloaded line counts one saved input per segment.
    host_line = next(ln for ln in p4.host_lines if ln.name.startswith("offloaded boundary"))
    assert host_line.nbytes == t * h * 4 * 7
    assert "7 saved (1 per 4 of 28 layers)" in host_line.name
    # GPU: k - 1 recomputed fp32 inputs cached during a segment's backward, in the place of
    # the two offload buffers (in use + prefetched: the chain's own output is the input in use):
    # max(2, k - 1) inputs in all, never both.
    cache = next(ln for ln in p4.gpu_lines if ln.name.startswith("checkpoint segment"))
    buffers = next(ln for ln in p4.gpu_lines if ln.name.startswith("boundary activations"))
    assert buffers.nbytes == 2 * t * h * 4 and cache.nbytes == (3 - 2) * t * h * 4
    assert not any(ln.name.startswith("checkpoint segment") for ln in p1.gpu_lines)
    p3 = plan_memory(shape, step, opts(mlp_tile_tokens=16384, offload_activations=True,
                                       checkpoint_every=3), BF16, hbm, host)  # fmt: skip
    assert not any(ln.name.startswith("checkpoint segment") for ln in p3.gpu_lines)
    # Not fitting in host RAM with every layer saved, a segment length that fits is advised.
    assert not p1.fits and p1.checkpoint_every_fit is not None
    assert f"checkpoint_every={p1.checkpoint_every_fit}:" in str(p1.problems[-1])
    assert dict(p1.problems[-1].advice.options) == {"checkpoint_every": p1.checkpoint_every_fit}
    fit = opts(mlp_tile_tokens=16384, offload_activations=True,
               checkpoint_every=p1.checkpoint_every_fit)  # fmt: skip
    assert plan_memory(shape, step, fit, BF16, hbm, host).fits
    # PCIe: with k=4, layers 0-1 of each segment stream in a second time in backward (chain
    # then own backward; layers 2-3 are still in the double buffer); k=2 streams nothing more.
    n_host = p4.n_host
    again = [i for s in range(0, n, 4) for i in (s, s + 1) if i >= n - n_host]
    p4_as_1 = plan_memory(shape, step, off, BF16, hbm, host, hbm_layers=p4.n_hbm)
    assert p4.h2d_bytes_per_step - p4_as_1.h2d_bytes_per_step == len(again) * 233_000_000 * 4
    off2 = opts(mlp_tile_tokens=16384, offload_activations=True, checkpoint_every=2)
    p2 = plan_memory(shape, step, off2, BF16, hbm, host)
    p2_as_1 = plan_memory(shape, step, off, BF16, hbm, host, hbm_layers=p2.n_hbm)
    assert p2.h2d_bytes_per_step == p2_as_1.h2d_bytes_per_step
    # On the device (no offload): the boundary line shrinks the same way.
    dev4 = plan_memory(shape, step, opts(mlp_tile_tokens=16384, checkpoint_every=4), BF16,
                       hbm, host)  # fmt: skip
    line = next(ln for ln in dev4.gpu_lines if ln.name.startswith("boundary activations"))
    assert line.nbytes == t * h * 4 * 7


def test_segments_with_lora_on_a_frozen_base(tmp_path):
    """Resident adapters over a frozen streamed base: the chain binds the adapters as the
    forward did; the adapters train bitwise as with k=1."""
    peft = pytest.importorskip("peft")
    base = tiny_model(tiny_config("llama", num_hidden_layers=4))
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ref_logs, ref = _train(copy.deepcopy(model), tmp_path, "k1", 1)
    logs, trainer = _train(model, tmp_path, "k2", 2, megatrain_offload_activations=True)
    assert _track(logs) == _track(ref_logs)
    hidden = (2, make_data(1)[0]["input_ids"].numel(), base.config.hidden_size)
    offloaded = trainer.megatrain.engine.activations.offloaded()
    assert {layer for (layer, _), h in offloaded.items() if h.shape == hidden} == {0, 2}
    want = {n: p for n, p in ref.model.named_parameters() if p.requires_grad}
    got = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and got
    for n, p in got.items():
        assert torch.equal(p.detach(), want[n].detach()), n


def test_plan_cli_checkpoint_every(capsys):
    """Qwen2.5-7B on one 512k-token sequence, activations offloaded: bf16 boundaries alone
    leave the host ~27 GiB short; with segments of 2 the plan fits."""
    from pathlib import Path  # noqa: PLC0415

    from hf_megatrain.cli import main  # noqa: PLC0415

    cfg = Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / "qwen2.5-7b"
    argv = [
        "plan", str(cfg), "--seq-len", "524288", "--tokens-per-step", "524288",
        "--mlp-tile-tokens", "16384", "--offload-activations", "--no-clip",
        "--stream-fp32-master", "--hbm-gib", "139", "--host-gib", "124", "--no-search",
        "--boundary-dtype", "bfloat16",
    ]  # fmt: skip
    with pytest.raises(SystemExit, match="--checkpoint-every 2: .*this plan fits"):
        main([*argv, "--auto-fit", "off"])
    # By default (auto_fit exact) training turns that on by itself; plan says so.
    assert main(argv) == 0
    assert "training turns on --checkpoint-every 2" in capsys.readouterr().out
    assert main([*argv, "--checkpoint-every", "2"]) == 0
    out = capsys.readouterr().out
    assert "x 14 saved (1 per 2 of 28 layers)" in out
    # Segments of 2 with bf16 boundaries cache nothing beyond the boundary lines: a follower's
    # re-made fp32 input is the one in use that they count. Segments of 3 cache one more.
    assert "checkpoint segment backward" not in out
    assert main([*argv, "--checkpoint-every", "3"]) == 0
    assert "checkpoint segment backward: up to 1 recomputed layer inputs" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--checkpoint-every 0 must be an integer >= 1"):
        main([*argv, "--checkpoint-every", "0"])


# Families and features the attention-output tests run over: a dense model, an MoE, a sliding
# window, bf16 under autocast, and offload with MLP tiles.
ATTENTION_OUTPUT_CASES = pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("llama", {}),
        ("qwen3_moe", {}),
        ("mistral", {}),
        ("qwen2", {"bf16": True}),
        ("llama", {"megatrain_offload_activations": True, "megatrain_mlp_tile_tokens": 8}),
    ],
    ids=["llama", "qwen3_moe", "mistral", "qwen2-bf16", "llama-offload-tiles"],
)


@ATTENTION_OUTPUT_CASES
def test_chain_keeps_attention_outputs_for_the_recompute(tmp_path, arch, extra):
    """megatrain_chain_attention_outputs: a segment's chain (which re-runs its leader and
    followers but the last in backward) keeps the fused attention kernel's outputs of its last
    N layers, and their recompute takes them instead of running the kernel. The chain runs the
    kernel as the recompute would (under grad: the log-sum-exp included), so training is
    bitwise the same (fp32, and bf16 under autocast); per step the kernel runs N times fewer."""
    model = tiny_model(tiny_config(arch, num_hidden_layers=3))
    runs = {}
    for keep in (0, 1, 2, 5):
        counter = CountAttentionKernels()
        with counter:
            logs, trainer = _train(
                copy.deepcopy(model), tmp_path, f"chain-{keep}", k=3, steps=2,
                megatrain_chain_attention_outputs=keep, megatrain_keep_attention_outputs="off",
                **extra,
            )  # fmt: skip
        runs[keep] = (_track(logs), mega_params(trainer), counter.calls)
    for keep in (1, 2, 5):
        assert runs[keep][0] == runs[0][0]
        for name, value in runs[0][1].items():
            assert torch.equal(runs[keep][1][name], value), (keep, name)
    # One segment of 3 layers, 2 steps: 3 forwards, the chain re-runs layers 0 and 1, and 3
    # recomputes less those that got the chain's outputs (at most the chain's 2 layers).
    assert [runs[k][2] for k in (0, 1, 2, 5)] == [2 * 8, 2 * 7, 2 * 6, 2 * 6]


@ATTENTION_OUTPUT_CASES
def test_chain_reads_the_attention_outputs_the_forward_kept(tmp_path, arch, extra):
    """Layers whose forward kept the fused attention kernel's outputs (keep_attention_outputs)
    hand them to the segment chain too (``KeptAttention.peek``), then to their own recompute:
    the kernel runs once per layer and step, in the forward, and training is bitwise that of
    running it in the chain and the recompute (fp32, and bf16 under autocast)."""
    model = tiny_model(tiny_config(arch, num_hidden_layers=3))
    runs = {}
    for keep in ("off", "all"):
        counter = CountAttentionKernels()
        with counter:
            logs, trainer = _train(
                copy.deepcopy(model), tmp_path, f"kept-{keep}", k=3, steps=2,
                megatrain_keep_attention_outputs=keep, **extra,
            )  # fmt: skip
        runs[keep] = (_track(logs), mega_params(trainer), counter.calls)
    assert runs["all"][0] == runs["off"][0]
    for name, value in runs["off"][1].items():
        assert torch.equal(runs["all"][1][name], value), name
    # One segment of 3 layers, 2 steps. Off: 3 forwards, the chain's 2 and 3 recomputes. All:
    # the 3 forwards only.
    assert (runs["off"][2], runs["all"][2]) == (2 * 8, 2 * 3)


def test_chain_attention_outputs_option():
    """Counted only where a segment chain exists and its layers recompute with the early stop
    from inputs saved as they are; at most checkpoint_every - 1; negative counts refused."""

    def layers(**kw) -> int:
        return EngineOptions(**kw).resolve(clipping=True, cuda=True).chain_attention_layers

    assert layers(chain_attention_outputs=3) == 0  # no segments
    assert layers(chain_attention_outputs=3, checkpoint_every=6) == 3
    assert layers(chain_attention_outputs=9, checkpoint_every=4) == 3
    assert layers(chain_attention_outputs=2, checkpoint_every=4, boundary_dtype="bfloat16") == 0
    assert layers(chain_attention_outputs=2, checkpoint_every=4, recompute_early_stop=False) == 0
    with pytest.raises(OptionError, match="chain_attention_outputs"):
        EngineOptions(chain_attention_outputs=-1)


def test_planner_counts_the_chain_attention_outputs():
    """The plan counts what the chain keeps: up to checkpoint_every - 1 layers of attention
    output (heads x head_dim in the compute dtype + 4 B per head per token), none where the
    option does nothing (no segments, inputs saved rounded, attention outside SDPA)."""
    from hf_megatrain.core.activation_memory import attention_output_bytes_per_token
    from hf_megatrain.core.planner import GIB

    shape = ModelShape(
        layer_numels=(1000,) * 6, non_layer_numel=1000, hidden_size=64, vocab_size=100,
        intermediate_size=128, kv_size=32, head_dim=16, num_heads=4,
    )  # fmt: skip
    step = StepShape(seq_len=512, micro_batch_tokens=512)

    def kept(shape=shape, **kw) -> int:
        o = EngineOptions(keep_attention_outputs="off", keep_activations="off", **kw).resolve(
            clipping=True, cuda=True
        )
        plan = plan_memory(shape, step, o, BF16, 8 * GIB, 8 * GIB, hbm_layers=0)
        return sum(ln.nbytes for ln in plan.gpu_lines if "chain layers" in ln.name)

    per_layer = 512 * attention_output_bytes_per_token(shape, BF16)
    assert per_layer == 512 * (4 * 16 * 2 + 4 * 4)
    assert kept(checkpoint_every=3, chain_attention_outputs=1) == per_layer
    assert kept(checkpoint_every=3, chain_attention_outputs=4) == 2 * per_layer
    assert kept(checkpoint_every=3) == 0
    assert kept(chain_attention_outputs=2) == 0
    assert kept(checkpoint_every=3, chain_attention_outputs=2, boundary_dtype="bfloat16") == 0
    eager = replace(shape, sdpa_attention=False)
    assert kept(eager, checkpoint_every=3, chain_attention_outputs=2) == 0


@pytest.mark.parametrize(
    ("layers", "every", "attention", "chain"),
    [(28, 6, 28, 0), (28, 6, 0, 0), (28, 6, 2, 5), (12, 4, 5, 3), (7, 1, 3, 0), (10, 3, 10, 2)],
)
def test_planner_counts_the_offloaded_segment_peak_once(layers, every, attention, chain):
    """With fp32 boundaries offloaded, a segment's backward holds either the two offload
    buffers or its chain's cached inputs (max(2, len - 1) layer inputs), the attention outputs
    kept by layers up to its last (the later ones are freed by then) and its chain's own kept
    outputs (for layers without forward-kept ones). The plan's lines for these come to the
    largest such segment, not their sum over the step (the sum over-counted the H200's
    base262k row by 14 GiB of 74)."""
    from hf_megatrain.core.activation_memory import attention_output_bytes_per_token
    from hf_megatrain.core.planner import GIB

    h = 64
    shape = ModelShape(
        layer_numels=(1000,) * layers, non_layer_numel=1000, hidden_size=h, vocab_size=100,
        intermediate_size=128, kv_size=32, head_dim=16, num_heads=4,
    )  # fmt: skip
    t = 512
    step = StepShape(seq_len=t, micro_batch_tokens=t)
    o = EngineOptions(
        keep_attention_outputs=str(attention) if attention else "off", keep_activations="off",
        checkpoint_every=every, chain_attention_outputs=chain, offload_activations=True,
    ).resolve(clipping=True, cuda=True)  # fmt: skip
    plan = plan_memory(shape, step, o, BF16, 8 * GIB, 8 * GIB, hbm_layers=0)
    counted = sum(
        ln.nbytes
        for ln in plan.gpu_lines
        if ln.name.startswith(("boundary activations", "checkpoint segment", "attention outputs"))
    )
    out = attention_output_bytes_per_token(shape, BF16)
    kept_from = layers - attention
    segments = [range(s, min(s + every, layers)) for s in range(0, layers, every)]

    def held(seg: range) -> int:
        inputs = max(2, len(seg) - 1) * t * h * 4
        kept = sum(1 for i in range(seg[-1] + 1) if i >= kept_from)
        chained = [i for i in seg[:-1][-min(chain, every - 1) :] if chain and i < kept_from]
        return inputs + (kept + len(chained)) * t * out

    assert plan.attention_layers == attention
    assert counted == max(held(seg) for seg in segments)
    summed = (2 + every - 1) * t * h * 4 + (attention + min(chain, every - 1)) * t * out
    assert counted < summed if every > 1 else counted == summed  # (the old sum)


@pytest.mark.parametrize(("layers", "every", "attention", "chain"), [(28, 6, 9, 1), (12, 4, 5, 1)])
def test_chains_below_the_peak_keep_more_outputs(layers, every, attention, chain):
    """``chain_attention_outputs`` N sets the step's joint peak; a segment whose backward holds
    less (no forward-kept outputs alive yet: the early layers) keeps more of its chain's outputs,
    up to all its chain layers, while it stays under that peak (``MemoryPlan.
    chain_output_counts``, which the builder hands the engine). The plan's lines stay those of N
    per segment; each kept output spares an attention forward (``recompute_flops``)."""
    from hf_megatrain.core.activation_memory import attention_output_bytes_per_token
    from hf_megatrain.core.planner import GIB, recompute_flops

    h, t = 64, 512
    shape = ModelShape(
        layer_numels=(1000,) * layers, non_layer_numel=1000, hidden_size=h, vocab_size=100,
        intermediate_size=128, kv_size=32, head_dim=16, num_heads=4,
    )  # fmt: skip
    step = StepShape(seq_len=t, micro_batch_tokens=t)

    def planned(chain: int):
        o = EngineOptions(
            keep_attention_outputs=str(attention), keep_activations="off", checkpoint_every=every,
            chain_attention_outputs=chain, offload_activations=True,
        ).resolve(clipping=True, cuda=True)  # fmt: skip
        return plan_memory(shape, step, o, BF16, 8 * GIB, 8 * GIB, hbm_layers=0)

    plan = planned(chain)
    counts = plan.chain_output_counts
    out = attention_output_bytes_per_token(shape, BF16)
    kept_from = layers - attention
    segments = [range(s, min(s + every, layers)) for s in range(0, layers, every)]
    assert sorted(counts) == [seg[0] for seg in segments]

    def held(seg: range, n: int) -> int:  # as the test above: inputs, kept and chain outputs
        inputs = max(2, len(seg) - 1) * t * h * 4
        kept = sum(1 for i in range(seg[-1] + 1) if i >= kept_from)
        chained = [i for i in seg[:-1][len(seg) - 1 - n :] if n and i < kept_from]
        return inputs + (kept + len(chained)) * t * out

    peak = max(held(seg, chain) for seg in segments)
    for seg in segments:
        assert chain <= counts[seg[0]] <= len(seg) - 1
        if seg[-1] < kept_from:  # (no forward-kept output of its own: the filled ones)
            assert held(seg, counts[seg[0]]) <= peak
    assert max(counts.values()) > chain  # the early segments keep more
    # The plan's lines for them stay those of N per segment: the peak is not raised.
    counted = sum(
        ln.nbytes
        for ln in plan.gpu_lines
        if ln.name.startswith(("boundary activations", "checkpoint segment", "attention outputs"))
    )
    assert counted == peak
    # Each chain-kept output (of a layer without a forward-kept one) spares one attention
    # forward: 2 x tokens x sequence x heads x head_dim FLOPs.
    spared = sum(
        1 for seg in segments for i in seg[:-1][len(seg) - 1 - counts[seg[0]] :] if i < kept_from
    )
    assert spared > sum(
        1 for seg in segments for i in seg[:-1][len(seg) - 1 - chain :] if i < kept_from
    )
    attention_flops = 2.0 * t * t * 4 * 16
    assert recompute_flops(planned(0)) - recompute_flops(plan) == spared * attention_flops


def test_engine_keeps_chain_outputs_per_segment(tmp_path, monkeypatch):
    """The engine's per-segment chain counts (what the builder hands it from
    ``MemoryPlan.chain_output_counts`` on a GPU; on the CPU no plan is made, so given here):
    8 layers in segments of 4, the last 3 keeping their forward outputs; the first segment's
    chain keeps all 3 of its layers' outputs, the second 1 (layer 6: forward-kept already).
    Bitwise the training without chain outputs; per step the kernel runs 3 times fewer."""
    from hf_megatrain.core import builder  # noqa: PLC0415

    real = builder.StreamingEngine

    model = tiny_model(tiny_config("llama", num_hidden_layers=8))
    runs = {}
    for name, by_segment in (("none", None), ("per-segment", {0: 3, 4: 1})):

        def engine(*args, by_segment=by_segment, **kw):
            return real(*args, **{**kw, "chain_attention_by_segment": by_segment})

        monkeypatch.setattr(builder, "StreamingEngine", engine)
        counter = CountAttentionKernels()
        with counter:
            logs, trainer = _train(
                copy.deepcopy(model), tmp_path, name, k=4, steps=2,
                megatrain_keep_attention_outputs="3", megatrain_offload_activations=True,
                megatrain_chain_attention_outputs=0 if by_segment is None else 1,
            )  # fmt: skip
        monkeypatch.undo()
        runs[name] = (_track(logs), mega_params(trainer), counter.calls)
    assert runs["per-segment"][0] == runs["none"][0]
    for key, value in runs["none"][1].items():
        assert torch.equal(runs["per-segment"][1][key], value), key
    # Without: 8 forwards, the chains' 3 + 1 (layers 5 and 6 read their forward-kept outputs)
    # and the recomputes of layers 0-4. With: layers 0-2's recomputes read the chain's.
    assert (runs["none"][2], runs["per-segment"][2]) == (2 * 17, 2 * 14)
