"""Scoring a generated answer against the reference, as users expect (pure; no torch).

Normalised text: Unicode NFKC, case folded, whitespace collapsed, surrounding quotes and the
trailing sentence punctuation dropped (SQuAD's and lm-eval's exact_match normalisations do the
same kind of cleaning). A numeric reference ("15", "1,024", "$3.50", "-2") is compared as a
number: exact when the answer's last number equals it (GSM8K's convention: the final number is
the answer), contains when any number in the answer does.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

_NUMBER = re.compile(r"[-+]?\$?\d[\d,]*(?:\.\d+)?")
_TRAILING = ".!?;:,"
_QUOTES = "\"'`“”‘’"


def normalize(text: str) -> str:
    t = unicodedata.normalize("NFKC", text).casefold()
    t = " ".join(t.split())
    t = t.strip(_QUOTES + " ").rstrip(_TRAILING).strip(_QUOTES + " ")
    return t


def as_number(text: str) -> float | None:
    """The value of a text that is one number (commas, a currency sign and a trailing period
    allowed), else None."""
    t = normalize(text)
    m = _NUMBER.fullmatch(t)
    return _value(m.group()) if m else None


def numbers_in(text: str) -> list[float]:
    out = []
    for m in _NUMBER.finditer(unicodedata.normalize("NFKC", text)):
        v = _value(m.group())
        if v is not None:
            out.append(v)
    return out


def _value(s: str) -> float | None:
    try:
        return float(s.replace(",", "").replace("$", ""))
    except ValueError:
        return None


@dataclass(frozen=True)
class Score:
    exact: bool
    contains: bool


def score(prediction: str, reference: str) -> Score:
    number = as_number(reference)
    if number is not None:
        found = numbers_in(prediction)
        return Score(exact=bool(found) and found[-1] == number, contains=number in found)
    p, r = normalize(prediction), normalize(reference)
    return Score(exact=p == r, contains=bool(r) and r in p)
