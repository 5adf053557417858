"""Boundary activation offload: layer inputs kept in host buffers between forward and backward
train exactly like inputs kept on the device (CPU exercises the same copy/fetch path)."""

import copy

import pytest
import torch

from hf_megatrain import HFMegaTrainer, MegaTrainArguments

from .helpers import LogRecorder, common_args, make_data, run_trainer, tiny_config, tiny_model


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_moe"])
def test_offloaded_activations_match_stock(tmp_path, arch):
    model = tiny_model(tiny_config(arch))
    stock, _ = run_trainer(copy.deepcopy(model), tmp_path, "stock", mega=False)
    rec = LogRecorder()
    args = MegaTrainArguments(
        output_dir=str(tmp_path / "mega"),
        megatrain_offload_activations=True,
        **common_args(),
    )
    trainer = HFMegaTrainer(model=model, args=args, train_dataset=make_data(), callbacks=[rec])
    engine = trainer.megatrain.engine
    assert engine.offload_activations
    engine.offload_min_numel = 1  # tiny shapes: offload every float input of every layer
    trainer.train()
    # Every layer's hidden-state input went through a host buffer, and nothing else did: the
    # RoPE cos/sin (same tensor for every layer) stay on the device, shared by reference.
    buffers = engine.activations.host_buffers()
    assert {layer for layer, _ in buffers} == set(range(len(engine.stores)))
    hidden = model.config.hidden_size
    assert all(h.shape[-1] == hidden for h in engine.activations.offloaded().values())
    assert len({k for _, k in buffers}) == 1, sorted(buffers)
    for a, b in zip(stock, rec.logs):
        # Offloading copies bytes; the arithmetic is that of the streamed path (fp32, rel 1e-5
        # as in the equivalence tests).
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert len(rec.logs) == len(stock) == 5


def test_offload_skips_small_inputs():
    from hf_megatrain.core.streaming import StreamingEngine

    engine = StreamingEngine([], torch.device("cpu"), torch.float32, offload_activations=True)
    stash = engine.activations
    residual = {(1 << 20,), (10,)}  # the shapes of the layer's floating outputs
    assert not stash.should_offload(torch.zeros(10), residual)  # below offload_min_numel (1M)
    assert stash.should_offload(torch.zeros(1 << 20), residual)
    big_ids = torch.zeros(1 << 20, dtype=torch.long)
    assert not stash.should_offload(big_ids, residual)  # ids, masks
    # Large but not the residual stream (RoPE tables): kept on the device by reference.
    assert not stash.should_offload(torch.zeros(1 << 21), residual)
    # Off unless the engine was built with it.
    off = StreamingEngine([], torch.device("cpu"), torch.float32).activations
    assert not off.should_offload(torch.zeros(1 << 20), residual)
