"""LoRA (PEFT) on a streamed frozen base: adapters resident, base streamed, saved adapters load
with stock peft."""

import copy

import pytest
import torch

from .helpers import make_data, run_trainer, tiny_config, tiny_model

peft = pytest.importorskip("peft")


def _lora_model(**lora):
    base = tiny_model(tiny_config("llama"))
    lora = {"target_modules": ["q_proj", "v_proj", "gate_proj"], **lora}
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **lora)
    model = peft.get_peft_model(base, cfg)
    # Non-zero B so the adapters matter from step one (peft initializes B to zero).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def test_lora_matches_stock_trainer_and_saves_loadable_adapters(tmp_path):
    model = _lora_model()
    untouched = copy.deepcopy(model)  # same frozen base, initial adapters
    stock, stock_trainer = run_trainer(copy.deepcopy(model), tmp_path, "stock", mega=False)
    mega, trainer = run_trainer(model, tmp_path, "mega", mega=True)
    assert len(stock) == len(mega) == 5
    for a, b in zip(stock, mega):
        # fp32 on CPU; the frozen base is bound from the host store, the adapters are the
        # same resident tensors: only summation orders differ (norm per tensor vs per layer).
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    # The base streams from a frozen host store: no gradient or moment buffers were allocated.
    stores = trainer.megatrain.store.layers
    assert all(not s.trainable and s.exp_avg is None for s in stores)
    # Adapters trained like the stock run's.
    stock_lora = {n: p for n, p in stock_trainer.model.named_parameters() if p.requires_grad}
    mega_lora = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert stock_lora.keys() == mega_lora.keys() and stock_lora
    for n, p in mega_lora.items():
        torch.testing.assert_close(p.detach().cpu(), stock_lora[n].detach(), rtol=1e-4, atol=1e-6)

    out = tmp_path / "adapters"
    trainer.save_model(str(out))
    assert (out / "adapter_model.safetensors").is_file()
    # Stock peft loads the adapters onto a fresh copy of the (unchanged) base.
    fresh = untouched.unload()
    loaded = peft.PeftModel.from_pretrained(fresh, str(out)).eval()
    ids = make_data(1)[0]["input_ids"][None]
    stock_trainer.model.eval()
    with torch.no_grad():
        ref = stock_trainer.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    # Same trained adapters (1e-4 above) on the same base.
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_lora_with_label_smoothing_matches_stock(tmp_path):
    """Label smoothing shifts the labels of a causal LM, which the Trainer tells by the name of
    the model it calls: under PEFT its base model's (the streamed wrapper's name before)."""
    model = _lora_model()
    kw = dict(max_steps=2, label_smoothing_factor=0.1)
    stock, _ = run_trainer(copy.deepcopy(model), tmp_path, "stock", mega=False, **kw)
    mega, _ = run_trainer(model, tmp_path, "mega", mega=True, **kw)
    assert len(stock) == len(mega) == 2
    for a, b in zip(stock, mega):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def test_lora_resume_continues_the_run(tmp_path):
    model = _lora_model()
    kw = dict(max_steps=6, save_strategy="steps", save_steps=3)
    full, _ = run_trainer(copy.deepcopy(model), tmp_path, "full", mega=True, **kw)
    resumed, _ = run_trainer(
        copy.deepcopy(model),
        tmp_path,
        "resumed",
        mega=True,
        resume=str(tmp_path / "full" / "checkpoint-3"),
        **kw,
    )
    assert len(resumed) == 3
    for a, b in zip(full[3:], resumed):
        # Adapters, their AdamW moments and the scheduler are restored exactly (fp32 CPU).
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["learning_rate"] == a["learning_rate"]


@pytest.mark.parametrize(
    "lora",
    [{"target_modules": ["q_proj", "lm_head"]}, {"modules_to_save": ["lm_head"]}],
    ids=["lora-on-head", "head-trained-whole"],
)
def test_an_adapted_lm_head_trains_as_stock(tmp_path, lora):
    """A LoRA-adapted LM head computes more than ``F.linear(x, weight, bias)``: the fused loss
    (which reads the head's weight) would drop the adapter's term, so such a model keeps its own
    forward; a head trained whole (``modules_to_save``, a plain copy) keeps the fused loss. Both
    train as the stock Trainer does (the head's adapters or copy included)."""
    from hf_megatrain.hf.loss import supports_fused_loss

    model = _lora_model(**lora)
    assert supports_fused_loss(model) is ("modules_to_save" in lora)
    stock, stock_trainer = run_trainer(copy.deepcopy(model), tmp_path, "stock", mega=False)
    mega, trainer = run_trainer(model, tmp_path, "mega", mega=True)
    for a, b in zip(stock, mega, strict=True):
        # fp32 on CPU: summation orders only (as the test above).
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    trained = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("lm_head" in n for n in trained)
    for n, p in stock_trainer.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(trained[n].detach().cpu(), p.detach(), rtol=1e-4, atol=1e-6)


def test_adapters_added_to_a_streamed_model_are_a_clear_error(tmp_path):
    """Adapters put on an already streamed model (``load_streamed_model``'s, then
    ``PeftModel.from_pretrained`` or ``get_peft_model``) wrap linear layers whose weights the
    store binds by name: its forward and generate() are refused in one line naming the layer
    and what to do (found by an audit: the forward failed inside torch's reparametrize)."""
    from hf_megatrain import load_streamed_model  # noqa: PLC0415
    from hf_megatrain.core.streamed_layer import LayerChangedError  # noqa: PLC0415

    base = tiny_model(tiny_config("llama"))
    base.save_pretrained(tmp_path / "base")
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    adapted.save_pretrained(tmp_path / "adapters")
    ids = torch.randint(3, 100, (1, 8))
    for attach in (
        lambda m: peft.PeftModel.from_pretrained(m, tmp_path / "adapters"),
        lambda m: peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_proj"])),
    ):
        model = attach(load_streamed_model(tmp_path / "base", bf16=False)).eval()
        with torch.no_grad(), pytest.raises(LayerChangedError, match="decoder layer 0's modules"):
            model(input_ids=ids)
        with torch.no_grad(), pytest.raises(LayerChangedError, match="merge_and_unload"):
            model.generate(input_ids=ids, max_new_tokens=2)
