"""Recipe (+ command-line choices, + detected hardware) -> PlanRequest -> Plan: the one bridge into
the pure :mod:`lowvram.plan`, and the one entry point `lowvram train` and `lowvram plan` share, so
the two never disagree.

When the model's architecture can be read (catalog name, a folder with config.json, a cached hub
id) the memory-driven chooser (:mod:`lowvram.plan.choose`) picks every ``auto`` technique. When it
cannot (a GGUF-only folder, an unknown name in a recipe) :func:`resolve_fixed` gives fixed
defaults and the plan says that its memory was not predicted.

No torch here unless the hardware has to be detected (no ``--vram`` / ``LOWVRAM_VRAM``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.plan.types import Plan, dtype_precision, precisions_for_dtype
from lowvram.recipe import Recipe, TrainingSection
from lowvram.units import gib, parse_size
from lowvram.vocab import (
    ATTENTIONS,
    BNB_OPTIMIZERS,
    LOSSES,
    OFF_VALUES,
    OFFLOADS,
    ON_VALUES,
    OPTIMIZERS,
    PRECISIONS,
    QUANTIZATIONS,
    WEIGHT_DTYPE,
    on_off,
)

if TYPE_CHECKING:
    from lowvram.plan.request import PlanRequest

# `--method` is a shorthand for the lora and quantization techniques.
METHODS = {"full": (False, "none"), "lora": (True, "none"), "qlora": (True, ON_VALUES["quantization"])}


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


def check_dtype(recipe: Recipe) -> None:
    """model.dtype and a fixed mixed_precision must agree on the weights' dtype."""
    dtype, mp = recipe.model.dtype, recipe.techniques.mixed_precision
    fixed = "fp32" if mp == "off" else mp
    if dtype == "auto" or fixed in ("auto", "on") or fixed in precisions_for_dtype(dtype):
        return
    raise LowvramError(
        f"model.dtype {dtype} and techniques.mixed_precision {mp} disagree: {fixed} keeps "
        f"{WEIGHT_DTYPE[fixed]} weights",
        f"set mixed_precision to one of {', '.join(precisions_for_dtype(dtype))}, or model.dtype: auto")


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
    if quant != "none" and not lora:
        raise LowvramError("quantization needs lora", "set techniques.lora: on, or quantization: off")

    optim = _fixed_value("optimizer", t.optimizer)
    reasons["optimizer"] = "set in the recipe" if t.optimizer != "auto" else "default: torch AdamW"

    offload = _fixed_value("offload", t.offload)
    reasons["offload"] = "set in the recipe" if t.offload != "auto" else "default: no offload"

    # activation_offload: on needs checkpointing (auto checkpointing follows it, as in the search)
    gc = t.gradient_checkpointing == "on" or (t.gradient_checkpointing == "auto" and t.activation_offload == "on")
    reasons["gradient_checkpointing"] = ("set in the recipe" if t.gradient_checkpointing != "auto" else
                                         "on: activation_offload needs it" if gc else "default: off")
    # GPU only: a CPU run has no device memory to free (lowvram.plan.activations.activation_offloaded)
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
        **lora_fields(recipe), reasons=reasons,
    )


# --------------------------------------------------------------------------------------------
# Budget


def make_budget(vram: str | None = None, hardware=None, gpus: int = 1):
    """The memory the plan must fit in (``_budget``), with the optional extras not installed here
    (plans that need one rank after those that need nothing more). ``gpus``: processes on this
    node; the budget is the smallest free card among those they use."""
    from dataclasses import replace

    override = vram or os.environ.get("LOWVRAM_VRAM")
    if hardware is None and not override:
        from lowvram.hardware import detect_hardware

        hardware = detect_hardware()
    budget = _budget(vram, hardware)
    if hardware is not None and hardware.kind == "cuda" and hardware.devices and not override:
        budget = replace(budget, **detected_cuda_budget(hardware, gpus))
    return replace(budget, missing_extras=missing_extras())


def detected_cuda_budget(hardware, gpus: int = 1) -> dict:
    """Budget fields for detected CUDA cards: free memory read once per card, the smallest among
    the ``gpus`` used, and the CUDA context counted once.

    The plan's peak holds a ``cuda_context`` term. Free memory read after this process's context
    exists (``hardware.context_in_free``: torch.cuda.mem_get_info creates it) no longer holds it,
    so the modelled term is added back to the budget: the fit test becomes tensors + allocator
    slack <= free - margin, whatever the real context's size. A free size that still holds the
    context (context_in_free False) is the budget as it is."""
    from lowvram.plan.setup import cuda_overheads

    dev = hardware.tightest_device(gpus)
    free = hardware.free_bytes(gpus)
    n = len(hardware.used_devices(gpus))
    where = f"GPU {dev.index} ({dev.name})" if n == 1 else f"GPU {dev.index} ({dev.name}), the least free of GPUs 0-{n - 1}"
    if not hardware.context_in_free:
        return {"vram_bytes": free, "source": f"{where}: free memory"}
    context = cuda_overheads().context_bytes
    return {"vram_bytes": free + context,
            "source": f"{where}: {gib(free)} free after this process's CUDA context + the plan's "
                      f"{gib(context)} cuda_context term (the context counted once)"}


def missing_extras() -> tuple[str, ...]:
    """Optional extras (pyproject.toml) a plan may need that are not importable here."""
    import importlib.util

    return tuple(e for e, module in (("deepspeed", "deepspeed"), ("liger", "liger_kernel"))
                 if importlib.util.find_spec(module) is None)


def _budget(vram: str | None, hardware):
    """The memory the plan must fit in.

    - ``--vram`` / ``LOWVRAM_VRAM`` with no ``hardware`` given: a GPU of that free size is assumed
      (bf16 assumed too, and said so); torch is not imported.
    - Otherwise the hardware is detected: the first GPU's free memory; on a CPU-only machine the
      plan is for a CPU run against the available host RAM, and a note says so.
    """
    from lowvram.plan.request import Budget

    override = vram or os.environ.get("LOWVRAM_VRAM") or None
    flag = "--vram" if vram else "LOWVRAM_VRAM"
    if override and hardware is None:
        return Budget(parse_size(override), "cuda", bf16=True, bf16_known=False, source=f"{flag} {override}")
    if hardware is None:
        from lowvram.hardware import detect_hardware

        hardware = detect_hardware(override)
    hw = hardware
    if hw.kind == "cpu":
        if override:
            return Budget(parse_size(override), "cpu", bf16=False, bf16_known=True,
                          host_ram_bytes=hw.host_available_bytes, source=f"{flag} {override} (CPU run)")
        note = ("no GPU found: planning a CPU run against the available host RAM; "
                "pass --vram 24GB (or set LOWVRAM_VRAM) to plan for a GPU")
        return Budget(hw.host_available_bytes, "cpu", bf16=False, bf16_known=True,
                      host_ram_bytes=hw.host_available_bytes, source="host RAM available", notes=(note,))
    dev = hw.devices[0] if hw.devices else None
    source = f"{flag} {override}" if override else (f"{dev.name}: free memory" if dev else hw.kind)
    return Budget(hw.budget_bytes, hw.kind, bf16=hw.bf16, bf16_known=True,
                  host_ram_bytes=hw.host_available_bytes or None, source=source,
                  notes=tuple(hw.notes))


# --------------------------------------------------------------------------------------------
# Request: recipe choices, then command-line choices on top


def recipe_choices(recipe: Recipe) -> dict:
    """The recipe's fixed (non-auto) techniques as PlanRequest fields."""
    t = recipe.techniques
    out: dict = {}
    check_dtype(recipe)
    if t.mixed_precision not in ("auto", "on"):  # on = bf16 where supported: what auto picks
        out["mixed_precision"] = on_off(t.mixed_precision, None, OFF_VALUES["mixed_precision"])
    elif recipe.model.dtype != "auto":
        out["weight_dtype"] = recipe.model.dtype  # the chooser picks a precision storing it
    if t.gradient_checkpointing != "auto":
        out["gradient_checkpointing"] = t.gradient_checkpointing == "on"
    if t.activation_offload != "auto":
        out["activation_offload"] = t.activation_offload == "on"
    if isinstance(t.gradient_accumulation, int):
        out["grad_accum"] = t.gradient_accumulation
    elif t.gradient_accumulation == "off":
        out["grad_accum"] = 1
    if isinstance(recipe.training.micro_batch_size, int):
        out["micro_batch_size"] = recipe.training.micro_batch_size
    if t.lora != "auto":
        out["lora"] = t.lora == "on"
    if t.quantization != "auto":
        out["quantization"] = on_off(t.quantization, ON_VALUES["quantization"], OFF_VALUES["quantization"])
    if t.optimizer != "auto":
        out["optimizer"] = on_off(t.optimizer, ON_VALUES["optimizer"], OFF_VALUES["optimizer"])
    if t.offload != "auto":
        out["offload"] = on_off(t.offload, ON_VALUES["offload"], OFF_VALUES["offload"])
    if t.attention != "auto":
        out["attention"] = t.attention
    if t.loss != "auto":
        out["loss"] = t.loss
    return {k: v for k, v in out.items() if v is not None}


def flag_choices(method: str | None = None, **flags) -> tuple[dict, dict]:
    """Command-line choices as PlanRequest fields, and which flag set each (for the reasons)."""
    names = {
        "precision": ("mixed_precision", "--precision"), "quant": ("quantization", "--quant"),
        "optim": ("optimizer", "--optim"), "loss": ("loss", "--loss"), "attn": ("attention", "--attn"),
        "grad_accum": ("grad_accum", "--grad-accum"), "offload": ("offload", "--offload"),
        "gradient_checkpointing": ("gradient_checkpointing", "--gradient-checkpointing"),
        "activation_offload": ("activation_offload", "--activation-offload"),
        "seq_len": ("seq_len", "--seq-len"), "batch_size": ("batch_size", "--batch-size"),
        "gpus": ("gpus", "--gpus"), "lora_r": ("lora_r", "--lora-r"),
        "lora_targets": ("lora_targets", "--lora-targets"),
    }
    out: dict = {}
    sources: dict = {}
    if method is not None:
        if method not in METHODS:
            raise LowvramError(f"unknown method {method!r}", "use --method full, lora or qlora")
        out["lora"], quant = METHODS[method]
        sources["lora"] = f"--method {method}"
        if flags.get("quant") is None:
            out["quantization"] = quant
            sources["quantization"] = f"--method {method}"
    for key, value in flags.items():
        if value is None:
            continue
        field, flag = names[key]
        if key == "lora_targets" and isinstance(value, str):
            value = tuple(x.strip() for x in value.split(",") if x.strip())
        if key in ("gradient_checkpointing", "activation_offload"):
            flag = flag if value else flag.replace("--", "--no-", 1)
        out[field] = value
        switch = key in ("lora_targets", "gradient_checkpointing", "activation_offload")
        sources[field] = flag if switch else f"{flag} {_shown(value)}"
    return out, sources


def _shown(value) -> str:
    return ",".join(value) if isinstance(value, tuple) else str(value)


def build_request(model, recipe: Recipe | None = None, flags: dict | None = None,
                  flag_sources: dict | None = None):
    """PlanRequest: schema defaults, then the recipe, then the flags (flags win)."""
    from lowvram.plan.request import PlanRequest

    training = recipe.training if recipe else TrainingSection()
    fields: dict = {"seq_len": training.seq_len, "batch_size": training.batch_size}
    sources: dict = {}
    if recipe is not None:
        fields.update(lora_fields(recipe))
        fixed = recipe_choices(recipe)
        fields.update(fixed)
        sources.update({k: "the recipe" for k in fixed})
    for key, value in (flags or {}).items():
        fields[key] = value
    sources.update(flag_sources or {})
    # A flag fixing accumulation releases a micro-batch fixed by the recipe (and vice versa).
    if flags and "grad_accum" in flags and "micro_batch_size" not in flags:
        fields.pop("micro_batch_size", None)
    return PlanRequest(model=model, sources=sources, **fields)


def lora_fields(recipe: Recipe) -> dict:
    """The recipe's lora section as PlanRequest / Plan fields."""
    lc = recipe.lora
    targets = (lc.target_modules,) if isinstance(lc.target_modules, str) else tuple(lc.target_modules)
    return {"lora_r": lc.r, "lora_alpha": lc.alpha, "lora_dropout": lc.dropout, "lora_targets": targets}


def recipe_model(recipe: Recipe):
    """The recipe's model as a ModelSpec (a local folder resolves against the recipe file)."""
    from lowvram.plan.models import resolve_model

    name = recipe.model.name_or_path
    local = recipe.resolve_path(name)
    return resolve_model(str(local) if local.exists() else name)


# --------------------------------------------------------------------------------------------
# The shared entry


def plan_for_recipe(recipe: Recipe, vram: str | None = None, hardware=None, gpus: int = 1) -> Plan:
    """The plan `lowvram train` runs with (and `lowvram plan RECIPE` shows).

    ``gpus``: data-parallel processes in all (``--gpus`` x ``--nodes``); memory is per GPU."""
    if hardware is None:
        from lowvram.hardware import detect_hardware

        hardware = detect_hardware(vram)
    check_card(recipe, hardware, vram)
    try:
        spec = recipe_model(recipe)
    except LowvramError as err:
        return check_runnable(_fixed_with_note(recipe, hardware.kind, hardware.bf16, err, gpus), hardware)
    from lowvram.plan.choose import choose_plan

    budget = make_budget(vram, hardware, gpus)
    flags, sources = ({"gpus": gpus}, {"gpus": f"--gpus {gpus}"}) if gpus > 1 else ({}, {})
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


@dataclass(frozen=True)
class Replanner:
    """What a run asks the planner once it is under way, built here from the recipe's request and
    handed down to train/ (which imports nothing from planning, STYLE.md): the peak at another
    sequence length, and the next cheaper plan after an out-of-memory error. ``request`` None:
    the model could not be read, so neither can be predicted."""

    request: PlanRequest | None = None

    def peak_at(self, plan: Plan, seq_len: int) -> int | None:
        """The plan's peak if every batch were ``seq_len`` tokens long.

        Batches are padded to their longest row, not to ``training.seq_len``: on data shorter than
        seq_len the run peaks at the longest batch it meets, which this predicts."""
        breakdown = self.breakdown_at(plan, seq_len)
        return None if breakdown is None else sum(breakdown.values())

    def breakdown_at(self, plan: Plan, seq_len: int) -> dict[str, int] | None:
        """The parts of :meth:`peak_at` (the plan's breakdown keys, summing to it)."""
        from lowvram.plan.memory import estimate_memory
        from lowvram.plan.setup import RunSetup

        if self.request is None:
            return None
        setup = RunSetup(
            model=self.request.model, precision=plan.mixed_precision, quantization=plan.quantization,
            lora=plan.lora, lora_r=plan.lora_r, lora_targets=plan.lora_targets, lora_dropout=plan.lora_dropout,
            optimizer=plan.optimizer, gradient_checkpointing=plan.gradient_checkpointing,
            attention=plan.attention, loss=plan.loss, micro_batch_size=plan.micro_batch_size,
            seq_len=seq_len, grad_accum=plan.grad_accum, gpus=plan.gpus, offload=plan.offload,
            device=plan.device, activation_offload=plan.activation_offload,
        )
        return dict(estimate_memory(setup).breakdown)

    def next_cheaper(self, plan: Plan, measured_peak_bytes: int | None) -> Plan | None:
        """The plan to retry with after ``plan`` ran out of memory (the same request: the recipe's
        fixed techniques stay fixed, the effective batch is kept); None when nothing is cheaper."""
        from lowvram.plan.choose import next_cheaper

        if self.request is None:
            return None
        req = replace(self.request, gpus=plan.gpus) if plan.gpus > 1 else self.request
        return next_cheaper(plan, req, measured_peak_bytes)


def replanner_for(recipe: Recipe) -> Replanner:
    """The Replanner for a run of ``recipe`` (its request without command-line flags, as the
    chooser's OOM re-plan has always used it)."""
    try:
        spec = recipe_model(recipe)
    except LowvramError:
        return Replanner()
    return Replanner(build_request(spec, recipe))


def check_card(recipe: Recipe, hardware, vram: str | None = None) -> None:
    """Before planning: a budget no run fits in, or a recipe forcing what the card cannot do."""
    from lowvram.plan.setup import cuda_overheads

    override = vram or os.environ.get("LOWVRAM_VRAM") or None
    budget = parse_size(override) if override else hardware.budget_bytes
    context = cuda_overheads().context_bytes
    # A --vram budget is GPU memory (also when planning on a machine without one). Free memory
    # read after this process's context existed does not hold the context: the plan says
    # whether anything fits in it.
    holds_context = bool(override) or (hardware.kind == "cuda" and not hardware.context_in_free)
    if holds_context and budget is not None and budget <= context:
        shown = f"--vram {override}" if override else "the free GPU memory"
        raise LowvramError(
            f"{shown} ({gib(budget)}) is no more than the CUDA context alone "
            f"({gib(context)}): nothing can train in it",
            "pass the card's free memory, e.g. --vram 8GB (nvidia-smi shows it), or free the GPU")
    mp = recipe.techniques.mixed_precision
    if hardware.kind == "cuda" and mp in ("bf16", "bf16-mixed") and not hardware.bf16:
        name = hardware.devices[0].name if hardware.devices else "this GPU"
        raise LowvramError(
            f"techniques.mixed_precision: {mp} needs bf16, which {name} does not support "
            "(bf16 needs compute capability 8.0, Ampere or newer)",
            "set techniques.mixed_precision: fp16-mixed (or auto: lowvram picks what the card supports)")
    quant = recipe.techniques.quantization
    _check_bnb(ON_VALUES["quantization"] if quant == "on" else quant, recipe.techniques.optimizer, hardware)


def check_runnable(plan: Plan, hardware) -> Plan:
    """After planning: bitsandbytes techniques need bitsandbytes, on a device it supports."""
    _check_bnb(plan.quantization, plan.optimizer, hardware)
    return plan


def _check_bnb(quantization: str, optimizer: str, hardware) -> None:
    needs_bnb = [f"quantization {quantization}"] if quantization not in ("none", "off", "auto") else []
    if optimizer in (*BNB_OPTIMIZERS, "on"):
        needs_bnb.append(f"optimizer {ON_VALUES['optimizer'] if optimizer == 'on' else optimizer}")
    if not needs_bnb:
        return
    import importlib.util

    why = None
    if hardware.kind == "mps":
        why = "bitsandbytes has no Apple MPS support"
    elif importlib.util.find_spec("bitsandbytes") is None:
        why = "bitsandbytes is not installed"
    if why:
        raise LowvramError(
            f"{' and '.join(needs_bnb)} need bitsandbytes: {why}",
            "set techniques.quantization: off and techniques.optimizer: adamw"
            + (" (or pip install bitsandbytes)" if hardware.kind != "mps" else ""))


def _fixed_with_note(recipe: Recipe, kind: str, bf16: bool, err: LowvramError, gpus: int = 1) -> Plan:
    plan = resolve_fixed(recipe, kind, bf16, gpus)
    plan.reasons["memory"] = f"memory not predicted: {err.message} (fixed defaults used)"
    return plan


# --------------------------------------------------------------------------------------------
# `lowvram plan`: recipe and/or flags -> Choice (or a fixed Plan when memory cannot be predicted)

_CHOICES = {
    "method": tuple(METHODS),
    "precision": PRECISIONS,
    "quant": QUANTIZATIONS,
    "optim": OPTIMIZERS,
    "loss": LOSSES,
    "attn": ATTENTIONS,
    "offload": OFFLOADS,
}


def check_choice(name: str, value: str | None) -> None:
    """A flag value outside its choices -> UsageError (exit 2) listing them."""
    from lowvram.errors import UsageError

    allowed = _CHOICES[name]
    if value is not None and value not in allowed:
        import difflib

        close = difflib.get_close_matches(value, allowed, n=1)
        guess = f"did you mean {close[0]}? " if close else ""
        raise UsageError(f"--{name} {value!r} is not one of: {', '.join(allowed)}",
                         f"{guess}e.g. --{name} {allowed[0]}")


def make_plan(recipe: Recipe | None = None, model: str | None = None, vram: str | None = None,
              method: str | None = None, hardware=None, **flags):
    """The plan `lowvram plan` shows: a Choice, or a fixed Plan if the model cannot be read."""
    from lowvram.plan.choose import choose_plan
    from lowvram.plan.models import resolve_model

    for name in ("precision", "quant", "optim", "loss", "attn", "offload"):
        check_choice(name, flags.get(name))
    check_choice("method", method)
    if recipe is None and model is None:
        raise LowvramError("nothing to plan: give a recipe or --model",
                           "e.g. lowvram plan --model llama-2-7b --vram 24GB, or lowvram plan recipes/quickstart.yaml")
    fields, sources = flag_choices(method, **flags)
    if model is not None:
        spec = resolve_model(model)
    else:
        try:
            spec = recipe_model(recipe)
        except LowvramError as err:
            if hardware is None and (vram or os.environ.get("LOWVRAM_VRAM")):
                return _fixed_with_note(recipe, "cuda", True, err)  # a GPU budget, bf16 assumed
            if hardware is None:
                from lowvram.hardware import detect_hardware

                hardware = detect_hardware(vram)
            return _fixed_with_note(recipe, hardware.kind, hardware.bf16, err)
    budget = make_budget(vram, hardware, fields.get("gpus") or 1)
    return choose_plan(build_request(spec, recipe, fields, sources), budget)


def list_models() -> list[tuple[str, str, int]]:
    from lowvram.plan.models import catalog_names, count_parameters, resolve_model

    rows = []
    for name in catalog_names():
        spec = resolve_model(name)
        rows.append((name, spec.hf_id or "", count_parameters(spec)))
    return rows
