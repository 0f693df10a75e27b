"""`lowvram plan --image-table` (issue 47 item 4): per card, the largest data.max_pixels a Qwen-VL
request reaches at its text length and images per row, over every plan, checked against an
exhaustive search over every plan and rung; refused with its reason for a model without a pixel knob."""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.plan.choose.image_table import TOKEN_LADDER, at_rung, rungs
from lowvram.plan.choose.limits import _fits, _limit_setups
from lowvram.plan.choose.pool import Estimates
from lowvram.plan.choose.request import PlanRequest
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.model.image_size import image_geometry
from lowvram.planning.budget import make_budget

ARGS = ["plan", "--model", "qwen2.5-vl-7b", "--method", "qlora", "--image-table", "--images-per-row", "2",
        "--seq-len", "512", "--host-ram", "64GiB"]


def _table(args=ARGS) -> dict:
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_each_row_is_the_largest_image_over_every_plan():
    d = _table()
    assert d["images_per_row"] == 2 and d["text_tokens"] == 512 and d["pixels_per_token"] == 28 * 28
    estimate = Estimates(estimate_memory)
    spec = resolve_model("qwen2.5-vl-7b")
    req = PlanRequest(model=spec, seq_len=512 + 2 * 16, batch_size=1, lora=True, quantization="nf4-dq",
                      images_per_row=2, max_pixels=16 * 784)
    ladder = rungs(req, 512)
    assert list(ladder) == d["ladder_tokens"]
    sizes = [r["max_pixels"] for r in d["rows"]]
    assert sizes == sorted(sizes, key=lambda s: s or 0) and sizes[0] is None and sizes[-1] == 16384 * 784
    for r in d["rows"][1:4]:  # 12, 16, 24 GB: below the ladder's top
        assert r["max_pixels"] == r["image_tokens"] * 784 and r["seq_len"] == 512 + 2 * r["image_tokens"]
        assert r["peak_bytes"] <= r["budget_bytes"] and r["binds"]
        budget = make_budget(r["card"].replace(" ", ""), None, 1, "64GiB")
        assert budget.usable_bytes == r["budget_bytes"]
        # exhaustive: some plan fits at the row's rung, none at the next one
        i = ladder.index(r["image_tokens"])
        setups = _limit_setups(req, budget)
        assert any(_fits(at_rung(s, 512, ladder[i], None), budget, estimate) for s in setups)
        assert not any(_fits(at_rung(s, 512, ladder[i + 1], None), budget, estimate) for s in setups)


def test_a_rung_is_the_processors_tokens_at_that_max_pixels():
    for name, unit in (("qwen2.5-vl-7b", 28), ("qwen3-vl-8b", 32)):
        v = resolve_model(name).vision
        for t in TOKEN_LADDER:
            assert image_geometry(v, t * unit * unit).tokens == t
            assert image_geometry(v, t * unit * unit - 1).tokens == t - 1  # the grid: one pixel less, one token less
    d = _table(["plan", "--model", "qwen3-vl-8b", "--method", "qlora", "--image-table"])
    assert d["images_per_row"] == 1 and d["text_tokens"] == 1024 and d["pixels_per_token"] == 1024
    # positions: a 1,024-token row with one image stays within the model's max_position_embeddings
    spec = resolve_model("qwen3-vl-8b")
    req = PlanRequest(model=replace(spec, max_position_embeddings=1024 + 300), images_per_row=1)
    assert rungs(req, 1024) == (16, 32, 64, 128, 192, 256)


def test_the_table_prints_and_refuses_what_it_cannot_size():
    r = CliRunner().invoke(app, ARGS)
    assert r.exit_code == 0 and "Largest image per card: qwen2.5-vl-7b, 2 images a row beside 512 text" in r.output
    r = CliRunner().invoke(app, [*ARGS, "--vram", "24GB"])
    assert r.exit_code == 2 and "error: --image-table plans every card and image size itself" in r.output
    r = CliRunner().invoke(app, [*ARGS, "--max-pixels", "1003520"])
    assert r.exit_code == 2 and "--max-pixels does not apply" in r.output


@pytest.mark.parametrize("model, reason", [
    ("gemma-3-4b", "its processor resizes every image to 896 x 896 px"),
    ("llava-1.5-7b", "its processor resizes every image to 336 x 336 px"),
    ("llama-3.2-11b-vision", "cuts every image into 4 tiles of 560 px"),
    ("mistral-small-3.1-24b", "PixtralProcessor needs torchvision"),
    ("llama-3.1-8b", "this model has no vision tower"),
])
def test_a_model_without_a_pixel_knob_is_refused_with_its_reason(model, reason):
    r = CliRunner().invoke(app, ["plan", "--model", model, "--method", "qlora", "--image-table"])
    assert r.exit_code == 1, r.output
    err = " ".join(r.stderr.split())
    assert err.startswith("error: --image-table") and reason in err and "hint: --image-table sizes Qwen2.5-VL" in err
    assert "Traceback" not in r.output
