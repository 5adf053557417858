"""TRL: ``MegaSFTTrainer`` trains like TRL's stock ``SFTTrainer`` (full fine-tuning and LoRA from
``peft_config``), on a tiny Llama with the bundled tokenizer, entirely offline."""

import copy
import importlib
import sys

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from hf_megatrain import MegaTrainArguments
from hf_megatrain.cli import DEFAULT_TOKENIZER

from .helpers import LogRecorder, assert_logs_match, common_args, tiny_config, tiny_model

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from hf_megatrain.integrations.trl import MegaSFTConfig, MegaSFTTrainer  # noqa: E402

STEPS = 5


def _tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_file=str(DEFAULT_TOKENIZER), eos_token="<|endoftext|>", pad_token="<|pad|>"
    )


def _model():
    tok = _tokenizer()
    config = tiny_config(
        "llama",
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    return tiny_model(config)


def _dataset():
    # Rows of different lengths, so the collator pads and the attention mask matters.
    words = "the streamed layers run on the device while the host keeps every weight".split()
    texts = [" ".join(words[i % 5 : i % 5 + 3 + i % 7]) for i in range(24)]
    return datasets.Dataset.from_dict({"text": texts})


def _run(mega: bool, tmp_path, name: str, model=None, args_cls=None, **kw):
    config_cls = args_cls or (MegaSFTConfig if mega else trl.SFTConfig)
    trainer_cls = MegaSFTTrainer if mega else trl.SFTTrainer
    rec = LogRecorder()
    args = config_cls(
        output_dir=str(tmp_path / name),
        # SFTConfig defaults bf16 and gradient checkpointing on: compare fp32, no recompute.
        bf16=False,
        gradient_checkpointing=False,
        max_length=24,
        **common_args(max_steps=STEPS),
    )
    trainer = trainer_cls(
        model=model if model is not None else _model(),
        args=args,
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
        callbacks=[rec],
        **kw,
    )
    trainer.train()
    return rec.logs, trainer


def test_mega_sft_matches_stock_sft_trainer(tmp_path):
    stock, _ = _run(False, tmp_path, "stock")
    mega, trainer = _run(True, tmp_path, "mega")
    assert len(mega) == STEPS
    # Same tolerance and reasons as helpers.assert_logs_match (fp32 CPU, same kernels; TRL's
    # fused LM head runs identically in both; only the global-norm summation order and the
    # fused clip scale differ, ~1e-6 relative over a few steps).
    assert_logs_match(stock, mega)
    assert all(s.trainable for s in trainer.megatrain.store.layers)
    # SFTTrainer's own metrics still come through, next to the engine's.
    assert "mean_token_accuracy" in mega[-1] and "tokens_per_s" in mega[-1]


@pytest.mark.parametrize("method", ["lora", "loha"])
def test_mega_sft_with_peft_config_matches_stock(tmp_path, method):
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "v_proj", "gate_proj"]
    if method == "lora":
        lora = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"
        )
    else:  # another adapter method, with its random module dropout
        lora = peft.LoHaConfig(
            r=4, alpha=8, module_dropout=0.3, target_modules=targets, task_type="CAUSAL_LM"
        )
    stock, stock_trainer = _run(False, tmp_path, "stock", peft_config=copy.deepcopy(lora))
    mega, trainer = _run(True, tmp_path, "mega", peft_config=copy.deepcopy(lora))
    assert len(mega) == STEPS
    # SFTTrainer seeds before adding the adapters in both runs: same initial LoRA weights, and
    # (fp32 CPU) the same 1e-5 reasons as assert_logs_match.
    assert_logs_match(stock, mega)
    # Streaming happened after SFTTrainer's PEFT wrapping: the base streams from frozen stores
    # (no gradient or moment buffers) and the adapters are resident and trained like stock's.
    assert isinstance(trainer.model, peft.PeftModel)
    assert all(not s.trainable and s.exp_avg is None for s in trainer.megatrain.store.layers)
    got = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    ref = {n: p for n, p in stock_trainer.model.named_parameters() if p.requires_grad}
    assert got.keys() == ref.keys() and got
    for n, p in got.items():
        torch.testing.assert_close(p.detach().cpu(), ref[n].detach(), rtol=1e-4, atol=1e-6)


def test_training_arguments_keep_megatrain_knobs(tmp_path):
    # SFTTrainer rebuilds a non-SFTConfig args as SFTConfig; MegaSFTTrainer keeps the knobs.
    args = MegaTrainArguments(
        output_dir=str(tmp_path / "a"),
        use_cpu=True,
        report_to=[],
        megatrain_log_throughput=False,
        gradient_checkpointing=True,
    )
    trainer = MegaSFTTrainer(
        model=_model(), args=args, train_dataset=_dataset(), processing_class=_tokenizer()
    )
    assert isinstance(trainer.args, MegaSFTConfig)
    assert trainer.args.megatrain_log_throughput is False
    # Streamed layers always recompute: HF checkpointing stays off under either flag name.
    assert not trainer.args.gradient_checkpointing
    assert not getattr(trainer.args, "activation_checkpointing", False)
    help_text = MegaSFTConfig.__dataclass_fields__["megatrain_resident_layers"].metadata["help"]
    assert "HBM" in help_text
    assert "help" in MegaSFTConfig.__dataclass_fields__["max_length"].metadata


def test_streamed_model_with_peft_config_is_refused(tmp_path):
    from hf_megatrain import prepare_streamed_model  # noqa: PLC0415

    model = prepare_streamed_model(_model(), "cpu", torch.float32)
    with pytest.raises(ValueError, match="materialized model"):
        MegaSFTTrainer(
            model=model,
            args=MegaSFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False),
            train_dataset=_dataset(),
            processing_class=_tokenizer(),
            peft_config=pytest.importorskip("peft").LoraConfig(r=2),
        )


def test_missing_trl_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # makes `import trl` fail
    monkeypatch.delitem(sys.modules, "hf_megatrain.integrations.trl")
    with pytest.raises(ImportError, match="pip install trl"):
        importlib.import_module("hf_megatrain.integrations.trl")
