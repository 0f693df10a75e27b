"""The Plan: every technique resolved to a concrete value, each with its reason.

Training consumes a Plan and never decides techniques itself (STYLE.md). ``lowvram plan`` and
``lowvram train`` build the same Plan from the same recipe, so the two never disagree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from lowvram.vocab import ATTENTIONS, LOSSES, OFFLOADS, OPTIMIZERS, PRECISIONS, QUANTIZATIONS

Precision = Literal[PRECISIONS]
Quant = Literal[QUANTIZATIONS]
Optim = Literal[OPTIMIZERS]
OffloadKind = Literal[OFFLOADS]
Attention = Literal[ATTENTIONS]
Loss = Literal[LOSSES]


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
        """The seven canonical techniques plus attention and loss, as shown to users."""
        return {
            "mixed_precision": self.mixed_precision,
            "gradient_checkpointing": self.gradient_checkpointing,
            "gradient_accumulation": self.grad_accum,
            "lora": self.lora,
            "quantization": self.quantization,
            "optimizer": self.optimizer,
            "offload": self.offload,
            "attention": self.attention,
            "loss": self.loss,
        }

    def to_dict(self) -> dict:
        return asdict(self)
