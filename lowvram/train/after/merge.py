"""`lowvram merge`: fold a run's LoRA adapter into its base model, save a plain transformers folder.

The base is found and loaded through :mod:`lowvram.train.after.artifacts` (as `lowvram generate` does).
A 4-bit/8-bit (QLoRA) base is loaded in its compute dtype instead, i.e.
dequantized, so the merged weights are ordinary tensors: merging into packed 4-bit weights would
round the adapter away (peft docs, "Merge LoRA weights into the base model"). The saved config
has no ``quantization_config``.

Planned before anything is loaded (``plan_merge``, with footprint.py, the planning export shares):
the GPU memory, host RAM and disk it needs, the device picked by what fits (the GPU when the
model, the adapter and one layer's delta fit there and host RAM holds the model while it is saved;
else the CPU), refused with the figures when nothing fits.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lowvram.errors import LowvramError
from lowvram.train.after.artifacts import (
    MERGE_INFO,
    BaseModel,
    adapter_bytes,
    dense_size,
    find_base_model,
    load_adapter,
    load_base,
    load_run_tokenizer,
    merge_dtype,
    read_adapter_run,
    run_prompt_format,
)
from lowvram.vocab import DTYPE_BYTES


@dataclass(frozen=True)
class MergePlan:
    run_dir: str
    out_dir: str
    base: BaseModel
    dtype: str
    device: str  # "cuda" | "cpu"
    parameters: int
    adapter_bytes: int
    needed_bytes: int  # on the device it runs on (GPU memory, or host RAM on the CPU)
    host_available_bytes: int
    gpu_free_bytes: int | None
    notes: tuple[str, ...] = ()
    ram_bytes: int = 0  # host RAM at the peak (on the GPU too: the model is copied to host memory to be saved)
    disk_bytes: int = 0
    disk_free_bytes: int = 0
    disk_folder: str = ""
    counted: str = ""

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
# Memory and device


def plan_merge(run_dir: str | Path, out_dir: str | Path, dtype: str = "auto", device: str = "auto") -> MergePlan:
    """Find the base, size the merge (GPU memory, host RAM, disk: footprint.py), pick the device by
    what fits; LowvramError with the figures if it cannot work."""
    from lowvram.plan.model.catalog import local_config
    from lowvram.train.after.footprint import (
        HEADER_BYTES,
        largest_matrix,
        merge_usage,
        plan_footprint,
    )

    p, adapter, recipe, plan = read_adapter_run(run_dir)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LowvramError(f"--out {out} exists and is not empty", "choose a new folder (nothing was overwritten)")
    if dtype not in ("auto", *DTYPE_BYTES):
        raise LowvramError(f"unknown dtype {dtype!r}", "use auto, bfloat16, float16 or float32")
    base = find_base_model(p, adapter, recipe)
    dt = merge_dtype(recipe, plan, dtype)
    n = dense_size(base, dt, p).parameters
    config = local_config(base.source) or {}
    if n is None:
        raise LowvramError(f"cannot count the parameters of {base.source}: the merge's memory cannot be planned",
                           "merge needs the base's config.json in a folder lowvram can read (transformers' own model types)")
    notes = []
    if plan.get("quantization", "none") != "none":
        notes.append(f"the run trained on a {plan['quantization']} base: the base is loaded dequantized in {dt} for "
                     f"the merge, counted at {DTYPE_BYTES[dt]} bytes per parameter")
    on_gpu, on_cpu = merge_usage(n, dt, adapter_bytes(p), largest_matrix(config) if config else 0)
    tok = p if (p / "tokenizer_config.json").is_file() else Path(base.source)
    tok_bytes = sum(f.stat().st_size for f in tok.glob("*") if f.is_file() and "token" in f.name) if tok.is_dir() else 0
    half = " or --dtype bfloat16 (half the memory)" if dt == "float32" else ""
    fp = plan_footprint("merge", on_gpu, on_cpu, n * DTYPE_BYTES[dt] + tok_bytes + HEADER_BYTES, out.parent,
                        f"the merged folder, written as .{out.name}.* beside it and renamed: no second copy",
                        device, ram_hint=f"close other programs, or merge on a machine with more RAM{half}",
                        disk_hint="free space there, or merge to a disk with room for it (--out)")
    return MergePlan(str(p), str(out), base, dt, fp.device, n, adapter_bytes(p), fp.gpu_bytes or fp.ram_bytes,
                     fp.ram_available_bytes, fp.gpu_free_bytes, (*notes, *fp.notes), fp.ram_bytes, fp.disk_bytes,
                     fp.disk_free_bytes, fp.disk_folder, fp.counted)


# --------------------------------------------------------------------------------------------
# Merging


def merge_run(plan: MergePlan) -> MergeResult:
    """Load base (dequantized) + adapter, merge_and_unload, save a from_pretrained folder."""
    from lowvram.train.build.model import quiet_libraries

    quiet_libraries()
    t0 = time.perf_counter()
    run = Path(plan.run_dir)
    merged = load_adapter(load_base(plan.base, plan.dtype, plan.device), run).merge_and_unload()
    config = merged.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tok_source = run if (run / "tokenizer_config.json").is_file() else plan.base.source
    tokenizer = load_run_tokenizer(tok_source, plan.base.trust_remote_code)

    out = Path(plan.out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {"merged_from": str(run.resolve()), "base": plan.base.source, "dtype": plan.dtype,
                "prompt_format": run_prompt_format(run), "trust_remote_code": plan.base.trust_remote_code}
        (tmp / MERGE_INFO).write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (plan_merge checked)
        os.replace(tmp, out)
    except BaseException as e:
        failed = _disk_full(e, tmp, out)
        shutil.rmtree(tmp, ignore_errors=True)
        if failed is not None:
            raise failed from None
        raise
    seconds = time.perf_counter() - t0
    return MergeResult(str(out), round(seconds, 3), _peak_rss(), tuple(sorted(f.name for f in out.iterdir())), plan)


def _disk_full(exc: BaseException, tmp: Path, out: Path) -> LowvramError | None:
    """The error for a disk that filled while the merged folder was written (None: another
    failure). The half-written folder is removed by the caller: nothing of it stays."""
    from lowvram.train.diskfull import staged_file_that_did_not_fit

    what = staged_file_that_did_not_fit(exc, tmp, out)
    if what is None:
        return None
    return LowvramError(f"disk full while writing {what} (the merged model did not fit; nothing of it was kept)",
                        f"free space on that disk (df -h {shlex.quote(str(out.parent))}) and merge again, "
                        f"or merge to a disk with room for it (--out)")


def _peak_rss() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux
