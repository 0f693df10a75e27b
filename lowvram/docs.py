"""Refresh the generated docs: the README's key reference and docs/constants.md (the planner's
fitted constants, from lowvram.plan.constants): `python -m lowvram.docs` (`make docs`)."""

from __future__ import annotations

from pathlib import Path

from lowvram.plan.constants import markdown_table
from lowvram.recipe import describe_schema
from lowvram.report.info import keys_markdown


def refresh_readme(path: Path) -> None:
    text = path.read_text()
    head, rest = text.split("<!-- keys:begin -->\n", 1)
    _, tail = rest.split("<!-- keys:end -->", 1)
    path.write_text(head + "<!-- keys:begin -->\n" + keys_markdown(describe_schema()) + "\n<!-- keys:end -->" + tail)


def write_constants(path: Path) -> None:
    """docs/constants.md, generated from lowvram.plan.constants.CONSTANTS."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown_table())


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    refresh_readme(root / "README.md")
    write_constants(root / "docs" / "constants.md")
