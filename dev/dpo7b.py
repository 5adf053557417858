"""DPO of the Qwen2.5-7B config on the GPU machine, the reference streaming frozen (issue 22).

Builds the policy from ``benchmarks/configs/qwen2.5-7b`` (random init straight into the host
store, bf16 compute, fp32 masters and AdamW moments, ``resident_layers="auto"`` with a 64 GiB
activation reserve), lets ``MegaDPOTrainer`` build the reference as a frozen streamed copy of the
initial weights (weights-only bf16 host store, 2 bytes/param), and trains on synthetic preference
pairs of random token ids (prompt 512 + chosen / rejected completions of 1536 tokens each). Prints
each step's loss and rewards, then appends one row in ``benchmarks/bench.py``'s CSV schema to
``--out``. Model FLOPs per token: policy forward + backward 6N plus the reference's forward 2N
(N: the policy's parameters); MFU adds causal attention, 6 L h s (policy) + 2 L h s (reference),
over the H200's 989 TFLOP/s bf16 peak, as ``bench.mfu`` does for training.

    BENCH_COMMIT=$(git rev-parse --short HEAD) python3 dev/dpo7b.py --out /tmp/dpo7b.csv

On a CPU (fp32, no HBM tier) with a tiny config, to check the script itself:

    python3 dev/dpo7b.py --config benchmarks/configs/tiny-qwen2 --prompt-len 8 \\
        --completion-len 24 --steps 2 --out /tmp/dpo_tiny.csv
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from hf_megatrain.option_flags import add_option_arguments  # noqa: E402

#: bench.py's bf16 peak (H200 / H100 SXM datasheet), the MFU denominator.
PEAK_BF16_FLOPS = 989e12


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="CSV file the result row is appended to")
    p.add_argument(
        "--config",
        default=str(REPO_ROOT / "benchmarks/configs/qwen2.5-7b"),
        help="model config folder (default: Qwen2.5-7B)",
    )
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (the first is warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="leading steps left out of the timing")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--completion-len", type=int, default=1536)
    p.add_argument("--pairs", type=int, default=2, help="preference pairs per micro-batch")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--beta", type=float, default=0.1)
    # The engine's own flags (generated: defaults and help from EngineOptions).
    add_option_arguments(p.add_argument_group("engine options"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="dpo7b")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    return args


def say(message: str) -> None:
    print(f"[dpo7b {time.strftime('%H:%M:%S')}] {message}", flush=True)


def preference_rows(n: int, prompt_len: int, completion_len: int, vocab: int, seed: int):
    """``n`` pre-tokenized pairs of uniform random token ids (what DPOTrainer's tokenizing step
    would produce): prompt_ids, chosen_ids, rejected_ids."""
    import datasets
    import torch

    g = torch.Generator().manual_seed(seed)

    def ids(length: int) -> list[int]:
        return torch.randint(0, vocab, (length,), generator=g).tolist()

    rows = [
        {
            "prompt_ids": ids(prompt_len),
            "chosen_ids": ids(completion_len),
            "rejected_ids": ids(completion_len),
        }
        for _ in range(n)
    ]
    return datasets.Dataset.from_list(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks import bench

    launched = time.perf_counter()
    cuda = torch.cuda.is_available()
    seq = args.prompt_len + args.completion_len
    row = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": bench.git_commit(),
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "system": "megatrain-dpo",
        "model": Path(args.config).name,
        "seq_len": seq,
        "tokens_per_step": args.pairs * 2 * seq * args.grad_accum,  # chosen and rejected rows
        "steps": args.steps - args.warmup,
        "warmup": args.warmup,
        "micro_batch": 2 * args.pairs,
        "grad_accum": args.grad_accum,
        **{k: v for k, v in bench.versions().items() if k != "deepspeed"},
        "cuda": (torch.version.cuda or "") if cuda else "",
        "src_sha": bench.source_sha(),
        "tag": args.tag,
        "command": "python3 " + shlex.join([os.path.relpath(__file__, REPO_ROOT), *sys.argv[1:]]),
    }
    try:
        row.update(run(args, launched, row["tokens_per_step"]))
        code = 0
    except BaseException as exc:  # a failure (an OOM) is a row too, as in bench.py
        row["status"] = bench.failure_status(exc)
        say(f"failed: {row['status']}")
        code = 1
        if not isinstance(exc, Exception):
            raise
        import traceback

        traceback.print_exc()
    row["peak_host_gib"] = f"{bench.peak_host_gib():.2f}"
    if cuda:
        row["peak_hbm_gib"] = f"{torch.cuda.max_memory_reserved() / 2**30:.2f}"
    bench.append_csv(Path(args.out), [row])
    say(
        f"row appended to {args.out}: {json.dumps({k: row.get(k) for k in bench.REQUIRED_COLUMNS})}"
    )
    return code


def run(args: argparse.Namespace, launched: float, tokens_per_step: int) -> dict:
    """Build policy and trainer, train, and return the row's measured columns."""
    import torch
    from transformers import AutoConfig, TrainerCallback

    from hf_megatrain import init_streamed_model
    from hf_megatrain.core.options import EngineOptions
    from hf_megatrain.hf.arguments import as_arguments
    from hf_megatrain.hf.model import streamed_state
    from hf_megatrain.integrations.trl import MegaDPOConfig, MegaDPOTrainer
    from hf_megatrain.option_flags import options_from_namespace
    from hf_megatrain.text import load_tokenizer

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = "bf16" if cuda else "fp32"
    config = AutoConfig.from_pretrained(args.config)
    config.use_cache = False
    say(f"{Path(args.config).name} on {device} ({dtype} compute)")

    # No step shape: the plan keeps hbm_reserve_gb free instead of sizing the activations, for
    # what it does not model here: TRL's fused log-prob head (policy and reference) and the
    # reference's resident embeddings and LM head (an fp32 copy, 4.4 GB at 7B). This workload
    # keeps 64 GiB (the options' 48 is for one model), unless --hbm-reserve-gb says otherwise.
    options = options_from_namespace(args, base=EngineOptions(hbm_reserve_gb=64.0))
    say(f"policy: random init into the host store (resident_layers={options.resident_layers})")
    policy = init_streamed_model(config, options, device=device, bf16=cuda, seed=args.seed)
    n_params = sum(p.numel() for p in policy.parameters())
    hbm_layers = sum(1 for s in streamed_state(policy).store.layers if s.resident)
    say(f"policy: {n_params / 1e9:.3f} B parameters, {hbm_layers} layers in HBM")

    seq = args.prompt_len + args.completion_len
    n_rows = args.steps * args.pairs * args.grad_accum
    dataset = preference_rows(
        n_rows, args.prompt_len, args.completion_len, config.vocab_size, args.seed
    )

    class PreTokenizedDPO(MegaDPOTrainer):
        def _prepare_dataset(self, dataset, *a, **kw):
            return dataset  # the rows hold prompt_ids / chosen_ids / rejected_ids already

    marks: list[float] = []
    step_logs: list[dict] = []

    class Progress(TrainerCallback):
        def _now(self) -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, *a, **kw):
            marks.append(self._now())

        def on_step_end(self, *a, **kw):
            marks.append(self._now())

        def on_log(self, _args, state, _control, logs=None, **kw):
            entry = logs or {}
            if "loss" not in entry:
                return
            step_logs.append(dict(entry))
            keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins",
                    "logps/chosen", "logps/rejected", "grad_norm", "tokens_per_s",
                    "hbm_peak_gib", "host_peak_gib")  # fmt: skip
            step_s = marks[-1] - marks[-2]
            shown = {k: entry[k] for k in keys if k in entry}
            say(f"step {state.global_step}/{args.steps} ({step_s:.2f} s): {json.dumps(shown)}")

    dpo_args = MegaDPOConfig(
        output_dir=tempfile.mkdtemp(prefix="dpo7b-"),
        bf16=cuda,
        use_cpu=not cuda,
        per_device_train_batch_size=args.pairs,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        beta=args.beta,
        max_length=seq,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=args.seed,
        **as_arguments(options),
    )
    say(f"trainer: streaming the frozen reference (an {dtype} weights-only copy of the policy)")
    trainer = PreTokenizedDPO(
        model=policy,
        args=dpo_args,
        train_dataset=dataset,
        processing_class=load_tokenizer(None),  # pad id only: the rows hold token ids
        callbacks=[Progress()],
    )
    del policy
    ref_gib = trainer.megatrain_ref.store.nbytes / 2**30
    say(f"reference: {ref_gib:.2f} GiB host store (weights only), frozen")
    startup = time.perf_counter() - launched
    say(f"start-up {startup:.1f} s; training {args.steps} steps of {tokens_per_step} tokens")
    result = trainer.train()

    durations = [b - a for a, b in zip(marks, marks[1:])]
    step_time = statistics.median(durations[args.warmup :])
    tps = tokens_per_step / step_time
    # Model FLOPs: policy forward + backward (6N) and the reference's forward (2N) per token;
    # MFU adds causal attention: 6 L h s for the policy, 2 L h s for the reference.
    layers_h_s = config.num_hidden_layers * config.hidden_size * seq
    mfu = (8 * n_params + 8 * layers_h_s) * tps / PEAK_BF16_FLOPS
    try:
        trl_version = metadata.version("trl")
    except metadata.PackageNotFoundError:
        trl_version = "?"
    last = step_logs[-1] if step_logs else {}
    say(f"step times (s): {[round(d, 3) for d in durations]}; median of the timed: {step_time:.3f}")
    return {
        "params_b": f"{n_params / 1e9:.4f}",
        "tokens_per_s": f"{tps:.1f}",
        "model_tflops": f"{8 * n_params * tps / 1e12:.2f}",
        "mfu": f"{mfu:.4f}" if cuda else "",
        "status": "ok",
        "params": n_params,
        "step_time_s": f"{step_time:.4f}",
        "train_loss": f"{result.training_loss:.4f}",
        "hbm_layers": hbm_layers,
        "startup_s": f"{startup:.1f}",
        "note": (
            f"DPO beta={args.beta}, frozen streamed reference ({ref_gib:.2f} GiB {dtype} "
            f"weights-only store); prompt {args.prompt_len} + completion {args.completion_len}, "
            f"{args.pairs} pairs x {args.grad_accum} micro-batches; model FLOPs 8N/token (policy "
            f"6N + reference 2N); trl {trl_version}; final loss {last.get('loss')}, "
            f"rewards/margins {last.get('rewards/margins')}"
        ),
    }


if __name__ == "__main__":
    sys.exit(main())
