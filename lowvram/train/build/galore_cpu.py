"""optimizer galore_adamw_8bit (and its layerwise form) on a machine without CUDA.

galore-torch 1.0's ``AdamW8bit.step`` (``galore_torch/adamw8bit.py``, the class transformers'
``_get_galore_optimizer`` hands the Trainer for both names) calls ``torch.cuda.synchronize()``
after each parameter's bitsandbytes update, unconditionally. It only waits for that update's
CUDA kernels before the projection back reads ``p.data``. bitsandbytes' own
``Optimizer8bit.step`` does the same with ``bitsandbytes.utils.sync_gpu(p)``, which synchronizes
a CUDA tensor's device and does nothing for a CPU tensor. bitsandbytes 0.50 steps CPU tensors
with its CPU kernels (``backends/cpu/ops.py``: ``optimizer_update_8bit_blockwise`` and
``optimizer_update_32bit`` dequantize, update and requantize in Python, synchronously). So with
a CPU-only torch the one thing in the way is the call itself, which raises ("Torch not compiled
with CUDA enabled") before the first projection back.

:func:`allow_cpu_step` wraps the class's ``step`` once: while it runs, and only on a machine
where CUDA is not available, ``torch.cuda.synchronize`` does nothing (there is nothing to wait
for). With CUDA available nothing is changed. Checked against the real optimizer and Trainer in
tests/train/test_galore_cpu.py (the update equals bitsandbytes' own on the CPU).
"""

from __future__ import annotations

import contextlib
import functools


@contextlib.contextmanager
def _no_cuda_synchronize():
    import torch

    saved = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None
    try:
        yield
    finally:
        torch.cuda.synchronize = saved


def allow_cpu_step() -> bool:
    """Let galore_torch's AdamW8bit step on a machine without CUDA (see the module); True when
    its step is (now) wrapped, False where CUDA is available and nothing needs changing."""
    import torch
    from galore_torch import GaLoreAdamW8bit

    if torch.cuda.is_available():
        return False
    if getattr(GaLoreAdamW8bit.step, "_lowvram_cpu_step", False):
        return True
    original = GaLoreAdamW8bit.step

    @functools.wraps(original)
    def step(self, closure=None):
        with _no_cuda_synchronize():
            return original(self, closure)

    step._lowvram_cpu_step = True
    GaLoreAdamW8bit.step = step
    return True


__all__ = ["allow_cpu_step"]
