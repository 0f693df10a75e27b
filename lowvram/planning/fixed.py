"""`lowvram train` and `lowvram plan RECIPE` for a model whose architecture cannot be read (a
GGUF-only folder, a hub id not cached here): the recipe and flags as a request without a model,
planned by :func:`lowvram.plan.choose.unpredicted.unpredicted_plan` (the search with nothing left on auto),
and the plan says that its memory was not predicted."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.plan.choose.request import Budget
from lowvram.plan.choose.unpredicted import unpredicted_plan
from lowvram.plan.types import Plan
from lowvram.planning.budget import missing_extras
from lowvram.planning.from_recipe import build_request

if TYPE_CHECKING:  # the recipe's pydantic schema is imported only where a recipe is read
    from lowvram.recipe import Recipe


def fixed_with_note(recipe: Recipe, budget: Budget, err: LowvramError, flags: dict | None = None,
                    flag_sources: dict | None = None) -> Plan:
    """The unpredicted plan of ``recipe`` (+ ``flags``) on ``budget``'s device; ``err``: why the
    model could not be read."""
    plan = unpredicted_plan(build_request(None, recipe, flags, flag_sources), budget)
    plan.reasons["memory"] = f"memory not predicted: {err.message} (fixed defaults used)"
    return plan


def resolve_fixed(recipe: Recipe, kind: str = "cpu", bf16: bool = False, gpus: int = 1) -> Plan:
    """The unpredicted plan of ``recipe`` on a ``kind`` device, whatever its model (the tests of
    training build their runs of tiny models with it); no card is queried."""
    budget = Budget(0, kind, bf16=bf16, bf16_known=False, source="not queried: memory not predicted",
                    missing_extras=missing_extras())
    flags = {"gpus": gpus} if gpus > 1 else {}
    return unpredicted_plan(build_request(None, recipe, flags, {k: f"--{k} {v}" for k, v in flags.items()}), budget)
