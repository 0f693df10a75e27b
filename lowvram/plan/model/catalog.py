"""``resolve_model``: a name or path -> ModelSpec, in milliseconds (``lowvram plan --model
llama-7b`` must be instant): the offline catalog (catalog.json: names, aliases, hub ids), a local
folder or config.json, a GGUF file, a cached hub id's config.json, or a spec registered in this
process. No weights, no torch.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import fields
from functools import lru_cache
from pathlib import Path

from lowvram.errors import ModelError
from lowvram.plan.model.models import ModelSpec, spec_from_dict
from lowvram.plan.model.readers import read_config, spec_from_gguf

_CATALOG = Path(__file__).with_name("catalog.json")


@lru_cache(maxsize=1)
def _catalog() -> dict[str, dict]:
    return json.loads(_CATALOG.read_text())["models"]


@lru_cache(maxsize=1)
def _aliases() -> dict[str, str]:
    out: dict[str, str] = {}
    for name, entry in _catalog().items():
        for key in [name, *entry.get("aliases", []), entry.get("hf_id") or ""]:
            if key:
                out[key.lower()] = name
                out[key.lower().rsplit("/", 1)[-1]] = out.get(key.lower().rsplit("/", 1)[-1], name)
    return out


def is_catalog_name(name: str) -> bool:
    """A catalog name, alias or hub id of a catalog entry (case-insensitive)."""
    return name.strip().lower() in _aliases()


def catalog_hub_id(name: str) -> str | None:
    """The hub id of a catalog name or alias (None when the name is not in the catalog)."""
    canonical = _aliases().get(name.strip().lower())
    return (_catalog()[canonical].get("hf_id") or None) if canonical else None


def catalog_names() -> list[str]:
    """Canonical catalog names (aliases and hub ids resolve to these)."""
    return sorted(_catalog())


_SPEC_FIELDS = {f.name for f in fields(ModelSpec)}


def _from_catalog(name: str) -> ModelSpec:
    entry = {k: v for k, v in _catalog()[name].items() if k in _SPEC_FIELDS}
    return spec_from_dict({"name": name, **entry})


def hub_cache_folder(hub_id: str) -> Path:
    """Where huggingface_hub caches a model repo (HF_HUB_CACHE, else HF_HOME/hub)."""
    root = Path(os.environ.get("HF_HUB_CACHE") or Path(
        os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub")
    return root / ("models--" + hub_id.replace("/", "--"))


def hub_cache_config(hub_id: str) -> Path | None:
    """The newest cached config.json of a hub id (huggingface_hub's cache layout), or None."""
    folder = hub_cache_folder(hub_id)
    found = sorted(folder.glob("snapshots/*/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def local_config(model_ref: str | None) -> dict | None:
    """The config.json dict of a local folder or file, or of a hub id's cached config.json (None
    for catalog names and hub ids not cached)."""
    if not model_ref:
        return None
    path = Path(model_ref).expanduser()
    if path.is_dir():
        path = path / "config.json"
    elif not path.exists() and "/" in model_ref:
        path = hub_cache_config(model_ref.strip()) or path
    if not path.is_file() or path.suffix != ".json":
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


# Specs registered in this process for names the resolver cannot read itself (e.g. `lowvram
# plan --simulate` on a config.json whose fields only transformers can interpret).
_REGISTERED: dict[str, ModelSpec] = {}


def register_spec(name_or_path: str, spec: ModelSpec) -> None:
    """Make ``resolve_model(name_or_path)`` answer ``spec`` in this process."""
    _REGISTERED[name_or_path.strip()] = spec


def resolve_model(name_or_path: str) -> ModelSpec:
    """Catalog name/alias/hub id (case-insensitive), a folder or config.json, or a cached hub id."""
    key = name_or_path.strip()
    if key in _REGISTERED:
        return _REGISTERED[key]
    if key.lower() in _aliases():
        return _from_catalog(_aliases()[key.lower()])
    path = Path(key).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return read_config(path / "config.json", path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return spec_from_gguf(ggufs[0], path.name)
        raise ModelError(
            f"{path} has no config.json",
            f"files there: {', '.join(sorted(p.name for p in path.iterdir())[:8]) or 'none'}; "
            "pass the folder that holds the model's config.json",
        )
    if path.is_file():
        if path.suffix == ".gguf":
            return spec_from_gguf(path, path.stem)
        return read_config(path, path.parent.name)
    if "/" in key:
        cached = hub_cache_config(key)
        if cached is not None:
            return read_config(cached, key)
    close = difflib.get_close_matches(key.lower(), list(_aliases()), n=3, cutoff=0.5)
    close_names = list(dict.fromkeys(_aliases()[c] for c in close))
    hint = (f"did you mean {', '.join(close_names)}? " if close_names else "") + (
        "known models: `lowvram plan --list-models`; or pass a local folder with config.json")
    raise ModelError(f"unknown model '{name_or_path}'", hint)
