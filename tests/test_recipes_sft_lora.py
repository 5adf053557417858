"""The SFT (TRL, chat template, assistant-only loss, packing) and LoRA recipes run offline on the
bundled data, on CPU, and do what they say: only assistant tokens in the loss, conversations packed
without attending to each other, a frozen streamed base whose adapters load in stock peft."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("trl")
peft = pytest.importorskip("peft")

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _losses(logs: list[dict]) -> list[float]:
    losses = [h["loss"] for h in logs]
    assert losses and all(math.isfinite(x) for x in losses)
    return losses


def test_sft_recipe_masks_user_turns_and_packs_conversations(tmp_path):
    sft = _recipe("sft")
    out = tmp_path / "sft"
    argv = ["--max-steps", "4", "--max-length", "256", "--batch-size", "2"]
    result = sft.main([*argv, "--output-dir", str(out)])
    trainer = result["trainer"]
    losses = _losses(result["logs"])
    assert len(losses) == 4 and losses[-1] < losses[0]
    # Packing: 90 conversations of <= ~120 tokens share 256-token rows.
    assert result["conversations"] == 90
    assert result["packed_rows"] < result["conversations"] // 2

    # One collated training batch, as the model saw it: TRL's padding-free packing flattens the
    # batch into one row, position_ids restarting at 0 at each conversation.
    batch = next(iter(trainer.get_train_dataloader()))
    ids, labels, pos = batch["input_ids"][0], batch["labels"][0], batch["position_ids"][0]
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    starts = (pos == 0).nonzero().flatten().tolist()
    assert len(starts) > 2 and starts[0] == 0
    bounds = [*starts, len(ids)]
    for s, e in zip(bounds[:-1], bounds[1:]):
        assert torch.equal(pos[s:e], torch.arange(e - s))

    # Assistant-only loss: in every packed conversation the tokens left in the loss decode to
    # exactly its assistant turns, each with the EOS that ends it; headers and user turns
    # (including second user turns) are -100.
    tok = trainer.processing_class
    rows = [json.loads(line) for line in sft.DEFAULT_CHAT.read_text().splitlines()]
    by_question = {r["messages"][0]["content"]: r["messages"] for r in rows}
    multi_turn = 0
    for s, e in zip(bounds[:-1], bounds[1:]):
        text = tok.decode(ids[s:e])
        question = text.removeprefix("User:\n").split("\n", 1)[0]
        messages = by_question[question]
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        multi_turn += len(answers) > 1
        assert tok.decode(ids[s:e][labels[s:e] != -100]) == "".join(
            t + tok.eos_token for t in answers
        )
        assert all(m["content"] in text for m in messages)  # whole, not truncated
    assert multi_turn > 0  # the batch covers a second user turn too

    # Packing is exact on the streamed model: the packed row's loss equals the loss of its
    # conversations run one by one (fp32 CPU: same kernels, only the reduction order differs),
    # and the same row without position_ids (conversations attending to each other) differs.
    model = trainer.model.eval()
    dev = trainer.args.device
    with torch.no_grad():
        packed = model(**{k: v.to(dev) if torch.is_tensor(v) else v for k, v in batch.items()})
        total, count = 0.0, 0
        for s, e in zip(bounds[:-1], bounds[1:]):
            lab = labels[s:e].clone()
            lab[0] = -100  # as TRL masks each conversation's first label in the packed row
            n = int((lab[1:] != -100).sum())
            loss = model(input_ids=ids[s:e][None].to(dev), labels=lab[None].to(dev)).loss
            total, count = total + loss.item() * n, count + n
        crossing = model(input_ids=ids[None].to(dev), labels=labels[None].to(dev)).loss.item()
    separate = total / count
    assert packed.loss.item() == pytest.approx(separate, rel=1e-5)
    assert abs(crossing - separate) > 100 * abs(packed.loss.item() - separate)

    # The saved model and tokenizer (with the chat template) load the stock way.
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "llama"
    assert AutoTokenizer.from_pretrained(out).chat_template == sft.CHAT_TEMPLATE


def test_lora_recipe_trains_adapters_on_a_frozen_streamed_base(tmp_path):
    from safetensors.torch import load_file  # noqa: PLC0415

    from hf_megatrain.hf.checkpoint import host_state_dict  # noqa: PLC0415

    lora = _recipe("lora")
    out = tmp_path / "lora"
    argv = ["--max-steps", "4", "--seq-len", "64", "--batch-size", "4", "--eval-chunks", "2"]
    result = lora.main([*argv, "--output-dir", str(out)])
    trainer = result["trainer"]
    _losses(result["logs"])
    assert result["eval_loss_after"] < result["eval_loss_before"]

    # Base streamed from frozen host stores (no gradient or moment buffers), adapters resident
    # and trained: peft initializes every lora_B to zero, so non-zero means updated.
    assert all(not s.trainable and s.exp_avg is None for s in trainer.megatrain.store.layers)
    adapters = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert all(p.abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n)

    # The frozen base did not move: every base tensor in the host store equals the base folder's.
    base = load_file(str(Path(result["base_path"]) / "model.safetensors"))
    state = host_state_dict(trainer.model)
    checked = 0
    for key, value in state.items():
        if "lora_" in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(value, base[name]), name
        checked += 1
    assert checked == len(base)

    # Stock peft over a stock model loads the saved adapters and gives the streamed model's
    # logits. fp32, both on the trainer's device, the same base values and adapter tensors: only
    # the order of float sums may differ between the streamed and the stock layer code (0.0
    # apart on CPU here; 1e-5 on logits of size ~1 leaves margin for other kernels, while the
    # adapters move the logits by > 1e-3, checked below).
    dev = trainer.args.device
    stock = lora.stock_peft_model(result["base_path"], str(out), device=dev)
    ids = torch.tensor([result["eval_rows"][0]["input_ids"]], device=dev)
    with torch.no_grad():
        got = stock(input_ids=ids).logits
        ref = trainer.model.eval()(input_ids=ids).logits
        with stock.disable_adapter():
            plain = stock(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert (plain - ref).abs().max() > 1e-3
    assert result["stock_eval_loss"] == pytest.approx(result["eval_loss_after"], rel=1e-5)


REPO = RECIPES.parent
TINY_QWEN2 = REPO / "benchmarks" / "configs" / "tiny-qwen2"  # vocab 128: below the tokenizer's


def _tiny_qwen2_config(folder: Path) -> Path:
    """benchmarks/configs/tiny-qwen2 with the bundled tokenizer's vocab (4096), as a folder."""
    cfg = json.loads((TINY_QWEN2 / "config.json").read_text())
    cfg.update(vocab_size=4096, max_position_embeddings=1024)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_sft_recipe_trains_a_config_at_random_init(tmp_path):
    # --config: a real-size run's path (random init through init_streamed_model, bundled
    # tokenizer) at a tiny shape: the model is streamed from the start, trains, and saves.
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    sft = _recipe("sft")
    out = tmp_path / "sft"
    cfg = _tiny_qwen2_config(tmp_path / "tiny-qwen2-4096")
    argv = ["--config", str(cfg), "--max-steps", "4", "--max-length", "256", "--batch-size", "2"]
    result = sft.main([*argv, "--output-dir", str(out)])
    losses = _losses(result["logs"])
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert result["bf16"] is torch.cuda.is_available()  # automatic: bf16 only on a GPU
    trainer = result["trainer"]
    assert trainer.model.config.model_type == "qwen2"
    assert all(s.trainable for s in trainer.megatrain.store.layers)  # full fine-tuning
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.model_type == "qwen2" and reloaded.config.vocab_size == 4096


def test_lora_recipe_on_a_config_base(tmp_path):
    # --config: adapters over a frozen random-init base that is never materialized; the base
    # is small, so the recipe writes it from the host store and reloads with stock peft.
    from safetensors.torch import load_file  # noqa: PLC0415

    lora = _recipe("lora")
    out = tmp_path / "lora"
    cfg = _tiny_qwen2_config(tmp_path / "tiny-qwen2-4096")  # tied embeddings, q/k/v biases
    argv = ["--config", str(cfg), "--max-steps", "3", "--seq-len", "64", "--batch-size", "4"]
    result = lora.main([*argv, "--eval-chunks", "2", "--output-dir", str(out)])
    trainer = result["trainer"]
    _losses(result["logs"])
    assert result["eval_loss_after"] < result["eval_loss_before"]
    assert all(not s.trainable and s.exp_avg is None for s in trainer.megatrain.store.layers)
    adapters = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert all(p.abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n)
    # The base written for the check is the model's own init: normal(0, initializer_range)
    # projections, zero biases, unit norms.
    base = load_file(str(Path(result["base_path"]) / "model.safetensors"))
    q = base["model.layers.1.self_attn.q_proj.weight"]
    assert abs(q.std().item() - 0.02) < 0.004 and q.abs().max() > 0
    assert torch.all(base["model.layers.1.self_attn.q_proj.bias"] == 0)
    assert torch.all(base["model.layers.0.input_layernorm.weight"] == 1)
    assert "lm_head.weight" not in base  # tied: from_pretrained ties it to the embedding
    assert result["stock_eval_loss"] == pytest.approx(result["eval_loss_after"], rel=1e-5)


def test_lora_recipe_skips_the_reload_check_of_a_large_config_base(tmp_path, capsys):
    lora = _recipe("lora")
    lora.VERIFY_MAX_PARAMS = 0  # every --config base counts as too large to write and reload
    out = tmp_path / "lora"
    argv = ["--config", str(REPO / "hf_megatrain" / "data" / "config.json")]
    argv += ["--max-steps", "1", "--seq-len", "32", "--batch-size", "2", "--eval-chunks", "1"]
    result = lora.main([*argv, "--output-dir", str(out)])
    assert "stock_eval_loss" not in result and not (out / "base").exists()
    assert "skipped the stock peft reload check" in capsys.readouterr().out
    assert (out / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("name", ["sft", "lora"])
def test_recipes_refuse_bad_config_arguments(name, tmp_path, capsys):
    recipe = _recipe(name)
    out = ["--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        recipe.main(["--config", str(TINY_QWEN2), "--model-path", str(tmp_path), *out])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err and "--config" in err and "--model-path" in err

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        recipe.main(["--config", str(tmp_path / "empty"), *out])
    assert e.value.code == 2 and "has no config.json" in capsys.readouterr().err

    (tmp_path / "doge").mkdir()
    (tmp_path / "doge" / "config.json").write_text(json.dumps({"model_type": "doge"}))
    with pytest.raises(SystemExit) as e:
        recipe.main(["--config", str(tmp_path / "doge"), *out])
    assert e.value.code == 2 and "'doge' is not supported" in capsys.readouterr().err

    # tiny-qwen2's vocab (128) cannot index the bundled tokenizer's 4096 ids.
    with pytest.raises(SystemExit, match="vocab_size is 128"):
        recipe.main(["--config", str(TINY_QWEN2), *out])
    assert not (tmp_path / "out").exists()

    # Found by an audit: a missing --model-path said "tokenizer not found", and the library's
    # refusals (here the host RAM) ended in a traceback. One line each, as hf-megatrain's.
    from hf_megatrain.recipe_helpers import run_recipe  # noqa: PLC0415

    def said(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as e:
            run_recipe(lambda: recipe.main([*argv, *out]), f"{name}.py")
        assert isinstance(e.value.code, str) and "\n" not in e.value.code
        return e.value.code

    assert said(["--model-path", str(tmp_path / "missing")]).startswith(
        f"{name}.py: error: model path not found"
    )
    config = _tiny_qwen2_config(tmp_path / "cfg")
    limited = said(["--config", str(config), "--host-memory-limit-gb", "0.000001"])
    assert limited.startswith(f"{name}.py: error: the host store needs")


def test_bundled_chat_is_what_build_chat_writes():
    # chat.jsonl is committed; it must stay the deterministic function of corpus.txt that its
    # README row and build_chat.py describe.
    from hf_megatrain.cli import DATA_DIR  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("build_chat", DATA_DIR / "build_chat.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.build((DATA_DIR / "corpus.txt").read_text(encoding="utf-8"))
    lines = (DATA_DIR / "chat.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == rows
    assert any(len(r["messages"]) == 4 for r in rows)  # multi-turn rows exist
