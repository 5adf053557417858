"""Where the device updates' AdamW kernel and torch's fused CPU AdamW round apart (diagnostic):
the CPU, its vector width, and per differing element its inputs, both results and the emulated
candidates of the second moment (tests/test_exact_adamw.py's one-rounding-per-operation
emulation). Usage: python3 dev/exact_adamw_probe.py"""

from __future__ import annotations

import logging
import platform
import subprocess

import torch

from hf_megatrain.core import exact_adamw
from tests.test_exact_adamw import HYPERS, _cpu_fused, _f32, _fma32


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("matches_cpu_adamw:", exact_adamw.matches_cpu_adamw(torch.device("cuda")))
    model = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln for ln in model.splitlines() if "Model name" in ln), platform.processor())
    print(
        "cpu:",
        model.strip(),
        "| capability:",
        torch.backends.cpu.get_cpu_capability(),
        "| width:",
        exact_adamw.cpu_vector_width(),
        "| torch",
        torch.__version__,
    )
    for h in HYPERS:
        numel = (1 << 18) + 13
        tensors = exact_adamw.sample_state(numel, torch.Generator().manual_seed(0))
        orig = [t.clone() for t in tensors]
        gpu = [t.cuda() for t in tensors]
        _cpu_fused(tensors, h)
        scale = None if h["scale"] is None else torch.tensor([h["scale"]], device="cuda")
        exact_adamw.adamw_(
            *gpu,
            rounding=exact_adamw.DOCUMENTED_ROUNDING,
            step=h["step"],
            lr=h["lr"],
            beta1=h["beta1"],
            beta2=h["beta2"],
            weight_decay=h["weight_decay"],
            eps=h["eps"],
            grad_scale=scale,
        )
        bad = {}
        for name, i in (("master", 0), ("exp_avg", 2), ("exp_avg_sq", 3)):
            differ = tensors[i].view(torch.int32) != gpu[i].cpu().view(torch.int32)
            bad[name] = differ.nonzero().flatten().tolist()
        print(h, {k: len(v) for k, v in bad.items()})
        const = lambda x: torch.tensor(x, dtype=torch.float64).float().double()  # noqa: E731
        g = orig[1].double()
        if h["scale"] is not None:
            g = _f32(g / const(h["scale"]))
        v, b2 = orig[3].double(), const(h["beta2"]).expand(numel)
        part = _f32(const(1 - h["beta2"]) * g)
        cands = {
            "vector fma(c g, g, v b2)": _fma32(part, g, _f32(v * b2)),
            "scalar fma(v, b2, c g g)": _fma32(v, b2, _f32(part * g)),
            "plain": _f32(_f32(v * b2) + _f32(part * g)),
        }
        for idx in sorted(set(sum(bad.values(), [])))[:12]:
            row = {k: float(c[idx]) for k, c in cands.items()}
            print(
                f"  [{idx}] tail={idx >= numel - numel % exact_adamw.DOCUMENTED_ROUNDING[2]}"
                f" p={orig[0][idx].item():.9g} g={orig[1][idx].item():.9g}"
                f" m={orig[2][idx].item():.9g} v={orig[3][idx].item():.9g}"
                f" | cpu v={tensors[3][idx].item():.9g} gpu v={gpu[3][idx].item():.9g}"
                f" cpu m={tensors[2][idx].item():.9g} gpu m={gpu[2][idx].item():.9g}"
                f" cpu p={tensors[0][idx].item():.9g} gpu p={gpu[0][idx].item():.9g} | {row}"
            )


if __name__ == "__main__":
    main()
