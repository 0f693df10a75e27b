"""What each rank runs under ``accelerate launch``: ``python -m lowvram.train.run.worker RECIPE``.

``lowvram train RECIPE --gpus N`` plans once, writes the plan and its request as JSON and starts
``accelerate launch ... -m lowvram.train.run.worker RECIPE --plan PLAN.json --request REQUEST.json``:
every rank trains with exactly the parent's plan (no rank plans, against its own view of the
hardware or otherwise: this module imports nothing from lowvram.planning), and predicts the peak at
the data's length from the request (lowvram.plan.choose.replan). The recipe gives the data and the output
folder. Only rank 0 prints progress and writes the run files; the parent prints the summary from
metrics.json.

    python -m lowvram.train.run.worker RECIPE --plan PLAN.json [--request REQUEST.json] [--set key=value ...] [--resume]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lowvram.errors import LowvramError, error_text


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lowvram.train.run.worker", description=__doc__.splitlines()[0])
    p.add_argument("recipe", type=Path)
    p.add_argument("--plan", type=Path, required=True, help="the parent's plan (JSON, launch-plan.json)")
    p.add_argument("--request", type=Path, default=None,
                   help="the plan's request (JSON, launch-request.json); without it no peak is predicted")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    return p.parse_args(argv)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if rank() != 0:
        # Progress and library chatter from rank 0 only; errors still reach stderr.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    try:
        from lowvram.recipe import load_recipe

        recipe = load_recipe(args.recipe, args.overrides)
        from lowvram.train.run.launch import read_plan, read_replanner

        plan = read_plan(args.plan)
        replanner = read_replanner(args.request)
        import json

        from lowvram.train.build.trainer import output_dir
        from lowvram.train.run import oom, signals
        from lowvram.train.run.run import run_training
        from lowvram.train.types import RetryLog, TrainOptions

        extra = json.loads(os.environ.get(oom.EXTRA_METRICS_ENV) or "{}")
        reporting = os.environ.get(oom.REPORT_ENV) == "1"  # the launcher re-plans after an OOM
        options = TrainOptions(recipe_path=args.recipe, overrides=tuple(args.overrides), resume=args.resume,
                               track_memory=None)  # None: the launcher's LOWVRAM_TRACK_MEMORY
        try:
            run_training(recipe, plan, options, prepared=True,
                         retries=RetryLog.from_dict(extra) if extra else None, replanner=replanner)
        except oom.TrainingOOM as err:
            if not reporting:
                raise
            # The launcher re-plans and says what happened; torchrun stops the other ranks.
            oom.write_oom_report(output_dir(recipe), rank(), err)
            return err.exit_code
        except signals.TrainingInterrupted as err:
            # Stopped by torchrun because another rank ran out of memory: the launcher speaks.
            if reporting and oom.has_oom_reports(output_dir(recipe)):
                return err.exit_code
            raise
    except LowvramError as err:
        if rank() == 0:  # the CLI's error/hint lines; the launcher shows them to the user
            sys.stderr.write(error_text(err))
            sys.stderr.flush()
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
