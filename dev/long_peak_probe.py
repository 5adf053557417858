"""Where a long-context step's GPU peak comes from, phase by phase, against the plan's lines.

Builds a model from a config directory with its real widths but few layers (``--layers``), streams
it with the engine options given (as in a long-context run: MLP tiles, activation offload,
checkpoint segments, fp32-master streaming, Liger's kernels where installed), runs two steps of
one ``--tokens``-token sequence and reports, for the second step:

* the allocator's peak over the step's start in each phase (each layer's forward, the loss, each
  layer's recompute and its backward), so the step's peak has a place;
* the blocks live at the step's peak, grouped by size (the allocator's history without stacks:
  Python stacks in the autograd threads broke a run under ``BENCH_MEMORY_TRACE``);
* the plan's GPU lines for the same model, step and options.

    python3 dev/long_peak_probe.py benchmarks/configs/qwen2.5-7b --layers 8 --tokens 131072 \\
        --hbm-layers 2 --option checkpoint_every=4 --option mlp_tile_tokens=16384 \\
        --option offload_activations=true --option stream_fp32_master=true [--json OUT]

A diagnostic for the planner's activation lines (dev/README.md), CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_megatrain.core.options import StepShape  # noqa: E402
from hf_megatrain.core.plan_search import plan_memory  # noqa: E402
from hf_megatrain.hf.model import (  # noqa: E402
    find_decoder_layers,
    model_shape,
    prepare_streamed_model,
    streamed_state,
)
from hf_megatrain.hf.trainer import StreamedModelWrapper  # noqa: E402

GIB = 2**30
BF16 = torch.bfloat16


def _option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    low = value.lower()
    if low in ("true", "false"):
        return key, low == "true"
    try:
        return key, int(value)
    except ValueError:
        return key, value


class Phases:
    """The allocator's peak per phase (over ``base``), switching at layer hooks."""

    def __init__(self) -> None:
        self.base = 0
        self.current = "start"
        self.peaks: list[tuple[str, float]] = []
        self.in_backward = False

    def enter(self, name: str) -> None:
        peak = torch.cuda.max_memory_allocated() - self.base
        self.peaks.append((self.current, peak / GIB))
        self.current = name
        torch.cuda.reset_peak_memory_stats()

    def hook(self, model: torch.nn.Module) -> list:
        handles = []
        for i, layer in enumerate(find_decoder_layers(model)[1]):

            def pre(mod, args, i=i):
                self.enter(f"{'recompute' if self.in_backward else 'forward'} {i}")

            def post(mod, args, out, i=i):
                o = out[0] if isinstance(out, tuple) else out
                if isinstance(o, torch.Tensor) and o.requires_grad:
                    o.register_hook(lambda g, i=i: self.enter(f"backward {i}"))

            handles.append(layer.register_forward_pre_hook(pre))
            handles.append(layer.register_forward_hook(post))
        return handles


def _live_at_peak(trace: list[dict]) -> tuple[float, int, Counter]:
    """Replay alloc/free events: the most bytes live (over the recording's start), the event
    index, and the live blocks then by size in MiB."""
    live, blocks = 0, {}
    best, best_at, best_blocks = 0, -1, {}
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live += ev["size"]
            blocks[ev["addr"]] = ev["size"]
            if live > best:
                best, best_at, best_blocks = live, i, dict(blocks)
        elif ev["action"] == "free_completed":
            if blocks.pop(ev["addr"], None) is not None:
                live -= ev["size"]
    sizes = Counter(round(s / 2**20) for s in best_blocks.values())
    return best / GIB, best_at, sizes


def probe(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(args.config)
    cfg.num_hidden_layers = args.layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = cfg.layer_types[: args.layers]
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, args.tokens)
    cfg.use_cache = False
    torch.manual_seed(0)
    t0 = time.time()
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.config._attn_implementation = args.attn
    step = StepShape(seq_len=args.tokens, micro_batch_tokens=args.tokens)
    fields = dict(_option(o) for o in args.option)
    fields.setdefault("auto_fit", "off")
    fields["resident_layers"] = str(args.hbm_layers)
    prepare_streamed_model(model, "cuda", BF16, step=step, **fields)
    model.train()
    state = streamed_state(model)
    shape = model_shape(model)  # after streaming: its kernels (Liger's) and attention as applied
    options = state.options
    print(f"built in {time.time() - t0:.0f} s; options: {options}", flush=True)
    wrapper = StreamedModelWrapper(model, BF16, "cuda", loss_chunk_tokens=options.loss_chunk_tokens)
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), device="cuda")
    phases = Phases()
    handles = phases.hook(model)
    for n in range(2):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        phases.base = torch.cuda.memory_allocated()
        phases.peaks, phases.current, phases.in_backward = [], "start", False
        if n == 1:
            torch.cuda.memory._record_memory_history(
                enabled="all", context=None, stacks="python", max_entries=2_000_000
            )
        torch.cuda.reset_peak_memory_stats()
        t1 = time.time()
        loss = wrapper(input_ids=ids, labels=ids.clone()).loss
        phases.enter("loss done, head backward")
        phases.in_backward = True
        loss.backward()
        torch.cuda.synchronize()
        phases.enter("end")
        print(f"step {n}: {time.time() - t1:.1f} s", flush=True)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = max(snap.get("device_traces", [[]]), key=len)
    live_gib, at, sizes = _live_at_peak(trace)
    for h in handles:
        h.remove()
    peak_phase = max(phases.peaks, key=lambda p: p[1])
    plan = plan_memory(shape, step, options, BF16, 139 * GIB, 1 << 50, hbm_layers=args.hbm_layers)
    result = {
        "config": args.config,
        "layers": args.layers,
        "tokens": args.tokens,
        "hbm_layers": args.hbm_layers,
        "options": {k: str(v) for k, v in fields.items()},
        "base_gib": phases.base / GIB,
        "phase_peaks_gib": phases.peaks,
        "peak_phase": peak_phase,
        "trace_live_peak_gib": live_gib,
        "trace_peak_event": at,
        "trace_events": len(trace),
        "live_at_peak_mib": sorted(sizes.items(), key=lambda kv: -kv[0] * kv[1]),
        "plan_gpu_lines": [
            (ln.name, ln.nbytes / GIB, str(ln.kind), ln.error) for ln in plan.gpu_lines
        ],
    }
    print(f"base {phases.base / GIB:.2f} GiB (parameters, buffers); peak phase {peak_phase}")
    for name, gib in phases.peaks:
        print(f"  {gib:8.2f}  {name}")
    print(f"trace: live peak {live_gib:.2f} GiB over the step's start, event {at}/{len(trace)}")
    for mib, count in result["live_at_peak_mib"][:30]:
        print(f"  {mib:8d} MiB x {count}")
    print("plan (GPU lines, GiB):")
    for name, gib, kind, err in result["plan_gpu_lines"]:
        print(f"  {gib:8.2f}  [{kind}, {err:.2f}] {name}")
    del wrapper, model
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a config directory (benchmarks/configs/...)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[131072])
    ap.add_argument("--hbm-layers", type=int, default=2)
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--option", action="append", default=[], help="an EngineOptions field=value")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("long_peak_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    for tokens in args.tokens:
        one = argparse.Namespace(**{**vars(args), "tokens": tokens})
        results.append(probe(one))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
