"""The recipe schema: one pydantic model is the truth for every key, default and help text
(``extra="forbid"``: an unknown key is an error); reading YAML into it is load.py's. Its sections
live beside it: sections.py (model, data, training), techniques.py (techniques, lora, galore),
preference.py and grpo.py; this module holds the Recipe root, the rules across sections and the
schema as documentation. ``from lowvram.recipe.schema import ...`` reaches every section.

No torch, transformers or other heavy imports here: ``lowvram validate`` must be instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, PrivateAttr, model_validator

from lowvram.plan.memory.preference import PREFERENCE_OBJECTIVES, RL_OBJECTIVES
from lowvram.recipe.grpo import GrpoSection, grpo_problem, rl_format_problem
from lowvram.recipe.preference import DPO_LOSS_TYPES, PREFERENCE_FORMATS, PreferenceSection
from lowvram.recipe.sections import (
    CHAT_ROLES,
    DataFormat,
    DataSection,
    DatasetSpec,
    ModelSection,
    Objective,
    OnOffAuto,
    Section,
    TrainingSection,
)
from lowvram.recipe.techniques import (
    Attention,
    GaloreSection,
    LoraSection,
    Loss,
    MixedPrecision,
    Offload,
    Optimizer,
    Quantization,
    TechniquesSection,
)

__all__ = [
    "CHAT_ROLES", "DPO_LOSS_TYPES", "PREFERENCE_FORMATS", "Attention", "DataFormat", "DataSection",
    "DatasetSpec", "GaloreSection", "GrpoSection", "LoraSection", "Loss", "MixedPrecision", "ModelSection",
    "Objective", "Offload", "OnOffAuto", "Optimizer", "PreferenceSection", "Quantization", "Recipe",
    "TechniquesSection", "TrainingSection", "describe_schema", "objective_problem",
]


class Recipe(Section):
    model: ModelSection
    data: DataSection
    training: TrainingSection = Field(default_factory=TrainingSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    galore: GaloreSection = Field(default_factory=GaloreSection)
    preference: PreferenceSection = Field(default_factory=PreferenceSection)
    grpo: GrpoSection = Field(default_factory=GrpoSection)
    techniques: TechniquesSection = Field(default_factory=TechniquesSection)

    @model_validator(mode="after")
    def _dora_needs_lora(self) -> Recipe:
        if self.lora.use_dora and self.techniques.lora == "off":
            raise ValueError("lora.use_dora needs LoRA: DoRA decomposes the adapter update "
                             "(set techniques.lora: on or auto, or lora.use_dora: false)")
        if self.lora.init != "default" and self.techniques.lora == "off":
            raise ValueError(f"lora.init {self.lora.init} needs LoRA: it initialises the adapters "
                             "(set techniques.lora: on or auto, or lora.init: default)")
        return self

    @model_validator(mode="after")
    def _objective_matches_data(self) -> Recipe:
        problem = objective_problem(self.training.objective, [d.format for d in self.data.datasets],
                                    self.data.packing)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _grpo_batch(self) -> Recipe:
        # written: a grpo section that says something (a resolved recipe.yaml of an sft run carries the defaults)
        written = "grpo" in self.model_fields_set and self.grpo != GrpoSection()
        problem = grpo_problem(self.grpo, self.training, written, self.data.validation)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _images_not_packed(self) -> Recipe:
        if self.data.packing and any(d.format == "image_chat" for d in self.data.datasets):
            raise ValueError("data.packing does not apply to format image_chat: a window's images and "
                             "their tokens are not packed (set data.packing: false)")
        return self

    # Where the recipe came from; relative data paths resolve against it. Not a YAML key.
    _source: Path | None = None
    # What load_recipe decided for the user (a data format recognised from the columns), to print.
    _notes: list[str] = PrivateAttr(default_factory=list)

    @property
    def notes(self) -> list[str]:
        return self._notes

    @property
    def source(self) -> Path | None:
        return self._source

    def base_dir(self) -> Path:
        return self._source.parent if self._source else Path.cwd()

    def resolve_path(self, p: str) -> Path:
        """A path from the recipe, relative to the recipe file, with ``..`` and ``.`` folded away
        (the recipe's folder is already resolved, so folding cannot cross a link of it)."""
        import os

        path = Path(p).expanduser()
        return Path(os.path.normpath(path if path.is_absolute() else self.base_dir() / path))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def objective_problem(objective: str, formats: list[str], packing: bool) -> str | None:
    """Why training.objective cannot train on data of these formats (None when it can)."""
    formats = [f for f in formats if f != "auto"]  # recognised from the rows when they are read
    if objective in RL_OBJECTIVES or "prompt" in formats:
        return rl_format_problem(objective, formats, packing)
    preference = objective in PREFERENCE_OBJECTIVES
    allowed = PREFERENCE_FORMATS if objective == "kto" else ("preference",)
    wrong = sorted({f for f in formats if ((f not in allowed) if preference else (f in PREFERENCE_FORMATS))})
    if wrong and preference:
        want = ("format: preference (prompt/chosen/rejected) or unpaired (prompt/completion/label)"
                if objective == "kto" else "format: preference, with prompt/chosen/rejected")
        return (f"training.objective {objective} does not train on format {', '.join(wrong)} (set the datasets' {want})")
    if wrong:
        return (f"format {', '.join(wrong)} needs a preference objective (preference: dpo, orpo, simpo or kto; "
                f"unpaired: kto; training.objective is {objective})")
    if preference and packing:
        return (f"data.packing does not apply to training.objective {objective}: TRL pads each "
                "row of the batch (set data.packing: false)")
    return None


# --------------------------------------------------------------------------------------------
# The schema as documentation (`lowvram keys`, the recipe reference in docs/recipes.md)


def _type_name(ann: Any) -> str:
    args = getattr(ann, "__args__", None)
    origin = getattr(ann, "__origin__", None)
    if origin is Literal:
        return ", ".join(str(a) for a in args)
    if args and origin is not None and origin is not list and origin is not dict:
        return ", ".join(_type_name(a) for a in args if a is not type(None)) + (
            ", null" if type(None) in args else ""
        )
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    if args and origin is None:  # a union written with |
        return ", ".join(_type_name(a) for a in args if a is not type(None))
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "mapping"
    if origin is dict:
        return "mapping"
    if type(None) in (args or ()):
        return ", ".join(_type_name(a) for a in args if a is not type(None)) + ", null"
    return getattr(ann, "__name__", str(ann))


def describe_schema() -> list[tuple[str, str, str, str]]:
    """(key path, type, default, help) for every recipe key, from the pydantic schema."""
    from pydantic_core import PydanticUndefined

    rows: list[tuple[str, str, str, str]] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            key = f"{prefix}{name}"
            ann = f.annotation
            inner = [a for a in (ann, *getattr(ann, "__args__", ())) if isinstance(a, type) and issubclass(a, BaseModel)]
            if inner and not f.description:
                walk(inner[0], key + ".")
                continue
            item = ann.__args__[0] if getattr(ann, "__origin__", None) is list else None
            if isinstance(item, type) and issubclass(item, BaseModel):
                rows.append((key, "list", "(required)", f.description or ""))
                walk(ann.__args__[0], key + "[].")
                continue
            if f.default is PydanticUndefined and f.default_factory is None:
                default = "(required)"
            elif f.default_factory is not None:
                default = repr(f.default_factory()) if not inner else ""
            else:
                default = "null" if f.default is None else (str(f.default).lower() if isinstance(f.default, bool) else str(f.default))
            rows.append((key, _type_name(ann), default, f.description or ""))

    walk(Recipe, "")
    return rows
