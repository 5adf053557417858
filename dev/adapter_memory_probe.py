"""One PEFT-adapted linear on the CPU tracker against hf/adapter_memory.py's terms for it.

A frozen linear (its weight bound in bf16, as a streamed layer's) adapted by each method of
tests/test_plan_accuracy.py's ``PEFT_METHODS`` (and plain LoRA), run under bf16 autocast on an fp32
input that needs a gradient (a layer's normed input), forward then backward, with the live-tensor
tracker (tests/helpers.py ``LiveStorages``) and CUDA's dropout (a 1-byte mask). Per token (the growth between two token counts at
256 x 768 and 768 x 256) and per weight element (4 tokens at 1024 x 3072 and 3072 x 1024): what
the forward leaves alive for backward (besides its output), the forward's temporary peak above that
and the backward's above its start (its output's gradient, the input's gradient included); beside them the plan shape's terms for the same linear (saved; the
largest temporary), in bf16 bytes. The plan's are meant to hold what is measured; a method whose
output is handed back in fp32 (``UPCASTING_METHODS``) also makes the MLP after it run in fp32,
which a lone linear does not show (tests/test_plan_accuracy.py measures whole steps).

    python3 dev/adapter_memory_probe.py --methods dora,loha,hra
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_megatrain.hf.adapter_memory import adapter_shape_fields  # noqa: E402
from tests.helpers import LiveStorages  # noqa: E402
from tests.test_plan_accuracy import PEFT_METHODS  # noqa: E402


class _Layer(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(n_in, n_out, bias=False)

    def forward(self, x):
        return self.proj(x)


def _adapted(peft, method: str, n_in: int, n_out: int):
    config = (
        peft.LoraConfig(r=64, lora_alpha=128, target_modules="all-linear")
        if method == "lora"
        else PEFT_METHODS[method](peft)
    )
    config.target_modules = ["proj"]
    if getattr(config, "feedforward_modules", None) is not None:
        config.feedforward_modules = []
    model = peft.get_peft_model(_Layer(n_in, n_out), config).train()
    for module in model.modules():  # the frozen base weight bound in bf16, as streamed
        if isinstance(module, nn.Linear) and not module.weight.requires_grad:
            module.weight = nn.Parameter(module.weight.detach().bfloat16(), requires_grad=False)
    return model


def measure(peft, method: str, n_in: int, n_out: int, tokens: int) -> dict[str, int]:
    """Bytes the adapted linear holds: after its forward (less its output), the forward's peak
    above that, the backward's peak."""
    torch.manual_seed(0)
    model = _adapted(peft, method, n_in, n_out)
    x = torch.randn(1, tokens, n_in, requires_grad=True)
    live = LiveStorages()
    with live:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        forward_peak, held = live.peak, live.cur - y.untyped_storage().nbytes()
        start = live.peak = live.cur
        y.backward(torch.ones_like(y))
    return {"saved": held, "forward": forward_peak - held, "backward": live.peak - start}


def planned(peft, method: str, n_in: int, n_out: int) -> dict[str, tuple[int, int]]:
    """The plan's terms for the linear in bf16 bytes: per token and per forward, (saved, the
    largest temporary)."""
    model = _adapted(peft, method, n_in, n_out)
    f = adapter_shape_fields(nn.ModuleList([model.base_model.model]), 0, 0, 1)
    if not f.get("adapter_methods"):
        return {"token": (0, 0), "weight": (0, 0)}
    token = 2 * f["adapter_token_elements"] + 4 * f["adapter_token_fp32"]
    token += f["adapter_token_masks"]
    peak = f["adapter_token_peak"]
    weight = 2 * f["adapter_weight_elements"] + 4 * f["adapter_weight_fp32"]
    w_peak = f["adapter_weight_peak"]
    return {
        "token": (token, 2 * peak[0] + 4 * peak[1]),
        "weight": (weight, 2 * w_peak[0] + 4 * w_peak[1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(["lora", *PEFT_METHODS]))
    a = parser.parse_args()
    import peft  # noqa: PLC0415

    # CUDA's dropout (a 1-byte mask saved; the CPU's saves an fp32 noise tensor), as the plan.
    def dropout(x, p=0.5, training=True, inplace=False):
        return torch.native_dropout(x, p, training)[0] if training and p > 0 else x

    torch.nn.functional.dropout = dropout

    for method in a.methods.split(","):
        cells = []
        for n_in, n_out in ((256, 768), (768, 256)):
            small, large = (measure(peft, method, n_in, n_out, t) for t in (1024, 2048))
            grown = {k: (large[k] - small[k]) / 1024 for k in small}
            plan = planned(peft, method, n_in, n_out)["token"]
            cells.append(
                f"{n_in}x{n_out} /token: saved {grown['saved']:.0f} (plan {plan[0]}), "
                f"fwd +{grown['forward']:.0f} bwd {grown['backward']:.0f} (plan +{plan[1]})"
            )
        for n_in, n_out in ((1024, 3072), (3072, 1024)):
            w = n_in * n_out
            got = measure(peft, method, n_in, n_out, 4)
            plan = planned(peft, method, n_in, n_out)["weight"]
            cells.append(
                f"{n_in}x{n_out} /weight: saved {got['saved'] / w:.2f} (plan {plan[0] / w:.2f}), "
                f"fwd +{got['forward'] / w:.2f} bwd {got['backward'] / w:.2f} "
                f"(plan +{plan[1] / w:.2f})"
            )
        print(f"{method}:\n  " + "\n  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
