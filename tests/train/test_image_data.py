"""Issue 47 item 3: format image_chat measured on the data. Each image's tokens under the model's
processor (the processor's own count from the image's size, checked against what the processor
itself puts in the sequence for generated images of several sizes), the longest row in text +
image tokens, the rows over seq_len by file and row (cut, dropped, refused or skipped as training
treats them), in `validate` / `lowvram data` and their --json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("PIL")
pytest.importorskip("torch")

from typer.testing import CliRunner  # noqa: E402

from lowvram.cli import app  # noqa: E402
from lowvram.errors import LowvramError  # noqa: E402
from lowvram.recipe import Recipe  # noqa: E402
from lowvram.train.data.image_check import ImageMeasure, data_image_extent, image_token_counts  # noqa: E402
from lowvram.train.data.read import load_rows  # noqa: E402

# (width, height) of the generated images: square, wide, a sliver, a photo-sized one
SIZES = [(60, 60), (300, 100), (20, 1000), (640, 480)]
# Qwen2.5-VL (patch 14, merge 2) at the processor's default pixel limits: smart_resize to
# multiples of 28 px, (h / 28) x (w / 28) tokens: 56x56 -> 4; 112x308 -> 44; 1008x28 -> 36;
# 476x644 -> 17 x 23 = 391 (read off the processor's image_grid_thw, below)
QWEN25_TOKENS = [4, 44, 36, 391]


def write_data(folder: Path) -> Path:
    """Three rows: one small image; two images (wide and a sliver); one large image and a long answer."""
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    for i, (w, h) in enumerate(SIZES):
        Image.new("RGB", (w, h), (40 * i, 100, 200)).save(folder / "images" / f"im{i}.png")

    def row(n_images: list[int], question: str, answer: str) -> dict:
        parts = [{"type": "image"} for _ in n_images] + [{"type": "text", "text": question}]
        return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}],
                "images": [f"images/im{i}.png" for i in n_images]}

    rows = [row([0], "What?", "A thing."), row([1, 2], "Compare.", "Two things, " + "red " * 20),
            row([3], "Big?", "Yes " * 30)]
    path = folder / "vqa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2.5-VL checkpoint folder (config, weights, its processor) and the data beside it."""
    from lowvram.check.builders import save_tiny_vision_model

    root = tmp_path_factory.mktemp("qwen-vl-data")
    save_tiny_vision_model(root / "model", "qwen2_5_vl", patch_size=14)
    write_data(root)
    return root


def write_recipe(root: Path, tmp_path: Path, seq_len: int = 512, **data_keys) -> Path:
    doc = {"model": {"name_or_path": str(root / "model")},
           "data": {"datasets": [{"path": str(root / "vqa.jsonl"), "format": "image_chat"}], "images_per_row": 2,
                    **data_keys},
           "training": {"seq_len": seq_len, "batch_size": 2, "output_dir": str(tmp_path / "run")}}
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps(doc))
    return path


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "gemma3", "llava", "mllama"])
def processor_of(request):
    from lowvram.check.builders import tiny_vision_config
    from lowvram.testing import build_processor, build_vision_tokenizer

    family = request.param
    tok = build_vision_tokenizer(family)
    kw = {"patch_size": 14 if family == "qwen2_5_vl" else 16} if family.startswith("qwen") else {}
    cfg = tiny_vision_config(family, tok, **kw)
    return family, build_processor(cfg, tok), cfg


def test_measured_tokens_are_what_the_processor_puts_in_the_sequence(tmp_path, processor_of):
    """Every generated image's measured tokens equal the image tokens the processor itself expands
    the image into (and, Qwen-VL, its image_grid_thw over merge^2); a row's tokens are the rows
    training tokenizes."""
    from PIL import Image

    family, processor, cfg = processor_of
    data = write_data(tmp_path)
    image_token = cfg.image_token_id if family.startswith("qwen") else cfg.image_token_index
    expands = family != "mllama"
    recipe = Recipe.model_validate({"model": {"name_or_path": "unused"},
                                    "data": {"datasets": [{"path": str(data), "format": "image_chat"}],
                                             "images_per_row": 2}, "training": {"seq_len": 1024}})
    spec = recipe.data.datasets[0]
    measure = ImageMeasure(recipe, processor, image_token, expands=expands)
    measure.add(load_rows(recipe, spec, spec.split, None), spec)
    report = measure.report()
    assert not measure.problems and [i.image for i in report.images] == [f"images/im{i}.png" for i in (0, 1, 2, 3)]
    for cost, (w, h) in zip(report.images, SIZES, strict=True):
        assert (cost.width, cost.height) == (w, h)
        img = Image.new("RGB", (w, h))
        out = processor(text=[processor.image_token], images=[[img]], return_tensors="np")
        assert cost.tokens == int((out["input_ids"][0] == image_token).sum())
        if family.startswith("qwen"):
            assert cost.tokens == int(out["image_grid_thw"][0].prod()) // processor.image_processor.merge_size ** 2
    tokens = [c.tokens for c in report.images]
    if family == "qwen2_5_vl":
        assert tokens == QWEN25_TOKENS
    elif family in ("gemma3", "llava"):  # fixed tokens per image: the tower's
        assert tokens == [4 if family == "gemma3" else 16] * 4
    elif family == "mllama":  # one <|image|> token; the tiles reach the text through cross-attention
        assert tokens == [1] * 4
    rows = [sum(c.tokens for c in report.images if c.where == f"vqa.jsonl:{n}") for n in (1, 2, 3)]
    assert [r.image_tokens for r in measure.rows] == (rows if expands else [1, 2, 1])
    assert report.max_images_per_row == 2
    # the plan's measure (headers only, no row rendered) agrees: 2 images a row, the fullest row's
    # image tokens, the costliest image
    assert data_image_extent(recipe, processor, expands) == (2, max(rows) if expands else 2, max(tokens))


def test_max_pixels_changes_the_measure_as_it_changes_the_processor():
    """data.max_pixels as the run sets it on the processor (size.longest_edge): the measure follows
    smart_resize (the 640 x 480 image: 391 tokens; under 28^2 x 100 px, floored to 224 x 308 px:
    8 x 11 = 88), as the processor itself expands it."""
    from PIL import Image

    from lowvram.check.builders import tiny_vision_config
    from lowvram.testing import build_vision_tokenizer, qwen_vl_processor

    tok = build_vision_tokenizer("qwen2_5_vl")
    cfg = tiny_vision_config("qwen2_5_vl", tok, patch_size=14)
    small = qwen_vl_processor(cfg, tok, max_pixels=28 * 28 * 100)
    assert image_token_counts(small, [(480, 640)]) == [88]
    out = small(text=[small.image_token], images=[[Image.new("RGB", (640, 480))]], return_tensors="np")
    assert out["image_grid_thw"].tolist() == [[1, 16, 22]] and (out["input_ids"][0] == cfg.image_token_id).sum() == 88
    assert image_token_counts(qwen_vl_processor(cfg, tok), [(480, 640)]) == [391]


def test_data_json_reports_each_image_and_the_longest_row(tmp_path, qwen_dir):
    result = cli("data", str(write_recipe(qwen_dir, tmp_path)), "--json", "-n", "1")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    im = data["images"]
    assert set(im) == {"processor", "min_pixels", "max_pixels", "seq_len", "rows", "images", "max_images_per_row",
                       "min_image_tokens", "median_image_tokens", "max_image_tokens", "longest_row", "over_seq_len"}
    assert set(im["images"][0]) == {"where", "image", "width", "height", "tokens"}
    assert set(im["longest_row"]) == {"where", "tokens", "image_tokens", "images", "outcome"}
    assert im["processor"] == "Qwen2_5_VLProcessor" and (im["min_pixels"], im["max_pixels"]) == (56 * 56, 28 * 28 * 1280)
    assert [(i["where"], i["tokens"]) for i in im["images"]] == [
        ("vqa.jsonl:1", 4), ("vqa.jsonl:2", 44), ("vqa.jsonl:2", 36), ("vqa.jsonl:3", 391)]
    assert (im["max_images_per_row"], im["max_image_tokens"], im["over_seq_len"]) == (2, 391, [])
    longest = im["longest_row"]
    assert (longest["where"], longest["image_tokens"], longest["images"]) == ("vqa.jsonl:3", 391, 1)
    assert data["tokens"]["max_tokens"] == longest["tokens"] and data["tokens"]["samples"] == 3
    assert "<391 image tokens>" not in json.dumps(data["samples"])  # the sample shown is row 1's
    shown = "".join(f"[[{text}]]" if trained else text for text, trained in data["samples"][0]["pieces"])
    assert shown == ("<|im_start|>user\n<|vision_start|><4 image tokens><|vision_end|>What?<|im_end|>\n"
                     "<|im_start|>assistant\n[[A thing.<|im_end|>\n]]")


def test_validate_names_rows_over_seq_len_by_file_and_row(tmp_path, qwen_dir):
    """Row 3 (391 image tokens, then its answer): at seq_len 420 its answer is cut (as a text row's
    is), at 405 nothing trained is left (dropped), at 300 the cut falls inside its image: refused,
    by file and row (skipped and counted with data.skip_bad_rows)."""
    longest = json.loads(cli("data", str(write_recipe(qwen_dir, tmp_path)), "--json", "-n", "0").stdout)
    n = longest["images"]["longest_row"]["tokens"]
    result = cli("validate", str(write_recipe(qwen_dir, tmp_path, seq_len=420)))
    assert result.exit_code == 0, result.output
    assert f"longest image row: vqa.jsonl:3, {n} tokens (391 image + {n - 391} text, 1 image(s)); seq_len 420" in result.output
    assert f"over seq_len 420: vqa.jsonl:3, {n} tokens (391 image): cut after its images" in result.output
    assert "│ vqa.jsonl:3 │ images/im3.png │ 640 x 480 │    391 │" in result.output
    out = json.loads(cli("validate", str(write_recipe(qwen_dir, tmp_path, seq_len=405)), "--json").stdout)
    assert [(r["where"], r["outcome"]) for r in out["data"]["images"]["over_seq_len"]] == [("vqa.jsonl:3", "dropped")]
    assert out["data"]["images"]["longest_row"]["where"] == "vqa.jsonl:2"  # row 3 is not trained on
    assert out["data"]["tokens"]["dropped"] == 1
    result = cli("validate", str(write_recipe(qwen_dir, tmp_path, seq_len=300)))
    assert result.exit_code == 1
    assert (f"error: vqa.jsonl:3: the row is {n} tokens, and training.seq_len 300 would cut into its images' "
            "391 tokens") in result.stderr
    assert "hint: raise training.seq_len" in result.stderr
    out = json.loads(cli("data", str(write_recipe(qwen_dir, tmp_path, seq_len=300, skip_bad_rows=True)),
                         "--json").stdout)
    assert [(r["where"], r["outcome"]) for r in out["images"]["over_seq_len"]] == [("vqa.jsonl:3", "skipped")]
    assert out["images"]["longest_row"]["where"] == "vqa.jsonl:2"


# --------------------------------------------------------------------------------------------
# The plan sized for the data's images (lowvram train, lowvram plan RECIPE)


def test_train_plans_for_the_images_the_data_has(tmp_path, qwen_dir):
    """Rows of 1 and 2 images, the fullest 391 image tokens: `lowvram train --dry-run` (the plan
    the run uses) and `lowvram plan RECIPE` count 2 images a row of 196 tokens (392 >= 391), not 2
    of the 1280 data.max_pixels allows, and say so; the same request planned by hand gives the
    same peak, and the bound's plan is larger."""
    from lowvram.planning.entry import plan_for_recipe
    from lowvram.recipe import load_recipe
    from lowvram.train.run.preflight import measured_images

    path = write_recipe(qwen_dir, tmp_path, seq_len=2048)
    assert measured_images(load_recipe(path)) == (2, 196)
    result = cli("train", str(path), "--dry-run", "--json", "--vram", "8GB")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["plan"]
    assert plan["reasons"]["images"].startswith("sized on the data, measured under the model's processor: up to 2 "
                                                "image(s) a row, 196 tokens each (392 a row")
    shown = json.loads(cli("plan", str(path), "--json", "--vram", "8GB").stdout)
    assert shown["reasons"]["images"] == plan["reasons"]["images"] and shown["images_per_row"] == 2
    assert shown["vision"]["image"]["tokens_per_image"] == 196
    r = load_recipe(path)
    assert plan_for_recipe(r, vram="8GB", images=(2, 196)).predicted_peak_bytes == plan["predicted_peak_bytes"]
    with pytest.raises(LowvramError, match=r"2 x 1280 tokens per image .* leave no room for text in training.seq_len 2048"):
        plan_for_recipe(r, vram="8GB")  # without the measure: 2 images of the limits' 1280 tokens
    longer = load_recipe(path, ["training.seq_len=4096"])
    bound = plan_for_recipe(longer, vram="8GB")
    assert "images" not in bound.reasons
    assert bound.predicted_peak_bytes > plan_for_recipe(longer, vram="8GB", images=(2, 196)).predicted_peak_bytes
    human = cli("train", str(path), "--dry-run", "--vram", "8GB").output
    assert "images" in human and "measured" in human and "196 tokens each" in " ".join(human.split())


def test_eager_attention_sizes_each_image_as_the_costliest(tmp_path, qwen_dir):
    """The tower's eager scores are per image: with attention eager every image is the costliest."""
    from lowvram.recipe import load_recipe
    from lowvram.train.run.preflight import measured_images

    path = write_recipe(qwen_dir, tmp_path, seq_len=2048)
    assert measured_images(load_recipe(path, ["techniques.attention=eager"])) == (2, 391)


@pytest.mark.slow
def test_a_run_peaks_where_the_data_sized_plan_says(tmp_path, qwen_dir):
    """`lowvram train` on rows of the 640 x 480 image (391 tokens): planned for 1 image of 391
    tokens a row (not the limits' 1280), and the CPU run's live tensor peak is the plan's at the
    longest row (measured: 45.1 MiB both, 2026-12-06)."""
    rows = (qwen_dir / "vqa.jsonl").read_text().splitlines()
    (tmp_path / "images").symlink_to(qwen_dir / "images")
    (tmp_path / "big.jsonl").write_text((rows[2] + "\n") * 8)
    doc = {"model": {"name_or_path": str(qwen_dir / "model")},
           "data": {"datasets": [{"path": "big.jsonl", "format": "image_chat"}], "images_per_row": 2},
           "training": {"seq_len": 1024, "batch_size": 2, "max_steps": 2, "save_steps": 100,
                        "output_dir": str(tmp_path / "run")},
           "techniques": {"lora": "off", "gradient_checkpointing": "off"}}
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps(doc))
    result = cli("train", str(path), "--json")
    assert result.exit_code == 0, result.output
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["reasons"]["images"].startswith("sized on the data, measured under the model's processor: up to 1 "
                                                "image(s) a row, 391 tokens each")
    assert abs(m["peak_memory_bytes"] / m["predicted_peak_bytes_at_data"] - 1) < 0.03
