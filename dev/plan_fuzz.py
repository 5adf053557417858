"""Plan fuzz: seeded random tiny shapes, each one streamed step measured against the plan (CPU).

An audit on configs the tests do not use. For each case: a family's tiny config
(``tests.helpers.tiny_config``) at random widths (hidden size, MLP ratio, heads and kv heads,
head_dim other than hidden / heads where the family honours it, vocab sizes up to ~64x the
hidden size, tied or untied embeddings, MoE experts), a random token count split into batch x
seq, a fused-loss chunk (64, 256 or the default), run under bf16 autocast as
``tests/test_plan_accuracy.py::step_vs_plan`` runs it (every layer streamed and recomputed, the
loss's fp32 product as on CUDA) under its live-tensor tracker, against the plan's lines that
tracker can see for the same step (same micro-batch, sequence length and loss chunk), plus the
non-layer parameters' fp32 gradients.

Printed per case: measured peak / planned (``ratio``; above 1.0 the plan under-counts the step)
and measured / (planned + the lines' error margin) (``ratio_m``); the phase the peak was in; and
a CSV of every row (``--csv``, default /tmp/plan_fuzz.csv).

    nice -n 10 python3 dev/plan_fuzz.py [--cases 96] [--seed 0] [--families llama,qwen3,...]

Known tracker noise (dev/family_plan_sweep.py's docstring): the layer's weight gradients, made one
weight at a time, are in the GPU's gradient-buffer line, which the tracker's comparison leaves
out; at tiny widths and few tokens they read a few percent high. ``wgrad`` is an upper bound of
that noise: the largest layer's parameters in fp32, over the planned bytes.

What the CPU cannot say (2026-12-05's audit, 112 cases: 10 over the plan plus margin): the
tracker runs PyTorch's loss ops, whose chunk holds 10-12 B per logit and the final norm's fp32
saves; bf16 runs on CUDA take the fused loss kernel (fused_loss_kernel), which holds less per
logit. The cases that peaked in the loss's chunk (short micro-batches, vocab many times hidden:
Mixtral 1.40x, Qwen3-MoE 1.13x, Llama 1.06x) are that path's. Adding those lines to the plan
raised every CUDA plan where the loss phase binds (Gemma-2-2B at 4,096 tokens +2.4 GiB, already
4.6% over its measured H200 peak; Qwen2.5-7B at 8,192 tokens kept 1 layer's activations, not 3),
so it was not applied: the H200 rows are the evidence on CUDA. Five cases with query widths of
4-10x hidden (no real model) under-count in attention's backward; an untiled attention-backward
line would need GPU calibration.
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_megatrain.core.chunked_loss as chunked_loss  # noqa: E402
from hf_megatrain.core.options import EngineOptions, StepShape  # noqa: E402
from hf_megatrain.core.planner import plan_memory  # noqa: E402
from tests.test_plan_accuracy import (  # noqa: E402
    BF16,
    TRACKER_UNSEEN_KINDS,
    Live,
    _cuda_fp32_gemm,
    _streamed,
    family_config,
    mark_layer_backwards,
)


class Detail(Live):
    """``Live`` that also keeps, per storage, the phase and op that made it and its shape, and
    the live set at the step's peak (``at_peak``)."""

    def __init__(self) -> None:
        super().__init__()
        self.meta: dict[int, tuple] = {}
        self.at_peak: list[tuple] = []

    def on_new(self, key: int, t: torch.Tensor, func) -> None:
        super().on_new(key, t, func)
        self.meta[key] = (self.label, str(func).split(".")[1], tuple(t.shape), str(t.dtype)[6:])

    def forget(self, key: int) -> None:
        super().forget(key)
        self.meta.pop(key, None)

    def after_op(self) -> None:
        if self.cur > self.peak:
            self.at_peak = [(*self.meta[k], n) for k, n in self.live.items() if k in self.meta]
            self.peak_label = self.label
        super().after_op()


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "qwen3_moe", "mixtral")
#: Families whose attention takes ``head_dim`` from the config (the others: hidden / heads).
FREE_HEAD_DIM = {"llama", "qwen2", "qwen3", "mistral", "gemma2", "qwen3_moe", "mixtral"}
EAGER = {"gemma2"}  # soft-capped: eager attention, as the loaders choose


def sample_case(rng: random.Random, family: str, index: int) -> dict:
    """One random tiny case of ``family``."""
    heads = rng.choice([2, 3, 4, 5, 6, 8])
    kv_choices = [k for k in (1, 2, 3, 4, heads) if heads % k == 0]
    kv = rng.choice(kv_choices)
    h = rng.choice([48, 64, 80, 96, 128, 160, 192, 256])
    if family in FREE_HEAD_DIM:
        head_dim = rng.choice([8, 16, 24, 32, 48, 64])
    else:
        h = heads * max(8, h // heads // 2 * 2)  # hidden / heads, even (RoPE)
        head_dim = h // heads
    ratio = rng.choice([1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.5, 8.0])
    inter = int(h * ratio) // 8 * 8
    vocab = rng.choice([96, 257, 512, 1000, 2048, 4099, h * 12, h * 32])
    tokens = rng.choice([256, 512, 768, 1024, 1536, 2048, 3072, 4096])
    batch = rng.choice([b for b in (1, 2, 3, 4, 8) if tokens % b == 0 and tokens // b >= 32])
    case = dict(
        case=index, family=family, h=h, heads=heads, kv=kv, head_dim=head_dim, inter=inter,
        vocab=vocab, tied=rng.random() < 0.4, tokens=tokens, batch=batch, seq=tokens // batch,
        chunk=rng.choice([64, 256, 0]), window=0, experts=0, topk=0,
    )  # fmt: skip
    if family in ("mistral", "gemma2") and rng.random() < 0.6:  # a window shorter than seq
        case["window"] = max(8, case["seq"] // rng.choice([2, 3, 4]))
    if family in ("qwen3_moe", "mixtral"):
        case["experts"] = rng.choice([4, 6, 8])
        case["topk"] = rng.choice([1, 2, 3])
        case["inter"] = int(h * rng.choice([0.5, 1.0, 2.0, 4.0])) // 8 * 8
    return case


def build_config(case: dict):
    fam = case["family"]
    positions = 2 * case["seq"] + 64
    cfg = family_config(
        fam, case["h"], case["heads"], case["kv"], case["head_dim"], case["inter"],
        layers=3, keep_window=bool(case["window"]), positions=positions,
    )  # fmt: skip
    if fam in FREE_HEAD_DIM:
        cfg.head_dim = case["head_dim"]  # (Qwen2's config has no field: its attention reads it)
    cfg.vocab_size = case["vocab"]
    cfg.tie_word_embeddings = case["tied"]
    if case["window"]:
        cfg.sliding_window = case["window"]
    if fam == "gemma2":
        cfg.query_pre_attn_scalar = case["head_dim"]
    if fam == "qwen3_moe":
        cfg.num_experts, cfg.num_experts_per_tok = case["experts"], case["topk"]
        cfg.intermediate_size = 2 * case["inter"]  # (dense layers: none unless mlp_only_layers)
    if fam == "mixtral":
        cfg.num_local_experts, cfg.num_experts_per_tok = case["experts"], case["topk"]
    return cfg


def check_widths(model, case: dict, shape) -> str:
    """'' where the shape's q/kv widths are the first attention layer's; else what differs."""
    from hf_megatrain.hf.model import find_decoder_layers  # noqa: PLC0415

    attn = find_decoder_layers(model)[1][0].self_attn
    q = getattr(attn, "q_proj", None)
    if q is None:  # Phi-3's fused qkv
        out = attn.qkv_proj.weight.shape[0]
        want = shape.num_heads * shape.head_dim + 2 * shape.kv_size
        return "" if out == want else f"qkv {out} != {want}"
    qw, kw = q.weight.shape[0], attn.k_proj.weight.shape[0]
    if qw != shape.num_heads * shape.head_dim or kw != shape.kv_size:
        return f"q {qw} kv {kw} != shape {shape.num_heads * shape.head_dim} {shape.kv_size}"
    return ""


def run_case(case: dict, detail: bool = False) -> dict:
    from hf_megatrain.hf.trainer import StreamedModelWrapper  # noqa: PLC0415

    cfg = build_config(case)
    attn = "eager" if case["family"] in EAGER else "sdpa"
    chunk = case["chunk"] or None
    model, shape = _streamed(cfg, attn=attn)
    widths = check_widths(model, case, shape)
    live = Detail() if detail else Live()
    handles = mark_layer_backwards(model, live.enter)
    wrapper = StreamedModelWrapper(model, BF16, "cpu", loss_chunk_tokens=chunk)
    gen = torch.Generator().manual_seed(case["case"])
    ids = torch.randint(0, cfg.vocab_size, (case["batch"], case["seq"]), generator=gen)
    with live:
        live.enter("forward")
        loss = wrapper(input_ids=ids, labels=ids.clone()).loss
        live.enter("backward")
        loss.backward()
    for hd in handles:
        hd.remove()
    step = StepShape(seq_len=case["seq"], micro_batch_tokens=case["tokens"])
    options = EngineOptions(
        keep_activations="off", keep_attention_outputs="off", autocast_kernels=False,
        loss_chunk_tokens=chunk,
    ).resolve(clipping=True, cuda=True)  # fmt: skip
    plan = plan_memory(shape, step, options, BF16, 1 << 50, 1 << 50, hbm_layers=0)
    lines = [ln for ln in plan.gpu_lines if str(ln.kind) not in TRACKER_UNSEEN_KINDS]
    trained = shape.non_layer_numel - shape.frozen_non_layer_numel + shape.adapter_numel
    planned = sum(ln.nbytes for ln in lines) + 4 * trained
    margin = sum(ln.nbytes * ln.error for ln in lines)
    measured = live.peak
    peak_phase = max(live.phase_peak, key=live.phase_peak.get)
    wgrad = 4 * max(shape.layer_numels)
    if detail:
        print(f"peak {measured} in {live.peak_label}; lines:")
        for ln in lines:
            print(f"  {ln.nbytes:>10} {ln.kind}: {ln.name[:150]}")
        print(f"  {4 * trained:>10} non-layer fp32 grads")
        print("live at the peak (phase made, op, shape, dtype, bytes), largest first:")
        for row in sorted(live.at_peak, key=lambda r: -r[-1])[:40]:
            print("  ", row)
    return dict(
        measured=measured, planned=planned, margin=margin, ratio=measured / planned,
        ratio_m=measured / (planned + margin), peak_phase=peak_phase,
        wgrad_share=wgrad / planned, widths_ok=widths or "ok",
        lines="; ".join(f"{ln.kind}={ln.nbytes}" for ln in lines),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--csv", type=Path, default=Path("/tmp/plan_fuzz.csv"))
    ap.add_argument("--only", default="", help="comma-separated case indices to run")
    ap.add_argument("--detail", action="store_true", help="the lines and the peak's tensors")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    chunked_loss.add_product_fp32 = _cuda_fp32_gemm  # the loss's fp32 product as on CUDA
    fams = args.families.split(",")
    rng = random.Random(args.seed)
    cases = [sample_case(rng, fams[i % len(fams)], i) for i in range(args.cases)]
    if args.only:
        keep = {int(x) for x in args.only.split(",")}
        cases = [c for c in cases if c["case"] in keep]
    cols = ["case", "family", "h", "heads", "kv", "head_dim", "inter", "vocab", "tied",
            "tokens", "batch", "seq", "chunk", "window", "experts", "topk"]  # fmt: skip
    out_cols = ["measured", "planned", "margin", "ratio", "ratio_m", "peak_phase",
                "wgrad_share", "widths_ok", "secs", "lines"]  # fmt: skip
    head = (f"{'#':>3} {'family':9} {'h':>4} {'hd':>3} {'q/kv':>5} {'i':>5} {'vocab':>5} "
            f"{'tie':>3} {'bxs':>8} {'chnk':>4} {'win':>4} {'e/k':>4}  {'meas MB':>8} "
            f"{'plan MB':>8} {'ratio':>6} {'r_marg':>6} {'wgrad':>5} peak phase")  # fmt: skip
    print(head, flush=True)
    rows = []
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols + out_cols)
        writer.writeheader()
        for c in cases:
            t0 = time.time()
            try:
                r = run_case(c, args.detail)
            except Exception as exc:  # noqa: BLE001  (a case that fails is a row)
                r = dict(widths_ok=f"error {type(exc).__name__}: {str(exc)[:120]}")
                print(f"{c['case']:>3} {c['family']:9} {r['widths_ok']}", flush=True)
                writer.writerow({**c, **r})
                continue
            r["secs"] = round(time.time() - t0, 1)
            rows.append({**c, **r})
            writer.writerow(rows[-1])
            f.flush()
            flag = " UNDER" if r["ratio"] > 1 else ""
            flag += "" if r["widths_ok"] == "ok" else f" WIDTHS {r['widths_ok']}"
            print(
                f"{c['case']:>3} {c['family']:9} {c['h']:>4} {c['head_dim']:>3} "
                f"{c['heads']:>2}/{c['kv']:<2} {c['inter']:>5} {c['vocab']:>5} "
                f"{'y' if c['tied'] else 'n':>3} {c['batch']:>3}x{c['seq']:<4} "
                f"{c['chunk'] or 'dflt':>4} {c['window'] or '-':>4} "
                f"{(str(c['experts']) + '/' + str(c['topk'])) if c['experts'] else '-':>4}  "
                f"{r['measured'] / 1e6:8.2f} {r['planned'] / 1e6:8.2f} {r['ratio']:6.3f} "
                f"{r['ratio_m']:6.3f} {r['wgrad_share']:5.3f} {r['peak_phase']} "
                f"({r['secs']} s){flag}",
                flush=True,
            )
    print("\nper family: cases, worst ratio (case), worst ratio with margin")
    for fam in fams:
        fr = [r for r in rows if r["family"] == fam]
        if not fr:
            continue
        worst = max(fr, key=lambda r: r["ratio"])
        print(f"  {fam:9} {len(fr):3}  {worst['ratio']:.3f} (#{worst['case']})  "
              f"{max(r['ratio_m'] for r in fr):.3f}")  # fmt: skip
    under = [r for r in rows if r["ratio"] > 1]
    print(f"{len(rows)} cases, {len(under)} with measured > planned; CSV: {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
