"""`lowvram plan` flags are spelled as the techniques are (--mixed-precision, --quantization,
--optimizer, --attention, --gradient-accumulation); the short spellings stay as aliases and give
the same plan. (This file is left alone by the spelling script, so the aliases stay tested.)"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lowvram.cli import app

runner = CliRunner()
BASE = ["plan", "--model", "llama-2-7b", "--vram", "24GiB", "--seq-len", "2048", "--batch-size", "16", "--json"]

PAIRS = [
    (["--mixed-precision", "bf16-mixed"], ["--precision", "bf16-mixed"], "mixed_precision", "bf16-mixed"),
    (["--quantization", "nf4"], ["--quant", "nf4"], "quantization", "nf4"),
    (["--optimizer", "adamw_8bit"], ["--optim", "adamw_8bit"], "optimizer", "adamw_8bit"),
    (["--attention", "eager"], ["--attn", "eager"], "attention", "eager"),
    (["--gradient-accumulation", "4"], ["--grad-accum", "4"], "gradient_accumulation", 4),
]


def _plan(*flags: str) -> dict:
    r = runner.invoke(app, [*BASE, "--method", "lora", *flags])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.parametrize(("canonical", "alias", "technique", "value"), PAIRS, ids=[p[2] for p in PAIRS])
def test_alias_gives_the_same_plan(canonical, alias, technique, value):
    new, old = _plan(*canonical), _plan(*alias)
    assert new["techniques"][technique] == value
    assert new == old
    assert canonical[0] in new["reasons"][technique]  # the reason names the canonical flag


def test_help_shows_canonical_names_first():
    out = runner.invoke(app, ["plan", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"}).output
    for canonical, alias, *_ in PAIRS:
        assert f"{canonical[0]}" in out and alias[0] in out


def test_bad_value_names_the_canonical_flag():
    r = runner.invoke(app, [*BASE, "--quant", "nf5"])
    assert r.exit_code == 2
    assert "--quantization 'nf5' is not one of" in r.output
