"""init_streamed_model: HF's own random init written straight into the host store."""

import math

import pytest
import torch

from hf_megatrain import HFMegaTrainer, MegaTrainArguments, init_streamed_model
from hf_megatrain.hf.model import streamed_state

from .helpers import common_args, make_data, patch_mlps_as_liger, simulate_liger, tiny_config


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_init_streamed_model_matches_hf_init_statistics(tmp_path, arch):
    cfg = tiny_config(arch, hidden_size=64, intermediate_size=128)
    model = init_streamed_model(cfg, device="cpu", bf16=False, seed=0)
    std = cfg.initializer_range
    stores = streamed_state(model).store.layers
    for store in stores:
        for name, view in store.param_views(store.master).items():
            if view.dim() >= 2:
                # Normal(0, initializer_range) over >= 2k values: the sample std lands within a
                # few percent; 15% leaves room for the smallest tensors (routers).
                assert view.std().item() == pytest.approx(std, rel=0.15), name
            elif "norm" in name:
                assert torch.all(view == 1.0), name
        # The stream copy the GPU would receive is the master (fp32 run).
        assert store.stream is store.master
    emb = model.get_input_embeddings().weight
    assert emb.std().item() == pytest.approx(std, rel=0.15)
    # And it trains: a few streamed steps give finite, moving losses.
    args = MegaTrainArguments(output_dir=str(tmp_path), **common_args(max_steps=3))
    trainer = HFMegaTrainer(model=model, args=args, train_dataset=make_data(8))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # Random init over a 128-token vocabulary starts near ln(128).
    assert losses[0] == pytest.approx(math.log(cfg.vocab_size), rel=0.1)


def test_init_streamed_model_is_seeded():
    cfg = tiny_config("llama")

    def first_master(seed: int) -> torch.Tensor:
        model = init_streamed_model(cfg, device="cpu", bf16=False, seed=seed)
        return streamed_state(model).store.layers[0].master

    a, b, c = first_master(1), first_master(1), first_master(2)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_liger_kernels_go_in_before_the_loader_streams(monkeypatch):
    """use_liger_kernel on a streamed loader: the kernels are applied to the skeleton before it
    is streamed (the loader's memory plan then counts their smaller activations, as the
    trainer's does for a model it streams itself), and the initial weights are unchanged.
    Liger's Triton kernels need CUDA: a stand-in patches each MLP's forward as Liger does."""
    import hf_megatrain.hf.long_context as long_context
    from hf_megatrain.hf.model import model_shape, streamed_state

    calls = []

    def fake_apply(model, config):
        calls.append((config, streamed_state(model) is None))
        patch_mlps_as_liger(model)

    monkeypatch.setattr(long_context, "apply_liger_kernels", fake_apply)
    simulate_liger(monkeypatch)
    cfg = tiny_config("llama")
    kernels = {"swiglu": True}
    fused = init_streamed_model(
        cfg, device="cpu", bf16=False, seed=3, use_liger_kernel=True, liger_kernel_config=kernels
    )
    assert calls == [(kernels, True)], "applied once, to the model before it was streamed"
    assert model_shape(fused).fused_layer_kernels
    plain = init_streamed_model(cfg, device="cpu", bf16=False, seed=3, layer_kernels="torch")
    assert len(calls) == 1 and not model_shape(plain).fused_layer_kernels
    for a, b in zip(streamed_state(fused).store.layers, streamed_state(plain).store.layers):
        assert torch.equal(a.master, b.master)
