"""The recipe's grpo section (training.objective grpo and rloo): its keys, TRL's batch rules and the
shape of a reward reference, refused when the recipe loads (lowvram validate), before any model."""

from __future__ import annotations

import pytest

from lowvram.errors import LowvramError
from lowvram.recipe import parse_recipe


def grpo_recipe(grpo: str = "rewards: [exact_match]", objective: str = "grpo", fmt: str = "prompt",
                batch: int = 16, extra: str = "") -> str:
    return f"""\
model: {{name_or_path: m}}
data: {{datasets: [{{path: d.jsonl, format: {fmt}}}]}}
training: {{objective: {objective}, batch_size: {batch}}}
grpo: {{{grpo}}}
{extra}"""


def test_defaults_and_values():
    r = parse_recipe(grpo_recipe("num_generations: 4, max_completion_length: 64, beta: 0.04, "
                                 "rewards: [r.py:score, {function: length, weight: 0.5, target: 40}, pkg.mod:f]"))
    g = r.grpo
    assert (g.num_generations, g.max_completion_length, g.max_prompt_length, g.beta) == (4, 64, 512, 0.04)
    assert (g.generation_batch_size, g.steps_per_generation, g.generation, g.loss_type) == ("auto", "auto", "auto", "dapo")
    assert g.rewards[0] == "r.py:score" and g.rewards[1].weight == 0.5 and g.rewards[1].target == 40
    plain = parse_recipe("model: {name_or_path: m}\ndata: {datasets: [{path: d.jsonl}]}\n")
    assert plain.grpo.num_generations == 8 and plain.grpo.rewards == []


@pytest.mark.parametrize("text, words", [
    # TRL's divisibility rule (GRPOConfig.__post_init__): at load, with the nearest multiples
    (grpo_recipe(batch=12), "training.batch_size 12 is not a multiple of grpo.num_generations 8"),
    (grpo_recipe(batch=12), "use training.batch_size 8 or 16"),
    (grpo_recipe("generation_batch_size: 12, rewards: [exact_match]"), "generation_batch_size 12 is not a multiple"),
    (grpo_recipe("generation_batch_size: 16, steps_per_generation: 2, rewards: [exact_match]"), "not both"),
    (grpo_recipe("num_generations: 1, rewards: [exact_match]"), "num_generations"),
    (grpo_recipe("rewards: []"), "needs grpo.rewards"),
    (grpo_recipe("rewards: [nonsense]"), "expected path/to/file.py:function"),
    (grpo_recipe("rewards: ['r.py:not-a-name']"), "is not a Python function name"),
    (grpo_recipe("rewards: [{function: 'a b:f'}]"), "neither a .py file nor a module name"),
    (grpo_recipe("loss_type: luspo, rewards: [exact_match]"), "loss_type"),
    (grpo_recipe("vllm_gpu_memory_utilization: 1.5, rewards: [exact_match]"), "between 0 and 1"),
    (grpo_recipe("num_generatoins: 4, rewards: [exact_match]"), "did you mean 'num_generations'"),
    (grpo_recipe(fmt="preference"), "does not train on format preference"),
    (grpo_recipe(objective="sft", fmt="alpaca"), "the grpo section applies to training.objective grpo or rloo"),
    (grpo_recipe(objective="dpo", fmt="prompt").replace("grpo: {rewards: [exact_match]}", ""),
     "format prompt holds prompts without answers"),
    (grpo_recipe(extra="").replace("format: prompt}", "format: prompt}], packing: true, x: [{}"), "packing"),
])
def test_bad_grpo_recipes_are_refused(text, words):
    with pytest.raises(LowvramError) as e:
        parse_recipe(text)
    assert words in str(e.value) + (e.value.hint or ""), str(e.value)


@pytest.mark.parametrize("fmt", ["prompt", "chat", "alpaca"])
def test_prompt_formats_train_grpo_and_rloo(fmt):
    for objective in ("grpo", "rloo"):
        assert parse_recipe(grpo_recipe(fmt=fmt, objective=objective)).training.objective == objective


def test_generation_batch_fixes_the_groups_not_the_batch():
    # an explicit generation batch of whole groups: training.batch_size need not be a multiple
    r = parse_recipe(grpo_recipe("generation_batch_size: 16, rewards: [exact_match]", batch=4))
    assert r.grpo.generation_batch_size == 16
