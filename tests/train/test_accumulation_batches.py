"""Image data with gradient accumulation through `lowvram train` (CPU, live tensor bytes): between
two optimizer steps the Trainer holds the last step's micro-batches while it fetches the next
step's (transformers trainer.py _run_epoch: ``batch_samples`` is rebound only when
get_batch_samples returns) and accelerate's DataLoaderShard has prefetched one more, so
2 x grad_accum + 1 micro-batches' pixel values are alive beside the weights and the optimizer
state (plan/memory/image_moment.py between_steps_bytes, the moment next_step_batches). With one
large image a row and micro-batch 1 that moment is the run's peak: before it was planned, 1 x 2
measured +19% to +26% above its plan, 1 x 4 +46.5%."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("PIL")
pytest.importorskip("torch")

from typer.testing import CliRunner  # noqa: E402

from lowvram.cli import app  # noqa: E402

# A 640 x 480 image: 1564 patches of 14 px (391 tokens merged 2 x 2) under Qwen2.5-VL's default
# max_pixels, 1564 x 1176 float32 pixel values = 7,357,056 B a micro-batch, against a model of
# under 1 MB: the pixels of the micro-batches held between two steps are the run's peak.
SIDE = (640, 480)
ROWS = 12  # more than 2 steps x 4 micro-batches + the prefetched one: the data never ends first


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    from lowvram.check.builders import write_one_image_rows

    return write_one_image_rows(tmp_path_factory.mktemp("qwen-vl-accumulation"), SIDE, ROWS)


def _run(root: Path, micro: int, accumulation: int) -> tuple[dict, dict]:
    out = root / f"run-{micro}x{accumulation}"
    doc = {"model": {"name_or_path": str(root / "model")},
           "data": {"datasets": [{"path": str(root / "big.jsonl"), "format": "image_chat"}], "images_per_row": 1},
           "training": {"seq_len": 1024, "batch_size": micro * accumulation, "micro_batch_size": micro,
                        "max_steps": 2, "save_steps": 100, "output_dir": str(out)},
           "techniques": {"lora": "off", "gradient_checkpointing": "off", "optimizer": "adamw", "loss": "standard",
                          "mixed_precision": "off", "gradient_accumulation": accumulation}}
    recipe = root / f"r{micro}x{accumulation}.yaml"
    recipe.write_text(json.dumps(doc))
    result = CliRunner().invoke(app, ["train", str(recipe), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads((out / "metrics.json").read_text()), json.loads((out / "plan.json").read_text())


def _ratio(m: dict) -> float:
    return m["peak_memory_bytes"] / m["predicted_peak_bytes_at_data"] - 1


def test_micro_batch_1_with_accumulation_2_peaks_where_its_plan_says(data_dir):
    """1 x 2 (13 s CPU): 5 micro-batches' pixels at the peak, between the two steps; +21.7% above
    the plan before the moment was counted, +0.12% after (2026-12-06)."""
    m, _ = _run(data_dir, 1, 2)
    assert -0.03 < _ratio(m) < 0.03, m


@pytest.mark.slow
def test_micro_batch_1_with_accumulation_4_peaks_where_its_plan_says(data_dir):
    """1 x 4: 9 micro-batches' pixels at the peak (+46.5% above the plan before, +0.12% after)."""
    m, _ = _run(data_dir, 1, 4)
    assert -0.03 < _ratio(m) < 0.03, m
