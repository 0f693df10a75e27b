"""optimizers apollo_adamw and apollo_adamw_layerwise (APOLLO, apollo-torch): the state and one
step's working set counted by the planner (lowvram.plan.memory.optimizers) against the real optimizer the
Trainer builds, the constraints, the search's use of them, the Trainer mapping, and runs through
`lowvram train` (issue 27)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.memory.states import optimizer_bytes, optimizer_step_temp_bytes
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.setup import RunSetup
from tests.plan.stepping import measure_steps
from tests.plan.test_galore import TINY, _state_bytes_after_one_step

LLAMA = resolve_model("llama-3.2-1b")
GIB = 2**30


def test_apollo_state_is_exact_for_the_tiny_llama():
    """Per target m x n at rank r (not capped): the projector (r x n, or m x r when m < n), two
    projected moments and a 0-d norm in the dtype; every other tensor AdamW's two moments."""
    h, kv, i, v, r, w = 64, 32, 160, 256, 48, 2
    targets = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
    per_layer = 0
    for m, n in targets:
        projector = r * n if m >= n else m * r
        moments = 2 * (m * r if m >= n else r * n)
        per_layer += w * (projector + moments) + w
    per_layer += 2 * w * 2 * h  # two norms
    expected = 2 * per_layer + 2 * w * (h + 2 * v * h)  # final norm, embedding, lm_head
    setup = RunSetup(TINY, precision="bf16", optimizer="apollo_adamw", galore_rank=r)
    assert optimizer_bytes(setup) == expected


@pytest.mark.parametrize("optimizer", ["apollo_adamw", "apollo_adamw_layerwise"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_apollo_state_is_the_real_optimizers(optimizer, precision, tmp_path):
    """After one Trainer-built step (the layerwise form: its hooks' per-parameter optimizers), at a
    rank below every side (8) and one above the kv width (48): every state storage, the projectors
    (GradientProjector.ortho_matrix) included, byte for byte."""
    pytest.importorskip("apollo_torch")
    for rank in (8, 48):
        setup = RunSetup(TINY, precision=precision, optimizer=optimizer, galore_rank=rank)
        assert optimizer_bytes(setup) == _state_bytes_after_one_step(precision, rank, tmp_path / str(rank), optimizer)


@pytest.mark.parametrize("shape", [(160, 64), (64, 160)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_apollo_step_makes_what_the_plan_counts(shape, dtype):
    """One target's step under the live-bytes tracker, beside its weight, gradient and state: the
    renewal at the first step, then a steady step (the norm-growth limiter's second m x n), each
    at most the plan's and the larger equal to it."""
    pytest.importorskip("apollo_torch")
    import torch
    from apollo_torch import APOLLOAdamW

    from lowvram.plan.memory.optimizers.galore_apollo import _step_temps

    dt = getattr(torch, dtype)
    p = torch.nn.Parameter(torch.randn(*shape, dtype=dt))
    opt = APOLLOAdamW([{"params": [p], "rank": 8, "proj": "random", "scale_type": "channel",
                        "update_proj_gap": 200, "scale": 1.0, "proj_type": "std"}], lr=1e-3)
    # each step's peak above what it keeps (the state made at the first)
    peaks = [m.peak - m.after for m in measure_steps(p, opt, 2)]
    w = 4 if dtype == "float32" else 2
    planned = _step_temps(RunSetup(TINY, optimizer="apollo_adamw", galore_rank=8), w, shape, True)
    assert max(peaks) == planned


@pytest.mark.parametrize(("changes", "why"), [
    (dict(lora=True), "with lora there are none"),
    (dict(offload="zero2", gpus=2), "cannot run under offload zero2"),
    (dict(model=resolve_model("qwen3-30b-a3b")), "MoE"),
    (dict(optimizer="apollo_adamw_layerwise", grad_accum=2), "or apollo_adamw)"),
])
def test_apollo_constraints_are_refused_by_the_memory_model(changes, why):
    setup = replace(RunSetup(LLAMA, precision="bf16", optimizer="apollo_adamw", device="cuda"), **changes)
    with pytest.raises(LowvramError, match="cannot estimate memory") as e:
        estimate_memory(setup)
    assert why in str(e.value)


@pytest.mark.parametrize(("fixed", "why", "hint"), [
    (dict(optimizer="apollo_adamw_layerwise", batch_size=8, micro_batch_size=2), "cannot accumulate gradients",
     "or use optimizer apollo_adamw"),
    (dict(optimizer="apollo_adamw_layerwise", gradient_clipping=True), "cannot clip gradients", "max_grad_norm: 0"),
    (dict(optimizer="apollo_adamw", lora=True), "without LoRA", "--method full"),
])
def test_fixed_apollo_forms_that_cannot_run_are_refused_with_a_hint(fixed, why, hint):
    from lowvram.plan.choose.choose import choose_plan
    from lowvram.plan.choose.request import Budget, PlanRequest

    with pytest.raises(LowvramError) as e:
        choose_plan(PlanRequest(**{"model": LLAMA, "batch_size": 1, "lora": False, **fixed}), Budget(24 * GIB))
    assert why in e.value.message and hint in e.value.hint


@pytest.mark.parametrize(("request_changes", "budget_changes", "expected"), [
    ({}, {}, {"apollo_adamw", "apollo_adamw_layerwise"}),
    ({}, dict(device="cpu"), {"apollo_adamw", "apollo_adamw_layerwise"}),  # no CUDA needed
    (dict(gradient_clipping=True), {}, {"apollo_adamw"}),
    ({}, dict(missing_extras=("apollo",)), set()),
    (dict(lora=None), {}, set()),
])
def test_apollo_forms_are_searched_only_where_they_run(request_changes, budget_changes, expected):
    from lowvram.plan.choose.request import Budget, PlanRequest
    from lowvram.plan.choose.search import candidate_setups

    req = PlanRequest(**{"model": LLAMA, "batch_size": 1, "lora": False, "optimizer_any": True, **request_changes})
    setups = candidate_setups(req, Budget(24 * GIB, **budget_changes))
    assert {s.optimizer for s in setups if s.optimizer.startswith("apollo")} == expected


def test_apollo_ranks_with_galore():
    from lowvram.plan.choose.request import optimizer_given_up

    s = RunSetup(LLAMA)
    assert optimizer_given_up(replace(s, optimizer="apollo_adamw")) == optimizer_given_up(
        replace(s, optimizer="galore_adamw")) == 3
    assert optimizer_given_up(replace(s, optimizer="apollo_adamw_layerwise")) == 4


def test_apollo_plans_map_to_the_trainers_apollo(tmp_path):
    pytest.importorskip("apollo_torch")
    from lowvram.plan.choose.search import plan_for_setup
    from lowvram.recipe.schema import Recipe
    from lowvram.train.build.trainer import build_training_args

    recipe = Recipe.model_validate({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d"}]},
                                    "training": {"output_dir": str(tmp_path), "report_to": "none"}})
    plan = plan_for_setup(RunSetup(TINY, precision="fp32", optimizer="apollo_adamw_layerwise", galore_rank=16,
                                   device="cpu"), "cpu", 16)
    args = build_training_args(recipe, plan)
    assert args.optim == "apollo_adamw_layerwise" and args.max_grad_norm == 0.0
    assert set(args.optim_target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"}
    assert "rank=16" in args.optim_args and "scale" not in args.optim_args


def test_apollo_step_temporaries_include_the_full_size_scaled_gradient():
    s = RunSetup(LLAMA, precision="bf16", optimizer="apollo_adamw", galore_rank=128)
    i, h = LLAMA.intermediate_size, LLAMA.hidden_size
    assert optimizer_step_temp_bytes(s) >= 2 * 2 * i * h


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "layerwise"), [(1, False), (2, True)])
def test_apollo_runs_stay_within_their_plan(seed, layerwise, tmp_path):
    pytest.importorskip("apollo_torch")
    from lowvram.difftest import TEN_FAMILIES, made_apollo, random_case, run_case

    case = made_apollo(random_case(seed, families=TEN_FAMILIES), layerwise=layerwise)
    assert case is not None
    out = run_case(case, tmp_path)
    assert out.error is None, out.error
    assert out.ok, f"{case.label()}: {out.ratio:+.2%}"
