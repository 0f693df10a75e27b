"""lowvram.units: bytes to text and back, speed factors in words, sparklines, shell lines."""

from __future__ import annotations

import shlex

import pytest

from lowvram.errors import LowvramError
from lowvram.units import gib, mem, parse_size, percent, shell_line, sparkline


def test_gib_and_mem():
    assert gib(None) == "-" and mem(None) == "-"
    assert gib(3 * 2**29) == "1.50 GiB"
    assert mem(2**30) == "1.00 GiB"
    assert mem(2**30 - 2**20) == "1023.0 MiB"  # below 1 GiB: MiB, not 1.00 GiB
    assert mem(5 * 2**19) == "2.5 MiB"


@pytest.mark.parametrize("text, expected", [
    ("24GB", 24 * 10**9), ("24GiB", 24 * 2**30), ("12000MB", 12 * 10**9), ("1.5g", 15 * 10**8),
    ("512", 512), (" 2 TiB ", 2 * 2**40), ("100kib", 100 * 2**10),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["24 GX", "GB", "-1GB", "0GB", ""])
def test_parse_size_refuses(text):
    with pytest.raises(LowvramError):
        parse_size(text)


def test_percent():
    assert percent(1.0) == "no speed cost"
    assert percent(1.004) == "no speed cost"
    assert percent(1.25) == "~25% slower"
    assert percent(0.8) == "~20% faster"


def test_sparkline():
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    assert sparkline([1.0, 1.0]) == "▅▅"
    assert sparkline([]) == ""
    assert sparkline([None, 1.0, 2.0]) == "▁█"
    assert len(sparkline(list(range(100)), width=40)) == 40


def test_shell_line_round_trips():
    argv = ["lowvram", "train", "my recipe.yaml", "--set", "training.output_dir=a b; rm -rf /", "it's"]
    line = shell_line(argv)
    assert shlex.split(line) == argv
    assert line.startswith("lowvram train 'my recipe.yaml' --set ")
