"""A run's measured memory against its plan, like with like (issue 13, item 5).

The plan's peak (:func:`lowvram.plan.memory.memory.estimate_memory`) is the sum of parts that different
counters see, so each part is compared with the counter that sees exactly it:

=============================  ===============================================================
plan                           measured
=============================  ===============================================================
tensors (weights, gradients,   ``torch.cuda.max_memory_allocated``: bytes of live tensors (the
optimizer, activations,        CPU: the live-bytes tracker, lowvram.livebytes, counts the same)
logits)
tensors + ``allocator``        ``torch.cuda.max_memory_reserved``: the caching allocator's
                               segments (tensors plus the slack of its block rounding and cache)
``cuda_context``               ``total - free - memory_reserved`` from ``torch.cuda.mem_get_info``:
                               what the process holds outside the allocator (the context, kernels
                               loaded lazily, library handles), plus any other process on the card
                               (not lowvram's launcher: it reads the cards in a child process and
                               holds no context, lowvram.hardware)
the whole peak                 the reserved peak plus that
=============================  ===============================================================

Comparing the whole peak with ``max_memory_allocated`` (what the run summary did before) calls
every small run 300 MiB over-predicted. The context is read once, at the end of the run, when
every kernel the run needed is loaded. Pure: the reading comes from
:func:`lowvram.hardware.read_cuda_memory`; no torch here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lowvram.plan.setup import cuda_overheads

# The plan's breakdown keys that are not tensors (lowvram.plan.setup.BREAKDOWN_KEYS).
CONTEXT_KEY = "cuda_context"
SLACK_KEY = "allocator"

TENSORS = "tensors"
RESERVED = "tensors + slack"  # + the allocator term
CONTEXT = "CUDA context"
DEVICE = "whole card"


@dataclass(frozen=True)
class CudaMemoryReading:
    """One process's counters on one CUDA card (bytes), read once."""

    allocated_peak_bytes: int  # torch.cuda.max_memory_allocated
    reserved_peak_bytes: int  # torch.cuda.max_memory_reserved
    reserved_bytes: int  # torch.cuda.memory_reserved, at the moment mem_get_info was read
    free_bytes: int  # torch.cuda.mem_get_info()[0]
    total_bytes: int  # torch.cuda.mem_get_info()[1]

    @property
    def beyond_reserved_bytes(self) -> int:
        """Device memory in use that the caching allocator does not hold: the CUDA context,
        kernels and library handles, and other processes on the card."""
        return max(0, self.total_bytes - self.free_bytes - self.reserved_bytes)


@dataclass(frozen=True)
class MemoryComparison:
    """One like-with-like pair: a part of the plan and the counter that measures exactly it."""

    what: str  # TENSORS | RESERVED | CONTEXT | DEVICE
    predicted_bytes: int
    measured_bytes: int
    measured_by: str  # the counter, as the summary names it
    gpu_calibrated: bool  # the predicted part was calibrated on a GPU by this project

    @property
    def error(self) -> float | None:
        """(measured - predicted) / predicted; None without a prediction."""
        return (self.measured_bytes - self.predicted_bytes) / self.predicted_bytes if self.predicted_bytes else None

    def to_dict(self) -> dict:
        return {**asdict(self), "error": None if self.error is None else round(self.error, 4)}


def tensor_bytes(breakdown: dict[str, int]) -> int:
    """The plan's tensor bytes: its peak without the CUDA context and the allocator slack."""
    return sum(v for k, v in breakdown.items() if k not in (CONTEXT_KEY, SLACK_KEY))


def compare_cuda(breakdown: dict[str, int], reading: CudaMemoryReading) -> tuple[MemoryComparison, ...]:
    """The four pairs of a CUDA run: tensors, tensors + slack, context, the whole peak.

    Tensor terms have not been measured on a GPU by this project (bench/gpu_check.py is prepared,
    not run); the context and slack constants were fitted on published rows (cuda_overheads)."""
    tensors = tensor_bytes(breakdown)
    slack = int(breakdown.get(SLACK_KEY, 0))
    context = int(breakdown.get(CONTEXT_KEY, 0))
    overheads = cuda_overheads().calibrated
    beyond = reading.beyond_reserved_bytes
    return (
        MemoryComparison(TENSORS, tensors, reading.allocated_peak_bytes, "max_memory_allocated", False),
        MemoryComparison(RESERVED, tensors + slack, reading.reserved_peak_bytes, "max_memory_reserved", overheads),
        MemoryComparison(CONTEXT, context, beyond, "total - free - reserved", overheads),
        MemoryComparison(DEVICE, tensors + slack + context, reading.reserved_peak_bytes + beyond,
                         "reserved peak + beyond", overheads),
    )


def compare_tensors(breakdown: dict[str, int], measured_bytes: int, measured_by: str) -> tuple[MemoryComparison, ...]:
    """A run off CUDA (the CPU's live-bytes tracker): only tensors are measured, and the plan
    holds no context or slack there."""
    return (MemoryComparison(TENSORS, tensor_bytes(breakdown), measured_bytes, measured_by, False),)


def tensor_comparison(rows: list[dict]) -> dict | None:
    """The tensors pair of a metrics.json ``memory_comparison`` list (the one a warning is about)."""
    return next((r for r in rows or () if r.get("what") == TENSORS), None)


__all__ = [
    "CONTEXT", "DEVICE", "RESERVED", "TENSORS", "CudaMemoryReading", "MemoryComparison", "compare_cuda",
    "compare_tensors", "tensor_bytes", "tensor_comparison",
]
