"""Hardware detection: the only module that asks CUDA / MPS / the OS about memory.

``detect_hardware()`` returns a frozen :class:`Hardware`; tests build a fake one directly.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field

from lowvram.units import parse_size


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
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

    @property
    def bf16(self) -> bool:
        if self.kind == "cuda":
            return bool(self.devices) and all(d.bf16 for d in self.devices)
        return self.kind == "cpu"

    @property
    def budget_bytes(self) -> int | None:
        """Free memory of the first accelerator (or the override); None on CPU-only."""
        if self.vram_override_bytes is not None:
            return self.vram_override_bytes
        if self.devices:
            return self.devices[0].free_bytes
        return None

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
            free, total = torch.cuda.mem_get_info(i)
            props = torch.cuda.get_device_properties(i)
            cc = (props.major, props.minor)
            devices.append(Device(i, props.name, int(total), int(free), cc, bool(cc >= (8, 0))))
        return Hardware("cuda", tuple(devices), host_total, host_avail, override_bytes)
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        # MPS shares host memory; report the recommended working set as the budget.
        total = int(getattr(torch.mps, "recommended_max_memory", lambda: host_total)())
        dev = Device(0, "Apple MPS", total, total, None, True)
        return Hardware("mps", (dev,), host_total, host_avail, override_bytes)
    return Hardware("cpu", (), host_total, host_avail, override_bytes, ("no GPU found: training runs on the CPU",))


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
