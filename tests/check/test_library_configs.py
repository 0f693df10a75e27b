"""The configurations a plan hands the libraries (TrainingArguments, the accelerate config and the
FSDP2 / DeepSpeed plugins made from it, DeepSpeed's config after the Trainer's finalisation,
BitsAndBytesConfig, LoraConfig, from_pretrained arguments), built with lowvram's own builders and
validated by each library's own code (tests/library_configs.py says what is faked: the bf16
device probe and DeepSpeed's world size)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lowvram.plan.types import Plan
from lowvram.recipe import parse_recipe
from lowvram.testing import tiny_llama_config
from lowvram.train.run.launch import LaunchSpec, accelerate_config
from tests.library_configs import (
    finalize_deepspeed,
    launch_environment,
    launched,
    meta_model,
    training_arguments,
)

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="transformers' HfTrainerDeepSpeedConfig needs the deepspeed package "
    "(optional extra, not installed in the default test run)")


def recipe_for(tmp: Path, **training):
    fields = ", ".join(f"{k}: {v}" for k, v in {"output_dir": str(tmp / "out"), **training}.items())
    return parse_recipe(f"""
model: {{name_or_path: tiny}}
data: {{datasets: [{{path: data.jsonl, format: completion}}]}}
training: {{{fields}}}
""", source=tmp / "recipe.yaml")


def zero_plan(offload: str = "zero3", **change) -> Plan:
    fields = dict(device="cuda", mixed_precision="bf16", gradient_checkpointing=True, micro_batch_size=1,
                  grad_accum=2, lora=True, quantization="none", optimizer="adamw", offload=offload,
                  attention="sdpa", loss="standard", gpus=2)
    return Plan(**{**fields, **change})


def test_deepspeed_config_leaves_gradient_clipping_to_the_trainer(tmp_path):
    """accelerate's DeepSpeedPlugin, built from lowvram's config as `accelerate launch` passes it
    on, has gradient_clipping "auto" (the Trainer fills it from max_grad_norm). Needs no deepspeed."""
    plan = zero_plan()
    env = launch_environment(accelerate_config(plan, LaunchSpec(gpus=2)), tmp_path)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_GRADIENT_CLIPPING"] == "auto"
    with launched(env):
        from accelerate.utils import DeepSpeedPlugin

        plugin = DeepSpeedPlugin()  # what TrainingArguments makes under this environment
    assert plugin.deepspeed_config["gradient_clipping"] == "auto" and plugin.zero_stage == 3


@needs_deepspeed
@pytest.mark.parametrize("offload", ["zero3", "zero2-offload", "full", "optimizer"])
@pytest.mark.parametrize("max_grad_norm", [1.0, 0.3, 0.0])
def test_deepspeed_runs_with_any_max_grad_norm(tmp_path, offload, max_grad_norm):
    """Issue 24 item 3: every DeepSpeed plan failed at train start unless max_grad_norm was 1.0
    (launch.py wrote gradient_clipping: 1.0; transformers' fill_match refused the mismatch).
    Through accelerate's launch processing and the Trainer's own config check/finalisation."""
    gpus = 1 if offload in ("full", "optimizer") else 2  # the single-GPU offload plans too
    plan = zero_plan(offload, gpus=gpus)
    env = launch_environment(accelerate_config(plan, LaunchSpec(gpus=gpus)), tmp_path)
    model = meta_model(tiny_llama_config(128))
    with launched(env):
        args = training_arguments(recipe_for(tmp_path, max_grad_norm=max_grad_norm, batch_size=2 * gpus), plan)
        ds = finalize_deepspeed(args, model, gpus)
    assert ds["gradient_clipping"] == max_grad_norm
    assert ds["train_batch_size"] == 2 * gpus and ds["train_micro_batch_size_per_gpu"] == 1
    assert ds["gradient_accumulation_steps"] == 2 and ds["bf16"]["enabled"] is True


# --------------------------------------------------------------------------------------------
# Every plan the search returns for CUDA cards, through the libraries' own validation


def _sweep(requests, tmp_path) -> dict:
    """Plan each (model, method, card GB, GPUs) request, validate each distinct configuration;
    every library rejection is collected (one failure lists them all)."""
    from collections import Counter

    from tests.library_configs import config_key, searched_plan, validate_plan

    plans, failures, validated = {}, [], Counter()
    for name, method, gb, gpus in requests:
        plan = searched_plan(name, method, gb, gpus)
        if plan is not None:
            plans.setdefault(config_key(name, plan), (name, plan, (method, gb, gpus)))
    for i, (name, plan, asked) in enumerate(plans.values()):
        work = tmp_path / f"p{i}"
        work.mkdir()
        try:
            validated.update(validate_plan(name, plan, work))
        except Exception as e:  # a library rejected what lowvram builds for this plan
            failures.append(f"{name} {asked}: {plan.mixed_precision} {plan.quantization} lora={plan.lora} "
                            f"{plan.optimizer} {plan.offload} {plan.attention} {plan.loss}: {type(e).__name__}: {e}")
    print(f"\n{len(requests)} requests, {len(plans)} distinct plan configurations validated: {dict(validated)}")
    assert not failures, "\n".join(failures)
    return {"requests": len(requests), "plans": len(plans), "validated": validated}


def _sampled_requests(per_model: int) -> list[tuple]:
    """Every catalog model, each with ``per_model`` (method, card, GPUs) triples spread over the
    grid, deterministic."""
    import itertools

    from lowvram.plan.model.catalog import catalog_names
    from tests.library_configs import CARDS_GB, GPU_COUNTS, METHOD_NAMES

    grid = list(itertools.product(METHOD_NAMES, CARDS_GB, GPU_COUNTS))
    return [(name, *grid[(7 * i + 31 * k) % len(grid)])
            for i, name in enumerate(catalog_names()) for k in range(per_model)]


def test_sampled_plans_pass_every_librarys_validation(tmp_path):
    """The configuration test (issue 24): a sample of the grid catalog models x methods (auto,
    full, lora, qlora) x 8-80 GB cards x 1/2/4 GPUs, every model at least twice."""
    out = _sweep(_sampled_requests(2), tmp_path)
    assert out["plans"] > 40 and out["validated"]["TrainingArguments"] == out["plans"]
    assert out["validated"]["FullyShardedDataParallelPlugin"] and out["validated"]["LoraConfig"]
    assert out["validated"]["BitsAndBytesConfig"] and out["validated"]["DeepSpeedPlugin"]


@pytest.mark.slow  # the whole grid, 41 models x 4 methods x 7 cards x 3 GPU counts: 3444 requests, 2000
# distinct configurations, all valid (2026-12-02, 34 min on the shared 2-core machine)
def test_every_plan_passes_every_librarys_validation(tmp_path):
    import itertools

    from lowvram.plan.model.catalog import catalog_names
    from tests.library_configs import CARDS_GB, GPU_COUNTS, METHOD_NAMES

    _sweep(list(itertools.product(catalog_names(), METHOD_NAMES, CARDS_GB, GPU_COUNTS)), tmp_path)
