"""The device updates' AdamW (``core/exact_adamw``) rounds as torch's fused CPU AdamW.

On the CPU: the operation order the Triton kernel spells out, emulated here one rounding at a
time, is bitwise what ``torch._fused_adamw_`` gives on this machine's torch (so a torch whose CPU
kernel changes its order fails here). On CUDA: the kernel itself against the CPU kernel."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hf_megatrain.core import exact_adamw

HYPERS = [
    dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, step=3.0, scale=1.3),
    dict(lr=3e-4, beta1=0.9, beta2=0.95, weight_decay=0.0, eps=1e-6, step=1.0, scale=None),
    dict(lr=0.1, beta1=0.3, beta2=0.5, weight_decay=0.1, eps=1e-8, step=40.0, scale=0.7),
    dict(lr=6e-4, beta1=0.8, beta2=0.99, weight_decay=0.1, eps=1e-8, step=1000.0, scale=2.5),
]
IDS = ["decay-scaled", "no-decay", "lerp-from-grad", "late-step"]


def _sample(numel: int, seed: int) -> list[torch.Tensor]:
    return exact_adamw.sample_state(numel, torch.Generator().manual_seed(seed))


def _cpu_fused(tensors: list[torch.Tensor], h: dict) -> None:
    scale = None if h["scale"] is None else torch.tensor(h["scale"])
    torch._fused_adamw_(
        [tensors[0]], [tensors[1]], [tensors[2]], [tensors[3]], [], [torch.tensor(h["step"])],
        lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], weight_decay=h["weight_decay"],
        eps=h["eps"], amsgrad=False, maximize=False, grad_scale=scale, found_inf=None,
    )  # fmt: skip


def _f32(x: torch.Tensor) -> torch.Tensor:
    """Round fp64 values to fp32 (and back to fp64): an fp32 operation's one rounding, since an
    fp64 +, -, *, / or sqrt of fp32 operands rounded to fp32 is the fp32 operation's result."""
    return x.float().double()


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c) with one rounding: a x b is exact in fp64; the fp64 sum's own rounding
    error (TwoSum) decides the fp32 ties that rounding made."""
    s = a * b
    t = s + c
    bp = t - s
    err = (s - (t - bp)) + (c - bp)
    x = t.float()
    up = torch.nextafter(x, torch.tensor(float("inf"))).double()
    down = torch.nextafter(x, torch.tensor(float("-inf"))).double()
    x = x.double()
    out = torch.where((t == (x + up) / 2) & (err > 0), up, x)
    return torch.where((t == (x + down) / 2) & (err < 0), down, out)


def _emulated(tensors: list[torch.Tensor], h: dict) -> list[torch.Tensor]:
    """The order ``exact_adamw`` documents, one fp32 rounding per operation."""
    import math  # noqa: PLC0415

    p, g, m, v = (t.double() for t in tensors)
    const = lambda x: torch.tensor(x, dtype=torch.float64).float().double()  # noqa: E731
    if h["scale"] is not None:
        g = _f32(g / const(h["scale"]))
    if h["weight_decay"] != 0:
        p = _f32(p * const(1 - h["lr"] * h["weight_decay"]))
    lerp = const(1 - h["beta1"])
    diff = _f32(g - m)
    if abs(lerp) < 0.5:
        m = _fma32(lerp.expand_as(diff), diff, m)
    else:
        m = _fma32(_f32(lerp - 1).expand_as(diff), diff, g)
    grad_part = _f32(const(1 - h["beta2"]) * g)
    vector = _fma32(grad_part, g, _f32(v * const(h["beta2"])))
    # The last elements (numel modulo 8): the CPU kernel's scalar loop, contracted otherwise.
    tail = v.numel() - v.numel() % exact_adamw.DOCUMENTED_ROUNDING[2]
    scalar = _fma32(v, const(h["beta2"]).expand_as(v), _f32(grad_part * g))
    v = torch.cat([vector[:tail], scalar[tail:]])
    bc1, bc2 = 1 - math.pow(h["beta1"], h["step"]), 1 - math.pow(h["beta2"], h["step"])
    den = _f32(_f32(_f32(torch.sqrt(v)) / const(math.sqrt(bc2))) + const(h["eps"]))
    p = _f32(p + _f32(_f32(const(-(h["lr"] / bc1)) * m) / den))
    return [p.float(), m.float(), v.float()]


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements differ in their bits."""
    return int((a.view(torch.int32) != b.cpu().view(torch.int32)).sum())


@pytest.mark.skipif(
    exact_adamw.cpu_vector_width() is None, reason="the order of torch's AVX2/AVX-512 kernels"
)
@pytest.mark.parametrize("numel", [4096, 100_003], ids=["whole-vectors", "with-a-tail"])
@pytest.mark.parametrize("h", HYPERS, ids=IDS)
def test_the_documented_order_is_the_cpu_kernels(h, numel):
    tensors = _sample(numel, seed=numel)
    want = _emulated(tensors, h)
    _cpu_fused(tensors, h)
    got = [tensors[0], tensors[2], tensors[3]]
    assert [_bitwise_equal(a, b) for a, b in zip(got, want)] == [0, 0, 0]


@pytest.mark.skipif(
    exact_adamw.cpu_vector_width() is None, reason="the order of torch's AVX2/AVX-512 kernels"
)
def test_every_tail_length_rounds_as_documented():
    """Calls whose vector loop leaves 1 to W - 1 elements (the compiler runs 8 of them in vectors
    of its own, the rest one by one): each call as the documented rounding, element by element."""
    h = HYPERS[0]
    width = exact_adamw.cpu_vector_width()
    for left in range(1, width):
        call_len = 4 * width + left
        tensors = _sample(call_len * 64, seed=left)
        calls = [list(t.split(call_len)) for t in tensors]
        want = [_emulated(list(call), h) for call in zip(*calls)]
        torch._fused_adamw_(
            *calls, [], [torch.tensor(h["step"]) for _ in calls[0]], lr=h["lr"],
            beta1=h["beta1"], beta2=h["beta2"], weight_decay=h["weight_decay"], eps=h["eps"],
            amsgrad=False, maximize=False, grad_scale=torch.tensor(h["scale"]), found_inf=None,
        )  # fmt: skip
        for i, (name, j) in enumerate((("master", 0), ("exp_avg", 2), ("exp_avg_sq", 3))):
            got, expected = torch.cat(calls[j]), torch.cat([w[i] for w in want])
            assert _bitwise_equal(got, expected) == 0, (left, name)


def test_the_emulation_sees_a_rounding_apart():
    """The emulation tells orders apart: the plain multiply-add order of the second moment
    (``v * beta2 + (1 - beta2) * g * g``, rounded after each operation) differs from the CPU
    kernel on part of the elements."""
    h = HYPERS[0]
    tensors = _sample(1 << 16, seed=5)
    v = tensors[3].double()
    g = _f32(tensors[1].double() / _f32(torch.tensor(h["scale"], dtype=torch.float64)))
    beta2 = _f32(torch.tensor(h["beta2"], dtype=torch.float64))
    plain = _f32(_f32(v * beta2) + _f32(_f32(_f32(1 - beta2) * g) * g)).float()
    _cpu_fused(tensors, h)
    assert _bitwise_equal(tensors[3], plain) > 0


def test_without_cuda_the_kernel_is_not_used():
    assert not exact_adamw.matches_cpu_adamw(torch.device("cpu"))
    with pytest.raises(ValueError, match="exact_adamw needs"):
        exact_adamw.adamw_(
            *_sample(64, 0), step=1.0, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0,
            eps=1e-8,
        )  # fmt: skip


@contextlib.contextmanager
def _flushing_subnormals():
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def test_flushing_subnormals_changes_the_cpu_kernel_and_the_probe_sees_it():
    """``torch.set_flush_denormal(True)`` changes the CPU kernel's bits on the checked sample
    (subnormals among its values), so device updates must stop while it is on: the probe the
    optimizer asks every step follows it."""
    kept = exact_adamw.sample_state(1 << 14, torch.Generator().manual_seed(2))
    flushed = [t.clone() for t in kept]
    assert not exact_adamw.cpu_flushes_subnormals()
    _cpu_fused(kept, HYPERS[0])
    with _flushing_subnormals():
        assert exact_adamw.cpu_flushes_subnormals()
        _cpu_fused(flushed, HYPERS[0])
    assert not exact_adamw.cpu_flushes_subnormals()
    assert sum(_bitwise_equal(a, b) for a, b in zip(kept, flushed)) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_updates_stop_while_the_cpu_flushes_subnormals_on_gpu():
    cuda = torch.device("cuda")
    assert exact_adamw.matches_cpu_adamw(cuda)
    with _flushing_subnormals():
        assert not exact_adamw.matches_cpu_adamw(cuda)
    assert exact_adamw.matches_cpu_adamw(cuda)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("numel", [4096, 1_000_003], ids=["whole-vectors", "with-a-tail"])
@pytest.mark.parametrize("h", HYPERS, ids=IDS)
def test_the_gpu_kernel_rounds_as_the_cpu_kernel_on_gpu(h, numel):
    assert exact_adamw.matches_cpu_adamw(torch.device("cuda"))
    tensors = _sample(numel, seed=numel + 1)
    gpu = [t.cuda() for t in tensors]
    _cpu_fused(tensors, h)
    scale = None if h["scale"] is None else torch.tensor([h["scale"]], device="cuda")
    exact_adamw.adamw_(
        *gpu, step=h["step"], lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"],
        weight_decay=h["weight_decay"], eps=h["eps"], grad_scale=scale,
    )  # fmt: skip
    pairs = [(tensors[0], gpu[0]), (tensors[2], gpu[2]), (tensors[3], gpu[3])]
    assert [_bitwise_equal(a, b) for a, b in pairs] == [0, 0, 0]
    # torch's own CUDA kernel (what device updates ran before) rounds apart.
    ref = [t.cuda() for t in _sample(numel, seed=numel + 1)]
    torch._fused_adamw_(
        [ref[0]], [ref[1]], [ref[2]], [ref[3]], [], [torch.tensor(h["step"], device="cuda")],
        lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], weight_decay=h["weight_decay"],
        eps=h["eps"], amsgrad=False, maximize=False, found_inf=None,
        grad_scale=scale,
    )  # fmt: skip
    assert _bitwise_equal(tensors[0], ref[0]) > 0
