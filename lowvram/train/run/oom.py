"""Out of memory: recognise it, report it with the peak measured up to it, and pass it from a
launched worker to its launcher (``oom-rank{R}.json``), which re-plans (recover.py).

No torch at import time.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.runfiles import OOM_REPORT, write_atomic

if TYPE_CHECKING:
    from torch.utils._python_dispatch import TorchDispatchMode

    from lowvram.plan.types import Plan

EMULATE_ENV = "LOWVRAM_EMULATE_VRAM"  # testing: cap the CPU live-bytes tracker like a card this size

# RuntimeError texts of an allocation failure that is not a torch.OutOfMemoryError (cuBLAS and
# cuDNN workspaces, bitsandbytes kernels, older torch, MPS/ROCm).
OOM_MESSAGES = (
    "CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED", "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE", "MPS backend out of memory",
    "HIP out of memory", "cudaErrorMemoryAllocation",
)


def is_oom(exc: BaseException) -> bool:
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in OOM_MESSAGES)


def requested_bytes(message: str) -> int:
    """The allocation a CUDA OOM message says failed ("Tried to allocate 2.00 GiB"), else 0."""
    from lowvram.units import parse_size

    m = re.search(r"Tried to allocate ([\d.]+ ?(?:B|KiB|MiB|GiB|TiB))", message)
    return parse_size(m.group(1)) if m else 0


def emulated_vram_bytes() -> int | None:
    """LOWVRAM_EMULATE_VRAM=SIZE (tests, demos): the CPU tracker raises OOM above SIZE."""
    text = os.environ.get(EMULATE_ENV)
    if not text:
        return None
    from lowvram.units import parse_size

    return parse_size(text)


class TrainingOOM(LowvramError):
    """Out of memory during training, with what the retry needs to know."""

    def __init__(self, step: int, measured_peak_bytes: int | None, plan: Plan, detail: str) -> None:
        from lowvram.units import mem as gib  # MiB below 1 GiB

        measured = f"measured {gib(measured_peak_bytes)}, " if measured_peak_bytes else ""
        super().__init__(
            f"out of memory at step {step} ({measured}predicted {gib(plan.predicted_peak_bytes)}): {detail}",
            "lower training.micro_batch_size or seq_len, or turn on techniques.gradient_checkpointing; "
            "`lowvram plan` shows the predicted peak",
        )
        self.step = step
        self.measured_peak_bytes = measured_peak_bytes
        self.plan = plan
        self.detail = detail


def oom_error(exc: BaseException, step: int, plan: Plan, tracker: TorchDispatchMode | None = None) -> TrainingOOM:
    """The TrainingOOM for ``exc``, with the peak measured up to the failure."""
    measured = None
    if tracker is not None:
        measured = int(tracker.peak_bytes)
    elif plan.device == "cuda":
        import torch

        measured = int(torch.cuda.max_memory_allocated())
    if measured is not None:  # the failed allocation was needed too (not in the allocator's peak)
        measured += requested_bytes(str(exc))
    # global_step counts finished optimizer steps: the one that failed is the next.
    return TrainingOOM(step + 1, measured, plan, (str(exc).splitlines() or ["out of memory"])[0])


# Set by the launcher: a worker that runs out of memory writes OOM_REPORT for it instead of
# printing the error (the launcher retries, or prints the final error itself).
REPORT_ENV = "LOWVRAM_OOM_REPORT"


EXTRA_METRICS_ENV = "LOWVRAM_EXTRA_METRICS"  # the launcher's retries, for the worker's metrics.json


def write_oom_report(out: Path, rank: int, err: TrainingOOM) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / OOM_REPORT.format(rank=rank), json.dumps(
        {"rank": rank, "step": err.step, "measured_peak_bytes": err.measured_peak_bytes,
         "detail": err.detail}) + "\n")


def has_oom_reports(out: Path) -> bool:
    return any(out.glob(OOM_REPORT.format(rank="*")))


def collect_oom_reports(out: Path, plan: Plan) -> TrainingOOM | None:
    """The workers' OOM reports as one TrainingOOM (first step, highest measured peak); the
    report files are removed."""
    reports = []
    for p in sorted(out.glob(OOM_REPORT.format(rank="*"))):
        try:
            reports.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            pass
        p.unlink(missing_ok=True)
    if not reports:
        return None
    measured = max((r.get("measured_peak_bytes") or 0 for r in reports), default=0) or None
    first = min(reports, key=lambda r: r["step"])
    ranks = ", ".join(str(r["rank"]) for r in sorted(reports, key=lambda r: r["rank"]))
    return TrainingOOM(first["step"], measured, plan, f"{first['detail']} (rank {ranks})")
