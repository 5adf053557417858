"""``HFMegaTrainer.evaluate()`` against the stock Trainer on the same weights."""

from __future__ import annotations

import copy

import pytest
from transformers import Trainer, TrainingArguments

from hf_megatrain import HFMegaTrainer, MegaTrainArguments

from .helpers import (
    LogRecorder,
    common_args,
    make_data,
    mega_params,
    run_trainer,
    tiny_config,
    tiny_model,
)

EVAL = make_data(6, seed=3)  # 6 rows, eval batch 4: the last batch is partial


def _evaluate(model, tmp_path, name, mega) -> float:
    cls, argcls = (HFMegaTrainer, MegaTrainArguments) if mega else (Trainer, TrainingArguments)
    args = argcls(output_dir=str(tmp_path / name), per_device_eval_batch_size=4, **common_args())
    return cls(model=model, args=args, eval_dataset=EVAL).evaluate()["eval_loss"]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_moe"])
def test_evaluate_matches_stock(arch, tmp_path):
    model = tiny_model(tiny_config(arch))
    stock = _evaluate(copy.deepcopy(model), tmp_path, "stock", False)
    mega = _evaluate(copy.deepcopy(model), tmp_path, "mega", True)
    # Same weights, same forward, same batching and averaging: bit-identical.
    assert mega == stock

    # After training, on the streamed run's own weights (loaded into a plain model).
    _, trained = run_trainer(
        copy.deepcopy(model), tmp_path, "train", True, max_steps=3, per_device_eval_batch_size=4
    )
    after = trained.evaluate(eval_dataset=EVAL)["eval_loss"]
    plain = tiny_model(tiny_config(arch))
    plain.load_state_dict(mega_params(trained))
    assert after == _evaluate(plain, tmp_path, "stock_after", False)  # bit-identical, as above
    assert abs(after - mega) > 1e-4  # training moved the weights: a stale store would show


def test_evaluation_during_training(tmp_path):
    """Evaluations interleaved with training steps leave the training trajectory unchanged."""
    model = tiny_model(tiny_config("llama"))
    runs = []
    for name, mega in (("stock", False), ("mega", True)):
        rec = LogRecorder()
        run_trainer(
            copy.deepcopy(model),
            tmp_path,
            name,
            mega,
            eval_dataset=EVAL,
            recorder=rec,
            per_device_eval_batch_size=4,
            max_steps=4,
            eval_strategy="steps",
            eval_steps=2,
        )
        runs.append(rec)
    stock, mega = runs
    assert len(mega.eval_logs) == len(stock.eval_logs) == 2
    for a, b in zip(stock.eval_logs, mega.eval_logs):
        # Weights after clipped AdamW steps differ by ulps (see test_equivalence): 1e-5 relative.
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
    for a, b in zip(stock.logs, mega.logs):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)  # same reason
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def test_metric_keys_match_stock(tmp_path):
    """evaluate() and predict() return stock's metric keys: ``*_model_preparation_time`` from an
    evaluation before any training on (the stock Trainer prepares the model with accelerate
    there and reports the time from then on), none where train() came first."""
    model = tiny_model(tiny_config("llama"))
    keys = {}
    for name, mega in (("stock", False), ("mega", True)):
        cls, argcls = (HFMegaTrainer, MegaTrainArguments) if mega else (Trainer, TrainingArguments)
        args = argcls(
            output_dir=str(tmp_path / name),
            per_device_eval_batch_size=4,
            **common_args(max_steps=1),
        )
        runs = []
        for evaluate_first in (True, False):
            trainer = cls(
                model=copy.deepcopy(model), args=args, train_dataset=make_data(4), eval_dataset=EVAL
            )
            if evaluate_first:
                runs.append(trainer.evaluate())
            trainer.train()
            runs += [trainer.evaluate(), trainer.predict(EVAL).metrics]
        keys[name] = [sorted(metrics) for metrics in runs]
    assert keys["mega"] == keys["stock"]
    # What the comparison is about: stock has the key in the first three, not in the last two.
    has = ["model_preparation_time" in " ".join(k) for k in keys["stock"]]
    assert has == [True, True, True, False, False]


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3_moe"])
def test_loss_only_evaluation_never_builds_the_logits(arch, tmp_path):
    """Found by an audit: evaluation ran the model's own forward, tokens x vocab logits and
    all, even where only the loss was kept (no compute_metrics): at a 150k vocabulary they were
    a CPU run's peak, past training's, and a long row's would be far past the GPU's. Such an
    evaluation now takes the fused loss (the head in chunks), with stock's loss; with
    compute_metrics the logits reach it as stock's."""
    import numpy as np  # noqa: PLC0415

    model = tiny_model(tiny_config(arch))

    def mean_logit(p):  # (an MoE's predictions: the logits, then its router logits)
        logits = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        return {"mean_logit": float(np.mean(logits))}

    for metrics in (None, mean_logit):
        seen = {}
        for name, mega in (("stock", False), ("mega", True)):
            m = copy.deepcopy(model)
            head_calls = []
            m.get_output_embeddings().register_forward_hook(lambda *a, c=head_calls: c.append(1))
            cls, argcls = (
                (HFMegaTrainer, MegaTrainArguments) if mega else (Trainer, TrainingArguments)
            )
            args = argcls(
                output_dir=str(tmp_path / name), per_device_eval_batch_size=4, **common_args()
            )
            trainer = cls(model=m, args=args, eval_dataset=EVAL, compute_metrics=metrics)
            seen[name] = (trainer.evaluate(), len(head_calls))
        (stock, stock_calls), (mega, mega_calls) = seen["stock"], seen["mega"]
        assert stock_calls == 2  # (6 rows in batches of 4)
        assert mega_calls == (0 if metrics is None else 2)
        # The chunked loss sums the same fp32 terms in this tiny case: equal (1e-6 relative in
        # general, the chunks' order of summation).
        assert mega["eval_loss"] == pytest.approx(stock["eval_loss"], rel=1e-6)
        if metrics is not None:
            assert mega["eval_mean_logit"] == pytest.approx(stock["eval_mean_logit"], rel=1e-6)
