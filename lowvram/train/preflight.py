"""`validate` and `train --dry-run`: the recipe's local files exist, its first rows parse and
the model folder's JSON and weight files are whole (runfiles.folder_problem).

The same rules as training uses (data.py decides what is a local file and what a hub id,
model.py where a model folder is), without loading a model or a whole dataset: a few
milliseconds, so a missing file is reported before anything heavy starts, not after the model
has loaded. No torch here.
"""

from __future__ import annotations

from pathlib import Path

from lowvram.errors import LowvramError

_HEAD_BYTES = 1 << 16  # the first rows of a JSON Lines file: enough for a few rows, read in microseconds


def input_problems(recipe) -> list[str]:
    """One line per missing or unreadable input (empty when all are there)."""
    from lowvram.runfiles import folder_problem
    from lowvram.train.data.read import is_local
    from lowvram.train.model import resolve_model_location

    problems = []
    try:
        damaged = folder_problem(Path(resolve_model_location(recipe)), model_files(recipe))  # a hub id: no folder
        if damaged:
            problems.append(f"{damaged[0]} is damaged: {damaged[1]}")
    except LowvramError as e:
        problems.append(e.message)
    for spec in recipe.data.datasets:
        path = recipe.resolve_path(spec.path)
        suffix = path.suffix.lower()
        if not is_local(path, spec.path):
            continue  # a hub dataset: checked when it downloads
        if not path.is_file():
            problems.append(f"data file not found: {path}" if not path.exists() else f"{path} is a folder, not a data file")
        elif suffix in (".jsonl", ".ndjson") and not recipe.data.skip_bad_rows:
            problems += _first_rows_problem(path)
    return problems


def model_files(recipe) -> tuple[str, ...] | None:
    """The files of the model folder that training reads and that runfiles.folder_problem
    checks: a GGUF model's gguf_file only (a folder may hold several quantizations); else all."""
    return (recipe.model.gguf_file,) if recipe.model.gguf_file else None


def _first_rows_problem(path) -> list[str]:
    from lowvram.train.data.read import BadRow, jsonl_rows

    with path.open("rb") as f:
        head = f.read(_HEAD_BYTES)
    if len(head) == _HEAD_BYTES:
        head = head[: head.rfind(b"\n") + 1]  # whole lines only
    try:
        rows = list(jsonl_rows(head.decode("utf-8-sig"), path.name))
    except UnicodeDecodeError as e:
        return [f"{path}: not UTF-8 text (byte {e.start})"]
    bad = [f"{r.where}: {r.data}" for r in rows if isinstance(r.data, BadRow)]
    if not rows:
        return [f"{path}: the data file is empty"]
    return bad[:1]  # the first; training reports each, or skips them with data.skip_bad_rows


def check_inputs(recipe) -> None:
    problems = input_problems(recipe)
    if problems:
        raise LowvramError(
            f"{len(problems)} input{'s' if len(problems) != 1 else ''} of the recipe cannot be read:\n  "
            + "\n  ".join(problems),
            "paths in a recipe are relative to the recipe file; fix them and run `lowvram validate RECIPE` again",
        )
