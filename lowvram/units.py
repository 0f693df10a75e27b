"""Small shared facts about units: bytes as people read and write them, a speed factor in words,
a row of numbers as a sparkline, a command as a shell line.

The bottom of the package: imports nothing of lowvram but :mod:`lowvram.errors`, and nothing
heavy. Code counts in bytes everywhere (``*_bytes``); these turn bytes into text and back.
"""

from __future__ import annotations

import math
import re
import shlex

from lowvram.errors import LowvramError

GIB = 2**30
MIB = 2**20


def gib(n: int | float | None) -> str:
    """'1.50 GiB'; '-' for None."""
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB"


def mem(n: int | None) -> str:
    """GiB, or MiB below 1 GiB (tiny test models would all read 0.00 GiB)."""
    if n is None:
        return "-"
    return gib(n) if n >= GIB else f"{n / MIB:.1f} MiB"


_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
}


def size_parts(text: str) -> tuple[float, str]:
    """'24GB' -> (24.0, 'gb'): a positive number and a known unit (lower case), else the one error."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise LowvramError(
            f"cannot read memory size {text!r}",
            "write a number with a unit, e.g. 24GB, 24GiB or 12000MB",
        )
    value = float(m.group(1))
    if value <= 0:
        raise LowvramError(f"memory size must be positive, got {text!r}", "e.g. --vram 24GB")
    return value, m.group(2).lower()


def parse_size(text: str) -> int:
    """'24GB' -> 24e9 bytes, '24GiB' -> 24*2**30, '12000MB', '1.5g'. Plain numbers are bytes."""
    value, unit = size_parts(text)
    return int(value * _SIZE_UNITS[unit])


def percent(slowdown: float) -> str:
    """A step-time factor in words: '~25% slower', '~20% faster', 'no speed cost'."""
    delta = round((slowdown - 1.0) * 100)
    if delta == 0 or math.isclose(slowdown, 1.0):
        return "no speed cost"
    return f"~{abs(delta)}% {'slower' if delta > 0 else 'faster'}"


BLOCKS = "▁▂▃▄▅▆▇█"
NONFINITE = "×"  # a NaN or infinite value in a sparkline


def sparkline(values: list[float], width: int = 40) -> str:
    """Unicode blocks, one per value (evenly resampled to ``width``); min -> ▁, max -> █; a
    non-finite value (a diverged step) is ``NONFINITE``, never a low block."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return ""
    if len(vals) > width:  # keep the first and last value, sample evenly between them
        vals = [vals[round(i * (len(vals) - 1) / (width - 1))] for i in range(width)]
    finite = [v for v in vals if math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    top = len(BLOCKS) - 1

    def block(v: float) -> str:
        if not math.isfinite(v):
            return NONFINITE
        return BLOCKS[len(BLOCKS) // 2] if hi == lo else BLOCKS[round(top * (v - lo) / (hi - lo))]

    return "".join(block(v) for v in vals)


def shell_line(argv: list[str]) -> str:
    """The command as a user would paste it into a shell (each word quoted where it needs it)."""
    return shlex.join(argv)
