"""What each part of a plan's peak has been checked against (issue 13: the plan table marks the
terms that are not yet calibrated on a GPU).

No part has been measured on a GPU by this project yet (``bench/gpu_check.py`` is prepared, not
run), so every part says what it *was* checked against instead:

- ``cpu``: exact live tensor bytes of real steps on the CPU (``bench/plan_accuracy.py``,
  ``bench/plan_fuzz.py``, FSDP2 over gloo in ``bench/multi_process_accuracy.py``); a tensor has
  the same bytes on a GPU, GPU-only kernels' workspaces aside.
- ``published``: constants fitted on GPU measurements others published (``cuda_overheads``,
  ``bench/gpu_truth/``; the README's fitted-constants table).
- ``sources``: read from the engine's sources, never measured here (DeepSpeed ZeRO residency,
  activation offload).
- ``gpu``: calibrated on a GPU by this project (``CudaOverheads.calibrated``).
"""

from __future__ import annotations

from lowvram.plan.memory.sharding import ZERO_OFFLOADS
from lowvram.plan.setup import BREAKDOWN_KEYS, RunSetup, cuda_overheads

CHECKED = {
    "gpu": "yes",
    "cpu": "no (CPU: exact)",
    "published": "no (published rows)",
    "sources": "no (never measured)",
}

_MODEL_STATES = ("weights", "gradients", "optimizer")


def term_checks(setup: RunSetup) -> dict[str, str]:
    """Breakdown key -> a CHECKED key, for the parts ``setup`` has on its device."""
    out = {k: "cpu" for k in BREAKDOWN_KEYS if k not in ("cuda_context", "allocator")}
    if setup.offload in ZERO_OFFLOADS:  # DeepSpeed needs GPUs: its residency terms are unmeasured
        out.update({k: "sources" for k in _MODEL_STATES})
    if getattr(setup, "activation_offload", False):  # the activation_offload knob (issue 13, item 3)
        out["activations"] = "sources"
    if setup.device == "cuda":
        fitted = "gpu" if cuda_overheads().calibrated else "published"
        out.update(cuda_context=fitted, allocator=fitted)
    return out


__all__ = ["CHECKED", "term_checks"]
