"""The Trainer's ``use_liger_kernel`` with a streamed model.

Liger's Triton kernels need CUDA (tests/test_gpu.py runs them for real). Here a stand-in for
``transformers.integrations.liger.apply_liger_kernel`` patches every MLP's forward on the
instance as Liger does (same arithmetic, counted), to check the integration itself: kernels go
in when the model is streamed, before MLP tiling (which then tiles the patched forward), and
the Trainer does not patch again in ``train()`` (that would replace the tiling).
"""

from __future__ import annotations

import copy

import pytest
import transformers.integrations.liger as hf_liger

from hf_megatrain.core.tiling import TiledTokenwise
from hf_megatrain.hf.model import streamed_state

from .helpers import (
    alias_config,
    liger_like_mlp_forward,
    llama_alias,
    patch_mlps_as_liger,
    run_trainer,
    simulate_liger,
    tiny_config,
    tiny_model,
)


def _fake_liger(calls: list, used: list):
    def apply(model, config):
        calls.append(config)
        for layer in model.model.layers:
            mlp = layer.mlp
            orig = type(mlp).forward

            def fused(self, x, _orig=orig):
                used.append(x.shape[-2])
                return _orig(self, x)

            mlp.__dict__["forward"] = fused.__get__(mlp, type(mlp))  # as Liger binds it

    return apply


def test_liger_kernels_go_in_before_tiling_and_once(tmp_path, monkeypatch):
    calls: list = []
    used: list = []
    monkeypatch.setattr(hf_liger, "apply_liger_kernel", _fake_liger(calls, used))
    simulate_liger(monkeypatch)  # (the stand-in above runs on the CPU)
    model = tiny_model(tiny_config("llama"))
    tile = dict(megatrain_mlp_tile_tokens=4)
    ref, _ = run_trainer(
        copy.deepcopy(model), tmp_path, "ref", mega=True, megatrain_layer_kernels="torch", **tile
    )
    config = {"rope": False, "fused_linear_cross_entropy": False}
    logs, trainer = run_trainer(
        model, tmp_path, "liger", mega=True, use_liger_kernel=True, liger_kernel_config=config,
        **tile,
    )  # fmt: skip
    assert calls == [config]  # applied once, when the model was streamed
    assert trainer.args.use_liger_kernel  # the flag is the user's again after train()
    mlp = trainer.model.model.layers[0].mlp
    assert isinstance(mlp.forward, TiledTokenwise)
    assert mlp.forward.forward_impl.__name__ == "fused"  # the tiles run the patched forward
    assert used and set(used) == {4}  # ... tile by tile (16-token rows, tiles of 4)
    # The stand-in computes what the MLP does: training is bitwise the reference run's.
    assert [(r["loss"], r["grad_norm"]) for r in logs] == [(r["loss"], r["grad_norm"]) for r in ref]


def test_planner_counts_the_fused_kernels_smaller_activations():
    """A Liger-patched MLP (seen through MLP tiling too) makes the planner count what Liger's
    kernels save: RMSNorm its input and scale (not the 2 fp32 normalized products, 8h), SwiGLU
    gate and up but not the SiLU output (2i; down_proj still saves the product). The GPU test
    measures it on the H200."""
    from dataclasses import replace  # noqa: PLC0415

    from hf_megatrain.core.planner import kept_activation_bytes_per_token  # noqa: PLC0415
    from hf_megatrain.hf.long_context import install_mlp_tiling  # noqa: PLC0415
    from hf_megatrain.hf.model import model_shape  # noqa: PLC0415

    model = tiny_model(tiny_config("qwen2"))
    plain = model_shape(model)
    assert not plain.fused_layer_kernels

    patch_mlps_as_liger(model)
    fused = model_shape(model)
    assert fused.fused_layer_kernels
    h, i = plain.hidden_size, plain.intermediate_size
    assert kept_activation_bytes_per_token(fused) == (
        kept_activation_bytes_per_token(plain) - 8 * h - 2 * i
    )
    install_mlp_tiling(model, 4)
    assert model_shape(model).fused_layer_kernels
    # A class swapped before the model was built (apply_liger_kernel_to_qwen2()) counts too.
    other = tiny_model(tiny_config("qwen2"))
    fused_cls = type(
        "LigerSwiGLUMLP", (type(other.model.layers[0].mlp),), {"forward": liger_like_mlp_forward()}
    )
    for layer in other.model.layers:
        layer.mlp.__class__ = fused_cls
    assert model_shape(other).fused_layer_kernels
    qk = replace(fused, qk_norm=True)
    q, kv = fused.num_heads * fused.head_dim, fused.kv_size
    assert kept_activation_bytes_per_token(qk) == (
        kept_activation_bytes_per_token(replace(plain, qk_norm=True))
        - 8 * h
        - 2 * i
        - 4 * q
        - 4 * kv
    )


@pytest.mark.parametrize("tile", [0, 64], ids=["untiled", "mlp-tiles"])
def test_fused_kernels_shrink_the_recompute_working_set(tile):
    """Untiled, Liger's SwiGLU leaves out the SiLU output: the plan's working set is 2 B x
    intermediate per MLP token smaller. With MLP tiles the tile holds the gated MLP's measured
    peak either way (12i) and the fused norms keep no fp32 products: the line is
    ``FUSED_TILED_BYTES_PER_TOKEN_HIDDEN`` x hidden per token smaller. Either way the fused
    loss's phase (its chunk, the LM head's copy and fp32 weight gradient), which never overlaps
    a layer's backward, adds only what exceeds that backward, in one micro-batch; with gradient
    accumulation the head's and the embedding's gradients live on through the next micro-batch's
    backward, and the lines are summed as without Liger's kernels."""
    from dataclasses import replace  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from hf_megatrain.core.activation_memory import (  # noqa: PLC0415
        FUSED_TILED_BYTES_PER_TOKEN_HIDDEN,
        GATED_MLP_PEAK_BYTES_PER_TOKEN_INTER,
        activation_lines,
    )
    from hf_megatrain.core.options import EngineOptions, StepShape  # noqa: PLC0415
    from hf_megatrain.hf.model import model_shape  # noqa: PLC0415

    plain = model_shape(tiny_model(tiny_config("qwen2")))
    fused = replace(plain, fused_layer_kernels=True)
    t = 512
    step = StepShape(seq_len=256, micro_batch_tokens=t)
    # Without the shared casts: at these tiny widths the smaller working set they leave would
    # drop under the fused loss's phase, whose line counts only what exceeds it.
    options = EngineOptions(mlp_tile_tokens=tile, autocast_kernels=False).resolve(
        clipping=True, cuda=True
    )

    def lines(shape):
        return {
            ln.name.split(" (")[0]: ln.nbytes
            for ln in activation_lines(shape, step, options, torch.bfloat16)
        }

    a, b = lines(plain), lines(fused)
    ws = "one layer's backward working set"
    h, i = plain.hidden_size, plain.intermediate_size
    if not tile:
        assert a[ws] - b[ws] == 2 * i * t
    else:
        assert a[ws] - b[ws] == FUSED_TILED_BYTES_PER_TOKEN_HIDDEN * h * t
        # The tile holds the measured peak of the gated MLP's backward (tiny Qwen2: no q/k
        # norms).
        q = plain.num_heads * plain.head_dim
        kv = plain.kv_size
        per_token = 32 * h + 4 * q + 4 * kv
        assert a[ws] == per_token * t + GATED_MLP_PEAK_BYTES_PER_TOKEN_INTER * i * tile
    # The fused loss's phase, head copy and weight gradient included, never overlaps a layer's
    # backward: one line, what exceeds that backward (here nothing: tiny vocab).
    phase = [
        ln
        for ln in activation_lines(fused, step, options, torch.bfloat16)
        if ln.name.startswith("fused loss phase")
    ]
    assert len(phase) == 1 and "never alive with a layer's backward" in phase[0].name
    assert not any(k.startswith("LM head") for k in b) and any(k.startswith("LM head") for k in a)
    assert sum(b.values()) < sum(a.values())
    # Two micro-batches: the gradients of the first are alive in the second's backward, so
    # the head's line is summed with it again (and the embedding's stays a parameter line).
    accumulated = StepShape(seq_len=256, micro_batch_tokens=t, grad_accum=2)
    names = [ln.name for ln in activation_lines(fused, accumulated, options, torch.bfloat16)]
    assert any(n.startswith("LM head") for n in names)
    assert not any(n.startswith(("fused loss phase", "embedding's fp32")) for n in names)


def test_plan_cli_liger_keeps_more_layers(capsys):
    """`plan --liger` (and auto's compiled kernels): the smaller saved set of the fused kernels
    leaves room to keep more layers' activations (Qwen2.5-1.5B at one 64k-token micro-batch on
    an H200)."""
    import re  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from hf_megatrain.cli import main  # noqa: PLC0415

    cfg = Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / "qwen2.5-1.5b"
    argv = ["plan", str(cfg), "--seq-len", "4096", "--tokens-per-step", "65536",
            "--keep-activations", "auto", "--hbm-gib", "139.3", "--host-gib", "124",
            "--no-search"]  # fmt: skip

    def kept(extra: list[str]) -> int:
        assert main(argv + extra) == 0
        first, last = re.search(r"activations kept, no recompute: layers (\d+)-(\d+)",
                                capsys.readouterr().out).groups()  # fmt: skip
        return int(last) - int(first) + 1

    assert kept(["--liger"]) > kept(["--layer-kernels", "torch"]) > 0
    assert kept([]) == kept(["--liger"])  # auto: compiled (or Liger's), the same saves


def test_liger_without_the_transformers_integration_module(monkeypatch):
    """transformers versions that apply Liger inline in the Trainer have no
    ``transformers.integrations.liger``: the same instance patching is called directly (the
    model under PEFT adapters), and a missing liger-kernel is a clear ImportError."""
    import sys  # noqa: PLC0415
    import types  # noqa: PLC0415

    import pytest  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    from hf_megatrain.hf.long_context import apply_liger_kernels  # noqa: PLC0415

    monkeypatch.setitem(sys.modules, "transformers.integrations.liger", None)
    calls = []
    fake = types.ModuleType("liger_kernel.transformers")
    fake._apply_liger_kernel_to_instance = lambda model, **kw: calls.append((model, kw))
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    base = nn.Linear(2, 2)
    wrapped = types.SimpleNamespace(get_base_model=lambda: base)
    apply_liger_kernels(wrapped, {"rope": False})
    assert calls == [(base, {"rope": False})]
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    with pytest.raises(ImportError, match="needs liger-kernel"):
        apply_liger_kernels(base, None)


def test_tiling_survives_a_trainer_that_patches_liger_in_init(tmp_path, monkeypatch):
    """Older transformers apply Liger inside Trainer.__init__, after hf_megatrain tiled the
    MLPs: the tiling is installed again over the (fused) forward."""
    import transformers  # noqa: PLC0415

    calls: list = []
    used: list = []
    fake = _fake_liger(calls, used)
    monkeypatch.setattr(hf_liger, "apply_liger_kernel", fake)
    original_init = transformers.Trainer.__init__

    def init_that_patches(self, *a, **kw):
        original_init(self, *a, **kw)
        if self.args.use_liger_kernel:
            fake(self.model, self.args.liger_kernel_config)

    monkeypatch.setattr(transformers.Trainer, "__init__", init_that_patches)
    simulate_liger(monkeypatch)
    _, trainer = run_trainer(
        tiny_model(tiny_config("llama")), tmp_path, "old", mega=True, use_liger_kernel=True,
        megatrain_mlp_tile_tokens=4,
    )  # fmt: skip
    assert len(calls) == 2  # hf_megatrain's, then the Trainer's own
    mlp = trainer.model.model.layers[0].mlp
    assert isinstance(mlp.forward, TiledTokenwise)
    assert mlp.forward.forward_impl.__name__ == "fused"
    assert used and set(used) == {4}


@pytest.mark.parametrize(
    "loader_knew, workload",
    [(False, True), (True, True), (False, False)],
    ids=["plan-without-liger", "plan-with-it", "fixed-reserve-plan"],
)
def test_trainer_warns_when_a_loaders_plan_missed_liger(
    tmp_path, monkeypatch, caplog, loader_knew, workload
):
    """A model streamed by a loader without use_liger_kernel carries a plan that over-counts the
    fused kernels' activations: the trainer given use_liger_kernel=True says so, and how to fix
    it. (On the CPU no plan is made: one is attached as the GPU loader would.)"""
    from dataclasses import replace  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from hf_megatrain import HFMegaTrainer, MegaTrainArguments, init_streamed_model  # noqa: PLC0415
    from hf_megatrain.core.options import EngineOptions, StepShape  # noqa: PLC0415
    from hf_megatrain.core.planner import plan_memory  # noqa: PLC0415
    from hf_megatrain.hf.model import model_shape  # noqa: PLC0415

    from .helpers import common_args, make_data  # noqa: PLC0415

    monkeypatch.setattr(hf_liger, "apply_liger_kernel", _fake_liger([], []))
    simulate_liger(monkeypatch)
    model = init_streamed_model(
        tiny_config("llama"), device="cpu", bf16=False, layer_kernels="torch"
    )
    shape = replace(model_shape(model), fused_layer_kernels=loader_knew)
    step = StepShape(seq_len=16, micro_batch_tokens=32) if workload else None
    options = EngineOptions(keep_activations="off").resolve(clipping=True, cuda=True)
    # Without a step a fixed reserve stands for activations: nothing Liger changes.
    streamed_state(model).plan = plan_memory(
        shape, step, options, torch.bfloat16, 1 << 34, 1 << 34,
        reserve_bytes=0 if workload else 1 << 30,
    )  # fmt: skip
    args = MegaTrainArguments(
        output_dir=str(tmp_path), use_liger_kernel=True, **common_args(max_steps=1)
    )
    with caplog.at_level("WARNING", logger="hf_megatrain.hf.trainer"):
        HFMegaTrainer(model=model, args=args, train_dataset=make_data(4))
    warned = [r.getMessage() for r in caplog.records if "made without Liger" in r.getMessage()]
    assert bool(warned) == (workload and not loader_knew)
    if warned:
        assert "init_streamed_model / load_streamed_model" in warned[0]


def test_liger_global_patches_stay_with_the_model_that_asked(tmp_path, monkeypatch):
    """Liger-Kernel replaces the family's RMSNorm and MLP classes, its RoPE function and its
    CausalLM forward in the modeling module, not only the model's modules: after hf_megatrain
    applies it, the module is as before (a stock model built later runs PyTorch's kernels) and
    the RoPE replacement runs inside the streamed model's attention only."""
    import torch  # noqa: PLC0415
    from transformers.models.llama import modeling_llama as ml  # noqa: PLC0415

    originals = {n: getattr(ml, n) for n in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")}
    forward = ml.LlamaForCausalLM.forward
    for name, value in originals.items():  # restored after the test whatever happens
        monkeypatch.setattr(ml, name, value)
    monkeypatch.setattr(ml.LlamaForCausalLM, "forward", forward)
    from hf_megatrain.hf.scoped_globals import original_global, scope_global  # noqa: PLC0415

    rope_calls: list[int] = []
    family_rope = original_global(ml, "apply_rotary_pos_emb")
    # A dispatcher already in place (another model's scoped kernels, e.g. compiled ones), which
    # the stand-in below calls as "what was there": it must reach the family's, not recurse.
    scope_global(ml, "apply_rotary_pos_emb", family_rope, [])
    previous = ml.apply_rotary_pos_emb

    def liger_rope(q, k, cos, sin, *args, **kwargs):  # same arithmetic, counted
        rope_calls.append(q.shape[-2])
        return previous(q, k, cos, sin, *args, **kwargs)

    def liger_like(model, config):  # what apply_liger_kernel_to_llama(model=...) does
        ml.apply_rotary_pos_emb = liger_rope
        ml.LlamaRMSNorm = type("LigerRMSNorm", (originals["LlamaRMSNorm"],), {})
        ml.LlamaMLP = type("LigerSwiGLUMLP", (originals["LlamaMLP"],), {})
        ml.LlamaForCausalLM.forward = lambda self, *a, **kw: forward(self, *a, **kw)
        _fake_liger([], [])(model, config)

    monkeypatch.setattr(hf_liger, "apply_liger_kernel", liger_like)
    simulate_liger(monkeypatch)
    model = tiny_model(tiny_config("llama"))
    stock_twin = copy.deepcopy(model)
    logs, trainer = run_trainer(model, tmp_path, "liger", mega=True, use_liger_kernel=True)
    assert rope_calls  # the streamed model's attention ran the replacement
    assert ml.LlamaRMSNorm is originals["LlamaRMSNorm"] and ml.LlamaMLP is originals["LlamaMLP"]
    assert ml.LlamaForCausalLM.forward is forward
    assert original_global(ml, "apply_rotary_pos_emb") is family_rope  # the family's outside
    # A model of the family built now is PyTorch's, and its forward never runs the replacement.
    later = ml.LlamaForCausalLM(tiny_config("llama"))
    assert type(later.model.norm) is originals["LlamaRMSNorm"]
    calls = len(rope_calls)
    with torch.no_grad():
        stock_twin(input_ids=torch.arange(8)[None])
        later(input_ids=torch.arange(8)[None])
    assert len(rope_calls) == calls
    # ... while the streamed model still does.
    trainer.model.eval()
    with torch.no_grad():
        trainer.model(input_ids=torch.arange(8)[None])
    assert len(rope_calls) > calls


def test_liger_patches_a_type_built_as_a_supported_family(monkeypatch):
    """A model_type transformers builds with a supported family's classes (InternLM3 and
    EXAONE as ``LlamaForCausalLM``) takes the family's Liger kernels: 'auto' picks them as for
    the family, and Liger-Kernel, which dispatches on ``config.model_type``, is called with the
    family's instance patching (its keywords filtered to the function's, as Liger does)."""
    import sys  # noqa: PLC0415
    import types  # noqa: PLC0415

    import hf_megatrain.hf.long_context as long_context  # noqa: PLC0415

    model = tiny_model(alias_config(llama_alias(), tiny_config("llama")))

    calls = []

    def apply_to_llama(rope=True, rms_norm=True, swiglu=True, model=None):
        calls.append((type(model).__name__, rope, rms_norm, swiglu))

    table = types.ModuleType("liger_kernel.transformers.monkey_patch")
    table.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": apply_to_llama}
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", table)
    monkeypatch.setattr(long_context, "liger_installed", lambda: True)

    choice = long_context.apply_layer_kernels(model, "liger", "cuda")
    assert choice.liger and "llama" in choice.why
    # LIGER_LAYER_KERNELS' keywords the function does not take (the losses) are left out.
    assert calls == [("LlamaForCausalLM", True, True, True)]
    long_context.apply_liger_kernels(model, {"rope": False, "cross_entropy": True})
    assert calls[-1] == ("LlamaForCausalLM", False, True, True)
    # 'auto' takes them for the alias as for Llama.
    auto = long_context.apply_layer_kernels(model, "auto", "cuda")
    assert auto.liger and len(calls) == 3


def test_liger_warns_only_of_its_triton_backend(caplog):
    """On an op's first call Liger-Kernel imports every backend it declares; the CuTe DSL and
    Ascend ones fail on a CUDA machine without those extras and each warned in every run,
    though the Triton kernel ran. Applying Liger silences those; a Triton failure still shows."""
    import logging

    from hf_megatrain.hf.long_context import LIGER_REGISTRY_LOGGER, quiet_liger_backend_discovery

    registry = logging.getLogger(LIGER_REGISTRY_LOGGER)
    quiet_liger_backend_discovery()
    installed = len(registry.filters)
    quiet_liger_backend_discovery()  # (once: applying Liger twice adds no second filter)
    assert len(registry.filters) == installed
    msg = "Backend impl '%s' for op '%s' could not be imported: %s: %s"
    with caplog.at_level(logging.WARNING, logger=LIGER_REGISTRY_LOGGER):
        for path in ("liger_kernel.ops.backends._cutedsl.rope", "x.backends._ascend.rope"):
            registry.warning(msg, path, "rope", "ImportError", "no CuTe DSL")
        registry.warning(msg, "liger_kernel.ops.backends._triton.rope", "rope", "E", "broken")
        registry.warning("a registration problem of op %s", "rope")
    shown = [r.getMessage() for r in caplog.records]
    assert len(shown) == 2
    assert "_triton.rope" in shown[0] and shown[1] == "a registration problem of op rope"
