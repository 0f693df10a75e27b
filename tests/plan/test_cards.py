"""--vram read as cards are sold (issue 26 item 4): 12GB is a 12 GB card, as CUDA reports its total."""

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.cards import read_vram
from lowvram.plan.constants import CARD_READINGS, CARD_REPORTED_FRACTION
from lowvram.planning.budget import make_budget

GIB = 2**30


@pytest.mark.parametrize("text, expected", [
    ("12GB", 12 * GIB * 39 // 40), ("12G", 12 * GIB * 39 // 40), ("24gb", 24 * GIB * 39 // 40),
    ("11.5GB", int(11.5 * GIB) * 39 // 40),
    ("12GiB", 12 * GIB), ("11.5GiB", int(11.5 * GIB)), ("12000MB", 12 * 10**9), ("1000", 1000),
])
def test_card_sizes_and_exact_sizes(text, expected):
    assert read_vram(text).bytes == expected


def test_how_a_card_size_was_read_is_said_and_an_exact_size_is_not():
    assert read_vram("12GB").how == "a 12 GB card, 97.5% of 12 GiB as CUDA reports its total"
    assert read_vram("12GiB").how == "" and read_vram("12000MB").how == ""


@pytest.mark.parametrize("text", ["0GB", "GB", "twelve", "-3GB"])
def test_bad_sizes_are_one_error(text):
    with pytest.raises(LowvramError):
        read_vram(text)


def test_the_share_is_at_or_below_every_published_reading():
    """The budget of a card must not exceed what CUDA reports on any card published."""
    share = float(CARD_REPORTED_FRACTION.value)
    assert share <= min(r.fraction for r in CARD_READINGS)
    assert min(r.fraction for r in CARD_READINGS) - share < 0.001  # and not far below the lowest
    for r in CARD_READINGS:  # every reading is of a card as sold, less what the driver keeps
        assert 0.97 < r.fraction < 1.0, r


def test_the_budget_line_says_how_it_read_the_size(monkeypatch):
    b = make_budget("12GB")
    assert b.vram_bytes == 12 * GIB * 39 // 40
    assert b.source == "--vram 12GB: a 12 GB card, 97.5% of 12 GiB as CUDA reports its total"
    monkeypatch.setenv("LOWVRAM_VRAM", "16GB")
    b = make_budget()
    assert b.vram_bytes == 16 * GIB * 39 // 40 and b.source.startswith("LOWVRAM_VRAM 16GB: a 16 GB card")
    assert make_budget("12000MB").source == "--vram 12000MB"
