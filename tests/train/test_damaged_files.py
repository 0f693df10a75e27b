"""Damaged files in a run or model folder (issue 24, item 12), through the real CLI: a truncated
adapter, checkpoint or model safetensors file, a cut optimizer.pt, a GGUF cut short, garbage in
config.json, tokenizer.json, adapter_config.json, metrics.json or recipe.yaml. `generate`,
`merge`, `train` (and `--resume`), `validate`, `runs` and `show` each end with one `error:` naming
the file and a `hint:`, exit 1, never a library's traceback (safetensors' SafetensorError,
json's JSONDecodeError, torch.load's unpickling errors). The files are real ones written by a
real run and then cut or overwritten.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from lowvram.runfiles import DAMAGED_HINT, MARKER, file_problem
from tests.train.test_after_training import cli
from tests.train.test_e2e import write_recipe

NO_TENSORBOARD = ("--set", "training.report_to=none")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir) -> Path:
    """A finished 4-step LoRA run with checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("damaged")
    recipe = write_recipe(tmp, tiny_model_dir, steps=4, save_steps=2)
    result = cli("train", str(recipe), *NO_TENSORBOARD)
    assert result.exit_code == 0, result.output
    return tmp / "out"


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A copy of the finished run, to damage, where write_recipe(tmp_path) puts its output_dir."""
    copy = tmp_path / "out"
    shutil.copytree(finished, copy)
    return copy


def user_error(result) -> list[str]:
    """The error: and hint: lines of a user error (exit 1, nothing escaped the CLI)."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    return [line for line in result.output.splitlines() if line.startswith(("error:", "hint:", "  "))
            and "│" not in line]


def _run_hint(run: Path) -> str:
    return (f"hint: the run's checkpoints hold earlier copies: pass {run / 'checkpoint-4'} instead, or remove the "
            "damaged file and finish the run again with `lowvram train RECIPE --resume`")


def test_generate_on_a_truncated_adapter_names_the_file(run):
    os.truncate(run / "adapter_model.safetensors", 1000)  # within its header
    result = cli("generate", str(run), "--prompt", "hi", "--max-new-tokens", "2")
    header = int.from_bytes((run / "adapter_model.safetensors").read_bytes()[:8], "little") + 8
    assert user_error(result) == [
        f"error: {run}/adapter_model.safetensors is damaged: truncated (1000 bytes; its header alone is {header})",
        _run_hint(run)]


def test_merge_on_an_adapter_cut_in_its_tensors_names_the_file(run, tmp_path):
    size = (run / "adapter_model.safetensors").stat().st_size
    os.truncate(run / "adapter_model.safetensors", size - 100)
    result = cli("merge", str(run), "--out", str(tmp_path / "merged"))
    assert user_error(result) == [
        f"error: {run}/adapter_model.safetensors is damaged: truncated ({size - 100} bytes; its tensors need {size})",
        _run_hint(run)]
    assert not (tmp_path / "merged").exists()


def _json_error(text: str) -> str:
    import json

    try:
        json.loads(text)
    except ValueError as e:
        return f"not valid JSON ({e})"
    raise AssertionError("valid JSON")


@pytest.mark.parametrize("name", ["adapter_config.json", "tokenizer.json"])
def test_generate_and_merge_on_broken_json_name_the_file(run, tmp_path, name):
    path = run / name
    path.write_text(path.read_text()[:len(path.read_text()) // 2])  # cut in the middle, as a writer that stopped
    why = _json_error(path.read_text())
    expected = [f"error: {path} is damaged: {why}", _run_hint(run)]
    assert user_error(cli("generate", str(run), "--prompt", "hi", "--max-new-tokens", "2")) == expected
    assert user_error(cli("merge", str(run), "--out", str(tmp_path / "merged"))) == expected


def test_runs_and_show_name_a_damaged_metrics_json(run):
    (run / "metrics.json").write_text('{"steps": 4, "train_')
    why = "not valid JSON (Unterminated string starting at: line 1 column 14 (char 13))"
    hint = ("hint: restore the file from a copy; a damaged metrics.json can be removed instead: "
            "`lowvram train RECIPE --resume` writes it again from the last complete checkpoint")
    assert user_error(cli("show", str(run))) == [f"error: {run}/metrics.json is damaged: {why}", hint]
    listed = cli("runs", str(run.parent))  # a warning naming the run, exit 0: a listing goes on (issue 42)
    assert listed.exit_code == 0, listed.output
    assert listed.stderr == (f"warning: run out: {run}/metrics.json is damaged: {why}; "
                             f"`lowvram show {run}` says how to repair it\n")
    assert "damaged" in listed.stdout  # the run is still listed, with its status


def test_show_names_a_damaged_recipe_yaml(run):
    (run / "recipe.yaml").write_text("model: {name_or_path: [\n")
    lines = user_error(cli("show", str(run)))
    assert lines[0] == f"error: {run}/recipe.yaml is damaged: not valid YAML (while parsing a flow node)"


@pytest.fixture
def damaged_model(tiny_model_dir, tmp_path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    return copy


@pytest.mark.parametrize("damage", ["weights", "config"])
def test_train_and_validate_on_a_damaged_model_folder_name_the_file(damaged_model, tmp_path, damage):
    if damage == "weights":
        path = damaged_model / "model.safetensors"
        size = path.stat().st_size
        os.truncate(path, 5000)
        header = int.from_bytes(path.read_bytes()[:8], "little") + 8
        why = f"truncated (5000 bytes; its tensors need {size})" if header <= 5000 else \
            f"truncated (5000 bytes; its header alone is {header})"
    else:
        path = damaged_model / "config.json"
        path.write_text('{"model_type": "llama", "hidden_size": 6')
        why = "not valid JSON (Expecting ',' delimiter: line 1 column 41 (char 40))"
    recipe = write_recipe(tmp_path, damaged_model, steps=1)
    assert user_error(cli("train", str(recipe), *NO_TENSORBOARD)) == [
        f"error: {path} is damaged: {why}", f"hint: {DAMAGED_HINT}"]
    assert user_error(cli("validate", str(recipe)))[:2] == [
        "error: 1 input of the recipe cannot be read:", f"  {path} is damaged: {why}"]
    assert not (tmp_path / "out" / "checkpoint-1").exists()


def test_resume_refuses_a_checkpoint_whose_optimizer_state_is_cut(run, tmp_path, tiny_model_dir):
    """Checkpoints without lowvram's marker (another tool, an older lowvram) are judged by their
    files: a cut optimizer.pt made torch.load fail inside the Trainer's resume with
    "PytorchStreamReader failed reading zip archive" and a traceback."""
    shutil.rmtree(run / "checkpoint-4")
    (run / "checkpoint-2" / MARKER).unlink()
    (run / "metrics.json").unlink()  # unfinished, at step 2
    os.truncate(run / "checkpoint-2" / "optimizer.pt", 3000)
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=4, save_steps=2)  # the run's own settings
    assert user_error(cli("train", str(recipe), "--resume", *NO_TENSORBOARD)) == [
        f"error: no checkpoint to resume from in {run} (checkpoint folders: checkpoint-2); skipped checkpoint-2 "
        "(optimizer.pt is damaged: cut short or overwritten (3000 bytes; torch.save's zip archive has no central "
        "directory))",
        "hint: checkpoints are written every training.save_steps steps; run with --overwrite to start over"]


def test_train_on_a_cut_gguf_names_the_file(tmp_path, tiny_model_dir):
    """A GGUF written by gguf's own writer, cut short: transformers' reader failed with numpy's
    reshape error; the check names the file before the conversion starts."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    folder = tmp_path / "gguf-model"
    folder.mkdir()
    path = folder / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((512, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.truncate(path, 20000)
    recipe = write_recipe(tmp_path, f"{folder}, gguf_file: model.gguf", steps=1)
    assert user_error(cli("train", str(recipe), *NO_TENSORBOARD)) == [
        f"error: {path} is damaged: cannot be parsed (20000 bytes: cannot reshape array of size 4960 into shape (512,64))",
        f"hint: {DAMAGED_HINT}"]


def test_file_problem_reads_real_files(finished, tmp_path):
    """The checks on files a real run wrote: whole files pass, cut ones do not (exact sizes)."""
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "training_args.bin",
                 "checkpoint-4/optimizer.pt", "checkpoint-4/rng_state.pth", "checkpoint-4/trainer_state.json"):
        assert file_problem(finished / name) is None, name
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes((finished / "adapter_model.safetensors").read_bytes() + b"x")
    assert file_problem(cut) == "has 1 bytes after its last tensor (not a whole safetensors file)"
    cut.write_bytes(b"\x01\x00")
    assert file_problem(cut) == "truncated (2 bytes: no safetensors header)"
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGML" + bytes(100))
    assert file_problem(gguf) == "not a GGUF file (no GGUF magic at its start)"
