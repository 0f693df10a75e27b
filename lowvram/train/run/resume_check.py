"""`--resume` continues the run in output_dir, never a mix of two runs.

The run's ``recipe.yaml`` (the resolved recipe it started with), ``plan.json``, and the data hashes
and base model fingerprint (manifest.model_hashes) in its manifest are compared with the recipe and plan of the command that resumes, before
anything in the folder is rewritten. A change to what is trained (model, data and its content,
seq_len, LoRA shape, quantization, optimizer, precision, learning rate and schedule, batch, seed)
is refused with every difference listed; a change to how the run is watched or saved (logging,
checkpoints, evaluation, memory techniques that do not change the math) is allowed and said.
No torch here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.runfiles import PLAN, RECIPE

if TYPE_CHECKING:
    from collections.abc import Callable

    from lowvram.plan.types import Plan
    from lowvram.recipe import Recipe

# Recipe keys whose change keeps the training identical, step for step.
SAFE_KEYS = (
    "training.logging_steps", "training.save_steps", "training.save_total_limit", "training.eval_steps",
    "training.output_dir", "training.report_to", "training.micro_batch_size",
    "training.on_nonfinite", "training.nonfinite_skips", "training.worst_batch_first",
    "model.trust_remote_code",
    "techniques.gradient_checkpointing", "techniques.gradient_accumulation", "techniques.attention",
    "techniques.loss",
)
# Plan settings that change what is trained (the techniques are "auto" in most recipes: the plan
# is what ran).
PLAN_KEYS = ("lora", "quantization", "optimizer", "mixed_precision", "offload")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "fields":
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _steps_change_is_safe(new: dict) -> bool:
    """More or fewer total steps changes no step already taken only when the learning rate does
    not depend on the total (a constant schedule without warmup)."""
    return new.get("training.lr_scheduler") == "constant" and not new.get("training.warmup_ratio")


def recipe_differences(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(refused, allowed) differences between two resolved recipes, one 'key: old -> new' each."""
    a, b = _flatten(old), _flatten(new)
    refused, allowed = [], []
    for key in [*b, *(k for k in a if k not in b)]:
        if a.get(key) == b.get(key):
            continue
        line = f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
        if key in SAFE_KEYS:
            allowed.append(line)
        elif key in ("training.max_steps", "training.epochs") and _steps_change_is_safe(b):
            allowed.append(line)
        elif key in ("training.max_steps", "training.epochs"):
            refused.append(f"{line} (the {b.get('training.lr_scheduler')} learning-rate schedule depends on the total steps)")
        else:
            refused.append(line)
    return refused, allowed


def plan_differences(old: dict, plan: Plan) -> list[str]:
    if not old:
        return []
    out = [f"plan {k}: {old[k]!r} -> {getattr(plan, k)!r}" for k in PLAN_KEYS
           if k in old and old[k] != getattr(plan, k)]
    try:
        before = int(old["micro_batch_size"]) * int(old["grad_accum"]) * int(old.get("gpus", 1))
    except (KeyError, TypeError, ValueError):
        return out
    after = plan.micro_batch_size * plan.grad_accum * plan.gpus
    if before != after:
        out.append(f"effective batch: {before} -> {after}")
    return out


def data_differences(out: Path, recipe: Recipe) -> list[str]:
    from lowvram.train.run import manifest

    recorded = (manifest.read(out) or {}).get("data_sha256") or {}
    if not recorded:
        return []
    now = manifest.data_hashes(recipe)
    return [f"data file {name} changed since the run started (sha256 {str(old)[:12]}... -> {now[name][:12]}...)"
            for name, old in recorded.items() if name in now and now[name] != old]


def model_differences(out: Path, recipe: Recipe) -> list[str]:
    """The base model's files that changed, appeared or went since the run started
    (manifest.model_hashes: small files whole, weight files sampled); [] for a run that recorded
    none (an older lowvram) or a model not found locally now."""
    from lowvram.train.run import manifest

    recorded = (manifest.read(out) or {}).get("model_sha256") or {}
    if not recorded:
        return []
    now = manifest.model_hashes(recipe)
    if not now:
        return []
    where = recipe.model.name_or_path
    changed = [f"base model file {name} changed since the run started (in {where})"
               for name in recorded if name in now and now[name] != recorded[name]]
    gone = [f"base model file {name} is gone since the run started (in {where})" for name in recorded if name not in now]
    new = [f"base model file {name} is new since the run started (in {where})" for name in now if name not in recorded]
    return changed + gone + new


def check_resume(out: Path, recipe: Recipe, plan: Plan | None = None, notify: Callable[[str], None] | None = None) -> None:
    """Refuse a resume that would mix two runs; say which safe changes it takes."""
    from lowvram.past_runs import read_json, read_yaml_dict

    notify = notify or (lambda text: (sys.stderr.write(text + "\n"), sys.stderr.flush()))
    old = read_yaml_dict(out / RECIPE)
    if not old:
        notify(f"note: {out} has no readable recipe.yaml; the recipe was not compared with the run's")
        return
    refused, allowed = recipe_differences(old, recipe.model_dump(mode="json"))
    if plan is not None:
        refused += plan_differences(read_json(out / PLAN), plan)
    refused += data_differences(out, recipe)
    refused += model_differences(out, recipe)
    if refused:
        raise LowvramError(
            f"--resume would continue the run in {out} with different settings, mixing two runs:\n  "
            + "\n  ".join(refused),
            f"resume with the run's own settings, data and base model ({out / 'recipe.yaml'} is its recipe), "
            "or start over: --overwrite, or a new training.output_dir (--set training.output_dir=runs/new)",
        )
    for line in allowed:
        notify(f"note: resuming with a changed setting that does not change the training: {line}")
