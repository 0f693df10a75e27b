"""The search's candidates, each estimated only where an answer needs its peak, and one command's
estimates kept so no setup is estimated twice.

Everything the search orders by except the peak (the plan's level, what its optimizer gives up,
missing extras, step time, micro-batch: search.rank) and a floor of the peak
(floor.peak_floor_bytes) are known before any estimate. So the cheapest plan that fits is found by
estimating candidates in rank order until the first that fits (a candidate whose floor is above
the budget cannot fit and is not estimated), the lowest peak by estimating in floor order until
the floors pass the lowest peak seen, and each tier's best alternative likewise. The answers are
those of estimating every candidate (``min`` over all of them, ties to the earlier candidate):
tests/plan/test_floor.py compares both on a grid of requests, and the golden snapshot pins them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import groupby

from lowvram.plan.choose import techniques as tq
from lowvram.plan.choose.explain import Estimator
from lowvram.plan.choose.request import Budget, Candidate, PlanRequest
from lowvram.plan.choose.search import (
    candidate,
    candidate_setups,
    candidate_tier,
    largest_micro_batch_size,
    rank_order,
)
from lowvram.plan.memory.floor import peak_floor_bytes
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.setup import MemoryEstimate, RunSetup


class Estimates:
    """An Estimator that estimates each setup once per command (the search, the limits, the
    ladder and the reasons ask many of the same setups) and counts what it estimated; with
    memory.estimate_memory inside, it also knows the floor of a peak (floor.peak_floor_bytes)."""

    def __init__(self, estimate: Estimator = estimate_memory):
        self.inner = estimate
        self.known: dict[RunSetup, MemoryEstimate] = {}
        self.count = 0  # estimates made (bench/plan_speed.py prints it)

    @classmethod
    def of(cls, estimate: Estimator) -> Estimates:
        """``estimate`` itself if it keeps its estimates already, else one that does."""
        return estimate if isinstance(estimate, Estimates) else cls(estimate)

    def __call__(self, setup: RunSetup) -> MemoryEstimate:
        est = self.known.get(setup)
        if est is None:
            est = self.known[setup] = self.inner(setup)
            self.count += 1
        return est

    def floor(self, setup: RunSetup) -> int:
        """A peak no estimate of ``setup`` is below; 0 for an estimator other than the memory
        model's (a test's), whose peaks the floor knows nothing of."""
        return peak_floor_bytes(setup) if self.inner is estimate_memory else 0

    def cannot_fit(self, setup: RunSetup, budget: Budget) -> bool:
        """``setup`` is over the budget's card whatever its estimate (its floor is)."""
        return self.floor(setup) > budget.usable_bytes


@dataclass
class _Option:
    """A setup of the search before (and after) its estimate."""

    index: int  # its place in candidate_setups: ties go to the earlier one, as min() over a list
    setup: RunSetup
    tier: float
    order: tuple  # search.rank without the peak, budget's missing extras counted
    order_shown: tuple  # the same without a budget (the alternatives shown)
    floor: int
    estimated: Candidate | None = field(default=None, repr=False)


class CandidatePool:
    """Every setup the request allows (search.candidate_setups), estimated on demand."""

    def __init__(self, req: PlanRequest, budget: Budget, estimate: Estimator,
                 setups: Iterable[RunSetup] | None = None):
        self.req, self.budget = req, budget
        self.estimate = Estimates.of(estimate)
        largest = largest_micro_batch_size(req)
        self.options = []
        for i, s in enumerate(candidate_setups(req, budget) if setups is None else setups):
            slow = tq.setup_slowdown(s, largest)
            self.options.append(_Option(i, s, candidate_tier(s, largest), rank_order(s, slow, budget),
                                        rank_order(s, slow), self.estimate.floor(s)))

    def __len__(self) -> int:
        return len(self.options)

    def _candidate(self, o: _Option) -> Candidate:
        if o.estimated is None:
            o.estimated = candidate(o.setup, self.req, self.budget, self.estimate)
        return o.estimated

    def _may_fit(self, o: _Option) -> bool:
        return o.floor <= self.budget.usable_bytes

    def best_fitting(self, shown: bool = False, keep: Callable[[_Option], bool] = lambda o: True) -> Candidate | None:
        """min(fitting, key=search.rank) over the kept candidates (without the budget's
        missing extras where ``shown``); None when none fits."""
        key = (lambda o: o.order_shown) if shown else (lambda o: o.order)
        kept = sorted((o for o in self.options if keep(o)), key=lambda o: (key(o), o.index))
        for _, group in groupby(kept, key=key):
            fit = [c for o in group if self._may_fit(o) and (c := self._candidate(o)).fits]
            if fit:
                return min(fit, key=lambda c: c.peak_bytes)
        return None

    def lowest(self, keep: Callable[[_Option], bool] = lambda o: True) -> Candidate:
        """min(candidates, key=(peak, slowdown)) over the kept candidates."""
        best: tuple | None = None
        for o in sorted((o for o in self.options if keep(o)), key=lambda o: (o.floor, o.index)):
            if best is not None and o.floor > best[0]:
                break  # this and every later floor is above the lowest peak seen
            c = self._candidate(o)
            if best is None or (c.peak_bytes, c.slowdown, o.index) < best:
                best = (c.peak_bytes, c.slowdown, o.index)
        return self._candidate(self.options[best[2]]) if best else None

    def alternatives(self, chosen: Candidate) -> tuple[Candidate, ...]:
        """The best candidate of each tier other than the chosen one: the best fitting by rank, or
        where none of the tier fits, the first by rank (search.rank without a budget)."""
        out = []
        for tier in sorted({o.tier for o in self.options}):
            best = self.best_fitting(shown=True, keep=lambda o, t=tier: o.tier == t)
            if best is None:
                first = min(o.order_shown for o in self.options if o.tier == tier)
                group = [self._candidate(o) for o in self.options if o.tier == tier and o.order_shown == first]
                best = min(group, key=lambda c: c.peak_bytes)
            if best.setup != chosen.setup:
                out.append(best)
        return tuple(out)


__all__ = ["CandidatePool", "Estimates"]
