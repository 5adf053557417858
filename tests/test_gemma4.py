"""Gemma 4 (text) beyond its family suite's tiny dense config: its MoE variant (26B-A4B's routed
experts beside the dense MLP in every layer) against stock, the widths the plan and the FLOP
count read from its per-layer config, and the keys and values its layers store for layers
that would reuse them (refused), which the streamed model does not hold."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CONFIG_MAPPING

from hf_megatrain import prepare_streamed_model
from hf_megatrain.hf.flops import attention_flops_per_token
from hf_megatrain.hf.model import model_shape, streamed_gradients

from .helpers import (
    assert_logs_match,
    gemma4_config,
    make_data,
    run_trainer,
    tiny_config,
    tiny_model,
    train_both,
)

pytestmark = pytest.mark.skipif(
    "gemma4_text" not in CONFIG_MAPPING, reason="transformers without Gemma 4"
)

#: The kind of layer 26B-A4B has (there top-8 of 128): the dense MLP and top-2 of 4 routed
#: experts, the experts' output RMS-normed before the two are added.
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)


def _ids(n: int) -> torch.Tensor:
    return torch.stack([r["input_ids"] for r in make_data(n)])


def assert_streamed_matches_stock(model, device: str = "cpu", loss_rtol: float = 1e-6, **options):
    """fp32 forward and every gradient of ``model`` streamed (``options``) against stock's on
    ``device``: the same kernels, so the recompute's rounding only (the family suite's
    1e-5/1e-7 on the gradients). Returns the streamed gradients."""
    stock = copy.deepcopy(model).to(device)
    streamed = prepare_streamed_model(copy.deepcopy(model), device, torch.float32, **options)
    ids = _ids(4).to(device)
    want = stock(input_ids=ids, labels=ids, use_cache=False)
    got = streamed(input_ids=ids, labels=ids, use_cache=False)
    want.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=loss_rtol, atol=0)
    grads = streamed_gradients(streamed)
    for name, p in stock.named_parameters():
        torch.testing.assert_close(grads[name].to(device), p.grad, rtol=1e-5, atol=1e-7, msg=name)
    return grads


def test_moe_forward_backward_matches_stock():
    assert_streamed_matches_stock(tiny_model(gemma4_config(**MOE)), loss_rtol=0)


def test_moe_trains_like_stock(tmp_path):
    """5 steps, to the family suite's 1e-5. At lr 1e-3: at the suite's 1e-2 this tiny MoE is
    chaotic, stock against itself as 2 x 1 accumulation (fp32 sums in another order) drifting
    2.3e-5 (one thread) to 1.4e-4 (two) on the grad norm by step 5. At 1e-3 that twin drifts
    9.1e-6 at most and streamed 8.0e-7."""
    model = tiny_model(gemma4_config(**MOE))
    (stock, _), (mega, _) = train_both(model, tmp_path, steps=5, learning_rate=1e-3)
    assert_logs_match(stock, mega)


def test_plan_reads_the_widest_layers_attention_and_the_mlp_beside_the_experts():
    """The full-attention layers' heads are twice as wide (16), the sliding ones have more kv
    heads of their width: the plan takes each at its widest layer's (head width 16, kv width
    2 x 16 = 32 against the sliding 2 x 8), and the dense MLP that runs every token beside the
    routed experts as a shared expert's width."""
    shape = model_shape(tiny_model(gemma4_config(**MOE)))
    assert (shape.head_dim, shape.kv_size, shape.num_heads) == (16, 32, 4)
    assert shape.experts_per_token == 2 and shape.shared_expert_size == 64
    dense = model_shape(tiny_model(gemma4_config()))
    assert (dense.head_dim, dense.kv_size, dense.experts_per_token) == (16, 32, 0)


@pytest.mark.parametrize("seq", [4, 64])
def test_attention_flops_take_each_layers_head_width(seq):
    """Sliding layers: window 6, heads of 8; full layers: heads of 16 over the whole row."""
    config = gemma4_config()
    window = 6
    sliding_keys = window - window * window / (2 * seq) if window < seq else seq / 2
    want = 2 * 6 * 4 * (8 + 8) * sliding_keys + 2 * 6 * 4 * (16 + 16) * seq / 2
    assert attention_flops_per_token(config, seq) == pytest.approx(want, rel=1e-12)


def test_streamed_model_holds_no_stored_keys_and_values():
    """Stock's last layer of each attention type stores its keys and values for layers that
    would reuse them (none here) in a dict that lives through the forward; the streamed
    model's layers keep their call's arguments for the recompute, so they would live through
    the backward too. It stores none, and computes the same."""
    model = tiny_model(gemma4_config())
    ids = _ids(2)
    want = model.model(input_ids=ids, return_shared_kv_states=True, use_cache=False)
    assert set(want.shared_kv_states) == {"sliding_attention", "full_attention"}
    streamed = prepare_streamed_model(copy.deepcopy(model), "cpu", torch.float32)
    got = streamed.model(input_ids=ids, return_shared_kv_states=True, use_cache=False)
    assert len(got.shared_kv_states) == 0
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=0, atol=0)


#: E2B's and E4B's kind of model: per-layer inputs (a table gives every layer its own slice of
#: each token's embedding, gated into the layer's output) and KV sharing (the last layers read
#: the keys and values the last earlier layer of their attention type stores, and run a
#: double-wide MLP). Six layers: 2 and 3 store, 4 and 5 reuse.
E2B = dict(
    num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
    num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
    use_double_wide_mlp=True,
)  # fmt: skip

#: Layouts of the streamed step (each changes what a layer saves and how it is re-run):
#: segments (followers re-made by a chain from their leader; the storing layers lead and follow),
#: offloaded boundaries, whole-layer recompute, the HBM tier keeping layers' graphs.
LAYOUTS = {
    "default": {},
    "segments of 2": dict(checkpoint_every=2),
    "segments of 3, offloaded": dict(checkpoint_every=3, offload_activations=True),
    "whole-layer recompute": dict(recompute_early_stop=False),
    "tier keeps graphs": dict(resident_layers="3", keep_activations="3"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shared_kv_and_per_layer_inputs_match_stock(layout):
    """Forward and every gradient against stock (fp32, the same kernels: the recompute's
    rounding only, the family suite's 1e-5/1e-7). Without the storing layers' keys and values
    carried as outputs of their streamed call (core/carried.py), the reusing layers failed
    (the mapping empty) or their gradients never reached the storing layers' projections."""
    model = tiny_model(gemma4_config(**E2B))
    modes = model.config.kv_sharing_modes if hasattr(model.config, "kv_sharing_modes") else None
    if modes is not None:
        assert modes == [None, None, "store", "store", "reuse", "reuse"]
    grads = assert_streamed_matches_stock(model, **LAYOUTS[layout])
    # (the checked names include what the reusing layers' gradients reach)
    assert any(".layers.2.self_attn.k_proj" in n for n in grads)
    assert any("per_layer" in n for n in grads)


def test_shared_kv_and_per_layer_inputs_evaluate_like_stock():
    """Under no_grad (evaluation) a streamed layer gets the model's mapping itself: the
    storing layers fill it as stock's do, and the reusing layers read it."""
    model = tiny_model(gemma4_config(**E2B))
    streamed = prepare_streamed_model(copy.deepcopy(model), "cpu", torch.float32)
    ids = _ids(2)
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids, use_cache=False)
        got = streamed(input_ids=ids, labels=ids, use_cache=False)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_shared_kv_and_per_layer_inputs_train_like_stock(tmp_path, accumulation):
    """5 Trainer steps (and 2 x 2 accumulation) to the family suite's 1e-5. The first backward's
    gradients are stock's bit for bit; the optimizers then round differently (the clip
    coefficient as a grad scale, the host AdamW), and this tiny model amplifies that: at lr 1e-3
    its grad norm drifted 1.4e-4 from stock's by step 5 (mostly AdamW's steps on embedding rows
    whose gradients are rounding noise). At lr 3e-4: 4.6e-6, and stock against itself as
    1 x 2 accumulation (fp32 sums in another order) 5.1e-6."""
    model = tiny_model(gemma4_config(**E2B))
    (stock, _), (mega, _) = train_both(
        model, tmp_path, steps=5, learning_rate=3e-4, gradient_accumulation_steps=accumulation
    )
    assert_logs_match(stock, mega)


#: bf16 against stock's autocast, per variant: the loss's and the grad norm's bounds.
#: MoE: stock's autocast runs the grouped experts in fp32, the streamed layers in bf16
#: (docs/design.md), and Gemma 4 RMS-norms each expert output before adding it: their rounding
#: is relative error of a unit-scale term. Measured: loss within 4.7e-4, the grad norm 6.1e-2
#: apart at step 3 (transformers 5.25, torch 2.13; 3.6e-7 with the experts bound in fp32, as
#: stock runs them; the dense variant 4.1e-7), 1.08e-1 with transformers 5.17 and torch 2.11.
#: The MoE families' 2e-3 on the loss; 2e-1 on the norm (a dropped term moves the loss; the fp32
#: tests hold the gradients exact). E2B's kind: the streamed layers' bf16 weight copies against
#: autocast's casts of the fp32 ones, which round alike (the dense family suite's 2e-3, 5e-2).
BF16_BOUNDS = {"moe": (MOE, 2e-3, 2e-1), "e2b": (E2B, 2e-3, 5e-2)}


@pytest.mark.parametrize("variant", list(BF16_BOUNDS))
def test_bf16_loss_close_to_stock(tmp_path, variant):
    overrides, loss_rel, norm_rel = BF16_BOUNDS[variant]
    (stock, _), (mega, _) = train_both(
        tiny_model(gemma4_config(**overrides)), tmp_path, steps=4, bf16=True, learning_rate=1e-3
    )
    for a, b in zip(stock, mega):
        assert b["loss"] == pytest.approx(a["loss"], rel=loss_rel)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=norm_rel)


def test_plan_counts_per_layer_inputs_shared_kv_and_the_widest_mlp():
    """The per-layer inputs (6 layers x 8, fp32) and the two storing layers' keys and values
    (2 x (2 x 8) sliding + 2 x (2 x 16) full = 96 channels) are planned as tensors carried past
    the layers, saved through the step and with gradients in backward; the MLP at the
    double-wide layers' width (2 x 64)."""
    from hf_megatrain.core.options import EngineOptions, StepShape  # noqa: PLC0415
    from hf_megatrain.core.plan_search import plan_memory  # noqa: PLC0415
    from hf_megatrain.hf.family_memory import (  # noqa: PLC0415
        PER_LAYER_INPUT_GRAD_BYTES,
        PER_LAYER_INPUT_SAVED_BYTES,
        SHARED_KV_GRAD_BYTES,
        SHARED_KV_SAVED_BYTES,
    )

    shape = model_shape(tiny_model(gemma4_config(**E2B)))
    saved = PER_LAYER_INPUT_SAVED_BYTES * 6 * 8 + SHARED_KV_SAVED_BYTES * 96
    grad = PER_LAYER_INPUT_GRAD_BYTES * 6 * 8 + SHARED_KV_GRAD_BYTES * 96
    assert (shape.carried_bytes_per_token, shape.carried_grad_bytes_per_token) == (saved, grad)
    assert shape.intermediate_size == 128
    plain = model_shape(tiny_model(gemma4_config()))
    assert plain.carried_bytes_per_token == plain.carried_grad_bytes_per_token == 0
    options = EngineOptions().resolve(clipping=True, cuda=True)
    plan = plan_memory(shape, StepShape(seq_len=64, micro_batch_tokens=64), options,
                       torch.bfloat16, 1 << 40, 1 << 40, hbm_layers=0)  # fmt: skip
    carried = {ln.name: ln.nbytes for ln in plan.gpu_lines if "per-layer inputs" in ln.name}
    assert sorted(carried.values()) == sorted([64 * saved, 64 * grad]), carried


def test_flops_leave_out_the_per_layer_input_table():
    """The per-layer input table is a lookup (E2B's, 262,144 x 35 x 256, is larger than its
    layers): 6 FLOPs per parameter and token count everything else, the input embedding (the
    tied head's matmul) included, and nothing of the table."""
    from hf_megatrain.hf.flops import active_params  # noqa: PLC0415

    model = tiny_model(gemma4_config(**E2B))
    table = model.model.embed_tokens_per_layer.weight
    assert table.numel() == 128 * 6 * 8
    assert active_params(model) == sum(p.numel() for p in model.parameters()) - table.numel()


unified = pytest.mark.skipif(
    "gemma4_unified_text" not in CONFIG_MAPPING, reason="transformers without Gemma 4 unified"
)


@unified
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_unified_matches_stock(layout):
    """Gemma 4 unified's text model (its family tiny config: sliding, full, full; the last
    reuses the second's keys and values): forward and every gradient as stock's, fp32."""
    options = {**LAYOUTS[layout]}
    if "resident_layers" in options:  # (three layers here)
        options.update(resident_layers="2", keep_activations="2")
    assert_streamed_matches_stock(tiny_model(tiny_config("gemma4_unified_text")), **options)


def _drift(a: list[dict], b: list[dict], key: str) -> float:
    assert len(a) == len(b) == 5
    return max(abs(y[key] / x[key] - 1) for x, y in zip(a, b))


@unified
@pytest.mark.parametrize("accumulation", [1, 2])
def test_unified_trains_inside_stocks_own_spread(tmp_path, accumulation):
    """Stock cannot train this tiny model reproducibly to the suites' 1e-5 (helpers'
    ``TWIN_NOISE_ARCHS``): some of its q-projection elements get gradients of rounding size,
    and AdamW's first steps move each element by about lr whatever its gradient's size, so
    their rounding decides the sign. The streamed run is held to stock's own spread, measured
    here: stock against itself with the batch as 1 x 2 accumulation (2 x 2 against 1 x 4), 5
    steps at lr 1e-4 (at 1e-2 both spread to the whole grad norm by step 5), within 3x of it
    (plus 1e-6 for a spread of none) on the grad norm and the loss. Measured: streamed 1.2e-5
    on the grad norm, stock against itself 1.2e-5."""
    model = tiny_model(tiny_config("gemma4_unified_text"))
    kw = dict(learning_rate=1e-4, gradient_accumulation_steps=accumulation)
    (stock, _), (mega, _) = train_both(model, tmp_path, **kw)
    twin_kw = dict(kw, per_device_train_batch_size=1, gradient_accumulation_steps=2 * accumulation)
    twin, _ = run_trainer(copy.deepcopy(model), tmp_path, "twin", False, **twin_kw)
    for key in ("grad_norm", "loss"):
        spread, drift = _drift(stock, twin, key), _drift(stock, mega, key)
        print(f"{key}: streamed {drift:.1e}, stock against itself {spread:.1e}")
        assert drift <= 3 * spread + 1e-6, key


@pytest.mark.parametrize("arch", ["gemma4_text", "gemma3n_text"])
def test_checkpoint_with_projections_the_sharing_layers_lack_loads(tmp_path, arch):
    """A checkpoint may hold key projections for the layers that reuse an earlier layer's keys
    and values, which have none (the model class lists them in
    ``_keys_to_ignore_on_load_unexpected`` and ``from_pretrained`` skips them): the streaming
    load skips them too, instead of refusing the checkpoint, and computes as stock."""
    import os  # noqa: PLC0415

    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    from hf_megatrain import load_streamed_model  # noqa: PLC0415

    if arch not in CONFIG_MAPPING:
        pytest.skip(f"transformers without {arch}")
    config = gemma4_config(**E2B) if arch == "gemma4_text" else tiny_config(arch)
    model = tiny_model(config)
    model.save_pretrained(str(tmp_path))
    file = os.path.join(str(tmp_path), "model.safetensors")
    tensors = load_file(file)
    shared = [i for i, x in enumerate(model.model.layers) if x.self_attn.is_kv_shared_layer]
    assert shared
    for i in shared:
        tensors[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.randn(16, config.hidden_size)
    save_file(tensors, file, metadata={"format": "pt"})
    streamed = load_streamed_model(str(tmp_path), device="cpu", bf16=False)
    ids = _ids(2)
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids, use_cache=False).loss
        got = streamed(input_ids=ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def gemma4_tracker_config(
    layers: int, per_layer: int, tokens: int, hidden: int, shared: int, wide: bool
):
    """Gemma 4 text at these widths: 3 sliding layers (one kv head of 64) per full one (one of
    128), MLP 4 x hidden (doubled in the KV-sharing layers with ``wide``)."""
    types = (["sliding_attention"] * 3 + ["full_attention"]) * (layers // 4)
    return gemma4_config(
        hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, global_head_dim=128,
        num_global_key_value_heads=1, sliding_window=512, attention_k_eq_v=False,
        layer_types=types, max_position_embeddings=2 * tokens, num_kv_shared_layers=shared,
        hidden_size_per_layer_input=per_layer, vocab_size_per_layer_input=4096,
        use_double_wide_mlp=wide,
    )  # fmt: skip


def gemma3n_tracker_config(
    layers: int, per_layer: int, tokens: int, hidden: int, shared: int, sparse: int
):
    """Gemma 3n text at these widths: 3 sliding layers per full one (one kv head of 64), MLP 4 x
    hidden, AltUp's 4 streams, LAuReL of rank 64, activation sparsity 0.95 in the first
    ``sparse`` layers."""
    from transformers import CONFIG_MAPPING  # noqa: PLC0415

    types = (["sliding_attention"] * 3 + ["full_attention"]) * (layers // 4)
    sparsity = [0.95 if i < sparse else 0.0 for i in range(layers)]
    return CONFIG_MAPPING["gemma3n_text"](
        vocab_size=4096, vocab_size_per_layer_input=4096, hidden_size=hidden,
        intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, hidden_size_per_layer_input=per_layer,
        num_kv_shared_layers=shared, layer_types=types, sliding_window=512, laurel_rank=64,
        altup_num_inputs=4, max_position_embeddings=2 * tokens,
        activation_sparsity_pattern=sparsity, pad_token_id=0,
    )  # fmt: skip


@pytest.mark.parametrize(
    "family,point",
    [("gemma4_text", (8, 64, 2048, 256, 4, True)), ("gemma3n_text", (8, 64, 2048, 256, 4, 2))],
)
def test_carried_tensors_and_streams_stay_inside_the_plan(family, point):
    """One streamed step on the CPU tracker (dev/carried_plan_fit.py's points; every one of
    them inside): E2B's kind of model was 1.34x its plan before the per-layer inputs, the
    shared keys and values and the widest MLP were planned; Gemma 3n 1.24x with its streams in
    the boundary lines and no AltUp term, more without the streams."""
    from tests.test_plan_accuracy import step_vs_plan  # noqa: PLC0415

    if family not in CONFIG_MAPPING:
        pytest.skip(f"transformers without {family}")
    build = gemma4_tracker_config if family == "gemma4_text" else gemma3n_tracker_config
    r = step_vs_plan(build(*point), point[2], "sdpa")
    assert r["measured"] <= r["planned"] + r["margin"], (r["measured"], r["planned"])


@pytest.mark.parametrize("arch", ["gemma4_text", "gemma3n_text"])
def test_lora_on_shared_kv_and_per_layer_inputs_trains_like_stock(tmp_path, arch):
    """LoRA over a frozen streamed base (E2B's kind of Gemma 4, and Gemma 3n): the adapters on
    the storing layers' key projections get their gradient through the keys the reusing layers
    read (carried as outputs of the storing layers' calls). 5 steps at lr 1e-3 to the family
    suite's 1e-5 (measured: the grad norm 3.7e-6 apart at most, the losses 2e-7)."""
    peft = pytest.importorskip("peft")
    if arch not in CONFIG_MAPPING:
        pytest.skip(f"transformers without {arch}")
    base = tiny_model(gemma4_config(**E2B) if arch == "gemma4_text" else tiny_config(arch))
    targets = ["q_proj", "k_proj", "v_proj", "gate_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # (non-zero B: the adapters matter from step one)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    layers = model.base_model.model.model.layers
    stores = [i for i, x in enumerate(layers) if x.self_attn.store_full_length_kv]
    assert stores and any(x.self_attn.is_kv_shared_layer for x in layers)
    names = [n for n, _ in model.named_parameters()]
    assert all(any(f".layers.{i}.self_attn.k_proj.lora_A" in n for n in names) for i in stores)
    (stock, _), (mega, _) = train_both(model, tmp_path, learning_rate=1e-3)
    assert_logs_match(stock, mega)
