"""``hf-megatrain plan``: the memory plan of a config, before anything is allocated."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

from .cli_common import (
    CLIError,
    check_config_sizes,
    config_from_json,
    error_summary,
    say,
    setup_logging,
)
from .core.options import OptionError, StepShape
from .core.planner import PLANNED_OPTIONS, OptionNamer
from .option_flags import (
    add_option_arguments,
    flag_message,
    flag_name,
    flag_text,
    options_from_namespace,
)

#: How ``plan``'s advice spells engine options: as this command's flags.
CLI_NAMER = OptionNamer(setting=flag_text, option=flag_name, clipping_off="--no-clip")


def add_plan_parser(sub) -> None:
    pl = sub.add_parser(
        "plan",
        help="print the memory plan (HBM/host tiers, PCIe traffic) without building the model",
        description="Plan where each decoder layer's weights and optimizer state live (GPU or "
        "host RAM) for a step of --tokens-per-step tokens, and the largest sequence, step and "
        "model of this shape that fit. Nothing is allocated: parameters are counted on the "
        "meta device. The engine option flags are those of 'train' that the plan depends on.",
    )
    pl.add_argument("model", help="a config.json, or a folder holding one (checkpoint folder)")
    pl.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    pl.add_argument("--tokens-per-step", type=int, required=True, help="tokens per optimizer step")
    pl.add_argument(
        "--micro-batch-tokens", type=int, help="tokens per forward (default: the whole step)"
    )
    pl.add_argument("--grad-accum", type=int, help="micro-batches per step (default: 1)")
    pl.add_argument(
        "--no-clip",
        action="store_true",
        help="plan for training without gradient clipping (max_grad_norm 0): layers update "
        "eagerly during backward and host layers keep no fp32 gradient slot (4 B/param less)",
    )
    pl.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="data-parallel processes (one GPU each) on this host: they share one host store; "
        "--hbm-gib is per GPU, --host-gib the host's",
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
    lora = pl.add_argument_group(
        "LoRA (plan a peft LoRA run on this base: frozen base, resident adapters)"
    )
    lora.add_argument(
        "--lora-r", type=int, help="the adapters' rank (default: no adapters, full training)"
    )
    lora.add_argument(
        "--lora-target-modules",
        default="all-linear",
        help="LoraConfig.target_modules: comma-separated module names, or all-linear (default)",
    )
    lora.add_argument(
        "--lora-dropout", type=float, default=0.0, help="LoraConfig.lora_dropout (default 0)"
    )
    lora.add_argument("--use-dora", action="store_true", help="LoraConfig.use_dora")
    lora.add_argument(
        "--lora-modules-to-save",
        help="LoraConfig.modules_to_save: comma-separated modules trained whole (embed_tokens, "
        "lm_head)",
    )
    add_option_arguments(pl.add_argument_group("engine options"), only=PLANNED_OPTIONS)


def lora_config(ns: argparse.Namespace):
    """The ``peft.LoraConfig`` the plan's ``--lora-*`` flags describe, or None."""
    r = getattr(ns, "lora_r", None)
    if r is None:
        return None
    if r < 1:
        raise CLIError(f"--lora-r {r}: a rank of at least 1")
    if not 0 <= ns.lora_dropout < 1:
        raise CLIError(f"--lora-dropout {ns.lora_dropout:g}: in [0, 1)")
    try:
        from peft import LoraConfig  # noqa: PLC0415
    except ImportError:
        raise CLIError("--lora-r needs peft: pip install 'hf_megatrain[peft]'") from None

    def names(text: str | None) -> list[str] | None:
        return [n.strip() for n in text.split(",") if n.strip()] if text else None

    targets = ns.lora_target_modules
    return LoraConfig(
        r=r,
        target_modules=targets if targets == "all-linear" else names(targets),
        lora_dropout=ns.lora_dropout,
        use_dora=ns.use_dora,
        modules_to_save=names(ns.lora_modules_to_save),
        task_type="CAUSAL_LM",
    )


def _flag_message(message: str) -> str:
    """An options message with the planned options' names spelled as this command's flags."""
    return flag_message(message, PLANNED_OPTIONS)


def plan_config(path: str):
    """The model config of ``hf-megatrain plan``'s argument: a config.json or a folder with one."""
    from transformers import AutoConfig  # noqa: PLC0415

    from .hf.families import (  # noqa: PLC0415
        model_family,
        text_model_type,
        unsupported_model_type,
    )

    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise CLIError(f"{p} has no config.json")
        try:
            cfg = AutoConfig.from_pretrained(str(p), local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise CLIError(f"{p}: could not read config.json: {e}") from None
        if model_family(cfg.model_type) is None:
            text = text_model_type(cfg)
            raise CLIError(unsupported_model_type(str(p), cfg.model_type, "", text))
        check_config_sizes(cfg, str(p / "config.json"))
    elif p.is_file():
        cfg = config_from_json(str(p))
    else:
        raise CLIError(f"config not found: {path} (give a config.json or a folder with one)")
    return cfg


def plan_label(path: str) -> str:
    """The model's name in the plan: a checkpoint folder's (given as the folder or its
    config.json), else the config file's (``cfgs/huge200.json``: huge200, not cfgs)."""
    src = Path(path).resolve()
    if src.is_file():
        return src.parent.name if src.name == "config.json" else src.stem
    return src.name


def model_shape_from_config(cfg, name: str = "model"):
    """``hf.model.model_shape_from_config``, its refusal as a command-line error."""
    return _meta_model_and_shape(cfg, name)[1]


def _meta_model_and_shape(cfg, name: str, lora=None):
    """``cfg``'s meta model (with ``lora``'s adapters: a ``peft.LoraConfig``) and its plan
    shape; a refusal as a command-line error."""
    from .hf.model import UnsupportedModelError, meta_model, model_shape  # noqa: PLC0415

    try:
        model = meta_model(cfg)
        if lora is not None:
            from peft import get_peft_model  # noqa: PLC0415

            try:
                model = get_peft_model(model, lora)
            except ValueError as e:  # (peft's own refusals: a target module the model lacks)
                raise CLIError(f"LoRA: {error_summary(e)}") from None
        return model, model_shape(model, name)
    except UnsupportedModelError as e:
        raise CLIError(str(e).removeprefix("hf_megatrain: ")) from None
    except (ArithmeticError, LookupError, AttributeError, AssertionError) as e:
        # (meta_model lets these through: check_config_builds, as train refuses them)
        raise CLIError(
            f"could not build {cfg.model_type} from this config: {error_summary(e)}"
        ) from None


def _learned_positions(cfg) -> int | None:
    """The longest row ``cfg``'s learned position table takes (None: rotary or ALiBi)."""
    from .hf.guards import learned_position_limit  # noqa: PLC0415
    from .hf.model import meta_model  # noqa: PLC0415

    return learned_position_limit(meta_model(cfg))


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


def _planned_layer_kernels(setting: str, liger: bool, model_type: str, whole_layers: bool):
    """The layer kernels the planned run would use, for a CUDA run: ``--layer-kernels auto``
    means Liger-Kernel's where it is installed here and used for the family automatically, else
    torch.compile'd ones for the families verified with them and those whose layers they
    replace whole (``whole_layers``); ``--liger`` (or ``--layer-kernels liger``) plans with
    Liger's whether installed here or not."""
    from .hf.compiled_kernels import COMPILED_AUTO_MODEL_TYPES  # noqa: PLC0415
    from .hf.long_context import (  # noqa: PLC0415
        LIGER_AUTO_MODEL_TYPES,
        NOT_WHOLE_LAYERS,
        LayerKernels,
        liger_installed,
    )

    if liger or setting == "liger":
        if setting in ("torch", "compiled"):
            raise CLIError(
                f"--liger asks for Liger-Kernel's layer kernels, --layer-kernels {setting} not"
            )
        return LayerKernels("liger", f"asked for, {model_type}")
    if setting == "torch":
        return LayerKernels("torch", "--layer-kernels torch")
    if setting == "compiled":
        return LayerKernels("compiled", f"asked for, {model_type}")
    if liger_installed() and model_type in LIGER_AUTO_MODEL_TYPES:
        return LayerKernels("liger", f"Liger-Kernel installed here, {model_type}")
    if model_type in COMPILED_AUTO_MODEL_TYPES or whole_layers:
        return LayerKernels("compiled", f"torch.compile, {model_type}")
    return LayerKernels("torch", f"{NOT_WHOLE_LAYERS.format(model_type=model_type)}; "
                        "--layer-kernels compiled or --liger plans with them")  # fmt: skip


def compiled_kernels_of(cfg) -> tuple[bool, bool]:
    """Whether the compiled kernels would fuse ``cfg``'s MLPs and run every norm of its layers
    (probed on the config's meta model)."""
    from .hf.model import meta_model  # noqa: PLC0415

    return _compiled_kernels_of(meta_model(cfg))


def _compiled_kernels_of(model) -> tuple[bool, bool]:
    from .hf.compiled_kernels import compiles_norms, fuses_mlp  # noqa: PLC0415

    return fuses_mlp(model), compiles_norms(model)


def planned_kernel_shape(
    cfg, name: str, layer_kernels: str = "auto", liger: bool = False, lora=None
):
    """The model shape a CUDA run of ``cfg`` plans with, and the layer kernels it would use
    (``_planned_layer_kernels``): the fused SwiGLU's smaller saves where Liger's MLP kernel, or
    compiled ones that fuse the family's MLP, run; the compiled norms' where they run; kept
    activations audited as for the run's kernels."""
    from .hf.families import family_key  # noqa: PLC0415
    from .hf.family_memory import kept_bytes_audited  # noqa: PLC0415

    # (One meta model: the shape and the kernel probes read the same skeleton.)
    model, shape = _meta_model_and_shape(cfg, name, lora)
    fuses, norms = _compiled_kernels_of(model)
    family = family_key(cfg.model_type)  # (whose kernels its layers take)
    kernels = _planned_layer_kernels(layer_kernels, liger, family, fuses and norms)
    if kernels.kind == "compiled":
        from .hf.compiled_kernels import check_compiled_kernels_apply  # noqa: PLC0415

        try:  # (as training refuses them when applying them)
            check_compiled_kernels_apply(model)
        except ValueError as e:
            raise CLIError(str(e).removeprefix("hf_megatrain: ")) from None
    if kernels.liger:
        shape = dataclasses.replace(shape, fused_layer_kernels=True)
    elif kernels.kind == "compiled":
        shape = dataclasses.replace(shape, fused_layer_kernels=fuses, compiled_norms=norms)
    audited = kept_bytes_audited(family, shape.fused_layer_kernels or shape.compiled_norms)
    return dataclasses.replace(shape, kept_bytes_audited=audited), kernels


def run_plan(ns: argparse.Namespace) -> dict[str, Any]:
    """``hf-megatrain plan``: print the plan and what fits; return them for tests."""
    import torch  # noqa: PLC0415

    from .core.planner import (  # noqa: PLC0415
        add_margin_only_advice,
        auto_fit_changes,
        max_micro_batch_sequences,
        max_num_layers,
        max_seq_len,
        plan_with_auto_fit,
    )

    nproc = getattr(ns, "nproc", None)
    nproc = 1 if nproc is None else int(nproc)
    if nproc < 1:
        raise CLIError(f"--nproc {nproc}: need at least 1 process")
    try:
        engine = options_from_namespace(ns)
        step = StepShape.from_step(
            ns.seq_len, ns.tokens_per_step, ns.micro_batch_tokens, ns.grad_accum
        )
        # The plan is for a GPU run: what CUDA decides (the optimizer's overlap) plans the same.
        options = engine.resolve(
            clipping=not getattr(ns, "no_clip", False),
            cuda=True,
            single_backward=step.grad_accum == 1 and nproc == 1,
        )
    except OptionError as e:
        raise CLIError(_flag_message(str(e))) from None
    sp = engine.sequence_parallel
    if nproc % sp:
        raise CLIError(
            f"{flag_text('sequence_parallel', sp)}: the ranks sharing a sequence are processes "
            f"of this host: give --nproc as a multiple of {sp}"
        )
    row_len, rows = step.seq_len, step.micro_batch_tokens // step.seq_len
    if sp > 1:
        # As the trainer plans: each rank's layers run on its shard of every row.
        shard = -(-row_len // sp)
        step = StepShape(shard, rows * shard, step.grad_accum)
    hbm, host, said = detected_memory(ns.hbm_gib, ns.host_gib)
    if sp > 1:
        said.append(
            f"sequence parallel {sp}: planned per rank, for its {step.seq_len}-token shard of "
            f"each {row_len}-token row"
        )
    limit = options.host_memory_limit_bytes
    if limit is not None and limit < host:
        # As training: the host store is held to the limit, so the plan counts on no more.
        from .core.host_store import planned_host_bytes  # noqa: PLC0415
        from .core.planner import GIB  # noqa: PLC0415

        host = planned_host_bytes(host, limit)
        said.append(
            f"host RAM planned: {host / GIB:.2f} GiB ({flag_name('host_memory_limit_gb')} "
            f"{options.host_memory_limit_gb:g})"
        )
    cfg = plan_config(ns.model)
    label = plan_label(ns.model)
    setup_logging()
    lora = lora_config(ns)
    name = f"{label} [{cfg.model_type}]" + (f", LoRA r{lora.r}" if lora is not None else "")
    shape, kernels = planned_kernel_shape(
        cfg, name, options.layer_kernels, getattr(ns, "liger", False), lora
    )
    positions = _learned_positions(cfg)
    if positions is not None and row_len > positions:
        # (As train refuses such rows: past the table the embedding lookup fails.)
        raise CLIError(
            f"--seq-len {row_len} is longer than the {positions} positions of this model's "
            f"learned position embeddings: plan rows of at most {positions} tokens"
        )
    trained_positions = getattr(cfg, "max_position_embeddings", None) if positions is None else None
    if trained_positions and row_len > trained_positions:
        # (Training warns the same: rotary positions extend, but past these none was trained.)
        said.append(
            f"note: --seq-len {row_len} is longer than the model's max_position_embeddings="
            f"{trained_positions}: positions past it were never trained; extend the context "
            "deliberately (e.g. rope_scaling) or plan shorter rows"
        )
    said.append(kernels.log_line().replace("hf_megatrain: ", "", 1))
    # The attention the trainer would switch the model to before its plan (on CUDA, as above);
    # the search's longer rows take the choice for rows of any length.
    from .hf.attention import planned_attention  # noqa: PLC0415

    search_shape, _ = planned_attention(shape, cfg, options.attention, 2**62, sequence_parallel=sp)
    shape, attention = planned_attention(
        shape, cfg, options.attention, step.seq_len, sequence_parallel=sp
    )
    said.append(attention.log_line().replace("hf_megatrain: ", "", 1))
    dtype = torch.float32 if ns.fp32 else torch.bfloat16
    where: dict[str, int] = {"ranks": nproc}
    if options.resident_layers != "auto":
        # A count: that many in HBM, as training's builder takes it.
        if options.resident_layers > shape.num_layers:
            raise CLIError(
                f"{flag_text('resident_layers', options.resident_layers)}: the model has "
                f"{shape.num_layers} layers"
            )
        where["hbm_layers"] = options.resident_layers
    if shape.tier_layers < shape.num_layers:  # (the plan caps the tier there, as training does)
        said.append(
            f"HBM tier: at most {shape.tier_layers} layers (the leading ones that train: it holds "
            "optimizer state; a frozen base's layers stream)"
        )
    try:
        plan, as_asked = plan_with_auto_fit(shape, step, options, dtype, hbm, host, **where)
    except ValueError as e:
        raise CLIError(_flag_message(str(e).removeprefix("hf_megatrain: "))) from None
    asked = options  # ("what fits" below: with what auto_fit may turn on, as training would)
    if as_asked is not None:
        said.append(
            f"auto_fit {options.auto_fit}: the step does not fit with the options as given; "
            f"training turns on {auto_fit_changes(plan, as_asked).render(CLI_NAMER)} (planned "
            "below; --auto-fit off plans the options as given)"
        )
        options = plan.options
    say("\n".join(said))
    say(plan.table(CLI_NAMER))
    result: dict[str, Any] = {"plan": plan}
    if ns.search:
        ga = step.grad_accum
        auto = asked.auto_fit != "off"
        # (Seconds to a minute for big models with auto_fit: it plans each option set it allows.)
        say("\nsearching what fits on this memory (--no-search skips this) ...")
        # With the tier the run pins (and its kept-activation count, from the options): what
        # training with these flags accepts.
        search = dict(allow_auto_fit=auto, hbm_layers=where.get("hbm_layers"))
        seqs = max_micro_batch_sequences(
            shape, step.seq_len, ga, asked, dtype, hbm, host, nproc, **search
        )
        longest = max_seq_len(search_shape, ga, asked, dtype, hbm, host, nproc, **search)
        longest *= sp  # (the rows whose shards fit)
        if positions is not None and longest > positions:
            longest = positions  # (memory would fit longer rows; the position table does not)
        n_layers = max_num_layers(shape, step, asked, dtype, hbm, host, nproc, **search)
        result.update(max_sequences=seqs, max_seq_len=longest, max_layers=n_layers)
        big = shape.with_num_layers(n_layers)
        say(
            "\nwhat fits on this memory (same plan rules"
            + (f"; auto_fit {asked.auto_fit}: with the options it may turn on" if auto else "")
            + "):\n"
            f"  tokens per step at seq {row_len}, grad-accum {ga}: "
            + (f"{seqs * row_len * ga} ({seqs} sequence(s) per micro-batch)" if seqs else "none")
            + f"\n  longest sequence (one per micro-batch, grad-accum {ga}): "
            + (f"{longest} tokens" if longest else "none (below 1024)")
            + (
                f" (past max_position_embeddings={trained_positions}: memory only)"
                if trained_positions and longest > trained_positions
                else ""
            )
            + f"\n  most layers of this shape at this step: {n_layers} "
            f"({big.total_numel / 1e9:.2f}B params; the config has {shape.num_layers})"
        )
    if not plan.fits:
        add_margin_only_advice(plan, options, **where)
        raise CLIError(plan.problems[0].message(CLI_NAMER).removeprefix("hf_megatrain: "))
    return result
