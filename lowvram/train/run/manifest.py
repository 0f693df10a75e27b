"""What a run wrote into its folder, so `--overwrite` deletes exactly that and nothing else.

``lowvram-run.json`` in the run folder is written when a run starts in a new or empty folder
and lists every path the run writes there, each recorded *before* it is written (the recipe and
plan copies, each checkpoint folder, the final weights and tokenizer files, metrics, the loss
plot, TensorBoard's ``runs/``). It also records the content hash of each local data file, which
``--resume`` compares (resume_check.py). ``--overwrite`` removes the listed paths, then the
manifest, then the folder itself if it is empty and lowvram created it: a file someone put there
later stays. A folder without a manifest (or the recipe.yaml + plan.json of a run written before
manifests existed) is not a lowvram run and is never deleted. No torch here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.runfiles import (
    CHECKPOINT_GLOB,
    LAUNCH_FILES,
    MANIFEST,
    MARKER,
    METRICS,
    PLAN,
    RECIPE,
    file_sha256,
    write_atomic,
)

if TYPE_CHECKING:
    from lowvram.recipe import Recipe

# Runs written before the manifest: the files lowvram and the Trainer write into a run folder.
_LEGACY_FILES = (
    RECIPE, PLAN, METRICS, *LAUNCH_FILES, "loss.png", "adapter_model.safetensors",
    "adapter_config.json", "model.safetensors", "model.safetensors.index.json", "config.json",
    "generation_config.json", "training_args.bin", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model",
    "added_tokens.json",
)
_LEGACY_GLOBS = ("model-*.safetensors", "rank-*.json", CHECKPOINT_GLOB)


def read(out: Path) -> dict | None:
    try:
        data = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("paths"), list) else None


def _write(out: Path, data: dict) -> None:
    write_atomic(out / MANIFEST, json.dumps(data, indent=1) + "\n")


def start(out: Path, created_folder: bool, data_hashes: dict | None = None) -> None:
    """A new run in ``out``: an empty list of paths (recorded as they are written)."""
    from lowvram import __version__

    out.mkdir(parents=True, exist_ok=True)
    _write(out, {"lowvram": __version__, "created_folder": created_folder, "paths": [],
                 "data_sha256": data_hashes or {}})


def record(out: Path, *names: str) -> None:
    """Add ``names`` (relative to ``out``) to the manifest, before they are written."""
    data = read(out)
    if data is None:  # a run folder of an older lowvram, resumed: what it holds of lowvram's, then ours
        data = {"created_folder": False, "paths": sorted(p.name for p in _listed(out)[0] if p.exists()),
                "data_sha256": {}}
    new = [n for n in names if n not in data["paths"]]
    if new:
        data["paths"] = [*data["paths"], *new]
        _write(out, data)


def set_data_hashes(out: Path, hashes: dict) -> None:
    data = read(out)
    if data is not None and data.get("data_sha256") != hashes:
        data["data_sha256"] = hashes
        _write(out, data)


def is_legacy_run(out: Path) -> bool:
    return (out / RECIPE).is_file() and (out / PLAN).is_file()


def is_run(out: Path) -> bool:
    """A folder lowvram wrote a run into (stray ``checkpoint-*`` folders alone are not one)."""
    return read(out) is not None or is_legacy_run(out)


def only_manifest(out: Path, ignore: tuple[str, ...] = ()) -> bool:
    """The run never got past its start (nothing but the manifest and ``ignore``)."""
    return all(p.name in (MANIFEST, *ignore) or _is_temp(p.name) for p in out.iterdir())


def _is_temp(name: str) -> bool:
    return name.startswith(".final-") or (name.startswith(".") and any(
        name.startswith(f".{n}.") for n in (MANIFEST, RECIPE, PLAN, METRICS)))


def _listed(out: Path) -> tuple[list[Path], bool]:
    data = read(out)
    if data is not None:
        names = [str(n) for n in data["paths"]]
        paths = [out / n for n in names if n and not Path(n).is_absolute() and ".." not in Path(n).parts]
        return paths, bool(data.get("created_folder"))
    paths = [out / n for n in _LEGACY_FILES]
    for pattern in _LEGACY_GLOBS:
        paths += [p for p in out.glob(pattern) if not p.name.startswith("checkpoint-") or _lowvram_checkpoint(p)]
    return paths, False


def _lowvram_checkpoint(p: Path) -> bool:
    return p.is_dir() and ((p / MARKER).is_file() or (p / "trainer_state.json").is_file())


def remove_run(out: Path) -> list[str]:
    """Delete what the run in ``out`` wrote; returns what is left that lowvram did not write."""
    paths, created = _listed(out)
    paths += [out / n for n in LAUNCH_FILES]
    paths += [p for p in out.iterdir() if _is_temp(p.name) and p.name != MANIFEST]
    for p in paths:
        if p.is_symlink() or p.is_file():
            p.unlink(missing_ok=True)
        elif p.is_dir():
            shutil.rmtree(p)
    (out / MANIFEST).unlink(missing_ok=True)  # last: a crash before here leaves a run to overwrite again
    left = sorted(p.name for p in out.iterdir())
    if not left and created:
        out.rmdir()
    return left


# --------------------------------------------------------------------------------------------
# Folders a run must never be written into or deleted


def check_output_dir_is_safe(out: Path, recipe_source: Path | None, overwrite: bool) -> None:
    """Never the home folder, the filesystem root or an ancestor of either; with --overwrite,
    never a folder that holds the recipe being run."""
    out = out.resolve()
    home = Path.home().resolve()
    if out == home or out in home.parents or out == Path(out.anchor):
        raise LowvramError(
            f"training.output_dir {out} is {'your home folder' if out == home else 'a parent of your home folder'}",
            "set training.output_dir to a folder of its own, e.g. runs/my-run (nothing was written or deleted)",
        )
    if overwrite and recipe_source is not None:
        src = Path(recipe_source).resolve()
        if out == src.parent or out in src.parent.parents:
            raise LowvramError(
                f"--overwrite would delete from {out}, which holds the recipe {src}",
                "set training.output_dir to a folder of its own, e.g. runs/my-run (nothing was deleted)",
            )


# --------------------------------------------------------------------------------------------
# Data files


def data_hashes(recipe: Recipe) -> dict[str, str]:
    """sha256 of each local data file, keyed by the path as the recipe writes it."""
    out = {}
    for d in recipe.data.datasets:
        p = recipe.resolve_path(d.path)
        if p.is_file():
            out[d.path] = file_sha256(p)
    return out

