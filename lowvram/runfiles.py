"""The names of the files a run writes into its folder, and how each is written (atomically).

The small facts that the run, its checkpoints, the manifest, the launcher and the retry loops
(train/) and the readers of run folders (runs.py, `lowvram runs` / `show`) all need, kept here
once so none of them imports another for a name. No torch here; nothing of lowvram imported.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

METRICS = "metrics.json"  # written last: the run finished
PLAN = "plan.json"
RECIPE = "recipe.yaml"
MANIFEST = "lowvram-run.json"  # every path the run writes (manifest.py)
MARKER = "lowvram-checkpoint.json"  # in a checkpoint folder: it is whole (checkpoints.py)
# The Trainer's checkpoint folders (transformers' PREFIX_CHECKPOINT_DIR + "-" + the global step).
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
CHECKPOINT_GLOB = "checkpoint-*"

# Written by `lowvram train --gpus N` before the run starts (launch.py): not a sign of an earlier run.
CONFIG = "accelerate_config.yaml"
LAUNCH_PLAN = "launch-plan.json"
LAUNCH_REQUEST = "launch-request.json"  # the plan's request, for the workers' Replanner
LAUNCH_LOG = "launch.log"
LAUNCH_FILES = (CONFIG, LAUNCH_PLAN, LAUNCH_REQUEST, LAUNCH_LOG)

OOM_REPORT = "oom-rank{rank}.json"  # a launched worker's out-of-memory, for the launcher (oom.py)


def write_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same folder + rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; a run's files are like any other
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.filename is None:  # a failed write()/close() names no file: say which one did not fit
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_folder(step: int) -> str:
    """The name of the Trainer's checkpoint folder for ``step``."""
    return f"checkpoint-{step}"


def checkpoint_number(p: Path) -> int | None:
    """N of a ``checkpoint-N`` folder name, else None."""
    m = CHECKPOINT.match(p.name)
    return int(m.group(1)) if m else None
