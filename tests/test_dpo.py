"""TRL beyond SFT: ``MegaDPOTrainer`` (the reference streams frozen from its own host store)
against TRL's stock ``DPOTrainer``, and ``MegaGRPOTrainer`` against stock ``GRPOTrainer``, on
tiny models with the bundled tokenizer, on the CPU (fp32; bf16 under CPU autocast where said),
entirely offline."""

import copy

import pytest
import torch

from hf_megatrain import (
    HFMegaTrainer,
    MegaTrainArguments,
    frozen_streamed_copy,
    load_streamed_model,
    prepare_streamed_model,
)
from hf_megatrain.core.host_store import frozen_layer_bytes
from hf_megatrain.hf.checkpoint import host_state_dict
from hf_megatrain.hf.model import streamed_state
from hf_megatrain.text import load_tokenizer

from .helpers import LogRecorder, common_args, mega_params, tiny_config, tiny_model

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from hf_megatrain.integrations.trl import (  # noqa: E402
    MegaDPOConfig,
    MegaDPOTrainer,
    MegaGRPOConfig,
    MegaGRPOTrainer,
)

STEPS = 3
BETA = 0.1


def _tokenizer():
    return load_tokenizer(None)


def _model(arch: str = "llama", seed: int = 0):
    tok = _tokenizer()
    config = tiny_config(
        arch,
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    return tiny_model(config, seed=seed)


def _preferences():
    # Completions of different lengths, so the collator pads and the masks matter.
    rows = [
        ("the host keeps", " every weight", " nothing at all, not even one"),
        ("layers stream", " through the device one at a time", " backwards"),
        ("the optimizer runs", " on the cpu", " nowhere near the layers today"),
        ("a reference model", " stays frozen", " moves"),
        ("the gpu holds", " the embeddings and the head", " the whole model"),
        ("gradients flow", " back to the host", " sideways"),
    ]
    return datasets.Dataset.from_list(
        [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in rows]
    )


def _dpo_args(mega: bool, tmp_path, name: str, **kw):
    config_cls = MegaDPOConfig if mega else trl.DPOConfig
    values = dict(
        output_dir=str(tmp_path / name),
        # DPOConfig defaults bf16 and gradient checkpointing on: compare fp32, no recompute.
        bf16=False,
        gradient_checkpointing=False,
        beta=BETA,
        max_length=32,
        **common_args(max_steps=STEPS, warmup_steps=0),
    )
    return config_cls(**{**values, **kw})


def _run_dpo(mega: bool, tmp_path, name: str, model, ref_model=None, args_kw=None, **kw):
    rec = LogRecorder()
    trainer = (MegaDPOTrainer if mega else trl.DPOTrainer)(
        model=model,
        ref_model=ref_model,
        args=_dpo_args(mega, tmp_path, name, **(args_kw or {})),
        train_dataset=_preferences(),
        eval_dataset=_preferences(),
        processing_class=_tokenizer(),
        callbacks=[rec],
        **kw,
    )
    trainer.train()
    return rec.logs, trainer


def _assert_dpo_logs_match(stock: list[dict], mega: list[dict]) -> None:
    assert len(stock) == len(mega) == STEPS
    for step, (a, b) in enumerate(zip(stock, mega), 1):
        # fp32 on the CPU, the same kernels on the same weights: the differences are the global
        # gradient norm's summation order (per layer vs per tensor) and the clip scale applied
        # in the fused AdamW (one rounding), ulps per step. Measured: loss and log-probs equal to
        # the last bit at step 1, at most 8e-7 relative apart by step 3 (grad_norm too); 1e-5
        # is >10x that and far below what a step changes (the loss moves ~1e-2).
        for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), f"{key} at step {step}"
        # A reward is beta * (policy - reference log-prob sum): its error is absolute, beta
        # times the log-probs' (measured at most 1.6e-5 on sums of up to 90 nats, rewards at
        # most 1e-6 apart). 4e-5 is >20x that and below the rewards the tests check (> 1e-3).
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert b[key] == pytest.approx(a[key], rel=0, abs=4e-5), f"{key} at step {step}"
        assert b["learning_rate"] == a["learning_rate"]


def _assert_weights_match(stock_model, mega_trainer, start) -> None:
    final = mega_params(mega_trainer)
    moved = max((final[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3  # the policy trained
    for name, p in stock_model.state_dict().items():
        # As test_equivalence.test_trainer_matches_stock: 3 clipped AdamW steps at lr 1e-2
        # amplify the per-step ulp differences to well under 1e-5, 1000x below an update.
        torch.testing.assert_close(final[name], p, rtol=0, atol=1e-5, msg=name)


def _assert_frozen_reference(trainer, want: dict[str, torch.Tensor]) -> None:
    """The reference holds weights only, never trained, with ``want``'s values."""
    state = trainer.megatrain_ref
    assert state is not None and state.frozen
    layers = state.store.layers
    # No fp32 master, gradient or AdamW moments: host bytes are the fp32 weights alone.
    assert all(not s.trainable and s.grad is None and s.exp_avg is None for s in layers)
    assert state.store.nbytes == sum(frozen_layer_bytes(s.numel, torch.float32) for s in layers)
    ref = trainer.ref_model.module
    assert not any(p.requires_grad for p in ref.parameters())
    # The optimizer updates none of the reference's tensors.
    ref_ptrs = {p.data_ptr() for p in ref.parameters() if p.device.type != "meta"}
    ref_ptrs |= {s.master.data_ptr() for s in layers}
    for group in trainer.optimizer.param_groups:
        assert not any(p.data_ptr() in ref_ptrs for p in group["params"])
    got = host_state_dict(ref)
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mega_dpo_matches_stock_dpo_trainer(arch, tmp_path):
    start = _model(arch)
    initial = {k: v.clone() for k, v in start.state_dict().items()}
    # Stock DPOTrainer loads its reference from the model's path; a from-config model has none.
    stock, stock_trainer = _run_dpo(
        False, tmp_path, "stock", copy.deepcopy(start), ref_model=copy.deepcopy(start)
    )
    mega, trainer = _run_dpo(True, tmp_path, "mega", copy.deepcopy(start))
    _assert_dpo_logs_match(stock, mega)
    # The policy moved away from the reference: the comparison covers non-zero rewards.
    assert abs(mega[-1]["rewards/margins"]) > 1e-2
    _assert_weights_match(stock_trainer.model, trainer, initial)
    # Evaluation after training, where the policy is far from the reference (margins ~0.4).
    stock_eval, mega_eval = stock_trainer.evaluate(), trainer.evaluate()
    assert abs(mega_eval["eval_rewards/margins"]) > 0.1
    for key in ("eval_loss", "eval_logps/chosen", "eval_logps/rejected"):
        assert mega_eval[key] == pytest.approx(stock_eval[key], rel=1e-5), key
    for key in ("eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins"):
        assert mega_eval[key] == pytest.approx(stock_eval[key], rel=0, abs=4e-5), key
    # The reference is the frozen snapshot of the initial weights, unchanged by training.
    _assert_frozen_reference(trainer, initial)
    # DPOTrainer's metrics come through next to the engine's.
    assert "tokens_per_s" in mega[-1] and "rewards/accuracies" in mega[-1]


def test_mega_dpo_reference_from_path_and_frozen_model(tmp_path):
    # A reference other than the policy (another init): rewards are non-zero from step 1, so
    # the comparison shows the reference's own weights are used.
    policy, other = _model(seed=0), _model(seed=1)
    other.save_pretrained(tmp_path / "ref")
    want = {k: v.clone() for k, v in other.state_dict().items()}
    stock, _ = _run_dpo(False, tmp_path, "stock", copy.deepcopy(policy), copy.deepcopy(other))
    assert abs(stock[0]["rewards/margins"]) > 1e-3
    mega, trainer = _run_dpo(True, tmp_path, "path", copy.deepcopy(policy), str(tmp_path / "ref"))
    _assert_dpo_logs_match(stock, mega)
    _assert_frozen_reference(trainer, want)
    # Already streaming frozen: used as it is, not copied.
    frozen = load_streamed_model(str(tmp_path / "ref"), device="cpu", bf16=False, trainable=False)
    mega2, trainer2 = _run_dpo(True, tmp_path, "frozen", copy.deepcopy(policy), frozen)
    assert trainer2.ref_model.module is frozen
    _assert_dpo_logs_match(stock, mega2)


def test_mega_dpo_precompute_ref_log_probs(tmp_path):
    start = _model()
    # The streamed run first: its log-probs are computed, not read from a cache of the stock
    # run's (same fingerprint: same weights and data).
    mega, trainer = _run_dpo(
        True, tmp_path, "mega", copy.deepcopy(start), args_kw={"precompute_ref_log_probs": True}
    )
    stock, _ = _run_dpo(False, tmp_path, "stock", copy.deepcopy(start), copy.deepcopy(start))
    # The policy itself computed the reference log-probs before training: no reference model.
    assert trainer.ref_model is None and trainer.megatrain_ref is None
    _assert_dpo_logs_match(stock, mega)
    # With a reference model, the frozen streamed reference computes them.
    mega2, trainer2 = _run_dpo(
        True, tmp_path, "mega2", copy.deepcopy(start), _model(seed=1),
        args_kw={"precompute_ref_log_probs": True},
    )  # fmt: skip
    stock2, _ = _run_dpo(False, tmp_path, "stock2", copy.deepcopy(start), _model(seed=1))
    assert trainer2.megatrain_ref.frozen
    assert abs(mega2[0]["rewards/margins"]) > 1e-3  # the other reference's log-probs
    _assert_dpo_logs_match(stock2, mega2)


def test_mega_dpo_with_peft_config_matches_stock(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )  # fmt: skip
    start = _model()
    stock, _ = _run_dpo(False, tmp_path, "s", copy.deepcopy(start), peft_config=copy.deepcopy(lora))
    mega, trainer = _run_dpo(True, tmp_path, "m", copy.deepcopy(start), peft_config=lora)
    # The reference is the streamed frozen base with the adapters disabled (TRL's own way).
    assert trainer.ref_model is None and trainer.megatrain_ref is None
    assert all(not s.trainable for s in trainer.megatrain.store.layers)
    _assert_dpo_logs_match(stock, mega)
    assert abs(mega[-1]["rewards/margins"]) > 1e-4  # the adapters trained


def test_frozen_streamed_copy_is_exact_in_bf16():
    # bf16 compute (CPU autocast): the copy streams the bf16 rounding of the fp32 masters, which
    # is what the trainable model's own forward streams, so the logits agree to the last bit.
    start = _model("qwen3")
    policy = prepare_streamed_model(copy.deepcopy(start), "cpu", torch.bfloat16)
    copies = [
        frozen_streamed_copy(policy, device="cpu"),
        frozen_streamed_copy(start, device="cpu"),  # from the materialized model
    ]
    ids = torch.randint(
        0, start.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = policy(input_ids=ids, use_cache=False).logits
        for ref in copies:
            torch.testing.assert_close(
                ref(input_ids=ids, use_cache=False).logits, want, rtol=0, atol=0
            )
    for ref in copies:
        store = streamed_state(ref).store
        # bf16 weights only: 2 bytes per parameter (page-rounded), no fp32 copy.
        assert all(s.master.dtype == torch.bfloat16 and s.stream is s.master for s in store.layers)
        assert store.nbytes == sum(
            frozen_layer_bytes(s.numel, torch.bfloat16) for s in store.layers
        )


def test_mega_dpo_bf16_reference_reproduces_the_first_forward(tmp_path):
    # bf16 compute (CPU autocast): the reference's bf16 weights are exactly what the policy's
    # first forward streams (the bf16 rounding of its fp32 masters), and both run the same
    # kernels, so before any update every reward is exactly 0 and the loss exactly log(2).
    mega, trainer = _run_dpo(True, tmp_path, "m", _model(), args_kw={"bf16": True, "max_steps": 1})
    assert mega[0]["rewards/chosen"] == 0.0 and mega[0]["rewards/rejected"] == 0.0
    assert mega[0]["loss"] == pytest.approx(0.6931471824645996, rel=0, abs=0)
    layers = trainer.megatrain_ref.store.layers
    # Host RAM of the reference: its bf16 weights, 2 bytes per parameter (page-rounded).
    assert all(s.master.dtype == torch.bfloat16 for s in layers)
    nbytes = sum(frozen_layer_bytes(s.numel, torch.bfloat16) for s in layers)
    assert trainer.megatrain_ref.store.nbytes == nbytes


def test_dpo_misuse_errors(tmp_path):
    peft = pytest.importorskip("peft")
    model = _model()
    lora = peft.LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="hf_megatrain: with peft_config .* leave ref_model=None"):
        _run_dpo(True, tmp_path, "a", copy.deepcopy(model), copy.deepcopy(model), peft_config=lora)
    with pytest.raises(ValueError, match="hf_megatrain: sync_ref_model=True is not supported"):
        _run_dpo(True, tmp_path, "b", copy.deepcopy(model), args_kw={"sync_ref_model": True})
    # A frozen reference streamed in another precision than the run's.
    frozen = frozen_streamed_copy(model, device="cpu", bf16=True)
    with pytest.raises(ValueError, match="hf_megatrain: ref_model streams torch.bfloat16"):
        _run_dpo(True, tmp_path, "c", copy.deepcopy(model), frozen)
    # GRPO with beta=0 uses no reference: a ref_model would be silently unused.
    with pytest.raises(ValueError, match="hf_megatrain: ref_model is used only with beta > 0"):
        MegaGRPOTrainer(
            model=copy.deepcopy(model),
            reward_funcs=_reward_length,
            args=MegaGRPOConfig(output_dir=str(tmp_path / "g"), bf16=False, use_cpu=True),
            ref_model=copy.deepcopy(model),
        )
    # A frozen model cannot be trained.
    with pytest.raises(ValueError, match="hf_megatrain: the model streams frozen"):
        HFMegaTrainer(
            model=frozen_streamed_copy(model, device="cpu", bf16=False),
            args=MegaTrainArguments(output_dir=str(tmp_path / "d"), use_cpu=True, report_to=[]),
        )


# ---- GRPO ---------------------------------------------------------------------------------------
def _reward_length(completions, **kwargs):
    """A toy reward: completions near 10 characters."""
    return [-abs(len(c) - 10) / 10 for c in completions]


def _run_grpo(mega: bool, tmp_path, name: str, model, beta: float, steps: int):
    rec = LogRecorder()
    config_cls = MegaGRPOConfig if mega else trl.GRPOConfig
    args = config_cls(
        output_dir=str(tmp_path / name),
        bf16=False,
        gradient_checkpointing=False,
        num_generations=4,
        max_completion_length=8,
        beta=beta,
        **common_args(max_steps=steps, per_device_train_batch_size=4, warmup_steps=0),
    )
    prompts = ["the host keeps", "layers stream", "the optimizer", "a reference"]
    trainer = (MegaGRPOTrainer if mega else trl.GRPOTrainer)(
        model=model,
        reward_funcs=_reward_length,
        args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in prompts]),
        processing_class=_tokenizer(),
        callbacks=[rec],
    )
    trainer.train()
    return rec.logs, trainer


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_mega_grpo_matches_stock_grpo_trainer(beta, tmp_path):
    # Stock GRPOTrainer loads its reference (beta > 0) from the policy's path: both start there.
    _model().save_pretrained(tmp_path / "start")
    path = str(tmp_path / "start")
    steps = 3
    stock, _ = _run_grpo(False, tmp_path, "stock", path, beta, steps)
    mega, trainer = _run_grpo(True, tmp_path, "mega", path, beta, steps)
    assert len(stock) == len(mega) == steps
    for step, (a, b) in enumerate(zip(stock, mega), 1):
        # The same seed draws the same completions (same logits, same sampler): rewards equal.
        assert b["reward"] == a["reward"], f"reward at step {step}"
        # fp32, the same kernels: ulp-level differences as for DPO (see above).
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7), f"loss at {step}"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), f"grad_norm at {step}"
        if beta:
            assert b["kl"] == pytest.approx(a["kl"], rel=1e-4, abs=1e-9), f"kl at {step}"
    if beta:
        # The policy moved away from the frozen streamed reference (loaded from the path).
        assert mega[-1]["kl"] > 1e-4 and trainer.megatrain_ref.frozen
    else:
        assert trainer.ref_model is None and trainer.megatrain_ref is None


def test_dev_dpo7b_script_runs_on_a_tiny_config(tmp_path):
    # dev/dpo7b.py is run on the GPU machine with the 7B config; on a CPU with a tiny config
    # the same code path (fp32, no HBM tier) writes an "ok" row in bench.py's CSV schema.
    import csv
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("dpo7b", root / "dev" / "dpo7b.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "dpo.csv"
    argv = ["--config", str(root / "benchmarks/configs/tiny-qwen2"), "--prompt-len", "8",
            "--completion-len", "24", "--steps", "2", "--out", str(out)]  # fmt: skip
    assert script.main(argv) == 0
    with out.open() as f:
        (row,) = list(csv.DictReader(f))
    assert row["status"] == "ok" and row["system"] == "megatrain-dpo"
    assert row["tokens_per_step"] == str(2 * 2 * 32 * 2) and float(row["tokens_per_s"]) > 0
