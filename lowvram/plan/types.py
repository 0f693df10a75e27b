"""The Plan: every technique resolved to a concrete value, each with its reason.

Training consumes a Plan and never decides techniques itself (.importlinter: train/ never
imports planning/). ``lowvram plan`` and
``lowvram train`` build the same Plan from the same recipe, so the two never disagree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Literal

from lowvram.vocab import (
    ATTENTIONS,
    LOSSES,
    OFFLOADS,
    OPTIMIZERS,
    PRECISIONS,
    QUANTIZATIONS,
    WEIGHT_DTYPE,
)

Precision = Literal[PRECISIONS]
Quant = Literal[QUANTIZATIONS]
Optim = Literal[OPTIMIZERS]
OffloadKind = Literal[OFFLOADS]
Attention = Literal[ATTENTIONS]
Loss = Literal[LOSSES]


def precisions_for_dtype(dtype: str) -> tuple[str, ...]:
    """The precisions that store weights in ``dtype`` (model.dtype; auto: all)."""
    return tuple(p for p, d in WEIGHT_DTYPE.items() if dtype in ("auto", d))


def dtype_precision(dtype: str, kind: str, bf16: bool) -> str:
    """The precision a recipe's model.dtype implies when mixed_precision is auto: 16-bit weights
    train as bf16/fp16, fp32 weights under the card's autocast (fp32 on a CPU)."""
    if dtype == "float32":
        return "fp32" if kind == "cpu" else ("bf16-mixed" if bf16 else "fp16-mixed")
    return "bf16" if dtype == "bfloat16" else "fp16"



@dataclass(frozen=True)
class Plan:
    """Resolved settings for one run. Memory fields are bytes; None where not predicted."""

    device: Literal["cuda", "mps", "cpu"]
    mixed_precision: Precision
    gradient_checkpointing: bool
    micro_batch_size: int
    grad_accum: int
    lora: bool
    quantization: Quant
    optimizer: Optim
    offload: OffloadKind
    attention: Attention
    loss: Loss
    gpus: int = 1
    # PyTorch's expandable segments, as planned (the allocator slack's churn share; RunSetup)
    expandable_segments: bool = True
    # Checkpointed layer inputs kept in pinned host RAM (transformers' offload=True); GPU only.
    activation_offload: bool = False
    # Each layer's MLP over the sequence in shards (lowvram.plan.memory.tiled; 0 shards: ceil(seq_len / hidden)).
    tiled_mlp: bool = False
    tiled_mlp_shards: int = 0
    # loss chunked: tokens per logits chunk (1024 unless the budget needed fewer)
    loss_chunk_tokens: int = 1024
    # The rest of the run setup the memory model read; training takes these from the Plan.
    seq_len: int = 1024
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_use_dora: bool = False
    lora_use_rslora: bool = False
    lora_init: str = "default"  # lora.init (lowvram.plan.memory.lora_init)
    lora_targets: tuple[str, ...] = ("all-linear",)
    # optimizer galore_adamw: its rank, renewal gap, scale and the Linears it projects (by name)
    galore_rank: int = 128
    galore_update_proj_gap: int = 200
    galore_scale: float = 0.25
    optimizer_target_modules: tuple[str, ...] = ()
    # training.objective grpo/rloo (lowvram.plan.memory.grpo): the engine ("" otherwise), micro-steps per
    # generation round and the global generation batch (TRL's names), the engine's share: the paged
    # cache's blocks and bytes, or vLLM's fraction of the card
    generation: str = ""
    steps_per_generation: int = 0
    generation_batch_size: int = 0
    paged_num_blocks: int | None = None
    paged_max_batch_tokens: int | None = None
    generation_cache_bytes: int | None = None
    vllm_gpu_memory_utilization: float | None = None
    # data.max_pixels auto (plan/choose/pixels.py): the image processor's max_pixels the chooser
    # chose, which training gives the processor; None: the recipe's own (or the processor's)
    max_pixels: int | None = None
    reasons: dict[str, str] = field(default_factory=dict)
    predicted_peak_bytes: int | None = None
    budget_bytes: int | None = None
    breakdown: dict[str, int] = field(default_factory=dict)
    host_ram_bytes: int | None = None  # predicted host RAM per training process (offload, libraries)

    @property
    def fits(self) -> bool | None:
        """Predicted peak within the budget; None where either is not known."""
        if self.predicted_peak_bytes is None or self.budget_bytes is None:
            return None
        return self.predicted_peak_bytes <= self.budget_bytes

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.gpus

    def techniques(self) -> dict[str, object]:
        """The eight canonical techniques plus attention and loss, as shown to users."""
        return {
            "mixed_precision": self.mixed_precision,
            "gradient_checkpointing": self.gradient_checkpointing,
            "gradient_accumulation": self.grad_accum,
            "lora": self.lora,
            "quantization": self.quantization,
            "optimizer": self.optimizer,
            "offload": self.offload,
            "activation_offload": self.activation_offload,
            "tiled_mlp": self.tiled_mlp,
            "attention": self.attention,
            "loss": self.loss,
        }

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """The inverse of to_dict: keys that are not Plan fields (older runs' plan.json) are dropped,
        and JSON's lists come back as the tuples the Plan keeps."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names})
