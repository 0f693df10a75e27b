"""What `merge` and `export` need before anything is loaded - GPU memory, host RAM, disk (with the
temporary files) - one planning function for both: ``plan_footprint`` picks the device by what
fits and refuses, with the figures, what does not.

The memory of a merge, counted from the sources:
  the base      parameters x bytes of the dtype it is loaded in (a QLoRA run's base is loaded
                dequantized, in its compute dtype: artifacts.merge_dtype; the peak is this 16-bit
                model, never the 4-bit one)
  the adapter   its file size (loaded beside the base)
  the context   on the GPU, the CUDA context (constants.CUDA_CONTEXT_BYTES)
  the delta     peft's LoraLayer.merge adds get_delta_weight(B @ A x scaling) to each weight in
                turn: one weight-sized product in the adapter's float32 (peft casts adapters to
                float32, autocast_adapter_dtype) and its cast to the weight's dtype, for the
                largest adapted matrix, alive at once
  saving        on the CPU, safetensors writes the tensors from their own memory (torch.py
                _to_ndarray: no copy); from the GPU it copies every tensor of a shard to host
                memory and keeps them until the shard is written (_flatten_as_ptr's
                keep_alive_buffer; transformers' max_shard_size is 50 GB): the whole model in
                host RAM
The process itself (Python, torch, transformers: about 0.5 GB) is not counted.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from lowvram.errors import LowvramError
from lowvram.vocab import DTYPE_BYTES

HEADER_BYTES = 64 * 1024  # config.json, generation_config.json, the record: kilobytes


@dataclass(frozen=True)
class Usage:
    """What one way of running the job needs (bytes) and how it was counted."""
    gpu_bytes: int
    ram_bytes: int
    counted: str


@dataclass(frozen=True)
class Footprint:
    device: str  # cuda | cpu
    gpu_bytes: int  # 0 on the CPU
    gpu_free_bytes: int | None  # None: no CUDA GPU
    ram_bytes: int
    ram_available_bytes: int
    disk_bytes: int  # the output, and its temporary copy where there is one
    disk_free_bytes: int
    disk_folder: str
    counted: str
    notes: tuple[str, ...] = ()


def model_shapes(config: dict) -> tuple[dict[str, tuple[int, ...]], int]:
    """Every tensor of the model config.json describes, with its shape, and its parameter count
    (a tied embedding once): the model built on the meta device (no memory, no weights)."""
    import contextlib
    import io

    from lowvram.train.build.quiet import quiet_libraries

    quiet_libraries()  # before torch: torchao's import lines (planning runs before any load)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"), contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_config(cfg)
    return ({k: tuple(v.shape) for k, v in model.state_dict().items()},
            sum(p.numel() for p in model.parameters()))


def largest_matrix(config: dict) -> int:
    """Elements of the largest matrix LoRA adapts (the embedding and lm_head left out); from
    config.json's sizes when the model cannot be built here (remote code)."""
    try:
        shapes, _ = model_shapes(config)
    except Exception:  # noqa: BLE001 - remote code, an unknown model_type: the sizes are enough
        h = int(config.get("hidden_size") or 0)
        return h * max(int(config.get("intermediate_size") or 0), h)
    skip = ("embed", "lm_head", "wte", "wpe")
    return max((s[0] * s[1] for k, s in shapes.items() if len(s) == 2 and not any(x in k for x in skip)), default=0)


def merge_usage(parameters: int, dtype: str, adapter_bytes: int, matrix_elements: int) -> tuple[Usage, Usage]:
    """(on the GPU, on the CPU) for merging ``parameters`` in ``dtype`` (module docstring)."""
    model = parameters * DTYPE_BYTES[dtype]
    delta = matrix_elements * (4 + DTYPE_BYTES[dtype]) if adapter_bytes else 0
    counted = (f"{parameters:,} parameters x {DTYPE_BYTES[dtype]} bytes ({dtype}) + the adapter"
               + (" + one layer's LoRA delta" if delta else ""))
    # the GPU also holds the process's CUDA context (the probe's free figure has none of it)
    from lowvram.plan.setup import cuda_overheads

    context = cuda_overheads().context_bytes
    on_gpu = Usage(model + adapter_bytes + delta + context, model,
                   counted + " + the CUDA context; host RAM: the model, copied there to be saved")
    return on_gpu, Usage(0, model + adapter_bytes + delta, counted)


def disk_free(path: Path) -> tuple[Path, int]:
    """The nearest existing folder at or above ``path`` and its free bytes."""
    folder = next((a for a in (path, *path.parents) if a.exists()), Path("/"))
    return folder, shutil.disk_usage(folder).free


def plan_footprint(job: str, on_gpu: Usage | None, on_cpu: Usage, disk_bytes: int, out_folder: Path,
                   disk_what: str, device: str = "auto", ram_hint: str = "close other programs",
                   disk_hint: str = "free space there, or write elsewhere with --out") -> Footprint:
    """Pick the device (``on_gpu`` None: the CPU only) by what fits, check the disk; LowvramError
    with the figures when nothing fits."""
    from lowvram.units import mem

    if on_gpu is None:  # no need to look for a GPU
        from lowvram.hardware import host_memory

        gpu_free, ram = None, host_memory()[1]
    else:
        from lowvram.hardware import detect_hardware

        hw = detect_hardware(gpus=1)  # the first card, as merge and generate use
        gpu_free = hw.devices[0].free_bytes if hw.kind == "cuda" and hw.devices else None
        ram = hw.host_available_bytes
    notes: list[str] = []
    gpu_fits = on_gpu is not None and gpu_free is not None and on_gpu.gpu_bytes <= gpu_free
    if device == "cuda" and gpu_free is None:
        raise LowvramError(f"{job} on the GPU: no CUDA GPU found", "leave the device to lowvram (it merges on the CPU)")
    if device != "cpu" and gpu_fits and on_gpu.ram_bytes <= ram:
        chosen = on_gpu
    elif device == "cuda" and on_gpu is not None:
        raise LowvramError(f"{job} needs {mem(on_gpu.gpu_bytes)} of GPU memory and {mem(on_gpu.ram_bytes)} of host RAM "
                           f"({on_gpu.counted}); the GPU has {mem(gpu_free or 0)} free, host RAM {mem(ram)} available",
                           "leave the device to lowvram (it merges on the CPU when that fits)")
    else:
        chosen = on_cpu
        if on_gpu is not None and gpu_free is not None:
            notes.append(f"the GPU has {mem(gpu_free)} free, {job} there needs {mem(on_gpu.gpu_bytes)} (+ "
                         f"{mem(on_gpu.ram_bytes)} of host RAM): on the CPU (slower)")
        if on_cpu.ram_bytes > ram:
            also = (f"; on the GPU it needs {mem(on_gpu.gpu_bytes)}, {mem(gpu_free)} free"
                    if on_gpu is not None and gpu_free is not None else "")
            raise LowvramError(f"{job} needs {mem(on_cpu.ram_bytes)} of host RAM ({on_cpu.counted}), "
                               f"{mem(ram)} available{also}", ram_hint)
    folder, free = disk_free(out_folder)
    if disk_bytes > free:
        raise LowvramError(f"{job} needs {mem(disk_bytes)} of disk in {folder} ({disk_what}), {mem(free)} free",
                           disk_hint)
    return Footprint("cuda" if chosen is on_gpu else "cpu", chosen.gpu_bytes, gpu_free, chosen.ram_bytes, ram,
                     disk_bytes, free, str(folder), chosen.counted, tuple(notes))
