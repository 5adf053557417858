"""Recipe: LoRA on a streamed frozen base; the saved adapters load with stock peft.

The base is loaded as an ordinary model in host RAM and wrapped by ``peft.get_peft_model``;
``HFMegaTrainer`` then streams its decoder layers: the frozen base weights live in frozen host
stores (fp32 master + bf16 stream copy, no gradient or AdamW buffers) and cross PCIe layer by
layer, while the LoRA adapters stay resident on the device with their own AdamW state. Training
is causal LM on a text corpus (documents joined with EOS, cut into ``--seq-len`` blocks).
``save_model`` writes ordinary ``adapter_model.safetensors`` / ``adapter_config.json``.

Afterwards (``--verify``) the recipe reloads the adapters the stock way,
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), output_dir)``, and
compares its held-out loss with the streamed model's. That reload is a second copy of the base
(host RAM, then the device); ``--no-verify`` skips it.

Without ``--model-path`` or ``--config`` the base is the bundled ~3M-parameter config at random
init, written to ``<output-dir>/base`` so that the adapters have a base folder to load onto.

``--config`` (a config.json, or a folder with one) builds a real-size base at random init without
downloading weights and without ever materializing it: the model is built on ``meta``, the LoRA
adapters are added and initialized on the CPU, the frozen base's decoder layers get frozen host
stores, and the model's own ``_init_weights`` writes each layer's values straight into its store
(as ``hf_megatrain.init_streamed_model`` does for a model without adapters). The bundled
tokenizer is used. The stock reload check then needs the base written to disk first
(``<output-dir>/base``, fp32 from the host store): by default it runs up to 2B base parameters
and is skipped, with a note, above (a 7B base would be 30 GB of files plus a second, materialized
copy next to the host store); ``--verify`` forces it, ``--no-verify`` skips it.

    python3 recipes/lora.py                                         # bundled data, CPU, ~1 min
    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/lora.py \
        --model-path /models/Qwen2.5-7B --data /data/corpus/ \
        --seq-len 4096 --batch-size 4 --lr 2e-4 --max-steps 500 --rank 16
    python3 recipes/lora.py --config benchmarks/configs/qwen2.5-7b --seq-len 4096 \
        --batch-size 2 --max-steps 4 --eval-chunks 2                # 7B base at random init

Precision: bf16 compute (fp32 masters and AdamW states) when a bf16-capable GPU is there, fp32 on
the CPU; ``--bf16`` / ``--fp32`` choose.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, default_data_collator

from hf_megatrain import (
    EngineOptions,
    HFMegaTrainer,
    MegaTrainArguments,
    prepare_streamed_model,
)
from hf_megatrain.hf.arguments import as_arguments
from hf_megatrain.option_flags import add_option_arguments, options_from_namespace
from hf_megatrain.recipe_helpers import (
    add_model_args,
    check_model_path,
    check_vocab,
    model_config,
    run_recipe,
)
from hf_megatrain.text import DEFAULT_CONFIG, build_chunks, load_tokenizer, read_texts, use_bf16

# Above this many parameters a --config base (random init, never on disk) is not written out and
# reloaded for the stock peft check unless --verify asks (as `hf-megatrain train` decides).
VERIFY_MAX_PARAMS = 2_000_000_000


def _is_adapter(name: str) -> bool:
    return any(part.startswith("lora_") for part in name.split("."))


def streamed_lora_model(
    cfg,
    lora: LoraConfig,
    bf16: bool,
    seed: int = 0,
    attn: str = "sdpa",
    device=None,
    options: EngineOptions | None = None,
) -> PeftModel:
    """LoRA adapters over a random-init frozen base of ``cfg`` that is never materialized.

    The base is built on ``meta``; ``get_peft_model`` adds the adapters (on ``meta`` too, as their
    base layers), which are then allocated on the CPU and initialized the peft way (A random, B
    zero). ``prepare_streamed_model`` gives the frozen base weights of each decoder layer a
    frozen host store (fp32 master + stream copy, no gradient or moments) and keeps the adapters
    resident; finally the base model's own ``_init_weights`` writes each layer's values straight
    into its store, as ``hf_megatrain.init_streamed_model`` does for a model without adapters.
    """
    from accelerate import init_empty_weights  # noqa: PLC0415
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415

    from hf_megatrain.hf.loading import init_streamed_weights  # noqa: PLC0415

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    with init_empty_weights(include_buffers=False):
        base = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
    base.tie_weights()  # not tied yet under init_empty_weights
    torch.manual_seed(seed)
    model = get_peft_model(base, lora)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name in module.lora_A:
                module.lora_A[name].to_empty(device="cpu")
                module.lora_B[name].to_empty(device="cpu")
                module.reset_lora_parameters(name, lora.init_lora_weights)
    left = [n for n, q in model.named_parameters() if q.requires_grad and q.is_meta]
    if left:
        raise SystemExit(
            f"lora: adapters of this kind cannot be built on a --config base: {left[0]}"
        )
    prepare_streamed_model(
        model,
        device,
        torch.bfloat16 if bf16 else torch.float32,
        options,
        decay_names=set(Trainer.get_decay_parameter_names(None, model)),
    )
    # The stores hold the layers' frozen base tensors; the adapters (resident, initialized above)
    # are left alone.
    init_streamed_weights(model, model.get_base_model()._init_weights, skip=_is_adapter)
    return model


def write_base(model: PeftModel, cfg, path: str) -> None:
    """The frozen base of a streamed LoRA model as a Hub-format folder (fp32, from the store)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    from hf_megatrain.hf.checkpoint import host_state_dict  # noqa: PLC0415

    tensors = {}
    for key, value in host_state_dict(model).items():
        if _is_adapter(key):
            continue
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        tensors[name] = value.detach().to("cpu", torch.float32).clone()  # no shared storage
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # from_pretrained ties it to the embedding
    Path(path).mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    save_file(tensors, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})


def base_model(a, bf16: bool) -> tuple[torch.nn.Module, str]:
    """The materialized base on the CPU, and the folder it loads from (for the stock reload)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
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
    add_model_args(
        p,
        config_help="config.json, or a folder with one (e.g. benchmarks/configs/qwen2.5-7b): a "
        "random-init frozen base at that size, never materialized, with the bundled tokenizer",
    )
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
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reload the adapters with stock peft and compare the held-out loss (default: on, "
        f"except for a --config base above {VERIFY_MAX_PARAMS / 1e9:g}B parameters)",
    )
    add_option_arguments(p.add_argument_group("engine options"))
    a = p.parse_args(argv)
    check_model_path(a.model_path)
    engine = options_from_namespace(a)
    cfg = model_config(a.config, p) if a.config else None
    bf16 = use_bf16(a.precision)

    # --config: the bundled tokenizer.
    tokenizer = load_tokenizer(a.model_path)
    chunks = build_chunks(tokenizer, read_texts(a.data), a.seq_len)
    rows = [{"input_ids": c, "labels": c} for c in chunks]
    if len(rows) <= a.eval_chunks:
        raise SystemExit(
            f"lora: the data give {len(rows)} blocks of {a.seq_len} tokens, not more than "
            f"--eval-chunks {a.eval_chunks}: lower --seq-len or --eval-chunks"
        )
    train_rows, eval_rows = rows[: -a.eval_chunks], rows[-a.eval_chunks :]

    targets = a.target_modules if a.target_modules == "all-linear" else a.target_modules.split(",")
    lora = LoraConfig(
        r=a.rank,
        lora_alpha=a.alpha,
        lora_dropout=0.0,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    if cfg is not None:
        check_vocab(cfg, tokenizer, "lora")
        print(
            f"lora: random-init {cfg.model_type} base from {a.config} ({cfg.num_hidden_layers} "
            f"layers, hidden {cfg.hidden_size}), built on meta; LoRA r={a.rank} adapters; each "
            "frozen decoder layer initialized straight into its host store ...",
            flush=True,
        )
        t0 = time.perf_counter()
        model = streamed_lora_model(cfg, lora, bf16, a.seed, a.attn, options=engine)
        base_path = None  # written below only for the stock reload check
        print(f"lora: built in {time.perf_counter() - t0:.1f} s", flush=True)
    else:
        base, base_path = base_model(a, bf16)
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
        bf16=bf16,
        use_cpu=not torch.cuda.is_available(),
        seed=a.seed,
        save_strategy="no",
        report_to="none",
        **as_arguments(engine),
    )
    trainer = HFMegaTrainer(
        model=model, args=args, train_dataset=train_rows, data_collator=default_data_collator
    )
    device = trainer.args.device
    loss_before = mean_loss(trainer.model, eval_rows, device)
    print(
        f"lora: {len(train_rows)} blocks of {a.seq_len} tokens, held-out loss {loss_before:.4f}; "
        f"{'bf16 compute, fp32 masters' if bf16 else 'fp32'} on {device.type}",
        flush=True,
    )
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    loss_after = mean_loss(trainer.model, eval_rows, device)
    trainer.save_model(a.output_dir)  # adapter_model.safetensors + adapter_config.json
    tokenizer.save_pretrained(a.output_dir)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    # tokens_per_s: HFMegaTrainer's rate over the last logging interval (the first interval
    # also carries the warm-up).
    tps = logs[-1].get("tokens_per_s") if logs else None
    print(
        f"lora: {a.max_steps} steps in {train_s:.1f} s"
        + (f", {tps:,.0f} tokens/s (last logged interval)" if tps else "")
        + f"; held-out loss {loss_before:.4f} -> {loss_after:.4f}; adapters saved to "
        f"{a.output_dir} (base: {base_path or 'random init from ' + a.config})",
        flush=True,
    )
    result = {
        "logs": logs,
        "trainer": trainer,
        "base_path": base_path,
        "eval_rows": eval_rows,
        "eval_loss_before": loss_before,
        "eval_loss_after": loss_after,
        "output_dir": a.output_dir,
        "bf16": bf16,
        "train_seconds": train_s,
    }
    verify = a.verify
    if cfg is not None:
        n_params = sum(q.numel() for q in trainer.model.parameters())  # meta views counted
        if verify is None:
            verify = n_params <= VERIFY_MAX_PARAMS
            if not verify:
                print(
                    f"lora: skipped the stock peft reload check: the {n_params / 1e9:.1f}B-"
                    "parameter base is a random init that exists only in the host store; the "
                    f"check would write it to disk ({4 * n_params / 1e9:.0f} GB in fp32) and "
                    "load a second, materialized copy next to the store (--verify forces it)."
                )
        if verify:
            # The base is frozen: the store still holds its initial values.
            base_path = str(Path(a.output_dir) / "base")
            write_base(trainer.model, cfg, base_path)
            result["base_path"] = base_path
            print(f"lora: wrote the random-init base to {base_path} for the stock reload")
    if verify is None:
        verify = True
    if verify:
        stock = stock_peft_model(base_path, a.output_dir, bf16, a.attn, device)
        stock_loss = mean_loss(stock, eval_rows, device)
        print(f"lora: stock peft reload of the adapters: held-out loss {stock_loss:.4f}")
        # fp32: the same weights and kernels, only summation order may differ; bf16 runs keep
        # the base in bf16 either way, but the adapter path's rounding can differ slightly.
        if not math.isclose(stock_loss, loss_after, rel_tol=1e-2 if bf16 else 1e-4):
            raise SystemExit(
                f"lora: the reloaded adapters give loss {stock_loss} != streamed {loss_after}"
            )
        result["stock_eval_loss"] = stock_loss
    return result


if __name__ == "__main__":
    run_recipe(main, "lora.py")
