"""Recipe: train on whole documents packed into rows, each document attending only to itself.

Every paragraph block of the corpus is one document (cut to --max-doc-tokens). The Trainer's
batches go through transformers' ``DataCollatorWithFlattening``: the batch's documents are laid
end to end in ONE row with no padding, ``position_ids`` restarting at 0 for each document and the
first label of each document masked. transformers turns the restarting positions into a
document-causal mask; with ``--attn flex_attention`` that mask is a sparse BlockMask (no T x T
tensor), the choice for long rows on the GPU; ``sdpa`` materializes it (fine for short rows).

    python3 recipes/packed_documents.py --max-steps 50                  # bundled data, CPU ok
    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/packed_documents.py \
        --model-path /models/Qwen2.5-7B --data /data/docs/ --docs-per-row 64 --bf16 \
        --attn flex_attention --max-doc-tokens 8192
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DataCollatorWithFlattening

from hf_megatrain import HFMegaTrainer, MegaTrainArguments, load_streamed_model
from hf_megatrain.hf.arguments import as_arguments
from hf_megatrain.option_flags import add_option_arguments, options_from_namespace
from hf_megatrain.recipe_helpers import check_model_path, run_recipe
from hf_megatrain.text import DEFAULT_CONFIG, load_tokenizer, read_texts


def documents(tokenizer, texts, max_doc_tokens: int, min_doc_tokens: int = 8) -> list[dict]:
    """One row per paragraph block (blank-line separated), cut to ``max_doc_tokens``."""
    rows = []
    for _, text in texts:
        blocks = [b.strip() for b in text.split("\n\n") if b.strip()]
        for ids in tokenizer(blocks, add_special_tokens=False)["input_ids"]:
            for i in range(0, len(ids), max_doc_tokens):
                piece = ids[i : i + max_doc_tokens]
                if len(piece) >= min_doc_tokens:
                    rows.append({"input_ids": piece, "labels": piece})
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="Hub-format checkpoint folder (default: bundled config)")
    p.add_argument("--data", help="text file or folder (default: bundled corpus)")
    p.add_argument("--output-dir", default="outputs/packed-documents")
    p.add_argument("--docs-per-row", type=int, default=8, help="documents packed into one row")
    p.add_argument("--max-doc-tokens", type=int, default=256)
    p.add_argument("--max-steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "flex_attention"])
    p.add_argument("--bf16", action="store_true")
    add_option_arguments(p.add_argument_group("engine options"))
    a = p.parse_args(argv)
    check_model_path(a.model_path)
    engine = options_from_namespace(a)

    tokenizer = load_tokenizer(a.model_path)
    rows = documents(tokenizer, read_texts(a.data), a.max_doc_tokens)
    if a.model_path:
        model = load_streamed_model(a.model_path, engine, bf16=a.bf16, attn_implementation=a.attn)
    else:
        cfg = AutoConfig.from_pretrained(DEFAULT_CONFIG)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.float32, attn_implementation=a.attn
        )
    args = MegaTrainArguments(
        output_dir=a.output_dir,
        per_device_train_batch_size=a.docs_per_row,
        max_steps=a.max_steps,
        learning_rate=a.lr,
        warmup_steps=min(10, a.max_steps // 5),
        logging_steps=max(1, a.max_steps // 10),
        bf16=a.bf16,
        use_cpu=not torch.cuda.is_available(),
        save_strategy="no",
        report_to="none",
        **as_arguments(engine),
    )
    trainer = HFMegaTrainer(
        model=model,
        args=args,
        train_dataset=rows,
        data_collator=DataCollatorWithFlattening(),
    )
    trainer.train()
    trainer.save_model(a.output_dir)
    tokenizer.save_pretrained(a.output_dir)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    print(
        f"packed-documents: {len(rows)} documents, final loss {logs[-1]['loss']:.4f}, "
        f"saved to {a.output_dir}"
    )
    return {"documents": len(rows), "logs": logs, "output_dir": a.output_dir}


if __name__ == "__main__":
    run_recipe(main, "packed_documents.py")
