"""Fast by default (issue 20): the defaults are the measured-fastest exact settings, chosen from
the memory plan of the actual workload, and Liger-Kernel's layer kernels where they apply.

CPU only: the planner's choices for Llama-3.1-8B on an H200's memory, the layer-kernel
decision with liger-kernel's presence and CUDA simulated, and what the trainer does with the
defaults here (no plan, no CUDA: nothing kept, PyTorch's kernels, no warning)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hf_megatrain.core.options import EngineOptions, StepShape
from hf_megatrain.core.plan_search import ATTENTION_FIRST_TOKENS
from hf_megatrain.core.planner import GIB, plan_memory
from hf_megatrain.hf.long_context import (
    LIGER_INSTALL,
    LIGER_LAYER_KERNELS,
    choose_layer_kernels,
    liger_installed,
)

from .helpers import (
    common_args,
    make_data,
    patch_mlps_as_liger,
    run_trainer,
    simulate_liger,
    tiny_config,
    tiny_model,
)

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
H200 = int(139.3 * GIB)
HOST = 124 * GIB


@pytest.fixture(scope="module")
def llama8b():
    from transformers import AutoConfig  # noqa: PLC0415

    from hf_megatrain.hf.model import model_shape_from_config  # noqa: PLC0415

    return model_shape_from_config(AutoConfig.from_pretrained(CONFIGS / "llama-3.1-8b"), "8b")


def _plan(shape, tokens, hbm=H200, host=HOST, **options):
    resolved = EngineOptions(**options).resolve(clipping=True, cuda=True)
    step = StepShape(seq_len=4096, micro_batch_tokens=tokens)
    return plan_memory(shape, step, resolved, torch.bfloat16, hbm, host)


def _attention_line(plan) -> int:
    return sum(ln.nbytes for ln in plan.gpu_lines if ln.name.startswith("attention outputs"))


# ---- keep_attention_outputs "auto" in the plan -------------------------------------------------
def test_auto_attention_outputs_go_before_the_tier_at_64k_and_are_counted(llama8b):
    """The headline workload: every layer keeps its attention outputs and the tier takes what
    they leave (14 layers; 13 measured fastest then: 461 against 451 TFLOP/s with 18 and none,
    the plan's margin was a fixed 3% then, now each line's measured error); the outputs' bytes
    are a GPU line of the plan, which still fits."""
    off = _plan(llama8b, 65536, keep_attention_outputs="off")
    auto = _plan(llama8b, 65536)
    assert (off.n_hbm, off.attention_layers) == (18, 0)
    # The host tier's 18 of 32 layers keep up with the forward: no device-update staging (it
    # cost this workload 9% when it ran, test_device_updates.py has the rule).
    assert (auto.n_hbm, auto.attention_layers) == (14, 32) and not auto.device_updates
    assert auto.fits and auto.gpu_total <= H200
    assert _attention_line(auto) == _attention_line(
        _plan(llama8b, 65536, keep_attention_outputs="all")
    )
    assert _attention_line(auto) > 16 * GIB  # 32 layers x 64k tokens x (32 x 128 x 2 + 32 x 4) B
    table = auto.table()
    assert "attention outputs kept for the recompute: 32 layers, 0-31 (auto" in table
    assert "planned before the HBM tier" in table


def test_auto_attention_outputs_fill_what_is_left_below_64k(llama8b):
    """Shorter micro-batches: the tier first (as without them), attention outputs in the rest."""
    tokens = ATTENTION_FIRST_TOKENS // 4
    off = _plan(llama8b, tokens, keep_attention_outputs="off", keep_activations="off")
    auto = _plan(llama8b, tokens, keep_activations="off")
    assert auto.n_hbm == off.n_hbm
    assert auto.fits and "the tier first" in auto.table()


def test_auto_attention_outputs_never_make_a_fitting_plan_not_fit(llama8b):
    """HBM for the run without them and little more: "auto" keeps only what fits beside it."""
    off = _plan(llama8b, 65536, keep_attention_outputs="off", keep_activations="off")
    tight = off.gpu_total - sum(ln.nbytes for ln in off.gpu_lines if "HBM-tier" in ln.name)
    tight += 4 * GIB  # the no-tier run and 4 GiB: room for a few layers' attention outputs
    base = _plan(llama8b, 65536, hbm=tight, keep_attention_outputs="off")
    auto = _plan(llama8b, 65536, hbm=tight)
    assert base.fits and auto.fits
    assert 0 < auto.attention_layers < 32
    assert auto.gpu_total <= tight
    # Host RAM that holds the streamed layers of the 18-layer tier but not of the 13-layer one:
    # the attention outputs give way so that the tier stays large enough for the host.
    host = off.host_total + 2 * GIB
    auto_host = _plan(llama8b, 65536, host=host)
    assert _plan(llama8b, 65536, host=host, keep_attention_outputs="off").fits
    assert auto_host.fits and auto_host.n_hbm > 13 and auto_host.attention_layers < 32


def test_auto_attention_outputs_plan_nothing_for_attention_outside_sdpa(llama8b):
    eager = replace(llama8b, sdpa_attention=False)
    off = _plan(eager, 65536, keep_attention_outputs="off")
    auto = _plan(eager, 65536)
    assert auto.attention_layers == 0 and auto.n_hbm == off.n_hbm
    assert "none (attention does not run through PyTorch SDPA)" in auto.table()
    # Without the step (a fixed reserve) nothing is kept either.
    resolved = EngineOptions().resolve(clipping=True, cuda=True)
    assert plan_memory(llama8b, None, resolved, torch.bfloat16, H200, HOST).attention_layers == 0


def test_the_trainer_defaults_on_cpu_keep_nothing_and_do_not_warn(tmp_path, caplog):
    """No plan on a CPU: keep_attention_outputs "auto" keeps none, silently, also for attention
    outside SDPA; "all" asked for there is warned about (it cannot be used)."""
    model = tiny_model(tiny_config("llama"))
    model.config._attn_implementation = "eager"
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
        _, trainer = run_trainer(model, tmp_path, "auto", mega=True, max_steps=1)
    layers = trainer.model.model.layers
    assert not any(layer.forward.keep_attention for layer in layers)
    assert not [r for r in caplog.records if "keep_attention_outputs" in r.getMessage()]
    caplog.clear()
    model = tiny_model(tiny_config("llama"))
    model.config._attn_implementation = "eager"
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
        run_trainer(
            model, tmp_path, "all", mega=True, max_steps=1, megatrain_keep_attention_outputs="all"
        )
    assert [r for r in caplog.records if "keep_attention_outputs has no effect" in r.getMessage()]


# ---- layer_kernels ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "installed, cuda, compiles, family, kind, why",
    [
        (False, True, True, "llama", "compiled", "torch.compile (Triton), llama"),
        (False, True, False, "llama", "torch", "Triton is not installed"),
        (True, False, True, "llama", "torch", "no CUDA device"),
        (False, False, True, "llama", "torch", "no CUDA device"),
        (True, True, True, "llama", "liger", "Liger-Kernel installed, llama"),
        (True, True, True, "qwen3", "liger", "Liger-Kernel installed, qwen3"),
        (False, True, True, "qwen3", "compiled", "torch.compile (Triton), qwen3"),
        (True, True, True, "gemma", "torch", "not all ones the compiled kernels compute exactly"),
        (False, True, True, "olmo", "torch", "not all ones the compiled kernels compute exactly"),
        # Layers the compiled kernels replace whole (probed on the model: whole_layers).
        (False, True, True, "granite", "compiled", "torch.compile (Triton), granite"),
        (True, True, True, "granite", "compiled", "torch.compile (Triton), granite"),
        (False, True, False, "granite", "torch", "Triton is not installed"),
    ],
)
def test_auto_layer_kernels(monkeypatch, installed, cuda, compiles, family, kind, why):
    simulate_liger(monkeypatch, installed=installed, cuda=cuda, compiles=compiles)
    whole = family in ("llama", "qwen3", "granite")  # what compiles_whole_layers says of them
    choice = choose_layer_kernels("auto", family, "cuda" if cuda else "cpu", whole_layers=whole)
    assert choice.kind == kind and why in choice.why
    assert choice.fused == (kind != "torch") and choice.liger == (kind == "liger")
    assert choice.log_line() == f"hf_megatrain: layer kernels: {kind} ({choice.why})"
    assert choose_layer_kernels("torch", family, "cuda").kind == "torch"


def test_asked_for_compiled_kernels(monkeypatch):
    """'compiled' runs wherever torch.compile builds kernels (the CPU too), for any family (what
    of it computes like the kernels is probed when they are applied: tests/
    test_compiled_kernels.py); a clear error where nothing does, where they cannot be built, and
    beside a Liger request."""
    from hf_megatrain.hf.compiled_kernels import apply_compiled_kernels  # noqa: PLC0415

    simulate_liger(monkeypatch, installed=True, cuda=False)
    assert choose_layer_kernels("compiled", "qwen2", "cpu").kind == "compiled"
    assert choose_layer_kernels("compiled", "bloom", "cpu").kind == "compiled"
    with pytest.raises(ValueError, match="no norm, MLP or RoPE of BloomForCausalLM computes"):
        apply_compiled_kernels(tiny_model(tiny_config("bloom")))
    simulate_liger(monkeypatch, compiles=False)
    with pytest.raises(ValueError, match="'compiled': Triton is not installed"):
        choose_layer_kernels("compiled", "llama", "cuda")
    with pytest.raises(ValueError, match="megatrain_layer_kernels='compiled' forbids them"):
        choose_layer_kernels("compiled", "llama", "cuda", requested=True)


def test_asked_for_liger_kernels_must_be_able_to_run(monkeypatch):
    """'liger' or use_liger_kernel=True: Liger's kernels for any family Liger patches, and a
    clear error where they cannot run."""
    simulate_liger(monkeypatch, installed=False)
    with pytest.raises(ImportError, match=r"megatrain_layer_kernels='liger' needs liger-kernel"):
        choose_layer_kernels("liger", "llama", "cuda")
    with pytest.raises(ImportError, match=r"use_liger_kernel=True needs liger-kernel \(pip"):
        choose_layer_kernels("auto", "llama", "cuda", requested=True)
    simulate_liger(monkeypatch, cuda=False)
    with pytest.raises(ValueError, match="need a CUDA device"):
        choose_layer_kernels("liger", "llama", "cpu")
    simulate_liger(monkeypatch)
    assert choose_layer_kernels("liger", "gemma", "cuda").liger  # asked for: Liger patches it
    assert choose_layer_kernels("auto", "llama", "cuda", requested=True).liger
    with pytest.raises(ValueError, match="no kernels for model_type 'olmo'"):
        choose_layer_kernels("liger", "olmo", "cuda")
    with pytest.raises(ValueError, match="forbids them"):
        choose_layer_kernels("torch", "llama", "cuda", requested=True)


def test_trainer_applies_fused_kernels_automatically_before_streaming(
    tmp_path, monkeypatch, caplog
):
    """Default arguments and CUDA (simulated): the layer kernels go in before the model is
    streamed (the plan counts them). Liger-Kernel's layer kernels only where it is installed;
    without it the compiled ones; without either, PyTorch's, and one line says why."""
    import hf_megatrain.hf.long_context as long_context  # noqa: PLC0415
    from hf_megatrain.hf.model import layer_kernels_of, model_shape, streamed_state  # noqa: PLC0415

    calls = []

    def fake_apply(model, config):
        calls.append((config, streamed_state(model) is None))
        patch_mlps_as_liger(model)

    def said():
        return [r.getMessage() for r in caplog.records if "layer kernels:" in r.getMessage()]

    monkeypatch.setattr(long_context, "apply_liger_kernels", fake_apply)
    simulate_liger(monkeypatch, installed=False, compiles=False)
    with caplog.at_level(logging.INFO, logger="hf_megatrain"):
        _, trainer = run_trainer(tiny_model(tiny_config("llama")), tmp_path, "a", mega=True)
    assert calls == [] and not model_shape(trainer.model).fused_layer_kernels
    assert layer_kernels_of(trainer.model) == "torch"
    assert said() == [
        "hf_megatrain: layer kernels: torch (Triton is not installed; Liger-Kernel not "
        f"installed: {LIGER_INSTALL})"
    ]
    caplog.clear()
    simulate_liger(monkeypatch, installed=False)
    with caplog.at_level(logging.INFO, logger="hf_megatrain"):
        _, trainer = run_trainer(tiny_model(tiny_config("llama")), tmp_path, "b", mega=True)
    assert calls == [] and model_shape(trainer.model).fused_layer_kernels
    assert layer_kernels_of(trainer.model) == "compiled"
    assert said() == ["hf_megatrain: layer kernels: compiled (torch.compile (Triton), llama)"]
    caplog.clear()
    simulate_liger(monkeypatch)
    with caplog.at_level(logging.INFO, logger="hf_megatrain"):
        _, trainer = run_trainer(tiny_model(tiny_config("llama")), tmp_path, "c", mega=True)
    assert calls == [(LIGER_LAYER_KERNELS, True)]  # once, before streaming, layer kernels only
    assert model_shape(trainer.model).fused_layer_kernels
    assert said() == ["hf_megatrain: layer kernels: liger (Liger-Kernel installed, llama)"]
    assert not trainer.args.use_liger_kernel  # the Trainer's own patching stays off


def test_plan_says_which_layer_kernels_it_planned_for(monkeypatch, capsys):
    from hf_megatrain.cli import main  # noqa: PLC0415

    argv = ["plan", str(CONFIGS / "llama-3.1-8b"), "--seq-len", "4096", "--tokens-per-step",
            "65536", "--hbm-gib", "139.3", "--host-gib", "124", "--no-search"]  # fmt: skip
    simulate_liger(monkeypatch, installed=False)
    assert main(argv + ["--layer-kernels", "torch"]) == 0
    out = capsys.readouterr().out
    assert "layer kernels: torch (--layer-kernels torch)" in out
    torch_set = _working_set_gib(out)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "layer kernels: compiled (torch.compile, llama)" in out
    # The fused kernels' smaller working set (liger-plan-1707): no SiLU output per MLP token.
    assert "fused SwiGLU" in out and _working_set_gib(out) < torch_set
    compiled_set = _working_set_gib(out)
    simulate_liger(monkeypatch)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "layer kernels: liger (Liger-Kernel installed here, llama)" in out
    # The compiled norms keep no fp32 normalized products (8h per token, measured on the CPU
    # with Inductor's kernels); Liger's norms are not measured there and keep them in the plan.
    assert _working_set_gib(out) - compiled_set == pytest.approx(8 * 4096 * 65536 / 2**30, abs=0.01)


def _working_set_gib(plan_output: str) -> float:
    line = next(ln for ln in plan_output.splitlines() if "backward working set" in ln)
    return float(line.split()[-1])


def test_plan_names_the_attention_layers_around_a_kept_one(llama8b):
    """The recomputed layers keeping attention outputs skip the tier's last layer when it keeps
    its activations: the table names both runs, not one span over the kept layer."""
    plan = _plan(llama8b, 65536, keep_activations="1", keep_attention_outputs="all")
    assert plan.kept_layers == 1
    last = plan.n_hbm - 1
    assert plan.kept_layer_indices == [last]
    assert plan.attention_layer_indices == [i for i in range(32) if i != last]
    assert f"31 layers, 0-{last - 1}, {last + 1}-31" in plan.table()


@pytest.mark.parametrize(
    "family, kernels, audited",
    [("olmo2", "torch", True), ("olmo2", "compiled", False), ("llama", "compiled", True),
     ("gemma3_text", "torch", True), ("gemma3_text", "liger", False)],
)  # fmt: skip
def test_planned_kept_bytes_audited_with_the_kernels_planned(family, kernels, audited):
    """``plan`` plans kept activations for a family only where its count is audited under the
    kernels the run would use: the fitted families' and Gemma3's under PyTorch's kernels only
    (the fused count is the Llama family's), as the run's own model shape says."""
    from hf_megatrain.cli_plan import planned_kernel_shape

    shape, _ = planned_kernel_shape(tiny_config(family, num_hidden_layers=2), "m", kernels)
    assert shape.kept_bytes_audited == audited


@pytest.mark.parametrize(
    "family, whole",
    [("llama", True), ("qwen3", True), ("granite", True), ("smollm3", True), ("seed_oss", True),
     ("exaone4", True), ("hunyuan_v1_dense", True), ("olmo2", False), ("helium", False),
     ("phi3", False), ("gemma", False), ("cohere", False), ("qwen3_moe", False)],
)  # fmt: skip
def test_auto_compiles_the_families_whose_layers_the_kernels_replace_whole(family, whole):
    """'auto' compiles, on CUDA without Liger-Kernel, for every family whose decoder-layer norms
    and MLPs all compute exactly like the compiled kernels (bf16 too): the run (its model) and
    ``plan`` (the config's meta model) agree. Not OLMo 2's or Helium's norms (fp32 product,
    rounded once), Phi-3's fused gate-up, Gemma's 1 + weight norms, Cohere's LayerNorm, MoE
    experts."""
    from hf_megatrain.cli_plan import planned_kernel_shape
    from hf_megatrain.hf.compiled_kernels import compiles_whole_layers

    cfg = tiny_config(family, num_hidden_layers=2)
    assert compiles_whole_layers(tiny_model(cfg)) == whole
    if liger_installed():  # plan's auto would name Liger's for the Llama family here
        return
    _, kernels = planned_kernel_shape(cfg, "m")
    assert kernels.kind == ("compiled" if whole else "torch")


def test_whole_layer_probe_of_a_model_without_decoder_layers_is_false():
    """The probe runs before the support check: a model whose decoder layers are not found
    (BERT) has none the kernels replace, and the support check names its model_type."""
    from transformers import BertConfig, BertForMaskedLM

    from hf_megatrain.hf.compiled_kernels import compiles_whole_layers

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64)  # fmt: skip
    assert compiles_whole_layers(BertForMaskedLM(cfg)) is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without an accelerator")
def test_a_cpu_run_does_not_pin_its_batches(tmp_path):
    """Found by an audit: the README's example warned from torch's DataLoader ("'pin_memory'
    argument is set as true but no accelerator is found") on a CPU, where pinned batches serve
    no copy to a GPU."""
    import warnings  # noqa: PLC0415

    from hf_megatrain import HFMegaTrainer, MegaTrainArguments  # noqa: PLC0415

    # (as the README's example: no use_cpu, which turns pinning off itself)
    kw = common_args(max_steps=1, use_cpu=False)
    args = MegaTrainArguments(output_dir=str(tmp_path / "out"), **kw)
    assert args.dataloader_pin_memory  # (the Trainer's default)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = HFMegaTrainer(
            model=tiny_model(tiny_config("llama")), args=args, train_dataset=make_data(4)
        )
        trainer.train()
    assert not [w for w in caught if "pin_memory" in str(w.message)]
    assert not args.dataloader_pin_memory
