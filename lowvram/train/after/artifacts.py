"""A trained run's artifacts: find a LoRA run's base model, read the run's recipe and plan, load
base + adapter, and the dtype and prompt format the run trained with. `lowvram merge` and
`lowvram generate` both load through here.

The base is found through ``adapter_config.json`` (``base_model_name_or_path``), then the run's
``recipe.yaml`` (``model.name_or_path`` and ``gguf_file``; a GGUF base goes through model.py's
cached conversion). torch, transformers and peft are imported inside the loaders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError, ModelError
from lowvram.past_runs import read_json, read_yaml_dict
from lowvram.runfiles import PLAN, RECIPE
from lowvram.vocab import COMPUTE_DTYPE, DTYPE_BYTES, WEIGHT_DTYPE

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from lowvram.plan.types import Plan

MERGE_INFO = "lowvram_merge.json"


@dataclass(frozen=True)
class BaseModel:
    source: str  # a folder or hub id from_pretrained reads
    found_via: str  # where the location came from, for the report
    gguf_file: str | None = None
    trust_remote_code: bool = False  # the run's model.trust_remote_code: may the model's own code run


def run_trusts_code(recipe: dict) -> bool:
    """The run's choice: model.trust_remote_code of its recipe.yaml (off when not recorded)."""
    return (recipe.get("model") or {}).get("trust_remote_code") is True


# --------------------------------------------------------------------------------------------
# The run and its base model


def read_adapter_run(run_dir: str | Path) -> tuple[Path, dict, dict, dict]:
    """(folder, adapter_config, recipe, plan) of a run (or checkpoint) that holds a LoRA adapter."""
    from lowvram.past_runs import is_run_dir, read_run

    p = Path(run_dir)
    _require_intact_run(p)
    adapter = read_json(p / "adapter_config.json")
    if adapter:
        info = read_run(p) if is_run_dir(p) else None
        recipe, plan = (info.recipe, read_json(p / PLAN)) if info else _parent_run(p)
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


def _require_intact_run(p: Path) -> None:
    """A damaged adapter, tokenizer or run file names itself (the hint: a checkpoint's copy)."""
    from lowvram.runfiles import CHECKPOINT_GLOB, require_intact

    ckpts = sorted(c.name for c in p.glob(CHECKPOINT_GLOB) if c.is_dir())
    hint = (f"the run's checkpoints hold earlier copies: pass {p / ckpts[-1]} instead, or remove the damaged "
            "file and finish the run again with `lowvram train RECIPE --resume`" if ckpts else
            "restore the file from a copy, or train the run again (`lowvram train RECIPE --overwrite`)")
    require_intact(p, hint)


def _parent_run(p: Path) -> tuple[dict, dict]:
    """A checkpoint-* folder: the recipe and plan are in the run folder above it."""
    return read_yaml_dict(p.parent / RECIPE), read_json(p.parent / PLAN)


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
    from lowvram.train.build.model import _looks_like_path

    model = recipe.get("model") or {}
    trust = run_trusts_code(recipe)
    gguf_file = model.get("gguf_file")
    named = adapter.get("base_model_name_or_path")
    looked = []
    if named:
        p = Path(named).expanduser()
        if _is_model_dir(p):
            return BaseModel(str(p), "adapter_config.json", trust_remote_code=trust)
        if not _looks_like_path(named) and not gguf_file:
            return BaseModel(named, "adapter_config.json (hub id)", trust_remote_code=trust)
        looked.append(f"adapter_config.json names {named} (missing)")
    name = model.get("name_or_path")
    if name:
        for c in _candidates(name, run_dir):
            if gguf_file and (c / gguf_file).is_file():
                from lowvram.train.build.gguf import gguf_folder

                folder, hit = gguf_folder(str(c), gguf_file, trust)
                how = "recipe.yaml, GGUF (cached conversion)" if hit else "recipe.yaml, GGUF (converted now)"
                return BaseModel(str(folder), how, gguf_file, trust)
            if not gguf_file and _is_model_dir(c):
                return BaseModel(str(c.resolve()), "recipe.yaml", trust_remote_code=trust)
        if not _looks_like_path(name) and not gguf_file:
            return BaseModel(name, "recipe.yaml (hub id)", trust_remote_code=trust)
        what = f"{name}/{gguf_file}" if gguf_file else name
        looked.append(f"recipe.yaml names {what} (not found next to the run or in {Path.cwd()})")
    raise ModelError(
        f"base model of {run_dir} not found: " + ("; ".join(looked) or "no adapter_config.json base and no recipe.yaml"),
        f"put the base model back, or set base_model_name_or_path in {run_dir / 'adapter_config.json'} to its folder",
    )


# --------------------------------------------------------------------------------------------
# Dtype and prompt format the run trained with


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


def _recipe_of(folder: Path) -> dict:
    from lowvram.past_runs import read_yaml_dict

    for p in (folder / RECIPE, folder.parent / RECIPE):  # a run, or a checkpoint in one
        if p.is_file():
            return read_yaml_dict(p)
    return {}


def run_prompt_format(folder: str | Path) -> str | None:
    """The format the model was trained on: alpaca | chat | raw, or None if unknown."""
    folder = Path(folder)
    info = folder / MERGE_INFO  # a merged folder remembers its run's format
    if info.is_file():
        try:
            return json.loads(info.read_text()).get("prompt_format")
        except (OSError, ValueError):
            return None
    datasets = ((_recipe_of(folder).get("data") or {}).get("datasets")) or []
    formats = {str(d.get("format", "alpaca")) for d in datasets if isinstance(d, dict)}
    if not formats:
        return None
    if formats == {"alpaca"}:
        return "alpaca"
    if formats & {"chat", "sharegpt"}:
        return "chat"
    return "raw"


# --------------------------------------------------------------------------------------------
# Memory: what loading base + adapter needs, checked before anything is loaded


@dataclass(frozen=True)
class LoadSize:
    parameters: int | None  # of the base, from config.json (None: its architecture is unknown)
    needed_bytes: int | None
    counted: str  # how needed_bytes was counted, for the message


def count_base_parameters(source: str) -> int | None:
    """Exact count from config.json (no weights); for an architecture the planner cannot read, the
    elements in its safetensors files' headers (no code runs, no tensor is read), else the model
    transformers builds from config.json on the meta device (its own model types only: no remote
    code runs); None if none of these can be read."""
    from lowvram.plan.model.catalog import local_config, resolve_model
    from lowvram.plan.model.models import model_numel

    try:
        return model_numel(resolve_model(source))
    except LowvramError:
        pass
    n = _weight_file_elements(Path(source))
    config = local_config(source) if n is None else None
    if config:
        from lowvram.train.after.footprint import model_shapes

        try:
            n = model_shapes(config)[1]
        except Exception:  # noqa: BLE001 - an unknown model_type or remote code: not countable here
            n = None
    return n


def _weight_file_elements(folder: Path) -> int | None:
    """The elements of every tensor in the folder's *.safetensors files, from their headers."""
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    total = 0
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    n = 1
                    for d in st.get_slice(name).get_shape():
                        n *= int(d)
                    total += n
    except (OSError, ValueError, RuntimeError):
        return None
    return total


def adapter_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("adapter_model.*") if f.is_file())


def dense_size(base: BaseModel, dtype: str, folder: Path) -> LoadSize:
    """The base in ``dtype`` (every weight an ordinary tensor) + the adapter (its file size)."""
    n = count_base_parameters(base.source)
    needed = n * DTYPE_BYTES[dtype] + adapter_bytes(folder) if n is not None else None
    return LoadSize(n, needed, f"{n or 0:,} parameters x {DTYPE_BYTES[dtype]} bytes ({dtype}) + adapter")


def trained_size(base: BaseModel, plan: dict) -> LoadSize:
    """The base as the run trained it (4/8-bit linears, the rest in the plan's weight dtype) + the
    fp32 adapters: the planner's exact weight bytes (lowvram.plan.memory.states.weight_bytes)."""
    from lowvram.plan.memory.states import weight_bytes
    from lowvram.plan.model.catalog import resolve_model
    from lowvram.plan.model.models import model_numel
    from lowvram.plan.setup import RunSetup

    try:
        spec = resolve_model(base.source)
    except LowvramError:
        return LoadSize(None, None, "")
    setup = RunSetup(model=spec, precision=plan["mixed_precision"], quantization=plan["quantization"], lora=True,
                     lora_r=int(plan["lora_r"]), lora_targets=tuple(plan["lora_targets"]))
    return LoadSize(model_numel(spec), weight_bytes(setup),
                    f"{model_numel(spec):,} parameters, {plan['quantization']} as trained, + adapter")


def refuse_if_short(job: str, size: LoadSize, free_bytes: int, where: str, hint: str) -> None:
    """LowvramError when ``size`` does not fit the ``free_bytes`` of ``where`` (host RAM, the GPU)."""
    from lowvram.units import mem

    if size.needed_bytes is not None and size.needed_bytes > free_bytes:
        raise LowvramError(f"{job} needs {mem(size.needed_bytes)} of {where} ({size.counted}), "
                           f"{mem(free_bytes)} available", hint)


# --------------------------------------------------------------------------------------------
# Loading base + adapter


def trained_plan(plan: dict):
    """plan.json as a Plan (older runs' extra keys dropped; JSON lists back to tuples)."""
    from lowvram.plan.types import Plan

    try:
        return Plan.from_dict(plan)
    except TypeError as e:
        raise LowvramError(f"the run's plan.json cannot be read as a plan: {e}",
                           "pass --dtype to load the base dequantized, or retrain with this lowvram") from None


def load_trained_base(base: BaseModel, plan: Plan, device: str):
    """The base as the run trained it: the BitsAndBytesConfig and weight dtype of train/build/model.py's
    builder (load_kwargs), on ``device``."""
    from lowvram.plan.model.catalog import local_config
    from lowvram.train.build.model import has_vision, load_kwargs

    kwargs = load_kwargs(plan, has_vision(local_config(base.source) or {}))
    return _from_pretrained(base, dtype=kwargs["dtype"], quantization_config=kwargs.get("quantization_config"),
                            device_map={"": device})


def load_base(base: BaseModel, dtype: str, device: str):
    import torch

    return _from_pretrained(base, dtype=getattr(torch, dtype), device_map={"": device})


def _from_pretrained(base: BaseModel, **kwargs):
    from lowvram.plan.model.catalog import local_config
    from lowvram.runfiles import require_intact
    from lowvram.train.build.custom_code import custom_code_error, is_custom_code_refusal
    from lowvram.train.build.model import _first_line, has_vision, model_class, mxfp4_dequantized

    require_intact(Path(base.source))  # a hub id: no such folder, nothing to check
    if kwargs.get("quantization_config") is None:  # gpt-oss: dequantized, as train loads it
        kwargs.update(mxfp4_dequantized(base.source))
    try:
        # quantization_config=None is not enough for a pre-quantized checkpoint; plain folders
        # (hub bases, the GGUF cache) carry none, and that is what a lowvram run trains on.
        # trust_remote_code always given: left None, transformers asks on the terminal.
        return model_class(has_vision(local_config(base.source) or {})).from_pretrained(
            base.source, trust_remote_code=base.trust_remote_code, **kwargs)
    except OSError as e:
        raise ModelError(f"cannot load the base model {base.source}: {_first_line(e)}",
                         "check the folder (or hub cache; HF_HUB_OFFLINE=1 reads only the cache)") from None
    except ValueError as e:
        if is_custom_code_refusal(e):
            raise custom_code_error(base.source, base.found_via) from None
        raise


def load_pretrained(source: str | Path, trust_remote_code: bool, found_via: str = "folder", **kwargs):
    """A full model folder (merged, or a full fine-tune) as _from_pretrained loads a base."""
    return _from_pretrained(BaseModel(str(source), found_via, trust_remote_code=trust_remote_code), **kwargs)


def load_run_tokenizer(source: str | Path, trust_remote_code: bool, found_via: str = "folder"):
    """AutoTokenizer of ``source`` with the run's trust_remote_code choice (pad token = eos)."""
    from transformers import AutoTokenizer

    from lowvram.runfiles import require_intact
    from lowvram.train.build.custom_code import custom_code_error, is_custom_code_refusal

    require_intact(Path(source))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    except ValueError as e:
        if is_custom_code_refusal(e):
            raise custom_code_error(str(source), found_via) from None
        raise
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def trusts_code(folder: str | Path) -> bool:
    """A merged or fully fine-tuned folder's choice: lowvram_merge.json's trust_remote_code (a
    merge), else the recipe.yaml of its run (the folder, or the run above a checkpoint)."""
    info = Path(folder) / MERGE_INFO
    if info.is_file():
        try:
            return json.loads(info.read_text()).get("trust_remote_code") is True
        except (OSError, ValueError):
            return False
    return run_trusts_code(_recipe_of(Path(folder)))


def load_adapter(model: PreTrainedModel, folder: str | Path):
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, str(folder))
    except (ValueError, RuntimeError, KeyError) as e:
        raise ModelError(f"the adapter in {folder} does not fit its base model: {str(e).splitlines()[0]}",
                         "the base must be the model the run trained on (same architecture and sizes)") from None
