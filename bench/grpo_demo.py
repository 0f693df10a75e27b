"""The shipped GRPO recipe trained end to end on the CPU (SmolLM2-135M-Instruct, the model `make demo`
links), and its mean reward as it rises: issue 44's "a recipe that learns on a CPU".

    PYTHONPATH=. python bench/grpo_demo.py [--recipe recipes/smollm2-135m-grpo.yaml] [--run DIR]

Trains the recipe with `lowvram train` (into a temporary folder unless --run names one; an existing
run folder with a metrics.json is read, not trained again) and prints, per logged step, the summed
reward, each reward function's mean and the completion length (TRL's logs, as `lowvram show`
reports them), then the mean reward of the first and the last quarter of the steps and the rise,
and writes the table to bench/results/grpo_demo.txt. Time it on an idle machine: the wall time of
the run is printed with the host's load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def train(recipe: Path, run: Path) -> tuple[dict, float]:
    from typer.testing import CliRunner

    from lowvram.cli import app
    from lowvram.runfiles import METRICS

    metrics = run / METRICS
    t0 = time.perf_counter()
    if not metrics.exists():
        r = CliRunner().invoke(app, ["train", str(recipe), "--set", f"training.output_dir={run}", "--overwrite",
                                     "--no-track-memory"])
        if r.exit_code != 0:
            sys.exit(f"lowvram train failed ({r.exit_code}):\n{r.output[-3000:]}")
    return json.loads(metrics.read_text()), time.perf_counter() - t0


def table(m: dict) -> list[str]:
    """One line per logged step: the summed reward, each function's mean, the completion length."""
    total = dict(m.get("reward_history") or [])
    functions = {name: dict(f.get("history") or []) for name, f in (m.get("reward_functions") or {}).items()}
    length = dict(m.get("completion_length_history") or [])
    lines = [f"{'step':>5} {'reward':>8} " + " ".join(f"{n:>10}" for n in functions) + f" {'length':>7}"]
    for s in sorted(total):
        lines.append(f"{s:>5} {total[s]:>8.3f} " + " ".join(f"{functions[n].get(s, float('nan')):>10.3f}" for n in functions)
                     + f" {length.get(s, float('nan')):>7.1f}")
    return lines


def rise(history: list[list[float]]) -> tuple[float, float]:
    """(mean of the first quarter of the logged steps, mean of the last quarter)."""
    values = [v for _, v in history]
    k = max(1, len(values) // 4)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=str(REPO / "recipes" / "smollm2-135m-grpo.yaml"))
    ap.add_argument("--run", help="run folder (default: a temporary one)")
    ap.add_argument("--out", help="results file (default: bench/results/grpo_demo.txt; '' for none)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        m, wall = train(Path(args.recipe), Path(args.run) if args.run else Path(tmp) / "run")
    lines = [f"{Path(args.recipe).name}: {m.get('steps')} steps in {wall:.0f} s wall (load average "
             f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores), peak {m.get('peak_memory_bytes', 0) / 2**30:.2f} GiB "
             f"({m.get('peak_memory_kind') or 'measured'}), {(m.get('predicted_peak_bytes') or 0) / 2**30:.2f} GiB planned "
             "(tensors)", *table(m)]
    if m.get("reward_history"):
        first, last = rise(m["reward_history"])
        lines.append(f"mean reward: first quarter {first:+.3f}, last quarter {last:+.3f}, rise {last - first:+.3f}")
        for name, f in (m.get("reward_functions") or {}).items():
            a, b = rise(f["history"])
            lines.append(f"  {name}: {a:+.3f} -> {b:+.3f}")
    print("\n".join(lines))
    out = args.out if args.out is not None else str(RESULTS / "grpo_demo.txt")
    if out:
        Path(out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
