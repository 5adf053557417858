"""Saving, loading and resuming through the host store."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.trainer_utils import get_last_checkpoint

from hf_megatrain import load_streamed_model
from hf_megatrain.hf.model import streamed_state

from .helpers import (
    LogRecorder,
    assert_logs_match,
    make_data,
    mega_params,
    reset_peak_rss,
    run_trainer,
    status_mib,
    tiny_config,
    tiny_model,
)


def _ids(n: int = 3) -> torch.Tensor:
    return torch.stack([r["input_ids"] for r in make_data(n, seed=7)])


@torch.no_grad()
def _logits(model, ids) -> torch.Tensor:
    model.eval()
    return model(input_ids=ids, use_cache=False).logits


# gemma3_text ties the LM head to the embedding; the MoE models go through transformers' expert
# conversion (fused 3D experts in memory, per-expert tensors on disk) when saving.
@pytest.mark.parametrize(
    "arch",
    ["llama", "gemma3_text", "qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss", "phi",
     "granitemoe", "deepseek_v3", "glm4_moe", "lfm2"],
)  # fmt: skip
def test_save_model_then_from_pretrained(arch, tmp_path):
    model = tiny_model(tiny_config(arch))
    _, stock = run_trainer(copy.deepcopy(model), tmp_path, "stock", False, max_steps=3)
    _, mega = run_trainer(copy.deepcopy(model), tmp_path, "mega", True, max_steps=3)
    out = tmp_path / "saved"
    mega.save_model(str(out))
    assert not any(n.startswith(".megatrain-staging") for n in os.listdir(out))
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = _ids()
    got = _logits(loaded, ids)
    # fp32 masters are written as-is and the forward is the same code on the same weights:
    # the reloaded model reproduces the streamed model's logits bit for bit.
    torch.testing.assert_close(got, _logits(mega.model, ids), rtol=0, atol=0)
    # And the stock-trained model's, up to the few-ulp weight differences of 3 clipped AdamW
    # steps (see test_equivalence): logits of O(1) agree to 1e-4.
    torch.testing.assert_close(got, _logits(stock.model, ids), rtol=0, atol=1e-4)
    # Every weight survived the round trip (including per-expert conversion for MoE).
    saved = loaded.state_dict()
    for name, value in mega_params(mega).items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)


# Both MoE families: resume reads back what save_pretrained wrote, i.e. per-expert tensors under
# the checkpoint's own (pre-rename) module names.
@pytest.mark.parametrize(
    "arch",
    ["llama", "qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss", "granitemoe", "deepseek_v3"],
)
def test_resume_from_checkpoint(arch, tmp_path):
    model = tiny_model(tiny_config(arch))
    kw = dict(max_steps=6, save_strategy="steps", save_steps=3)
    full_logs, full = run_trainer(copy.deepcopy(model), tmp_path, "full", True, **kw)
    ckpt = tmp_path / "full" / "checkpoint-3"
    assert ckpt.is_dir() and (tmp_path / "full" / "checkpoint-6").is_dir()
    assert not (tmp_path / "full" / ".megatrain-staging").exists()
    assert len(full_logs) == 6

    # A fresh model object: everything must come from the checkpoint, not from memory.
    resumed_logs, resumed = run_trainer(
        copy.deepcopy(model), tmp_path, "resumed", True, resume=str(ckpt), **kw
    )
    assert [round(log["epoch"], 6) for log in resumed_logs] == [
        round(log["epoch"], 6) for log in full_logs[3:]
    ]
    # Weights, both AdamW moments, step counts, scheduler and data order all restored from fp32
    # state: the continuation is the same computation, bit for bit.
    assert_logs_match(full_logs[3:], resumed_logs, rel=0)
    a, b = mega_params(full), mega_params(resumed)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


def test_a_resume_with_other_run_arguments_says_what_it_does(tmp_path, caplog):
    """The Python API resumed under a changed learning rate (dropped: the saved scheduler keeps
    the old one) or max_grad_norm (applied) without a word, as the stock Trainer does (found by
    an audit); the CLI refuses such a resume. The trainer now warns, naming each argument and
    what the resume does with it; an unchanged resume says nothing."""
    model = tiny_model(tiny_config("llama"))
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
    run_trainer(copy.deepcopy(model), tmp_path, "full", True, **kw)
    ckpt = str(tmp_path / "full" / "checkpoint-2")
    with caplog.at_level("WARNING", logger="hf_megatrain.hf.trainer"):
        run_trainer(copy.deepcopy(model), tmp_path, "same", True, resume=ckpt, **kw)
    assert "No uninterrupted run" not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_megatrain.hf.trainer"):
        run_trainer(
            copy.deepcopy(model), tmp_path, "other", True, resume=ckpt,
            learning_rate=5e-3, max_grad_norm=0.0, **kw,
        )  # fmt: skip
    assert "learning_rate=0.01 (this run: 0.005), max_grad_norm=0.5 (this run: 0.0)" in caplog.text
    assert "keep learning_rate as saved; max_grad_norm takes this run's value" in caplog.text


def test_a_moe_resume_at_another_batch_layout_warns_of_the_aux_loss(tmp_path, caplog):
    """The router aux loss is computed per micro-batch: 4 rows x 1 and 2 x 2 train the same
    rows but another objective (stock alike), so a resume at another layout is not the run an
    uninterrupted one would be, and says so; a dense model's resume at it says nothing."""
    for arch in ("mixtral", "llama"):
        model = tiny_model(tiny_config(arch))  # (the tiny MoE configs have the aux loss on)
        kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
        run_trainer(copy.deepcopy(model), tmp_path, f"{arch}-4x1", True,
                    per_device_train_batch_size=4, **kw)  # fmt: skip
        caplog.clear()
        with caplog.at_level("WARNING", logger="hf_megatrain.hf.trainer"):
            run_trainer(
                copy.deepcopy(model), tmp_path, f"{arch}-2x2", True,
                resume=str(tmp_path / f"{arch}-4x1" / "checkpoint-2"),
                per_device_train_batch_size=2, gradient_accumulation_steps=2, **kw,
            )  # fmt: skip
        warned = "router aux loss is computed per micro-batch" in caplog.text
        assert warned == (arch == "mixtral"), (arch, caplog.text)
        if arch == "mixtral":
            assert "batch 4 x accumulation 1 on 1 process" in caplog.text


@pytest.mark.parametrize(
    "arch,shard",
    [
        ("llama", "20KB"),
        ("gemma3_text", None),
        ("qwen3_moe", "20KB"),
        ("mixtral", None),
        ("qwen2_moe", "20KB"),
        ("olmoe", None),
        ("gpt_oss", None),
        ("phi", None),
        ("granitemoe", None),
        ("deepseek_v3", "20KB"),
        ("glm4_moe", None),
        ("lfm2", None),
        ("falcon", "20KB"),
        ("bloom", None),
    ],
)
def test_load_streamed_model_matches_from_pretrained(arch, shard, tmp_path):
    model = tiny_model(tiny_config(arch))
    kw = {} if shard is None else {"max_shard_size": shard}
    model.save_pretrained(str(tmp_path), **kw)
    if shard is not None:
        # The point of a small shard size: the loader must follow the index across files.
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    streamed = load_streamed_model(str(tmp_path), device="cpu", bf16=False)
    assert streamed_state(streamed) is not None
    assert not streamed.training and not ref.training  # eval mode, as from_pretrained's
    ids = _ids()
    # Same fp32 weights, same forward: identical logits.
    torch.testing.assert_close(_logits(streamed, ids), _logits(ref, ids), rtol=0, atol=0)


def test_quantized_checkpoint_is_refused_before_loading(tmp_path, monkeypatch):
    """gpt-oss ships MXFP4 experts: a quantized checkpoint is refused, naming the method, before
    the host store is allocated or a tensor is read."""
    import json

    from hf_megatrain import UnsupportedModelError
    from hf_megatrain.hf import loading

    tiny_model(tiny_config("gpt_oss")).save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(loading, "streamed_skeleton", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(UnsupportedModelError, match=r"quantized checkpoint \(mxfp4\)"):
        load_streamed_model(str(tmp_path), device="cpu", bf16=False)


def test_checkpoint_not_visible_until_complete(tmp_path, monkeypatch):
    from hf_megatrain.hf import trainer as trainer_mod

    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(trainer_mod, "save_optimizer_state", boom)
    model = tiny_model(tiny_config("llama"))
    with pytest.raises(OSError, match="simulated"):
        run_trainer(model, tmp_path, "run", True, max_steps=4, save_strategy="steps", save_steps=2)
    run_dir = tmp_path / "run"
    assert run_dir.is_dir()
    # Weights were already written when the optimizer save failed; none of it may look like a
    # checkpoint that resume (get_last_checkpoint) would pick up.
    assert not [p for p in run_dir.iterdir() if p.name.startswith("checkpoint-")]
    assert get_last_checkpoint(str(run_dir)) is None


def _checkpoints(run_dir) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith("checkpoint-"))


def test_save_total_limit_and_load_best_model_at_end(tmp_path):
    """Checkpoint rotation and best-model reload behave as with the stock Trainer."""
    eval_data = make_data(4, seed=3)
    model = tiny_model(tiny_config("llama"))
    results = {}
    for name, mega in (("stock", False), ("mega", True)):
        rec = LogRecorder()
        _, trainer = run_trainer(
            copy.deepcopy(model),
            tmp_path,
            name,
            mega,
            eval_dataset=eval_data,
            recorder=rec,
            max_steps=6,
            # lr high enough that eval loss goes up again, so "best" is not simply the last.
            learning_rate=5e-2,
            save_strategy="steps",
            save_steps=1,
            eval_strategy="steps",
            eval_steps=1,
            save_total_limit=2,
            load_best_model_at_end=True,
            metric_for_best_model="eval_loss",
        )
        final_eval = trainer.evaluate()["eval_loss"]
        results[name] = (_checkpoints(tmp_path / name), trainer.state, rec, final_eval)
    (s_ckpts, s_state, s_rec, s_eval), (m_ckpts, m_state, m_rec, m_eval) = results.values()
    # Rotation keeps at most 2 checkpoints plus the best one, in the real output dir.
    assert m_ckpts == s_ckpts
    assert 2 <= len(m_ckpts) <= 3
    assert not (tmp_path / "mega" / ".megatrain-staging").exists()
    assert m_state.best_global_step == s_state.best_global_step
    assert m_state.best_model_checkpoint == str(
        tmp_path / "mega" / f"checkpoint-{m_state.best_global_step}"
    )
    # The best model was reloaded: the final evaluation is the best step's evaluation, not the
    # last step's (the weights differ from stock by ulps, see test_equivalence: 1e-5 relative).
    best = min(m_rec.eval_logs, key=lambda x: x["eval_loss"])["eval_loss"]
    assert m_eval == pytest.approx(best, rel=1e-6)
    assert m_eval == pytest.approx(s_eval, rel=1e-5)


def test_a_save_holds_no_second_copy_of_the_streamed_weights(tmp_path):
    """Found by an audit: the saved state dict's streamed weights were views of each layer's one
    buffer, and ``save_pretrained`` clones tensors that share a storage without being tied, so
    every save (each checkpoint and the final model) held one more fp32 copy of every streamed
    weight in host RAM: +587 MiB on a 589 MiB model, +56 GiB at 14B. Each view now has a
    storage of its own over the same memory."""
    from transformers import LlamaConfig  # noqa: PLC0415
    from transformers.pytorch_utils import id_tensor_storage  # noqa: PLC0415

    from hf_megatrain import init_streamed_model  # noqa: PLC0415
    from hf_megatrain.hf.checkpoint import host_state_dict, save_streamed_pretrained  # noqa: PLC0415

    # Four layers of 19M parameters (77 MB each in fp32): the weights are most of the model.
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=24576,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = init_streamed_model(cfg, device="cpu", bf16=False)
    layers = {k: v for k, v in host_state_dict(model).items() if ".layers." in k}
    assert len({id_tensor_storage(v) for v in layers.values()}) == len(layers)
    weights_mib = sum(v.numel() * v.element_size() for v in layers.values()) / 2**20
    if not reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs to reset the peak RSS")
    before = status_mib("VmRSS")
    save_streamed_pretrained(model, str(tmp_path / "out"), max_shard_size="50MB")
    grew = status_mib("VmHWM") - before
    # A copy would add the weights' 300 MiB; the writer's own buffers are a few MiB.
    assert grew < 0.2 * weights_mib, (grew, weights_mib)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    name = next(iter(layers))
    assert torch.equal(loaded.state_dict()[name], layers[name])


@pytest.mark.parametrize("size", ["20KiB", "20000", "0.02mb"])
def test_every_shard_size_the_option_accepts_saves(tmp_path, size):
    """``max_shard_size`` accepted '20KiB' and '20000', which transformers' writer refuses
    ('Unit ... not supported'), so a run failed at its first checkpoint, hours in. The size is
    now handed over in bytes, and a size the option refuses is refused before training."""
    from hf_megatrain import EngineOptions, init_streamed_model
    from hf_megatrain.core.options import OptionError, size_bytes
    from hf_megatrain.hf.checkpoint import save_streamed_pretrained

    model = init_streamed_model(tiny_config("llama"), device="cpu", bf16=False)
    save_streamed_pretrained(model, str(tmp_path / "out"), max_shard_size=size)
    shards = list((tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 1 and all(p.stat().st_size <= size_bytes(size) + 4096 for p in shards)
    with pytest.raises(OptionError, match="max_shard_size='20 kilobytes'"):
        EngineOptions(max_shard_size="20 kilobytes")


_MOE_SAVE = """
import glob, json, sys
import torch
from safetensors.torch import load_file
from transformers import MixtralConfig
from transformers.core_model_loading import revert_weight_conversion
from hf_megatrain import EngineOptions, init_streamed_model
from hf_megatrain.core.plan_arithmetic import save_line
from hf_megatrain.hf.checkpoint import host_state_dict, save_streamed_pretrained
from hf_megatrain.hf.model import model_shape
from tests.helpers import reset_peak_rss, status_mib

# 8 experts of width 4096 over hidden 256, 4 layers: 256 MiB of gate/up in fp32.
cfg = MixtralConfig(vocab_size=128, hidden_size=256, intermediate_size=4096, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8)
model = init_streamed_model(cfg, device="cpu", bf16=False)
line = save_line(model_shape(model), EngineOptions().resolve(clipping=True, cuda=False), 0)
reset_peak_rss()
before = status_mib("VmRSS")
save_streamed_pretrained(model, sys.argv[1], max_shard_size="50MB")
grew = status_mib("VmHWM") - before
# transformers' own revert (copies) of the same state: the files must hold exactly that.
stock = revert_weight_conversion(model, host_state_dict(model))
saved = {}
for f in glob.glob(sys.argv[1] + "/*.safetensors"):
    saved.update(load_file(f))
same = sorted(saved) == sorted(stock) and all(torch.equal(saved[k], stock[k]) for k in stock)
print("RESULT " + json.dumps(dict(planned=line.nbytes / 2**20 if line else 0.0, grew=grew,
                                  same=same, experts=sum(".experts." in k for k in saved))))
"""


def test_a_save_of_fused_moe_experts_copies_none_of_them(tmp_path):
    """transformers reverts fused MoE experts to the checkpoint's layout on save, and its
    ``Chunk`` made each ``gate_up_proj``'s halves contiguous: a copy of 2/3 of the experts, all
    alive at once (planned since, 23.8 GB for OLMoE). The revert now hands out views (each
    expert's half is a contiguous slice of the fused tensor): the save grows the host by a few
    MiB where the copies were 256, the plan has no line for it, and the files hold exactly what
    transformers' own revert makes (measured in a fresh process: one that freed memory before
    reuses it without growing)."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    if not reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs to reset the peak RSS")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", _MOE_SAVE, str(tmp_path / "out")],
        cwd=root, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    r = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT ")).split(" ", 1)[1])
    assert r["same"] and r["experts"] == 4 * 8 * 3, r
    # The copies were 256 MiB (2/3 of the experts); the writer adds a few MiB of its own.
    assert r["planned"] == 0.0 and r["grew"] < 24, r
