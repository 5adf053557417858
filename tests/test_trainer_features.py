"""``TrainingArguments`` and ``Trainer`` features a user reaches for, streamed against the stock
Trainer (tiny Llama, fp32 on the CPU, the same weights, data and seed).

What other files compare already is not repeated here: the LR schedulers and
``lr_scheduler_kwargs`` (test_schedulers.py), gradient accumulation, label smoothing and
``max_grad_norm=0`` (test_equivalence.py, test_eager_update.py), ``save_total_limit`` with
``load_best_model_at_end`` on ``eval_loss`` (test_checkpoint.py), ``evaluate()``'s loss and metric
keys (test_evaluate.py), the ``torch_compile`` warning (test_input_checks.py) and the refusal of
optimizers other than AdamW (test_errors.py).

Tolerances: fp32 on the CPU, the same kernels; streamed and stock differ in the summation order
of the global gradient norm and in the clip applied as one fused scale, which leaves the 1e-7
relative level over a few steps (``assert_logs_match``'s 1e-5 relative, learning rates exact).
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from transformers import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments

from hf_megatrain import HFMegaTrainer, MegaTrainArguments

from .helpers import (
    VOCAB,
    LogRecorder,
    assert_logs_match,
    common_args,
    make_data,
    mega_params,
    run_trainer,
    stock_params,
    tiny_config,
    tiny_model,
    train_both,
)

STEPS = 4
EVAL = make_data(6, seed=3)  # eval batch 4: the last batch is partial


@pytest.fixture(scope="module")
def model():
    return tiny_model(tiny_config("llama"))


@pytest.fixture(scope="module")
def plain_logs(model, tmp_path_factory):
    """A stock run without any of the features: a feature must change the run, or comparing
    it says nothing (an argument both trainers ignored would match too)."""
    logs, _ = run_trainer(
        copy.deepcopy(model), tmp_path_factory.mktemp("plain"), "plain", False, max_steps=STEPS
    )
    return logs


def _build(model, tmp_path, name: str, mega: bool, hooks=None, **overrides):
    """A trainer of either class on a copy of ``model`` (not trained): 32 training rows,
    ``EVAL`` to evaluate, a ``LogRecorder`` as ``trainer.recorder``; ``hooks``: Trainer
    keywords (``compute_metrics``, ``callbacks``, ...); ``overrides``: arguments."""
    cls, argcls = (HFMegaTrainer, MegaTrainArguments) if mega else (Trainer, TrainingArguments)
    hooks = dict(hooks or {})
    rec = LogRecorder()
    hooks["callbacks"] = [rec, *hooks.get("callbacks", ())]
    args = argcls(
        output_dir=str(tmp_path / name), per_device_eval_batch_size=4, **common_args(**overrides)
    )
    trainer = cls(
        model=copy.deepcopy(model), args=args, train_dataset=make_data(), eval_dataset=EVAL, **hooks
    )
    trainer.recorder = rec
    return trainer


def _trajectory(logs: list[dict]) -> list[tuple[float, float]]:
    return [(log["loss"], log["grad_norm"]) for log in logs]


@pytest.mark.parametrize(
    "overrides",
    [
        # NEFTune's noise on the (resident) input embeddings, drawn from the same generator as
        # stock's; over two micro-batches per step.
        dict(neftune_noise_alpha=5.0, gradient_accumulation_steps=2),
        # The host AdamW's hyperparameters, spelled with the non-fused optimizer's name.
        dict(adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-3, optim="adamw_torch"),
        # Another shuffle of the data than the model seed's.
        dict(data_seed=7),
        dict(train_sampling_strategy="sequential"),
        # A warmup given as a share of the steps (transformers 5: a float below 1).
        dict(warmup_steps=0.5, lr_scheduler_type="cosine"),
    ],
    ids=["neftune", "adam_hyperparameters", "data_seed", "sequential", "warmup_fraction"],
)
def test_training_arguments_match_stock(model, plain_logs, tmp_path, overrides):
    (stock, _), (mega, _) = train_both(model, tmp_path, steps=STEPS, **overrides)
    assert_logs_match(stock, mega)
    assert _trajectory(stock) != _trajectory(plain_logs) or [
        log["learning_rate"] for log in stock
    ] != [log["learning_rate"] for log in plain_logs], "the argument changed nothing"


def _pad(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded batch of rows of different lengths; padding masked out of the loss."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), n), -100)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        ids[i, :k] = torch.as_tensor(r["input_ids"])
        labels[i, :k] = torch.as_tensor(r["labels"])
        mask[i, :k] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def test_length_grouping_and_tokens_seen_match_stock(model, tmp_path):
    """A ``datasets.Dataset`` of rows of 4-16 tokens with a column the model does not take
    (``remove_unused_columns`` drops it), batched by length (``group_by_length``), padded by the
    collator; ``num_input_tokens_seen`` counts the non-padding tokens: the same batches, losses
    and counts as stock."""
    import datasets  # noqa: PLC0415

    g = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(32):
        ids = torch.randint(0, VOCAB, (int(torch.randint(4, 17, (1,), generator=g)),), generator=g)
        rows.append(ids.tolist())
    data = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows, "text": ["x"] * 32})
    kw = dict(
        data=data, data_collator=_pad, max_steps=STEPS, include_num_input_tokens_seen="non_padding"
    )
    runs = {
        (name, strategy): run_trainer(
            copy.deepcopy(model),
            tmp_path,
            f"{name}-{strategy}",
            mega,
            train_sampling_strategy=strategy,
            **kw,
        )[0]
        for name, mega, strategy in (
            ("stock", False, "group_by_length"),
            ("mega", True, "group_by_length"),
            ("stock", False, "random"),
        )
    }
    stock, mega = runs["stock", "group_by_length"], runs["mega", "group_by_length"]
    assert_logs_match(stock, mega)
    seen = [log["num_input_tokens_seen"] for log in stock]
    assert [log["num_input_tokens_seen"] for log in mega] == seen
    # The counts are of real tokens (below 2 rows x 16 per step) and grouping changed the batches.
    assert seen[-1] < STEPS * 2 * 16
    assert seen != [log["num_input_tokens_seen"] for log in runs["stock", "random"]]


def test_full_determinism_matches_stock(model, tmp_path, monkeypatch):
    """``full_determinism`` (deterministic algorithms on, every seed set): no op of the streamed
    path refuses it, and the run is stock's."""
    for var in (
        "CUDA_LAUNCH_BLOCKING",
        "CUBLAS_WORKSPACE_CONFIG",
        "ASCEND_LAUNCH_BLOCKING",
        "HCCL_DETERMINISTIC",
        "FLASH_ATTENTION_DETERMINISTIC",
    ):
        monkeypatch.setenv(var, os.environ.get(var, ""))  # restored after the test
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    try:
        (stock, _), (mega, _) = train_both(model, tmp_path, steps=STEPS, full_determinism=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
    assert_logs_match(stock, mega)


# ---- a compute_loss that reads the training forward's logits ------------------------------------
class _LogitsTerm:
    """A ``compute_loss`` override that adds a term on the logits (a z-loss) to the model's
    loss, reading them as ``read`` says, and keeps the first micro-batch's logits."""

    read = "attribute"
    first_logits: torch.Tensor | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        if self.read == "attribute":
            logits = outputs.logits
        elif self.read == "key":
            logits = outputs["logits"]
        else:
            loss, logits = outputs[:2]  # (loss, logits, ...) as the output class orders them
        if self.first_logits is None:
            self.first_logits = logits.detach().clone()
        # 0.1 x logsumexp^2 (~2.4 here): its gradient moves the run visibly off the plain one.
        loss = outputs.loss + 0.1 * logits.float().logsumexp(-1).pow(2).mean()
        return (loss, outputs) if return_outputs else loss


class _StockLogitsTerm(_LogitsTerm, Trainer):
    pass


class _MegaLogitsTerm(_LogitsTerm, HFMegaTrainer):
    pass


@pytest.mark.parametrize(
    "arch,read",
    [
        ("llama", "position"),
        ("gemma2", "attribute"),  # final logit soft-capping
        ("granite", "key"),  # logits divided by logits_scaling
        ("cohere", "attribute"),  # logits times logit_scale
        ("qwen3_moe", "key"),  # the MoE output class, router aux loss on
    ],
)
def test_compute_loss_reading_logits_matches_stock(arch, read, tmp_path):
    """The training forward's fused loss makes no logits; a ``compute_loss`` that reads them
    (by attribute, key or position) gets them computed then, as the model's forward makes them,
    and its term on them trains the model as stock's (was: ``logits`` None, an AttributeError)."""
    model = tiny_model(tiny_config(arch))
    runs = []
    for name, mega in (("stock", False), ("mega", True)):
        cls, argcls = (
            (_MegaLogitsTerm, MegaTrainArguments) if mega else (_StockLogitsTerm, TrainingArguments)
        )
        rec = LogRecorder()
        args = argcls(output_dir=str(tmp_path / name), **common_args(max_steps=3))
        trainer = cls(
            model=copy.deepcopy(model), args=args, train_dataset=make_data(), callbacks=[rec]
        )
        trainer.read = read
        trainer.train()
        runs.append((rec.logs, trainer))
    (stock, st), (mega, mt) = runs
    # The first micro-batch's logits from the same weights: the same forward in fp32 (the
    # default assert_close tolerance for fp32, 1.3e-6 relative).
    torch.testing.assert_close(mt.first_logits, st.first_logits)
    assert_logs_match(stock, mega)
    final, ref = mega_params(mt), stock_params(st.model)
    for k, v in ref.items():
        # A few clipped AdamW steps from ulp-level gradient differences (test_equivalence).
        torch.testing.assert_close(final[k], v, rtol=0, atol=1e-5, msg=k)


# ---- evaluation and prediction -----------------------------------------------------------------


def _accuracy(p) -> dict[str, float]:
    preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
    if preds.ndim == 3:  # logits, not the argmax preprocess_logits_for_metrics made
        preds = preds.argmax(-1)
    out = {"accuracy": float((preds[:, :-1] == p.label_ids[:, 1:]).mean())}
    if p.losses is not None:  # include_for_metrics=["loss"]
        out["mean_loss"] = float(np.mean(p.losses))
    if p.inputs is not None:  # include_for_metrics=["inputs"]
        out["input_rows"] = float(len(p.inputs))
    return out


def _argmax(logits, labels):
    return logits.argmax(-1)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(compute_metrics=_accuracy),
        dict(
            compute_metrics=_accuracy,
            preprocess_logits_for_metrics=_argmax,
            eval_accumulation_steps=1,
            include_for_metrics=["inputs", "loss"],
        ),
        dict(compute_metrics=_accuracy, prediction_loss_only=True, label_names=["labels"]),
    ],
    ids=["metrics", "preprocessed_accumulated", "loss_only"],
)
def test_evaluate_and_predict_match_stock(model, tmp_path, overrides):
    """After two training steps: ``evaluate()``'s metrics from ``compute_metrics`` and
    ``predict()``'s predictions and label ids are stock's (the evaluation forward returns the
    logits; only training fuses them away)."""
    overrides = dict(overrides)  # (the parameter's dict is shared by reruns)
    hooks = {
        k: overrides.pop(k, None) for k in ("compute_metrics", "preprocess_logits_for_metrics")
    }
    results = []
    for name, mega in (("stock", False), ("mega", True)):
        trainer = _build(model, tmp_path, name, mega, hooks, max_steps=2, **overrides)
        trainer.train()
        results.append((trainer.evaluate(), trainer.predict(EVAL)))
    (s_eval, s_pred), (m_eval, m_pred) = results
    timing = ("runtime", "per_second")
    keys = sorted(k for k in s_eval if not any(t in k for t in timing))
    assert sorted(k for k in m_eval if not any(t in k for t in timing)) == keys
    for k in keys:
        # Weights after clipped AdamW steps differ by ulps (module docstring): 1e-5 relative.
        assert m_eval[k] == pytest.approx(s_eval[k], rel=1e-5), k
    if overrides.get("prediction_loss_only"):
        assert m_pred.predictions is None and s_pred.predictions is None
        assert "eval_accuracy" not in keys
        return
    assert "eval_accuracy" in keys
    np.testing.assert_array_equal(m_pred.label_ids, s_pred.label_ids)
    assert m_pred.predictions.shape == s_pred.predictions.shape
    if hooks["preprocess_logits_for_metrics"] is None:
        assert m_pred.predictions.shape == (len(EVAL), 16, VOCAB)
        np.testing.assert_allclose(m_pred.predictions, s_pred.predictions, rtol=1e-5, atol=1e-5)
    else:  # the argmax of logits that differ by ulps: the same tokens
        np.testing.assert_array_equal(m_pred.predictions, s_pred.predictions)


def test_early_stopping_on_a_metric_to_maximize(model, tmp_path):
    """``metric_for_best_model`` naming a ``compute_metrics`` score with
    ``greater_is_better=True``, ``EarlyStoppingCallback``, ``load_best_model_at_end`` and
    ``save_total_limit``: the run stops at stock's step, keeps stock's checkpoints and ends on
    the best one's weights."""

    def neg_loss(p):  # from the logits: higher is better
        logits = torch.as_tensor(p.predictions)[:, :-1]
        labels = torch.as_tensor(p.label_ids)[:, 1:]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return {"neg_loss": -float(ce)}

    results = {}
    for name, mega in (("stock", False), ("mega", True)):
        hooks = dict(
            compute_metrics=neg_loss, callbacks=[EarlyStoppingCallback(early_stopping_patience=2)]
        )
        trainer = _build(
            model,
            tmp_path,
            name,
            mega,
            hooks,
            # lr high enough that the score falls after the first step: the patience runs out.
            max_steps=20,
            learning_rate=5e-2,
            eval_strategy="steps",
            eval_steps=1,
            save_strategy="steps",
            save_steps=1,
            save_total_limit=1,
            metric_for_best_model="neg_loss",
            greater_is_better=True,
            load_best_model_at_end=True,
        )
        trainer.train()
        results[name] = (trainer, sorted(os.listdir(tmp_path / name)))
    (st, s_dirs), (mt, m_dirs) = results.values()
    assert mt.state.global_step == st.state.global_step < 20  # stopped early
    assert mt.state.best_global_step == st.state.best_global_step
    assert m_dirs == s_dirs
    assert mt.state.best_metric == pytest.approx(st.state.best_metric, rel=1e-5)
    # The best step's weights are back: evaluating them gives the best score again.
    assert mt.evaluate()["eval_neg_loss"] == pytest.approx(mt.state.best_metric, rel=1e-6)


# ---- logging a non-finite loss -----------------------------------------------------------------
class _NanAtStep(TrainerCallback):
    """Makes the final norm's output (a resident module in both trainers) NaN during one step,
    so that step's loss is NaN."""

    def __init__(self, step: int) -> None:
        self.step, self.active = step, False

    def hook(self, module, args, output):
        return output * float("nan") if self.active else output

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step + 1 == self.step

    def on_step_end(self, args, state, control, **kwargs):
        self.active = False


@pytest.mark.parametrize("nan_filter", [True, False])
def test_logging_nan_inf_filter_logs_as_stock(model, tmp_path, nan_filter):
    """A NaN loss at the last step: ``logging_nan_inf_filter`` on logs stock's stand-in for it
    (and stock's ``train_loss``), off logs the NaN. The streamed run skips that step's update
    (megatrain_nonfinite, test_nonfinite.py) where stock applies NaN; the logs are the same."""
    results = []
    for name, mega in (("stock", False), ("mega", True)):
        nan = _NanAtStep(3)
        copy_ = copy.deepcopy(model)
        copy_.model.norm.register_forward_hook(nan.hook)
        logs, trainer = run_trainer(
            copy_,
            tmp_path,
            name,
            mega,
            max_steps=3,
            callbacks=[nan],
            logging_nan_inf_filter=nan_filter,
        )
        results.append((logs, trainer.state.log_history[-1]["train_loss"]))
    (stock, s_train), (mega, m_train) = results
    assert_logs_match(stock[:2], mega[:2])
    # The filtered value is the average of the logged losses so far: bit-equal where they are.
    if nan_filter:
        assert mega[2]["loss"] == stock[2]["loss"] and np.isfinite(mega[2]["loss"])
        assert m_train == pytest.approx(s_train, rel=1e-6)
    else:
        assert np.isnan(mega[2]["loss"]) and np.isnan(stock[2]["loss"])
        assert np.isnan(m_train) and np.isnan(s_train)


# ---- save_only_model ---------------------------------------------------------------------------
def test_save_only_model_checkpoints_and_their_resume(model, tmp_path):
    """``save_only_model`` writes stock's files (weights, config, trainer state; no optimizer,
    scheduler or RNG state). Resuming from one is refused, saying it is a weights-only
    checkpoint (stock goes on silently with fresh AdamW moments and the schedule restarted);
    with ``megatrain_resume_without_optimizer_state`` the run goes on exactly as stock's."""
    kw = dict(max_steps=STEPS, save_strategy="steps", save_steps=2, save_only_model=True)
    files = {}
    for name, mega in (("stock", False), ("mega", True)):
        run_trainer(copy.deepcopy(model), tmp_path, name, mega, **kw)
        files[name] = set(os.listdir(tmp_path / name / "checkpoint-2"))
    assert files["mega"] - {"megatrain_manifest.json"} == files["stock"]
    assert not any(f.startswith(("optimizer", "scheduler", "rng_state")) for f in files["mega"])

    checkpoint = str(tmp_path / "mega" / "checkpoint-2")
    with pytest.raises(FileNotFoundError, match="weights-only checkpoint.*save_only_model=True"):
        run_trainer(copy.deepcopy(model), tmp_path, "refused", True, resume=checkpoint, **kw)
    stock, _ = run_trainer(
        copy.deepcopy(model),
        tmp_path,
        "stock_resumed",
        False,
        resume=str(tmp_path / "stock" / "checkpoint-2"),
        **kw,
    )
    mega, _ = run_trainer(
        copy.deepcopy(model),
        tmp_path,
        "mega_resumed",
        True,
        resume=checkpoint,
        megatrain_resume_without_optimizer_state=True,
        **kw,
    )
    assert len(stock) == STEPS - 2
    assert stock[0]["learning_rate"] == 0.0  # stock restarted the schedule (warmup step 1)
    assert_logs_match(stock, mega)


def test_hyperparameter_search_refused(model, tmp_path):
    """The Trainer's search rebuilds the model from ``model_init`` for every trial: refused in
    one line saying what to do instead (was: install a search backend, then 'need model_init')."""
    trainer = _build(model, tmp_path, "mega", True)
    with pytest.raises(ValueError, match="hyperparameter_search is not supported.*inside each"):
        trainer.hyperparameter_search(n_trials=1)


def _mlp_decay_only(trainer_cls):
    """``trainer_cls`` with its own weight-decay set (only the MLPs' weights): a common override."""

    class MlpDecayOnly(trainer_cls):
        def get_decay_parameter_names(self, model) -> list[str]:
            return [n for n, _ in model.named_parameters() if ".mlp." in n]

    return MlpDecayOnly


def test_a_weight_decay_override_is_honoured(model, tmp_path):
    """A subclass's ``get_decay_parameter_names`` decides the decayed set, as in the stock
    Trainer (it was the base class's set, silently). A high weight decay makes the sets' results
    far apart: the override's run matches stock's override, not the default set."""
    weights = {}
    for name, mega in (("stock", False), ("mega", True)):
        cls, argcls = (HFMegaTrainer, MegaTrainArguments) if mega else (Trainer, TrainingArguments)
        args = argcls(output_dir=str(tmp_path / name), **common_args(max_steps=3, weight_decay=0.5))
        trainer = _mlp_decay_only(cls)(
            model=copy.deepcopy(model), args=args, train_dataset=make_data()
        )
        trainer.train()
        weights[name] = mega_params(trainer) if mega else stock_params(trainer.model)
    default = _build(model, tmp_path, "default", False, max_steps=3, weight_decay=0.5)
    default.train()
    plain = stock_params(default.model)
    key = "model.embed_tokens.weight"  # decayed by default, not by the override
    for k in weights["stock"]:
        torch.testing.assert_close(weights["mega"][k], weights["stock"][k], rtol=0, atol=1e-6)
    assert (weights["mega"][key] - plain[key]).abs().max() > 1e-4


@pytest.mark.parametrize("tied", [False, True])
def test_a_weight_decay_override_on_an_already_streamed_model_is_refused(model, tmp_path, tied):
    """A model streamed before the trainer keeps its decayed set in its layer stores: an
    override asking for another set of trainable parameters is refused (not ignored); one that
    gives the same set (with a tied head named twice, as the Trainer's own names it) is not,
    and without weight decay the set changes nothing."""
    from hf_megatrain import load_streamed_model

    folder = tmp_path / "saved"
    base = tiny_model(tiny_config("llama", tie_word_embeddings=True)) if tied else model
    copy.deepcopy(base).save_pretrained(str(folder))

    class SameAsStock(HFMegaTrainer):
        def get_decay_parameter_names(self, model) -> list[str]:
            return super().get_decay_parameter_names(model)

    def build(cls, **overrides):
        args = MegaTrainArguments(
            output_dir=str(tmp_path / "out"), **common_args(max_steps=1, **overrides)
        )
        streamed = load_streamed_model(str(folder), device="cpu", bf16=False)
        return cls(model=streamed, args=args, train_dataset=make_data())

    with pytest.raises(ValueError, match="would decay another set of parameters"):
        build(_mlp_decay_only(HFMegaTrainer), weight_decay=0.1)
    build(_mlp_decay_only(HFMegaTrainer), weight_decay=0.0)
    build(SameAsStock, weight_decay=0.1)
    build(HFMegaTrainer, weight_decay=0.1)


def test_an_override_reading_attributes_set_after_init_is_named(model, tmp_path):
    """The trainer streams the model inside __init__, so the override runs then: one that reads
    an attribute the subclass sets after super().__init__() gets a clear error."""

    class Late(HFMegaTrainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.no_decay = ("embed",)

        def get_decay_parameter_names(self, model) -> list[str]:
            return [n for n, _ in model.named_parameters() if not n.startswith(self.no_decay)]

    args = MegaTrainArguments(output_dir=str(tmp_path / "out"), **common_args(max_steps=1))
    with pytest.raises(ValueError, match="before calling super"):
        Late(model=copy.deepcopy(model), args=args, train_dataset=make_data())


@pytest.mark.parametrize("how", ["layer frozen", "layer unfrozen", "adapter switched"])
def test_a_trainable_set_changed_after_construction_is_refused(model, tmp_path, how):
    """The stock Trainer builds its optimizer in train() and follows what was frozen, unfrozen
    or switched (``set_adapter``) after it was built; the streamed stores were laid out when
    the trainer was built. A decoder layer frozen or unfrozen in between trained as before,
    silently, and a switched adapter failed inside autograd (found by an audit): each is now
    refused before any work, naming the change."""
    model = copy.deepcopy(model)
    if how == "layer unfrozen":
        model.model.layers[0].requires_grad_(False)
    if how == "adapter switched":
        import peft  # noqa: PLC0415

        model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
        model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["v_proj"]))
        model.set_adapter("default")
    args = MegaTrainArguments(output_dir=str(tmp_path / "out"), **common_args(max_steps=1))
    trainer = HFMegaTrainer(model=model, args=args, train_dataset=make_data())
    if how == "adapter switched":
        trainer.model.set_adapter("other")
    else:
        trainer.model.model.layers[0].requires_grad_(how == "layer unfrozen")
    word = {"layer frozen": "were frozen", "layer unfrozen": "were unfrozen"}
    match = word.get(how, r"active adapter was changed to \['other'\]")
    with pytest.raises(ValueError, match=f"{match}.*before building the HFMegaTrainer"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_a_learning_rate_changed_after_the_eager_updates_is_reported(model, tmp_path, caplog):
    """Without clipping the streamed layers update during backward (eager updates), before a
    callback's on_pre_optimizer_step runs: a learning rate it sets reached the other parameters
    only, silently (found by an audit; the stock optimizer applies it to all). Now warned, once;
    one set in on_step_begin (before the backward) says nothing."""

    class SetLr(TrainerCallback):
        def __init__(self, hook: str) -> None:
            self.hook = hook

        def _set(self, state, optimizer) -> None:
            if state.global_step == 1 and optimizer is not None:
                for group in optimizer.param_groups:
                    group["lr"] = 0.0

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
            if self.hook == "pre_optimizer_step":
                self._set(state, optimizer)

        def on_step_begin(self, args, state, control, optimizer=None, **kw):
            if self.hook == "step_begin":
                self._set(state, optimizer)

    for hook in ("pre_optimizer_step", "step_begin"):
        caplog.clear()
        kw = dict(max_steps=3, max_grad_norm=0.0, lr_scheduler_type="constant", warmup_steps=0)
        args = MegaTrainArguments(output_dir=str(tmp_path / hook), **common_args(**kw))
        trainer = HFMegaTrainer(
            model=copy.deepcopy(model), args=args, train_dataset=make_data(),
            callbacks=[SetLr(hook)],
        )  # fmt: skip
        with caplog.at_level("WARNING", logger="hf_megatrain.core.optimizer"):
            trainer.train()
        said = [r for r in caplog.records if "changed after this step's backward" in r.message]
        assert len(said) == (hook == "pre_optimizer_step"), (hook, caplog.text)
        if said:
            assert "they used lr=0.01, the other parameters use lr=0" in said[0].message


class _OwnOptimizer(HFMegaTrainer):
    def create_optimizer(self, model=None):
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        return self.optimizer


@pytest.mark.parametrize(
    "how", ["create_optimizer override", "assigned", "clipping turned on", "override, resumed"]
)
def test_what_changed_after_construction_is_refused_before_any_update(model, tmp_path, how):
    """An optimizer other than the engine's (a ``create_optimizer`` override, or assigned to
    ``trainer.optimizer``) failed inside the first step ('no attribute nonfinite'); clipping
    turned on through ``trainer.args`` after the trainer was built for eager updates failed
    after the first backward had updated the layers. Both are refused before any work."""
    cls = _OwnOptimizer if "override" in how else HFMegaTrainer
    resume = None
    if how == "override, resumed":  # (a resume loads optimizer state before the first step)
        args = MegaTrainArguments(
            output_dir=str(tmp_path / "first"),
            **common_args(max_steps=1, save_strategy="steps", save_steps=1),
        )
        HFMegaTrainer(model=copy.deepcopy(model), args=args, train_dataset=make_data()).train()
        resume = str(tmp_path / "first" / "checkpoint-1")
    args = MegaTrainArguments(
        output_dir=str(tmp_path / "out"),
        **common_args(max_steps=2, max_grad_norm=0.0 if how == "clipping turned on" else 1.0),
    )
    trainer = cls(model=copy.deepcopy(model), args=args, train_dataset=make_data())
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    if how == "assigned":
        trainer.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    if how == "clipping turned on":
        trainer.args.max_grad_norm = 1.0
    match = (
        "max_grad_norm=1.0, but the trainer was built"
        if how == "clipping turned on"
        else (r"the optimizer is torch\.optim\..*only the engine's own AdamW")
    )
    with pytest.raises(ValueError, match=match):
        trainer.train(resume_from_checkpoint=resume)
    if resume is None:  # (a resume loads the checkpoint's weights first)
        after = trainer.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert trainer.state.global_step == 0
