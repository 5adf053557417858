"""``load_streamed_model`` never materializes the model: peak host RSS while loading stays close
to what the host store itself holds, never store + a full model copy.

Measured in fresh subprocesses so that nothing this test session allocated counts:
a first one writes a ~100M-parameter Llama checkpoint (fp32, 100 MB shards), a second one
records its RSS after the imports, loads the checkpoint, and reports its peak RSS (VmHWM) next to
the store's size. After the measurement the same process checks that the loaded weights and
logits are those of ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MiB = 2**20
REPO = Path(__file__).resolve().parents[1]

# ~97M parameters: 12 decoder layers of 7.1M (85M, streamed through the host store) and an untied
# 8000 x 768 embedding and LM head (12.3M, resident). The vocabulary is kept at 8000 (not 32000)
# so the largest single tensor (24.6 MB), part of the loader's transient read buffer, is small
# next to the decoder layers' fp32 size (340 MB), which is what a loader that materializes the
# model before copying it into the store would hold on top: the bound below separates the two.
CONFIG = dict(
    vocab_size=8000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

_WRITE = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**{config}))
model.save_pretrained(sys.argv[1], max_shard_size="100MB")
"""

_LOAD = """
import json, sys

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)

import torch
import transformers
import transformers.models.llama.modeling_llama  # noqa: F401 - lazily imported otherwise
import hf_megatrain
from hf_megatrain import load_streamed_model
from hf_megatrain.hf.model import streamed_state

path = sys.argv[1]
# Reset the peak (VmHWM) to the current RSS: import-time peaks must not hide the load's.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
model = load_streamed_model(path, device="cpu", bf16=True)
peak = status("VmHWM")
after = status("VmRSS")

state = streamed_state(model)
written = 0  # host-store bytes the load writes: fp32 master + separate bf16 stream copy
layer_numel = 0
for store in state.store.layers:
    layer_numel += store.numel
    written += store.master.numel() * 4
    if store.stream is not store.master:
        written += store.stream.numel() * store.stream.element_size()
resident = sum(p.numel() * 4 for _, p, _ in state.resident)
out = dict(
    base=base, peak=peak, after=after, store=state.store.nbytes, written=written,
    resident=resident, layer_numel=layer_numel,
    # Streamed layers keep meta placeholders of their parameters: this counts every parameter.
    model_numel=sum(p.numel() for p in model.parameters()),
)

# ---- after the measurement: the loaded model is the checkpoint's model ----
from hf_megatrain.hf.checkpoint import host_state_dict

ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
ref_sd = ref.state_dict()
got = host_state_dict(model)
out["same_keys"] = sorted(got) == sorted(ref_sd)
out["weights_max_diff"] = max((got[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
out["stream_is_bf16_master"] = all(
    torch.equal(s.stream, s.master.to(torch.bfloat16)) for s in state.store.layers
)
del model, got
ids = torch.randint(0, ref.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
fp32 = load_streamed_model(path, device="cpu", bf16=False).eval()
with torch.no_grad():
    want = ref(input_ids=ids, use_cache=False).logits
    have = fp32(input_ids=ids, use_cache=False).logits
out["logits_max_diff"] = (have - want).abs().max().item()
out["logits_scale"] = want.abs().max().item()
print("RESULT " + json.dumps(out))
"""


def _python(script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def _largest_tensor_bytes(ckpt: Path) -> int:
    from safetensors import safe_open  # noqa: PLC0415

    largest = 0
    for file in ckpt.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                numel = 1
                for d in sl.get_shape():
                    numel *= d
                assert sl.get_dtype() == "F32", key
                largest = max(largest, numel * 4)
    return largest


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_load_streamed_model_peak_rss(tmp_path):
    ckpt = tmp_path / "ckpt"
    _python(_WRITE.format(config=CONFIG), str(ckpt))
    # The loader has to follow the index across several shard files.
    assert len(list(ckpt.glob("model-*.safetensors"))) > 1
    line = next(x for x in _python(_LOAD, str(ckpt)).splitlines() if x.startswith("RESULT "))
    r = json.loads(line.removeprefix("RESULT "))
    largest = _largest_tensor_bytes(ckpt)

    delta = r["peak"] - r["base"]
    model_fp32 = r["model_numel"] * 4  # a full fp32 copy of the model
    layers_fp32 = r["layer_numel"] * 4  # the decoder layers' part of it
    # Transient cost of reading: safetensors maps a whole shard file, and the pages read so far
    # stay mapped (file-backed RSS) until the shard is closed; get_tensor copies each tensor out
    # of the mapping (one heap copy alive at a time). Measured: the excess over the written store
    # and residents is the shard size (33 MiB with 30 MB shards, 98 MiB with 100 MB, 190 MiB with
    # 200 MB). 64 MiB more for allocator arenas and the meta skeleton's Python objects.
    largest_shard = max(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    slack = largest_shard + largest + 64 * MiB
    summary = (
        f"peak-base {delta / MiB:.0f} MiB; store {r['store'] / MiB:.0f} MiB "
        f"(written by the load {r['written'] / MiB:.0f}), resident {r['resident'] / MiB:.0f} MiB, "
        f"slack {slack / MiB:.0f} MiB, full fp32 model {model_fp32 / MiB:.0f} MiB"
    )
    print(summary)

    # The README's claim: peak RSS stays within the store (plus the resident embedding and head)
    # and one shard's read buffer.
    assert delta <= r["store"] + r["resident"] + slack, summary
    # The store reserves fp32 grad and both AdamW moments too (store = 18 bytes per layer
    # parameter), but those are untouched anonymous pages until training starts: the bound above
    # alone is loose enough to admit a model copy. What the load must really keep resident is
    # what it writes, the fp32 masters and bf16 stream copies (6 bytes per layer parameter), and
    # the resident parameters. Nothing else but the read buffer may show.
    assert delta <= r["written"] + r["resident"] + slack, summary
    # Contrast: a loader that holds a full fp32 copy of the model while it fills the store (a
    # materialized model kept alive, or the whole checkpoint read into memory first) needs at
    # least the written store plus that copy. The slack is smaller than the layers' fp32 copy, so
    # such a loader fails the bound above (tried by hand with both variants: ~954 MiB peak
    # against a ~716 MiB bound). A loader that materializes the model but frees each layer right
    # after copying it would pass: its fp32 layers (4 bytes per parameter) are only ever
    # replaced by the larger master + stream copy (6 bytes), so its peak is the same store.
    assert slack < layers_fp32
    assert delta < r["written"] + model_fp32, summary
    # (The README bound is then at least layers_fp32 - slack below store + a full fp32 copy.)

    # The loaded weights are the checkpoint's, bit for bit (fp32 masters are copied as-is), and
    # the bf16 stream copies are the masters rounded once.
    assert r["same_keys"]
    assert r["weights_max_diff"] == 0
    assert r["stream_is_bf16_master"]
    # Same fp32 weights and the model's own forward: identical logits (as in test_checkpoint).
    assert r["logits_scale"] > 0.1
    assert r["logits_max_diff"] == 0
