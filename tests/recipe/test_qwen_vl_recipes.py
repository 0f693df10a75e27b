"""The Qwen2.5-VL image recipes (issue 47 item 6). recipes/qwen2.5-vl-tiny-shapes.yaml: a tiny Qwen2.5-VL made by
recipes/data/make_tiny_qwen2_5_vl.py trains on the shipped shapes through `lowvram train` on a CPU,
its loss falls and its peak is the plan's; both recipes' headers are what the tools say."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

RECIPE = REPO / "recipes" / "qwen2.5-vl-tiny-shapes.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_tiny", REPO / "recipes/data/make_tiny_qwen2_5_vl.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    return make.make(tmp_path_factory.mktemp("tiny-qwen2.5-vl"))


def _lowvram(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "lowvram", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)


def test_the_script_makes_the_model_the_header_names(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_5_vl" and cfg["vision_config"]["patch_size"] == 8
    r = _lowvram("plan", str(RECIPE), "--set", f"model.name_or_path={model_dir}", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert 0.55e6 < plan["parameters"] < 0.65e6  # "0.6M parameters"
    image = plan["vision"]["image"]
    assert (image["tokens_per_image"], image["max_pixels"], plan["images_per_row"]) == (16, 4096, 1)
    assert f"{plan['peak_bytes'] / 2**20:.1f} MiB" == "18.9 MiB"  # the header's plan at seq_len 128


@pytest.mark.slow
def test_the_recipe_trains_its_loss_falls_and_its_peak_is_planned(model_dir, tmp_path):
    r = _lowvram("train", str(RECIPE), "--set", f"model.name_or_path={model_dir}",
                 "--set", f"training.output_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["steps"] == 40 and m["data_longest_tokens"] == 101
    # the header: loss 6.30 -> 1.19, eval 1.38 (seeded: the same on any CPU to a few 1e-3)
    assert m["first_loss"] == pytest.approx(6.30, abs=0.02) and m["train_loss"] < 1.3 and m["eval_loss"] < 1.5
    assert abs(m["peak_memory_bytes"] / m["predicted_peak_bytes_at_data"] - 1) < 0.01  # 16.3 MiB, the plan's
    assert m["peak_memory_bytes"] <= m["predicted_peak_bytes"]


def test_the_7b_recipes_header_is_the_plan_today():
    """recipes/qwen2.5-vl-7b-vision-qlora.yaml's header quotes `lowvram plan RECIPE --vram 24GB`."""
    r = _lowvram("plan", str(REPO / "recipes/qwen2.5-vl-7b-vision-qlora.yaml"), "--vram", "24GB", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    header = " ".join(line.lstrip("# ") for line in
                      (REPO / "recipes/qwen2.5-vl-7b-vision-qlora.yaml").read_text().splitlines() if line.startswith("#"))
    image = d["vision"]["image"]
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    assert f"up to {image['tokens_per_image']} tokens an image ({image['patches_per_image']:,} patches in the tower)" in header
    assert f"bf16 tower ({gib(d['vision']['weight_bytes'])})" in header
    assert f"micro-batch {d['micro_batch_size']} x {d['grad_accum']}: peak {gib(d['peak_bytes'])}" in header
    assert f"of a {gib(d['budget_bytes'])} budget, at {d['peak_moment']}" in header
    assert f"vision_encoder_forward, {gib(image['encoder_forward_bytes'])} beside the weights" in header
    assert d["techniques"]["optimizer"] == "paged_adamw_8bit" and d["techniques"]["gradient_checkpointing"]
