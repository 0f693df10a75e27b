"""The CUDA caching allocator's settings for a training run.

``lowvram train`` sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set
the variable (to anything): the allocator then grows segments in place instead of caching
fixed-size blocks, so the reserved memory stays close to the allocated (PyTorch "CUDA semantics",
Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF; ALST's recipe, arXiv:2506.13996 sec. 4:
"fragmentation nearly disappears"). PyTorch reads the variable when CUDA first allocates, so it
is set in the launcher's environment before anything touches CUDA; ``accelerate launch`` and the
hardware probe inherit it (lowvram.train.run.launch.run_launch passes os.environ on). The plan reads
the same rule (lowvram.plan.setup.expandable_segments_set, from lowvram.planning.budget): the
allocator slack's churn share is smaller with expandable segments (docs/planner.md, The allocator
slack).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def set_expandable_segments(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in ``environ`` (os.environ) unless
    it is set already; True when this call set it."""
    env = os.environ if environ is None else environ
    if ALLOC_CONF in env:
        return False
    env[ALLOC_CONF] = EXPANDABLE_SEGMENTS
    return True


__all__ = ["ALLOC_CONF", "EXPANDABLE_SEGMENTS", "set_expandable_segments"]
