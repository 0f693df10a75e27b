"""One process per run folder: an exclusive lock for `train`, `--resume`, `--overwrite`, `merge --out`.

The lock is a file beside the folder, ``.<name>.lowvram-lock`` (beside, not inside: it exists
before the folder does, `merge --out` needs an empty folder, and `--overwrite` never has to step
around it). It holds the pid, host and start time of its holder and is created with
``O_CREAT | O_EXCL``, which the kernel does atomically: of two processes started at the same
instant exactly one creates it. It is removed when the holder exits (a ``with`` block, also on an
exception or a signal that unwinds). A holder killed with SIGKILL leaves it behind: a lock whose
pid no longer runs on this host is stale, and the next process says so and takes it over.
No torch here.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.runfiles import LOCK_SUFFIX, lock_path, pid_alive, read_lock

if TYPE_CHECKING:
    from collections.abc import Callable

SUFFIX = LOCK_SUFFIX
_TORN_AFTER_S = 10.0  # an empty or unreadable lock older than this was left by a crash while it was taken
_read = read_lock
_pid_alive = pid_alive


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} (started {when}: {holder.get('command', '?')})"


def _stale_reason(path: Path, holder: dict | None) -> str | None:
    """Why the lock at ``path`` no longer protects anything, or None while its holder may run."""
    if holder is None:
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return "it was just released"
        return f"it is unreadable and {age:.0f} s old" if age > _TORN_AFTER_S else None
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return None  # another machine's process: cannot be checked from here
    if pid == os.getpid():
        return None
    return None if _pid_alive(pid) else f"{_describe(holder)} is no longer running"


def folder_words(what: str) -> tuple[str, str]:
    """(what the folder is, the hint when it cannot be written) for the command ``what``."""
    if "--out" in what:
        return "--out", "merge into a folder on writable storage (--out DIR)"
    return "training.output_dir", ("set training.output_dir to a folder on writable storage "
                                   "(--set training.output_dir=DIR); nothing was written")


def _try_create(path: Path, record: dict, what: str = "lowvram train") -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError as e:
        subject, hint = folder_words(what)
        raise LowvramError(f"cannot create the lock file {path} beside {subject}: {e.strerror or e}",
                           hint.replace("a folder on writable storage", "a folder whose parent folder is writable")) from None
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record) + "\n")
    return True


def acquire(folder: Path, what: str, notify: Callable[[str], None] | None = None) -> dict:
    """Take the lock on ``folder`` or raise LowvramError naming its holder; returns our record."""
    from lowvram.runfiles import require_writable

    notify = notify or (lambda text: (sys.stderr.write(text + "\n"), sys.stderr.flush()))
    path = lock_path(folder)
    subject, hint = folder_words(what)
    require_writable(folder, subject, hint)  # read-only storage: said before anything is written
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LowvramError(f"{subject} {folder} cannot be made: {e.strerror or e}", hint) from None
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": what}
    for _ in range(5):  # a stale lock is moved aside, then taken like a free one
        if _try_create(path, record, what):
            return record
        holder = _read(path)
        why = _stale_reason(path, holder)
        if why is None:
            held = _describe(holder) if holder else "a process that is taking it now"
            raise LowvramError(
                f"{folder} is in use by {held}",
                f"wait for it to finish, or stop it; if no such process runs, remove {path}",
            )
        aside = path.with_name(f"{path.name}.stale-{os.getpid()}")
        try:
            os.replace(path, aside)
        except FileNotFoundError:
            continue
        if _read(aside) != holder:  # another process took the stale lock first: give its lock back
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            continue
        aside.unlink(missing_ok=True)
        notify(f"note: took over a stale lock on {folder}: {why}")
    raise LowvramError(f"could not lock {folder}", f"remove {path} if no lowvram process uses the folder")


def held_by_another(folder: Path) -> bool:
    """Whether another process may hold the lock on ``folder`` now (its refusal names it)."""
    path = lock_path(folder)
    if not path.exists():
        return False
    holder = _read(path)
    if holder is not None and holder.get("pid") == os.getpid():
        return False
    return _stale_reason(path, holder) is None


def release(folder: Path, record: dict) -> None:
    """Remove the lock if it is still ours (never another process's)."""
    path = lock_path(folder)
    holder = _read(path)
    if holder and holder.get("pid") == record["pid"] and holder.get("started") == record["started"]:
        try:
            path.unlink(missing_ok=True)
        except OSError:  # its storage turned read-only: the lock is stale once this process ends
            pass


@contextmanager
def run_lock(folder: Path, what: str = "lowvram", notify: Callable[[str], None] | None = None):
    """``with run_lock(out, "train"):`` holds the folder for the block."""
    record = acquire(Path(folder), what, notify)
    try:
        yield record
    finally:
        release(Path(folder), record)

