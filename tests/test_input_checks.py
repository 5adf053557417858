"""Bad inputs are refused with errors that name them, before any work (issue 23)."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_megatrain import HFMegaTrainer, MegaTrainArguments
from hf_megatrain.core.options import EngineOptions, OptionError

from .helpers import (
    VOCAB,
    common_args,
    make_data,
    mega_params,
    run_trainer,
    tiny_config,
    tiny_model,
)


def _trainer(tmp_path, data, model=None, **overrides):
    model = model if model is not None else tiny_model(tiny_config("llama"))
    args = MegaTrainArguments(output_dir=str(tmp_path / "out"), **common_args(**overrides))
    return HFMegaTrainer(model=model, args=args, train_dataset=data)


def test_labels_shorter_than_input_ids(tmp_path):
    data = [{"input_ids": r["input_ids"], "labels": r["labels"][:10]} for r in make_data()]
    trainer = _trainer(tmp_path, data)
    before = mega_params(trainer)
    with pytest.raises(
        ValueError, match=r"labels have shape \(2, 10\) but its input_ids \(2, 16\)"
    ):
        trainer.train()
    after = mega_params(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was trained


def test_attention_mask_shape(tmp_path):
    data = [dict(r, attention_mask=torch.ones(8, dtype=torch.long)) for r in make_data()]
    with pytest.raises(ValueError, match="attention_mask has shape"):
        _trainer(tmp_path, data).train()


def test_token_ids_outside_the_vocabulary(tmp_path):
    data = make_data()
    data[0]["input_ids"] = data[0]["input_ids"].clone()
    data[0]["input_ids"][3] = VOCAB + 5
    with pytest.raises(ValueError, match=f"vocab_size is {VOCAB}"):
        _trainer(tmp_path, data, max_steps=1, per_device_train_batch_size=32).train()
    labels = make_data()
    labels[0]["labels"] = labels[0]["labels"].clone()
    labels[0]["labels"][0] = -100  # ignored: fine
    labels[0]["labels"][1] = VOCAB
    with pytest.raises(ValueError, match="labels range over"):
        _trainer(tmp_path, labels, max_steps=1, per_device_train_batch_size=32).train()


def test_float64_model_is_refused(tmp_path):
    model = tiny_model(tiny_config("llama")).double()
    with pytest.raises(ValueError, match=r"float64 parameters .*model\.float\(\)"):
        _trainer(tmp_path, make_data(), model=model)


def test_a_half_precision_model_is_said_to_train_as_fp32_masters(tmp_path, caplog):
    """A model handed over in bf16 trains as fp32 masters (exact upcast), where the stock Trainer
    updates the bf16 weights themselves; with bf16=False it also computes in fp32. That went
    unsaid (found by an audit, through TRL's model_init_kwargs dtype); now a warning names it
    (an info line with bf16=True, where only the update's precision differs)."""
    cases = [(torch.bfloat16, False, logging.WARNING), (torch.bfloat16, True, logging.INFO),
             (torch.float32, False, None)]  # fmt: skip
    for dtype, bf16, level in cases:
        caplog.clear()
        model = tiny_model(tiny_config("llama")).to(dtype)
        with caplog.at_level(logging.INFO, logger="hf_megatrain.hf.guards"):
            _trainer(tmp_path, make_data(), model=model, bf16=bf16, use_cpu=True)
        said = [r for r in caplog.records if "train as fp32 master weights" in r.getMessage()]
        assert [r.levelno for r in said] == ([level] if level else []), (dtype, bf16)
        if said:
            assert "the stock Trainer would update the bfloat16 weights" in said[0].getMessage()


def test_rows_longer_than_learned_positions_are_refused(tmp_path):
    """A model with a learned position table (GPTBigCode's wpe) has no position past it: a
    longer row is refused before any work, naming the limit (it failed inside the embedding
    lookup). Rotary models only warn (below)."""
    model = tiny_model(tiny_config("gpt_bigcode"))
    limit = model.config.n_positions
    data = make_data(seq=limit + 8)
    trainer = _trainer(tmp_path, data, model=model, max_steps=1)
    before = mega_params(trainer)
    with pytest.raises(ValueError, match=f"longer than the {limit} positions of the model's"):
        trainer.train()
    after = mega_params(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)
    _trainer(tmp_path, make_data(seq=limit), model=tiny_model(tiny_config("gpt_bigcode")),
             max_steps=1).train()  # fmt: skip


def test_rows_longer_than_positions_warn_once(tmp_path, caplog):
    model = tiny_model(tiny_config("llama"))  # max_position_embeddings=64
    with caplog.at_level(logging.WARNING, logger="hf_megatrain.hf.guards"):
        run_trainer(model, tmp_path, "long", mega=True, data=make_data(8, seq=80), max_steps=3)
    hits = [r for r in caplog.records if "max_position_embeddings=64" in r.getMessage()]
    assert len(hits) == 1 and "80 positions" in hits[0].getMessage()


@pytest.mark.parametrize("arch", ["gpt_bigcode", "llama"])
def test_padding_free_rows_are_judged_by_their_positions(tmp_path, caplog, arch):
    """Found by an audit: a padding-free batch (DataCollatorWithFlattening: the documents in one
    row, position_ids restarting at each) was judged by its row's length: refused for learned
    positions (GPT-2, OPT), warned about for rotary ones, where the stock Trainer trains it.
    Now judged by its largest position; the same losses as stock."""
    from transformers import DataCollatorWithFlattening  # noqa: PLC0415

    cfg = tiny_config(arch)
    limit = getattr(cfg, "n_positions", None) or cfg.max_position_embeddings
    g = torch.Generator().manual_seed(1)
    docs = [{"input_ids": torch.randint(0, VOCAB, (limit - 8,), generator=g).tolist()}]
    docs *= 8  # two per batch: rows of 2 x (limit - 8) tokens, positions up to limit - 9
    logs = {}
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
        for mega in (False, True):
            logs[mega], _ = run_trainer(
                tiny_model(tiny_config(arch)), tmp_path, f"m{mega}", mega, data=docs,
                data_collator=DataCollatorWithFlattening(), max_steps=2,
            )  # fmt: skip
    assert not [r for r in caplog.records if "positions" in r.getMessage()]
    stock, streamed = ([r["loss"] for r in logs[m]] for m in (False, True))
    # fp32 on both sides: the same ops, only the host AdamW's and the streamed layers' sums
    # ordered otherwise (a few ulps of the loss after 2 steps).
    assert streamed == pytest.approx(stock, rel=1e-5)


def test_negative_host_memory_limit_is_refused(tmp_path):
    with pytest.raises(OptionError, match="host_memory_limit_gb"):
        EngineOptions(host_memory_limit_gb=-1.0)
    with pytest.raises(ValueError, match="host_memory_limit_gb"):
        _trainer(tmp_path, make_data(), megatrain_host_memory_limit_gb=-1.0)


def test_torch_compile_is_said_to_be_not_applied(tmp_path, caplog):
    """torch_compile=True was silently ignored (the stock Trainer compiles the model it prepares;
    the streamed wrapper is never prepared): the run says so, and trains as without it."""
    with caplog.at_level(logging.WARNING, logger="hf_megatrain.hf.trainer"):
        trainer = _trainer(tmp_path, make_data(), torch_compile=True, max_steps=1)
    hits = [r for r in caplog.records if "torch_compile=True is not applied" in r.getMessage()]
    assert len(hits) == 1
    trainer.train()


def test_per_process_token_averaging_is_said_to_differ_from_one_process(caplog, monkeypatch):
    """Found by an audit: with average_tokens_across_devices off, every step whose processes
    hold unequal token counts differs from one process (as with the stock Trainer), but only
    the partial last batch was warned about. Said once per arguments, before training."""
    from hf_megatrain.hf.trainer import check_training_arguments  # noqa: PLC0415

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(MegaTrainArguments, "world_size", property(lambda self: 2))
    said = "average_tokens_across_devices=False: each process divides its loss"
    for average, times in ((False, 1), (True, 0)):
        args = MegaTrainArguments(
            output_dir="unused", use_cpu=True, average_tokens_across_devices=average
        )
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
            check_training_arguments(args)
            check_training_arguments(args)
        assert sum(said in r.getMessage() for r in caplog.records) == times
