#!/usr/bin/env python3
"""Side-by-side training throughput: hf_megatrain vs DeepSpeed ZeRO-3 offload vs stock Trainer.

Every run trains a random-init model built from a real config (same seed), on the same random
tokens (fixed seed), with bf16 compute, fp32 master weights and fp32 AdamW states, through the HF
``Trainer`` loop:

* ``megatrain``: ``HFMegaTrainer`` + ``MegaTrainArguments(bf16=True)``.
* ``deepspeed``: stock ``Trainer`` with a ZeRO-3 config offloading parameters and optimizer to
  pinned CPU memory (DeepSpeedCPUAdam), bf16, activation checkpointing.
* ``stock``: stock ``Trainer``, fp32 model on the GPU, bf16 autocast, gradient checkpointing,
  ``adamw_torch_fused``.

Each run is its own subprocess (``--worker``), one after another, so one run's memory cannot
affect the next and an OOM, a kill by the host's OOM killer or a timeout becomes a result row
instead of ending the sweep. Rows are appended to ``results/results.csv`` after every run (a sweep
cut short keeps what it measured) and a markdown summary of the sweep is rewritten each time.

Examples::

    python3 benchmarks/bench.py --system megatrain --model qwen2.5-1.5b --seq-len 4096 \\
        --tokens-per-step 16384 --steps 5 --warmup 2
    python3 benchmarks/bench.py --tag h200 --run qwen2.5-1.5b:16384:megatrain,deepspeed,stock \\
        --run qwen2.5-7b:8192:stock
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import functools
import gzip
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
CONFIG_DIR = BENCH_DIR / "configs"
RESULTS_DIR = BENCH_DIR / "results"

# Run from a plain checkout (``python3 benchmarks/bench.py``) without installing the package.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from hf_megatrain.core.engine.updates import host_update_rate  # noqa: E402
from hf_megatrain.core.options import EngineOptions, StepShape  # noqa: E402
from hf_megatrain.option_flags import (  # noqa: E402
    add_option_arguments,
    flag_text,
    options_from_namespace,
)

# megatrain: every decoder layer streamed from host RAM (resident_layers 0); megatrain-hbm:
# hf_megatrain's defaults, an HBM tier of as many layers' full state as fit (resident_layers
# "auto"), the rest streams. megatrain-hbm with no engine flag is what a user gets by default
# (with Liger-Kernel's layer kernels when liger-kernel is installed: layer_kernels "auto").
SYSTEMS = ("megatrain", "megatrain-hbm", "deepspeed", "stock")
# H200 (and H100 SXM) dense bf16 datasheet peak; the MFU denominator the issue fixes.
PEAK_BF16_FLOPS = 989e12
GIB = 2**30
LAUNCHED_AT = time.perf_counter()  # start-up time is measured from here

REQUIRED_COLUMNS = [
    "date",
    "commit",
    "gpu",
    "system",
    "model",
    "params_b",
    "seq_len",
    "tokens_per_step",
    "tokens_per_s",
    "model_tflops",
    "mfu",
    "peak_hbm_gib",
    "peak_host_gib",
    "status",
]
EXTRA_COLUMNS = [
    "params",
    "step_time_s",
    "steps",
    "warmup",
    "micro_batch",
    "grad_accum",
    "train_loss",
    "torch",
    "transformers",
    "accelerate",
    "deepspeed",
    "python",
    "cuda",
    "src_sha",
    "tag",
    "command",
    "hbm_layers",
    "plan_hbm_gib",
    "plan_host_gib",
    "startup_s",
    "mlp_tile_tokens",
    "offload_activations",
    "gpu_busy",
    "kept_layers",
    "layer_busy",
    "layer_gaps",
    "note",  # provenance remarks (e.g. a row restored from its sweep's markdown summary)
    # torch.cuda.max_memory_allocated beside peak_hbm_gib's max reserved: the live tensors' peak
    # (reserved less this: the allocator's cached, unused blocks at the peak). Empty off CUDA.
    "peak_hbm_alloc_gib",
    # The plan's expected GPU peak (plan_hbm_gib less its margin for measured errors,
    # MemoryPlan.gpu_peak_estimate): what peak_hbm_gib is set against; plan_hbm_gib is the bound.
    "plan_hbm_est_gib",
    # hf_megatrain: seconds per step (median of the timed steps) the training thread waited for
    # host optimizer updates (StreamingEngine.host_wait_s): > 0 where the CPU AdamW set the pace.
    "host_wait_s",
    # hf_megatrain: host-layer updates per step (median of the timed steps) the GPU took over
    # from a CPU AdamW that fell behind the forward (StreamingEngine.device_updates).
    "gpu_updates",
    # hf_megatrain: the CPU AdamW's rate in G parameters/s (median of the timed steps): what the
    # machine start's host gives, so that a slower step is told apart from a slower host.
    "host_update_gparams_s",
]
CSV_COLUMNS = REQUIRED_COLUMNS + EXTRA_COLUMNS


# ---- formulas --------------------------------------------------------------------------------
def model_tflops(params: int, tokens_per_s: float) -> float:
    """Model TFLOP/s as the issue defines it: 6 * params * tokens/s (no attention, no recompute);
    ``params``: those a token runs through (an MoE's routed experts count top-k of n)."""
    return 6 * params * tokens_per_s / 1e12


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float = PEAK_BF16_FLOPS) -> float:
    """Model FLOPs utilization: useful FLOPs per token (``hf_megatrain.hf.flops``: dense work on
    the active parameters plus causal attention within each layer's window) over the peak.
    Recompute is not counted: MFU counts useful work only."""
    return flops_per_token * tokens_per_s / peak_flops


def count_params(config: Any) -> int:
    """Parameter count of a llama/qwen2-style decoder from its config (tied embeddings once).

    Used for rows of runs that died before the model was built; runs that get that far report
    the built model's own count.
    """
    h = config.hidden_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    qwen2 = config.model_type == "qwen2"
    qkv_bias = qwen2 or bool(getattr(config, "attention_bias", False))
    o_bias = (not qwen2) and bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    inter = config.intermediate_size
    q, k = heads * head_dim, kv * head_dim
    attn = h * q + 2 * h * k + q * h + (q + 2 * k if qkv_bias else 0) + (h if o_bias else 0)
    mlp = 3 * h * inter + ((2 * inter + h) if mlp_bias else 0)
    layer = attn + mlp + 2 * h  # two RMSNorm weights
    embed = config.vocab_size * h
    head = 0 if config.tie_word_embeddings else config.vocab_size * h
    return config.num_hidden_layers * layer + embed + head + h  # + final norm


# ---- run configuration -----------------------------------------------------------------------
def default_engine(system: str) -> EngineOptions:
    """The engine options a run of ``system`` starts from: megatrain-hbm the defaults (its HBM
    tier holds as many layers as the plan fits: ``resident_layers`` "auto"); the others stream
    every layer."""
    return EngineOptions() if system == "megatrain-hbm" else EngineOptions(resident_layers="0")


@dataclass
class RunConfig:
    """One training run: a system on a model at a batch size, and hf_megatrain's engine options."""

    system: str
    model: str
    seq_len: int = 4096
    tokens_per_step: int = 16384
    micro_batch: int | None = None  # sequences per forward; None: the whole step in one
    steps: int = 5  # timed optimizer steps
    warmup: int = 2  # untimed optimizer steps first (allocator, autotuning, JIT, first-step setup)
    seed: int = 0
    device: str = "auto"
    timeout_s: float = 900.0
    learning_rate: float = 1e-5
    # megatrain only: random init written straight into the host store (init_streamed_model)
    # instead of a materialized fp32 model moved in. Needed where an fp32 copy of the model does
    # not fit next to the store (7B/8B on 128 GiB). Same init distribution, other draws: the
    # throughput does not depend on the values, the final loss is not comparable across systems.
    streamed_init: bool = False
    # Training without gradient clipping (max_grad_norm 0, every system); megatrain then updates
    # layers eagerly and its host store keeps no fp32 gradient slot (14 instead of 18 B/param).
    no_clip: bool = False
    # megatrain only: CUDA events around every layer pass of the timed steps; the row gets the
    # fraction of the step in layer compute and in gaps between layers (no CUPTI overhead).
    layer_timing: bool = False
    # megatrain and stock: Liger-Kernel's fused RMSNorm / RoPE / SwiGLU Triton kernels through
    # the Trainer's use_liger_kernel (losses unchanged: hf_megatrain's chunked one, stock's own).
    liger: bool = False
    # Record a CUDA kernel trace of the last warm-up step (steady state, outside the timed steps)
    # and report the fraction of it the GPU was busy.
    profile: bool = False
    # megatrain only: hf_megatrain's engine options (hf_megatrain.core.options.EngineOptions).
    # None: ``default_engine(system)``. Systems other than megatrain-hbm always run with
    # resident_layers "0" (every layer streamed).
    engine: EngineOptions | None = None

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"unknown system {self.system!r}; choose from {SYSTEMS}")
        if self.tokens_per_step % self.seq_len:
            raise ValueError(
                f"tokens_per_step {self.tokens_per_step} is not a multiple of seq_len "
                f"{self.seq_len}"
            )
        if self.sequences_per_step % self.resolved_micro_batch:
            raise ValueError(
                f"{self.sequences_per_step} sequences per step do not split into micro-batches "
                f"of {self.resolved_micro_batch}"
            )
        if self.steps < 1 or self.warmup < 0:
            raise ValueError("need steps >= 1 and warmup >= 0")
        if self.engine is None:
            self.engine = default_engine(self.system)
        elif self.system != "megatrain-hbm" and self.engine.resident_layers != "0":
            self.engine = self.engine.with_(resident_layers="0")

    @property
    def sequences_per_step(self) -> int:
        return self.tokens_per_step // self.seq_len

    @property
    def resolved_micro_batch(self) -> int:
        return self.micro_batch or self.sequences_per_step

    @property
    def grad_accum(self) -> int:
        return self.sequences_per_step // self.resolved_micro_batch

    def cli_args(self) -> list[str]:
        """Flags that reproduce exactly this run with bench.py."""
        args = [
            "--system", self.system,
            "--model", self.model,
            "--seq-len", str(self.seq_len),
            "--tokens-per-step", str(self.tokens_per_step),
            "--micro-batch", str(self.resolved_micro_batch),
            "--steps", str(self.steps),
            "--warmup", str(self.warmup),
            "--seed", str(self.seed),
            "--device", self.device,
            "--timeout-s", f"{self.timeout_s:g}",
            "--lr", f"{self.learning_rate:g}",
        ]  # fmt: skip
        if self.streamed_init:
            args.append("--streamed-init")
        if self.no_clip:
            args.append("--no-clip")
        args += self.engine_args()
        if self.layer_timing:
            args.append("--layer-timing")
        if self.liger:
            args.append("--liger")
        if self.profile:
            args.append("--profile")
        return args

    def engine_args(self) -> list[str]:
        """The engine option flags of this run: each option that differs from the system's
        starting point (``default_engine``), spelled as hf_megatrain's generated flag."""
        args = []
        for name, value in self.engine.changed(default_engine(self.system)).items():
            if value is not None:  # None is every option's "unset": nothing to spell
                args += flag_text(name, value).split(" ", 1)
        return args

    def command(self) -> str:
        return shlex.join(["python3", "benchmarks/bench.py", *self.cli_args()])

    def step_shape(self) -> StepShape:
        """The optimizer step's shape, as hf_megatrain's memory plan takes it."""
        return StepShape(
            seq_len=self.seq_len,
            micro_batch_tokens=self.resolved_micro_batch * self.seq_len,
            grad_accum=self.grad_accum,
        )

    def megatrain_engine(self) -> EngineOptions:
        """The engine options the megatrain run uses: the plan sizes activations for the run's
        sequences unless ``plan_seq_len`` was given."""
        if self.engine.plan_seq_len is None:
            return self.engine.with_(plan_seq_len=self.seq_len)
        return self.engine


def model_config_path(model: str) -> Path:
    """A name under benchmarks/configs/ or a folder / config.json path."""
    p = Path(model)
    if p.is_file():
        return p.parent
    if p.is_dir():
        return p
    named = CONFIG_DIR / model
    if (named / "config.json").is_file():
        return named
    known = sorted(d.name for d in CONFIG_DIR.iterdir() if (d / "config.json").is_file())
    raise ValueError(f"unknown model {model!r}; known: {', '.join(known)}")


def load_model_config(model: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_config_path(model)))


@functools.cache
def config_flops(model: str, seq_len: int) -> tuple[int, float]:
    """``(active params, model FLOPs per token)`` of a benchmark config at ``seq_len``, from a
    meta build (no weight allocated): what a row of it is measured against."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_megatrain.hf.flops import active_params, model_flops_per_token

    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(load_model_config(model))
    return active_params(built), model_flops_per_token(built, seq_len)


def gpus_of(system: str) -> int:
    """GPUs of a row's system: bench_dp's ``...-dpN`` (one node) or ``...-dpMxN`` (M nodes of
    N), whose tokens/s is the whole job's and MFU per GPU; one otherwise."""
    dp = re.search(r"-dp(?:(\d+)x)?(\d+)$", system)
    return int(dp.group(1) or 1) * int(dp.group(2)) if dp else 1


# ---- worker: one run in this process ---------------------------------------------------------
class RandomTokens:
    """``n`` rows of uniform random token ids; row ``i`` depends only on (seed, i)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        self.n, self.seq_len, self.vocab, self.seed = n, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def _make_step_timer(use_cuda: bool):
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step, the device drained at every step boundary.

        Step k's time runs from the end of step k-1 (or the start of training) to the end of
        step k, so it covers everything the loop does: data, forward/backward, clipping, the
        optimizer and any work a system defers into the next step.
        """

        def __init__(self) -> None:
            self.marks: list[float] = []
            # hf_megatrain: the engine, whose host-update waits are read at each step end.
            self.engine = None
            self.waits: list[float] = []

        def _now(self) -> float:
            if use_cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def _wait(self) -> float:
            return self.engine.host_wait_s if self.engine is not None else 0.0

        def _gpu_updates(self) -> int:
            return self.engine.device_updates if self.engine is not None else 0

        def _cpu_update(self) -> tuple[float, int]:
            return self.engine.host_update_seconds if self.engine is not None else (0.0, 0)

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks = [self._now()]
            self.waits = [self._wait()]
            self.gpu_updates = [self._gpu_updates()]
            self.cpu_updates = [self._cpu_update()]

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(self._now())
            self.waits.append(self._wait())
            self.gpu_updates.append(self._gpu_updates())
            self.cpu_updates.append(self._cpu_update())

        def durations(self) -> list[float]:
            return [b - a for a, b in zip(self.marks, self.marks[1:])]

        def host_waits(self) -> list[float]:
            """Per step: seconds the training thread waited for host optimizer updates."""
            return [b - a for a, b in zip(self.waits, self.waits[1:])]

        def host_update_rates(self) -> list[float | None]:
            """Per step: the CPU AdamW's rate in G parameters/s over the layer updates that
            finished in it (None where none did): the host's speed, apart from the code's."""
            return [host_update_rate(a, b) for a, b in zip(self.cpu_updates, self.cpu_updates[1:])]

        def step_gpu_updates(self) -> list[int]:
            """Per step: host-layer updates the GPU took over (of the update the step's
            forward overlapped)."""
            return [b - a for a, b in zip(self.gpu_updates, self.gpu_updates[1:])]

    return StepTimer()


def _make_layer_timer(first_timed_step: int):
    """Callback giving the engine a fresh ``LayerTimeline`` for each timed step (1-based steps
    from ``first_timed_step`` on) and keeping each step's summary."""
    import torch
    from transformers import TrainerCallback

    from hf_megatrain.core.layer_timing import LayerTimeline

    class LayerTimer(TrainerCallback):
        def __init__(self) -> None:
            self.engine = None  # set once the trainer has streamed the model
            self.steps: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if self.engine is not None and state.global_step + 1 >= first_timed_step:
                self.engine.timeline = LayerTimeline()

        def on_step_end(self, args, state, control, **kwargs):
            timeline = getattr(self.engine, "timeline", None)
            if timeline is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.steps.append(timeline.summary())
                self.engine.timeline = None

    return LayerTimer()


def _make_profiler(step: int, trace_path: Path):
    """Callback tracing CUDA kernels and copies of optimizer step ``step`` (1-based)."""
    import torch
    from transformers import TrainerCallback

    class StepProfiler(TrainerCallback):
        def __init__(self) -> None:
            self.prof = None
            self.path: Path | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == step:
                torch.cuda.synchronize()
                acts = [torch.profiler.ProfilerActivity.CUDA]
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self.prof is not None and state.global_step == step:
                torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                raw = trace_path.with_suffix("")  # .json
                self.prof.export_chrome_trace(str(raw))
                with open(raw, "rb") as src, gzip.open(trace_path, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                raw.unlink()
                self.path, self.prof = trace_path, None

    return StepProfiler()


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch sees no CUDA device")
    return name


def deepspeed_config() -> dict:
    """ZeRO-3 with parameters and optimizer states offloaded to pinned CPU memory.

    ``auto`` values are filled by the Trainer from its arguments (batch sizes, lr, clipping, bf16)
    and the model config (bucket sizes), as in HF's documented ZeRO-3 offload recipe. The
    optimizer entry makes DeepSpeed run its CPUAdam (AdamW mode) over fp32 master partitions.
    """
    return {
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": False,
        },
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _single_process_dist_env() -> None:
    """DeepSpeed needs a process group; give it a one-rank one without the launcher."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        os.environ.setdefault(key, value)


def build_model(config, seed: int):
    """Random-init fp32 model on the CPU: the same weights for every system given the seed."""
    import torch
    from transformers import AutoModelForCausalLM

    config.use_cache = False  # training: a KV cache is never wanted
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def training_arguments(cfg: RunConfig, output_dir: str, device: str) -> dict:
    """Arguments shared by all three systems: same loop, schedule, clipping and precision."""
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=cfg.resolved_micro_batch,
        gradient_accumulation_steps=cfg.grad_accum,
        max_steps=cfg.warmup + cfg.steps,
        learning_rate=cfg.learning_rate,
        weight_decay=0.1,
        lr_scheduler_type="constant",
        max_grad_norm=0.0 if cfg.no_clip else 1.0,  # clipping on unless --no-clip
        bf16=True,
        optim="adamw_torch_fused",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        # No periodic logging: its .item() would add host syncs; the mean loss comes at the end.
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=cfg.seed,
        use_cpu=device == "cpu",
    )


def make_trainer(cfg: RunConfig, model, dataset, callbacks, output_dir: str, device: str):
    from hf_megatrain.hf.long_context import liger_layer_kernel_arguments

    common = training_arguments(cfg, output_dir, device)
    if cfg.system.startswith("megatrain"):
        from hf_megatrain import HFMegaTrainer, MegaTrainArguments
        from hf_megatrain.hf.arguments import as_arguments

        # Streamed layers always recompute in backward: checkpointing is built in.
        common["gradient_checkpointing"] = False
        args = MegaTrainArguments(
            **common,
            **as_arguments(cfg.megatrain_engine()),
            **liger_layer_kernel_arguments(cfg.liger),
        )
        return HFMegaTrainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
    from transformers import Trainer, TrainingArguments

    if cfg.system == "deepspeed":
        args = TrainingArguments(**common, deepspeed=deepspeed_config())
    else:
        # --liger: the same layer kernels for stock, so the comparison stays like for like.
        args = TrainingArguments(**common, **liger_layer_kernel_arguments(cfg.liger))
    return Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)


def peak_host_gib() -> float | None:
    """Peak resident set of this process (VmHWM), pinned buffers included.

    DeepSpeed here runs its CPU optimizer in-process (no aio or dataloader workers), so the
    worker process is all there is; the JIT compiler's children are not training memory.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def peak_hbm_gib() -> float | None:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_reserved() / GIB


def peak_hbm_alloc_gib() -> float | None:
    """``torch.cuda.max_memory_allocated``: the peak of live tensors (``peak_hbm_gib`` is the
    allocator's reserved peak, which also holds cached blocks)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_allocated() / GIB


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "accelerate", "deepspeed"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = ""
    return out


def train_once(cfg: RunConfig) -> dict:
    """Build, train and measure one run in this process; raises on failure."""
    import torch

    device = resolve_device(cfg.device)
    result: dict[str, Any] = {"device": device}
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
        result["cuda"] = torch.version.cuda or ""
    if cfg.system == "deepspeed":
        _single_process_dist_env()
        import deepspeed  # noqa: F401  (fail early, as "skipped", when it is not installed)

    config = load_model_config(cfg.model)
    # Built before any TrainingArguments: with a DeepSpeed config registered, from_config would
    # go through zero.Init and initialize different (partitioned, on-GPU) random weights.
    if cfg.streamed_init and cfg.system.startswith("megatrain"):
        from hf_megatrain import init_streamed_model
        from hf_megatrain.hf.long_context import liger_layer_kernel_arguments

        config.use_cache = False
        model = init_streamed_model(
            config,
            # The store is built here, before the trainer: give it the run's options and layout.
            options=cfg.megatrain_engine(),
            device=device,
            bf16=True,
            seed=cfg.seed,
            step=cfg.step_shape(),
            clipping=not cfg.no_clip,
            # The plan made here must count Liger's kernels, which the trainer applies later.
            **liger_layer_kernel_arguments(cfg.liger),
        )
    else:
        model = build_model(config, cfg.seed)
    from hf_megatrain.hf.flops import active_params, model_flops_per_token

    result["params"] = sum(p.numel() for p in model.parameters())
    result["active_params"] = active_params(model)
    result["flops_per_token"] = model_flops_per_token(model, cfg.seq_len)
    n_rows = (cfg.warmup + cfg.steps) * cfg.sequences_per_step
    dataset = RandomTokens(n_rows, cfg.seq_len, config.vocab_size, cfg.seed)
    timer = _make_step_timer(device == "cuda")
    callbacks = [timer]
    profiler = None
    if cfg.profile and device == "cuda":
        if cfg.warmup < 2:
            raise ValueError("--profile traces the last warm-up step: use --warmup 2 or more")
        name = f"{dt.date.today()}-{cfg.system}-{cfg.model}-{cfg.tokens_per_step}.json.gz"
        profiler = _make_profiler(cfg.warmup, RESULTS_DIR / "traces" / name)
        (RESULTS_DIR / "traces").mkdir(parents=True, exist_ok=True)
        callbacks.append(profiler)
    layer_timer = None
    if cfg.layer_timing and cfg.system.startswith("megatrain"):
        layer_timer = _make_layer_timer(cfg.warmup + 1)
        callbacks.append(layer_timer)
    output_dir = tempfile.mkdtemp(prefix=f"bench-{cfg.system}-")
    try:
        trainer = make_trainer(cfg, model, dataset, callbacks, output_dir, device)
        if getattr(trainer, "megatrain", None) is not None:
            timer.engine = trainer.megatrain.engine
        if layer_timer is not None:
            layer_timer.engine = trainer.megatrain.engine
        del model  # the trainer holds it; nothing else should keep host copies alive
        result.update(_megatrain_plan(trainer, cfg.megatrain_engine()))
        out = trainer.train()
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    # Launch (this module's import) to the start of the first step: build, load, pin, plan.
    result["startup_s"] = timer.marks[0] - LAUNCHED_AT
    if profiler is not None and profiler.path is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from trace_overlap import analyze, load_events

        trace = analyze(load_events(str(profiler.path)))
        result["gpu_busy"] = trace["gpu_busy_fraction"]
        result["trace"] = str(profiler.path.relative_to(REPO_ROOT))
        print(f"bench worker: trace {result['trace']}: {json.dumps(trace, default=str)}")
    durations = timer.durations()
    if len(durations) != cfg.warmup + cfg.steps:
        raise RuntimeError(f"timed {len(durations)} steps, expected {cfg.warmup + cfg.steps}")
    timed = durations[cfg.warmup :]
    step_time = statistics.median(timed)
    if timer.engine is not None:
        result["host_waits"] = timer.host_waits()
        result["host_wait_s"] = statistics.median(result["host_waits"][cfg.warmup :])
        result["gpu_updates_per_step"] = timer.step_gpu_updates()
        result["gpu_updates"] = statistics.median(result["gpu_updates_per_step"][cfg.warmup :])
        result["host_update_rates"] = timer.host_update_rates()
        rates = [r for r in result["host_update_rates"][cfg.warmup :] if r is not None]
        if not rates:  # (tiny steps: each update finished outside the timed steps' marks)
            whole_run = host_update_rate((0.0, 0), timer.engine.host_update_seconds)
            rates = [whole_run] if whole_run is not None else []
        result["host_update_gparams_s"] = statistics.median(rates) if rates else None
    if layer_timer is not None and layer_timer.steps:
        # Per timed step: layer compute and inter-layer gaps as fractions of that step's time.
        pairs = list(zip(layer_timer.steps, timed))
        result["layer_busy"] = statistics.median(s["layer_ms"] / 1e3 / t for s, t in pairs)
        result["layer_gaps"] = statistics.median(s["gap_ms"] / 1e3 / t for s, t in pairs)
        print(f"bench worker: layer timeline per timed step: {json.dumps(layer_timer.steps)}")
    tps = cfg.tokens_per_step / step_time
    result.update(
        status="ok",
        step_times=durations,
        step_time_s=step_time,
        tokens_per_s=tps,
        train_loss=float(out.training_loss),
        model_tflops=model_tflops(result["active_params"], tps),
        mfu=mfu(result["flops_per_token"], tps),
    )
    return result


def _megatrain_plan(trainer, asked: EngineOptions) -> dict:
    """The placement the run used, the memory options auto_fit turned on beyond ``asked`` (as
    flags), and, for "auto", the planner's predicted peaks."""
    from hf_megatrain.hf.model import find_decoder_layers, layer_kernels_of

    state = getattr(trainer, "megatrain", None)
    if state is None:
        return {}
    layers = find_decoder_layers(trainer.model)[1]
    out = {
        "hbm_layers": sum(1 for s in state.store.layers if s.resident),
        "kept_layers": sum(1 for layer in layers if layer.forward.keep_graph),
        # What the defaults chose: attention outputs kept, the layer kernels (liger, compiled).
        "attention_layers": sum(1 for layer in layers if layer.forward.keep_attention),
        "layer_kernels": layer_kernels_of(trainer.model),
    }
    run = getattr(trainer, "megatrain_options", None)
    if run is not None:
        fitted = run.options.changed(asked)
        out["auto_fit"] = " ".join(flag_text(k, v) for k, v in sorted(fitted.items()))
    print(f"bench worker: megatrain placement {json.dumps(out)}", flush=True)
    if state.plan is not None:
        out["plan_hbm_gib"] = state.plan.gpu_total / GIB
        out["plan_hbm_est_gib"] = state.plan.gpu_peak_estimate / GIB
        out["plan_host_gib"] = state.plan.host_step_peak_estimate / GIB  # (saves nothing)
    return out


def failure_status(exc: BaseException) -> str:
    """The CSV status of a failed run: OOMs are results, named as such."""
    from hf_megatrain import InsufficientHostMemoryError, MemoryPlanError

    text = str(exc)
    if isinstance(exc, MemoryPlanError):
        # Refused by the memory plan before anything was allocated: not an out-of-memory.
        return f"refused ({exc.tier}): {text.removeprefix('hf_megatrain: ')}"[:200]
    if isinstance(exc, InsufficientHostMemoryError):
        m = re.search(r"needs ([\d.]+ [KMGT]iB).*?only ([\d.]+ [KMGT]iB)", text, re.S)
        if m:
            return f"oom-host (needs {m[1]}, has {m[2]})"
        return "oom-host"
    name = type(exc).__name__
    if name == "OutOfMemoryError" or re.search(r"CUDA (error: )?out of memory", text):
        return "oom-gpu"
    if isinstance(exc, MemoryError):
        return f"oom-host ({name})"
    if isinstance(exc, ImportError) and "deepspeed" in text:
        return "skipped: deepspeed not installed"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"error: {name}: {first}"[:200]


def failure_details(exc: BaseException) -> dict[str, Any]:
    """The exception of a failed run as data, for callers that classify failures themselves
    (benchmarks/validation_matrix.py: a refusal before allocation vs an out-of-memory crash):
    its class name, the class names of its bases (most derived first) and its message."""
    return {
        "error_type": type(exc).__name__,
        "error_bases": [c.__name__ for c in type(exc).__mro__[1:] if c is not object],
        "error": str(exc)[:4000],
    }


def run_worker(cfg: RunConfig, result_json: Path) -> int:
    """Run one benchmark and write its result (or its failure) as JSON for the parent."""
    result: dict[str, Any]
    trace_to = os.environ.get("BENCH_MEMORY_TRACE")  # a diagnostic (benchmarks/memory_trace.py)
    if trace_to:
        from benchmarks import memory_trace

        trace_to = trace_to if memory_trace.start() else None
    try:
        result = train_once(cfg)
        code = 0
    except BaseException as exc:  # noqa: BLE001  (any failure is a row, never a crash)
        traceback.print_exc()
        result = {"status": failure_status(exc), **failure_details(exc)}
        code = 1
    result.update(versions())
    result["peak_host_gib"] = peak_host_gib()
    try:
        result["peak_hbm_gib"] = peak_hbm_gib()
        result["peak_hbm_alloc_gib"] = peak_hbm_alloc_gib()
    except Exception:  # noqa: BLE001  (a broken CUDA context after a failure)
        result["peak_hbm_gib"] = result["peak_hbm_alloc_gib"] = None
    if trace_to:
        memory_trace.write_summary(trace_to)
    result_json.write_text(json.dumps(result))
    print(f"bench worker: {cfg.system} {cfg.model}: {result['status']}", flush=True)
    return code


# ---- parent: run workers one after another ---------------------------------------------------
def status_from_exit(rc: int, timed_out: bool, timeout_s: float, tail: list[str]) -> str:
    """Status of a worker that wrote no result."""
    if timed_out:
        return f"timeout ({timeout_s:g} s)"
    if rc == -signal.SIGKILL:
        # SIGKILL from outside: on these machines the kernel's OOM killer (host RAM exhausted).
        return f"killed (rc {rc})"
    if rc < 0:
        return f"killed (rc {rc}, {signal.Signals(-rc).name})"
    last = next((line.strip() for line in reversed(tail) if line.strip()), "")
    return f"failed (rc {rc}): {last}"[:200]


def _pump(stream, sinks: list, tail: deque, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        tail.append(line)
        for sink in sinks:
            sink.write(prefix + line)
            sink.flush()


def wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> tuple[int, bool]:
    """Wait for a run started in its own session; past ``timeout_s`` kill its whole group.

    Returns (exit code, whether it timed out)."""
    try:
        return proc.wait(timeout=timeout_s), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(), True


def kill_session(sid: int) -> int:
    """SIGKILL every process left in the worker's session; returns how many were signalled.

    ``killpg`` alone is not enough: ninja (DeepSpeed's JIT build) puts each compile job in a
    process group of its own, and those jobs would outlive a timed-out worker.
    """
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Fields after the command name: state, ppid, pgrp, session.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError, IndexError):
            continue
    return killed


def run_subprocess(cfg: RunConfig, log_file) -> dict:
    """Run ``cfg`` in a fresh worker process; always return a result dict with a status."""
    with tempfile.TemporaryDirectory(prefix="bench-result-") as tmp:
        result_json = Path(tmp) / "result.json"
        argv = [sys.executable, str(BENCH_DIR / "bench.py"), "--worker"]
        argv += ["--result-json", str(result_json), *cfg.cli_args()]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        log_file.write(f"\n===== {cfg.command()}\n")
        start = time.perf_counter()
        # Own session: a timeout kills the whole group (DeepSpeed's JIT build children too).
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
            env=env,
            cwd=str(REPO_ROOT),
        )
        tail: deque = deque(maxlen=40)
        prefix = f"[{cfg.system} {cfg.model} {cfg.tokens_per_step}] "
        pump = threading.Thread(
            target=_pump, args=(proc.stdout, [sys.stdout, log_file], tail, prefix), daemon=True
        )
        pump.start()
        rc, timed_out = wait_or_kill(proc, cfg.timeout_s)
        # Nothing of this run may hold memory or the GPU while the next one runs.
        leftovers = kill_session(proc.pid)
        if leftovers:
            log_file.write(f"bench: killed {leftovers} leftover processes of the run\n")
        pump.join(timeout=10)
        wall = time.perf_counter() - start
        if result_json.is_file():
            # A result written before a hang or crash at exit still stands: it was measured.
            result = json.loads(result_json.read_text())
        else:
            result = {"status": status_from_exit(rc, timed_out, cfg.timeout_s, list(tail))}
        result["returncode"] = rc
        result["wall_s"] = wall
        result["tail"] = list(tail)[-12:] if result["status"] != "ok" else []
        return result


def git_commit() -> str:
    """$BENCH_COMMIT when set (the GPU copy's .git, if any, is not the tree that runs), else the
    checkout's commit (with -dirty)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=10"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def source_sha() -> str:
    """Hash of the code under test, to tie a row to its source where git is not available."""
    h = hashlib.sha256()
    files = sorted((REPO_ROOT / "hf_megatrain").rglob("*.py")) + [BENCH_DIR / "bench.py"]
    for f in files:
        h.update(str(f.relative_to(REPO_ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def gpu_name_from_smi() -> str:
    """GPU name without touching CUDA in the parent (a context here would take HBM)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "none"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "none"


def _fmt(value: Any, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def make_row(cfg: RunConfig, result: dict, sweep: dict) -> dict:
    params = result.get("params") or count_params(load_model_config(cfg.model))
    return {
        "date": sweep["date"],
        "commit": sweep["commit"],
        "gpu": result.get("gpu") or ("cpu" if result.get("device") == "cpu" else sweep["gpu"]),
        "system": cfg.system,
        "model": cfg.model,
        "params_b": f"{params / 1e9:.4f}",
        "seq_len": cfg.seq_len,
        "tokens_per_step": cfg.tokens_per_step,
        "tokens_per_s": _fmt(result.get("tokens_per_s"), 1),
        "model_tflops": _fmt(result.get("model_tflops"), 2),
        "mfu": _fmt(result.get("mfu"), 4),
        "peak_hbm_gib": _fmt(result.get("peak_hbm_gib"), 2),
        "peak_host_gib": _fmt(result.get("peak_host_gib"), 2),
        "status": result["status"],
        "params": params,
        "step_time_s": _fmt(result.get("step_time_s"), 4),
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        "micro_batch": cfg.resolved_micro_batch,
        "grad_accum": cfg.grad_accum,
        "train_loss": _fmt(result.get("train_loss"), 4),
        "torch": result.get("torch") or sweep["versions"].get("torch", ""),
        "transformers": result.get("transformers") or sweep["versions"].get("transformers", ""),
        "accelerate": result.get("accelerate") or sweep["versions"].get("accelerate", ""),
        "deepspeed": result.get("deepspeed") or sweep["versions"].get("deepspeed", ""),
        "python": result.get("python") or sweep["versions"].get("python", ""),
        "cuda": result.get("cuda", ""),
        "src_sha": sweep["src_sha"],
        "tag": sweep["tag"],
        "command": cfg.command(),
        "hbm_layers": result.get("hbm_layers", ""),
        "plan_hbm_gib": _fmt(result.get("plan_hbm_gib"), 2),
        "plan_hbm_est_gib": _fmt(result.get("plan_hbm_est_gib"), 2),
        "plan_host_gib": _fmt(result.get("plan_host_gib"), 2),
        "startup_s": _fmt(result.get("startup_s"), 1),
        "mlp_tile_tokens": cfg.engine.mlp_tile_tokens or "",
        "offload_activations": int(cfg.engine.offload_activations),
        "gpu_busy": _fmt(result.get("gpu_busy"), 4),
        "kept_layers": result.get("kept_layers", ""),
        "layer_busy": _fmt(result.get("layer_busy"), 4),
        "layer_gaps": _fmt(result.get("layer_gaps"), 4),
        "peak_hbm_alloc_gib": _fmt(result.get("peak_hbm_alloc_gib"), 2),
        "host_wait_s": _fmt(result.get("host_wait_s"), 3),
        "gpu_updates": _fmt(result.get("gpu_updates"), 1),
        "host_update_gparams_s": _fmt(result.get("host_update_gparams_s"), 3),
        # The fused kernels chosen by layer_kernels "auto" (no --liger in the command to say so),
        # and the attention outputs the plan kept.
        "note": "; ".join(
            text
            for text, on in (
                (
                    "Liger-Kernel layer kernels (auto)",
                    result.get("layer_kernels") == "liger" and not cfg.liger,
                ),
                ("compiled layer kernels", result.get("layer_kernels") == "compiled"),
                (f"auto-fit: {result.get('auto_fit')}", result.get("auto_fit")),
                (
                    f"attention outputs kept: {result.get('attention_layers')} layers",
                    result.get("attention_layers"),
                ),
            )
            if on
        ),
    }


def append_csv(path: Path, rows: list[dict], extra_columns: list[str] | None = None) -> None:
    """Append rows; if the file's header lacks a column, rewrite it with the union (long format).

    ``extra_columns``: columns beyond ``CSV_COLUMNS`` the rows carry (a caller's own, e.g. the
    validation matrix's), kept after bench's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    wanted = CSV_COLUMNS + [c for c in extra_columns or [] if c not in CSV_COLUMNS]
    existing: list[dict] = []
    header: list[str] = []
    if path.is_file() and path.stat().st_size:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            if any(c not in header for c in wanted):
                existing = list(reader)
    if header and not existing and all(c in header for c in wanted):
        with path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=header, extrasaction="ignore").writerows(rows)
        return
    columns = wanted + [c for c in header if c not in wanted]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(existing + rows)


def _model_summary(model: str) -> str:
    c = load_model_config(model)
    return (
        f"| {model} | {c.model_type} | {c.num_hidden_layers} | {c.hidden_size} | "
        f"{c.intermediate_size} | {c.num_attention_heads} | {c.num_key_value_heads} | "
        f"{c.vocab_size} | {c.tie_word_embeddings} | {count_params(c) / 1e9:.3f} |"
    )


def host_summary() -> str:
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = next(line.split(":")[1].strip() for line in f if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} CPUs, MemTotal {mem}"


def write_markdown(path: Path, sweep: dict, runs: list[tuple[RunConfig, dict, dict]]) -> None:
    lines = [
        f"# Benchmark sweep `{sweep['tag']}`, {sweep['date']}",
        "",
        "Command:",
        "",
        "```",
        sweep["argv"],
        "```",
        "",
        f"- commit: `{sweep['commit']}` (source sha `{sweep['src_sha']}`)",
        f"- GPU: {sweep['gpu']}; host: {sweep['host']}",
        "- versions: "
        + ", ".join(f"{k} {v or 'not installed'}" for k, v in sweep["versions"].items()),
        "- precision: bf16 compute, fp32 master weights, fp32 AdamW states (all systems)",
        "- data: uniform random token ids, labels = inputs, same rows for every system",
        "- timing: wall time per optimizer step (CUDA synchronized at step ends), warm-up steps "
        "excluded, median of the timed steps; tokens/s = tokens per step / median step time",
        "- model TFLOP/s = 6 * active params * tokens/s (an MoE token's top-k experts); MFU = "
        "(6 * active params + causal attention within each layer's window) * tokens/s / "
        f"{PEAK_BF16_FLOPS / 1e12:g} TFLOP/s (hf_megatrain/hf/flops.py)",
        "- peak HBM = torch.cuda.max_memory_reserved; peak host = VmHWM of the run's process",
        "",
        "## Systems",
        "",
        "- megatrain: HFMegaTrainer, MegaTrainArguments(bf16=True), host AdamW",
        "- deepspeed: Trainer + ZeRO-3, params and optimizer offloaded to pinned CPU memory, "
        "DeepSpeedCPUAdam, gradient checkpointing; config:",
        "",
        "```json",
        json.dumps(deepspeed_config(), indent=1),
        "```",
        "",
        "- stock: Trainer, fp32 model on the GPU, bf16 autocast, gradient checkpointing "
        "(non-reentrant), adamw_torch_fused",
        "- all: lr 1e-5 constant, weight decay 0.1, max_grad_norm 1.0 (0 where the run's "
        "command has --no-clip), sdpa attention, "
        "no logging, no saving",
        "",
        "## Models (configs in benchmarks/configs/)",
        "",
        "| model | type | layers | hidden | intermediate | heads | kv heads | vocab | tied | "
        "params (B) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_model_summary(m) for m in dict.fromkeys(cfg.model for cfg, _, _ in runs)]
    lines += [
        "",
        "## Results",
        "",
        "| system | model | seq | tokens/step | micro-batch x accum | tokens/s | model TFLOP/s | "
        "MFU | peak HBM GiB | peak host GiB | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cfg, _, row in runs:
        lines.append(
            f"| {cfg.system} | {cfg.model} | {cfg.seq_len} | {cfg.tokens_per_step} | "
            f"{row['micro_batch']} x {row['grad_accum']} | {row['tokens_per_s']} | "
            f"{row['model_tflops']} | {row['mfu']} | {row['peak_hbm_gib']} | "
            f"{row['peak_host_gib']} | {row['status']} |"
        )
    lines += ["", "## Per-run details", ""]
    for cfg, result, _ in runs:
        lines.append(f"- `{cfg.command()}`: {result['status']}, wall {result['wall_s']:.1f} s")
        if result.get("step_times"):
            times = ", ".join(f"{t:.3f}" for t in result["step_times"])
            lines.append(f"  - step times (s, first {cfg.warmup} warm-up): {times}")
        if result.get("host_waits"):
            waits = ", ".join(f"{t:.3f}" for t in result["host_waits"])
            lines.append(f"  - waits for the host optimizer update (s, per step): {waits}")
        if any(r is not None for r in result.get("host_update_rates") or []):
            rates = ", ".join("-" if r is None else f"{r:.2f}" for r in result["host_update_rates"])
            lines.append(f"  - the CPU AdamW's rate (G parameters/s, per step): {rates}")
        if result.get("gpu_updates_per_step"):
            counts = ", ".join(str(n) for n in result["gpu_updates_per_step"])
            lines.append(f"  - host-layer updates the GPU took over (per step): {counts}")
        if result.get("tail"):
            lines.append("  - last output:")
            lines.append("")
            lines.append("    ```")
            lines += [f"    {line.rstrip()}" for line in result["tail"]]
            lines.append("    ```")
    path.write_text("\n".join(lines) + "\n")


def unique_path(directory: Path, stem: str, suffix: str) -> Path:
    path = directory / f"{stem}{suffix}"
    n = 2
    while path.exists():
        path = directory / f"{stem}-{n}{suffix}"
        n += 1
    return path


def sweep_info(tag: str, argv: str, now: dt.datetime | None = None) -> dict:
    """What every row of a sweep shares (``make_row``'s ``sweep``): date, commit, source hash,
    GPU, host, versions, tag and the sweep's command line."""
    now = now or dt.datetime.now(dt.timezone.utc)
    return {
        "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "src_sha": source_sha(),
        "gpu": gpu_name_from_smi(),
        "host": host_summary(),
        "versions": versions(),
        "tag": tag,
        "argv": argv,
    }


def run_sweep(
    cfgs: list[RunConfig],
    tag: str,
    results_dir: Path,
    mirror_dirs: list[Path],
    argv: str,
) -> list[dict]:
    """Run each config in its own worker, one after another; record every outcome."""
    now = dt.datetime.now(dt.timezone.utc)
    sweep = sweep_info(tag, argv, now)
    results_dir.mkdir(parents=True, exist_ok=True)
    csv_path = results_dir / "results.csv"
    md_path = unique_path(results_dir, f"{now:%Y-%m-%d}-{tag}", ".md")
    log_dir = results_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    log_path = unique_path(log_dir, f"{now:%Y-%m-%d}-{tag}", ".log")
    runs: list[tuple[RunConfig, dict, dict]] = []
    with log_path.open("w") as log_file:
        for cfg in cfgs:
            result = run_subprocess(cfg, log_file)
            row = make_row(cfg, result, sweep)
            runs.append((cfg, result, row))
            append_csv(csv_path, [row])
            write_markdown(md_path, sweep, runs)
            print(
                f"bench: {cfg.system} {cfg.model} {cfg.tokens_per_step} tok/step: "
                f"{row['status']}, {row['tokens_per_s'] or '-'} tok/s, "
                f"{row['model_tflops'] or '-'} TFLOP/s, HBM {row['peak_hbm_gib'] or '-'} GiB, "
                f"host {row['peak_host_gib'] or '-'} GiB",
                flush=True,
            )
            log_file.flush()
            # Copy after every run: a device call cut short still returns what was measured.
            for d in mirror_dirs:
                d.mkdir(parents=True, exist_ok=True)
                for f in (csv_path, md_path, log_path):
                    shutil.copy2(f, d / f.name)
    print(f"bench: wrote {csv_path}, {md_path}, {log_path}", flush=True)
    return [row for _, _, row in runs]


# ---- command line ----------------------------------------------------------------------------
def _csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_megatrain_options(p: argparse.ArgumentParser) -> None:
    """The run flags shared with bench_dp.py, and one flag per hf_megatrain engine option
    (generated from ``EngineOptions``; read back by ``megatrain_options``)."""
    p.add_argument(
        "--streamed-init",
        action="store_true",
        help="megatrain only: random init straight into the host store (for models whose fp32 "
        "copy does not fit next to the store)",
    )
    p.add_argument(
        "--no-clip",
        action="store_true",
        help="max_grad_norm 0 for every system; megatrain updates layers eagerly and keeps no "
        "host gradient slot",
    )
    p.add_argument(
        "--layer-timing",
        action="store_true",
        help="megatrain only: time every layer pass of the timed steps with CUDA events; the row "
        "gets layer_busy / layer_gaps (fractions of the step in layer compute / between layers)",
    )
    p.add_argument(
        "--liger",
        action="store_true",
        help="megatrain and stock: Liger-Kernel's fused RMSNorm / RoPE / SwiGLU "
        "(use_liger_kernel; needs liger-kernel installed). Without it megatrain runs them too "
        "where liger-kernel is installed (--layer-kernels auto; --layer-kernels torch: never)",
    )
    engine = p.add_argument_group(
        "hf_megatrain engine options (megatrain systems only)",
        "One flag per field of hf_megatrain.core.options.EngineOptions, as `hf-megatrain train`\n"
        "takes them. A flag not given keeps the option's default, except --resident-layers\n"
        "('auto' for megatrain-hbm; the other systems always stream every layer: 0) and\n"
        "--plan-seq-len (--seq-len).",
    )
    add_option_arguments(engine)


def megatrain_options(a: argparse.Namespace, system: str) -> dict[str, Any]:
    """The ``RunConfig`` fields that ``add_megatrain_options``' flags set, for a run of
    ``system`` (its engine options start from ``default_engine(system)``)."""
    return dict(
        streamed_init=a.streamed_init,
        no_clip=a.no_clip,
        layer_timing=a.layer_timing,
        liger=a.liger,
        engine=options_from_namespace(a, default_engine(system)),
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--system", help="one of " + ", ".join(SYSTEMS))
    p.add_argument("--systems", help="comma list, run one after another (separate processes)")
    p.add_argument("--model", help="config name under benchmarks/configs/ (comma list allowed)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--tokens-per-step", default="16384", help="tokens per optimizer step; list ok")
    p.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="MODEL:TOKENS_PER_STEP:SYSTEMS[:MICRO_BATCH]",
        help="one sweep entry, e.g. qwen2.5-1.5b:16384:megatrain,deepspeed,stock or "
        "qwen2.5-1.5b:65536:stock:4 (repeatable; replaces --model/--tokens-per-step/--system(s))",
    )
    p.add_argument("--micro-batch", type=int, default=None, help="default: whole step at once")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--timeout-s", type=float, default=900.0, help="wall-clock limit per run")
    p.add_argument("--lr", type=float, default=1e-5)
    add_megatrain_options(p)
    p.add_argument(
        "--profile",
        action="store_true",
        help="trace the last warm-up step's CUDA kernels (results/traces/) and record the GPU "
        "busy fraction",
    )
    p.add_argument("--tag", default="sweep", help="names the markdown summary")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--mirror-dir", type=Path, action="append", default=[], help="copy outputs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-json", type=Path, help=argparse.SUPPRESS)
    return p


def configs_from_args(a: argparse.Namespace) -> list[RunConfig]:
    common = dict(
        seq_len=a.seq_len,
        steps=a.steps,
        warmup=a.warmup,
        seed=a.seed,
        device=a.device,
        timeout_s=a.timeout_s,
        learning_rate=a.lr,
        profile=a.profile,
    )
    entries: list[tuple[str, int, list[str], int | None]] = []
    for spec in a.run:
        try:
            model, tps, systems, *mb = spec.split(":")
            if len(mb) > 1:
                raise ValueError(spec)
            micro = int(mb[0]) if mb else a.micro_batch
            entries.append((model, int(tps), _csv_list(systems), micro))
        except ValueError as exc:
            raise SystemExit(
                f"bad --run {spec!r}: want MODEL:TOKENS_PER_STEP:SYSTEMS[:MICRO_BATCH]"
            ) from exc
    if not a.run:
        if not a.model or not (a.system or a.systems):
            raise SystemExit("give --model and --system/--systems, or --run entries")
        systems = _csv_list(a.systems or a.system)
        for model in _csv_list(a.model):
            for tps in _csv_list(a.tokens_per_step):
                entries.append((model, int(tps), systems, a.micro_batch))
    cfgs = []
    for model, tps, systems, micro in entries:
        model_config_path(model)  # fail before the sweep starts, not in the middle
        for system in systems:
            cfgs.append(
                RunConfig(
                    system=system,
                    model=model,
                    tokens_per_step=tps,
                    micro_batch=micro,
                    **common,
                    **megatrain_options(a, system),
                )
            )
    return cfgs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    cfgs = configs_from_args(a)
    if a.worker:
        if len(cfgs) != 1 or a.result_json is None:
            raise SystemExit("--worker runs exactly one config and needs --result-json")
        code = run_worker(cfgs[0], a.result_json)
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: process-group and CUDA teardown can hang after the result
        # is safely written, and the parent would then record a timeout.
        os._exit(code)
    command = shlex.join(["python3", "benchmarks/bench.py", *argv])
    rows = run_sweep(cfgs, a.tag, a.results_dir, a.mirror_dir, command)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
