"""Light result types of a training run (no torch here; lowvram.report.training renders them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunResult:
    output_dir: str
    metrics: dict = field(default_factory=dict)  # the content of metrics.json
    resumed_from: str | None = None

