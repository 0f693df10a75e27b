"""optimizers lomo and adalomo (LOMO and AdaLomo, lomo-optim): AdaLomo's state and both step
working sets counted by the planner (lowvram.plan.memory.optimizers) against the real classes the
Trainer builds, their constraints with error/hint, the search's use of them, and a LOMO run
through `lowvram train` (issue 27)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.memory.optimizers import lomo_experts_steps, lomo_state_bytes, lomo_working_bytes
from lowvram.plan.memory.states import optimizer_bytes, trainable_tensors
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.setup import RunSetup

GIB = 2**30
LLAMA = resolve_model("llama-3.2-1b")
TINY = replace(LLAMA, num_layers=2, hidden_size=64, intermediate_size=160, num_heads=4, num_kv_heads=2,
               head_dim=16, vocab_size=256, tie_word_embeddings=False)


def test_adalomo_state_is_exact_for_the_tiny_llama():
    """Row + column fp32 means per matrix, the full vector per norm (AdaLomo.__init__)."""
    setup = RunSetup(TINY, precision="bf16", optimizer="adalomo", device="cuda")
    h, kv, i, v = 64, 32, 160, 256
    per_layer = 4 * ((h + h) + (kv + h) + (kv + h) + (h + h) + 2 * (i + h) + (h + i) + 2 * h)
    expected = 2 * per_layer + 4 * h + 2 * 4 * (v + h)  # 2 layers, final norm, embedding + lm_head
    assert optimizer_bytes(setup) == lomo_state_bytes(setup, trainable_tensors(setup)) == expected == 12_800
    assert optimizer_bytes(replace(setup, optimizer="lomo")) == 0


def test_adalomo_state_is_the_real_optimizers(tmp_path, monkeypatch):
    """The Trainer's AdaLomo on the tiny Llama: its exp_avg_sq* tensors' bytes equal the plan's
    (``.cuda()`` stubbed: AdaLomo moves its state to CUDA in __init__, and there is none here)."""
    pytest.importorskip("lomo_optim")
    import torch
    from transformers import AutoModelForCausalLM, Trainer

    from lowvram.check.builders import hf_config
    from lowvram.plan.choose.search import plan_for_setup
    from lowvram.recipe.schema import Recipe
    from lowvram.train.build.trainer import build_training_args

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    setup = RunSetup(TINY, precision="fp32", optimizer="adalomo", device="cuda")
    plan = plan_for_setup(setup, "cpu", 16)
    recipe = Recipe.model_validate({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d"}]},
                                    "training": {"output_dir": str(tmp_path), "report_to": "none", "max_steps": 1}})
    model = AutoModelForCausalLM.from_config(hf_config(TINY), dtype=torch.float32)
    trainer = Trainer(model=model, args=build_training_args(recipe, plan))
    opt = trainer.create_optimizer()
    assert type(opt).__name__ == "AdaLomo"
    state = [*opt.exp_avg_sq.values(), *opt.exp_avg_sq_row.values(), *opt.exp_avg_sq_col.values()]
    assert sum(t.untyped_storage().nbytes() for t in state) == optimizer_bytes(setup)


@pytest.mark.parametrize(("optimizer", "dtype", "expected"), [
    ("lomo", "float32", 4), ("lomo", "bfloat16", 8), ("adalomo", "float32", 12), ("adalomo", "bfloat16", 12)])
def test_one_parameters_step_is_the_real_hooks_peak(optimizer, dtype, expected, monkeypatch):
    """The bytes alive while the real fuse_update steps one 64 x 160 weight (its gradient set,
    as after its AccumulateGrad), over the gradient's own: lomo_working_bytes per element."""
    pytest.importorskip("lomo_optim")
    import torch

    from lowvram.livebytes import LiveBytes

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    from lomo_optim import AdaLomo, Lomo

    t, w, n = getattr(torch, dtype), 4 if dtype == "float32" else 2, 64 * 160
    with LiveBytes() as live:  # weight and gradient made inside, so what is freed is counted too
        lin = torch.nn.Linear(160, 64, bias=False, dtype=t)
        opt = (AdaLomo if optimizer == "adalomo" else Lomo)(lin, lr=1e-3)
        lin.weight.grad = torch.randn(64, 160, dtype=t)
        opt.grad_func(0)
    assert lin.weight.grad is None
    assert lomo_working_bytes(RunSetup(TINY, optimizer=optimizer), w, n) == expected * n
    # beside the weight itself (and AdaLomo's 224-float state)
    assert live.peak_bytes - w * n == pytest.approx(expected * n, rel=0.03)


@pytest.mark.parametrize(("changes", "why"), [
    (dict(lora=True), "with lora"),
    (dict(offload="optimizer"), "cannot run under offload optimizer"),
    (dict(grad_accum=2), "cannot accumulate"),
    (dict(gpus=2, offload="none"), "one process only"),
    (dict(precision="fp16-mixed"), "GradScaler"),
    (dict(optimizer="adalomo", device="cpu"), "adalomo needs CUDA"),
    (dict(optimizer="adalomo", model=resolve_model("qwen3-30b-a3b")), "3-D expert"),
])
def test_lomo_constraints_are_refused_by_the_memory_model(changes, why):
    setup = replace(RunSetup(LLAMA, precision="bf16", optimizer="lomo", device="cuda"), **changes)
    with pytest.raises(LowvramError, match="cannot estimate memory") as e:
        estimate_memory(setup)
    assert why in str(e.value)


@pytest.mark.parametrize(("fixed", "budget", "why", "hint"), [
    (dict(optimizer="adalomo"), dict(device="cpu"), "optimizer adalomo needs a CUDA GPU",
     "set techniques.optimizer: lomo"),
    (dict(optimizer="lomo", mixed_precision="fp16-mixed"), {}, "cannot train in fp16-mixed",
     "mixed_precision: bf16"),
    (dict(optimizer="lomo", batch_size=8, micro_batch_size=2), {}, "cannot accumulate gradients",
     "or use optimizer adamw_8bit"),
    (dict(optimizer="lomo", gpus=2, batch_size=2), {}, "one process only", "use --gpus 1"),
    (dict(optimizer="lomo", gradient_clipping=True), {}, "cannot clip gradients", "max_grad_norm: 0"),
    (dict(optimizer="adalomo", lora=True), {}, "without LoRA", "--method full"),
])
def test_fixed_lomo_forms_that_cannot_run_are_refused_with_a_hint(fixed, budget, why, hint):
    from lowvram.plan.choose.choose import choose_plan
    from lowvram.plan.choose.request import Budget, PlanRequest

    with pytest.raises(LowvramError) as e:
        choose_plan(PlanRequest(**{"model": LLAMA, "batch_size": 1, "lora": False, **fixed}),
                    Budget(24 * GIB, **budget))
    assert why in e.value.message and hint in e.value.hint


@pytest.mark.parametrize(("request_changes", "budget_changes", "expected"), [
    ({}, {}, {"lomo", "adalomo"}),
    ({}, dict(device="cpu"), {"lomo"}),  # AdaLomo: CUDA only
    (dict(gradient_clipping=True), {}, set()),
    ({}, dict(missing_extras=("lomo",)), set()),  # lomo_optim not installed
    (dict(lora=None), {}, set()),  # LoRA on auto stays the answer to a model too big to train whole
    (dict(model=resolve_model("qwen3-30b-a3b")), {}, {"lomo"}),  # MoE: AdaLomo refused
])
def test_lomo_forms_are_searched_only_where_they_run(request_changes, budget_changes, expected):
    from lowvram.plan.choose.request import Budget, PlanRequest
    from lowvram.plan.choose.search import candidate_setups

    req = PlanRequest(**{"model": LLAMA, "batch_size": 4, "lora": False, "optimizer_any": True, **request_changes})
    setups = candidate_setups(req, Budget(24 * GIB, **budget_changes))
    lomo = [s for s in setups if s.optimizer in ("lomo", "adalomo")]
    assert {s.optimizer for s in lomo} == expected
    assert all(s.grad_accum == 1 and not s.precision.startswith("fp16") for s in lomo)


def test_lomo_ranks_after_layerwise_galore_and_is_what_fits_last():
    """What each gives up (request.optimizer_given_up): AdaLomo after layerwise GaLore, LOMO
    last; Llama-3.2-1B full fine-tuned on an 8 GiB CPU budget, where no GaLore form fits, takes LOMO."""
    from lowvram.plan.choose.choose import choose_plan
    from lowvram.plan.choose.request import Budget, PlanRequest, optimizer_given_up

    s = RunSetup(LLAMA)
    order = [optimizer_given_up(replace(s, optimizer=o)) for o in
             ("adamw", "galore_adamw", "galore_adamw_layerwise", "adalomo", "lomo")]
    assert order == sorted(order) and len(set(order)) == 5
    c = choose_plan(PlanRequest(LLAMA, seq_len=512, batch_size=1, lora=False, offload="none", optimizer_any=True),
                    Budget(8 * GIB, device="cpu"))
    assert c.plan.optimizer == "lomo" and c.plan.grad_accum == 1
    assert "plain SGD" in c.plan.reasons["optimizer"]


def test_lomo_on_a_16bit_8b_model_binds_at_lm_heads_fp32_copies():
    """Llama-3.1-8B in bf16: LOMO's step of the untied lm_head makes fp32 copies of its gradient
    and weight (8 bytes x 128256 x 4096), more than 8-bit layerwise GaLore's whole step there."""
    big = resolve_model("llama-3.1-8b")
    e = estimate_memory(RunSetup(big, precision="bf16", optimizer="lomo", seq_len=512,
                                 gradient_checkpointing=True, device="cuda"))
    assert e.peak_moment == "layerwise_head_step"
    assert e.breakdown["gradients"] == 8 * 128256 * 4096
    galore = estimate_memory(RunSetup(big, precision="bf16", optimizer="galore_adamw_8bit_layerwise",
                                      seq_len=512, gradient_checkpointing=True, device="cuda"))
    assert galore.peak_bytes < e.peak_bytes


def test_lomo_plans_map_to_the_trainers_lomo_without_clipping(tmp_path):
    pytest.importorskip("lomo_optim")
    from lowvram.plan.choose.search import plan_for_setup
    from lowvram.recipe.schema import Recipe
    from lowvram.train.build.trainer import training_arguments

    plan = plan_for_setup(RunSetup(TINY, precision="fp32", optimizer="lomo", device="cpu"), "cpu", 16)
    recipe = Recipe.model_validate({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d"}]},
                                    "training": {"output_dir": str(tmp_path), "report_to": "none"}})
    args = training_arguments(recipe, plan)
    assert args["optim"] == "lomo" and args["max_grad_norm"] == 0.0
    assert "optim_target_modules" not in args


MIXTRAL = replace(resolve_model("mixtral-8x7b"), num_layers=2, hidden_size=64, intermediate_size=96,
                  moe_intermediate_size=96, num_experts=8, num_heads=2, num_kv_heads=2, head_dim=32,
                  vocab_size=1024, tie_word_embeddings=False)


def test_lomo_steps_an_moe_layers_fused_experts_at_the_next_hooks():
    """Issue 27 (held-out seed 534, Mixtral bf16 with checkpointing, the shapes here): down_proj's
    step at gate_up's hook beside gate_up's gradient, then gate_up's at the router's beside the
    router's gradient; in 16-bit a step is the fp32 copies of weight and gradient (8 bytes each)."""
    e, h, i = 8, 64, 96
    down, gate_up, router = e * h * i, e * 2 * i * h, e * h
    bf16 = RunSetup(MIXTRAL, precision="bf16", optimizer="lomo", gradient_checkpointing=True, seq_len=64)
    assert lomo_experts_steps(bf16, 2) == (8 * down + 2 * gate_up, 8 * gate_up + 2 * router) == (589_824, 787_456)
    # fp32: each step is the gradient itself, so down_proj's step beside gate_up's gradient binds
    assert lomo_experts_steps(replace(bf16, precision="fp32"), 4) == (4 * down + 4 * gate_up, 4 * gate_up + 4 * router)
    est = estimate_memory(bf16)
    assert est.peak_moment == "layerwise_layer_step" and est.breakdown["gradients"] == 787_456
    assert estimate_memory(replace(bf16, precision="fp32")).peak_moment == "lomo_experts_step"


@pytest.mark.slow
@pytest.mark.parametrize("seed", [3, 11, 534])
def test_lomo_runs_stay_within_their_plan(seed, tmp_path):
    """LOMO full fine-tuning runs through `lowvram train` on the CPU within the plan-truth target
    (bench/results/plan_fuzz_lomo_heldout.txt: the held-out seeds; 534, Mixtral bf16 with
    checkpointing, was -10.83% before the fused experts' steps were placed at their hooks)."""
    pytest.importorskip("lomo_optim")
    from lowvram.difftest import (
        TEN_FAMILIES,
        made_lomo,
        random_case,
        run_case,
    )

    case = made_lomo(random_case(seed, families=TEN_FAMILIES))
    assert case.optimizer == "lomo" and case.grad_accum == 1
    out = run_case(case, tmp_path)
    assert out.error is None, out.error
    assert out.ok, f"{case.label()}: {out.ratio:+.2%}"
