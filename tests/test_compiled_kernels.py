"""torch.compile'd layer kernels (``layer_kernels='compiled'``, what 'auto' runs on CUDA without
Liger-Kernel): each family's arithmetic, the memory the plan counts, the RoPE stand-in kept to
the models that asked for it, and training equal to PyTorch's kernels under the engine's memory
features.

Built with the "aot_eager" backend here: the graphs and saved tensors Inductor gets, without
its C++ build (half a minute per graph on the CPU). tests/test_gpu.py runs Inductor's Triton
kernels on the GPU."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_megatrain.hf.compiled_kernels as compiled_kernels
from hf_megatrain.hf.compiled_kernels import COMPILED_AUTO_MODEL_TYPES, apply_compiled_kernels
from hf_megatrain.hf.model import layer_kernels_of, model_shape

from .helpers import (
    ARCHS,
    MOE_ARCHS,
    SEQ,
    VOCAB,
    assert_same_training_logs,
    run_trainer,
    tiny_config,
    tiny_model,
)

FAMILIES = sorted(COMPILED_AUTO_MODEL_TYPES)


@pytest.fixture(autouse=True)
def aot_eager(monkeypatch):
    monkeypatch.setattr(compiled_kernels, "COMPILE_BACKEND", "aot_eager")


def _loss_and_grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return out.logits.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_layers_compute_like_the_family(family, monkeypatch):
    """Every norm (q/k norms and the final one included) and every MLP is patched, and logits
    and gradients equal the family's own modules'. fp32: the forward runs the same aten ops
    (bit-equal); the traced backward sums in another order (observed <= 5e-7 relative), so
    gradients get 1e-5, far below a wrong formula's error (a dropped term is O(1))."""
    cfg = tiny_config(family, num_hidden_layers=3)
    ref = tiny_model(cfg)
    model = copy.deepcopy(ref)
    assert layer_kernels_of(model) == "torch"
    per_layer = 3 + (2 if family == "qwen3" else 0)  # two norms and the MLP (+ q/k norms)
    assert apply_compiled_kernels(model) == 3 * per_layer + 1
    assert layer_kernels_of(model) == "compiled"
    assert model_shape(model).fused_layer_kernels and not model_shape(ref).fused_layer_kernels
    used = []
    real = compiled_kernels.compiled
    monkeypatch.setattr(
        compiled_kernels, "compiled", lambda fn: used.append(fn.__name__) or real(fn)
    )
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    logits, grads = _loss_and_grads(model, ids)
    assert set(used) == {"rms_norm", "silu_mul", "rotary"}
    used.clear()
    ref_logits, ref_grads = _loss_and_grads(ref, ids)
    assert used == []  # the other model of the family keeps the original RoPE
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    for name, grad in ref_grads.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("family", [a for a in ARCHS + MOE_ARCHS if a not in FAMILIES])
def test_other_families_get_what_computes_like_the_kernels(family):
    """Any family: the modules whose own forward the probes find equal to the kernels' (norms,
    SwiGLU MLPs, a whole-head RoPE) are patched, the others keep theirs (Gemma's 1 + weight
    norms and GeGLU, Phi-3's fused gate-up and partial RoPE, MoE experts), and the model still
    computes as before (fp32; the traced backward's summation order as above, 1e-5)."""
    cfg = tiny_config(family)
    ref = tiny_model(cfg)
    model = copy.deepcopy(ref)
    try:
        apply_compiled_kernels(model)
    except ValueError as e:  # nothing of this family computes like the kernels
        assert "computes like the compiled kernels" in str(e)
        return
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    logits, grads = _loss_and_grads(model, ids)
    ref_logits, ref_grads = _loss_and_grads(ref, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name, grad in ref_grads.items():
        if grad is None:
            continue
        scale = grad.abs().max().item()
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)
    fused = model_shape(model).fused_layer_kernels
    assert fused == compiled_kernels.fuses_mlp(ref)  # the plan knows whether the MLP is fused


def test_compiled_swiglu_saves_what_the_plan_counts():
    """The plan's fused SwiGLU saves one (tokens x intermediate) tensor less than PyTorch's
    (``FUSED_SWIGLU_BYTES_PER_TOKEN_INTER``: no SiLU output): measured by the saved-tensor
    hooks the engine's own offload uses, in bf16 as on the GPU."""
    from hf_megatrain.core.activation_memory import FUSED_SWIGLU_BYTES_PER_TOKEN_INTER

    cfg = tiny_config("llama", intermediate_size=96)
    mlp = tiny_model(cfg).model.layers[0].mlp.to(torch.bfloat16)
    tokens = 2 * SEQ

    def saved_bytes(module) -> int:
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(2, SEQ, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x).sum().backward()
        return sum(seen.values()) - x.numel() * x.element_size() - module_weights(module)

    def module_weights(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    eager = saved_bytes(mlp)
    fused = copy.deepcopy(mlp)
    fused.forward = compiled_kernels.types.MethodType(compiled_kernels.swiglu_forward, fused)
    saved = saved_bytes(fused)
    assert eager - saved == tokens * cfg.intermediate_size * FUSED_SWIGLU_BYTES_PER_TOKEN_INTER


@pytest.mark.parametrize(
    "family, features",
    [
        ("llama", dict(megatrain_mlp_tile_tokens=4, megatrain_checkpoint_every=2)),
        ("qwen3", dict(megatrain_offload_activations=True, gradient_accumulation_steps=2)),
        (
            "mistral",
            dict(
                megatrain_resident_layers="3",
                megatrain_keep_activations="2",
                megatrain_keep_attention_outputs="all",
            ),
        ),
    ],
)
def test_training_with_compiled_kernels_equals_torch_kernels(tmp_path, family, features):
    """Streamed training, 3 steps, the compiled kernels against PyTorch's, under MLP tiling and
    checkpoint segments (forward re-run under no_grad, then with grad), activation offload with
    gradient accumulation, and kept activations: the same losses and grad norms (fp32, within
    the traced backward's summation order, as above)."""
    model = tiny_model(tiny_config(family, num_hidden_layers=3))
    runs = {}
    for kernels in ("torch", "compiled"):
        logs, trainer = run_trainer(
            copy.deepcopy(model), tmp_path, kernels, mega=True, max_steps=3,
            megatrain_layer_kernels=kernels, **features,
        )  # fmt: skip
        assert layer_kernels_of(trainer.model) == kernels
        runs[kernels] = logs
    assert len([r for r in runs["torch"] if "loss" in r]) == 3
    assert_same_training_logs(runs["compiled"], runs["torch"], rel=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "cohere", "olmo2"])
def test_plans_count_the_compiled_norms_only_where_every_layer_norm_runs_one(family):
    """A recomputed layer holds no fp32 normalized product where every norm of the layers is a
    compiled one (``ModelShape.compiled_norms``): the planner's probe on a meta model and the
    patched model agree, and families with a norm the kernel does not compute (Gemma's
    1 + weight, Cohere's LayerNorm; OLMo 2's, which multiplies by its bf16 weight in fp32 and
    rounds once, where Llama's rounds the normalized input first) keep it."""
    from hf_megatrain.cli_plan import compiled_kernels_of
    from hf_megatrain.hf.compiled_kernels import runs_compiled_norms

    cfg = tiny_config(family, num_hidden_layers=2)
    _, planned = compiled_kernels_of(cfg)
    model = tiny_model(cfg)
    assert not runs_compiled_norms(model) and not model_shape(model).compiled_norms
    try:
        apply_compiled_kernels(model)
    except ValueError:  # nothing of the family computes like the kernels
        pass
    ran = runs_compiled_norms(model)
    assert ran == planned == model_shape(model).compiled_norms
    assert ran == (family in ("llama", "qwen3")), family


@pytest.mark.parametrize("family", ["llama", "qwen3", "granite", "ernie4_5", "olmo2", "helium"])
def test_patched_norms_equal_the_familys_in_bf16(family):
    """The compiled norm replaces a family's norm only where it computes alike in bf16 too, as
    the engine runs it under autocast (bf16 weights over the fp32 residual stream, and over bf16
    q/k projections): bitwise equal outputs there. OLMo 2's and Helium's norms multiply by the
    weight in fp32 and round once (equal to Llama's in fp32 only): they keep their own."""
    model = tiny_model(tiny_config(family, num_hidden_layers=1)).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    try:
        apply_compiled_kernels(model)
    except ValueError:
        pass
    assert compiled_kernels.runs_compiled_norms(model) == (family not in ("olmo2", "helium"))
    names = [n for n, m in model.named_modules() if "norm" in type(m).__name__.lower()]
    g = torch.Generator().manual_seed(0)
    for name in names:
        mine, theirs = model.get_submodule(name), ref.get_submodule(name)
        width = theirs.weight.shape[0]
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(2, 5, width, generator=g).to(dtype)
            with torch.no_grad():
                assert torch.equal(mine(x), theirs(x)), (name, dtype)


@pytest.mark.parametrize("family", ["llama", "qwen3", "ernie4_5"])
def test_kept_layer_with_compiled_kernels_saves_what_the_plan_counts(family):
    """A kept layer under the compiled kernels (their traced graphs' partition of saved
    tensors), bf16 autocast with the shared input casts: per token, exactly the plan's kept
    bytes with ``fused_layer_kernels`` and the compiled norms (no fp32 normalized products, no
    SiLU output; ERNIE 4.5's RoPE copies included). Measured as the growth between two token
    counts, so the weights and the per-layer norm scales cancel."""
    from hf_megatrain.core.planner import kept_activation_bytes_per_token

    from .test_keep_activations import kept_layer_saved_bytes

    cfg = tiny_config(family, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=1)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    cfg.head_dim = 64
    saved = {t: kept_layer_saved_bytes(cfg, True, t, compiled=True) for t in (64, 128)}
    shape = saved[128][1]
    assert shape.fused_layer_kernels and shape.compiled_norms
    per_token = (saved[128][0] - saved[64][0]) / 64
    assert per_token == kept_activation_bytes_per_token(shape, shared_casts=True)


@pytest.mark.parametrize("family", ["llama", "exaone4"])
def test_bf16_training_with_compiled_kernels_is_bitwise_with_and_without_autocast_kernels(
    tmp_path, family
):
    """bf16 (CPU autocast) with the compiled kernels, whose traced regions run inside
    autocast_kernels' mode: the same losses and weights with the mode and without it (its
    shared casts and gradient sums round as autocast's), over steps that call the compiled
    kernels with new inputs."""
    from .helpers import mega_params  # noqa: PLC0415

    model = tiny_model(tiny_config(family, num_hidden_layers=3))
    runs = []
    for on in (True, False):
        logs, trainer = run_trainer(
            copy.deepcopy(model), tmp_path, f"run-{on}", mega=True, max_steps=3, bf16=True,
            megatrain_layer_kernels="compiled", megatrain_autocast_kernels=on,
        )  # fmt: skip
        assert layer_kernels_of(trainer.model) == "compiled"
        runs.append(([r["loss"] for r in logs if "loss" in r], mega_params(trainer)))
    (loss_on, params_on), (loss_off, params_off) = runs
    assert len(loss_on) == 3 and loss_on == loss_off
    for k in params_off:
        assert torch.equal(params_on[k], params_off[k]), k
