"""The hardware side of planning: the memory budget (``--vram``, ``LOWVRAM_VRAM`` or the detected
card), and the checks of what the card can run before and after planning (bf16, bitsandbytes).

No torch here unless the hardware has to be detected (no ``--vram`` / ``LOWVRAM_VRAM``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.plan.cards import read_vram
from lowvram.plan.setup import expandable_segments_set
from lowvram.plan.types import Plan
from lowvram.units import gib
from lowvram.vocab import BNB_OPTIMIZERS, GALORE_8BIT_OPTIMIZERS, ON_VALUES

if TYPE_CHECKING:  # the recipe's pydantic schema is imported only where a recipe is read
    from lowvram.hardware import Hardware
    from lowvram.recipe import Recipe


@dataclass(frozen=True)
class Machine:
    """What a command's plans read of this machine, read once (read_machine) and handed down:
    every budget of the command (the context table's seven cards too) comes from it."""

    hardware: Hardware | None  # None: the card is given (--vram / LOWVRAM_VRAM) and not read
    host_ram: dict  # Budget's host_ram_bytes and host_ram_source (host_ram_budget)
    missing_extras: tuple[str, ...]  # optional extras not installed here
    expandable_segments: bool  # the run's allocator setting (PYTORCH_CUDA_ALLOC_CONF)


def read_machine(vram: str | None = None, gpus: int = 1, host_ram: str | None = None, hardware=None,
                 cards: bool | None = None) -> Machine:
    """This machine as planning needs it, read once per command. The cards are read (the one
    detect_hardware of a command: torch, in a child process) unless ``hardware`` is given or a
    --vram / LOWVRAM_VRAM budget makes them unneeded; ``cards`` True: read them anyway (`lowvram
    train` checks what the card can run), False: never (the context table's card sizes).
    ``gpus``: the processes on this node (only their cards are read); ``host_ram`` (or
    LOWVRAM_HOST_RAM): the host RAM the plan may use, else this machine's available memory."""
    if cards is None:
        cards = not (vram or os.environ.get("LOWVRAM_VRAM"))
    if hardware is None and cards:
        from lowvram.hardware import detect_hardware

        hardware = detect_hardware(vram, gpus=gpus)
    # `lowvram train` sets expandable segments unless PYTORCH_CUDA_ALLOC_CONF is set
    # (lowvram.train.build.allocator); a value the user set is planned as it is
    expandable = expandable_segments_set(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    return Machine(hardware, host_ram_budget(host_ram, hardware), missing_extras(), expandable)


def make_budget(vram: str | None = None, hardware=None, gpus: int = 1, host_ram: str | None = None,
                machine: Machine | None = None):
    """The memory the plan must fit in (``_budget``), with the optional extras not installed here
    (plans that need one rank after those that need nothing more). ``gpus``: processes on this
    node; the budget is the smallest free card among those they use. ``machine``: this machine
    as the command read it (read_machine); else read here from ``hardware`` and ``host_ram``."""
    from dataclasses import replace

    machine = machine or read_machine(vram, gpus, host_ram, hardware)
    hardware = machine.hardware
    override = vram or os.environ.get("LOWVRAM_VRAM")
    budget = _budget(vram, hardware)
    if hardware is not None and hardware.kind == "cuda" and hardware.devices and not override:
        budget = replace(budget, **detected_cuda_budget(hardware, gpus))
    if budget.device != "cpu":  # a CPU run's host RAM is its budget already
        budget = replace(budget, **machine.host_ram)
    return replace(budget, missing_extras=machine.missing_extras, expandable_segments=machine.expandable_segments)


def host_ram_budget(host_ram: str | None, hardware=None) -> dict:
    """Budget fields for host RAM: --host-ram / LOWVRAM_HOST_RAM read exactly (a plan for another
    machine is reproducible), else this machine's available memory (read without torch)."""
    from lowvram.units import parse_size

    flag = "--host-ram" if host_ram else "LOWVRAM_HOST_RAM"
    given = host_ram or os.environ.get("LOWVRAM_HOST_RAM") or None
    if given:
        return {"host_ram_bytes": parse_size(given), "host_ram_source": f"{flag} {given}"}
    if hardware is not None and hardware.host_available_bytes:
        available = hardware.host_available_bytes
    else:
        from lowvram.hardware import host_memory

        available = host_memory()[1]
    if not available:
        return {"host_ram_bytes": None, "host_ram_source": "not known (pass --host-ram SIZE)"}
    return {"host_ram_bytes": available, "host_ram_source": "available on this machine"}


def detected_cuda_budget(hardware, gpus: int = 1) -> dict:
    """Budget fields for detected CUDA cards: free memory read once per card, the smallest among
    the ``gpus`` used, and the CUDA context counted once.

    The plan's peak holds a ``cuda_context`` term. Free memory read after a context exists
    (``hardware.context_in_free``: torch.cuda.mem_get_info creates it, in the probe's child
    process, whose context ends before the run's own takes its place; the process that plans and
    launches holds none) no longer holds it, so the modelled term is added back to the budget:
    the fit test becomes tensors + allocator slack <= free - margin, whatever the real context's
    size. A free size that still holds the context (context_in_free False) is the budget as it is."""
    from lowvram.plan.setup import cuda_overheads

    dev = hardware.tightest_device(gpus)
    free = hardware.free_bytes(gpus)
    n = len(hardware.used_devices(gpus))
    where = f"GPU {dev.index} ({dev.name})" if n == 1 else f"GPU {dev.index} ({dev.name}), the least free of GPUs 0-{n - 1}"
    capability = _lowest_capability(hardware.used_devices(gpus))
    if not hardware.context_in_free:
        return {"vram_bytes": free, "source": f"{where}: free memory", "compute_capability": capability}
    context = cuda_overheads().context_bytes
    return {"vram_bytes": free + context, "compute_capability": capability,
            "source": f"{where}: {gib(free)} free after a CUDA context + the plan's "
                      f"{gib(context)} cuda_context term (the context counted once)"}


def missing_extras() -> tuple[str, ...]:
    """Optional extras (pyproject.toml) a plan may need that are not importable here, and
    "cpu_adam" where DeepSpeed's CPU Adam cannot be built (lowvram.deps.cpu_adam_build_problems)."""
    import importlib.util

    extras = (("deepspeed", "deepspeed"), ("liger", "liger_kernel"), ("galore", "galore_torch"),
              ("lomo", "lomo_optim"), ("torchao", "torchao"),
              ("apollo", "apollo_torch"))
    missing = tuple(e for e, module in extras if importlib.util.find_spec(module) is None)
    from lowvram.deps import cpu_adam_build_problems

    # DeepSpeed's CPU Adam is built at first use (issue 41 item 12): where it cannot be, plans that
    # offload the optimizer rank after those that need nothing more, and say so
    return missing + (("cpu_adam",) if cpu_adam_build_problems() else ())


def _budget(vram: str | None, hardware):
    """The memory the plan must fit in.

    - ``--vram`` / ``LOWVRAM_VRAM`` with no ``hardware`` given: a GPU of that free size is assumed
      (bf16 assumed too, and said so); torch is not imported.
    - Otherwise the hardware is detected: the first GPU's free memory; on a CPU-only machine the
      plan is for a CPU run against the available host RAM, and a note says so.
    """
    from lowvram.plan.choose.request import Budget

    override = vram or os.environ.get("LOWVRAM_VRAM") or None
    flag = "--vram" if vram else "LOWVRAM_VRAM"
    reading = read_vram(override) if override else None
    given = f"{flag} {override}" + (f": {reading.how}" if reading and reading.how else "")
    if override and hardware is None:
        return Budget(reading.bytes, "cuda", bf16=True, bf16_known=False, source=given)
    hw = hardware  # read_machine read it: no budget without a card or a size
    if hw.kind == "cpu":
        if override:
            return Budget(reading.bytes, "cpu", bf16=False, bf16_known=True,
                          host_ram_bytes=hw.host_available_bytes, source=f"{given} (CPU run)")
        note = ("no GPU found: planning a CPU run against the available host RAM; "
                "pass --vram 24GB (or set LOWVRAM_VRAM) to plan for a GPU")
        return Budget(hw.host_available_bytes, "cpu", bf16=False, bf16_known=True,
                      host_ram_bytes=hw.host_available_bytes, source="host RAM available", notes=(note,))
    dev = hw.devices[0] if hw.devices else None
    source = given if override else (f"{dev.name}: free memory" if dev else hw.kind)
    return Budget(hw.budget_bytes, hw.kind, bf16=hw.bf16, bf16_known=True,
                  compute_capability=_lowest_capability(hw.devices),
                  host_ram_bytes=hw.host_available_bytes or None, source=source,
                  notes=tuple(hw.notes))


def _lowest_capability(devices) -> tuple[int, int] | None:
    """The lowest CUDA compute capability among ``devices`` (what every rank can run), or None."""
    return min((tuple(d.compute_capability) for d in devices if d.compute_capability), default=None)


def check_card(recipe: Recipe, hardware, vram: str | None = None) -> None:
    """Before planning: a budget no run fits in, or a recipe forcing what the card cannot do."""
    from lowvram.plan.setup import cuda_overheads

    override = vram or os.environ.get("LOWVRAM_VRAM") or None
    budget = read_vram(override).bytes if override else hardware.budget_bytes
    context = cuda_overheads().context_bytes
    # A --vram budget is GPU memory (also when planning on a machine without one). Free memory
    # read after a context existed (the probe's) does not hold the context: the plan says
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
    # techniques.attention: flash_attention_2 where it cannot run: the planner refuses it
    # (lowvram.plan.choose.request.check_attention), whether the memory is predicted or not


def check_runnable(plan: Plan, hardware) -> Plan:
    """After planning: bitsandbytes techniques need bitsandbytes, on a device it supports."""
    _check_bnb(plan.quantization, plan.optimizer, hardware)
    return plan


def _check_bnb(quantization: str, optimizer: str, hardware) -> None:
    needs_bnb = [f"quantization {quantization}"] if quantization not in ("none", "off", "auto") else []
    if optimizer in (*BNB_OPTIMIZERS, *GALORE_8BIT_OPTIMIZERS, "on"):
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
