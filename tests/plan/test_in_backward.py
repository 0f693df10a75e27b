"""optimizer adamw_in_backward (AdamW stepped in the backward, lowvram.train.build.in_backward): the
hooks step every parameter and free its gradient inside the backward with AdamW's own update, the
planner holds one gradient at a time, the constraints, the search's use of it, and runs through
`lowvram train` (issue 27)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.memory.states import optimizer_bytes
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.setup import RunSetup
from tests.plan.test_galore import TINY

LLAMA = resolve_model("llama-3.2-1b")
GIB = 2**30


def test_the_trainer_steps_each_parameter_in_its_hook_as_adamw_would(tmp_path):
    """After one backward: every gradient is gone, every parameter stepped, each per-parameter
    optimizer torch's fused AdamW with the Trainer's weight-decay split, and the weights equal
    those of the plain Trainer's adamw_torch_fused after the same step (the same update)."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer

    from lowvram.check.builders import hf_config
    from lowvram.plan.choose.search import plan_for_setup
    from lowvram.recipe.schema import Recipe
    from lowvram.train.build.in_backward import in_backward_trainer_class
    from lowvram.train.build.trainer import build_training_args

    recipe = Recipe.model_validate({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d"}]},
                                    "training": {"output_dir": str(tmp_path), "report_to": "none", "max_steps": 1,
                                                 "weight_decay": 0.1}})
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    weights = {}
    for optimizer in ("adamw_in_backward", "adamw"):
        plan = plan_for_setup(RunSetup(TINY, precision="fp32", optimizer=optimizer, device="cpu"), "cpu", 16)
        args = build_training_args(recipe, plan)
        assert args.optim == "adamw_torch_fused"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config(TINY), dtype=torch.float32)
        cls = in_backward_trainer_class(Trainer) if optimizer == "adamw_in_backward" else Trainer
        trainer = cls(model=model, args=args)
        opt = trainer.create_optimizer()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        if optimizer == "adamw_in_backward":
            assert args.max_grad_norm == 0.0
            assert type(opt).__name__ == "LayerWiseDummyOptimizer"
            assert all(p.grad is None for p in model.parameters())
            per = opt.optimizer_dict
            assert len(per) == len(list(model.parameters()))
            assert all(type(o).__name__ == "AdamW" and o.defaults["fused"] for o in per.values())
            assert all(o.state for o in per.values())
            decays = {o.param_groups[0]["weight_decay"] for o in per.values()}
            assert decays == {0.0, 0.1}
        weights[optimizer] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, w in weights["adamw"].items():
        assert torch.allclose(weights["adamw_in_backward"][n], w, atol=1e-6), n


def test_the_plan_holds_one_gradient_and_adamws_state():
    s = RunSetup(LLAMA, precision="bf16", seq_len=256, gradient_checkpointing=True)
    plain, ib = estimate_memory(s), estimate_memory(replace(s, optimizer="adamw_in_backward"))
    assert optimizer_bytes(replace(s, optimizer="adamw_in_backward")) == optimizer_bytes(s)
    assert ib.peak_bytes < plain.peak_bytes
    v, h = LLAMA.vocab_size, LLAMA.hidden_size
    assert ib.breakdown["gradients"] <= 2 * 2 * v * h  # the tied embedding: lm_head's share and its own


@pytest.mark.parametrize(("changes", "why"), [
    (dict(lora=True), "with lora"),
    (dict(offload="optimizer"), "cannot run under offload optimizer"),
    (dict(grad_accum=2), "cannot accumulate"),
    (dict(gpus=2), "one process only"),
])
def test_in_backward_constraints_are_refused_by_the_memory_model(changes, why):
    setup = replace(RunSetup(LLAMA, precision="bf16", optimizer="adamw_in_backward", device="cuda"), **changes)
    with pytest.raises(LowvramError, match="cannot estimate memory") as e:
        estimate_memory(setup)
    assert why in str(e.value)


@pytest.mark.parametrize(("fixed", "why", "hint"), [
    (dict(batch_size=8, micro_batch_size=2), "cannot accumulate gradients", "or use optimizer adamw"),
    (dict(gpus=2, batch_size=2), "one process only", "use --gpus 1, or optimizer adamw"),
    (dict(gradient_clipping=True), "cannot clip gradients", "max_grad_norm: 0"),
    (dict(lora=True), "without LoRA", "--method full"),
])
def test_a_fixed_in_backward_step_that_cannot_run_is_refused_with_a_hint(fixed, why, hint):
    from lowvram.plan.choose.choose import choose_plan
    from lowvram.plan.choose.request import Budget, PlanRequest

    with pytest.raises(LowvramError) as e:
        choose_plan(PlanRequest(**{"model": LLAMA, "batch_size": 1, "lora": False, "optimizer": "adamw_in_backward",
                                   **fixed}), Budget(24 * GIB))
    assert why in e.value.message and hint in e.value.hint


@pytest.mark.parametrize(("request_changes", "expected"), [
    ({}, {"adamw_in_backward"}),
    (dict(gradient_clipping=True), set()),
    (dict(lora=None), set()),
])
def test_in_backward_is_searched_for_full_fine_tuning_without_clipping(request_changes, expected):
    from lowvram.plan.choose.request import Budget, PlanRequest
    from lowvram.plan.choose.search import candidate_setups

    req = PlanRequest(**{"model": LLAMA, "batch_size": 4, "lora": False, **request_changes})
    setups = [s for s in candidate_setups(req, Budget(24 * GIB)) if s.optimizer == "adamw_in_backward"]
    assert {s.optimizer for s in setups} == expected
    assert all(s.grad_accum == 1 and s.offload == "none" for s in setups)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_in_backward_runs_stay_within_their_plan(seed, tmp_path):
    from lowvram.difftest import TEN_FAMILIES, made_in_backward, random_case, run_case

    case = made_in_backward(random_case(seed, families=TEN_FAMILIES))
    out = run_case(case, tmp_path)
    assert out.error is None, out.error
    assert out.ok, f"{case.label()}: {out.ratio:+.2%}"
