"""The recipe's grpo section (training.objective grpo and rloo, through TRL's GRPOTrainer and
RLOOTrainer): TRL's knobs under the recipe's names, their rules checked when the recipe loads, and
the shape of a reward reference (``path/file.py:function``, ``module:function`` or a built-in).
Importing and calling the rewards is lowvram.train.build.rewards' (validate runs it before any model).

No torch here: ``lowvram validate`` must be instant.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lowvram.plan.memory.preference import RL_OBJECTIVES

# The rewards lowvram ships (lowvram.train.build.rewards): exact_match (the completion's answer equals
# the row's answer or solution column), format (a regular expression), length (a target length).
BUILTIN_REWARDS = ("exact_match", "format", "length")
# the data formats of grpo and rloo: the prompt the model completes (format prompt; chat: the
# messages before the last assistant turn; alpaca: the instruction and input)
PROMPT_FORMATS = ("prompt", "chat", "alpaca")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def reference_problem(ref: str) -> str | None:
    """Why ``ref`` names no reward function (None when it does, by shape: whether the file or
    module exists is checked when the rewards are loaded)."""
    if ref in BUILTIN_REWARDS:
        return None
    where, sep, name = ref.rpartition(":")
    if not sep or not where or not name:
        return (f"reward {ref!r}: expected path/to/file.py:function, module:function or a built-in "
                f"({', '.join(BUILTIN_REWARDS)})")
    if not _NAME.match(name):
        return f"reward {ref!r}: {name!r} is not a Python function name"
    if not where.endswith(".py") and not _MODULE.match(where):
        return f"reward {ref!r}: {where!r} is neither a .py file nor a module name"
    return None


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# GRPOTrainer's loss types (trl/trainer/grpo_config.py loss_type, TRL 1.16) that need no further
# setting: luspo needs importance_sampling_level sequence and vespo token-level vLLM importance
# sampling (grpo_trainer.py L916-940), which lowvram does not expose.
GRPO_LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo")
GENERATION_ENGINES = ("auto", "generate", "paged", "vllm")


class RewardSpec(_Section):
    """One reward function with its weight (and a built-in's settings)."""

    function: str = Field(description="path/to/file.py:function (relative to the recipe), module:function, "
                                      "or a built-in: exact_match, format, length.")
    weight: float = Field(1.0, description="Its weight in the sum of the rewards (TRL's reward_weights).")
    pattern: str | None = Field(None, description="format only: the regular expression a completion must match "
                                "in full (default: <think>...</think><answer>...</answer>).")
    target: int | None = Field(None, gt=0, description="length only: the completion length in characters the "
                               "reward peaks at (default: half of grpo.max_completion_length tokens' worth, 2 "
                               "characters a token).")

    @field_validator("function")
    @classmethod
    def _reference(cls, v: str) -> str:
        if problem := reference_problem(v):
            raise ValueError(problem)
        return v


class GrpoSection(_Section):
    """TRL's GRPO and RLOO settings (training.objective grpo or rloo): how many completions each
    prompt gets, how long, and what scores them. Each is planned (the generation batch and the
    engine's share of memory from the card)."""

    num_generations: int = Field(
        8, ge=2, description="Completions sampled per prompt (GRPO's group size G; at least 2). More: a better "
                             "baseline, more memory and time per prompt (changes the algorithm: the planner "
                             "shrinks the generation batch before it).")
    max_completion_length: int = Field(256, gt=0, le=1_048_576, description="The most tokens a completion has "
                                       "(longer ones are cut there: completions/clipped_ratio).")
    max_prompt_length: int = Field(512, gt=0, le=1_048_576, description="The most prompt tokens kept: a longer "
                                   "prompt loses its start (truncated from the left, as TRL did before 1.0).")
    generation_batch_size: int | Literal["auto"] = Field(
        "auto", description="Completions generated at once (a multiple of num_generations); auto: TRL's rule, "
                            "the effective batch (steps_per_generation x micro-batch x GPUs), or what the plan "
                            "fits. Smaller: less memory while generating, no change to the algorithm.")
    steps_per_generation: int | Literal["auto"] = Field(
        "auto", description="Micro-batch steps trained on each generation batch (TRL's default: the gradient "
                            "accumulation). Set this or generation_batch_size, not both.")
    beta: float = Field(0.0, ge=0, description="KL penalty toward the starting model (0: no reference model, "
                        "TRL's default; > 0 keeps a reference: LoRA turns the adapter off, full fine-tuning "
                        "loads a second copy). The same default for rloo (TRL's RLOOConfig says 0.05).")
    loss_type: Literal[GRPO_LOSS_TYPES] = Field(
        "dapo", description="grpo only: TRL's loss aggregation (dapo: over the active tokens of the whole "
                            "accumulated batch; grpo: per sequence; dr_grpo: by a constant; bnpo, cispo, sapo). "
                            "Same memory, other results.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the completions.")
    num_iterations: int = Field(1, ge=1, description="Optimizer passes over each generation batch (GRPO's mu); "
                                "> 1 keeps the old policy's log-probs for the clipped ratio.")
    mask_truncated_completions: bool = Field(
        False, description="Leave completions cut at max_completion_length out of the loss (DAPO's advice).")
    generation: Literal[GENERATION_ENGINES] = Field(
        "auto", description="The generation engine: generate (transformers' generate, a padded KV cache per "
                            "batch), paged (transformers' continuous batching with a paged cache whose size the "
                            "plan sets), vllm (refused: TRL 1.16 supports vLLM 0.22-0.31, which need "
                            "transformers < 5.18), auto: what the plan picks.")
    vllm_gpu_memory_utilization: float | Literal["auto"] = Field(
        "auto", description="generation vllm: the card's share vLLM takes (auto: the plan's answer).")
    rewards: list[str | RewardSpec] = Field(
        default_factory=list,
        description="The reward functions, summed with their weights: path/to/file.py:function (relative to "
                    "the recipe), module:function, or a built-in (exact_match: the completion's answer equals "
                    "the row's answer or solution column; format: the completion matches a regular expression; "
                    "length: peaks at a target length), each a name or {function, weight, pattern (format), target (length, "
                    "characters)}. TRL's signature: "
                    "f(prompts, completions, **kwargs) -> one float (or None) per completion, the dataset's other "
                    "columns as keyword arguments. Runs in the training process: it is your code.")

    @field_validator("rewards")
    @classmethod
    def _references(cls, v: list) -> list:
        for item in v:
            if isinstance(item, str) and (problem := reference_problem(item)):
                raise ValueError(problem)
        return v

    @field_validator("vllm_gpu_memory_utilization")
    @classmethod
    def _share(cls, v: float | str) -> float | str:
        if isinstance(v, float) and not 0.0 < v < 1.0:
            raise ValueError("must be between 0 and 1 (a share of the card), or auto")
        return v

    @field_validator("generation_batch_size", "steps_per_generation")
    @classmethod
    def _positive_count(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v <= 0:
            raise ValueError("must be > 0 or 'auto'")
        return v

    @model_validator(mode="after")
    def _generation_batch(self) -> GrpoSection:
        # GRPOConfig.__post_init__ (trl/trainer/grpo_config.py, TRL 1.16) raises for both set and for
        # a generation batch that is not whole groups; here at validate, not at train start
        if isinstance(self.generation_batch_size, int) and isinstance(self.steps_per_generation, int):
            raise ValueError("set generation_batch_size or steps_per_generation, not both (TRL derives one from "
                             "the other: generation_batch_size = steps_per_generation x micro-batch x GPUs)")
        if isinstance(self.generation_batch_size, int) and self.generation_batch_size % self.num_generations:
            raise ValueError(f"generation_batch_size {self.generation_batch_size} is not a multiple of "
                             f"num_generations {self.num_generations}: a generation batch holds whole groups "
                             f"(use {multiples(self.generation_batch_size, self.num_generations)})")
        return self


def multiples(n: int, of: int) -> str:
    """The multiples of ``of`` nearest ``n``, as a hint."""
    low, high = (n // of) * of, (n // of + 1) * of
    return f"{low} or {high}" if low else str(high)


def grpo_problem(g: GrpoSection, t, written: bool, validation: object = None) -> str | None:
    """Why a grpo/rloo recipe's batch cannot hold whole groups of completions (None when it can):
    with generation_batch_size and steps_per_generation auto, TRL's generation batch is the
    effective batch (training.batch_size), which must then be a multiple of num_generations
    (GRPOConfig.__post_init__, TRL 1.16); its rewards must be named. ``t``: the training section;
    ``written``: the recipe has a grpo section; ``validation``: data.validation."""
    if t.objective not in RL_OBJECTIVES:
        if written:
            return f"the grpo section applies to training.objective grpo or rloo (training.objective is {t.objective})"
        return None
    if validation is not None:
        return (f"data.validation does not apply to training.objective {t.objective}: lowvram reports the rewards "
                "of the training completions (TRL's evaluation would generate again); remove data.validation")
    if not g.rewards:
        return (f"training.objective {t.objective} needs grpo.rewards: the functions that score the completions "
                "(e.g. rewards: [rewards/my_task.py:my_reward] or a built-in: exact_match, format, length)")
    if g.generation_batch_size == "auto" and g.steps_per_generation == "auto" and t.batch_size % g.num_generations:
        return (f"training.batch_size {t.batch_size} is not a multiple of grpo.num_generations {g.num_generations}: "
                f"it counts completions per step, and TRL generates that many at once in whole groups "
                f"(use training.batch_size {multiples(t.batch_size, g.num_generations)}, or set "
                "grpo.generation_batch_size)")
    return None


def rl_format_problem(objective: str, formats: list[str], packing: bool) -> str | None:
    """Why grpo/rloo cannot train on these formats, or another objective on format prompt."""
    if objective not in RL_OBJECTIVES:
        return (f"format prompt holds prompts without answers: it needs training.objective grpo or rloo "
                f"(training.objective is {objective})")
    wrong = sorted({f for f in formats if f not in PROMPT_FORMATS})
    if wrong:
        return (f"training.objective {objective} does not train on format {', '.join(wrong)}: it needs prompts "
                "(format prompt, or chat / alpaca, whose prompt side it completes)")
    if packing:
        return f"data.packing does not apply to training.objective {objective}: TRL pads each completion"
    return None
