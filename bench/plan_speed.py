"""Wall time of `lowvram plan` (the README's examples: under 0.5 s median; the context table
and the image table under 1.5 s; no torch on this path), the memory estimates each makes, and the import time a
command pays before it plans.

Runs the real console command in fresh processes (median and max wall, median CPU of the child)
and counts each command's full estimates in this process (memory.estimate_memory's checks, the
same command through lowvram.cli.main). Usage: .venv/bin/python bench/plan_speed.py [--runs N]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT_S = 0.5  # a plan: the README's examples (issue 43)
TABLE_LIMIT_S = 1.5  # --context-table: seven cards

# The README's `lowvram plan` lines (README.md "Planning memory", "Newer knobs", "Long context")
CASES = [
    ["--model", "llama-3.1-8b", "--vram", "12GB", "--json"],
    ["--model", "llama-7b", "--vram", "12GB"],
    ["recipes/llama-3.1-8b-qlora.yaml", "--vram", "12GB"],
    ["--model", "qwen2.5-1.5b", "--method", "lora", "--seq-len", "2048", "--vram", "8GB", "--json"],
    ["--model", "llama-3-8b", "--method", "full", "--vram", "24GB", "--check"],
    ["--list-models"],
    ["--model", "Qwen/Qwen3-8B", "--method", "qlora", "--vram", "12GB"],
    ["--model", "google/gemma-3-12b-it", "--method", "qlora", "--vram", "12GB"],
    ["--objective", "kto", "--model", "llama-3.1-8b", "--method", "qlora", "--vram", "12GB", "--batch-size", "4"],
    ["--model", "llama-3.1-8b", "--method", "full", "--vram", "24GiB", "--seq-len", "2048", "--batch-size", "1",
     "--offload", "none"],
    ["--model", "llama-2-70b", "--vram", "8GB", "--offload", "none"],  # nothing fits: suggestions
    # data.max_pixels auto lowering the images (plan/choose/pixels.py: the grid bisected)
    ["--model", "qwen2.5-vl-7b", "--vram", "9GB", "--seq-len", "2048", "--max-pixels", "auto"],
]
TABLE = ["--model", "llama-3.1-8b", "--method", "qlora", "--lora-r", "32", "--offload", "none", "--context-table",
         "--host-ram", "160GiB"]
IMAGE_TABLE = ["--model", "qwen2.5-vl-7b", "--method", "qlora", "--image-table", "--seq-len", "1024", "--host-ram",
               "160GiB"]


def _cli() -> list[str]:
    exe = Path(sys.executable).parent / "lowvram"
    return [str(exe)] if exe.exists() else [shutil.which("lowvram") or "lowvram"]


def _time(cmd: list[str], runs: int) -> tuple[float, float, float]:
    """(median wall, max wall, median CPU) of ``runs`` fresh processes, after one not counted."""
    walls, cpus = [], []
    for i in range(runs + 1):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if i:
            walls.append(wall)
            cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return statistics.median(walls), max(walls), statistics.median(cpus)


def _estimates(args: list[str]) -> int:
    """Full memory estimates one `lowvram plan ARGS` makes (run here through lowvram.cli.main)."""
    from lowvram import cli
    from lowvram.plan.memory import memory

    count = [0]
    real = memory._check  # every estimate_memory checks its setup once first

    def counted(setup):
        count[0] += 1
        return real(setup)

    memory._check = counted
    argv, sys.argv = sys.argv, ["lowvram", "plan", *args]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            with contextlib.suppress(SystemExit):
                cli.main()
    finally:
        memory._check, sys.argv = real, argv
    return count[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    os.chdir(REPO)
    py = [sys.executable, "-c"]
    rows = [("python -c 'import lowvram.cli'", *_time(py + ["import lowvram.cli"], args.runs), None, None),
            ("python -c 'import <the plan path>'",
             *_time(py + ["import lowvram.cli, lowvram.planning.entry, lowvram.plan.choose.choose, lowvram.report.plans"],
                    args.runs), None, None)]
    for case, limit in [(c, LIMIT_S) for c in CASES] + [(TABLE, TABLE_LIMIT_S), (IMAGE_TABLE, TABLE_LIMIT_S)]:
        rows.append(("lowvram plan " + " ".join(case), *_time(_cli() + ["plan", *case], args.runs),
                     _estimates(case), limit))
    width = max(len(r[0]) for r in rows)
    print(f"{'command':<{width}}  median_s  max_s  cpu_s  estimates  limit_s")
    slow = []
    for name, med, worst, cpu, n, limit in rows:
        print(f"{name:<{width}}  {med:8.3f}  {worst:5.3f}  {cpu:5.3f}  {'' if n is None else n:>9}  "
              f"{'' if limit is None else limit:>7}")
        if limit is not None and med > limit:
            slow.append(name)
    print(f"{args.runs} runs each (wall: median and max; cpu: the child's user + sys, median); "
          f"over the limit: {len(slow)}" + (f" ({'; '.join(slow)})" if slow else ""))
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
