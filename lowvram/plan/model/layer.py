"""One decoder layer as the activation and backward terms see it (LayerSpec), derived once from a
ModelSpec: the family's quirks are decided here, and the terms (:mod:`lowvram.plan.memory.activations`,
:mod:`lowvram.plan.memory.backward`, :mod:`lowvram.plan.memory.memory`) read its fields instead of asking which
family a model is. A new family states its facts here (or in ModelSpec); no term grows a
``model_type`` branch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from lowvram.plan.model.models import ModelSpec


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer of a model is made of, as far as its saved tensors go."""

    # "softmax": the standard attention (SDPA, flash or eager's fp32 softmax); "sinks": a learned
    # sink logit per head joins the scores (gpt-oss, modeling_gpt_oss.py eager_attention_forward:
    # ``cat([scores, sinks])``), trainable through eager attention only (moe.sink_* terms)
    attention: str
    # masks transformers builds per batch, one per attention type: 2 with full and sliding-window
    # layers side by side (Gemma-3, gpt-oss), else 1 (masking_utils)
    attention_types: int
    sliding_window: int  # tokens a sliding-window layer sees (0: none)
    sliding_layers: int  # how many layers use it
    qk_norm: str  # "" | "head" (an RMSNorm per head_dim: Qwen3, Gemma-3) | "full" (OLMo-2, OLMoE)
    fused_qkv: bool  # one qkv projection (Phi-3 qkv_proj, GPT-2 c_attn, Falcon/Bloom)
    # q and k rotated into new tensors out of the fused qkv output, v a view of it (every fused
    # model without a learned position table): SDPA keeps the fused storage alive
    fused_qkv_rotated: bool
    # rotary applied by concatenation (Phi-3's apply_rotary_pos_emb ``cat([rotated, pass])``, and
    # every partial rotary): q stays head-major, so ``attn_output.transpose(1, 2).contiguous()``
    # copies SDPA's output and o_proj saves the copy (Llama's keeps token-major: a no-op)
    attention_output_copied: bool
    norms: int  # norms per layer (Llama 2; Gemma-2/3 4; Phi-2 and Falcon 1)
    norm_after: bool  # OLMo-2: norms on the attention and MLP outputs, none before
    # RMSNorms that apply their weight to the fp32 normalized x (Gemma-3, OLMo-2): a trainable
    # weight saves the fp32 x, not a 16-bit copy
    norm_weight_fp32: bool
    # Gemma3RMSNorm saves its fp32 (1 + weight) for the input gradient, trainable or frozen
    # (modeling_gemma3.py ``x * (1.0 + self.weight.float())``; measured with saved_tensors_hooks)
    norm_saves_fp32_weight: bool
    parallel_attn: bool  # attention and MLP read the same normed input (Phi-2, Falcon)
    # the MLP the layer's Linears form: "gated" (gate, up, down), "plain" (fc1, fc2), "experts"
    # (routed experts, beside a gated shared expert where shared_expert)
    mlp: str
    fused_gate_up: bool  # Phi-3 gate_up_proj
    # "none"; "routed": a softmax top-k router and two fused 3-D expert parameters combined by
    # the routing weights (transformers 5 integrations/moe.py grouped_mm_experts_forward: Mixtral,
    # Qwen2/3-MoE, OLMoE); "routed_biased": a biased router, experts stored transposed with biases
    # and a clamped SwiGLU (gpt-oss, GptOssExperts), its own terms (moe.sink_*)
    experts: str
    shared_expert: bool  # Qwen2-MoE: one always-on gated MLP and a sigmoid gate
    # a pre-norm gated block with two norms or Gemma-2/3's four, no residual dropout: the layout
    # whose first layer the LoRA terms trace (activations._first_layer_grads); other layouts count
    # every saved tensor of layer 0 (over, never under)
    standard_block: bool


@lru_cache(maxsize=256)
def describe_layer(spec: ModelSpec) -> LayerSpec:
    """The decoder layer of ``spec`` (every layer of a model is the same block; sliding-window
    layers differ in their mask only)."""
    experts = "none"
    if spec.is_moe:
        experts = "routed_biased" if spec.expert_bias else "routed"
    return LayerSpec(
        attention="sinks" if spec.attention_sinks else "softmax",
        attention_types=2 if 0 < spec.sliding_layers < spec.num_layers else 1,
        sliding_window=spec.sliding_window,
        sliding_layers=spec.sliding_layers,
        qk_norm=spec.qk_norm,
        fused_qkv=spec.fused_qkv,
        fused_qkv_rotated=spec.fused_qkv and not spec.learned_positions,
        attention_output_copied=not spec.learned_positions and (
            spec.model_type == "phi3" or spec.partial_rotary_factor < 1),
        norms=spec.norms_per_layer,
        norm_after=spec.norm_after,
        norm_weight_fp32=spec.norm_weight_fp32,
        norm_saves_fp32_weight=spec.model_type == "gemma3_text",
        parallel_attn=spec.parallel_attn,
        mlp="experts" if spec.is_moe else spec.mlp,
        fused_gate_up=spec.fused_gate_up,
        experts=experts,
        shared_expert=bool(spec.shared_expert_intermediate_size),
        standard_block=not (spec.norms_per_layer not in (2, 4) or spec.norm_after or spec.parallel_attn
                            or spec.mlp != "gated" or spec.resid_dropout),
    )


__all__ = ["LayerSpec", "describe_layer"]
