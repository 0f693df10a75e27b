"""`lowvram merge`: fold a run's LoRA adapter into its base model, save a plain transformers folder.

The base is found through ``adapter_config.json`` (``base_model_name_or_path``), then the run's
``recipe.yaml`` (``model.name_or_path`` and ``gguf_file``; a GGUF base goes through model.py's
cached conversion). A 4-bit/8-bit (QLoRA) base is loaded in its compute dtype instead, i.e.
dequantized, so the merged weights are ordinary tensors: merging into packed 4-bit weights would
round the adapter away (peft docs, "Merge LoRA weights into the base model"). The saved config
has no ``quantization_config``.

Memory: the merged model is parameters x bytes of the dtype, plus the adapter (its file size).
``plan_merge`` reads the parameter count from config.json (lowvram.plan.models, no weights) and
refuses before anything is loaded when host RAM cannot hold it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lowvram.errors import LowvramError, ModelError
from lowvram.runs import read_json, read_yaml_dict
from lowvram.units import mem as _size  # GiB, or MiB below 1 GiB
from lowvram.vocab import COMPUTE_DTYPE, WEIGHT_DTYPE

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MERGE_INFO = "lowvram_merge.json"


@dataclass(frozen=True)
class BaseModel:
    source: str  # a folder or hub id from_pretrained reads
    found_via: str  # where the location came from, for the report
    gguf_file: str | None = None


@dataclass(frozen=True)
class MergePlan:
    run_dir: str
    out_dir: str
    base: BaseModel
    dtype: str
    device: str  # "cuda" | "cpu"
    parameters: int | None
    adapter_bytes: int
    needed_bytes: int | None
    host_available_bytes: int
    gpu_free_bytes: int | None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MergeResult:
    out_dir: str
    seconds: float
    peak_rss_bytes: int
    files: tuple[str, ...]
    plan: MergePlan

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# The run and its base model


def read_adapter_run(run_dir: str | Path) -> tuple[Path, dict, dict, dict]:
    """(folder, adapter_config, recipe, plan) of a run (or checkpoint) that holds a LoRA adapter."""
    from lowvram.runs import is_run_dir, read_run

    p = Path(run_dir)
    adapter = read_json(p / "adapter_config.json")
    if adapter:
        info = read_run(p) if is_run_dir(p) else None
        recipe, plan = (info.recipe, read_json(p / "plan.json")) if info else _parent_run(p)
        return p, adapter, recipe, plan
    info = read_run(p)  # raises "not a lowvram run" for a foreign folder
    if (p / "config.json").is_file():
        raise LowvramError(f"{p} holds a full model (no LoRA adapter): there is nothing to merge",
                           f"load it directly: `lowvram generate {p} --prompt ...`")
    ckpts = ", ".join(info.checkpoints) or "none"
    raise LowvramError(
        f"{p} has no adapter_config.json: the run is {info.status} (checkpoints: {ckpts})",
        f"finish it with `lowvram train RECIPE --resume`, or merge a checkpoint: `lowvram merge {p}/CHECKPOINT --out DIR`"
        if info.checkpoints else "train the run to the end first (`lowvram train RECIPE`)",
    )


def _parent_run(p: Path) -> tuple[dict, dict]:
    """A checkpoint-* folder: the recipe and plan are in the run folder above it."""
    return read_yaml_dict(p.parent / "recipe.yaml"), read_json(p.parent / "plan.json")


def _candidates(name: str, run_dir: Path) -> list[Path]:
    """Where a relative model path in a copied recipe.yaml may point: it was relative to the
    original recipe file, which is not kept. Try the run folder, its ancestors with the leading
    ``..`` parts dropped (``../models/x`` from ``recipes/`` -> ``<repo>/models/x``), and the cwd."""
    p = Path(name).expanduser()
    if p.is_absolute():
        return [p]
    parts = p.parts
    stripped = Path(*[x for x in parts if x != ".."]) if ".." in parts else p
    anchors = [run_dir.resolve(), *run_dir.resolve().parents]
    out = [run_dir / p, *(a / stripped for a in anchors), Path.cwd() / p]
    return list(dict.fromkeys(out))


def _is_model_dir(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file()


def find_base_model(run_dir: Path, adapter: dict, recipe: dict) -> BaseModel:
    """The base model of an adapter, or ModelError naming every place looked at."""
    from lowvram.train.model import _looks_like_path

    model = recipe.get("model") or {}
    gguf_file = model.get("gguf_file")
    named = adapter.get("base_model_name_or_path")
    looked = []
    if named:
        p = Path(named).expanduser()
        if _is_model_dir(p):
            return BaseModel(str(p), "adapter_config.json")
        if not _looks_like_path(named) and not gguf_file:
            return BaseModel(named, "adapter_config.json (hub id)")
        looked.append(f"adapter_config.json names {named} (missing)")
    name = model.get("name_or_path")
    if name:
        for c in _candidates(name, run_dir):
            if gguf_file and (c / gguf_file).is_file():
                from lowvram.train.model import gguf_folder

                folder, hit = gguf_folder(str(c), gguf_file, bool(model.get("trust_remote_code")))
                how = "recipe.yaml, GGUF (cached conversion)" if hit else "recipe.yaml, GGUF (converted now)"
                return BaseModel(str(folder), how, gguf_file)
            if not gguf_file and _is_model_dir(c):
                return BaseModel(str(c.resolve()), "recipe.yaml")
        if not _looks_like_path(name) and not gguf_file:
            return BaseModel(name, "recipe.yaml (hub id)")
        what = f"{name}/{gguf_file}" if gguf_file else name
        looked.append(f"recipe.yaml names {what} (not found next to the run or in {Path.cwd()})")
    raise ModelError(
        f"base model of {run_dir} not found: " + ("; ".join(looked) or "no adapter_config.json base and no recipe.yaml"),
        f"put the base model back, or set base_model_name_or_path in {run_dir / 'adapter_config.json'} to its folder",
    )


# --------------------------------------------------------------------------------------------
# Memory and device


def merge_dtype(recipe: dict, plan: dict, override: str = "auto") -> str:
    """The dtype the run kept its base weights in; a quantized base -> its compute dtype."""
    if override != "auto":
        return override
    mp = str(plan.get("mixed_precision") or "fp32")
    if plan.get("quantization", "none") != "none":
        return COMPUTE_DTYPE.get(mp, "float32")  # bnb_4bit_compute_dtype (model.py) follows mixed_precision
    stored = (recipe.get("model") or {}).get("dtype", "auto")
    if stored in DTYPE_BYTES:
        return stored
    return WEIGHT_DTYPE.get(mp, "float32")  # *-mixed keeps fp32 weights


def count_base_parameters(source: str) -> int | None:
    """Exact count from config.json (no weights); None if the architecture cannot be read."""
    from lowvram.plan.models import count_parameters, resolve_model

    try:
        return count_parameters(resolve_model(source))
    except LowvramError:
        return None


def _adapter_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("adapter_model.*") if f.is_file())


def plan_merge(run_dir: str | Path, out_dir: str | Path, dtype: str = "auto", device: str = "auto") -> MergePlan:
    """Find the base, size the merge, pick the device; LowvramError if it cannot work."""
    p, adapter, recipe, plan = read_adapter_run(run_dir)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LowvramError(f"--out {out} exists and is not empty", "choose a new folder (nothing was overwritten)")
    if dtype not in ("auto", *DTYPE_BYTES):
        raise LowvramError(f"unknown dtype {dtype!r}", "use auto, bfloat16, float16 or float32")
    base = find_base_model(p, adapter, recipe)
    dt = merge_dtype(recipe, plan, dtype)
    n = count_base_parameters(base.source)
    adapter_bytes = _adapter_bytes(p)
    needed = n * DTYPE_BYTES[dt] + adapter_bytes if n is not None else None

    from lowvram.hardware import detect_hardware

    hw = detect_hardware()
    gpu_free = hw.devices[0].free_bytes if hw.kind == "cuda" and hw.devices else None
    notes = []
    if plan.get("quantization", "none") != "none":
        notes.append(f"the run trained on a {plan['quantization']} base: the base is loaded dequantized in {dt} for the merge")
    if n is None:
        notes.append(f"cannot read the base's architecture from {base.source}: memory not checked")
    chosen = device
    if device == "auto":
        if gpu_free is not None and needed is not None and needed <= gpu_free:
            chosen = "cuda"
        else:
            chosen = "cpu"
            if gpu_free is not None:
                notes.append(f"the GPU has {_size(gpu_free)} free, the merge needs "
                             f"{_size(needed or 0)}: merging on the CPU (slower)")
    if chosen == "cpu" and needed is not None and needed > hw.host_available_bytes:
        half = " or --dtype bfloat16 (half the memory)" if dt == "float32" else ""
        raise LowvramError(
            f"merge needs {_size(needed)} of host RAM ({n:,} parameters x {DTYPE_BYTES[dt]} bytes "
            f"({dt}) + adapter), {_size(hw.host_available_bytes)} available",
            f"close other programs, or merge on a machine with more RAM{half}",
        )
    return MergePlan(str(p), str(out), base, dt, chosen, n, adapter_bytes, needed,
                     hw.host_available_bytes, gpu_free, tuple(notes))


# --------------------------------------------------------------------------------------------
# Merging


def load_base(base: BaseModel, dtype: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    from lowvram.train.model import _first_line

    try:
        # quantization_config=None is not enough for a pre-quantized checkpoint; plain folders
        # (hub bases, the GGUF cache) carry none, and that is what a lowvram run trains on.
        return AutoModelForCausalLM.from_pretrained(base.source, dtype=getattr(torch, dtype), device_map={"": device})
    except OSError as e:
        raise ModelError(f"cannot load the base model {base.source}: {_first_line(e)}",
                         "check the folder (or hub cache; HF_HUB_OFFLINE=1 reads only the cache)") from None


def load_adapter(model, folder: str | Path):
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, str(folder))
    except (ValueError, RuntimeError, KeyError) as e:
        raise ModelError(f"the adapter in {folder} does not fit its base model: {str(e).splitlines()[0]}",
                         "the base must be the model the run trained on (same architecture and sizes)") from None


def merge_run(plan: MergePlan) -> MergeResult:
    """Load base (dequantized) + adapter, merge_and_unload, save a from_pretrained folder."""
    from lowvram.train.model import quiet_libraries

    quiet_libraries()
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    run = Path(plan.run_dir)
    merged = load_adapter(load_base(plan.base, plan.dtype, plan.device), run).merge_and_unload()
    config = merged.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tok_source = run if (run / "tokenizer_config.json").is_file() else plan.base.source
    tokenizer = AutoTokenizer.from_pretrained(str(tok_source))

    out = Path(plan.out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {"merged_from": str(run.resolve()), "base": plan.base.source, "dtype": plan.dtype,
                "prompt_format": _prompt_format(run)}
        (tmp / MERGE_INFO).write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (plan_merge checked)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    return MergeResult(str(out), round(seconds, 3), _peak_rss(), tuple(sorted(f.name for f in out.iterdir())), plan)


def _prompt_format(run: Path) -> str | None:
    """The data format the run trained on, so `lowvram generate` on the merged folder prompts alike."""
    from lowvram.train.generate import run_prompt_format

    return run_prompt_format(run)


def _peak_rss() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux
