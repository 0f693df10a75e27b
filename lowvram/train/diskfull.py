"""A full disk, recognised in whatever a writer raises, and the file that did not fit.

Used by recover.py (the run's error and hint), run.py (the final save, the loss plot) and
merge.py. No torch or transformers here.
"""

from __future__ import annotations

import errno
from pathlib import Path

# torch.save's zip writer (caffe2 inline_container.cc) reports a short write as a RuntimeError
# without the errno: "[enforce fail at inline_container.cc:672] . unexpected pos 1234 vs 1180" or
# "PytorchStreamWriter failed writing file data/0: file write failed" (issue 15: optimizer.pt on a
# full 30 MB tmpfs gave the first). Its words count only from a RuntimeError (or an OSError).
TORCH_WRITER_MESSAGES = ("PytorchStreamWriter failed", "unexpected pos", "file write failed")
# The OS's own strings (strerror of ENOSPC / EDQUOT, 122 on Linux) count from any exception: the
# Rust writers raise exceptions that are neither OSError nor RuntimeError, with the errno in the
# text only (issue 24, on a real tmpfs): safetensors' SafetensorError (a plain Exception
# subclass, safetensors/src/lib.rs) "Error while serializing: I/O error: No space left on device
# (os error 28)", and tokenizers' Tokenizer.save a plain ``Exception: No space left on device (os
# error 28)``.
OS_MESSAGES = ("No space left on device", "Disk quota exceeded", "(os error 28)", "(os error 122)")


def _chain(exc: BaseException | None):
    """``exc`` and the exceptions it wraps (``__cause__``, else ``__context__``), each once."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_disk_full(exc: BaseException) -> bool:
    codes = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
    for e in _chain(exc):  # torch.save wraps the OSError in a RuntimeError
        if isinstance(e, OSError) and e.errno in codes:
            return True
        if isinstance(e, Exception) and any(m in str(e) for m in OS_MESSAGES):
            return True
        if isinstance(e, (OSError, RuntimeError)) and any(m in str(e) for m in TORCH_WRITER_MESSAGES):
            return True
    return False


def written_file(exc: BaseException | None, under: Path) -> Path | None:
    """The file that a failed save was writing: the one an OSError in ``exc`` names, else the
    path below ``under`` (not a folder) held by a local of the innermost frame of the traceback
    that holds one: safetensors.torch.save_file's ``filename``, the tokenizer's ``tokenizer_file``
    (transformers tokenization_utils_tokenizers._save_pretrained), torch.save's ``f``. The Rust
    writers' errors name no file and safetensors removes its half-written one, so neither the
    error nor the folder says which file did not fit."""
    for e in _chain(exc):  # the file an OSError names, in the exception or one it wraps
        if getattr(e, "filename", None):
            return Path(e.filename)
    root = str(under.resolve())
    for e in _chain(exc):
        frames, tb = [], e.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        for frame in reversed(frames):
            for value in list(frame.f_locals.values()):
                path = _path_below(value, root)
                if path is not None:
                    return path
    return None


def staged_file_that_did_not_fit(exc: BaseException, tmp: Path, out: Path) -> Path | None:
    """For a save staged in ``tmp`` and moved into ``out`` (the final save, a merge): None when
    ``exc`` is not a full disk; else the file that did not fit, named as it would be in ``out``
    (``out`` itself when no file can be told)."""
    if not is_disk_full(exc):
        return None
    written = written_file(exc, tmp)
    return _in_place_of(written, tmp, out) if written else out


def _in_place_of(path: Path, tmp: Path, out: Path) -> Path:
    """``path`` as it would have been named in ``out`` (the files are written into ``tmp``, which
    is removed before the error is shown, then moved into ``out``)."""
    try:
        return out / Path(path).resolve().relative_to(tmp.resolve())
    except ValueError:
        return Path(path)


def _path_below(value, root: str) -> Path | None:
    if not isinstance(value, (str, Path)) or len(str(value)) > 4096 or "\0" in str(value):
        return None
    try:
        p = Path(value).resolve()
        return p if str(p).startswith(root + "/") and not p.is_dir() else None
    except (OSError, ValueError, RuntimeError):
        return None
