"""Running a drawn case: its files written, `lowvram train` run in this process under the live-bytes
tracker, and the measured peak set against the plan's (:class:`Outcome`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lowvram.difftest.cases import ANY_LIMIT, OVER_LIMIT, Case, chunk_budget
from lowvram.difftest.files import recipe_text, write_data, write_model

# --------------------------------------------------------------------------------------------
# Running a case


@dataclass
class Outcome:
    case: Case
    measured_bytes: int | None = None
    predicted_bytes: int | None = None
    error: str | None = None  # the run failed or the planner refused (its message)
    details: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if not self.measured_bytes or not self.predicted_bytes:
            return None
        return self.measured_bytes / self.predicted_bytes - 1

    @property
    def ok(self) -> bool:
        r = self.ratio
        return r is not None and r <= OVER_LIMIT and abs(r) <= ANY_LIMIT

    def to_dict(self) -> dict:
        return {"case": asdict(self.case), "label": self.case.label(), "measured_bytes": self.measured_bytes,
                "predicted_bytes": self.predicted_bytes, "ratio": self.ratio, "error": self.error,
                **self.details}


def run_case(case: Case, workdir: Path) -> Outcome:
    """Write the case's files and run `lowvram train RECIPE --json` in this process."""
    from typer.testing import CliRunner

    from lowvram.cli import app
    from lowvram.runfiles import METRICS, PLAN

    workdir.mkdir(parents=True, exist_ok=True)
    model = write_model(case, workdir / "model")
    data = write_data(case, workdir / "data.jsonl")
    recipe = workdir / "recipe.yaml"
    recipe.write_text(recipe_text(case, model, data, workdir / "run"))
    args = ["train", str(recipe), "--json", "--overwrite"]
    if case.loss_chunk_tokens != 1024:  # a budget under which the plan sizes the chunk to it
        args += ["--vram", str(chunk_budget(recipe, case.loss_chunk_tokens))]
    result = CliRunner().invoke(app, args)
    metrics_file = workdir / "run" / METRICS
    if result.exit_code != 0 or not metrics_file.exists():
        text = (result.stderr or "") + (result.stdout or "")
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            text += f"{type(result.exception).__name__}: {result.exception}"
        return Outcome(case, error=text.strip()[-2000:] or f"exit code {result.exit_code}")
    m = json.loads(metrics_file.read_text())
    details = {k: m.get(k) for k in ("peak_memory_kind", "steps", "eval_loss")}
    plan_file = workdir / "run" / PLAN
    if plan_file.exists():  # the chunk the run's plan took (the chunked loss sized to the budget)
        details["loss_chunk_tokens"] = json.loads(plan_file.read_text()).get("loss_chunk_tokens")
    # data shorter than seq_len (short preference pairs): the plan at the longest row is the one
    # the run can reach (train.run._prediction_at_data_length)
    predicted = m.get("predicted_peak_bytes_at_data") or m.get("predicted_peak_bytes")
    details["data_longest_tokens"] = m.get("data_longest_tokens")
    return Outcome(case, measured_bytes=m.get("peak_memory_bytes"), predicted_bytes=predicted, details=details)
