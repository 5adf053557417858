"""Without clipping, layers update during backward (eager) and training equals the stock Trainer."""

import copy

import pytest

from .helpers import (
    assert_logs_match,
    mega_params,
    run_trainer,
    stock_params,
    tiny_config,
    tiny_model,
)


@pytest.mark.parametrize("ga", [1, 2], ids=["ga1", "ga2"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_eager_updates_match_stock(tmp_path, arch, ga):
    model = tiny_model(tiny_config(arch))
    kw = dict(max_grad_norm=0.0, gradient_accumulation_steps=ga, per_device_train_batch_size=2)
    stock, stock_trainer = run_trainer(copy.deepcopy(model), tmp_path, "stock", mega=False, **kw)
    mega, trainer = run_trainer(model, tmp_path, "mega", mega=True, **kw)
    assert trainer.optimizer.eager
    # Every streamed layer updated inside backward at every step, none in step().
    assert trainer.optimizer.eager_updates == 5 * len(trainer.megatrain.store.layers)
    assert_logs_match(stock, mega)
    got, ref = mega_params(trainer), stock_params(stock_trainer.model)
    for k, v in ref.items():
        # fp32, same kernels in the same per-layer order as the deferred update.
        assert got[k].cpu().allclose(v, rtol=1e-4, atol=1e-6), k


def test_eager_updates_off_with_clipping(tmp_path):
    _, trainer = run_trainer(tiny_model(tiny_config("llama")), tmp_path, "mega", mega=True)
    assert not trainer.optimizer.eager and trainer.optimizer.eager_updates == 0


_EXIT_SCRIPT = """
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from hf_megatrain import prepare_streamed_model
from hf_megatrain.core.optimizer import HostAdamW
from hf_megatrain.hf.model import streamed_state
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)
model = AutoModelForCausalLM.from_config(cfg)
prepare_streamed_model(model, device="cpu", compute_dtype=torch.float32)
engine = streamed_state(model).engine
opt = HostAdamW(engine, [])
opt.enable_eager_updates()
engine.is_cuda = True  # the worker thread is a CUDA-only path; only its lifetime is tested
opt.on_layer_grad_final(0, None)
raise SystemExit(3)  # training fails before step() joins the worker
"""


def test_eager_worker_does_not_block_exit():
    """A run that fails mid-step must exit, not hang on the idle eager-update thread."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT], env=env, timeout=120, capture_output=True
    )
    assert proc.returncode == 3, proc.stderr.decode()[-2000:]
