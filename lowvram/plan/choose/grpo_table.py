"""`lowvram plan --generation-table`: per card, the largest num_generations x max_completion_length a
grpo/rloo request reaches over every plan it allows, the plan that reaches it and what binds.

Each card tries one prompt's group per step (batch = num_generations, the generation batch the
same) at NUM_GENERATIONS sizes; for each, the longest completion (in steps of COMPLETION_STEP
tokens, up to the model's max_position_embeddings less the prompt) for which some plan fits, by
doubling then bisection (the peak grows with the completion); the row keeps the size with the most
tokens generated. What binds: the moment of the lowest-peak plan one step longer."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lowvram.plan.choose.explain import Estimator
from lowvram.plan.choose.request import Budget, PlanRequest
from lowvram.plan.choose.search import candidate, candidate_setups, describe_setup, rank, sized_fits
from lowvram.plan.setup import RunSetup

NUM_GENERATIONS = (8, 16, 32, 64)
COMPLETION_STEP = 64


@dataclass(frozen=True)
class GenerationRow:
    card: str
    usable_bytes: int
    num_generations: int
    max_completion_length: int  # 0: nothing fits
    setup: RunSetup | None
    peak_bytes: int
    binds: str


def _request(req: PlanRequest, ng: int, completion: int) -> PlanRequest:
    g = replace(req.grpo, num_generations=ng, completion_len=completion, generation_batch_size=None,
                steps_per_generation=None)
    return replace(req, grpo=g, batch_size=ng * req.gpus, seq_len=g.prompt_len + completion,
                   micro_batch_size=None, grad_accum=None)


def _best(req: PlanRequest, budget: Budget, estimate: Estimator):
    """(the chosen candidate among those that fit or None, the lowest-peak candidate)."""
    cands = [candidate(s, req, budget, estimate) for s in candidate_setups(req, budget)]
    if not cands:
        return None, None
    fitting = [c for c in cands if c.fits]
    lowest = min(cands, key=lambda c: c.peak_bytes)
    return (min(fitting, key=lambda c: rank(c, budget)) if fitting else None), lowest


def longest_completion(req: PlanRequest, budget: Budget, estimate: Estimator, ng: int) -> int:
    """The longest completion (a multiple of COMPLETION_STEP) some plan fits at ``ng`` generations."""
    top = max(0, req.model.max_position_embeddings - req.grpo.prompt_len) // COMPLETION_STEP
    hint = [0]  # where the last fitting setup stood in candidate_setups' order: tried first next time

    def fits(n: int) -> bool:
        """Whether some plan fits (= _best(...)[0] is not None, without estimating every setup:
        sized_fits, stopping at the first that fits)."""
        setups = candidate_setups(_request(req, ng, n * COMPLETION_STEP), budget)
        first = min(hint[0], len(setups) - 1) if setups else 0
        for i in [first, *(j for j in range(len(setups)) if j != first)]:
            if sized_fits(setups[i], budget, estimate):
                hint[0] = i
                return True
        return False

    if top < 1 or not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= top and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, top + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * COMPLETION_STEP


def generation_table(req: PlanRequest, cards: list[tuple[str, Budget]], estimate: Estimator) -> list[GenerationRow]:
    rows = []
    for card, budget in cards:
        found = [(ng, longest_completion(req, budget, estimate, ng)) for ng in NUM_GENERATIONS]
        ng, length = max(found, key=lambda f: (f[0] * f[1], f[0]))
        if length == 0:
            rows.append(GenerationRow(card, budget.usable_bytes, 0, 0, None, 0, ""))
            continue
        chosen, _ = _best(_request(req, ng, length), budget, estimate)
        _, lowest = _best(_request(req, ng, length + COMPLETION_STEP), budget, estimate)
        rows.append(GenerationRow(card, budget.usable_bytes, ng, length, chosen.setup, chosen.peak_bytes,
                                  lowest.estimate.peak_moment if lowest else ""))
    return rows


def generation_table_to_dict(req: PlanRequest, rows: list[GenerationRow]) -> dict:
    """`lowvram plan --generation-table --json`."""
    return {"model": req.model.name, "objective": req.objective, "max_prompt_length": req.grpo.prompt_len,
            "rows": [{"card": r.card, "budget_bytes": r.usable_bytes, "num_generations": r.num_generations,
                      "max_completion_length": r.max_completion_length,
                      "plan": describe_setup(r.setup) if r.setup else None, "peak_bytes": r.peak_bytes,
                      "binds": r.binds or None} for r in rows]}


__all__ = ["COMPLETION_STEP", "GenerationRow", "generation_table", "generation_table_to_dict", "longest_completion",
           "NUM_GENERATIONS"]
