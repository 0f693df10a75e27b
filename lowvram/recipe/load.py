"""Reading a recipe: YAML with line numbers (duplicate keys refused, YAML 1.1 booleans off),
``--set key.path=value`` overrides, and validation against the schema (schema.py) into one
:class:`RecipeError` that lists *every* problem with file, line and key path, what was expected,
and a did-you-mean for misspelled keys.

No torch, transformers or other heavy imports here: ``lowvram validate`` must be instant.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from lowvram.errors import LowvramError, RecipeError
from lowvram.recipe.schema import Recipe

# --------------------------------------------------------------------------------------------
# Loading with line numbers


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (yaml silently keeps the last one)."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain value", key_node.start_mark
            ) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# Booleans as YAML 1.2 reads them: only true/false. YAML 1.1's on/off/yes/no/y/n stay words, so a
# string key keeps them (`output_dir: off`, `--set training.output_dir=no`); boolean keys still
# accept them (pydantic reads yes/no/on/off as booleans) and techniques read them as on/off.
_BOOL_TAG = "tag:yaml.org,2002:bool"
_LineLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_LineLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))

# Alias bombs: a recipe is small; refuse documents whose node graph explodes.
_MAX_NODES = 100_000


def _line_map(node: yaml.Node, path: tuple = (), out: dict | None = None, budget: list | None = None) -> dict:
    """Map each key path (tuple of str/int) to its 1-based line."""
    out = {} if out is None else out
    budget = [_MAX_NODES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        raise LowvramError("the recipe is too large or uses too many YAML aliases", "a recipe is a small file; remove anchors/aliases that expand into huge structures")
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else str(k.start_mark)
            out[path + (key,)] = k.start_mark.line + 1
            _line_map(v, path + (key,), out, budget)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out[path + (i,)] = v.start_mark.line + 1
            _line_map(v, path + (i,), out, budget)
    return out


def _parse_yaml(text: str, where: str) -> tuple[Any, dict]:
    try:
        node = yaml.compose(text, Loader=_LineLoader)
        lines = _line_map(node) if node is not None else {}
        data = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise LowvramError(
            f"{where}{line}: invalid YAML: {e.problem or e}",
            "check indentation and quoting at that line; only plain YAML is accepted (no Python tags)",
        ) from None
    except yaml.YAMLError as e:
        raise LowvramError(f"{where}: invalid YAML: {e}", "check the file is a plain YAML mapping") from None
    except RecursionError:
        raise LowvramError(f"{where}: the recipe nests too deeply", "a recipe has a few levels of keys") from None
    return data, lines


def _fields_at(loc: tuple) -> list[str]:
    """Known keys of the section at ``loc`` (for did-you-mean)."""
    model: Any = Recipe
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        candidates = [ann, *args]
        nxt = None
        for c in candidates:
            inner = getattr(c, "__args__", ())
            for cc in (c, *inner):
                if isinstance(cc, type) and issubclass(cc, BaseModel):
                    nxt = cc
        if nxt is None:
            return []
        model = nxt
    return list(getattr(model, "model_fields", {}))


def _line_of(loc: tuple, lines: dict) -> int:
    for n in range(len(loc), 0, -1):
        if tuple(loc[:n]) in lines:
            return lines[tuple(loc[:n])]
    return 10**9


def _key_path(loc: tuple) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _format_problem(err: dict, where: str, lines: dict, override_keys: dict) -> str:
    loc = tuple(p for p in err["loc"])
    key = _key_path(loc)
    line = _line_of(loc, lines) if _line_of(loc, lines) < 10**9 else None
    origin = override_keys.get(".".join(str(p) for p in loc))
    if origin:
        place = f"--set {origin}"
    else:
        place = f"{where}:{line}" if line else where
    kind = err["type"]
    if kind == "extra_forbidden":
        known = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        msg = f"unknown key '{loc[-1]}'"
        if close:
            msg += f"; did you mean '{close[0]}'?"
        elif known:
            msg += f" (known: {', '.join(known)})"
    elif kind == "missing":
        msg = "required key is missing"
    else:
        msg = err["msg"]
        if "input" in err and not isinstance(err["input"], (dict, list)):
            shown = repr(err["input"])
            if len(shown) > 60:
                shown = shown[:57] + "..."
            msg += f" (got {shown})"
    return f"{place}: {key}: {msg}"


def _apply_override(data: dict, item: str) -> str:
    if "=" not in item:
        raise RecipeError([f"--set {item}: expected KEY.PATH=VALUE, e.g. training.learning_rate=1e-4"])
    key, _, raw = item.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise RecipeError([f"--set {item}: empty key"])
    try:
        value = yaml.load(raw, Loader=_LineLoader) if raw.strip() else ""  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError:
        value = raw
    if raw.strip().startswith("~"):  # the home folder on a command line (YAML reads a lone ~ as null)
        value = raw.strip()
    node = data
    for p in parts[:-1]:
        if isinstance(node, list) and p.isdigit() and int(p) < len(node):
            node = node[int(p)]
            continue
        if not isinstance(node, dict):
            raise RecipeError([f"--set {item}: '{p}' is not a section"])
        node = node.setdefault(p, {})
    last = parts[-1]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise RecipeError([f"--set {item}: '{parts[-2] if len(parts) > 1 else last}' is not a section"])
    return ".".join(parts)


def parse_recipe(text: str, where: str = "<recipe>", overrides: list[str] | tuple = (), source: Path | None = None) -> Recipe:
    """Validate recipe text; every problem is reported at once."""
    data, lines = _parse_yaml(text, where)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise LowvramError(
            f"{where}: a recipe must be a YAML mapping of sections, got {type(data).__name__}",
            "start from recipes/quickstart.yaml",
        )
    override_keys: dict[str, str] = {}
    for item in overrides:
        key = _apply_override(data, item)
        override_keys[key] = item
    notes = _recognise_formats(data, source.parent if source else Path.cwd())
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        errs = sorted(e.errors(), key=lambda err: _line_of(err["loc"], lines))
        problems = [_format_problem(err, where, lines, override_keys) for err in errs]
        raise RecipeError(problems) from None
    except RecursionError:
        raise LowvramError(f"{where}: the recipe nests too deeply", "a recipe has a few levels of keys") from None
    recipe._source = source
    recipe.notes.extend(notes)
    return recipe


def _recognise_formats(data: dict, base: Path) -> list[str]:
    """Fill in the format of each local dataset that leaves ``format:`` out (or says auto), from
    its first row's columns (recipe/formats.py), before validation: the rest of the program, and
    the schema's own checks, see a concrete format. Returns what was chosen, to print."""
    from lowvram.recipe.formats import first_row, recognise

    datasets = data.get("data", {}).get("datasets") if isinstance(data.get("data"), dict) else None
    notes = []
    for spec in datasets if isinstance(datasets, list) else ():
        if not isinstance(spec, dict) or spec.get("format", "auto") != "auto" or not isinstance(spec.get("path"), str):
            continue
        path = Path(spec["path"]).expanduser()
        found = recognise(first_row(path if path.is_absolute() else base / path))
        if found is None:
            continue  # the data check names the columns (train/data/check.py)
        spec["format"] = found.format
        if found.fields:
            fields = spec.get("fields")
            spec["fields"] = {**found.fields, **(fields if isinstance(fields, dict) else {})}
        mapped = ", ".join(f"{k}: {v}" for k, v in found.fields.items() if k != v)
        notes.append(f"{spec['path']}: format {found.format} ({found.reason}"
                     + (f"; fields: {{{mapped}}}" if mapped else "") + ")")
    return notes


def load_recipe(path: str | Path, overrides: list[str] | tuple = ()) -> Recipe:
    """Read and validate a recipe file, applying ``--set`` overrides."""
    p = Path(path)
    if not p.exists():
        raise LowvramError(f"recipe file not found: {p}", "pass the path to a .yaml recipe, e.g. recipes/quickstart.yaml")
    if p.is_dir():
        raise LowvramError(f"{p} is a folder, not a recipe file", "pass the path to a .yaml recipe inside it")
    from lowvram.inputfiles import RECIPE_LIMIT_BYTES, read_bounded, require_ordinary

    hint = "pass the path to a .yaml recipe file, e.g. recipes/quickstart.yaml"
    require_ordinary(p, "the recipe", hint)  # a FIFO or /dev/zero would block or never end
    raw = read_bounded(p, RECIPE_LIMIT_BYTES, "the recipe", "a recipe is a small YAML file; pass the recipe, not a data file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LowvramError(f"{p}: not UTF-8 text (byte {e.start})", "save the recipe as UTF-8 YAML") from None
    if "\x00" in text:
        raise LowvramError(f"{p}: binary data, not a YAML recipe", "pass a text .yaml recipe")
    return parse_recipe(text, str(p), overrides, source=p.resolve())


