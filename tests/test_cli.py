"""The ``hf-megatrain`` CLI: tiny end-to-end runs (seconds) and clean errors for user mistakes."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_megatrain import HFMegaTrainer
from hf_megatrain.cli import DEFAULT_CONFIG, build_train_parser, main, parse_train
from hf_megatrain.cli_arguments import load_recipe
from hf_megatrain.option_flags import options_from_mapping

REPO = Path(__file__).resolve().parents[1]
TEXT = (
    "Streaming decoder layers through the accelerator keeps the master weights in host memory. "
    "Each layer is copied in, used, and its gradient copied back out.\n\n"
) * 40


def _tiny_config(path: Path, model_type: str = "llama") -> Path:
    cfg = json.loads(DEFAULT_CONFIG.read_text())
    cfg.update(
        model_type=model_type,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    path.write_text(json.dumps(cfg))
    return path


def _fast_flags(out: Path) -> list[str]:
    return [
        "--max-steps", "2", "--seq-len", "16", "--batch-size", "2", "--logging-steps", "1",
        "--max-new-tokens", "4", "--no-progress-bar", "--output-dir", str(out),
    ]  # fmt: skip


# (parsing train's arguments without --output_dir makes outputs/ where it runs)
pytestmark = pytest.mark.usefixtures("in_a_tmp_folder")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, Path]:
    """One tiny random-init run (sharded save) shared by the tests that inspect its output."""
    root = tmp_path_factory.mktemp("cli")
    data = root / "text.txt"
    data.write_text(TEXT)
    out = root / "out"
    cfg = _tiny_config(root / "config.json")
    rc = main(
        ["train", "--config", str(cfg), "--data", str(data), "--max-shard-size", "100KB"]
        + _fast_flags(out)
    )
    assert rc == 0
    return out, data


def test_train_saves_a_loadable_sharded_checkpoint(tiny_run):
    out, _ = tiny_run
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("host memory", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert math.isfinite(loss.item())


@pytest.mark.parametrize("clip", ["1.0", "0"], ids=["clipping", "no-clipping"])
def test_continue_from_model_path(tiny_run, tmp_path, monkeypatch, clip):
    """The checkpoint written by the CLI is a Hub-format folder: load_streamed_model reads it
    back, given what init_streamed_model gets too: the run's workload for the "auto" plan and
    a store without gradient slots when nothing clips (eager updates)."""
    import hf_megatrain

    ckpt, data = tiny_run
    out = tmp_path / "continued"
    seen = []
    load = hf_megatrain.load_streamed_model

    def spy(path, **kw):
        model = load(path, **kw)
        seen.append((kw, hf_megatrain.hf.model.streamed_state(model).options))
        return model

    monkeypatch.setattr(hf_megatrain, "load_streamed_model", spy)
    flags = ["--resident-layers", "auto", "--max-grad-norm", clip] + _fast_flags(out)
    assert main(["train", "--model-path", str(ckpt), "--data", str(data)] + flags) == 0
    ((kw, options),) = seen
    assert kw["step"].micro_batch_tokens == 2 * 16  # --batch-size 2 x --seq-len 16
    assert options.resident_layers == "auto"
    assert options.host_grads == (clip != "0")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 2


def test_default_model_and_data_smoke(tmp_path, capsys):
    # The embedded default (bundled config, corpus, tokenizer), cut to two tiny steps.
    assert main(["train", "--eval-fraction", "0.01", "--max-eval-chunks", "2"] + _fast_flags(tmp_path)) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "from_pretrained loaded the saved model" in printed
    assert "Greedy sample" in printed
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.vocab_size == 4096


@pytest.mark.parametrize("arch", ["gemma2", "deepseek_v3", "falcon"])
def test_train_other_families_from_a_config(tmp_path, capsys, arch):
    """`train --config` for families off the Llama path: Gemma2 has no SDPA attention (eager,
    said once), DeepSeek-V3's latent attention and router buffer, Falcon's transformer.h."""
    from .helpers import tiny_config

    vocab = json.loads(DEFAULT_CONFIG.read_text())["vocab_size"]
    tiny_config(arch, vocab_size=vocab, max_position_embeddings=64).save_pretrained(tmp_path / "c")
    out = tmp_path / "out"
    assert main(["train", "--config", str(tmp_path / "c")] + _fast_flags(out)) == 0
    assert "from_pretrained loaded the saved model" in capsys.readouterr().out
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == arch


def test_recipe_then_flags_precedence(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "seq_len: 64\nmax_steps: 7\nlr: 3e-4\nbf16: true\neval-fraction: 0.1\n"
        "report_to: tensorboard\nsave_steps: 3\nresident_layers: '1'\n"
    )
    s = parse_train(["--recipe", str(recipe), "--max-steps", "3", "--save_steps", "2"])
    assert (s.data.seq_len, s.training.max_steps, s.training.learning_rate) == (64, 3, 3e-4)
    assert s.training.bf16 and s.data.eval_fraction == 0.1
    assert s.training.report_to == ["tensorboard"] and s.training.save_steps == 2
    assert s.engine.resident_layers == "1" and s.training.megatrain_resident_layers == "1"
    assert s.source["max_steps"] == "flag" and s.source["seq_len"] == "recipe"
    assert not parse_train(["--recipe", str(recipe), "--fp32"]).training.bf16


def test_recipe_keys_for_one_setting(tmp_path):
    """A recipe is read as its flags would be (found by an audit: the last key won silently):
    two keys for one setting with different values, or one key twice, are refused; equal
    values in two spellings (YAML reads 1e-3 as text, 0.001 as a number) pass; a switch named
    other than its setting (--no_packing) is a key too."""
    recipe = tmp_path / "r.yaml"
    for text, said in (
        ("learning_rate: 1e-3\nlr: 2e-3\n", "'learning_rate: 1e-3' and 'lr: 2e-3' set the same"),
        ("learning-rate: 1e-3\nlearning_rate: 2e-3\n", "set the same setting"),
        ("max_steps: 2\nmax_steps: 3\n", "key 'max_steps' is given twice"),
    ):
        recipe.write_text(text)
        assert said in _error(["train", "--recipe", str(recipe)]), text
    recipe.write_text("lr: 1e-3\nlearning_rate: 0.001\nno_packing: true\n")
    s = parse_train(["--recipe", str(recipe)])
    assert s.training.learning_rate == 1e-3 and not s.data.packing
    recipe.write_text("no_packing: false\n")
    assert parse_train(["--recipe", str(recipe)]).data.packing  # (the flag not typed)
    # Found by a later audit: quoted 'false' or 'no' turned the switch on (any non-empty text
    # did), and a conflict named the switch's setting, not what was written.
    for text, packing in (("no_packing: 'false'\n", True), ("no_packing: 'YES'\n", False)):
        recipe.write_text(text)
        assert parse_train(["--recipe", str(recipe)]).data.packing is packing, text
    recipe.write_text("no_packing: maybe\n")
    assert "'no_packing: maybe' is a switch: give true or false" in _error(
        ["train", "--recipe", str(recipe)]
    )
    recipe.write_text("<<: {lr: 0.001}\nmax_steps: 3\n")  # (a YAML merge key: was refused)
    assert parse_train(["--recipe", str(recipe)]).training.learning_rate == 1e-3
    recipe.write_text("no_packing: true\npacking: true\n")
    assert "'no_packing: True' and 'packing: True' set the same" in _error(
        ["train", "--recipe", str(recipe)]
    )


def test_training_arguments_defaults_and_epochs():
    """The embedded default's settings, and the Trainer's own flags in both spellings."""
    s = parse_train([])
    t = s.training
    assert (t.max_steps, t.learning_rate, t.per_device_train_batch_size) == (500, 3e-3, 8)
    assert (t.save_strategy, t.save_steps, t.save_total_limit) == ("steps", 500, 2)
    assert t.resume_from_checkpoint is None and s.data.seq_len == 128
    s = parse_train(["--num_train_epochs", "2", "--eval-strategy", "steps", "--eval_steps", "5"])
    assert s.training.max_steps == -1 and s.training.num_train_epochs == 2
    assert s.training.eval_strategy == "steps" and s.training.eval_steps == 5
    s = parse_train(["--num_train_epochs", "2", "--max_steps", "4"])
    assert s.training.max_steps == 4  # max_steps wins when both are given, as in the Trainer


def test_help_lists_the_trainer_and_data_flags(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--report_to", "--save_steps", "--resume_from_checkpoint", "--dataset_name",
                 "--streaming", "--push_to_hub", "--export-dtype", "--eval_strategy",
                 "--num_train_epochs", "--hub_model_id", "--resident-layers", "--recipe"):  # fmt: skip
        assert flag in text, flag


@pytest.mark.parametrize(
    "name", ["default_cpu.yaml", "continued_pretraining.yaml", "long_context.yaml"]
)
def test_shipped_recipes_parse(name):
    keys = load_recipe(str(REPO / "recipes" / name), build_train_parser())
    assert "seq_len" in keys
    if "model_path" not in keys:  # a placeholder path would (rightly) fail the existence check
        parse_train(["--recipe", str(REPO / "recipes" / name)])  # every key known and valid


def test_engine_options_reach_the_trainer(tmp_path):
    """--mlp-tile-tokens / --offload-activations / --boundary-dtype / --resident-layers /
    --attn end to end."""
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    cfg = _tiny_config(tmp_path / "config.json")
    flags = ["--mlp-tile-tokens", "8", "--offload-activations", "--resident-layers", "1"]
    flags += ["--boundary-dtype", "bfloat16", "--checkpoint-every", "2"]
    engine = parse_train(flags).engine
    assert engine.boundary_dtype == "bfloat16" and engine.checkpoint_every == 2
    rc = main(["train", "--config", str(cfg), "--data", str(data), "--attn", "eager"] + flags + _fast_flags(tmp_path / "out"))  # fmt: skip
    assert rc == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.num_hidden_layers == 2
    # --keep-attention-outputs reaches MegaTrainArguments (SDPA: the kernels it keeps).
    seen = []
    init = HFMegaTrainer.__init__

    def spy(self, *a, **kw):
        seen.append(kw["args"].megatrain_keep_attention_outputs)
        init(self, *a, **kw)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(HFMegaTrainer, "__init__", spy)
        flags = ["--keep-attention-outputs"] + _fast_flags(tmp_path / "attn")
        assert main(["train", "--config", str(cfg), "--data", str(data)] + flags) == 0
    assert seen == ["all"]
    with pytest.raises(SystemExit) as e:  # argparse's own refusal: usage and one error line
        main(["train", "--attn", "x"])
    assert e.value.code == 2
    assert "'some' is neither an integer >= 0 nor 'auto'" in _error(
        ["train", "--resident-layers", "some"]
    )


def _error(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert isinstance(e.value.code, str), e.value.code  # a message, not a bare status
    assert e.value.code.startswith("hf-megatrain: error:")
    return e.value.code


def test_bad_input_errors_are_clean(tmp_path):
    txt = tmp_path / "t.txt"
    txt.write_text(TEXT)
    assert "fp16 is not supported" in _error(["train", "--fp16"])
    assert "data not found" in _error(["train", "--data", str(tmp_path / "nope.txt")])
    assert "model path not found" in _error(["train", "--model-path", str(tmp_path / "nope")])
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert "no *.safetensors" in _error(["train", "--model-path", str(tmp_path / "ckpt")])
    assert "config file not found" in _error(["train", "--config", str(tmp_path / "c.json")])
    assert "recipe file not found" in _error(["train", "--recipe", str(tmp_path / "r.yaml")])
    assert "seq_len must be" in _error(["train", "--seq-len", "0"])
    assert "eval_fraction" in _error(["train", "--eval-fraction", "0.9"])
    bad_recipe = tmp_path / "bad.yaml"
    bad_recipe.write_text("fp16: true\n")
    assert "fp16 is not supported" in _error(["train", "--recipe", str(bad_recipe)])
    bad_recipe.write_text("learnin_rate: 1e-4\n")
    assert "unknown key 'learnin_rate'" in _error(["train", "--recipe", str(bad_recipe)])
    bad_recipe.write_text("config: x.json\n")
    assert "config file not found" in _error(["train", "--recipe", str(bad_recipe)])
    assert "a YAML of arguments goes to --recipe" in _error(["train", "--config", "r.yaml"])
    assert "no checkpoint-N in" in _error(
        ["train", "--resume_from_checkpoint", "last", "--output_dir", str(tmp_path / "fresh")]
    )
    assert "--streaming needs --max_steps" in _error(
        ["train", "--streaming", "--max_steps", "-1", "--num_train_epochs", "1"]
    )
    bad_recipe.write_text("max_steps: many\n")
    assert "max_steps: invalid value" in _error(["train", "--recipe", str(bad_recipe)])
    doge = tmp_path / "doge.json"
    doge.write_text(json.dumps({"model_type": "doge", "vocab_size": 4096}))
    assert "not supported" in _error(["train", "--config", str(doge), "--data", str(txt)])
    short = tmp_path / "short.txt"
    short.write_text("too short")
    assert "not enough text" in _error(["train", "--data", str(short), "--seq-len", "512"])
    (tmp_path / "empty").mkdir()
    assert "no data files" in _error(["train", "--data", str(tmp_path / "empty")])
    if not torch.cuda.is_available():
        assert "need a CUDA GPU" in _error(["train", "--liger"])
    # Checked before the model is built (the Trainer would make the folder only after that).
    assert "output_dir cannot be created" in _error(["train", "--output-dir", str(txt / "out")])
    # A setting checked against the model once it is built: the library's message, no traceback.
    msg = _error(["train", "--resident-layers", "99", "--output-dir", str(tmp_path / "o")])
    assert "resident_layers=99 but the model has 4 layers" in msg


def test_more_bad_input_errors_are_clean(tmp_path):
    """Found by an audit of the CLI with bad input: each is one line naming the fix, before
    training starts."""
    cfg = json.loads(DEFAULT_CONFIG.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**cfg, "hidden_size": 100, "num_attention_heads": 3}))
    assert "invalid config" in _error(["train", "--config", str(bad)])
    not_tok = tmp_path / "tok.csv"
    not_tok.write_text("a,b\n1,2\n")
    assert "could not load a tokenizer from" in _error(["train", "--tokenizer", str(not_tok)])
    assert "nothing to train" in _error(["train", "--max_steps", "0"])
    assert "nothing to train" in _error(["train", "--max_steps", "-1", "--num_train_epochs", "0"])
    assert "output_dir is empty" in _error(["train", "--output_dir", ""])
    # (transformers trains --num_train_epochs for any max_steps <= 0: 3 epochs, rc 0, before)
    assert "max_steps must be a positive number of steps (or -1" in _error(
        ["train", "--max_steps", "-5"]
    )
    no_layers = tmp_path / "none.json"
    no_layers.write_text(json.dumps({**cfg, "num_hidden_layers": 0}))
    assert "num_hidden_layers is 0" in _error(["train", "--config", str(no_layers)])
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    assert "names a configuration of a Hub dataset" in _error(
        ["train", "--dataset_name", str(text), "--dataset_config", "wikitext-2"]
    )
    assert "--eval_strategy steps needs evaluation rows" in _error(
        ["train", "--eval_strategy", "steps", "--eval_steps", "1", "--max_eval_sequences", "0"]
    )
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(DEFAULT_CONFIG.read_text())
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    assert "is not a readable safetensors file" in _error(["train", "--model_path", str(model)])
    (model / "model.safetensors").unlink()
    (model / "model-00001-of-00002.safetensors").write_bytes(b"")
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                   "b": "model-00002-of-00002.safetensors"}})
    )  # fmt: skip
    assert "missing: ['model-00002-of-00002.safetensors']" in _error(
        ["train", "--model_path", str(model)]
    )
    if not torch.cuda.is_available():
        assert "flex_attention has no backward on a CPU" in _error(
            ["train", "--attn", "flex_attention"]
        )
    (tmp_path / "run" / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint-2" / "trainer_state.json").write_text("{}")
    msg = _error(["train", "--resume_from_checkpoint", str(tmp_path / "run")])
    assert "is not a Trainer checkpoint (no trainer_state.json)" in msg
    assert f"the newest checkpoint in it is {tmp_path / 'run' / 'checkpoint-2'}" in msg


def test_uneven_multi_node_launch_is_refused(monkeypatch):
    # A node's ranks share its host store: every node runs the same number of processes.
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert "same number of processes on every node" in _error(["train", "--max-steps", "1"])
    # The node of 1 process (3 % 1 == 0) knows from torchrun's node count (found by an audit).
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert "launched on 2 nodes with 1 on this node" in _error(["train", "--max-steps", "1"])


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path):
    """Found by an audit: two runs into one --output_dir were not refused (the second resumed
    from the first's unfinished checkpoint, both wrote the same names, or both crashed at their
    first save). The running one holds the folder; the second is refused in one line, and the
    folder is free again once the first has ended."""
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    cfg = _tiny_config(tmp_path / "config.json")
    out = tmp_path / "out"
    flags = ["--config", str(cfg), "--data", str(data), *_fast_flags(out)]
    first = subprocess.Popen(
        [sys.executable, "-m", "hf_megatrain", "train", *flags, "--max-steps", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        for line in first.stdout:  # until it trains
            if "'loss'" in line:
                break
        assert first.poll() is None
        msg = _error(["train", *flags])
        assert f"output_dir {out} is in use by another hf-megatrain run" in msg, msg
        # Through a symlink to the folder: the same folder, refused too (found by an audit: it
        # resumed from the first run's checkpoint, then failed when rotation removed it).
        link = tmp_path / "link"
        link.symlink_to(out)
        linked = ["--config", str(cfg), "--data", str(data), *_fast_flags(link)]
        assert "is in use by another hf-megatrain run" in _error(["train", *linked])
    finally:
        first.kill()
        first.wait(timeout=60)
    assert main(["train", *flags, "--max-steps", "1", "--save_strategy", "no"]) == 0


def test_ctrl_c_exits_130_in_one_line(tmp_path, monkeypatch, capsys):
    """An interrupt (Ctrl-C) exits with 128 + SIGINT, as shells report it (it was 1, an error)."""
    import hf_megatrain.cli as cli

    def interrupted(settings):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_train", interrupted)
    with pytest.raises(SystemExit) as e:
        main(["train", "--output_dir", str(tmp_path / "out")])
    assert e.value.code == 130
    assert capsys.readouterr().err.strip() == "hf-megatrain: interrupted"


def test_module_entry_point_prints_one_line_error():
    # `python3 -m hf_megatrain` goes through __main__.py; a user mistake gives no traceback.
    r = subprocess.run(
        [sys.executable, "-m", "hf_megatrain", "train", "--fp16"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("hf-megatrain: error: fp16 is not supported")


def test_random_init_straight_into_the_store(tmp_path, monkeypatch, capsys):
    """The GPU path of random init (init_streamed_model), run on the CPU: it trains and saves."""
    import hf_megatrain.cli_train as cli_train
    from hf_megatrain.hf.model import streamed_state

    monkeypatch.setattr(cli_train, "init_in_store", lambda: True)
    built = []
    real = cli_train.build_model

    def spy(settings, tokenizer):
        model = real(settings, tokenizer)
        built.append(streamed_state(model) is not None)
        return model

    monkeypatch.setattr(cli_train, "build_model", spy)
    assert main(["train"] + _fast_flags(tmp_path)) == 0
    assert built == [True]  # streamed before the trainer saw it
    assert (tmp_path / "model.safetensors").is_file() or list(tmp_path.glob("*.safetensors"))


@pytest.mark.parametrize("installed", [False, True], ids=["flash-attn-missing", "installed"])
def test_attn_flash_attention_2_needs_flash_attn(monkeypatch, installed):
    """--attn flash_attention_2 (the optional flash-attn extra): a clear error naming the extra
    where the package is missing, accepted where it is installed (this machine cannot build it:
    its presence is simulated for the check only)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            (object() if installed else None) if name == "flash_attn" else real(name, *a)
        ),
    )
    if installed:
        assert parse_train(["--attn", "flash_attention_2"]).model.attn == "flash_attention_2"
    else:
        assert r"hf_megatrain[flash-attn]" in _error(["train", "--attn", "flash_attention_2"])


def test_a_full_disk_while_saving_is_one_line(tmp_path):
    """A checkpoint that does not fit on the output disk (a 1 MiB tmpfs, where mounting is
    allowed): one line saying so and what to do, no traceback from the safetensors writer."""
    from .helpers import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "small", "1M") as out:
        data = tmp_path / "text.txt"
        data.write_text(TEXT)
        msg = _error(["train", "--data", str(data), "--save_steps", "1"] + _fast_flags(out))
        assert "no space left on the device of --output_dir while saving" in msg


def test_unknown_flags_get_a_short_error(tmp_path, capsys):
    """A misspelled flag: two lines (the flag with the closest known one, a pointer to --help),
    not the whole usage first; a unique prefix of a flag is not taken for it, on every
    command."""
    cfg = _tiny_config(tmp_path / "config.json")
    plan = ["plan", str(cfg), "--seq-len", "8", "--tokens-per-step", "16"]
    cases = {
        ("train", "--max_stpes", "2"): "train: error: unrecognized argument: --max_stpes (did "
        "you mean --max_steps?)",
        ("train", "--max_step", "2"): "unrecognized argument: --max_step (did you mean "
        "--max_steps?)",
        ("train", "--rec", "r.yaml"): "unrecognized argument: --rec",
        (*plan, "--offload-activ"): "plan: error: unrecognized argument: --offload-activ (did "
        "you mean --offload-activations?)",
        (*plan, "--host-update-threads", "2"): "plan: error: unrecognized argument: "
        "--host-update-threads",
        ("verify", str(tmp_path), "--bogus"): "verify: error: unrecognized argument: --bogus",
    }
    for argv, said in cases.items():
        with pytest.raises(SystemExit) as e:
            main(list(argv))
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert said in err, err
        assert "usage:" not in err and len(err.strip().splitlines()) == 2, err
        assert err.strip().endswith(f"see hf-megatrain {argv[0]} --help"), err


def test_end_of_run_report(tmp_path, capsys):
    """The summary's train loss is the mean over the steps trained (the Trainer's train_loss,
    said so), whatever --logging_steps logged; --no-verify is named as the reason the reload
    check is skipped; a tiny model's size reads in M."""
    from hf_megatrain.cli_train import human_count, run_train

    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    cfg = _tiny_config(tmp_path / "config.json")
    argv = ["--config", str(cfg), "--data", str(data), "--no-verify"] + _fast_flags(tmp_path)
    result = run_train(parse_train(argv + ["--max_steps", "3"]))
    said = capsys.readouterr().out
    losses = [h["loss"] for h in result["log_history"] if "loss" in h]
    assert len(losses) == 3 and result["train_loss"] == pytest.approx(sum(losses) / 3, abs=1e-3)
    assert f"(mean train loss {result['train_loss']:.4f} over these steps" in said
    assert "Skipped reloading the saved model for the final check: --no-verify was given" in said
    assert f"llama {result['n_params'] / 1e6:.1f}M params" in said
    assert (human_count(3_100_000), human_count(7_615_000_000)) == ("3.1M", "7.6B")


def test_model_path_that_is_a_file(tmp_path):
    """An existing file is not "not found": the message says what --model_path takes, and for a
    config.json, the folder and --config it probably meant."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    msg = _error(["train", "--model_path", str(weights)])
    assert f"--model_path {weights} is a file" in msg and "not found" not in msg
    assert "a Hub repo id" in msg and "folder holding config.json" in msg
    cfg = _tiny_config(tmp_path / "config.json")
    msg = _error(["train", "--model_path", str(cfg)])
    assert f"--model_path {tmp_path};" in msg and f"--config {cfg})" in msg


def test_opposite_flags_are_refused(tmp_path):
    """A yes and a no for one setting typed together: refused naming both, not last-wins;
    one of them, the same one twice, or a recipe overridden by a flag still parse."""
    out = ["--output_dir", str(tmp_path), "--max_steps", "1"]  # (were it trained: briefly)
    msg = _error(["train", "--bf16", "--fp32", *out])
    assert msg.endswith("--bf16 and --fp32 contradict each other: give only one of them")
    msg = _error(["train", "--no_packing", "--packing", *out])
    assert "--no_packing and --packing contradict" in msg
    msg = _error(["train", "--packing=true", "--no-packing", *out])
    assert "--packing and --no-packing contradict" in msg
    assert parse_train(["--fp32", "--fp32"] + out).training.bf16 is False
    assert parse_train(["--no_packing"] + out).data.packing is False
    recipe = tmp_path / "r.yaml"
    recipe.write_text("packing: false\nbf16: true\n")
    settings = parse_train(["--recipe", str(recipe), "--packing", "--fp32"] + out)
    assert settings.data.packing is True and settings.training.bf16 is False


def test_verify_names_checkpoint_folders_apart(tmp_path, capsys):
    """A run's output folder: files of its checkpoint-N folders (manifests of their own) are
    not counted as stray files of the final model; the folders are named, with the command
    that verifies them."""
    from hf_megatrain.core.publish import write_manifest

    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights")
    write_manifest(str(out))
    for step in (10, 2):
        ckpt = out / f"checkpoint-{step}"
        (ckpt / "megatrain_optimizer").mkdir(parents=True)
        (ckpt / "megatrain_optimizer" / "layer_00000.safetensors").write_bytes(b"state")
        write_manifest(str(ckpt))
    (out / "notes.txt").write_text("kept beside the model")
    assert main(["verify", str(out)]) == 0
    ok, note = capsys.readouterr().out.strip().splitlines()
    assert ok.endswith("1 files, 7 B verified, 1 other files not in the manifest")
    assert "2 folders with their own manifests (checkpoint-2, checkpoint-10)" in note
    assert note.endswith(f"hf-megatrain verify {out / 'checkpoint-10'}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the wording of a CPU run")
@pytest.mark.parametrize(
    "resident, said_first", [("0", "2 layers streamed ("), ("1", "1 layers kept whole, 1 layers")]
)
def test_cpu_run_report_has_no_gpu_terms(tmp_path, caplog, resident, said_first):
    """On a CPU the streaming report says nothing of HBM or pinned memory, and nothing of
    keep_attention_outputs' GPU memory plan; layers kept whole are counted as such."""
    import logging

    caplog.set_level(logging.INFO, logger="hf_megatrain")
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    cfg = _tiny_config(tmp_path / "config.json")
    argv = ["--config", str(cfg), "--data", str(data), "--no-verify", "--resident-layers", resident]
    assert main(["train", *argv, *_fast_flags(tmp_path / "out")]) == 0
    said = [r.getMessage() for r in caplog.records if r.name.startswith("hf_megatrain")]
    assert any(m.startswith(f"hf_megatrain: {said_first}") for m in said), said
    assert not any("HBM" in m or "keep_attention_outputs" in m or "pageable" in m for m in said)


def test_bad_settings_are_refused_before_the_model_loads(tmp_path):
    """Found by an audit: each failed after training (eval batch 0), in the Trainer (no eval
    rows, an unknown --report_to) or deep in the data loader (a negative seed); now one line
    from parsing, before anything is loaded."""
    out = ["--output_dir", str(tmp_path / "out")]
    msg = _error(["train", "--per_device_eval_batch_size", "0", *out])
    assert "per_device_eval_batch_size must be at least 1" in msg
    no_eval = ["--eval_fraction", "0", *out]  # the bundled corpus has no eval split
    msg = _error(["train", "--eval_strategy", "steps", "--eval_steps", "1", *no_eval])
    assert "--eval_strategy steps needs evaluation rows" in msg and "--eval_fraction" in msg
    best = ["--eval_strategy", "steps", "--save_strategy", "steps", "--load_best_model_at_end"]
    assert "--eval_strategy steps needs evaluation rows" in _error(["train", *best, *no_eval])
    msg = _error(["train", "--metric_for_best_model", "loss", *no_eval])
    assert "--metric_for_best_model needs evaluation rows" in msg
    assert parse_train(["--eval_strategy", "steps", "--eval_fraction", "0.1", *out])
    # A Hub dataset may have an eval split of its own: not known before it is loaded.
    hub = ["--dataset_name", "org/some-dataset", "--eval_strategy", "steps", *no_eval]
    assert parse_train(hub).data.eval_fraction == 0
    # Two names of one setting with different values (argparse kept the last, silently).
    msg = _error(["train", "--lr", "1e-3", "--learning_rate", "2e-3", *out])
    assert "--lr 1e-3 and --learning_rate 2e-3 set the same setting" in msg
    assert parse_train(["--lr", "1e-3", "--lr", "2e-3", *out]).training.learning_rate == 2e-3
    agree = parse_train(["--lr", "1e-3", "--learning_rate", "0.001", *out])
    assert agree.training.learning_rate == 1e-3
    msg = _error(["train", "--report_to", "bogus", *out])
    assert "--report_to bogus: not a known integration" in msg and "tensorboard" in msg
    assert parse_train(["--report_to", "tensorboard", *out]).training.report_to == ["tensorboard"]
    assert parse_train(["--report_to", "all", *out])
    for flag, value in (("--seed", "-1"), ("--data_seed", "-5"), ("--seed", str(2**32))):
        msg = _error(["train", flag, value, *out])
        assert f"{flag.lstrip('-')} must be an integer from 0 to 4294967295" in msg, msg
    assert parse_train(["--data_seed", "7", *out]).training.data_seed == 7


@pytest.mark.parametrize(
    "flags,said",
    [
        (["--adam_epsilon", "-1"], "--adam_epsilon -1.0 must be >= 0"),
        (["--adam_beta2", "1.5"], "--adam_beta2 1.5 must be in [0, 1)"),
        (
            ["--adam_beta1", "-0.5", "--weight_decay", "-0.1"],
            "--adam_beta1 -0.5 must be in [0, 1) (torch.optim.AdamW refuses others); ",
        ),
        (["--optim", "sgd"], "--optim 'sgd' is not supported"),
        (["--lr_scheduler_type", "cosine_with_min_lr"], "One of min_lr or min_lr_rate"),
        (["--save_strategy", "best"], "--save_strategy 'best' needs metric_for_best_model"),
        (["--fsdp", "full_shard"], "fsdp and deepspeed are not supported"),
        # (a traceback from transformers' deepspeed import before, found by an audit)
        (["--deepspeed", "ds.json"], "fsdp and deepspeed are not supported"),
        (["--label_names", "foo"], "--label_names foo: this command's rows carry their labels"),
    ],
)
def test_settings_the_trainer_refuses_are_refused_when_parsed(tmp_path, flags, said):
    """Found by an audit: out-of-range AdamW settings trained without learning (eps -1: rc 0);
    the others were refused only after the data and the model were loaded, most as a traceback
    (--label_names: after training, before the final model was saved). Now one line each,
    from parsing, naming the settings as this command's flags."""
    msg = _error(["train", *flags, "--output_dir", str(tmp_path / "out")])
    assert said in msg, msg
    assert "Traceback" not in msg


def test_push_to_hub_is_checked_before_training(tmp_path, monkeypatch):
    """--push_to_hub without a reachable Hub failed with an httpx traceback once the model was
    loaded; without credentials, likewise. Now both are refused up front, in one line."""
    import huggingface_hub

    import hf_megatrain.training_data as training_data

    push = ["--push_to_hub", "--hub_model_id", "me/x", "--output_dir", str(tmp_path / "out")]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(
        training_data,
        "hub_unreachable",
        lambda: "the Hub at https://huggingface.co cannot be reached: Name or service not known",
    )
    msg = _error(["train", *push])
    assert "--push_to_hub needs the Hub, and the Hub at https://huggingface.co cannot be" in msg
    monkeypatch.setattr(training_data, "hub_unreachable", lambda: None)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    assert "--push_to_hub needs a Hub token" in _error(["train", *push])
    assert parse_train([*push, "--hub_token", "hf_x"]).training.push_to_hub


def test_recipe_numbers_for_string_settings(tmp_path):
    """YAML reads `dataset_name: 2024` (a folder named 2024) as an int; a str setting gets it
    as the text it was typed as (it failed deep in the data loader)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("dataset_name: 2024\nresident_layers: 1\nresume_from_checkpoint: true\n")
    s = parse_train(["--recipe", str(recipe), "--output_dir", str(tmp_path / "out")])
    assert s.data.dataset_name == "2024" and s.engine.resident_layers == "1"
    assert s.training.resume_from_checkpoint == "True"  # "true": resume from the newest
    recipe.write_text("eval_strategy: 3\n")
    assert "3 is not a valid IntervalStrategy" in _error(["train", "--recipe", str(recipe)])


@pytest.mark.parametrize(
    "line, changed",
    [("auto_fit: off", {"auto_fit": "off"}),  # YAML 1.1 reads `off` as False
     ("auto_fit: on", {}),  # (on: the default, exact)
     ("keep_activations: no", {"keep_activations": "off"}),
     ("keep_attention_outputs: true", {"keep_attention_outputs": "all"}),
     ("resident_layers: false", {"resident_layers": "0"}),  # ("off" was refused)
     ("checkpoint_every: 2.0", {"checkpoint_every": 2}),
     ("plan_seq_len: '4096'", {"plan_seq_len": 4096}),
     ("offload_activations: 'yes'", {"offload_activations": True})],
)  # fmt: skip
def test_recipe_engine_values_read_as_every_front_door_reads_them(tmp_path, line, changed):
    """A recipe's engine keys go through the options' one reading (``option_value``), as
    ``options_from_mapping`` and the Python API do: `auto_fit: off` was refused as 'False', a
    YAML boolean for resident_layers as 'off'."""
    import yaml  # noqa: PLC0415

    recipe = tmp_path / "r.yaml"
    recipe.write_text(line + "\n")
    s = parse_train(["--recipe", str(recipe), "--output_dir", str(tmp_path / "out")])
    assert s.engine.changed() == changed
    assert options_from_mapping(yaml.safe_load(line)).changed() == changed


@pytest.mark.parametrize(
    "line, said",
    [("checkpoint_every: 2.5", "checkpoint_every=2.5 must be an integer"),
     ("export_dtype: true", "give one of float32, bfloat16"),
     ("mlp_tile_tokens: true", "mlp-tile-tokens must be int")],
)  # fmt: skip
def test_recipe_engine_values_of_the_wrong_kind_are_refused(tmp_path, line, said):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(line + "\n")
    assert said in _error(["train", "--recipe", str(recipe)])


@pytest.mark.parametrize(
    "field, value",
    [("hidden_size", 0), ("num_attention_heads", -3), ("intermediate_size", -5),
     ("vocab_size", 0), ("num_key_value_heads", 0)],
)  # fmt: skip
def test_degenerate_config_sizes_are_refused(tmp_path, capsys, field, value):
    """A size of 0 or below in --config failed inside the host store or torch (a TypeError, a
    negative dimension) once the data was loaded; now train and plan name the field."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({**json.loads(DEFAULT_CONFIG.read_text()), field: value}))
    said = f"{cfg}: {field} is {value}; it must be at least 1"
    assert said in _error(["train", "--config", str(cfg), "--output_dir", str(tmp_path / "o")])
    plan = ["plan", str(cfg), "--seq-len", "64", "--tokens-per-step", "128", "--no-search"]
    assert said in _error(plan + ["--hbm-gib", "80", "--host-gib", "64"])


def test_a_damaged_model_path_is_refused_by_its_manifest(tiny_run, tmp_path):
    """Found by an audit: --model_path on a folder hf-megatrain saved, with weights altered
    after (finite bytes: they still load), trained and saved without a word; a resume checks
    its checkpoint's manifest, --model_path now checks the folder's the same way."""
    out, data = tiny_run
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    shard = sorted(damaged.glob("*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size - 64)
        f.write(bytes(range(64)))
    msg = _error(["train", "--model_path", str(damaged), "--data", str(data),
                  *_fast_flags(tmp_path / "out")])  # fmt: skip
    assert f"--model_path: {shard} is corrupt: its sha256 differs" in msg
    assert "delete megatrain_manifest.json to train from the folder as it is" in msg
    # Its config edited on purpose (not its weights): trains.
    edited = tmp_path / "edited"
    shutil.copytree(out, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "use_cache": False}))
    flags = _fast_flags(tmp_path / "out2")
    assert main(["train", "--model_path", str(edited), "--data", str(data), *flags]) == 0


def test_training_into_the_model_folder_is_refused(tiny_run, tmp_path):
    """Found by an audit: --output_dir the --model_path folder (a saved model, no checkpoints)
    trained and saved over the weights it started from, rc 0. Refused before anything is read
    (by the folders' real paths: a link to it too), the weights untouched."""
    out, data = tiny_run
    model = tmp_path / "model"
    shutil.copytree(out, model, ignore=shutil.ignore_patterns("checkpoint-*"))
    before = {p.name: p.read_bytes() for p in model.glob("*.safetensors")}
    (tmp_path / "link").symlink_to(model)
    for target in (model, tmp_path / "link"):
        msg = _error(["train", "--model_path", str(model), "--data", str(data),
                      *_fast_flags(target)])  # fmt: skip
        assert "output_dir is the folder the model is loaded from" in msg, msg
    assert {p.name: p.read_bytes() for p in model.glob("*.safetensors")} == before


def test_no_progress_bar_silences_every_librarys_bars(tmp_path, capsys):
    """Found by an audit: --no-progress-bar left transformers' bars on (writing the shards of
    every save, loading the model for the final check) in log files; and --save_only_model's
    checkpoints, which a rerun cannot resume as the uninterrupted run, went unmentioned until
    that rerun."""
    import transformers.utils.logging

    flags = ["--max-shard-size", "100KB", "--save_steps", "1", "--save_only_model"]
    flags += ["--hbm-reserve-gb", "20"]  # (a knob train's known row length leaves unused)
    try:
        assert main(["train", *flags, *_fast_flags(tmp_path)]) == 0
    finally:
        transformers.utils.logging.enable_progress_bar()
    printed = capsys.readouterr()
    err = printed.err
    assert "Writing model shards" not in err and "Loading weights" not in err, err[-2000:]
    assert "note: --save_only_model: checkpoints hold the weights only" in printed.out
    assert "note: --hbm-reserve-gb is not used" in printed.out


def test_plan_seq_len_is_what_train_plans_for(tmp_path):
    """Found by an audit: train planned for --seq_len whatever --plan-seq-len said (the Python
    API's trainer honours it), so the flag did nothing; now it plans for the longer length,
    and a shorter one than the rows, which would not hold for them, is refused."""
    from hf_megatrain.cli_train import loader_arguments  # noqa: PLC0415

    out = ["--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "2"]
    step = loader_arguments(parse_train(["--seq_len", "64", "--plan-seq-len", "256", *out]))
    assert (step["step"].seq_len, step["step"].micro_batch_tokens) == (256, 512)
    assert loader_arguments(parse_train(["--seq_len", "64", *out]))["step"].seq_len == 64
    msg = _error(["train", "--seq_len", "64", "--plan-seq-len", "32", *out])
    assert "--plan-seq-len 32 is shorter than --seq_len 64" in msg


def test_plan_keeps_to_a_learned_position_table(tmp_path, capsys):
    """Found by an audit: for a model with learned positions, plan accepted rows longer than its
    table (which train refuses) and its search reported a longest sequence far past it."""
    cfg = tmp_path / "bigcode.json"
    cfg.write_text(json.dumps(dict(
        model_type="gpt_bigcode", architectures=["GPTBigCodeForCausalLM"], vocab_size=512,
        n_positions=32, n_embd=32, n_layer=2, n_head=2, multi_query=True,
    )))  # fmt: skip
    memory = ["--hbm-gib", "8", "--host-gib", "8"]
    msg = _error(["plan", str(cfg), "--seq-len", "64", "--tokens-per-step", "128", *memory])
    assert "--seq-len 64 is longer than the 32 positions" in msg
    from hf_megatrain.cli import build_parser
    from hf_megatrain.cli_plan import run_plan

    plan = ["plan", str(cfg), "--seq-len", "16", "--tokens-per-step", "64", *memory]
    assert run_plan(build_parser().parse_args(plan))["max_seq_len"] == 32


def test_plan_notes_rows_past_the_trained_rotary_positions(tmp_path, capsys):
    """Found by an audit: a rotary model planned at rows past its max_position_embeddings got no
    word (training warns: positions past it were never trained), and the search's longest
    sequence, far past it, none either. Rotary positions extend, so both stay plans, with a
    note; rows within the positions get none."""
    cfg = json.loads(DEFAULT_CONFIG.read_text())
    short = tmp_path / "short.json"
    short.write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    memory = ["--hbm-gib", "1.5", "--host-gib", "4.5"]  # (a short search: ~175 layers fit)
    assert main(["plan", str(short), "--seq-len", "128", "--tokens-per-step", "128", *memory]) == 0
    out = capsys.readouterr().out
    assert (
        "note: --seq-len 128 is longer than the model's max_position_embeddings=64: positions "
        "past it were never trained"
    ) in out
    assert re.search(r"longest sequence .*: \d+ tokens \(past max_position_embeddings=64", out)
    within = ["--seq-len", "64", "--tokens-per-step", "128", "--no-search"]
    assert main(["plan", str(short), *within, *memory]) == 0
    assert "max_position_embeddings" not in capsys.readouterr().out


def test_config_that_cannot_be_built_is_refused_at_parse_time(tmp_path, monkeypatch):
    """Any other construction error of a --config model: one line, before the data is read."""
    import hf_megatrain.training_data as training_data

    cfg = json.loads(DEFAULT_CONFIG.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**cfg, "hidden_act": "no_such_activation"}))
    monkeypatch.setattr(training_data, "load_training_data", None)  # never reached
    msg = _error(["train", "--config", str(bad), "--output_dir", str(tmp_path / "o")])
    assert f"{bad}: could not build llama from this config" in msg


def test_agreeing_flags_are_not_contradictory(tmp_path):
    """--bf16 false with --fp32, --no_packing with --packing false: the same setting twice, not
    a contradiction (the check compared the switches' constants, not the values given)."""
    out = ["--output_dir", str(tmp_path), "--max_steps", "1"]
    assert parse_train(["--bf16", "false", "--fp32", *out]).training.bf16 is False
    assert parse_train(["--no_packing", "--packing", "false", *out]).data.packing is False
    assert parse_train(["--packing=false", "--no-packing", *out]).data.packing is False
    assert parse_train(["--no-verify", "--verify", "false", *out]).model.verify is False
    msg = _error(["train", "--bf16", "true", "--fp32", *out])
    assert "--bf16 and --fp32 contradict each other" in msg
    msg = _error(["train", "--fp32", "--bf16=yes", *out])
    assert "--fp32 and --bf16 contradict each other" in msg
    msg = _error(["train", "--offload-activations", "--no-offload-activations", *out])
    assert "--offload-activations and --no-offload-activations contradict" in msg
    # One flag given twice stays last-wins.
    assert parse_train(["--bf16", "true", "--bf16", "false", *out]).training.bf16 is False


def test_help_says_each_default_once(capsys):
    """Engine flags' help named their default, then argparse's formatter added the parser's
    own default too: "(default: True) (default: None)"."""
    import re

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert not re.search(r"\(default: [^()]*\) \(default:", text)
    assert "--offload-activations, --no-offload-activations" in text
    assert "(default: False)" in text and "--max_steps MAX_STEPS" in text


def test_plan_names_the_model_after_its_config_file(tmp_path, capsys):
    """`plan cfgs/big.json` named the model "cfgs" (the folder); a file is named after
    itself, a checkpoint folder (or its config.json) after the folder."""
    folder = tmp_path / "cfgs"
    folder.mkdir()
    cfg = _tiny_config(folder / "huge200.json")
    flags = ["--seq-len", "64", "--tokens-per-step", "128", "--no-search"]
    flags += ["--hbm-gib", "80", "--host-gib", "64"]
    assert main(["plan", str(cfg), *flags]) == 0
    assert "memory plan: huge200 [llama]" in capsys.readouterr().out
    _tiny_config(folder / "config.json")
    for target in (folder, folder / "config.json"):
        assert main(["plan", str(target), *flags]) == 0
        assert "memory plan: cfgs [llama]" in capsys.readouterr().out


def test_batch_larger_than_the_data_is_refused():
    """A per-device batch beyond the training rows: each step sees every row once, not the
    batch the summary claimed (2 steps x 12800000 tokens of 550 rows)."""
    from hf_megatrain.cli_arguments import check_batch_size
    from hf_megatrain.cli_common import CLIError

    with pytest.raises(
        CLIError, match=r"--per_device_train_batch_size 100000 is more than the 550"
    ):
        check_batch_size(100000, 550)
    with pytest.raises(CLIError, match=r"275 rows per process"):
        check_batch_size(300, 550, world=2)
    check_batch_size(550, 550)
    check_batch_size(10**6, None)  # streaming: no row count


def test_checks_once_the_data_is_loaded(tmp_path):
    """check_loaded_data (run_train's call after loading the data, before the model): evaluation
    asked for where a Hub dataset turned out to have no eval split, and a batch beyond the rows,
    refused in one line."""
    from types import SimpleNamespace

    from hf_megatrain.cli_arguments import check_loaded_data
    from hf_megatrain.cli_common import CLIError

    out = ["--output_dir", str(tmp_path / "out")]
    hub = ["--dataset_name", "org/some-dataset", "--eval_fraction", "0", *out]
    settings = parse_train(["--eval_strategy", "steps", *hub])
    with pytest.raises(CLIError, match="--eval_strategy steps needs evaluation rows, but org/"):
        check_loaded_data(settings, SimpleNamespace(num_train_rows=100, eval=None))
    check_loaded_data(settings, SimpleNamespace(num_train_rows=100, eval=[0]))
    metric = parse_train(["--metric_for_best_model", "loss", *hub])
    with pytest.raises(CLIError, match="--metric_for_best_model needs evaluation rows"):
        check_loaded_data(metric, SimpleNamespace(num_train_rows=100, eval=None))
    check_loaded_data(parse_train(hub), SimpleNamespace(num_train_rows=100, eval=None))
    with pytest.raises(CLIError, match="--per_device_train_batch_size 8 is more than the 5 "):
        check_loaded_data(parse_train(out), SimpleNamespace(num_train_rows=5, eval=[0]))


@pytest.mark.parametrize(
    "world,sp,rows,split",
    [
        (1, 1, 8, "batch 2 x grad-accum 4"),
        (4, 1, 32, "batch 2 x grad-accum 4 x 4 processes"),
        # Ranks sharing a sequence train one row among them: 4 processes at N=2 take 2 groups'
        # rows (the header said 4 processes' worth, twice the tokens a step trains).
        (4, 2, 16, "batch 2 x grad-accum 4 x 2 groups of 2 processes sharing each row"),
        (2, 2, 8, "batch 2 x grad-accum 4 x 1 group of 2 processes sharing each row"),
    ],
)
def test_the_header_counts_the_rows_a_step_trains(world, sp, rows, split):
    from hf_megatrain.cli_train import step_rows

    assert step_rows(2, 4, world, sp) == (rows, split)


def test_an_output_dir_name_too_long_for_its_staging_is_refused_at_parse_time(tmp_path):
    """Saves are staged beside the output folder under names some 40 bytes longer: a name of
    240 bytes trained, published its checkpoints, then failed its final save with a traceback
    (ENAMETOOLONG), on every re-run. Now one line before any work; one over the file system's
    limit too (it was a traceback from the argument check)."""
    for n in (240, 300):
        msg = _error(["train", "--output_dir", str(tmp_path / ("c" * n)), "--max_steps", "1"])
        assert "pass a shorter --output_dir name" in msg and "\n" not in msg
    # A name too long in the middle of the path; a short link to a long-named folder (saves
    # and the lock go beside the folder's real path).
    msg = _error(["train", "--output_dir", str(tmp_path / ("m" * 300) / "run")])
    assert "past this file system's" in msg and "\n" not in msg
    (tmp_path / ("d" * 230)).mkdir()
    (tmp_path / "link").symlink_to(tmp_path / ("d" * 230))
    msg = _error(["train", "--output_dir", str(tmp_path / "link"), "--max_steps", "1"])
    assert "pass a shorter --output_dir name" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d" * 230, "link"]


def test_option_refusals_name_the_flags_as_typed(tmp_path):
    """Found by an audit: the trainer's message spells options as training arguments
    (megatrain_host_grads=False), which the command line turned into "megatrain_--host-grads
    False". Engine options and the Trainer's own arguments are named as they are typed."""
    out = ["--output_dir", str(tmp_path / "out")]
    msg = _error(["train", "--no-host-grads", *out])
    assert msg.startswith("hf-megatrain: error: --no-host-grads needs eager layer updates"), msg
    assert "--max_grad_norm 1.0 clips gradients" in msg and "leave --host-grads unset" in msg
    assert "megatrain_" not in msg and "False" not in msg and "=" not in msg
    from hf_megatrain.option_flags import flag_message  # noqa: PLC0415

    # (a name inside a path stays as it is)
    path = "under /tmp/host_grads/run and host_grads.json"
    assert flag_message(f"leave host_grads unset, {path}") == f"leave --host-grads unset, {path}"


# ---- data-parallel launches gone wrong (found by an audit; the real launches: torchrun on 2
# CPU processes and 2 emulated nodes, recorded in docs/benchmarks.md's forty-fifth session) ---
def test_accelerates_cpu_launcher_starting_one_of_several_is_refused(monkeypatch):
    """`accelerate launch --cpu --num_processes 2` without mpirun starts one process (a
    rendezvous address, no world size): it trained alone at half the global batch."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    msg = _error(["train", "--max-steps", "1"])
    assert "accelerate launch started one process where several were asked" in msg
    assert "torchrun --nproc_per_node N" in msg
    from hf_megatrain.cli_train import check_launch  # noqa: PLC0415

    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # mpirun's launch: not this case
    check_launch()


def _two_ranks(monkeypatch, gathered: list) -> None:
    """torch.distributed as a rank of 2 sees it, the other rank's gathered object given."""
    import torch.distributed as dist  # noqa: PLC0415

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)

    def gather(out, mine, *a, **k):
        out[:] = [mine, *gathered]

    monkeypatch.setattr(dist, "all_gather_object", gather)


def test_a_peer_gone_mid_run_is_one_line(tmp_path, monkeypatch):
    """A rank killed mid-run left the others a gloo traceback through the gradient reduction:
    now one line saying a peer stopped and that a rerun resumes."""
    import hf_megatrain.cli as cli  # noqa: PLC0415

    gloo = (
        "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:34229: Connection reset by peer. This is typically caused by a remote "
        "worker hanging or bugs in the application."
    )

    def peer_gone(settings):
        raise RuntimeError(gloo)

    monkeypatch.setattr(cli, "run_train", peer_gone)
    monkeypatch.setattr(cli, "end_process_group", lambda: None)
    out = ["--output_dir", str(tmp_path / "out")]
    _two_ranks(monkeypatch, [])
    msg = _error(["train", *out])
    assert msg.startswith(
        "hf-megatrain: error: a data-parallel peer process stopped (Read error "
        "[127.0.0.1]:34229: Connection reset by peer): this rank stops too"
    )
    assert "rerunning the command resumes from the newest one" in msg
    monkeypatch.setattr(cli, "run_train", lambda s: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="other"):  # any other error keeps its traceback
        main(["train", *out])


def test_more_ranks_than_layers_is_one_line(tmp_path, monkeypatch):
    """The refusal came as each rank's traceback ending in DataParallelError."""
    import hf_megatrain.cli as cli  # noqa: PLC0415
    from hf_megatrain.core.distributed import DataParallel  # noqa: PLC0415

    def too_many(settings):
        DataParallel(rank=0, world_size=2, local_world_size=2).assign_owners([10])

    monkeypatch.setattr(cli, "run_train", too_many)
    msg = _error(["train", "--output_dir", str(tmp_path / "out")])
    assert "2 data-parallel ranks per node but the model has 1 decoder layer;" in msg


def test_an_output_dir_some_rank_cannot_see_is_refused(tmp_path, monkeypatch):
    """Node-local folders: one node failed in a traceback from the disk-space check, the other
    in a gloo error. Every rank checks the folder rank 0 made, and all refuse."""
    from hf_megatrain.cli_common import CLIError  # noqa: PLC0415
    from hf_megatrain.cli_train import check_output_dir_on_every_rank  # noqa: PLC0415

    mine = tmp_path / "out"
    mine.mkdir()
    _two_ranks(monkeypatch, [("/node1/out", False)])
    with pytest.raises(CLIError, match=r"where rank 0 made it \(.*out\) for rank 1's /node1/out"):
        check_output_dir_on_every_rank(str(mine))
    _two_ranks(monkeypatch, [("/shared/out", True)])
    check_output_dir_on_every_rank(str(mine))


def test_messages_for_what_an_audit_tried(tmp_path):
    """Each in one line saying what is wrong (found by an audit): a file on the output_dir's
    path, a JSON file that is not a config, a one-token sequence on plan as on train, and a
    sequence longer than the step."""
    (tmp_path / "afile").write_text("x")
    said = _error(["train", "--output_dir", str(tmp_path / "afile" / "sub" / "out")])
    assert f"({tmp_path / 'afile'} is a file, not a folder)" in said
    for text, what in (("[]", "it holds a list"), ('{"hidden_size": 8}', "it has no model_type")):
        (tmp_path / "c.json").write_text(text)
        said = _error(
            ["plan", str(tmp_path / "c.json"), "--seq-len", "8", "--tokens-per-step", "8"]
        )
        assert f"is not a model config: {what}" in said
    cfg = str(Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / "qwen2.5-7b")
    said = _error(["plan", cfg, "--seq-len", "1", "--tokens-per-step", "1024"])
    assert "seq_len must be at least 2" in said
    said = _error(["plan", cfg, "--seq-len", "131072", "--tokens-per-step", "65536"])
    assert "shorter than one sequence of seq_len 131072" in said
