"""The tree in docs/architecture.md names every module of the package, and only modules that exist."""

from __future__ import annotations

import re

from tests.conftest import REPO


def readme_tree() -> set[str]:
    """Paths of the ```text tree under "## The tree" (indentation gives the folders)."""
    section = (REPO / "docs" / "architecture.md").read_text().split("## The tree", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    paths, folders = set(), {}
    for line in block.splitlines():
        name = line.strip().split()[0] if line.strip() else ""
        if not name:
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        parent = folders.get(depth - 1, "")
        if name.endswith("/"):
            folders[depth] = parent + name
        else:
            paths.add(parent + name)
    return paths


def test_tree_lists_every_module():
    modules = {str(p.relative_to(REPO)) for p in (REPO / "lowvram").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    listed = readme_tree()
    assert modules - listed == set(), "add these to the tree in docs/architecture.md"
    assert listed - modules == set(), "the tree in docs/architecture.md names files that do not exist"
