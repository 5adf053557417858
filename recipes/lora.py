"""Recipe: LoRA on a streamed frozen base; the saved adapters load with stock peft.

The base is loaded as an ordinary model in host RAM and wrapped by ``peft.get_peft_model``;
``HFMegaTrainer`` then streams its decoder layers: the frozen base weights live in frozen host
stores (fp32 master + bf16 stream copy, no gradient or AdamW buffers) and cross PCIe layer by
layer, while the LoRA adapters stay resident on the device with their own AdamW state. Training
is causal LM on a text corpus (documents joined with EOS, cut into ``--seq-len`` blocks).
``save_model`` writes ordinary ``adapter_model.safetensors`` / ``adapter_config.json``.

Afterwards (``--verify``, default on) the recipe reloads the adapters the stock way,
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), output_dir)``, and
compares its held-out loss with the streamed model's. That reload is a second copy of the base
(host RAM, then the device); ``--no-verify`` skips it.

Without ``--model-path`` the base is the bundled ~3M-parameter config at random init, written to
``<output-dir>/base`` so that the adapters have a base folder to load onto.

    python3 recipes/lora.py                                         # bundled data, CPU, ~1 min
    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/lora.py \
        --model-path /models/Qwen2.5-7B --data /data/corpus/ --bf16 \
        --seq-len 4096 --batch-size 4 --lr 2e-4 --max-steps 500 --rank 16
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, default_data_collator

from hf_megatrain import HFMegaTrainer, MegaTrainArguments
from hf_megatrain.cli import DEFAULT_CONFIG, TrainOptions, build_chunks, load_tokenizer, read_texts


def base_model(a) -> tuple[torch.nn.Module, str]:
    """The materialized base on the CPU, and the folder it loads from (for the stock reload)."""
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    base_path = a.model_path
    if base_path is None:
        base_path = str(Path(a.output_dir) / "base")
        torch.manual_seed(a.seed)
        cfg = AutoConfig.from_pretrained(DEFAULT_CONFIG)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(
        base_path, dtype=dtype, attn_implementation=a.attn, device_map="cpu"
    )
    return model, base_path


def stock_peft_model(
    base_path: str, adapter_dir: str, bf16: bool = False, attn: str = "sdpa", device="cpu"
) -> PeftModel:
    """The adapters loaded the stock way: no hf_megatrain involved."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype, attn_implementation=attn)
    return PeftModel.from_pretrained(base, adapter_dir).to(device).eval()


@torch.no_grad()
def mean_loss(model, rows: list[dict], device) -> float:
    """Token-weighted mean loss of ``rows`` (every row has the same length)."""
    model.eval()
    losses = [
        model(
            input_ids=torch.tensor([r["input_ids"]], device=device),
            labels=torch.tensor([r["labels"]], device=device),
        ).loss.item()
        for r in rows
    ]
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="Hub-format checkpoint folder (default: bundled config)")
    p.add_argument("--data", help="text file or folder (default: bundled corpus)")
    p.add_argument("--output-dir", default="outputs/lora")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=int, default=32)
    p.add_argument(
        "--target-modules",
        default="all-linear",
        help="comma-separated module names, or all-linear (every linear layer but the LM head)",
    )
    p.add_argument("--eval-chunks", type=int, default=8, help="held-out blocks for the loss check")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "flex_attention"])
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True)
    a = p.parse_args(argv)

    tokenizer = load_tokenizer(TrainOptions(model_path=a.model_path))
    chunks = build_chunks(tokenizer, read_texts(a.data), a.seq_len)
    rows = [{"input_ids": c, "labels": c} for c in chunks]
    train_rows, eval_rows = rows[: -a.eval_chunks], rows[-a.eval_chunks :]

    base, base_path = base_model(a)
    targets = a.target_modules if a.target_modules == "all-linear" else a.target_modules.split(",")
    lora = LoraConfig(
        r=a.rank,
        lora_alpha=a.alpha,
        lora_dropout=0.0,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    model.print_trainable_parameters()
    args = MegaTrainArguments(
        output_dir=a.output_dir,
        per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=a.grad_accum,
        max_steps=a.max_steps,
        learning_rate=a.lr,
        lr_scheduler_type="cosine",
        warmup_steps=min(10, a.max_steps // 5),
        logging_steps=max(1, a.max_steps // 10),
        bf16=a.bf16,
        use_cpu=not torch.cuda.is_available(),
        seed=a.seed,
        save_strategy="no",
        report_to="none",
    )
    trainer = HFMegaTrainer(
        model=model, args=args, train_dataset=train_rows, data_collator=default_data_collator
    )
    device = trainer.args.device
    loss_before = mean_loss(trainer.model, eval_rows, device)
    print(f"lora: {len(train_rows)} blocks of {a.seq_len} tokens, held-out loss {loss_before:.4f}")
    trainer.train()
    loss_after = mean_loss(trainer.model, eval_rows, device)
    trainer.save_model(a.output_dir)  # adapter_model.safetensors + adapter_config.json
    tokenizer.save_pretrained(a.output_dir)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    print(
        f"lora: held-out loss {loss_before:.4f} -> {loss_after:.4f}; adapters saved to "
        f"{a.output_dir} (base: {base_path})"
    )
    result = {
        "logs": logs,
        "trainer": trainer,
        "base_path": base_path,
        "eval_rows": eval_rows,
        "eval_loss_before": loss_before,
        "eval_loss_after": loss_after,
        "output_dir": a.output_dir,
    }
    if a.verify:
        stock = stock_peft_model(base_path, a.output_dir, a.bf16, a.attn, device)
        stock_loss = mean_loss(stock, eval_rows, device)
        print(f"lora: stock peft reload of the adapters: held-out loss {stock_loss:.4f}")
        # fp32: the same weights and kernels, only summation order may differ; bf16 runs keep
        # the base in bf16 either way, but the adapter path's rounding can differ slightly.
        if not math.isclose(stock_loss, loss_after, rel_tol=1e-2 if a.bf16 else 1e-4):
            raise SystemExit(
                f"lora: the reloaded adapters give loss {stock_loss} != streamed {loss_after}"
            )
        result["stock_eval_loss"] = stock_loss
    return result


if __name__ == "__main__":
    main()
