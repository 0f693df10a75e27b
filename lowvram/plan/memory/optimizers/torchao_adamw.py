"""**torchao's low-bit AdamW** (optimizers adamw_torch_8bit and adamw_torch_4bit, the Trainer's own
names; torchao 0.18 ``torchao/optim/adam.py`` AdamW8bit / AdamW4bit, ``subclass_8bit.py`` /
``subclass_4bit.py``; Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", and Li
et al. 2023, "Memory Efficient Optimizers with 4-bit States"), as the Trainer wires them
(transformers ``trainer_optimizer._get_torchao_optimizer``: ``block_size`` 256 unless optim_args
say otherwise, for the 4-bit form too, whose own default is 128; the Trainer's two weight-decay
groups):

- **State** (``_AdamBase._new_buffer``): a tensor of at least 4096 elements whose size is a
  multiple of the block gets two quantized moments, each ``codes`` (uint8: n bytes at 8 bit, n / 2
  packed at 4 bit), ``scale`` (one fp32 per 256-element block) and ``qmap`` (fp32: 256 entries at 8
  bit, 16 at 4 bit); every other tensor two ``zeros_like`` moments in its own dtype. ``step`` is
  ``torch.tensor(0.0)``: a CPU scalar per parameter (4 bytes, counted on a CPU plan only), and so
  is each group's ``lr`` tensor (:func:`torchao_state_bytes`). Every tensor is quantized, the
  embedding too (bitsandbytes' 8-bit AdamW keeps the embedding in 32 bit under the Trainer).
- **Step temporaries**: ``step()`` calls ``torch.compile(single_param_adam, fullgraph=True,
  dynamic=False)`` per parameter; what the compiled kernel keeps for one quantized parameter was
  measured (constants.TORCHAO_8BIT_STEP_TEMP_BYTES / _4BIT_: the fp32 moments before
  re-quantization and the block absmaxes), a full-precision one steps in place
  (:func:`torchao_step_temp_bytes`). The first step compiles once per shape and dtype (seconds to
  tens of seconds each); compiling needs a C++ compiler on the CPU and Triton on CUDA.

What it gives up: moments rounded to 8 or 4 bits per block (torchao's own Llama-2-7B fine-tune:
truthfulqa_mc2 42.61 with fused AdamW, 41.50 at 8 bit, 42.27 at 4 bit; torchao/optim/README.md), no
DeepSpeed or FSDP here (the plans are not measured under them). Measured: the state of the real
optimizers after one step (tests/plan/test_torchao.py, byte for byte) and whole runs through
``lowvram train`` with the step compiled (bench/plan_fuzz.py --torchao).
"""

from __future__ import annotations

from math import prod

from lowvram.plan import constants as fitted
from lowvram.plan.setup import RunSetup

TORCHAO_BLOCK_SIZE = 256  # transformers _get_torchao_optimizer: optim_args block_size, default 256
TORCHAO_MIN_QUANTIZED = 4096  # torchao _AdamBase._new_buffer: "only quantize tensors >= 4096 values"
TORCHAO_QMAP_ENTRIES = {"adamw_torch_8bit": 256, "adamw_torch_4bit": 16}  # fp32 lookup table per moment
TORCHAO_CODE_BITS = {"adamw_torch_8bit": 8, "adamw_torch_4bit": 4}


def torchao_problems(setup: RunSetup) -> list[str]:
    """Why the setup's torchao AdamW cannot run as planned (see the module)."""
    if setup.offload == "none":
        return []
    return [f"optimizer {setup.optimizer} under offload {setup.offload} is not planned: DeepSpeed flattens "
            "the parameters it would quantize per tensor, and FSDP2's sharded state was not measured "
            "(use offload none, one GPU or DDP)"]


def _torchao_quantized(numel: int) -> bool:
    return numel >= TORCHAO_MIN_QUANTIZED and numel % TORCHAO_BLOCK_SIZE == 0


def torchao_state_bytes(setup: RunSetup, w: int, shapes: list[tuple[int, ...]]) -> int:
    """torchao AdamW8bit / AdamW4bit's state (``_new_buffer``, ``OptimState8bit.zeros`` /
    ``OptimState4bit.zeros``): per quantized tensor two moments of codes + an fp32 scale per block
    + an fp32 qmap; per other tensor two moments in its dtype ``w``. On a CPU plan also each
    parameter's ``step`` scalar and the two groups' ``lr`` tensors (on CUDA they stay in host RAM)."""
    o = setup.optimizer
    total = 0
    for s in shapes:
        n = prod(s)
        if _torchao_quantized(n):
            codes = n * TORCHAO_CODE_BITS[o] // 8
            total += 2 * (codes + 4 * (n // TORCHAO_BLOCK_SIZE) + 4 * TORCHAO_QMAP_ENTRIES[o])
        else:
            total += 2 * w * n
    if setup.device == "cpu":
        total += 4 * len(shapes) + 4 * 2
    return total


def torchao_step_temp_bytes(setup: RunSetup, shapes: list[tuple[int, ...]]) -> int:
    """The compiled step's buffers for its largest quantized tensor (constants.TORCHAO_*BIT_STEP_TEMP_BYTES;
    a tensor kept in full precision steps in place)."""
    quantized = [prod(s) for s in shapes if _torchao_quantized(prod(s))]
    if not quantized:
        return 0
    c = fitted.TORCHAO_8BIT_STEP_TEMP_BYTES if setup.optimizer == "adamw_torch_8bit" else fitted.TORCHAO_4BIT_STEP_TEMP_BYTES
    return c.of(max(quantized))
