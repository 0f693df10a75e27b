"""metrics.json has a schema (issue 25, item 6): lowvram.metrics.RunMetrics, versioned, written by
train/ and read by `lowvram runs` / `show`; files from before the schema still read; a file of a
newer version or with a value of the wrong type is a damaged file (error/hint, exit 1). And
`lowvram train` is one library call: lowvram.session.train_recipe(TrainOptions) -> TrainOutcome.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowvram.metrics import SCHEMA_VERSION, RunMetrics, metrics_problem
from tests.train.test_after_training import cli
from tests.train.test_e2e import write_recipe

# A metrics.json as lowvram wrote it before the schema (no schema_version): keys of a real CPU run.
OLD = {"first_loss": 5.61, "train_loss": 5.52, "eval_loss": None, "steps": 4, "runtime_s": 1.5,
       "train_runtime_s": 1.4, "tokens_seen": 512, "tokens_per_s": 341.3, "peak_memory_bytes": 3_145_728,
       "peak_memory_kind": "live tensor bytes (exact, CPU)", "peak_rss_bytes": 900_000_000,
       "predicted_peak_bytes": 3_000_000, "predicted_device": "cpu", "memory_history": [[1, 3_000_000]],
       "processes": 1, "distributed_type": "NO", "sharded_parameters": 0, "peak_memory_bytes_per_rank": None,
       "train_rows": 24, "eval_rows": 0, "truncated": 0, "skipped_bad_rows": 0, "packed": False, "load_s": 0.2,
       "gguf_cache_hit": None, "trainable_params": 1024, "total_params": 100_000, "resumed_from": None,
       "loss_history": [[1, 5.61], [4, 5.52]], "eval_history": [], "oom_retries": []}


def test_an_old_file_reads_as_version_0_and_writes_back_the_same_keys():
    m = RunMetrics.from_dict(OLD)
    assert m.schema_version == 0 and m.steps == 4 and m.peak_rss_bytes == 900_000_000 and m.other == {}
    assert m.to_dict() == {**OLD, "schema_version": 0}
    assert "peak_reserved_bytes" not in m.to_dict()  # measured on CUDA only: absent, as before


def test_a_new_file_carries_its_version_and_keeps_keys_it_does_not_know():
    m = RunMetrics(steps=2, peak_memory_bytes=10)
    d = json.loads(m.to_json())
    assert d["schema_version"] == SCHEMA_VERSION == 1
    assert "final_plan" not in d and "oom_retries" not in d  # not trained through the retry loop
    later = {**d, "tokens_per_joule": 3.5}
    assert RunMetrics.from_dict(later).other == {"tokens_per_joule": 3.5}
    assert RunMetrics.from_dict(later).to_dict() == later


@pytest.mark.parametrize("data, why", [
    ({"schema_version": 2}, "schema_version 2 is newer than this lowvram reads (1): upgrade lowvram to read it"),
    ({"steps": "four"}, "steps is 'four', which is not a number or null"),
    ({"packed": 1}, "packed is 1, which is not true or false or null"),
    ({"loss_history": None}, "loss_history is None, which is not a list"),
    ([1, 2], "not a JSON object (a list)"),
])
def test_what_does_not_match_the_schema(data, why):
    assert metrics_problem(data) == why
    with pytest.raises(ValueError, match="^" + why.replace("(", r"\(").replace(")", r"\)") + "$"):
        RunMetrics.from_dict(data)


def _run_folder(tmp_path: Path, metrics: dict) -> Path:
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text("# recipe: /work/r.yaml\nmodel: {name_or_path: m}\n")
    (run / "plan.json").write_text(json.dumps({"lora": True, "reasons": {}}))
    (run / "metrics.json").write_text(json.dumps(metrics))
    return run


def test_runs_and_show_read_an_old_file(tmp_path):
    run = _run_folder(tmp_path, OLD)
    shown = cli("show", str(run), "--json")
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.output)
    assert data["status"] == "finished" and data["steps"] == 4 and data["measured_peak_bytes"] == 3_145_728
    assert data["metrics"] == {**OLD, "schema_version": 0}
    listed = cli("runs", str(tmp_path / "runs"), "--json")
    assert listed.exit_code == 0 and json.loads(listed.output)[0]["final_loss"] == 5.52


def test_a_newer_file_is_an_error_with_a_hint(tmp_path):
    run = _run_folder(tmp_path, {**OLD, "schema_version": 7})
    result = cli("show", str(run))
    assert result.exit_code == 1
    assert (f"error: {run}/metrics.json is damaged: schema_version 7 is newer than this lowvram reads (1): "
            "upgrade lowvram to read it") in result.output
    assert "hint: restore the file from a copy" in result.output
    assert "damaged" in cli("runs", str(tmp_path / "runs")).output


def test_train_is_one_library_call(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """train_recipe plans once and returns typed data, printing nothing itself: a dry run gives
    the plan; a run gives RunResult whose metrics are what metrics.json holds, every key in the
    schema (``other`` empty) and the version written."""
    from lowvram.session import train_recipe
    from lowvram.train.types import TrainOptions

    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2)
    dry = train_recipe(TrainOptions(recipe_path=recipe, overrides=("training.report_to=none",), dry_run=True))
    assert dry.dry_run and dry.result is None and dry.planned.launch is None
    assert dry.planned.plan.micro_batch_size >= 1
    assert capsys.readouterr().out == ""
    started = []
    done = train_recipe(TrainOptions(recipe_path=recipe, overrides=("training.report_to=none",)),
                        started=started.append)
    assert len(started) == 1  # planned once; the same techniques as the dry run (the host's free RAM moves)
    assert (started[0].plan.techniques(), started[0].plan.micro_batch_size) == (
        dry.planned.plan.techniques(), dry.planned.plan.micro_batch_size)
    m = done.result.metrics
    assert m.steps == 2 and m.schema_version == SCHEMA_VERSION and m.other == {}
    written = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert written == m.to_dict() and written["oom_retries"] == []
