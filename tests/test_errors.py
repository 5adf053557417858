"""Bad input is refused with a clear error, before anything is allocated or written."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    DogeConfig,
    DogeForCausalLM,
    LlamaForSequenceClassification,
)

from hf_megatrain import (
    HFMegaTrainer,
    InsufficientHostMemoryError,
    MegaTrainArguments,
    UnsupportedModelError,
    load_streamed_model,
)
from hf_megatrain.core.distributed import DataParallelError
from hf_megatrain.hf.model import streamed_state

from .helpers import common_args, make_data, tiny_config, tiny_model, two_forward_trainers


def _args(tmp_path, **kw) -> MegaTrainArguments:
    return MegaTrainArguments(output_dir=str(tmp_path / "out"), **common_args(**kw))


def _assert_untouched(model, tmp_path) -> None:
    """Nothing was streamed (no parameter moved to meta) and no output was written."""
    assert streamed_state(model) is None
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "model_type,build",
    [
        (
            "doge",
            lambda: DogeForCausalLM(
                DogeConfig(
                    vocab_size=128,
                    hidden_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=4,
                    intermediate_size=64,
                )
            ),
        ),
        (
            "bert",
            lambda: BertForMaskedLM(
                BertConfig(
                    vocab_size=128,
                    hidden_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    intermediate_size=64,
                )
            ),
        ),
    ],
)
def test_unsupported_architecture(model_type, build, tmp_path):
    model = build()
    with pytest.raises(UnsupportedModelError, match=f"model_type '{model_type}'") as err:
        HFMegaTrainer(model=model, args=_args(tmp_path), train_dataset=make_data(4))
    assert "llama" in str(err.value)  # lists what is supported
    _assert_untouched(model, tmp_path)


def test_supported_family_but_not_causal_lm(tmp_path):
    cfg = tiny_config("llama")
    cfg.num_labels = 2
    model = LlamaForSequenceClassification(cfg)
    with pytest.raises(UnsupportedModelError, match="ForCausalLM"):
        HFMegaTrainer(model=model, args=_args(tmp_path), train_dataset=make_data(4))
    _assert_untouched(model, tmp_path)


def test_a_module_without_a_config_is_refused_as_unsupported(tmp_path):
    """Found by an audit: a plain ``nn.Module`` failed with an AttributeError from the attention
    choice, which read its config before the support check ran."""
    model = torch.nn.Linear(4, 4)
    with pytest.raises(UnsupportedModelError, match="Linear has no config: not a transformers"):
        HFMegaTrainer(model=model, args=_args(tmp_path), train_dataset=make_data(4))


@pytest.mark.parametrize("how", ["init_empty_weights", "to-meta"])
def test_a_model_without_values_is_refused(tmp_path, how):
    """Found by an audit: a model built under accelerate's ``init_empty_weights`` (parameters on
    meta, buffers real) was streamed with its layers unfilled and its embeddings and head as
    uninitialized memory: step 1's loss NaN, reported as a divergence ("lower the learning
    rate"). ``model.to("meta")`` failed in train(), deep in the rotary embedding."""
    from accelerate import init_empty_weights

    if how == "init_empty_weights":
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    else:
        model = tiny_model(tiny_config("llama")).to("meta")
    with pytest.raises(ValueError, match=r"tensors on the meta device, without values \(model\."):
        HFMegaTrainer(model=model, args=_args(tmp_path), train_dataset=make_data(4))


def test_router_aux_loss_without_router_logits_refused(tmp_path, monkeypatch):
    """An MoE decoder that does not return its router logits (transformers 5.17's GraniteMoE)
    with output_router_logits on: its own forward fails adding an int aux "loss"; refused in
    one line before streaming, and accepted with the aux loss off."""
    model = tiny_model(tiny_config("mixtral"))
    decoder = type(model.model)
    recorded = {k: v for k, v in decoder._can_record_outputs.items() if k != "router_logits"}
    monkeypatch.setattr(decoder, "_can_record_outputs", recorded)
    with pytest.raises(UnsupportedModelError, match="output_router_logits = False"):
        HFMegaTrainer(model=model, args=_args(tmp_path), train_dataset=make_data(4))
    _assert_untouched(model, tmp_path)
    model.config.output_router_logits = False
    HFMegaTrainer(model=model, args=_args(tmp_path), train_dataset=make_data(4))


def test_fp16_refused(tmp_path):
    model = tiny_model(tiny_config("llama"))
    args = _args(tmp_path)
    args.fp16 = True  # set after construction: TrainingArguments itself may refuse fp16 on CPU
    with pytest.raises(ValueError, match="fp16"):
        HFMegaTrainer(model=model, args=args, train_dataset=make_data(4))
    _assert_untouched(model, tmp_path)


def test_unsupported_optimizer_refused(tmp_path):
    model = tiny_model(tiny_config("llama"))
    with pytest.raises(ValueError, match="optim='sgd'"):
        HFMegaTrainer(model=model, args=_args(tmp_path, optim="sgd"), train_dataset=make_data(4))
    _assert_untouched(model, tmp_path)


def test_optimizer_given_to_the_trainer_refused(tmp_path):
    """An optimizer passed to the Trainer (instance or class) is refused before streaming: it was
    ignored (optimizer_cls_and_kwargs: AdamW trained instead) or failed in the first step
    (optimizers=: an AttributeError about 'nonfinite')."""
    model = tiny_model(tiny_config("llama"))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for kw, name in (
        (dict(optimizers=(sgd, None)), r"optimizers=\(SGD"),
        (dict(optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1})), r"optimizer_cls_and_kw"),
    ):
        with pytest.raises(ValueError, match=name + r".*not supported.*engine's own AdamW"):
            HFMegaTrainer(model=model, args=_args(tmp_path), train_dataset=make_data(4), **kw)
        _assert_untouched(model, tmp_path)


@pytest.mark.parametrize(
    "args,said",
    [
        (dict(adam_epsilon=-1.0), r"adam_epsilon=-1.0 must be >= 0"),
        (dict(learning_rate=float("nan")), r"learning_rate=nan must be >= 0"),
        (dict(adam_beta2=1.0), r"adam_beta2=1.0 must be in \[0, 1\)"),
        # Found by an audit: AdamW takes eps=0, and the first step wrote NaN into every weight
        # whose gradient was 0; the next steps were skipped as a "non-finite loss".
        (dict(adam_epsilon=0.0), r"adam_epsilon=0.0 must be > 0 \(0 makes NaN weights"),
        # The refusal said torch.optim.AdamW refuses it, which the Trainer's groups get past.
        (dict(weight_decay=-0.1), r"weight_decay=-0.1 must be >= 0 \(a negative decay grows"),
        (dict(lr_scheduler_type="cosine_with_min_lr"), r"cosine_with_min_lr.*min_lr"),
    ],
)
def test_settings_that_would_fail_or_not_train_refused_before_streaming(tmp_path, args, said):
    """AdamW settings torch.optim.AdamW refuses trained without learning (a negative eps), and a
    scheduler missing its kwargs failed at train(): refused when the trainer is built."""
    model = tiny_model(tiny_config("llama"))
    with pytest.raises(ValueError, match=said):
        HFMegaTrainer(model=model, args=_args(tmp_path, **args), train_dataset=make_data(4))
    _assert_untouched(model, tmp_path)


def test_model_init_refused(tmp_path):
    """model_init (the Trainer rebuilds the model from it at every train()) is named, not
    answered with 'needs a model'."""
    with pytest.raises(ValueError, match="model_init is not supported"):
        HFMegaTrainer(
            model_init=lambda: tiny_model(tiny_config("llama")),
            args=_args(tmp_path),
            train_dataset=make_data(4),
        )


def test_insufficient_host_memory(tmp_path):
    model = tiny_model(tiny_config("llama"))
    args = _args(tmp_path, megatrain_host_memory_limit_gb=1e-6)  # ~1 KiB
    with pytest.raises(InsufficientHostMemoryError) as err:
        HFMegaTrainer(model=model, args=args, train_dataset=make_data(4))
    msg = str(err.value)
    # Both figures, in units that show the gap (the store of this model is ~100 KiB).
    assert "needs" in msg and "KiB" in msg and "1.05 KiB is available" in msg
    _assert_untouched(model, tmp_path)


def test_a_cpu_run_counts_the_embeddings_training_state(tmp_path):
    """Found by an audit: on a CPU the host check counted the layers' store alone, while the
    embeddings and head (a large vocabulary's) also get a gradient and two AdamW moments in
    host RAM: such a run was killed mid-way instead of refused. Refused now where the store
    fits but that state does not; trained where both fit."""
    from hf_megatrain.core.host_store import layer_store_bytes  # noqa: PLC0415

    model = tiny_model(tiny_config("llama", vocab_size=4096))  # embeddings 14x the layers
    params = dict(model.named_parameters())
    layers = [p.numel() for n, p in params.items() if ".layers." in n]
    non_layer = sum(p.numel() for n, p in params.items() if ".layers." not in n)
    store = layer_store_bytes(sum(layers), torch.float32)
    between = (store + 6 * non_layer) / 2**30  # the store fits, its 12 B/param do not
    args = _args(tmp_path, megatrain_host_memory_limit_gb=between)
    with pytest.raises(InsufficientHostMemoryError, match="needs"):
        HFMegaTrainer(model=model, args=args, train_dataset=make_data(4))
    enough = (store + 12 * non_layer + 2**20) / 2**30
    args = _args(tmp_path, megatrain_host_memory_limit_gb=enough)
    HFMegaTrainer(model=tiny_model(tiny_config("llama", vocab_size=4096)), args=args,
                  train_dataset=make_data(4))  # fmt: skip


def test_insufficient_host_memory_when_loading(tmp_path):
    model = tiny_model(tiny_config("llama"))
    model.save_pretrained(str(tmp_path / "ckpt"))
    with pytest.raises(InsufficientHostMemoryError, match="needs .* of host RAM"):
        load_streamed_model(str(tmp_path / "ckpt"), device="cpu", host_memory_limit_gb=1e-6)


def test_no_grad_forward_leaves_no_gradients(tmp_path):
    """A streamed forward under no_grad must not leave gradients behind for the next step."""
    from hf_megatrain import prepare_streamed_model

    model = prepare_streamed_model(tiny_model(tiny_config("llama")), "cpu", torch.float32)
    ids = make_data(2)[0]["input_ids"][None]
    with torch.no_grad():
        model(input_ids=ids, labels=ids)
    assert not streamed_state(model).engine.has_grads()


@pytest.mark.parametrize("mostly_frozen", [False, True], ids=["some-frozen", "mostly-frozen"])
def test_partially_frozen_layer_trains_like_stock(tmp_path, mostly_frozen):
    """A layer mixing frozen and trainable tensors trains as stock. Frozen ones no more than
    the trainable ones stream with the layer and never update (a store slot that does not
    train); a layer mostly frozen streams its frozen ones from a frozen store, and the trainable
    ones stay resident (as LoRA adapters do)."""
    import copy  # noqa: PLC0415

    from hf_megatrain.hf.model import streamed_names  # noqa: PLC0415

    from .helpers import assert_logs_match, mega_params, run_trainer  # noqa: PLC0415

    model = tiny_model(tiny_config("llama"))
    layer = model.model.layers[1]
    frozen = (
        [n for n, _ in layer.named_parameters() if n != "mlp.down_proj.weight"]
        if mostly_frozen
        else ["mlp.up_proj.weight"]
    )
    for name in frozen:
        layer.get_parameter(name).requires_grad_(False)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    expected = set(frozen) if mostly_frozen else set(before)
    assert streamed_names(layer) == expected
    stock, _ = run_trainer(copy.deepcopy(model), tmp_path, "stock", mega=False)
    mega, trainer = run_trainer(model, tmp_path, "mega", mega=True)
    assert_logs_match(stock, mega)
    final = mega_params(trainer)
    for name in frozen:
        torch.testing.assert_close(final[f"model.layers.1.{name}"], before[name], rtol=0, atol=0)
    assert not torch.equal(
        final["model.layers.1.mlp.down_proj.weight"], before["mlp.down_proj.weight"]
    )


def test_uneven_multi_node_launch_refused(tmp_path, monkeypatch):
    """A node's ranks share its host store: nodes with different process counts are refused."""
    model = tiny_model(tiny_config("llama"))
    args = _args(tmp_path)
    monkeypatch.setattr(type(args), "world_size", property(lambda self: 3))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(DataParallelError, match="same number of processes on every node"):
        HFMegaTrainer(model=model, args=args, train_dataset=make_data(4))
    _assert_untouched(model, tmp_path)


def test_mixin_passes_args_by_keyword(tmp_path):
    """A Trainer subclass whose second parameter is not ``args`` (TRL's DPOTrainer takes
    ``ref_model`` there) gets the arguments in ``args``."""
    from transformers import Trainer

    from hf_megatrain import MegaTrainArguments
    from hf_megatrain.hf.trainer import MegaTrainerMixin

    seen = {}

    class RefFirstTrainer(Trainer):
        def __init__(self, model=None, ref_model=None, args=None, **kw):
            seen.update(ref_model=ref_model, args=args)
            super().__init__(model=model, args=args, **kw)

    class Mega(MegaTrainerMixin, RefFirstTrainer):
        pass

    args = MegaTrainArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = Mega(model=tiny_model(tiny_config("llama")), args=args)
    assert seen == {"ref_model": None, "args": args}
    assert trainer.args is args


def _streamed(tmp_path, **config):
    from hf_megatrain import load_streamed_model

    folder = tmp_path / "saved"
    tiny_model(tiny_config("llama", **config)).save_pretrained(str(folder))
    return load_streamed_model(str(folder), device="cpu", bf16=False)


def _resize(model):
    model.resize_token_embeddings(model.config.vocab_size + 8)


def _freeze_layer(model):
    model.model.layers[0].requires_grad_(False)


def _add_adapters(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))


@pytest.mark.parametrize(
    "change,said",
    [
        (_resize, "lm_head.weight was replaced"),
        (_freeze_layer, "decoder layer 0's streamed parameters were frozen"),
        (_add_adapters, "PEFT adapters were added to an already streamed model"),
    ],
    ids=["resized head", "frozen layer", "adapters"],
)
def test_changes_after_streaming_are_refused(tmp_path, change, said):
    """Found by an audit: a head replaced by resize_token_embeddings never trained, a layer frozen
    after streaming trained on, adapters added to a streamed model failed deep in torch. Training
    would not follow such changes: refused when the trainer is built."""
    model = _streamed(tmp_path)
    model = change(model) or model
    with pytest.raises(ValueError, match=said + ".*after the model was streamed"):
        HFMegaTrainer(model=model, args=_args(tmp_path), train_dataset=make_data(4))


def test_gradient_checkpointing_of_a_streamed_model_is_left_to_the_engine(tmp_path):
    """Found by an audit: the model's own gradient checkpointing (as peft's
    prepare_model_for_kbit_training turns it on) recomputed a streamed layer outside the engine
    and failed ('not on the expected device meta'). Before streaming it is turned off, after it
    is a no-op: the gradients are the ones without it."""

    def loss_and_grad(model):
        ids = make_data(1)[0]["input_ids"][None]
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), model.lm_head.weight.grad.clone()

    plain = _streamed(tmp_path)
    want = loss_and_grad(plain)
    after = _streamed(tmp_path)
    after.gradient_checkpointing_enable()
    before = tiny_model(tiny_config("llama"))
    before.gradient_checkpointing_enable()
    HFMegaTrainer(model=before, args=_args(tmp_path), train_dataset=make_data(4))
    assert not getattr(before, "is_activation_checkpointing", before.is_gradient_checkpointing)
    for model in (after, before):
        model.train()
        got = loss_and_grad(model)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_an_address_space_limit_is_host_memory_too(monkeypatch):
    """Under ``ulimit -v`` (a scheduler's h_vmem) the OS refuses mappings past the limit
    however much RAM is free: the plan counts on no more than the limit leaves, and a mapping
    the OS still refuses is the one-line host-memory error (it was mmap's traceback)."""
    import errno
    import mmap
    import resource

    from hf_megatrain import prepare_streamed_model
    from hf_megatrain.core.host_store import available_host_bytes

    with open("/proc/self/status") as f:
        used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = used + (1 << 30)  # 1 GiB of address space left
    real_getrlimit = resource.getrlimit
    with monkeypatch.context() as m:
        m.setattr(
            resource,
            "getrlimit",
            lambda which: (
                (limit, resource.RLIM_INFINITY)
                if which == resource.RLIMIT_AS
                else real_getrlimit(which)
            ),
        )
        assert 0 < available_host_bytes() <= 1 << 30

    def refused(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refused)
    with pytest.raises(InsufficientHostMemoryError, match="the OS refused .* host memory"):
        prepare_streamed_model(tiny_model(tiny_config("llama")), "cpu", torch.float32)


def test_two_forwards_in_one_micro_batch_without_clipping_say_which_option_trains(tmp_path):
    """Found by an audit: a compute_loss that runs the model twice (R-Drop, a consistency loss)
    with clipping off failed inside autograd with "eager updates need the trainer's
    gradient-accumulation flags", which names nothing the user can change. It now names the
    argument; with it the run trains as the stock Trainer does."""
    from transformers import Trainer, TrainingArguments

    from hf_megatrain.core.engine.gradients import SecondGradientError

    model = tiny_model(tiny_config("llama"))
    mega, stock = two_forward_trainers(HFMegaTrainer, Trainer)
    kw = dict(max_grad_norm=0.0, max_steps=3)
    with pytest.raises(SecondGradientError, match=r"set megatrain_eager_update=False \("):
        mega(
            model=copy.deepcopy(model), args=_args(tmp_path, **kw), train_dataset=make_data(8)
        ).train()
    losses = {}
    for name, cls, args in (
        ("mega", mega, _args(tmp_path / "held", megatrain_eager_update=False, **kw)),
        ("stock", stock, TrainingArguments(output_dir=str(tmp_path / "s"), **common_args(**kw))),
    ):
        trainer = cls(model=copy.deepcopy(model), args=args, train_dataset=make_data(8))
        trainer.train()
        losses[name] = [x["loss"] for x in trainer.state.log_history if "loss" in x]
    # fp32 on the CPU: the streamed run equals stock to rounding (test_equivalence's 1e-5).
    assert len(losses["mega"]) == 3
    assert losses["mega"] == pytest.approx(losses["stock"], rel=1e-5)
