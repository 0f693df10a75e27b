"""The recipe: its schema (schema.py) and reading it from YAML with ``--set`` overrides (load.py).

``from lowvram.recipe import load_recipe, Recipe, ...`` reaches both.
"""

from lowvram.recipe.load import load_recipe, parse_recipe
from lowvram.recipe.schema import (
    DataSection,
    DatasetSpec,
    LoraSection,
    ModelSection,
    Recipe,
    TechniquesSection,
    TrainingSection,
    describe_schema,
)

__all__ = [
    "DataSection", "DatasetSpec", "LoraSection", "ModelSection", "Recipe", "TechniquesSection",
    "TrainingSection", "describe_schema", "load_recipe", "parse_recipe",
]
