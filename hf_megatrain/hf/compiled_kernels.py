"""Fused layer kernels by ``torch.compile``: the decoder layers' RMSNorm, SwiGLU gate and RoPE,
each compiled by Inductor into one Triton kernel forward and one backward.

Without them each of these is a chain of elementwise PyTorch ops, every one a pass over
(tokens x hidden) or (tokens x intermediate) memory: at 64k tokens per step they cost an 8B
model about a sixth of its step (the gap Liger-Kernel's hand-written kernels close). Compiled,
they need no extra package. The functions below restate the families' own arithmetic
(``LlamaRMSNorm.forward``, ``LlamaMLP.forward``'s gate, ``apply_rotary_pos_emb``) as functions
of tensors only: the streamed layer's weights are bound per call, so a compiled function must
take them as inputs (a compiled module would be guarded on its instance: one compile per layer).
Which modules get them is decided by probing, not by family: a norm, an MLP or a RoPE function
is patched only if its own forward, run on small random inputs through a stand-in of it, gives
exactly what the restated function gives (``_computes_like``), once per class. A family whose
arithmetic differs (Gemma's 1 + weight norms, GeGLU, interleaved or partial RoPE where the rest of
the head passes through) keeps its own there. tests/test_compiled_kernels.py checks the patched
models against their families' modules.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from .layers import UnsupportedModelError, find_decoder_layers, forward_function
from .scoped_globals import attention_scopes, original_global, scope_global

logger = logging.getLogger(__name__)

#: Families whose compiled kernels are verified on the GPU (tests/test_gpu.py, benchmarks).
#: ``layer_kernels="auto"`` compiles for any family whose layers the kernels replace whole
#: (``compiles_whole_layers``: every norm and MLP computes exactly like them, bf16 too; these
#: four do), where Liger-Kernel is not installed. ``"compiled"`` asks for them in any family:
#: whatever of its modules passes the probes is patched.
COMPILED_AUTO_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

#: The ``torch.compile`` backend. Tests on the CPU set "aot_eager": the same traced graphs and
#: saved tensors as Inductor's, without a C++ build per graph (half a minute each there).
COMPILE_BACKEND = "inductor"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` as a function of tensors."""
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: ``act_fn(gate_proj(x)) * up_proj(x)`` with SiLU."""
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary(q, k, cos, sin, unsqueeze_dim: int = 1):
    """``apply_rotary_pos_emb`` of the families here."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


_COMPILED: dict[tuple, object] = {}


def compiled(fn):
    """``fn`` compiled (once per backend), with a shape per token count avoided: the token
    dimensions are marked dynamic where a call passes them (``_dynamic``)."""
    key = (fn, COMPILE_BACKEND)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, backend=COMPILE_BACKEND, fullgraph=True)
    return _COMPILED[key]


def _dynamic(t: torch.Tensor, *dims: int) -> torch.Tensor:
    # Token counts change between micro-batches, MLP tiles and evaluation: one graph for all
    # (maybe_: a dimension of size 1 stays specialized without an error).
    for d in dims:
        torch._dynamo.maybe_mark_dynamic(t, d)
    return t


def _norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    shape = hidden_states.shape
    # One 2-D graph for the hidden-size norms and the per-head q/k norms alike.
    flat = _dynamic(hidden_states.reshape(-1, shape[-1]), 0)
    return compiled(rms_norm)(flat, self.weight, self.variance_epsilon).reshape(shape)


def swiglu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    shape = gate.shape
    flat = [_dynamic(t.reshape(-1, shape[-1]), 0) for t in (gate, up)]
    return self.down_proj(compiled(silu_mul)(*flat).reshape(shape))


def _compiled_rotary(original):
    """The family's RoPE function ``original`` with the compiled ``rotary`` where it rotates the
    whole head (a rotation narrower than the head, Phi-3's partial RoPE, stays the family's)."""

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        plain = not args and kwargs.get("unsqueeze_dim", 1) == 1
        if not (plain and cos.shape[-1] == q.shape[-1] == k.shape[-1]):
            return original(q, k, cos, sin, *args, **kwargs)
        for t, dims in ((q, (0, 2)), (k, (0, 2)), (cos, (0, 1)), (sin, (0, 1))):
            _dynamic(t, *dims)  # batch and sequence
        return compiled(rotary)(q, k, cos, sin)

    return apply_rotary_pos_emb


def compile_available(device: torch.device | str) -> tuple[bool, str]:
    """Whether Inductor can build kernels for ``device``: Triton for CUDA (PyTorch's CUDA wheels
    ship it), a C++ compiler for the CPU (slow to build: never chosen automatically there)."""
    kind = torch.device(device).type
    if kind == "cuda":
        if importlib.util.find_spec("triton") is None:
            return False, "Triton is not installed"
        return True, "Triton"
    if kind == "cpu":
        return True, "C++"
    return False, f"torch.compile's Inductor has no kernels for {kind}"


def is_compiled_forward(module: nn.Module | None) -> bool:
    """Whether ``module`` runs a forward of this file (also under MLP tiling)."""
    return module is not None and getattr(forward_function(module), "__module__", None) == __name__


_PROBED: dict[object, bool] = {}


def _computes_like(key: object, run_theirs, run_ours) -> bool:
    """Whether ``run_theirs()`` equals ``run_ours()`` exactly (fp32, small random inputs; once
    per ``key``). Any error in theirs means no."""
    if key not in _PROBED:
        try:
            with torch.no_grad():
                theirs, ours = run_theirs(), run_ours()
            flat = lambda t: t if isinstance(t, tuple) else (t,)  # noqa: E731
            _PROBED[key] = all(
                torch.equal(a, b) for a, b in zip(flat(theirs), flat(ours), strict=True)
            )
        except Exception:  # noqa: BLE001 - a forward that cannot run on the stand-in: not ours
            _PROBED[key] = False
    return _PROBED[key]


def stand_in(module: nn.Module, **parts: nn.Module | nn.Parameter) -> nn.Module:
    """A shallow copy of ``module`` whose parameters / sub-modules ``parts`` are small real ones
    (the module's own may be meta placeholders, and are large)."""
    proxy = copy.copy(module)
    proxy._parameters = dict(module._parameters)
    proxy._modules = dict(module._modules)
    for name, part in parts.items():
        setattr(proxy, name, part)
    return proxy


def _norm_like(module: nn.Module) -> bool:
    """An RMSNorm whose forward is ``rms_norm``'s (Llama's): probed on a stand-in."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
        return False
    g = torch.Generator().manual_seed(0)
    w32 = torch.randn(8, generator=g)
    x32 = torch.randn(3, 8, generator=g)
    # fp32; and as the engine runs them under autocast: bf16 weights over the fp32 residual
    # stream and over bf16 projections (per-head q/k norms), where a norm that multiplies in
    # fp32 and rounds once (OLMo 2's, Helium's) differs from Llama's.
    for x, wd in ((x32, torch.float32), (x32, torch.bfloat16), (x32.bfloat16(), torch.bfloat16)):
        w = nn.Parameter(w32.to(wd))
        proxy = stand_in(module, weight=w)
        if not _computes_like(
            (type(module), "norm", x.dtype, wd),
            lambda proxy=proxy, x=x: type(module).forward(proxy, x),
            lambda w=w, x=x: rms_norm(x, w, eps),
        ):
            return False
    return True


def _swiglu_like(module: nn.Module) -> bool:
    """An MLP whose forward is ``down_proj(silu(gate_proj(x)) * up_proj(x))``: probed on a
    stand-in with small projections."""
    names = ("gate_proj", "up_proj", "down_proj")
    if not all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
        return False
    g = torch.Generator().manual_seed(0)
    h, i = 8, 12
    bias = module.gate_proj.bias is not None
    gate, up, down = nn.Linear(h, i, bias), nn.Linear(h, i, bias), nn.Linear(i, h, bias)
    for lin in (gate, up, down):
        for p in lin.parameters():
            p.data = torch.randn(p.shape, generator=g)
    x = torch.randn(3, h, generator=g)
    proxy = stand_in(module, gate_proj=gate, up_proj=up, down_proj=down)
    return _computes_like(
        (type(module), "mlp"),
        lambda: type(module).forward(proxy, x),
        lambda: down(silu_mul(gate(x), up(x))),
    )


def _rotary_like(fn) -> bool:
    """A RoPE function that, rotating the whole head, is ``rotary``'s."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g)
    cos, sin = torch.randn(1, 3, 8, generator=g), torch.randn(1, 3, 8, generator=g)
    return _computes_like(fn, lambda: fn(q, k, cos, sin), lambda: rotary(q, k, cos, sin))


def _layer_norms(model: nn.Module) -> list[nn.Module]:
    """The decoder layers' norm modules (by class name: RMSNorm, LayerNorm and the like)."""
    _, layers = find_decoder_layers(model)
    return [m for x in layers for m in x.modules() if "norm" in type(m).__name__.lower()]


def compiles_norms(model: nn.Module) -> bool:
    """Whether the compiled kernels would run every norm of ``model``'s decoder layers (each
    computes like Llama's RMSNorm): what the memory plan needs to know before they are applied
    (a ``meta`` model is fine)."""
    norms = _layer_norms(model)
    return bool(norms) and all(_norm_like(m) for m in norms)


def runs_compiled_norms(model: nn.Module) -> bool:
    """Whether every norm of ``model``'s decoder layers runs its compiled kernel now."""
    norms = _layer_norms(model)
    return bool(norms) and all(is_compiled_forward(m) for m in norms)


def fuses_mlp(model: nn.Module) -> bool:
    """Whether the compiled kernels would fuse ``model``'s MLPs (they are SwiGLU ones): what
    the memory plan needs to know before they are applied (a ``meta`` model is fine)."""
    _, layers = find_decoder_layers(model)
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    return bool(mlps) and all(m is not None and _swiglu_like(m) for m in mlps)


def compiles_whole_layers(model: nn.Module) -> bool:
    """Whether the compiled kernels would replace every norm and MLP of ``model``'s decoder
    layers (the RoPE too where it computes like theirs): what ``layer_kernels="auto"`` compiles
    for (Granite, SmolLM3, Seed-OSS, EXAONE 4 and Hunyuan besides Llama, Mistral and Qwen2/3; a
    ``meta`` model is fine). False where no decoder layers are found (the support check says
    why)."""
    try:
        return fuses_mlp(model) and compiles_norms(model)
    except UnsupportedModelError:
        return False


def _compiled_targets(model: nn.Module) -> tuple[list[nn.Module], tuple | None]:
    """What the compiled kernels replace in ``model`` (a ``meta`` model is fine): the norms and
    SwiGLU MLPs of its decoder layers and final norm that compute like them, and the family's
    RoPE function where it does (its modeling module and the function), else None."""
    prefix, layers = find_decoder_layers(model)
    base = model.get_submodule(prefix.rpartition(".")[0])
    roots = [*layers, getattr(base, "norm", None)]
    modules = [
        module
        for root in roots
        if root is not None
        for module in root.modules()
        if _norm_like(module) or _swiglu_like(module)
    ]
    rope = None
    if layers:
        # The family's RoPE is a global of its modeling module (the attention looks it up per
        # call): the compiled one runs only inside this model's attention (scope_global).
        modeling = sys.modules.get(type(layers[0]).__module__)
        family = original_global(modeling, "apply_rotary_pos_emb")
        # the family's own function, not one Liger-Kernel (or another patch) put there
        if getattr(family, "__module__", None) == modeling.__name__ and _rotary_like(family):
            rope = (modeling, family)
    return modules, rope


def check_compiled_kernels_apply(model: nn.Module) -> None:
    """Raise ``ValueError`` (a library refusal) when no norm, MLP or RoPE of ``model`` computes
    like the compiled kernels: ``layer_kernels='compiled'`` cannot apply to it (``train``
    refuses it when applying them, ``plan`` on the config's meta model)."""
    modules, rope = _compiled_targets(model)
    if not modules and rope is None:
        raise ValueError(
            f"hf_megatrain: megatrain_layer_kernels='compiled': no norm, MLP or RoPE of "
            f"{type(model).__name__} computes like the compiled kernels (Llama's RMSNorm, SwiGLU, "
            "RoPE); use 'auto' or 'torch'"
        )


def apply_compiled_kernels(model: nn.Module) -> int:
    """Patch the compiled forwards onto every RMSNorm and SwiGLU MLP of the decoder layers and
    the final norm that compute like them (instances, like Liger-Kernel), and onto the family's
    RoPE function if it does (its module's global, as Liger-Kernel does: the attention forward
    looks it up per call; only the patched models' attention uses it). Returns how many modules
    were patched; raises ``ValueError`` when none computes like these kernels."""
    check_compiled_kernels_apply(model)
    modules, rope = _compiled_targets(model)
    for module in modules:
        forward = _norm_forward if _norm_like(module) else swiglu_forward
        module.forward = types.MethodType(forward, module)
    count = len(modules)
    if rope is not None:
        modeling, family = rope
        scope = attention_scopes(model)
        scope_global(modeling, "apply_rotary_pos_emb", _compiled_rotary(family), scope)
    logger.info(
        "hf_megatrain: %d norms and MLPs%s run torch.compile'd kernels",
        count,
        " and the RoPE" if rope else "",
    )
    return count
