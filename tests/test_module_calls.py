"""``nn.Module`` calls that callbacks and scripts make on ``trainer.model``, on a streamed model.

A streamed layer's parameters are meta placeholders; its weights live in the layer store.
``state_dict()`` / ``load_state_dict()`` / ``save_pretrained()`` must read and write the store:
before, ``torch.save(model.state_dict())`` wrote no layer weights, ``model.save_pretrained``
failed inside torch and ``load_state_dict`` was a silent no-op. Moves and casts: ``.to(device)``
to where it is failed inside torch, ``.half()`` silently cast the resident fp32 weights the
optimizer updates; ``copy.deepcopy`` and pickling failed on the store's shared memory. The
optimizer's ``state_dict()`` held no streamed layer's AdamW moments (a manual
``torch.save(trainer.optimizer.state_dict())`` lost them).

Tolerances: fp32 on the CPU. Reads are views of the fp32 masters (compared exactly); a trained
model is compared with the stock Trainer's at ``assert_close_weights``' 1e-6 (a few AdamW steps
at lr 1e-2 move weights ~1e-2; the two differ in summation order only, ~1e-7).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from hf_megatrain import HFMegaTrainer, MegaTrainArguments
from hf_megatrain.hf.model import find_decoder_layers, streamed_state
from hf_megatrain.hf.module_calls import written_placeholders

from .helpers import (
    assert_close_weights,
    common_args,
    make_data,
    mega_params,
    one_gpu,
    run_trainer,
    stock_params,
    tiny_config,
    tiny_model,
)

STEPS = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A streamed and a stock run of the same tiny Llama, STEPS steps each."""
    model = tiny_model(tiny_config("llama"))
    root = tmp_path_factory.mktemp("sd")
    _, stock = run_trainer(copy.deepcopy(model), root, "stock", False, max_steps=STEPS)
    _, mega = run_trainer(copy.deepcopy(model), root, "mega", True, max_steps=STEPS)
    return stock, mega


def _layer_keys(state: dict) -> list[str]:
    return [k for k in state if ".layers." in k]


def test_state_dict_holds_the_trained_weights(trained):
    stock, mega = trained
    state = mega.model.state_dict()
    assert _layer_keys(state) and not any(v.is_meta for v in state.values())
    expected = mega_params(mega)  # what save_model writes, from the host store
    assert sorted(state) == sorted(expected)
    for key, value in state.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
    assert_close_weights(stock_params(stock.model), {k: v.clone() for k, v in state.items()})
    # A layer's own state_dict (a callback walking modules) reads the store too.
    layer = mega.model.model.layers[1].state_dict()
    assert layer and all(not v.is_meta for v in layer.values())
    torch.testing.assert_close(
        layer["mlp.down_proj.weight"], expected["model.layers.1.mlp.down_proj.weight"]
    )


def test_torch_save_and_save_pretrained_write_the_weights(trained, tmp_path):
    stock, mega = trained
    expected = mega_params(mega)
    torch.save(mega.model.state_dict(), tmp_path / "sd.pt")
    loaded = torch.load(tmp_path / "sd.pt")
    assert sorted(loaded) == sorted(expected)
    for key in _layer_keys(expected):
        torch.testing.assert_close(loaded[key], expected[key], rtol=0, atol=0, msg=key)
    # transformers' own save, as a script or callback would call it on trainer.model.
    mega.model.save_pretrained(tmp_path / "direct")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "direct", dtype=torch.float32)
    assert_close_weights(expected, stock_params(reloaded), atol=0)


def test_load_state_dict_writes_the_store(trained):
    _, mega = trained
    other = tiny_model(tiny_config("llama"), seed=7)  # other weights, the same shapes
    values = stock_params(other)
    result = mega.model.load_state_dict(values)
    assert not result.missing_keys and not result.unexpected_keys
    assert_close_weights(values, mega_params(mega), atol=0)
    # The forward streams the new weights: the same loss as the model they came from.
    batch = make_data(2, seed=5)
    ids = torch.stack([r["input_ids"] for r in batch])
    with torch.no_grad():
        want = other(input_ids=ids, labels=ids).loss
        mega.model.eval()
        got = mega.model(input_ids=ids, labels=ids).loss
        mega.model.train()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_load_state_dict_refuses_what_it_cannot_write(trained):
    _, mega = trained
    before = mega_params(mega)
    values = stock_params(tiny_model(tiny_config("llama"), seed=9))
    key = "model.layers.0.self_attn.q_proj.weight"
    bad = dict(values)
    bad[key] = values[key][:-1]  # one row short
    with pytest.raises(RuntimeError, match="size mismatch"):
        mega.model.load_state_dict(bad)
    for k in _layer_keys(before):
        if k.startswith("model.layers.0."):  # the layer with the bad tensor is left as it was
            torch.testing.assert_close(mega_params(mega)[k], before[k], rtol=0, atol=0, msg=k)
    with pytest.raises(ValueError, match="assign=False"):
        mega.model.load_state_dict(values, assign=True)
    assert mega.model.model.layers[0].self_attn.q_proj.weight.is_meta  # placeholders kept


def test_moves_to_where_it_is_do_nothing_and_casts_are_refused(trained):
    _, mega = trained
    model = mega.model
    before = mega_params(mega)
    ids = make_data(1, seed=5)[0]["input_ids"][None]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    # What scripts call before inference: the model is there already, in this dtype.
    assert model.to("cpu") is model and model.cpu() is model and model.float() is model
    layer = model.model.layers[0]
    assert model.to(torch.float32) is model and layer.to("cpu") is layer
    for cast in (model.half, model.bfloat16, model.double, lambda: model.to(torch.float16)):
        with pytest.raises(ValueError, match="save_pretrained"):
            cast()
    assert model.model.embed_tokens.weight.dtype == torch.float32  # nothing was cast
    assert_close_weights(before, mega_params(mega), atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, loss, rtol=0, atol=0)


def test_copies_and_pickles_are_refused_in_one_line(trained, tmp_path):
    _, mega = trained
    for copy_it in (
        lambda: copy.deepcopy(mega.model),
        lambda: pickle.dumps(mega.model),
        lambda: torch.save(mega.model, tmp_path / "m.pt"),
        lambda: copy.deepcopy(mega.model.model.layers[1]),
    ):
        with pytest.raises(TypeError, match="cannot be copied or pickled"):
            copy_it()


def test_optimizer_state_dict_holds_and_restores_the_streamed_moments(tmp_path):
    from safetensors.torch import load_file

    from hf_megatrain.core.optimizer import STREAMED_STATE_KEY

    model = tiny_model(tiny_config("llama"))
    kw = dict(max_steps=2, save_strategy="steps", save_steps=2)
    _, mega = run_trainer(model, tmp_path, "mega", True, **kw)
    state = mega.optimizer.state_dict()
    layers = state[STREAMED_STATE_KEY]["layers"]
    assert sorted(layers) == list(range(model.config.num_hidden_layers))
    # The same moments the trainer's checkpoint wrote (its own format, one file per layer).
    saved = tmp_path / "mega" / "checkpoint-2" / "megatrain_optimizer"
    for i, entry in layers.items():
        on_disk = load_file(saved / f"layer_{i:05d}.safetensors")
        assert entry["exp_avg"].abs().sum() > 0 and entry["step"] == 2.0
        torch.testing.assert_close(entry["exp_avg"], on_disk["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(entry["exp_avg_sq"], on_disk["exp_avg_sq"], rtol=0, atol=0)
    snapshot = copy.deepcopy(state)  # (the entries are views of the store: copied)
    torch.save(snapshot, tmp_path / "opt.pt")
    mega.train()  # two more updates move every moment
    moved = mega.optimizer.state_dict()[STREAMED_STATE_KEY]["layers"]
    assert not torch.equal(
        moved[0]["exp_avg"], snapshot[STREAMED_STATE_KEY]["layers"][0]["exp_avg"]
    )
    mega.optimizer.load_state_dict(torch.load(tmp_path / "opt.pt"))
    back = mega.optimizer.state_dict()
    for i, entry in back[STREAMED_STATE_KEY]["layers"].items():
        want = snapshot[STREAMED_STATE_KEY]["layers"][i]
        torch.testing.assert_close(entry["exp_avg"], want["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(entry["exp_avg_sq"], want["exp_avg_sq"], rtol=0, atol=0)
        assert entry["step"] == want["step"]
    for key, value in snapshot["state"].items():  # the resident parameters' state too
        torch.testing.assert_close(back["state"][key]["exp_avg"], value["exp_avg"])
    # A state dict without the streamed layers' state (a stock optimizer's) is refused.
    with pytest.raises(ValueError, match="holds no streamed layer"):
        mega.optimizer.load_state_dict(
            {k: v for k, v in snapshot.items() if k != STREAMED_STATE_KEY}
        )
    wrong = copy.deepcopy(snapshot)
    del wrong[STREAMED_STATE_KEY]["layers"][1]
    with pytest.raises(ValueError, match="the state of layers"):
        mega.optimizer.load_state_dict(wrong)


def test_a_streamed_peft_models_state_dict_holds_its_frozen_base(tmp_path):
    """Under PEFT the layers' base weights stream from frozen stores: state_dict() reads them
    (unchanged by training, so equal to the base's own), beside the trained adapters."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    base = tiny_model(tiny_config("llama"))
    original = {k: v.detach().clone() for k, v in base.state_dict().items()}
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear"))
    _, mega = run_trainer(model, tmp_path, "mega", True, max_steps=STEPS)
    state = mega.model.state_dict()
    assert not any(v.is_meta for v in state.values())
    layer_base = [k for k in state if ".layers." in k and ".base_layer." in k]
    assert layer_base
    for key in layer_base:
        name = key.removeprefix("base_model.model.").replace(".base_layer", "")
        torch.testing.assert_close(state[key], original[name], rtol=0, atol=0, msg=key)
    adapters = get_peft_model_state_dict(mega.model)
    assert adapters and all(v.abs().sum() > 0 for k, v in adapters.items() if "lora_B" in k)


def _batch(seed: int) -> torch.Tensor:
    return torch.stack([r["input_ids"] for r in make_data(2, seed=seed)])


def test_model_zero_grad_clears_the_streamed_layers_gradients(tmp_path):
    """A backward outside the trainer (a probe, a custom loss), then training: the trainer's
    model.zero_grad() at the start clears every gradient in stock. The streamed layers'
    gradients accumulate in the engine, not on their placeholders, and leaked into the first
    step (weights ~1e-3 off stock's after 3 steps)."""
    from hf_megatrain import prepare_streamed_model

    start = tiny_model(tiny_config("llama"))
    runs = {}
    for name, mega in (("stock", False), ("mega", True)):
        model = copy.deepcopy(start)
        if mega:
            model = prepare_streamed_model(model, "cpu", torch.float32)
        ids = _batch(11)
        model(input_ids=ids, labels=ids).loss.backward()  # the stray backward
        _, runs[name] = run_trainer(model, tmp_path, name, mega, max_steps=STEPS)
    assert_close_weights(stock_params(runs["stock"].model), mega_params(runs["mega"]))


def test_casting_a_submodule_is_refused_before_anything_is_cast(trained):
    """``model.model.half()`` recursed into the embedding (cast it) before a streamed layer
    refused: the resident fp32 weights the optimizer updates were left half cast."""
    _, mega = trained
    before = mega_params(mega)
    model = mega.model
    for cast in (
        model.model.half,
        lambda: model.model.to(torch.bfloat16),
        model.model.embed_tokens.half,
        model.model.layers[0].mlp.half,
        model.lm_head.double,
    ):
        with pytest.raises(ValueError, match="save_pretrained"):
            cast()
    assert all(p.dtype == torch.float32 for p in model.parameters())  # placeholders too
    assert model.model.to("cpu") is model.model  # where it is: nothing to do
    assert_close_weights(before, mega_params(mega), atol=0)


def _init_linears(module: torch.nn.Module) -> None:
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.normal_(module.weight, std=0.05)


def _replace_norms(module: torch.nn.Module) -> None:
    if type(module).__name__.endswith("RMSNorm"):
        module.weight = torch.nn.Parameter(torch.full_like(module.weight, 0.5))


def test_apply_reaches_the_streamed_layers_weights(tmp_path):
    """``model.apply(init_fn)``: the function saw the streamed layers' meta placeholders, so
    its writes were lost (only the resident tensors changed). It now sees the fp32 masters;
    what it writes, in place or as a new parameter, is what the layers stream."""
    from hf_megatrain import prepare_streamed_model

    start = tiny_model(tiny_config("llama"))
    stock = copy.deepcopy(start)
    mega = prepare_streamed_model(copy.deepcopy(start), "cpu", torch.float32)
    for model in (stock, mega):
        torch.manual_seed(3)  # the same draws: apply visits the modules in the same order
        assert model.apply(_init_linears) is model
        model.apply(_replace_norms)
    from hf_megatrain.hf.checkpoint import host_state_dict

    got = {k: v.detach().clone() for k, v in host_state_dict(mega).items()}
    want = stock_params(stock)
    assert not torch.equal(want["model.layers.1.mlp.up_proj.weight"], stock_params(start)[
        "model.layers.1.mlp.up_proj.weight"])  # fmt: skip
    assert_close_weights(want, got, atol=0)
    assert mega.model.layers[0].mlp.up_proj.weight.is_meta  # the placeholders are back
    ids = _batch(5)
    with torch.no_grad():
        stock.eval(), mega.eval()
        torch.testing.assert_close(
            mega(input_ids=ids, labels=ids).loss, stock(input_ids=ids, labels=ids).loss,
            rtol=1e-6, atol=0,  # fp32, the same weights; the streamed forward's own order
        )  # fmt: skip
    # One layer's apply binds that layer; a reshaping function is refused, the weights kept.
    mega.model.layers[1].apply(_init_linears)

    def reshape(module):
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(module.weight[:1].clone())

    before = {k: v.detach().clone() for k, v in host_state_dict(mega).items()}
    with pytest.raises(ValueError, match="removed or reshaped"):
        mega.model.layers[1].apply(reshape)
    after = host_state_dict(mega)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_in_place_writes_to_state_dict_views_reach_the_bf16_stream(tmp_path):
    """With bf16 compute copies, ``state_dict()`` views are of the fp32 master: writes into
    them changed the saved weights but the layers kept streaming the old bf16 copy."""
    from hf_megatrain import prepare_streamed_model

    start = tiny_model(tiny_config("llama"))
    values = stock_params(tiny_model(tiny_config("llama"), seed=7))
    ids = _batch(5)
    losses = []
    for write in ("in_place", "load_state_dict"):
        model = prepare_streamed_model(copy.deepcopy(start), "cpu", torch.bfloat16)
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, labels=ids)  # the old weights are in use once
            if write == "in_place":
                state = model.state_dict()
                for key, value in values.items():
                    state[key].copy_(value)
            else:
                model.load_state_dict(values)
            losses.append(model(input_ids=ids, labels=ids).loss)
    # load_state_dict re-derives the bf16 copies: in-place writes must stream the same bits.
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)


class _InputSaliency:
    """A callback that, after each step, takes the loss's gradient with respect to a probe
    batch's input embeddings (saliency, a gradient penalty's first half) with
    ``torch.autograd.grad``, which leaves every parameter's gradient as it is."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, model=None, **kw):
                ids = _batch(13)
                embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
                loss = model(inputs_embeds=embeds, labels=ids).loss
                (g,) = torch.autograd.grad(loss, embeds)
                assert g.abs().sum() > 0

        self.callback = Callback()


def test_autograd_grad_with_respect_to_inputs_leaves_the_layers_gradients(tmp_path):
    """``torch.autograd.grad(loss, inputs)`` (and ``backward(inputs=...)`` without the model's
    parameters) accumulated the streamed layers' weight gradients into the engine anyway: a
    callback taking input gradients after a step added them to the next step's (weights
    ~1e-3 off stock's)."""
    from hf_megatrain import prepare_streamed_model

    start = tiny_model(tiny_config("llama"))
    runs = {}
    for name, mega in (("stock", False), ("mega", True)):
        _, runs[name] = run_trainer(
            copy.deepcopy(start), tmp_path, name, mega, max_steps=STEPS,
            callbacks=[_InputSaliency().callback],
        )  # fmt: skip
    assert_close_weights(stock_params(runs["stock"].model), mega_params(runs["mega"]))
    # backward(inputs=...): the named parameters' gradients only; with every parameter named
    # (the streamed layers' placeholders among them), the layers' gradients too, as backward().
    model = prepare_streamed_model(copy.deepcopy(start), "cpu", torch.float32)
    engine = streamed_state(model).engine
    ids = _batch(5)
    model(input_ids=ids, labels=ids).loss.backward(inputs=[model.lm_head.weight])
    assert model.lm_head.weight.grad is not None and not engine.has_grads()
    # autograd.grad never accumulates, also with respect to the parameters (allow_unused: the
    # streamed layers' placeholders get no gradient of their own).
    params = list(model.parameters())
    torch.autograd.grad(model(input_ids=ids, labels=ids).loss, params, allow_unused=True)
    assert not engine.has_grads()
    model(input_ids=ids, labels=ids).loss.backward(inputs=params)
    assert engine.has_grads()
    model.zero_grad()
    # One of a layer's weights named (not its first): the layer's gradients accumulate.
    up = model.model.layers[1].mlp.up_proj.weight
    model(input_ids=ids, labels=ids).loss.backward(inputs=[up])
    assert engine.has_grads()


@pytest.mark.parametrize("streamed_bf16", [True, False], ids=["bf16-weights", "fp32-weights"])
def test_a_model_streamed_in_another_precision_is_refused(tmp_path, streamed_bf16):
    """Found by an audit: a model streamed with bf16 weights (``load_streamed_model``'s default)
    and trained with fp32 arguments (the Trainer's default) ran in neither precision, silently;
    the reverse failed deep in the recompute, naming another option. One line naming both."""
    from hf_megatrain import prepare_streamed_model

    dtype = torch.bfloat16 if streamed_bf16 else torch.float32
    model = prepare_streamed_model(tiny_model(tiny_config("llama")), "cpu", dtype)
    with pytest.raises(ValueError, match="but the training arguments compute in") as e:
        run_trainer(model, tmp_path, "mega", True, max_steps=1, bf16=not streamed_bf16)
    assert f"bf16={not streamed_bf16}" in str(e.value)


def test_a_loop_of_ones_own_trains_with_streamed_optimizer(tmp_path):
    """Found by an audit: ``torch.optim.AdamW(model.parameters())`` over a streamed model saw
    the layers' placeholders and left the decoder layers untrained, silently. It is refused at
    its first step; ``streamed_optimizer`` trains as torch's AdamW trains the stock model
    (fp32: the fused and foreach kernels and the norm's summation order round apart, ~1e-7)."""
    from hf_megatrain import prepare_streamed_model, streamed_optimizer

    start = tiny_model(tiny_config("llama"))
    stock = copy.deepcopy(start)
    mega = prepare_streamed_model(copy.deepcopy(start), "cpu", torch.float32)
    foreign = torch.optim.AdamW(mega.parameters(), lr=1e-2)
    ids = _batch(3)
    mega(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(ValueError, match="streamed_optimizer"):
        foreign.step()
    # So is torch's clipping over its parameters (it clipped by the norm of the resident
    # parameters alone, silently; found by an audit); a stock model's stays torch's.
    with pytest.raises(ValueError, match=r"optimizer\.clip_grad_norm_\(max_norm\)"):
        torch.nn.utils.clip_grad_norm_(mega.parameters(), 1.0)
    # And torch's other clipping functions, accelerate's way to them included (its
    # clip_grad_norm_ goes through clip_grads_with_norm_: found by a later audit).
    from accelerate import Accelerator

    with pytest.raises(ValueError, match="clip_grad_value_ was given a streamed model's"):
        torch.nn.utils.clip_grad_value_(mega.parameters(), 1.0)
    with pytest.raises(ValueError, match="accelerate's clip_grad_norm_ was given a streamed model's"):
        Accelerator(cpu=True).clip_grad_norm_(mega.parameters(), 1.0)
    mega.zero_grad()
    optimizers = {
        "stock": torch.optim.AdamW(stock.parameters(), lr=1e-2, weight_decay=0.0),
        "mega": streamed_optimizer(mega, lr=1e-2, weight_decay=0.0),
    }
    losses = {"stock": [], "mega": []}
    for step in range(STEPS):
        ids = _batch(20 + step)
        for name, model in (("stock", stock), ("mega", mega)):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if name == "stock":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            else:
                optimizers[name].clip_grad_norm_(0.5)
            optimizers[name].step()
            optimizers[name].zero_grad()
            losses[name].append(loss.item())
    assert losses["mega"] == pytest.approx(losses["stock"], rel=1e-6)
    from hf_megatrain.hf.checkpoint import host_state_dict

    got = {k: v.detach().clone() for k, v in host_state_dict(mega).items()}
    # AdamW divides by each element's RMS: an element whose gradient is near rounding turns the
    # kernels' ulp differences into update differences (1.3e-6 measured with transformers
    # 5.25's initial weights, 1e-7 elsewhere); a missed or doubled update leaves ~1e-2.
    assert_close_weights(stock_params(stock), got, atol=1e-5)


class _ShrinkThroughParameters(TrainerCallback):
    """A weight constraint applied after each step the stock way: in place, over
    ``model.named_parameters()`` (found by an audit: the streamed layers' writes vanished)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "down_proj" in name:
                    p.mul_(0.9)


def test_writes_into_placeholders_stop_the_run(tmp_path):
    """In-place writes into a streamed layer's placeholders change no weight: the next step is
    refused, naming the parameter and the way that writes (state_dict()'s views)."""
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight .*state_dict"):
        run_trainer(
            tiny_model(tiny_config("llama")), tmp_path, "shrink", True, max_steps=STEPS,
            callbacks=[_ShrinkThroughParameters()],
        )  # fmt: skip


def test_writes_after_the_last_step_are_said_and_the_model_kept(tmp_path, caplog):
    """A write after the last step is said (a warning, not an error: the trained run can still
    be saved). load_state_dict's own copy into the placeholders is no such write."""
    import logging  # noqa: PLC0415

    model = tiny_model(tiny_config("llama"))
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
        _, trainer = run_trainer(
            copy.deepcopy(model), tmp_path, "last", True, max_steps=1,
            callbacks=[_ShrinkThroughParameters()],
        )  # fmt: skip
    assert "was written in place through the model's parameters" in caplog.text
    assert written_placeholders(find_decoder_layers(trainer.model)[1])
    _, clean = run_trainer(copy.deepcopy(model), tmp_path, "clean", True, max_steps=1)
    clean.model.load_state_dict(stock_params(model))
    assert not written_placeholders(find_decoder_layers(clean.model)[1])


def test_a_loss_over_the_placeholders_is_a_clear_error(tmp_path):
    """An L2 penalty over ``model.parameters()`` in ``compute_loss`` (which trains on stock)
    reads the placeholders: refused with what to use instead, not autograd's meta error."""

    class L2(HFMegaTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return loss + 1e-3 * sum((p**2).sum() for p in model.parameters() if p.requires_grad)

    args = one_gpu(MegaTrainArguments(output_dir=str(tmp_path), **common_args(max_steps=1)))
    trainer = L2(model=tiny_model(tiny_config("llama")), args=args, train_dataset=make_data())
    with pytest.raises(ValueError, match="placeholders on the meta device.*weight_decay"):
        trainer.train()
