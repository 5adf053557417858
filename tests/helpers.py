"""Shared fixtures for equivalence tests: tiny configs, data, and a log-recording callback."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_megatrain import HFMegaTrainer, MegaTrainArguments

VOCAB = 128


class LogRecorder(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append(dict(logs))


def make_data(n: int = 32, seq: int = 16, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (seq,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def tiny_model(config, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def train_both(model, tmp_path, steps: int = 5, data=None, **arg_overrides):
    """Train deep copies of ``model`` with stock Trainer and HFMegaTrainer; return both logs."""
    data = data if data is not None else make_data()
    common = dict(
        per_device_train_batch_size=2,
        max_steps=steps,
        logging_steps=1,
        learning_rate=1e-2,
        weight_decay=0.1,
        report_to=[],
        save_strategy="no",
        seed=0,
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_grad_norm=0.5,
        use_cpu=True,
        disable_tqdm=True,
    )
    common.update(arg_overrides)
    out = []
    for cls, argcls, name in (
        (Trainer, TrainingArguments, "stock"),
        (HFMegaTrainer, MegaTrainArguments, "mega"),
    ):
        rec = LogRecorder()
        args = argcls(output_dir=str(tmp_path / name), **common)
        trainer = cls(model=copy.deepcopy(model), args=args, train_dataset=data, callbacks=[rec])
        trainer.train()
        out.append((rec.logs, trainer))
    return out
