"""Refresh generated parts of the README: `python -m lowvram.docs`."""

from __future__ import annotations

from pathlib import Path

from lowvram.recipe import describe_schema
from lowvram.report.info import keys_markdown


def refresh_readme(path: Path) -> None:
    text = path.read_text()
    head, rest = text.split("<!-- keys:begin -->\n", 1)
    _, tail = rest.split("<!-- keys:end -->", 1)
    path.write_text(head + "<!-- keys:begin -->\n" + keys_markdown(describe_schema()) + "\n<!-- keys:end -->" + tail)


if __name__ == "__main__":
    refresh_readme(Path(__file__).resolve().parent.parent / "README.md")
