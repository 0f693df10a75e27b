"""What lowvram reads from the user is an ordinary file, read up to a limit (issue 42, item 3).

A recipe, data file, model or tokenizer file that is a FIFO, a character or block device, a
socket, or a link to one of them is refused before it is opened for reading: a FIFO blocks the
reader until some other process writes (``validate`` hung), ``/dev/zero`` and ``/dev/urandom``
never end (``train`` grew past 20 GB of RAM before the kernel stopped it). The file is opened
with ``O_NONBLOCK`` and checked again with ``fstat`` on the open descriptor, so a path swapped for
a FIFO between the check and the read cannot block either.

Reads are bounded: a recipe is at most :data:`RECIPE_LIMIT_BYTES`; a data line (one JSON Lines
row, one .txt sample) at most :func:`line_limit_bytes` of ``seq_len``, so one enormous line is an
error naming its file and line, not gigabytes of tokenizer memory. No torch here.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from lowvram.errors import DataError, LowvramError

# A recipe is a screen or two of YAML (the largest shipped one is under 4 KiB); 1 MiB leaves room
# for long comments and data lists while refusing a file that is not a recipe at all.
RECIPE_LIMIT_BYTES = 1 << 20
# The longest text one token stands for, as UTF-8 inside a JSON row, generously: the longest
# tokens of the common vocabularies are runs of 16-64 spaces or '=' (cl100k, Llama-3, Qwen2),
# most are 3-6 bytes, and JSON's \uXXXX escapes write a 2-4 byte character in 6-12 bytes.
BYTES_PER_TOKEN = 32
# A row may hold more than seq_len tokens (its tail is cut, tokenize.py counts it as truncated):
# up to 4 windows of it are read, more is never trained on.
LINE_MARGIN = 4
LINE_FLOOR_BYTES = 1 << 20  # short seq_len: a long row is still read, up to 1 MiB


def line_limit_bytes(seq_len: int) -> int:
    """The longest data line read for ``seq_len``: BYTES_PER_TOKEN x seq_len x LINE_MARGIN bytes,
    at least LINE_FLOOR_BYTES (seq_len 1024: 1 MiB; 8192: 1 MiB; 32768: 4 MiB)."""
    return max(LINE_FLOOR_BYTES, BYTES_PER_TOKEN * seq_len * LINE_MARGIN)


_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((words for test, words in _KINDS if test(mode)), "not an ordinary file")


def not_ordinary(path: str | Path) -> str | None:
    """Why ``path`` is not an ordinary file ("a FIFO (named pipe)", "a link to /dev/zero, a
    character device"), or None when it is one or does not exist (missing files have their own
    messages where they are read)."""
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return None
    kind = _kind(mode)
    if kind is None:
        return None
    if p.is_symlink():
        return f"a link to {os.path.realpath(p)}, {kind}"
    return kind


def require_ordinary(path: str | Path, what: str, hint: str) -> None:
    """LowvramError "``what`` PATH is a FIFO ..." when ``path`` exists and is not an ordinary
    file (folders are the caller's to refuse: they have their own message)."""
    why = not_ordinary(path)
    if why and why != "a folder":
        raise LowvramError(f"{what} {path} is {why}, not an ordinary file", hint)


ORDINARY_HINT = "point it at a regular file (lowvram does not read pipes, devices or sockets)"


@contextmanager
def open_ordinary(path: str | Path, what: str = "", hint: str = ORDINARY_HINT) -> Iterator[BinaryIO]:
    """The file opened for reading in binary, or LowvramError when it is not an ordinary file.
    ``O_NONBLOCK``: opening a FIFO returns at once instead of waiting for a writer; the mode is
    checked on the descriptor itself (fstat), then the flag is dropped for ordinary reads."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        kind = _kind(os.fstat(fd).st_mode)
        if kind is not None:
            link = f"a link to {os.path.realpath(path)}, " if Path(path).is_symlink() else ""
            raise LowvramError(f"{(what + ' ') if what else ''}{path} is {link}{kind}, not an ordinary file", hint)
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def read_bounded(path: str | Path, limit_bytes: int, what: str, hint: str) -> bytes:
    """The whole of an ordinary file of at most ``limit_bytes``; LowvramError when it is larger
    (at most limit + 1 bytes are read, whatever the file)."""
    with open_ordinary(path, what) as f:
        data = f.read(limit_bytes + 1)
    if len(data) > limit_bytes:
        raise LowvramError(f"{what} {path} is larger than {_size(limit_bytes)}", hint)
    return data


class LineTooLong(Exception):
    """A line past the limit: its 1-based number, and the bytes read of it (at least limit + 1)."""

    def __init__(self, line: int, read_bytes: int) -> None:
        super().__init__(f"line {line} is longer than the limit")
        self.line = line
        self.read_bytes = read_bytes


def bounded_lines(f: BinaryIO, limit_bytes: int) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, line) of each line ending in b"\\n" (the last may not); raises
    LineTooLong at the first line longer than ``limit_bytes``, never holding more than
    limit + 1 bytes of it."""
    offset = 0
    for number in range(1, 1 << 62):
        line = f.readline(limit_bytes + 1)
        if not line:
            return
        if len(line) > limit_bytes and not (len(line) == limit_bytes + 1 and line.endswith(b"\n")):
            raise LineTooLong(number, len(line))
        yield number, offset, line
        offset += len(line)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def too_long_error(where: str, seq_len: int, what: str = "line") -> DataError:
    """The error for a data line (or row) past line_limit_bytes(seq_len); ``where``: "FILE:LINE"
    or "FILE: row N"."""
    limit = line_limit_bytes(seq_len)
    return DataError(
        f"{where}: the {what} is longer than {_size(limit)}, the most read for training.seq_len {seq_len:,} "
        f"({BYTES_PER_TOKEN} bytes per token x seq_len x {LINE_MARGIN}, at least {_size(LINE_FLOOR_BYTES)}); "
        f"training keeps at most {seq_len:,} tokens of a sample",
        "split it into samples of at most seq_len tokens, or raise training.seq_len",
    )


def ordinary_entries_problem(folder: str | Path) -> str | None:
    """"PATH is a FIFO ..." for the first entry directly in ``folder`` that a library could open
    and is not an ordinary file or a folder (a model or tokenizer folder: transformers reads
    config.json, tokenizer files and weights from it), else None."""
    p = Path(folder)
    if not p.is_dir():
        return None
    for entry in sorted(p.iterdir()):
        why = not_ordinary(entry)
        if why and why != "a folder":
            return f"{entry} is {why}, not an ordinary file"
    return None
