"""One training run for the data-parallel tests, single process or one rank of a torchrun launch.

``python3 tests/dp_worker.py --out DIR ...`` (single process),
``torchrun --nproc_per_node 2 tests/dp_worker.py --out DIR ...`` (data parallel on one host) or
one ``torchrun --nnodes 2 --node_rank K --nproc_per_node 2 ...`` per node (multi-node, see
tests/test_multinode.py). Each rank writes ``DIR/rank{r}.json`` (its logs, host-store bytes,
reduced bytes, a digest of the weights it sees, the rows each step trained);
``trainer.save_model`` writes ``DIR/final``. ``--jobs FILE`` runs several trainings (each its own
argument list, a JSON list of them) in one launch, one after another.
``--per-device-batch`` is per rank: pass world x it to the single run for the same global batch.
``--rows`` / ``--epochs`` / ``--eval-rows`` / ``--also-iterable`` make the partial last global
batch (rows not a multiple of the global batch) for tests/test_distributed.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys

# Run as a script by torchrun: make the repository importable (tests.helpers, hf_megatrain).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hf_megatrain import HFMegaTrainer, MegaTrainArguments  # noqa: E402
from hf_megatrain.hf.arguments import as_arguments  # noqa: E402
from hf_megatrain.hf.checkpoint import host_state_dict  # noqa: E402
from hf_megatrain.hf.preemption import SaveOnSigterm  # noqa: E402
from hf_megatrain.option_flags import add_option_arguments, options_from_namespace  # noqa: E402
from tests.helpers import (  # noqa: E402
    LogRecorder,
    add_job_arguments,
    common_args,
    make_data,
    run_jobs,
    tiny_config,
    tiny_model,
)


def weights_digest(model) -> str:
    """sha256 of every weight as this rank sees it: its node's host store (streamed layers) and
    its own replicated parameters. Equal on every rank of every node: the copies are the same."""
    h = hashlib.sha256()
    for key, value in sorted(host_state_dict(model).items()):
        h.update(key.encode())
        h.update(value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", help="the report's folder (required)")
    p.add_argument("--arch", default="llama")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--per-device-batch", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: none)")
    p.add_argument("--resume", default=None, help="checkpoint folder to resume from")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--cuda", action="store_true")
    # The engine's own flags (generated; the library's defaults where not given).
    add_option_arguments(
        p, only=("resident_layers", "stream_fp32_master", "keep_attention_outputs")
    )
    p.add_argument("--rows", type=int, default=64, help="training rows")
    p.add_argument("--epochs", type=float, default=0, help="train epochs (not --steps) if > 0")
    p.add_argument("--eval-rows", type=int, default=0, help="evaluate on N rows after training")
    p.add_argument("--iterable", action="store_true", help="the rows as an IterableDataset")
    p.add_argument(
        "--also-iterable",
        metavar="OUT",
        help="afterwards, in the same processes: train on the rows as an IterableDataset "
        "(accelerate dispatches its batches from rank 0), --steps steps, into OUT",
    )
    p.add_argument(
        "--sigterm-rank", type=int, default=-1, help="this rank sends itself SIGTERM at step 2"
    )
    p.add_argument("--rank1-lr", type=float, default=None, help="rank 1's learning rate")
    add_job_arguments(p)
    a = p.parse_args()
    run_jobs(run_all, p, a)


def run_all(a: argparse.Namespace, out: str, resume: str | None, save_steps: int) -> None:
    """``run``; after the first training, with ``--also-iterable``, the streamed-rows one."""
    run(a, out, resume, save_steps)
    if a.also_iterable and out == a.out:
        stream = argparse.Namespace(**{**vars(a), "iterable": True, "epochs": 0, "eval_rows": 0})
        run(stream, a.also_iterable, None, 0)


class _SigtermAt(TrainerCallback):
    """Rank ``rank`` sends itself SIGTERM at the end of step ``step`` (-1: none)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_step_end(self, args, state, control, **kwargs):
        if int(os.environ.get("RANK", "0")) == self.rank and state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class Stream(torch.utils.data.IterableDataset):
    """The rows as a stream without a length (accelerate dispatches its batches)."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __iter__(self):
        yield from self.rows


class RowsSeen(HFMegaTrainer):
    """Records which rows (their index in ``make_data``'s list) each optimizer step trains;
    the repeats that pad an epoch's last global batch (every label -100) are not counted."""

    def __init__(self, *args, rows: list[dict], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.index = {tuple(r["input_ids"].tolist()): i for i, r in enumerate(rows)}
        self.rows_seen: dict[int, list[int]] = {}

    def training_step(self, model, inputs, num_items_in_batch=None):
        step = self.rows_seen.setdefault(self.state.global_step + 1, [])
        for ids, labels in zip(inputs["input_ids"], inputs["labels"], strict=True):
            if (labels != -100).any():
                step.append(self.index[tuple(ids.tolist())])
        return super().training_step(model, inputs, num_items_in_batch)


def run(a: argparse.Namespace, out: str, resume: str | None, save_steps: int) -> None:
    """One training into ``out`` (resumed from ``resume``); writes this rank's report there."""
    os.makedirs(out, exist_ok=True)
    model = tiny_model(tiny_config(a.arch, num_hidden_layers=a.layers))
    save = dict(save_strategy="steps", save_steps=save_steps) if save_steps else {}
    if a.epochs > 0:
        save |= dict(max_steps=-1, num_train_epochs=a.epochs)
    args = MegaTrainArguments(
        output_dir=os.path.join(out, "run"),
        **common_args(
            per_device_train_batch_size=a.per_device_batch,
            gradient_accumulation_steps=a.grad_accum,
            **{"max_steps": a.steps, **save},
            max_grad_norm=a.max_grad_norm,
            use_cpu=not a.cuda,
            bf16=a.bf16,
            **as_arguments(options_from_namespace(a)),
            per_device_eval_batch_size=a.per_device_batch,
            **(
                {"learning_rate": a.rank1_lr}
                if a.rank1_lr is not None and os.environ.get("RANK") == "1"
                else {}
            ),
        ),
    )
    rec = LogRecorder()
    rows = make_data(a.rows)
    stop = SaveOnSigterm()
    trainer = RowsSeen(
        model=model,
        args=args,
        train_dataset=Stream(rows) if a.iterable else rows,
        eval_dataset=make_data(a.eval_rows, seed=3) if a.eval_rows else None,
        callbacks=[rec, _SigtermAt(a.sigterm_rank, 2), stop],
        rows=rows,
    )
    trainer.train(resume_from_checkpoint=resume)
    evaluated = trainer.evaluate() if a.eval_rows else {}
    trainer.save_model(os.path.join(out, "final"))
    state = trainer.megatrain
    dp = state.engine.dp
    rank = 0 if dp is None else dp.rank
    layers = state.store.layers
    report = {
        "world_size": 1 if dp is None else dp.world_size,
        "logs": rec.logs,
        "private_bytes": state.store.nbytes,
        "shared_bytes": state.store.shared_nbytes,
        # Bytes of AdamW moments this rank holds in host RAM (HBM-tier layers not counted).
        "moment_bytes": sum(
            2 * s.exp_avg.numel() * 4 for s in layers if not s.resident and s.exp_avg is not None
        ),
        "owners": None if dp is None else dp.owners,
        "node": 0 if dp is None else dp.node,
        "local_rank": 0 if dp is None else dp.local_rank,
        "num_nodes": 1 if dp is None else dp.num_nodes,
        # Payload bytes this rank put into each kind of gradient collective, over the run.
        "bytes_reduced": None if dp is None else dict(dp.bytes_reduced),
        "optimizer_steps": trainer.state.global_step,
        "weights_digest": weights_digest(trainer.model),
        # Host layers without a gradient slot (eager updates) / streaming their fp32 master.
        "grad_slots": [s.grad is not None for s in layers if not s.resident and s.owned],
        "streams_fp32_master": state.engine.streams_fp32_master,
        "threads": torch.get_num_threads(),
        "eval_loss": evaluated.get("eval_loss"),
        # Optimizer step -> the rows this rank trained in it.
        "rows": trainer.rows_seen,
        "stopped_at": stop.stopped_at,
        "received": None if stop.received is None else stop.received.name,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
