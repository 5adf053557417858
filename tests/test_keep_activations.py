"""HBM-tier layers that keep their forward activations instead of recomputing in backward.

Keeping changes when a layer's forward runs (once instead of twice per step), not what it
computes: on the CPU in fp32 the same kernels see the same inputs, so losses, gradient norms and
weights must be bitwise equal to the recompute path, and close to the stock Trainer.
"""

from __future__ import annotations

import copy
import inspect
from contextlib import nullcontext

import pytest
import torch

from hf_megatrain.core.autocast_kernels import AutocastKernels
from hf_megatrain.core.options import EngineOptions, StepShape
from hf_megatrain.core.planner import ModelShape, plan_memory
from hf_megatrain.hf.model import keep_activations

from .helpers import (
    assert_logs_match,
    installed_supported_types,
    make_data,
    mega_params,
    run_trainer,
    stock_params,
    tiny_config,
    tiny_model,
)


def _count_layer_forwards(model) -> dict[int, int]:
    """Wrap every streamed layer's forward implementation with a call counter."""
    from hf_megatrain.hf.model import find_decoder_layers  # noqa: PLC0415

    counts: dict[int, int] = {}
    for i, layer in enumerate(find_decoder_layers(model)[1]):
        streamed = layer.forward
        impl = streamed.forward_impl

        def counted(module, *a, _i=i, _impl=impl, **kw):
            counts[_i] = counts.get(_i, 0) + 1
            return _impl(module, *a, **kw)

        streamed.forward_impl = counted
    return counts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("ga", [1, 2], ids=["ga1", "ga2"])
def test_kept_activations_equal_recompute(tmp_path, arch, ga):
    model = tiny_model(tiny_config(arch, num_hidden_layers=3))
    steps = 3
    kw = dict(max_steps=steps, gradient_accumulation_steps=ga)
    tier = dict(megatrain_resident_layers="2")
    stock, stock_trainer = run_trainer(copy.deepcopy(model), tmp_path, "stock", mega=False, **kw)
    recomputed, base = run_trainer(
        copy.deepcopy(model), tmp_path, "recompute", mega=True, megatrain_keep_activations="off",
        **tier, **kw,
    )  # fmt: skip
    kept, trainer = run_trainer(
        model, tmp_path, "kept", mega=True, megatrain_keep_activations="2", **tier, **kw
    )
    layers = [layer.forward for layer in trainer.model.model.layers]
    assert [s.keep_graph for s in layers] == [True, True, False]
    assert not any(layer.forward.keep_graph for layer in base.model.model.layers)
    # Same kernels, same inputs: bitwise equal, not merely close.
    assert [r["loss"] for r in kept] == [r["loss"] for r in recomputed]
    assert [r["grad_norm"] for r in kept] == [r["grad_norm"] for r in recomputed]
    got, ref = mega_params(trainer), mega_params(base)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    assert_logs_match(stock, kept)
    for k, v in stock_params(stock_trainer.model).items():
        # As test_equivalence's trainer check: absolute, since Adam's normalized update turns
        # fp32 summation-order noise of near-zero gradients (Qwen2's k_proj bias: attention is
        # invariant to it) into O(1e-6) weight differences whatever their magnitude.
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-5, msg=k)


def test_kept_layers_run_forward_once(tmp_path):
    """The point of keeping: a kept layer's forward runs once per micro-batch, not twice."""
    model = tiny_model(tiny_config("llama", num_hidden_layers=3))
    _, trainer = run_trainer(
        model, tmp_path, "warm", mega=True, max_steps=1, megatrain_resident_layers="2",
        megatrain_keep_activations="1",
    )  # fmt: skip
    counts = _count_layer_forwards(trainer.model)
    trainer.args.max_steps = 2
    trainer.train(resume_from_checkpoint=None)
    n_micro = 2  # two fresh steps of one micro-batch each (train() restarts from step 0)
    assert counts == {0: 2 * n_micro, 1: n_micro, 2: 2 * n_micro}


def test_keep_activations_refuses_streamed_layers(tmp_path):
    model = tiny_model(tiny_config("llama", num_hidden_layers=3))
    with pytest.raises(ValueError, match="only 1 layers are in the HBM tier"):
        run_trainer(
            model, tmp_path, "bad", mega=True, max_steps=1, megatrain_resident_layers="1",
            megatrain_keep_activations="2",
        )  # fmt: skip
    with pytest.raises(ValueError, match="use 'auto', 'off' or a layer count"):
        keep_activations(model, "many")


def test_planner_keeps_what_hbm_leaves():
    h, i, kv = 1536, 10240, 256
    shape = ModelShape((50_000_000,) * 28, 200_000_000, h, 151_936, i, kv_size=kv)
    step = StepShape(seq_len=4096, micro_batch_tokens=32768)

    def opts(keep: str, **changes):
        engine = EngineOptions(keep_activations=keep, **changes)
        return engine.resolve(clipping=True, cuda=True)

    # (no head_dim here: no per-head term; autocast_kernels' shared casts, the default, save
    # one bf16 cast per normed input, 2 x 2h, where autocast makes one per linear, 5 x 2h)
    per_layer = 32768 * (26 * h - 6 * h + 4 * kv + 8 * i + 8)
    roomy = plan_memory(shape, step, opts("auto"), torch.bfloat16, 139 * 2**30, 200 * 2**30)
    assert roomy.n_hbm == 28 and roomy.kept_layers > 0
    assert roomy.kept_layer_indices == list(range(28 - roomy.kept_layers, 28))
    line = next(ln for ln in roomy.gpu_lines if ln.name.startswith("kept activations"))
    assert line.nbytes == roomy.kept_layers * per_layer
    assert roomy.gpu_total <= 139 * 2**30
    # One more kept layer would not fit: auto takes as many as fit, not fewer.
    assert roomy.kept_layers < 28  # (the shape is chosen so that not every layer fits)
    more = plan_memory(shape, step, opts(str(roomy.kept_layers + 1)), torch.bfloat16,
                       139 * 2**30, 200 * 2**30)  # fmt: skip
    assert more.gpu_total > 139 * 2**30
    # Off, and offload (activations that do not fit) keep none; explicit counts are honoured.
    assert plan_memory(shape, step, opts("off"), torch.bfloat16, 139 * 2**30,
                       200 * 2**30).kept_layers == 0  # fmt: skip
    off = opts("auto", offload_activations=True)
    assert plan_memory(shape, step, off, torch.bfloat16, 139 * 2**30,
                       200 * 2**30).kept_layers == 0  # fmt: skip
    with pytest.raises(ValueError, match="HBM-tier"):
        plan_memory(shape, step, opts("4"), torch.bfloat16, 139 * 2**30, 200 * 2**30,
                    hbm_layers=3)  # fmt: skip
    assert "activations kept, no recompute" in roomy.table()


def test_keep_activations_data_path_defaults(tmp_path):
    """'auto' without a plan (explicit resident count) keeps nothing; the run still trains."""
    model = tiny_model(tiny_config("qwen2", num_hidden_layers=2))
    logs, trainer = run_trainer(
        model, tmp_path, "auto", mega=True, max_steps=2, megatrain_resident_layers="2",
        data=make_data(8),
    )  # fmt: skip
    assert trainer.args.megatrain_keep_activations == "auto"
    assert not any(layer.forward.keep_graph for layer in trainer.model.model.layers)
    assert len(logs) == 2


def test_micro_batch_larger_than_planned_recomputes(tmp_path):
    """A micro-batch above the planned size recomputes every layer; the next that fits keeps."""
    from types import SimpleNamespace

    model = tiny_model(tiny_config("llama", num_hidden_layers=3))
    _, trainer = run_trainer(
        model, tmp_path, "t", mega=True, max_steps=1, megatrain_resident_layers="2",
        megatrain_keep_activations="2",
    )  # fmt: skip
    layers = [layer.forward for layer in trainer.model.model.layers]
    # The CPU run has no plan (the planner runs for CUDA); stand in one sized for 32 tokens.
    trainer.megatrain.plan = SimpleNamespace(
        step=SimpleNamespace(micro_batch_tokens=32), kept_layers=2
    )
    trainer.fit_kept_activations(33)
    assert [s.keep_graph for s in layers] == [False, False, False]
    trainer.fit_kept_activations(32)
    assert [s.keep_graph for s in layers] == [True, True, False]


@pytest.mark.parametrize(
    "extra",
    [{"megatrain_mlp_tile_tokens": 4}, {"max_grad_norm": 0.0}],
    ids=["mlp-tiles", "eager-updates"],
)
def test_kept_activations_with_other_engine_options(tmp_path, extra):
    """MLP tiles (their own per-tile recompute inside the kept graph) and eager layer updates
    (an HBM-tier layer updated as soon as its gradient is final) leave results bitwise equal."""
    model = tiny_model(tiny_config("qwen2", num_hidden_layers=3))
    kw = dict(max_steps=2, megatrain_resident_layers="2", **extra)
    ref, base = run_trainer(
        copy.deepcopy(model), tmp_path, "ref", mega=True, megatrain_keep_activations="off", **kw
    )
    got, trainer = run_trainer(
        model, tmp_path, "kept", mega=True, **kw, megatrain_keep_activations="2"
    )
    assert [layer.forward.keep_graph for layer in trainer.model.model.layers] == [True, True, False]
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]
    a, b = mega_params(trainer), mega_params(base)
    for k, v in b.items():
        assert torch.equal(a[k], v), k


def kept_layer_saved_bytes(
    cfg, shared_casts: bool, tokens: int, layer: int = 0, compiled: bool = False
) -> tuple[int, object]:
    """What decoder layer ``layer`` of ``cfg``'s model saves for its backward on one
    ``tokens``-token sequence under bf16 autocast (bf16 weights, LayerNorm in fp32 as autocast
    runs it, fp32 residual input, the config's attention), with ``shared_casts`` or not: every
    saved tensor once per storage, less the layer input, its weights and the model's RoPE tables;
    and the model's plan shape. ``compiled``: under the compiled layer kernels (applied first).
    dev/family_working_set_fit.py --kept fits families with it."""
    from hf_megatrain.hf.compiled_kernels import apply_compiled_kernels  # noqa: PLC0415
    from hf_megatrain.hf.model import find_decoder_layers, model_shape  # noqa: PLC0415

    model = tiny_model(cfg)
    if compiled:
        apply_compiled_kernels(model)
    shape = model_shape(model)
    block = find_decoder_layers(model)[1][layer].to(torch.bfloat16)
    for norm in block.modules():  # autocast runs LayerNorm in fp32 (CUDA's: it casts the weight)
        if isinstance(norm, torch.nn.LayerNorm):
            norm.float()
    x = torch.randn(1, tokens, cfg.hidden_size, requires_grad=True)
    pos = torch.arange(tokens)[None]
    rope, tables, kwargs = getattr(model.base_model, "rotary_emb", None), (), {}
    if rope is not None:
        if "layer_type" in inspect.signature(rope.forward).parameters:
            tables = rope(x, pos, layer_type="full_attention")
        else:
            tables = rope(x, pos)
        kwargs["position_embeddings"] = tables
    if "position_ids" in inspect.signature(block.forward).parameters:
        kwargs["position_ids"] = pos  # (GPT-J makes its sin/cos from them, in each layer)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            casts = AutocastKernels("cpu", torch.bfloat16) if shared_casts else nullcontext()
            with casts:
                block(x, attention_mask=None, **kwargs)
    shared = {t.untyped_storage().data_ptr() for t in (x, *tables, *block.parameters())}
    return sum(n for ptr, n in saved.items() if ptr not in shared), shape


@pytest.mark.parametrize("shared_casts", [False, True], ids=["autocast", "shared-casts"])
@pytest.mark.parametrize("arch", installed_supported_types())
def test_kept_bytes_per_token_match_saved_tensors(arch, shared_casts):
    """The planner's per-token bytes of a kept layer against what autograd really saves: one
    decoder layer under bf16 autocast (bf16 weights, fp32 residual input, SDPA), every tensor
    saved for backward counted once per storage, minus the layer input, the weights and the
    shared RoPE tables: exactly the planner's count for the Llama family (Qwen3's tiny config
    has head_dim 8, so its query width, 4 x 8, is not the hidden size, and it normalizes q and k
    per head); with autocast_kernels' shared input casts (the engine's default) q/k/v and
    gate/up save one cast of their input each, as the count with ``shared_casts`` says;
    Granite, SmolLM3 and Seed-OSS layers are Llama's; ERNIE 4.5's and Helium's too, plus the
    cos/sin copies their RoPE makes (``rope_saved_bytes_per_token``, measured by calling it);
    Gemma3's four fp32 norms have terms of their own; Phi-3's fused projections save a little
    less; the families of ``FITTED_KEPT_RESIDUALS`` differ from the count by their fitted
    residual. The MoE families save more than the count (router, expert dispatch): they must
    not be marked audited, and "auto" then plans no kept activations for them, as for the
    families not measured here."""
    from hf_megatrain.core.planner import kept_activation_bytes_per_token  # noqa: PLC0415
    from hf_megatrain.hf.family_memory import FITTED_KEPT_RESIDUALS  # noqa: PLC0415
    from hf_megatrain.hf.model import model_shape  # noqa: PLC0415

    # Gemma3's tiny config has one layer per kind; OLMo Hybrid needs a linear-attention and an
    # attention layer.
    layers = 2 if arch in ("gemma3_text", "olmo_hybrid") else 1
    cfg = tiny_config(arch, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=layers)  # fmt: skip
    model = tiny_model(cfg)
    shape = model_shape(model)
    planned = kept_activation_bytes_per_token(shape, shared_casts)
    if not shape.kept_bytes_audited:
        # Not audited (the MoE families save more than the count; the other families' layers
        # were not measured against it): "auto" plans no kept activations for them.
        step = StepShape(seq_len=64, micro_batch_tokens=64)
        auto = EngineOptions(keep_activations="auto").resolve(clipping=True, cuda=True)
        plan = plan_memory(shape, step, auto, torch.bfloat16, 2**40, 2**40)
        assert plan.kept_layers == 0 and "kept activations not planned" in plan.table()
        if arch not in ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe"):
            return
    cfg._attn_implementation = "sdpa"
    if arch == "helium":  # its o_proj is hidden x hidden: heads x head_dim must be the hidden size
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    tokens = 64
    saved_bytes, shape = kept_layer_saved_bytes(cfg, shared_casts, tokens, layer=layers - 1)
    planned = kept_activation_bytes_per_token(shape, shared_casts)
    per_token = saved_bytes / tokens
    if arch == "phi3":
        assert shape.kept_bytes_audited
        assert per_token <= planned <= 1.03 * per_token, (per_token, planned)
    elif arch in (
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "granite",
        "smollm3",
        "seed_oss",
        "ernie4_5",
    ):
        assert shape.kept_bytes_audited
        assert per_token == planned, (per_token, planned)
        assert shape.rope_saved_bytes_per_token == (8 * cfg.head_dim if arch == "ernie4_5" else 0)
    elif arch in FITTED_KEPT_RESIDUALS:
        # Their saves less the shared count, fitted per family at other widths with the shared
        # casts. Per layer besides, not per token: a norm's weight in fp32 (Gemma's 1 + weight),
        # here spread over 64 tokens.
        assert shape.kept_bytes_audited
        per_layer = 2 * 4 * cfg.hidden_size
        assert per_token * tokens <= planned * tokens + per_layer, (per_token, planned)
        if shared_casts:  # what the residuals were fitted for: the saves within 0.5%
            assert planned <= 1.005 * per_token, (per_token, planned)
    elif arch == "helium":
        # Besides the per-token count (its RoPE's cos/sin copies in it), per layer: each of its
        # 2 norms' weight cast to fp32.
        assert shape.kept_bytes_audited and shape.rope_saved_bytes_per_token == 8 * cfg.head_dim
        assert per_token * tokens == planned * tokens + 2 * 4 * cfg.hidden_size
    elif arch == "gemma3_text":
        # Besides the per-token count, per layer: each of its 4 norms' and 2 q/k norms' fp32
        # (1 + weight), which a 64-token audit spreads over the tokens.
        assert shape.kept_bytes_audited
        per_layer = 4 * 4 * cfg.hidden_size + 2 * 4 * cfg.head_dim
        assert per_token * tokens == planned * tokens + per_layer, (per_token, planned)
    else:  # the MoE families: router and expert dispatch save more than the count
        assert per_token > planned, (per_token, planned)


@pytest.mark.parametrize(("arch", "linears"), [("llama", 5), ("qwen3", 5), ("phi3", 2)])
def test_normed_input_linears_count_each_projection_once(arch, linears):
    """The linears reading a layer's normed inputs (whose bf16 casts autocast_kernels shares):
    q/k/v and gate/up, or Phi-3's fused qkv and gate-up; a LoRA-wrapped projection (its wrapper,
    base layer and adapter all take the hidden width) still counts once."""
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415

    from hf_megatrain.hf.model import model_shape  # noqa: PLC0415

    model = tiny_model(tiny_config(arch))
    assert model_shape(model).normed_input_linears == linears
    targets = ["qkv_proj", "gate_up_proj"] if arch == "phi3" else ["q_proj", "v_proj", "up_proj"]
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=targets))
    assert model_shape(lora).normed_input_linears == linears
