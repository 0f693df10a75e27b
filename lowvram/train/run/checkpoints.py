"""Complete checkpoints, and which one `--resume` continues from, checked by content.

The Trainer writes a checkpoint folder file by file; a process killed half-way leaves a folder
that looks like a checkpoint. :func:`mark_complete` (from the run's ``on_save`` callback,
signals.py) writes ``lowvram-checkpoint.json`` after the Trainer's last file, atomically: each
file's size and sha256; only folders whose marker matches their files are resumed from. The sizes are checked wherever checkpoints are listed (cheap); the hashes only here, when a
run resumes: the newest checkpoint whose files hash as recorded is taken, and each newer one that
does not is named with the reason (a file changed on disk after it was written: a bad disk, a
copy that went wrong, an editor). No torch here.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.runfiles import (
    CHECKPOINT_GLOB,
    MARKER,
    checkpoint_number,
    file_sha256,
    folder_problem,
    write_atomic,
)

if TYPE_CHECKING:
    from collections.abc import Callable


def mark_complete(folder: Path) -> None:
    """Write the marker listing every file of a checkpoint that is now whole, with its size and
    sha256 (read back while the file is still in the page cache; called last)."""
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MARKER and not p.name.startswith(".")]
    files = {str(p.relative_to(folder)): p.stat().st_size for p in paths}
    sums = {str(p.relative_to(folder)): file_sha256(p) for p in paths}
    write_atomic(folder / MARKER, json.dumps({"files": files, "sha256": sums}, indent=1) + "\n")


def _marker_matches(folder: Path) -> bool:
    try:
        files = json.loads((folder / MARKER).read_text())["files"]
        return bool(files) and all((folder / n).is_file() and (folder / n).stat().st_size == size
                                   for n, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _looks_complete(folder: Path) -> bool:
    """A checkpoint lowvram did not mark (another tool, an older lowvram): the Trainer writes
    trainer_state.json last, so it must parse, next to some model weights."""
    try:
        json.loads((folder / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    return any(p.stat().st_size > 0 for pat in ("*.safetensors", "*.bin", "pytorch_model_fsdp_*")
               for p in folder.glob(pat))


def complete_checkpoints(out: Path) -> list[Path]:
    """Checkpoint folders that can be resumed from, oldest first.

    Where lowvram marks checkpoints (any folder has a marker), an unmarked one is partial: the
    process died while writing it. Elsewhere the Trainer's own files are checked."""
    found = []
    for p in out.glob(CHECKPOINT_GLOB) if out.is_dir() else ():
        n = checkpoint_number(p)
        if n is not None and p.is_dir():
            found.append((n, p))
    marked = any((p / MARKER).exists() for _, p in found)
    ok = _marker_matches if marked else _looks_complete
    return [p for _, p in sorted(found) if ok(p)]


def partial_checkpoints(out: Path) -> list[Path]:
    """Checkpoint folders newer than the last complete one (being written when it failed)."""
    complete = complete_checkpoints(out)
    last = checkpoint_number(complete[-1]) if complete else -1
    return [p for p in out.glob(CHECKPOINT_GLOB)
            if (n := checkpoint_number(p)) is not None and p.is_dir() and n > last]


def content_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from by content, or None (markers without hashes, from
    an older lowvram or another tool, pass: their sizes were checked)."""
    try:
        sums = json.loads((folder / MARKER).read_text()).get("sha256") or {}
    except (OSError, ValueError, AttributeError):
        return None
    for name, expected in sums.items():
        path = folder / name
        try:
            actual = file_sha256(path)
        except OSError as e:
            return f"{name} cannot be read ({e.strerror or e})"
        if actual != expected:
            return f"{name} changed after it was written (sha256 {actual[:12]}..., recorded {str(expected)[:12]}...)"
    return None


def resume_checkpoint(out: Path, notify: Callable[[str], None] | None = None) -> Path:
    """The newest complete checkpoint whose content is intact; LowvramError when there is none."""
    notify = notify or (lambda text: (sys.stderr.write(text + "\n"), sys.stderr.flush()))
    folders = sorted((p for p in out.glob(CHECKPOINT_GLOB) if p.is_dir()), key=_step) if out.is_dir() else []
    complete = complete_checkpoints(out)
    skipped = [f"{p.name} (incomplete: written when the process stopped)" for p in folders
               if p not in complete and complete and _step(p) > _step(complete[-1])]
    for p in reversed(complete):
        why = content_problem(p) or (None if _hashed(p) else _damaged(p))
        if why is None:
            for line in skipped:
                notify(f"note: skipped {line}")
            return p
        skipped.append(f"{p.name} ({why})")
    listed = ", ".join(p.name for p in folders) or "none"
    detail = ("; skipped " + "; ".join(skipped)) if skipped else ""
    raise LowvramError(
        f"no checkpoint to resume from in {out} (checkpoint folders: {listed}){detail}",
        "checkpoints are written every training.save_steps steps; run with --overwrite to start over",
    )


def _hashed(folder: Path) -> bool:
    """Its marker records every file's sha256 (this lowvram's): content_problem checked them all."""
    try:
        return bool(json.loads((folder / MARKER).read_text()).get("sha256"))
    except (OSError, ValueError, AttributeError):
        return False


def _damaged(folder: Path) -> str | None:
    """A checkpoint without hashes (another tool, an older lowvram) whose weights, optimizer
    state or JSON are cut short: torch.load or safetensors would fail in the Trainer's resume."""
    found = folder_problem(folder)
    return f"{found[0].name} is damaged: {found[1]}" if found else None


def _step(p: Path) -> int:
    tail = p.name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else -1


def checkpoint_step(folder: Path) -> tuple[int, int | None]:
    """(global_step, the run's max_steps) from the checkpoint's trainer_state.json."""
    try:
        state = json.loads((folder / "trainer_state.json").read_text())
        return int(state["global_step"]), (int(state["max_steps"]) if state.get("max_steps") else None)
    except (OSError, ValueError, KeyError, TypeError):
        return _step(folder), None


def mid_generation_cycle(checkpoint: Path, grad_accum: int, steps_per_generation: int, num_iterations: int) -> str | None:
    """grpo/rloo: why ``checkpoint`` cannot be resumed exactly (None: it can). TRL regenerates once
    every steps_per_generation x num_iterations micro-steps and keeps the completions in memory
    between (GRPOTrainer._prepare_inputs: ``self._step % generate_every``, ``_buffered_inputs``);
    neither is in a checkpoint, so a resume starts a new generation round. At a step that ends a
    round that is what the uninterrupted run does; inside one (num_iterations > 1, or a generation
    batch spanning optimizer steps) the resumed run would generate again for prompts it had
    completions of, and its rounds would fall out of step with TRL's sampler: another training."""
    every = steps_per_generation * num_iterations
    step, _ = checkpoint_step(checkpoint)
    if not every or (step * grad_accum) % every == 0:
        return None
    per = every // math.gcd(every, grad_accum)  # optimizer steps per generation round, reused num_iterations times
    return (f"{checkpoint.name} is inside a generation round: TRL regenerates every {every} micro-steps "
            f"(steps_per_generation {steps_per_generation} x num_iterations {num_iterations}), every {per} "
            f"optimizer steps here, and keeps that round's completions only in memory")


def check_generation_round(checkpoint: Path, grad_accum: int, steps_per_generation: int, num_iterations: int) -> None:
    """`--resume` from a grpo/rloo checkpoint inside a generation round (:func:`mid_generation_cycle`):
    refused, naming the last checkpoint that can be resumed."""
    def why(c: Path) -> str | None:
        return mid_generation_cycle(c, grad_accum, steps_per_generation, num_iterations)

    problem = why(checkpoint)
    if problem is None:
        return
    good = [c.name for c in complete_checkpoints(checkpoint.parent) if why(c) is None]
    then = (f"resume from {good[-1]} (a round's end) by removing the checkpoints after it" if good
            else "start over with --overwrite")
    raise LowvramError(f"--resume cannot continue the run exactly: {problem}",
                       f"{then}; a training.save_steps that is a multiple of the round keeps every checkpoint resumable")
