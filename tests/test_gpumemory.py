"""lowvram.gpumemory: a CUDA run's counters against its plan, like with like."""

from __future__ import annotations

import dataclasses

import pytest

from lowvram.gpumemory import (
    CONTEXT,
    DEVICE,
    PAGED,
    RESERVED,
    TENSORS,
    CudaMemoryReading,
    compare_cuda,
)

MIB = 2**20
BREAKDOWN = {"weights": 1000 * MIB, "optimizer": 4000 * MIB, "activations": 500 * MIB,
             "cuda_context": 300 * MIB, "allocator": 100 * MIB}


def _rows(reading):
    return {r.what: (r.predicted_bytes, r.measured_bytes) for r in compare_cuda(BREAKDOWN, reading)}


def test_paged_optimizer_state_is_its_own_row_not_cuda_context():
    """issue 41 item 7: paged_adamw_* keeps its state in CUDA unified memory (bitsandbytes
    get_paged), which max_memory_allocated/reserved never see: the report filed the resident pages
    under "CUDA context" and called the tensors under-measured by the whole optimizer state."""
    reading = CudaMemoryReading(allocated_peak_bytes=1500 * MIB, reserved_peak_bytes=1600 * MIB,
                                reserved_bytes=1600 * MIB, free_bytes=10_000 * MIB,
                                total_bytes=(10_000 + 1600 + 320 + 4000) * MIB, paged_bytes=4000 * MIB)
    rows = _rows(reading)
    assert rows[TENSORS] == (1500 * MIB, 1500 * MIB)  # the optimizer part out of the allocator's row
    assert rows[RESERVED] == (1600 * MIB, 1600 * MIB)
    assert rows[CONTEXT] == (300 * MIB, 320 * MIB)  # the context alone, the paged pages taken out
    assert rows[PAGED] == (4000 * MIB, 4000 * MIB)
    assert rows[DEVICE] == (5900 * MIB, (1600 + 320 + 4000) * MIB)  # the whole card unchanged
    plain = _rows(dataclasses.replace(reading, paged_bytes=0))  # no paged optimizer: as before
    assert PAGED not in plain and plain[TENSORS] == (5500 * MIB, 1500 * MIB)
    assert plain[CONTEXT] == (300 * MIB, 4320 * MIB)


def test_paged_state_bytes_reads_bitsandbytes_own_registry():
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    import torch

    from lowvram.hardware import paged_state_bytes

    pages = bnb_functional.GlobalPageManager.get_instance().paged_tensors
    kept = list(pages)
    try:
        pages.clear()
        assert paged_state_bytes() == 0
        # what Optimizer.get_state_buffer appends for a paged optimizer (a CPU-typed tensor over
        # managed memory on CUDA; bitsandbytes' CPU library has no cget_managed_ptr)
        pages += [torch.empty(1024, dtype=torch.float32), torch.empty(256, dtype=torch.uint8)]
        assert paged_state_bytes() == 4096 + 256
    finally:
        pages[:] = kept
