"""Parameters of a trained layer that get no gradient: a frozen one (``requires_grad=False``,
as ERNIE 4.5 MoE's router statistics) and one the loss does not reach in some steps or never
(DeepSeek-V3.2's indexer picks positions only). torch's AdamW skips such a parameter in that
step: no decay, no moment update, its step count unchanged. The engine's must do the same,
and a resume must carry each one's own step count."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import TrainerCallback

from hf_megatrain.hf.model import streamed_names

from .helpers import assert_logs_match, mega_params, run_trainer, tiny_config, tiny_model

#: Whether the layers' ``mlp.extra`` takes part in this step's loss (set by ``_Schedule``).
_EXTRA_IN_USE = {"on": True}


class _Schedule(TrainerCallback):
    """``mlp.extra`` in use at the steps ``uses(global_step)`` says (before each step)."""

    def __init__(self, uses) -> None:
        self.uses = uses

    def on_step_begin(self, args, state, control, **kwargs):
        _EXTRA_IN_USE["on"] = self.uses(state.global_step)


def _add_extra(mlp: torch.nn.Module, hidden: int) -> None:
    """A decayed parameter added to the MLP's output only while ``_EXTRA_IN_USE``."""
    mlp.extra = torch.nn.Parameter(torch.randn(hidden) * 0.1)
    mlp.register_forward_hook(
        lambda module, args, out: out + module.extra if _EXTRA_IN_USE["on"] else out
    )


def _model(frozen: bool, extra: bool):
    config = tiny_config("llama")
    torch.manual_seed(0)
    model = tiny_model(config)
    for layer in model.model.layers:
        if frozen:
            layer.self_attn.q_proj.weight.requires_grad_(False)
        if extra:
            _add_extra(layer.mlp, config.hidden_size)
    return model


#: When ``mlp.extra`` takes part: never, or not at every third step from the second.
_USES = {"never": lambda step: False, "some steps": lambda step: step % 3 != 1}


def _train_both(model, tmp_path, uses, **kw):
    callbacks = [_Schedule(uses)]
    stock_kw = {k: v for k, v in kw.items() if not k.startswith("megatrain_")}
    return [
        run_trainer(copy.deepcopy(model), tmp_path, name, mega, callbacks=callbacks, **args)
        for name, mega, args in (("stock", False, stock_kw), ("mega", True, kw))
    ]


#: ``(frozen q_proj, when mlp.extra takes part)``: a frozen parameter (no extra); an extra
#: one that never takes part; one that takes part in some steps only.
_CASES = {"frozen": (True, None), "never": (False, "never"), "some steps": (False, "some steps")}


@pytest.mark.parametrize(
    "overrides",
    [{}, {"gradient_accumulation_steps": 2}, {"megatrain_resident_layers": 1}],
    ids=["streamed", "accumulated", "hbm-tier"],
)
@pytest.mark.parametrize("case", list(_CASES))
def test_parameters_without_a_gradient_are_skipped_as_torch_does(case, overrides, tmp_path):
    frozen, uses = _CASES[case]
    model = _model(frozen=frozen, extra=uses is not None)
    # A frozen projection streams with its layer (no resident trainable part).
    layer = model.model.layers[0]
    assert streamed_names(layer) == {n for n, _ in layer.named_parameters()}
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    (stock, st), (mega, mt) = _train_both(
        model, tmp_path, _USES[uses or "never"], max_steps=6, **overrides
    )
    assert_logs_match(stock, mega)
    final = mega_params(mt)
    for name, p in st.model.state_dict().items():
        # fp32 on the CPU, 6 steps at lr 1e-2: rounding of the norm's summation order only.
        # Decaying a skipped parameter once moves it by lr * weight_decay = 1e-3 of itself.
        torch.testing.assert_close(final[name], p, rtol=0, atol=1e-5, msg=name)
    unchanged = "mlp.extra" if uses == "never" else "q_proj.weight" if frozen else None
    changed = "mlp.extra" if uses == "some steps" else None
    for name in final:
        if unchanged and name.endswith(unchanged):
            assert torch.equal(final[name], initial[name]), name
        if changed and name.endswith(changed):
            assert not torch.equal(final[name], initial[name]), name


def test_resume_keeps_each_parameters_own_step_count(tmp_path):
    """Saved after a step that skipped ``mlp.extra``, its step count trails its layer's: the
    resumed run goes on as the uninterrupted one, bitwise."""
    model = _model(frozen=False, extra=True)
    uses = _USES["some steps"]
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, callbacks=[_Schedule(uses)])
    _, full = run_trainer(copy.deepcopy(model), tmp_path, "full", True, **kw)
    ckpt = tmp_path / "full" / "checkpoint-2"
    _, resumed = run_trainer(
        copy.deepcopy(model), tmp_path, "resumed", True, resume=str(ckpt), **kw
    )
    expected, got = mega_params(full), mega_params(resumed)
    for name, p in expected.items():
        assert torch.equal(got[name], p), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "overrides",
    [{"gradient_accumulation_steps": 2}, {"megatrain_resident_layers": 1}],
    ids=["accumulated", "hbm-tier"],
)
@pytest.mark.parametrize("case", list(_CASES))
def test_parameters_without_a_gradient_are_skipped_on_gpu(case, overrides, tmp_path):
    """The same on CUDA (device accumulators, the D2H drain, the HBM tier's device update):
    what got no gradient stays bitwise as it was, the rest trains as stock's fp32."""
    frozen, uses = _CASES[case]
    model = _model(frozen=frozen, extra=uses is not None)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    (stock, st), (mega, mt) = _train_both(
        model, tmp_path, _USES[uses or "never"], max_steps=6, use_cpu=False, **overrides
    )
    # fp32 on the GPU: cuBLAS may pick other kernels for the streamed layers' shapes and the
    # norm sums in another order; a skipped parameter decayed would move by ~1e-4 per step.
    assert_logs_match(stock, mega, rel=1e-4)
    final = mega_params(mt)
    for name, p in st.model.state_dict().items():
        torch.testing.assert_close(final[name], p.cpu(), rtol=0, atol=5e-5, msg=name)
    unchanged = "mlp.extra" if uses == "never" else "q_proj.weight" if frozen else None
    for name in final:
        if unchanged and name.endswith(unchanged):
            assert torch.equal(final[name], initial[name]), name


@pytest.mark.parametrize("damage", [None, "exp_avg_sq"], ids=["complete", "incomplete"])
def test_resume_from_a_checkpoint_of_the_earlier_mixed_layer_layout(tmp_path, monkeypatch, damage):
    """Before 2026-12-06 a layer mixing frozen and trainable parameters streamed only its frozen
    ones and kept the trainable ones resident, their moments in resident.safetensors and no
    file of the layer's. Such a checkpoint resumes into the layer's store (moments and step
    counts), and the run goes on as that layout's uninterrupted run."""
    import hf_megatrain.hf.model as hf_model  # noqa: PLC0415

    model = tiny_model(tiny_config("llama"))
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)

    def earlier_layout(layer):  # the rule of that time: frozen ones stream, the rest resident
        flags = {n: p.requires_grad for n, p in layer.named_parameters()}
        if all(flags.values()) or not any(flags.values()):
            return set(flags)
        return {n for n, f in flags.items() if not f}

    with monkeypatch.context() as m:
        m.setattr(hf_model, "streamed_names", earlier_layout)
        earlier, full = run_trainer(copy.deepcopy(model), tmp_path, "full", True, **kw)
    ckpt = tmp_path / "full" / "checkpoint-2"
    assert not (ckpt / "megatrain_optimizer" / "layer_00001.safetensors").exists()
    if damage is not None:
        # A resident file without one of the layer's moments: named, no traceback from torch.
        from safetensors.torch import load_file, save_file  # noqa: PLC0415

        path = ckpt / "megatrain_optimizer" / "resident.safetensors"
        tensors = load_file(str(path))
        del tensors[f"model.layers.1.mlp.down_proj.weight.{damage}"]
        save_file(tensors, str(path))
        # (Written by hand: no manifest, whose sizes would name the file as altered first.)
        (ckpt / "megatrain_manifest.json").unlink()
        with pytest.raises(ValueError, match="resident.safetensors holds .* without .*incomplete"):
            run_trainer(copy.deepcopy(model), tmp_path, "resumed", True, resume=str(ckpt), **kw)
        return
    resumed, trainer = run_trainer(
        copy.deepcopy(model), tmp_path, "resumed", True, resume=str(ckpt), **kw
    )
    assert_logs_match(earlier[2:], resumed)
    expected, got = mega_params(full), mega_params(trainer)
    for name, p in expected.items():
        # fp32 on the CPU: the two layouts sum the global norm in other orders (1e-7 relative).
        torch.testing.assert_close(got[name], p, rtol=0, atol=1e-6, msg=name)


def test_optimizer_state_dict_carries_each_parameters_own_step_count(tmp_path):
    """``HostAdamW.state_dict()`` holds the per-slot step counts where they differ from their
    layer's; a new optimizer loading it has the same counts (torch's keeps one per
    parameter)."""
    from hf_megatrain.core.optimizer import STREAMED_STATE_KEY  # noqa: PLC0415
    from hf_megatrain.hf.model import streamed_optimizer  # noqa: PLC0415

    model = _model(frozen=False, extra=True)
    callbacks = [_Schedule(_USES["some steps"])]
    _, trainer = run_trainer(model, tmp_path, "mega", True, max_steps=3, callbacks=callbacks)
    counts = trainer.optimizer.slot_steps()
    # Every layer: its MLP's extra missed step 2 of 3, the rest trained in all three.
    assert sorted(counts) == list(range(len(model.model.layers)))
    for per_slot in counts.values():
        assert sorted(per_slot)[0] == 2.0 and max(per_slot) == 3.0
    state = copy.deepcopy(trainer.optimizer.state_dict())
    assert all("slot_steps" in layer for layer in state[STREAMED_STATE_KEY]["layers"].values())
    fresh = streamed_optimizer(trainer.model, lr=1e-2)
    assert fresh.slot_steps() == {}
    fresh.load_state_dict(state)
    assert fresh.slot_steps() == counts
