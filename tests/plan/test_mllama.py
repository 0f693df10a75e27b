"""Issue 29: Llama-3.2-Vision (mllama) on text: its tower, projector and the cross-attention layers
the text forward skips, counted against the model transformers builds (meta)."""

import json
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lowvram.plan.model.models import (  # noqa: E402
    count_parameters,
    cross_attention_numel,
    model_numel,
    vision_numel,
)
from lowvram.plan.model.readers import spec_from_config  # noqa: E402

_TINY = dict(
    model_type="mllama",
    text_config=dict(model_type="mllama_text_model", hidden_size=64, intermediate_size=128,
                     num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=512, cross_attention_layers=[1, 3], pad_token_id=0, bos_token_id=1,
                     eos_token_id=2),
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                       attention_heads=2, image_size=32, patch_size=8, vision_output_dim=96,
                       intermediate_layers_indices=[0, 1]))


def _meta_model(cfg: dict):
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        return transformers.AutoModelForImageTextToText.from_config(config)


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_tower_projector_and_cross_attention_layers_exact():
    """The local + gated global ViT (with its tile and gated position embeddings) and the projector
    are vision_numel; the cross-attention layers cross_attention_numel; the rest (Llama's
    self-attention layers, embed_tokens of vocab + 8 rows, lm_head) count_parameters."""
    spec = spec_from_config(_TINY, "tiny-mllama")
    m = _meta_model(_TINY)
    assert type(m).__name__ == "MllamaForConditionalGeneration"
    inner = m.model
    assert vision_numel(spec) == _numel(inner.vision_model) + _numel(inner.multi_modal_projector)
    layers = inner.language_model.layers
    assert spec.num_layers == 3 and spec.cross_attention_layers == (1, 3)
    assert cross_attention_numel(spec) == _numel(layers[1]) + _numel(layers[3])
    assert count_parameters(spec) == _numel(m) - cross_attention_numel(spec) - vision_numel(spec)
    assert model_numel(spec) == _numel(m)
    assert inner.language_model.embed_tokens.num_embeddings == spec.embedding_rows == 512 + 8
    assert spec.model_type == "llama" and not spec.tie_word_embeddings


def test_check_builders_config_rebuilds_the_same_model():
    """check.builders.hf_config (the simulator's and the differential test's config) puts the
    cross-attention layers back at their indices: the same module tree."""
    from lowvram.check.builders import hf_config

    spec = spec_from_config(_TINY, "tiny-mllama")
    cfg = hf_config(spec)
    assert cfg.text_config.cross_attention_layers == [1, 3] and cfg.text_config.num_hidden_layers == 5
    with torch.device("meta"):
        rebuilt = transformers.AutoModelForImageTextToText.from_config(cfg)
    original = _meta_model(_TINY)
    assert {n: p.shape for n, p in rebuilt.named_parameters()} == \
        {n: p.shape for n, p in original.named_parameters()}


def test_the_text_forward_skips_the_cross_attention_layers():
    """What the plan's no-activations rests on (modeling_mllama.py MllamaTextModel.forward: no
    cross_attention_states and no cache -> ``continue``): without images, under training's
    use_cache False, no cross-attention layer runs; every self-attention layer does."""
    from lowvram.train.build.model import no_kv_cache

    config = transformers.AutoConfig.for_model(**_TINY)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    no_kv_cache(model)
    ran = []
    for i, layer in enumerate(model.model.language_model.layers):
        layer.register_forward_hook(lambda mod, args, out, i=i: ran.append(i))
    model.train()
    model(input_ids=torch.randint(0, 500, (2, 8)), labels=torch.randint(0, 500, (2, 8))).loss.backward()
    assert ran == [0, 2, 4]
    cross = model.model.language_model.layers[1]
    assert all(p.grad is None for p in cross.parameters())


# Llama-3.2-Vision's model cards: "Llama 3.2-Vision 11B (10.6B)" and "90B (88.6B)" parameters; the
# 11B figure is the count cut (10.67B), the 90B's rounded (88.59B)
_ADVERTISED = {"llama-3.2-11b-vision": (10.6, 10_670_220_835), "llama-3.2-90b-vision": (88.6, 88_593_355_323)}


@pytest.mark.parametrize("name", sorted(_ADVERTISED))
def test_catalog_entries_count_what_transformers_builds(name):
    from lowvram.check.builders import hf_config
    from lowvram.plan.model.catalog import resolve_model

    spec = resolve_model(name)
    with torch.device("meta"):
        m = transformers.AutoModelForImageTextToText.from_config(hf_config(spec))
    card, exact = _ADVERTISED[name]
    assert model_numel(spec) == _numel(m) == exact
    assert int(model_numel(spec) / 1e8) / 10 == card or round(model_numel(spec) / 1e9, 1) == card
    assert resolve_model(spec.hf_id) == spec
    assert spec.cross_attention_layers == tuple(range(3, spec.num_layers + len(spec.cross_attention_layers), 5))


def test_11b_qlora_on_a_12gb_card_counts_tower_and_cross_attention_layers():
    """Issue 29: `lowvram plan --model meta-llama/Llama-3.2-11B-Vision-Instruct --method qlora
    --vram 12GB` answers with the tower (bf16, not quantized) and the cross-attention layers
    (4-bit, frozen) in the weights, each a line and a breakdown row."""
    from typer.testing import CliRunner

    from lowvram.cli import app
    from lowvram.plan.memory.states import quantized_bytes

    args = ["plan", "--model", "meta-llama/Llama-3.2-11B-Vision-Instruct", "--method", "qlora", "--vram", "12GB"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["fits"] and d["model"] == "llama-3.2-11b-vision"
    v = d["vision"]
    assert (v["tower"], v["layers"], v["parameters"], v["weight_bytes"]) == ("mllama", 40, 895_028_755,
                                                                           2 * 895_028_755)
    cross = v["cross_attention"]
    assert cross["layers"] == 8 and cross["parameters"] == 1_744_898_064 and cross["quantized"]
    h, kv, i = 4096, 1024, 14336
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    q = sum(quantized_bytes(a * b, d["techniques"]["quantization"], b) for a, b in shapes)
    quantized = sum(a * b for a, b in shapes)
    assert cross["weight_bytes"] == 8 * q + 2 * (1_744_898_064 - 8 * quantized)
    assert d["parameters"] == 10_670_220_835 + d["trainable_parameters"]
    text = CliRunner().invoke(app, args).stdout
    assert "vision tower: mllama (40 layers) + mllama projector, 895.0M params" in text
    assert "cross-attention layers: 8 of the language model, 1744.9M params" in text
    assert re.search(r"│\s+cross-attention\s+│", text)


def test_trainable_parameters_leave_the_cross_attention_layers_out():
    """LoRA adapts the self-attention layers only (lowvram.train.build.vision.frozen_modules); full
    fine-tuning trains count_parameters: the cross-attention layers are loaded, not trained."""
    from lowvram.plan.memory.states import gradient_bytes, lora_parameters, weight_bytes
    from lowvram.plan.setup import RunSetup

    spec = spec_from_config(_TINY, "tiny-mllama")
    lora = RunSetup(spec, lora=True, lora_r=4, device="cpu", precision="fp32")
    # r (d_in + d_out) of q, k, v, o, gate, up, down in the 3 self-attention layers only
    assert lora_parameters(lora) == 3 * 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128))
    full = RunSetup(spec, lora=False, device="cpu", precision="fp32")
    assert gradient_bytes(full) == 4 * count_parameters(spec)
    assert weight_bytes(full) == 4 * model_numel(spec)


def test_flash_attention_refused():
    """transformers has no flash-attention path for mllama: refused with error and hint."""
    from typer.testing import CliRunner

    from lowvram.cli import app

    r = CliRunner().invoke(app, ["plan", "--model", "llama-3.2-11b-vision", "--method", "qlora",
                                 "--vram", "24GB", "--attention", "flash_attention_2"])
    assert r.exit_code != 0 and "Traceback" not in r.output, r.output
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and "no flash-attention path" in lines[0], lines
    assert lines[1].startswith("hint: ")


def test_images_train_the_cross_attention_layers_and_are_planned():
    """Issue 47: with images the cross-attention layers run and train: planned as decoder layers
    of the language model (LoRA adapts their Linears, full fine-tuning their weights), plus their
    vision-token terms; the 11B plan answers, and more images a row plan more."""
    from dataclasses import replace

    from lowvram.plan.choose.request import PlanRequest, validate_request
    from lowvram.plan.memory import cross_attention
    from lowvram.plan.memory.memory import estimate_memory
    from lowvram.plan.memory.states import lora_parameters
    from lowvram.plan.model.catalog import resolve_model
    from lowvram.plan.setup import RunSetup

    spec = spec_from_config(_TINY, "tiny-mllama")
    text = RunSetup(spec, lora=True, lora_r=4, device="cpu", precision="fp32", seq_len=64)
    images = replace(text, images_per_row=1)
    active = cross_attention.active_setup(images)
    assert (active.model.num_layers, active.cross_layers, active.model.cross_attention_layers) == (5, (1, 3), ())
    assert lora_parameters(active) == lora_parameters(text) * 5 // 3
    assert cross_attention.vision_tokens(active) == 4 * (16 + 1)  # 4 tiles of 32 px in 8 px patches + CLS
    assert estimate_memory(images).peak_bytes > estimate_memory(text).peak_bytes
    two = estimate_memory(replace(images, images_per_row=2)).peak_bytes
    assert two > estimate_memory(images).peak_bytes
    validate_request(PlanRequest(model=resolve_model("llama-3.2-11b-vision"), images_per_row=1))


def test_eager_attention_with_images_refused():
    """Eager attention's scores over the tiles in every cross layer are not counted: refused."""
    from lowvram.errors import LowvramError
    from lowvram.plan.choose.request import PlanRequest, validate_request
    from lowvram.plan.model.catalog import resolve_model

    with pytest.raises(LowvramError, match="attention eager with Llama-3.2-Vision images is not modelled") as e:
        validate_request(PlanRequest(model=resolve_model("llama-3.2-11b-vision"), images_per_row=1,
                                     attention="eager"))
    assert "attention sdpa" in e.value.hint


def test_11b_plan_answers_with_images(tmp_path):
    """Issue 47 item 5: `lowvram plan RECIPE` for Llama-3.2-11B-Vision QLoRA with image_chat data
    answers on a 24 GB card: the cross-attention layers trained, more images a row more memory."""
    from typer.testing import CliRunner

    from lowvram.cli import app
    from lowvram.testing import write_image_chat

    data = write_image_chat(tmp_path / "vqa.jsonl", rows=2)

    def plan(images: int) -> dict:
        recipe = tmp_path / f"r{images}.yaml"
        recipe.write_text("model: {name_or_path: llama-3.2-11b-vision}\n"
                          f"data: {{datasets: [{{path: {data}, format: image_chat}}], images_per_row: {images}}}\n"
                          "training: {seq_len: 2048, batch_size: 8}\n"
                          "techniques: {lora: on, quantization: nf4-dq}\n")
        r = CliRunner().invoke(app, ["plan", str(recipe), "--vram", "24GB", "--json"])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    one, two = plan(1), plan(2)
    assert one["fits"] and one["images_per_row"] == 1 and one["techniques"]["attention"] == "sdpa"
    assert one["vision"]["cross_attention"]["trained"]
    assert two["peak_bytes"] > one["peak_bytes"]
