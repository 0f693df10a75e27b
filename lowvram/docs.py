"""Refresh the generated parts of docs/: `python -m lowvram.docs` (the recipe reference in
docs/recipes.md, from the schema as `lowvram keys` prints it)."""

from __future__ import annotations

from pathlib import Path

from lowvram.recipe import describe_schema
from lowvram.report.info import keys_markdown

DOCS = Path(__file__).resolve().parent.parent / "docs"


def refresh_keys(path: Path) -> None:
    """Rewrite the table between ``<!-- keys:begin -->`` and ``<!-- keys:end -->`` in ``path``."""
    text = path.read_text()
    head, rest = text.split("<!-- keys:begin -->\n", 1)
    _, tail = rest.split("<!-- keys:end -->", 1)
    path.write_text(head + "<!-- keys:begin -->\n" + keys_markdown(describe_schema()) + "\n<!-- keys:end -->" + tail)


if __name__ == "__main__":
    refresh_keys(DOCS / "recipes.md")
