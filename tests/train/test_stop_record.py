"""A run lowvram stopped on purpose mid-run says so in its folder (lowvram-run.json's "stop"), so
`show` and `runs` tell it from an interrupted run: a reward that raised is "stopped" with the
error, its hint and the resume command once mended; resuming clears it. (The diverged case:
tests/train/test_guard.py.)"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from lowvram.cli import app
from tests.train.test_grpo import RAISES_AT_STEP_3, setup_run


def test_a_reward_that_raised_is_stopped_not_interrupted_and_resume_clears_it(tmp_path, tiny_model_dir):
    recipe = setup_run(tmp_path, tiny_model_dir, reward_code=RAISES_AT_STEP_3, steps=4, save_steps=2,
                       rewards="[rewards.py:short, rewards.py:fragile]")
    result = CliRunner().invoke(app, ["train", str(recipe)])
    assert result.exit_code == 1 and "reward rewards.py:fragile raised ZeroDivisionError at step 3" in result.output
    out = tmp_path / "out"
    stop = json.loads((out / "lowvram-run.json").read_text())["stop"]
    assert stop["status"] == "stopped" and stop["step"] == 3 and "--resume" in stop["hint"]
    shown = CliRunner().invoke(app, ["show", str(out)])
    assert shown.exit_code == 0 and ": stopped" in shown.output, shown.output
    assert "stopped by lowvram at step 3: reward rewards.py:fragile raised ZeroDivisionError" in shown.output
    assert "once mended, resume with: lowvram train" in shown.output
    (tmp_path / "rewards.py").write_text(RAISES_AT_STEP_3.replace("== 2", "== -1"))  # mended
    resumed = CliRunner().invoke(app, ["train", str(recipe), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert "stop" not in json.loads((out / "lowvram-run.json").read_text())
    assert ": finished" in CliRunner().invoke(app, ["show", str(out)]).output


def test_a_refusal_before_training_records_no_stop(tmp_path, tiny_model_dir):
    """--resume of a run with nothing to resume is refused before any step: not a stop."""
    recipe = setup_run(tmp_path, tiny_model_dir, steps=2, save_steps=1)
    assert CliRunner().invoke(app, ["train", str(recipe)]).exit_code == 0
    (tmp_path / "out" / "metrics.json").unlink()  # as if stopped before its final save
    (tmp_path / "p.jsonl").write_text((tmp_path / "p.jsonl").read_text() + '{"prompt": "x", "answer": "1"}\n')
    refused = CliRunner().invoke(app, ["train", str(recipe), "--resume"])
    assert refused.exit_code == 1 and "changed since the run started" in refused.output
    assert "stop" not in json.loads((tmp_path / "out" / "lowvram-run.json").read_text())
