"""Budget + request -> the cheapest plan that fits, every choice with its reason.

The search is exhaustive over the techniques left on ``auto``: each candidate gets a peak from
:func:`lowvram.plan.memory.memory.estimate_memory` and a step-time factor from
:mod:`lowvram.plan.choose.techniques`, estimated only where the answer needs it (:mod:`lowvram.plan.choose.pool`:
in rank order until the first that fits, never where its floor is over the budget; the answer is
that of estimating all of them). Among the candidates that fit, the
first level of what the plan gives up wins (``plan_level``: full fine-tuning on the GPU, LoRA,
QLoRA, offload to CPU RAM), then a plan that needs no missing extra (DeepSpeed), then the
fastest, then the larger micro-batch, then the smaller peak (``rank``). The ladder (one technique
after another, in tier order) stays as the explanation; the search is not bound to its order.
A technique fixed by the user is never changed; ``lora: off`` is never turned into LoRA.

Pure: no torch, no CUDA. The caller builds the :class:`Budget` (from ``--vram`` or
``detect_hardware``); tests pass a fake one.

The parts live below this module: the Budget, the request and the Choice in
:mod:`lowvram.plan.choose.request`, the candidates and their ranking in :mod:`lowvram.plan.choose.search`, the
longest seq_len and largest micro-batch in :mod:`lowvram.plan.choose.limits`, what would help when
nothing fits in :mod:`lowvram.plan.choose.suggestions`, the ladder in :mod:`lowvram.plan.choose.ladder`; the JSON
form is :mod:`lowvram.plan.serialize`. This module makes the choice and the OOM re-plan.
"""

from __future__ import annotations

from dataclasses import replace

from lowvram.errors import LowvramError
from lowvram.plan.choose import pixels
from lowvram.plan.choose.explain import Estimator, data_images_reason, technique_reasons
from lowvram.plan.choose.ladder import build_ladder
from lowvram.plan.choose.limits import (
    limits_over_plans,
    max_fitting_micro_batch,
    max_fitting_seq_len,
)
from lowvram.plan.choose.pool import CandidatePool, Estimates
from lowvram.plan.choose.request import (
    BUILT_EXTRAS,
    Budget,
    Candidate,
    Choice,
    PlanRequest,
    check_attention,
    check_optimizer,
    missing_extras,
    validate_request,
    vram_needed_bytes,
)
from lowvram.plan.choose.search import (
    auto_precision,
    describe_setup,
    largest_micro_batch_size,
    plan_for_setup,
)
from lowvram.plan.choose.suggestions import suggest_changes
from lowvram.plan.memory.grpo import (
    PAGED_PRECISION_HINT,
    generation_fields,
    paged_precision_problem,
)
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.types import Plan
from lowvram.units import gib, mem

# --------------------------------------------------------------------------------------------
# The choice


def choose_plan(req: PlanRequest, budget: Budget, estimate: Estimator = estimate_memory) -> Choice:
    """The cheapest plan that fits ``budget``; if none does, the closest one and what would help."""
    asked = req
    req = pixels.auto_ceiling(req)  # data.max_pixels auto: a row's images leave room for text
    validate_request(req)
    precision = req.mixed_precision or auto_precision(budget, req.weight_dtype)
    check_attention(req, budget, precision)
    check_optimizer(req, budget, precision)
    if req.grpo is not None and req.grpo.engine == "paged":  # TRL 1.16's paged engine runs in fp32 only
        lora = True if req.quantization not in (None, "none") else req.lora
        if problem := paged_precision_problem(precision, lora):
            raise LowvramError(problem, PAGED_PRECISION_HINT)
    estimate = Estimates.of(estimate)  # each setup estimated once in this choice
    cands = CandidatePool(req, budget, estimate)
    best = cands.best_fitting()
    start = req
    if best is None and pixels.lowerable(req):  # the last resort: the images smaller (plan/choose/pixels.py)
        req = pixels.largest_fitting(req, budget, estimate, cands)
        cands = CandidatePool(req, budget, estimate)
        best = cands.best_fitting()
    lowest = cands.lowest()
    chosen = best or lowest
    fits = best is not None
    if req.grpo is None:
        max_seq = max_fitting_seq_len(chosen.setup, budget, estimate)
        max_micro = max_fitting_micro_batch(chosen.setup, budget, estimate)
        longest, largest = limits_over_plans(req, budget, estimate)
    else:  # grpo/rloo: the generation table answers how far the budget goes (plan/choose/grpo_table.py)
        max_seq, max_micro = (req.seq_len, chosen.setup.micro_batch_size) if fits else (0, 0)
        longest, largest = (0, None), (0, None)
    suggestions: tuple[str, ...] = ()
    if not fits:
        suggestions = suggest_changes(req, budget, lowest, estimate)
    notes = list(budget.notes) + _extras_notes(chosen, cands, budget)
    if req.seq_len > req.model.max_position_embeddings:
        notes.append(f"seq_len {req.seq_len} is longer than the model's max_position_embeddings "
                     f"{req.model.max_position_embeddings}")
    auto, why = pixels.auto_pixels(asked, req, fits)
    reasons = technique_reasons(chosen, req, budget, estimate, largest_micro_batch_size(req)) | data_images_reason(req)
    plan = _to_plan(chosen, req, budget, reasons | why)
    if auto.get("applies"):  # the processor's max_pixels in the run is the one planned (train/build/processor.py)
        plan = replace(plan, max_pixels=auto["max_pixels"])
    ladder = build_ladder(req, budget, estimate)
    if req is not start:  # the ladder from the processor's own size, then max_pixels lowered
        start_ladder = build_ladder(start, budget, estimate)
        ladder = start_ladder + (pixels.pixels_rung(start_ladder, ladder, f"{auto['max_pixels']:,}"),)
    return Choice(
        plan=plan, request=req, budget=budget, chosen=chosen, fits=fits, max_pixels_auto=auto,
        alternatives=cands.alternatives(chosen), ladder=ladder,
        max_seq_len=max_seq, max_micro_batch_size=max_micro,
        min_vram_bytes=vram_needed_bytes(lowest.peak_bytes, budget.min_margin_bytes), longest=longest, largest_micro=largest,
        suggestion=suggestions[0] if suggestions else None, suggestions=suggestions,
        notes=tuple(notes),
    )


def _extras_notes(chosen: Candidate, cands: CandidatePool, budget: Budget) -> list[str]:
    """A plan that needs a missing extra says so and names the best plan that needs nothing more."""
    missing = missing_extras(chosen.setup, budget)
    if not missing:
        return []
    pip = " ".join(f"'lowvram[{e}]'" for e in missing if e not in BUILT_EXTRAS)
    text = "; ".join([f"this plan needs {', '.join(e for e in missing if e not in BUILT_EXTRAS)}, not installed "
                      f"here (pip install {pip})"] * bool(pip)
                     + [f"this plan needs {BUILT_EXTRAS[e]}, which cannot be built here" for e in missing
                        if e in BUILT_EXTRAS])

    def ready(o) -> bool:
        return not missing_extras(o.setup, budget)

    best = cands.best_fitting(keep=ready)
    if best:
        return [f"{text}; the best plan that needs nothing more: {describe_setup(best.setup)}, "
                f"peak {gib(best.peak_bytes)}, {best.slowdown / chosen.slowdown:.2f}x its step time"]
    best = cands.lowest(keep=ready)
    if best:
        return [f"{text}; of the plans that need nothing more none fits: the lowest, "
                f"{describe_setup(best.setup)}, peaks at {gib(best.peak_bytes)}"]
    return [text]


def _to_plan(c: Candidate, req: PlanRequest, budget: Budget, reasons: dict[str, str]) -> Plan:
    return plan_for_setup(c.setup, budget.device, req.lora_alpha, req.lora_use_rslora,
                          req.galore_update_proj_gap, req.galore_scale, reasons=reasons,
                          **generation_fields(c.setup, c.estimate, budget, req.grpo),
                          predicted_peak_bytes=c.peak_bytes, budget_bytes=budget.usable_bytes,
                          breakdown=dict(c.estimate.breakdown), host_ram_bytes=c.estimate.cpu_ram_bytes)


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
    if plan.max_pixels is not None:  # data.max_pixels auto: a retry keeps the images the run has
        pinned = replace(pinned, max_pixels=plan.max_pixels, max_pixels_auto=False)
    budget = Budget(vram_needed_bytes(limit), device=plan.device, bf16=plan.mixed_precision.startswith("bf16"),
                    expandable_segments=plan.expandable_segments,
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
    return replace(choice.plan, reasons=reasons, max_pixels=plan.max_pixels)


__all__ = [
    "choose_plan", "next_cheaper", "STEP_DOWN",
]
