"""One training run for the sequence-parallel tests: a single process on whole sequences, or one
rank of ``torchrun --nproc_per_node N tests/sp_worker.py --sequence-parallel N`` (Ulysses).

Each rank writes ``DIR/rank{r}.json`` (its logs, the planned step); rank 0's
``trainer.save_model`` writes ``DIR/final``; ``--save-steps K`` checkpoints into
``DIR/run/checkpoint-K``, ``--resume CHECKPOINT`` starts from one, and ``--then-resume CHECKPOINT
OUT`` resumes from one afterwards, in the same processes. The batch arguments are per rank and the same for both runs: with sequence
parallelism a group's ranks process their batches one after the other, each split along the
sequence, so a step sees the rows a single process sees (see tests/test_sequence_parallel.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Run as a script by torchrun: make the repository importable (tests.helpers, hf_megatrain).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from hf_megatrain import HFMegaTrainer, MegaTrainArguments  # noqa: E402
from tests.helpers import (  # noqa: E402
    LogRecorder,
    add_job_arguments,
    common_args,
    make_data,
    run_jobs,
    tiny_config,
    tiny_model,
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", help="the report's folder (required)")
    p.add_argument("--arch", default="llama")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--per-device-batch", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sequence-parallel", type=int, default=1)
    p.add_argument("--heads", type=int, default=None, help="num_attention_heads (and kv heads)")
    p.add_argument("--kv-heads", type=int, default=None, help="num_key_value_heads")
    p.add_argument("--epochs", type=int, default=0, help="train whole epochs (not --steps)")
    p.add_argument("--no-fused-loss", action="store_true", help="the model's own loss")
    p.add_argument("--router-aux-off", action="store_true", help="output_router_logits=False")
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--eval-rows", type=int, default=0, help="evaluate on N rows after training")
    p.add_argument(
        "--rows-kind",
        default="plain",
        choices=("plain", "right_pad", "left_pad", "packed"),
        help="right_pad / left_pad: rows with an attention_mask and padding; packed: documents "
        "packed into each row (position_ids restart at each document)",
    )
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: none)")
    p.add_argument("--resume", default=None, help="checkpoint folder to resume from")
    add_job_arguments(p)
    a = p.parse_args()
    run_jobs(run, p, a)


def run(a: argparse.Namespace, out: str, resume: str | None, save_steps: int) -> None:
    """One training into ``out`` (resumed from ``resume``); writes this rank's report there."""
    os.makedirs(out, exist_ok=True)
    shape = dict(num_hidden_layers=a.layers)
    if a.heads is not None:
        shape.update(num_attention_heads=a.heads, num_key_value_heads=a.heads)
    if a.kv_heads is not None:
        shape.update(num_key_value_heads=a.kv_heads)
    config = tiny_config(a.arch, **shape)
    if a.router_aux_off:
        config.output_router_logits = False
    model = tiny_model(config)
    save = dict(save_strategy="steps", save_steps=save_steps) if save_steps else {}
    args = MegaTrainArguments(
        output_dir=os.path.join(out, "run"),
        **common_args(
            per_device_train_batch_size=a.per_device_batch,
            gradient_accumulation_steps=a.grad_accum,
            max_steps=-1 if a.epochs else a.steps,
            num_train_epochs=a.epochs or 1,
            megatrain_sequence_parallel=a.sequence_parallel,
            megatrain_fused_loss=not a.no_fused_loss,
            per_device_eval_batch_size=2,
            label_smoothing_factor=a.label_smoothing,
            **save,
        ),
    )
    rec = LogRecorder()
    data = _rows(a.rows_kind, make_data(a.rows, seq=a.seq))
    evals = _rows(a.rows_kind, make_data(a.eval_rows, seq=a.seq, seed=2)) if a.eval_rows else None
    try:
        trainer = HFMegaTrainer(
            model=model, args=args, train_dataset=data, eval_dataset=evals, callbacks=[rec]
        )
    except Exception as e:  # the refusals the tests check: written where the test reads them
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"error": f"{type(e).__name__}: {e}"}, f)
        raise
    try:
        trainer.train(resume_from_checkpoint=resume)
    except Exception as e:  # a refusal at the first batch: written where the test reads it
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"error": f"{type(e).__name__}: {e}"}, f)
        raise
    eval_loss = trainer.evaluate()["eval_loss"] if evals is not None else None
    trainer.save_model(os.path.join(out, "final"))
    dp = trainer.megatrain.engine.dp
    rank = 0 if dp is None else dp.rank
    step = trainer.megatrain.step  # the micro-batch the memory plan sizes activations for
    report = {
        "world_size": 1 if dp is None else dp.world_size,
        "logs": rec.logs,
        "eval_loss": eval_loss,
        "optimizer_steps": trainer.state.global_step,
        # The row length the rank's layers ran on (seq / N under sequence parallelism).
        "seq_len_seen": trainer.last_seq_len,
        "attention_row_len": trainer.attention_row_len,  # what MFU counts attention over
        "planned_step": None if step is None else [step.seq_len, step.micro_batch_tokens],
        # The function transformers calls for the model's attention (DeepSpeed's wrapper).
        "attention_function": ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation].__name__,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if torch.distributed.is_initialized():
        # Every rank done (rank 0 saves the final model last) before any tears the group down:
        # a rank leaving early can abort gloo's threads ("terminate called without an active
        # exception") while rank 0 still works.
        torch.distributed.barrier()


def _rows(kind: str, rows: list[dict]) -> list[dict]:
    """``rows`` as ``kind`` (see --rows-kind): row i padded by 3 + i % 5 tokens (label -100),
    or split into documents of 7 + i % 5 tokens."""
    out = []
    for i, row in enumerate(rows):
        ids, labels = row["input_ids"], row["labels"].clone()
        n = ids.shape[-1]
        if kind in ("right_pad", "left_pad"):
            pad = 3 + i % 5
            mask = torch.ones(n, dtype=torch.long)
            where = slice(n - pad, n) if kind == "right_pad" else slice(0, pad)
            mask[where] = 0
            labels[where] = -100
            ids = ids.clone()
            ids[where] = 0
            out.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
        elif kind == "packed":
            doc = 7 + i % 5
            pos = torch.arange(n) % doc
            labels[pos == 0] = -100  # no document's first token is predicted from another's
            out.append({"input_ids": ids, "labels": labels, "position_ids": pos})
        else:
            out.append(row)
    return out


if __name__ == "__main__":
    main()
    # Every report and save is written: leave without the interpreter's teardown, where
    # DeepSpeed's CPU comm op and gloo's C++ threads can still abort the process ("terminate
    # called without an active exception", seen after a run had finished).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
