"""The planner's advice when a run does not fit: the lightest set of memory options not used
yet that makes it fit, exact options before approximate ones."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hf_megatrain.cli_plan import CLI_NAMER
from hf_megatrain.core.memory_options import (
    ADVICE_TILE_TOKENS,
    MemoryOptions,
    candidates,
    lightest_fit,
)
from hf_megatrain.core.options import EngineOptions, StepShape
from hf_megatrain.core.plan_search import RECOMPUTE_TIE
from hf_megatrain.core.planner import (
    GIB,
    MemoryPlanError,
    auto_fit_changes,
    fitting_options,
    margin_only_advice,
    margin_only_options,
    plan_memory,
    plan_with_auto_fit,
    recompute_flops,
)
from hf_megatrain.hf.model import model_shape_from_config

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
BF16 = torch.bfloat16
HBM, HOST = int(139.3 * GIB), 124 * GIB
BF16_BOUNDARIES = "bfloat16"


def opts(clipping: bool = True, **changes):
    """Resolved engine options for a plan; kept activations off unless asked for."""
    changes.setdefault("keep_activations", "off")
    return EngineOptions(**changes).resolve(clipping=clipping, cuda=True)


def _applied(o: MemoryOptions):
    """The resolved options of a run that uses the memory options ``o``."""
    return opts(
        not o.no_clip,
        mlp_tile_tokens=o.mlp_tile_tokens,
        offload_activations=o.offload_activations,
        stream_fp32_master=o.stream_fp32_master,
        checkpoint_every=o.checkpoint_every,
        boundary_dtype=o.boundary_dtype,
        hbm_cast_weights=o.hbm_cast_weights,
    )


def _shape(name: str):
    from transformers import AutoConfig  # noqa: PLC0415

    return model_shape_from_config(AutoConfig.from_pretrained(CONFIGS / name), name)


def test_candidates_keep_base_and_go_lightest_first():
    base = MemoryOptions(offload_activations=True, checkpoint_every=2)
    cands = candidates(base, micro_batch_tokens=1 << 20)
    assert cands and all(c.offload_activations and c.checkpoint_every >= 2 for c in cands)
    assert all(c != base for c in cands)
    costs = [c.cost(base) for c in cands]
    assert costs == sorted(costs)
    # Exact and cheap first; approximate (bf16) and semantic (no clipping) options come late.
    assert cands[0] == replace(base, mlp_tile_tokens=ADVICE_TILE_TOKENS)
    first_bf16 = next(i for i, c in enumerate(cands) if c.boundary_dtype == BF16_BOUNDARIES)
    assert all(c.boundary_dtype == "input" and not c.no_clip for c in cands[:first_bf16])
    assert cands[-1].no_clip and cands[-1].boundary_dtype == BF16_BOUNDARIES
    # Tiles are no option for micro-batches no longer than a tile.
    assert all(not c.mlp_tile_tokens for c in candidates(MemoryOptions(), 4096))


def test_lightest_fit_and_describe():
    base = MemoryOptions()
    found = lightest_fit(lambda o: o.offload_activations and o.checkpoint_every >= 3, base, 1 << 19)
    # segments of 3 plus offload beats segments of 4 plus offload; tiles are not needed.
    assert found == MemoryOptions(offload_activations=True, checkpoint_every=3)
    changes = found.changes(base)
    assert dict(changes.options) == {"offload_activations": True, "checkpoint_every": 3}
    assert not changes.clipping_off
    assert found.describe(base) == "offload_activations=True, checkpoint_every=3"
    assert found.describe(base, CLI_NAMER) == "--offload-activations, --checkpoint-every 3"
    slim = MemoryOptions(boundary_dtype=BF16_BOUNDARIES, no_clip=True)
    assert slim.describe(base) == (
        "boundary_dtype='bfloat16' (approximate gradients), clipping off (changes the training)"
    )
    assert slim.describe(base, CLI_NAMER) == (
        "--boundary-dtype bfloat16 (approximate gradients), --no-clip (changes the training)"
    )
    assert lightest_fit(lambda o: False, base, 1 << 19) is None


@pytest.mark.parametrize(
    ("model", "seq", "wanted"),
    [
        # 84 GiB of fp32 boundaries stay in HBM once the MLP works in tiles: exact, one option.
        ("qwen2.5-1.5b", 524288, MemoryOptions(mlp_tile_tokens=ADVICE_TILE_TOKENS)),
        # 196 GiB of boundaries: offload, fp32-master streaming, bf16 and no clipping, the
        # combination the 524,288-token run used (long7b-0759). With each estimate line's
        # measured error in the margin, clipping's fp32 host gradients no longer fit beside
        # it; with a save's copies planned (the 2 GB embedding's moments), segments of 3
        # (that run's 2 offload 2 GB more boundaries than the host has left).
        (
            "qwen2.5-7b",
            524288,
            MemoryOptions(ADVICE_TILE_TOKENS, True, True, 3, BF16_BOUNDARIES, True),
        ),
    ],
)
def test_long_sequence_advice_names_options_that_fit(model, seq, wanted):
    shape = _shape(model)
    step = StepShape(seq_len=seq, micro_batch_tokens=seq)
    plan = plan_memory(shape, step, opts(), BF16, HBM, HOST)
    assert not plan.fits and plan.options_fit == wanted
    assert plan.advice == wanted.changes(MemoryOptions())
    assert wanted.describe(MemoryOptions()) in str(plan.problems[0])
    assert wanted.describe(MemoryOptions(), CLI_NAMER) in plan.problems[0].message(CLI_NAMER)
    assert plan_memory(shape, step, _applied(wanted), BF16, HBM, HOST).fits


def test_host_bound_advice_and_a_plan_that_fits_gets_none():
    """Qwen2.5-14B at 16k tokens/step: the 18 B/param host store does not fit 124 GiB; the
    advice names options that make it fit. A plan that fits carries no advice."""
    shape = _shape("qwen2.5-14b")
    step = StepShape.from_step(4096, 16384)
    plan = plan_memory(shape, step, opts(), BF16, HBM, HOST)
    assert not plan.fits and plan.options_fit is not None
    assert plan_memory(shape, step, _applied(plan.options_fit), BF16, HBM, HOST).fits
    ok = plan_memory(shape, step, opts(), BF16, HBM, 1024 * GIB)
    assert ok.fits and ok.options_fit is None and ok.advice is None


def _builder_plan(monkeypatch, shape, options, step):
    """The builder's planning of a run on an H200-sized GPU (nothing allocated)."""
    from hf_megatrain.core import builder  # noqa: PLC0415

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (HBM, HBM))
    monkeypatch.setattr(builder, "available_host_bytes", lambda: HOST)
    layers = [
        builder.LayerLayout(slots=[], numel=n, decay_numel=n, trainable=True)
        for n in shape.layer_numels
    ]
    resolved = options.resolve(clipping=True, cuda=True)
    cuda = torch.device("cuda")
    return builder.resident_layer_count(layers, resolved, cuda, BF16, shape, step, 0, None)


def test_refusal_names_exact_options_that_fit_by_the_expected_peak():
    """The 3B at one 1,097,728-token sequence (PyTorch's kernels): no exact option set fits the
    plan's bound, but segments of 4 with tiles, offload and fp32-master streaming fit its
    expected peak (the bound less the estimates' margin). The refusal names that set and
    auto_fit off: a run the plan cannot promise, which may still train (the 7B's exact 524,288
    with Liger's kernels was such a run, and trained). (The 7B at 425,984 was this case until
    the plan stopped summing the segment cache with the offload buffers: now it fits.)"""
    shape = _shape("qwen2.5-3b")
    step = StepShape(seq_len=1097728, micro_batch_tokens=1097728)
    plan = plan_memory(shape, step, opts(), BF16, HBM, HOST)
    assert not plan.fits and fitting_options(plan, opts()) is None
    found = margin_only_options(plan, opts())
    assert found is not None and not found.fits
    assert found.gpu_peak_estimate <= HBM < found.gpu_total and found.host_total <= HOST
    engine = found.options.options
    assert engine.boundary_dtype == "input" and found.options.clipping  # exact, clipping kept
    assert engine.checkpoint_every == 4 and engine.offload_activations
    # What the builder's refusal and `plan` add to the problem (the builder's wiring: below).
    text = margin_only_advice(found, opts()).render(None)
    assert text.startswith("Exact options whose expected GPU peak fits")
    assert "checkpoint_every=4" in text and "auto_fit='off'" in text, text


def test_builder_refuses_a_step_that_fits_with_no_exact_option(monkeypatch, caplog):
    """The 7B at one 458,752-token sequence (172 GiB of fp32 boundary activations): no exact
    option set fits on one H200, so auto_fit 'exact' (the default) refuses before anything is
    allocated, naming what would fit; 'approximate' takes bf16 boundaries; 'off' warns only."""
    import logging  # noqa: PLC0415

    from hf_megatrain.core import builder  # noqa: PLC0415

    shape = _shape("qwen2.5-7b")
    step = StepShape(seq_len=458752, micro_batch_tokens=458752)
    with pytest.raises(MemoryPlanError, match="GiB of GPU memory but only") as refused:
        _builder_plan(monkeypatch, shape, EngineOptions(), step)
    assert "boundary_dtype" in str(refused.value)  # what would fit
    # and the longest exact rows that do (on the plan's own arithmetic)
    # (PyTorch's kernels here: 389,120 tokens; Liger's smaller working set reaches further)
    longest = re.search(
        r"The longest rows that fit \(1 per micro-batch, auto_fit='exact'\): (\d+) tokens",
        str(refused.value),
    )
    assert longest and 360_000 < int(longest.group(1)) < 458752, str(refused.value)
    # Not even by its expected peak does an exact set fit here: nothing more is named.
    assert "expected GPU peak fits" not in str(refused.value)
    n_hbm, plan = _builder_plan(monkeypatch, shape, EngineOptions(auto_fit="approximate"), step)
    assert plan.fits and plan.options.boundary_dtype == torch.bfloat16
    with caplog.at_level(logging.WARNING, logger=builder.logger.name):
        n_hbm, plan = _builder_plan(monkeypatch, shape, EngineOptions(auto_fit="off"), step)
    assert not plan.fits and plan.options.boundary_dtype is None
    assert "offload_activations" in caplog.text and "may run out of GPU memory" in caplog.text
    # Without the step (fixed reserve), nothing is claimed about activations.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=builder.logger.name):
        _builder_plan(monkeypatch, shape, EngineOptions(), None)
    assert "may run out of GPU memory" not in caplog.text


def test_builder_turns_on_the_fastest_exact_options_that_fit(monkeypatch, caplog):
    """A step that does not fit as asked but does with exact options: the builder turns on the
    set auto_fit picks (of those that fit, the one with the least recompute; the lightest among
    near-equals), logs it, and plans with it. At 262,144 tokens that keeps every layer's
    attention output, where the lightest set (the planner's advice) kept fewer and recomputed
    the rest: more recompute."""
    import logging  # noqa: PLC0415

    from hf_megatrain.core import builder  # noqa: PLC0415

    shape = _shape("qwen2.5-7b")
    seq = 262144
    step = StepShape(seq_len=seq, micro_batch_tokens=seq)
    asked = EngineOptions(resident_layers="0")
    as_asked = plan_memory(shape, step, asked.resolve(clipping=True, cuda=True), BF16, HBM, HOST)
    assert not as_asked.fits
    with caplog.at_level(logging.WARNING, logger=builder.logger.name):
        n_hbm, plan = _builder_plan(monkeypatch, shape, asked, step)
    assert plan.fits and "turning on" in caplog.text
    fitted = plan.options
    resolved = asked.resolve(clipping=True, cuda=True)
    auto, _ = plan_with_auto_fit(shape, step, resolved, BF16, HBM, HOST, hbm_layers=0)
    assert fitted.options == auto.options.options
    lightest = fitting_options(as_asked, resolved, hbm_layers=0)
    assert lightest is not None and lightest.options != fitted.options
    light = plan_memory(shape, step, lightest, BF16, HBM, HOST, hbm_layers=0)
    assert recompute_flops(plan) < recompute_flops(light)
    assert plan.attention_layers > light.attention_layers
    assert fitted.boundary_dtype is None and fitted.clipping  # exact: nothing approximate
    assert fitted.options.changed(asked)  # something was turned on
    assert set(fitted.options.changed(asked)) <= {
        "mlp_tile_tokens", "offload_activations", "stream_fp32_master", "checkpoint_every",
        "chain_attention_outputs",
    }  # fmt: skip


def test_auto_fit_segments_keep_the_chain_outputs_that_cut_recompute():
    """Segments auto_fit turns on (none asked for) also keep their chains' attention outputs:
    the count with the least recompute that still fits (the same gradients). Checked against
    every count planned on the same options; segments the user asked for keep the user's count,
    and attention outside SDPA's fused kernels keeps none (nothing to keep)."""
    shape = _shape("qwen2.5-7b")
    # (393,216 until a save's copies were planned: 2 GB more host RAM, and none fits there)
    seq = 376832
    step = StepShape(seq_len=seq, micro_batch_tokens=seq)
    where = dict(hbm_layers=0)

    def auto(s, **asked):
        resolved = EngineOptions(resident_layers="0", **asked).resolve(clipping=True, cuda=True)
        return plan_with_auto_fit(s, step, resolved, BF16, HBM, HOST, **where)

    plan, asked = auto(shape)
    fitted = plan.options
    assert asked is not None and plan.fits and fitted.checkpoint_every > 1
    chain = fitted.options.chain_attention_outputs
    assert 0 < chain < fitted.checkpoint_every
    assert auto_fit_changes(plan, asked).options["chain_attention_outputs"] == chain
    trials = [
        plan_memory(
            shape, step, fitted.resolved_again(fitted.options.with_(chain_attention_outputs=n)),
            BF16, HBM, HOST, **where,
        )
        for n in range(fitted.checkpoint_every)
    ]  # fmt: skip
    least = min(recompute_flops(p) for p in trials if p.fits)
    assert recompute_flops(plan) == least < recompute_flops(trials[0])
    # Segments asked for and kept (auto_fit adds other options): no chain outputs added; a
    # count asked for stays.
    mine, _ = auto(shape, checkpoint_every=8)
    assert mine.fits and mine.options.checkpoint_every == 8
    assert mine.options.options.chain_attention_outputs == 0
    two, _ = auto(shape, chain_attention_outputs=2)
    assert two.options.options.chain_attention_outputs == 2
    # Attention the fused kernels do not run: no chain outputs, none counted.
    eager, _ = auto(replace(shape, sdpa_attention=False))
    assert eager.options.options.chain_attention_outputs == 0


def test_public_names():
    """What the README's examples import from the package itself."""
    import hf_megatrain  # noqa: PLC0415
    from hf_megatrain.core import planner  # noqa: PLC0415

    assert hf_megatrain.MemoryPlanError is planner.MemoryPlanError
    assert "MemoryPlanError" in hf_megatrain.__all__
    # The step and the engine options are separate concepts: no Workload mixing them.
    assert not hasattr(planner, "Workload") and "Workload" not in hf_megatrain.__all__


def test_advice_when_nothing_fits():
    """Qwen2.5-7B at 4M tokens in one sequence fits with no combination of options: said so."""
    from hf_megatrain.core.planner import NOTHING_FITS_ADVICE  # noqa: PLC0415

    seq = 1 << 22
    step = StepShape(seq_len=seq, micro_batch_tokens=seq)
    plan = plan_memory(_shape("qwen2.5-7b"), step, opts(), BF16, HBM, HOST)
    assert not plan.fits and plan.options_fit is None and plan.advice is None
    assert NOTHING_FITS_ADVICE in str(plan.problems[0])


def test_auto_fit_weighs_each_set_with_its_chain_outputs():
    """auto_fit's least recompute counts what each fitting set's chains could keep. At 425,984
    tokens (PyTorch's kernels) the set it runs keeps chain outputs and recomputes less, by more
    than a tie, than every exact set that fits without them (all planned here). (Against every
    set with every chain count, 327,680-425,984 tokens: the same least; a probe, ~30 s a
    length.)"""
    shape = _shape("qwen2.5-7b")
    seq = 425984
    step = StepShape(seq_len=seq, micro_batch_tokens=seq)
    asked = EngineOptions().resolve(clipping=True, cuda=True, single_backward=True)
    plan, _ = plan_with_auto_fit(shape, step, asked, BF16, HBM, HOST)
    assert plan.fits and plan.options.options.chain_attention_outputs > 0
    base = MemoryOptions.of(asked)
    without = math.inf  # the least recompute of the fitting sets without chain outputs
    for o in candidates(base, seq):
        if o.no_clip or o.boundary_dtype != base.boundary_dtype:
            continue
        trial = plan_memory(shape, step, o.applied(asked), BF16, HBM, HOST)
        if trial.fits:
            without = min(without, recompute_flops(trial))
    scale = 6.0 * seq * sum(shape.layer_numels)
    assert recompute_flops(plan) < without - RECOMPUTE_TIE * scale
