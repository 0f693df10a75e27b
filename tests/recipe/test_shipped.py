"""Every shipped recipe validates and starts with the header STYLE.md asks for."""

from __future__ import annotations

import pytest

from lowvram.recipe import load_recipe
from tests.conftest import REPO

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def test_there_are_recipes():
    assert {p.name for p in RECIPES} >= {"quickstart.yaml", "llama-3.1-8b-qlora.yaml", "qwen2.5-1.5b-lora.yaml", "mistral-7b-lora.yaml"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_validates(path):
    r = load_recipe(path)
    assert r.model.name_or_path


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_header(path):
    head = [line for line in path.read_text().splitlines() if line.startswith("#")]
    text = "\n".join(head)
    assert "Sized for:" in text
    assert f"lowvram train recipes/{path.name}" in text
