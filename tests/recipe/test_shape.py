"""`validate` and `train` refuse what the data or the model cannot hold (issue 24, item 12): a
batch that one optimizer step could not fill from the training rows, and a seq_len beyond the
model's max_position_embeddings unless its config.json sets rope scaling. Through the real CLI
on the tiny model (1024 positions) and real data files."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.train.run.preflight import _rope_scaled
from tests.train.test_e2e import write_alpaca, write_recipe

NO_TENSORBOARD = ("--set", "training.report_to=none")


def run(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert "Traceback" not in (result.output or ""), result.output
    return result


def refused(result) -> list[str]:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    return [line for line in result.output.splitlines() if line.startswith(("error:", "hint:"))]


@pytest.fixture
def recipe(tmp_path, tiny_model_dir):
    write_alpaca(tmp_path / "data.jsonl", n=64)
    return write_recipe(tmp_path, tiny_model_dir)


def _batch_lines(batch: int, rows: int, what: str = "rows", held: str = "") -> list[str]:
    return [f"error: training.batch_size {batch:,} is more than the training data holds: one optimizer step "
            f"takes {batch:,} samples, the data has {rows:,} training {what}{held}",
            f"hint: lower training.batch_size to {rows:,} or less, or add rows to the data"]


def test_validate_refuses_a_batch_the_rows_cannot_fill(recipe):
    big = run("validate", str(recipe), "--set", "training.batch_size=1000000000000")
    assert refused(big) == _batch_lines(1_000_000_000_000, 64)
    assert refused(run("validate", str(recipe), "--set", "training.batch_size=65")) == _batch_lines(65, 64)
    assert run("validate", str(recipe), "--set", "training.batch_size=64").exit_code == 0
    # data.validation 0.25 holds out 16 of the 64 rows (collate.hold_out): 48 are left to train on.
    held = run("validate", str(recipe), "--set", "data.validation=0.25", "--set", "training.batch_size=49")
    assert refused(held) == _batch_lines(49, 48, held=" after data.validation's hold-out")
    assert run("validate", str(recipe), "--set", "data.validation=0.25", "--set", "training.batch_size=48").exit_code == 0
    capped = run("validate", str(recipe), "--set", "data.datasets=[{path: data.jsonl, max_samples: 10}]",
                 "--set", "training.batch_size=16")
    assert refused(capped) == _batch_lines(16, 10)


def test_train_refuses_a_batch_the_rows_cannot_fill(recipe, tmp_path):
    """Counted once the data is built (after a bad row or a missing file is named in training's
    own words). The plan's micro-batch search walked every number up to the batch: 10^12 never
    finished planning; now its divisors, in sqrt(batch) steps."""
    result = run("train", str(recipe), "--set", "training.batch_size=1000000000000", *NO_TENSORBOARD)
    assert refused(result) == _batch_lines(1_000_000_000_000, 64)
    assert not list((tmp_path / "out").glob("checkpoint-*")) and not (tmp_path / "out" / "metrics.json").exists()
    assert run("train", str(recipe), *NO_TENSORBOARD).exit_code == 0  # the folder is not taken by the refusal


def test_train_refuses_a_batch_the_packed_windows_cannot_fill(recipe, tmp_path):
    """Packed windows are known only once the data is tokenized: validate lets it pass, train
    counts the windows it built. Each Alpaca row of the test data is longer than half of seq_len
    64 (the template alone is), so each fills a window of its own: 64 windows."""
    packed = ("--set", "data.packing=true", "--set", "training.batch_size=65")
    assert run("validate", str(recipe), *packed).exit_code == 0
    assert run("train", str(recipe), *packed, "--dry-run").exit_code == 0  # the plan for the recipe as it is
    result = run("train", str(recipe), *packed, *NO_TENSORBOARD)
    assert refused(result) == _batch_lines(65, 64, what="packed windows")
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def _seq_len_lines(seq_len: int, positions: int) -> list[str]:
    return [f"error: training.seq_len {seq_len:,} is beyond the model's max_position_embeddings {positions:,}, "
            "and its config.json sets no rope scaling: positions past it were never trained",
            f"hint: lower training.seq_len to {positions:,} or less, or use a model whose config.json sets "
            "rope_scaling (rope_parameters) with a factor for longer contexts"]


def test_validate_and_train_refuse_a_seq_len_beyond_the_models_positions(recipe, tmp_path):
    """train refuses before planning (config.json is all it needs): nothing is written."""
    long = ("--set", "training.seq_len=2048")
    assert refused(run("validate", str(recipe), *long)) == _seq_len_lines(2048, 1024)
    assert refused(run("train", str(recipe), *long, *NO_TENSORBOARD)) == _seq_len_lines(2048, 1024)
    assert not (tmp_path / "out").exists()
    assert run("validate", str(recipe), "--set", "training.seq_len=1024").exit_code == 0


def test_a_catalog_model_is_checked_against_its_positions(tmp_path):
    write_alpaca(tmp_path / "data.jsonl", n=64)
    recipe = write_recipe(tmp_path, "llama-2-7b")
    assert refused(run("validate", str(recipe), "--set", "training.seq_len=8192")) == _seq_len_lines(8192, 4096)


def test_rope_scaling_in_config_json_allows_a_longer_seq_len(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    (model / "config.json").write_text(json.dumps(cfg))
    write_alpaca(tmp_path / "data.jsonl", n=64)
    recipe = write_recipe(tmp_path, model)
    assert run("validate", str(recipe), "--set", "training.seq_len=2048").exit_code == 0


def test_rope_scaled_reads_both_spellings_and_per_layer_types():
    assert _rope_scaled({"rope_scaling": {"type": "linear", "factor": 2.0}})  # transformers 4
    assert _rope_scaled({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})
    assert _rope_scaled({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0},
                                             "sliding_attention": {"rope_type": "default"}}})  # Gemma-3
    assert not _rope_scaled({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    assert not _rope_scaled({"rope_scaling": None}) and not _rope_scaled({})


def test_divisors_descending_are_every_micro_batch_a_batch_allows():
    from lowvram.plan.choose.explain import divisors_descending

    assert divisors_descending(12) == [12, 6, 4, 3, 2, 1] and divisors_descending(1) == [1]
    assert divisors_descending(49) == [49, 7, 1]
    big = divisors_descending(10**12)  # 2^12 x 5^12: 13 x 13 divisors, found in 10^6 steps
    assert len(big) == 169 and big[0] == 10**12 and big[-1] == 1
