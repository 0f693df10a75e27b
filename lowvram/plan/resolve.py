"""Recipe -> Plan. The one entry point `lowvram train` and `lowvram plan` share.

Fixed choices in the recipe are respected; ``auto`` ones get a default here. The memory-driven
automatic choice (planner issue) plugs in at :func:`plan_for_recipe`.
"""

from __future__ import annotations

from lowvram.errors import LowvramError
from lowvram.plan.types import Plan
from lowvram.recipe import Recipe

ON_VALUES = {
    "quantization": "nf4-dq",
    "optimizer": "adamw_8bit",
    "offload": "optimizer",
}


def _precision(value: str, kind: str, bf16: bool) -> tuple[str, str]:
    if value in ("bf16", "fp16", "bf16-mixed", "fp16-mixed", "fp32"):
        return value, "set in the recipe"
    if value == "off":
        return "fp32", "mixed_precision off in the recipe: fp32 weights and compute (2x the memory of bf16)"
    if kind == "cpu":
        # CPU autocast in bf16 is slower than fp32 on most CPUs; say so instead of choosing silently.
        return "fp32", "CPU run: fp32 (bf16 on CPU is slower here); mixed precision applies on a GPU"
    if bf16:
        return "bf16", "the card supports bf16: 16-bit weights, half the memory of fp32"
    return "fp16-mixed", "the card has no bf16: fp16 autocast with fp32 master weights and loss scaling"


def resolve_fixed(recipe: Recipe, kind: str = "cpu", bf16: bool = False, gpus: int = 1) -> Plan:
    """Resolve every ``auto`` to a fixed default (no memory model involved)."""
    t = recipe.techniques
    reasons: dict[str, str] = {}
    precision, reasons["mixed_precision"] = _precision(t.mixed_precision, kind, bf16)

    lora = t.lora != "off"
    reasons["lora"] = "set in the recipe" if t.lora != "auto" else "default: train LoRA adapters (16 bytes per adapter param instead of per weight)"

    quant = t.quantization
    if quant == "on":
        quant = ON_VALUES["quantization"]
    if quant in ("auto", "off"):
        quant = "none"
    reasons["quantization"] = "set in the recipe" if t.quantization not in ("auto",) else "default: full-precision base"
    if quant != "none" and not lora:
        raise LowvramError("quantization needs lora", "set techniques.lora: on, or quantization: off")

    optim = t.optimizer
    if optim == "on":
        optim = ON_VALUES["optimizer"]
    if optim in ("auto", "off"):
        optim = "adamw"
    reasons["optimizer"] = "set in the recipe" if t.optimizer != "auto" else "default: torch AdamW"

    offload = t.offload
    if offload == "on":
        offload = ON_VALUES["offload"]
    if offload in ("auto", "off"):
        offload = "none"
    reasons["offload"] = "set in the recipe" if t.offload != "auto" else "default: no offload"

    gc = t.gradient_checkpointing == "on"
    reasons["gradient_checkpointing"] = "set in the recipe" if t.gradient_checkpointing != "auto" else "default: off"

    batch = recipe.training.batch_size
    per_step = batch // gpus if batch % gpus == 0 else None
    if per_step is None:
        raise LowvramError(
            f"training.batch_size {batch} is not divisible by {gpus} GPUs",
            f"use a multiple of {gpus}",
        )
    if isinstance(t.gradient_accumulation, int):
        accum = t.gradient_accumulation
        if per_step % accum:
            raise LowvramError(
                f"training.batch_size {batch} is not divisible by gradient_accumulation {accum} x {gpus} GPUs",
                "make batch_size = micro_batch_size x gradient_accumulation x GPUs",
            )
        micro = per_step // accum
        reasons["gradient_accumulation"] = "set in the recipe"
    else:
        mb = recipe.training.micro_batch_size
        if t.gradient_accumulation == "off":
            micro = per_step
        elif mb == "auto":
            micro = min(per_step, 4)
            while per_step % micro:
                micro -= 1
        else:
            micro = mb
        if per_step % micro:
            raise LowvramError(
                f"training.batch_size {batch} is not divisible by micro_batch_size {micro} x {gpus} GPUs",
                "make batch_size = micro_batch_size x gradient_accumulation x GPUs",
            )
        accum = per_step // micro
        reasons["gradient_accumulation"] = f"micro-batch {micro} x {accum} steps = batch {batch}"

    attention = "sdpa" if t.attention == "auto" else t.attention
    reasons["attention"] = "set in the recipe" if t.attention != "auto" else "default: SDPA (no s x s matrix stored)"
    loss = "standard" if t.loss == "auto" else t.loss
    reasons["loss"] = "set in the recipe" if t.loss != "auto" else "default: standard cross-entropy"
    return Plan(
        device=kind, mixed_precision=precision, gradient_checkpointing=gc, micro_batch_size=micro,
        grad_accum=accum, lora=lora, quantization=quant, optimizer=optim, offload=offload,
        attention=attention, loss=loss, gpus=gpus, reasons=reasons,
    )


def plan_for_recipe(recipe: Recipe, vram: str | None = None, hardware=None) -> Plan:
    """The plan `lowvram train` runs with."""
    if hardware is None:
        from lowvram.hardware import detect_hardware

        hardware = detect_hardware(vram)
    return resolve_fixed(recipe, hardware.kind, hardware.bf16)
