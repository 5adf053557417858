import copy

import pytest

from .helpers import run_trainer, tiny_config, tiny_model


@pytest.mark.parametrize("overlap", [False, True], ids=["sync-update", "threaded-update"])
def test_llama_matches_stock_trainer(tmp_path, overlap):
    cfg = tiny_config("llama", num_hidden_layers=3)
    # threaded-update: the host AdamW runs on a background thread overlapping the next forward
    # (the CUDA default); it must not change a single number.
    model = tiny_model(cfg)
    stock, _ = run_trainer(copy.deepcopy(model), tmp_path, "stock", mega=False, max_steps=5)
    mega, trainer = run_trainer(
        model, tmp_path, "mega", mega=True, max_steps=5, megatrain_overlap_optimizer=overlap
    )
    assert trainer.optimizer.overlap_update is overlap
    # The dense path trains through the fused chunked LM-head loss (logits never built).
    assert trainer.streamed_model.fused_loss
    # Throughput and memory reach the Trainer's logs (so TensorBoard / W&B callbacks see them).
    last = mega[-1]
    assert last["tokens_per_s"] > 0 and last["model_tflops"] > 0
    n_params = sum(p.numel() for p in trainer.model.parameters())
    assert last["model_tflops"] == pytest.approx(
        6 * n_params * last["tokens_per_s"] / 1e12, rel=1e-2
    )
    assert 0 < last["host_rss_gib"] <= last["host_peak_gib"]
    # Waits for the host update: the overlapped one's forward may wait, the synchronous never.
    assert last["host_update_wait_s"] >= 0 if overlap else last["host_update_wait_s"] == 0
    assert last["host_updates_on_gpu"] == 0  # CUDA only
    # The threaded update's rate (parameters per second over its layer updates since the last
    # log; a log interval in which none finished has none); the synchronous update runs on the
    # training thread and reports none.
    rates = [log["host_update_gparams_s"] for log in mega if "host_update_gparams_s" in log]
    assert (len(rates) > 0 and min(rates) > 0) if overlap else not rates
    assert len(stock) == len(mega) == 5
    for a, b in zip(stock, mega):
        # fp32 on CPU, same kernels: the only differences are summation order in the global
        # norm and the clip coefficient applied as a fused-kernel scale (one rounding).
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["learning_rate"] == a["learning_rate"]


def test_hbm_tier_layers_match_stock_trainer(tmp_path):
    """Layers kept whole on the compute device (the HBM tier) train exactly like streamed ones."""
    cfg = tiny_config("llama", num_hidden_layers=3)
    model = tiny_model(cfg)
    stock, _ = run_trainer(copy.deepcopy(model), tmp_path, "stock", mega=False, max_steps=5)
    mega, trainer = run_trainer(
        model, tmp_path, "mega", mega=True, max_steps=5, megatrain_resident_layers="2"
    )
    assert [s.resident for s in trainer.megatrain.store.layers] == [True, True, False]
    for a, b in zip(stock, mega):
        # Same kernels and order as the streamed path; tolerance as in the test above.
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def test_plain_training_arguments_are_accepted(tmp_path):
    """A plain TrainingArguments (no megatrain_* fields) runs with the engine's defaults."""
    from transformers import TrainingArguments

    from hf_megatrain import HFMegaTrainer

    from .helpers import LogRecorder, common_args, make_data

    cfg = tiny_config("llama")
    model = tiny_model(cfg)
    stock, _ = run_trainer(copy.deepcopy(model), tmp_path, "stock", mega=False, max_steps=3)
    rec = LogRecorder()
    args = TrainingArguments(output_dir=str(tmp_path / "plain"), **common_args(max_steps=3))
    HFMegaTrainer(model=model, args=args, train_dataset=make_data(), callbacks=[rec]).train()
    for a, b in zip(stock, rec.logs):
        # As in the tests above: fp32, same kernels, norm summation order differs.
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["learning_rate"] == a["learning_rate"]
    assert len(rec.logs) == 3
