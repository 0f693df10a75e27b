"""The README and docs/: the recipe reference equals `lowvram keys`, every command is exercised,
the figures quoted from `lowvram plan` are what it prints, the links lead somewhere, and the
README stays a page (310 lines at most: the long-context and full fine-tuning tables included)."""

from __future__ import annotations

import re
import shlex

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.recipe import describe_schema
from lowvram.report.info import keys_markdown
from tests.conftest import REPO

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README = (REPO / "README.md").read_text()


def test_recipe_reference_matches_schema():
    text = (REPO / "docs" / "recipes.md").read_text()
    block = text.split("<!-- keys:begin -->\n", 1)[1].split("<!-- keys:end -->", 1)[0].strip()
    assert block == keys_markdown(describe_schema()), "run: python -m lowvram.docs to refresh docs/recipes.md"


def readme_commands() -> list[str]:
    """Every `lowvram ...` line of a ```sh block in the README and docs/*.md, once each."""
    cmds = []
    for doc in DOCUMENTS:
        for block in re.findall(r"```sh\n(.*?)```", doc.read_text(), re.S):
            for line in block.splitlines():
                line = line.split("  #", 1)[0].strip()
                if line.startswith("lowvram ") and line not in cmds:
                    cmds.append(line)
    return cmds


# Commands that train for real are run by tests/train/test_e2e.py / tests/test_demo.py on the
# same recipe; here the quick ones run as written.
QUICK = [c for c in readme_commands() if not re.match(r"lowvram train \S+( --resume| --set| *$)", c)]


def test_readme_has_commands():
    assert "lowvram validate recipes/quickstart.yaml" in readme_commands()
    in_docs = [c for c in readme_commands() if c not in README]
    assert "lowvram plan --model llama-2-70b --method qlora --gpus 2 --vram 24GB" in in_docs


def test_readme_is_a_page():
    """The README is for users, under 300 lines; the depth is in docs/."""
    assert len(README.splitlines()) < 300


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces -> '-'."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M)}


# Written by the fitted-constants generator, not by hand: until it exists a link to it is not checked.
GENERATED_ELSEWHERE = {REPO / "docs" / "constants.md"}


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.name)
def test_links_lead_to_a_file_and_heading(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if file in GENERATED_ELSEWHERE and not file.exists():
            continue
        assert file.exists(), f"{doc.name}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(file.read_text()), f"{doc.name}: link to {target}: no such heading"


@pytest.mark.parametrize("cmd", QUICK)
def test_readme_command_runs(cmd, monkeypatch, quickstart_model):
    # quickstart_model: the recipes' model folder, as `make demo` links it (not left to test order)
    monkeypatch.chdir(REPO)
    r = CliRunner().invoke(app, shlex.split(cmd)[1:])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("args, shown", [
    (("--model", "llama-2-70b", "--method", "qlora", "--gpus", "2", "--vram", "24GB"),
     ("| 19.72 GiB | 50.3 GiB (2 x 25.13) |", "plain `fsdp` would peak at 38.08 GiB")),
    (("--model", "llama-3.1-8b", "--method", "full", "--gpus", "4", "--vram", "24GB"),
     ("| 19.93 GiB | 26.63 GiB (4 x 6.66) | DDP would peak at 79.64 GiB",)),
    (("--model", "llama-7b", "--seq-len", "2048", "--batch-size", "1", "--vram", "6000MB", "--offload",
      "zero3-offload"), ("shows ZeRO-3 full offload at 5.10 GiB (2.05 GiB of it parameters",)),
    (("--model", "llama-7b", "--seq-len", "2048", "--batch-size", "1", "--vram", "3GB"),
     ("the lowest plan peaks at 2.81 GiB and needs a card with 3.06 GiB free",)),
    (("--model", "llama-2-7b", "--method", "full", "--gpus", "4", "--vram", "40GB"),
     ("Llama-2-7B on 4 x 40 GB, planned 28.56 GiB per GPU",)),
])
def test_readme_plan_figures_are_what_the_plan_says(args, shown):
    """The multi-GPU table (docs/multi-gpu.md) and the ZeRO example (docs/planner.md) quote
    `lowvram plan`: the numbers must be the ones it prints now (they had drifted: 18.37 / 37.37
    GiB for 70B)."""
    import json

    d = json.loads(CliRunner().invoke(app, ["plan", *args, "--json"]).stdout)
    readme = " ".join(" ".join(doc.read_text() for doc in DOCUMENTS).split())
    peak = f"{d['peak_bytes'] / 2**30:.2f} GiB"
    assert any(peak in s for s in shown), (peak, shown)
    for s in shown:
        assert s in readme, s


def test_the_full_fine_tuning_table_is_the_bench_result():
    """docs/planner.md's table of the largest model per card is bench/full_finetune_table.py's output."""
    table = (REPO / "bench" / "results" / "full_finetune_table.txt").read_text().split("\n\n")[0].strip()
    assert table in (REPO / "docs" / "planner.md").read_text()
    assert "| 24 GB | gemma-7b (8.5B) |" in table
