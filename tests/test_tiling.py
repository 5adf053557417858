"""Sequence-tiled MLPs equal untiled ones: module level and through the streamed trainer."""

import copy

import pytest
import torch

from hf_megatrain.core.rng import rng_state
from hf_megatrain.core.tiling import TiledTokenwise
from hf_megatrain.hf.long_context import install_mlp_tiling
from hf_megatrain.hf.model import find_decoder_layers

from .helpers import (
    ARCHS,
    AUX_FREE_MOE_ARCHS,
    MOE_ARCHS,
    SSM_ARCHS,
    mega_params,
    run_trainer,
    tiny_config,
    tiny_model,
)


@pytest.mark.parametrize("tile", [1, 5, 16, 64])
def test_tiled_module_equals_untiled(tile):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.SiLU(), torch.nn.Linear(24, 8))
    ref = copy.deepcopy(mlp)
    mlp.forward = TiledTokenwise(mlp, tile)
    x = torch.randn(2, 37, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, out_ref = mlp(x), ref(x_ref)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    # fp32: each token's output is computed by the same ops; weight gradients are summed over
    # tiles instead of in one matmul, a different summation order only.
    torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    for p, q in zip(mlp.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


class _TokenCounter(torch.nn.Module):
    """A token-wise MLP that records how many tokens each of its calls gets."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.numel() // x.shape[-1])
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize(("rows", "length", "tile"), [(4, 8, 8), (3, 5, 4), (1, 37, 16)])
def test_tiles_count_the_micro_batchs_tokens_not_each_rows(rows, length, tile):
    """The plan counts an MLP tile over a micro-batch's tokens; the tiles must be those: rows no
    longer than the tile (packed 4k rows under 16k tiles) run tiled too, and tiles may span
    rows. Outputs, a later in-place add (Falcon's layer) and gradients as untiled."""
    torch.manual_seed(0)
    mlp = _TokenCounter()
    ref = copy.deepcopy(mlp)
    mlp.forward = TiledTokenwise(mlp, tile)
    x = torch.randn(rows, length, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, out_ref = mlp(x) + 0, ref(x_ref) + 0
    tiled_out = mlp(x)
    tiled_out += 1.0  # an output the caller may modify in place
    tokens = rows * length
    assert max(mlp.calls) <= tile and sum(mlp.calls) == 2 * tokens
    mlp.calls.clear()
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (out_ref * g).sum().backward()
    assert mlp.calls and max(mlp.calls) <= tile  # the backward's recompute, tile by tile
    # fp32: the same per-token ops; weight gradients summed over tiles in another order only.
    torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tiled_out, out_ref + 1.0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    for p, q in zip(mlp.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        mlp.calls.clear()
        torch.testing.assert_close(mlp(x), out_ref, rtol=1e-6, atol=1e-6)
        assert max(mlp.calls) <= tile


_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize(("rows", "length"), [(4, 8), (1, 32)])
def test_tiled_backward_replays_the_forwards_dropout_masks(rows, length, device):
    """A tiled MLP that drops (GPT-2's resid_pdrop, LoRA's dropout): backward re-runs the tiles
    from the random state the forward's started from, so each gradient has the forward's mask
    (it drew new ones: gradients of dropped outputs, none for kept ones), and the random state
    after backward is what it would be without the replay."""
    # On CUDA the masks come from the device's generator and backward runs on autograd's device
    # thread: the replay must set and restore that generator, not the CPU's.
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).to(device)
    mlp.forward = TiledTokenwise(mlp, 8)
    x = torch.randn(rows, length, 8, device=device, requires_grad=True)
    out = mlp(x)
    after_forward = rng_state(x.device)
    out.sum().backward()
    after_backward = rng_state(x.device)
    assert torch.equal(after_backward[0], after_forward[0])
    if device == "cuda":
        assert torch.equal(after_backward[1], after_forward[1])
    # d out / d fc's output is 2 where the token's output was kept, 0 where dropped.
    kept = out != 0
    (expected,) = torch.autograd.grad(
        torch.nn.functional.linear(x, mlp[0].weight, mlp[0].bias), mlp[0].bias, kept.float() * 2
    )
    torch.testing.assert_close(mlp[0].bias.grad, expected.detach(), rtol=1e-6, atol=1e-6)


def test_tiled_backward_recomputes_under_the_forward_autocast():
    """On CUDA the backward runs on the autograd engine's device thread, where the forward's
    autocast is not active; the recompute must restore it (bf16 weights, fp32 activations)."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.SiLU(), torch.nn.Linear(24, 8))
    mlp.to(torch.bfloat16)
    ref = copy.deepcopy(mlp)
    mlp.forward = TiledTokenwise(mlp, 5)
    x = torch.randn(2, 37, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_ref = mlp(x), ref(x_ref)
    # Backward outside the autocast context, as the CUDA device thread sees it.
    out.float().sum().backward()
    out_ref.float().sum().backward()
    # bf16 compute in both (a missing autocast would raise a dtype error instead). Input grads
    # go through the same per-token ops, but a kernel may differ with the tile's shape: one bf16
    # rounding (2**-8 relative); weight grads also sum over tiles in another order.
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-2, atol=1e-2)
    for p, q in zip(mlp.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", ["cpu", _CUDA])
def test_tiled_gated_mlp_input_gradient_is_the_untiled_ones_in_bf16(device):
    """A gated MLP's gate and up projections read one input: untiled (its input no leaf), under
    autocast each cast's gradient is widened and the two are summed in fp32. The tile recompute
    must not sum them in bf16 (autocast caches its casts of a leaf that requires grad). Gate and
    up weights 2^24 apart make their gradients' bf16 sum round."""
    torch.manual_seed(0)
    mlp = tiny_model(tiny_config("llama")).model.layers[0].mlp
    with torch.no_grad():
        mlp.gate_proj.weight.mul_(2.0**-12)
        mlp.up_proj.weight.mul_(2.0**12)
    mlp.to(device=device, dtype=torch.bfloat16)
    tiled = copy.deepcopy(mlp)
    tiled.forward = TiledTokenwise(tiled, 4)
    base = torch.randn(2, 16, mlp.gate_proj.in_features, device=device)
    grads = []
    for module in (mlp, tiled):
        x = base.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            out = module(x * 1.0)
        out.float().square().sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize(
    "arch",
    [
        a
        for a in ARCHS
        if a
        not in (
            *MOE_ARCHS,
            *AUX_FREE_MOE_ARCHS,
            "lfm2",
            "lfm3",
            "mpt",
            "bloom",
            "opt",
            "xglm",
            "biogpt",
            "ctrl",
            *SSM_ARCHS,
        )
    ],
)
def test_streamed_training_with_tiled_mlp_matches_stock(tmp_path, arch):
    """Every dense family's MLP is token-wise (MoE blocks are left untiled; LFM2, LFM3, MPT and
        CTRL call theirs feed_forward / ffn, which are not tiled, as do Bamba, Falcon-H1 and the other
    state-space families, or have none (Mamba); OPT, XGLM and BioGPT have no MLP
        module, their layers call fc1 and fc2 themselves; BLOOM's takes the residual too: see
        test_install_skips_mlps_with_a_second_input). GPT-2's MLP views its input: a tile of
        several rows is made contiguous for it."""
    model = tiny_model(tiny_config(arch))
    stock, _ = run_trainer(copy.deepcopy(model), tmp_path, "stock", mega=False, max_steps=4)
    mega, trainer = run_trainer(
        model, tmp_path, "mega", mega=True, max_steps=4, megatrain_mlp_tile_tokens=5
    )
    layers = find_decoder_layers(trainer.model)[1]
    assert all(isinstance(layer.mlp.forward, TiledTokenwise) for layer in layers)
    for a, b in zip(stock, mega):
        # As the untiled equivalence tests: fp32, only summation orders differ.
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def test_install_skips_nothing_dense_and_is_idempotent():
    model = tiny_model(tiny_config("llama", num_hidden_layers=3))
    assert install_mlp_tiling(model, 8) == 3
    assert install_mlp_tiling(model, 8) == 0
    assert install_mlp_tiling(model, 0) == 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_tiles_on_a_model_without_a_dense_mlp_are_said_to_do_nothing(arch, caplog):
    """Found by an audit: an MoE model took mlp_tile_tokens without a word (its experts run
    each on its own tokens: nothing is tiled). Said once per install; a model with a dense
    first layer (some layers tiled) says nothing."""
    import logging  # noqa: PLC0415

    with caplog.at_level(logging.WARNING, logger="hf_megatrain.hf.long_context"):
        assert install_mlp_tiling(tiny_model(tiny_config(arch)), 8) == 0
    assert "mlp_tile_tokens=8 has no effect" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_megatrain.hf.long_context"):
        assert install_mlp_tiling(tiny_model(tiny_config("llama")), 8) == 2
    assert "has no effect" not in caplog.text


def test_install_skips_mlps_with_a_second_input():
    """BLOOM's MLP adds the residual inside (forward(hidden_states, residual)): a tile of one
    input cannot stand in for it, so tiling leaves it alone and training still runs."""
    model = tiny_model(tiny_config("bloom"))
    assert install_mlp_tiling(model, 8) == 0
    assert install_mlp_tiling(tiny_model(tiny_config("falcon")), 8) == 2


@pytest.mark.parametrize(("arch", "skips"), [("llama", True), ("qwen2", True), ("gemma2", False)])
def test_recompute_skips_the_tiles_whose_output_it_never_reads(tmp_path, monkeypatch, arch, skips):
    """The early-stop recompute stops once the tiled MLP's saves (its input and weights) are
    re-made, right after the tiled Function returns, so the Function skips its tiles there
    (``recompute.refill_remaining``): training bitwise as when it ran them, the tiles run in
    forward and backward only. Gemma-2's post-feedforward norm saves the MLP's output, so its
    recompute needs the tiles and runs them."""
    import hf_megatrain.core.tiling as tiling

    calls = {"n": 0}
    run = tiling.run_tile

    def counted(*a):
        calls["n"] += 1
        return run(*a)

    monkeypatch.setattr(tiling, "run_tile", counted)
    model = tiny_model(tiny_config(arch, num_hidden_layers=2))
    results = {}
    for name in ("all-tiles", "skip"):
        if name == "all-tiles":
            monkeypatch.setattr(tiling, "refill_remaining", lambda: None)
        else:
            monkeypatch.undo()
            monkeypatch.setattr(tiling, "run_tile", counted)
        calls["n"] = 0
        logs, trainer = run_trainer(
            copy.deepcopy(model), tmp_path, name, mega=True, max_steps=2,
            megatrain_mlp_tile_tokens=5, megatrain_resident_layers="0",
            megatrain_keep_activations="off",
        )  # fmt: skip
        results[name] = (
            [(r["loss"], r["grad_norm"]) for r in logs],
            mega_params(trainer),
            calls["n"],
        )
    assert results["skip"][0] == results["all-tiles"][0]
    for key, value in results["all-tiles"][1].items():
        assert torch.equal(results["skip"][1][key], value), key
    # Forward, recompute and backward each run every tile; the skip takes the recompute's.
    ran, skipped = results["all-tiles"][2], results["skip"][2]
    assert (skipped == ran * 2 // 3) if skips else (skipped == ran), (ran, skipped)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiled_bf16_weight_gradients_round_once(seed):
    """bf16 weight gradients of a tiled MLP are summed over the tiles in fp32 and rounded once,
    as the untiled GEMM over every token rounds once: against an fp64 reference their error
    stays within 1.25x the untiled module's (1.06-1.08x over six seeds with 32 tiles; a bf16
    sum rounded at every tile came out 1.81-1.85x)."""

    def grads(module, tile=None, dtype=torch.bfloat16):
        m = copy.deepcopy(module).to(dtype)
        if tile:
            m.forward = TiledTokenwise(m, tile)
        m(x.to(dtype).requires_grad_(True)).backward(g.to(dtype))
        return [p.grad.double() for p in m.parameters()]

    gen = torch.Generator().manual_seed(seed)
    x, g = torch.randn(1, 4096, 64, generator=gen), torch.randn(1, 4096, 64, generator=gen)
    torch.manual_seed(seed)
    mlp = torch.nn.Sequential(  # no biases, as decoder MLPs
        torch.nn.Linear(64, 256, bias=False), torch.nn.SiLU(), torch.nn.Linear(256, 64, bias=False)
    )
    truth = grads(mlp, dtype=torch.float64)

    def error(gs):
        return [float((a - b).abs().sum() / b.abs().sum()) for a, b in zip(gs, truth)]

    untiled, tiled = error(grads(mlp)), error(grads(mlp, tile=128))
    for u, t in zip(untiled, tiled):
        assert t <= 1.25 * u, (untiled, tiled)


@pytest.mark.parametrize("arch, tiles_apply", [("llama", True), ("bloom", False), ("opt", False)])
def test_the_plan_counts_tiles_only_where_they_apply(arch, tiles_apply):
    """A model whose MLPs tiling cannot split (BLOOM's takes the residual, OPT's layers call
    fc1/fc2 themselves) runs untiled whatever mlp_tile_tokens asks: its plan must count the
    untiled MLP (it counted tiles, and so planned less than the layers use)."""
    from hf_megatrain.core.options import EngineOptions, StepShape
    from hf_megatrain.core.planner import plan_memory
    from hf_megatrain.hf.model import model_shape

    model = tiny_model(tiny_config(arch))
    shape = model_shape(model)
    assert shape.mlp_tileable == tiles_apply
    assert (install_mlp_tiling(model, 8) > 0) == tiles_apply
    step = StepShape.from_step(4096, 4096)
    peaks = [
        plan_memory(
            shape,
            step,
            EngineOptions(mlp_tile_tokens=tile).resolve(clipping=True, cuda=True),
            torch.float32,
            1 << 40,
            1 << 40,
        ).gpu_total
        for tile in (0, 512)
    ]
    # (Where tiles apply they change the plan: a smaller MLP working set, their weight
    # gradients' sums; on this tiny model the latter weigh more.)
    assert (peaks[1] != peaks[0]) == tiles_apply


@pytest.mark.parametrize("arch", ["bamba", "mamba", "falcon_h1"])
def test_state_space_families_are_planned_untiled(arch):
    """Their MLPs are not named ``mlp`` (or absent): tiles would not run, so the plan must not
    count tiled MLP working sets for them."""
    from hf_megatrain.hf.model import model_shape  # noqa: PLC0415

    assert model_shape(tiny_model(tiny_config(arch))).mlp_tileable is False
