"""data.max_pixels: auto (issue 47 item 2, plan/choose/pixels.py): the chooser keeps the processor's
own max_pixels where a plan fits at it, else lowers it on the processor's grid to exactly the largest
value at which some plan fits (the next grid step fits none), last of all; the plan says the size
and what it costs; fixed-size towers keep their size; nothing fitting is refused as usual."""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.plan.choose.choose import choose_plan, next_cheaper
from lowvram.plan.choose.replan import Replanner
from lowvram.plan.choose.request import PlanRequest
from lowvram.plan.model.catalog import resolve_model
from lowvram.planning.budget import make_budget


def auto(name: str, seq_len: int = 2048, **kw) -> PlanRequest:
    return PlanRequest(model=resolve_model(name), images_per_row=1, seq_len=seq_len, max_pixels_auto=True, **kw)


def fixed(req: PlanRequest, max_pixels: int) -> PlanRequest:
    return replace(req, max_pixels=max_pixels, max_pixels_auto=False)


@pytest.mark.parametrize(("name", "vram", "pixels", "unit2", "tokens"), [
    ("qwen2.5-vl-7b", "9GB", 627_984, 28 * 28, 801),  # 801 x 784 px
    ("qwen3-vl-8b", "9GB", 94_208, 32 * 32, 92),  # 92 x 1,024 px
])
def test_the_largest_grid_value_that_fits(name, vram, pixels, unit2, tokens):
    """Nothing fits at the processor's own 1,003,520 px; auto picks exactly ``pixels`` (on the
    grid), at which a plan fits, and one grid step more fits no plan (each planned with max_pixels
    fixed: the whole search, not auto's)."""
    budget = make_budget(vram)
    req = auto(name)
    assert not choose_plan(fixed(req, 1_003_520), budget).fits
    choice = choose_plan(req, budget)
    assert choice.fits and choice.plan.max_pixels == pixels and pixels == tokens * unit2
    assert choice.request.model.vision.tokens_per_image == tokens
    assert choose_plan(fixed(req, pixels), budget).fits
    assert not choose_plan(fixed(req, pixels + unit2), budget).fits
    same = choose_plan(fixed(req, pixels), budget)  # the plan is the one the search picks at that size
    assert same.plan.predicted_peak_bytes == choice.plan.predicted_peak_bytes
    assert same.plan.techniques() == choice.plan.techniques()
    a = choice.max_pixels_auto
    assert (a["processor_max_pixels"], a["max_pixels"], a["pixels_per_token"], a["lowered"], a["fits"]) == (
        1_003_520, pixels, unit2, True, True)
    assert a["processor_tokens_per_image"] == 1_003_520 // unit2 and a["tokens_per_image"] == tokens
    side = int(pixels ** 0.5)
    assert a["square_side"] == side
    why = choice.plan.reasons["max_pixels"]
    assert f"lowered to max_pixels {pixels:,} (about {side} x {side})" in why
    assert f"one step larger, {pixels + unit2:,}, fits no plan" in why
    assert f"{1_003_520 // unit2:,} -> {tokens:,} tokens an image: images larger than {side} x {side} are scaled down" in why
    # the ladder: the techniques at the processor's own size, then max_pixels lowered
    assert choice.ladder[-1].technique == "max_pixels" and choice.ladder[-1].value == f"{pixels:,}"
    assert choice.ladder[-1].saved_bytes > 0


def test_auto_is_untouched_where_the_default_fits():
    """A plan fits at the processor's own max_pixels: auto keeps it, and the plan is the one
    planned without auto (the same peak, techniques and ladder)."""
    budget = make_budget("12GB")
    req = auto("qwen2.5-vl-7b")
    choice, plain = choose_plan(req, budget), choose_plan(fixed(req, None), budget)
    assert choice.fits and choice.plan.max_pixels == 1_003_520
    assert choice.plan.predicted_peak_bytes == plain.plan.predicted_peak_bytes
    assert choice.plan.techniques() == plain.plan.techniques() and choice.ladder == plain.ladder
    assert choice.max_pixels_auto["lowered"] is False
    assert choice.plan.reasons["max_pixels"] == ("auto: the processor's own max_pixels 1,003,520 (about 1001 x 1001), "
                                                 "1,280 tokens an image: a plan fits at it")
    assert "max_pixels" not in plain.plan.reasons and plain.plan.max_pixels is None


def test_the_checkpoints_own_max_pixels_is_the_start():
    """auto starts from the processor's own (a checkpoint's preprocessor_config.json: the request's
    max_pixels), 16,384 tokens for a real Qwen2.5-VL; with seq_len 1024 a row keeps room for one
    token of text: 1,023 tokens an image (802,032 px), where a plan fits on 24 GB."""
    choice = choose_plan(auto("qwen2.5-vl-7b", seq_len=1024, max_pixels=12_845_056), make_budget("24GB"))
    assert choice.fits and choice.plan.max_pixels == 1023 * 784
    a = choice.max_pixels_auto
    assert a["processor_max_pixels"] == 12_845_056 and a["tokens_per_image"] == 1023
    assert "1 image(s) of 16,384 tokens leave no text in seq_len 1024" in choice.plan.reasons["max_pixels"]


def test_nothing_fits_even_at_min_pixels_is_refused_as_usual():
    """8 GB: no plan fits even at one step above min_pixels (4 tokens, 3,136 px): planned there,
    does not fit, with its binding moment; the CLI says so (exit 1 with --check)."""
    choice = choose_plan(auto("qwen2.5-vl-7b"), make_budget("8GB"))
    assert not choice.fits and choice.plan.max_pixels == 3_136
    assert choice.max_pixels_auto["fits"] is False and choice.chosen.estimate.peak_moment
    assert "none fits even at the smallest on its 784-px grid" in choice.plan.reasons["max_pixels"]
    r = CliRunner().invoke(app, ["plan", "--model", "qwen2.5-vl-7b", "--vram", "8GB", "--seq-len", "2048",
                                 "--max-pixels", "auto", "--check"])
    assert r.exit_code == 1 and "error: does not fit" in r.output


def test_fixed_size_towers_keep_their_size_and_mistral3_stays_refused():
    budget = make_budget("24GB")
    for name, size in (("gemma-3-4b", "896 x 896 px (256 tokens an image)"),
                       ("llava-1.5-7b", "336 x 336 px (576 tokens an image)"),
                       ("llama-3.2-11b-vision", "4 tiles of 560 px")):
        choice = choose_plan(auto(name, seq_len=1024), budget)
        assert choice.plan.max_pixels is None and choice.max_pixels_auto["applies"] is False
        assert choice.plan.reasons["max_pixels"].startswith("auto: the fixed size, no pixel limit to lower")
        assert size in choice.plan.reasons["max_pixels"]
        plain = choose_plan(fixed(auto(name, seq_len=1024), None), budget)
        assert choice.plan.predicted_peak_bytes == plain.plan.predicted_peak_bytes
    r = CliRunner().invoke(app, ["plan", "--model", "mistral-small-3.1-24b", "--vram", "24GB", "--max-pixels", "auto"])
    assert r.exit_code == 1 and "Mistral-3 (Pixtral) is not modelled" in r.output


def test_a_retry_and_the_run_keep_the_chosen_size():
    """After out of memory the re-plan keeps the images the run has (max_pixels pinned), and the
    run's prediction at another length sizes the tower at the plan's max_pixels, not the start's."""
    req = auto("qwen2.5-vl-7b")
    plan = choose_plan(req, make_budget("9GB")).plan
    replanner = Replanner(req)
    assert sum(replanner.breakdown_at(plan, plan.seq_len).values()) == plan.predicted_peak_bytes
    retry = next_cheaper(replace(plan, predicted_peak_bytes=plan.predicted_peak_bytes * 2), req, None)
    assert retry is not None and retry.max_pixels == plan.max_pixels
    back = Replanner.from_dict(json.loads(json.dumps(replanner.to_dict())))
    assert back.request.max_pixels_auto is True


def test_cli_json_and_table():
    args = ["plan", "--model", "qwen2.5-vl-7b", "--vram", "9GB", "--seq-len", "2048", "--max-pixels", "auto"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert set(data["max_pixels_auto"]) == {
        "applies", "processor_max_pixels", "max_pixels", "min_pixels", "pixels_per_token", "square_side",
        "processor_tokens_per_image", "tokens_per_image", "lowered", "fits", "changes"}
    assert data["max_pixels_auto"]["max_pixels"] == data["vision"]["image"]["max_pixels"] == 627_984
    assert data["vision"]["image"]["tokens_per_image"] == 801 and data["images_per_row"] == 1
    assert data["max_pixels_auto"]["changes"].startswith("the data:")
    assert data["ladder"][-1]["technique"] == "max_pixels"
    text = " ".join(CliRunner().invoke(app, args, env={"COLUMNS": "300"}).stdout.split())
    assert "max_pixels │ 627,984 │ auto: the processor's own max_pixels is 1,003,520" in text
    bad = CliRunner().invoke(app, ["plan", "--model", "qwen2.5-vl-7b", "--vram", "9GB", "--max-pixels", "big"])
    assert bad.exit_code == 2 and "--max-pixels takes a number of pixels or auto" in bad.output


def test_the_recipe_key_takes_auto(tmp_path):
    from pydantic import ValidationError

    from lowvram.planning.from_recipe import build_request
    from lowvram.recipe import Recipe

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 12845056}))
    doc = {"model": {"name_or_path": str(tmp_path)},
           "data": {"datasets": [{"path": "x.jsonl", "format": "image_chat"}], "max_pixels": "auto"}}
    recipe = Recipe.model_validate(doc)
    req = build_request(resolve_model("qwen2.5-vl-7b"), recipe)
    assert req.max_pixels_auto and req.max_pixels == 12_845_056  # the checkpoint's own: the start
    assert not build_request(resolve_model("qwen2.5-vl-7b"), recipe, {"max_pixels": 401_408}).max_pixels_auto
    doc["data"]["max_pixels"] = 401_408
    flagged = build_request(resolve_model("qwen2.5-vl-7b"), Recipe.model_validate(doc), {"max_pixels_auto": True})
    assert flagged.max_pixels_auto and flagged.max_pixels == 12_845_056  # --max-pixels auto over the recipe's
    for bad in (0, "big"):
        doc["data"]["max_pixels"] = bad
        with pytest.raises(ValidationError):
            Recipe.model_validate(doc)


def test_nothing_fits_suggests_smaller_images():
    """Without auto (max_pixels fixed or the processor's own), a plan that does not fit names
    data.max_pixels: auto and the size where it would fit, with what it costs."""
    req = fixed(auto("qwen2.5-vl-7b"), None)
    choice = choose_plan(req, make_budget("9GB"))
    assert not choice.fits
    assert ("smaller images: data.max_pixels: auto (--max-pixels auto) lowers it to 627,984 (about 792 x 792; "
            "1,280 -> 801 tokens an image), where it fits") in choice.suggestions[0]
    assert not any("smaller images" in s for s in choose_plan(req, make_budget("8GB")).suggestions)


def test_a_start_at_the_grids_floor_is_not_lowered():
    """max_pixels already the smallest the grid allows above min_pixels: nothing to lower, said so."""
    req = auto("qwen2.5-vl-7b", max_pixels=4 * 784, min_pixels=4 * 784)
    choice = choose_plan(req, make_budget("8GB"))
    assert not choice.fits and choice.plan.max_pixels == 4 * 784 and choice.ladder[-1].technique != "max_pixels"
    assert choice.plan.reasons["max_pixels"].endswith("no plan fits, and it is the smallest the grid allows (min_pixels)")
