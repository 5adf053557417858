#!/usr/bin/env python3
"""One step's gradients: streamed and stock's own rounding twins against an fp32 reference.

The 150-step bf16 curves (``benchmarks/loss_curves.py``) cannot tell a rounding bias from chaos:
at the parity test's seed 1 the streamed curve leaves stock's band in a loss rise, and moving
AdamW to the GPU or the loss off the fused path each bring it back. This probe measures the
gradient of one step instead, where nothing is amplified: from the same weights and batch, each
run's gradient against the fp32 gradient (no autocast) of those weights and that batch.

Weights: stock's own run (the curves' hyper-parameters, ``--steps`` long) stopped at each of
``--at-steps``. Batches: ``--batches`` fixed batches of ``--batch`` rows of the bundled corpus.
Runs (each a real Trainer step, its gradient read before the optimizer step, clipping on but
never binding):

* ``fp32``: stock without autocast (the reference);
* ``stock``: stock under bf16 autocast; ``stock-accum<k>`` (``--band-accums``): the same batch as
  k micro-batches, i.e. stock's own rounding twins;
* ``streamed``: ``HFMegaTrainer`` with every layer streamed (the defaults), and ``--variant``
  runs (``NAME:field=value,...`` engine options, as ``loss_curves.py``).

Per run and parameter group (embeddings, attention, MLP, norms, LM head, all), averaged over
the batches: ``err`` = |g - g_fp32| / |g_fp32| (how far its bf16 arithmetic moves the gradient),
``dist`` = |g - g_stock| / |g_stock|, ``cos`` = the cosine between g - g_fp32 and g_stock - g_fp32
(1: it rounds where stock does). A run whose ``err`` and ``dist`` sit within the twins' is no
further from stock, step by step, than stock is from itself; a larger ``err`` in one group
names where it rounds differently.

    python3 dev/grad_band_probe.py --family llama --size small --seq-len 512 --seed 1 \\
        --at-steps 0,64 --batches 4 --sdpa-backend math --variant nofl:fused_loss=false
    python3 dev/grad_band_probe.py --family llama --tiny --seq-len 32 --batch 4 --fp32 --batches 1
    python3 dev/grad_band_probe.py --direct --size small --seq-len 256 --batch 4 --seed 1 \\
        --batches 2 --variant nofl:fused_loss=false   # CPU bf16 (autocast), no Trainer
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.loss_curves import (  # noqa: E402
    FAMILIES,
    SDPA_BACKENDS,
    SHAPES,
    RunSpec,
    band_run_name,
    build_config,
    load_rows,
    make_trainer,
    parse_variant,
    sdpa_backend,
)
from hf_megatrain.hf.model import streamed_gradients  # noqa: E402
from hf_megatrain.option_flags import options_from_mapping  # noqa: E402
from tests.helpers import one_step_gradients  # noqa: E402

REFERENCE = "fp32"
GROUPS = ("embed", "attn", "mlp", "norm", "head")


def group_of(name: str) -> str:
    """The parameter group of a parameter name (``GROUPS``)."""
    if "embed" in name or name.endswith("wte.weight"):
        return "embed"
    if "lm_head" in name:
        return "head"
    if "norm" in name or "ln_" in name:
        return "norm"
    if "attn" in name or "attention" in name:
        return "attn"
    return "mlp"


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


class _Grads(TrainerCallback):
    """The step's gradients, read before the optimizer step (fp32, on the host)."""

    def __init__(self, streamed: bool) -> None:
        self.streamed = streamed
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.streamed:
            self.grads = streamed_gradients(model)
        else:
            self.grads = {
                n: p.grad.detach().float().cpu().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }


def weights_at(model, rows, step: int, *, steps: int, bf16: bool, cpu: bool, out: Path, seed: int):
    """Stock's own run (``steps`` long: its schedule) stopped after ``step`` optimizer steps."""
    if step == 0:
        return model
    spec = RunSpec("stock-weights", False, 8)
    trainer = make_trainer(
        spec, model, rows, steps=steps, bf16=bf16, cpu=cpu, out_dir=out, seed=seed,
        callbacks=[_StopAt(step)],
    )  # fmt: skip
    trainer.train()
    return trainer.model


def step_gradients(spec: RunSpec, model, batch_rows, *, bf16: bool, cpu: bool, out: Path, seed):
    """One optimizer step of ``spec`` over exactly ``batch_rows``: its gradient before the
    update (clipping on with a bound no gradient reaches, so none is scaled)."""
    grads = _Grads(spec.streamed)
    trainer = make_trainer(
        spec, model, batch_rows, steps=1, bf16=bf16, cpu=cpu, out_dir=out, seed=seed,
        max_grad_norm=1e9, callbacks=[grads],
    )  # fmt: skip
    trainer.train()
    if not grads.grads:
        raise RuntimeError(f"{spec.name}: no gradient was read")
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return grads.grads


def direct_gradients(spec: RunSpec, model, batch_rows, *, bf16: bool) -> dict[str, torch.Tensor]:
    """``step_gradients`` without a Trainer, on the CPU (``--direct``; HFMegaTrainer refuses bf16
    there): ``tests/helpers.py::one_step_gradients`` of the batch, stock (the accumulation twins
    in ``spec.accum`` slices) or streamed with ``spec``'s options (every layer streamed)."""
    ids = torch.stack([r["input_ids"] for r in batch_rows])
    labels = torch.stack([r["labels"] for r in batch_rows])
    if spec.streamed:
        fields = {"resident_layers": "0", "attention": "model", **dict(spec.options)}
        options_from_mapping(fields)  # unknown fields and bad values fail here
        return one_step_gradients(model, ids, labels, bf16=bf16, streamed=fields)[1]
    return one_step_gradients(model, ids, labels, bf16=bf16, accum=spec.accum)[1]


def _norm(tensors) -> float:
    return float(sum(float(t.double().square().sum()) for t in tensors) ** 0.5)


def compare(grads: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, dict]]:
    """``{run: {group: {err, dist, cos}}}`` against ``fp32`` and ``stock`` (one batch)."""
    ref, stock = grads[REFERENCE], grads["stock"]
    names = sorted(ref)
    out: dict[str, dict[str, dict]] = {}
    for run, g in grads.items():
        if run == REFERENCE:
            continue
        missing = set(names) - set(g)
        if missing:
            raise RuntimeError(f"{run}: no gradient for {sorted(missing)[:3]}")
        rows = {}
        for group in (*GROUPS, "all"):
            sel = [n for n in names if group == "all" or group_of(n) == group]
            if not sel:
                continue
            e = [g[n] - ref[n] for n in sel]
            es = [stock[n] - ref[n] for n in sel]
            dot = sum(float((a.double() * b.double()).sum()) for a, b in zip(e, es))
            ne, nes = _norm(e), _norm(es)
            rows[group] = dict(
                err=ne / _norm(ref[n] for n in sel),
                dist=_norm(g[n] - stock[n] for n in sel) / _norm(stock[n] for n in sel),
                cos=dot / (ne * nes) if ne and nes else 1.0,
            )
        out[run] = rows
    return out


def mean_rows(per_batch: list[dict]) -> dict:
    """The batches' mean of each number."""
    runs = per_batch[0]
    return {
        run: {
            group: {k: sum(b[run][group][k] for b in per_batch) / len(per_batch) for k in vals}
            for group, vals in groups.items()
        }
        for run, groups in runs.items()
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="llama", choices=FAMILIES)
    p.add_argument("--size", default="small", choices=list(SHAPES))
    p.add_argument("--tiny", action="store_true", help="same as --size tiny (CPU smoke runs)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=150, help="stock's run (its lr schedule)")
    p.add_argument("--at-steps", default="0", help="comma-separated steps of stock's run")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--band-accums", default="2,4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp32", action="store_true", help="every run in fp32 (CPU plumbing check)")
    p.add_argument("--direct", action="store_true", help="CPU: gradients without a Trainer")
    p.add_argument("--sdpa-backend", choices=SDPA_BACKENDS)
    p.add_argument("--variant", action="append", default=[], help="NAME:field=value,...")
    p.add_argument("--out", default="outputs/grad_band_probe")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    cpu = not torch.cuda.is_available()
    bf16 = not a.fp32
    if bf16 and cpu and not a.direct:
        raise SystemExit("grad_band_probe.py: bf16 on a CPU needs --direct (or pass --fp32)")
    if a.direct and not cpu:
        raise SystemExit("grad_band_probe.py: --direct is the CPU's path")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is fp32 arithmetic
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(a.family, "tiny" if a.tiny else a.size, a.seq_len)
    rows = load_rows(a.seq_len)
    if a.batches * a.batch > len(rows):
        raise SystemExit(f"grad_band_probe.py: {a.batches} x {a.batch} rows > the {len(rows)}")
    torch.manual_seed(a.seed)
    capped = getattr(config, "attn_logit_softcapping", None)
    impl = {"attn_implementation": "eager"} if capped else {}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **impl)
    accums = [int(k) for k in a.band_accums.split(",") if k.strip()]
    runs = [RunSpec("stock", False, a.batch)]
    runs += [RunSpec(band_run_name(k), False, a.batch // k, k) for k in accums]
    runs += [RunSpec("streamed", True, a.batch)]
    runs += [dataclasses.replace(parse_variant(v), batch=a.batch) for v in a.variant]
    result: dict = {}
    kw = dict(cpu=cpu, out=out, seed=a.seed)
    with sdpa_backend(a.sdpa_backend):
        for step in (int(s) for s in a.at_steps.split(",")):
            weights = weights_at(model, rows, step, steps=a.steps, bf16=bf16, **kw)
            weights = weights.float().cpu()
            per_batch = []
            for b in range(a.batches):
                batch_rows = rows[b * a.batch : (b + 1) * a.batch]
                ref = RunSpec(REFERENCE, False, a.batch)
                if a.direct:
                    grads = {REFERENCE: direct_gradients(ref, weights, batch_rows, bf16=False)}
                    for spec in runs:
                        grads[spec.name] = direct_gradients(spec, weights, batch_rows, bf16=bf16)
                else:
                    grads = {REFERENCE: step_gradients(ref, weights, batch_rows, bf16=False, **kw)}
                    for spec in runs:
                        grads[spec.name] = step_gradients(
                            spec, weights, batch_rows, bf16=bf16, **kw
                        )
                per_batch.append(compare(grads))
            result[step] = mean_rows(per_batch)
            print(f"step {step} ({a.batches} batches of {a.batch} x {a.seq_len}): "
                  "err vs fp32 / dist to stock / cos with stock's error")  # fmt: skip
            groups = [g for g in (*GROUPS, "all") if g in result[step]["stock"]]
            print(f"  {'run':16s}" + "".join(f"{g:>24s}" for g in groups))
            for run, vals in result[step].items():
                cells = "".join(
                    f"{vals[g]['err']:9.2e}/{vals[g]['dist']:8.2e}/{vals[g]['cos']:5.2f}"
                    for g in groups
                )
                print(f"  {run:16s}{cells}")
    (out / "grad_band_probe.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'grad_band_probe.json'}")
    return result


if __name__ == "__main__":
    main()
