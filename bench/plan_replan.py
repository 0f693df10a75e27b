"""Re-plan recorded differential-test rows against their measured peaks (no training).

bench/plan_fuzz.py records each case's recipe (Outcome.case) beside its measured peak. The run of
such a recipe does not depend on the planner's numbers (the recipe fixes micro-batch, length and
techniques; rows whose loss chunk the plan sized to a budget, or whose plan was taken at the data's
length, are left out), so a planner change is checked against every recorded seed by planning
each recipe again and dividing the recorded measured peak by the new prediction:

    python bench/plan_replan.py bench/results/plan_fuzz_tiled*.json
    python bench/plan_replan.py bench/results/plan_fuzz_tiled_heldout_46-65.json --out ''

Each row: the recorded ratio, the new one, the plan's binding moment, MOVED where the prediction
changed, and MISS where the new ratio is outside the target (tests/plan/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NO_COLOR", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lowvram.difftest import ANY_LIMIT, OVER_LIMIT, Case, recipe_text, write_data, write_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_fuzz import _commit  # noqa: E402  (the results' header names the planner's commit alike)

_FIELDS = {f.name for f in dataclasses.fields(Case)}


def replan(row: dict) -> dict:
    """The plan of a recorded row's recipe (`lowvram plan RECIPE --json`)."""
    from typer.testing import CliRunner

    from lowvram.cli import app

    case = Case(**{k: tuple(v) if isinstance(v, list) else v for k, v in row["case"].items() if k in _FIELDS})
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        model, data = write_model(case, d / "model"), write_data(case, d / "data.jsonl")
        (d / "recipe.yaml").write_text(recipe_text(case, model, data, d / "run"))
        result = CliRunner().invoke(app, ["plan", str(d / "recipe.yaml"), "--json"])
        return json.loads(result.stdout)


def _comparable(row: dict) -> bool:
    case = row.get("case") or {}
    return (not row.get("error") and row.get("measured_bytes") is not None and not row.get("data_longest_tokens")
            and case.get("loss_chunk_tokens", 1024) == 1024)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="bench/results/plan_fuzz*.json files")
    ap.add_argument("--out", default="", help="also write the table here")
    args = ap.parse_args()
    lines, ratios = [], []
    for name in args.results:
        for row in json.loads(Path(name).read_text()):
            if not _comparable(row):
                continue
            plan = replan(row)
            ratio = row["measured_bytes"] / plan["peak_bytes"] - 1
            ratios.append(ratio)
            moved = "  MOVED" if plan["peak_bytes"] != row["predicted_bytes"] else ""
            miss = "" if ratio <= OVER_LIMIT and abs(ratio) <= ANY_LIMIT else "  <-- MISS"
            line = (f"{Path(name).stem[10:]:<24} {row['label'][:90]:<90} recorded {row['ratio']:+7.2%}  "
                    f"now {ratio:+7.2%}  {plan['peak_moment']}{moved}{miss}")
            print(line, flush=True)
            lines.append(line)
    misses = sum(1 for r in ratios if r > OVER_LIMIT or abs(r) > ANY_LIMIT)
    summary = (f"rows {len(ratios)}, moved {sum('MOVED' in x for x in lines)}, misses {misses}; "
               f"now: min {min(ratios):+.2%} max {max(ratios):+.2%}" if ratios else "rows 0")
    print(summary)
    if args.out:
        header = ["# bench/plan_replan.py: recorded plan_fuzz rows re-planned against their measured peaks",
                  f"# files: {' '.join(Path(n).name for n in args.results)}; planner of commit {_commit()}", ""]
        Path(args.out).write_text("\n".join(header + lines + ["", summary]) + "\n")
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
