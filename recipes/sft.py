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

``--config`` trains a real-size architecture without downloading weights: the model is built
from a config.json at random init with ``init_streamed_model`` (each decoder layer's initial
values are written straight into its host-store master, so a 7B config never exists as a whole
torch model) and trained with the bundled tokenizer. The loss is then that of a random model, the
steps, memory and throughput are those of the real size.

    python3 recipes/sft.py                                          # bundled data, CPU, ~1 min
    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/sft.py \
        --model-path /models/Qwen2.5-7B --data /data/chat.jsonl \
        --max-length 4096 --batch-size 4 --lr 1e-5 --max-steps 500
    python3 recipes/sft.py --config benchmarks/configs/qwen2.5-7b --max-length 4096 \
        --max-steps 4 --no-save                                     # 7B from random init, 1 GPU

Precision: bf16 compute (fp32 masters and AdamW states) when a bf16-capable GPU is there, fp32 on
the CPU; ``--bf16`` / ``--fp32`` choose.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from datasets import Dataset, load_dataset
from transformers import AutoConfig, AutoModelForCausalLM

from hf_megatrain import StepShape, init_streamed_model, load_streamed_model
from hf_megatrain.hf.arguments import as_arguments
from hf_megatrain.integrations.trl import MegaSFTConfig, MegaSFTTrainer
from hf_megatrain.option_flags import add_option_arguments, options_from_namespace
from hf_megatrain.recipe_helpers import (
    add_model_args,
    check_model_path,
    check_vocab,
    model_config,
    run_recipe,
)
from hf_megatrain.text import DATA_DIR, DEFAULT_CONFIG, load_tokenizer, use_bf16

_CHECKPOINTING = (
    "activation_checkpointing"
    if hasattr(MegaSFTConfig, "activation_checkpointing")
    else "gradient_checkpointing"
)

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
    add_model_args(
        p,
        config_help="config.json, or a folder with one (e.g. benchmarks/configs/qwen2.5-7b): random "
        "init at that size through init_streamed_model, with the bundled tokenizer",
    )
    p.add_argument("--data", help="JSON/JSONL/Parquet of 'messages' rows (default: bundled chat)")
    p.add_argument("--output-dir", default="outputs/sft")
    p.add_argument("--max-length", type=int, default=512, help="tokens per packed row")
    p.add_argument("--batch-size", type=int, default=2, help="packed rows per step (one flat row)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--save",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write the model and tokenizer to --output-dir at the end (--no-save: a 7B "
        "model is 30 GB of fp32 safetensors)",
    )
    add_option_arguments(p.add_argument_group("engine options"))
    a = p.parse_args(argv)
    check_model_path(a.model_path)
    cfg = model_config(a.config, p) if a.config else None
    bf16 = use_bf16(a.precision)

    # --config: the bundled tokenizer (TrainOptions() without a model path names it).
    engine = options_from_namespace(a)
    tokenizer = load_tokenizer(a.model_path)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHAT_TEMPLATE
    conversations = load_conversations(a.data)
    if a.model_path:
        model = load_streamed_model(a.model_path, engine, bf16=bf16, attn_implementation=a.attn)
    elif cfg is not None:
        check_vocab(cfg, tokenizer, "sft")
        print(
            f"sft: random init of a {cfg.model_type} model from {a.config} "
            f"({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}): each decoder layer "
            "initialized straight into its host-store master ...",
            flush=True,
        )
        t0 = time.perf_counter()
        cuda = torch.cuda.is_available()
        if cuda and a.resident_layers is None:
            # On a GPU the memory planner puts as many layers into HBM as the step leaves room
            # for (a packed step is batch-size rows of max-length tokens); the rest stream.
            engine = engine.with_(resident_layers="auto")
        model = init_streamed_model(
            cfg,
            engine,
            bf16=bf16,
            seed=a.seed,
            attn_implementation=a.attn,
            step=StepShape(a.max_length, a.batch_size * a.max_length) if cuda else None,
        )
        n_params = sum(q.numel() for q in model.parameters())  # streamed ones: meta views
        print(
            f"sft: {n_params / 1e6:,.1f}M parameters built in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
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
        bf16=bf16,  # SFTConfig defaults bf16 on; CPU runs need fp32
        # Streamed layers always recompute in backward; HF checkpointing would only add work
        # (SFTConfig turns it on; newer transformers 5.x name it activation_checkpointing).
        **{_CHECKPOINTING: False},
        use_cpu=not torch.cuda.is_available(),
        seed=a.seed,
        save_strategy="no",
        report_to="none",
        **as_arguments(engine),
    )
    trainer = MegaSFTTrainer(
        model=model, args=args, train_dataset=conversations, processing_class=tokenizer
    )
    packed = trainer.train_dataset
    loss_tokens = sum(sum(t != -100 for t in row) for row in packed["labels"])
    all_tokens = sum(len(row) for row in packed["input_ids"])
    print(
        f"sft: {len(conversations)} conversations packed into {len(packed)} rows of <= "
        f"{a.max_length} tokens; {loss_tokens}/{all_tokens} tokens are assistant tokens (in the "
        f"loss); {'bf16 compute, fp32 masters' if bf16 else 'fp32'} on {trainer.args.device.type}",
        flush=True,
    )
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    if a.save:
        trainer.save_model(a.output_dir)
        tokenizer.save_pretrained(a.output_dir)  # with the chat template, for inference
    logs = [h for h in trainer.state.log_history if "loss" in h]
    # num_tokens: TRL's running count of the tokens trained on (padding-free rows: all real).
    # tokens_per_s: HFMegaTrainer's rate over the last logging interval.
    tokens = int(logs[-1].get("num_tokens", 0))
    tps = logs[-1].get("tokens_per_s")
    print(
        f"sft: loss {logs[0]['loss']:.4f} -> {logs[-1]['loss']:.4f} over {a.max_steps} steps, "
        + (
            f"{tokens:,} tokens in {train_s:.1f} s = {tokens / train_s:,.0f} tokens/s "
            "(first step's warm-up included)"
            if tokens
            else f"{train_s:.1f} s"
        )  # fmt: skip
        + (f", last logged interval {tps:,.0f} tokens/s" if tps else "")
        + (f"; saved to {a.output_dir}" if a.save else "; not saved (--no-save)")
    )
    return {
        "conversations": len(conversations),
        "packed_rows": len(packed),
        "logs": logs,
        "trainer": trainer,
        "output_dir": a.output_dir,
        "bf16": bf16,
        "train_seconds": train_s,
        "train_tokens": tokens,
    }


if __name__ == "__main__":
    run_recipe(main, "sft.py")
