"""Which weights differ between autocast_kernels on and off under Liger's kernels (GPU).

    python3 dev/liger_bitwise.py

Two steps of tests/test_gpu.py's tiny Llama with the Trainer's use_liger_kernel, Liger's
RMSNorm, RoPE and SwiGLU each alone and all three: autocast_kernels off twice (run-to-run
determinism) and on; with all three, the stock Trainer twice too. Prints the parameters that
are not bitwise equal.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from tests.helpers import mega_params, one_gpu, tiny_model
from tests.test_gpu import _args, _data, _mega_losses, _tiny_gpu_config


def stock_params(tmp: Path, name: str, model, data, cfg: dict) -> dict[str, torch.Tensor]:
    """The stock Trainer's weights after 4 steps with Liger's kernels ``cfg``."""
    args = one_gpu(_args(TrainingArguments, tmp / name, max_steps=4, use_liger_kernel=True,
                         liger_kernel_config=cfg))  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return {n: p.detach().cpu() for n, p in trainer.model.named_parameters()}


def main() -> None:
    model = tiny_model(_tiny_gpu_config())
    data = _data(32, 128)
    none = dict(rope=False, rms_norm=False, swiglu=False, fused_linear_cross_entropy=False)
    tmp = Path(tempfile.mkdtemp())
    for name in ("rms_norm", "rope", "swiglu", "all"):
        cfg = {k: (name in (k, "all")) if k != "fused_linear_cross_entropy" else False
               for k in none}  # fmt: skip
        runs = []
        for i, on in enumerate((False, False, True)):
            trainer, losses = _mega_losses(
                tmp, f"{name}-{i}", copy.deepcopy(model), data, use_liger_kernel=True,
                liger_kernel_config=cfg, megatrain_autocast_kernels=on,
            )  # fmt: skip
            runs.append((losses, mega_params(trainer)))
        (la, pa), (lb, pb), (lc, pc) = runs
        off_off = [k for k in pa if not torch.equal(pa[k], pb[k])]
        off_on = [k for k in pa if not torch.equal(pa[k], pc[k])]
        print(f"liger {name}: losses off {la} / {lb} / on {lc}")
        print(f"  off vs off differ ({len(off_off)}): {off_off[:8]}")
        print(f"  off vs on differ ({len(off_on)}): {off_on[:8]}", flush=True)
        if name == "all":  # the stock Trainer's own run-to-run determinism with all three
            sa, sb = (stock_params(tmp, f"stock-{i}", copy.deepcopy(model), data, cfg)
                      for i in range(2))  # fmt: skip
            differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
            print(f"  stock vs stock differ ({len(differ)}): {differ[:8]}", flush=True)


if __name__ == "__main__":
    main()
