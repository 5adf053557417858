"""``autocast_kernels``: a layer's autocast work in fewer kernels, bitwise the same.

On the CPU (no Triton) the widening and the mixed add are PyTorch's own ops; what these tests
pin is the graph: one shared cast per fp32 linear input, one autograd node per consumer, and
identical outputs and gradients (every comparison is ``torch.equal``: nothing is rounded
differently, so nothing may differ). The Triton kernels are checked bitwise on the GPU
(tests/test_gpu.py).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_megatrain.core.autocast_kernels import (
    AutocastKernels,
    add_two_widened,
    add_widened,
    widen,
)

from .helpers import mega_params, run_trainer, tiny_config, tiny_model

BF16 = torch.bfloat16


class _CastCounter(TorchDispatchMode):
    """Counts casts of tensors of ``shape`` from ``source`` to ``target`` dtype (fp32 -> bf16
    by default; bf16 -> fp32: widenings)."""

    def __init__(self, shape: tuple[int, ...], source=torch.float32, target=torch.bfloat16) -> None:
        super().__init__()
        self.shape, self.source, self.target, self.casts = shape, source, target, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
            and isinstance(out, torch.Tensor)
            and out.dtype == self.target
            and tuple(out.shape) == self.shape
            and (args[-1] if func is torch.ops.aten.copy_.default else args[0]).dtype == self.source
        ):
            self.casts += 1
        return out


def _layer(arch: str):
    """Decoder layer 0 of a tiny ``arch`` model, bound as the engine binds it: matmul weights
    in bf16, norm weights in fp32."""
    model = tiny_model(tiny_config(arch))
    layer = model.model.layers[0]
    for module in layer.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(BF16)
    rotary = model.model.rotary_emb
    return layer, rotary, model.config


def _run(
    layer,
    rotary,
    config,
    fast: bool,
    counter: TorchDispatchMode | None = None,
    backward_counter: TorchDispatchMode | None = None,
):
    """The layer's output and gradients (input first) under CPU autocast, as in a stock model:
    its input the output of something before it, not a leaf (autocast caches casts of leaves).
    ``counter`` watches the forward, ``backward_counter`` the backward."""
    torch.manual_seed(3)
    leaf = torch.randn(2, 16, config.hidden_size, requires_grad=True)
    x = leaf * 1.0
    pos = torch.arange(16).unsqueeze(0).expand(2, -1)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", dtype=BF16))
        emb = rotary(x, pos)
        if fast:
            stack.enter_context(AutocastKernels("cpu", BF16))
        if counter is not None:
            stack.enter_context(counter)
        out = layer(x, position_embeddings=emb, attention_mask=None, position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out
    assert out.dtype == torch.float32  # the residual stream stays fp32, as under autocast
    with backward_counter or contextlib.nullcontext():
        grads = torch.autograd.grad(out.square().sum(), [leaf, *layer.parameters()])
    return out.detach(), grads


@pytest.mark.parametrize(
    "arch",
    ["llama", "qwen3", "gemma2", "phi3", "mixtral", "qwen3_moe", "cohere", "olmoe", "olmo2",
     "exaone4"],
)  # fmt: skip
def test_layer_outputs_and_gradients_are_bitwise_autocasts(arch):
    layer, rotary, config = _layer(arch)
    out, grads = _run(layer, rotary, config, fast=False)
    out_fast, grads_fast = _run(copy.deepcopy(layer), rotary, config, fast=True)
    assert torch.equal(out, out_fast)
    assert len(grads) == len(grads_fast)
    for a, b in zip(grads, grads_fast):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_q_k_v_and_gate_up_share_one_cast():
    """Llama: autocast casts the normed input once per linear (q, k, v; gate, up): 5 casts of a
    hidden-sized activation per layer; shared, 2 (one per norm output)."""
    layer, rotary, config = _layer("llama")
    shape = (2, 16, config.hidden_size)
    counts = []
    for fast in (False, True):
        counter = _CastCounter(shape)
        _run(copy.deepcopy(layer), rotary, config, fast=fast, counter=counter)
        counts.append(counter.casts)
    assert counts == [5, 2]


def _widenings_in_backward(arch: str, fast: bool) -> int:
    """bf16 -> fp32 copies of hidden-sized gradients in one layer's backward (CPU)."""
    layer, rotary, config = _layer(arch)
    widenings = _CastCounter((2, 16, config.hidden_size), source=BF16, target=torch.float32)
    _run(layer, rotary, config, fast=fast, backward_counter=widenings)
    return widenings.casts


@pytest.mark.parametrize(
    ("arch", "autocasts", "shared"),
    [("llama", 5, 4), ("cohere", 5, 2), ("olmo2", 8, 8)],
)
def test_a_shared_casts_gradients_reach_autograd_summed(arch, autocasts, shared):
    """The consumers of one shared cast hand autograd their gradients' sum at the last one: the
    first two are widened and added, each later one is added narrow (on the GPU one kernel each;
    on the CPU PyTorch's mixed add). Llama: q/k/v 3 -> 2 widenings, gate/up 2 -> 2; Cohere (one
    normed input for q, k, v, gate, up) 5 -> 2. Olmo2 (post-norm: q/k/v read the layer input,
    which the residual add reads too) keeps autocast's one widening per consumer, so autograd
    interleaves the residual's gradient as in stock. Values: the bitwise test above."""
    assert _widenings_in_backward(arch, fast=False) == autocasts
    assert _widenings_in_backward(arch, fast=True) == shared


@contextlib.contextmanager
def _autocast(fast: bool):
    """CPU autocast to bf16, with autocast_kernels' mode inside it when ``fast``."""
    with torch.autocast("cpu", dtype=BF16):
        with AutocastKernels("cpu", BF16) if fast else contextlib.nullcontext():
            yield


def _three_consumers(x: torch.Tensor, weights, use: tuple[bool, bool, bool], fast: bool):
    with _autocast(fast):
        outs = [torch.nn.functional.linear(x, w) for w in weights]
    return sum(o.float().square().sum() for o, u in zip(outs, use) if u)


def _three_weights_and_input(seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(6, 8).to(BF16) for _ in range(3)], torch.randn(4, 8)


@pytest.mark.parametrize("use", [(True, True, True), (True, False, True), (False, True, False)])
def test_a_consumer_outside_the_loss_is_not_waited_for(use):
    """Only the consumers whose outputs reach the loss send gradients: the sum is handed on at
    the last of those (a wait for the others would drop the input's gradient)."""
    weights, base = _three_weights_and_input(0)
    grads = []
    for fast in (False, True):
        x = base.clone().requires_grad_()
        _three_consumers(x * 1.0, weights, use, fast).backward()
        grads.append(x.grad)
    assert grads[1].abs().sum() > 0
    assert torch.equal(grads[0], grads[1])


def test_a_shared_cast_backward_twice_and_through_autograd_grad():
    """The sum starts afresh in each backward (``retain_graph``), and ``torch.autograd.grad``
    (which runs only the nodes its inputs need) gives autocast's gradient too."""
    weights, base = _three_weights_and_input(1)
    got, want = [], []
    for fast, out in ((True, got), (False, want)):
        x = base.clone().requires_grad_()
        mid = x * 1.0
        loss = _three_consumers(mid, weights, (True, True, True), fast)
        out.append(torch.autograd.grad(loss, [x], retain_graph=True)[0])
        out.append(torch.autograd.grad(loss, [mid], retain_graph=True)[0])
        loss.backward(retain_graph=True)
        loss.backward()
        out.append(x.grad)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _outer_and_inner_gradients(weights, base: torch.Tensor, fast: bool):
    """x's gradient through three consumers of one cast, and that of a second backward started
    from a hook on the first consumer's output (the others' gradients have come by then)."""
    x = base.clone().requires_grad_()
    mid = x * 1.0
    with _autocast(fast):
        outs = [torch.nn.functional.linear(mid, w) for w in weights]

    def loss():
        return sum((o.float() * 1e-2).sin().sum() for o in outs)

    inner = []

    def hook(grad):
        if not inner:  # (the inner backward runs this hook too: once only)
            inner.append(None)
            with torch.enable_grad():
                inner[0] = torch.autograd.grad(loss(), [x], retain_graph=True)[0]
        return grad

    outs[0].register_hook(hook)
    outer = torch.autograd.grad(loss(), [x], retain_graph=True)[0]
    return outer, inner[0]


def test_a_backward_inside_a_backward_sums_apart():
    """A backward started inside another (each its own graph task) through the same shared
    cast: each gets autocast's gradient (one running sum for both lost the outer's)."""
    weights, base = _three_weights_and_input(1)
    want = _outer_and_inner_gradients(weights, base, fast=False)
    got = _outer_and_inner_gradients(weights, base, fast=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_double_backward_through_a_shared_cast():
    """``create_graph``: the consumers hand on their own widened gradients (differentiable), as
    autocast's casts do; the first and second derivatives are autocast's."""
    weights, base = _three_weights_and_input(0)
    got = []
    for fast in (False, True):
        x = base.clone().requires_grad_()
        loss = _three_consumers(x * 1.0, weights, (True, True, True), fast)
        (g,) = torch.autograd.grad(loss, [x], create_graph=True)
        got.append((g.detach(), torch.autograd.grad(g.square().sum(), [x])[0]))
    assert all(torch.equal(a, b) for a, b in zip(*got))


def test_a_compiled_region_under_the_mode_compiles_once():
    """Dynamo traces the mode inside a ``torch.compile``'d function (the compiled kernels'
    RoPE and norms): the mode must not read its table of live casts there, or dynamo guards on
    the inputs' ids and recompiles every call until ``fullgraph`` fails at its recompile
    limit (seen at the second training step with compiled kernels; the tests' limit is raised,
    so the compiles are counted)."""
    compiles = []

    def backend(graph, example_inputs):  # (counts what dynamo hands on to compile)
        compiles.append(graph)
        return graph.forward

    torch._dynamo.reset()
    rotary = torch.compile(lambda q, k, cos, sin: q * cos + k * sin, backend=backend)
    weights = [torch.randn(8, 8).to(BF16) for _ in range(2)]
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(12):  # (the default recompile limit is 8)
        x = torch.randn(4, 8, requires_grad=True) * 1.0  # a new input each call, as per layer
        with torch.autocast("cpu", dtype=BF16), AutocastKernels("cpu", BF16):
            q, k = (torch.nn.functional.linear(x, w) for w in weights)
            out = rotary(q, k, cos, sin)
        out.float().sum().backward()
    assert len(compiles) == 1


def test_gradients_of_an_input_changed_in_place_between_its_casts_are_autocasts():
    """An input changed in place without grad between its linears gets a second cast; both
    casts' consumers send gradients to the same graph node, interleaved (here l3, then l2 and
    l1). The in-place op is a use of the input whose result joins the graph (the input itself),
    so each consumer hands on its own widened gradient and autograd sums them in stock's order
    (summed per cast, l3's would come first and l1 + l2 after: another rounding)."""
    torch.manual_seed(2)
    # Gradients 2^16 apart: sums of three of them round in fp32 by the order they meet in.
    weights = [(torch.randn(512, 256) * 2.0**e).to(BF16) for e in (-16, 0, 16)]
    base = torch.randn(64, 256)
    grads = []
    for fast in (False, True):
        x = base.clone().requires_grad_()
        mid = x * 1.0
        with _autocast(fast):
            first = [torch.nn.functional.linear(mid, w) for w in weights[:2]]
            with torch.no_grad():
                mid.mul_(1.5)
            last = torch.nn.functional.linear(mid, weights[2])
        sum((o.float() * 1e-3).sin().sum() for o in (*first, last)).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def test_a_cast_is_redone_after_its_input_changes_in_place():
    w = torch.randn(4, 8).to(BF16)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=BF16), AutocastKernels("cpu", BF16):
        first = torch.nn.functional.linear(x, w)
        x.mul_(2)
        second = torch.nn.functional.linear(x, w)
    with torch.autocast("cpu", dtype=BF16):
        assert torch.equal(second, torch.nn.functional.linear(x, w))
    assert not torch.equal(first, second)


def test_a_linear_called_by_keyword_shares_the_cast():
    """``F.linear(input=x, weight=w)`` (PEFT's HRA) as positional: autocast's value and gradient
    (it failed indexing the empty positional arguments)."""
    w = torch.randn(4, 8).to(BF16)
    got = torch.randn(3, 8, requires_grad=True)
    ref_x = got.detach().requires_grad_()
    with torch.autocast("cpu", dtype=BF16):
        ref = torch.nn.functional.linear(ref_x, w)
        with AutocastKernels("cpu", BF16):
            out = torch.nn.functional.linear(input=got, weight=w)
            again = torch.nn.functional.linear(got, weight=w)
    assert torch.equal(out, ref) and torch.equal(again, ref)
    (out.float().sum() + again.float().sum()).backward()
    (2 * ref.float().sum()).backward()
    assert torch.equal(got.grad, ref_x.grad)


def test_mixed_add_either_order_and_its_gradients():
    a = torch.randn(5, 7, requires_grad=True)
    b = torch.randn(5, 7).to(BF16).requires_grad_(True)
    for order in ((a, b), (b, a)):
        with AutocastKernels("cpu", BF16):
            got = order[0] + order[1]
        want = order[0] + order[1]
        assert got.dtype == torch.float32 and torch.equal(got, want)
        g = torch.randn(5, 7)
        assert all(
            x.dtype == y.dtype and torch.equal(x, y)
            for x, y in zip(
                torch.autograd.grad(got, (a, b), g), torch.autograd.grad(want, (a, b), g)
            )
        )
    # Not a mixed same-shape add: left to PyTorch.
    with AutocastKernels("cpu", BF16):
        assert torch.equal(a + 1, a.detach() + 1)
        assert (a[:1] + b).shape == (5, 7)


def test_widen_and_add_widened_are_pytorchs_values():
    x = torch.tensor([1.5, -0.0, float("inf"), float("nan"), 1e-40], dtype=BF16)
    assert torch.equal(widen(x).isnan(), x.float().isnan())
    assert torch.equal(widen(x).nan_to_num(), x.float().nan_to_num())
    a = torch.randn(64)
    b = torch.randn(64).to(BF16)
    assert torch.equal(add_widened(a, b), a + b)
    c = torch.randn(64).to(BF16)
    assert torch.equal(add_two_widened(b, c), b.float() + c.float())


@pytest.mark.parametrize("arch", ["llama", "olmo2"])
def test_streamed_bf16_training_is_bitwise_with_and_without(tmp_path, arch):
    """Whole runs (CPU autocast to bf16, clipping, 3 steps): the same losses and weights. Olmo2
    (post-norm: q/k/v read the layer input itself) needs the layer's input to be no autocast-
    cached leaf, as in stock (``StreamedLayer.run``)."""
    model = tiny_model(tiny_config(arch))
    runs = []
    for on in (True, False):
        logs, trainer = run_trainer(
            copy.deepcopy(model), tmp_path, f"run-{on}", True, max_steps=3, bf16=True,
            megatrain_autocast_kernels=on,
        )  # fmt: skip
        engine = trainer.megatrain.engine
        assert engine.autocast and engine.autocast_kernels is on
        runs.append(([r["loss"] for r in logs if "loss" in r], mega_params(trainer)))
    (loss_on, params_on), (loss_off, params_off) = runs
    assert loss_on == loss_off and len(loss_on) == 3
    for k in params_off:
        assert torch.equal(params_on[k], params_off[k]), k
