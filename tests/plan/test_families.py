"""Gemma-3 (gemma3_text), OLMo-2 and SmolLM3 in the analytic planner (lowvram.plan.model.models, memory).

Parameter counts are exact against the transformers 5 model built from the same config.json on
the meta device. Peak memory is checked against the real training step on fake tensors
(lowvram.check.simulate) of scaled-down models whose saved tensors were read one by one with
torch.autograd.graph.saved_tensors_hooks: Gemma3RMSNorm and Olmo2RMSNorm save their fp32
normalized x, Gemma-3's sliding layers at seq_len >= sliding_window save an s x s mask and
GQA-expanded k and v, OLMo-2's rotary tables stay fp32.
"""

from __future__ import annotations

import pytest

from lowvram.plan.memory.activations import activation_bytes, masked_attention_bytes, masked_layers
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.model.models import count_parameters
from lowvram.plan.model.readers import spec_from_config
from lowvram.plan.setup import RunSetup

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128)
CONFIGS = {
    # layer 0 slides over 128 tokens, layer 1 attends to all (Gemma3TextConfig.layer_types)
    "gemma3_text": dict(BASE, model_type="gemma3_text", head_dim=32, sliding_window=128,
                        layer_types=["sliding_attention", "full_attention"]),
    # one kv head: repeat_kv's expand stays a view, nothing expanded is saved
    "gemma3_mqa": dict(BASE, model_type="gemma3_text", head_dim=32, num_key_value_heads=1,
                       sliding_window=128, layer_types=["sliding_attention", "full_attention"]),
    "olmo2": dict(BASE, model_type="olmo2", pad_token_id=0, eos_token_id=1),
    # every second layer without rotary (NoPE): the same saved tensors as a Llama layer
    "smollm3": dict(BASE, model_type="smollm3", num_hidden_layers=4, no_rope_layer_interval=2,
                    pad_token_id=0, bos_token_id=1, eos_token_id=1),
}


def _meta_count(cfg: dict) -> int:
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    c = dict(cfg)
    config = AutoConfig.for_model(c.pop("model_type"), **c)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_count_equals_transformers(name):
    assert count_parameters(spec_from_config(CONFIGS[name], name)) == _meta_count(CONFIGS[name])


def test_architecture_fields_from_config_json():
    g = spec_from_config(CONFIGS["gemma3_text"], "g")
    assert (g.norms_per_layer, g.qk_norm, g.tie_word_embeddings, g.hidden_act) == (
        4, "head", True, "gelu_pytorch_tanh")
    assert (g.sliding_window, g.sliding_layers, g.rotary_tables) == (128, 1, 2)
    o = spec_from_config(CONFIGS["olmo2"], "o")
    assert (o.qk_norm, o.norm_after, o.rotary_fp32, o.tie_word_embeddings) == ("full", True, True, False)
    # Gemma-3-1B: 26 layers, every sixth full attention (sliding_window_pattern 6)
    one_b = resolve_model("google/gemma-3-1b-it")
    assert (one_b.sliding_layers, one_b.sliding_window, one_b.num_kv_heads) == (22, 512, 1)
    assert resolve_model("HuggingFaceTB/SmolLM3-3B").tie_word_embeddings


def test_sliding_window_masks_start_at_the_window():
    spec = spec_from_config(CONFIGS["gemma3_text"], "g")
    below = RunSetup(spec, seq_len=127, micro_batch_size=1, device="cpu", precision="bf16")
    at = RunSetup(spec, seq_len=128, micro_batch_size=2, device="cpu", precision="bf16")
    assert (masked_layers(below), masked_attention_bytes(below)) == (0, 0)
    assert masked_layers(at) == spec.sliding_layers == 1
    # bf16 mask 2 x 128 x 128 per row; k and v expanded from 2 to 4 heads: 2 x 2 x (128 - 64) per token
    assert masked_attention_bytes(at) == 2 * (2 * 128 * 128) + 2 * (2 * 128) * 2 * 64


def test_a_recompute_holds_a_mask_only_in_a_sliding_layer():
    """recomputed_mask_bytes: with checkpointing the last layer's recompute and layer 0's hold the
    additive mask only where that layer is a sliding-window one (layer_types; held-out tiled seed
    50: a 2-layer Gemma-3, layer 1 full, kept its mask in layer 0's recompute only); packed rows
    mask every layer."""
    from dataclasses import replace

    from lowvram.plan.memory.activations import recomputed_mask_bytes

    cfg = dict(CONFIGS["gemma3_text"], layer_types=["sliding_attention", "full_attention"])
    spec = spec_from_config(cfg, "g")
    assert (spec.first_layer_sliding, spec.last_layer_sliding) == (True, False)
    setup = RunSetup(spec, seq_len=128, micro_batch_size=2, device="cpu", precision="bf16",
                     gradient_checkpointing=True)
    mask = masked_attention_bytes(setup)
    assert mask > 0
    assert (recomputed_mask_bytes(setup, last=True), recomputed_mask_bytes(setup, last=False)) == (0, mask)
    packed = replace(setup, packing=True)
    assert recomputed_mask_bytes(packed, last=True) == masked_attention_bytes(packed) > 0
    # the catalog: Gemma-3-1B's 26 layers end sliding, Gemma-3-12B's 48 with a full one
    assert resolve_model("google/gemma-3-1b-it").last_layer_sliding
    assert not resolve_model("gemma-3-12b").last_layer_sliding


def test_layer_zero_of_olmo2_under_lora_keeps_no_probabilities_copy_with_v_frozen():
    """OLMo-2's v_proj in layer 0 reads the frozen embedding output (no norm before the
    attention): with v frozen the matmul with v saves no 16-bit copy of the eager probabilities,
    tiled MLP or not (held-out tiled seed 48: -11.15% with it counted). A tiled layer is traced on
    its whole block (without its MLP it is no standard block, and layer 0 was counted whole)."""
    from dataclasses import replace

    from lowvram.plan.memory import tiled
    from lowvram.plan.memory.activations import layer_activation_bytes

    spec = spec_from_config(CONFIGS["olmo2"], "o")
    setup = RunSetup(spec, seq_len=512, micro_batch_size=1, device="cpu", precision="bf16-mixed", lora=True,
                     lora_r=4, lora_targets=("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj"),
                     attention="eager", tiled_mlp=True)
    copy = 2 * spec.num_heads * 512**2  # bf16 (1, heads, 512, 512)
    plain = replace(setup, tiled_mlp=False)
    assert layer_activation_bytes(plain) - layer_activation_bytes(plain, first=True) == copy
    assert tiled.layer_activation_bytes(setup) - tiled.layer_activation_bytes(setup, first=True) == copy
    with_v = replace(setup, lora_targets=setup.lora_targets + ("v_proj",))
    assert tiled.layer_activation_bytes(with_v, first=True) == tiled.layer_activation_bytes(with_v)
    # a Llama-style block, tiled: layer 0 with LoRA on down_proj alone saves x (TiledMLP's leaf) only
    llama = RunSetup(spec_from_config(CONFIGS["smollm3"], "s"), seq_len=256, micro_batch_size=1, device="cpu",
                     precision="bf16", lora=True, lora_r=4, lora_targets=("down_proj",), tiled_mlp=True)
    assert tiled.layer_activation_bytes(llama, first=True) == 2 * 256 * llama.model.hidden_size


def test_packing_masks_every_sdpa_layer():
    """data.packing: several samples per window, a block-diagonal mask in every layer's SDPA (not
    in eager attention, which saves none; not in flash-attention, which reads position_ids)."""
    from dataclasses import replace

    spec = spec_from_config(CONFIGS["smollm3"], "s")
    plain = RunSetup(spec, seq_len=256, micro_batch_size=2, device="cpu", precision="bf16")
    packed = replace(plain, packing=True)
    assert (masked_layers(plain), masked_attention_bytes(plain)) == (0, 0)
    assert masked_layers(packed) == spec.num_layers
    expanded = 2 * (spec.q_dim - spec.kv_dim) if spec.num_kv_heads > 1 else 0
    per_layer = 2 * (2 * 256 * 256 + 2 * 256 * expanded)
    assert masked_attention_bytes(packed) == per_layer
    assert activation_bytes(packed) - activation_bytes(plain) == spec.num_layers * per_layer
    for attention in ("eager", "flash_attention_2"):
        assert masked_layers(replace(packed, attention=attention)) == 0


# The analytic plan against the simulated step (bf16 weights, 2-4 layers, seq 256). Measured:
# every case below within 0.8% (full and LoRA, bf16 / bf16-mixed / fp32). With checkpointing the
# plan's fitted recompute share (layer_backward_bytes) is high on these small models: Gemma-3
# +2.3% (full) / +9.0% (LoRA), OLMo-2 -0.8% / +4.2%, SmolLM3 +3.1% / +4.1%; at full size
# (Gemma-3-1B, OLMo-2-7B, SmolLM3-3B, seq 512 and 2048, with and without checkpointing) the
# plan is within 0.01% (bench/results/simulate_full_size_families.txt).
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("lora", [False, True])
def test_analytic_equals_the_simulated_step(name, lora):
    pytest.importorskip("torch")
    from lowvram.check.simulate import simulate_memory

    spec = spec_from_config(CONFIGS[name], name)
    setup = RunSetup(spec, seq_len=256, micro_batch_size=1, device="cpu", precision="bf16", lora=lora)
    est, sim = estimate_memory(setup), simulate_memory(setup, config=CONFIGS[name])
    assert abs(est.peak_bytes - sim.peak_bytes) / sim.peak_bytes < 0.01, (est.breakdown, sim.breakdown)


@pytest.mark.parametrize("name", ["smollm3", "gemma3_text"])
def test_packed_plan_equals_the_simulated_step(name):
    """data.packing: the simulated step gets restarting position_ids (lowvram.check.builders
    make_batch), so transformers builds the packed mask the plan counts (measured: within 0.05%,
    full and LoRA; without packing the same models are within 1.1%)."""
    pytest.importorskip("torch")
    from lowvram.check.simulate import simulate_memory

    spec = spec_from_config(CONFIGS[name], name)
    for lora in (False, True):
        setup = RunSetup(spec, seq_len=256, micro_batch_size=2, device="cpu", precision="bf16",
                         lora=lora, packing=True)
        est, sim = estimate_memory(setup), simulate_memory(setup, config=CONFIGS[name])
        assert abs(est.peak_bytes - sim.peak_bytes) / sim.peak_bytes < 0.005, (lora, est.breakdown, sim.breakdown)


@pytest.mark.parametrize("name,precision", [("gemma3_text", "bf16-mixed"), ("olmo2", "fp32")])
def test_analytic_equals_the_simulated_step_other_precisions(name, precision):
    pytest.importorskip("torch")
    from lowvram.check.simulate import simulate_memory

    spec = spec_from_config(CONFIGS[name], name)
    for lora in (False, True):
        setup = RunSetup(spec, seq_len=256, micro_batch_size=1, device="cpu", precision=precision,
                         lora=lora)
        est, sim = estimate_memory(setup), simulate_memory(setup, config=CONFIGS[name])
        assert abs(est.peak_bytes - sim.peak_bytes) / sim.peak_bytes < 0.01, (lora, est.breakdown)


@pytest.mark.parametrize("name", ["gemma3_text", "olmo2", "smollm3"])
@pytest.mark.parametrize("lora", [False, True])
def test_checkpointing_plan_is_at_or_above_the_simulated_step(name, lora):
    pytest.importorskip("torch")
    from lowvram.check.simulate import simulate_memory

    spec = spec_from_config(CONFIGS[name], name)
    setup = RunSetup(spec, seq_len=256, micro_batch_size=1, device="cpu", precision="bf16",
                     lora=lora, gradient_checkpointing=True)
    est, sim = estimate_memory(setup), simulate_memory(setup, config=CONFIGS[name])
    assert -0.01 < (est.peak_bytes - sim.peak_bytes) / sim.peak_bytes < 0.10, (est.breakdown, sim.breakdown)
