"""Engine option ``attention``: which attention implementation a streamed model runs
(hf/attention.py), on every road (the decision, the trainer, the loaders, ``plan``) and what the
memory plan counts for it. CPU only: FlexAttention's training runs are tests/test_gpu_attention.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    Gemma2Config,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
)

from hf_megatrain import HFMegaTrainer, MegaTrainArguments, init_streamed_model
from hf_megatrain.core.activation_memory import (
    EAGER_SCORES_KIND,
    MASK_KIND,
    attention_mask_lines,
)
from hf_megatrain.core.options import EngineOptions, OptionError, StepShape
from hf_megatrain.hf.attention import (
    FLEX,
    AttentionFacts,
    apply_attention,
    choose_attention,
    planned_attention,
)
from hf_megatrain.hf.model import model_shape, model_shape_from_config

from .helpers import common_args, gemma4_config, make_data, tiny_config, tiny_model

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
WINDOW = 64
# Heads of 16: FlexAttention's kernels need at least that (the shared tiny shape has 8).
WIDE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)  # fmt: skip


def _gemma2(**kw) -> Gemma2Config:
    return Gemma2Config(
        **WIDE, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        attn_logit_softcapping=50.0, **kw,
    )  # fmt: skip


def _facts(config, impl=None, **changes) -> AttentionFacts:
    facts = AttentionFacts.of_config(config, impl)
    return dataclasses.replace(facts, **changes) if changes else facts


CUDA = "cuda"
# (id, facts, device, seq_len, keyword arguments, expected implementation, words of the reason)
CASES = [
    ("gemma2-softcap-sdpa", lambda: _facts(_gemma2(), "sdpa"), CUDA, 32, {}, FLEX,
     "SDPA drops the cap"),
    ("gemma2-softcap-eager", lambda: _facts(_gemma2(), "eager"), CUDA, 32, {}, FLEX,
     "eager makes s x s scores"),
    ("gemma2-softcap-length-unknown", lambda: _facts(_gemma2(), "eager"), CUDA, None, {}, FLEX,
     "soft-capped"),
    ("mistral-window-reached", lambda: _facts(MistralConfig(**WIDE, sliding_window=WINDOW)),
     CUDA, WINDOW, {}, FLEX, f"sliding window {WINDOW} <= sequence {WINDOW}"),
    ("mistral-window-not-reached", lambda: _facts(MistralConfig(**WIDE, sliding_window=WINDOW)),
     CUDA, WINDOW - 1, {}, "sdpa", "the model's"),
    ("mistral-length-unknown", lambda: _facts(MistralConfig(**WIDE, sliding_window=WINDOW)),
     CUDA, None, {}, "sdpa", "row length unknown"),
    ("llama4-chunks-reached", lambda: _facts(tiny_config("llama4_text"), "sdpa"), CUDA, 32, {},
     "sdpa", "attention chunk 6 <= sequence 32: sdpa would make an s x s mask"),
    ("llama-full-attention", lambda: _facts(LlamaConfig(**WIDE)), CUDA, 4096, {}, "sdpa",
     "the model's"),
    ("cpu", lambda: _facts(_gemma2(), "eager"), "cpu", 32, {}, "eager", "no CUDA device (cpu)"),
    ("option-model", lambda: _facts(_gemma2(), "sdpa"), CUDA, 32, {"setting": "model"}, "sdpa",
     "attention 'model'"),
    ("flash-attention-2", lambda: _facts(_gemma2(), "flash_attention_2"), CUDA, 32, {},
     "flash_attention_2", "as given"),
    ("sequence-parallel", lambda: _facts(MistralConfig(**WIDE, sliding_window=WINDOW)), CUDA,
     WINDOW, {"sequence_parallel": 2}, "sdpa", "sequence parallelism"),
    ("class-without-flex", lambda: _facts(_gemma2(), "sdpa", supports_flex=False), CUDA, 32, {},
     "sdpa", "has no FlexAttention"),
    ("bloom-eager-no-sdpa-no-flex", lambda: _facts(tiny_config("bloom")), CUDA, 32, {}, "eager",
     "BloomForCausalLM has no FlexAttention"),
    ("eager-class-without-sdpa", lambda: _facts(GptOssConfig(**WIDE, head_dim=16)), CUDA, None,
     {}, FLEX, "GptOssForCausalLM has no SDPA"),
    # (eager asked: transformers 5.17's Gemma-2 defaults to SDPA, 5.25's to eager)
    ("heads-too-narrow", lambda: _facts(tiny_config("gemma2"), "eager"), CUDA, 32, {}, "eager",
     "heads of 8 < 16"),
    ("attention-dropout", lambda: _facts(_gemma2(attention_dropout=0.1), "sdpa"), CUDA, 32, {},
     "sdpa", "attention dropout"),
    # Gemma 4's full-attention heads (512 in its checkpoints) beside sliding ones of 256.
    ("heads-too-wide", lambda: _facts(_gemma4(512)), CUDA, 32, {}, "sdpa", "heads of 512 > 256"),
    ("every-head-narrow-enough", lambda: _facts(_gemma4(256)), CUDA, 32, {}, FLEX,
     "sliding window 6 <= sequence 32"),
]  # fmt: skip


def _gemma4(full_head_dim: int):
    """Gemma 4's per-layer widths: sliding layers' heads of 128, the full layers' own."""
    if "gemma4_text" not in CONFIG_MAPPING:
        pytest.skip("transformers without Gemma 4")
    return gemma4_config(head_dim=128, global_head_dim=full_head_dim)


@pytest.mark.parametrize(
    "facts, device, seq_len, kw, impl, words",
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_choose_attention(facts, device, seq_len, kw, impl, words):
    kw = dict(kw)
    choice = choose_attention(kw.pop("setting", "auto"), facts(), device, seq_len, **kw)
    assert choice.impl == impl
    assert words in choice.why
    assert choice.log_line() == f"hf_megatrain: attention: {impl} ({choice.why})"


def test_facts_read_the_config_and_class():
    g = AttentionFacts.of_config(_gemma2())
    assert (g.model_class, g.softcapping, g.sliding_window, g.head_dim, g.supports_flex) == (
        "Gemma2ForCausalLM",
        True,
        WINDOW,
        16,
        True,
    )
    # No implementation set: transformers' default for the class (SDPA where it has it).
    assert g.impl == ("sdpa" if g.supports_sdpa else "eager")
    llama = AttentionFacts.of_config(LlamaConfig(**WIDE))
    assert (llama.softcapping, llama.sliding_window, llama.impl) == (False, 0, "sdpa")


def test_the_option_is_checked_and_normalized():
    assert EngineOptions().attention == "auto"
    assert EngineOptions(attention=" Model ").attention == "model"
    with pytest.raises(OptionError, match="attention='flex'"):
        EngineOptions(attention="flex")


def test_apply_switches_the_model_and_every_config():
    """The switch itself (the device only feeds the decision: nothing runs here)."""
    model = tiny_model(_gemma2())
    choice = apply_attention(model, "auto", "cuda", 32)
    assert choice.impl == FLEX
    assert model.config._attn_implementation == FLEX
    assert model.model.config._attn_implementation == FLEX
    assert model_shape(model).attn_implementation == FLEX
    # Not written into config.json: a saved model loads with transformers' default again.
    assert FLEX not in model.config.to_json_string()
    kept = tiny_model(_gemma2())
    before = kept.config._attn_implementation
    assert apply_attention(kept, "model", "cuda", 32).impl == before
    assert kept.config._attn_implementation == before


def test_apply_acts_on_the_base_model_under_peft():
    peft = pytest.importorskip("peft")
    base = tiny_model(MistralConfig(**WIDE, sliding_window=WINDOW))
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"])
    model = peft.get_peft_model(base, lora)
    assert apply_attention(model, "auto", "cuda", WINDOW).impl == FLEX
    assert base.config._attn_implementation == FLEX
    assert model.config._attn_implementation == FLEX


def test_plan_counts_no_s_by_s_tensor_for_flex():
    """The planner's s x s lines are keyed on 'eager' and 'sdpa': FlexAttention gets its block
    masks only ((s / 128)^2 tiles), and no kept attention outputs (SDPA's only)."""
    shape = model_shape_from_config(AutoConfig.from_pretrained(CONFIGS / "gemma-2-2b"), "g2")
    s = 32768
    step = StepShape(seq_len=s, micro_batch_tokens=s)
    eager = dataclasses.replace(shape, attn_implementation="eager", sdpa_attention=False)
    flex, choice = planned_attention(eager, AutoConfig.from_pretrained(CONFIGS / "gemma-2-2b"),
                                     "auto", s)  # fmt: skip
    assert choice.impl == FLEX and flex.attn_implementation == FLEX and not flex.sdpa_attention
    eager_lines = attention_mask_lines(eager, step, torch.bfloat16, kept_layers=[0, 1])
    assert sum(ln.nbytes for ln in eager_lines) >= s * s * 4  # the masks and scores it replaces
    lines = attention_mask_lines(flex, step, torch.bfloat16, kept_layers=[0, 1])
    assert [ln.kind for ln in lines] == [MASK_KIND]
    assert "FlexAttention block masks" in lines[0].name
    # Two masks (full and sliding layers), 16 B per 128 x 128 tile: 2 MiB, not 2 x 4 GiB.
    assert lines[0].nbytes == 2 * (s // 128) ** 2 * 16
    assert all(ln.kind != EAGER_SCORES_KIND for ln in lines)
    # Sliding-window SDPA at seq >= window made an s x s mask; FlexAttention does not.
    danube = AutoConfig.from_pretrained(CONFIGS / "h2o-danube-1.8b")
    sdpa = model_shape_from_config(danube, "danube")
    assert sdpa.attn_implementation == "sdpa" and sdpa.sliding_window
    long = StepShape(seq_len=262144, micro_batch_tokens=262144)
    assert sum(ln.nbytes for ln in attention_mask_lines(sdpa, long, torch.bfloat16)) > 2**37
    flex_danube, _ = planned_attention(sdpa, danube, "auto", long.seq_len)
    flex_lines = attention_mask_lines(flex_danube, long, torch.bfloat16)
    assert sum(ln.nbytes for ln in flex_lines) == (262144 // 128) ** 2 * 16  # 64 MiB
    # Below the window SDPA runs is_causal and stays: nothing to gain.
    short, choice = planned_attention(sdpa, danube, "auto", sdpa.sliding_window - 1)
    assert short.attn_implementation == "sdpa" and choice.why == "the model's"


def test_plan_cli_gemma2_at_32k_fits_with_flex(capsys):
    """Before the option, Gemma-2-2B at 32k tokens was refused on one H200: eager attention's
    s x s scores (112 GiB) and masks (8 GiB). The plan now says FlexAttention and fits."""
    from hf_megatrain.cli import main  # noqa: PLC0415

    argv = ["plan", str(CONFIGS / "gemma-2-2b"), "--seq-len", "32768", "--tokens-per-step",
            "32768", "--hbm-gib", "139.3", "--host-gib", "120", "--no-search"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "attention: flex_attention (soft-capped attention logits" in out
    assert "eager attention" not in out and "attention masks (eager" not in out
    assert "FlexAttention block masks" in out
    assert "available (fits" in out


def test_plan_cli_keeps_sdpa_below_the_window(capsys):
    from hf_megatrain.cli import main  # noqa: PLC0415

    argv = ["plan", str(CONFIGS / "h2o-danube-1.8b"), "--seq-len", "2048", "--tokens-per-step",
            "2048", "--hbm-gib", "139.3", "--host-gib", "120", "--no-search"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "attention: sdpa (the model's)" in out
    assert "FlexAttention" not in out


def test_trainer_on_cpu_keeps_the_model_attention(tmp_path, caplog):
    """A soft-capped model on the CPU: no FlexAttention backward there, the model's own
    implementation stays, and the log says why."""
    model = tiny_model(_gemma2())
    before = model.config._attn_implementation
    args = MegaTrainArguments(output_dir=str(tmp_path), **common_args())
    with caplog.at_level("INFO", logger="hf_megatrain.hf.attention"):
        trainer = HFMegaTrainer(model=model, args=args, train_dataset=make_data(4, seq=WINDOW))
    assert trainer.model.config._attn_implementation == before
    assert f"hf_megatrain: attention: {before} (the model's; soft-capped" in caplog.text
    assert "no CUDA device (cpu)" in caplog.text


def test_loader_decides_with_the_step(caplog):
    """init_streamed_model takes the decision from the options and the step's row length."""
    cfg = MistralConfig(**WIDE, sliding_window=WINDOW)
    with caplog.at_level("INFO", logger="hf_megatrain.hf.attention"):
        model = init_streamed_model(
            cfg, device="cpu", bf16=False, step=StepShape(WINDOW, WINDOW), resident_layers="0"
        )
    assert model.config._attn_implementation == "sdpa"
    assert "attention: sdpa (the model's; sliding window" in caplog.text
    assert "no CUDA device (cpu)" in caplog.text
