"""Recompute into the forward's graph with early stop (core/recompute.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.autograd.graph import get_gradient_edge

from hf_megatrain.core.recompute import PlaceholderSaves, release_storage

from .helpers import CountAttentionKernels, mega_params, run_trainer, tiny_config, tiny_model


def _block(x, w1, w2, calls):
    """A pre-norm residual MLP block like a decoder layer's second half; counts the last GEMM."""
    h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
    a = torch.nn.functional.silu(h @ w1)
    calls.append("down")
    return x + a @ w2


def test_refill_matches_plain_autograd_and_skips_the_tail():
    torch.manual_seed(0)
    x = torch.randn(6, 8, dtype=torch.float64)
    w1 = torch.randn(8, 16, dtype=torch.float64)
    w2 = torch.randn(16, 8, dtype=torch.float64)
    g = torch.randn(6, 8, dtype=torch.float64)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    ref = torch.autograd.grad(_block(*ref_leaves, []), ref_leaves, g)

    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    saves, calls = PlaceholderSaves(), []
    with saves.recording():
        out = _block(*leaves, calls)
    assert len(saves) > 0 and calls == ["down"]
    root = get_gradient_edge(out)
    del out
    release_storage(leaves)  # the graph keeps the leaves, not their memory
    assert all(t.untyped_storage().nbytes() == 8 for t in leaves)
    again = [t.clone().requires_grad_() for t in (x, w1, w2)]
    saves.refill(lambda: _block(*again, calls))
    # The recompute stopped when the last GEMM's inputs were saved, before that GEMM ran
    # (autograd saves an op's inputs before running it).
    assert calls == ["down", "down"]
    got = torch.autograd.grad([root], leaves, [g])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same ops on the same values


def test_refill_refuses_a_different_recompute():
    leaves = [torch.randn(4, 8).requires_grad_(), torch.randn(8, 8).requires_grad_()]
    saves = PlaceholderSaves()
    with saves.recording():
        (leaves[0] @ leaves[1]).sin()
    other = [torch.randn(5, 8).requires_grad_(), torch.randn(8, 8).requires_grad_()]
    with pytest.raises(RuntimeError, match="recompute differs from its forward"):
        saves.refill(lambda: (other[0] @ other[1]).sin())
    saves = PlaceholderSaves()
    with saves.recording():
        (leaves[0] @ leaves[1]).sin()
    with pytest.raises(RuntimeError, match="recompute saved 0 tensors, its forward"):
        saves.refill(lambda: None)


def test_streamed_layers_do_not_rerun_the_down_projection(tmp_path, monkeypatch):
    """A training step runs each layer's MLP down projection once: in forward. The recompute in
    backward stops before it (the stock Trainer's gradient checkpointing does the same), and
    what it re-makes went into placeholders in forward (no activation held)."""
    cfg = tiny_config("qwen2", num_hidden_layers=3)
    model = tiny_model(cfg)
    calls: list[int] = []
    for i, layer in enumerate(model.model.layers):
        layer.mlp.down_proj.register_forward_hook(lambda m, a, o, i=i: calls.append(i))
    refilled: list[int] = []
    refill = PlaceholderSaves.refill

    def counting_refill(self, run):
        refilled.append(len(self))
        return refill(self, run)

    monkeypatch.setattr(PlaceholderSaves, "refill", counting_refill)
    steps = 2
    run_trainer(model, tmp_path, "mega", mega=True, max_steps=steps)
    # One forward per layer and step (the trainer's log-only eval passes none here).
    assert sorted(calls) == sorted(list(range(3)) * steps)
    assert len(refilled) == 3 * steps and min(refilled) > 10


def test_rounded_inputs_recompute_the_whole_layer(tmp_path, monkeypatch):
    """With layer inputs saved rounded to bf16 the recompute does not see the forward's exact
    input (MoE routing could differ), so it builds its own graph from the whole layer."""
    model = tiny_model(tiny_config("qwen2", num_hidden_layers=2))
    calls: list[int] = []
    for i, layer in enumerate(model.model.layers):
        layer.mlp.down_proj.register_forward_hook(lambda m, a, o, i=i: calls.append(i))
    monkeypatch.setattr(PlaceholderSaves, "refill", lambda self, run: pytest.fail("refill"))
    logs, _ = run_trainer(
        model, tmp_path, "mega", mega=True, max_steps=1, megatrain_boundary_dtype="bfloat16"
    )
    assert sorted(calls) == [0, 0, 1, 1] and logs[0]["grad_norm"] > 0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_early_stop_switch_trains_identically(tmp_path, arch):
    """megatrain_recompute_early_stop=False re-runs whole layers (the before/after switch of the
    benchmark): the same ops on the same values, so bitwise the same training (fp32 on the CPU);
    MoE routing included."""
    model = tiny_model(tiny_config(arch, num_hidden_layers=2))
    runs = {}
    for early in (True, False):
        calls: list[int] = []
        m = copy.deepcopy(model)
        for layer in m.model.layers:
            mlp = layer.mlp
            hooked = mlp.down_proj if hasattr(mlp, "down_proj") else mlp
            hooked.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        logs, trainer = run_trainer(
            m, tmp_path, f"early-{early}", mega=True, max_steps=2,
            megatrain_recompute_early_stop=early,
        )  # fmt: skip
        runs[early] = ([r["loss"] for r in logs], mega_params(trainer), len(calls))
    assert runs[True][0] == runs[False][0]
    for k, v in runs[False][1].items():
        assert torch.equal(runs[True][1][k], v), k
    if arch == "qwen2":  # one down projection per layer and step, twice without early stop
        assert (runs[True][2], runs[False][2]) == (4, 8)


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("qwen2", {}), ("llama", {}), ("gemma3_text", {}), ("qwen3_moe", {}),
        # bf16 autocast, one layer in the device tier (recomputing: keep_activations off).
        ("qwen2", {"bf16": True, "megatrain_resident_layers": "1",
                   "megatrain_keep_activations": "off"}),
    ],
    ids=["qwen2", "llama", "gemma3", "qwen3_moe", "qwen2-bf16-tier"],
)  # fmt: skip
def test_kept_attention_outputs_train_identically_without_rerunning_attention(
    tmp_path, arch, extra
):
    """megatrain_keep_attention_outputs: the recompute gets the attention kernel's outputs from
    the forward instead of running it again. The values are the ones the kernel would make
    again (deterministic on the CPU), so training is bitwise the same (fp32, and bf16 under
    autocast); the kernel runs once per layer and step instead of twice."""
    model = tiny_model(tiny_config(arch, num_hidden_layers=2))
    runs = {}
    for keep in (False, True):
        counter = CountAttentionKernels()
        with counter:
            logs, trainer = run_trainer(
                copy.deepcopy(model), tmp_path, f"attn-{keep}", mega=True, max_steps=2,
                megatrain_keep_attention_outputs=keep, **extra,
            )  # fmt: skip
        runs[keep] = ([r["loss"] for r in logs], mega_params(trainer), counter.calls)
    assert runs[True][0] == runs[False][0]
    for k, v in runs[False][1].items():
        assert torch.equal(runs[True][1][k], v), k
    # 2 layers x 2 steps: forward and recompute each run the kernel, or forward only.
    assert (runs[False][2], runs[True][2]) == (8, 4)


def test_kept_attention_outputs_for_a_count_of_layers(tmp_path):
    """A count keeps them for the last N recomputed layers only: with 1 of 3, the kernel runs
    in 3 forwards and 2 recomputes per step; 'off' and 0 keep none; nonsense is refused."""
    from hf_megatrain.hf.model import find_decoder_layers, keep_attention_outputs

    model = tiny_model(tiny_config("qwen2", num_hidden_layers=3))
    counter = CountAttentionKernels()
    with counter:
        _, trainer = run_trainer(
            model, tmp_path, "one", mega=True, max_steps=2, megatrain_keep_attention_outputs="1"
        )
    layers = [layer.forward for layer in find_decoder_layers(model)[1]]
    assert [layer.keep_attention for layer in layers] == [False, False, True]
    assert counter.calls == 2 * (3 + 2)
    assert keep_attention_outputs(model, "off") == keep_attention_outputs(model, 0) == 0
    assert keep_attention_outputs(model, "all") == keep_attention_outputs(model, 7) == 3
    # "auto" is the memory plan's count; on the CPU there is no plan of the step: none.
    assert keep_attention_outputs(model, "auto") == 0
    with pytest.raises(ValueError, match="use 'off', 'all', 'auto' or a layer count"):
        keep_attention_outputs(model, "most")


def test_kept_attention_outputs_are_planned():
    """The plan counts the kept outputs for every recomputed layer (not for layers that keep
    their whole graph, which hold them already): heads x head_dim bf16 + 4 B per head."""
    from hf_megatrain.core.activation_memory import attention_output_bytes_per_token
    from hf_megatrain.core.options import EngineOptions, StepShape
    from hf_megatrain.core.planner import GIB, ModelShape, max_seq_len, plan_memory

    shape = ModelShape(
        layer_numels=(1000,) * 4, non_layer_numel=1000, hidden_size=64, vocab_size=100,
        intermediate_size=128, kv_size=32, head_dim=16, num_heads=4,
    )  # fmt: skip
    assert attention_output_bytes_per_token(shape, torch.bfloat16) == 4 * 16 * 2 + 4 * 4
    step = StepShape(seq_len=256, micro_batch_tokens=512)

    def opts(attention: str = "off", keep: str = "off", boundary: str = "input"):
        return EngineOptions(
            keep_attention_outputs=attention, keep_activations=keep, boundary_dtype=boundary
        ).resolve(clipping=True, cuda=True)

    def total(attention: str, kept: int, boundary: str = "input") -> int:
        o = opts(attention, str(kept), boundary)
        plan = plan_memory(shape, step, o, torch.bfloat16, 8 * GIB, 8 * GIB, hbm_layers=4)
        return sum(line.nbytes for line in plan.gpu_lines if "attention outputs" in line.name)

    per_layer = 512 * 144
    assert total("off", 0) == 0
    assert total("all", 0) == 4 * per_layer
    assert total("all", 1) == 3 * per_layer  # the kept layer holds them already
    assert total("2", 0) == 2 * per_layer
    # Inputs saved rounded to bf16: layers re-run whole and keep nothing of the kind.
    assert total("all", 0, boundary="bfloat16") == 0
    # "auto": as many as the HBM left by the tier fits. With room for about 2.5 layers' worth
    # beyond a plan without them, 2.
    base = plan_memory(shape, step, opts(), torch.bfloat16, 8 * GIB, 8 * GIB, hbm_layers=4)
    room = base.gpu_total + int(2.5 * per_layer * 1.03)  # the slack line grows 3% with them
    auto = plan_memory(shape, step, opts("auto"), torch.bfloat16, room, 8 * GIB, hbm_layers=4)
    assert auto.attention_layers == 2 and auto.attention_layer_indices == [2, 3]
    # Without the early-stop recompute (whole layers re-run) nothing is kept either.
    whole = EngineOptions(keep_attention_outputs="all", recompute_early_stop=False,
                          keep_activations="off").resolve(clipping=True, cuda=True)  # fmt: skip
    plan = plan_memory(shape, step, whole, torch.bfloat16, 8 * GIB, 8 * GIB, hbm_layers=4)
    assert plan.attention_layers == 0
    # The "what fits" searches plan with them too: a shorter longest sequence.
    hbm, host = 2 * GIB, 8 * GIB
    longest = {
        keep: max_seq_len(shape, 1, opts(keep), torch.bfloat16, hbm, host, multiple=1024)
        for keep in ("off", "all")
    }
    assert 0 < longest["all"] < longest["off"]


def test_kept_attention_outputs_warn_where_they_do_nothing(tmp_path, caplog):
    """Only PyTorch SDPA's fused kernels are kept, and only by the early-stop recompute: other
    attention implementations and whole-layer recomputes get a warning, not a silent no-op."""
    import logging

    cases = [
        ({"attn_implementation": "eager"}, {}, "attn_implementation='eager'"),
        ({}, {"megatrain_recompute_early_stop": False}, "megatrain_recompute_early_stop=False"),
        ({}, {"megatrain_boundary_dtype": "bfloat16"}, "megatrain_boundary_dtype"),
        ({}, {}, None),
    ]
    for i, (model_kw, args_kw, expected) in enumerate(cases):
        model = tiny_model(tiny_config("llama", num_hidden_layers=1, **model_kw))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_megatrain.hf.trainer"):
            run_trainer(
                model, tmp_path, f"warn-{i}", mega=True, max_steps=1,
                megatrain_keep_attention_outputs=True, **args_kw,
            )  # fmt: skip
        said = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
        assert (said and expected in said[0]) if expected else not said, (expected, said)
        if model_kw:  # only SDPA's kernels are kept: another attention keeps none
            from hf_megatrain.hf.model import keep_attention_outputs  # noqa: PLC0415

            assert keep_attention_outputs(model, "all") == 0
    # The segment chains' kept outputs, likewise (found by an audit: nothing was said).
    model = tiny_model(tiny_config("llama", num_hidden_layers=2, attn_implementation="eager"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_megatrain.hf.trainer"):
        run_trainer(
            model, tmp_path, "warn-chain", mega=True, max_steps=1,
            megatrain_checkpoint_every=2, megatrain_chain_attention_outputs=1,
        )  # fmt: skip
    said = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert len(said) == 1 and "chain_attention_outputs has no effect here" in said[0], said
