"""Load a Hub-format checkpoint folder straight into the host store.

The model is built on ``meta`` (no weight is materialized), its decoder layers get host-store
buffers, and the safetensors files are read tensor by tensor into those buffers: peak host RSS
stays close to the store's own size, never store + full model.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..core.options import EngineOptions, StepShape
from .attention import apply_attention
from .checkpoint import (
    _checkpoint_files,
    _checkpoint_renamings,
    _rename,
    check_checkpoint_files,
    drop_ignored_keys,
    drop_other_towers,
    load_weights_into_store,
    resolve_checkpoint_key,
)
from .families import (
    model_family,
    text_model_type,
    unsupported_model_type,
)
from .hub import resolve_model_folder
from .long_context import apply_layer_kernels
from .model import (
    UnsupportedModelError,
    _is_peft,
    find_decoder_layers,
    layer_kernels_of,
    prepare_frozen_streamed_model,
    prepare_streamed_model,
    streamed_state,
)

logger = logging.getLogger(__name__)


def attention_for(config, attn_implementation: str | None) -> str | None:
    """The loaders' default, SDPA, where the model class has it; else transformers' own default
    (eager), with a warning: gpt-oss's attention sinks, for one, have no SDPA path."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if attn_implementation == "sdpa" and not getattr(model_class, "_supports_sdpa", True):
        logger.warning(
            "hf_megatrain: %s has no SDPA attention; it runs transformers' default (eager)",
            model_class.__name__,
        )
        return None
    return attn_implementation


def _split_options(
    options: EngineOptions | None, kwargs: dict[str, Any]
) -> tuple[EngineOptions, dict[str, Any]]:
    """``options`` with the option fields among ``kwargs`` applied, and the other ``kwargs``."""
    names = set(EngineOptions.field_names())
    fields = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    base = options if options is not None else EngineOptions()
    return (base.with_(**fields) if fields else base), kwargs


def streamed_skeleton(
    config,
    options: EngineOptions,
    *,
    device,
    bf16: bool,
    attn_implementation: str | None,
    step: StepShape | None,
    clipping: bool,
    use_liger_kernel: bool,
    liger_kernel_config: dict | None,
    trainable: bool = True,
):
    """``AutoModelForCausalLM`` for ``config`` built on meta, its layers given host-store buffers
    (weights-only frozen stores when not ``trainable``)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config,
            attn_implementation=attention_for(config, attn_implementation),
            dtype=torch.float32,
        )
    # Under init_empty_weights the LM head is not tied to the embedding yet; tie it now, or a
    # tied checkpoint (which stores only the embedding) would leave the head without weights.
    model.tie_weights()
    # Before streaming, as the trainer does for a model it streams itself: the memory plan made
    # here counts the fused kernels' smaller activations and working set, and the attention's.
    seq_len = step.seq_len if step is not None else options.plan_seq_len
    apply_attention(
        model, options.attention, device, seq_len, sequence_parallel=options.sequence_parallel
    )
    apply_layer_kernels(
        model, options.layer_kernels, device, use_liger_kernel=use_liger_kernel,
        liger_kernel_config=liger_kernel_config,
    )  # fmt: skip
    if not trainable:
        return prepare_frozen_streamed_model(
            model, device, torch.bfloat16 if bf16 else torch.float32, options
        )
    prepare_streamed_model(
        model,
        device,
        torch.bfloat16 if bf16 else torch.float32,
        options,
        step=step,
        clipping=clipping,
    )
    return model


def load_streamed_model(
    path: str,
    options: EngineOptions | None = None,
    *,
    device: torch.device | str | None = None,
    bf16: bool = True,
    step: StepShape | None = None,
    clipping: bool = True,
    use_liger_kernel: bool = False,
    liger_kernel_config: dict | None = None,
    trainable: bool = True,
    **kwargs,
):
    """Build ``AutoModelForCausalLM`` for ``path`` in streamed form and load its weights.

    Args:
        path: a local folder with ``config.json`` and safetensors weights (Hub layout), or a
            Hugging Face Hub repo id (``"Qwen/Qwen2.5-7B"``): taken from the local cache, else
            downloaded (config, safetensors and tokenizer files only) unless ``HF_HUB_OFFLINE``.
            A ``revision=`` keyword picks the Hub revision (branch, tag or commit).
        options: the engine options (:class:`hf_megatrain.EngineOptions`); any of its fields may
            also be given as a keyword (``resident_layers="auto"``, ``host_memory_limit_gb=64``),
            applied over ``options``. Pass the same options as the trainer's ``megatrain_*``
            arguments: the model remembers them.
        device: compute device; default ``cuda`` when available, else ``cpu``.
        bf16: stream bf16 weights (fp32 masters and moments either way); ``False`` for fp32.
        step: the step's shape (:class:`hf_megatrain.StepShape`) for the memory plan to size
            activations for (with ``resident_layers`` "auto" or a count); default: a reserve.
        clipping: whether training will clip gradients (``max_grad_norm > 0``): without it the
            layers update eagerly and host stores keep no gradient slot (``host_grads``).
        use_liger_kernel, liger_kernel_config: apply Liger-Kernel's fused kernels before the
            memory plan is made, as ``TrainingArguments.use_liger_kernel`` would (pass the same
            values as the trainer's arguments): the plan then counts their smaller activations.
        trainable: ``False`` loads a frozen model that is only ever run forward (e.g. a DPO
            reference, ``MegaDPOTrainer(ref_model=...)``): its layers stream from weights-only
            stores in the compute dtype (2 bytes/param in bf16, no master, gradient or moments),
            its other parameters a frozen fp32 copy on the device; ``step`` and ``clipping`` do
            not apply.
        kwargs: other keywords are set on the config before the model is built (e.g.
            ``attn_implementation``, default "sdpa").
    """
    options, config_overrides = _split_options(options, kwargs)
    attn = config_overrides.pop("attn_implementation", "sdpa")
    path = resolve_model_folder(path, revision=config_overrides.pop("revision", None))
    check_model_type(path)
    config = AutoConfig.from_pretrained(path, **config_overrides)
    check_quantization(config, path)
    # Before the store is allocated: a missing, truncated or unreadable shard, and checkpoint
    # tensors that do not fit the model (missing, unexpected, another shape), from the headers.
    check_checkpoint_files(path)
    check_checkpoint_tensors(config, path)
    model = streamed_skeleton(
        config, options, device=device, bf16=bf16, attn_implementation=attn, step=step,
        clipping=clipping, use_liger_kernel=use_liger_kernel,
        liger_kernel_config=liger_kernel_config, trainable=trainable,
    )  # fmt: skip
    load_weights_into_store(model, path)
    model.eval()  # as from_pretrained returns it (the trainer turns training mode on)
    return model


def check_quantization(config, path: str) -> None:
    """Refuse a quantized checkpoint before the store is allocated and gigabytes are read (packed
    low-bit tensors, e.g. gpt-oss's MXFP4 experts, are no fp32 master weights), reading its
    ``quantization_config`` as ``from_pretrained`` does (transformers' quantizers/auto.py): one
    without a ``quant_method`` (``{}`` included) is refused as there; one of a method transformers
    does not know is skipped with a warning, and the weights load as they are stored."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    quant = getattr(config, "quantization_config", None) or getattr(
        text, "quantization_config", None
    )
    if quant is None:
        return
    if not isinstance(quant, dict):  # a transformers QuantizationConfig
        method = getattr(quant, "quant_method", None) or type(quant).__name__
    elif quant.get("load_in_8bit") or quant.get("load_in_4bit"):
        method = "bitsandbytes_4bit" if quant.get("load_in_4bit") else "bitsandbytes_8bit"
    else:
        method = quant.get("quant_method")
        if method is None:
            raise ValueError(
                f"hf_megatrain: {path}: config.json's quantization_config "
                f"{json.dumps(quant, default=str)} has no quant_method, and from_pretrained "
                "refuses it too; if the weights are not quantized, delete quantization_config "
                "from config.json"
            )
        known = _known_quant_methods()
        if known is not None and str(method) not in known:
            logger.warning(
                "hf_megatrain: %s: config.json names an unknown quantization type %r: it is "
                "skipped and the weights load as stored, as from_pretrained does (delete "
                "quantization_config from config.json to remove this warning)",
                path,
                method,
            )
            return
    method = getattr(method, "value", method)
    raise UnsupportedModelError(
        f"hf_megatrain: {path} is a quantized checkpoint ({method}); full-precision training "
        "starts from bf16/fp16/fp32 weights: use the model's unquantized (e.g. BF16) release"
    )


def _known_quant_methods() -> set[str] | None:
    """The quant_method values transformers loads (its registered quantization configs); None
    where this version has no such table (then every method counts as a quantization)."""
    try:
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING  # noqa: PLC0415
    except ImportError:
        return None
    return {str(getattr(k, "value", k)) for k in AUTO_QUANTIZATION_CONFIG_MAPPING}


def check_model_type(path: str) -> None:
    """Refuse, in one line, a folder whose ``config.json`` names a model_type hf_megatrain does
    not stream (custom code behind ``auto_map`` included), or a ``quantization_config`` that is
    not a mapping, before transformers is asked to resolve it (whose errors span lines, and which
    would prompt to run the custom code)."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"hf_megatrain: {path} has no config.json: not a Hub-format model folder")
    try:
        with open(file) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"hf_megatrain: {file} is not valid JSON ({e})") from None
    quant = raw.get("quantization_config") if isinstance(raw, dict) else None
    if quant is not None and not isinstance(quant, dict):
        # AutoConfig (and so from_pretrained) fails on it with an AttributeError traceback.
        raise ValueError(
            f"hf_megatrain: {file}: quantization_config is {json.dumps(quant)}, not a mapping "
            "(transformers cannot read this config either); delete it if the weights are not "
            "quantized"
        )
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type is None:
        return  # (transformers decides; the model is checked when streamed)
    if model_family(model_type) is not None:
        return
    custom = " (custom code: config.json's auto_map)" if raw.get("auto_map") else ""
    raise UnsupportedModelError(
        unsupported_model_type(f"hf_megatrain: {path}", model_type, custom, text_model_type(raw))
    )


def _headers(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every checkpoint tensor's shape and file, from the safetensors headers alone."""
    from safetensors import safe_open  # noqa: PLC0415

    out = {}
    for file in _checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                out[key] = (tuple(f.get_slice(key).get_shape()), file)
    return out


def _same_values(a: tuple[str, str], b: tuple[str, str], rows_per_chunk: int = 4096) -> bool:
    """Whether checkpoint tensors ``a`` and ``b`` (key, file) hold equal values (compared in
    fp32, as ``from_pretrained`` compares the loaded parameters), a few rows at a time."""
    from safetensors import safe_open  # noqa: PLC0415

    with safe_open(a[1], framework="pt") as fa, safe_open(b[1], framework="pt") as fb:
        sa, sb = fa.get_slice(a[0]), fb.get_slice(b[0])
        shape = tuple(sa.get_shape())
        if shape != tuple(sb.get_shape()):
            return False
        rows = shape[0] if shape else 1
        for i in range(0, rows, rows_per_chunk):
            x = sa[i : i + rows_per_chunk] if shape else sa[:]
            y = sb[i : i + rows_per_chunk] if shape else sb[:]
            if not torch.equal(x.to(torch.float32), y.to(torch.float32)):
                return False
    return True


def check_checkpoint_tensors(config, path: str) -> None:
    """Match the checkpoint's tensors (headers only) to ``config``'s model built on meta, as
    :func:`load_weights_into_store` will: raises ``ValueError`` (one line) for a missing tensor,
    an unexpected one, or another shape, before anything is allocated.

    A config that ties the LM head to the embedding, with both in the checkpoint holding
    different values, is untied (``config.tie_word_embeddings = False``) with a warning, as
    ``from_pretrained`` does, rather than one overwriting the other."""
    with init_empty_weights(include_buffers=False):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    meta.tie_weights()
    prefix = getattr(meta, "base_model_prefix", "model") or "model"
    renamings = _checkpoint_renamings(meta)
    targets: dict[str, torch.Tensor] = dict(meta.named_parameters(remove_duplicate=False))
    optional: set[int] = set()
    for mod_name, module in meta.named_modules():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf_name not in module._non_persistent_buffers_set:
                full = f"{mod_name}.{buf_name}" if mod_name else buf_name
                targets.setdefault(full, buf)
                optional.add(id(buf))
    found: dict[str, tuple[str, str]] = {}  # target name -> (checkpoint key, file)
    filled: set[int] = set()
    unknown: list[str] = []
    for key, (shape, file) in _headers(path).items():
        hit = resolve_checkpoint_key(_rename(key, renamings), targets, prefix)
        hit = hit or resolve_checkpoint_key(key, targets, prefix)
        if hit is None:
            unknown.append(key)
            continue
        name, index = hit
        dest = targets[name]
        want = tuple((dest if index is None else dest[index]).shape)
        if shape != want:
            raise ValueError(
                f"hf_megatrain: checkpoint tensor {key} ({os.path.basename(file)}) has shape "
                f"{shape}, the model expects {want}"
            )
        found.setdefault(name, (key, file))
        filled.add(id(dest))
    if unknown and config.get_text_config() is not config:  # a multimodal config (Llama 4's)
        unknown = drop_other_towers(unknown, meta, prefix, path)
    unknown = drop_ignored_keys(unknown, meta)
    if unknown:
        raise ValueError(
            f"hf_megatrain: {len(unknown)} checkpoint tensors in {path} do not match the "
            f"{type(meta).__name__} model, e.g. {unknown[:5]}"
        )
    missing = [n for n, t in targets.items() if id(t) not in filled and id(t) not in optional]
    if missing:
        raise ValueError(
            f"hf_megatrain: the checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:5]}"
        )
    tied = getattr(meta, "all_tied_weights_keys", None) or {}
    for target, source in tied.items():
        if target in found and source in found and not _same_values(found[target], found[source]):
            logger.warning(
                "hf_megatrain: config.json ties %s to %s, but the checkpoint holds both with "
                "different values: loading them untied (tie_word_embeddings=False), as "
                "from_pretrained does",
                target,
                source,
            )
            config.tie_word_embeddings = False
            # (A multimodal config's text model reads its own flag: Llama 4's.)
            config.get_text_config().tie_word_embeddings = False


def frozen_streamed_copy(
    model: torch.nn.Module,
    options: EngineOptions | None = None,
    *,
    device: torch.device | str | None = None,
    bf16: bool = True,
    use_liger_kernel: bool = False,
    liger_kernel_config: dict | None = None,
) -> torch.nn.Module:
    """A frozen streamed copy of ``model``'s current weights, e.g. a DPO reference model.

    ``model``: a materialized ``*ForCausalLM`` or a streamed one (its host store's weights); it
    is left as it is. The copy is the same architecture built on ``meta``: its decoder layers
    stream from weights-only host stores in the compute dtype (bf16, or fp32 with
    ``bf16=False``; 2 or 4 bytes/param of host RAM, no master, gradient or AdamW moments), its
    other parameters (embeddings, final norm, LM head) are a frozen fp32 copy on ``device``, as
    a streamed model's resident parameters are. Its forward computes what the source's own
    streamed forward computes with these weights, bit for bit (in bf16, the bf16 copy of the
    fp32 masters is exactly what a streamed model's forward streams). Every parameter has
    ``requires_grad=False``; run it under ``torch.no_grad()``. Of ``options``, ``pin_memory``,
    ``host_memory_limit_gb`` and ``mlp_tile_tokens`` apply; ``use_liger_kernel`` and
    ``liger_kernel_config`` as in :func:`load_streamed_model` (the source's trainer's values, so
    both run the same kernels).
    """
    if _is_peft(model):
        raise UnsupportedModelError(
            "hf_megatrain: frozen_streamed_copy of a PEFT model is not supported; merge its "
            "adapters first (under LoRA the reference is the base with adapters disabled)"
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    state = streamed_state(model)
    if state is not None:
        # A background optimizer update may still be writing the store.
        state.engine.wait_all_weights()
        stores = state.store.layers

        def layer_weights(i: int) -> dict[str, torch.Tensor]:
            return stores[i].param_views(stores[i].master)
    else:
        _, source_layers = find_decoder_layers(model)

        def layer_weights(i: int) -> dict[str, torch.Tensor]:
            return dict(source_layers[i].named_parameters())

    config = copy.deepcopy(model.config)
    attn = getattr(config, "_attn_implementation", None)
    with init_empty_weights(include_buffers=False):
        copy_model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn, dtype=torch.float32
        )
    copy_model.tie_weights()
    # The source's kernels: a streamed source already runs Liger's, compiled or eager ones
    # (chosen when it was streamed); otherwise the options decide, as they will for the source.
    setting = (options or EngineOptions()).layer_kernels
    if state is not None and not use_liger_kernel:
        setting = layer_kernels_of(model)
    apply_layer_kernels(
        copy_model,
        setting,
        device,
        use_liger_kernel=use_liger_kernel,
        liger_kernel_config=liger_kernel_config,
    )
    prepare_frozen_streamed_model(
        copy_model,
        device,
        torch.bfloat16 if bf16 else torch.float32,
        options,
        layer_weights=layer_weights,
    )
    # The resident parameters and the buffers, by name (tied weights appear once in both).
    source_params = dict(model.named_parameters())
    source_buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, p in copy_model.named_parameters():
            if p.device.type != "meta":
                p.copy_(source_params[name])
        for mod_name, module in copy_model.named_modules():
            for b_name, buf in list(module._buffers.items()):
                full = f"{mod_name}.{b_name}" if mod_name else b_name
                if buf is not None and full in source_buffers:
                    # As the source's own (its dtype), on the copy's device.
                    source = source_buffers[full].detach()
                    module._buffers[b_name] = source.to(buf.device, copy=True)
    copy_model.eval()
    return copy_model


def init_streamed_model(
    config,
    options: EngineOptions | None = None,
    *,
    device: torch.device | str | None = None,
    bf16: bool = True,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    step: StepShape | None = None,
    clipping: bool = True,
    use_liger_kernel: bool = False,
    liger_kernel_config: dict | None = None,
    **option_fields,
):
    """A randomly initialized streamed model for ``config``, never materialized as a whole.

    The model's own ``_init_weights`` writes each decoder layer's initial values straight into
    its fp32 master in the host store (the layer is bound to those buffers while it runs), and
    the resident parts' values on the device. Peak host RAM is the store itself, so a model whose
    fp32 copy would not fit next to the store can still start from scratch. Arguments as in
    :func:`load_streamed_model` (keywords other than those are option fields).
    """
    options, unknown = _split_options(options, option_fields)
    if unknown:
        raise TypeError(f"init_streamed_model: unknown argument(s) {', '.join(sorted(unknown))}")
    model = streamed_skeleton(
        config, options, device=device, bf16=bf16, attn_implementation=attn_implementation,
        step=step, clipping=clipping, use_liger_kernel=use_liger_kernel,
        liger_kernel_config=liger_kernel_config,
    )  # fmt: skip
    torch.manual_seed(seed)
    init_streamed_weights(model, model._init_weights)
    return model


def init_streamed_weights(
    model: torch.nn.Module,
    init_weights: Callable[[torch.nn.Module], None],
    skip: Callable[[str], bool] = lambda name: False,
) -> None:
    """Run ``init_weights`` (a model's ``_init_weights``) on every module of a streamed model.

    Each decoder layer runs bound to its store's fp32 master, so the values land straight in the
    host store (or the HBM tier); the other modules are initialized in place. Modules whose
    dotted name ``skip`` accepts are left alone (e.g. LoRA adapters already initialized).
    """
    from torch.nn.utils.stateless import _reparametrize_module  # noqa: PLC0415

    from .model import find_decoder_layers, streamed_state  # noqa: PLC0415

    state = streamed_state(model)
    _, layers = find_decoder_layers(model)
    engine_device = state.engine.device
    # On CUDA the host layers' values are drawn on the GPU (into one scratch buffer, then copied
    # into the host master): the CPU's normal_ draws ~0.1-0.2 G values/s on one core, a minute
    # or more of start-up for a 7B-14B model; the GPU takes milliseconds and PCIe seconds.
    # Same distributions, other draws than a CPU init (seeded and reproducible either way).
    scratch = None
    if engine_device.type == "cuda":
        host_numels = [s.numel for s in state.store.layers if s.master.device.type == "cpu"]
        if host_numels:
            scratch = torch.empty(max(host_numels), dtype=torch.float32, device=engine_device)
    with torch.no_grad():
        for layer, store in zip(layers, state.store.layers):
            on_host = store.master.device.type == "cpu"
            if scratch is not None and on_host:
                # Zeroed: a parameter the model's _init_weights leaves alone must come out as
                # on the CPU path (the fresh, zero master), not as the previous layer's values.
                target = scratch[: store.numel].zero_()
            elif store.owned:
                target = store.master
            else:
                target = torch.empty_like(store.master)
            # Data parallel: every rank draws every layer's values (the RNG stream of one
            # process), only the layer's owner writes them into the shared master.
            with _reparametrize_module(layer, store.param_views(target)):
                for name, module in layer.named_modules():
                    if not skip(name):
                        init_weights(module)
            if store.owned:
                if target is not store.master:
                    store.master.copy_(target)  # synchronous: the scratch is reused next
                store.refresh_stream_copy()
        in_layers = {id(m) for layer in layers for m in layer.modules()}
        for name, module in model.named_modules():
            if id(module) not in in_layers and not skip(name):
                init_weights(module)
    state.engine.invalidate_weights()
    if state.engine.dp is not None:
        state.engine.dp.barrier()  # every owner has written its layers
