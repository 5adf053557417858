"""Ulysses sequence parallelism (DeepSpeed's) on CPU (gloo): 2 ranks sharing each sequence train
exactly as 1 process on the whole sequences.

Each run is a subprocess (``tests/sp_worker.py``; 2 ranks through ``torch.distributed.run``), so
the process groups, the all-to-alls and the shared host store are real. Both runs use the same
per-rank batch and gradient accumulation: accelerate gives rank r every 2nd batch of the same
permutation, DeepSpeed's dataloader adapter gathers the group's two batches and processes them
one after the other (each split along the sequence), so every optimizer step sees the rows the
single process sees, in the same order. Rows of 64 tokens, 32 per rank.

The run tests need deepspeed (skipped without it); the checks of what cannot run do not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import CONFIG_MAPPING

import hf_megatrain.cli_resume as cli_resume
from hf_megatrain.cli import parse_train
from hf_megatrain.cli_common import CLIError
from hf_megatrain.cli_resume import RECORD_NAME, check_same_run, run_record
from hf_megatrain.cli_train import loader_arguments
from hf_megatrain.core.options import EngineOptions, OptionError
from hf_megatrain.hf.flops import model_flops_utilization
from hf_megatrain.hf.sequence_parallel import (
    SequenceParallelError,
    batch_problem,
    check_sequence_parallel,
    check_sequence_parallel_arguments,
    pad_to_shards,
)
from hf_megatrain.hf.step_layout import StepLayout, layout_change, processes_keeping_steps
from tests.helpers import gemma4_config, tiny_config, tiny_model

WORKER = Path(__file__).with_name("sp_worker.py")
ROOT = WORKER.parent.parent


# (parsing train's arguments without --output_dir makes outputs/ where it runs)
pytestmark = pytest.mark.usefixtures("in_a_tmp_folder")


def _run(out: Path, world: int, *extra: str, check: bool = True, sp: int = 0) -> list[dict]:
    """Train with ``world`` processes, ``sp`` (default: all) sharing each sequence; return each
    rank's report."""
    args = [str(WORKER), "--out", str(out), *extra]
    if world == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc_per_node", str(world), *args, "--sequence-parallel", str(sp or world)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    else:
        assert proc.returncode != 0, "the run should have failed"
    return _reports(out, world)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def runs(request, tmp_path_factory):
    """One single-process run on whole rows and one 2-rank Ulysses run (GA 2, clipping, 3
    steps). Both tiny models are GQA (4 query heads, 2 key/value heads): each rank attends with
    2 query heads and 1 key/value head over the whole sequence; qwen3 adds its q/k norms.

    The Ulysses run checkpoints at step 2 and, in the same processes, resumes from it into
    ``sp_resumed``; the single process then resumes from that 2-rank checkpoint into
    ``single_from_sp`` (another layout: whole rows, no sharding), having checkpointed at step 2
    itself (``single/run/checkpoint-2``)."""
    pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")
    arch = request.param
    root = tmp_path_factory.mktemp(f"sp-{arch}")
    common = ("--arch", arch, "--seq", "64", "--grad-accum", "2", "--steps", "3")
    ckpt = str(root / "sp" / "run" / "checkpoint-2")
    resume = ("--then-resume", ckpt, str(root / "sp_resumed"))
    sp = _run(root / "sp", 2, *common, "--save-steps", "2", *resume)
    resume = ("--then-resume", ckpt, str(root / "single_from_sp"))
    single = _run(root / "single", 1, *common, "--save-steps", "2", *resume)
    return root, single, sp


def test_sequence_parallel_equals_single_process(runs):
    root, single, sp = runs
    # The layers ran on half rows, through DeepSpeed's attention wrapper.
    assert single[0]["seq_len_seen"] == 64
    assert all(r["seq_len_seen"] == 32 for r in sp)
    # MFU's attention term counts the whole row a token attends over, not the local shard.
    assert single[0]["attention_row_len"] == 64
    assert all(r["attention_row_len"] == 64 for r in sp)
    assert all(r["attention_function"] == "uattn_wrapper" for r in sp)
    assert single[0]["attention_function"] != "uattn_wrapper"
    a, b = single[0]["logs"], sp[0]["logs"]
    assert len(a) == len(b) == 3
    for step, (x, y) in enumerate(zip(a, b), 1):
        # fp32 on CPU. What differs is only the order of fp32 sums: projections and MLPs run on
        # 32-token shards, a weight's gradient is the sum of the two ranks' halves, the loss sums
        # two shards' token losses (observed: loss 1e-7 relative, grad_norm equal to all printed
        # digits). Attention without the all-to-all (each rank attending only to its own shard)
        # moves the loss by 1e-4 and grad_norm by 1.6-4% relative; a label shifted after the
        # split or a per-rank mean loss (the last shard has one label fewer) by ~1e-2.
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), f"loss at step {step}"
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), f"grad_norm at {step}"
        assert y["learning_rate"] == x["learning_rate"], f"learning_rate at step {step}"
    # Both ranks log the same (all-reduced) values.
    keys = ("loss", "grad_norm", "learning_rate")
    assert [[s[k] for k in keys] for s in sp[1]["logs"]] == [[s[k] for k in keys] for s in b]
    # The saved model, from the shared host store: after 3 AdamW steps at lr 1e-2 the weights
    # differ by ~1e-7 (observed 9.3e-8); attention without the all-to-all leaves 3e-2.
    _weights_close(root / "single", root / "sp", atol=1e-6)
    # The memory plan sized activations for this rank's shard: half of each 64-token row.
    assert single[0]["planned_step"] == [64, 2 * 64]
    assert all(r["planned_step"] == [32, 2 * 32] for r in sp)


def _reports(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_sequence_parallel_resumes(runs):
    """Resumed from its step-2 checkpoint, the Ulysses run ends as the uninterrupted one: the
    Trainer's skip of the trained batches goes through the sharded loader (accelerate's own
    would rebuild a plain DataLoader: whole rows on every rank, and twice the rows skipped). One
    process resumed from the 2-rank checkpoint ends as the single-process run."""
    root, single, sp = runs
    for r, resumed in zip(sp, _reports(root / "sp_resumed", 2), strict=True):
        assert resumed["optimizer_steps"] == 3
        assert resumed["seq_len_seen"] == 32
        (last,) = resumed["logs"]  # only step 3 ran
        # Same processes, same shards, same order of sums: observed equal to the last digit.
        for k in ("loss", "grad_norm", "learning_rate"):
            assert last[k] == pytest.approx(r["logs"][-1][k], rel=1e-6), k
    _weights_close(root / "sp", root / "sp_resumed", atol=1e-7)
    (other,) = _reports(root / "single_from_sp", 1)
    assert other["optimizer_steps"] == 3 and other["seq_len_seen"] == 64
    (last,) = other["logs"]
    for k in ("loss", "grad_norm"):
        assert last[k] == pytest.approx(single[0]["logs"][-1][k], rel=1e-5), k
    _weights_close(root / "single", root / "single_from_sp", atol=1e-6)


def test_sequence_parallel_resume_at_another_degree(runs, tmp_path):
    """A checkpoint resumed at another sequence-parallel degree trains as a run at the new
    degree from the start would, or is refused. The step's rows are batch x accumulation x the
    groups of ranks sharing each sequence, and the resume counts its data position in steps of
    the new layout. 1 process and 2 ranks sharing each sequence take the same 4 rows a step:
    the single-process checkpoint resumed by 2 Ulysses ranks ends as the single run (the reverse
    is test_sequence_parallel_resumes). 2 ranks without sequence parallelism take 8 rows a step:
    resumed from the 2-rank Ulysses checkpoint, step 3 would train rows 16-23 of the order and
    rows 8-15 never (measured: exactly as a single-process checkpoint resumed at 2 ranks, which
    the stock Trainer allows); it was accepted without a word. Now refused on both ranks, before
    training, naming both layouts and the ways on."""
    root, single, _ = runs
    arch = ("--arch", "qwen3" if "qwen3" in root.name else "llama")
    common = (*arch, "--seq", "64", "--grad-accum", "2", "--steps", "3")
    ckpt = root / "single" / "run" / "checkpoint-2"
    sp = _run(tmp_path / "sp_from_single", 2, *common, "--resume", str(ckpt))
    for r in sp:
        assert r["optimizer_steps"] == 3 and r["seq_len_seen"] == 32
        (last,) = r["logs"]
        for k in ("loss", "grad_norm"):  # observed equal to all printed digits
            assert last[k] == pytest.approx(single[0]["logs"][-1][k], rel=1e-5), k
    _weights_close(root / "single", tmp_path / "sp_from_single", atol=1e-6)

    ckpt = root / "sp" / "run" / "checkpoint-2"
    out = tmp_path / "dp_from_sp"
    reports = _run(out, 2, *common, "--resume", str(ckpt), check=False, sp=1)
    for r in reports:
        msg = r["error"]
        assert msg.startswith("ValueError: hf_megatrain: cannot resume ") and "\n" not in msg
        assert "at megatrain_sequence_parallel=1 on 2 processes: it was saved at " in msg
        assert "megatrain_sequence_parallel=2 on 2 processes" in msg
        assert "a step trained 4 rows there and would train 8 here" in msg
        assert "(or megatrain_sequence_parallel=1 on 1 process)" in msg
    assert not (out / "final").exists()  # nothing trained or written


def _weights_close(a: Path, b: Path, atol: float) -> None:
    w1 = load_file(str(a / "final" / "model.safetensors"))
    w2 = load_file(str(b / "final" / "model.safetensors"))
    assert sorted(w1) == sorted(w2)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=atol, msg=name)


def test_sequence_parallel_with_data_parallel(tmp_path):
    """4 ranks: 2 Ulysses groups of 2, data parallel to each other. A step of gradient
    accumulation 2 per group covers 4 batches (each group 2, one after the other): one process
    with accumulation 4 sees the same rows. 4 layers: every rank owns one."""
    pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")
    common = ("--seq", "64", "--steps", "3", "--rows", "32", "--layers", "4")
    single = _run(tmp_path / "single", 1, *common, "--grad-accum", "4")
    runs = _run(tmp_path / "sp", 4, *common, "--grad-accum", "2", sp=2)
    assert all(r["seq_len_seen"] == 32 for r in runs)
    for step, (x, y) in enumerate(zip(single[0]["logs"], runs[0]["logs"], strict=True), 1):
        # Observed: loss 1e-7 relative, grad_norm 1.3e-7, weights 2e-7 (same argument as above).
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), f"loss at step {step}"
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), f"grad_norm at {step}"
    _weights_close(tmp_path / "single", tmp_path / "sp", atol=1e-6)


def test_sequence_parallel_refuses_indivisible_heads(tmp_path):
    """One attention head cannot be split over 2 ranks: both ranks refuse before any
    all-to-all (none is left waiting)."""
    pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")
    reports = _run(tmp_path, 2, "--heads", "1", "--steps", "1", check=False)
    for r in reports:
        assert "SequenceParallelError" in r["error"]
        assert "num_attention_heads=1" in r["error"]


def test_sequence_parallel_pads_rows_mixtral(tmp_path):
    """Rows of 63 tokens, right-padded by 3 to 7 (attention_mask, labels -100), on Mixtral (MoE
    without its router aux loss, see test_check_families_ulysses_cannot_split; its config says
    head_dim=None): the 2-rank run pads each row to 64 at the end and trains as one process on
    the 63-token rows. Before: DeepSpeed's adapter raised "seqlen=63 isn't divisible by
    sp-size=2", and its attention wrapper failed on head_dim=None."""
    pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")
    common = ("--arch", "mixtral", "--router-aux-off", "--seq", "63", "--rows-kind", "right_pad")
    common += ("--steps", "2")
    single = _run(tmp_path / "single", 1, *common)
    sp = _run(tmp_path / "sp", 2, *common)
    assert single[0]["seq_len_seen"] == 63 and all(r["seq_len_seen"] == 32 for r in sp)
    for step, (x, y) in enumerate(zip(single[0]["logs"], sp[0]["logs"], strict=True), 1):
        # Same argument as test_sequence_parallel_equals_single_process (observed 1e-7).
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), f"loss at step {step}"
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), f"grad_norm at {step}"
    _weights_close(tmp_path / "single", tmp_path / "sp", atol=1e-6)


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        # The dropped mask would let every token attend to the pads before it.
        (("--rows-kind", "left_pad"), "left padding"),
        # GPT-BigCode's layers pass their attention no position_ids (DeepSpeed asserted).
        (("--arch", "gpt_bigcode"), "without position_ids"),
        # Multi-head latent attention: query heads of 16, value heads of 8 (DeepSpeed asserted).
        (("--arch", "deepseek_v2"), "one head size for all three"),
    ],
    ids=["left_pad", "gpt_bigcode", "deepseek_v2"],
)
def test_sequence_parallel_refuses_what_it_would_train_wrongly(tmp_path, extra, said):
    """Both ranks stop with the reason (none left waiting in a collective)."""
    pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")
    reports = _run(tmp_path, 2, *extra, "--steps", "1", check=False)
    for r in reports:
        assert "SequenceParallelError" in r["error"] and said in r["error"], r["error"]


# ---- what cannot run (no processes, no deepspeed) ------------------------------------------------


def test_check_heads_divisible():
    config = tiny_config("llama")  # 4 query heads, 2 key/value heads
    check_sequence_parallel(config, 2, world_size=2, local_world_size=2)
    check_sequence_parallel(config, 4, world_size=4, local_world_size=4)  # kv heads replicated
    with pytest.raises(SequenceParallelError, match="num_attention_heads=4"):
        check_sequence_parallel(config, 3, world_size=3, local_world_size=3)


@pytest.mark.skipif("gemma4_text" not in CONFIG_MAPPING, reason="transformers without Gemma 4")
def test_check_refuses_per_layer_attention_widths():
    """Gemma 4's full-attention layers have their own head width and kv heads: Ulysses reads one
    of each, so it is refused in words (the global attribute raised from inside the check)."""
    with pytest.raises(SequenceParallelError, match=r"sets \[.*'head_dim'.*\] per layer"):
        check_sequence_parallel(gemma4_config(), 2, world_size=2, local_world_size=2)


def test_check_launch():
    config = tiny_config("llama")
    with pytest.raises(SequenceParallelError, match="multiple of 2 processes"):
        check_sequence_parallel(config, 2, world_size=3, local_world_size=3)
    with pytest.raises(SequenceParallelError, match="per node"):
        check_sequence_parallel(config, 2, world_size=2, local_world_size=1)
    check_sequence_parallel(config, 2, world_size=4, local_world_size=4)  # 2 groups of 2


def test_check_attention():
    config = tiny_config("llama")
    config._attn_implementation = "eager"
    with pytest.raises(SequenceParallelError, match="attn_implementation"):
        check_sequence_parallel(config, 2, world_size=2, local_world_size=2)
    # Mistral's sliding window goes through SDPA's mask, which Ulysses drops.
    mistral = tiny_config("mistral")
    mistral._attn_implementation = "sdpa"
    with pytest.raises(SequenceParallelError, match="sliding-window"):
        check_sequence_parallel(mistral, 2, world_size=2, local_world_size=2)
    # Llama 4's chunks too.
    llama4 = tiny_config("llama4_text")
    llama4._attn_implementation = "sdpa"
    with pytest.raises(SequenceParallelError, match="chunked attention"):
        check_sequence_parallel(llama4, 2, world_size=2, local_world_size=2)
    qwen3 = tiny_config("qwen3")  # a sliding_window value, but no layer uses it
    qwen3._attn_implementation = "sdpa"
    check_sequence_parallel(qwen3, 2, world_size=2, local_world_size=2)


def test_option_validated():
    assert EngineOptions().sequence_parallel == 1
    with pytest.raises(OptionError, match="sequence_parallel=0"):
        EngineOptions(sequence_parallel=0)


def test_cli_plans_the_shard():
    """The CLI streams the model before the trainer: its plan's step is per rank too."""
    whole = loader_arguments(parse_train(["--seq_len", "64"]))["step"]
    shard = loader_arguments(parse_train(["--seq_len", "64", "--sequence-parallel", "2"]))["step"]
    assert whole.seq_len == 64
    assert (shard.seq_len, shard.micro_batch_tokens) == (32, whole.micro_batch_tokens // 2)
    assert shard.grad_accum == whole.grad_accum


def test_mfu_attention_over_the_whole_row():
    """MFU counts 6 FLOPs per active parameter and token plus causal attention over the row
    the token attends to (the trainer passes ``attention_row_len``: the global row under
    sequence parallelism, checked in test_sequence_parallel_equals_single_process)."""
    cfg = SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2)

    def mfu(row_len):  # 2000 tokens/s over 2 GPUs of 1e6 FLOP/s, 100 active parameters
        return model_flops_utilization(cfg, 100, 2000.0, 2, 1e-6, row_len)

    # Per token 6 x 100 params + attention: 6 x 2 heads x (4 + 4) head dims = 96 FLOPs per key
    # and layer, row / 2 keys per query (causal), 2 layers: 96 x row.
    assert mfu(32) == pytest.approx((600 + 96 * 32) * 2000 / 2e6)
    assert mfu(64) == pytest.approx((600 + 96 * 64) * 2000 / 2e6)


# ---- batches Ulysses cannot take as they are (no processes, no deepspeed) ------------------------


def test_rows_padded_to_a_multiple_of_the_group():
    """A row of 63 tokens cannot be split over 2 ranks (DeepSpeed's adapter raises): it is padded
    at the end, which changes nothing a real token computes (causal attention, no label)."""
    ids = torch.arange(2 * 63).reshape(2, 63)
    batch = {
        "input_ids": ids,
        "labels": ids.clone(),
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(63).expand(2, -1),
    }
    out = pad_to_shards(batch, 4, pad_token_id=7)
    assert {k: tuple(v.shape) for k, v in out.items()} == dict.fromkeys(batch, (2, 64))
    assert out["input_ids"][:, -1].tolist() == [7, 7]
    assert out["labels"][:, -1].tolist() == [-100, -100]
    assert out["attention_mask"][:, -1].tolist() == [0, 0]
    assert out["position_ids"][:, -1].tolist() == [63, 63]  # the positions go on
    for key in batch:
        assert torch.equal(out[key][:, :63], batch[key]), key
    assert pad_to_shards(out, 2) is out  # already a multiple


def test_batches_ulysses_would_train_wrongly_are_refused():
    ids = torch.ones(2, 8, dtype=torch.long)
    right = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    assert batch_problem({"input_ids": ids, "attention_mask": right}, "sdpa") is None
    # Left padding: the dropped mask would let real tokens attend to the pads.
    left = right.flip(-1)
    assert "left padding" in batch_problem({"input_ids": ids, "attention_mask": left}, "sdpa")
    # Packed documents without a mask: SDPA separates them only through the dropped mask.
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)
    assert "packs several documents" in batch_problem(
        {"input_ids": ids, "position_ids": packed}, "sdpa"
    )
    assert batch_problem({"input_ids": ids, "position_ids": packed}, "flash_attention_2") is None
    plain = torch.arange(8).expand(2, -1)
    assert batch_problem({"input_ids": ids, "position_ids": plain}, "sdpa") is None
    # Tensors that cannot be split along the sequence, named instead of failing in the adapter.
    assert "'input_ids'" in batch_problem({"input_ids": torch.ones(8)}, "sdpa")
    odd = {"input_ids": ids, "pixel_values": torch.ones(2, 3)}
    assert "'pixel_values' has shape (2, 3)" in batch_problem(odd, "sdpa")


def test_cli_resume_at_another_sequence_parallel_degree_is_refused(tmp_path):
    """The CLI records the ranks sharing each sequence with the processes: with the same
    WORLD_SIZE another --sequence-parallel changes the rows of a step (2 ranks: one group
    sharing each row, or two data-parallel ranks) and the data position a resume skips to."""
    argv = ["--seq_len", "64"]
    saved = run_record(parse_train([*argv, "--sequence-parallel", "2"]))
    assert saved["sequence_parallel"] == 2
    state = {"stateful_callbacks": {RECORD_NAME: {"args": saved, "attributes": {}}}}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CLIError, match=r"--sequence-parallel 2 \(this run: 1\)"):
        check_same_run(str(tmp_path), parse_train(argv), explicit=True)
    check_same_run(str(tmp_path), parse_train([*argv, "--sequence-parallel", "2"]), explicit=True)


def test_cli_resume_at_another_sequence_parallel_degree_keeping_its_steps(tmp_path, monkeypatch):
    """Processes and --sequence-parallel may change together where every step still trains the
    same rows (the check the trainer makes, hf/step_layout.py): 2 processes sharing each
    sequence resumed by 1 process, and the reverse. They were refused as another run."""

    def saved_at(world: int, sp: int) -> None:
        monkeypatch.setattr(cli_resume, "world_size", lambda: world)  # WORLD_SIZE, as launched
        record = run_record(parse_train(["--seq_len", "64", "--sequence-parallel", str(sp)]))
        state = {"stateful_callbacks": {RECORD_NAME: {"args": record, "attributes": {}}}}
        (tmp_path / "trainer_state.json").write_text(json.dumps(state))

    def resume_at(world: int, sp: int) -> None:
        monkeypatch.setattr(cli_resume, "world_size", lambda: world)
        settings = parse_train(["--seq_len", "64", "--sequence-parallel", str(sp)])
        check_same_run(str(tmp_path), settings, explicit=True)

    saved_at(2, 2)
    resume_at(1, 1)
    resume_at(2, 2)
    with pytest.raises(CLIError) as err:  # 2 data-parallel ranks: twice the rows a step
        resume_at(2, 1)
    msg = str(err.value)
    assert "WORLD_SIZE" not in msg and "2 (this run: 1); a step trained 8 rows there" in msg
    assert "(--sequence-parallel 1 on 1 process continues it too)" in msg
    saved_at(1, 1)
    resume_at(2, 2)
    with pytest.raises(CLIError, match=r"WORLD_SIZE \(processes\) 1 \(this run: 2\)"):
        resume_at(2, 1)  # data parallel alone: refused as before (another batch per step)


def test_resume_layouts_that_train_the_same_steps():
    """``layout_change``: None exactly where a resume at ``now`` trains as a run at ``now`` from
    the start (measured with tests/sp_worker.py: 32 or 30 rows, batch 2; see the module)."""

    def at(world, sp, accum=2, drop=None):
        return StepLayout(world, sp, 2, accum, sp > 1 if drop is None else drop)

    single, ulysses, dp = at(1, 1), at(2, 2), at(2, 1)
    assert layout_change(ulysses, single) is None and layout_change(single, ulysses) is None
    assert "4 rows there and would train 8 here" in layout_change(ulysses, dp)
    assert "8 rows there and would train 4 here" in layout_change(dp, ulysses)
    assert processes_keeping_steps(ulysses, dp) == 1
    # 2 groups of 2 take a step's rows as 2 data-parallel ranks do when the accumulation is a
    # multiple of 2 (measured: the same rows, resumes either way equal the uninterrupted runs);
    # with accumulation 1 each step takes one batch of each group's round (rows 0-1 and 4-5).
    assert layout_change(at(4, 2), dp) is None and layout_change(dp, at(4, 2)) is None
    assert "another order" in layout_change(at(4, 2, accum=1), at(2, 1, accum=1))
    # An epoch of 30 rows: sequence parallelism drops the last round (28 trained, 7 steps), one
    # process trains all 30 in 8 steps. Steps 1-7 are the same: a resume from them at a fixed
    # max_steps goes on as the new layout's run; past them, or an epoch-based run (its schedule
    # is laid out over the epochs' steps), would not.
    assert layout_change(ulysses, single, rows=30, step=2, max_steps=10) is None
    assert "trained 28 of them there and would train 30" in layout_change(
        ulysses, single, rows=30, step=8, max_steps=10
    )
    assert "other steps" in layout_change(ulysses, single, rows=30, step=2, max_steps=-1)
    assert layout_change(ulysses, single, rows=32, step=8, max_steps=-1) is None
    # Batch and accumulation may trade places while the step's rows stay.
    assert layout_change(StepLayout(1, 1, 4, 2), StepLayout(2, 1, 2, 2)) is None


def test_check_families_ulysses_cannot_split():
    """Ulysses wraps transformers' attention functions and drops their mask: a family whose
    layers mix tokens elsewhere, or whose position bias rides in the mask, would train each rank
    on its shard alone, silently. Qwen3-Next's linear-attention layers run on the shard;
    Falcon's ALiBi variant adds its bias through the mask (its RoPE one trains exactly)."""
    falcon = tiny_config("falcon")
    check_sequence_parallel(falcon, 2, 2, 2, model=tiny_model(falcon))
    falcon.alibi = True
    with pytest.raises(SequenceParallelError, match="ALiBi"):
        check_sequence_parallel(falcon, 2, 2, 2)
    with pytest.raises(SequenceParallelError, match="type linear_attention"):
        check_sequence_parallel(tiny_config("qwen3_next"), 2, 2, 2)
    # The router aux loss over each shard is another loss (observed: 5.650 instead of one
    # process's 5.250 on the tiny Mixtral); without it the family trains exactly.
    mixtral = tiny_model(tiny_config("mixtral"))
    with pytest.raises(SequenceParallelError, match="output_router_logits=True"):
        check_sequence_parallel(mixtral.config, 2, 2, 2, model=mixtral)
    mixtral.config.output_router_logits = False
    check_sequence_parallel(mixtral.config, 2, 2, 2, model=mixtral)
    llama = tiny_config("llama")
    check_sequence_parallel(llama, 2, 2, 2, model=tiny_model(llama))


def test_label_smoothing_refused():
    """The Trainer's label smoother shifts the labels again (they are already shifted for the
    shard boundary): observed 3% off one process's loss before the check."""
    check_sequence_parallel_arguments(SimpleNamespace(label_smoothing_factor=0.1), 1)
    check_sequence_parallel_arguments(SimpleNamespace(label_smoothing_factor=0.0), 2)
    with pytest.raises(SequenceParallelError, match="label_smoothing_factor=0.1"):
        check_sequence_parallel_arguments(SimpleNamespace(label_smoothing_factor=0.1), 2)
