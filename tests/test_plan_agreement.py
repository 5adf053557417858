"""What ``hf-megatrain plan`` says is what training does: the CLI's plan against the builder's
(the road every streamed model takes on a GPU), on meta-device models and pretended memory."""

from __future__ import annotations

import pytest
import torch

from hf_megatrain.cli_common import CLIError
from hf_megatrain.cli_plan import plan_config
from hf_megatrain.core import builder
from hf_megatrain.core.options import EngineOptions, StepShape
from hf_megatrain.core.planner import GIB
from hf_megatrain.hf.model import model_shape_from_config
from tests.test_planner import CONFIGS

BF16 = torch.bfloat16
H200, HOST = 139 * GIB, 128 * GIB


def _builder_plan(monkeypatch, shape, options, step, *, trainable=True, hbm=H200, host=HOST):
    """The builder's plan of a run on a pretended GPU (nothing allocated)."""
    monkeypatch.setattr(builder, "device_free_bytes", lambda device: hbm)
    monkeypatch.setattr(builder, "available_host_bytes", lambda: host)
    layers = [
        builder.LayerLayout(slots=[], numel=n, decay_numel=n, trainable=trainable)
        for n in shape.layer_numels
    ]
    resolved = options.resolve(clipping=True, cuda=True, single_backward=step.grad_accum == 1)
    cuda = torch.device("cuda")
    return builder.resident_layer_count(layers, resolved, cuda, BF16, shape, step, 0, None)


@pytest.fixture(scope="module")
def qwen1_5b():
    return model_shape_from_config(plan_config(str(CONFIGS / "qwen2.5-1.5b")), "qwen2.5-1.5b")


def test_frozen_layers_are_planned_streamed(monkeypatch, qwen1_5b):
    """A LoRA base (every layer frozen) cannot join the HBM tier (it holds optimizer state):
    the plan streams every layer and keeps no activations. It planned all 28 layers in HBM,
    keeping their activations, which the builder then streamed; keep_activations 'auto' asked
    the empty tier for the plan's 28 layers and the run failed before its first step."""
    step = StepShape(seq_len=4096, micro_batch_tokens=4 * 4096)
    n_hbm, plan = _builder_plan(monkeypatch, qwen1_5b, EngineOptions(), step)
    assert n_hbm == plan.n_hbm > 0 and plan.kept_layers > 0  # trainable: the tier as before
    n_hbm, plan = _builder_plan(monkeypatch, qwen1_5b, EngineOptions(), step, trainable=False)
    assert n_hbm == plan.n_hbm == 0 and plan.kept_layers == 0
    assert plan.fits


def test_kept_activations_beyond_the_tier_are_one_line_refusals(monkeypatch, qwen1_5b, capsys):
    """keep_activations pinned above the HBM tier the memory holds: `plan` and training refuse
    it alike, as a library refusal ("hf_megatrain: ..."), which `hf-megatrain train` shows as
    one line; the builder's was a bare ValueError, which the CLI shows with its traceback."""
    from hf_megatrain.cli import main  # noqa: PLC0415

    step = StepShape(seq_len=4096, micro_batch_tokens=4096)
    options = EngineOptions(keep_activations="2")
    with pytest.raises(ValueError, match=r"^hf_megatrain: keep_activations=2: only the 0 HBM"):
        _builder_plan(monkeypatch, qwen1_5b, options, step, hbm=GIB // 2)
    argv = ["plan", str(CONFIGS / "qwen2.5-1.5b"), "--seq-len", "4096", "--tokens-per-step"]
    argv += ["4096", "--hbm-gib", "0.5", "--host-gib", "128", "--keep-activations", "2"]
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert str(refused.value) == (
        "hf-megatrain: error: --keep-activations 2: only the 0 HBM-tier layers can keep their "
        "activations"
    )


def test_a_config_that_cannot_be_built_is_a_one_line_refusal(tmp_path):
    """A vocabulary below the family's default pad_token_id (GLM-4's 151329): torch asserts
    while building the embedding. `plan` showed that AssertionError's traceback, and so did
    `train`'s config check; both now refuse in one line."""
    import json  # noqa: PLC0415

    from hf_megatrain.cli import main  # noqa: PLC0415
    from hf_megatrain.cli_common import CLIError, check_config_builds  # noqa: PLC0415

    sizes = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128)
    sizes |= dict(intermediate_size=512, num_hidden_layers=2, vocab_size=32000)
    path = tmp_path / "glm4.json"
    path.write_text(json.dumps({"model_type": "glm4", **sizes}))
    expected = "could not build glm4 from this config: Padding_idx must be within num_embeddings"
    with pytest.raises(SystemExit) as refused:
        main(["plan", str(path), "--seq-len", "4096", "--tokens-per-step", "4096", "--no-search"])
    assert str(refused.value) == f"hf-megatrain: error: {expected}"
    with pytest.raises(CLIError, match=expected):
        check_config_builds(plan_config(str(path)), str(path))


def test_a_process_that_does_not_fit_the_host_is_told_only_more_ram_helps(qwen1_5b):
    """Every layer in HBM and host RAM below the process baseline and margin: the refusal says
    what the host needs and that only more RAM helps. It told of "0 streamed layers", an HBM
    "which is full", and to try fewer tokens, no clipping or fp32-master streaming, each of
    which `plan` then refused the same way."""
    from hf_megatrain.core.planner import plan_memory  # noqa: PLC0415

    step = StepShape(seq_len=4096, micro_batch_tokens=4096)
    options = EngineOptions().resolve(clipping=True, cuda=True, single_backward=True)
    plan = plan_memory(qwen1_5b, step, options, BF16, H200, 2 * GIB)
    assert plan.n_host == 0 and [p.tier for p in plan.problems] == ["host"]
    text = plan.problems[0].message()
    # The margin (4 GiB) and a save's 2 GB shard.
    assert text.startswith("hf_megatrain: the process needs 5.86 GiB of host RAM (every layer")
    assert "only 2.00 GiB is available. Use a machine with more RAM." in text
    assert "fewer tokens" not in text and "fp32-master streaming (no" not in text


def test_a_host_no_option_fits_is_named_before_a_gpu_options_fit(qwen1_5b):
    """Found by an audit: both tiers short, the refusal named the GPU ("no combination of the
    memory options makes it fit") where activation offload fits the GPU part; the host RAM,
    which no option fixes, was the second problem. Now it is the first (the one raised), and
    the GPU's says which options fit it."""
    from hf_megatrain.core.planner import plan_memory  # noqa: PLC0415

    step = StepShape(seq_len=131072, micro_batch_tokens=131072)
    options = EngineOptions(auto_fit="off").resolve(clipping=True, cuda=True, single_backward=True)
    plan = plan_memory(qwen1_5b, step, options, BF16, 40 * GIB, 8 * GIB)
    assert [p.tier for p in plan.problems] == ["host", "gpu"]
    host, gpu = (p.message() for p in plan.problems)
    assert "No combination of the memory options" in host
    assert "No combination" not in gpu
    assert gpu.endswith(
        "With offload_activations=True the GPU part fits; the host RAM is what no option makes fit."
    )
    # Where options fit both tiers, the GPU's problem stays first with that advice.
    step = StepShape(seq_len=262144, micro_batch_tokens=262144)
    plan = plan_memory(qwen1_5b, step, options, BF16, 60 * GIB, 8 * GIB)
    assert [p.tier for p in plan.problems] == ["gpu", "host"]
    assert all("this plan fits" in p.message() for p in plan.problems)


def test_contradictory_switches_are_named_as_typed():
    """Contradictory pins are one-line refusals naming the switches as they are typed
    (--no-host-grads), not as "--host-grads False", which plan's parser would not take."""
    from hf_megatrain.cli import main  # noqa: PLC0415

    argv = ["plan", str(CONFIGS / "qwen2.5-1.5b"), "--seq-len", "4096", "--tokens-per-step"]
    argv += ["4096", "--no-clip", "--no-eager-update", "--no-host-grads", "--no-search"]
    with pytest.raises(SystemExit) as refused:
        main(argv)
    message = str(refused.value)
    assert message.startswith("hf-megatrain: error: --no-host-grads needs eager layer updates")
    assert "but --no-eager-update:" in message and "False" not in message


def _cli_plan(argv):
    """``hf-megatrain plan``'s plan for ``argv`` (after "plan"), as it prints it."""
    from hf_megatrain.cli import build_parser  # noqa: PLC0415
    from hf_megatrain.cli_plan import run_plan  # noqa: PLC0415

    return run_plan(build_parser().parse_args(["plan", *argv]))["plan"]


def _lines_of(plan, *kinds):
    return [line for line in plan.gpu_lines if line.kind in kinds]


def test_the_loss_is_planned_as_the_run_makes_it(monkeypatch, qwen1_5b, capsys):
    """The loss's lines are the run's: a larger ``loss_chunk_tokens`` chunk, and with the fused
    loss turned off the full logits (compute-dtype logits, fp32 copy and log-probabilities).
    Both the builder and ``plan`` counted the default 3,533-token chunk whatever the run used:
    a 32,768-token chunk (45 GiB of logits at Qwen's 151,936 vocabulary, 40 more) or the full
    logits of 65,536 tokens (93 GiB) could run out of memory where the plan said it fits."""
    from hf_megatrain.core.activation_memory import FULL_LOGITS_KIND, LOSS_KIND  # noqa: PLC0415

    t, v = 65536, qwen1_5b.vocab_size
    step = StepShape(seq_len=4096, micro_batch_tokens=t)
    plans = {
        name: _builder_plan(monkeypatch, qwen1_5b, EngineOptions(**o), step)[1]
        for name, o in {
            "default": {},
            "chunk": {"loss_chunk_tokens": 32768},
            "unfused": {"fused_loss": False},
        }.items()
    }
    loss = {name: _lines_of(plan, LOSS_KIND) for name, plan in plans.items()}
    assert any("3533 tokens" in line.name for line in loss["default"])
    assert any("32768 tokens" in line.name for line in loss["chunk"])
    more = sum(line.nbytes for line in loss["chunk"]) - sum(ln.nbytes for ln in loss["default"])
    assert more > 24 * GIB, more / GIB  # (the part beyond a layer's backward phase)
    assert not _lines_of(plans["unfused"], LOSS_KIND)
    (full,) = _lines_of(plans["unfused"], FULL_LOGITS_KIND)
    assert full.nbytes == t * v * (2 + 4 + 4)
    # The room left: fewer layers keep their activations, or fewer join the HBM tier.
    assert plans["chunk"].kept_layers < plans["default"].kept_layers
    assert plans["unfused"].n_hbm < plans["chunk"].n_hbm
    # `plan` takes both options and plans the same lines.
    argv = [str(CONFIGS / "qwen2.5-1.5b"), "--seq-len", "4096", "--tokens-per-step", str(t)]
    argv += ["--hbm-gib", "139", "--host-gib", "128", "--no-search"]
    cli_chunk = _lines_of(_cli_plan([*argv, "--loss-chunk-tokens", "32768"]), LOSS_KIND)
    assert any("32768 tokens" in line.name for line in cli_chunk)
    (cli_full,) = _lines_of(_cli_plan([*argv, "--no-fused-loss"]), FULL_LOGITS_KIND)
    assert cli_full.nbytes == full.nbytes


def test_the_host_is_planned_within_the_host_memory_limit(monkeypatch, qwen1_5b, capsys):
    """With host_memory_limit_gb set, the host store is held to it (``HostStore.check_fits``):
    the plan counts on no more host RAM than that, so auto_fit makes the store fit it (here an
    HBM tier without bf16 copies, which holds 2 more layers) instead of planning a store the
    check then refuses. Training planned with all the machine's available RAM (128 GiB here),
    and `plan` took no such option."""
    step = StepShape(seq_len=4096, micro_batch_tokens=4096)
    unlimited = _builder_plan(monkeypatch, qwen1_5b, EngineOptions(), step, hbm=24 * GIB)[1]
    limited = EngineOptions(host_memory_limit_gb=14)
    _, plan = _builder_plan(monkeypatch, qwen1_5b, limited, step, hbm=24 * GIB)
    assert plan.host_available == 14 * GIB and plan.host_total <= 14 * GIB < unlimited.host_total
    assert plan.fits and plan.options.hbm_cast_weights and plan.n_hbm > unlimited.n_hbm
    argv = [str(CONFIGS / "qwen2.5-1.5b"), "--seq-len", "4096", "--tokens-per-step", "4096"]
    argv += ["--hbm-gib", "24", "--host-gib", "128", "--no-search", "--layer-kernels", "torch"]
    cli = _cli_plan([*argv, "--host-memory-limit-gb", "14"])
    assert cli.host_available == 14 * GIB and cli.host_total <= 14 * GIB
    assert cli.n_hbm == plan.n_hbm > _cli_plan(argv).n_hbm
    assert "host RAM planned: 14.00 GiB (--host-memory-limit-gb 14)" in capsys.readouterr().out


def test_plan_takes_every_option_its_plan_depends_on(monkeypatch, capsys):
    """`plan` has a flag for each option marked ``planned`` in the options' metadata, and plans
    with it as training does. It had none for resident_layers (a count: that many in HBM),
    compact_host_grads (fp32 host gradient slots), overlap_optimizer and device_update_lead (the
    device updates' staging), sequence_parallel (each rank's shard of a row) and
    host_memory_limit_gb, so it planned another run than the one asked for."""
    from hf_megatrain.cli import build_parser  # noqa: PLC0415
    from hf_megatrain.core.options import planned_options  # noqa: PLC0415

    sub = next(a for a in build_parser()._actions if a.dest == "command" or a.choices)
    flags = {a.dest for a in sub.choices["plan"]._actions}
    reported = {"resident_layers", "compact_host_grads", "overlap_optimizer"}
    reported |= {"device_update_lead", "sequence_parallel", "host_memory_limit_gb"}
    assert reported | {"fused_loss", "loss_chunk_tokens"} <= set(planned_options()) <= flags
    assert not {"pin_memory", "max_shard_size", "host_update_threads", "nonfinite"} & flags
    argv = [str(CONFIGS / "qwen2.5-7b"), "--seq-len", "4096", "--tokens-per-step", "16384"]
    argv += ["--hbm-gib", "80", "--host-gib", "250", "--no-search"]
    assert _cli_plan([*argv, "--resident-layers", "4"]).n_hbm == 4
    shape = model_shape_from_config(plan_config(str(CONFIGS / "qwen2.5-7b")), "qwen2.5-7b")
    step = StepShape(seq_len=4096, micro_batch_tokens=16384)
    builder_plan = _builder_plan(monkeypatch, shape, EngineOptions(resident_layers="4"), step)[1]
    assert builder_plan.n_hbm == 4
    default = _cli_plan(argv)
    assert default.host_grad_dtype == BF16 and default.device_updates
    assert _cli_plan([*argv, "--no-compact-host-grads"]).host_grad_dtype == torch.float32
    assert not _cli_plan([*argv, "--device-update-lead", "0"]).device_updates
    assert not _cli_plan([*argv, "--no-overlap-optimizer"]).device_updates
    sp = _cli_plan([*argv, "--sequence-parallel", "2", "--nproc", "2"])
    assert (sp.step.seq_len, sp.step.micro_batch_tokens, sp.ranks) == (2048, 8192, 2)
    assert "its 2048-token shard of each 4096-token row" in capsys.readouterr().out
    with pytest.raises(CLIError, match="give --nproc as a multiple of 2"):
        _cli_plan([*argv, "--sequence-parallel", "2"])
    with pytest.raises(CLIError, match="--resident-layers 40: the model has 28 layers"):
        _cli_plan([*argv, "--resident-layers", "40"])


def test_frozen_layers_are_planned_at_what_their_store_holds(monkeypatch, qwen1_5b):
    """A frozen layer's host store holds its fp32 master and bf16 copy (6 B/param), no gradient
    or moments: the plan counts that, so a LoRA base that fits is not refused. It counted every
    streamed layer at the trainable store's 16 B/param: Qwen2.5-1.5B's frozen layers as 20 GiB
    where the store allocates 7.3, and 14 GiB of host RAM was refused."""
    from hf_megatrain.core.host_store import layer_store_bytes  # noqa: PLC0415

    step = StepShape(seq_len=4096, micro_batch_tokens=4096)
    _, plan = _builder_plan(
        monkeypatch, qwen1_5b, EngineOptions(), step, trainable=False, host=14 * GIB
    )
    assert plan.fits and plan.n_hbm == 0
    store = sum(layer_store_bytes(n, BF16, False) for n in qwen1_5b.layer_numels)
    line = next(ln for ln in plan.host_lines if ln.name.startswith("host-tier layers"))
    assert line.nbytes == store == sum(p.host_bytes for p in plan.layers) < 8 * GIB
    assert "frozen params 1.31B: fp32 master + copy, 6 B/param" in line.name
    # Trainable layers: the trainable store's bytes, as before.
    _, trained = _builder_plan(monkeypatch, qwen1_5b, EngineOptions(), step, hbm=12 * GIB)
    streamed = qwen1_5b.layer_numels[trained.n_hbm :]
    store = dict(hold_grad=True, stream_master=False, grad_dtype=BF16)
    assert sum(p.host_bytes for p in trained.layers) == sum(
        layer_store_bytes(n, BF16, True, **store) for n in streamed
    )


def test_compiled_kernels_that_cannot_apply_are_refused_by_plan(tmp_path):
    """``--layer-kernels compiled`` on a family none of whose norms, MLPs or RoPE compute like
    the compiled kernels (BLOOM's LayerNorm and GELU MLP): `plan` refuses it in one line, with
    the check training refuses it by when applying them. `plan` planned it."""
    import json  # noqa: PLC0415

    from hf_megatrain.cli import main  # noqa: PLC0415
    from hf_megatrain.hf.compiled_kernels import apply_compiled_kernels  # noqa: PLC0415
    from hf_megatrain.hf.model import meta_model  # noqa: PLC0415

    path = tmp_path / "bloom.json"
    sizes = dict(hidden_size=64, n_head=4, n_layer=2, vocab_size=256)
    path.write_text(json.dumps({"model_type": "bloom", **sizes}))
    argv = ["plan", str(path), "--seq-len", "128", "--tokens-per-step", "128", "--no-search"]
    assert main(argv) == 0
    with pytest.raises(SystemExit) as refused:
        main([*argv, "--layer-kernels", "compiled"])
    with pytest.raises(ValueError) as applied:  # training's refusal, where it applies them
        apply_compiled_kernels(meta_model(plan_config(str(path))))
    said = str(applied.value).removeprefix("hf_megatrain: ")
    assert said.startswith("megatrain_layer_kernels='compiled': no norm, MLP or RoPE of Bloom")
    assert str(refused.value) == f"hf-megatrain: error: {said}"


def test_a_config_field_the_family_derives_is_a_one_line_refusal(tmp_path, capsys):
    """A config.json setting a field its family's config derives (Falcon's head_dim, a
    read-only property): one line naming the field. transformers logged the whole config and
    `plan` (and train's config_from_json) showed its AttributeError's traceback."""
    import json  # noqa: PLC0415

    from hf_megatrain.cli import main  # noqa: PLC0415
    from hf_megatrain.cli_common import config_from_json  # noqa: PLC0415

    path = tmp_path / "falcon.json"
    sizes = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=256)
    path.write_text(json.dumps({"model_type": "falcon", **sizes, "head_dim": 32}))
    expected = f"{path}: invalid config: head_dim cannot be set in a falcon config"
    with pytest.raises(CLIError, match=f"^{expected}"):
        config_from_json(str(path))
    argv = ["plan", str(path), "--seq-len", "128", "--tokens-per-step", "128", "--no-search"]
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert str(refused.value).startswith(f"hf-megatrain: error: {expected}")
    assert "\n" not in str(refused.value) and "FalconConfig {" not in capsys.readouterr().err


def test_lora_resident_parameters_are_planned_at_what_training_holds(tmp_path):
    """Under LoRA the frozen base's non-layer parameters (embeddings, final norm, the head's
    original) stay on the GPU in fp32 with no gradient or moments (4 B/param); the adapters and
    a ``modules_to_save`` copy of the head train there, fp32 with gradient and two AdamW moments
    (16 B/param). The plan's parameter lines are what the second step holds before its update.
    They counted every non-layer parameter at 16 B/param and the adapters not at all (as if they
    streamed in their layer's host store): 197,120 B planned of the 360,576 held here, the
    adapters' 262,144 missing (and Llama-3.1-8B's frozen embeddings and head planned at 16.8 GB
    for the 4.2 they hold)."""
    from transformers import TrainerCallback  # noqa: PLC0415

    from hf_megatrain.core.plan_arithmetic import PARAMS_KIND  # noqa: PLC0415
    from hf_megatrain.core.planner import plan_memory  # noqa: PLC0415
    from hf_megatrain.hf.model import model_shape  # noqa: PLC0415
    from tests.helpers import run_trainer, tiny_config, tiny_model  # noqa: PLC0415

    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=16, target_modules="all-linear", modules_to_save=["lm_head"])
    model = peft.get_peft_model(tiny_model(tiny_config("llama")), lora)

    class Held(TrainerCallback):
        """Bytes of the resident parameters, their gradients and AdamW moments, per step."""

        def __init__(self) -> None:
            self.bytes: list[int] = []

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            params = [p for p in kwargs["model"].parameters() if p.device.type != "meta"]
            moments = [
                t
                for st in getattr(optimizer, "optimizer", optimizer).state.values()
                for k, t in st.items()
                if k.startswith("exp_avg")
            ]
            grads = [p.grad for p in params if p.grad is not None]
            self.bytes.append(sum(t.numel() * t.element_size() for t in params + grads + moments))

    held = Held()
    _, trainer = run_trainer(model, tmp_path, "mega", True, max_steps=2, callbacks=[held])
    shape = model_shape(trainer.model)
    step = StepShape(seq_len=16, micro_batch_tokens=32)
    options = EngineOptions().resolve(clipping=True, cuda=True, single_backward=True)
    plan = plan_memory(shape, step, options, BF16, H200, HOST, hbm_layers=0)
    planned = sum(line.nbytes for line in _lines_of(plan, PARAMS_KIND))
    assert shape.adapter_numel and shape.frozen_non_layer_numel
    assert held.bytes[1] == planned, (held.bytes, planned)


@pytest.mark.parametrize("method", ["boft", "vera"])
def test_peft_adapter_buffers_are_planned_resident(method):
    """Adapter layers' buffers go to the GPU with the adapters (``_place_resident``): BOFT's
    butterfly permutations (fp32, input width squared per adapted linear and factor; with every
    linear of Llama-3.1-8B adapted, 32 x (6 x 4096^2 + 14336^2) x 4 B = 39 GB) and VeRA's frozen
    projections, which every adapted linear shares (counted once). The plan's adapters line now
    holds them beside the adapters' 16 B/param; it counted none."""
    from hf_megatrain.core.planner import plan_memory  # noqa: PLC0415
    from hf_megatrain.hf.model import model_shape, prepare_streamed_model  # noqa: PLC0415
    from tests.helpers import tiny_config, tiny_model  # noqa: PLC0415

    peft = pytest.importorskip("peft")
    base = tiny_model(tiny_config("llama"))
    before = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in base.buffers()}
    config = (
        peft.BOFTConfig(boft_block_size=8, target_modules="all-linear")
        if method == "boft"
        else peft.VeraConfig(r=16, target_modules="all-linear")
    )
    model = peft.get_peft_model(base, config)
    prepare_streamed_model(model, "cpu", BF16, resident_layers="0")
    # What the streamed model holds in buffers beyond the base model's (its rotary tables),
    # each storage once (VeRA's projections are the same tensors in every layer).
    held = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in model.buffers()}
    adapters = sum(held.values()) - sum(before.values())
    shape = model_shape(model)
    step = StepShape(seq_len=16, micro_batch_tokens=16)
    options = EngineOptions().resolve(clipping=True, cuda=True, single_backward=True)
    plan = plan_memory(shape, step, options, BF16, H200, HOST, hbm_layers=0)
    (line,) = [ln for ln in plan.gpu_lines if ln.name.startswith("LoRA adapters of the layers")]
    assert adapters > 0 and line.nbytes == 16 * shape.adapter_numel + adapters


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_frozen_base_is_planned_without_gradients(monkeypatch, qwen1_5b, grad_accum):
    """A frozen layer (a LoRA base) makes no gradient: none drains to the host or accumulates
    over micro-batches on the GPU, none crosses PCIe, and the CPU has no update of it to fall
    behind on (no device-update staging). The plan counted a trained base's for it: for
    Qwen2.5-1.5B's layers 0.35 GiB draining (4.9 GiB of accumulators with 2 micro-batches),
    2.6 GB D2H per step (5.2) and, with device_update_lead, the staging."""
    from hf_megatrain.core.plan_arithmetic import GRADS_KIND  # noqa: PLC0415

    step = StepShape(seq_len=4096, micro_batch_tokens=4096, grad_accum=grad_accum)
    options = EngineOptions(device_update_lead=2)
    _, trained = _builder_plan(monkeypatch, qwen1_5b, options, step, hbm=24 * GIB)
    assert sum(line.nbytes for line in _lines_of(trained, GRADS_KIND)) > 0
    assert trained.d2h_bytes_per_step > 0
    _, frozen = _builder_plan(monkeypatch, qwen1_5b, options, step, trainable=False)
    assert frozen.n_hbm == 0 and frozen.fits
    assert sum(line.nbytes for line in _lines_of(frozen, GRADS_KIND)) == 0
    assert frozen.d2h_bytes_per_step == 0 and not frozen.device_updates


@pytest.mark.parametrize(
    "pin", [("--resident-layers", "8"), ("--keep-activations", "6")], ids=["tier", "kept"]
)
def test_what_fits_is_what_plan_accepts_with_the_same_flags(tmp_path, pin):
    """`plan`'s search of what fits planned the HBM tier and the layers keeping activations as
    its own choice whatever the flags pinned: for Qwen2.5-7B on 80 GiB with --resident-layers 8
    it named 89 sequences of 4,096 tokens, 365,568-token rows and 94 layers, which `plan` (and
    train) with the same flags refuse (8 tier layers beside 364,544 tokens' 28 fp32 boundaries
    need 273 GiB); with --keep-activations 6 the same, too few tier layers left to keep them.
    Now each is the most that `plan` with the same flags accepts."""
    import json  # noqa: PLC0415

    from hf_megatrain.cli import build_parser  # noqa: PLC0415
    from hf_megatrain.cli_plan import run_plan  # noqa: PLC0415

    config = CONFIGS / "qwen2.5-7b"
    machine = ["--hbm-gib", "80", "--host-gib", "250", *pin]

    def accepted(seq_len: int, tokens: int, model=config) -> bool:
        argv = [str(model), "--seq-len", str(seq_len), "--tokens-per-step", str(tokens)]
        try:
            return _cli_plan([*argv, *machine, "--no-search"]).fits
        except CLIError:
            return False

    argv = ["plan", str(config), "--seq-len", "4096", "--tokens-per-step", "4096", *machine]
    found = run_plan(build_parser().parse_args(argv))
    seqs, longest, layers = found["max_sequences"], found["max_seq_len"], found["max_layers"]
    assert 0 < seqs < 89 and 0 < longest < 365568 and 28 <= layers < 94
    assert accepted(4096, seqs * 4096) and not accepted(4096, (seqs + 1) * 4096)
    assert accepted(longest, longest) and not accepted(longest + 1024, longest + 1024)
    deeper = json.loads((config / "config.json").read_text())
    for n, fits in ((layers, True), (layers + 1, False)):
        path = tmp_path / f"{n}.json"
        path.write_text(json.dumps({**deeper, "num_hidden_layers": n}))
        assert accepted(4096, 4096, path) is fits, n
