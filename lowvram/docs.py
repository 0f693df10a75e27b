"""Refresh the generated parts of docs/: `python -m lowvram.docs` (`make docs`): the recipe
reference in docs/recipes.md (from the schema, as `lowvram keys` prints it) and docs/constants.md
(the planner's fitted constants, from lowvram.plan.constants)."""

from __future__ import annotations

from pathlib import Path

from lowvram.plan.constants import markdown_table
from lowvram.recipe import describe_schema
from lowvram.report.info import keys_markdown

DOCS = Path(__file__).resolve().parent.parent / "docs"


def refresh_keys(path: Path) -> None:
    """Rewrite the table between ``<!-- keys:begin -->`` and ``<!-- keys:end -->`` in ``path``."""
    text = path.read_text()
    head, rest = text.split("<!-- keys:begin -->\n", 1)
    _, tail = rest.split("<!-- keys:end -->", 1)
    path.write_text(head + "<!-- keys:begin -->\n" + keys_markdown(describe_schema()) + "\n<!-- keys:end -->" + tail)


def write_constants(path: Path) -> None:
    """docs/constants.md, generated from lowvram.plan.constants.CONSTANTS."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown_table())


if __name__ == "__main__":
    refresh_keys(DOCS / "recipes.md")
    write_constants(DOCS / "constants.md")
