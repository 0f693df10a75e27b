"""How far the budget goes: the longest seq_len and the largest micro-batch that fit, under one
plan and over every plan the request allows (binary search on the memory model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from lowvram.plan import techniques as tq
from lowvram.plan.explain import Estimator
from lowvram.plan.request import Budget, PlanRequest, fits_budget, plan_level
from lowvram.plan.search import candidate_setups, loss_options
from lowvram.plan.setup import RunSetup

# Longest micro-batch the max_micro_batch_size search tries.
_MAX_MICRO_BATCH = 4096


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


def max_fitting_seq_len(setup: RunSetup, budget: Budget, estimate: Estimator) -> int:
    top = max(setup.model.max_position_embeddings, setup.seq_len)
    return _largest_fitting(1, top, lambda n: fits_budget(estimate(replace(setup, seq_len=n)), budget))


def max_fitting_micro_batch(setup: RunSetup, budget: Budget, estimate: Estimator) -> int:
    return _largest_fitting(
        1, _MAX_MICRO_BATCH, lambda n: fits_budget(estimate(replace(setup, micro_batch_size=n)), budget))


def _limit_setups(req: PlanRequest, budget: Budget) -> list[RunSetup]:
    """One setup per technique combination the request allows, for the limits over all plans.
    Pruned: the chunked loss (and Liger's fused loss where it runs) where the loss is auto (for
    t <= CHUNK_TOKENS chunked is the standard loss, beyond it smaller: logits_bytes), and one
    micro-batch (the limits vary it)."""
    one = replace(req, micro_batch_size=None, grad_accum=None, batch_size=req.gpus)
    losses = [req.loss] if req.loss else [x for x in loss_options(req, budget) if x != "standard"]
    if req.objective != "sft":
        losses = ["standard"]  # TRL's own preference loss (search.loss_options)
    return [s for loss in losses
            for s in candidate_setups(replace(one, loss=loss), budget)]


def limits_over_plans(req: PlanRequest, budget: Budget, estimate: Estimator
                       ) -> tuple[tuple[int, RunSetup | None], tuple[int, RunSetup | None]]:
    """(longest seq_len, the plan), (largest micro-batch at req.seq_len, the plan), over every
    plan the request allows; ties go to the faster plan (plan_level, then step time)."""
    setups = _limit_setups(req, budget)

    def speed(s: RunSetup) -> tuple:
        return (plan_level(s), round(tq.setup_slowdown(s, 1), 6))

    best_seq: tuple[int, RunSetup | None] = (0, None)
    best_micro: tuple[int, RunSetup | None] = (0, None)
    for s in sorted(setups, key=speed):
        if fits_budget(estimate(replace(s, seq_len=max(best_seq[0], 1))), budget) or best_seq[1] is None:
            n = max_fitting_seq_len(s, budget, estimate)
            if n > best_seq[0]:
                best_seq = (n, replace(s, seq_len=n))
        if fits_budget(estimate(replace(s, micro_batch_size=max(best_micro[0], 1))), budget) or best_micro[1] is None:
            m = max_fitting_micro_batch(s, budget, estimate)
            if m > best_micro[0]:
                best_micro = (m, replace(s, micro_batch_size=m, grad_accum=1))
    return best_seq, best_micro


__all__ = [
    "limits_over_plans", "max_fitting_micro_batch", "max_fitting_seq_len",
]
