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
def test_readme_command_runs(cmd, monkeypatch):
    monkeypatch.chdir(REPO)
    r = CliRunner().invoke(app, shlex.split(cmd)[1:])
    assert r.exit_code == 0, r.output
