"""One training run for the sequence-parallel tests: a single process on whole sequences, or one
rank of ``torchrun --nproc_per_node N tests/sp_worker.py --sequence-parallel N`` (Ulysses).

Each rank writes ``DIR/rank{r}.json`` (its logs, the planned step); rank 0's
``trainer.save_model`` writes ``DIR/final``; ``--save-steps K`` checkpoints into
``DIR/run/checkpoint-K`` and ``--then-resume CHECKPOINT OUT`` resumes from one afterwards, in the
same processes. The batch arguments are per rank and the same for both runs: with sequence
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
    add_then_resume_argument,
    common_args,
    make_data,
    run_then_resume,
    tiny_config,
    tiny_model,
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="llama")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--per-device-batch", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sequence-parallel", type=int, default=1)
    p.add_argument("--heads", type=int, default=None, help="num_attention_heads (and kv heads)")
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: none)")
    add_then_resume_argument(p)
    run_then_resume(run, p.parse_args(), None)


def run(a: argparse.Namespace, out: str, resume: str | None, save_steps: int) -> None:
    """One training into ``out`` (resumed from ``resume``); writes this rank's report there."""
    os.makedirs(out, exist_ok=True)
    shape = dict(num_hidden_layers=a.layers)
    if a.heads is not None:
        shape.update(num_attention_heads=a.heads, num_key_value_heads=a.heads)
    model = tiny_model(tiny_config(a.arch, **shape))
    save = dict(save_strategy="steps", save_steps=save_steps) if save_steps else {}
    args = MegaTrainArguments(
        output_dir=os.path.join(out, "run"),
        **common_args(
            per_device_train_batch_size=a.per_device_batch,
            gradient_accumulation_steps=a.grad_accum,
            max_steps=a.steps,
            megatrain_sequence_parallel=a.sequence_parallel,
            **save,
        ),
    )
    rec = LogRecorder()
    data = make_data(a.rows, seq=a.seq)
    try:
        trainer = HFMegaTrainer(model=model, args=args, train_dataset=data, callbacks=[rec])
    except Exception as e:  # the refusals the tests check: written where the test reads them
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"error": f"{type(e).__name__}: {e}"}, f)
        raise
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(out, "final"))
    dp = trainer.megatrain.engine.dp
    rank = 0 if dp is None else dp.rank
    step = trainer.megatrain.step  # the micro-batch the memory plan sizes activations for
    report = {
        "world_size": 1 if dp is None else dp.world_size,
        "logs": rec.logs,
        "optimizer_steps": trainer.state.global_step,
        # The row length the rank's layers ran on (seq / N under sequence parallelism).
        "seq_len_seen": trainer._last_seq_len,
        "planned_step": None if step is None else [step.seq_len, step.micro_batch_tokens],
        # The function transformers calls for the model's attention (DeepSpeed's wrapper).
        "attention_function": ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation].__name__,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
