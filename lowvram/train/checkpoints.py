"""Which checkpoint `--resume` continues from, checked by content.

recover.py marks a checkpoint complete with ``lowvram-checkpoint.json``: each file's size and
sha256. The sizes are checked wherever checkpoints are listed (cheap); the hashes only here, when a
run resumes: the newest checkpoint whose files hash as recorded is taken, and each newer one that
does not is named with the reason (a file changed on disk after it was written: a bad disk, a
copy that went wrong, an editor). No torch here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lowvram.errors import LowvramError


def content_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from by content, or None (markers without hashes, from
    an older lowvram or another tool, pass: their sizes were checked)."""
    from lowvram.train.manifest import file_sha256
    from lowvram.train.recover import MARKER

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


def resume_checkpoint(out: Path, notify=None) -> Path:
    """The newest complete checkpoint whose content is intact; LowvramError when there is none."""
    from lowvram.train.recover import complete_checkpoints

    notify = notify or (lambda text: (sys.stderr.write(text + "\n"), sys.stderr.flush()))
    folders = sorted((p for p in out.glob("checkpoint-*") if p.is_dir()), key=_step) if out.is_dir() else []
    complete = complete_checkpoints(out)
    skipped = [f"{p.name} (incomplete: written when the process stopped)" for p in folders
               if p not in complete and complete and _step(p) > _step(complete[-1])]
    for p in reversed(complete):
        why = content_problem(p)
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
