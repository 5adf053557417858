"""Packed documents (one row, position_ids restarting per document, no padding) through the
streamed engine: equal to stock Trainer on the same packed batches, and equal to running the
documents one by one."""

import copy

import pytest
import torch
from transformers import DataCollatorWithFlattening, LlamaConfig

from hf_megatrain import HFMegaTrainer, MegaTrainArguments

from .helpers import VOCAB, common_args, run_trainer, tiny_config, tiny_model

_CUDA = torch.cuda.is_available()
# sdpa: HF builds a block-diagonal causal mask from the restarting position_ids (dense, fine for
# short rows); flex_attention: a sparse BlockMask, the long-context choice. FlexAttention has no
# CPU backward, so its cases run on the GPU only.
IMPLS = [
    "sdpa",
    pytest.param(
        "flex_attention",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not _CUDA, reason="FlexAttention has no CPU backward"),
        ],
    ),
]


def _config(impl: str) -> LlamaConfig:
    # FlexAttention's Triton kernels need a head dim of at least 16 (the tiny shape has 8).
    cfg = tiny_config("llama", num_attention_heads=2, num_key_value_heads=1)
    cfg._attn_implementation = impl
    return cfg


def _docs(n: int = 24, seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 14, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids})
    return rows


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_training_matches_stock(tmp_path, impl):
    model = tiny_model(_config(impl))
    collator = DataCollatorWithFlattening()
    kw = dict(
        data=_docs(),
        per_device_train_batch_size=3,
        data_collator=collator,
        max_steps=4,
        use_cpu=not _CUDA,
    )
    stock, _ = run_trainer(copy.deepcopy(model), tmp_path, "stock", mega=False, **kw)
    mega, _ = run_trainer(model, tmp_path, "mega", mega=True, **kw)
    assert len(stock) == len(mega) == 4
    for a, b in zip(stock, mega):
        # fp32 CPU, same kernels and the same document mask: only summation orders differ.
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_equals_unpacked(tmp_path, impl):
    """Loss and gradients of a packed row equal those of its documents run separately."""
    model = tiny_model(_config(impl))
    args = MegaTrainArguments(output_dir=str(tmp_path), **common_args(use_cpu=not _CUDA))
    trainer = HFMegaTrainer(model=model, args=args, train_dataset=_docs(4))
    wrapper = trainer.streamed_model
    wrapper.train()
    engine = trainer.megatrain.engine
    docs = _docs(3, seed=7)

    def run(batches: list[dict], weight: list[float]) -> tuple[float, dict]:
        trainer.model.zero_grad(set_to_none=True)
        engine.reset_grads()
        total = 0.0
        for batch, w in zip(batches, weight):
            loss = wrapper(**batch).loss * w
            loss.backward()
            total += float(loss)
        engine.finish_grads()
        grads = {
            n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None
        }
        for i, store in enumerate(engine.stores):
            grads[f"layer{i}"] = store.grad.clone()
        return total, grads

    device = trainer.args.device
    packed = {k: v.to(device) for k, v in DataCollatorWithFlattening()(docs).items()}
    n_valid = int((packed["labels"] != -100).sum())
    packed_loss, packed_grads = run([packed], [1.0])
    # One document per batch: its mean loss weighted by its share of the predicted tokens.
    singles = [
        {
            "input_ids": torch.tensor([d["input_ids"]], device=device),
            "labels": torch.tensor([d["labels"]], device=device),
        }
        for d in docs
    ]
    weights = [(len(d["input_ids"]) - 1) / n_valid for d in docs]
    single_loss, single_grads = run(singles, weights)
    # fp32: the same per-token terms, summed in a different grouping.
    assert packed_loss == pytest.approx(single_loss, rel=1e-5)
    assert packed_grads.keys() == single_grads.keys()
    for k in packed_grads:
        torch.testing.assert_close(packed_grads[k], single_grads[k], rtol=1e-4, atol=1e-6)
