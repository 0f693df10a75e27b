"""Hardware detection: the only module that asks CUDA / MPS / the OS about memory.

``detect_hardware()`` returns a frozen :class:`Hardware`; tests build a fake one directly.
``read_cuda_memory()`` reads a CUDA run's memory counters once, at the end of the run
(:mod:`lowvram.gpumemory` compares them with the plan, like with like).
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field

from lowvram.gpumemory import CudaMemoryReading
from lowvram.units import parse_size


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    total_bytes: int
    free_bytes: int  # CUDA: torch.cuda.mem_get_info, read once (see Hardware.context_in_free)
    compute_capability: tuple[int, int] | None = None
    bf16: bool = False


@dataclass(frozen=True)
class Hardware:
    kind: str  # "cuda" | "mps" | "cpu"
    devices: tuple[Device, ...] = ()
    host_total_bytes: int = 0
    host_available_bytes: int = 0
    vram_override_bytes: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    # True: each Device.free_bytes was read by this process after its own CUDA context existed
    # (torch.cuda.mem_get_info creates the context before it asks the driver), so the context is
    # already out of free_bytes and the plan must not take its cuda_context term off again
    # (lowvram.planning adds it back to the budget). False: a free size that still holds it (a
    # Hardware built by hand, a --vram size).
    context_in_free: bool = False

    @property
    def bf16(self) -> bool:
        if self.kind == "cuda":
            return bool(self.devices) and all(d.bf16 for d in self.devices)
        return self.kind == "cpu"

    @property
    def budget_bytes(self) -> int | None:
        """Free memory of the first accelerator (or the override); None on CPU-only."""
        return self.free_bytes(1)

    def used_devices(self, gpus: int = 1) -> tuple[Device, ...]:
        """The accelerators a run of ``gpus`` processes on this node uses: the first ``gpus``
        (accelerate gives local rank K the device K), all of them when ``gpus`` is larger."""
        return self.devices[:max(1, gpus)]

    def free_bytes(self, gpus: int = 1) -> int | None:
        """What each of ``gpus`` processes can count on: the override, else the smallest free
        memory among the cards used (data parallel: every rank holds the same plan)."""
        if self.vram_override_bytes is not None:
            return self.vram_override_bytes
        used = self.used_devices(gpus)
        return min(d.free_bytes for d in used) if used else None

    def tightest_device(self, gpus: int = 1) -> Device | None:
        """The used card with the least free memory (the one the budget comes from)."""
        used = self.used_devices(gpus)
        return min(used, key=lambda d: (d.free_bytes, d.index)) if used else None

    def to_dict(self) -> dict:
        return asdict(self)


def _host_memory() -> tuple[int, int]:
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
        return info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0))
    except OSError:
        try:
            pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            return pages, pages
        except (ValueError, OSError, AttributeError):
            return 0, 0


def detect_hardware(vram: str | None = None) -> Hardware:
    """Detect GPUs and host memory. ``vram`` (or LOWVRAM_VRAM) overrides the budget."""
    override = vram or os.environ.get("LOWVRAM_VRAM") or None
    override_bytes = parse_size(override) if override else None
    host_total, host_avail = _host_memory()
    import torch

    if torch.cuda.is_available():
        devices = []
        for i in range(torch.cuda.device_count()):
            # Read once per card. mem_get_info creates this process's CUDA context on card i
            # first, so `free` no longer holds it: context_in_free=True below.
            free, total = torch.cuda.mem_get_info(i)
            props = torch.cuda.get_device_properties(i)
            cc = (props.major, props.minor)
            devices.append(Device(i, props.name, int(total), int(free), cc, bool(cc >= (8, 0))))
        return Hardware("cuda", tuple(devices), host_total, host_avail, override_bytes, context_in_free=True)
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        # MPS shares host memory; report the recommended working set as the budget.
        total = int(getattr(torch.mps, "recommended_max_memory", lambda: host_total)())
        dev = Device(0, "Apple MPS", total, total, None, True)
        return Hardware("mps", (dev,), host_total, host_avail, override_bytes)
    return Hardware("cpu", (), host_total, host_avail, override_bytes, ("no GPU found: training runs on the CPU",))


def read_cuda_memory(device: int | None = None) -> CudaMemoryReading:
    """This process's memory counters on one CUDA card, read once (at the end of a run): the
    caching allocator's peaks since the last reset (max_memory_allocated: tensors;
    max_memory_reserved: tensors + the allocator's slack), what it reserves now, and the driver's
    free and total memory (mem_get_info), whose difference beyond the reservation is the CUDA
    context, the loaded kernels and any other process on the card."""
    import torch

    index = torch.cuda.current_device() if device is None else device
    free, total = torch.cuda.mem_get_info(index)
    return CudaMemoryReading(
        allocated_peak_bytes=int(torch.cuda.max_memory_allocated(index)),
        reserved_peak_bytes=int(torch.cuda.max_memory_reserved(index)),
        reserved_bytes=int(torch.cuda.memory_reserved(index)),
        free_bytes=int(free), total_bytes=int(total),
    )


def collect_env() -> dict:
    """Versions and devices for bug reports (`lowvram env`)."""
    from importlib import metadata

    from lowvram import __version__

    versions = {"lowvram": __version__, "python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    try:
        import torch

        versions["cuda"] = torch.version.cuda or "none"
        hw = detect_hardware()
    except Exception as e:  # noqa: BLE001 - env must always print something for bug reports
        return {"versions": versions, "hardware": {"error": str(e)}}
    return {"versions": versions, "hardware": hw.to_dict()}
