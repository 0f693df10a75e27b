"""fp16 loss scaling with an optimizer stepped in the backward (issue 41 item 4): adamw_in_backward
and the layerwise GaLore/APOLLO forms step each parameter in its gradient hook, before accelerate's
GradScaler unscales; GradScaler then finds no gradient on the Trainer's LayerWiseDummyOptimizer
and fails the step. Refused before the model loads, never searched, and said in the plan's reason
(lowvram.plan.memory.optimizers.scaled_gradient_problem)."""

from __future__ import annotations

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.choose.request import Budget, PlanRequest
from lowvram.plan.model.catalog import resolve_model
from lowvram.vocab import FUSED_BACKWARD_OPTIMIZERS, IN_BACKWARD_OPTIMIZERS, LAYERWISE_OPTIMIZERS

LLAMA = resolve_model("llama-3.2-1b")
GIB = 2**30


def test_gradscaler_fails_the_step_after_the_hooks_stepped_with_scaled_gradients(tmp_path):
    """The mechanism, with a real GradScaler on the CPU (accelerate makes one on CUDA only; here it
    is handed to accelerate's own AcceleratedOptimizer as on CUDA) around lowvram's in-backward
    optimizer built by the Trainer: the hooks step every weight during the scaled backward, then
    ``scaler.step`` asserts. If this stops failing, the refusal below can be revisited."""
    import torch
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from lowvram.check.builders import hf_config
    from lowvram.train.build.in_backward import in_backward_trainer_class
    from tests.plan.test_galore import TINY

    model = AutoModelForCausalLM.from_config(hf_config(TINY))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], optim="adamw_torch_fused")
    trainer = in_backward_trainer_class(Trainer)(model=model, args=args)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    optimizer = AcceleratedOptimizer(trainer.create_optimizer(), device_placement=False, scaler=scaler)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, TINY.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, labels=ids).loss
    scaler.scale(loss).backward()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())  # stepped, scaled
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        optimizer.step()


@pytest.mark.parametrize("optimizer", [o for o in IN_BACKWARD_OPTIMIZERS if o != "adalomo"])
@pytest.mark.parametrize("fixed, budget", [
    ({"mixed_precision": "fp16-mixed"}, Budget(24 * GIB)),
    ({}, Budget(24 * GIB, bf16=False)),  # a card without bf16: auto takes fp16-mixed
])
def test_a_fixed_in_backward_optimizer_under_fp16_is_refused(optimizer, fixed, budget):
    from lowvram.plan.choose.choose import choose_plan

    with pytest.raises(LowvramError) as e:
        choose_plan(PlanRequest(model=LLAMA, batch_size=1, lora=False, optimizer=optimizer, **fixed), budget)
    assert f"optimizer {optimizer} cannot train in fp16-mixed" in e.value.message
    other = {"adamw_in_backward": "adamw", "lomo": "adamw_8bit"}.get(
        optimizer, optimizer.replace("_8bit", "").replace("_layerwise", ""))
    assert f"techniques.optimizer: {other}" in e.value.hint
    assert ("techniques.mixed_precision: bf16" in e.value.hint) == bool(fixed)


def test_the_search_never_steps_in_the_backward_under_fp16_and_says_why():
    """Llama-3.2-1B full fine-tuning on an 8 GiB card without bf16: before, the search took a
    layerwise form (GaLore or APOLLO, ~5-6 GiB); now none of the in-backward forms is a
    candidate, and the optimizer's reason says why."""
    from lowvram.plan.choose.choose import choose_plan
    from lowvram.plan.choose.search import candidate_setups

    req = PlanRequest(model=LLAMA, batch_size=1, lora=False, optimizer_any=True)  # the layerwise forms searched
    fp16 = Budget(8 * GIB, bf16=False)
    setups = candidate_setups(req, fp16)
    assert setups and all(s.precision == "fp16-mixed" for s in setups)
    assert not [s.optimizer for s in setups if s.optimizer in IN_BACKWARD_OPTIMIZERS]
    bf16 = {s.optimizer for s in candidate_setups(req, Budget(8 * GIB))}
    assert set(FUSED_BACKWARD_OPTIMIZERS + LAYERWISE_OPTIMIZERS) <= bf16 | {"galore_adamw_8bit_layerwise"}
    plan = choose_plan(req, fp16).plan
    assert plan.optimizer not in IN_BACKWARD_OPTIMIZERS
    assert "under fp16-mixed no optimizer stepped in the backward is tried" in plan.reasons["optimizer"]
    assert "before accelerate's GradScaler unscales" in plan.reasons["optimizer"]


@pytest.mark.parametrize("optimizer", ["adamw_in_backward", "galore_adamw_layerwise"])
def test_a_plan_made_elsewhere_stops_before_the_model_loads(tmp_path, optimizer):
    """training_arguments (which `lowvram train` builds before loading the model) refuses a Plan
    that pairs fp16 with an in-backward optimizer, whoever made it."""
    from dataclasses import replace

    from lowvram.planning.fixed import resolve_fixed
    from lowvram.recipe.schema import Recipe
    from lowvram.train.build.trainer import training_arguments

    recipe = Recipe.model_validate({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d"}]},
                                    "training": {"output_dir": str(tmp_path), "report_to": "none",
                                                 "max_steps": 1, "batch_size": 1}})
    plan = replace(resolve_fixed(recipe), lora=False, optimizer=optimizer, mixed_precision="fp16-mixed", grad_accum=1)
    with pytest.raises(LowvramError, match=f"optimizer {optimizer} cannot train in fp16-mixed"):
        training_arguments(recipe, plan)
