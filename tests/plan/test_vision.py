"""The vision tower / projector parameter counts against the real transformers models (meta)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lowvram.plan.vision import projector_numel, tower_numel, vision_spec_from_config  # noqa: E402

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)


def _counts(model_cls, cfg_cls, cfg):
    with torch.device("meta"):
        m = model_cls(cfg_cls.from_dict(cfg))
    inner = m.model
    return (sum(p.numel() for p in inner.vision_tower.parameters()),
            sum(p.numel() for p in inner.multi_modal_projector.parameters()))


@pytest.mark.parametrize("use_head", [False, True])
def test_gemma3_tower_and_projector_exact(use_head):
    cfg = dict(model_type="gemma3", mm_tokens_per_image=16,
               text_config=dict(model_type="gemma3_text", **TEXT),
               vision_config=dict(model_type="siglip_vision_model", hidden_size=48,
                                  intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, image_size=64, patch_size=8,
                                  vision_use_head=use_head))
    tower, proj = _counts(transformers.Gemma3ForConditionalGeneration, transformers.Gemma3Config,
                          cfg)
    v = vision_spec_from_config(cfg, "tiny", text_hidden_size=64)
    assert (tower_numel(v), projector_numel(v)) == (tower, proj)
    assert v.tokens_per_image == 16


@pytest.mark.parametrize("strategy,layer", [("default", -2), ("full", [-2, -1])])
def test_llava_tower_and_projector_exact(strategy, layer):
    cfg = dict(model_type="llava", vision_feature_select_strategy=strategy,
               vision_feature_layer=layer, text_config=dict(model_type="llama", **TEXT),
               vision_config=dict(model_type="clip_vision_model", hidden_size=48,
                                  intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, image_size=64, patch_size=8))
    tower, proj = _counts(transformers.LlavaForConditionalGeneration, transformers.LlavaConfig,
                          cfg)
    v = vision_spec_from_config(cfg, "tiny", text_hidden_size=64)
    assert (tower_numel(v), projector_numel(v)) == (tower, proj)
    assert v.tokens_per_image == 64 + (strategy == "full")


def test_unmodelled_family_refused():
    from lowvram.errors import ModelError

    with pytest.raises(ModelError, match="mllama"):
        vision_spec_from_config({"model_type": "mllama", "vision_config": {}}, "x", 64)


@pytest.mark.parametrize("family", ["gemma3", "llava"])
def test_whole_model_count_exact(family):
    """language model (text_config spec) + tower + projector == the whole model's parameters."""
    from lowvram.plan.models import count_parameters
    from lowvram.plan.readers import multimodal_specs_from_config

    tower_kind = "siglip_vision_model" if family == "gemma3" else "clip_vision_model"
    cfg = dict(model_type=family,
               text_config=dict(model_type="gemma3_text" if family == "gemma3" else "llama",
                                **TEXT),
               vision_config=dict(model_type=tower_kind, hidden_size=48, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4, image_size=64,
                                  patch_size=8, vision_use_head=False))
    if family == "gemma3":
        cls, cfg_cls = transformers.Gemma3ForConditionalGeneration, transformers.Gemma3Config
    else:
        cls, cfg_cls = transformers.LlavaForConditionalGeneration, transformers.LlavaConfig
    with torch.device("meta"):
        m = cls(cfg_cls.from_dict(cfg))
    spec, v = multimodal_specs_from_config(cfg, "tiny")
    assert count_parameters(spec) + tower_numel(v) + projector_numel(v) == sum(
        p.numel() for p in m.parameters())
