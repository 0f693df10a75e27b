"""Hardware detection: the only module that asks CUDA / MPS / the OS about memory.

``detect_hardware()`` returns a frozen :class:`Hardware`; tests build a fake one directly. The
cards are read by a short child process (:func:`probe_cuda`): reading a card's free memory
(``torch.cuda.mem_get_info``) creates a CUDA context on it, which would stay in this process,
the one that launches the workers, for the whole run (a second context on every card), and on
cards the run does not use at all.
``read_cuda_memory()`` reads a CUDA run's memory counters once, at the end of the run
(:mod:`lowvram.gpumemory` compares them with the plan, like with like).
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from lowvram.plan.cards import read_vram

if TYPE_CHECKING:  # imported where a run's memory is read: a plan needs only the host's
    from lowvram.gpumemory import CudaMemoryReading


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    total_bytes: int
    # CUDA: torch.cuda.mem_get_info, read once by the probe (see Hardware.context_in_free);
    # None: not read (a card the run does not use)
    free_bytes: int | None
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
    # True: each Device.free_bytes was read by a process after its own CUDA context existed
    # (torch.cuda.mem_get_info creates the context before it asks the driver): the probe's child
    # process, whose context is gone when the run starts, so free_bytes is what the process that
    # trains on the card has once its own context exists. The context is already out of
    # free_bytes and the plan must not take its cuda_context term off again (lowvram.planning
    # adds it back to the budget). False: a free size that still holds it (a Hardware built by
    # hand, a --vram size).
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


def host_memory() -> tuple[int, int]:
    """(total, available) host RAM in bytes, from /proc/meminfo (no torch)."""
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


def detect_hardware(vram: str | None = None, gpus: int | None = None) -> Hardware:
    """Detect GPUs and host memory. ``vram`` (or LOWVRAM_VRAM) overrides the budget. ``gpus``:
    the cards the run uses (accelerate gives local rank K card K), the only ones whose free
    memory is read; None: every visible card (`lowvram env`, `lowvram plan`)."""
    override = vram or os.environ.get("LOWVRAM_VRAM") or None
    override_bytes = read_vram(override).bytes if override else None
    host_total, host_avail = host_memory()
    import torch

    # torch.cuda.is_available() only counts the devices (torch/cuda/__init__.py: cudaGetDeviceCount,
    # which runs cuInit, or NVML): no torch CUDA state (_lazy_init), no context on a card.
    if torch.cuda.is_available():
        devices = probe_cuda(None if gpus is None else range(gpus))
        return Hardware("cuda", devices, host_total, host_avail, override_bytes, context_in_free=True)
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        # MPS shares host memory; report the recommended working set as the budget.
        total = int(getattr(torch.mps, "recommended_max_memory", lambda: host_total)())
        dev = Device(0, "Apple MPS", total, total, None, True)
        return Hardware("mps", (dev,), host_total, host_avail, override_bytes)
    return Hardware("cpu", (), host_total, host_avail, override_bytes, ("no GPU found: training runs on the CPU",))


def read_cards(wanted: list[int] | None) -> list[dict]:
    """Every visible card's name, total memory and compute capability, and the free memory of
    the cards in ``wanted`` (None: all). Run in the probe's child process: mem_get_info creates a
    CUDA context on each card it reads, and the child's contexts end with it."""
    import torch

    cards = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i) if wanted is None or i in wanted else (None, p.total_memory)
        cards.append({"index": i, "name": p.name, "total": int(total), "free": free, "cc": [p.major, p.minor]})
    return cards


def devices_from(cards: list[dict]) -> tuple[Device, ...]:
    """read_cards' answer (JSON from the child) as Devices; bf16 from compute capability 8.0."""
    devices = []
    for c in cards:
        cc = (int(c["cc"][0]), int(c["cc"][1]))
        free = None if c["free"] is None else int(c["free"])
        devices.append(Device(int(c["index"]), str(c["name"]), int(c["total"]), free, cc, cc >= (8, 0)))
    return tuple(devices)


_PROBE = "import json, sys; from lowvram.hardware import read_cards; print(json.dumps(read_cards(json.loads(sys.argv[1]))))"
PROBE_TIMEOUT_S = 120  # importing torch and creating a context per card read: seconds


def probe_cuda(indices=None) -> tuple[Device, ...]:
    """:func:`read_cards` in a child process (this interpreter, this environment:
    CUDA_VISIBLE_DEVICES gives it the numbering the workers get; PYTHONPATH gets this lowvram)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    wanted = None if indices is None else sorted(indices)
    env = dict(os.environ)
    here = Path(__file__).resolve().parent.parent
    if here.name not in ("site-packages", "dist-packages"):  # a source tree: the child imports this lowvram
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(here), os.environ.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(wanted)], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, check=False, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise _probe_failed(str(e)) from None
    try:
        return devices_from(json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError, KeyError, TypeError):
        raise _probe_failed((done.stderr.strip().splitlines() or [f"exit {done.returncode}, no output"])[-1]) from None


def _probe_failed(why: str):
    import sys

    from lowvram.errors import LowvramError

    return LowvramError(f"cannot read the GPUs' memory: a child `{sys.executable} -c` asking torch failed ({why})",
                        f"check that `{sys.executable} -c 'import torch; print(torch.cuda.mem_get_info())'` "
                        "works in this environment (driver, CUDA_VISIBLE_DEVICES)")


def read_cuda_memory(device: int | None = None) -> CudaMemoryReading:
    """This process's memory counters on one CUDA card, read once (at the end of a run): the
    caching allocator's peaks since the last reset (max_memory_allocated: tensors;
    max_memory_reserved: tensors + the allocator's slack), what it reserves now, and the driver's
    free and total memory (mem_get_info), whose difference beyond the reservation is the CUDA
    context, the loaded kernels and any other process on the card."""
    import torch

    from lowvram.gpumemory import CudaMemoryReading

    index = torch.cuda.current_device() if device is None else device
    free, total = torch.cuda.mem_get_info(index)
    return CudaMemoryReading(
        allocated_peak_bytes=int(torch.cuda.max_memory_allocated(index)),
        reserved_peak_bytes=int(torch.cuda.max_memory_reserved(index)),
        reserved_bytes=int(torch.cuda.memory_reserved(index)),
        free_bytes=int(free), total_bytes=int(total), paged_bytes=paged_state_bytes(),
    )


def paged_state_bytes() -> int:
    """Bytes of bitsandbytes' paged optimizer state in this process (paged_adamw_8bit/32bit):
    every buffer a paged optimizer makes is CUDA unified memory (functional.get_paged:
    cudaMallocManaged under a CPU-typed torch.frombuffer tensor) and is appended to the
    process-wide GlobalPageManager.paged_tensors (optim/optimizer.py get_state_buffer), which
    nothing in bitsandbytes ever frees. torch's counters do not see it. 0 when bitsandbytes was
    never imported (it is not imported for this)."""
    import sys

    bnb = sys.modules.get("bitsandbytes.functional")
    if bnb is None:
        return 0
    return sum(t.nbytes for t in bnb.GlobalPageManager.get_instance().paged_tensors)


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
