"""The plan for a model whose architecture cannot be read (a GGUF-only folder, a hub id not cached
here), so its memory cannot be predicted: the search with nothing left on auto.

Each technique the request leaves on auto takes one default among the values the search would
try (:func:`lowvram.plan.choose.search.technique_options`); the request is checked by the search's own
rules (:func:`lowvram.plan.choose.request.validate_request`, ``check_attention``), and
:func:`lowvram.plan.choose.search.candidate_setups` gives the one setup left, with the search's micro-batch
arithmetic and loss fallback. The Plan has no predicted peak; the caller says why.
"""

from __future__ import annotations

from dataclasses import replace

from lowvram.errors import LowvramError
from lowvram.plan.choose import techniques as tq
from lowvram.plan.choose.request import Budget, PlanRequest, check_attention, validate_request
from lowvram.plan.choose.search import candidate_setups, plan_for_setup, technique_options
from lowvram.plan.setup import RunSetup, activation_offload_conflict
from lowvram.plan.types import Plan
from lowvram.vocab import PROJECTED_OPTIMIZERS

# The default of each technique left on auto when memory cannot be predicted: the plain value the
# search tries first, except LoRA, on: adapters only, for a model of unknown size (what
# LLaMA-Factory does too: FinetuningArguments.finetuning_type defaults to "lora",
# src/llamafactory/hparams/finetuning_args.py).
UNPREDICTED_DEFAULTS = {
    "lora": True, "gradient_checkpointing": False, "activation_offload": False, "optimizer": "adamw",
    "quantization": "none", "offload": "none", "loss": "standard", "tiled_mlp": False,
}
# A micro-batch on auto: the largest divisor of the per-GPU batch up to 4, accumulation making up
# the rest (lowvram's fixed default since the first fixed plans; our choice, not fitted).
UNPREDICTED_MAX_MICRO_BATCH = 4

# technique_options' names that are spelled otherwise in the PlanRequest
_REQUEST_FIELD = {"precision": "mixed_precision"}


def without_auto(req: PlanRequest, budget: Budget) -> PlanRequest:
    """``req`` with every technique it leaves on auto fixed to its unpredicted default (a fixed
    one stays as asked: a fused loss that cannot run here falls back in the search's options)."""
    chosen: dict = {}
    for name, values in technique_options(req, budget).items():
        field = _REQUEST_FIELD.get(name, name)
        if getattr(req, field) is not None:
            continue
        if len(values) == 1:  # the search has one value too (precision, attention, the micro-batch of a fixed accumulation)
            chosen[field] = values[0]
        elif name == "micro_batch_size":
            chosen[field] = next(d for d in values if d <= UNPREDICTED_MAX_MICRO_BATCH)
        else:
            chosen[field] = UNPREDICTED_DEFAULTS[name]
    if req.gradient_checkpointing is None and activation_offload_conflict(bool(req.activation_offload), False):
        chosen["gradient_checkpointing"] = True  # the activation offload asked for needs it
    return replace(req, **chosen)


def unpredicted_plan(req: PlanRequest, budget: Budget) -> Plan:
    """The Plan of ``req`` (its model may be None) on ``budget``'s device, every auto resolved by
    ``without_auto``; no predicted peak, no budget compared."""
    validate_request(req)
    fixed = without_auto(req, budget)
    validate_request(fixed)
    check_attention(req, budget, fixed.mixed_precision)
    if fixed.optimizer in PROJECTED_OPTIMIZERS and fixed.model is None:  # before the search, which skips it
        raise LowvramError(f"optimizer {fixed.optimizer} needs the model's architecture (its target modules are "
                           "the decoder blocks' linear layers), and it cannot be read here",
                           "use a model folder with config.json or a catalog name, or techniques.optimizer: adamw")
    # one setup; grpo/rloo: one per generation batch, largest first (TRL's own default, steps per
    # generation = the accumulation: search.steps_per_generation_options), which is the one taken
    setup = candidate_setups(fixed, budget)[0]
    return plan_for_setup(setup, budget.device, req.lora_alpha, req.lora_use_rslora, req.galore_update_proj_gap,
                          req.galore_scale, reasons=unpredicted_reasons(setup, req, budget))


def unpredicted_reasons(s: RunSetup, req: PlanRequest, budget: Budget) -> dict[str, str]:
    """One line per technique: set by whom, or the default taken (no numbers: nothing is predicted)."""

    def why(name: str, default: str) -> str:
        if not req.fixed(name):
            return default
        src = req.sources.get(name)
        return f"set by {src}" if src else "set"

    r: dict[str, str] = {}
    if req.fixed("mixed_precision"):
        r["mixed_precision"] = why("mixed_precision", "")
        if s.precision == "fp32" and budget.device != "cpu":
            r["mixed_precision"] += "; fp32 weights and compute (2x the memory of bf16)"
    elif req.weight_dtype is not None:
        r["mixed_precision"] = f"model.dtype {req.weight_dtype} in the recipe: {s.precision}"
    elif budget.device == "cpu":
        r["mixed_precision"] = "CPU run: fp32 (bf16 on CPU is slower here); mixed precision applies on a GPU"
    elif s.precision == "bf16":
        r["mixed_precision"] = "the card supports bf16: 16-bit weights, half the memory of fp32"
    else:
        r["mixed_precision"] = "the card has no bf16: fp16 autocast with fp32 master weights and loss scaling"
    r["lora"] = why("lora", "default: train LoRA adapters (16 bytes per adapter param instead of per weight)")
    r["quantization"] = why("quantization", "default: full-precision base")
    r["optimizer"] = why("optimizer", "default: torch AdamW")
    r["offload"] = why("offload", "default: no offload")
    r["gradient_checkpointing"] = why(
        "gradient_checkpointing", "on: activation_offload needs it" if s.gradient_checkpointing else "default: off")
    r["activation_offload"] = (
        f"off on the {budget.device.upper()}: activations are in host RAM already"
        if req.activation_offload and not s.activation_offload else why("activation_offload", "default: off"))
    batch = f"micro-batch {s.micro_batch_size} x {s.grad_accum} steps = batch {req.batch_size}"
    fixed_by = why("grad_accum", "") or why("micro_batch_size", "")
    r["gradient_accumulation"] = f"{batch}; {fixed_by}" if fixed_by else batch
    r["attention"] = why("attention", "default: SDPA (no s x s matrix stored)")
    r["tiled_mlp"] = why("tiled_mlp", "default: off")
    r["loss"] = (tq.fused_loss_fallback(req.sources.get("loss", "the recipe"), budget, s.model)
                 if req.loss == "fused" and s.loss != "fused" else why("loss", "default: standard cross-entropy"))
    return r


__all__ = ["UNPREDICTED_DEFAULTS", "UNPREDICTED_MAX_MICRO_BATCH", "unpredicted_plan", "unpredicted_reasons", "without_auto"]
