"""The per-layer description (lowvram.plan.model.layer): each family's quirks decided once from its
ModelSpec, exact for the catalog's families; the activation and backward terms read its fields
and never ask for a model_type."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.model.layer import LayerSpec, describe_layer
from tests.conftest import REPO

LLAMA = LayerSpec(
    attention="softmax", attention_types=1, sliding_window=0, sliding_layers=0, qk_norm="",
    fused_qkv=False, fused_qkv_rotated=False, attention_output_copied=False, norms=2,
    norm_after=False, norm_weight_fp32=False, norm_saves_fp32_weight=False, parallel_attn=False,
    mlp="gated", fused_gate_up=False, experts="none", shared_expert=False, standard_block=True)

EXPECTED = {
    "llama-3.1-8b": LLAMA,
    # one qkv_proj and gate_up_proj; rotary by concatenation: o_proj reads a copy of SDPA's output
    "phi-3-mini": replace(LLAMA, fused_qkv=True, fused_qkv_rotated=True, attention_output_copied=True,
                          fused_gate_up=True),
    # partial rotary (0.4), one LayerNorm read by attention and MLP in parallel, fc1/fc2
    "phi-2": replace(LLAMA, attention_output_copied=True, norms=1, parallel_attn=True, mlp="plain",
                     standard_block=False),
    # learned positions: no rotary, so the fused c_attn output is not rotated
    "gpt2": replace(LLAMA, fused_qkv=True, norms=2, mlp="plain", standard_block=False),
    # 22 of 26 layers slide over 512 tokens; four norms, q/k norms per head, fp32 (1 + weight)
    "gemma-3-1b": replace(LLAMA, attention_types=2, sliding_window=512, sliding_layers=22,
                          qk_norm="head", norms=4, norm_weight_fp32=True, norm_saves_fp32_weight=True),
    # post-norms only, q/k norms over all heads
    "olmo-2-7b": replace(LLAMA, qk_norm="full", norm_after=True, norm_weight_fp32=True,
                         standard_block=False),
    # sinks, half the layers sliding over 128 tokens, biased experts with a clamped SwiGLU
    "gpt-oss-20b": replace(LLAMA, attention="sinks", attention_types=2, sliding_window=128,
                           sliding_layers=12, norm_weight_fp32=True, mlp="experts",
                           experts="routed_biased"),
    "mixtral-8x7b": replace(LLAMA, mlp="experts", experts="routed"),
    "qwen3-30b-a3b": replace(LLAMA, qk_norm="head", mlp="experts", experts="routed"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_layer_of_each_family(name):
    assert describe_layer(resolve_model(name)) == EXPECTED[name]


def test_shared_expert_and_dense_view():
    """Qwen2-MoE's always-on gated expert is part of the layer; its dense view is a plain block."""
    from lowvram.plan.model.models import dense_view

    spec = replace(resolve_model("qwen3-30b-a3b"), shared_expert_intermediate_size=512)
    assert describe_layer(spec).shared_expert and describe_layer(spec).experts == "routed"
    dense = describe_layer(dense_view(spec))
    assert (dense.mlp, dense.experts, dense.shared_expert) == ("gated", "none", False)


@pytest.mark.parametrize("module", ["activations.py", "backward.py"])
def test_terms_do_not_branch_on_model_type(module):
    assert "model_type" not in (REPO / "lowvram" / "plan" / "memory" / module).read_text()
