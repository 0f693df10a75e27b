"""Wall time of `lowvram plan` (must answer in < 1 s: no torch on this path).

Runs the real console command in fresh processes and prints a table plus the import-only time.
Usage: .venv/bin/python bench/plan_speed.py [--runs N]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT_S = 1.0

CASES = [
    ["--model", "llama-7b", "--vram", "24GB"],
    ["--model", "llama-7b", "--vram", "12GB", "--json"],
    ["--model", "llama-2-70b", "--vram", "8GB", "--offload", "none"],  # nothing fits: suggestions
    ["--model", "llama-3.1-8b", "--vram", "16GB", "--seq-len", "8192", "--check"],
]


def _cli() -> list[str]:
    exe = Path(sys.executable).parent / "lowvram"
    return [str(exe)] if exe.exists() else [shutil.which("lowvram") or "lowvram"]


def _time(cmd: list[str], runs: int) -> tuple[float, float]:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return statistics.median(times), max(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rows = [("python -c 'import lowvram.cli'", *_time([sys.executable, "-c", "import lowvram.cli"], args.runs))]
    for case in CASES:
        rows.append(("lowvram plan " + " ".join(case), *_time(_cli() + ["plan", *case], args.runs)))
    width = max(len(r[0]) for r in rows)
    print(f"{'command':<{width}}  median_s  max_s")
    slow = False
    for name, med, worst in rows:
        print(f"{name:<{width}}  {med:8.3f}  {worst:5.3f}")
        slow |= name.startswith("lowvram plan") and med > LIMIT_S
    print(f"limit {LIMIT_S:.1f} s median: {'FAIL' if slow else 'ok'} ({args.runs} runs each)")
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
