"""HBM-tier layers that keep their forward graph with its saved tensors in host RAM
(``host_kept_activations``, ``engine/saved_offload.py``).

Keeping in host RAM changes where a layer's saved tensors wait and that its forward runs once,
not what it computes: on the CPU in fp32 the same kernels see the same values, so losses,
gradient norms and weights must be bitwise those of recomputing every layer.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_megatrain import HFMegaTrainer, MegaTrainArguments
from hf_megatrain.core.engine.saved_offload import SavedTensorOffload
from hf_megatrain.core.options import EngineOptions, OptionError
from hf_megatrain.core.plan_arithmetic import host_kept_layer_bytes, host_kept_pcie_limit
from hf_megatrain.core.plan_types import spread
from hf_megatrain.core.planner import GIB
from hf_megatrain.hf.model import find_decoder_layers

from .helpers import LogRecorder, common_args, make_data, mega_params, tiny_config, tiny_model
from .test_fast_defaults import CONFIGS, _plan
from .test_keep_activations import _count_layer_forwards


def _train(model, tmp_path, name: str, **kw):
    rec = LogRecorder()
    args = MegaTrainArguments(
        output_dir=str(tmp_path / name),
        **common_args(megatrain_resident_layers="3", **kw),
    )
    trainer = HFMegaTrainer(model=model, args=args, train_dataset=make_data(), callbacks=[rec])
    # Tiny shapes: every floating saved tensor counts as large (default: >= 1M elements).
    trainer.megatrain.engine.offload_min_numel = 1
    trainer.train()
    return rec.logs, trainer


def _track(logs):
    return [(r["loss"], r["grad_norm"]) for r in logs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("ga", [1, 2], ids=["ga1", "ga2"])
def test_host_kept_activations_equal_recompute(tmp_path, arch, ga):
    model = tiny_model(tiny_config(arch, num_hidden_layers=4))
    kw = dict(max_steps=3, gradient_accumulation_steps=ga, megatrain_keep_activations="off")
    ref_logs, ref = _train(
        copy.deepcopy(model), tmp_path, "recompute", megatrain_host_kept_activations="off", **kw
    )
    logs, trainer = _train(model, tmp_path, "host", megatrain_host_kept_activations="2", **kw)
    layers = [layer.forward for layer in find_decoder_layers(trainer.model)[1]]
    # Two of the three tier layers (0-2), spread; layer 3 is streamed and recomputes.
    assert [(s.keep_graph, s.offload_graph) for s in layers] == [
        (True, True), (False, False), (True, True), (False, False),
    ]  # fmt: skip
    saved = trainer.megatrain.engine.saved
    assert saved.d2h_bytes > 0
    assert saved.h2d_bytes == saved.d2h_bytes  # every offloaded save came back once
    assert saved.layers() == []  # nothing left waiting after the step
    assert saved.host_bytes > 0
    # Same kernels, same values: bitwise equal, not merely close.
    assert _track(logs) == _track(ref_logs)
    got, want = mega_params(trainer), mega_params(ref)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_host_kept_layers_run_forward_once(tmp_path):
    model = tiny_model(tiny_config("llama", num_hidden_layers=4))
    _, trainer = _train(
        model, tmp_path, "warm", max_steps=1, megatrain_keep_activations="1",
        megatrain_host_kept_activations="1",
    )  # fmt: skip
    counts = _count_layer_forwards(trainer.model)
    trainer.args.max_steps = 1
    trainer.train(resume_from_checkpoint=None)
    # Layer 2 keeps in HBM (the tier's last), layer 1 in host RAM (the middle of 0-1).
    assert counts == {0: 2, 1: 1, 2: 1, 3: 2}


def test_host_kept_activations_option_values():
    assert EngineOptions().host_kept_activations == "auto"
    assert EngineOptions(host_kept_activations=3).host_kept_activations == "3"
    resolved = EngineOptions(host_kept_activations="off").resolve(clipping=True, cuda=False)
    assert resolved.host_kept_layers == 0
    with pytest.raises(OptionError, match="host_kept_activations='some'"):
        EngineOptions(host_kept_activations="some")


def test_spread_picks_evenly():
    assert spread(list(range(14)), 0) == []
    assert spread(list(range(14)), 1) == [7]
    assert spread(list(range(14)), 2) == [3, 10]
    assert spread(list(range(6)), 3) == [1, 3, 5]
    assert spread([4, 5, 6], 3) == [4, 5, 6]


def test_saved_tensor_offload_round_trip():
    """Large dense tensors go through the host (a permuted one keeps its strides, one saved
    twice is copied once); small, excluded and non-floating ones stay as they are."""
    offload = SavedTensorOffload(torch.device("cpu"), min_numel=8)
    weight = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 3, 4, requires_grad=True)
    with offload.saving(0, exclude=[weight]):
        h = x.transpose(0, 1) * 2  # a permuted (non-contiguous) tensor
        y = (h * h).sum() + (h @ weight).sum() + (x[:, :1, :1] * 3).sum()
    assert offload.layers() == [0]
    # x * 2 saves nothing large (a scalar); h is saved by the square (twice) and the matmul:
    # one copy of 24 floats.
    assert offload.d2h_bytes == 24 * 4
    y.backward()
    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = weight.detach().clone().requires_grad_(True)
    h_ref = x_ref.transpose(0, 1) * 2
    ((h_ref * h_ref).sum() + (h_ref @ w_ref).sum() + (x_ref[:, :1, :1] * 3).sum()).backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(weight.grad, w_ref.grad)
    assert offload.h2d_bytes == 24 * 4
    offload.release(0)
    assert offload.layers() == []


@pytest.fixture(scope="module")
def llama8b():
    from transformers import AutoConfig  # noqa: PLC0415

    from hf_megatrain.hf.model import model_shape_from_config  # noqa: PLC0415

    return model_shape_from_config(AutoConfig.from_pretrained(CONFIGS / "llama-3.1-8b"), "8b")


def test_plan_keeps_tier_activations_in_host_ram_where_it_is_free(llama8b):
    """Llama-3.1-8B at 64k tokens on an H200 with 124 GiB of host RAM: the ~58 GiB the host
    tier leaves hold HBM-tier layers' saves (13.8 GiB each without Liger's kernels), as many as PCIe carries during the
    tier's forward; the in-flight line costs no HBM (the later layers' boundaries are not made
    yet, or freed, when those run), so the tier keeps its size. Less host RAM, fewer; boundary
    offload (long context) or none asked: none."""
    off = _plan(llama8b, 65536, host_kept_activations="off")
    auto = _plan(llama8b, 65536)
    assert off.host_kept_layers == 0 and off.fits and auto.fits
    per_layer = host_kept_layer_bytes(auto.shape, auto.step)
    assert 13 * GIB < per_layer < 14 * GIB
    limit = host_kept_pcie_limit(auto.shape, auto.step, auto.n_hbm)
    assert 0 < auto.host_kept_layers <= limit < auto.n_hbm
    assert auto.n_hbm == off.n_hbm
    assert auto.host_total - off.host_total == auto.host_kept_layers * per_layer
    assert auto.host_total <= auto.host_available
    # Spread over the tier, and no longer among the recomputed layers keeping attention outputs.
    indices = auto.host_kept_layer_indices
    assert len(indices) == auto.host_kept_layers and max(indices) < auto.n_hbm
    assert min(b - a for a, b in zip(indices, indices[1:])) >= 2
    assert not set(indices) & set(auto.attention_layer_indices)
    assert "activations kept in host RAM, no recompute: layers " in auto.table()
    # Host RAM for two layers' saves beyond the tier's needs: two.
    two = _plan(llama8b, 65536, host=off.host_total + 2 * per_layer + GIB)
    assert two.host_kept_layers == 2 and two.n_hbm == off.n_hbm
    assert _plan(llama8b, 65536, host=off.host_total + GIB).host_kept_layers == 0
    assert _plan(llama8b, 65536, offload_activations=True).host_kept_layers == 0
    # A count asked for is planned as asked (at most the tier's layers).
    assert _plan(llama8b, 65536, host_kept_activations="3").host_kept_layers == 3
