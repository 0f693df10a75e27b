"""The plan at the data's own length: batches are padded to their longest row, not to the length
the plan was made for, so on shorter data the run peaks below the plan. The run predicts its peak
at the longest row its data can make as well (metrics.json ``predicted_peak_bytes_at_data``) and
compares the measured peak with that: SFT's tokenized rows or packed windows, the longest pair TRL
tokenized (preference), or for grpo/rloo the longest prompt as TRL tokenizes it plus
max_completion_length."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lowvram.plan.choose.replan import Replanner
from lowvram.plan.types import Plan
from lowvram.recipe import Recipe

if TYPE_CHECKING:
    from transformers import Trainer

    from lowvram.train.data.build import DataBundle


def planned_row_tokens(recipe: Recipe) -> int:
    """The row the plan was made for: training.seq_len, or grpo/rloo's max_prompt_length +
    max_completion_length (training.seq_len does not apply to them)."""
    if recipe.training.objective in ("grpo", "rloo"):
        return recipe.grpo.max_prompt_length + recipe.grpo.max_completion_length
    return recipe.training.seq_len


def longest_row(recipe: Recipe, bundle: DataBundle, trainer: Trainer) -> int | None:
    """The longest row a batch of the training data reaches: SFT's tokenized rows (or packed
    windows), the longest tokenized pair TRL made (train/build/preference.py), or grpo/rloo's
    longest prompt + max_completion_length (train/build/grpo.py longest_prompt_tokens)."""
    from lowvram.train.build.grpo import is_rl_config, longest_prompt_tokens
    from lowvram.train.build.preference import is_preference_config, longest_tokenized_row

    if is_rl_config(trainer.args):
        prompt = longest_prompt_tokens(trainer)
        return None if prompt is None else prompt + recipe.grpo.max_completion_length
    if is_preference_config(trainer.args):
        return longest_tokenized_row(trainer.train_dataset, recipe.training.objective, recipe.training.seq_len)
    if "input_ids" not in bundle.train.column_names:
        return None
    return max((len(ids) for ids in bundle.train["input_ids"]), default=0)


def prediction_at_data_length(recipe: Recipe, plan: Plan, bundle: DataBundle, replanner: Replanner | None,
                              longest: int | None) -> tuple[dict, dict[str, int]]:
    """Batches are padded to their longest row: on data shorter than seq_len the run peaks below
    the plan (made for full seq_len batches). Predict the peak at the longest row as well
    (``longest``: :func:`longest_row`), so the measured peak is compared with what this data can reach:
    (metrics, the breakdown the measured peak is compared with, part by part). Packed data: the
    plan takes every window to hold several samples (SDPA's block-diagonal mask in every layer);
    where none does (samples as long as seq_len), the windows are plain rows."""
    if plan.predicted_peak_bytes is None or replanner is None or longest is None:
        return {}, dict(plan.breakdown)
    several = bundle.stats.packed and bundle.stats.train_samples > bundle.stats.train_rows
    one_sample_windows = bundle.stats.packed and not several  # packing on, no window holds two
    planned = planned_row_tokens(recipe)
    if not 0 < longest <= planned or (longest == planned and not one_sample_windows):
        return {}, dict(plan.breakdown)  # the data reaches what the plan was made for
    breakdown = replanner.breakdown_at(plan, longest, packing=several)
    if not breakdown:
        return {}, dict(plan.breakdown)
    metrics = {"data_longest_tokens": longest, "predicted_peak_bytes_at_data": sum(breakdown.values())}
    if one_sample_windows:
        metrics["data_windows_one_sample"] = True
    return metrics, breakdown


def with_data_length_reason(plan: Plan, recipe: Recipe, at_data: dict) -> Plan:
    """A preference or grpo/rloo run on rows shorter than the plan's: the plan the run folder
    keeps says where the run peaks (TRL pads each batch to its longest pair, or each generation
    batch to its longest prompt, not to max_length / max_prompt_length)."""
    if recipe.training.objective == "sft" or not at_data:
        return plan
    from lowvram.units import gib

    n = at_data["data_longest_tokens"]
    at = f"so the run peaks at {gib(at_data['predicted_peak_bytes_at_data'])}, predicted at {n} tokens"
    if recipe.training.objective in ("grpo", "rloo"):
        g = recipe.grpo
        reason = (f"the longest prompt is {n - g.max_completion_length} tokens as TRL tokenizes it (cut to "
                  f"max_prompt_length {g.max_prompt_length}): TRL pads each generation batch to its longest prompt, "
                  f"{at} with max_completion_length {g.max_completion_length} (the plan's "
                  f"{gib(plan.predicted_peak_bytes)} is at {planned_row_tokens(recipe)})")
    else:
        reason = (f"the longest tokenized pair is {n} tokens (the prompt with the chosen or the rejected, "
                  f"truncated to max_length {recipe.training.seq_len} as TRL does): TRL pads each batch to its "
                  f"longest row, {at} (the plan's {gib(plan.predicted_peak_bytes)} is at {recipe.training.seq_len})")
    return dataclasses.replace(plan, reasons={**plan.reasons, "data_length": reason})


__all__ = ["longest_row", "planned_row_tokens", "prediction_at_data_length", "with_data_length_reason"]
