"""Long-context and kernel switches for a streamed HF model: sequence tiling of the decoder
layers' MLPs, and Liger-Kernel's fused Triton kernels (the Trainer's ``use_liger_kernel``)."""

from __future__ import annotations

import importlib.util
import inspect
import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..core.tiling import TiledTokenwise
from .compiled_kernels import (
    COMPILED_AUTO_MODEL_TYPES,
    apply_compiled_kernels,
    compile_available,
    compiles_whole_layers,
)
from .families import family_key
from .layers import find_decoder_layers
from .loss import unwrap_peft
from .scoped_globals import confine_global_patches

logger = logging.getLogger(__name__)

#: A ``liger_kernel_config`` of Liger's layer kernels only (fused RMSNorm, RoPE, SwiGLU), not its
#: losses: training batches with labels use hf_megatrain's chunked loss anyway.
LIGER_LAYER_KERNELS = {
    "rope": True,
    "rms_norm": True,
    "swiglu": True,
    "cross_entropy": False,
    "fused_linear_cross_entropy": False,
}


#: Families whose layers ``layer_kernels="auto"`` runs with Liger's kernels: Liger patches every
#: RMSNorm (Qwen3's q/k norms included), the RoPE and the SwiGLU MLP of these layers, the memory
#: plan counts what those kernels save (tests/test_liger.py, tests/test_gpu.py), and they train
#: like the default kernels within bf16 tolerance on the GPU. Other families Liger patches
#: (Gemma's offset norms and GeGLU, MoE experts, ...) run them only when asked for ("liger").
#: Types transformers builds with these families' classes (``model_family``) take them too.
LIGER_AUTO_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

#: Why "auto" runs PyTorch's kernels for a family the fused ones do not replace whole.
NOT_WHOLE_LAYERS = (
    "{model_type}'s norms and MLPs are not all ones the compiled kernels compute exactly "
    "(Llama's RMSNorm and SwiGLU)"
)

#: How to get Liger-Kernel, for messages.
LIGER_INSTALL = "pip install 'hf_megatrain[liger]'"


def liger_installed() -> bool:
    """Whether the ``liger_kernel`` package can be imported (without importing it: Triton)."""
    return importlib.util.find_spec("liger_kernel") is not None


def liger_model_types() -> frozenset[str]:
    """The ``model_type``s Liger-Kernel's instance patching knows (its own table)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN  # noqa: PLC0415

    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def liger_can_run_on(device: torch.device | str) -> bool:
    """Whether Liger-Kernel's Triton kernels run on ``device`` (CUDA only)."""
    return torch.device(device).type == "cuda"


@dataclass(frozen=True)
class LayerKernels:
    """Which kernels a streamed model's layers run, and why: Liger-Kernel's (``liger``), ones
    built by ``torch.compile`` (``compiled``) or PyTorch's eager ops (``torch``)."""

    kind: str
    why: str

    @property
    def liger(self) -> bool:
        return self.kind == "liger"

    @property
    def fused(self) -> bool:
        """Fused norms, SwiGLU and RoPE (the memory plan counts the SwiGLU's smaller saves)."""
        return self.kind != "torch"

    def log_line(self) -> str:
        return f"hf_megatrain: layer kernels: {self.kind} ({self.why})"


def choose_layer_kernels(
    setting: str,
    model_type: str | None,
    device: torch.device | str,
    *,
    requested: bool = False,
    whole_layers: bool = False,
) -> LayerKernels:
    """The ``layer_kernels`` option resolved for a model of ``model_type`` on ``device``.

    ``requested``: the Trainer's ``use_liger_kernel=True``, an explicit request like "liger".
    "auto" takes Liger's kernels where they are installed, run (CUDA) and are used for the
    family automatically (``LIGER_AUTO_MODEL_TYPES``), else compiled ones on CUDA for the
    families verified with them (``COMPILED_AUTO_MODEL_TYPES``) and any whose layers they
    replace whole (``whole_layers``: ``compiles_whole_layers``); an explicit request is an
    error where the kernels cannot run, and Liger's for a family Liger-Kernel does not know
    (the compiled ones probe each module when applied)."""
    if requested and setting in ("torch", "compiled"):
        raise ValueError(
            "hf_megatrain: use_liger_kernel=True asks for Liger-Kernel's layer kernels but "
            f"megatrain_layer_kernels={setting!r} forbids them; drop one of the two."
        )
    cuda = liger_can_run_on(device)
    if requested or setting == "liger":
        asked = "use_liger_kernel=True" if requested else "megatrain_layer_kernels='liger'"
        if not liger_installed():
            raise ImportError(f"hf_megatrain: {asked} needs liger-kernel ({LIGER_INSTALL})")
        if not cuda:
            raise ValueError(
                f"hf_megatrain: {asked}: Liger-Kernel's Triton kernels need a CUDA device, the "
                f"model runs on {torch.device(device).type}"
            )
        if model_type not in liger_model_types():
            raise ValueError(
                f"hf_megatrain: {asked}, but Liger-Kernel has no kernels for model_type "
                f"{model_type!r}"
            )
        return LayerKernels("liger", f"asked for, {model_type}")
    if setting == "torch":
        return LayerKernels("torch", "megatrain_layer_kernels='torch'")
    can_compile, compiler = compile_available(device)
    if setting == "compiled":
        if not can_compile:
            raise ValueError(f"hf_megatrain: megatrain_layer_kernels='compiled': {compiler}")
        # (Which modules compute like them is probed when they are applied.)
        return LayerKernels("compiled", f"asked for, {model_type}")
    kind = torch.device(device).type
    if not cuda:
        return LayerKernels("torch", f"no CUDA device ({kind}): the fused kernels are for CUDA")
    liger_auto = model_type in LIGER_AUTO_MODEL_TYPES
    if liger_installed() and liger_auto and model_type in liger_model_types():
        return LayerKernels("liger", f"Liger-Kernel installed, {model_type}")
    compiles = model_type in COMPILED_AUTO_MODEL_TYPES or whole_layers
    if compiles and can_compile:
        return LayerKernels("compiled", f"torch.compile ({compiler}), {model_type}")
    if compiles:
        return LayerKernels("torch", f"{compiler}; Liger-Kernel not installed: {LIGER_INSTALL}")
    return LayerKernels("torch", f"{NOT_WHOLE_LAYERS.format(model_type=model_type)}; "
                        "megatrain_layer_kernels='liger' asks for Liger-Kernel's")  # fmt: skip


def apply_layer_kernels(
    model: nn.Module,
    setting: str,
    device: torch.device | str,
    *,
    use_liger_kernel: bool = False,
    liger_kernel_config: dict | None = None,
) -> LayerKernels:
    """Resolve ``layer_kernels`` for ``model`` (before it is streamed: the memory plan counts
    the fused kernels) and apply the chosen ones; logs one line saying which and why. With
    ``layer_kernels`` chosen automatically, Liger's layer kernels only (its losses are not
    needed: training batches use hf_megatrain's chunked loss); an explicit
    ``use_liger_kernel`` request keeps its ``liger_kernel_config``."""
    model_type = family_key(_model_type(model))
    # (Probed only where 'auto' may compile: CUDA.)
    cuda = torch.device(device).type == "cuda"
    whole = setting == "auto" and cuda and compiles_whole_layers(unwrap_peft(model))
    choice = choose_layer_kernels(
        setting, model_type, device, requested=use_liger_kernel, whole_layers=whole
    )
    logger.info(choice.log_line())
    if choice.liger:
        config = liger_kernel_config if use_liger_kernel else dict(LIGER_LAYER_KERNELS)
        apply_liger_kernels(model, config)
    elif choice.kind == "compiled":
        apply_compiled_kernels(unwrap_peft(model))
    return choice


def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(unwrap_peft(model), "config", None), "model_type", None)


def liger_layer_kernel_arguments(enabled: bool) -> dict:
    """``use_liger_kernel`` / ``liger_kernel_config`` for Liger's layer kernels, or neither:
    the same keywords for the trainer's arguments and for a streamed loader (whose memory plan
    must know the kernels too)."""
    if not enabled:
        return {"use_liger_kernel": False, "liger_kernel_config": None}
    return {"use_liger_kernel": True, "liger_kernel_config": dict(LIGER_LAYER_KERNELS)}


# Token-wise feed-forward sub-modules by attribute name (MoE blocks route per token too, but
# their router outputs are recorded for the aux loss: left untiled).
_MLP_ATTRS = ("mlp",)
_MOE_MARKERS = ("experts", "gate")


def _takes_one_input(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes exactly one required input (what tiling splits)."""
    params = inspect.signature(module.forward).parameters.values()
    required = [
        p
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return len(required) == 1


def tileable_mlp(layer: nn.Module) -> nn.Module | None:
    """The decoder layer's dense, token-wise MLP module that tiling splits, or None: no such
    module (OPT's and XGLM's layers call fc1 and fc2 themselves; LFM2's and MPT's are named
    otherwise), an MoE block, or an MLP with a second input (BLOOM's adds the residual)."""
    for attr in _MLP_ATTRS:
        mlp = getattr(layer, attr, None)
        if mlp is None or any(hasattr(mlp, m) for m in _MOE_MARKERS):
            continue
        if _takes_one_input(mlp):
            return mlp
    return None


def install_mlp_tiling(model: nn.Module, tile_tokens: int) -> int:
    """Tile every decoder layer's dense MLP along the sequence; returns how many were tiled."""
    if tile_tokens <= 0:
        return 0
    _, layers = find_decoder_layers(model)
    count = tileable = 0
    for layer in layers:
        mlp = tileable_mlp(layer)
        tileable += mlp is not None
        if mlp is not None and not isinstance(mlp.forward, TiledTokenwise):
            mlp.forward = TiledTokenwise(mlp, tile_tokens)
            count += 1
    if not tileable and layers:
        # (found by an audit: an MoE model's layers took the option without a word)
        logger.warning(
            "hf_megatrain: mlp_tile_tokens=%d has no effect: no decoder layer of %s has a dense "
            "MLP to tile (mixture-of-experts layers run each expert on its own tokens)",
            tile_tokens,
            type(model).__name__,
        )
    if count:
        logger.info("hf_megatrain: MLPs of %d layers tiled by %d tokens", count, tile_tokens)
    return count


def apply_liger_kernels(model: nn.Module, kernel_config: dict | None) -> None:
    """Liger-Kernel's fused RMSNorm / RoPE / SwiGLU for the model, as the Trainer's
    ``use_liger_kernel=True`` applies them (``transformers.integrations.liger``), but before the
    model is streamed: the memory plan then counts the fused kernels' smaller saved activations,
    and MLP tiling, installed after, wraps the fused forward (the Trainer's own patching in
    ``train()`` would replace the tiling; HFMegaTrainer skips it). Training batches with labels
    keep hf_megatrain's chunked loss; Liger's fused linear cross-entropy, when configured, only
    serves the model's own forward (evaluation)."""
    # Liger-Kernel also replaces the family's norm and MLP classes and RoPE function in its
    # modeling module: confined, only this model runs them (scoped_globals).
    model_type = _model_type(model)
    family = family_key(model_type)
    quiet_liger_backend_discovery()
    with confine_global_patches(model):
        if family != model_type and liger_installed() and family in liger_model_types():
            _apply_liger_as(family, model, kernel_config)
        else:
            liger_apply_function()(model, kernel_config)
    logger.info("hf_megatrain: Liger kernels applied (%s)", kernel_config or "defaults")


LIGER_REGISTRY_LOGGER = "liger_kernel.backends.registry"


class _OtherBackendImports(logging.Filter):
    """Drops Liger-Kernel's warnings that an op's non-Triton backend (CuTe DSL, Ascend, ...)
    could not be imported: on its first call an op imports every backend it declares, and on a
    CUDA machine without those extras each one warns, though the Triton kernel runs. A Triton
    backend's failure still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Backend impl ") or not record.args:
            return True
        return "._triton" in str(record.args[0])


_BACKEND_FILTER = _OtherBackendImports()


def quiet_liger_backend_discovery() -> None:
    """Installs the filter of :class:`_OtherBackendImports` on Liger's backend registry logger
    (once; applying Liger's kernels calls it)."""
    registry = logging.getLogger(LIGER_REGISTRY_LOGGER)
    if _BACKEND_FILTER not in registry.filters:
        registry.addFilter(_BACKEND_FILTER)


def _apply_liger_as(family: str, model: nn.Module, kernel_config: dict | None) -> None:
    """Liger's instance patching of ``family`` for a model transformers builds with that
    family's classes under another ``model_type`` (InternLM3 and EXAONE as ``LlamaForCausalLM``):
    Liger-Kernel dispatches on ``config.model_type``, so its table is read here with the family,
    and its keywords filtered to the function's as Liger's own dispatch filters them."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN  # noqa: PLC0415

    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN[family]
    accepted = inspect.signature(apply_fn).parameters
    apply_fn(
        model=unwrap_peft(model),
        **{k: v for k, v in (kernel_config or {}).items() if k in accepted},
    )


def liger_apply_function():
    """transformers' ``apply_liger_kernel(model, kernel_config)``, or the same calls on a
    transformers that applies Liger inline in its Trainer."""
    try:
        from transformers.integrations.liger import apply_liger_kernel  # noqa: PLC0415
    except ImportError:
        return _apply_liger_kernel
    return apply_liger_kernel


def _apply_liger_kernel(model: nn.Module, kernel_config: dict | None) -> None:
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance  # noqa: PLC0415
    except ImportError:
        raise ImportError(
            "hf_megatrain: use_liger_kernel=True needs liger-kernel (pip install "
            "'hf_megatrain[liger]')"
        ) from None
    # PEFT: patch the model under the adapters.
    _apply_liger_kernel_to_instance(model=unwrap_peft(model), **(kernel_config or {}))
