"""The numbers of docs/accuracy.md and the README's headline that come from benches equal
bench/results/ (bench/readme_numbers.py)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("readme_numbers", REPO / "bench" / "readme_numbers.py")
rn = importlib.util.module_from_spec(_spec)
sys.modules["readme_numbers"] = rn  # dataclasses look their module up
_spec.loader.exec_module(rn)


@pytest.mark.parametrize("doc", rn.DOCS, ids=lambda p: p.name)
def test_documents_hold_the_bench_results(doc):
    assert rn.drift(doc.read_text(), doc) == [], "run: python bench/readme_numbers.py"


def test_every_document_has_figures():
    assert {f.doc for f in rn.figures()} == set(rn.DOCS)


def test_a_changed_result_is_drift_and_refresh_fixes_it():
    """The check can fail: a document with an old step time drifts, and refresh restores it."""
    doc = rn.ACCURACY
    text = doc.read_text()
    ladder = rn.ladder_figures()[0]
    old = text.replace(f"| {ladder.value} |", "| 1.0 MiB | 1.0 MiB | 9.9 s |", 1)
    assert old != text
    assert [line.split(":")[1].strip() for line in rn.drift(old, doc)] == ["fp32 baseline"]
    assert rn.refresh(old, doc) == text
    ranges = {f.name: f.value for f in rn.fuzz_figures()}  # "<min> to <max>, median <m>"
    held = text.replace(ranges["fuzz held out: range"] + ")", "-1.00% to +1.00%, median +9.99%)", 1)
    fuzz = text.replace(ranges["fuzz in sample: range"] + ")", "-1.00% to +1.00%, median +9.99%)", 1)
    assert held != text and len(rn.drift(held, doc)) == 1 and rn.refresh(held, doc) == text
    assert fuzz != text and len(rn.drift(fuzz, doc)) == 1 and rn.refresh(fuzz, doc) == text
    readme = rn.README.read_text()
    stale = readme.replace(ranges["fuzz held out: range"] + ")", "-1.00% to +1.00%, median +9.99%)", 1)
    assert stale != readme and len(rn.drift(stale, rn.README)) == 1 and rn.refresh(stale, rn.README) == readme
