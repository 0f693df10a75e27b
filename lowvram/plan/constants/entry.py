"""One entry of the fitted-constants table: a number of the memory model that was set from
measurements (or chosen) rather than derived from the code it models, and where it came from."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class FittedConstant:
    """One fitted (or chosen) number of the memory model and where it came from."""

    name: str  # the module-level name below
    value: int | float | Fraction
    shown: str  # the value as the docs write it ("300 MiB", "3/8 of ...")
    meaning: str  # what it counts
    used_in: str  # the term(s) that read it
    fitted_on: str  # the measurements (or the judgement) it was set from
    in_sample: str  # how the fit does on its own measurements
    held_out: str  # how it does on runs it was not fitted on

    def of(self, n: int) -> int:
        """``n`` scaled by this constant, in integers where it is a fraction (``n * p // q``)."""
        v = self.value
        kind = type(v)  # not isinstance: Fraction's ABC check is slow, and the planner calls this often
        if kind is Fraction:
            return n * v.numerator // v.denominator
        if kind is int:
            return n * v
        return int(v * n)
