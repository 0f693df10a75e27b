"""The published GPU ground truth (bench/gpu_truth) and its scoring cannot rot.

bench/published_accuracy.py plans every published row and writes
bench/results/published_accuracy.txt; these tests re-run its scoring on the committed data (pure
Python, no torch, about a second) and check that the held-out and in-sample errors are still what
the results file says, that every row names its source, and that the CUDA overheads shipped in
lowvram.plan.memory.memory are the ones the fitting set gives.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest

from lowvram.plan.setup import cuda_overheads
from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("published_accuracy", REPO / "bench" / "published_accuracy.py")
pa = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = pa  # dataclasses look their module up there
_spec.loader.exec_module(pa)

SOURCES = pa.load_sources()
ROWS = [row for src in SOURCES for row in src.rows]
RESULTS = pa.RESULTS.read_text()
# Planner changes move the errors a little; a change this large means the results file is stale:
# run `python bench/published_accuracy.py` and commit its output with the change.
TOLERANCE_PP = 1.0


def _headline(text: str, label: str) -> tuple[int, float, float]:
    m = re.search(re.escape(label) + r"\s+(\d+) comparisons, median \|error\|\s+([\d.]+)%, mean\s+([+-][\d.]+)%", text)
    assert m, f"no '{label}' line in the results"
    return int(m.group(1)), float(m.group(2)), float(m.group(3))


def test_every_source_and_row_is_traceable():
    assert len(SOURCES) >= 3
    assert {s.split for s in SOURCES} == {"fit", "heldout"}
    ids = [row.key for row in ROWS]
    assert len(ids) == len(set(ids)), "row ids must be unique within a source"
    for row in ROWS:
        assert row.url.startswith("https://"), row.key
        assert len(row.where) > 10, f"{row.key}: say where in the source the number was read"
        assert row.measured, row.key
        assert set(row.measured) <= {"allocated", "reserved", "device", "capacity", "context"}, row.key
        if not row.score:
            assert row.excluded, f"{row.key}: a row left out of the scoring says why"


def test_scored_rows_state_their_settings():
    required = {"model", "method", "seq_len", "micro_batch", "precision", "optimizer"}
    for row in ROWS:
        if row.score and "context" not in row.measured:
            missing = required - {k for k, v in row.settings.items() if v is not None}
            assert not missing, f"{row.key}: settings not stated: {sorted(missing)}"
            assert pa.row_setup(row) is not None


def test_config_copies_cite_their_source():
    for path in sorted((pa.DATA / "configs").glob("*/config.json")):
        cfg = json.loads(path.read_text())
        assert "huggingface.co" in cfg["_lowvram_source"], path


def test_shipped_cuda_overheads_are_the_fit():
    fit = pa.fit_overheads(SOURCES)
    assert cuda_overheads() == fit.overheads()
    # the allocator's shares: a bound over the load pairs, least squares over the nine runs, and
    # that share times the larger published off/on bound
    assert (fit.once_fraction, fit.churn_fraction, fit.expandable_ratio) == (0.015, 0.23, 0.55)
    pairs = pa.load_allocator_pairs()
    assert max(pa.load_share(p) for p in pairs["load"]) == pytest.approx(0.21 / 14.41)
    assert [round(pa.off_on_bound(p), 3) for p in pairs["off_on"]] == [0.455, 0.541]


def test_allocator_pairs_name_their_source():
    pairs = pa.load_allocator_pairs()
    for row in pairs["load"] + pairs["off_on"]:
        assert row["url"].startswith("https://") and len(row["where"]) > 10, row["id"]
        assert "expandable_segments" in row or "reserved_on" in row, row["id"]


def test_fit_uses_the_fitting_set_only():
    only_fit = [s for s in SOURCES if s.split == "fit"]
    assert pa.fit_overheads(only_fit) == pa.fit_overheads(SOURCES)
    assert all(s.split == "fit" for s in SOURCES for r in s.rows if r.overhead_fit)


@pytest.mark.parametrize("label", ["held out (never used in any fit)", "in sample (fitting set)"])
def test_errors_match_the_results_file(label):
    fresh = pa.report(SOURCES)
    n, median, mean = _headline(fresh, label)
    n_file, median_file, mean_file = _headline(RESULTS, label)
    assert n == n_file, f"{label}: {n} comparisons now, {n_file} in the results file"
    assert abs(median - median_file) <= TOLERANCE_PP, f"{label}: median |error| {median}% vs {median_file}%"
    assert abs(mean - mean_file) <= TOLERANCE_PP, f"{label}: mean error {mean}% vs {mean_file}%"


def test_units():
    assert pa.parse_size("19.77 GB") == 19_770_000_000
    assert pa.parse_size("300 MiB") == 300 * 2**20
    with pytest.raises(ValueError):
        pa.parse_size("3 gigs")


def test_readme_headline_is_the_results_file():
    """The held-out figures of the README's headline and of docs/accuracy.md are the ones
    bench/results/published_accuracy.txt holds: re-running the bench after a planner change must
    refresh them too."""
    n, median, mean = _headline(RESULTS, "held out (never used in any fit)")
    by_method = {m: _headline(RESULTS, "  " + m)[1] for m in ("lora", "qlora")}
    for doc in (REPO / "README.md", REPO / "docs" / "accuracy.md"):
        text = " ".join(doc.read_text().split())
        assert f"**median {median}%**" in text and f"mean {mean:+.1f}%".replace("+", "") in text.replace("+", ""), doc
        assert f"**LoRA {by_method['lora']}%**" in text, doc
        assert f"**QLoRA {by_method['qlora']}% under**" in text, doc
