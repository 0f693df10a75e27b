"""A shipped preference recipe trained end to end on the CPU (SmolLM2-135M-Instruct, the model
`make demo` links), and its reward margins as they grow: issue 28's demo-sized run.

    PYTHONPATH=. python bench/preference_demo.py [--recipe recipes/smollm2-135m-dpo.yaml] [--run DIR]

Trains the recipe with `lowvram train` (into a temporary folder unless --run names one; an existing
run folder with a metrics.json is read, not trained again) and prints, per logged step, the loss,
the chosen and rejected rewards, their margin and the accuracy (rewards/* of TRL, as
`lowvram show` reports them), then writes the table to bench/results/preference_demo_<objective>.txt.
A margin that grows from 0 (the adapter starts at zero: policy == reference) is the point.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def train(recipe: Path, run: Path) -> dict:
    from typer.testing import CliRunner

    from lowvram.cli import app
    from lowvram.runfiles import METRICS

    metrics = run / METRICS
    if not metrics.exists():
        r = CliRunner().invoke(app, ["train", str(recipe), "--set", f"training.output_dir={run}", "--overwrite"])
        if r.exit_code != 0:
            sys.exit(f"lowvram train failed ({r.exit_code}):\n{r.output[-3000:]}")
    return json.loads(metrics.read_text())


def table(m: dict) -> list[str]:
    """One line per logged step: loss and TRL's rewards, from metrics.json's histories."""
    cols = {name: dict(m.get(f"{name}_history") or []) for name in
            ("loss", "rewards_chosen", "rewards_rejected", "rewards_margins", "rewards_accuracies")}
    steps = sorted(cols["rewards_margins"])
    lines = [f"{'step':>5} {'loss':>8} {'chosen':>9} {'rejected':>9} {'margin':>8} {'accuracy':>8}"]
    for s in steps:
        v = [cols[k].get(s) for k in cols]
        lines.append(f"{s:>5} " + " ".join(f"{x:>{w}.4f}" if x is not None else f"{'-':>{w}}"
                                          for x, w in zip(v, (8, 9, 9, 8, 8), strict=True)))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=str(REPO / "recipes" / "smollm2-135m-dpo.yaml"))
    ap.add_argument("--run", help="run folder (default: a temporary one)")
    ap.add_argument("--out", help="results file (default: bench/results/preference_demo_<objective>.txt; '' for none)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        m = train(Path(args.recipe), Path(args.run) if args.run else Path(tmp) / "run")
    from lowvram.recipe import load_recipe

    objective = load_recipe(Path(args.recipe)).training.objective
    lines = [f"{Path(args.recipe).name}: objective {objective}, {m.get('steps')} steps, "
             f"peak {m.get('peak_memory_bytes', 0) / 2**30:.2f} GiB measured, "
             f"{m.get('predicted_peak_bytes', 0) / 2**30:.2f} GiB planned", *table(m)]
    margins = [v for _, v in m.get("rewards_margins_history") or []]
    if margins:
        lines.append(f"margin: first logged {margins[0]:+.4f}, last {margins[-1]:+.4f}, "
                     f"largest {max(margins):+.4f}")
    print("\n".join(lines))
    out = args.out if args.out is not None else str(RESULTS / f"preference_demo_{objective}.txt")
    if out:
        Path(out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
