"""Format image_chat with Qwen2.5-VL and Qwen3-VL: each row rendered through the family's own
processor (Qwen2_5_VLProcessor / Qwen3VLProcessor without its video processor) and chat template,
the image tokens the processor's smart_resize gives within data.max_pixels, labels never on an
image token, the batch carrying what the model computes its M-RoPE positions from, video refused,
and `lowvram train` on tiny models at the plan-truth target."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from lowvram.check.builders import tiny_vision_config  # noqa: E402
from lowvram.difftest import Case, made_images, run_case  # noqa: E402
from lowvram.errors import DataError  # noqa: E402
from lowvram.recipe import Recipe  # noqa: E402
from lowvram.testing import build_processor, build_vision_tokenizer, write_image_chat  # noqa: E402
from lowvram.train.data.build import ImageInputs, build_datasets  # noqa: E402
from lowvram.train.data.collate import make_collator  # noqa: E402
from lowvram.train.data.images import make_image_collator  # noqa: E402
from lowvram.train.types import IGNORE_INDEX  # noqa: E402


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def processor_of(family):
    tok = build_vision_tokenizer(family)
    cfg = tiny_vision_config(family, tok, patch_size=14 if family == "qwen2_5_vl" else 16)
    return build_processor(cfg, tok), cfg


def _bundle(processor_of, data: Path, **data_keys):
    processor, cfg = processor_of
    recipe = Recipe.model_validate({
        "model": {"name_or_path": "unused"},
        "data": {"datasets": [{"path": str(data), "format": "image_chat"}], **data_keys},
        "training": {"seq_len": 256}})
    return build_datasets(recipe, processor.tokenizer, ImageInputs(processor, cfg.image_token_id))


def test_image_tokens_follow_the_processor_and_are_never_labels(tmp_path, processor_of):
    """A 60 px image: smart_resize rounds it to 2 x 2 merged units (56 px at 28, 64 px at 32), so
    4 <|image_pad|> tokens, between <|vision_start|> and <|vision_end|>, none a label."""
    processor, cfg = processor_of
    data = write_image_chat(tmp_path / "vqa.jsonl", rows=3, side=60)
    ds = _bundle(processor_of, data).train
    for row in ds:
        ids, labels = row["input_ids"], row["labels"]
        assert ids.count(cfg.image_token_id) == 4
        start = ids.index(cfg.vision_start_token_id)
        assert ids[start + 1:start + 5] == [cfg.image_token_id] * 4 and ids[start + 5] == cfg.vision_end_token_id
        assert all(lab == IGNORE_INDEX for i, lab in zip(ids, labels, strict=True) if i == cfg.image_token_id)
        assert any(lab != IGNORE_INDEX for lab in labels)  # the answer is trained


def test_the_collator_carries_the_grid_and_the_image_token_types(tmp_path, processor_of):
    """pixel_values one row per patch, image_grid_thw per image and mm_token_type_ids (1 on image
    tokens): what compute_3d_position_ids needs; no position_ids, so the model computes M-RoPE."""
    processor, cfg = processor_of
    data = write_image_chat(tmp_path / "vqa.jsonl", rows=2, side=60)
    ds = _bundle(processor_of, data).train
    batch = make_image_collator(processor, cfg.image_token_id, make_collator(processor.tokenizer))([ds[0], ds[1]])
    row = 3 * 2 * cfg.vision_config.patch_size ** 2
    assert batch["pixel_values"].shape == (2 * 16, row)  # 4 x 4 patches an image
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == cfg.image_token_id).int())
    assert "position_ids" not in batch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg)
    out = model(**batch)
    assert torch.isfinite(out.loss)
    positions, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                              image_grid_thw=batch["image_grid_thw"],
                                              attention_mask=batch.get("attention_mask"))
    image = batch["input_ids"][0] == cfg.image_token_id
    start = int(positions[0, 0, image][0])  # the image's 2 x 2 tokens: one temporal position, rows, columns
    assert positions[0, 0, image].tolist() == [start] * 4
    assert positions[1, 0, image].tolist() == [start, start, start + 1, start + 1]
    assert positions[2, 0, image].tolist() == [start, start + 1, start, start + 1]


def test_max_pixels_shrinks_the_images(tmp_path, processor_of):
    """data.max_pixels reaches the processor (as train.build.processor.image_inputs sets it): a
    120 px image under one merged unit's square (28^2 / 32^2 px) costs one token."""
    from lowvram.train.build.processor import QWEN_VL_MODEL_TYPES

    processor, cfg = processor_of
    assert cfg.model_type in QWEN_VL_MODEL_TYPES
    unit = cfg.vision_config.patch_size * 2
    own = processor.image_processor.size
    try:
        processor.image_processor.size = {"shortest_edge": unit * unit, "longest_edge": unit * unit}
        data = write_image_chat(tmp_path / "vqa.jsonl", rows=1, side=120)
        ids = _bundle(processor_of, data).train[0]["input_ids"]
        assert ids.count(cfg.image_token_id) == 1
    finally:
        processor.image_processor.size = own


def test_video_is_refused_with_a_hint(tmp_path, processor_of):
    data = write_image_chat(tmp_path / "vqa.jsonl", rows=1, side=60)
    row = json.loads(data.read_text())
    row["messages"][0]["content"].append({"type": "video"})
    data.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match="video is not supported") as e:
        _bundle(processor_of, data)
    assert "frames as images" in e.value.hint
    row["messages"][0]["content"].pop()
    row["videos"] = ["clip.mp4"]
    data.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match="the row has videos"):
        _bundle(processor_of, data)


def _case(family: str, method: str, **kw) -> Case:
    base = dict(seed=5, family=family, hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128,
                vocab=512, tie=False, method=method, lora_r=8, precision="fp32",
                seq_len=128, micro_batch_size=2, vision_layers=1, vision_hidden=32, vision_image=32,
                vision_patch=8)
    return made_images(Case(**{**base, **kw}))


@pytest.mark.parametrize("family, method", [("qwen2_5_vl", "lora"), ("qwen3_vl", "full")])
def test_image_recipe_trains_end_to_end_at_its_plan(tmp_path, family, method):
    """`lowvram train` on image + text rows of a tiny Qwen2.5-VL / Qwen3-VL: the run's peak within
    the plan-truth target; the recipe's data.max_pixels sizes the plan (more pixels, more plan)."""
    case = _case(family, method)
    out = run_case(case, tmp_path)
    assert out.error is None, out.error
    assert out.ok, (out.measured_bytes, out.predicted_bytes, out.ratio)
    from lowvram.planning.entry import plan_for_recipe
    from lowvram.recipe import load_recipe

    recipe = load_recipe(tmp_path / "recipe.yaml")
    assert recipe.data.max_pixels == case.max_pixels
    assert plan_for_recipe(recipe).predicted_peak_bytes == out.predicted_bytes
    recipe.data.max_pixels *= 2  # twice the image tokens
    assert plan_for_recipe(recipe).predicted_peak_bytes > out.predicted_bytes
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 2 and all(loss == loss for _, loss in metrics["loss_history"])


def test_an_image_over_the_plans_bound_is_refused_by_row(tmp_path, processor_of):
    """A sliver (37 x 1900 px) at max_pixels of 2 x 2 units: smart_resize keeps one unit for its
    short side and floors the long one, past max_pixels; the plan's bound (max_pixels // unit^2)
    would not hold, so the row is refused, named by file and row."""
    from PIL import Image

    processor, cfg = processor_of
    unit = cfg.vision_config.patch_size * 2
    data = write_image_chat(tmp_path / "vqa.jsonl", rows=2, side=60)
    Image.new("RGB", (37, 1900), (200, 10, 10)).save(tmp_path / "images" / "image_1.png")
    own = processor.image_processor.size
    try:
        processor.image_processor.size = {"shortest_edge": unit * unit, "longest_edge": 4 * unit * unit + unit}
        with pytest.raises(DataError, match=r"vqa.jsonl:2: image 'images/image_1.png' costs \d+ tokens, more than the 4"):
            _bundle(processor_of, data)
    finally:
        processor.image_processor.size = own
