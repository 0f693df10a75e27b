"""data.max_pixels / data.min_pixels as a plan input (plan/model/image_size.py): the image tokens
bound against the processor's own smart_resize, the plan sized by them, the refusals, the CLI
answer, and the processor's own limits as the default."""

import json
from dataclasses import replace

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.choose.request import PlanRequest, validate_request
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.model.image_size import (
    QWEN_MAX_PIXELS,
    image_geometry,
    image_size_problem,
    patches_per_image,
    pixel_values_bytes,
    sized_vision,
)


def test_the_default_size_is_the_catalogs():
    """No limits: the image processor's class default (28 * 28 * 1280), as the catalog and the
    config reader already size a Qwen-VL tower, so text-only plans keep their numbers."""
    for name in ("qwen2.5-vl-7b", "qwen3-vl-8b"):
        v = resolve_model(name).vision
        assert sized_vision(v, None, None) == v
        assert image_geometry(v).tokens == QWEN_MAX_PIXELS // (v.patch_size * 2) ** 2


@pytest.mark.parametrize("patch", [14, 16])
def test_the_bound_holds_against_the_processor(patch):
    """Qwen2VLImageProcessor's smart_resize never gives more tokens than max_pixels // unit^2 to
    an image of a usual aspect ratio, and a square of k x k units just under the limit gets exactly
    the bound. A sliver (one unit wide, its other side floored) can exceed it at a small
    max_pixels: training refuses such a row (tests/train/test_qwen_images.py)."""
    pytest.importorskip("PIL")
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    unit = 2 * patch
    for max_pixels in (unit * unit * 4 + unit, 200_000, 1_003_520):
        proc = Qwen2VLImageProcessorPil(patch_size=patch, size={"shortest_edge": unit * unit,
                                                                 "longest_edge": max_pixels})
        v = sized_vision(replace(resolve_model("qwen2.5-vl-7b").vision, patch_size=patch), max_pixels, unit * unit)
        bound = v.tokens_per_image
        for w, h in ((640, 480), (1024, 1024), (3000, 1000), (50, 50), (333, 1000)):
            grid = proc(images=[Image.new("RGB", (w, h))], return_tensors="pt")["image_grid_thw"][0]
            assert int(grid.prod()) // 4 <= bound
        k = int(max_pixels ** 0.5) // unit
        side = 3 * k * unit
        grid = proc(images=[Image.new("RGB", (side, side))], return_tensors="pt")["image_grid_thw"][0]
        assert int(grid.prod()) // 4 == k * k
        if max_pixels == (2 * unit) ** 2 + unit:
            assert bound == k * k == 4
            grid = proc(images=[Image.new("RGB", (37, 1900))], return_tensors="pt")["image_grid_thw"][0]
            assert int(grid.prod()) // 4 > bound  # the sliver


def test_pixels_and_patches_of_the_largest_image():
    v = sized_vision(resolve_model("qwen2.5-vl-7b").vision, 1_003_520, None)
    assert (v.tokens_per_image, patches_per_image(v)) == (1280, 5120)
    assert pixel_values_bytes(v) == 4 * 5120 * 3 * 2 * 14 * 14  # one float32 row of c x t x p^2 per patch


def test_the_request_sizes_the_tower_and_the_plan_grows_with_it():
    from lowvram.plan.choose.choose import choose_plan
    from lowvram.planning.budget import make_budget

    model = resolve_model("qwen2.5-vl-7b")
    small = PlanRequest(model=model, images_per_row=1, max_pixels=200_704, seq_len=2048, batch_size=1)
    large = replace(small, max_pixels=1_003_520)
    assert small.model.vision.tokens_per_image == 256 and large.model.vision.tokens_per_image == 1280
    assert replace(large, seq_len=4096).model.vision == large.model.vision  # idempotent
    budget = make_budget("80GB")
    assert choose_plan(large, budget).plan.predicted_peak_bytes > choose_plan(small, budget).plan.predicted_peak_bytes


def test_refusals_name_what_is_wrong():
    gemma = resolve_model("gemma-3-4b").vision
    assert "do not apply to a gemma3 tower" in image_size_problem(gemma, 1_000_000, None)
    qwen = resolve_model("qwen2.5-vl-7b").vision
    assert "under one image token" in image_size_problem(qwen, 100, None)
    assert "above data.max_pixels" in image_size_problem(qwen, 10_000, 20_000)
    assert image_size_problem(qwen, 1_003_520, None) is None
    with pytest.raises(LowvramError, match="leave no room for text in training.seq_len 1024") as e:
        validate_request(PlanRequest(model=resolve_model("qwen2.5-vl-7b"), images_per_row=1, max_pixels=12_845_056))
    assert "lower data.max_pixels" in e.value.hint


def test_plan_answers_with_the_image_tokens_the_tower_and_the_moment():
    from typer.testing import CliRunner

    from lowvram.cli import app

    args = ["plan", "--model", "qwen2.5-vl-7b", "--method", "qlora", "--vram", "24GB", "--max-pixels", "1003520",
            "--seq-len", "2048"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    image = data["vision"]["image"]
    assert data["images_per_row"] == 1  # --max-pixels asks for an image plan
    assert (image["tokens_per_image"], image["patches_per_image"], image["max_pixels"]) == (1280, 5120, 1_003_520)
    assert 0 < image["encoder_forward_bytes"] < data["peak_bytes"]
    text = CliRunner().invoke(app, args).stdout
    assert "images: data.max_pixels 1,003,520 (min 3,136): up to 1,280 tokens an image" in text
    assert "peak at " in text
    r = CliRunner().invoke(app, ["plan", "--model", "gemma-3-4b", "--max-pixels", "1003520", "--vram", "24GB"])
    assert r.exit_code == 1 and "error: data.max_pixels / data.min_pixels do not apply" in r.output


def test_the_processor_config_is_the_default(tmp_path):
    """No data.max_pixels in the recipe: the model folder's preprocessor_config.json limits (as a
    real Qwen2.5-VL ships them: min_pixels 3136, max_pixels 12845056)."""
    from lowvram.planning.from_recipe import pixel_fields
    from lowvram.recipe import Recipe

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 12845056}))
    recipe = Recipe.model_validate({"model": {"name_or_path": str(tmp_path)},
                                    "data": {"datasets": [{"path": "x.jsonl", "format": "image_chat"}]}})
    assert pixel_fields(recipe) == {"max_pixels": 12845056, "min_pixels": 3136}
    recipe.data.max_pixels = 401_408
    assert pixel_fields(recipe) == {"max_pixels": 401_408, "min_pixels": 3136}
    (tmp_path / "preprocessor_config.json").unlink()  # transformers 5 nests it in processor_config.json
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {
        "image_processor_type": "Qwen2VLImageProcessor", "size": {"longest_edge": 1_000_000, "shortest_edge": 4096}}}))
    recipe.data.max_pixels = None
    assert pixel_fields(recipe) == {"max_pixels": 1_000_000, "min_pixels": 4096}
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {  # Llava's: a side, not pixels
        "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 336}}}))
    assert pixel_fields(recipe) == {}


def test_pixels_alive_follow_the_accumulation():
    """The Trainer holds a step's micro-batches together (get_batch_samples) and accelerate the
    next: grad_accum + 1 micro-batches of pixel values."""
    from lowvram.plan.memory.images import pixel_bytes
    from lowvram.plan.setup import RunSetup

    model = PlanRequest(model=resolve_model("qwen2.5-vl-7b"), max_pixels=200_704).model
    one = RunSetup(model=model, images_per_row=2, micro_batch_size=1, grad_accum=1, seq_len=2048)
    assert pixel_bytes(one) == 2 * 2 * pixel_values_bytes(model.vision)
    assert pixel_bytes(replace(one, grad_accum=4)) == 5 * 2 * pixel_values_bytes(model.vision)
