"""The names of the files a run writes into its folder, and how each is written (atomically).

The small facts that the run, its checkpoints, the manifest, the launcher and the retry loops
(train/) and the readers of run folders (past_runs.py, `lowvram runs` / `show`) all need, kept here
once so none of them imports another for a name; and the check for damaged files that each of
them runs before a library reads one. No torch here; of lowvram only its errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

METRICS = "metrics.json"  # written last: the run finished
PLAN = "plan.json"
RECIPE = "recipe.yaml"
EXPORTS = "exports.json"  # one row per `lowvram export` of the run (train/after/export.py)
EVALS = "evals.json"  # one row per `lowvram eval` of the run: base and trained scores (train/after/evaluate.py)
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


LOCK_SUFFIX = ".lowvram-lock"  # beside a run folder while a process trains in it (train/run/lock.py)


def lock_path(folder: Path) -> Path:
    """The lock file of a run folder: ``.<name>.lowvram-lock`` beside it (train/run/lock.py says why)."""
    folder = Path(folder).resolve()
    return folder.parent / f".{folder.name}{LOCK_SUFFIX}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    return True


def read_lock(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def lock_holder(folder: Path) -> dict | None:
    """Who trains in ``folder`` now: its lock's record while its process runs (on another host:
    taken as running, it cannot be checked from here), else None (no lock, or a stale one)."""
    import socket

    holder = read_lock(lock_path(folder))
    if holder is None:
        return None
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid):
        return None
    return holder


def write_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same folder + rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as e:  # read-only storage, no permission: name the file meant, not the temp file
        raise OSError(e.errno, e.strerror, str(path)) from e
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


def require_writable(folder: Path, what: str, hint: str) -> None:
    """LowvramError naming ``folder`` (or, not made yet, the nearest folder above it that exists)
    when nothing can be written there: read-only storage (EROFS, which root meets too), no
    permission. Checked by creating and removing a temporary file: true for every filesystem,
    its permissions, ACLs and mount flags alike, and for root. Nothing stays written."""
    from lowvram.errors import LowvramError

    here = Path(folder).absolute()
    while not here.is_dir() and here != here.parent:
        here = here.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=".lowvram-write-check.", dir=here)
    except OSError as e:
        where = f"{what} {folder}" if here == Path(folder).absolute() else f"{here}, the folder that would hold {what} {folder},"
        raise LowvramError(f"{where} cannot be written: {e.strerror or e}", hint) from None
    os.close(fd)
    os.unlink(tmp)


def is_read_only(exc: BaseException) -> bool:
    """A write refused by read-only storage: an OSError with EROFS in ``exc`` or what it wraps, or
    the OS's words in the text of a writer that keeps no errno (the Rust writers: "(os error 30)")."""
    import errno

    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.EROFS:
            return True
        if isinstance(e, Exception) and ("Read-only file system" in str(e) or "(os error 30)" in str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


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


# --------------------------------------------------------------------------------------------
# Damaged files: what a library would fail on with its own traceback, found before it reads them


def file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be what its name says (truncated, garbage), or None: a JSON file that
    does not parse, a safetensors file whose header or length is wrong, a torch zip file
    (``torch.save``'s format since torch 1.6) without its central directory, a GGUF file without
    its magic. Cheap: headers and small files only, never a tensor's data."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
        elif suffix == ".safetensors":
            return _safetensors_problem(path)
        elif suffix in (".pt", ".pth", ".bin"):
            return _torch_zip_problem(path)
        elif suffix == ".gguf":
            return _gguf_problem(path)
    except UnicodeDecodeError as e:
        return f"not UTF-8 text (byte {e.start})"
    except ValueError as e:  # json.JSONDecodeError
        return f"not valid JSON ({e})"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None


def _safetensors_problem(path: Path) -> str | None:
    # The format (safetensors' README, "Format"): 8 bytes little-endian N, N bytes of JSON header,
    # then the tensors' bytes; each tensor's data_offsets end at or before the data's length,
    # and the file ends where the last tensor does (safetensors' "file not fully covered").
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"truncated ({size} bytes: no safetensors header)"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"truncated ({size} bytes; its header alone is {n + 8})"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "not a safetensors file (its header is not a JSON object)"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2]
    data = size - 8 - n
    if ends and max(ends) != data:
        return f"truncated ({size} bytes; its tensors need {max(ends) + 8 + n})" if max(ends) > data else \
            f"has {data - max(ends)} bytes after its last tensor (not a whole safetensors file)"
    return None


def _torch_zip_problem(path: Path) -> str | None:
    import zipfile

    with path.open("rb") as f:
        if f.read(2) != b"PK":
            return None  # the legacy pickle format (or not torch's at all): nothing to check cheaply
    try:
        with zipfile.ZipFile(path):
            return None
    except zipfile.BadZipFile:
        return f"cut short or overwritten ({path.stat().st_size} bytes; torch.save's zip archive has no central directory)"


def _gguf_problem(path: Path) -> str | None:
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            return "not a GGUF file (no GGUF magic at its start)"
    try:
        from gguf import GGUFReader  # the reader transformers loads GGUF files with
    except ImportError:
        return None
    try:
        GGUFReader(str(path))  # parses every tensor's description against the file's length (a memmap)
    except Exception as e:  # noqa: BLE001 - the reader's ValueError / IndexError / struct.error of a cut file
        return f"cannot be parsed ({path.stat().st_size} bytes: {str(e).splitlines()[0] if str(e) else type(e).__name__})"
    return None


def folder_problem(folder: Path, only: tuple[str, ...] | None = None) -> tuple[Path, str] | None:
    """The first damaged file directly in ``folder`` (file_problem), or one that is not an
    ordinary file (a FIFO, a device: inputfiles.not_ordinary), with why; None if none is.
    ``only``: the names to check (a GGUF model folder: its gguf_file, not the other GGUFs)."""
    from lowvram.inputfiles import not_ordinary

    if not folder.is_dir():
        return None
    for p in sorted(folder.iterdir()):
        if p.name.startswith(".") or (only is not None and p.name not in only):
            continue
        kind = not_ordinary(p)  # a FIFO would block the library that opens it, /dev/zero never end
        if kind and kind != "a folder":
            return p, f"it is {kind}, not an ordinary file"
        if p.is_file() and (why := file_problem(p)):
            return p, why
    return None


DAMAGED_HINT = "copy or download the file again (a full disk or a copy that stopped leaves such files)"


def require_intact(folder: Path, hint: str = DAMAGED_HINT, only: tuple[str, ...] | None = None) -> None:
    """LowvramError naming the first damaged file in ``folder`` (folder_problem), before a
    library reads it and fails with its own traceback (a truncated safetensors file gives
    safetensors' SafetensorError, a broken tokenizer.json a JSONDecodeError)."""
    from lowvram.errors import LowvramError

    found = folder_problem(Path(folder), only)
    if found:
        raise LowvramError(f"{found[0]} is damaged: {found[1]}", hint)
