"""A memory size given for a card (``--vram``, ``LOWVRAM_VRAM``), read as cards are sold.

A card sold as "12 GB" has 12 GiB of memory chips (GDDR and HBM come in powers of two), and CUDA
reports a little less as its total: the driver keeps the rest. So ``--vram 12GB`` (or ``12G``) is
a 12 GB card: :data:`~lowvram.plan.constants.CARD_REPORTED_FRACTION` of 12 GiB, the lowest share
among published Linux readings (:data:`~lowvram.plan.constants.CARD_READINGS`). Any other unit is
read exactly: ``12000MB`` is 12e9 bytes, ``11.5GiB`` is 11.5 x 2^30, a plain number is bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowvram.plan.constants import CARD_REPORTED_FRACTION
from lowvram.units import parse_size, size_parts

_CARD_UNITS = ("gb", "g")


@dataclass(frozen=True)
class VramReading:
    bytes: int
    how: str  # how the text was read, for the plan's budget line ("" when read exactly)


def read_vram(text: str) -> VramReading:
    """``--vram`` / ``LOWVRAM_VRAM`` text -> bytes, and how they were read (see the module)."""
    sold, unit = size_parts(text)
    if unit not in _CARD_UNITS:
        return VramReading(parse_size(text), "")
    shown = f"{sold:g}"
    n = CARD_REPORTED_FRACTION.of(int(sold * 2**30))
    share = float(CARD_REPORTED_FRACTION.value)
    return VramReading(n, f"{card_words(shown)}, {share:.1%} of {shown} GiB as CUDA reports its total")


def card_words(gb: float | str) -> str:
    """"a 12 GB card", "an 8 GB card", "an 11 GB card" (the article as the number is spoken)."""
    shown = f"{gb:g}" if isinstance(gb, (int, float)) else gb
    whole = shown.split(".")[0]
    spoken_vowel = whole.startswith("8") or whole in ("11", "18") or (len(whole) in (5, 6) and whole[:2] in ("11", "18"))
    return f"{'an' if spoken_vowel else 'a'} {shown} GB card"
