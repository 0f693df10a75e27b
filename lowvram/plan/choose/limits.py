"""How far the budget goes: the longest seq_len and the largest micro-batch that fit, under one
plan and over every plan the request allows (binary search on the memory model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from lowvram.plan.choose import techniques as tq
from lowvram.plan.choose.explain import Estimator
from lowvram.plan.choose.pool import Estimates
from lowvram.plan.choose.request import Budget, PlanRequest, optimizer_given_up, plan_level
from lowvram.plan.choose.search import (
    candidate_setups,
    loss_options,
    sized_estimate,
    sized_fits,
    sized_loss_chunk,
)
from lowvram.plan.setup import RunSetup

# Longest micro-batch the max_micro_batch_size search tries.
_MAX_MICRO_BATCH = 4096


# --------------------------------------------------------------------------------------------
# Limits under the chosen plan


def _largest_fitting(lo: int, hi: int, fits: Callable[[int], bool], beyond: int = 0) -> int:
    """Largest n in [lo, hi] with fits(n), assuming fits is monotone; lo - 1 if none. ``beyond``:
    only an answer above it is wanted: the search stops (with an answer <= beyond) once its upper
    end shows the answer cannot be above it, after the same probes as a full search until then."""
    if not fits(lo):
        return lo - 1
    if hi <= beyond:
        return lo  # the answer is hi at most
    if fits(hi):
        return hi
    while hi - lo > 1 and hi - 1 > beyond:  # the answer is below hi now
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_fitting_seq_len(setup: RunSetup, budget: Budget, estimate: Estimator, top: int | None = None,
                        beyond: int = 0) -> int:
    """The longest seq_len that fits, up to ``top`` (default: the model's max_position_embeddings,
    or the setup's own seq_len if longer); ``beyond``: see _largest_fitting."""
    top = top or max(setup.model.max_position_embeddings, setup.seq_len)
    return _largest_fitting(1, top, lambda n: _fits(replace(setup, seq_len=n), budget, estimate), beyond)


def _fits(setup: RunSetup, budget: Budget, estimate: Estimator) -> bool:
    """``setup`` fits, its loss chunk sized to the budget (search.sized_loss_chunk); not estimated
    where its floor is over the budget already (pool.Estimates.cannot_fit)."""
    if isinstance(estimate, Estimates) and estimate.cannot_fit(setup, budget):
        return False
    return sized_fits(setup, budget, estimate)


def max_fitting_micro_batch(setup: RunSetup, budget: Budget, estimate: Estimator, beyond: int = 0) -> int:
    return _largest_fitting(
        1, _MAX_MICRO_BATCH, lambda n: _fits(replace(setup, micro_batch_size=n), budget, estimate), beyond)


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


def plan_speed(s: RunSetup) -> tuple:
    """The order the limits search plans in: what the plan gives up, then the faster."""
    return (plan_level(s), optimizer_given_up(s), round(tq.setup_slowdown(s, 1), 6))


def limits_over_plans(req: PlanRequest, budget: Budget, estimate: Estimator, top: int | None = None
                       ) -> tuple[tuple[int, RunSetup | None], tuple[int, RunSetup | None]]:
    """(longest seq_len, the plan), (largest micro-batch at req.seq_len, the plan), over every
    plan the request allows; ties go to the plan that gives up less, then the faster (plan_level,
    what its optimizer gives up, then step time: search.rank's order, so AdamW in the backward,
    whose measured step is a little faster than AdamW's, never wins a tie against AdamW itself).
    ``top``: the longest seq_len searched (max_fitting_seq_len's default when None)."""
    estimate = Estimates.of(estimate)
    # Each plan in speed order that fits the best limit so far is searched (from 1: the same
    # probes as alone) and kept if it goes further; a search is cut short once its upper end is
    # at the best (its answer can only be below the upper end), and setups whose floor is over
    # the budget are never estimated (_fits).
    best_seq: tuple[int, RunSetup | None] = (0, None)
    best_micro: tuple[int, RunSetup | None] = (0, None)
    for s in sorted(_limit_setups(req, budget), key=plan_speed):
        if best_seq[1] is None or _fits(replace(s, seq_len=max(best_seq[0], 1)), budget, estimate):
            n = max_fitting_seq_len(s, budget, estimate, top, beyond=best_seq[0])
            if n > best_seq[0]:
                best_seq = (n, sized_loss_chunk(replace(s, seq_len=n), budget, estimate))
        if best_micro[1] is None or _fits(replace(s, micro_batch_size=max(best_micro[0], 1)), budget, estimate):
            m = max_fitting_micro_batch(s, budget, estimate, beyond=best_micro[0])
            if m > best_micro[0]:
                best_micro = (m, sized_loss_chunk(replace(s, micro_batch_size=m, grad_accum=1), budget, estimate))
    return best_seq, best_micro


# --------------------------------------------------------------------------------------------
# The context table: the longest seq_len on each card size (lowvram plan --context-table)

CARD_SIZES_GB: tuple[int, ...] = (8, 12, 16, 24, 40, 48, 80)  # the rows Unsloth publishes
# How far past the model's max_position_embeddings the table searches: the memory limit is shown
# beyond the positions a model was trained on (reaching it needs RoPE scaling), flagged as such.
BEYOND_POSITIONS = 8


@dataclass(frozen=True)
class ContextRow:
    """The longest seq_len over every plan on one card, the plan that reaches it and what binds
    one token further (setup None: nothing fits at one token)."""

    card: str  # "12 GB"
    usable_bytes: int  # the budget less its safety margin
    longest: int
    setup: RunSetup | None
    peak_bytes: int  # the plan's peak at ``longest``
    host_ram_bytes: int  # the host RAM it needs there (pinned offloaded checkpoints, the process)
    binds: str  # the moment that binds at longest + 1 ("" when nothing fits or the search's end is reached)
    beyond_positions: bool  # longest is past the model's max_position_embeddings (needs RoPE scaling)


def context_table(req: PlanRequest, cards: list[tuple[str, Budget]], estimate: Estimator) -> list[ContextRow]:
    """One ContextRow per (card, budget): the longest seq_len over every plan ``req`` allows."""
    estimate = Estimates.of(estimate)  # the cards share what they estimate
    rows = []
    for card, budget in cards:
        top = BEYOND_POSITIONS * req.model.max_position_embeddings
        (n, s), _ = limits_over_plans(req, budget, estimate, top)
        if s is None or n < 1:
            rows.append(ContextRow(card, budget.usable_bytes, 0, None, 0, 0, "", False))
            continue
        binds = "" if n >= top else sized_estimate(replace(s, seq_len=n + 1), budget, estimate)[1].peak_moment
        est = estimate(s)
        rows.append(ContextRow(card, budget.usable_bytes, n, s, est.peak_bytes, est.cpu_ram_bytes, binds,
                               n > s.model.max_position_embeddings))
    return rows


__all__ = [
    "CARD_SIZES_GB", "ContextRow", "context_table", "limits_over_plans", "max_fitting_micro_batch",
    "max_fitting_seq_len", "plan_speed",
]
