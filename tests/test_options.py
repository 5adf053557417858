"""One options model: every engine option's default, validation and derived rules come from
``EngineOptions``, and every front door (training arguments, CLI, plan, loaders, benchmarks)
projects it without re-declaring anything."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from transformers import TrainingArguments

from hf_megatrain import EngineOptions, HFMegaTrainer, MegaTrainArguments, StepShape
from hf_megatrain.cli import build_parser, build_train_parser, parse_train
from hf_megatrain.core.options import ALL_LAYERS, OptionError
from hf_megatrain.hf.arguments import argument_name, as_arguments, engine_options
from hf_megatrain.hf.loading import init_streamed_model, load_streamed_model
from hf_megatrain.hf.model import prepare_streamed_model, streamed_state
from hf_megatrain.option_flags import add_option_arguments, flag_name, options_from_namespace
from hf_megatrain.text import DEFAULT_CONFIG

from .helpers import tiny_config, tiny_model

DEFAULTS = EngineOptions()


# (parsing train's arguments without --output_dir makes outputs/ where it runs)
pytestmark = pytest.mark.usefixtures("in_a_tmp_folder")


def _train_args(cls=MegaTrainArguments, **kw):
    return cls(output_dir="/tmp/hf-megatrain-options", use_cpu=True, report_to="none", **kw)


def test_training_arguments_are_generated_from_the_options():
    fields = {f.name: f for f in dataclasses.fields(MegaTrainArguments)}
    for f in dataclasses.fields(EngineOptions):
        arg = fields[argument_name(f.name)]
        assert arg.default == f.default, f.name
        assert arg.metadata["help"].replace("%%", "%") == f.metadata["help"], f.name


def test_every_front_door_has_the_same_defaults(tmp_path):
    """MegaTrainArguments, a plain TrainingArguments, the CLI, plan, the loaders and the trainer
    all end up with ``EngineOptions()``."""
    assert engine_options(_train_args()) == DEFAULTS
    assert engine_options(_train_args(TrainingArguments)) == DEFAULTS
    cli = parse_train([])
    assert cli.engine == DEFAULTS and engine_options(cli.training) == DEFAULTS
    plan_ns = build_parser().parse_args(
        ["plan", str(DEFAULT_CONFIG), "--seq-len", "64", "--tokens-per-step", "128"]
    )
    assert options_from_namespace(plan_ns) == DEFAULTS
    streamed = init_streamed_model(tiny_config("llama"), device="cpu", bf16=False)
    assert streamed_state(streamed).options.options == DEFAULTS
    tiny_model(tiny_config("llama")).save_pretrained(tmp_path / "ckpt")
    loaded = load_streamed_model(str(tmp_path / "ckpt"), device="cpu", bf16=False)
    assert streamed_state(loaded).options.options == DEFAULTS
    prepared = prepare_streamed_model(tiny_model(tiny_config("llama")), "cpu", torch.float32)
    assert streamed_state(prepared).options.options == DEFAULTS
    # The trainer with a plain TrainingArguments and with MegaTrainArguments: the same options
    # (keep_activations once defaulted to "auto" in one and "off" in the other).
    for cls in (TrainingArguments, MegaTrainArguments):
        trainer = HFMegaTrainer(model=tiny_model(tiny_config("llama")), args=_train_args(cls))
        assert trainer.megatrain_options.options == DEFAULTS, cls


def test_the_defaults_are_the_fast_path():
    """Issue 20: no flag is needed for the measured-fastest exact settings. The plan picks the
    HBM tier, kept activations and kept attention outputs for the workload (none of them on a
    CPU or without a plan); Liger-Kernel's layer kernels run where installed and applicable."""
    assert (
        DEFAULTS.resident_layers,
        DEFAULTS.keep_activations,
        DEFAULTS.keep_attention_outputs,
        DEFAULTS.layer_kernels,
    ) == ("auto", "auto", "auto", "auto")
    # Only exact options are on by default: nothing that changes the gradients.
    assert DEFAULTS.boundary_dtype == "input" and DEFAULTS.recompute_early_stop
    gpu = DEFAULTS.resolve(clipping=True, cuda=True)
    assert (gpu.resident_layers, gpu.keep_activation_layers, gpu.attention_output_layers) == (
        "auto",
        None,
        None,
    )
    # The same from the CLI and from a plain TrainingArguments: no Liger request (use_liger_kernel,
    # --liger) is needed for "auto"; --layer-kernels is the option's flag.
    cli = parse_train([])
    assert cli.engine == DEFAULTS and not cli.training.use_liger_kernel
    assert parse_train(["--layer-kernels", "torch"]).engine.changed() == {"layer_kernels": "torch"}
    assert engine_options(_train_args(TrainingArguments)).layer_kernels == "auto"
    with pytest.raises(OptionError, match="layer_kernels"):
        EngineOptions(layer_kernels="triton")


def test_every_option_has_a_flag_and_an_argument():
    import argparse

    parser = argparse.ArgumentParser()
    names = add_option_arguments(parser)
    assert names == list(EngineOptions.field_names())
    help_text = build_train_parser().format_help()
    for name in names:
        assert flag_name(name) in help_text, name
        assert hasattr(_train_args(), argument_name(name)), name


def test_a_set_option_reaches_the_engine_from_every_front_door():
    wanted = {"checkpoint_every": 2, "boundary_dtype": "bfloat16", "mlp_tile_tokens": 32}
    cli = parse_train(
        ["--checkpoint-every", "2", "--boundary-dtype", "bfloat16", "--mlp-tile-tokens", "32"]
    )
    assert cli.engine.changed() == wanted
    assert engine_options(cli.training).changed() == wanted
    args = _train_args(**as_arguments(cli.engine))
    assert engine_options(args).changed() == wanted
    trainer = HFMegaTrainer(model=tiny_model(tiny_config("llama")), args=args)
    engine = trainer.megatrain.engine
    assert engine.checkpoint_every == 2 and engine.boundary_dtype == torch.bfloat16
    assert trainer.megatrain_options.mlp_tile_tokens == 32


def test_resolve_derives_the_update_mode_in_one_place():
    clip = DEFAULTS.resolve(clipping=True, cuda=False)
    assert (clip.eager_update, clip.host_grads, clip.overlap_optimizer) == (False, True, False)
    eager = DEFAULTS.resolve(clipping=False, cuda=True)
    assert (eager.eager_update, eager.host_grads, eager.overlap_optimizer) == (True, False, True)
    held = EngineOptions(eager_update=False).resolve(clipping=False, cuda=True)
    assert (held.eager_update, held.host_grads) == (False, True)
    with pytest.raises(OptionError, match="host_grads=False needs eager"):
        EngineOptions(host_grads=False).resolve(clipping=True, cuda=False)
    with pytest.raises(OptionError, match="eager_update=False"):
        EngineOptions(host_grads=False, eager_update=False).resolve(clipping=False, cuda=False)
    # Aliases resolve to one meaning.
    for alias in ("bf16", "bfloat16", "BF16"):
        assert (
            EngineOptions(boundary_dtype=alias).resolve(clipping=True, cuda=False).boundary_dtype
            == torch.bfloat16
        )
    assert (
        EngineOptions(boundary_dtype="float32").resolve(clipping=True, cuda=False).boundary_dtype
        is None
    )
    keep = EngineOptions(keep_attention_outputs="all")
    assert keep.resolve(clipping=True, cuda=True).attention_output_layers == ALL_LAYERS
    # Without the early-stop recompute, whole layers re-run: no attention output is kept.
    no_stop = keep.with_(recompute_early_stop=False).resolve(clipping=True, cuda=True)
    assert no_stop.attention_output_layers == 0


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"checkpoint_every": 0}, "checkpoint_every"),
        ({"mlp_tile_tokens": -1}, "mlp_tile_tokens"),
        ({"host_memory_limit_gb": -4.0}, "host_memory_limit_gb"),
        ({"host_memory_limit_gb": float("nan")}, "host_memory_limit_gb"),
        ({"boundary_dtype": "fp8"}, "boundary_dtype"),
        ({"resident_layers": "most"}, "resident_layers"),
        ({"keep_activations": "-1"}, "keep_activations"),
        ({"keep_attention_outputs": "some"}, "keep_attention_outputs"),
        ({"pin_memory": "yes"}, "pin_memory"),
        ({"max_shard_size": "big"}, "max_shard_size"),
        ({"loss_chunk_tokens": 0}, "loss_chunk_tokens"),
    ],
)
def test_bad_values_are_refused_naming_the_option_in_each_front_door(bad, field):
    with pytest.raises(OptionError, match=field):
        EngineOptions(**bad)
    # As training arguments: named as the argument.
    with pytest.raises(ValueError, match=argument_name(field)):
        _train_args(**{argument_name(k): v for k, v in bad.items()})


def test_cli_refuses_a_bad_option_in_one_line(capsys):
    from hf_megatrain.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "--checkpoint-every", "0"])
    assert "--checkpoint-every 0" in str(exc.value)


def test_step_shape_is_only_the_step():
    assert {f.name for f in dataclasses.fields(StepShape)} == {
        "seq_len",
        "micro_batch_tokens",
        "grad_accum",
    }
    assert StepShape.from_step(4096, 65536, grad_accum=4) == StepShape(4096, 16384, 4)
    with pytest.raises(OptionError, match="seq_len"):
        StepShape(0, 16)


def test_a_model_streamed_earlier_keeps_its_options_and_refuses_contradicting_arguments(caplog):
    model = prepare_streamed_model(
        tiny_model(tiny_config("llama")), "cpu", torch.float32, checkpoint_every=2
    )
    # Defaults in the arguments: the model's options apply, and a line says so (found by an
    # audit: an argument set to its default was overruled without a word).
    with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
        trainer = HFMegaTrainer(model=model, args=_train_args(megatrain_log_throughput=False))
    assert trainer.megatrain.engine.checkpoint_every == 2
    said = "streamed with checkpoint_every=2: those are used (the trainer's "
    assert said + "megatrain_checkpoint_every at the default)" in caplog.text
    # Run-time options come from the arguments.
    assert trainer.megatrain_options.log_throughput is False
    other = prepare_streamed_model(
        tiny_model(tiny_config("llama")), "cpu", torch.float32, checkpoint_every=2
    )
    with pytest.raises(ValueError, match="megatrain_checkpoint_every=3"):
        HFMegaTrainer(model=other, args=_train_args(megatrain_checkpoint_every=3))


def test_options_this_run_cannot_use_are_named():
    """Said once at start, with why: a segment longer than the model, more chain attention
    outputs than a chain has layers (or no chain), device updates on a CPU or with eager
    updates; nothing for a run that uses what it asked for."""
    from hf_megatrain.core.options import unused_option_notes

    def notes(clipping=True, cuda=True, layers=4, **kw) -> list[str]:
        run = EngineOptions(**kw).resolve(clipping=clipping, cuda=cuda)
        return unused_option_notes(run, layers)

    assert notes() == []
    assert notes(checkpoint_every=3, chain_attention_outputs=2, device_update_lead=2) == []
    assert "more than the model's 4 layers" in notes(checkpoint_every=9)[0]
    assert (
        "keeps 2: at most checkpoint_every - 1 = 2"
        in notes(checkpoint_every=3, chain_attention_outputs=5)[0]
    )
    assert "keeps 0: no checkpoint segment chain" in notes(chain_attention_outputs=1)[0]
    # One segment of all 4 layers: its chain recomputes 3 (found by an audit: not said).
    said = notes(checkpoint_every=9, chain_attention_outputs=5)
    assert "keeps 3: at most the model's 4 layers - 1 = 3 layers in its one segment" in said[1]
    assert notes(checkpoint_every=9, chain_attention_outputs=3)[1:] == []
    assert "device updates need CUDA" in notes(cuda=False, device_update_lead=3)[0]
    assert "device updates need CUDA" in notes(clipping=False, device_update_lead=3)[0]
