"""Models that need their own Python code (issue 42, item 7), through the real CLI on a tiny model
folder whose config.json has an ``auto_map`` to .py files beside it that write a marker file when
imported (lowvram.testing.save_custom_code_model). No custom code ever runs without the opt-in:
`train` without ``model.trust_remote_code`` names the key (its hint pointed at attention and
quantization); `generate` and `merge` honour the run's choice (a traceback before, or
transformers' prompt on the terminal) and refuse without it with error/hint naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowvram.testing import save_custom_code_model
from tests.train.test_after_training import cli
from tests.train.test_e2e import train, write_recipe

NO_TENSORBOARD = ("--set", "training.report_to=none")
RUN_HINT = ("hint: if you trust that code, set model.trust_remote_code: true in the run's recipe.yaml (lowvram never "
            "runs a model's own code without it); the code runs with your user's rights")


def error_lines(result) -> list[str]:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    return [line for line in result.output.splitlines() if line.startswith(("error:", "hint:"))]


@pytest.fixture(scope="module")
def custom(tmp_path_factory, tiny_model_dir) -> tuple[Path, Path]:
    """(the model folder, its marker file)."""
    tmp = tmp_path_factory.mktemp("custom")
    marker = tmp / "MARKER"
    return save_custom_code_model(tmp / "model", tiny_model_dir, marker), marker


@pytest.fixture(scope="module")
def trusted_run(tmp_path_factory, custom) -> Path:
    """A finished LoRA run on the custom model, with model.trust_remote_code: true."""
    model, marker = custom
    tmp = tmp_path_factory.mktemp("trusted")
    recipe = write_recipe(tmp, model, steps=2)
    recipe.write_text(recipe.read_text().replace(f"name_or_path: {model}}}", f"name_or_path: {model}, trust_remote_code: true}}"))
    result = train(str(recipe), *NO_TENSORBOARD)
    assert result.exit_code == 0, result.output
    assert marker.is_file()  # opted in: the model's code ran
    marker.unlink()
    return tmp / "out"


def test_train_without_the_opt_in_names_the_key_and_runs_no_code(tmp_path, custom):
    model, marker = custom
    recipe = write_recipe(tmp_path, model, steps=2)
    assert error_lines(train(str(recipe), *NO_TENSORBOARD)) == [
        f"error: {model} needs the Python code shipped with it (auto_map in its config.json), and "
        "model.trust_remote_code is off: lowvram never runs a model's own code without it",
        "hint: if you trust that code, set model.trust_remote_code: true in the recipe (the code runs with your "
        "user's rights), or use a model that transformers supports natively"]
    assert not marker.exists()


def test_generate_and_merge_honour_the_runs_choice(trusted_run, custom, tmp_path):
    _, marker = custom
    assert cli("generate", str(trusted_run), "--prompt", "hi", "--max-new-tokens", "2").exit_code == 0
    merged = tmp_path / "merged"
    assert cli("merge", str(trusted_run), "--out", str(merged)).exit_code == 0
    assert json.loads((merged / "lowvram_merge.json").read_text())["trust_remote_code"] is True
    assert cli("generate", str(merged), "--prompt", "hi", "--max-new-tokens", "2").exit_code == 0
    assert marker.is_file()
    marker.unlink()


def test_generate_and_merge_refuse_without_the_runs_opt_in_and_run_no_code(trusted_run, custom, tmp_path):
    """The same run, its recipe.yaml saying model.trust_remote_code: false (a run copied from
    someone else, or a base swapped for one with code): refused, the marker never written."""
    import shutil

    model, marker = custom
    run = tmp_path / "run"
    shutil.copytree(trusted_run, run)
    (run / "recipe.yaml").write_text((run / "recipe.yaml").read_text().replace("trust_remote_code: true",
                                                                              "trust_remote_code: false"))
    expected = [f"error: {model} needs the Python code shipped with it (auto_map in its config.json; found via "
                "adapter_config.json), and the run did not opt in to running it: model.trust_remote_code is off",
                RUN_HINT]
    assert error_lines(cli("generate", str(run), "--prompt", "hi", "--max-new-tokens", "2")) == expected
    assert error_lines(cli("merge", str(run), "--out", str(tmp_path / "merged"))) == expected
    assert not (tmp_path / "merged").exists()
    assert not marker.exists()
