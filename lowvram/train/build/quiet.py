"""Library noise off the user's terminal: known-harmless log lines (each named with why it is
harmless) filtered on the loggers that make them, and per-load progress bars off; real warnings
still show. Called before any model is loaded (training, merge, generate)."""

from __future__ import annotations

import logging
import os
import warnings

_NOISE = (
    # bitsandbytes on CPU tries to fetch an optional kernel from the hub, then falls back (harmless).
    "Failed to load CPU gemm_4bit_forward from kernels-community",
    # The Trainer sorting checkpoints written within the same second (it then sorts by number).
    "mtime may not be reliable on this filesystem",
    # torchao (imported by peft when installed) without its optional CUDA kernels, e.g. on a CPU.
    "/torchao/_C",
    # torchao 0.18 registering its enums with torch 2.13's pytree (a deprecation, not the user's).
    "is an Enum subclass and is now natively supported by torch.compile",
    # kernels (bitsandbytes' hub kernels) offline: the kernel is cached or not used; nothing to do.
    "Skipping publisher trust check for 'kernels-community/",
    # DeepSpeed's import on a machine without a GPU (lowvram chose the device already).
    "Setting accelerator to CPU",
    # int8 on CUDA: bitsandbytes 0.50's MatMul8bitLt.forward logs this at every call with bf16/fp32
    # inputs (autograd/_functions.py L128-129), one line per int8 Linear per forward and recompute;
    # the cast is the path int8 always takes on CUDA (docs/planner.md, int8 on CUDA)
    "MatMul8bitLt: inputs will be cast from",
)
# a filter acts only on the logger a record is made on, not on its parents': each is named
_NOISY_LOGGERS = ("bitsandbytes", "bitsandbytes.backends.cpu.ops", "bitsandbytes.autograd._functions",
                  "transformers.trainer_utils", "torchao", "torch.utils._pytree", "kernels._internals.hf_hub",
                  "DeepSpeed")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in _NOISE)


def quiet_libraries() -> None:
    """Drop known-harmless log lines and per-load progress bars; real warnings still show."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in _NOISY_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in log.filters):
            log.addFilter(_DropNoise())
    # peft 0.21 reads a model attribute transformers 5 renamed; nothing for the user to change.
    warnings.filterwarnings("ignore", message=r".*`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars on every from_pretrained
