"""The planner's speed-ups leave every answer as it was (issue 43 item 5): the floor of a peak is
never above the estimate, the cached terms read no field outside their key, and the search, the
limits and the pool answer exactly what estimating every candidate answers. The golden snapshot
(tests/golden/) pins the same on the whole grid; these check the claims themselves, each against
a plain reimplementation of what the code did before."""

from __future__ import annotations

import pickle
from collections import defaultdict
from dataclasses import replace

import pytest

from lowvram.plan.choose import limits as limits_module
from lowvram.plan.choose import techniques as tq
from lowvram.plan.choose.choose import choose_plan
from lowvram.plan.choose.limits import (
    _limit_setups,
    limits_over_plans,
    max_fitting_micro_batch,
    max_fitting_seq_len,
)
from lowvram.plan.choose.pool import CandidatePool, Estimates
from lowvram.plan.choose.request import (
    Budget,
    PlanRequest,
    missing_extras,
    optimizer_given_up,
    plan_level,
)
from lowvram.plan.choose.search import (
    candidate,
    candidate_setups,
    rank,
    sized_estimate,
    sized_loss_chunk,
)
from lowvram.plan.memory import backward, floor, tiled
from lowvram.plan.memory import memory as memory_module
from lowvram.plan.memory.floor import peak_floor_bytes
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.model.catalog import resolve_model

GB = 10**9

# (model, request fields, budget): text and vision, dense and MoE, a card where full fine-tuning
# fits, where only QLoRA does, where nothing does, two GPUs, the CPU, missing extras
CASES = [
    ("llama-3.1-8b", {}, Budget(12 * GB)),
    ("llama-3.1-8b", {"lora": False}, Budget(24 * GB, missing_extras=("deepspeed", "liger"))),
    ("qwen2.5-0.5b", {"seq_len": 2048}, Budget(24 * GB)),
    ("qwen2.5-0.5b", {"lora": False, "batch_size": 4}, Budget(8 * GB, missing_extras=("galore", "lomo"))),
    ("gemma-3-4b", {"seq_len": 512}, Budget(8 * GB)),
    ("qwen3-30b-a3b", {"batch_size": 4}, Budget(16 * GB)),
    ("gpt-oss-20b", {"batch_size": 2}, Budget(24 * GB)),
    ("phi-3-mini", {"gpus": 2, "batch_size": 4}, Budget(12 * GB, missing_extras=("deepspeed",))),
    ("llama-2-70b", {"offload": "none"}, Budget(8 * GB)),  # nothing fits
    ("smollm2-135m", {"seq_len": 256, "batch_size": 4}, Budget(4 * GB, device="cpu", bf16=False)),
    ("mistral-small-24b", {"lora": False}, Budget(8 * 2**30)),  # limits not monotone in seq_len
]


# the default run checks these (QLoRA fits; nothing fits; the limits not monotone in seq_len);
# `make test-all` (-m slow) every case
FAST = ("llama-3.1-8b", "llama-2-70b", "mistral-small-24b")


def _request(model: str, fields: dict) -> PlanRequest:
    return PlanRequest(resolve_model(model), **fields)


def _params(cases, fast=FAST):
    """The cases as pytest params: the first of each model in ``fast`` in the default run, the
    others marked slow."""
    out, seen = [], set()
    for i, (model, fields, budget) in enumerate(cases):
        marks = () if model in fast and model not in seen else (pytest.mark.slow,)
        seen.add(model)
        out.append(pytest.param(model, fields, budget, marks=marks, id=f"{model}-{i}"))
    return out


# --------------------------------------------------------------------------------------------
# The floor


def _check_floor(model: str, fields: dict, budget: Budget, stride: int) -> None:
    req = _request(model, fields)
    setups = candidate_setups(req, budget)[::stride]
    setups += [replace(s, seq_len=n) for s in _limit_setups(req, budget)[::stride] for n in (1, 3000, 40_000)]
    for s in setups:
        low = peak_floor_bytes(s)
        assert low <= estimate_memory(s).peak_bytes, s
        assert low <= sized_estimate(s, budget, estimate_memory)[1].peak_bytes, s


@pytest.mark.parametrize("model, fields, budget", [next(c for c in CASES if c[0] == m) for m in FAST])
def test_floor_is_never_above_the_estimate(model, fields, budget):
    """Of the candidates the search makes and the limit setups at three lengths (every 5th): the
    floor is at or under the peak of the setup as estimated and as the search sizes its chunk."""
    _check_floor(model, fields, budget, stride=5)


@pytest.mark.slow
@pytest.mark.parametrize("model, fields, budget", CASES)
def test_floor_is_never_above_the_estimate_of_any_setup(model, fields, budget):
    _check_floor(model, fields, budget, stride=1)


def _cached_terms():
    return [t for module in (floor, tiled, backward) for t in vars(module).values() if hasattr(t, "key_fields")]


def test_cached_terms_read_no_field_outside_their_key():
    """Setups that agree on a cached term's key fields get the same value from the term itself
    (uncached): what the term reads is in its key, so a cached value is the term's."""
    terms = _cached_terms()
    assert {t.__name__ for t in terms} >= {"model_states", "saved_activation_bytes", "layer_activation_bytes",
                                          "recompute_bytes", "backward_gradient_bytes"}
    setups = []
    for model, fields, budget in CASES[:8]:
        req = _request(model, fields)
        setups += candidate_setups(req, budget)[::3] + [replace(s, seq_len=700) for s in _limit_setups(req, budget)]
    for term in terms:
        groups: dict = defaultdict(list)
        for s in setups:
            groups[tuple(getattr(s, f) for f in term.key_fields)].append(s)
        shared = [g for g in groups.values() if len(g) > 1]
        assert len(shared) >= 5, term.__name__  # the sample puts setups of one key together
        for group in shared[::max(1, len(shared) // 25)]:  # 25 keys a term, 3 setups a key
            values = {repr(term.uncached(s)) for s in group[:: max(1, len(group) // 3)]}
            assert len(values) == 1, (term.__name__, group[0])


def test_a_spec_keeps_its_hash_to_itself():
    """ModelSpec's hash is computed once and kept on the spec, but never pickled: another process
    hashes its strings differently."""
    spec = resolve_model("llama-3.1-8b")
    copy = pickle.loads(pickle.dumps(spec))
    assert hash(spec) == hash(replace(spec)) and "_hash" in vars(spec)
    assert copy == spec and "_hash" not in vars(copy)


# --------------------------------------------------------------------------------------------
# The pool and the limits against estimating everything


def _every_candidate(req, budget):
    return [candidate(s, req, budget, estimate_memory) for s in candidate_setups(req, budget)]


def _best_by_tier(cands):
    """The alternatives as choose_plan found them before the pool: each tier's best, fitting first."""
    best: dict = {}
    for c in cands:
        cur = best.get(c.ladder_tier)
        if cur is None or (not c.fits, rank(c)) < (not cur.fits, rank(cur)):
            best[c.ladder_tier] = c
    return [best[t] for t in sorted(best)]


@pytest.mark.parametrize("model, fields, budget", _params(CASES))
def test_pool_answers_what_estimating_every_candidate_answers(model, fields, budget):
    req = _request(model, fields)
    cands = _every_candidate(req, budget)
    pool = CandidatePool(req, budget, Estimates())
    fitting = [c for c in cands if c.fits]
    chosen = min(fitting, key=lambda c: rank(c, budget)) if fitting else None
    assert pool.best_fitting() == chosen
    assert pool.best_fitting(shown=True) == (min(fitting, key=rank) if fitting else None)  # suggestions'
    assert pool.lowest() == min(cands, key=lambda c: (c.peak_bytes, c.slowdown))
    ready = [c for c in cands if not missing_extras(c.setup, budget)]
    ready_fit = [c for c in ready if c.fits]
    keep = lambda o: not missing_extras(o.setup, budget)  # noqa: E731
    assert pool.best_fitting(keep=keep) == (min(ready_fit, key=lambda c: rank(c, budget)) if ready_fit else None)
    if ready:
        assert pool.lowest(keep=keep) == min(ready, key=lambda c: (c.peak_bytes, c.slowdown))
    shown = chosen or pool.lowest()
    assert list(pool.alternatives(shown)) == [c for c in _best_by_tier(cands) if c.setup != shown.setup]
    assert pool.estimate.count < len(cands)  # and it estimated fewer


def _limits_before(req, budget, top=None):
    """limits_over_plans as it was: every plan in speed order, searched from 1 where it fits the
    best so far, every probe estimated."""

    def speed(s):
        return (plan_level(s), optimizer_given_up(s), round(tq.setup_slowdown(s, 1), 6))

    def fits(s):
        return sized_estimate(s, budget, estimate_memory)[1].peak_bytes <= budget.usable_bytes and (
            budget.host_ram_bytes is None or budget.device == "cpu"
            or sized_estimate(s, budget, estimate_memory)[1].cpu_ram_bytes <= budget.host_ram_bytes)

    best_seq, best_micro = (0, None), (0, None)
    for s in sorted(_limit_setups(req, budget), key=speed):
        if fits(replace(s, seq_len=max(best_seq[0], 1))) or best_seq[1] is None:
            n = max_fitting_seq_len(s, budget, estimate_memory, top)
            if n > best_seq[0]:
                best_seq = (n, sized_loss_chunk(replace(s, seq_len=n), budget, estimate_memory))
        if fits(replace(s, micro_batch_size=max(best_micro[0], 1))) or best_micro[1] is None:
            m = max_fitting_micro_batch(s, budget, estimate_memory)
            if m > best_micro[0]:
                best_micro = (m, sized_loss_chunk(replace(s, micro_batch_size=m, grad_accum=1), budget,
                                                  estimate_memory))
    return best_seq, best_micro


@pytest.mark.parametrize("model, fields, budget", _params(CASES, fast=("mistral-small-24b",)))
def test_limits_answer_what_searching_every_plan_answers(model, fields, budget):
    req = _request(model, fields)
    assert limits_over_plans(req, budget, Estimates()) == _limits_before(req, budget)


def test_a_search_cut_short_never_misses_a_longer_limit():
    """_largest_fitting with ``beyond``: the same answer wherever it is above beyond, even where
    fits is not monotone (it probes the same points until it stops)."""
    import random

    rng = random.Random(7)
    for _ in range(300):
        hi = rng.randint(1, 5000)
        cut = rng.randint(0, hi)
        holes = {rng.randint(1, hi) for _ in range(rng.randint(0, 4))}
        fits = lambda n, cut=cut, holes=holes: n <= cut and n not in holes  # noqa: E731
        full = limits_module._largest_fitting(1, hi, fits)
        for beyond in (0, rng.randint(0, hi), full - 1, full):
            short = limits_module._largest_fitting(1, hi, fits, beyond)
            assert short == full if full > beyond else short <= beyond


# --------------------------------------------------------------------------------------------
# How much is estimated


def test_one_plan_estimates_a_few_hundred_setups(monkeypatch):
    """`lowvram plan --model llama-3.1-8b --vram 12GB`: 2,061 full estimates before (issue 43),
    each setup estimated once and the ones whose floor is over the card not at all now."""
    calls = []
    real = memory_module._check
    monkeypatch.setattr(memory_module, "_check", lambda s: calls.append(s) or real(s))
    choose_plan(_request("llama-3.1-8b", {}), Budget(int(0.975 * 12 * 2**30)))
    assert 0 < len(calls) < 600
    assert len(calls) == len(set(calls))
