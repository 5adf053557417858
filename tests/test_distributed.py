"""Data parallel on CPU (gloo): 2 ranks equal 1 process at the same global batch.

Each run is a subprocess (``tests/dp_worker.py``; 2 ranks through ``torch.distributed.run``), so
the process groups and shared host memory are real. The single-process run uses the per-rank
batch x 2 and the same gradient accumulation: with accelerate's sharding (rank r takes every
world-th per-device batch of the same permutation), both runs see the same rows in every
optimizer step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainingArguments

from hf_megatrain import HFMegaTrainer
from hf_megatrain.core.distributed import DataParallel, DataParallelError

from .helpers import assert_close_weights as _assert_close_weights
from .helpers import assert_same_training_logs as _assert_same_training
from .helpers import saved_weights as _weights
from .helpers import tiny_config

WORKER = Path(__file__).with_name("dp_worker.py")
ROOT = WORKER.parent.parent


def _job(out: Path, world: int, *extra: str, batch: int = 2) -> list[str]:
    """One training's worker arguments (per-rank batch ``batch`` with ``world`` processes)."""
    return ["--out", str(out), "--per-device-batch", str(batch * (2 // world)), *extra]


def _launch(root: Path, world: int, jobs: list[list[str]]) -> None:
    """Run ``jobs`` in order in one launch of ``world`` processes (imports and rendezvous once)."""
    outs = [job[job.index("--out") + 1] for job in jobs]
    assert len(set(outs)) == len(outs), f"two trainings into one folder: {outs}"
    root.mkdir(parents=True, exist_ok=True)
    (root / f"jobs{world}.json").write_text(json.dumps(jobs))
    args = [str(WORKER), "--jobs", str(root / f"jobs{world}.json")]
    if world == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc_per_node", str(world), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _reports(out: Path) -> list[dict]:
    """Each rank's report of the training into ``out``."""
    files = sorted(out.glob("rank*.json"), key=lambda f: int(f.stem[4:]))
    return [json.loads(f.read_text()) for f in files]


def _run(out: Path, world: int, *extra: str, batch: int = 2) -> list[dict]:
    """One training in its own launch (tests/test_gpu_dp.py); each rank's report."""
    _launch(out, world, [_job(out, world, *extra, batch=batch)])
    return _reports(out)


COMMON = ("--grad-accum", "2", "--steps", "4", "--save-steps", "2")
STEPS = ("--grad-accum", "2", "--steps", "4")
#: No clipping (layers update during backward) and one replicated HBM-tier layer.
EAGER = ("--grad-accum", "2", "--steps", "3", "--max-grad-norm", "0", "--resident-layers", "1")
#: DeepSeek-V3.2, whose indexer gets no gradient; the same HBM tier, eager or clipped.
GRADLESS = ("--arch", "deepseek_v32", "--grad-accum", "2", "--steps", "3", "--resident-layers", "1")
CLIPS = (("eager", "0"), ("clipped", "0.5"))
BF16 = ("--grad-accum", "2", "--steps", "3", "--max-grad-norm", "0", "--bf16")
#: 29 rows at a global batch of 4: each epoch's last global batch holds 1 row.
PARTIAL = ("--rows", "29", "--epochs", "2", "--grad-accum", "2", "--eval-rows", "5")
PARTIAL += ("--steps", "8", "--save-steps", "6")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every training of this module: the single-process ones in one process, then the 2-rank
    ones in one launch (some resume from the former's checkpoints), each into ``root / name``:
    two launches, not ~20 (each ~10 s of imports and a rendezvous on these 2 cores)."""
    root = tmp_path_factory.mktemp("dp")
    single_ckpt = str(root / "single" / "run" / "checkpoint-2")
    single = [
        _job(root / "single", 1, *COMMON),  # GA 2, clipping, checkpoint at step 2
        _job(root / "sixteen", 1, *STEPS, batch=4),
        _job(root / "eager_single", 1, *EAGER),
        *(
            _job(root / f"gradless_{k}_single", 1, *GRADLESS, "--max-grad-norm", c)
            for k, c in CLIPS
        ),
        _job(root / "partial_single", 1, *PARTIAL, "--also-iterable", str(root / "single_it")),
    ]
    ranks = [
        _job(root / "dp", 2, *COMMON),
        _job(root / "resumed", 2, *STEPS, "--resume", str(root / "dp" / "run" / "checkpoint-2")),
        _job(root / "same", 2, *STEPS, "--resume", single_ckpt),
        _job(root / "bigger", 2, *STEPS, "--resume", single_ckpt, batch=4),
        _job(root / "kept", 2, *COMMON, "--keep-attention-outputs"),
        _job(root / "eager_dp", 2, *EAGER),
        *(_job(root / f"gradless_{k}_dp", 2, *GRADLESS, "--max-grad-norm", c) for k, c in CLIPS),
        _job(root / "bf16_base", 2, *BF16),
        _job(root / "bf16_master", 2, *BF16, "--stream-fp32-master"),
        _job(
            root / "partial_dp",
            2,
            *PARTIAL,
            "--also-iterable",
            str(root / "dp_it"),
            "--then-resume",
            str(root / "partial_dp" / "run" / "checkpoint-6"),
            str(root / "partial_resumed"),
        ),  # fmt: skip
        # Last: rank 1 sends itself SIGTERM at step 2 (the launch's other trainings are done).
        _job(root / "term", 2, "--steps", "6", "--save-steps", "0", "--sigterm-rank", "1"),
    ]
    _launch(root, 1, single)
    _launch(root, 2, ranks)
    return root


def test_dp_equals_single_process(runs):
    single, dp = _reports(runs / "single"), _reports(runs / "dp")
    assert dp[0]["world_size"] == 2
    assert len(single[0]["logs"]) == 4
    _assert_same_training(single[0]["logs"], dp[0]["logs"])
    # Rank 1 logs the same (all-reduced) values as rank 0.
    _assert_same_training(dp[0]["logs"], dp[1]["logs"], rel=0)
    # The saved model (written by rank 0 from the shared masters) is the single-process one.
    _assert_close_weights(_weights(runs / "single" / "final"), _weights(runs / "dp" / "final"))


def test_dp_shards_optimizer_state(runs):
    single, dp = _reports(runs / "single"), _reports(runs / "dp")
    assert dp[0]["owners"] == [0, 1, 0, 1]  # 4 equal layers, round-robin
    # AdamW moments: each rank holds exactly half of the single-process moments, none twice.
    assert all(r["moment_bytes"] == single[0]["moment_bytes"] // 2 for r in dp)
    # Private host bytes per rank (grad + 2 moments of owned layers) plus the shared masters
    # (counted once per host) stay below the single process's store: no duplicated masters.
    per_layer = single[0]["private_bytes"] // 4  # fp32 run: grad, master, 2 moments
    assert all(r["private_bytes"] == 2 * 3 * per_layer // 4 for r in dp)
    assert dp[0]["shared_bytes"] == 4 * per_layer // 4
    host_total = sum(r["private_bytes"] for r in dp) + dp[0]["shared_bytes"]
    assert host_total == single[0]["private_bytes"]


def test_dp_checkpoint_matches_single_and_resumes(runs):
    ckpt_dp = runs / "dp" / "run" / "checkpoint-2"
    ckpt_single = runs / "single" / "run" / "checkpoint-2"
    _assert_close_weights(_weights(ckpt_single), _weights(ckpt_dp))
    opt_dp, opt_single = ckpt_dp / "megatrain_optimizer", ckpt_single / "megatrain_optimizer"
    names = sorted(p.name for p in opt_single.glob("*.safetensors"))
    # Every layer's moments were written, each by its owner.
    assert names == sorted(p.name for p in opt_dp.glob("*.safetensors"))
    for name in names:
        a, b = load_file(str(opt_single / name)), load_file(str(opt_dp / name))
        assert sorted(a) == sorted(b)
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6, msg=f"{name}:{key}")
    # Resume under data parallel from step 2: bit-equal to the uninterrupted run (same masters,
    # moments, steps, RNG and data order).
    dp, resumed = _reports(runs / "dp"), _reports(runs / "resumed")
    assert [x["loss"] for x in resumed[0]["logs"]] == [x["loss"] for x in dp[0]["logs"][2:]]
    a, b = _weights(runs / "dp" / "final"), _weights(runs / "resumed" / "final")
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _rows_by_step(reports: list[dict]) -> dict[int, list[int]]:
    """Optimizer step -> the rows every rank trained in it, sorted."""
    steps: dict[int, list[int]] = {}
    for r in reports:
        for step, rows in r["rows"].items():
            steps.setdefault(int(step), []).extend(rows)
    return {step: sorted(rows) for step, rows in sorted(steps.items())}


def test_dp_resume_at_another_world_size_as_the_trainer(runs):
    """A checkpoint resumed under another process count, as the stock Trainer resumes it: its
    data position is counted in steps of the new layout (global_step x accumulation of the new
    per-rank batches skipped). Where a step still trains the same rows (1 process x 4 rows, now
    2 x 2) the run goes on as the uninterrupted one; where it trains more (2 x 4: 16 rows a
    step, not 8), steps 3-4 train what a run at 16 rows a step trains in its steps 3-4, and the
    rows between are never trained in that epoch. Checked by hand against the stock Trainer
    (DDP over gloo, 2 processes): it trains the same rows at each step, both ways."""
    dp, same = _reports(runs / "dp"), _reports(runs / "same")
    assert _rows_by_step(same) == {k: v for k, v in _rows_by_step(dp).items() if k > 2}
    assert [x["loss"] for x in same[0]["logs"]] == pytest.approx(
        [x["loss"] for x in dp[0]["logs"][2:]], rel=1e-6
    )
    _assert_close_weights(_weights(runs / "dp" / "final"), _weights(runs / "same" / "final"))

    uninterrupted = _rows_by_step(_reports(runs / "sixteen"))
    resumed = _rows_by_step(_reports(runs / "bigger"))
    assert resumed == {3: uninterrupted[3], 4: uninterrupted[4]}
    before = _rows_by_step(_reports(runs / "single"))  # steps 1-2: the first 16 rows of the order
    trained = before[1] + before[2] + resumed[3] + resumed[4]
    assert len(set(trained)) == len(trained) == 48  # of the 64 rows: 16 never trained


def test_dp_eager_updates_and_hbm_tier(runs):
    """No clipping (layers update during backward) and one replicated HBM-tier layer."""
    single, dp = _reports(runs / "eager_single"), _reports(runs / "eager_dp")
    _assert_same_training(single[0]["logs"], dp[0]["logs"])
    _assert_close_weights(
        _weights(runs / "eager_single" / "final"), _weights(runs / "eager_dp" / "final")
    )
    # The HBM-tier layer 0 is replicated (on every rank's device); the 3 streamed layers'
    # host moments are split 2 + 1 over the ranks, none held twice.
    assert dp[0]["owners"] == [-1, 0, 1, 0]
    assert sum(r["moment_bytes"] for r in dp) == single[0]["moment_bytes"]
    # Clipping off: no host gradient slot anywhere; the owners' reduced gradients went through
    # the staging path into their eager updates. fp32 run: master (shared) + 2 moments (owned)
    # per streamed layer, the single process's store exactly.
    assert not any(slot for r in [*single, *dp] for slot in r["grad_slots"])
    per_layer = single[0]["private_bytes"] // 3  # 3 streamed layers: master + 2 moments
    assert [r["private_bytes"] for r in dp] == [2 * 2 * per_layer // 3, 2 * per_layer // 3]
    assert dp[0]["shared_bytes"] == 3 * per_layer // 3


@pytest.mark.parametrize("clip", [k for k, _ in CLIPS])
def test_dp_skips_parameters_without_a_gradient(runs, clip):
    """DeepSeek-V3.2's indexer gets no gradient on any rank: under data parallel (an HBM-tier
    layer replicated, the others owned; eager updates or clipping) AdamW skips it as the single
    process does, which stock's does too (tests/test_gradless_params.py)."""
    from .helpers import tiny_model  # noqa: PLC0415

    single, dp = _reports(runs / f"gradless_{clip}_single"), _reports(runs / f"gradless_{clip}_dp")
    _assert_same_training(single[0]["logs"], dp[0]["logs"])
    final = _weights(runs / f"gradless_{clip}_dp" / "final")
    _assert_close_weights(_weights(runs / f"gradless_{clip}_single" / "final"), final)
    initial = tiny_model(tiny_config("deepseek_v32", num_hidden_layers=4)).state_dict()
    indexer = [n for n in final if ".indexer." in n]
    assert indexer and all(torch.equal(final[n], initial[n]) for n in indexer)
    assert not torch.equal(final["model.layers.0.mlp.gate_proj.weight"],
                           initial["model.layers.0.mlp.gate_proj.weight"])  # fmt: skip


def test_dp_bf16_fp32_master_streaming_no_clip(runs):
    """12 B/param stores under data parallel: shared fp32 masters (no bf16 copy), owned moments.

    Compared with the same 2-rank bf16 run on the default store (shared bf16 copies): the ranks
    cast the shared fp32 master at acquire exactly as the owner's refresh rounds it into the
    copy, so losses and weights are bitwise equal (a stale or unpublished master would not be).
    """
    base, dp = _reports(runs / "bf16_base"), _reports(runs / "bf16_master")
    assert all(r["streams_fp32_master"] for r in dp) and not base[0]["streams_fp32_master"]
    assert [x["loss"] for x in dp[0]["logs"]] == [x["loss"] for x in base[0]["logs"]]
    a, b = _weights(runs / "bf16_base" / "final"), _weights(runs / "bf16_master" / "final")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # Shared region: the 4 fp32 masters and nothing else (the default run adds 4 bf16 copies);
    # each rank's private part: the 2 moments of its 2 layers, no gradient slot.
    f32 = dp[0]["private_bytes"] // 4  # one layer's page-rounded fp32 buffer
    assert [r["private_bytes"] for r in dp] == [4 * f32, 4 * f32]
    assert dp[0]["shared_bytes"] == 4 * f32 < base[0]["shared_bytes"]


def test_dp_keep_attention_outputs_trains_identically(runs):
    """Kept attention outputs under data parallel: each rank's recompute gets its own forward's
    kernel outputs, so 2-rank training is bitwise the default 2-rank training (fp32)."""
    kept, base = _reports(runs / "kept"), _reports(runs / "dp")
    assert [x["loss"] for x in kept[0]["logs"]] == [x["loss"] for x in base[0]["logs"]]
    a, b = _weights(runs / "dp" / "final"), _weights(runs / "kept" / "final")
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_dp_partial_last_batch_equals_single_process(runs):
    """29 rows at a global batch of 4: each epoch's last global batch holds 1 row. accelerate's
    even_batches gives rank 0 that row plus a repeated one and rank 1 two repeated rows; they are
    masked (labels -100), so 2 ranks train and evaluate as 1 process. Covered: 2 epochs with
    gradient accumulation 2 (the partial micro-batch is the second of its step's two, and the
    Trainer's gathered token count is the real rows'), the final evaluation over 5 rows (its last
    batch partial too), a resume mid-epoch (the data skip) from checkpoint-6 before the second
    epoch's partial batch, and the rows as an IterableDataset (accelerate dispatches its batches
    from rank 0 and pads the last one differently). Unmasked, step 4 (the first partial batch)
    differs from one process by ~1% in loss."""
    single, dp = _reports(runs / "partial_single"), _reports(runs / "partial_dp")
    assert len(single[0]["logs"]) == 8 and dp[0]["optimizer_steps"] == 8
    _assert_same_training(single[0]["logs"], dp[0]["logs"])
    _assert_close_weights(
        _weights(runs / "partial_single" / "final"), _weights(runs / "partial_dp" / "final")
    )
    # Evaluation: per-batch mean losses, repeated per row and gathered (the duplicates dropped by
    # gather_for_metrics): the same numbers as one process's up to fp32 summation order
    # (observed equal; the repeated rows counted in moved it by 2e-3).
    assert dp[0]["eval_loss"] == pytest.approx(single[0]["eval_loss"], rel=1e-6)
    # The resume skips the first 4 micro-batches of epoch 2 and masks its partial batch as the
    # uninterrupted run did: bitwise the same steps 7 and 8 and final weights.
    after = _reports(runs / "partial_resumed")
    assert [x["loss"] for x in after[0]["logs"]] == [x["loss"] for x in dp[0]["logs"][6:]]
    a, b = _weights(runs / "partial_dp" / "final"), _weights(runs / "partial_resumed" / "final")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # The streamed rows (8 steps: 2 passes of 8 micro-batches, the last of 1 row).
    it_single, it_dp = _reports(runs / "single_it"), _reports(runs / "dp_it")
    assert len(it_single) == 1 and len(it_dp) == 2
    assert len(it_single[0]["logs"]) == 8
    _assert_same_training(it_single[0]["logs"], it_dp[0]["logs"])
    _assert_close_weights(
        _weights(runs / "single_it" / "final"), _weights(runs / "dp_it" / "final")
    )


class _Rows(torch.utils.data.IterableDataset):
    """range(n) as a stream with a length (accelerate's IterableDatasetShard reads it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        yield from range(self.n)


@pytest.mark.parametrize("kind", ["sampler", "split", "stream"])
def test_last_batch_layout_marks_exactly_the_repeated_rows(kind):
    """What the trainer masks, against what accelerate's shards really yield (no processes:
    each rank's shard iterated here): the rows it keeps from every rank's epoch, earlier batches
    whole and the last batch's first ``clamp(real - r * per_rank, 0, per_rank)``, are every row
    of the data once (with drop_last, every row of the full global batches), over dataset
    sizes, batch sizes, process counts and skipped batches (a resume)."""
    from accelerate.data_loader import (
        BatchSamplerShard,
        DataLoaderShard,
        IterableDatasetShard,
        SkipBatchSampler,
    )
    from torch.utils.data import BatchSampler, SequentialSampler

    from hf_megatrain.hf.trainer import last_batch_rows

    for n, b, world, drop_last, skip in (
        (rows, b, world, drop, skip)
        for rows in range(1, 14)
        for b in (1, 2, 3)
        for world in (2, 3)
        for drop in (False, True)
        for skip in (0, 1)
    ):
        kept, batches = [], None
        for rank in range(world):
            if kind == "stream":
                data = IterableDatasetShard(
                    _Rows(n), b, drop_last, num_processes=world, process_index=rank
                )
                loader = DataLoaderShard(data, batch_size=b, drop_last=False)
            else:
                split = kind == "split"
                inner = BatchSampler(
                    SequentialSampler(range(n)), b * (world if split else 1), drop_last
                )
                shard = BatchSamplerShard(inner, world, rank, split_batches=split)
                sampler = SkipBatchSampler(shard, skip) if skip else shard
                loader = DataLoaderShard(range(n), batch_sampler=sampler)
            mine = [batch.tolist() for batch in loader]
            assert batches is None or len(mine) == batches  # even_batches: as many per rank
            batches = len(mine)
            if not mine:
                continue
            layout = last_batch_rows(loader, world)
            real, per_rank = layout if layout != (0, 0) else (world * b, b)
            assert len(mine[-1]) == per_rank
            first_real = max(0, min(per_rank, real - rank * per_rank))
            kept += [row for batch in mine[:-1] for row in batch] + mine[-1][:first_real]
        full = n - n % (world * b) if drop_last else n
        skipped = skip * world * b if kind != "stream" else 0
        assert sorted(kept) == list(range(skipped, full)), (n, b, world, drop_last, skip)


def test_refuses_unequal_nodes_and_too_many_ranks():
    # Several nodes run (tests/test_multinode.py), but each with as many ranks.
    with pytest.raises(DataParallelError, match="same number of processes on every node"):
        DataParallel(rank=0, world_size=3, local_world_size=2)
    dp = DataParallel(rank=0, world_size=4, local_world_size=4)
    with pytest.raises(DataParallelError, match="every rank must be able to own a layer"):
        dp.assign_owners([10, 10, 10])
    # Unequal layers: bytes balance (greedy onto the least-loaded rank).
    dp = DataParallel(rank=0, world_size=2, local_world_size=2)
    dp.assign_owners([100, 10, 10, 10, 100])
    assert dp.owners == [0, 1, 1, 1, 1]


@pytest.mark.parametrize("drop_last", [False, True])
def test_uneven_batches_are_refused_before_training(tmp_path, drop_last):
    # even_batches=False leaves a rank short of the partial last batch: the others would wait in
    # its gradient reduction forever. Refused at construction unless the partial batch is dropped.
    class TwoProcessArguments(TrainingArguments):
        world_size = 2  # as under a 2-process launch

    args = TwoProcessArguments(
        output_dir=str(tmp_path),
        report_to="none",
        accelerator_config={"even_batches": False},
        dataloader_drop_last=drop_last,
        use_cpu=True,
    )
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    # With the partial batch dropped the ranks run equal steps; the check after it (the model was
    # streamed in this one process) is what refuses then.
    match = "streamed for 1 process" if drop_last else "even_batches=False"
    with pytest.raises(DataParallelError, match=match):
        HFMegaTrainer(model=model, args=args, train_dataset=[])


def test_a_sigterm_to_one_rank_stops_every_rank_naming_it(runs):
    """Found by an audit: one rank preempted (SIGTERM to it alone): every rank stopped at the
    same step and the checkpoint was saved, but the ranks that got no signal had ``received``
    None (the CLI then failed on it, exit 1 and a traceback, not 143)."""
    reports = _reports(runs / "term")
    assert [r["received"] for r in reports] == ["SIGTERM", "SIGTERM"]
    stopped = {r["stopped_at"] for r in reports}
    assert len(stopped) == 1 and stopped.pop() in (2, 3)
    assert (runs / "term" / "run" / f"checkpoint-{reports[0]['stopped_at']}").is_dir()


def test_ranks_launched_with_other_arguments_are_refused(tmp_path):
    """Found by an audit: nodes launched with different arguments trained apart without a word
    (another learning rate: each node's copy of the layers its own), or hung at the end
    (another --max_steps). Every rank refuses the launch at once, naming what differs."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(WORKER), "--out", str(tmp_path / "lr"), "--steps", "2", "--rank1-lr", "1e-3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert "launched with different settings: learning_rate (rank 0: 0.01, rank 1: 0.001)" in said
