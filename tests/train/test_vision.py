"""Issue 29 items 2 and 6: a checkpoint with a vision tower (Gemma-3, Llava) trains on text through
`lowvram train`, the tower frozen, never adapted and never quantized, at the plan's peak."""

import json

import pytest

torch = pytest.importorskip("torch")

from lowvram.difftest import Case, run_case  # noqa: E402


def _case(family: str, method: str, **kw) -> Case:
    base = dict(seed=7, family=family, hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128,
                vocab=512, tie=family == "gemma3", method=method, lora_r=8, precision="fp32",
                seq_len=128, micro_batch_size=2, vision_layers=2, vision_hidden=32, vision_image=64,
                vision_patch=16)
    return Case(**{**base, **kw})


def _assert_only_the_text_model_trained(run, base, method: str, tower_markers: tuple[str, ...],
                                        class_name: str | None = None) -> list[str]:
    """Full fine-tuning left every tower tensor (a state_dict key with one of ``tower_markers``)
    as it was in ``base``; LoRA and QLoRA saved no adapter on one. Returns the adapter's keys
    (empty under full fine-tuning)."""
    def tower(folder):
        from lowvram.train.build.model import model_class

        m = model_class(True).from_pretrained(folder)
        if class_name:
            assert type(m).__name__ == class_name
        return {k: v for k, v in m.state_dict().items() if any(t in k for t in tower_markers)}

    if method == "full":
        trained, before = tower(run), tower(base)
        assert trained and trained.keys() == before.keys()
        assert all(torch.equal(trained[k], before[k]) for k in trained)  # not trained
        return []
    from safetensors import safe_open

    with safe_open(str(run / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not [k for k in keys if any(t in k for t in tower_markers)]
    return keys


@pytest.mark.parametrize("family, method", [("gemma3", "lora"), ("llava", "qlora"), ("gemma3", "full")])
def test_text_recipe_trains_at_its_plan_with_the_tower_frozen(tmp_path, family, method):
    out = run_case(_case(family, method), tmp_path)
    assert out.error is None, out.error
    assert out.ok, (out.measured_bytes, out.predicted_bytes, out.ratio)
    run = tmp_path / "run"
    plan = json.loads((run / "plan.json").read_text())
    _assert_only_the_text_model_trained(run, tmp_path / "model", method, ("vision_tower", "multi_modal_projector"))
    assert plan["lora"] == (method != "full")


def test_qlora_keeps_the_tower_out_of_bitsandbytes():
    """lowvram's BitsAndBytesConfig skips the tower and projector (train.model.quantization_config):
    the language model's Linears are 4-bit, the tower's stay torch Linears."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from lowvram.check.builders import build_model
    from lowvram.plan.model.readers import spec_from_config
    from lowvram.plan.setup import RunSetup

    cfg = dict(model_type="llava",
               text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                vocab_size=512),
               vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=16))
    spec = spec_from_config(cfg, "tiny-llava")
    model = build_model(RunSetup(spec, quantization="nf4-dq", lora=True, lora_r=4, device="cpu",
                                 precision="fp32"))
    from lowvram.plan.memory.states import vision_weight_bytes

    setup = RunSetup(spec, quantization="nf4-dq", lora=True, lora_r=4, device="cpu", precision="fp32")
    held = sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
               if "vision_tower" in n or "multi_modal_projector" in n)
    assert held == vision_weight_bytes(setup)  # exact: fp32 weights + the position_ids buffer
    names = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    tower = [n for n in names if "vision_tower" in n or "multi_modal_projector" in n]
    language = [n for n in names if "language_model" in n and n.endswith("base_layer")]
    assert tower and all(names[n] is torch.nn.Linear for n in tower)
    assert language and all(issubclass(names[n], bnb.nn.Linear4bit) for n in language)


@pytest.mark.parametrize("family", ["llava", "gemma3", "mistral3"])
def test_training_builds_no_kv_cache_on_a_multimodal_model(family):
    """Issue 29: the language model reads its text config's use_cache, which the top-level flag
    does not set; left on, a DynamicCache copied every layer's keys and values in the forward
    (held-out vision seed 110, Llava QLoRA packed, was +3.41% over its plan; +0.33% without)."""
    from lowvram.difftest import _config
    from lowvram.train.build.model import has_vision, model_class, no_kv_cache

    case = _case(family, "lora", vision_layers=1)
    model = model_class(True).from_config(_config(case, 512, 0, 1))
    assert has_vision(model.config) and model.config.get_text_config().use_cache
    no_kv_cache(model)
    assert model.config.use_cache is False and model.config.get_text_config().use_cache is False
    model.train()
    out = model(input_ids=torch.randint(2, 500, (2, 16)))
    assert out.past_key_values is None


_QWEN_VL_CLASSES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}


@pytest.mark.parametrize("family", sorted(_QWEN_VL_CLASSES))
@pytest.mark.parametrize("method", ["lora", "qlora", "full"])
def test_qwen_vl_text_recipe_trains_at_its_plan_with_model_visual_frozen(tmp_path, family, method):
    """Qwen2.5-VL and Qwen3-VL (tower, merger and Qwen3-VL's deepstack mergers under
    model.visual): text through `lowvram train` at the plan's peak; full fine-tuning leaves
    model.visual as it was, LoRA and QLoRA adapt none of it (Qwen2.5-VL's MLP's gate/up/down_proj
    share the language model's names)."""
    case = _case(family, method, tie=method == "lora", lora_targets="all-linear")
    out = run_case(case, tmp_path)
    assert out.error is None, out.error
    assert out.ok, (out.measured_bytes, out.predicted_bytes, out.ratio)
    run = tmp_path / "run"
    plan = json.loads((run / "plan.json").read_text())
    assert "vision tower" in plan["reasons"]["tiled_mlp"]  # planned with model.visual loaded
    keys = _assert_only_the_text_model_trained(run, tmp_path / "model", method, ("visual",),
                                               _QWEN_VL_CLASSES[family])
    if method != "full":
        assert [k for k in keys if "mlp.gate_proj" in k]  # the language model's are adapted


_TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=512)
_TINY_QWEN_VL = {
    "qwen2_5_vl": dict(model_type="qwen2_5_vl", **_TINY_TEXT,
                       vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                          patch_size=16, out_hidden_size=64)),
    "qwen3_vl": dict(model_type="qwen3_vl", text_config=dict(model_type="qwen3_vl_text", head_dim=32, **_TINY_TEXT),
                     vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                                        out_hidden_size=64, num_position_embeddings=16,
                                        deepstack_visual_indexes=[0, 1])),
}


@pytest.mark.parametrize("family", sorted(_TINY_QWEN_VL))
def test_qwen_vl_qlora_keeps_model_visual_out_of_bitsandbytes(family):
    """lowvram's BitsAndBytesConfig skips model.visual: its Linears (Qwen3-VL's deepstack mergers
    too) stay torch Linears, held at what states.vision_weight_bytes plans (weights + the rotary
    buffers), to the byte."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from lowvram.check.builders import build_model
    from lowvram.plan.memory.states import vision_weight_bytes
    from lowvram.plan.model.readers import spec_from_config
    from lowvram.plan.setup import RunSetup

    spec = spec_from_config(_TINY_QWEN_VL[family], f"tiny-{family}")
    setup = RunSetup(spec, quantization="nf4-dq", lora=True, lora_r=4, device="cpu", precision="fp32")
    model = build_model(setup)
    held = sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
               if ".visual." in n)
    assert held == vision_weight_bytes(setup)
    names = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    tower = [n for n in names if ".visual." in n]
    language = [n for n in names if "language_model" in n and n.endswith("base_layer")]
    assert tower and all(names[n] is torch.nn.Linear for n in tower)
    assert language and all(issubclass(names[n], bnb.nn.Linear4bit) for n in language)


@pytest.mark.parametrize("method", ["lora", "qlora", "full"])
def test_mllama_text_recipe_trains_at_its_plan_with_tower_and_cross_attention_frozen(tmp_path, method):
    """Llama-3.2-Vision on text through `lowvram train` at the plan's peak: full fine-tuning leaves
    the tower, the projector and the cross-attention layers (skipped without images) as they were;
    LoRA and QLoRA adapt none of them (their q_proj/gate_proj share the self-attention layers'
    names), only the self-attention layers."""
    from lowvram.difftest import mllama_cross_layers

    case = _case("mllama", method, tie=False, lora_targets="all-linear", cross_layers=1)
    out = run_case(case, tmp_path)
    assert out.error is None, out.error
    assert out.ok, (out.measured_bytes, out.predicted_bytes, out.ratio)
    run = tmp_path / "run"
    cross = [f"language_model.layers.{i}." for i in mllama_cross_layers(case)]
    frozen = ["vision_model", "multi_modal_projector", *cross]
    if method == "full":
        from lowvram.train.build.model import model_class

        def held(folder):
            m = model_class(True).from_pretrained(folder)
            assert type(m).__name__ == "MllamaForConditionalGeneration"
            return {k: v for k, v in m.state_dict().items() if any(f in k for f in frozen)}

        trained, before = held(run), held(tmp_path / "model")
        assert trained and trained.keys() == before.keys()
        assert [k for k in trained if cross[0] in k]
        assert all(torch.equal(trained[k], before[k]) for k in trained)  # not trained
    else:
        from safetensors import safe_open

        with safe_open(str(run / "adapter_model.safetensors"), "pt") as f:
            keys = list(f.keys())
        assert keys and not [k for k in keys if any(f in k for f in frozen)]
        assert [k for k in keys if "mlp.gate_proj" in k]  # the self-attention layers' are adapted


def test_mllama_qlora_quantizes_the_cross_attention_layers_without_adapters():
    """QLoRA on Llama-3.2-Vision: the tower and projector stay torch Linears (vision_weight_bytes),
    the cross-attention layers' Linears are 4-bit like the self-attention layers' but get no LoRA
    adapter and no gradient, held at what states.cross_attention_weight_bytes plans, to the byte."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from lowvram.check.builders import build_model
    from lowvram.livebytes import iter_tensors
    from lowvram.plan.memory.states import cross_attention_weight_bytes, vision_weight_bytes
    from lowvram.plan.model.readers import spec_from_config
    from lowvram.plan.setup import RunSetup

    cfg = dict(model_type="mllama",
               text_config=dict(model_type="mllama_text_model", hidden_size=64, intermediate_size=128,
                                num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                                vocab_size=512, cross_attention_layers=[1], pad_token_id=0),
               vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_global_layers=1, attention_heads=2, image_size=32, patch_size=16,
                                  vision_output_dim=64, intermediate_layers_indices=[0]))
    spec = spec_from_config(cfg, "tiny-mllama")
    setup = RunSetup(spec, quantization="nf4-dq", lora=True, lora_r=4, device="cpu", precision="fp32")
    model = build_model(setup)

    def held(part):
        return sum(t.numel() * t.element_size() for n, t in model.named_parameters() if part in n)

    assert held(".vision_model.") + held(".multi_modal_projector.") == vision_weight_bytes(setup)
    cross = [(n, p) for n, p in model.named_parameters() if ".language_model.layers.1." in n]
    layer = model.get_submodule("base_model.model.model.language_model.layers.1")
    tensors = {id(t): t for t in iter_tensors(layer)}.values()  # packed weights + their quant states
    assert sum(t.numel() * t.element_size() for t in tensors) == cross_attention_weight_bytes(setup)
    assert cross and not [n for n, p in cross if "lora_" in n or p.requires_grad]
    names = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert [n for n in names if ".layers.1.cross_attn.q_proj" in n]
    assert all(issubclass(names[n], bnb.nn.Linear4bit) for n in names if ".language_model.layers.1." in n)
    assert all(names[n] is torch.nn.Linear for n in names if ".vision_model." in n or "multi_modal_projector" in n)
    assert [n for n in names if ".layers.0.self_attn.q_proj.base_layer" in n]  # adapted
