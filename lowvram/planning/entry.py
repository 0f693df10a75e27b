"""The entry points `lowvram train` and `lowvram plan` share, so the two never disagree: a recipe
(+ flags, + detected hardware) -> request (request.py) -> :mod:`lowvram.plan` -> Plan or Choice.

When the model's architecture can be read (catalog name, a folder with config.json, a cached hub
id) the memory-driven chooser (:mod:`lowvram.plan.choose.choose`) picks every ``auto`` technique. When it
cannot, the same request is planned with nothing left on auto (fixed.py,
:mod:`lowvram.plan.choose.unpredicted`) and the plan says that its memory was not predicted."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.plan.choose.replan import Replanner
from lowvram.plan.memory.preference import OBJECTIVES
from lowvram.plan.types import Plan
from lowvram.planning.budget import check_card, check_runnable, make_budget, read_machine
from lowvram.planning.fixed import fixed_with_note
from lowvram.planning.from_recipe import METHODS, build_request, flag_choices, recipe_model
from lowvram.units import gib
from lowvram.vocab import (
    ANY_OPTIMIZER,
    ATTENTIONS,
    LOSSES,
    OFFLOADS,
    OPTIMIZERS,
    PRECISIONS,
    QUANTIZATIONS,
)

if TYPE_CHECKING:  # the recipe's pydantic schema is imported only where a recipe is read
    from lowvram.recipe import Recipe


def plan_for_recipe(recipe: Recipe, vram: str | None = None, hardware=None, gpus: int = 1,
                    images: tuple[int, int] | None = None) -> Plan:
    """The plan `lowvram train` runs with (and `lowvram plan RECIPE` shows).

    ``gpus``: data-parallel processes in all (``--gpus`` x ``--nodes``); memory is per GPU.
    ``images``: format image_chat measured on the data (images per row, the costliest image's
    tokens: lowvram.train.run.preflight.measured_images), which the plan is sized for."""
    machine = read_machine(vram, gpus, hardware=hardware, cards=True)  # only the cards the run uses
    check_card(recipe, machine.hardware, vram)
    budget = make_budget(vram, gpus=gpus, machine=machine)
    hardware = machine.hardware
    flags, sources = ({"gpus": gpus}, {"gpus": f"--gpus {gpus}"}) if gpus > 1 else ({}, {})
    flags.update(measured_image_fields(images))
    try:
        spec = recipe_model(recipe)
    except LowvramError as err:
        return check_runnable(fixed_with_note(recipe, budget, err, flags, sources), hardware)
    from lowvram.plan.choose.choose import choose_plan

    return check_runnable(choose_plan(build_request(spec, recipe, flags, sources), budget).plan, hardware)


def require_fit(plan: Plan, recipe_path) -> None:
    """`lowvram train` refuses a plan the planner itself says does not fit (no technique left)."""
    if plan.fits is not False:
        return
    raise LowvramError(
        f"the run does not fit: predicted peak {gib(plan.predicted_peak_bytes)} > budget "
        f"{gib(plan.budget_bytes)} even with every technique left on auto",
        f"`lowvram plan {recipe_path}` names the smallest budget that works and the change that "
        "helps most (shorter training.seq_len, a smaller model, techniques the recipe fixed)",
    )


def replanner_for(recipe: Recipe, images: tuple[int, int] | None = None) -> Replanner:
    """The Replanner for a run of ``recipe`` (its request without command-line flags, as the
    chooser's OOM re-plan has always used it; ``images``: as plan_for_recipe's)."""
    try:
        spec = recipe_model(recipe)
    except LowvramError:
        return Replanner()
    return Replanner(build_request(spec, recipe, measured_image_fields(images)))


def measured_image_fields(images: tuple[int, int] | None) -> dict:
    """The request fields of format image_chat measured on the data: the images per row it holds
    (at least one) and its costliest image's tokens (PlanRequest.image_tokens)."""
    return {} if images is None else {"images_per_row": max(1, images[0]), "image_tokens": images[1]}


# the flag of each choice is its name with "-" for "_" (--mixed-precision, --quantization, ...)
_CHOICES = {
    "method": tuple(METHODS),
    "mixed_precision": PRECISIONS,
    "quantization": QUANTIZATIONS,
    "optimizer": (ANY_OPTIMIZER, *OPTIMIZERS),
    "loss": LOSSES,
    "attention": ATTENTIONS,
    "offload": OFFLOADS,
    "objective": OBJECTIVES,
}


def check_choice(name: str, value: str | None) -> None:
    """A flag value outside its choices -> UsageError (exit 2) listing them."""
    from lowvram.errors import UsageError

    allowed = _CHOICES[name]
    if value is not None and value not in allowed:
        import difflib

        close = difflib.get_close_matches(value, allowed, n=1)
        guess = f"did you mean {close[0]}? " if close else ""
        flag = "--" + name.replace("_", "-")
        raise UsageError(f"{flag} {value!r} is not one of: {', '.join(allowed)}",
                         f"{guess}e.g. {flag} {allowed[0]}")


def _checked_flags(recipe: Recipe | None, model: str | None, method: str | None, flags: dict):
    """The flags' values checked against their vocabularies, as (fields, sources) of a request."""
    for name in ("mixed_precision", "quantization", "optimizer", "loss", "attention", "offload", "objective"):
        check_choice(name, flags.get(name))
    check_choice("method", method)
    if isinstance(flags.get("max_pixels"), str):  # --max-pixels N | auto
        flags = {**flags, "max_pixels": _pixels_flag(flags["max_pixels"])}
    if recipe is None and model is None:
        raise LowvramError("nothing to plan: give a recipe or --model",
                           "e.g. lowvram plan --model llama-2-7b --vram 24GB, or lowvram plan recipes/quickstart.yaml")
    return flag_choices(method, **flags)


def _pixels_flag(value: str) -> int | str:
    """--max-pixels: a number of pixels (at least 1) or auto."""
    if value.strip().lower() == "auto":
        return "auto"
    if value.strip().isdigit() and int(value) >= 1:
        return int(value)
    from lowvram.errors import UsageError

    raise UsageError(f"--max-pixels takes a number of pixels or auto, got {value!r}",
                     "e.g. --max-pixels 1003520, or --max-pixels auto (the planner lowers it only if nothing fits)")


def make_plan(recipe: Recipe | None = None, model: str | None = None, vram: str | None = None,
              method: str | None = None, hardware=None, host_ram: str | None = None,
              images: tuple[int, int] | None = None, **flags):
    """The plan `lowvram plan` shows: a Choice, or a fixed Plan if the model cannot be read.
    ``images``: as plan_for_recipe's (the flags win over it)."""
    from lowvram.plan.choose.choose import choose_plan
    from lowvram.plan.model.catalog import resolve_model

    fields, sources = _checked_flags(recipe, model, method, flags)
    fields = measured_image_fields(images) | fields
    if model is not None:
        spec = resolve_model(model)
    else:
        try:
            spec = recipe_model(recipe)
        except LowvramError as err:  # the same request and budget, planned without a memory model
            spec = err
    budget = make_budget(vram, hardware, fields.get("gpus") or 1, host_ram)
    if isinstance(spec, LowvramError):
        return fixed_with_note(recipe, budget, spec, fields, sources)
    return choose_plan(build_request(spec, recipe, fields, sources), budget)


def context_table(recipe: Recipe | None = None, model: str | None = None, method: str | None = None,
                  cards: tuple[int, ...] | None = None, host_ram: str | None = None, **flags):
    """`lowvram plan --context-table`: the longest seq_len over every plan on each card size
    (8 to 80 GB, read as cards are sold: lowvram.plan.cards), for the request the flags make."""
    from lowvram.plan.choose.limits import CARD_SIZES_GB
    from lowvram.plan.choose.limits import context_table as table
    from lowvram.plan.choose.request import validate_request
    from lowvram.plan.memory.memory import estimate_memory
    from lowvram.plan.model.catalog import resolve_model

    fields, sources = _checked_flags(recipe, model, method, flags)
    spec = resolve_model(model) if model is not None else recipe_model(recipe)
    req = build_request(spec, recipe, fields, sources)
    validate_request(req)
    gpus = fields.get("gpus") or 1
    machine = read_machine(None, gpus, host_ram, cards=False)  # once for every card; no card read
    budgets = [(f"{n} GB", make_budget(f"{n}GB", gpus=gpus, machine=machine)) for n in (cards or CARD_SIZES_GB)]
    return req, table(req, budgets, estimate_memory), budgets[0][1]


def image_table(recipe: Recipe | None = None, model: str | None = None, method: str | None = None,
                cards: tuple[int, ...] | None = None, host_ram: str | None = None, **flags) -> dict:
    """`lowvram plan --image-table`: per card (8 to 80 GB), the largest data.max_pixels over every
    plan at seq_len text tokens beside images_per_row images (lowvram.plan.choose.image_table)."""
    from lowvram.plan.choose.image_table import TOKEN_LADDER, image_table_to_dict
    from lowvram.plan.choose.image_table import image_table as table
    from lowvram.plan.choose.limits import CARD_SIZES_GB
    from lowvram.plan.choose.request import validate_request
    from lowvram.plan.memory.memory import estimate_memory
    from lowvram.plan.model.catalog import resolve_model

    flags = {k: v for k, v in flags.items() if v is not None}
    text = flags.pop("seq_len", None) or (recipe.training.seq_len if recipe else None) or 1024
    images = flags.pop("images_per_row", None) or (recipe.data.images_per_row if recipe else None) or 1
    spec = resolve_model(model) if model is not None else recipe_model(recipe)
    fields, sources = _checked_flags(recipe, model, method, flags)
    from lowvram.plan.choose.image_table import IMAGE_TABLE_HINT, image_table_problem

    if problem := image_table_problem(spec.vision):
        raise LowvramError(problem, IMAGE_TABLE_HINT)
    unit2 = (spec.vision.patch_size * spec.vision.merge_size) ** 2
    fields.update(seq_len=text + images * TOKEN_LADDER[0], images_per_row=images,
                  max_pixels=max(TOKEN_LADDER[0] * unit2, fields.get("min_pixels") or 0))
    req = build_request(spec, recipe, fields, sources)
    validate_request(req)  # at the smallest rung: every other rung differs in the image's size only
    gpus = fields.get("gpus") or 1
    machine = read_machine(None, gpus, host_ram, cards=False)
    budgets = [(f"{n} GB", make_budget(f"{n}GB", gpus=gpus, machine=machine)) for n in (cards or CARD_SIZES_GB)]
    return image_table_to_dict(req, table(req, budgets, estimate_memory, text), text)


def generation_table(recipe: Recipe | None = None, model: str | None = None, method: str | None = None,
                     cards: tuple[int, ...] | None = None, **flags) -> dict:
    """`lowvram plan --generation-table`: per card (8 to 80 GB), the largest num_generations x
    max_completion_length over every plan (lowvram.plan.choose.grpo_table), as plain data."""
    from lowvram.plan.choose.grpo_table import generation_table as table
    from lowvram.plan.choose.grpo_table import generation_table_to_dict
    from lowvram.plan.choose.limits import CARD_SIZES_GB
    from lowvram.plan.choose.request import validate_request
    from lowvram.plan.memory.memory import estimate_memory
    from lowvram.plan.model.catalog import resolve_model

    flags = {k: v for k, v in flags.items() if v is not None}
    flags.setdefault("objective", (recipe.training.objective if recipe else None) or "grpo")
    if flags["objective"] not in ("grpo", "rloo"):
        from lowvram.errors import UsageError

        raise UsageError(f"--generation-table plans grpo or rloo, not {flags['objective']}",
                         "add --objective grpo (or rloo)")
    fields, sources = _checked_flags(recipe, model, method, flags)
    spec = resolve_model(model) if model is not None else recipe_model(recipe)
    req = build_request(spec, recipe, fields, sources)
    validate_request(req)
    gpus = fields.get("gpus") or 1
    budgets = [(f"{n} GB", make_budget(f"{n}GB", None, gpus, None)) for n in (cards or CARD_SIZES_GB)]
    return generation_table_to_dict(req, table(req, budgets, estimate_memory))


def list_models() -> list[tuple[str, str, int]]:
    from lowvram.plan.model.catalog import catalog_names, resolve_model
    from lowvram.plan.model.models import model_numel

    rows = []
    for name in catalog_names():
        spec = resolve_model(name)
        rows.append((name, spec.hf_id or "", model_numel(spec)))
    return rows
