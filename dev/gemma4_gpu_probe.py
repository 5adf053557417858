"""Gemma 4's wide heads on the GPU, step by step: streamed against stock (bf16 autocast, the GPU
test's config), with one thing changed at a time (diagnostic for
tests/test_gpu.py::test_gemma4_wide_heads_train_like_stock_on_gpu).

    python3 dev/gemma4_gpu_probe.py
"""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import gemma4_config, run_trainer, tiny_model  # noqa: E402
from tests.test_gpu import VOCAB, _data  # noqa: E402


def config(full_head_dim: int = 512):
    return gemma4_config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                         global_head_dim=full_head_dim, num_global_key_value_heads=1,
                         sliding_window=256, max_position_embeddings=2048)  # fmt: skip


def logs(model, mega: bool, tmp: Path, name: str, **kw) -> list[tuple[float, float]]:
    args = dict(max_steps=3, bf16=True, learning_rate=1e-3, use_cpu=False,
                data=_data(8, 1024), per_device_train_batch_size=2)  # fmt: skip
    args.update(kw)
    out, _ = run_trainer(copy.deepcopy(model), tmp, name, mega, **args)
    return [(r["loss"], r["grad_norm"]) for r in out]


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    cases = [
        ("stock", 512, False, {}),
        ("stock 1x2 accumulation", 512, False,
         dict(per_device_train_batch_size=1, gradient_accumulation_steps=2)),
        ("streamed", 512, True, {}),
        ("streamed, attention outputs not kept", 512, True,
         dict(megatrain_keep_attention_outputs="off")),
        ("streamed, every layer in HBM", 512, True, dict(megatrain_resident_layers="4")),
        ("stock fp32", 512, False, dict(bf16=False)),
        ("streamed fp32", 512, True, dict(bf16=False)),
        ("stock, full heads 256", 256, False, {}),
        ("streamed, full heads 256", 256, True, {}),
    ]  # fmt: skip
    models = {d: tiny_model(config(d)) for d in (512, 256)}
    for i, (name, dim, mega, kw) in enumerate(cases):
        try:
            rows = logs(models[dim], mega, tmp, f"r{i}", **kw)
            print(f"{name:40s} " + "  ".join(f"{a:.5f}/{b:.4f}" for a, b in rows), flush=True)
        except Exception as e:  # noqa: BLE001 - a diagnostic: say and go on
            print(f"{name:40s} fails: {type(e).__name__}: {str(e).splitlines()[0][:160]}")


if __name__ == "__main__":
    main()
