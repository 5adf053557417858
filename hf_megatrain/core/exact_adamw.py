"""AdamW on a CUDA device that rounds exactly as torch's fused CPU AdamW.

Device updates (``device_update_lead``) let the GPU update a host layer the CPU AdamW has not
reached in time. Which layers it takes depends on timing, so unless both devices round alike a
run's result would depend on timing too. torch's CUDA fused AdamW does not round as its CPU
kernel does (another operation order, other fused multiply-adds); this one does.

The CPU kernel (``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``, its vectorized fp32 path, as
the compiler contracts it) computes, each operation rounded to fp32 once::

    g = g / grad_scale                                  (where a scale is given)
    p = p * f32(1 - lr * weight_decay)                  (where weight_decay != 0)
    m = fma(c1, g - m, m)                               (c1 = f32(1 - beta1) below 0.5; else
                                                         fma(c1 - 1, g - m, g))
    v = fma(f32(1 - beta2) * g, g, v * f32(beta2))
    p = p + (f32(-lr / (1 - beta1^step)) * m) / (sqrt(v) / f32(sqrt(1 - beta2^step)) + f32(eps))

except in the last ``numel % 8`` elements of a call, which its scalar loop updates, where
``v = fma(v, f32(beta2), (f32(1 - beta2) * g) * g)`` (the vector loop leaves ``numel % W``
elements, ``W`` the CPU's fp32 vector width; the compiler runs 8 of them at a time in vectors of
its own, contracted as the vector loop). The optimizer calls both kernels on the same slices in
chunks of a multiple of ``W``, so the tails fall on the same elements. That is torch 2.13's x86
build (AVX2 and AVX-512); how the second moment's multiplies and add are contracted, and how
much of the scalar loop the compiler vectorizes, are its compiler's choices
(``DOCUMENTED_ROUNDING``, ``SECOND_MOMENT_ORDERS``).

The Triton kernel below spells each of those as one PTX instruction with round-to-nearest
(``.rn`` keeps the assembler from fusing a multiply into an add). :func:`matches_cpu_adamw`
checks it bitwise against the CPU kernel once per device and process, trying each contraction
of the second moment in the vector loop and in the tail, and tail lengths (the documented
rounding first), before any device update uses it; ``tests/test_exact_adamw.py`` pins the
documented rounding against the CPU kernel on CPU.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

logger = logging.getLogger(__name__)

_BLOCK = 2048

#: How a build may contract the second moment ``v * beta2 + (1 - beta2) * g * g`` (the kernel's
#: ``ORDER`` index): fused into the gradient's product, fused into the decayed moment, or not.
SECOND_MOMENT_ORDERS = ("fma((1-b2) g, g, v b2)", "fma(v, b2, (1-b2) g g)", "v b2 + (1-b2) g g")
#: The CPU kernel's rounding: the second moment's order in its vectors and in its scalar tail
#: (``SECOND_MOMENT_ORDERS`` indices) and the tail's length as the call's length modulo this.
DOCUMENTED_ROUNDING = (0, 1, 8)
#: Per device, the rounding its check found (the documented one until then).
_rounding: dict[torch.device, tuple[int, int, int]] = {}


@functools.cache
def _kernel():
    """The Triton kernel, or None where Triton is not importable."""
    # Module-global: Triton evaluates a jit function's annotations (strings here, with
    # postponed evaluation) in its module's globals, where a local import is not seen.
    global tl
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _binary(a, b, asm: tl.constexpr):
        return tl.inline_asm_elementwise(
            asm, "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )

    @triton.jit
    def _fma(a, b, c):
        return tl.inline_asm_elementwise(
            "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", [a, b, c],
            dtype=tl.float32, is_pure=True, pack=1,
        )  # fmt: skip

    @triton.jit
    def _sqrt(a):
        return tl.inline_asm_elementwise(
            "sqrt.rn.f32 $0, $1;", "=f,f", [a], dtype=tl.float32, is_pure=True, pack=1
        )

    @triton.jit
    def _second_moment(v, g, grad_part, beta2, ORDER: tl.constexpr):
        # SECOND_MOMENT_ORDERS, by index.
        if ORDER == 0:
            out = _fma(grad_part, g, _binary(v, beta2, "mul.rn.f32 $0, $1, $2;"))
        elif ORDER == 1:
            out = _fma(v, beta2, _binary(grad_part, g, "mul.rn.f32 $0, $1, $2;"))
        else:
            out = _binary(
                _binary(v, beta2, "mul.rn.f32 $0, $1, $2;"),
                _binary(grad_part, g, "mul.rn.f32 $0, $1, $2;"),
                "add.rn.f32 $0, $1, $2;",
            )
        return out

    # (Not specialized on the sizes' divisibility: no compile on the training thread for a size
    # the check did not meet.)
    @triton.jit(do_not_specialize=["n", "call_len", "tail_len"])
    def adamw(
        p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, n, call_len, tail_len,
        wd_factor, lerp_coeff, one_minus_beta2, beta2, bc2_sqrt, eps, neg_step_size,
        HAS_SCALE: tl.constexpr, HAS_DECAY: tl.constexpr, LERP_FROM_GRAD: tl.constexpr,
        VECTOR_ORDER: tl.constexpr, TAIL_ORDER: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        if HAS_SCALE:
            g = _binary(g, tl.load(scale_ptr), "div.rn.f32 $0, $1, $2;")
        if HAS_DECAY:
            p = _binary(p, wd_factor, "mul.rn.f32 $0, $1, $2;")
        diff = _binary(g, m, "sub.rn.f32 $0, $1, $2;")
        if LERP_FROM_GRAD:
            m = _fma(lerp_coeff, diff, g)
        else:
            m = _fma(lerp_coeff, diff, m)
        grad_part = _binary(one_minus_beta2, g, "mul.rn.f32 $0, $1, $2;")
        vector = _second_moment(v, g, grad_part, beta2, VECTOR_ORDER)
        if TAIL_ORDER != VECTOR_ORDER:
            tail = offs % call_len >= call_len - tail_len
            v = tl.where(tail, _second_moment(v, g, grad_part, beta2, TAIL_ORDER), vector)
        else:
            v = vector
        den = _binary(_sqrt(v), bc2_sqrt, "div.rn.f32 $0, $1, $2;")
        den = _binary(den, eps, "add.rn.f32 $0, $1, $2;")
        move = _binary(_binary(neg_step_size, m, "mul.rn.f32 $0, $1, $2;"), den,
                       "div.rn.f32 $0, $1, $2;")  # fmt: skip
        p = _binary(p, move, "add.rn.f32 $0, $1, $2;")
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)

    return triton, adamw


def cpu_vector_width() -> int | None:
    """fp32 elements per vector of torch's CPU kernels here (``at::vec::Vectorized<float>``): 16
    with AVX-512, 8 with AVX2; None for the other builds (the generic one multiplies and adds
    apart where these fuse: not the order the kernel below spells out)."""
    return {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability())


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (as the CPU kernel's ``scalar_t(x)``), as a Python float."""
    return torch.tensor(x, dtype=torch.float64).float().item()


def adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    grad_scale: torch.Tensor | None = None,
    rounding: tuple[int, int, int] | None = None,
    call_len: int | None = None,
) -> None:
    """One AdamW step (decoupled weight decay) of fp32 CUDA tensors in place, rounded as
    ``torch._fused_adamw_`` rounds on the CPU; ``step`` is the count after this step's
    increment, ``grad_scale`` (a one-element fp32 tensor on the device) divides the gradient
    (which, unlike the CPU kernel's, is not written back). ``rounding``: as
    ``DOCUMENTED_ROUNDING``; by default what :func:`matches_cpu_adamw` found for the device,
    else the documented one. ``call_len``: the CPU kernel's calls these elements stand for,
    consecutive calls of that many elements each (default: one call of all; which elements are
    tails)."""
    kernel = _kernel()
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if kernel is None or not all(
        t.is_cuda and t.dtype == torch.float32 and t.is_contiguous() for t in tensors
    ):
        raise ValueError("hf_megatrain: exact_adamw needs Triton and contiguous fp32 CUDA tensors")
    n = param.numel()
    if cpu_vector_width() is None:
        raise ValueError("hf_megatrain: exact_adamw follows torch's AVX2 and AVX-512 CPU kernels")
    if not n:
        return
    call_len = n if call_len is None else call_len
    # The CPU kernel's constants, in double as it computes them, then rounded to fp32.
    bias_correction1 = 1 - math.pow(beta1, step)
    bias_correction2 = 1 - math.pow(beta2, step)
    lerp_weight = _f32(1 - beta1)
    lerp_from_grad = not abs(lerp_weight) < 0.5
    triton, adamw = kernel
    if rounding is None:
        rounding = _rounding.get(param.device, DOCUMENTED_ROUNDING)
    vector_order, tail_order, tail_modulus = rounding
    with torch.cuda.device(param.device):
        adamw[(triton.cdiv(n, _BLOCK),)](
            param, grad, exp_avg, exp_avg_sq,
            grad_scale if grad_scale is not None else param, n, call_len, call_len % tail_modulus,
            _f32(1 - lr * weight_decay),
            _f32(lerp_weight - 1) if lerp_from_grad else lerp_weight,
            _f32(1 - beta2), _f32(beta2), _f32(math.sqrt(bias_correction2)), _f32(eps),
            _f32(-(lr / bias_correction1)),
            HAS_SCALE=grad_scale is not None, HAS_DECAY=weight_decay != 0,
            LERP_FROM_GRAD=lerp_from_grad, VECTOR_ORDER=vector_order, TAIL_ORDER=tail_order,
            BLOCK=_BLOCK, num_warps=8,
        )  # fmt: skip


def sample_state(numel: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Master, gradient and moments over many magnitudes (zeros and subnormals among them): what
    the check compares the kernels on."""

    def spread(low: int, high: int) -> torch.Tensor:
        exponent = torch.randint(low, high, (numel,), generator=generator).float()
        return torch.randn(numel, generator=generator) * torch.pow(2.0, exponent)

    master, grad, exp_avg = spread(-20, 4), spread(-40, 2), spread(-40, -4)
    exp_avg_sq = spread(-80, -8).abs()
    for t in (master, grad, exp_avg, exp_avg_sq):
        t[: numel // 64] = 0.0
        t[numel // 64 : numel // 32] *= 2.0**-126  # subnormal or near it
    return [master, grad, exp_avg, exp_avg_sq]


#: Hyper-parameters the check covers: each branch of the kernel (scale, decay, lerp side).
_CHECKED = (
    dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, step=3.0, scale=1.3),
    dict(lr=3e-4, beta1=0.9, beta2=0.95, weight_decay=0.0, eps=1e-6, step=1.0, scale=None),
    dict(lr=0.1, beta1=0.3, beta2=0.5, weight_decay=0.1, eps=1e-8, step=40.0, scale=0.7),
)


def _cpu_adamw_(tensors: list[torch.Tensor], hyper: dict, call_len: int) -> None:
    """torch's fused CPU AdamW on ``tensors`` (master, gradient, moments) in place, one kernel
    call per ``call_len`` elements (each with its scalar tail)."""
    calls = [list(t.split(call_len)) for t in tensors]
    scale = hyper["scale"]
    torch._fused_adamw_(
        *calls, [], [torch.tensor(hyper["step"]) for _ in calls[0]], lr=hyper["lr"],
        beta1=hyper["beta1"], beta2=hyper["beta2"], weight_decay=hyper["weight_decay"],
        eps=hyper["eps"], amsgrad=False, maximize=False,
        grad_scale=None if scale is None else torch.tensor(scale), found_inf=None,
    )  # fmt: skip


def cpu_flushes_subnormals() -> bool:
    """Whether this thread's CPU arithmetic flushes subnormal floats to zero now
    (``torch.set_flush_denormal(True)``); a few microseconds."""
    return torch.tensor(1e-40, dtype=torch.float32).mul(1.0).item() == 0.0


def matches_cpu_adamw(device: torch.device) -> bool:
    """Whether :func:`adamw_` on ``device`` gives bitwise what torch's fused CPU AdamW gives,
    checked once per process on ~2^18 elements for each kernel branch (one in 65 a scalar-tail
    element); False (logged) where it does not, or where Triton, CUDA or a CPU kernel it
    follows is missing. Cheap after the first call: the optimizer asks again every step, as
    ``torch.set_flush_denormal(True)`` at any time makes the CPU round apart (the kernel keeps
    subnormals)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if cpu_flushes_subnormals():
        _log_once(
            "hf_megatrain: device updates are off while the CPU flushes subnormals to zero "
            "(torch.set_flush_denormal(True)): the GPU's AdamW keeps them"
        )
        return False
    return _matches_cpu_adamw(device)


@functools.cache
def _log_once(message: str) -> None:
    logger.warning(message)


@functools.cache
def _matches_cpu_adamw(device: torch.device) -> bool:
    """:func:`matches_cpu_adamw` once per device, where the CPU keeps subnormals."""
    missing = "Triton" if _kernel() is None else None
    if cpu_vector_width() is None:
        missing = f"torch's AVX2 or AVX-512 CPU kernels ({torch.backends.cpu.get_cpu_capability()})"
    if missing:
        logger.warning("hf_megatrain: device updates stay off: their AdamW needs %s", missing)
        return False
    if device.index is None:  # (the key tensors' devices give: with their index)
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        return _check(device)
    except Exception as exc:  # a kernel that fails to build or run here: the CPU updates all
        logger.warning(
            "hf_megatrain: the GPU's AdamW kernel failed its check (%s: %s): device updates "
            "stay off", type(exc).__name__, exc,
        )  # fmt: skip
        return False


def _check(device: torch.device) -> bool:
    """:func:`matches_cpu_adamw`'s comparison: the first rounding (the documented one, then each
    combination of second-moment orders and tail lengths) that gives the CPU kernel's bits on
    every checked branch is kept for ``device``."""
    generator = torch.Generator().manual_seed(0)
    # Calls of 64 vectors and a tail of W - 1 elements: one element in 65 is a tail element
    # (where contraction orders differ on some 10% of elements).
    width = cpu_vector_width()
    call_len = 65 * width - 1
    samples = [sample_state(call_len * ((1 << 18) // call_len), generator) for _ in _CHECKED]
    wanted = []
    for hyper, cpu in zip(_CHECKED, samples):
        gpu = [t.to(device) for t in cpu]
        _cpu_adamw_(cpu, hyper, call_len)
        wanted.append((gpu, [cpu[0], cpu[2], cpu[3]]))
    n_orders = len(SECOND_MOMENT_ORDERS)
    candidates = [DOCUMENTED_ROUNDING] + [
        (a, b, t)
        for t in dict.fromkeys((8, width, width // 2, 4))
        for a in range(n_orders)
        for b in range(n_orders)
    ]
    documented = None
    for rounding in dict.fromkeys(candidates):  # (the documented one first, once)
        differ = sum(
            _differing(hyper, gpu, cpu, rounding, call_len)
            for hyper, (gpu, cpu) in zip(_CHECKED, wanted)
        )
        documented = differ if documented is None else documented
        if not differ:
            _rounding[device] = rounding
            _warm_up(device)
            if rounding != DOCUMENTED_ROUNDING:
                logger.info(
                    "hf_megatrain: the CPU AdamW here computes the second moment as %s (%s in "
                    "the last elements of a call modulo %d)",
                    *(SECOND_MOMENT_ORDERS[i] for i in rounding[:2]), rounding[2],
                )  # fmt: skip
            return True
    logger.warning(
        "hf_megatrain: the GPU's AdamW kernel rounds apart from this torch's CPU AdamW (%s, "
        "%s; %d values of the documented order differ): device updates stay off",
        torch.__version__, torch.backends.cpu.get_cpu_capability(), documented,
    )  # fmt: skip
    return False


def _warm_up(device: torch.device) -> None:
    """Compile the kernel's variants a clipped run meets that the check did not (the norm
    weights': scaled, no decay), not on the training thread's first device update."""
    for lerp_beta1 in (0.9, 0.3):
        state = sample_state(16, torch.Generator().manual_seed(1))
        adamw_(
            *(t.to(device) for t in state), step=1.0, lr=1e-3, beta1=lerp_beta1, beta2=0.999,
            weight_decay=0.0, eps=1e-8, grad_scale=torch.ones(1, device=device),
        )  # fmt: skip


def _differing(
    hyper: dict,
    gpu: list[torch.Tensor],
    cpu: list[torch.Tensor],
    rounding: tuple[int, int, int],
    call_len: int,
) -> int:
    """How many of master and moments come out other bits than ``cpu`` (the CPU kernel's) when
    the kernel with ``rounding`` updates a copy of ``gpu`` (the inputs) with ``hyper``."""
    state = [t.clone() for t in gpu]
    scale = hyper["scale"]
    adamw_(
        *state, step=hyper["step"], lr=hyper["lr"], beta1=hyper["beta1"], beta2=hyper["beta2"],
        weight_decay=hyper["weight_decay"], eps=hyper["eps"], rounding=rounding, call_len=call_len,
        grad_scale=None if scale is None else torch.tensor([scale], device=state[0].device),
    )  # fmt: skip
    got = [state[0], state[2], state[3]]
    return sum(
        int((a.view(torch.int32) != b.cpu().view(torch.int32)).sum()) for a, b in zip(cpu, got)
    )


__all__ = [
    "DOCUMENTED_ROUNDING",
    "SECOND_MOMENT_ORDERS",
    "adamw_",
    "cpu_vector_width",
    "matches_cpu_adamw",
    "sample_state",
]
