"""The README's numbers that come from benches equal bench/results/ (bench/readme_numbers.py)."""

from __future__ import annotations

import importlib.util
import sys

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("readme_numbers", REPO / "bench" / "readme_numbers.py")
rn = importlib.util.module_from_spec(_spec)
sys.modules["readme_numbers"] = rn  # dataclasses look their module up
_spec.loader.exec_module(rn)


def test_readme_holds_the_bench_results():
    assert rn.drift(rn.README.read_text()) == [], "run: python bench/readme_numbers.py"


def test_a_changed_result_is_drift_and_refresh_fixes_it():
    """The check can fail: a README with an old step time drifts, and refresh restores it."""
    readme = rn.README.read_text()
    ladder = rn.ladder_figures()[0]
    old = readme.replace(f"| {ladder.value} |", "| 1.0 MiB | 1.0 MiB | 9.9 s |", 1)
    assert old != readme
    assert [line.split(":")[1].strip() for line in rn.drift(old)] == ["fp32 baseline"]
    assert rn.refresh(old) == readme
    ranges = {f.name: f.value for f in rn.fuzz_figures()}  # "<min> to <max>, median <m>"
    held = readme.replace(ranges["fuzz held out: range"] + ")", "-1.00% to +1.00%, median +9.99%)", 1)
    fuzz = readme.replace(ranges["fuzz in sample: range"] + ")", "-1.00% to +1.00%, median +9.99%)", 1)
    assert held != readme and len(rn.drift(held)) == 1 and rn.refresh(held) == readme
    assert fuzz != readme and len(rn.drift(fuzz)) == 1 and rn.refresh(fuzz) == readme
