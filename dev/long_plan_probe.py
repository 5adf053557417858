"""Scale model of the base262k / chain262k / exact524k H200 rows on the CPU live-tensor tracker.

Qwen2.5-7B widths / 8 (hidden 448, intermediate 2368, 28 heads x head_dim 16, 4 kv heads, vocab
152064/8), 28 layers, one sequence of --tokens tokens, MLP tiles of --tile tokens, checkpoint
segments of 6, activation offload, fp32 boundaries, every layer streamed, attention outputs kept
(--keep all|off|N), --chain N, Liger-like kernels (--kernels liger: CPU stand-ins that save and
allocate what Liger's RMSNorm / SwiGLU / RoPE do) or PyTorch's (--kernels torch).

Reports the step's live peak, the phase it is in, what is live then (grouped by role), the
per-phase peaks, and the plan's lines for the same scaled shape.

    python3 dev/long_plan_probe.py --tokens 4096 --tile 256 --kernels liger --keep all --show 4

The runs behind docs/long_context.md's "The plan's long-context over-estimate" (each 1-6 min on
2 CPU cores, < 1 GB RAM): base262k ``--keep all``; chain262k ``--keep 26 --chain 5``; exact524k
``--tile 128 --keep off --h200-tokens 524288 --autocast-kernels 0`` (it ran before the shared
casts); ``--kernels torch`` for PyTorch's kernels. ``--json FILE`` writes every live tensor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))

from tests.helpers import LiveStorages, offload_uncounted  # noqa: E402 - shared with the tests

BF16 = torch.bfloat16


# ---- live-tensor tracker (tests/test_plan_accuracy.py's Live, with metadata) ----------------------
class Live(LiveStorages):
    def __init__(self) -> None:
        super().__init__()
        self.meta: dict[int, tuple] = {}
        self.label = "start"
        self.peak_label = ""
        self.peak_snapshot: dict[int, tuple] = {}
        self.phase_peak: dict[str, int] = {}
        self.phase_order: list[str] = []
        self.phase_snap: dict[str, tuple] = {}

    def on_new(self, key: int, t: torch.Tensor, func) -> None:
        self.meta[key] = (tuple(t.shape), t.dtype, str(func.__name__), self.label)

    def forget(self, key: int) -> None:
        self.meta.pop(key, None)

    def after_op(self) -> None:
        if self.cur > self.peak:
            self.peak = self.cur
            self.peak_label = self.label
            self.peak_snapshot = dict(self.meta)
            self.peak_sizes = dict(self.live)
        if self.label not in self.phase_peak:
            self.phase_order.append(self.label)
        if self.cur > self.phase_peak.get(self.label, -1):
            self.phase_peak[self.label] = self.cur
            self.phase_snap[self.label] = (dict(self.meta), dict(self.live))


LIVE: Live | None = None


# ---- Liger-like CPU stand-ins --------------------------------------------------------------------
CH = 1024  # rows per chunk (Liger's kernels work row by row: no full-size temporaries)


class _quiet:
    """Temporaries of a stand-in's chunk loop are a fused kernel's registers: not tracked."""

    def __enter__(self):
        if LIVE is not None:
            LIVE.ignore += 1

    def __exit__(self, *exc):
        if LIVE is not None:
            LIVE.ignore -= 1


class _RMSNormFn(torch.autograd.Function):
    """LigerRMSNormFunction (casting mode llama, in_place=True): Y in X's dtype, saves X, W and
    the fp32 rstd per row; backward writes dX into dY."""

    @staticmethod
    def forward(ctx, X, W, eps):
        shape = X.shape
        X2 = X.reshape(-1, shape[-1])
        Y = torch.empty_like(X2)
        rstd = torch.empty(X2.shape[0], dtype=torch.float32)
        with torch.no_grad(), _quiet():
            for s in range(0, X2.shape[0], CH):
                x = X2[s : s + CH].float()
                r = torch.rsqrt(x.pow(2).mean(-1) + eps)
                rstd[s : s + CH] = r
                Y[s : s + CH] = (x * r[:, None]).to(X.dtype) * W
        ctx.save_for_backward(X2, W, rstd)
        ctx.shape = shape
        return Y.view(shape)

    @staticmethod
    def backward(ctx, dY):
        X2, W, rstd = ctx.saved_tensors
        dY2 = dY.reshape(-1, dY.shape[-1])
        if not dY2.is_contiguous():
            dY2 = dY2.contiguous()
        dW = torch.zeros_like(W, dtype=torch.float32)
        with torch.no_grad(), _quiet():
            for s in range(0, X2.shape[0], CH):
                x = X2[s : s + CH].float()
                r = rstd[s : s + CH][:, None]
                dy = dY2[s : s + CH].float()
                xh = x * r
                dW += (dy * xh).sum(0)
                m = dy * W
                dx = r * (m - xh * (m * xh).mean(-1, keepdim=True))
                dY2[s : s + CH] = dx.to(dY2.dtype)
        return dY2.view(ctx.shape), dW.to(W.dtype), None


def liger_rms_forward(self, hidden_states):
    return _RMSNormFn.apply(hidden_states, self.weight, self.variance_epsilon)


liger_rms_forward.__module__ = "liger_kernel.transformers.rms_norm"


class _SiLUMulFn(torch.autograd.Function):
    """LigerSiLUMulFunction: c = silu(a) * b; saves a and b; backward writes da, db into them."""

    @staticmethod
    def forward(ctx, a, b):
        a, b = a.contiguous(), b.contiguous()
        c = torch.empty_like(a)
        with torch.no_grad(), _quiet():
            a2, b2, c2 = a.view(-1, a.shape[-1]), b.view(-1, b.shape[-1]), c.view(-1, c.shape[-1])
            for s in range(0, a2.shape[0], CH // 4):
                af = a2[s : s + CH // 4].float()
                c2[s : s + CH // 4] = (af * torch.sigmoid(af) * b2[s : s + CH // 4].float()).to(
                    c.dtype
                )
        ctx.save_for_backward(a, b)
        return c

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        dc = dc.contiguous()
        with torch.no_grad(), _quiet():
            a2, b2, d2 = a.view(-1, a.shape[-1]), b.view(-1, b.shape[-1]), dc.view(-1, a.shape[-1])
            for s in range(0, a2.shape[0], CH // 4):
                sl = slice(s, s + CH // 4)
                af, bf, df = a2[sl].float(), b2[sl].float(), d2[sl].float()
                sig = torch.sigmoid(af)
                silu = af * sig
                db = df * silu
                da = df * bf * (sig * (1 + af * (1 - sig)))
                a2[sl] = da.to(a.dtype)
                b2[sl] = db.to(b.dtype)
        return a, b


def liger_swiglu_forward(self, x):
    return self.down_proj(_SiLUMulFn.apply(self.gate_proj(x), self.up_proj(x)))


liger_swiglu_forward.__module__ = "liger_kernel.transformers.swiglu"


class _RopeFn(torch.autograd.Function):
    """LigerRopeFunction, one tensor at a time: rotates q (or k) in place (its projection's
    storage, no copy), saves cos and sin; backward rotates the gradient in place."""

    @staticmethod
    def _rotate(t, cos, sin, sign):
        tt = t.transpose(1, 2)  # (b, s, heads, d): the physical layout
        d = tt.shape[-1] // 2
        for s in range(0, tt.shape[1], CH):
            x = tt[:, s : s + CH]
            c = cos[:, s : s + CH, None, :d].float()
            sn = sin[:, s : s + CH, None, :d].float() * sign
            x1, x2 = x[..., :d].float(), x[..., d:].float()
            r1 = x1 * c - x2 * sn
            r2 = x2 * c + x1 * sn
            x[..., :d] = r1.to(x.dtype)
            x[..., d:] = r2.to(x.dtype)

    @staticmethod
    def forward(ctx, q, cos, sin):
        with torch.no_grad(), _quiet():
            _RopeFn._rotate(q, cos, sin, 1.0)
        ctx.mark_dirty(q)
        ctx.save_for_backward(cos, sin)
        return q

    @staticmethod
    def backward(ctx, dq):
        cos, sin = ctx.saved_tensors
        with torch.no_grad(), _quiet():
            _RopeFn._rotate(dq, cos, sin, -1.0)
        return dq, None, None


def liger_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return _RopeFn.apply(q, cos, sin), _RopeFn.apply(k, cos, sin)


def apply_liger_like(model) -> None:
    import transformers.models.qwen2.modeling_qwen2 as mq

    mq.apply_rotary_pos_emb = liger_rope
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.__dict__["forward"] = liger_rms_forward.__get__(norm, type(norm))
        layer.mlp.__dict__["forward"] = liger_swiglu_forward.__get__(layer.mlp, type(layer.mlp))
    norm = model.model.norm
    norm.__dict__["forward"] = liger_rms_forward.__get__(norm, type(norm))


# ---- the model --------------------------------------------------------------------------------------
def build(args):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from hf_megatrain.core.options import StepShape  # noqa: F401
    from hf_megatrain.hf.model import model_shape, prepare_streamed_model

    s = args.scale
    cfg = Qwen2Config(
        hidden_size=3584 // s, intermediate_size=18944 // s, num_hidden_layers=args.layers,
        num_attention_heads=28, num_key_value_heads=4, head_dim=128 // s,
        vocab_size=152064 // s, max_position_embeddings=max(args.tokens, 4096),
        tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6, use_sliding_window=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    model.config.use_cache = False
    if args.kernels == "liger":
        apply_liger_like(model)
    options = dict(
        resident_layers="0", keep_activations="off", keep_attention_outputs=args.keep,
        checkpoint_every=args.every, mlp_tile_tokens=args.tile, offload_activations=True,
        stream_fp32_master=True, chain_attention_outputs=args.chain, auto_fit="off",
        autocast_kernels=args.autocast_kernels,
    )  # fmt: skip
    prepare_streamed_model(model, "cpu", BF16, **options)
    from hf_megatrain.hf.model import streamed_state

    streamed_state(model).engine.offload_min_numel = 1 << 14  # tiny shapes: still large
    shape = model_shape(model)
    return model.train(), shape, cfg


def label_hooks(model, live: Live):
    """Phase labels: 'fwd L', 'loss', 'chain@L q' (a segment chain re-running layer q in layer
    L's backward), 'recompute L', 'grad L' (autograd through L's graph)."""
    import hf_megatrain.core.streamed_layer as sl

    state = {"bwd": None}
    orig_run = sl.StreamedLayer.run
    orig_backward = sl._StreamedLayerFunction.backward

    def run(self, *a, **k):
        L = state["bwd"]

        if L is None:
            live.label = f"fwd {self.index}"
        elif self.index == L:
            live.label = f"recompute {L}"
        else:
            live.label = f"chain@{L} {self.index}"
        try:
            return orig_run(self, *a, **k)
        finally:
            if L is not None:
                live.label = f"grad {L}" if self.index == L else f"chain@{L} end"
            else:
                live.label = f"after fwd {self.index}"

    def backward(ctx, *grads):
        state["bwd"] = ctx.layer.index
        live.label = f"bwd-start {ctx.layer.index}"
        try:
            return orig_backward(ctx, *grads)
        finally:
            live.label = f"after {ctx.layer.index}"

    sl.StreamedLayer.run = run
    sl._StreamedLayerFunction.backward = staticmethod(backward)

    # Offload's host buffers (pinned host RAM on the GPU): not device memory.
    offload_uncounted(live).__enter__()
    return state


def role(shape, dtype, op, label, d) -> str:
    """A live tensor's role by its size; the prefix says how it scales to the H200."""
    t, h, i, kv, heads, v, tile = d["t"], d["h"], d["i"], d["kv"], d["heads"], d["v"], d["tile"]
    n = 1
    for x in shape:
        n *= x
    sz, dt = dtype.itemsize, str(dtype)[6:]
    if n == t * h:
        return f"[act] t x h {dt}" + (" (q-sized too: q = h)" if sz == 2 else "")
    if n == t * kv:
        return f"[act] t x kv {dt}"
    if n == tile * i and shape[-1] == i:
        return f"[tile] tile x i {dt}"
    if n == tile * h and shape[-1] == h:
        return f"[tile] tile x h {dt}"
    if n == t * heads:
        return f"[tok] lse t x heads {dt}"
    if n in (t * d["hd"], t * d["hd"] // 2):
        return f"[act] rope t x head_dim {dt}"
    if n == v * h:
        return f"[param] vocab x h {dt}"
    if len(shape) == 2 and shape[-1] == v:
        return f"[act] loss chunk x vocab {dt}"
    if n in (t, t + 1):
        return f"[tok] per-token scalar {dt}"
    if n == d["layer_numel"]:
        return f"[param] one layer's flat weights {dt}"
    if len(shape) == 2 and shape[0] in (h, i, d["q"], kv) and shape[1] in (h, i, d["q"], kv):
        return f"[param] weight-shaped {dt}"
    if len(shape) <= 1 and n in (h, i, d["q"], kv):
        return f"[param] weight-shaped {dt}"
    if n < 4096:
        return f"[tiny] {dt}"
    return f"[act?] other {shape} {dt}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--tile", type=int, default=256)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--every", type=int, default=6)
    ap.add_argument("--scale", type=int, default=8)
    ap.add_argument("--keep", default="all")
    ap.add_argument("--chain", type=int, default=0)
    ap.add_argument("--kernels", default="liger", choices=("liger", "torch"))
    ap.add_argument("--autocast-kernels", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--h200-tokens", type=int, default=262144)
    ap.add_argument("--show", type=int, default=3)
    ap.add_argument("--verbose", type=int, default=0)
    args = ap.parse_args()
    args.autocast_kernels = bool(args.autocast_kernels)

    from transformers import AutoModelForCausalLM

    from hf_megatrain.core.options import EngineOptions, StepShape
    from hf_megatrain.core.planner import plan_memory
    from hf_megatrain.hf.trainer import StreamedModelWrapper

    t0 = time.time()
    model, shape, cfg = build(args)
    global LIVE
    live = LIVE = Live()
    label_hooks(model, live)
    wrapper = StreamedModelWrapper(
        model, BF16, "cpu", loss_chunk_tokens=max(1, round(3530 * args.tokens / args.h200_tokens))
    )
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens))
    print(f"built in {time.time() - t0:.0f} s; fused kernels in shape: {shape.fused_layer_kernels}",
          flush=True)  # fmt: skip
    t1 = time.time()
    with live:
        live.label = "embed"
        out = wrapper(input_ids=ids, labels=ids.clone())
        live.label = "loss backward"
        out.loss.backward()
    print(f"step {time.time() - t1:.0f} s", flush=True)
    h, i, t = cfg.hidden_size, cfg.intermediate_size, args.tokens
    heads, hd, kvh = cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
    d = dict(t=t, h=h, i=i, q=heads * hd, kv=kvh * hd, heads=heads, v=cfg.vocab_size,
             tile=args.tile, hd=hd, layer_numel=sum(p.numel() for p in
             AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).model.layers[0].parameters()))  # fmt: skip
    # H200 equivalents: widths x scale, tokens x (H200 tokens / t), tiles x (16384 / tile)
    T = args.h200_tokens
    ws, ts, tl = args.scale, T / t, 16384 / args.tile

    def factor(r: str) -> float:
        return {"[tok]": ts, "[act]": ws * ts, "[tile]": ws * tl, "[param]": ws * ws,
                "[tiny]": 0.0}.get(r.split()[0], ws * ts)  # fmt: skip

    def grouped(snap):
        meta, sizes = snap
        groups: dict[str, list] = defaultdict(lambda: [0, 0, Counter()])
        for key, (shp, dt, op, lab) in meta.items():
            r = role(shp, dt, op, lab, d)
            g = groups[r]
            g[0] += sizes[key]
            g[1] += 1
            g[2][f"{op}@{lab}"] += 1
        return groups

    def h200(groups, params=False) -> float:
        return sum(
            b * factor(r) for r, (b, n, c) in groups.items() if r.startswith("[param]") == params
        )

    unit = t * h * 4
    print(f"\nlive peak {live.peak / 2**20:.2f} MiB = {live.peak / unit:.2f} x (t x h x 4 B) "
          f"in phase '{live.peak_label}'")  # fmt: skip
    phases = []
    for lab in live.phase_order:
        g = grouped(live.phase_snap[lab])
        phases.append((lab, live.phase_peak[lab], h200(g), g))
    print("\nphase peaks: MiB here, x (t x h x 4 B), H200-equivalent GiB: activations, "
          "[param] (weight copies, weight grads, LM head grad)")  # fmt: skip
    for lab, b, e, g in phases:
        print(f"  {b / 2**20:9.2f} {b / unit:7.2f} {e / 2**30:8.2f} {h200(g, True) / 2**30:6.2f}"
              f"  {lab}")  # fmt: skip
    top = sorted(phases, key=lambda p: -p[2])[: args.show]
    for lab, b, e, g in top:
        print(f"\n== phase '{lab}': {b / 2**20:.2f} MiB here, {e / 2**30:.2f} GiB H200-equivalent")
        for r, (nb, n, c) in sorted(g.items(), key=lambda kv: -kv[1][0] * factor(kv[0])):
            print(f"  {nb / 2**20:9.2f} MiB {nb / unit:6.2f}u  H200 {nb * factor(r) / 2**30:7.2f} GiB"
                  f"  x{n:3d}  {r}")  # fmt: skip
            if args.verbose:
                for what, k in c.most_common(args.verbose):
                    print(f"          {k:3d} x {what}")
    # the plan for this scaled shape
    step = StepShape(seq_len=t, micro_batch_tokens=t)
    keep = args.keep if args.keep != "all" else str(args.layers)
    opts = EngineOptions(
        keep_activations="off", keep_attention_outputs=keep, checkpoint_every=args.every,
        mlp_tile_tokens=args.tile, offload_activations=True, stream_fp32_master=True,
        chain_attention_outputs=args.chain, auto_fit="off",
    ).resolve(clipping=True, cuda=True)  # fmt: skip
    plan = plan_memory(shape, step, opts, BF16, 1 << 50, 1 << 50, hbm_layers=0)
    print("\nplan lines (MiB, B/token):")
    lines = []
    for ln in plan.gpu_lines:
        print(f"  {ln.nbytes / 2**20:9.2f} {ln.nbytes / t:9.0f}  [{ln.kind}] {ln.name[:100]}")
        lines.append((ln.name, ln.nbytes, str(ln.kind)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "peak": live.peak,
                    "peak_label": live.peak_label,
                    "phases": [
                        (lab, b, e, {r: [nb, n, dict(c)] for r, (nb, n, c) in g.items()})
                        for lab, b, e, g in phases
                    ],
                    "plan": lines,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
