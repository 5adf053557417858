"""Streamed vs stock: per-architecture gradients of one backward, and full Trainer runs."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from hf_megatrain import prepare_streamed_model
from hf_megatrain.hf.model import streamed_gradients, streamed_state

from .helpers import (
    ARCHS,
    AUX_FREE_MOE_ARCHS,
    MOE_ARCHS,
    alias_config,
    assert_close_weights,
    assert_logs_match,
    class_aliases,
    llama_alias,
    make_data,
    mega_params,
    run_trainer,
    stock_aux_loss_trains,
    stock_params,
    tiny_config,
    tiny_model,
    train_both,
)


def _batch(n: int = 4):
    rows = make_data(n)
    ids = torch.stack([r["input_ids"] for r in rows])
    return ids, ids.clone()


def _streamed_grads(model) -> dict[str, torch.Tensor]:
    """Every gradient of a streamed model; every layer must have got one."""
    state = streamed_state(model)
    for i in range(len(state.store.layers)):
        assert state.engine.layer_has_grad(i), f"layer {i} got no gradient"
    return streamed_gradients(model)


def _stock_and_streamed_grads(arch: str, **config_overrides):
    cfg = tiny_config(arch)
    for k, v in config_overrides.items():
        setattr(cfg, k, v)
    stock = tiny_model(cfg)
    streamed = prepare_streamed_model(copy.deepcopy(stock), "cpu", torch.float32)
    ids, labels = _batch()
    out_s = stock(input_ids=ids, labels=labels, use_cache=False)
    out_s.loss.backward()
    out_m = streamed(input_ids=ids, labels=labels, use_cache=False)
    out_m.loss.backward()
    stock_grads = {n: p.grad for n, p in stock.named_parameters() if p.grad is not None}
    return out_s, out_m, stock_grads, _streamed_grads(streamed)


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_backward_matches_stock(arch):
    out_s, out_m, gs, gm = _stock_and_streamed_grads(arch)
    # Same fp32 kernels on the same inputs in the same order: the forward is bit-identical.
    torch.testing.assert_close(out_m.logits, out_s.logits, rtol=0, atol=0)
    torch.testing.assert_close(out_m.loss, out_s.loss, rtol=0, atol=0)
    assert set(gm) == set(gs)
    for name in gs:
        # Recompute in backward runs the identical ops; only autograd.grad's accumulation order
        # for inputs used twice can differ, i.e. a few fp32 ulps.
        torch.testing.assert_close(gm[name], gs[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_router_aux_loss_reaches_router_gradients(arch):
    """The aux loss is computed from router logits made inside streamed layers: its gradient must
    reach the router weights, exactly as in the stock model."""
    if not stock_aux_loss_trains(arch):
        pytest.skip(f"transformers {transformers.__version__}'s own {arch} fails with its aux loss")
    out_s, out_m, gs, gm = _stock_and_streamed_grads(arch)
    # Without router logits there is no aux term, in every family (a zero router_aux_loss_coef
    # is not: DBRX, refused for now, reads its coefficient from ffn_config).
    _, _, gs0, gm0 = _stock_and_streamed_grads(arch, output_router_logits=False)
    assert out_m.aux_loss is not None and out_m.aux_loss.requires_grad
    torch.testing.assert_close(out_m.aux_loss, out_s.aux_loss, rtol=0, atol=0)
    routers = [
        n for n in gs if n.endswith(("mlp.gate.weight", "router.weight", "router.layer.weight"))
    ]
    assert routers, "no router weights found"
    for name in routers:
        # The aux term must change the router gradient by far more (100x) than the tolerance
        # below, otherwise this test could not tell a dropped aux gradient from a kept one.
        effect = (gs[name] - gs0[name]).abs().max().item()
        tolerance = 1e-7 + 1e-5 * gs[name].abs().max().item()
        assert effect > 100 * tolerance, f"{name}: aux loss barely changes the gradient ({effect})"
        # Streamed equals stock with and without the aux term (same tolerance as above).
        torch.testing.assert_close(gm[name], gs[name], rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(gm0[name], gs0[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_trainer_matches_stock(arch, tmp_path):
    (stock, st), (mega, mt) = train_both(tiny_model(tiny_config(arch)), tmp_path, steps=5)
    assert len(stock) == len(mega) == 5
    assert_logs_match(stock, mega)
    # The runs must have moved the weights, and to the same place.
    final = mega_params(mt)
    start = tiny_model(tiny_config(arch)).state_dict()
    moved = max((final[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3
    for name, p in st.model.state_dict().items():
        # 5 AdamW steps at lr 1e-2 amplify per-step ulp differences in the gradients by at most
        # lr * few steps; 1e-5 absolute is ~100x above what we observe and 100x below an update.
        # AdamW divides each element's gradient by that element's own RMS plus eps (1e-8): an
        # element whose gradient is near eps turns ulp differences into update differences of a
        # few % of lr. A key bias has a gradient that is zero but for rounding (softmax ignores
        # a constant added to a query's logits): GLM-4's k_proj bias 4.9e-5 measured, the fused
        # QKV biases of GPT-NeoX 1.6e-5 and GPTBigCode 1.2e-5; an EXAONE-4 embedding element got
        # 6.8e-8 (stock) vs 7.5e-8 (streamed) in one step, the rounding noise of a row summing
        # to 1e-2 (1.3e-4). 5e-4 for those, 20x below an update of lr 1e-2.
        # The same for OPT's and GLM's k_proj biases (1.2e-5, 1.8e-5), Persimmon's key LayerNorm
        # bias (1.2e-4: a constant added to every key, as a key bias) and a CodeGen embedding
        # element (2.6e-5), and Gemma 3n's first per-layer input projection (1.2e-5; stock
        # against itself as 1 x 2 accumulation 4.0e-6).
        noisy = ("glm4", "exaone4", "gpt_neox", "gpt_bigcode", "opt", "glm", "persimmon", "codegen",
                 "gemma3n_text")  # fmt: skip
        atol = 5e-4 if arch in noisy else 1e-5
        torch.testing.assert_close(final[name], p, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize(
    "alias,family",
    class_aliases() or [pytest.param("", "", marks=pytest.mark.skip("no such model types"))],
)
def test_types_built_with_a_supported_class_match_stock(alias, family, tmp_path):
    """A model_type transformers builds with a supported family's class, with its own config
    class (the family's tiny shape), trains as that family: streamed equal to stock."""
    config = alias_config(alias, tiny_config(family))
    assert config.model_type == alias
    (stock, st), (mega, mt) = train_both(tiny_model(config), tmp_path, steps=3)
    assert_logs_match(stock, mega)
    final = mega_params(mt)
    for name, p in st.model.state_dict().items():
        # As test_trainer_matches_stock's tolerance (3 steps at lr 1e-2).
        torch.testing.assert_close(final[name], p, rtol=0, atol=1e-5, msg=name)


def test_a_type_taken_as_a_family_must_be_its_transformers_class():
    """A model_type taken as a supported family's (``model_family``) streams only as the class
    transformers builds for it: the same type on a class of other code (a checkpoint's custom
    code, say) is refused, as any unsupported model is."""
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    from hf_megatrain import UnsupportedModelError  # noqa: PLC0415
    from hf_megatrain.hf.model import check_supported  # noqa: PLC0415

    alias = llama_alias()

    class CustomCausalLM(LlamaForCausalLM):  # (defined here: not transformers' module)
        pass

    config = alias_config(alias, tiny_config("llama"))
    assert check_supported(LlamaForCausalLM(config)) == "llama"
    with pytest.raises(UnsupportedModelError, match=f"model_type '{alias}' is not supported"):
        check_supported(CustomCausalLM(config))


@pytest.mark.parametrize(
    "arch,overrides",
    [("llama", {"attention_dropout": 0.2}), ("mixtral", {"router_jitter_noise": 0.2})],
)
def test_random_layers_replay_rng(arch, overrides, tmp_path):
    """Dropout and router jitter draw random numbers inside layers; the recompute in backward
    must replay the forward's draws. The model comes from from_pretrained, i.e. in eval mode when
    it is streamed (the Trainer switches to train mode later)."""
    cfg = tiny_config(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    tiny_model(cfg).save_pretrained(str(tmp_path / "init"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "init"), dtype=torch.float32)
    assert not model.training
    (stock, _), (mega, _) = train_both(model, tmp_path, steps=3)
    # Identical random draws make this the same computation as the deterministic case.
    assert_logs_match(stock, mega)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_bf16_autocast_close_to_stock(arch, tmp_path):
    """bf16 on CPU: streamed bf16 weights vs the stock Trainer's autocast over fp32 weights."""
    (stock, _), (mega, mt) = train_both(tiny_model(tiny_config(arch)), tmp_path, steps=4, bf16=True)
    assert len(stock) == len(mega) == 4
    for a, b in zip(stock, mega):
        # Not bit-equal by design: streamed layers get their weights rounded to bf16 once
        # (norm weights included, which autocast would keep fp32) while autocast rounds per op.
        # Each bf16 rounding is <= 2^-9 = 2e-3 relative; observed loss/grad-norm gaps are
        # <= 3e-4, so 2e-3 / 5e-3 leaves margin yet catches e.g. a stale or fp32-less update.
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-3)
        assert b["learning_rate"] == a["learning_rate"]  # same scheduler, same step count
    for store in mt.megatrain.store.layers:
        # fp32 masters, and the streamed bf16 copy re-derived from them after the last step.
        assert store.master.dtype == torch.float32 and store.stream.dtype == torch.bfloat16
        assert torch.equal(store.stream, store.master.to(torch.bfloat16))


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_every_family_close_to_stock(arch, tmp_path):
    """bf16 on CPU for every family: what bf16 alone changes (weights bound as bf16, norm
    parameters bound in fp32; a LayerNorm once refused its bf16 weight here, unseen in fp32)."""
    (stock, _), (mega, _) = train_both(
        tiny_model(tiny_config(arch)), tmp_path, steps=4, bf16=True, learning_rate=1e-3
    )
    assert len(stock) == len(mega) == 4
    for a, b in zip(stock, mega):
        # lr 1e-3, not the 1e-2 above: at 1e-2 some tiny families are chaotic (OLMo 2's stock
        # bf16 grad norm drifts 9% from its own fp32 run by step 4). Observed here: loss within
        # 8e-5, grad norm within 5.1e-3 (GLM-4); 1e-3 / 2e-2 leave margin, and a dropped term
        # (aux loss, a multiplier, soft-capping) moves them far more.
        # MoE families: stock's autocast runs transformers' grouped experts in fp32 where the
        # streamed layers run them in bf16 (docs/design.md): A.X K1's loss 1.1e-3 apart by step
        # 3, bit-equal with its MoE layers made dense; 2e-3 for them.
        moe = arch in (*MOE_ARCHS, *AUX_FREE_MOE_ARCHS)
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3 if moe else 1e-3)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-2)


def test_frozen_embeddings_and_first_layer(tmp_path):
    """With the embedding and layer 0 frozen, no input of layer 1 requires grad; layer 1 must
    still get its weight gradients (and the frozen parts must not move)."""
    model = tiny_model(tiny_config("llama"))
    frozen = ("model.embed_tokens.", "model.layers.0.")
    for name, p in model.named_parameters():
        if name.startswith(frozen):
            p.requires_grad_(False)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    (stock, st), (mega, mt) = train_both(model, tmp_path, steps=3)
    assert_logs_match(stock, mega)
    final = mega_params(mt)
    for name in start:
        if name.startswith(frozen):
            assert torch.equal(final[name], start[name]), name
        elif name.startswith("model.layers.1."):
            assert not torch.equal(final[name], start[name]), f"{name} was not trained"


def test_label_smoothing_matches_stock(tmp_path):
    """label_smoothing_factor: the Trainer shifts the labels only for a model it names as a causal
    LM, and it named the streamed wrapper (unshifted labels: step 1 loss 5.18 vs stock's 4.84).
    Training and evaluation losses equal stock's."""
    model = tiny_model(tiny_config("llama"))
    kw = dict(label_smoothing_factor=0.1, gradient_accumulation_steps=2)
    (stock, st), (mega, mt) = train_both(model, tmp_path, steps=3, **kw)
    assert_logs_match(stock, mega)
    data = make_data(6, seed=3)
    assert mt.evaluate(data)["eval_loss"] == pytest.approx(st.evaluate(data)["eval_loss"], 1e-5)


def test_a_second_trainer_starts_a_new_adamw(tmp_path):
    """A second trainer on a model the first one trained (the stock way to go on with new
    arguments) starts from zero AdamW moments and step counts, as the stock Trainer's new torch
    AdamW does: the host store's moments from the first run are not carried over."""
    model = tiny_model(tiny_config("llama"))
    weights = {}
    for name, mega in (("stock", False), ("mega", True)):
        _, first = run_trainer(copy.deepcopy(model), tmp_path, f"{name}1", mega, max_steps=2)
        _, second = run_trainer(first.model, tmp_path, f"{name}2", mega, max_steps=2)
        weights[name] = mega_params(second) if mega else stock_params(second.model)
    # Carried-over moments move the layers' weights by ~1e-2 at lr 1e-2; the same arithmetic
    # leaves ~1e-7 (assert_close_weights).
    assert_close_weights(weights["stock"], weights["mega"])


@pytest.mark.parametrize(
    "variant",
    [
        {"do_layer_norm_before": False},
        {"word_embed_proj_dim": 16},
        {"do_layer_norm_before": False, "word_embed_proj_dim": 16},
    ],
    ids=["post-ln", "projected-embeddings", "opt-350m-shape"],
)
def test_opt_variants_match_stock(variant, tmp_path):
    """OPT's other layouts: post-LN layers (OPT-350m's, no final norm) and embeddings narrower
    than the layers with project_in / project_out around them (OPT-350m: 512 into 1,024). Both
    train as stock does."""
    config = tiny_config("opt")
    for key, value in variant.items():  # (over the tiny config's own word_embed_proj_dim)
        setattr(config, key, value)
    model = tiny_model(config)
    if "word_embed_proj_dim" in variant:
        assert model.model.decoder.project_in is not None
    (stock, st), (mega, mt) = train_both(model, tmp_path, steps=5)
    assert_logs_match(stock, mega)
    final = mega_params(mt)
    for name, p in st.model.state_dict().items():
        # As test_trainer_matches_stock's OPT (its k_proj bias's gradient is rounding only).
        torch.testing.assert_close(final[name], p, rtol=0, atol=5e-4, msg=name)


#: Aux-free MoE families whose tiny configs turn ``output_router_logits`` on (the family's own
#: forward then trains): test_trainer_matches_stock does not reach their fused loss.
_ROUTER_LOGITS_ON = [
    a for a in AUX_FREE_MOE_ARCHS if getattr(tiny_config(a), "output_router_logits", False)
]


@pytest.mark.parametrize("arch", _ROUTER_LOGITS_ON)
def test_aux_free_moe_trains_with_the_fused_loss_as_stock(arch, tmp_path):
    """These families as their checkpoints come (``output_router_logits`` off): the trainer
    takes the fused chunked loss, and training equals stock's."""
    from hf_megatrain.hf.loss import supports_fused_loss  # noqa: PLC0415

    config = tiny_config(arch)
    config.output_router_logits = False
    model = tiny_model(config)
    assert supports_fused_loss(model)
    (stock, st), (mega, mt) = train_both(model, tmp_path, steps=5)
    assert_logs_match(stock, mega)
    final = mega_params(mt)
    for name, p in st.model.state_dict().items():
        # As test_trainer_matches_stock (fp32, 5 steps at lr 1e-2: ulp differences only).
        torch.testing.assert_close(final[name], p, rtol=0, atol=1e-5, msg=name)


@pytest.mark.skipif("phimoe" not in ARCHS, reason="transformers without PhiMoE")
def test_phimoe_router_jitter_trains_as_stock(tmp_path):
    """PhiMoE's sparse mixer draws jitter noise in training (its tiny config turns it off for the
    tests that run two forwards): the streamed layers' recompute replays the RNG, so training
    with the jitter of its checkpoints (0.01) equals stock's."""
    config = tiny_config("phimoe")
    config.router_jitter_noise = config.input_jitter_noise = 0.01
    (stock, st), (mega, mt) = train_both(tiny_model(config), tmp_path, steps=5)
    assert_logs_match(stock, mega)
    final = mega_params(mt)
    for name, p in st.model.state_dict().items():
        # As test_trainer_matches_stock (fp32, 5 steps at lr 1e-2: ulp differences only).
        torch.testing.assert_close(final[name], p, rtol=0, atol=1e-5, msg=name)
