"""The run folder before a run: check it against --resume/--overwrite, start its manifest, and
find the checkpoint to resume from. No torch here.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError, UsageError
from lowvram.runfiles import CHECKPOINT_GLOB, LAUNCH_FILES, MARKER, METRICS, checkpoint_number
from lowvram.train.run import manifest

if TYPE_CHECKING:
    from collections.abc import Callable

    from lowvram.plan.types import Plan
    from lowvram.recipe import Recipe


def prepare_output_dir(out: Path, resume: bool, overwrite: bool, recipe: Recipe | None = None, plan: Plan | None = None,
                       notify: Callable[[str], None] | None = None) -> Path | None:
    """Check the folder against --resume/--overwrite; returns the checkpoint to resume from.

    Called with the folder locked (lock.py). With ``recipe``: a resume is checked against the
    run's recipe (resume_check.py), and a new run records its data hashes in its manifest."""
    refuse_early(out, resume, overwrite, recipe)
    if resume:
        from lowvram.train.run.checkpoints import resume_checkpoint

        checkpoint = resume_checkpoint(out, notify)
        if recipe is not None:
            from lowvram.train.run.resume_check import check_resume

            check_resume(out, recipe, plan, notify)
        for tmp in out.glob(".final-*"):  # a final save the process did not finish: done again
            shutil.rmtree(tmp, ignore_errors=True)
        _unmark_newer(out, checkpoint)
        manifest.clear_stop(out)  # a stopped run resumed (its cause mended): it runs again
        return checkpoint
    hashes = manifest.data_hashes(recipe) if recipe is not None else {}
    model = manifest.model_hashes(recipe) if recipe is not None else {}
    if not _has_content(out):
        old = manifest.read(out) if out.is_dir() else None
        created = old["created_folder"] if old else not out.is_dir() or not any(out.iterdir())
        manifest.start(out, bool(created), hashes, model)
        return None
    # A run's folder with content: refuse_early let it through for --overwrite only.
    created = bool((manifest.read(out) or {}).get("created_folder"))
    left = manifest.remove_run(out)
    if left:
        (notify or _note)(f"note: --overwrite kept what the run did not write in {out}: {', '.join(left[:6])}")
    manifest.start(out, created, hashes, model)
    return None


def refuse_early(out: Path, resume: bool, overwrite: bool, recipe: Recipe | None = None) -> None:
    """The refusals of :func:`prepare_output_dir` that need nothing but the folder, so `lowvram
    train` says them before it plans (seconds to minutes for a large model) and again under the
    lock: the flags contradict, the folder is a file, the home folder, not a run, a finished run
    without --overwrite (or --resume on it with nothing more to train), an unfinished one without
    --resume. Nothing is written or read beyond names and metrics.json."""
    if resume and overwrite:
        raise UsageError("--resume and --overwrite contradict each other", "pass one of them")
    if out.exists() and not out.is_dir():
        raise LowvramError(f"training.output_dir {out} is a file", "set training.output_dir to a folder")
    if resume:
        _refuse_finished(out, recipe)
        return
    manifest.check_output_dir_is_safe(out, recipe.source if recipe is not None else None, overwrite)
    if not _has_content(out):
        return
    if not manifest.is_run(out):
        raise LowvramError(
            f"training.output_dir {out} is not empty and holds no lowvram run",
            "choose an empty or new folder for training.output_dir (nothing was deleted)",
        )
    if overwrite:
        return
    if (out / METRICS).is_file():
        raise LowvramError(
            f"{out} already holds a finished run",
            "pass --overwrite to replace it, or set training.output_dir (--set training.output_dir=runs/new)",
        )
    raise LowvramError(
        f"{out} holds an unfinished run",
        "pass --resume to continue from its last checkpoint, or --overwrite to start over",
    )


def _refuse_finished(out: Path, recipe: Recipe | None) -> None:
    """--resume on a finished run (its metrics.json written) trains nothing and must change no
    file of it; it continues only where training.max_steps asks for more steps than it took
    (from its final checkpoint: the Trainer saves at the last step)."""
    from lowvram.metrics import read_metrics

    if not (out / METRICS).is_file():
        return
    metrics = read_metrics(out / METRICS)
    if metrics is None or metrics.steps is None:
        return  # damaged: the resume's own checks name it, or finish the run again
    t = recipe.training if recipe is not None else None
    if t is not None and t.max_steps is not None and t.max_steps > metrics.steps:
        return
    more = metrics.steps * 2
    if t is not None and t.lr_scheduler == "constant" and not t.warmup_ratio:
        how = (f"to train more, raise training.max_steps: `--resume --set training.max_steps={more}` "
               "continues from its final checkpoint; or start a new run with "
               "--set training.output_dir=runs/new")
    else:
        sched = t.lr_scheduler if t is not None else "the run's"
        how = ("to train more, start a new run with --set training.output_dir=runs/new (raising "
               f"training.max_steps would change the {sched} learning-rate schedule of the steps already "
               "taken; with lr_scheduler constant and no warmup, `--resume --set "
               f"training.max_steps={more}` continues from its final checkpoint)")
    raise LowvramError(f"{out} holds a finished run ({metrics.steps} steps): --resume continues an unfinished "
                       "run, so nothing was trained and no file was changed", how)


def _has_content(out: Path) -> bool:
    # `lowvram train --gpus N` writes its accelerate config and launch plan before the run starts;
    # a run that stopped before training wrote only its manifest.
    return out.is_dir() and not manifest.only_manifest(out, LAUNCH_FILES)


def _note(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _unmark_newer(out: Path, checkpoint: Path) -> None:
    """Checkpoints after the one resumed from (skipped as corrupt or partial) are written again by
    the resumed run; until then they are not complete (a crash while rewriting one must not
    leave its old marker claiming it whole)."""
    step = checkpoint_number(checkpoint)
    for p in out.glob(CHECKPOINT_GLOB):
        if (n := checkpoint_number(p)) is not None and n > step:
            (p / MARKER).unlink(missing_ok=True)
