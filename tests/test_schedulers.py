"""Every Hugging Face LR scheduler type drives the host optimizer exactly as it drives AdamW.

``HostAdamW`` reads ``lr`` from its ``param_groups`` at every step; schedulers write it there.
Each test trains the same tiny Llama with the stock ``Trainer`` and with ``HFMegaTrainer`` under
one ``lr_scheduler_type`` and checks, step by step, the logged learning rate (exactly equal), the
loss and gradient norm (which depend on every update before them), and the final weights (which
also depend on the last update's learning rate).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_megatrain import HFMegaTrainer, MegaTrainArguments

from .helpers import (
    LogRecorder,
    assert_logs_match,
    common_args,
    make_data,
    mega_params,
    tiny_config,
    tiny_model,
    train_both,
)

STEPS = 5
# Two warmup steps: the warmup phase itself (lr 0, then lr/2) shows in the logs of every
# warmup-aware schedule, and "constant_with_warmup" has more than one distinct logged value.
WARMUP = 2

# lr_scheduler_kwargs each type needs (transformers.optimization.get_scheduler and the schedule
# functions it dispatches to), chosen so that every schedule's distinctive shape happens within
# STEPS steps.
SCHEDULES: dict[str, dict] = {
    "linear": {},
    "cosine": {},
    # Two hard restarts inside the 3 post-warmup steps: the lr jumps back up mid-run.
    "cosine_with_restarts": {"num_cycles": 2},
    # Quadratic decay to a non-zero floor (the default power 1 would equal "linear").
    "polynomial": {"power": 2.0, "lr_end": 1e-4},
    "constant": {},
    "constant_with_warmup": {},
    # timescale 1: 1/sqrt(step) decay right after warmup (the default timescale is the warmup).
    "inverse_sqrt": {"timescale": 1},
    # get_wsd_schedule requires num_decay_steps; the stable phase is what num_training_steps
    # (passed by the Trainer) leaves: warmup 2 + stable 1 + decay 2 = STEPS.
    "warmup_stable_decay": {"num_decay_steps": 2, "min_lr_ratio": 0.1},
    # get_cosine_with_min_lr_schedule_with_warmup raises without exactly one of min_lr /
    # min_lr_rate.
    "cosine_with_min_lr": {"min_lr_rate": 0.1},
    "cosine_warmup_with_min_lr": {"min_lr": 1e-3, "warmup_lr_rate": 0.1},
}


def _check_final_weights(stock_trainer, mega_trainer) -> None:
    final = mega_params(mega_trainer)
    stock = stock_trainer.model.state_dict()
    n_far = n_total = 0
    for name, p in stock.items():
        # Almost every weight agrees to ~1e-7 (per-step ulp differences of the gradients, as in
        # test_equivalence). A few elements whose gradient is at AdamW's eps level (1e-8) sit
        # where the first update lr * g / (|g| + eps) is steepest in g: a 1e-10 absolute
        # gradient difference (far inside test_equivalence's 1e-7 gradient tolerance) moves them
        # by ~3e-5 when the first step runs at full lr (measured with "constant": 2-3e-5 on a
        # handful of elements). 1e-4 is 1% of one full-lr update, so a step taken with another
        # lr still fails.
        torch.testing.assert_close(final[name], p, rtol=0, atol=1e-4, msg=name)
        n_far += int(((final[name] - p).abs() > 1e-6).sum())
        n_total += p.numel()
    # And those eps-level elements are rare (measured: < 0.3% of the weights); an update with a
    # different lr would move nearly every weight by more than 1e-6.
    assert n_far <= 0.01 * n_total, f"{n_far} of {n_total} weights differ by more than 1e-6"


@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_scheduler_matches_stock(sched, tmp_path):
    model = tiny_model(tiny_config("llama"))
    (stock, st), (mega, mt) = train_both(
        model,
        tmp_path,
        steps=STEPS,
        lr_scheduler_type=sched,
        lr_scheduler_kwargs=SCHEDULES[sched],
        warmup_steps=WARMUP,
    )
    assert len(stock) == len(mega) == STEPS
    lrs = [log["learning_rate"] for log in stock]
    # The schedule must really vary within the run, or a host optimizer that ignored
    # param_groups (kept the initial lr) would pass. "constant" is the one flat schedule.
    if sched == "constant":
        assert lrs == [common_args()["learning_rate"]] * STEPS
    else:
        assert len(set(lrs)) >= 2, f"{sched} lr did not vary: {lrs}"
    # learning_rate exactly equal, loss and grad_norm within the 1e-5 relative of helpers.
    assert_logs_match(stock, mega)
    _check_final_weights(st, mt)


# Metric-driven schedulers: the Trainer steps them with the eval metric after each evaluation
# (Trainer._evaluate), and they write lr into optimizer.param_groups themselves; the Trainer logs
# param_groups[0]["lr"], i.e. HostAdamW's own group.
METRIC_SCHEDULES: dict[str, dict] = {
    # threshold 0.5 (relative): no eval after the first counts as an improvement, and patience 0
    # halves the lr after each of them, so the decisions cannot hinge on ulp-level eval
    # differences between the two trainers.
    "reduce_lr_on_plateau": {"factor": 0.5, "patience": 0, "threshold": 0.5},
    # GreedyLR (transformers >= 5): doubles lr on the first (improving) eval, then the same
    # plateau rule halves it; min_lr below the run's lrs.
    "greedy": {
        "factor": 0.5,
        "patience": 0,
        "threshold": 0.5,
        "threshold_mode": "rel",
        "min_lr": 1e-5,
    },
}


def _run_with_eval(model, tmp_path, name: str, mega: bool, sched: str):
    cls, argcls = (HFMegaTrainer, MegaTrainArguments) if mega else (Trainer, TrainingArguments)
    rec = LogRecorder()
    args = argcls(
        output_dir=str(tmp_path / name),
        **common_args(
            max_steps=STEPS,
            lr_scheduler_type=sched,
            lr_scheduler_kwargs=METRIC_SCHEDULES[sched],
            eval_strategy="steps",
            eval_steps=1,
            metric_for_best_model="eval_loss",
        ),
    )
    trainer = cls(
        model=model,
        args=args,
        train_dataset=make_data(),
        eval_dataset=make_data(4, seed=3),
        callbacks=[rec],
    )
    trainer.train()
    return rec, trainer


@pytest.mark.parametrize("sched", list(METRIC_SCHEDULES))
def test_metric_scheduler_matches_stock(sched, tmp_path):
    from transformers.trainer_utils import SchedulerType  # noqa: PLC0415

    if sched not in {s.value for s in SchedulerType}:
        pytest.skip(f"this transformers has no {sched} scheduler")
    model = tiny_model(tiny_config("llama"))
    (s_rec, st), (m_rec, mt) = [
        _run_with_eval(copy.deepcopy(model), tmp_path, name, mega, sched)
        for name, mega in (("stock", False), ("mega", True))
    ]
    assert len(s_rec.logs) == len(m_rec.logs) == STEPS
    assert len(s_rec.eval_logs) == len(m_rec.eval_logs) == STEPS
    lrs = [log["learning_rate"] for log in s_rec.logs]
    # The scheduler acted on the optimizer's param_groups during the run.
    assert len(set(lrs)) >= 2 and min(lrs) < common_args()["learning_rate"], lrs
    assert_logs_match(s_rec.logs, m_rec.logs)
    for step, (a, b) in enumerate(zip(s_rec.eval_logs, m_rec.eval_logs), 1):
        # Same weights up to the ulp-level differences of assert_logs_match: same 1e-5 relative.
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5), f"eval_loss at {step}"
    _check_final_weights(st, mt)
