"""lm-eval (EleutherAI's lm-evaluation-harness, the [eval] extra) tasks for `lowvram eval --tasks`.

The model already loaded by evaluate.py is handed to lm-eval's ``HFLM`` (its ``pretrained``
takes a model object), so the adapter run's base is scored with the adapter disabled, exactly as
the held-out loss is. Tasks come from task YAML files in ``--task-dir`` (lm-eval's ``TaskManager``
with ``include_path``; read: lm-eval 0.4.13 lm_eval/tasks/manager.py): a task over a local JSONL
file runs offline. Without ``--task-dir`` lm-eval's own tasks are indexed (their data sets come
from the hub: cached, or downloaded when the network allows).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from lowvram.errors import LowvramError

INSTALL_HINT = "pip install 'lowvram[eval]'  (lm-eval 0.4.13 installs beside lowvram's torch, transformers and datasets)"
BATCH_SIZE = 8


def lm_eval_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:
        return None


def task_manager(task_dir: str | Path | None):
    if lm_eval_version() is None:
        raise LowvramError("--tasks needs lm-eval (the [eval] extra), which is not installed", INSTALL_HINT)
    if task_dir is not None and not Path(task_dir).is_dir():
        raise LowvramError(f"--task-dir {task_dir}: no such folder", "pass the folder that holds the task YAML files")
    with _quiet():
        from lm_eval.tasks import TaskManager

        return TaskManager(include_path=str(task_dir) if task_dir else None, include_defaults=task_dir is None)


def check_tasks(tasks: tuple[str, ...], task_dir: str | Path | None) -> None:
    """Every task name is known (before any model loads)."""
    known = set(task_manager(task_dir).all_tasks)
    missing = [t for t in tasks if t not in known]
    if missing:
        where = f"in {task_dir}" if task_dir else "among lm-eval's tasks"
        shown = ", ".join(sorted(known)[:8]) if task_dir else "see `lm-eval ls tasks`"
        raise LowvramError(f"--tasks: no task {', '.join(missing)} {where}",
                           f"known: {shown}" + ("" if task_dir else "; pass --task-dir DIR for task files of your own"))


def run_tasks(model, tokenizer, tasks: tuple[str, ...], task_dir: str | None) -> dict[str, float]:
    """{"TASK METRIC": value} of each task's metrics (stderr columns dropped)."""
    manager = task_manager(task_dir)
    with _quiet() as log:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM

        try:
            out = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=BATCH_SIZE),
                                  tasks=list(tasks), task_manager=manager, log_samples=False, bootstrap_iters=0)
        except Exception as e:  # noqa: BLE001 - lm-eval raises many kinds; each is a failed task run
            raise LowvramError(f"lm-eval failed on {', '.join(tasks)}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                               f"check the task files; lm-eval's log: {log}") from None
    scores = {}
    for task, metrics in (out or {}).get("results", {}).items():
        for key, value in metrics.items():
            name = key.split(",", 1)[0]
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in name \
                    and name != "sample_len":
                scores[f"{task} {name}"] = float(value)
    return scores


@contextlib.contextmanager
def _quiet():
    """lm-eval's warnings, progress bars and its `git describe` go to a log file, not the user's
    terminal (file descriptor 2 redirected: the git child process writes there too)."""
    import logging

    fd, log = tempfile.mkstemp(prefix="lowvram-lm-eval-", suffix=".log")
    saved = os.dup(2)
    logger = logging.getLogger("lm_eval")
    level = logger.level
    failed = True
    try:
        os.dup2(fd, 2)
        logger.setLevel(logging.ERROR)
        yield log
        failed = False
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)
        logger.setLevel(level)
        if not failed:
            os.unlink(log)  # kept only when it explains a failure
