"""A Plan from fixed defaults, for a model whose architecture cannot be read (a GGUF-only folder,
an unknown name in a recipe): every ``auto`` resolved without a memory model, and the plan says
that its memory was not predicted."""

from __future__ import annotations

from lowvram.errors import LowvramError
from lowvram.plan.setup import quantization_conflict
from lowvram.plan.types import Plan, dtype_precision
from lowvram.planning.budget import missing_extras
from lowvram.planning.request import check_dtype, galore_fields, lora_fields
from lowvram.recipe import Recipe
from lowvram.vocab import OFF_VALUES, ON_VALUES, PRECISIONS, on_off


def _precision(value: str, kind: str, bf16: bool, dtype: str = "auto") -> tuple[str, str]:
    if value in PRECISIONS:
        return value, "set in the recipe"
    if dtype != "auto":
        picked = dtype_precision(dtype, kind, bf16)
        return picked, f"model.dtype {dtype} in the recipe: {picked}"
    if value == "off":
        return "fp32", "mixed_precision off in the recipe: fp32 weights and compute (2x the memory of bf16)"
    if kind == "cpu":
        # CPU autocast in bf16 is slower than fp32 on most CPUs; say so instead of choosing silently.
        return "fp32", "CPU run: fp32 (bf16 on CPU is slower here); mixed precision applies on a GPU"
    if bf16:
        return "bf16", "the card supports bf16: 16-bit weights, half the memory of fp32"
    return "fp16-mixed", "the card has no bf16: fp16 autocast with fp32 master weights and loss scaling"


def _fixed_value(name: str, value: str) -> str:
    """A recipe value with no memory model: ``on`` -> the technique's on-value, auto/off -> off."""
    off = OFF_VALUES[name]
    return off if value in ("auto", "off") else on_off(value, ON_VALUES[name], off)


def resolve_fixed(recipe: Recipe, kind: str = "cpu", bf16: bool = False, gpus: int = 1) -> Plan:
    """Resolve every ``auto`` to a fixed default (no memory model involved)."""
    t = recipe.techniques
    reasons: dict[str, str] = {}
    check_dtype(recipe)
    precision, reasons["mixed_precision"] = _precision(t.mixed_precision, kind, bf16, recipe.model.dtype)

    lora = t.lora != "off"
    reasons["lora"] = "set in the recipe" if t.lora != "auto" else "default: train LoRA adapters (16 bytes per adapter param instead of per weight)"

    quant = _fixed_value("quantization", t.quantization)
    reasons["quantization"] = "set in the recipe" if t.quantization not in ("auto",) else "default: full-precision base"
    conflict = quantization_conflict(quant, lora)
    if conflict:
        raise LowvramError(conflict, "set techniques.lora: on, or quantization: off")

    optim = _fixed_value("optimizer", t.optimizer)
    reasons["optimizer"] = "set in the recipe" if t.optimizer != "auto" else "default: torch AdamW"

    offload = _fixed_value("offload", t.offload)
    reasons["offload"] = "set in the recipe" if t.offload != "auto" else "default: no offload"

    # activation_offload: on needs checkpointing (auto checkpointing follows it, as in the search)
    gc = t.gradient_checkpointing == "on" or (t.gradient_checkpointing == "auto" and t.activation_offload == "on")
    reasons["gradient_checkpointing"] = ("set in the recipe" if t.gradient_checkpointing != "auto" else
                                         "on: activation_offload needs it" if gc else "default: off")
    # GPU only: a CPU run has no device memory to free (lowvram.plan.memory.activation_offloaded)
    act_off = t.activation_offload == "on" and kind == "cuda"
    reasons["activation_offload"] = ("set in the recipe" if act_off else
                                     f"off on the {kind.upper()}: activations are in host RAM already"
                                     if t.activation_offload == "on" else "default: off")

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
    if loss == "fused" and (kind != "cuda" or "liger" in missing_extras()):
        loss = "chunked"  # the fallback (lowvram.train.loss); Liger's kernels need CUDA and the extra
        reasons["loss"] = ("chunked: the recipe asked for fused, but Liger Kernel's fused loss needs CUDA and "
                           "the liger extra (pip install 'lowvram[liger]'); the chunked loss runs instead")
    return Plan(
        device=kind, mixed_precision=precision, gradient_checkpointing=gc, micro_batch_size=micro,
        grad_accum=accum, lora=lora, quantization=quant, optimizer=optim, offload=offload,
        attention=attention, loss=loss, gpus=gpus, activation_offload=act_off, seq_len=recipe.training.seq_len,
        **lora_fields(recipe), **galore_fields(recipe), reasons=reasons,
    )


def fixed_with_note(recipe: Recipe, kind: str, bf16: bool, err: LowvramError, gpus: int = 1) -> Plan:
    plan = resolve_fixed(recipe, kind, bf16, gpus)
    plan.reasons["memory"] = f"memory not predicted: {err.message} (fixed defaults used)"
    return plan
