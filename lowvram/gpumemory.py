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
optimizer (a paged optimizer)  the bytes of bitsandbytes' paged state (``paged_state_bytes``):
                               CUDA unified memory (cudaMallocManaged) under CPU-typed tensors,
                               which neither allocator counter sees; its resident pages are taken
                               out of the context row, so that row is the context alone
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
PAGED = "paged optimizer state"
OPTIMIZER_KEY = "optimizer"


@dataclass(frozen=True)
class CudaMemoryReading:
    """One process's counters on one CUDA card (bytes), read once."""

    allocated_peak_bytes: int  # torch.cuda.max_memory_allocated
    reserved_peak_bytes: int  # torch.cuda.max_memory_reserved
    reserved_bytes: int  # torch.cuda.memory_reserved, at the moment mem_get_info was read
    free_bytes: int  # torch.cuda.mem_get_info()[0]
    total_bytes: int  # torch.cuda.mem_get_info()[1]
    # bitsandbytes' paged optimizer state (hardware.paged_state_bytes): unified memory outside the
    # caching allocator, resident on the card while the optimizer steps
    paged_bytes: int = 0

    @property
    def beyond_reserved_bytes(self) -> int:
        """Device memory in use that the caching allocator does not hold: the CUDA context,
        kernels and library handles, other processes on the card, and resident paged state."""
        return max(0, self.total_bytes - self.free_bytes - self.reserved_bytes)

    @property
    def context_bytes(self) -> int:
        """What is beyond the reservation without the paged state (taken as resident: the upper
        bound of its pages on the card; evicted pages make this row read low, never high)."""
        return max(0, self.beyond_reserved_bytes - self.paged_bytes)


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
    # a paged optimizer's state is planned as GPU tensors (its pages are on the card while it steps)
    # but lives outside the allocator: compared on its own row, out of the tensors and context rows
    paged = int(breakdown.get(OPTIMIZER_KEY, 0)) if reading.paged_bytes else 0
    rows = (
        MemoryComparison(TENSORS, tensors - paged, reading.allocated_peak_bytes, "max_memory_allocated", False),
        MemoryComparison(RESERVED, tensors - paged + slack, reading.reserved_peak_bytes, "max_memory_reserved",
                         overheads),
        MemoryComparison(CONTEXT, context, reading.context_bytes,
                         "total - free - reserved" + (" - paged" if paged else ""), overheads),
        MemoryComparison(DEVICE, tensors + slack + context, reading.reserved_peak_bytes + beyond,
                         "reserved peak + beyond", overheads),
    )
    if paged:
        rows += (MemoryComparison(PAGED, paged, reading.paged_bytes, "bitsandbytes paged tensors (unified memory)",
                                  False),)
    return rows


def compare_tensors(breakdown: dict[str, int], measured_bytes: int, measured_by: str) -> tuple[MemoryComparison, ...]:
    """A run off CUDA (the CPU's live-bytes tracker): only tensors are measured, and the plan
    holds no context or slack there."""
    return (MemoryComparison(TENSORS, tensor_bytes(breakdown), measured_bytes, measured_by, False),)


def tensor_comparison(rows: list[dict]) -> dict | None:
    """The tensors pair of a metrics.json ``memory_comparison`` list (the one a warning is about)."""
    return next((r for r in rows or () if r.get("what") == TENSORS), None)


__all__ = [
    "CONTEXT", "DEVICE", "PAGED", "RESERVED", "TENSORS", "CudaMemoryReading", "MemoryComparison", "compare_cuda",
    "compare_tensors", "tensor_bytes", "tensor_comparison",
]
