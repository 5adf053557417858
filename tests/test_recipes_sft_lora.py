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
