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


def start(out: Path, created_folder: bool, data_hashes: dict | None = None, model_hashes: dict | None = None) -> None:
    """A new run in ``out``: an empty list of paths (recorded as they are written), the hashes of
    its data files and of its base model (``--resume`` compares both, resume_check.py)."""
    from lowvram import __version__

    out.mkdir(parents=True, exist_ok=True)
    _write(out, {"lowvram": __version__, "created_folder": created_folder, "paths": [],
                 "data_sha256": data_hashes or {}, "model_sha256": model_hashes or {}})


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


def record_stop(out: Path, status: str, message: str, hint: str, step: int | None) -> None:
    """A run that lowvram stopped on purpose (``status`` diverged: a non-finite or untrainable step;
    stopped: its reward code or another user error mid-run): what `lowvram show` and `runs` say of
    it instead of "interrupted, resume with ...". Cleared when the run is resumed."""
    data = read(out)
    if data is not None:
        data["stop"] = {"status": status, "message": message, "hint": hint, "step": step}
        _write(out, data)


def clear_stop(out: Path) -> None:
    data = read(out)
    if data is not None and data.pop("stop", None) is not None:
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



# --------------------------------------------------------------------------------------------
# The base model: a fingerprint that is cheap for a 70B model

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
SMALL_FILE_BYTES = 64 << 20  # config, index, tokenizer and template files: hashed whole
HEAD_BYTES = 1 << 20  # a weight file's start: the safetensors header (names, dtypes, shapes, offsets)
SAMPLES, SAMPLE_BYTES = 8, 64 << 10  # and 8 blocks of 64 KiB spread through its tensors


def model_hashes(recipe: Recipe) -> dict[str, str]:
    """A fingerprint of the base model's folder (a local folder, or a hub id's cached snapshot
    at model.revision, else main), one sha256 per file, keyed by its name: every file directly
    in the folder of up to 64 MiB whole (config.json, model.safetensors.index.json, tokenizer and
    generation files); each weight file (.safetensors, .bin, .pt, .gguf ...) larger than that
    by its size, its first 1 MiB (the safetensors header) and 8 blocks of 64 KiB spread through
    the rest: under 2 MiB read per weight file whatever its size, and any fine-tune changes
    values in every block. Never the modification time: a copy or a fresh download of the same
    model is the same model. {} when the model is not found locally (a hub id not in the cache:
    nothing to compare)."""
    from lowvram.train.build.model import resolve_model_location

    try:
        folder = Path(resolve_model_location(recipe))
    except LowvramError:
        return {}
    if not folder.is_dir():
        folder = _hub_snapshot(str(folder), recipe.model.revision)
        if folder is None:
            return {}
    only = {recipe.model.gguf_file} if recipe.model.gguf_file else None
    out = {}
    for p in sorted(folder.iterdir()):
        if p.name.startswith(".") or not p.is_file() or (only and p.suffix == ".gguf" and p.name not in only):
            continue
        out[p.name] = _weight_fingerprint(p) if p.stat().st_size > SMALL_FILE_BYTES else file_sha256(p)
    return out


def _weight_fingerprint(path: Path) -> str:
    import hashlib

    size = path.stat().st_size
    h = hashlib.sha256(f"size {size}\n".encode())
    start, span = min(size, HEAD_BYTES), max(0, size - HEAD_BYTES - SAMPLE_BYTES)
    with path.open("rb") as f:
        h.update(f.read(HEAD_BYTES))
        for i in range(SAMPLES):  # the first block right after the head, the last at the file's end
            f.seek(start + span * i // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))
    return "sampled:" + h.hexdigest()


def _hub_snapshot(hub_id: str, revision: str | None) -> Path | None:
    """The cached snapshot transformers loads for ``hub_id`` at ``revision`` (huggingface_hub's
    cache layout: refs/<branch> holds the commit, snapshots/<commit>/ the files), or None."""
    from lowvram.plan.model.catalog import hub_cache_folder

    repo = hub_cache_folder(hub_id)
    ref = repo / "refs" / (revision or "main")
    try:
        commit = ref.read_text().strip() if ref.is_file() else (revision or "")
    except OSError:
        return None
    snapshot = repo / "snapshots" / commit if commit else None
    return snapshot if snapshot is not None and snapshot.is_dir() else None
