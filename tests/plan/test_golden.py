"""The planner's golden snapshot (tests/golden/snapshot.py): a refactoring leaves every plan and
estimate identical. `make golden` shows what moved and rewrites it when a change means to."""

import pytest

from tests.golden import snapshot


def _check(every: int) -> None:
    old = snapshot.load()
    new = snapshot.compute(every)
    assert len(new) > 0 and set(new) <= set(old), "cases were added: run `make golden`"
    lines = snapshot.differences({k: old[k] for k in new}, new)
    assert not lines, "the planner's numbers moved (run `make golden` to see and accept):\n" + "\n".join(lines[:40])


def test_golden_snapshot_sample_unchanged():
    """Every 13th case of each grid (~760 of 9,900), in about a minute on 2 cores."""
    _check(every=13)


@pytest.mark.slow
def test_golden_snapshot_unchanged():
    """All 7,380 cases (~2 min)."""
    _check(every=1)


def test_snapshot_covers_the_grid():
    old = snapshot.load()
    assert len(old) == len(snapshot.plan_cases()) + len(snapshot.estimate_cases())
    plans = [v for k, v in old.items() if k.startswith("plan|")]
    assert sum("error" in v for v in plans) < len(plans) // 4  # mostly real plans
    assert all("peak_moment" in v for v in plans if "error" not in v)


def test_differences_names_the_field():
    old = {"plan|m": {"peak_bytes": 1, "techniques": {"lora": True}}}
    new = {"plan|m": {"peak_bytes": 2, "techniques": {"lora": True}}, "plan|n": {}}
    assert snapshot.differences(old, new) == ["~ plan|m peak_bytes: 1 -> 2", "+ plan|n"]
