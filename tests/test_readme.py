"""The README's recipe reference equals `lowvram keys`, and its commands are exercised."""

from __future__ import annotations

import re
import shlex

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.recipe import describe_schema
from lowvram.report.info import keys_markdown
from tests.conftest import REPO

README = (REPO / "README.md").read_text()


def test_recipe_reference_matches_schema():
    block = README.split("<!-- keys:begin -->\n", 1)[1].split("<!-- keys:end -->", 1)[0].strip()
    assert block == keys_markdown(describe_schema()), "run: python -m lowvram.docs to refresh the README"


def readme_commands() -> list[str]:
    cmds = []
    for block in re.findall(r"```sh\n(.*?)```", README, re.S):
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line.startswith("lowvram "):
                cmds.append(line)
    return cmds


# Commands that train for real are run by tests/test_train_e2e.py / tests/test_demo.py on the
# same recipe; here the quick ones run as written.
QUICK = [c for c in readme_commands() if not re.match(r"lowvram train \S+( --resume| --set| *$)", c)]


def test_readme_has_commands():
    assert "lowvram validate recipes/quickstart.yaml" in readme_commands()


@pytest.mark.parametrize("cmd", QUICK)
def test_readme_command_runs(cmd, monkeypatch, quickstart_model):
    # quickstart_model: the recipes' model folder, as `make demo` links it (not left to test order)
    monkeypatch.chdir(REPO)
    r = CliRunner().invoke(app, shlex.split(cmd)[1:])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("args, shown", [
    (("--model", "llama-2-70b", "--method", "qlora", "--gpus", "2", "--vram", "24GB"),
     ("| 19.85 GiB | 50.3 GiB (2 x 25.13) |", "plain `fsdp` would peak at 40.11 GiB")),
    (("--model", "llama-3.1-8b", "--method", "full", "--gpus", "4", "--vram", "24GB"),
     ("| 21.04 GiB | 26.63 GiB (4 x 6.66) | DDP would peak at 84.06 GiB",)),
    (("--model", "llama-7b", "--seq-len", "2048", "--batch-size", "1", "--vram", "6GB"),
     ("shows ZeRO-3 full offload at 5.05 GiB (2.05 GiB of it parameters",)),
    (("--model", "llama-2-7b", "--method", "full", "--gpus", "4", "--vram", "40GB"),
     ("Llama-2-7B on 4 x 40 GB, planned 29.38 GiB per GPU",)),
])
def test_readme_plan_figures_are_what_the_plan_says(args, shown):
    """The README's multi-GPU table and the ZeRO example quote `lowvram plan`: the numbers must be
    the ones it prints now (they had drifted: 18.37 / 37.37 GiB for 70B)."""
    import json

    from typer.testing import CliRunner

    from lowvram.cli import app

    d = json.loads(CliRunner().invoke(app, ["plan", *args, "--json"]).stdout)
    readme = " ".join((REPO / "README.md").read_text().split())
    peak = f"{d['peak_bytes'] / 2**30:.2f} GiB"
    assert any(peak in s for s in shown), (peak, shown)
    for s in shown:
        assert s in readme, s
