"""Budget + request -> the cheapest plan that fits, every choice with its reason.

The search is exhaustive over the techniques left on ``auto`` (a few hundred memory estimates,
well under a second): each candidate gets a peak from :func:`lowvram.plan.memory.estimate_memory`
and a step-time factor from :mod:`lowvram.plan.techniques`. Among the candidates that fit, the
first level of what the plan gives up wins (``plan_level``: full fine-tuning on the GPU, LoRA,
QLoRA, offload to CPU RAM), then a plan that needs no missing extra (DeepSpeed), then the
fastest, then the larger micro-batch, then the smaller peak (``_rank``). The ladder (one technique
after another, in tier order) stays as the explanation; the search is not bound to its order.
A technique fixed by the user is never changed; ``lora: off`` is never turned into LoRA.

Pure: no torch, no CUDA. The caller builds the :class:`Budget` (from ``--vram`` or
``detect_hardware``); tests pass a fake one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from lowvram.errors import LowvramError
from lowvram.plan import memory, sharding
from lowvram.plan import techniques as tq
from lowvram.plan.calibration import term_checks
from lowvram.plan.explain import Estimator, technique_reasons
from lowvram.plan.memory import estimate_memory
from lowvram.plan.models import ModelSpec, catalog_names, count_parameters, resolve_model
from lowvram.plan.setup import MemoryEstimate, RunSetup, offload_conflict
from lowvram.plan.types import Plan, dtype_precision
from lowvram.units import gib, mem

# Safety margin: memory the plan leaves unused for what the model does not see (other processes
# on the card, fragmentation spikes, the first-step warm-up). 5% of the card, at least 256 MiB.
MARGIN_FRACTION = 0.05
MIN_MARGIN_BYTES = 256 * 2**20

# Several GPUs (issue 6): sharding the model states is exact (same result as DDP) and costs
# communication (~1.2x, techniques.OFFLOAD_SLOWDOWN), about what gradient checkpointing costs; so
# it is tried right after checkpointing, before the 8-bit optimizer, LoRA and a quantized base.
# Offload to CPU RAM (fsdp-offload) stays on the last tier. FSDP2 comes before DeepSpeed ZeRO-3:
# the same memory (ZeRO-3 = FSDP full shard, 16P/N) and it needs nothing beyond torch.
TIER_SHARD = tq.TIER_CHECKPOINTING + 0.5
SHARDED = ("zero2", "zero3", "fsdp")
MULTI_GPU_OFFLOADS = ["none", "fsdp", "fsdp-offload"]

# Longest micro-batch the max_micro_batch_size search tries.
_MAX_MICRO_BATCH = 4096


def safety_margin_bytes(vram_bytes: int) -> int:
    return max(MIN_MARGIN_BYTES, int(vram_bytes * MARGIN_FRACTION))


def vram_needed_bytes(peak_bytes: int, min_margin_bytes: int = MIN_MARGIN_BYTES) -> int:
    """Smallest card (free bytes) whose budget after the margin holds ``peak_bytes``."""
    return max(peak_bytes + min_margin_bytes, int(peak_bytes / (1 - MARGIN_FRACTION)) + 1)


@dataclass(frozen=True)
class Budget:
    """What the plan must fit in. Bytes."""

    vram_bytes: int  # free memory of the card (or the --vram override, or host RAM on CPU)
    device: str = "cuda"  # "cuda" | "mps" | "cpu"
    bf16: bool = True  # the card supports bf16
    bf16_known: bool = True  # False: assumed (a --vram budget; no card was queried)
    host_ram_bytes: int | None = None  # available host RAM, when planning for this machine
    source: str = ""  # where vram_bytes came from, shown to the user
    notes: tuple[str, ...] = ()
    # Optional extras not installed here ("deepspeed"): plans that need one rank after the plans
    # that need nothing more (lowvram.planning.make_budget fills it; tests pass their own).
    missing_extras: tuple[str, ...] = ()
    # The margin's floor: MIN_MARGIN_BYTES on a real card; an emulated card scaled down
    # (bench/emulated_cards.py) scales it by the same factor.
    min_margin_bytes: int = MIN_MARGIN_BYTES

    @property
    def safety_margin_bytes(self) -> int:
        return max(self.min_margin_bytes, int(self.vram_bytes * MARGIN_FRACTION))

    @property
    def usable_bytes(self) -> int:
        return self.vram_bytes - self.safety_margin_bytes


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for. ``None`` = auto (the chooser decides); anything else is fixed."""

    model: ModelSpec
    seq_len: int = 1024
    batch_size: int = 16  # effective batch: micro_batch_size x grad_accum x gpus
    gpus: int = 1
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ("all-linear",)
    lora_alpha: int = 32  # no memory effect; carried into the Plan for training
    lora_dropout: float = 0.0
    weight_dtype: str | None = None  # model.dtype fixed in the recipe: auto precision follows it
    mixed_precision: str | None = None
    gradient_checkpointing: bool | None = None
    grad_accum: int | None = None
    micro_batch_size: int | None = None
    lora: bool | None = None
    quantization: str | None = None
    optimizer: str | None = None
    offload: str | None = None
    activation_offload: bool | None = None
    attention: str | None = None
    loss: str | None = None
    # Where each fixed choice came from ("--optim", "the recipe"), for the reasons.
    sources: dict[str, str] = field(default_factory=dict)

    def fixed(self, name: str) -> bool:
        return getattr(self, name) is not None


@dataclass(frozen=True)
class Candidate:
    setup: RunSetup
    estimate: MemoryEstimate
    tier: float
    slowdown: float  # step time relative to bf16 + SDPA + full fine-tuning, largest micro-batch
    fits: bool

    @property
    def peak_bytes(self) -> int:
        return self.estimate.peak_bytes


@dataclass(frozen=True)
class Rung:
    """One row of the ladder: the peak after applying one more technique."""

    technique: str
    value: str
    peak_bytes: int
    saved_bytes: int
    slowdown: float
    fits: bool
    fixed: bool = False  # the user fixed this technique otherwise; the rung is skipped


@dataclass(frozen=True)
class Choice:
    """The chooser's answer: the plan and everything the report shows about it."""

    plan: Plan
    request: PlanRequest
    budget: Budget
    chosen: Candidate
    fits: bool
    alternatives: tuple[Candidate, ...]
    ladder: tuple[Rung, ...]
    max_seq_len: int  # longest seq_len that fits under this plan (0: none)
    max_micro_batch_size: int  # largest micro-batch that fits at this seq_len (0: none)
    min_vram_bytes: int  # smallest card that holds the lowest-peak plan allowed
    # Over every plan the request allows (not only the chosen one): the longest seq_len at
    # micro-batch 1 and the largest micro-batch at this seq_len, with the plan that reaches each.
    longest: tuple[int, RunSetup | None] = (0, None)
    largest_micro: tuple[int, RunSetup | None] = (0, None)
    suggestion: str | None = None  # when nothing fits: the single change that helps most
    suggestions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------
# Validation


def validate_request(req: PlanRequest) -> None:
    """Impossible values -> one LowvramError naming the flag and a fix."""
    positive = {
        "seq_len": req.seq_len, "batch_size": req.batch_size, "gpus": req.gpus, "lora_r": req.lora_r,
    }
    for name, value in positive.items():
        if value is None or value <= 0:
            flag = "--" + name.replace("_", "-")
            raise LowvramError(f"{name} must be a positive integer, got {value}", f"e.g. {flag} {_EXAMPLE[name]}")
    for name in ("grad_accum", "micro_batch_size"):
        value = getattr(req, name)
        if value is not None and value <= 0:
            raise LowvramError(f"{name} must be a positive integer, got {value}", "leave it out to let the planner choose")
    if req.quantization not in (None, "none") and req.lora is False:
        raise LowvramError(
            f"quantization {req.quantization} needs LoRA: a quantized base cannot be trained directly",
            "use --method qlora (or lora), or --quant none for full fine-tuning",
        )
    if req.activation_offload and req.gradient_checkpointing is False:
        raise LowvramError("activation_offload needs gradient checkpointing: it moves the checkpointed "
                           "layer inputs to host RAM", "drop --no-gradient-checkpointing, or the activation offload")
    if req.optimizer is not None and req.offload is not None:
        conflict = offload_conflict(req.optimizer, req.offload)
        if conflict:
            raise LowvramError(conflict, "use --optim adamw with it, or --offload fsdp-offload (FSDP2 "
                               "keeps your optimizer, its step on the CPU)")
    if req.batch_size % req.gpus:
        raise LowvramError(
            f"batch_size {req.batch_size} is not divisible by {req.gpus} GPUs",
            f"use a batch size that is a multiple of {req.gpus}",
        )
    per_gpu = req.batch_size // req.gpus
    if req.grad_accum is not None and per_gpu % req.grad_accum:
        raise LowvramError(
            f"batch_size {req.batch_size} is not divisible by grad_accum {req.grad_accum} x {req.gpus} GPU(s)",
            "make batch_size = micro_batch_size x grad_accum x GPUs",
        )
    if req.micro_batch_size is not None and per_gpu % req.micro_batch_size:
        raise LowvramError(
            f"batch_size {req.batch_size} is not divisible by micro_batch_size {req.micro_batch_size} x {req.gpus} GPU(s)",
            "make batch_size = micro_batch_size x grad_accum x GPUs",
        )
    if req.micro_batch_size is not None and req.grad_accum is not None:
        if req.micro_batch_size * req.grad_accum != per_gpu:
            raise LowvramError(
                f"micro_batch_size {req.micro_batch_size} x grad_accum {req.grad_accum} x {req.gpus} GPU(s) "
                f"!= batch_size {req.batch_size}",
                "fix two of the three and let the planner derive the third",
            )


_EXAMPLE = {"seq_len": 1024, "batch_size": 16, "gpus": 1, "lora_r": 16}


# --------------------------------------------------------------------------------------------
# Candidates


def auto_precision(budget: Budget, weight_dtype: str | None = None) -> str:
    """bf16 where the card has it, else fp16-mixed; fp32 on a CPU. A fixed model.dtype picks the
    precision that stores weights in it (lowvram.plan.types.dtype_precision)."""
    if weight_dtype is not None:
        return dtype_precision(weight_dtype, budget.device, budget.bf16)
    if budget.device == "cpu":
        return "fp32"
    return "bf16" if budget.bf16 else "fp16-mixed"


def _options(req: PlanRequest, budget: Budget) -> dict[str, list]:
    per_gpu = req.batch_size // req.gpus
    if req.micro_batch_size is not None:
        micros = [req.micro_batch_size]
    elif req.grad_accum is not None:
        micros = [per_gpu // req.grad_accum]
    else:
        micros = [d for d in range(per_gpu, 0, -1) if per_gpu % d == 0]
    on_gpu = budget.device != "cpu"

    def pick(name: str, auto: list) -> list:
        value = getattr(req, name)
        return [value] if value is not None else auto

    return {
        "precision": pick("mixed_precision", [auto_precision(budget, req.weight_dtype)]),
        "attention": pick("attention", ["sdpa"]),
        "loss": _loss_options(req, budget),
        "micro_batch_size": micros,
        "gradient_checkpointing": pick("gradient_checkpointing", [False, True]),
        # CUDA only: on a CPU (or MPS's unified memory) there is no device memory to free
        # (activations.activation_offloaded)
        "activation_offload": pick("activation_offload", [False, True]) if budget.device == "cuda" else [False],
        "optimizer": pick("optimizer", ["adamw", "adamw_8bit"]),
        "lora": pick("lora", [False, True]),
        "quantization": pick("quantization", ["none", "nf4-dq"]),
        "offload": pick("offload", _auto_offloads(req, on_gpu)),
    }


def _loss_options(req: PlanRequest, budget: Budget) -> list[str]:
    """standard, chunked, and Liger's fused loss where it can run. A fixed ``fused`` that cannot
    run here becomes the chunked loss (the fallback; the reason says why)."""
    fused_ok = tq.fused_loss_unavailable(budget, req.model) is None
    if req.loss is not None:
        return ["chunked" if req.loss == "fused" and not fused_ok else req.loss]
    return ["standard", "chunked"] + (["fused"] if fused_ok else [])


def _auto_offloads(req: PlanRequest, on_gpu: bool) -> list[str]:
    if not on_gpu:
        return ["none"]  # a CPU run (several processes: DDP over gloo)
    return MULTI_GPU_OFFLOADS if req.gpus > 1 else ["none", "optimizer", "full"]


def _setups(req: PlanRequest, budget: Budget) -> list[RunSetup]:
    o = _options(req, budget)
    per_gpu = req.batch_size // req.gpus
    # activation offload moves the checkpoints: only with checkpointing
    recompute = [(gc, ao) for gc in o["gradient_checkpointing"] for ao in o["activation_offload"] if gc or not ao]
    out = []
    for precision in o["precision"]:
        for attention in o["attention"]:
            for loss in o["loss"]:
                for micro in o["micro_batch_size"]:
                    for gc, act_off in recompute:
                        for optim in o["optimizer"]:
                            for lora in o["lora"]:
                                for quant in o["quantization"]:
                                    if quant != "none" and not lora:
                                        continue
                                    for offload in o["offload"]:
                                        if offload_conflict(optim, offload):
                                            continue  # DeepSpeed's CPU Adam replaces it
                                        out.append(RunSetup(
                                            model=req.model, precision=precision, quantization=quant,
                                            lora=lora, lora_r=req.lora_r, lora_targets=req.lora_targets,
                                            lora_dropout=req.lora_dropout,
                                            optimizer=optim, gradient_checkpointing=gc,
                                            attention=attention, loss=loss, micro_batch_size=micro,
                                            seq_len=req.seq_len, grad_accum=per_gpu // micro,
                                            gpus=req.gpus, offload=offload, device=budget.device,
                                            activation_offload=act_off,
                                        ))
    modelled = [s for s in out if memory.unmodelled(s) is None]
    if out and not modelled:
        raise LowvramError(f"cannot plan this run: {memory.unmodelled(out[0])}",
                           "use attention sdpa, or gradient_checkpointing off; or measure "
                           "the real step with `lowvram plan --simulate`")
    return modelled


def _largest_micro(req: PlanRequest) -> int:
    return req.batch_size // req.gpus


def _fits(est: MemoryEstimate, budget: Budget) -> bool:
    if est.peak_bytes > budget.usable_bytes:
        return False
    # Offload needs the host RAM too, when we know it (planning for this machine).
    return budget.host_ram_bytes is None or budget.device == "cpu" or est.cpu_ram_bytes <= budget.host_ram_bytes


def _candidate(setup: RunSetup, req: PlanRequest, budget: Budget, estimate: Estimator) -> Candidate:
    est = estimate(setup)
    largest = _largest_micro(req)
    tier = tq.setup_tier(setup)
    if setup.offload in SHARDED and setup.gpus > 1:
        tier = max(tq.setup_tier(replace(setup, offload="none")), TIER_SHARD)
    if setup.micro_batch_size < largest:
        tier = max(tier, tq.TIER_MICRO_BATCH)
    return Candidate(setup, est, tier, tq.setup_slowdown(setup, largest), _fits(est, budget))


# What a plan gives up, beyond speed: the search picks the fastest plan within the first of these
# levels that has a plan that fits. Level 0 trains the whole model with the same maths (precision,
# kernels, chunked loss, micro-batch + accumulation, checkpointing, 8-bit optimizer state, which
# matches 32-bit Adam's results: Dettmers et al. 2022; sharding over several GPUs); 1 trains
# adapters only (LoRA); 2 on a quantized base (QLoRA); 3 moves model states to CPU RAM (host RAM,
# PCIe, several times slower). Inside a level speed decides, not the ladder's order: the 8-bit
# optimizer (~3%) is taken before checkpointing (~25%) when either alone fits.
LEVEL_NAMES = ("full fine-tuning on the GPU", "LoRA", "QLoRA", "offload to CPU RAM")

# Optional extras each offload needs (pyproject.toml [project.optional-dependencies]).
EXTRAS = {o: ("deepspeed",) for o in sharding.ZERO_OFFLOADS}


def plan_level(setup: RunSetup) -> int:
    """The LEVEL_NAMES index of a plan."""
    if setup.offload not in ("none",) + SHARDED:
        return 3
    if setup.quantization != "none":
        return 2
    return 1 if setup.lora else 0


def missing_extras(setup: RunSetup, budget: Budget) -> tuple[str, ...]:
    """The extras ``setup`` needs that are not installed where the plan will run."""
    return tuple(e for e in EXTRAS.get(setup.offload, ()) if e in budget.missing_extras)


def _rank(c: Candidate, budget: Budget | None = None) -> tuple:
    """Search order among fitting plans: the lowest level (plan_level), then plans that need no
    missing extra, then the fastest (techniques.setup_slowdown); ties in speed go to the larger
    micro-batch (fewer passes), then to the smaller peak."""
    missing = bool(missing_extras(c.setup, budget)) if budget else False
    return (plan_level(c.setup), missing, round(c.slowdown, 6), -c.setup.micro_batch_size, c.peak_bytes)


# --------------------------------------------------------------------------------------------
# The choice


def choose_plan(req: PlanRequest, budget: Budget, estimate: Estimator = estimate_memory) -> Choice:
    """The cheapest plan that fits ``budget``; if none does, the closest one and what would help."""
    validate_request(req)
    cands = [_candidate(s, req, budget, estimate) for s in _setups(req, budget)]
    fitting = [c for c in cands if c.fits]
    lowest = min(cands, key=lambda c: (c.peak_bytes, c.slowdown))
    chosen = min(fitting, key=lambda c: _rank(c, budget)) if fitting else lowest
    fits = bool(fitting)
    max_seq = _max_seq_len(chosen.setup, budget, estimate)
    max_micro = _max_micro_batch(chosen.setup, budget, estimate)
    longest, largest = _limits_over_plans(req, budget, estimate)
    suggestions: tuple[str, ...] = ()
    if not fits:
        suggestions = _suggestions(req, budget, lowest, estimate)
    notes = list(budget.notes) + _extras_notes(chosen, cands, budget)
    if req.seq_len > req.model.max_position_embeddings:
        notes.append(f"seq_len {req.seq_len} is longer than the model's max_position_embeddings "
                     f"{req.model.max_position_embeddings}")
    reasons = technique_reasons(chosen, req, budget, estimate, _largest_micro(req))
    plan = _to_plan(chosen, req, budget, reasons)
    return Choice(
        plan=plan, request=req, budget=budget, chosen=chosen, fits=fits,
        alternatives=_alternatives(cands, chosen), ladder=build_ladder(req, budget, estimate),
        max_seq_len=max_seq, max_micro_batch_size=max_micro,
        min_vram_bytes=vram_needed_bytes(lowest.peak_bytes, budget.min_margin_bytes), longest=longest, largest_micro=largest,
        suggestion=suggestions[0] if suggestions else None, suggestions=suggestions,
        notes=tuple(notes),
    )


def _extras_notes(chosen: Candidate, cands: list[Candidate], budget: Budget) -> list[str]:
    """A plan that needs a missing extra says so and names the best plan that needs nothing more."""
    missing = missing_extras(chosen.setup, budget)
    if not missing:
        return []
    pip = " ".join(f"'lowvram[{e}]'" for e in missing)
    text = f"this plan needs {', '.join(missing)}, not installed here (pip install {pip})"
    ready = [c for c in cands if not missing_extras(c.setup, budget)]
    fit = [c for c in ready if c.fits]
    if fit:
        best = min(fit, key=lambda c: _rank(c, budget))
        return [f"{text}; the best plan that needs nothing more: {describe_setup(best.setup)}, "
                f"peak {gib(best.peak_bytes)}, {best.slowdown / chosen.slowdown:.2f}x its step time"]
    if ready:
        best = min(ready, key=lambda c: (c.peak_bytes, c.slowdown))
        return [f"{text}; of the plans that need nothing more none fits: the lowest, "
                f"{describe_setup(best.setup)}, peaks at {gib(best.peak_bytes)}"]
    return [text]


def describe_setup(s: RunSetup) -> str:
    """A plan in a few words, for notes."""
    parts = [s.precision, ("QLoRA " + s.quantization) if s.quantization != "none" else
             ("LoRA" if s.lora else "full")]
    parts += ["checkpointing"] if s.gradient_checkpointing else []
    parts += ["activation offload"] if s.activation_offload else []
    parts += [s.optimizer] if s.optimizer != "adamw" else []
    parts += [f"{s.loss} loss"] if s.loss != "standard" else []
    parts += [f"offload {s.offload}"] if s.offload != "none" else []
    parts.append(f"micro-batch {s.micro_batch_size} x {s.grad_accum}")
    return ", ".join(parts)


def plan_for_setup(setup: RunSetup, device: str, lora_alpha: int, **extra) -> Plan:
    """The Plan that runs ``setup``: every setting the memory model read (lowvram.measure builds
    its runs from this too); ``extra``: reasons and the predictions."""
    s = setup
    return Plan(
        device=device, mixed_precision=s.precision, gradient_checkpointing=s.gradient_checkpointing,
        micro_batch_size=s.micro_batch_size, grad_accum=s.grad_accum, lora=s.lora,
        quantization=s.quantization, optimizer=s.optimizer, offload=s.offload, attention=s.attention,
        loss=s.loss, gpus=s.gpus, activation_offload=s.activation_offload, seq_len=s.seq_len,
        lora_r=s.lora_r, lora_alpha=lora_alpha, lora_dropout=s.lora_dropout, lora_targets=tuple(s.lora_targets), **extra,
    )


def _to_plan(c: Candidate, req: PlanRequest, budget: Budget, reasons: dict[str, str]) -> Plan:
    return plan_for_setup(c.setup, budget.device, req.lora_alpha, reasons=reasons,
                          predicted_peak_bytes=c.peak_bytes, budget_bytes=budget.usable_bytes,
                          breakdown=dict(c.estimate.breakdown), host_ram_bytes=c.estimate.cpu_ram_bytes)


def _alternatives(cands: list[Candidate], chosen: Candidate) -> tuple[Candidate, ...]:
    """The best candidate of each tier other than the chosen one (fitting first)."""
    best: dict[float, Candidate] = {}
    for c in cands:
        cur = best.get(c.tier)
        if cur is None or (not c.fits, _rank(c)) < (not cur.fits, _rank(cur)):
            best[c.tier] = c
    return tuple(best[t] for t in sorted(best) if best[t].setup != chosen.setup)


# --------------------------------------------------------------------------------------------
# After an out-of-memory error: the next plan down the ladder

# A retry plans for 90% of what was seen to overflow: the measured peak at the failure is a lower
# bound on what the step needed, so the new plan must predict clearly less than it.
STEP_DOWN = 0.9


def next_cheaper(plan: Plan, req: PlanRequest, measured_peak_bytes: int | None,
                 estimate: Estimator = estimate_memory) -> Plan | None:
    """The plan to retry with after ``plan`` ran out of memory; None when nothing cheaper exists.

    Re-plans ``req`` (the recipe's request: its fixed techniques stay fixed, the effective batch is
    kept) with the budget lowered to ``STEP_DOWN`` x the lower of the measured and the predicted
    peak, so the choice is the next rung of the ladder order whose predicted peak is below it.
    Precision and attention stay as they were (they are not memory retries).
    """
    if plan.predicted_peak_bytes is None:
        return None
    seen = min(plan.predicted_peak_bytes, measured_peak_bytes or plan.predicted_peak_bytes)
    limit = int(STEP_DOWN * seen)
    pinned = replace(req, mixed_precision=plan.mixed_precision, attention=plan.attention, gpus=plan.gpus)
    budget = Budget(vram_needed_bytes(limit), device=plan.device, bf16=plan.mixed_precision.startswith("bf16"),
                    source="re-plan after out of memory",
                    # Liger's fused loss only where the failed plan ran it (installed, supported)
                    missing_extras=() if plan.loss == "fused" else ("liger",))
    choice = choose_plan(pinned, budget, estimate)
    if not choice.fits or choice.plan.predicted_peak_bytes >= plan.predicted_peak_bytes:
        return None
    shown = f"measured {mem(measured_peak_bytes)}" if measured_peak_bytes else "not measured"
    reasons = {**choice.plan.reasons,
               "retry": f"out of memory with the previous plan ({shown}, predicted "
                        f"{mem(plan.predicted_peak_bytes)}): re-planned for {mem(limit)}"}
    return replace(choice.plan, reasons=reasons)


# --------------------------------------------------------------------------------------------
# Limits under the chosen plan


def _largest_fitting(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """Largest n in [lo, hi] with fits(n), assuming fits is monotone; lo - 1 if none."""
    if not fits(lo):
        return lo - 1
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _max_seq_len(setup: RunSetup, budget: Budget, estimate: Estimator) -> int:
    top = max(setup.model.max_position_embeddings, setup.seq_len)
    return _largest_fitting(1, top, lambda n: _fits(estimate(replace(setup, seq_len=n)), budget))


def _max_micro_batch(setup: RunSetup, budget: Budget, estimate: Estimator) -> int:
    return _largest_fitting(
        1, _MAX_MICRO_BATCH, lambda n: _fits(estimate(replace(setup, micro_batch_size=n)), budget))


def _limit_setups(req: PlanRequest, budget: Budget) -> list[RunSetup]:
    """One setup per technique combination the request allows, for the limits over all plans.
    Pruned: the chunked loss (and Liger's fused loss where it runs) where the loss is auto (for
    t <= CHUNK_TOKENS chunked is the standard loss, beyond it smaller: logits_bytes), and one
    micro-batch (the limits vary it)."""
    one = replace(req, micro_batch_size=None, grad_accum=None, batch_size=req.gpus)
    fused = ["fused"] if tq.fused_loss_unavailable(budget, req.model) is None else []
    return [s for loss in ([req.loss] if req.loss else ["chunked", *fused])
            for s in _setups(replace(one, loss=loss), budget)]


def _limits_over_plans(req: PlanRequest, budget: Budget, estimate: Estimator
                       ) -> tuple[tuple[int, RunSetup | None], tuple[int, RunSetup | None]]:
    """(longest seq_len, the plan), (largest micro-batch at req.seq_len, the plan), over every
    plan the request allows; ties go to the faster plan (plan_level, then step time)."""
    setups = _limit_setups(req, budget)

    def speed(s: RunSetup) -> tuple:
        return (plan_level(s), round(tq.setup_slowdown(s, 1), 6))

    best_seq: tuple[int, RunSetup | None] = (0, None)
    best_micro: tuple[int, RunSetup | None] = (0, None)
    for s in sorted(setups, key=speed):
        if _fits(estimate(replace(s, seq_len=max(best_seq[0], 1))), budget) or best_seq[1] is None:
            n = _max_seq_len(s, budget, estimate)
            if n > best_seq[0]:
                best_seq = (n, replace(s, seq_len=n))
        if _fits(estimate(replace(s, micro_batch_size=max(best_micro[0], 1))), budget) or best_micro[1] is None:
            m = _max_micro_batch(s, budget, estimate)
            if m > best_micro[0]:
                best_micro = (m, replace(s, micro_batch_size=m, grad_accum=1))
    return best_seq, best_micro


# --------------------------------------------------------------------------------------------
# Nothing fits: what would help


def _suggestions(req: PlanRequest, budget: Budget, lowest: Candidate, estimate: Estimator) -> tuple[str, ...]:
    """Single changes that make it fit, the one that keeps the most of the request first."""
    out = []
    # 1. Release a choice the user fixed (the planner could then pick a cheaper setting).
    for name, flag in _RELEASABLE.items():
        if not req.fixed(name):
            continue
        freed = replace(req, **{name: None})
        if name == "lora":
            freed = replace(freed, quantization=None if req.quantization in (None, "none") else req.quantization)
        fit = [c for c in (_candidate(s, freed, budget, estimate) for s in _setups(freed, budget)) if c.fits]
        if fit:
            best = min(fit, key=_rank)
            source = req.sources.get(name, flag)
            value = _describe(name, best.setup)
            out.append(f"drop {source} and let the planner choose {name}: {value} fits "
                       f"(peak {gib(best.peak_bytes)})")
    # 2. A shorter sequence under the lowest-peak plan.
    max_seq = _max_seq_len(lowest.setup, budget, estimate)
    if max_seq >= 1:
        out.append(f"shorter sequences: --seq-len {_round_down(max_seq)} fits "
                   f"(asked {req.seq_len}) with the lowest-memory plan")
    # 3. A smaller model of the catalog.
    smaller = _smaller_model(req, budget, lowest, estimate)
    if smaller:
        out.append(smaller)
    out.append(f"a card with at least {gib(vram_needed_bytes(lowest.peak_bytes))} free")
    return tuple(out)


_RELEASABLE = {
    "lora": "--method", "quantization": "--quant", "offload": "--offload", "optimizer": "--optim",
    "gradient_checkpointing": "--no-gradient-checkpointing", "mixed_precision": "--precision",
    "loss": "--loss", "attention": "--attn", "micro_batch_size": "micro_batch_size",
    "grad_accum": "--grad-accum", "activation_offload": "--activation-offload",
}


def _describe(name: str, s: RunSetup) -> str:
    value = {
        "lora": "LoRA" if s.lora else "full fine-tuning", "quantization": s.quantization,
        "offload": s.offload, "optimizer": s.optimizer, "mixed_precision": s.precision,
        "gradient_checkpointing": "on" if s.gradient_checkpointing else "off", "loss": s.loss,
        "attention": s.attention, "micro_batch_size": s.micro_batch_size, "grad_accum": s.grad_accum,
        "activation_offload": "on" if s.activation_offload else "off",
    }[name]
    return str(value)


def _round_down(n: int) -> int:
    return n if n < 64 else n - n % 64


def _smaller_model(req: PlanRequest, budget: Budget, lowest: Candidate, estimate: Estimator) -> str | None:
    size = count_parameters(req.model)
    best: tuple[int, str] | None = None
    for name in catalog_names():
        try:
            spec = resolve_model(name)
        except LowvramError:
            continue
        n = count_parameters(spec)
        if n >= size or (best and n <= best[0]):
            continue
        if _fits(estimate(replace(lowest.setup, model=spec)), budget):
            best = (n, name)
    if best is None:
        return None
    return f"a smaller model: --model {best[1]} ({best[0] / 1e9:.1f}B parameters) fits"


# --------------------------------------------------------------------------------------------
# The ladder: what each technique saves and costs, applied one after another


def build_ladder(req: PlanRequest, budget: Budget, estimate: Estimator = estimate_memory) -> tuple[Rung, ...]:
    """Peaks from the plain run (fp32, eager, full batch, AdamW, full fine-tuning) up the ladder.

    Techniques the user fixed are applied from the start and their rung is marked ``fixed``.
    """
    largest = _largest_micro(req)
    if req.micro_batch_size is not None:
        largest = req.micro_batch_size
    elif req.grad_accum is not None:
        largest = largest // req.grad_accum
    s = RunSetup(
        model=req.model, precision=req.mixed_precision or "fp32", quantization=req.quantization or "none",
        lora=bool(req.lora) or (req.quantization not in (None, "none")), lora_r=req.lora_r,
        lora_targets=req.lora_targets, lora_dropout=req.lora_dropout, optimizer=req.optimizer or "adamw",
        gradient_checkpointing=bool(req.gradient_checkpointing), attention=req.attention or "eager",
        loss=_loss_options(req, budget)[0] if req.loss else "standard", micro_batch_size=largest,
        seq_len=req.seq_len,
        grad_accum=_largest_micro(req) // largest, gpus=req.gpus, offload=req.offload or "none",
        device=budget.device,
        activation_offload=bool(req.activation_offload and req.gradient_checkpointing) and budget.device == "cuda",
    )
    est = estimate(s)
    rungs = [Rung("baseline", "as asked", est.peak_bytes, 0, 1.0, _fits(est, budget))]
    for t in tq.LADDER:
        fixed_name = {"mixed_precision": "mixed_precision", "gradient_accumulation": "micro_batch_size"}.get(t.name, t.name)
        fixed = req.fixed(fixed_name) or (t.name == "gradient_accumulation" and req.fixed("grad_accum"))
        if (t.name == "offload" and budget.device == "cpu") or (t is tq.ACTIVATION_OFFLOAD and budget.device != "cuda"):
            continue
        if t is tq.ACTIVATION_OFFLOAD and req.gradient_checkpointing is False:
            fixed = True  # it needs checkpointing, which the user turned off
        if fixed:
            rungs.append(Rung(t.name, str(t.value), est.peak_bytes, 0, 1.0, _fits(est, budget), fixed=True))
            continue
        before = s
        if t is tq.MIXED_PRECISION:
            s = replace(s, precision=auto_precision(budget, req.weight_dtype))
        elif t is tq.MICRO_BATCH:
            s = replace(s, micro_batch_size=1, grad_accum=_largest_micro(req))
        else:
            settings = dict(t.settings)
            if offload_conflict(settings.get("optimizer", s.optimizer), settings.get("offload", s.offload)):
                if req.fixed("optimizer") or "offload" not in settings:
                    continue  # the user's optimizer (or offload) rules this rung out
                settings["optimizer"] = "adamw"  # DeepSpeed's CPU Adam takes its place
            s = replace(s, **settings)
        new = estimate(s)
        slowdown = tq.setup_slowdown(s, _largest_micro(req)) / tq.setup_slowdown(before, _largest_micro(req))
        value = s.precision if t is tq.MIXED_PRECISION else (
            f"micro-batch 1 x {s.grad_accum}" if t is tq.MICRO_BATCH else
            {True: "on", False: "off"}.get(t.value, str(t.value)))
        rungs.append(Rung(t.name, value, new.peak_bytes, est.peak_bytes - new.peak_bytes, slowdown,
                          _fits(new, budget) and memory.unmodelled(s) is None))
        est = new
    return tuple(rungs)


__all__ = [
    "Budget", "Candidate", "Choice", "PlanRequest", "Rung", "build_ladder", "choice_to_dict", "choose_plan",
    "next_cheaper", "safety_margin_bytes", "validate_request", "vram_needed_bytes",
]


# --------------------------------------------------------------------------------------------
# Plain data for `lowvram plan --json` and the report (bytes; report.py formats)


def _setup_techniques(s: RunSetup) -> dict:
    return {
        "mixed_precision": s.precision, "gradient_checkpointing": s.gradient_checkpointing,
        "gradient_accumulation": s.grad_accum, "lora": s.lora, "quantization": s.quantization,
        "optimizer": s.optimizer, "offload": s.offload, "activation_offload": s.activation_offload,
        "attention": s.attention, "loss": s.loss,
    }


def choice_to_dict(choice: Choice) -> dict:
    c, b, req = choice.chosen, choice.budget, choice.request
    est = c.estimate
    return {
        "model": req.model.name,
        "parameters": est.parameters,
        "trainable_parameters": est.trainable_parameters,
        "device": b.device,
        "vram_bytes": b.vram_bytes,
        "vram_source": b.source,
        "safety_margin_bytes": b.safety_margin_bytes,
        "budget_bytes": b.usable_bytes,
        "fits": choice.fits,
        "peak_bytes": est.peak_bytes,
        "headroom_bytes": b.usable_bytes - est.peak_bytes,
        "peak_phase": est.peak_phase,
        "breakdown": dict(est.breakdown),
        "checked": term_checks(c.setup),  # what each part was checked against (plan.calibration)
        "techniques": _setup_techniques(c.setup),
        "seq_len": req.seq_len,
        "batch_size": req.batch_size,
        "micro_batch_size": c.setup.micro_batch_size,
        "grad_accum": c.setup.grad_accum,
        "gpus": c.setup.gpus,
        "lora_r": c.setup.lora_r if c.setup.lora else None,
        "lora_targets": list(c.setup.lora_targets) if c.setup.lora else None,
        "cpu_ram_bytes": est.cpu_ram_bytes,
        "relative_step_time": round(c.slowdown, 3),
        "reasons": dict(choice.plan.reasons),
        "max_seq_len": choice.max_seq_len,
        "max_micro_batch_size": choice.max_micro_batch_size,
        "longest_seq_len": choice.longest[0],
        "longest_seq_len_plan": describe_setup(choice.longest[1]) if choice.longest[1] else None,
        "largest_micro_batch_size": choice.largest_micro[0],
        "largest_micro_batch_plan": describe_setup(choice.largest_micro[1]) if choice.largest_micro[1] else None,
        "min_vram_bytes": choice.min_vram_bytes,
        "suggestion": choice.suggestion,
        "suggestions": list(choice.suggestions),
        "alternatives": [
            {
                "techniques": _setup_techniques(a.setup),
                "micro_batch_size": a.setup.micro_batch_size,
                "grad_accum": a.setup.grad_accum,
                "peak_bytes": a.peak_bytes,
                "fits": a.fits,
                # > 1: faster than the chosen plan; < 1: slower (techniques.py factors).
                "relative_speed": round(c.slowdown / a.slowdown, 3),
            }
            for a in choice.alternatives
        ],
        "ladder": [
            {
                "technique": r.technique, "value": r.value, "peak_bytes": r.peak_bytes,
                "saved_bytes": r.saved_bytes, "slowdown": round(r.slowdown, 3), "fits": r.fits,
                "fixed": r.fixed,
            }
            for r in choice.ladder
        ],
        "notes": list(choice.notes),
    }
