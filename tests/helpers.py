"""Shared fixtures for equivalence tests: tiny configs, data, and a log-recording callback."""

from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from hf_megatrain import HFMegaTrainer, MegaTrainArguments
from hf_megatrain.core.recompute import _sdpa_kernels

VOCAB = 128
SEQ = 16

# Shared tiny shape: 2 decoder layers, hidden 32, GQA (4 query heads, 2 kv heads).
_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def tiny_config(arch: str, **overrides):
    """A tiny fp32 config of ``arch`` that still exercises the family's special paths.

    ``overrides`` replace entries of the shared tiny shape (e.g. ``num_hidden_layers=3``).
    """
    _BASE = {**_SHAPE, **overrides}  # noqa: N806 - reads as the shared shape below
    if arch == "llama":
        return LlamaConfig(**_BASE)
    if arch == "qwen2":
        return Qwen2Config(**_BASE)
    if arch == "qwen3":
        return Qwen3Config(**_BASE, head_dim=8)
    if arch == "mistral":
        # A window shorter than the sequence so the sliding-window mask really cuts attention.
        return MistralConfig(**_BASE, sliding_window=6)
    if arch == "gemma3_text":
        # One sliding and one full attention layer, window < SEQ: both mask paths run; soft-capping
        # and the embedding scale are model-level and must survive streaming.
        return Gemma3TextConfig(
            **_BASE,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
        )
    if arch == "phi3":
        return Phi3Config(**_BASE, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **_BASE,
            head_dim=8,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
            # Large so the aux-loss gradient is far above the comparison tolerance.
            router_aux_loss_coef=0.1,
        )
    if arch == "mixtral":
        return MixtralConfig(
            **_BASE,
            num_local_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        )
    raise KeyError(arch)


ARCHS = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma3_text",
    "phi3",
    "qwen3_moe",
    "mixtral",
]
MOE_ARCHS = ["qwen3_moe", "mixtral"]


class LogRecorder(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

        self.eval_logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append(dict(logs))
        if logs and "eval_loss" in logs:
            self.eval_logs.append(dict(logs))


def make_data(n: int = 32, seq: int = SEQ, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (seq,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def tiny_model(config, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def common_args(**overrides) -> dict:
    args = dict(
        per_device_train_batch_size=2,
        max_steps=5,
        logging_steps=1,
        learning_rate=1e-2,
        weight_decay=0.1,
        report_to=[],
        save_strategy="no",
        seed=0,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_grad_norm=0.5,
        use_cpu=True,
        disable_tqdm=True,
    )
    args.update(overrides)
    return args


def one_gpu(args: TrainingArguments) -> TrainingArguments:
    """Pin a stock run to one GPU, as HFMegaTrainer is: on a machine with several, the stock
    Trainer would wrap the model in DataParallel and scale the batch by the GPU count."""
    if args.n_gpu > 1:
        args._n_gpu = 1
    return args


def run_trainer(
    model,
    tmp_path,
    name: str,
    mega: bool,
    data=None,
    resume: str | None = None,
    data_collator=None,
    eval_dataset=None,
    recorder: LogRecorder | None = None,
    **arg_overrides,
):
    """Train ``model`` (not copied) with one trainer class; return ``(logs, trainer)``.

    ``recorder``: a ``LogRecorder`` to fill (for its eval logs too); a new one by default.
    """
    data = data if data is not None else make_data()
    cls, argcls = (HFMegaTrainer, MegaTrainArguments) if mega else (Trainer, TrainingArguments)
    rec = recorder if recorder is not None else LogRecorder()
    args = one_gpu(argcls(output_dir=str(tmp_path / name), **common_args(**arg_overrides)))
    trainer = cls(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=eval_dataset,
        callbacks=[rec],
        data_collator=data_collator,
    )
    trainer.train(resume_from_checkpoint=resume)
    return rec.logs, trainer


def train_both(model, tmp_path, steps: int = 5, data=None, **arg_overrides):
    """Train deep copies of ``model`` with stock Trainer and HFMegaTrainer; return both logs."""
    return [
        run_trainer(
            copy.deepcopy(model), tmp_path, name, mega, data=data, max_steps=steps, **arg_overrides
        )
        for name, mega in (("stock", False), ("mega", True))
    ]


def mega_params(trainer) -> dict[str, torch.Tensor]:
    """Full fp32 state of a trained HFMegaTrainer's model, streamed layers from the host store."""
    from hf_megatrain.hf.checkpoint import host_state_dict  # noqa: PLC0415

    return {k: v.detach().clone() for k, v in host_state_dict(trainer.model).items()}


def stock_params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_logs_match(stock: list[dict], mega: list[dict], rel: float = 1e-5) -> None:
    import pytest  # noqa: PLC0415

    assert len(stock) == len(mega) and len(stock) > 0
    for step, (a, b) in enumerate(zip(stock, mega), 1):
        # fp32 on CPU, same kernels: the differences are the summation order of the global norm
        # (per layer vs per tensor) and the clip coefficient applied as a fused-kernel grad scale
        # (one rounding); over a few steps that stays at the 1e-6 relative level.
        assert b["loss"] == pytest.approx(a["loss"], rel=rel), f"loss at step {step}"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel), f"grad_norm at {step}"
        # The LR comes from the same scheduler reading the same step count: exactly equal.
        assert b["learning_rate"] == a["learning_rate"], f"learning_rate at step {step}"


class CountAttentionKernels(TorchDispatchMode):
    """Counts the fused SDPA kernels that actually run while it is active (outputs that the
    recompute's cache hands back, megatrain_keep_attention_outputs, never reach a mode below
    it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.kernels = set(_sdpa_kernels())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in self.kernels
        return func(*args, **(kwargs or {}))


def liger_like_mlp_forward():
    """An MLP forward that computes what the MLP's own does but is named as Liger-Kernel's
    SwiGLU forward (its module), as ``model_shape`` recognizes Liger's kernels."""

    def forward(self, x):
        return type(self).forward(self, x)

    forward.__module__ = "liger_kernel.transformers.swiglu"  # where Liger's forward lives
    return forward


def patch_mlps_as_liger(model) -> None:
    """Bind :func:`liger_like_mlp_forward` on every decoder MLP instance, as Liger binds its own."""
    forward = liger_like_mlp_forward()
    for layer in model.model.layers:
        layer.mlp.__dict__["forward"] = forward.__get__(layer.mlp, type(layer.mlp))
