"""Turn a Hugging Face decoder model into its streamed form.

The model object stays the user's own ``PreTrainedModel``: its forward (embedding scale, masks,
rotary, soft-capping, MoE routing, loss) runs untouched. Only the decoder layers change: their
parameters move into the host store and are replaced by ``meta`` placeholders, and their
``forward`` becomes a ``StreamedLayer``. Everything outside the layers (embeddings, final norm,
LM head, buffers) stays resident on the compute device as fp32 masters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.allocator import prefer_expandable_segments
from ..core.distributed import DataParallel
from ..core.host_store import (
    DeviceLayerStore,
    HostStore,
    LayerStore,
    available_host_bytes,
    layer_store_bytes,
    layout_slots,
)
from ..core.plan_types import last_recomputed
from ..core.planner import (
    ALL_LAYERS,
    MemoryPlan,
    ModelShape,
    Workload,
    parse_attention_layers,
    plan_memory,
)
from ..core.streamed_layer import StreamedLayer
from ..core.streaming import GRAD_STAGING_SLOTS, StreamingEngine
from .capture import RecorderCapture, recorder_capture_available

logger = logging.getLogger(__name__)

#: Families whose kept-activation bytes the planner counts exactly (or, Phi-3, 2% high), checked
#: against autograd's saved tensors (tests/test_keep_activations.py); Gemma3 too, with its own
#: terms, unless Liger's kernels replace its layers'. Qwen3-MoE saves 25% more and Mixtral 11%
#: (router and expert dispatch, data-dependent): for those "auto" keeps none, as for the families
#: not measured (Gemma2, OLMo, StarCoder2, Cohere, GLM-4, ...).
KEPT_BYTES_AUDITED_MODEL_TYPES = frozenset(
    {"llama", "qwen2", "qwen3", "mistral", "phi3", "granite", "smollm3", "seed_oss"}
)

#: model_type -> short description; each has a tiny-config equivalence test.
SUPPORTED_MODEL_TYPES = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
    "gemma3_text": "Gemma3 (text, sliding + full attention layers)",
    "phi3": "Phi3",
    "qwen3_moe": "Qwen3-MoE (router aux loss keeps its gradient)",
    "mixtral": "Mixtral (router aux loss keeps its gradient)",
    "gemma2": "Gemma2 (sliding + full attention layers, soft-capping)",
    "granite": "Granite (embedding, residual, attention and logit multipliers)",
    "phi": "Phi (parallel attention and MLP, partial rotary)",
    "olmo2": "OLMo 2",
    "olmo3": "OLMo 3 (sliding + full attention layers)",
    "smollm3": "SmolLM3 (NoPE layers)",
    "starcoder2": "StarCoder2",
    "cohere": "Cohere / Command R (parallel attention and MLP)",
    "glm4": "GLM-4",
    "ernie4_5": "ERNIE 4.5 (dense)",
    "helium": "Helium",
    "exaone4": "EXAONE 4",
    "seed_oss": "Seed-OSS",
    "qwen2_moe": "Qwen2-MoE (shared expert; router aux loss keeps its gradient)",
    "olmoe": "OLMoE (router aux loss keeps its gradient)",
    "gpt_oss": "gpt-oss (attention sinks; bf16 checkpoints, not MXFP4; router aux loss kept)",
    "gemma": "Gemma",
    "olmo": "OLMo",
    "stablelm": "StableLM",
    "gpt_neox": "GPT-NeoX / Pythia (parallel attention and MLP)",
    "nemotron": "Nemotron",
    "arcee": "Arcee (AFM)",
    "apertus": "Apertus",
    "hunyuan_v1_dense": "Hunyuan (dense)",
    "lfm2": "LFM2 (short gated convolutions + attention)",
    "granitemoe": "Granite-MoE (router aux loss keeps its gradient)",
    "glm4_moe": "GLM-4.5 MoE (shared expert, grouped routing)",
    "dots1": "dots.llm1 (MoE, shared expert)",
    "deepseek_v2": "DeepSeek-V2 (multi-head latent attention, MoE)",
    "deepseek_v3": "DeepSeek-V3 / Kimi K2 shape (multi-head latent attention, MoE)",
    "falcon": "Falcon (new and old decoder architectures)",
    "bloom": "BLOOM (ALiBi)",
    "mpt": "MPT (ALiBi)",
    "gptj": "GPT-J (parallel attention and MLP)",
    "gpt_bigcode": "GPTBigCode / StarCoder (multi-query attention)",
    "qwen3_next": "Qwen3-Next (Gated DeltaNet linear + gated full attention, MoE)",
}
_MOE_TYPES = {"qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss", "granitemoe"}


class UnsupportedModelError(ValueError):
    """The model cannot be streamed; the message names what is unsupported."""


@dataclass
class StreamedModelState:
    """What hf_megatrain attaches to a streamed model (``model._megatrain``)."""

    engine: StreamingEngine
    store: HostStore
    layers_prefix: str  # e.g. "model.layers"
    resident: list[tuple[str, nn.Parameter, bool]] = field(default_factory=list)
    # The memory plan behind resident_layers="auto" (None for an explicit count): what the run
    # expected to need, for logs and for comparison with the measured peaks.
    plan: MemoryPlan | None = None

    def full_name(self, layer: int, rel: str) -> str:
        return f"{self.layers_prefix}.{layer}.{rel}"


def _liger_patched(module: nn.Module | None) -> bool:
    """Whether ``module`` runs a Liger-Kernel forward: patched onto the instance (the Trainer's
    use_liger_kernel; also under MLP tiling, which keeps the forward it tiles) or its class
    swapped before the model was built (``apply_liger_kernel_to_*()``)."""
    if module is None:
        return False
    forward = module.__dict__.get("forward") or type(module).forward
    forward = getattr(forward, "forward_impl", forward)  # TiledTokenwise
    func = getattr(forward, "__func__", forward)
    return str(getattr(func, "__module__", "")).startswith("liger_kernel")


def model_shape(model: nn.Module, name: str = "model") -> ModelShape:
    """Parameter counts per decoder layer and outside them, for the memory planner.

    Works on a materialized model, on a ``meta`` skeleton and on a streamed model (whose layer
    parameters are ``meta`` placeholders of the right shapes).
    """
    from .loss import FUSED_LOSS_MODEL_TYPES  # noqa: PLC0415 - loss imports this module

    _, layers = find_decoder_layers(model)
    layer_numels = tuple(sum(p.numel() for p in layer.parameters()) for layer in layers)
    # parameters() yields a shared (tied) tensor once, so a tied head is counted once.
    total = sum(p.numel() for p in model.parameters())
    cfg = model.config
    text_cfg = _text_config(cfg)
    # GPT-style configs name the MLP width otherwise or leave it at the 4 x hidden default.
    inter = (
        getattr(text_cfg, "intermediate_size", None)
        or getattr(text_cfg, "n_inner", None)
        or getattr(text_cfg, "ffn_hidden_size", None)
        or 4 * text_cfg.hidden_size
    )
    experts = getattr(text_cfg, "num_experts_per_tok", None)
    moe_inter = getattr(text_cfg, "moe_intermediate_size", None)
    if experts and moe_inter:  # MoE: the active experts' width drives the working set
        inter = experts * moe_inter
    elif experts:
        inter = experts * inter
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    heads = getattr(text_cfg, "num_attention_heads", 0) or 0
    head_dim = getattr(text_cfg, "head_dim", None) or (
        text_cfg.hidden_size // heads if heads else 0
    )
    kv_heads = getattr(text_cfg, "num_key_value_heads", None) or heads
    fused = bool(layers) and _liger_patched(getattr(layers[0], "mlp", None))
    return ModelShape(
        kv_size=kv_heads * head_dim,
        head_dim=head_dim,
        num_heads=heads,
        # Every decoder layer of these families is alike: the first one says.
        qk_norm=bool(layers) and hasattr(getattr(layers[0], "self_attn", None), "q_norm"),
        fused_layer_kernels=fused,
        layer_numels=layer_numels,
        non_layer_numel=total - sum(layer_numels),
        hidden_size=text_cfg.hidden_size,
        vocab_size=text_cfg.vocab_size,
        intermediate_size=inter,
        tied_embeddings=tied,
        fused_loss=cfg.model_type in FUSED_LOSS_MODEL_TYPES,
        kept_bytes_audited=cfg.model_type in KEPT_BYTES_AUDITED_MODEL_TYPES
        # (Liger's Gemma kernels are not audited: the fused count is the Llama family's.)
        or (cfg.model_type == "gemma3_text" and not fused),
        gemma_norms=cfg.model_type == "gemma3_text",
        name=name,
    )


#: Names of the decoder layer list: ``model.layers`` for most families, ``transformer.h`` for
#: the GPT-style ones (Falcon, BLOOM, GPT-J, GPTBigCode), ``transformer.blocks`` for MPT.
_LAYER_LIST_NAMES = ("h", "blocks")


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Locate the decoder layer list (``<base>.layers``, ``.h``, ``.blocks``) of a causal LM
    (PEFT-wrapped too): a ModuleList of ``num_hidden_layers`` modules, the outermost one."""
    n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if (name.endswith("layers") or name.rpartition(".")[2] in _LAYER_LIST_NAMES)
        and isinstance(module, nn.ModuleList)
        and (n_layers is None or len(module) == n_layers)
    ]
    if candidates:
        return min(candidates, key=lambda c: c[0].count("."))
    raise UnsupportedModelError(
        f"hf_megatrain: could not find the decoder layers (a ModuleList of num_hidden_layers "
        f"modules named '*.layers', '*.h' or '*.blocks') in {type(model).__name__}."
    )


def check_supported(model: nn.Module) -> str:
    """Raise ``UnsupportedModelError`` naming the problem, before anything is allocated."""
    if _is_peft(model):
        # LoRA: adapters stay resident and trainable, the frozen base streams.
        peft_types = {
            str(getattr(c.peft_type, "value", c.peft_type)) for c in model.peft_config.values()
        }
        if peft_types != {"LORA"}:
            raise UnsupportedModelError(
                f"hf_megatrain: PEFT method(s) {sorted(peft_types)} are not supported; LoRA is."
            )
        model = model.get_base_model()
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
        raise UnsupportedModelError(
            f"hf_megatrain: model_type '{model_type}' ({type(model).__name__}) is not supported. "
            f"Supported decoder architectures: {supported}."
        )
    if not type(model).__name__.endswith("ForCausalLM"):
        raise UnsupportedModelError(
            f"hf_megatrain: {type(model).__name__} is not a *ForCausalLM model; "
            f"load it with AutoModelForCausalLM."
        )
    if model_type in _MOE_TYPES and not recorder_capture_available():
        raise UnsupportedModelError(
            f"hf_megatrain: {model_type} needs transformers' output recorder to keep the router "
            f"aux-loss gradient, and this transformers version does not have it."
        )
    if getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False):
        raise UnsupportedModelError("hf_megatrain: quantized (8/4-bit) models are not supported.")
    return model_type


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel  # noqa: PLC0415 - optional dependency
    except ImportError:
        return False
    return isinstance(model, PeftModel)


_RANDOM_CONFIG_KEYS = ("dropout", "pdrop", "jitter")  # e.g. attention_dropout, router_jitter_noise


def _text_config(config):
    """The text model's config (the config itself for text-only models)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _residual_norm_weights(layer: nn.Module, streamed: set[str], hidden: int | None) -> list[str]:
    """The layer's residual-stream norm parameters (RMSNorm weights, LayerNorm weights and
    biases; shape (hidden,), the model's own norm class, not a fused kernel's), to be bound in
    fp32: the stock Trainer keeps them fp32, so ``weight * normalized`` on the fp32 stream runs
    as one fp32 kernel there; with the stream copy's bf16 weight it needs a casting kernel (6
    such per layer and step, measured in the 7B kernel trace), and CPU autocast's layer_norm
    refuses a bf16 weight on an fp32 input outright (Phi, StarCoder2). The values stay the
    bf16-rounded ones: the products are bitwise the same. Norms of bf16 tensors (per-head q/k
    norms) are left as they are."""
    names = []
    for mod_name, module in layer.named_modules():
        cls = type(module).__name__
        if (
            not ("RMSNorm" in cls or "LayerNorm" in cls)  # (Nemotron's LayerNorm1P too)
            or cls.startswith("Liger")
            or "forward" in module.__dict__
        ):
            continue
        for attr in ("weight", "bias"):
            p = getattr(module, attr, None)
            name = f"{mod_name}.{attr}" if mod_name else attr
            if isinstance(p, nn.Parameter) and tuple(p.shape) == (hidden,) and name in streamed:
                names.append(name)
    return names


def _has_dropout(config) -> bool:
    """Whether a layer's forward draws random numbers (dropout, MoE router jitter) in training.

    Then the recompute in backward must replay the forward's RNG state, or it would use other
    dropout masks / routes than the forward and the gradients would be wrong.
    """
    for key, value in config.to_dict().items():
        if not any(part in key for part in _RANDOM_CONFIG_KEYS):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return True
    return False


def streamed_names(layer: nn.Module) -> set[str]:
    """The parameters of ``layer`` that go to the host store.

    A layer whose parameters are all trainable or all frozen streams them all. A layer that mixes
    both (LoRA adapters over a frozen base) streams the frozen ones from a frozen store, and its
    trainable ones stay resident on the device with their own optimizer state.
    """
    flags = {n: p.requires_grad for n, p in layer.named_parameters()}
    if all(flags.values()) or not any(flags.values()):
        return set(flags)
    return {n for n, f in flags.items() if not f}


def plan_layers(
    layers: nn.ModuleList, decay_names: set[str], prefix: str
) -> list[tuple[list, int, int]]:
    """Per layer: ``(slots, numel, decay_numel)`` from the layer's streamed parameters."""
    plans = []
    seen: dict[int, str] = {}
    for i, layer in enumerate(layers):
        entries = []
        streamed = streamed_names(layer)
        for rel, p in layer.named_parameters():
            if rel not in streamed:
                continue
            full = f"{prefix}.{i}.{rel}"
            if id(p) in seen:
                raise UnsupportedModelError(
                    f"hf_megatrain: parameter {full} is shared with {seen[id(p)]}; weights shared "
                    f"across decoder layers cannot be streamed."
                )
            seen[id(p)] = full
            entries.append((rel, tuple(p.shape), full in decay_names))
        plans.append(layout_slots(entries))
    return plans


def streamed_state(model: nn.Module) -> StreamedModelState | None:
    return getattr(model, "_megatrain", None)


def prepare_streamed_model(
    model: nn.Module,
    device: torch.device | str,
    compute_dtype: torch.dtype,
    decay_names: set[str] | None = None,
    pin_memory: bool = True,
    host_memory_limit_bytes: int | None = None,
    resident_layers: int | str = 0,
    hbm_reserve_bytes: int = 48 * 2**30,
    plan_workload: Workload | None = None,
    host_grads: bool = True,
    stream_fp32_master: bool = False,
    keep_activations: int | str = "auto",
    hbm_cast_weights: bool = False,
) -> nn.Module:
    """Move ``model``'s decoder layers into a host store and stream them from now on.

    Works on a materialized model (parameters on CPU) and on a skeleton whose layer parameters
    are on ``meta`` (then the weights are filled by ``load_weights_into_store``). Idempotent.
    With ``resident_layers="auto"``, ``plan_workload`` (the step's micro-batch split) lets the
    planner size activations and the loss line by line instead of reserving
    ``hbm_reserve_bytes`` for them.

    ``host_grads=False`` builds host-tier layers without an fp32 gradient slot (4 B/param less):
    only for training with eager layer updates (no clipping; ``HFMegaTrainer`` checks it), whose
    gradients pass through a small staging ring instead. ``stream_fp32_master=True`` keeps no
    compute-dtype copy in the host store (2 B/param less in bf16 runs): the fp32 master crosses
    PCIe (twice the bytes) and is cast on the device. ``keep_activations`` is what the
    memory plan assumes for :func:`keep_activations` ("auto": the planner sizes it).
    ``hbm_cast_weights=True`` gives HBM-tier layers that will not keep their activations no
    compute-dtype copy (bf16 runs: 16 instead of 18 B/param, what stock training keeps, so more
    layers fit): each is cast from its fp32 master into a stream buffer when it runs.
    """
    existing = streamed_state(model)
    if existing is not None:
        return model
    check_supported(model)
    device = torch.device(device)
    # Data parallel (several processes launched): layer weights in host memory shared by the
    # ranks, each layer's gradient and moments only on its owner (core/distributed.py). Set up
    # first, so that "cuda" means this rank's GPU before anything (the planner) touches one.
    dp = DataParallel.from_environment(device)
    if dp is not None and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        prefer_expandable_segments()  # before the HBM tier and the stream buffers are allocated
    if compute_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"hf_megatrain: compute dtype {compute_dtype} is not supported; use bf16 or fp32."
        )
    config = model.config
    config.use_cache = (
        False  # a cache would be written through shared templates: never train with it
    )
    prefix, layers = find_decoder_layers(model)
    decay_names = decay_names if decay_names is not None else set()
    plans = plan_layers(layers, decay_names, prefix)
    streamed = [streamed_names(layer) for layer in layers]
    trainable_store = [
        all(p.requires_grad for n, p in layer.named_parameters() if n in names)
        for layer, names in zip(layers, streamed)
    ]

    shape = model_shape(model) if plan_workload is not None else None
    # An explicit keep count, or None: "auto", the plan's.
    keep_count = None if keep_activations == "auto" else _kept_count(keep_activations)
    n_resident, plan = _resident_layer_count(
        resident_layers,
        plans,
        device,
        compute_dtype,
        hbm_reserve_bytes,
        shape=shape,
        workload=plan_workload,
        hold_grads=host_grads,
        stream_fp32_master=stream_fp32_master,
        keep_activation_layers=keep_count,
        ranks=1 if dp is None else dp.world_size,
        hbm_cast_weights=hbm_cast_weights,
        # What the caller hands over already materialized in host RAM (not meta, not on a GPU).
        input_model_bytes=sum(
            p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu"
        ),
    )
    # The HBM tier holds optimizer state: only leading fully trainable layers qualify.
    n_resident = next((i for i, t in enumerate(trainable_store[:n_resident]) if not t), n_resident)
    # Refuse before allocating anything if host RAM cannot hold the store.
    store_kw = dict(hold_grad=host_grads, stream_master=stream_fp32_master)
    needed = sum(
        layer_store_bytes(numel, compute_dtype, trainable, **store_kw)
        for (_, numel, _), trainable in zip(plans[n_resident:], trainable_store[n_resident:])
    )
    shared: list = [None] * len(plans)
    if dp is not None:
        dp.assign_owners([None if i < n_resident else n for i, (_, n, _) in enumerate(plans)])
        streamed_numels = [numel for _, numel, _ in plans[n_resident:]]
        needed = dp.host_bytes(
            streamed_numels, trainable_store[n_resident:], compute_dtype, host_grads,
            stream_fp32_master,
        )  # fmt: skip
    if not host_grads and device.type == "cuda":
        # The engine's pinned gradient staging ring (per process).
        staged = [n for (_, n, _), t in zip(plans[n_resident:], trainable_store[n_resident:]) if t]
        needed += GRAD_STAGING_SLOTS * 4 * max(staged, default=0)
    HostStore.check_fits(needed, host_memory_limit_bytes)
    if dp is not None:
        shared = dp.allocate_layer_buffers(
            [None if i < n_resident else numel for i, (_, numel, _) in enumerate(plans)],
            compute_dtype,
            stream_fp32_master,
        )

    pin = pin_memory and device.type == "cuda"
    # With hbm_cast_weights only the tier's layers that will keep their activations keep a
    # compute-dtype copy (their kept graph holds the weights); the others are cast on use.
    n_kept = keep_count if keep_count is not None else (plan.kept_layers if plan is not None else 0)
    first_kept = n_resident - min(n_kept, n_resident)
    stores: list[LayerStore | DeviceLayerStore] = []
    for i, (layer, (slots, numel, decay_numel)) in enumerate(zip(layers, plans)):
        if i < n_resident:
            # The first layers go to the HBM tier: the forward runs them while the CPU is still
            # updating the streamed ones.
            store = DeviceLayerStore(
                slots, numel, decay_numel, compute_dtype, device,
                compute_copy=not hbm_cast_weights or i >= first_kept,
            )  # fmt: skip
        else:
            store = LayerStore(
                slots,
                numel,
                decay_numel,
                compute_dtype,
                pin,
                trainable=trainable_store[i],
                shared=shared[i],
                owned=dp is None or dp.owns(i),
                **store_kw,
            )
        named = {n: p for n, p in layer.named_parameters() if n in streamed[i]}
        views = store.param_views(store.master)
        for rel, p in named.items():
            if p.device.type != "meta" and store.owned:  # shared weights: the owner writes
                views[rel].copy_(p.detach().to(torch.float32))
        if store.owned:
            store.refresh_stream_copy()
        _replace_with_meta(layer, streamed[i])
        stores.append(store)

    # Not gated on model.training: from_pretrained returns the model in eval mode and the Trainer
    # switches it to train mode only later, so the flag here says nothing about training.
    if dp is not None:
        dp.barrier()  # every owner has written its layers' initial weights
    engine = StreamingEngine(
        stores, device, compute_dtype, preserve_rng=_has_dropout(config), data_parallel=dp
    )
    layer_prefixes = tuple(f"{prefix}.{i}." for i in range(len(layers)))
    _place_resident(model, device, layer_prefixes)
    capture = RecorderCapture()
    hidden = getattr(_text_config(config), "hidden_size", None)
    for i, layer in enumerate(layers):
        # After _place_resident: the resident tensors are the final device parameters.
        layer_resident = [(n, p) for n, p in layer.named_parameters() if n not in streamed[i]]
        layer.forward = StreamedLayer(
            engine,
            i,
            layer,
            capture=capture,
            trainable=trainable_store[i] and bool(streamed[i]),
            resident=layer_resident,
            fp32_params=_residual_norm_weights(layer, streamed[i], hidden),
        )
    resident = list(_named_resident(model, decay_names))
    model._megatrain = StreamedModelState(
        engine=engine,
        store=HostStore(stores),
        layers_prefix=prefix,
        resident=resident,
        plan=plan,
    )
    logger.info(
        "hf_megatrain: %d layers in HBM, %d streamed (%.2f GiB host store, %s%s%s); "
        "%d resident tensors on %s",
        n_resident,
        len(stores) - n_resident,
        model._megatrain.store.nbytes / 2**30,
        "pinned" if any(s.pinned for s in stores) else "pageable",
        "" if host_grads else ", no grad slots (eager updates)",
        ", fp32 masters stream" if stream_fp32_master else "",
        len(resident),
        device,
    )
    return model


def _resident_layer_count(
    resident_layers: int | str,
    plans: list,
    device: torch.device,
    compute_dtype: torch.dtype,
    hbm_reserve_bytes: int,
    *,
    shape: ModelShape | None = None,
    workload: Workload | None = None,
    hold_grads: bool = True,
    stream_fp32_master: bool = False,
    input_model_bytes: int = 0,
    keep_activation_layers: int | None = 0,
    ranks: int = 1,
    hbm_cast_weights: bool = False,
) -> tuple[int, MemoryPlan | None]:
    """How many leading layers keep their whole state in HBM, and the plan that decided it.

    An int asks for exactly that many. ``"auto"``: the memory planner's choice from the free
    device memory and available host RAM. Without a ``workload`` (the batch is not known yet when
    the model is prepared) ``hbm_reserve_bytes`` stands for activations, logits and the resident
    embeddings; with ``shape`` and ``workload`` those are planned line by line. The plan's table
    is logged either way.
    """
    n = len(plans)
    if resident_layers in (0, "0", None):
        return 0, None
    auto = resident_layers == "auto"
    count = None
    if not auto:
        count = int(resident_layers)
        if not 0 <= count <= n:
            raise ValueError(f"hf_megatrain: resident_layers={count} but the model has {n} layers")
        if shape is None or workload is None or device.type != "cuda":
            return count, None
        # A count with the step's workload known: planned around, so that
        # keep_activations="auto" fills the HBM the count leaves.
    elif device.type != "cuda":
        return 0, None
    free, _ = torch.cuda.mem_get_info(device)
    if shape is None:
        # Only the layer sizes are known here; the reserve covers everything else.
        shape = ModelShape(
            layer_numels=tuple(numel for _, numel, _ in plans),
            non_layer_numel=0,
            hidden_size=0,
            vocab_size=0,
            intermediate_size=0,
            name="streamed model",
        )
    plan = plan_memory(
        shape,
        workload,
        compute_dtype,
        hbm_bytes=free,
        host_bytes=available_host_bytes(),
        hbm_layers=count,
        reserve_bytes=hbm_reserve_bytes if workload is None else 0,
        hold_grads=hold_grads,
        stream_fp32_master=stream_fp32_master,
        input_model_bytes=input_model_bytes,
        keep_activation_layers=keep_activation_layers,
        ranks=ranks,
        hbm_cast_weights=hbm_cast_weights,
    )
    logger.info("hf_megatrain: memory plan (resident_layers=%r)\n%s", resident_layers, plan.table())
    # Host shortfalls are refused by the caller's HostStore.check_fits (which honours the
    # user's host limit); a GPU shortfall means no layer goes to HBM. With the step's
    # workload known, the plan says the activations themselves do not fit: warn now, with
    # the options that would make it fit, instead of letting the first step run out of
    # memory (not an error: the plan's estimates run a few percent high).
    gpu_short = [p for p in plan.problems if p.tier == "gpu"] if workload is not None else []
    for problem in gpu_short:
        logger.warning("%s (planned before training: it may run out of GPU memory)", problem)
    return plan.n_hbm, plan


def _kept_count(value: int | str) -> int:
    """An explicit ``keep_activations`` value ("off" or an integer) as a layer count."""
    if str(value).lower() in ("off", "none", "false", ""):
        return 0
    try:
        count = int(value)
    except ValueError:
        raise ValueError(
            f"hf_megatrain: keep_activations={value!r}: use 'auto', 'off' or a layer count"
        ) from None
    if count < 0:
        raise ValueError(f"hf_megatrain: keep_activations={count} must be >= 0")
    return count


def keep_activations(model: nn.Module, value: int | str) -> int:
    """Let the last HBM-tier layers keep their forward activations (no recompute in backward).

    ``value``: "auto" (the memory plan's count when the model was streamed with a planned
    workload, else 0), "off", or a count of HBM-tier layers. Returns how many keep them. The
    choice can change between steps (it takes effect at the next forward).
    """
    state = streamed_state(model)
    if state is None:
        raise ValueError("hf_megatrain: keep_activations needs a streamed model")
    layers = [layer.forward for layer in find_decoder_layers(model)[1]]
    # Layers cast from their fp32 master into a reused stream buffer cannot keep a graph over
    # their weights, like streamed layers.
    tier = [
        i
        for i, store in enumerate(state.engine.stores)
        if store.resident and not store.casts_on_use
    ]
    if value == "auto":
        count = state.plan.kept_layers if state.plan is not None else 0
    else:
        count = _kept_count(value)
    if count > len(tier):
        raise ValueError(
            f"hf_megatrain: keep_activations={count} but only {len(tier)} layers are in the HBM "
            "tier with their own compute-dtype copy (megatrain_resident_layers, "
            "megatrain_hbm_cast_weights off); streamed layers must recompute, their GPU buffer "
            "is reused by the next layer"
        )
    kept = set(tier[len(tier) - count :]) if count else set()
    _flag_layers(layers, "keep_graph", kept, "their activations (no recompute)")
    return count


def _flag_layers(layers: list, attr: str, chosen: set[int], what: str) -> None:
    """Set ``attr`` on the chosen streamed layers (and clear it on the others); say which."""
    for i, layer in enumerate(layers):
        setattr(layer, attr, i in chosen)
    if chosen:
        logger.info("hf_megatrain: layers %d-%d keep %s", min(chosen), max(chosen), what)


def keep_attention_outputs(model: nn.Module, value: object) -> int:
    """Let the last recomputed layers keep their attention kernel's outputs for the recompute.

    ``value``: "off" (or False), "all" (or True: every recomputed layer), "auto" (the memory
    plan's count when the model was streamed with a planned workload, else 0) or a count
    (capped at the recomputed layers). Call after :func:`keep_activations` (layers that keep
    their whole graph do not recompute). Returns how many keep them; takes effect at the next
    forward.
    """
    state = streamed_state(model)
    if state is None:
        raise ValueError("hf_megatrain: keep_attention_outputs needs a streamed model")
    layers = [layer.forward for layer in find_decoder_layers(model)[1]]
    ask = parse_attention_layers(value)
    recomputed = [i for i, layer in enumerate(layers) if not layer.keep_graph]
    if ask is None:
        if state.plan is None or state.plan.workload is None:
            logger.warning(
                "hf_megatrain: keep_attention_outputs='auto' needs the memory plan of the step "
                "(megatrain_resident_layers 'auto' or a count, on a GPU): no layer keeps them"
            )
        count = state.plan.attention_layers if state.plan is not None else 0
    else:
        count = len(recomputed) if ask == ALL_LAYERS else ask
    keep = set(last_recomputed(recomputed, min(count, len(recomputed))))
    _flag_layers(layers, "keep_attention", keep, "their attention outputs for the recompute")
    return len(keep)


def _named_resident(model: nn.Module, decay_names: set[str]):
    """Parameters that live on the device (streamed ones are ``meta`` placeholders)."""
    for name, p in model.named_parameters():
        if p.device.type != "meta":
            yield name, p, name in decay_names


def _replace_with_meta(layer: nn.Module, names: set[str]) -> None:
    """Swap the named parameters of ``layer`` for ``meta`` placeholders, releasing storage."""
    for mod_name, module in layer.named_modules():
        for pname, p in list(module._parameters.items()):
            full = f"{mod_name}.{pname}" if mod_name else pname
            if p is None or full not in names:
                continue
            placeholder = nn.Parameter(
                torch.empty(p.shape, dtype=torch.float32, device="meta"),
                requires_grad=p.requires_grad,
            )
            module._parameters[pname] = placeholder


def _place_resident(
    model: nn.Module, device: torch.device, layer_prefixes: tuple[str, ...]
) -> None:
    """fp32 masters of the non-streamed parameters, and all buffers, on the compute device.

    Inside decoder layers, ``meta`` parameters are the streamed placeholders and stay so; real
    ones there (LoRA adapters) become resident like the embeddings. Parameters shared between
    modules (tied input/output embeddings) stay shared.
    """
    replaced: dict[int, nn.Parameter] = {}
    for mod_name, module in model.named_modules():
        in_layer = (mod_name + ".").startswith(layer_prefixes)
        for pname, p in list(module._parameters.items()):
            if p is None or (in_layer and p.device.type == "meta"):
                continue
            if id(p) not in replaced:
                if p.device.type == "meta":
                    data = torch.empty(p.shape, dtype=torch.float32, device=device)
                else:
                    data = p.detach().to(device=device, dtype=torch.float32)
                replaced[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
            module._parameters[pname] = replaced[id(p)]
        for bname, b in list(module._buffers.items()):
            if b is not None and b.device.type != "meta":
                module._buffers[bname] = b.to(device)
