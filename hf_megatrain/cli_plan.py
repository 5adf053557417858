"""``hf-megatrain plan``: the memory plan of a config, before anything is allocated."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

from .cli_common import CLIError, config_from_json, say, setup_logging


def add_plan_parser(sub) -> None:
    pl = sub.add_parser(
        "plan",
        help="print the memory plan (HBM/host tiers, PCIe traffic) without building the model",
        description="Plan where each decoder layer's weights and optimizer state live (GPU or "
        "host RAM) for a step of --tokens-per-step tokens, and the largest sequence, step and "
        "model of this shape that fit. Nothing is allocated: parameters are counted on the "
        "meta device.",
    )
    pl.add_argument("model", help="a config.json, or a folder holding one (checkpoint folder)")
    pl.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    pl.add_argument("--tokens-per-step", type=int, required=True, help="tokens per optimizer step")
    pl.add_argument(
        "--micro-batch-tokens", type=int, help="tokens per forward (default: the whole step)"
    )
    pl.add_argument("--grad-accum", type=int, help="micro-batches per step (default: 1)")
    pl.add_argument(
        "--mlp-tile-tokens",
        type=int,
        default=0,
        help="plan for MLP sequence tiling with tiles of this many tokens (default: off)",
    )
    pl.add_argument(
        "--offload-activations",
        action="store_true",
        help="plan for layer-boundary activations in pinned host memory",
    )
    pl.add_argument(
        "--bf16-boundaries",
        action="store_true",
        help="plan for megatrain_boundary_dtype='bfloat16': each layer's saved input rounded to "
        "bf16 (2 instead of 4 B per token x hidden per layer, in HBM or offloaded)",
    )
    pl.add_argument(
        "--checkpoint-every",
        type=int,
        default=1,
        metavar="K",
        help="plan for megatrain_checkpoint_every=K: only every K-th layer saves its input "
        "(ceil(layers / K) boundary activations, in HBM or offloaded), plus up to K-1 fp32 "
        "layer inputs in HBM during a segment's backward (default: 1, every layer)",
    )
    pl.add_argument(
        "--keep-attention-outputs",
        nargs="?",
        const="all",
        default="off",
        metavar="off|all|auto|N",
        help="plan for megatrain_keep_attention_outputs: recomputed layers that keep the fused "
        "attention kernel's output and log-sum-exp in HBM (heads x head_dim x 2 B + 4 B per "
        "head per token and layer; their recompute skips attention's forward): all (the flag "
        "alone), auto (as many as the HBM left fits) or the last N",
    )
    pl.add_argument(
        "--no-clip",
        action="store_true",
        help="plan for training without gradient clipping (max_grad_norm 0): layers update "
        "eagerly during backward and host layers keep no fp32 gradient slot (4 B/param less)",
    )
    pl.add_argument(
        "--stream-fp32-master",
        action="store_true",
        help="plan for megatrain_stream_fp32_master: no bf16 copy in host RAM (2 B/param less), "
        "the fp32 master streams (twice the H2D bytes) and is cast on the GPU",
    )
    pl.add_argument(
        "--hbm-cast-weights",
        action="store_true",
        help="plan for megatrain_hbm_cast_weights: HBM-tier layers keep no bf16 copy (16 "
        "instead of 18 B/param) and recompute in backward",
    )
    pl.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="data-parallel processes (one GPU each) on this host: they share one host store; "
        "--hbm-gib is per GPU, --host-gib the host's",
    )
    pl.add_argument(
        "--keep-activations",
        default="auto",
        help="HBM-tier layers that keep their activations instead of recomputing in backward "
        "(megatrain_keep_activations): 'auto' (as many as the HBM left fits), 'off', or a count",
    )
    pl.add_argument(
        "--liger",
        action="store_true",
        help="plan for Liger-Kernel's fused RMSNorm / SwiGLU (use_liger_kernel=True): kept "
        "activations save their inputs only (8 x hidden + 4 x intermediate bytes per token less)",
    )
    pl.add_argument(
        "--hbm-gib", type=float, help="free GPU memory (default: measured, else 139 = one H200)"
    )
    pl.add_argument("--host-gib", type=float, help="host RAM (default: MemAvailable)")
    pl.add_argument("--fp32", action="store_true", help="fp32 compute (default: bf16)")
    pl.add_argument(
        "--no-search", dest="search", action="store_false", help="skip the what-fits search"
    )


def plan_config(path: str):
    """The model config of ``hf-megatrain plan``'s argument: a config.json or a folder with one."""
    from transformers import AutoConfig  # noqa: PLC0415

    from . import SUPPORTED_MODEL_TYPES  # noqa: PLC0415

    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise CLIError(f"{p} has no config.json")
        try:
            cfg = AutoConfig.from_pretrained(str(p), local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise CLIError(f"{p}: could not read config.json: {e}") from None
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise CLIError(
                f"{p}: model_type {cfg.model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        return cfg
    if not p.is_file():
        raise CLIError(f"config not found: {path} (give a config.json or a folder with one)")
    return config_from_json(str(p))


def model_shape_from_config(cfg, name: str = "model"):
    """Parameter counts per layer and outside the layers, from a model built on ``meta``."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from .hf.model import model_shape  # noqa: PLC0415

    try:
        # Built on the meta device: shapes only, no weight is allocated (a 70B config is fine).
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except (TypeError, ValueError, RuntimeError) as e:
        raise CLIError(f"could not build {cfg.model_type} from this config: {e}") from None
    return model_shape(model, name)


def detected_memory(hbm_gib: float | None, host_gib: float | None) -> tuple[int, int, list[str]]:
    """(HBM bytes, host bytes, lines saying where each figure came from)."""
    import torch  # noqa: PLC0415

    from .core.host_store import available_host_bytes  # noqa: PLC0415
    from .core.planner import GIB, H200_HBM_BYTES  # noqa: PLC0415

    said = []
    for label, value in (("hbm-gib", hbm_gib), ("host-gib", host_gib)):
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise CLIError(f"--{label} must be a positive number of GiB")
    if hbm_gib is not None:
        hbm = int(hbm_gib * GIB)
        said.append(f"GPU memory: {hbm_gib:g} GiB (--hbm-gib)")
    elif torch.cuda.is_available():
        hbm, _ = torch.cuda.mem_get_info()
        said.append(f"GPU memory: {hbm / GIB:.2f} GiB free on {torch.cuda.get_device_name()}")
    else:
        hbm = H200_HBM_BYTES
        said.append("GPU memory: no CUDA GPU here; assuming one H200 (139 GiB, --hbm-gib to set)")
    if host_gib is not None:
        host = int(host_gib * GIB)
        said.append(f"host RAM: {host_gib:g} GiB (--host-gib)")
    else:
        host = available_host_bytes()
        said.append(f"host RAM: {host / GIB:.2f} GiB available on this machine (MemAvailable)")
    return hbm, host, said


def run_plan(ns: argparse.Namespace) -> dict[str, Any]:
    """``hf-megatrain plan``: print the plan and what fits; return them for tests."""
    import torch  # noqa: PLC0415

    from .core.planner import (  # noqa: PLC0415
        Workload,
        max_micro_batch_sequences,
        max_num_layers,
        max_seq_len,
        parse_attention_layers,
        plan_memory,
    )
    from .hf.model import _kept_count  # noqa: PLC0415

    try:
        wl = Workload.from_step(
            ns.seq_len, ns.tokens_per_step, ns.micro_batch_tokens, ns.grad_accum
        )
        segment = getattr(ns, "checkpoint_every", None)
        wl = dataclasses.replace(
            wl,
            mlp_tile_tokens=getattr(ns, "mlp_tile_tokens", 0) or 0,
            offload_activations=bool(getattr(ns, "offload_activations", False)),
            boundary_bytes_per_element=2 if getattr(ns, "bf16_boundaries", False) else 4,
            checkpoint_every=1 if segment is None else segment,
            attention_output_layers=parse_attention_layers(
                getattr(ns, "keep_attention_outputs", "off")
            ),
        )
        if wl.checkpoint_every < 1:
            raise ValueError(f"--checkpoint-every {wl.checkpoint_every} must be at least 1")
    except ValueError as e:
        raise CLIError(str(e)) from None
    hbm, host, said = detected_memory(ns.hbm_gib, ns.host_gib)
    cfg = plan_config(ns.model)
    src = Path(ns.model).resolve()
    label = src.parent.name if src.is_file() else src.name
    setup_logging()
    shape = model_shape_from_config(cfg, f"{label} [{cfg.model_type}]")
    if getattr(ns, "liger", False):
        shape = dataclasses.replace(shape, fused_layer_kernels=True)
    dtype = torch.float32 if ns.fp32 else torch.bfloat16
    nproc = getattr(ns, "nproc", None)
    nproc = 1 if nproc is None else int(nproc)
    if nproc < 1:
        raise CLIError(f"--nproc {nproc}: need at least 1 process")
    store = dict(
        hold_grads=not getattr(ns, "no_clip", False),
        stream_fp32_master=bool(getattr(ns, "stream_fp32_master", False)),
        ranks=nproc,
        hbm_cast_weights=bool(getattr(ns, "hbm_cast_weights", False)),
    )
    keep = str(getattr(ns, "keep_activations", "off"))
    try:
        kept = None if keep == "auto" else _kept_count(keep)
        plan = plan_memory(shape, wl, dtype, hbm, host, keep_activation_layers=kept, **store)
    except ValueError as e:
        raise CLIError(str(e).removeprefix("hf_megatrain: ")) from None
    say("\n".join(said))
    say(plan.table())
    result: dict[str, Any] = {"plan": plan}
    if ns.search:
        engine = dict(
            mlp_tile_tokens=wl.mlp_tile_tokens,
            offload_activations=wl.offload_activations,
            boundary_bytes_per_element=wl.boundary_bytes_per_element,
            checkpoint_every=wl.checkpoint_every,
            attention_output_layers=wl.attention_output_layers,
        )
        seqs = max_micro_batch_sequences(
            shape, wl.seq_len, wl.grad_accum, dtype, hbm, host, **engine, **store
        )
        longest = max_seq_len(shape, wl.grad_accum, dtype, hbm, host, **engine, **store)
        n_layers = max_num_layers(shape, wl, dtype, hbm, host, **store)
        result.update(max_sequences=seqs, max_seq_len=longest, max_layers=n_layers)
        big = shape.with_num_layers(n_layers)
        say(
            "\nwhat fits on this memory (same plan rules):\n"
            f"  tokens per step at seq {wl.seq_len}, grad-accum {wl.grad_accum}: "
            + (
                f"{seqs * wl.seq_len * wl.grad_accum} ({seqs} sequence(s) per micro-batch)"
                if seqs
                else "none"
            )
            + f"\n  longest sequence (one per micro-batch, grad-accum {wl.grad_accum}): "
            + (f"{longest} tokens" if longest else "none (below 1024)")
            + f"\n  most layers of this shape at this step: {n_layers} "
            f"({big.total_numel / 1e9:.2f}B params; the config has {shape.num_layers})"
        )
    if not plan.fits:
        raise CLIError(str(plan.problems[0]).removeprefix("hf_megatrain: "))
    return result
