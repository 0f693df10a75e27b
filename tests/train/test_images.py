"""Issue 29 item 3: image + text data (format image_chat) through the model's processor: labels,
pixel values per batch, errors by file and row, and tiny Gemma-3 and Llava runs at their plan."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from lowvram.check.builders import tiny_vision_config  # noqa: E402
from lowvram.difftest import Case, made_images, run_case  # noqa: E402
from lowvram.errors import DataError, LowvramError  # noqa: E402
from lowvram.recipe import Recipe  # noqa: E402
from lowvram.testing import build_processor, build_vision_tokenizer, write_image_chat  # noqa: E402
from lowvram.train.data.build import ImageInputs, build_datasets  # noqa: E402
from lowvram.train.data.collate import make_collator  # noqa: E402
from lowvram.train.data.images import make_image_collator  # noqa: E402
from lowvram.train.types import IGNORE_INDEX  # noqa: E402


@pytest.fixture(scope="module", params=["gemma3", "llava"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def processor_of(family):
    tok = build_vision_tokenizer(family)
    cfg = tiny_vision_config(family, tok)
    return build_processor(cfg, tok), cfg


def _recipe(data: Path, **data_keys) -> Recipe:
    r = Recipe.model_validate({
        "model": {"name_or_path": "unused"},
        "data": {"datasets": [{"path": str(data), "format": "image_chat"}], **data_keys},
        "training": {"seq_len": 256},
    })
    return r


def _bundle(processor_of, data: Path, **data_keys):
    processor, cfg = processor_of
    return build_datasets(_recipe(data, **data_keys), processor.tokenizer, ImageInputs(processor, cfg.image_token_id))


def test_labels_are_the_assistant_turns_and_never_an_image_token(tmp_path, processor_of):
    processor, cfg = processor_of
    data = write_image_chat(tmp_path / "vqa.jsonl", rows=3)
    bundle = _bundle(processor_of, data)
    tok = processor.tokenizer
    per_image = cfg.mm_tokens_per_image if cfg.model_type == "gemma3" else (
        (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2)
    row = json.loads(data.read_text().splitlines()[0])
    for ids, labels, images in zip(bundle.train["input_ids"], bundle.train["labels"], bundle.train["images"],
                                   strict=True):
        assert ids.count(cfg.image_token_id) == per_image  # the processor expanded the one image
        assert all(lab == IGNORE_INDEX for i, lab in zip(ids, labels, strict=True) if i == cfg.image_token_id)
        trained = tok.decode([lab for lab in labels if lab != IGNORE_INDEX])
        assert trained.endswith("<|im_end|>\n") and "What is in the picture" not in trained  # user turn untrained
        assert [Path(p).name for p in images] and all(Path(p).is_file() for p in images)
    first = tok.decode([lab for lab in bundle.train["labels"][0] if lab != IGNORE_INDEX])
    assert first == row["messages"][1]["content"][0]["text"] + "<|im_end|>\n"  # the template's turn end


def test_the_collator_makes_pixel_values_per_batch(tmp_path, processor_of):
    processor, cfg = processor_of
    bundle = _bundle(processor_of, write_image_chat(tmp_path / "vqa.jsonl", rows=2))
    collate = make_image_collator(processor, cfg.image_token_id, make_collator(processor.tokenizer))
    batch = collate([bundle.train[0], bundle.train[1]])
    side = cfg.vision_config.image_size
    assert tuple(batch["pixel_values"].shape) == (2, 3, side, side)
    assert batch["pixel_values"].dtype == torch.float32
    assert "images" not in batch
    if cfg.model_type == "gemma3":  # its bidirectional attention over each image
        assert torch.equal(batch["token_type_ids"], (batch["input_ids"] == cfg.image_token_id).long())
        assert int(batch["token_type_ids"].sum()) == 2 * cfg.mm_tokens_per_image
    else:
        assert "token_type_ids" not in batch


def _one_row(tmp_path: Path, images: list[str], parts: int = 1) -> Path:
    data = tmp_path / "rows.jsonl"
    good = write_image_chat(tmp_path / "good.jsonl", rows=1)
    row = json.loads(good.read_text())
    row["messages"][0]["content"] = [{"type": "image"}] * parts + [{"type": "text", "text": "What?"}]
    row["images"] = images
    data.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    return data


def _error(processor_of, data: Path, **keys) -> DataError:
    with pytest.raises(DataError) as e:
        _bundle(processor_of, data, **keys)
    return e.value


def test_a_missing_image_names_its_file_and_row(tmp_path, processor_of):
    e = _error(processor_of, _one_row(tmp_path, ["images/nope.png"]))
    assert str(e).startswith("rows.jsonl:1: image file not found: 'images/nope.png'")
    assert "relative to the data file" in e.hint


def test_a_corrupt_image_names_its_file_and_row(tmp_path, processor_of):
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    e = _error(processor_of, _one_row(tmp_path, ["bad.png"]))
    assert str(e).startswith("rows.jsonl:1: image 'bad.png' cannot be opened as an image")
    assert "valid PNG" in e.hint


def test_a_too_large_image_names_its_size(tmp_path, processor_of, monkeypatch):
    import lowvram.train.data.images as images

    monkeypatch.setattr(images, "IMAGE_MAX_PIXELS", 40 * 40)
    e = _error(processor_of, _one_row(tmp_path, ["images/image_0.png"]))
    assert str(e) == ("rows.jsonl:1: image 'images/image_0.png' is 48 x 48 = 2,304 pixels, over the limit "
                      "of 1,600 (4096 x 4096)")
    assert "resize it" in e.hint


def test_placeholders_and_images_must_agree(tmp_path, processor_of):
    e = _error(processor_of, _one_row(tmp_path, ["images/image_0.png"], parts=2))
    assert str(e).startswith("rows.jsonl:1: 2 image placeholder(s) in the messages")
    assert "but 1 image(s) in 'images'" in str(e)
    e = _error(processor_of, _one_row(tmp_path, ["images/image_0.png", "images/image_0.png"], parts=2))
    assert "more than data.images_per_row (1)" in str(e)
    assert "raise data.images_per_row to 2" in e.hint


def test_bad_rows_are_skipped_and_counted_when_asked(tmp_path, processor_of):
    data = _one_row(tmp_path, ["images/nope.png"])
    with data.open("a") as f:
        f.write(write_image_chat(tmp_path / "ok.jsonl", rows=1).read_text())
    bundle = _bundle(processor_of, data, skip_bad_rows=True)
    assert bundle.stats.skipped_bad_rows == 2 and bundle.stats.train_rows == 1


def test_image_tokens_are_never_cut(tmp_path, processor_of):
    processor, cfg = processor_of
    data = write_image_chat(tmp_path / "vqa.jsonl", rows=1)
    r = _recipe(data)
    r.training.seq_len = 8  # the image's tokens alone are longer
    with pytest.raises(DataError, match="would cut into its images"):
        build_datasets(r, processor.tokenizer, ImageInputs(processor, cfg.image_token_id))


def test_a_model_without_a_vision_tower_is_refused(tmp_path, tiny_model_dir):
    from types import SimpleNamespace

    from transformers import AutoConfig

    from lowvram.train.build.processor import load_image_inputs

    r = _recipe(write_image_chat(tmp_path / "vqa.jsonl", rows=1))
    model = SimpleNamespace(config=AutoConfig.from_pretrained(tiny_model_dir))
    with pytest.raises(DataError) as e:
        load_image_inputs(r, str(tiny_model_dir), model)
    assert "format image_chat needs a model with a vision tower" in str(e.value)
    assert "model_type llama" in str(e.value)
    with pytest.raises(DataError, match="needs a model with a vision tower"):  # no processor handed in
        build_datasets(r, None, None)


def test_packing_is_refused_with_images(tmp_path):
    with pytest.raises(ValueError, match="data.packing does not apply to format image_chat"):
        _recipe(tmp_path / "x.jsonl", packing=True)


def _case(family: str, method: str, **kw) -> Case:
    base = dict(seed=11, family=family, hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128,
                vocab=512, tie=family == "gemma3", method=method, lora_r=8, precision="fp32",
                seq_len=128, micro_batch_size=2, vision_layers=1, vision_hidden=32, vision_image=32,
                vision_patch=8, cross_layers=1 if family == "mllama" else 0)
    return made_images(Case(**{**base, **kw}))


@pytest.mark.parametrize("family, method", [("gemma3", "lora"), ("llava", "full"), ("mllama", "lora")])
def test_image_recipe_trains_end_to_end_at_its_plan(tmp_path, family, method):
    """`lowvram train` on image + text rows of a tiny Gemma-3 / Llava: the run's peak within the
    plan-truth target, the plan counting the images (images_per_row in plan.json)."""
    out = run_case(_case(family, method), tmp_path)
    assert out.error is None, out.error
    assert out.ok, (out.measured_bytes, out.predicted_bytes, out.ratio)
    from lowvram.planning.entry import plan_for_recipe
    from lowvram.recipe import load_recipe

    recipe = load_recipe(tmp_path / "recipe.yaml")
    assert plan_for_recipe(recipe).predicted_peak_bytes == out.predicted_bytes
    recipe.data.images_per_row += 1  # one more image a row: more pixels, more planned
    assert plan_for_recipe(recipe).predicted_peak_bytes > out.predicted_bytes
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 2 and all(loss == loss for _, loss in metrics["loss_history"])


def test_the_planner_refuses_what_it_cannot_count():
    from lowvram.plan.memory.images import image_problems
    from lowvram.plan.model.readers import spec_from_config

    llama = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, vocab_size=512)
    text = spec_from_config(llama, "tiny")
    assert image_problems(text, 1, 512) == ["format image_chat needs a model with a vision tower (this model has none)"]
    mistral = spec_from_config(dict(model_type="mistral3", text_config={**llama, "model_type": "mistral"},
                                    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                       num_attention_heads=2, image_size=64, patch_size=16)), "m")
    assert "Mistral-3 (Pixtral) is not modelled" in image_problems(mistral, 1, 512)[0]
    qwen = spec_from_config(dict(llama, model_type="qwen2_5_vl",
                                 vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                    patch_size=16, out_hidden_size=64)), "q")
    assert image_problems(qwen, 1, 2048) == []  # dynamic resolution: sized by data.max_pixels (image_size.py)
    assert "the largest image data.max_pixels allows" in image_problems(qwen, 1, 512)[0]  # 16 px patches: 980 tokens
    qwen3 = spec_from_config(dict(model_type="qwen3_vl", text_config={**llama, "model_type": "qwen3_vl_text"},
                                  vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                     patch_size=16, out_hidden_size=64)), "q3")
    assert image_problems(qwen3, 1, 2048) == []
    mllama = spec_from_config(dict(model_type="mllama", text_config={**llama, "model_type": "mllama_text_model",
                                                                     "cross_attention_layers": [1]},
                                   vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      attention_heads=2, image_size=32, patch_size=8)), "ml")
    assert image_problems(mllama, 2, 512) == []  # issue 47: its cross-attention layers are planned
    assert "attention eager" in image_problems(mllama, 1, 512, "eager")[0]
    llava = spec_from_config(dict(model_type="llava", text_config=llama,
                                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=64, patch_size=16)), "l")
    assert llava.vision.tokens_per_image == 16  # (64 / 16)^2, the CLS dropped
    assert image_problems(llava, 2, 512) == []
    assert "leave no room for text in training.seq_len 32" in image_problems(llava, 2, 32)[0]


def test_plan_terms_of_images_exact():
    """Pixels: float32 images x 3 x side^2, for the batch and accelerate's prefetched next one;
    Gemma-3's image masks in every layer."""
    from dataclasses import replace

    from lowvram.plan.memory.activations import masked_layers
    from lowvram.plan.memory.images import pixel_bytes
    from lowvram.plan.model.readers import spec_from_config
    from lowvram.plan.setup import RunSetup

    gemma = spec_from_config(dict(
        model_type="gemma3", mm_tokens_per_image=4,
        text_config=dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=512,
                         sliding_window=512),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8, vision_use_head=False)), "g")
    s = RunSetup(model=gemma, micro_batch_size=2, seq_len=128, attention="sdpa", device="cpu")
    assert pixel_bytes(s) == 0 and masked_layers(s) == 0  # text: is_causal below the window
    s = replace(s, images_per_row=2)
    assert pixel_bytes(s) == 2 * 4 * (2 * 2) * 3 * 32 * 32
    assert masked_layers(s) == 4


def test_an_image_recipe_plan_names_the_images(tmp_path, tiny_model_dir):
    with pytest.raises(LowvramError, match="needs a model with a vision tower"):
        from lowvram.planning.entry import plan_for_recipe
        from lowvram.recipe import load_recipe

        model = tiny_model_dir  # the session's (read only here)
        data = write_image_chat(tmp_path / "vqa.jsonl", rows=1)
        (tmp_path / "r.yaml").write_text(f"model: {{name_or_path: {model}}}\n"
                                         f"data: {{datasets: [{{path: {data}, format: image_chat}}]}}\n")
        plan_for_recipe(load_recipe(tmp_path / "r.yaml"))


def test_a_placeholder_in_text_counts_as_an_image_part(tmp_path, processor_of):
    """LLaMA-Factory's shape: the processor's placeholder inside text content, images beside it;
    with train_on_inputs the prompt is trained too, the image tokens still never."""
    processor, cfg = processor_of
    write_image_chat(tmp_path / "good.jsonl", rows=1)
    row = {"messages": [{"role": "user", "content": processor.image_token + "What is it?"},
                        {"role": "assistant", "content": "A square."}],
           "images": ["images/image_0.png"]}
    data = tmp_path / "text.jsonl"
    data.write_text(json.dumps(row) + "\n")
    bundle = _bundle(processor_of, data, train_on_inputs=True)
    ids, labels = bundle.train["input_ids"][0], bundle.train["labels"][0]
    assert cfg.image_token_id in ids
    assert [lab for i, lab in zip(ids, labels, strict=True) if i == cfg.image_token_id] == [IGNORE_INDEX] * ids.count(
        cfg.image_token_id)
    assert sum(lab != IGNORE_INDEX for lab in labels) == len(ids) - ids.count(cfg.image_token_id)


def test_a_datasets_image_column_is_read(tmp_path, processor_of):
    """A dataset whose images are datasets' Image feature (a hub dataset's image column; here a
    local Parquet file written by datasets): decoded images, written once as files for the collator."""
    import datasets
    from PIL import Image

    processor, cfg = processor_of
    rows = [json.loads(line) for line in write_image_chat(tmp_path / "vqa.jsonl", rows=2).read_text().splitlines()]
    table = {"messages": [r["messages"] for r in rows],
             "images": [[Image.open(tmp_path / p).convert("RGB") for p in r["images"]] for r in rows]}
    ds = datasets.Dataset.from_dict(table)
    ds = ds.cast_column("images", datasets.Sequence(datasets.Image()))
    ds.to_parquet(str(tmp_path / "vqa.parquet"))
    bundle = _bundle(processor_of, tmp_path / "vqa.parquet")
    paths = [p for row in bundle.train["images"] for p in row]
    assert len(paths) == 2 and all(Path(p).is_file() for p in paths)
    collate = make_image_collator(processor, cfg.image_token_id, make_collator(processor.tokenizer))
    side = cfg.vision_config.image_size
    assert tuple(collate([bundle.train[0], bundle.train[1]])["pixel_values"].shape) == (2, 3, side, side)


def test_the_frozen_tower_stays_out_of_autograd_under_lora_and_checkpointing():
    """transformers' enable_input_require_grads (peft's wrapping, checkpointing a peft model)
    would hook the tower's patch embedding too; lowvram's hooks the language model's only."""
    from transformers import AutoModelForImageTextToText

    from lowvram.train.build.model import freeze_vision, text_input_grads_only

    tok = build_vision_tokenizer("gemma3")
    model = AutoModelForImageTextToText.from_config(tiny_vision_config("gemma3", tok))
    model.requires_grad_(False)
    freeze_vision(model)
    text_input_grads_only(model)
    model.enable_input_require_grads()
    model.enable_input_require_grads()  # again, as the Trainer's train() does: still one hook
    assert len(model._require_grads_hooks) == 1
    features = model.model.get_image_features(pixel_values=torch.randn(1, 3, 32, 32)).pooler_output
    assert not features.requires_grad  # no graph through the frozen tower
    assert model.get_input_embeddings()(torch.tensor([[1, 2]])).requires_grad


REPO = Path(__file__).resolve().parents[2]


def test_the_shipped_image_data_is_what_its_script_makes(tmp_path):
    import runpy
    import sys

    from PIL import Image, ImageChops

    out = tmp_path / "lowvram_shapes.jsonl"
    argv, sys.argv = sys.argv, ["make_lowvram_shapes.py", str(out)]
    try:
        runpy.run_path(str(REPO / "recipes/data/make_lowvram_shapes.py"), run_name="__main__")
    finally:
        sys.argv = argv
    shipped = REPO / "recipes/data/lowvram_shapes.jsonl"
    assert out.read_text() == shipped.read_text()
    for row in map(json.loads, shipped.read_text().splitlines()):
        for name in row["images"]:
            a, b = Image.open(shipped.parent / name), Image.open(out.parent / name)
            assert ImageChops.difference(a.convert("RGB"), b.convert("RGB")).getbbox() is None


def test_the_shipped_image_recipe_data_builds_with_a_gemma3_processor():
    """recipes/gemma-3-4b-vision-qlora.yaml's data through a tiny Gemma-3 processor: every row one
    image, its answer the trained tokens."""
    from lowvram.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes/gemma-3-4b-vision-qlora.yaml")
    tok = build_vision_tokenizer("gemma3")
    cfg = tiny_vision_config("gemma3", tok)
    bundle = build_datasets(recipe, tok, ImageInputs(build_processor(cfg, tok), cfg.image_token_id))
    assert bundle.stats.train_rows == 24 and bundle.stats.truncated == 0
    assert all(len(images) == 1 for images in bundle.train["images"])


def test_a_wide_tower_under_lora_and_checkpointing_stays_at_its_plan(tmp_path):
    """A 256-wide SigLIP tower, two images a row, LoRA with checkpointing: 64% above its plan while
    transformers' enable_input_require_grads hooked the tower (train.build.vision.text_input_grads_only)."""
    case = Case(seed=901, family="gemma3", hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vocab=512,
                tie=True, method="lora", precision="fp32", seq_len=256, micro_batch_size=4, vision_layers=2,
                vision_hidden=256, vision_image=64, vision_patch=4, images=2, gradient_checkpointing=True)
    out = run_case(case, tmp_path)
    assert out.error is None, out.error
    assert out.ok, (out.measured_bytes, out.predicted_bytes, out.ratio)


def test_mllama_collator_makes_tiles_and_the_cross_attention_mask(tmp_path):
    """Llama-3.2-Vision: one <|image|> token an image (never a label), the tiles and the
    cross_attention_mask from MllamaProcessor's own functions, and the LoRA run trains the
    cross-attention layers (adapters on them, a gradient in the step)."""
    tok = build_vision_tokenizer("mllama")
    cfg = tiny_vision_config("mllama", tok)
    processor = build_processor(cfg, tok)
    data = write_image_chat(tmp_path / "vqa.jsonl", rows=4, side=48)
    images = ImageInputs(processor, cfg.image_token_index, cross_attention=True)
    bundle = build_datasets(_recipe(data), tok, images)
    ids = bundle.train[0]["input_ids"]
    assert ids.count(cfg.image_token_index) == 1
    labels = bundle.train[0]["labels"]
    assert labels[ids.index(cfg.image_token_index)] == IGNORE_INDEX
    collate = make_image_collator(processor, cfg.image_token_index, make_collator(tok), cross_attention=True)
    batch = collate([dict(r) for r in bundle.train.select(range(2))])
    tiles = cfg.vision_config.max_num_tiles
    assert tuple(batch["pixel_values"].shape) == (2, 1, tiles, 3, 32, 32)
    assert tuple(batch["cross_attention_mask"].shape) == (2, batch["input_ids"].shape[1], 1, tiles)
    start = batch["input_ids"][0].tolist().index(cfg.image_token_index)
    assert batch["cross_attention_mask"][0, :start].sum() == 0 and batch["cross_attention_mask"][0, start:, 0, 0].all()
    model = transformers_model(cfg)
    out = model(**{k: v for k, v in batch.items() if k != "rows"})
    assert out.loss is not None and torch.isfinite(out.loss)


def transformers_model(cfg):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(cfg)


def test_mllama_images_make_the_cross_attention_layers_trainable():
    """Text data: the cross-attention layers stay frozen, no adapters; image data: they train."""
    from types import SimpleNamespace

    from lowvram.train.build.model import prepare_model

    tok = build_vision_tokenizer("mllama")
    cfg = tiny_vision_config("mllama", tok)
    plan = SimpleNamespace(lora=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_use_dora=False,
                           lora_use_rslora=False, lora_init="default", lora_targets=("all-linear",),
                           quantization="none", gradient_checkpointing=False, tiled_mlp=False)
    cross = [f"layers.{i}." for i in cfg.text_config.cross_attention_layers]
    for images in (False, True):
        model = prepare_model(transformers_model(cfg), plan, seed=0, images=images)
        adapted = [n for n, p in model.named_parameters() if p.requires_grad and any(c in n for c in cross)]
        assert bool(adapted) == images, adapted
        assert not [n for n, p in model.named_parameters() if p.requires_grad and "vision_model" in n]


def test_mllama_refuses_rows_and_datasets_without_images(tmp_path):
    """Llama-3.2-Vision's image processor takes no row without an image: such a row is an error by
    file and row (skipped with skip_bad_rows), a text dataset beside image_chat ones refused."""
    tok = build_vision_tokenizer("mllama")
    cfg = tiny_vision_config("mllama", tok)
    images = ImageInputs(build_processor(cfg, tok), cfg.image_token_index, cross_attention=True)
    data = write_image_chat(tmp_path / "vqa.jsonl", rows=2)
    text_row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    with open(data, "a") as f:
        f.write(json.dumps(text_row) + "\n")
    with pytest.raises(DataError, match=r"vqa.jsonl:3: a row without an image"):
        build_datasets(_recipe(data), tok, images)
    assert len(build_datasets(_recipe(data, skip_bad_rows=True), tok, images).train) == 2
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps(text_row) + "\n")
    mixed = Recipe.model_validate({"model": {"name_or_path": "unused"}, "training": {"seq_len": 256},
                                   "data": {"datasets": [{"path": str(data), "format": "image_chat"},
                                                         {"path": str(chat), "format": "chat"}]}})
    with pytest.raises(DataError, match="cannot mix text datasets"):
        build_datasets(mixed, tok, images)
