import pytest
from transformers import LlamaConfig

from .helpers import VOCAB, tiny_model, train_both


def test_llama_matches_stock_trainer(tmp_path):
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    (stock, _), (mega, _) = train_both(tiny_model(cfg), tmp_path, steps=5)
    assert len(stock) == len(mega) == 5
    for a, b in zip(stock, mega):
        # fp32 on CPU, same kernels: the only differences are summation order in the global
        # norm and the clip coefficient applied as a fused-kernel scale (one rounding).
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["learning_rate"] == a["learning_rate"]
