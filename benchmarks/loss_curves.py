#!/usr/bin/env python3
"""Loss curves of streamed vs stock training from the same initial weights (issue 21).

Trains one config on the bundled corpus and tokenizer with:

* ``stock``: the plain ``transformers.Trainer`` (fp32 model on the device; bf16 = autocast);
* ``stock-accum`` and ``stock-accum4`` (``--band-accums``, default 2,4): the same with an
  equivalent batching (batch/k x gradient accumulation k): the same rows per optimizer step,
  only the rounding differs. Their distances to ``stock`` and to each other are stock's own
  band: how far runs that should agree drift apart in this precision;
* ``stock-seed`` (``--seed-run``): stock with another data order, for scale;
* ``stock-repeat`` (``--repeat-stock``): stock again, unchanged (GPU kernels' nondeterminism);
* ``stock-optim`` (``--optim-twin``): stock with torch's other AdamW implementation (fused vs
  foreach): the same update rounded otherwise, as streamed's host AdamW rounds otherwise;
* ``streamed``: ``HFMegaTrainer`` with every decoder layer streamed, same hyper-parameters.

Writes ``loss_curves.csv`` (long format: run, step, loss) and ``loss_curves.png`` (the curves,
and each run's relative difference to ``stock`` per step with the band shaded), and prints one
summary line per run: the max and tail numbers against ``stock`` and, for streamed runs,
``parity``'s lower-variance ones (mean |difference| over every step against every stock
rounding twin, band from every pair of twins).

    python3 benchmarks/loss_curves.py                        # 82M Llama, 150 steps, bf16 on a GPU
    python3 benchmarks/loss_curves.py --family gemma2 --size small --steps 150
    python3 benchmarks/loss_curves.py --family llama --tiny --steps 6 --seq-len 32 --fp32  # CPU

matplotlib is an optional dependency (``pip install matplotlib``); ``--no-plot`` skips the PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import dataclasses
import itertools
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_megatrain import HFMegaTrainer, MegaTrainArguments
from hf_megatrain.hf.arguments import as_arguments
from hf_megatrain.option_flags import options_from_mapping
from hf_megatrain.text import build_chunks, load_tokenizer, read_texts, split_chunks, use_bf16

REFERENCE = "stock"
BAND_RUN = "stock-accum"
REPEAT_RUN = "stock-repeat"
OPTIM_RUN = "stock-optim"
SEED_RUN = "stock-seed"
STREAMED = "streamed"
#: Stock runs that differ from ``stock`` only in rounding: every pair of them is a sample of
#: stock's own spread: ``stock``, the equivalent batchings (``stock-accum``: batch/2 x 2;
#: ``stock-accum<k>``: batch/k x k), ``stock-repeat`` and ``stock-optim`` (the other torch AdamW
#: kernel: at the parity test's seed 1 moving AdamW's fp32 arithmetic to the GPU moved a
#: streamed curve by 4.9e-4 mean |diff|, streamed being 6.6e-4 from stock). ``stock-seed`` is
#: not one: another
#: data order is another trajectory (8.8e-2 from stock vs a band of 6e-3 on the first H200
#: measurement), it would make the band vacuous.
STOCK_TWINS = (REFERENCE, BAND_RUN, REPEAT_RUN, OPTIM_RUN)
#: Equivalent batchings of the band by default: batch/2 x 2 and batch/4 x 4. Two, not one
#: batching plus ``stock-repeat``: where the GPU kernels are deterministic (Gemma-2's eager
#: attention on the H200) a repeat is bitwise ``stock`` and the band was one pair.
BAND_ACCUMS = (2, 4)


def band_run_name(accum: int) -> str:
    """The stock twin at ``accum`` micro-batches per step (``stock-accum`` for 2)."""
    return BAND_RUN if accum == 2 else f"{BAND_RUN}{accum}"


def is_stock_twin(name: str) -> bool:
    """Whether run ``name`` is a stock rounding twin (see ``STOCK_TWINS``)."""
    if name in STOCK_TWINS:
        return True
    suffix = name.removeprefix(BAND_RUN)
    return suffix != name and suffix.isdigit()


# Shapes per size. "base" is issue 21's 82M Llama (hidden 768, 12 layers, 12/4 heads, vocab
# 4096 = the bundled tokenizer); "small" (~25M dense) keeps 150 steps of three families inside a
# GPU test run; "tiny" runs a few steps on a CPU in seconds.
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "base": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4, head_dim=64),
}  # fmt: skip
FAMILIES = ("llama", "qwen3", "gemma2", "mixtral", "qwen3_moe")


def build_config(family: str, size: str = "base", seq_len: int = 1024) -> PretrainedConfig:
    """A fp32 config of ``family`` at ``size`` for the bundled 4096-token tokenizer.

    Each family keeps what makes it special: Gemma2 its soft-capped attention and logits and a
    sliding window shorter than the rows (both mask paths run); the MoE families top-2 routing
    over 4 experts with the router aux loss in the training loss (its gradient must reach the
    routers through streaming)."""
    shape = dict(SHAPES[size])
    ids = dict(vocab_size=4096, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    base = dict(**shape, **ids, max_position_embeddings=max(seq_len, 64), tie_word_embeddings=False)
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    # MoE: fewer, narrower experts, so that total params stay near the dense shape's.
    moe = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
    moe_layers = max(2, layers * 2 // 3)
    if family == "llama":
        return LlamaConfig(**base)
    if family == "qwen3":
        return Qwen3Config(**base)
    if family == "gemma2":
        head = shape["head_dim"]
        return Gemma2Config(
            **base,
            query_pre_attn_scalar=head,
            sliding_window=max(seq_len // 2, 4),
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
        )
    if family == "mixtral":
        return MixtralConfig(
            **{**base, "num_hidden_layers": moe_layers, "intermediate_size": hidden},
            **moe,
            num_local_experts=4,
        )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **{**base, "num_hidden_layers": moe_layers},
            **moe,
            num_experts=4,
            moe_intermediate_size=hidden,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")


def load_rows(seq_len: int) -> list[dict]:
    """Packed rows of the bundled corpus (every chunk, no eval split; the order is seeded by
    ``split_chunks``; the Trainer's sampler shuffles again per epoch)."""
    tok = load_tokenizer(None)
    chunks = build_chunks(tok, read_texts(None), seq_len)
    train, _ = split_chunks(chunks, 0.0, seed=0)
    return train


@dataclass(frozen=True)
class RunSpec:
    """One training run: its name, trainer and batching (rows per step = batch x accum)."""

    name: str
    streamed: bool
    batch: int
    accum: int = 1
    data_seed: int | None = None  # None: the run's seed
    #: Engine options of a streamed run beyond "every layer streamed" (bisecting a difference).
    options: tuple[tuple[str, object], ...] = ()
    #: The Trainer's ``optim`` (None: its default).
    optim: str | None = None


def other_adamw() -> str:
    """torch's AdamW kernel that the Trainer does not use by default (fused <-> foreach)."""
    default = TrainingArguments.__dataclass_fields__["optim"].default
    default = str(getattr(default, "value", default))  # an OptimizerNames or its string
    return "adamw_torch" if default == "adamw_torch_fused" else "adamw_torch_fused"


def parse_variant(text: str) -> RunSpec:
    """``NAME:field=value,field=value`` -> a streamed run with those engine options, e.g.
    ``no-fused-loss:fused_loss=false`` or ``hbm:resident_layers=4``."""
    name, _, spec = text.partition(":")
    options = []
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        low = value.lower()
        options.append((key, low == "true" if low in ("true", "false") else value))
    options_from_mapping(dict(options))  # unknown fields and bad values fail here, not mid-run
    return RunSpec(name, True, 0, options=tuple(options))


def default_runs(
    batch: int,
    seed_run: bool = False,
    seed: int = 0,
    repeat_stock: bool = False,
    band_accums: tuple[int, ...] = BAND_ACCUMS,
    optim_twin: bool = False,
) -> list[RunSpec]:
    """stock, its equivalent-batching twins (the band: batch/k x k for each k of
    ``band_accums``), optionally stock again and another data order, then streamed."""
    if not band_accums:
        raise ValueError("the band needs at least one equivalent batching (band_accums)")
    for k in band_accums:
        if k < 2 or batch % k:
            raise ValueError(
                f"--batch must be even and divisible by every band accumulation "
                f"(batch/{k} x {k}), got batch {batch}"
            )
    runs = [RunSpec(REFERENCE, False, batch)]
    runs += [RunSpec(band_run_name(k), False, batch // k, k) for k in dict.fromkeys(band_accums)]
    if seed_run:
        runs.append(RunSpec(SEED_RUN, False, batch, data_seed=seed + 1))
    if repeat_stock:  # the same run again: what GPU kernels' nondeterminism alone does
        runs.append(RunSpec(REPEAT_RUN, False, batch))
    if optim_twin:  # the same update from the other AdamW kernel: fp32 roundings only
        runs.append(RunSpec(OPTIM_RUN, False, batch, optim=other_adamw()))
    runs.append(RunSpec(STREAMED, True, batch))
    return runs


class _LossLog(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def make_trainer(
    spec: RunSpec,
    model: torch.nn.Module,
    rows: list[dict],
    *,
    steps: int,
    bf16: bool,
    cpu: bool,
    out_dir: Path,
    seed: int = 0,
    lr: float = 6e-4,
    max_grad_norm: float = 1.0,
    callbacks: list[TrainerCallback] | None = None,
) -> Trainer:
    """The Trainer of ``spec`` over a deep copy of ``model`` (``HFMegaTrainer`` for a streamed
    run: every layer streamed unless its options say otherwise), the curves' hyper-parameters."""
    cls, args_cls = (
        (HFMegaTrainer, MegaTrainArguments) if spec.streamed else (Trainer, TrainingArguments)
    )
    extra: dict = {}
    if spec.streamed:  # every layer streamed unless the run's options say otherwise
        options = options_from_mapping(
            {"resident_layers": "0", "attention": "model", **dict(spec.options)}
        )
        extra = as_arguments(options)
    args = args_cls(
        output_dir=str(out_dir / spec.name),
        per_device_train_batch_size=spec.batch,
        gradient_accumulation_steps=spec.accum,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=10,
        weight_decay=0.1,
        max_grad_norm=max_grad_norm,
        bf16=bf16,
        seed=seed,
        data_seed=spec.data_seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=cpu,
        dataloader_num_workers=0,
        **({"optim": spec.optim} if spec.optim else {}),
        **extra,
    )
    if args.n_gpu > 1:  # one device, as HFMegaTrainer: no DataParallel scaling the batch
        args._n_gpu = 1
    return cls(model=copy.deepcopy(model), args=args, train_dataset=rows, callbacks=callbacks or [])


def train_run(
    spec: RunSpec, model: torch.nn.Module, rows: list[dict], *, steps: int, **trainer_kw
) -> list[float]:
    """Train a deep copy of ``model`` under ``spec`` (``make_trainer``'s keywords); the
    per-step training losses."""
    log = _LossLog()
    trainer = make_trainer(spec, model, rows, steps=steps, callbacks=[log], **trainer_kw)
    trainer.train()
    if len(log.losses) != steps:
        raise RuntimeError(f"{spec.name}: logged {len(log.losses)} losses for {steps} steps")
    if spec.streamed:
        # Device updates round apart from the CPU's and depend on timing: say how many ran.
        taken = trainer.megatrain.engine.device_updates
        print(f"  device updates in {spec.name}: {taken} host-layer updates the GPU took over")
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return log.losses


def first_differing_step(run: list[float], ref: list[float]) -> int | None:
    """The first step (1-based) whose loss differs at all between two runs (None: bitwise
    equal over their common steps)."""
    return next((i + 1 for i, (x, y) in enumerate(zip(run, ref)) if x != y), None)


def rel_diff(run: list[float], ref: list[float]) -> list[float]:
    """Signed relative difference per step: run / ref - 1."""
    return [a / b - 1.0 for a, b in zip(run, ref)]


def default_tail(steps: int) -> int:
    """The tail the drift is measured over: the last 10% of steps, at least 1."""
    return max(1, math.ceil(steps * 0.1))


def mean_abs(run: list[float], ref: list[float]) -> float:
    """Mean over steps of |run / ref - 1|. The whole trajectory, not its extreme: two runs that
    differ in rounding diverge chaotically, and the max over steps of that divergence is one
    excursion (the same code gave Llama 1.69x and 0.99x the band on two H200 calls)."""
    d = rel_diff(run, ref)
    return sum(abs(x) for x in d) / len(d)


def tail_signed(run: list[float], ref: list[float], tail: int) -> float:
    """Mean of run / ref - 1 over the last ``tail`` steps: a one-sided drift shows there."""
    d = rel_diff(run[-tail:], ref[-tail:])
    return sum(d) / len(d)


def summarize(losses: dict[str, list[float]], tail: int | None = None) -> dict[str, dict]:
    """Per run against ``stock``: ``max_rel`` (max over steps of |run/stock - 1|) and
    ``tail_signed`` (mean signed relative difference over the last ``tail`` steps; default
    ``default_tail``): a one-sided drift shows there, noise averages out."""
    ref = losses[REFERENCE]
    n = tail if tail is not None else default_tail(len(ref))
    out = {}
    for name, curve in losses.items():
        d = rel_diff(curve, ref)
        out[name] = dict(max_rel=max(abs(x) for x in d), tail_signed=tail_signed(curve, ref, n))
    return out


def max_band(summary: dict[str, dict]) -> float:
    """The max-based band: the largest ``max_rel`` of the stock twins against stock (0 with
    none). The parity checks use ``stock_band``; this one shades the plot and labels the
    max-based ratios printed beside them."""
    return max(
        (s["max_rel"] for name, s in summary.items() if is_stock_twin(name) and name != REFERENCE),
        default=0.0,
    )


def stock_twins(losses: dict[str, list[float]]) -> list[str]:
    """The stock rounding twins present (``STOCK_TWINS``; never ``stock-seed``); at least two,
    else there is no band to measure."""
    twins = [name for name in losses if is_stock_twin(name)]
    if len(twins) < 2:
        raise ValueError(f"a stock band needs two of {', '.join(STOCK_TWINS)}; got {twins}")
    return twins


def stock_band(losses: dict[str, list[float]], tail: int) -> tuple[float, float]:
    """``(band_mean, band_tail)``: the max over every pair of stock twins of ``mean_abs`` over
    all steps, and over the last ``tail`` steps. Every pair, not one twin vs stock: each pair
    is one draw of a noisy spread, and the largest of several is far less often a fluke-small
    yardstick than one. The tail band is a mean |difference| too, not a pair's |signed| tail
    mean: two twins' curves often cross in the tail, and a signed mean near 0 by chance would
    be a degenerate band (simulated: a quarter of unchanged runs fail against it)."""
    pairs = list(itertools.combinations(stock_twins(losses), 2))
    band_mean = max(mean_abs(losses[b], losses[a]) for a, b in pairs)
    band_tail = max(mean_abs(losses[b][-tail:], losses[a][-tail:]) for a, b in pairs)
    return band_mean, band_tail


@dataclass(frozen=True)
class Parity:
    """One run against the stock twins (``parity``): the statistics and their bands."""

    run: str
    twins: tuple[str, ...]
    tail: int
    band_mean: float  # max over twin pairs of mean_abs
    dev_mean: float  # mean over twins of mean_abs(run, twin)
    band_tail: float  # max over twin pairs of mean_abs over the last ``tail`` steps
    drift: float  # mean over twins of tail_signed(run, twin, tail)

    @property
    def ratio(self) -> float:
        return _ratio(self.dev_mean, self.band_mean)

    @property
    def drift_ratio(self) -> float:
        return _ratio(abs(self.drift), self.band_tail)


def _ratio(value: float, band: float) -> float:
    """value / band; 0 where both are 0 (bit-equal runs), inf where only the band is."""
    return value / band if band > 0 else (0.0 if value == 0 else math.inf)


def parity(losses: dict[str, list[float]], run: str = STREAMED, tail: int | None = None) -> Parity:
    """``run`` against every stock rounding twin present, with ``stock_band``'s bands.

    ``dev_mean`` averages ``run``'s ``mean_abs`` against each twin, ``drift`` its signed tail
    mean against each: a run that is just another rounding twin then scatters less than one
    comparison would, while a systematic offset survives the average unchanged."""
    twins = stock_twins(losses)
    n = tail if tail is not None else default_tail(len(losses[REFERENCE]))
    band_mean, band_tail = stock_band(losses, n)
    curve = losses[run]
    return Parity(
        run=run,
        twins=tuple(twins),
        tail=n,
        band_mean=band_mean,
        dev_mean=sum(mean_abs(curve, losses[t]) for t in twins) / len(twins),
        band_tail=band_tail,
        drift=sum(tail_signed(curve, losses[t], n) for t in twins) / len(twins),
    )


def write_csv(losses: dict[str, list[float]], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "step", "loss"])
        for name, curve in losses.items():
            for step, loss in enumerate(curve, 1):
                w.writerow([name, step, repr(loss)])  # repr: every bit, the diffs are tiny


def plot(losses: dict[str, list[float]], path: Path, title: str) -> None:
    """Two panels: the loss curves; each run's relative difference to stock, band shaded."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "loss_curves.py: the PNG needs matplotlib: `pip install matplotlib` "
            "(or pass --no-plot for the CSV and summary only)"
        ) from None
    matplotlib.use("Agg")  # headless: the GPU machine and CI have no display
    import matplotlib.pyplot as plt

    ref = losses[REFERENCE]
    steps = range(1, len(ref) + 1)
    band = max_band(summarize(losses))
    color = {name: f"C{i}" for i, name in enumerate(losses)}  # one color per run, both panels
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True)
    for name, curve in losses.items():
        top.plot(steps, curve, label=name, lw=1.2, color=color[name])
    top.set_ylabel("training loss")
    top.set_title(title)
    top.legend()
    bottom.axhspan(-band, band, color="grey", alpha=0.25, label=f"stock band ±{band:.2e}")
    for name, curve in losses.items():
        if name != REFERENCE:
            bottom.plot(steps, rel_diff(curve, ref), label=name, lw=1.0, color=color[name])
    bottom.axhline(0.0, color="black", lw=0.5)
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel("loss / stock loss - 1")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_all(
    config: PretrainedConfig,
    runs: list[RunSpec],
    *,
    steps: int,
    seq_len: int,
    bf16: bool,
    cpu: bool,
    out_dir: Path,
    seed: int = 0,
    lr: float = 6e-4,
    sdpa: str | None = None,
) -> dict[str, list[float]]:
    """Every run of ``runs`` from the same initial weights; ``{name: per-step losses}``.
    ``sdpa`` pins PyTorch's attention kernel for every run (``SDPA_BACKENDS``)."""
    rows = load_rows(seq_len)
    torch.manual_seed(seed)
    # Soft-capped attention (Gemma-2) runs eager in every run: transformers 5.17 would give it
    # SDPA, which drops the cap. The streamed runs keep the model's attention (attention="model"
    # in train_run), so that the curves compare the engine, not two attention kernels.
    capped = getattr(config, "attn_logit_softcapping", None)
    impl = {"attn_implementation": "eager"} if capped else {}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **impl)
    with sdpa_backend(sdpa):
        return {
            spec.name: train_run(
                spec, model, rows, steps=steps, bf16=bf16, cpu=cpu, out_dir=out_dir, seed=seed,
                lr=lr,
            )
            for spec in runs
        }  # fmt: skip


SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")


def sdpa_backend(name: str | None) -> contextlib.AbstractContextManager:
    """PyTorch's attention kernel pinned to ``name`` (one of ``SDPA_BACKENDS``; None: its own
    choice). The setting is process-wide, so it holds on autograd's threads too."""
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]
    return sdpa_kernel([backend])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--family", default="llama", choices=FAMILIES)
    src.add_argument("--config", help="a config.json or model folder instead of --family")
    p.add_argument("--size", default="base", choices=list(SHAPES), help="--family's shape")
    p.add_argument("--tiny", action="store_true", help="same as --size tiny (CPU smoke runs)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="rows per optimizer step (even)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    prec = p.add_mutually_exclusive_group()
    prec.add_argument("--bf16", dest="precision", action="store_const", const="bf16")
    prec.add_argument("--fp32", dest="precision", action="store_const", const="fp32")
    p.set_defaults(precision="auto")  # bf16 on a bf16-capable GPU, else fp32
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--seed-run", action="store_true", help="also stock with another data order")
    p.add_argument("--repeat-stock", action="store_true", help="also stock again, unchanged")
    p.add_argument(
        "--optim-twin",
        action="store_true",
        help="also stock with torch's other AdamW kernel (fused vs foreach), a band twin",
    )
    p.add_argument(
        "--band-accums",
        default=",".join(map(str, BAND_ACCUMS)),
        help="the band's equivalent batchings: batch/k x k for each k (comma-separated)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:FIELD=VALUE,...",
        help="one more streamed run with these engine options (repeatable), e.g. "
        "no-fused-loss:fused_loss=false or hbm:resident_layers=4",
    )
    p.add_argument(
        "--sdpa-backend",
        choices=SDPA_BACKENDS,
        help="pin PyTorch's attention kernel for every run (math: deterministic on GPUs)",
    )
    p.add_argument("--no-plot", action="store_true", help="CSV and summary only")
    p.add_argument("--out", default="outputs/loss_curves", help="output folder")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """Run, write the CSV (and PNG), print the summary; returns ``summarize``'s dict."""
    a = parse_args(argv)
    cpu = a.device == "cpu" or (a.device == "auto" and not torch.cuda.is_available())
    if not cpu and not torch.cuda.is_available():
        raise SystemExit("loss_curves.py: --device cuda but no CUDA GPU is visible")
    bf16 = use_bf16(a.precision) if not cpu else a.precision == "bf16"
    if bf16 and cpu:
        raise SystemExit("loss_curves.py: bf16 needs a GPU (HFMegaTrainer refuses it on a CPU)")
    if not a.no_plot:
        try:
            import matplotlib  # noqa: F401  - fail before training, not after
        except ImportError:
            raise SystemExit(
                "loss_curves.py: the PNG needs matplotlib: `pip install matplotlib` "
                "(or pass --no-plot)"
            ) from None
    size = "tiny" if a.tiny else a.size
    config = (
        AutoConfig.from_pretrained(a.config)
        if a.config
        else build_config(a.family, size, a.seq_len)
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    accums = tuple(int(k) for k in a.band_accums.split(",") if k.strip())
    runs = default_runs(a.batch, a.seed_run, a.seed, a.repeat_stock, accums, a.optim_twin)
    runs += [dataclasses.replace(parse_variant(v), batch=a.batch) for v in a.variant]
    losses = run_all(
        config, runs, steps=a.steps, seq_len=a.seq_len, bf16=bf16, cpu=cpu, out_dir=out,
        seed=a.seed, lr=a.lr, sdpa=a.sdpa_backend,
    )  # fmt: skip
    write_csv(losses, out / "loss_curves.csv")
    label = a.config or f"{a.family}-{size}"
    precision = "bf16" if bf16 else "fp32"
    if not a.no_plot:
        plot(losses, out / "loss_curves.png", f"{label}, {precision}, {a.steps} steps")
    summary = summarize(losses)
    band = max_band(summary)
    print(f"{label} {precision} steps={a.steps} seq={a.seq_len} batch={a.batch}: band={band:.3e}")
    twins = stock_twins(losses)
    tail = default_tail(a.steps)
    band_mean, band_tail = stock_band(losses, tail)
    print(
        f"  stock twins {', '.join(twins)}: band_mean={band_mean:.3e} (max over pairs of mean "
        f"|diff|), band_tail={band_tail:.3e} (same, last {tail} steps)"
        + (f"; {SEED_RUN} not in the band (another data order)" if SEED_RUN in losses else "")
    )
    for name, s in summary.items():
        if name == REFERENCE:
            continue
        ratio = s["max_rel"] / band if band > 0 else float("inf")
        line = (
            f"  {name:12s} max_rel={s['max_rel']:.3e} ({ratio:.2f}x band) "
            f"tail_mean_signed={s['tail_signed']:+.3e}"
        )
        if not is_stock_twin(name) and name != SEED_RUN:  # streamed: against every twin
            p = parity(losses, name, tail)
            line += (
                f" | dev_mean={p.dev_mean:.3e} ({p.ratio:.2f}x band_mean) "
                f"drift={p.drift:+.3e} ({p.drift_ratio:.2f}x band_tail)"
            )
        print(line)
    print(
        f"wrote {out / 'loss_curves.csv'}" + ("" if a.no_plot else f", {out / 'loss_curves.png'}")
    )
    return summary


if __name__ == "__main__":
    main()
