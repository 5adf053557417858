"""Recipe: supervised fine-tuning on conversations with TRL, the model's layers streamed from host RAM.

``MegaSFTTrainer`` is TRL's ``SFTTrainer`` on a streamed model. The data are ``messages`` rows
(user / assistant turns), rendered with the tokenizer's chat template; ``assistant_only_loss``
trains on the assistant turns only (TRL takes the spans between the template's
``{% generation %}`` markers, so every user turn is label -100), and ``packing`` lays
conversations into ``--max-length``-token rows by best-fit decreasing. TRL's packing is
padding-free: a batch is ONE row of conversations end to end, ``position_ids`` restarting at 0 per
conversation; with ``sdpa`` transformers turns that into a block-diagonal causal mask, so no
conversation attends to another (``--attn flex_attention`` keeps the mask sparse on the GPU).

A tokenizer without a chat template (the bundled one) gets ``CHAT_TEMPLATE`` below; one with a
template that TRL knows (Qwen2.5, Llama 3, ...) gets TRL's training variant with the markers.

    python3 recipes/sft.py                                          # bundled data, CPU, ~1 min
    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/sft.py \
        --model-path /models/Qwen2.5-7B --data /data/chat.jsonl --bf16 \
        --max-length 4096 --batch-size 4 --lr 1e-5 --max-steps 500
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from datasets import Dataset, load_dataset
from transformers import AutoConfig, AutoModelForCausalLM

from hf_megatrain import load_streamed_model
from hf_megatrain.cli import DATA_DIR, DEFAULT_CONFIG, TrainOptions, load_tokenizer
from hf_megatrain.integrations.trl import MegaSFTConfig, MegaSFTTrainer

DEFAULT_CHAT = DATA_DIR / "chat.jsonl"

# Plain-text role headers (the bundled tokenizer has no chat tokens, and adding some would resize
# the embeddings). The assistant's content AND its end-of-turn EOS sit inside the generation
# markers, so the model is trained to stop; the header and the newline after EOS are not.
# Each header ends in a newline, which the byte-level BPE never merges with the next word, so the
# marked spans start on a token boundary.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ 'Assistant:\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ message['role'] | capitalize + ':\n' + message['content'] + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:\n' }}{% endif %}"
)


def load_conversations(path: str | None) -> Dataset:
    """``messages`` rows from a JSON/JSONL/Parquet file (default: the bundled conversations)."""
    if path is None:
        # Read directly: the bundled file is small, and no datasets cache is written.
        lines = DEFAULT_CHAT.read_text(encoding="utf-8").splitlines()
        return Dataset.from_list([json.loads(line) for line in lines if line.strip()])
    builder = "parquet" if Path(path).suffix == ".parquet" else "json"
    return load_dataset(builder, data_files=path, split="train")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="Hub-format checkpoint folder (default: bundled config)")
    p.add_argument("--data", help="JSON/JSONL/Parquet of 'messages' rows (default: bundled chat)")
    p.add_argument("--output-dir", default="outputs/sft")
    p.add_argument("--max-length", type=int, default=512, help="tokens per packed row")
    p.add_argument("--batch-size", type=int, default=2, help="packed rows per step (one flat row)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "flex_attention"])
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    tokenizer = load_tokenizer(TrainOptions(model_path=a.model_path))
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHAT_TEMPLATE
    conversations = load_conversations(a.data)
    if a.model_path:
        model = load_streamed_model(a.model_path, bf16=a.bf16, attn_implementation=a.attn)
    else:
        # Random init of the bundled ~3M-parameter Llama: the loss falls within a minute on CPU.
        cfg = AutoConfig.from_pretrained(DEFAULT_CONFIG)
        torch.manual_seed(a.seed)
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.float32, attn_implementation=a.attn
        )
    args = MegaSFTConfig(
        output_dir=a.output_dir,
        assistant_only_loss=True,
        packing=True,  # TRL's default strategy "bfd": padding-free rows, position_ids per turn
        max_length=a.max_length,
        per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=a.grad_accum,
        max_steps=a.max_steps,
        learning_rate=a.lr,
        lr_scheduler_type="cosine",
        warmup_steps=min(10, a.max_steps // 5),
        logging_steps=max(1, a.max_steps // 10),
        bf16=a.bf16,  # SFTConfig defaults bf16 on; CPU runs need fp32
        # Streamed layers always recompute in backward; HF checkpointing would only add work.
        gradient_checkpointing=False,
        use_cpu=not torch.cuda.is_available(),
        seed=a.seed,
        save_strategy="no",
        report_to="none",
    )
    trainer = MegaSFTTrainer(
        model=model, args=args, train_dataset=conversations, processing_class=tokenizer
    )
    packed = trainer.train_dataset
    loss_tokens = sum(sum(t != -100 for t in row) for row in packed["labels"])
    all_tokens = sum(len(row) for row in packed["input_ids"])
    print(
        f"sft: {len(conversations)} conversations packed into {len(packed)} rows of <= "
        f"{a.max_length} tokens; {loss_tokens}/{all_tokens} tokens are assistant tokens (in the loss)"
    )
    trainer.train()
    trainer.save_model(a.output_dir)
    tokenizer.save_pretrained(a.output_dir)  # with the chat template, for inference
    logs = [h for h in trainer.state.log_history if "loss" in h]
    print(
        f"sft: loss {logs[0]['loss']:.4f} -> {logs[-1]['loss']:.4f} over {a.max_steps} steps, "
        f"saved to {a.output_dir}"
    )
    return {
        "conversations": len(conversations),
        "packed_rows": len(packed),
        "logs": logs,
        "trainer": trainer,
        "output_dir": a.output_dir,
    }


if __name__ == "__main__":
    main()
