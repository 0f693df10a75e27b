"""Light result types of a training run (no torch here; report.py renders them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RunResult:
    output_dir: str
    metrics: dict = field(default_factory=dict)  # the content of metrics.json
    resumed_from: str | None = None


class Replanner(Protocol):
    """What a run asks the planner once under way (lowvram.planning.Replanner, built above train/
    and handed down: train/ reads the Plan and never goes back up to the recipe or the model)."""

    def peak_at(self, plan, seq_len: int) -> int | None:
        """The plan's predicted peak with batches of ``seq_len`` tokens (None: not predicted)."""

    def breakdown_at(self, plan, seq_len: int) -> dict[str, int] | None:
        """The parts of that peak, by the plan's breakdown keys (None: not predicted)."""

    def next_cheaper(self, plan, measured_peak_bytes: int | None):
        """The Plan to retry with after ``plan`` ran out of memory, or None."""
