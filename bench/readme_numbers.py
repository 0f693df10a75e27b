"""The documents' numbers that come from benches, refreshed from bench/results/.

Each figure is a pattern in one document (docs/accuracy.md, or the README's headline) with one
``value`` group and the text that group must hold, computed from the newest results file of its
bench. tests/docs/test_readme_numbers.py fails when a bench result changed and a document did not
follow; this script rewrites the documents then.

    python bench/readme_numbers.py           # rewrite the documents where they drifted, list what changed
    python bench/readme_numbers.py --check   # exit 1 and list the drift, change nothing

The held-out GPU figures (bench/results/published_accuracy.txt) are checked by
tests/bench/test_published_accuracy.py, which re-scores them.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
README = REPO / "README.md"
ACCURACY = REPO / "docs" / "accuracy.md"
DOCS = (README, ACCURACY)

# bench/ladder_cpu.py's row names -> the ladder table's in docs/accuracy.md
LADDER_ROWS = {
    "fp32 baseline": "fp32 baseline",
    "+ bf16": "+ bf16",
    "+ gradient checkpointing": "+ gradient checkpointing",
    "+ 8-bit AdamW": "+ 8-bit AdamW",
    "+ LoRA r16 all-linear": "+ LoRA r16 all-linear",
    "+ QLoRA nf4-dq": "+ QLoRA nf4-dq",
    "+ chunked loss (1024-token chunks, batch 4)": "+ chunked loss, batch 4 (2048 tokens)",
    "(same, standard loss)": "same batch 4, standard loss",
}


@dataclass(frozen=True)
class Figure:
    name: str
    pattern: str  # a regex over the document with one group named "value"
    value: str  # what that group must be
    source: Path
    doc: Path = ACCURACY  # the document that holds it


def newest(glob: str) -> Path:
    """The newest results file of a bench (dated names sort by date)."""
    found = sorted(RESULTS.glob(glob))
    if not found:
        raise FileNotFoundError(f"no bench/results/{glob}")
    return found[-1]


def ladder_figures() -> list[Figure]:
    """The technique ladder table: measured peak, predicted peak, step time per row."""
    path = newest("ladder_cpu-*.txt")
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r"^(?P<name>\S.*?)\s{2,}(?P<meas>\d+\.\d)\s+(?P<pred>\d+\.\d)\s+(?:[-+]\d+\.\d%\s+)?(?P<step>\d+\.\d+)$",
                     line.strip())
        if not m or m["name"] not in LADDER_ROWS:
            continue
        row = LADDER_ROWS[m["name"]]
        out.append(Figure(f"ladder: {row}", rf"^\| {re.escape(row)} \| (?P<value>[^|]+\|[^|]+\|[^|]+?) \|$",
                          f"{m['meas']} MiB | {m['pred']} MiB | {m['step']} s", path))
    if len(out) != len(LADDER_ROWS):
        raise ValueError(f"{path.name}: found {len(out)} of the {len(LADDER_ROWS)} ladder rows")
    return out


def _fuzz_summary(path: Path) -> tuple[str, str, str, str, str]:
    """(ran, misses, min, median, max) of a bench/plan_fuzz.py results file."""
    text = path.read_text()
    ran = re.search(r"^cases \d+, ran (\d+), errors/refusals \d+, misses (\d+)", text, re.M)
    dist = re.search(r"^measured/predicted - 1: min (\S+)\s+p5 \S+\s+median (\S+)\s+p95 \S+\s+max (\S+)$", text, re.M)
    if not ran or not dist:
        raise ValueError(f"{path.name}: no summary lines (cases ..., measured/predicted - 1: ...)")
    lo, median, hi = dist.groups()
    return ran[1], ran[2], lo, median, hi


def fuzz_figures() -> list[Figure]:
    """The two differential-test paragraphs: the held-out seeds (plan_fuzz_heldout.txt, also the
    README's headline) and the in-sample ones (plan_fuzz.txt): how many ran, how many met the
    target, range and median."""
    out = []
    held = RESULTS / "plan_fuzz_heldout.txt"
    ran, misses, lo, median, hi = _fuzz_summary(held)
    for doc in (README, ACCURACY):
        out += [
            Figure("fuzz held out: runs", r"of (?P<value>\d+) held-out runs", ran, held, doc),
            Figure("fuzz held out: met", r"\*\*(?P<value>\d+) meet the target\*\*", str(int(ran) - int(misses)), held, doc),
            Figure("fuzz held out: range",
                   r"held out: measured/predicted - 1 from (?P<value>[-+]\S+ to [-+]\S+,\s+median [-+]\S+?)\)",
                   f"{lo} to {hi}, median {median}", held, doc),
        ]
    path = RESULTS / "plan_fuzz.txt"
    ran, _, lo, median, hi = _fuzz_summary(path)
    out += [
        Figure("fuzz in sample: runs", r"of (?P<value>\d+) runs, \*\*all within", ran, path),
        Figure("fuzz in sample: range", r"\(measured/predicted - 1 from (?P<value>[-+]\S+ to [-+]\S+, median [-+]\S+?)\)",
               f"{lo} to {hi}, median {median}", path),
    ]
    return out


def figures() -> list[Figure]:
    return ladder_figures() + fuzz_figures()


def drift(text: str, doc: Path = ACCURACY) -> list[str]:
    """One line per figure of ``doc`` that ``text`` (its contents) does not hold as its results
    file says."""
    problems = []
    name = doc.relative_to(REPO)
    for f in figures():
        if f.doc != doc:
            continue
        m = re.search(f.pattern, text, re.M)
        if m is None:
            problems.append(f"{f.name}: not found in {name} (pattern {f.pattern!r})")
        elif m["value"] != f.value:
            problems.append(f"{f.name}: {name} says {m['value']!r}, {f.source.relative_to(REPO)} gives {f.value!r}")
    return problems


def refresh(text: str, doc: Path = ACCURACY) -> str:
    """``text`` (the contents of ``doc``) with every figure set to its results file's value."""
    for f in figures():
        if f.doc == doc:
            text = re.sub(f.pattern, lambda m, v=f.value: m[0].replace(m["value"], v, 1), text, count=1, flags=re.M)
    return text


def main(argv: list[str]) -> int:
    drifted = 0
    for doc in DOCS:
        text = doc.read_text()
        problems = drift(text, doc)
        for line in problems:
            print(line)
        drifted += len(problems)
        if problems and "--check" not in argv:
            doc.write_text(refresh(text, doc))
            print(f"{doc.relative_to(REPO)}: {len(problems)} figure(s) refreshed")
    return 1 if drifted and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
