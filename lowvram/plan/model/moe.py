"""Mixture-of-experts terms of the memory model: pure functions of a RunSetup (no torch).

What transformers 5 and peft do with an MoE layer (read from transformers 5.24 modeling_mixtral /
modeling_qwen3_moe / modeling_olmoe / modeling_qwen2_moe, integrations/moe.py, integrations/
bitsandbytes.py, and peft 0.21 tuners/lora/layer.py ParamWrapper, utils/
transformers_weight_conversion.py), each checked on tiny models (tests/plan/test_moe.py):

- The experts of a layer are two fused 3-D parameters (gate_up_proj [E, 2I, h], down_proj
  [E, h, I]) and the router one [E, h] weight; none is an nn.Linear.
- bitsandbytes (``replace_with_bnb_linear``) swaps only nn.Linear / Conv1D modules: under QLoRA
  the experts and the router stay in the load dtype. Only attention (and a shared expert) is 4-bit.
- peft ``all-linear``: for Mixtral and the families transformers maps to its Qwen2-MoE conversion
  (Qwen3-MoE, OLMoE, ...) peft rewrites the targets to the v5 layout (_convert_peft_config_moe): the
  router weight (rank r) and, through ``target_parameters``, gate_up_proj (rank 2r: gate and up
  were two v4 Linears) and down_proj (rank r), each a ParamWrapper with lora_A [r*E, in] and
  lora_B [out, r*E]. Qwen2-MoE itself has no conversion: ``all-linear`` adapts attention, the
  shared expert and its gate, and leaves experts and router frozen.
- A ParamWrapper on 16-bit weights builds the merged weight (base + B@A) per forward and the
  expert matmul saves it for backward: one more copy of every adapted expert parameter per layer,
  plus autocast's 16-bit copies of the factors. It refuses lora_dropout > 0.
- Routing (transformers' default ``grouped_mm`` experts implementation): each token is copied to
  its top-k experts; per routed row the layer saves the gathered input, the gate_up output, the
  activation and product, the down output (for the routing-weight product), its routing weight and
  three int64 permutation indices; per token the fp32 router probabilities and the top-k indices
  and values (measured with saved_tensors_hooks, exact on a tiny Mixtral).
- gpt-oss (modeling_gpt_oss.py) has its own layout: a biased router, experts stored transposed
  with biases, a clamped SwiGLU, and attention sinks that only the eager path trains (no SDPA in
  transformers): the ``sink_*`` functions below; peft's all-linear adapts its attention only.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowvram.plan import constants as fitted
from lowvram.plan.model.models import ModelSpec, expert_shapes

# model_types whose v4 MoE targets peft converts to the fused v5 parameters, with the v4 names of
# (router, fused gate+up pair, down): peft utils/transformers_weight_conversion.py
# _MOE_TARGET_MODULE_MAPPING, keyed through transformers' _MODEL_TO_CONVERSION_PATTERN.
_PEFT_MOE_NAMES: dict[str, tuple[str, tuple[str, str], str]] = {
    "mixtral": ("gate", ("w1", "w3"), "w2"),
    "qwen3_moe": ("gate", ("gate_proj", "up_proj"), "down_proj"),
    "olmoe": ("gate", ("gate_proj", "up_proj"), "down_proj"),
}


@dataclass(frozen=True)
class ExpertAdapter:
    """One peft ParamWrapper of an MoE layer: LoRA on a router or fused expert parameter."""

    name: str
    d_in: int
    d_out: int
    rank: int  # per expert
    experts: int  # 1 for the router

    @property
    def numel(self) -> int:
        return self.rank * self.experts * (self.d_in + self.d_out)

    @property
    def base_numel(self) -> int:
        return self.experts * self.d_in * self.d_out

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return [(self.rank * self.experts, self.d_in), (self.d_out, self.rank * self.experts)]


def expert_adapters(spec: ModelSpec, lora_r: int, targets: tuple[str, ...]) -> list[ExpertAdapter]:
    """The ParamWrappers peft puts in one MoE layer for these LoRA targets (empty for dense
    models and for Qwen2-MoE, which peft does not convert)."""
    names = _PEFT_MOE_NAMES.get(spec.model_type) if spec.is_moe else None
    if names is None:
        return []
    router, pair, down = names
    every = "all-linear" in targets
    h, e, i = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    out = []
    if every or router in targets:
        out.append(ExpertAdapter("router", h, e, lora_r, 1))
    if every or all(p in targets for p in pair):
        out.append(ExpertAdapter("gate_up_proj", h, 2 * i, 2 * lora_r, e))
    if every or down in targets:
        out.append(ExpertAdapter("down_proj", i, h, lora_r, e))
    return out


def moe_problems(spec: ModelSpec, lora: bool, lora_r: int, targets: tuple[str, ...],
                 lora_dropout: float) -> list[str]:
    """What peft refuses on an MoE model (empty when nothing)."""
    if not (spec.is_moe and lora):
        return []
    out = []
    names = _PEFT_MOE_NAMES.get(spec.model_type)
    if names is not None and "all-linear" not in targets:
        pair = [p for p in names[1] if p in targets]
        if len(pair) == 1:
            out.append(f"lora target {pair[0]} of {spec.model_type} is fused with "
                       f"{({*names[1]} - {pair[0]}).pop()} into experts.gate_up_proj: target both")
    if lora_dropout and expert_adapters(spec, lora_r, targets):
        out.append("lora dropout > 0 on fused MoE experts (peft's ParamWrapper refuses it): "
                   "set lora.dropout: 0")
    return out


def expert_lora_parameters(spec: ModelSpec, lora_r: int, targets: tuple[str, ...]) -> int:
    """Trainable adapter parameters on the router and experts, all layers."""
    return spec.num_layers * sum(a.numel for a in expert_adapters(spec, lora_r, targets))


def expert_trainable_shapes(spec: ModelSpec, lora: bool, lora_r: int,
                            targets: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Trainable tensors of one layer beyond its Linears (optimizer state is per tensor)."""
    if not lora:
        return list(expert_shapes(spec))
    return [s for a in expert_adapters(spec, lora_r, targets) for s in a.shapes]


def routed_activation_bytes(spec: ModelSpec, tokens: int, c: int, w: int, autocast: bool,
                            lora: bool, lora_r: int, targets: tuple[str, ...],
                            router_input_counted: bool, router_c: int | None = None) -> int:
    """Bytes one MoE layer's router and routed experts save for backward (the attention and a
    shared expert are counted as a dense block).

    c: bytes of the experts' compute dtype (the stored dtype: grouped_mm is not autocast), w: of
    the stored weights, router_c: of the router's autocast input (default c). Per routed row (top-k per token):
    gathered input c*h, gate_up output 2c*I, activation and product 2c*I, down output c*h, fp32
    routing weight, three int64 indices. Per token: fp32 router probabilities (4E), top-k int64
    indices and fp32 values, their fp32 sum; the router's input (c*h) when the router weight
    gets a gradient and no shared-expert Linear saved it already. Per layer, with adapted experts:
    the merged weights (w bytes each) and, under autocast, 16-bit copies of the factors."""
    h, i, k = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts_per_tok
    adapters = expert_adapters(spec, lora_r, targets) if lora else []
    # Frozen experts (LoRA on attention only): grouped_mm's backward for its input reads the
    # weights alone, so neither the gathered input nor the activation product (down_proj's
    # input) is saved: c*h + 3c*I per row (measured with saved_tensors_hooks, tiny Qwen3-MoE).
    experts_grad = not lora or any(a.name != "router" for a in adapters)
    per_row = (2 * c * h + 4 * c * i if experts_grad else c * h + 3 * c * i) + 4 + 24
    router_grad = not lora or any(a.name == "router" for a in adapters)
    router = router_activation_bytes(spec, tokens, router_c or c, router_grad and not router_input_counted)
    fixed = sum(w * a.base_numel + (2 * a.numel if autocast else 0) for a in adapters)
    return tokens * k * per_row + router + fixed


def router_activation_bytes(spec: ModelSpec, tokens: int, router_c: int, router_input: bool) -> int:
    """The router's share of :func:`routed_activation_bytes`, alive until the backward reaches
    the router (after the routed experts'): per token fp32 probabilities (4E), top-k int64
    indices and fp32 values, their fp32 sum; with ``router_input``, its saved input (router_c*h)."""
    e, k = spec.num_experts, spec.num_experts_per_tok
    return tokens * (4 * e + 12 * k + 4 + (router_c * spec.hidden_size if router_input else 0))


# gpt-oss (transformers 5.24 modeling_gpt_oss.py): GptOssPreTrainedModel._supports_sdpa is False
# (from_pretrained with attn_implementation="sdpa" raises), and its flash path needs a kernel with
# sink support (the hub's vllm-flash-attn3); eager_attention_forward is the path that trains.
SINK_ATTENTIONS = ("eager",)


# Model types whose transformers class has neither an SDPA nor a flash-attention path (transformers
# 5.24: BloomPreTrainedModel sets no _supports_sdpa / _supports_flash_attn, so from_pretrained
# with attn_implementation="sdpa" raises): they train with eager attention only.
EAGER_ONLY_MODEL_TYPES = ("bloom",)


def attention_problems(spec: ModelSpec, attention: str) -> list[str]:
    """Attention kernels a model with attention sinks, or a model type with eager attention only,
    cannot train with (empty when fine)."""
    if spec.attention_sinks and attention not in SINK_ATTENTIONS:
        return [f"attention {attention} with {spec.model_type}: transformers has no {attention} "
                "path for its attention sinks (GptOssPreTrainedModel._supports_sdpa = False): "
                "set attention: eager (--attention eager)"]
    if spec.model_type in EAGER_ONLY_MODEL_TYPES and attention != "eager":
        return [f"attention {attention} with {spec.model_type}: transformers has only eager "
                f"attention for it (no _supports_sdpa / _supports_flash_attn): set attention: eager (--attention eager)"]
    if spec.cross_attention_layers and attention == "flash_attention_2":
        return ["attention flash_attention_2 with Llama-3.2-Vision (mllama): transformers has no flash-attention "
                "path for it (MllamaPreTrainedModel._supports_flash_attn = False): set attention: sdpa (--attention sdpa)"]
    return []


def default_attention(spec: ModelSpec) -> str:
    """The attention the chooser plans when the recipe names none."""
    eager = spec.attention_sinks or spec.model_type in EAGER_ONLY_MODEL_TYPES
    return SINK_ATTENTIONS[0] if eager else "sdpa"


def sink_eager_bytes(spec: ModelSpec, batch: int, seq_len: int, cc: int, w: int) -> int:
    """gpt-oss eager attention (eager_attention_forward with ``sinks``) per layer, beyond what the
    dense block counts for attention (SDPA's q, k, v, output and fp32 logsumexp per head).

    The scores get the additive mask (in the embeddings' dtype) and a sink column
    (``cat([scores, sinks])``), then ``softmax(dtype=scores.dtype)``: softmax keeps its output
    over s+1 columns, fp32 when the weights are fp32 (the fp32 mask and sinks promote autocast's
    16-bit scores), else the compute dtype; with fp32 scores and 16-bit values the sliced
    probabilities' cast is a copy the second matmul saves (s columns). The max subtracted first
    keeps its int64 indices per head and query; repeat_kv's k and v are copies of all heads
    (when grouped). Measured with saved_tensors_hooks on a 1-layer gpt-oss, pure bf16 / fp32 /
    bf16 autocast over fp32 and bf16 weights, exact."""
    a, t = spec.num_heads, batch * seq_len
    fp32_scores = w == 4
    soft = 4 if fp32_scores else cc
    copy = cc if (fp32_scores and cc != 4) else 0
    scores = a * batch * seq_len * (soft * (seq_len + 1) + copy * seq_len)
    grouped = spec.num_kv_heads < spec.num_heads
    expanded = 2 * cc * (spec.q_dim - spec.kv_dim) if grouped else 0
    return scores + t * (expanded + 8 * a - 4 * a)


def sink_eager_backward_bytes(spec: ModelSpec, batch: int, seq_len: int, cc: int, w: int) -> int:
    """The s x s gradients gpt-oss's eager backward makes in the last decoder layer, while every
    layer's saved activations are still alive: the probabilities' gradient padded back to s+1
    columns (the sink's slice) and the softmax's input gradient, in the softmax's dtype, and with
    fp32 scores over 16-bit values the gradient of the probabilities' 16-bit copy. Fitted on six
    2-layer gpt-oss CPU steps: constants.SINK_EAGER_BACKWARD_SOFTMAXES softmax-sized tensors."""
    soft = 4 if w == 4 else cc
    copy = cc if (w == 4 and cc != 4) else 0
    cells = spec.num_heads * batch * seq_len
    return fitted.SINK_EAGER_BACKWARD_SOFTMAXES.of(cells * (seq_len + 1) * soft) + cells * seq_len * copy


def sink_experts_backward_bytes(spec: ModelSpec, tokens: int, ce: int, lora: bool) -> int:
    """What gpt-oss's routed experts' backward makes in the last decoder layer, while every
    layer's saved activations are still alive: the clamped SwiGLU's elementwise gradients and the
    strided gate/up slices' zero-filled [rows, 2I] gradients, in the experts' dtype. Fitted on
    2-layer gpt-oss CPU steps (live-bytes tracker): constants.SINK_EXPERTS_BACKWARD_FROZEN x rows
    x I element-bytes with frozen experts (LoRA), SINK_EXPERTS_BACKWARD_TRAINABLE with trainable
    ones."""
    rows = tokens * spec.num_experts_per_tok
    factor = fitted.SINK_EXPERTS_BACKWARD_FROZEN if lora else fitted.SINK_EXPERTS_BACKWARD_TRAINABLE
    return factor.of(rows * spec.moe_intermediate_size * ce)


def sink_routed_bytes(spec: ModelSpec, tokens: int, ce: int, cc: int, w: int, autocast: bool,
                      lora: bool) -> int:
    """Bytes gpt-oss's router and routed experts save for backward, per layer
    (GptOssTopKRouter, GptOssExperts through transformers' grouped_mm_experts_forward with
    is_transposed and biases; measured with saved_tensors_hooks on a 1-layer gpt-oss, exact).

    ce: bytes of the experts' dtype (the stored one: grouped_mm is not autocast), cc: of the
    router's (autocast) output. Per routed row: gate_up's output (2I; the clamps save views of
    it), the clamped gate, sigmoid(alpha*gate), their product glu and up+1 (4I), the down output
    (h, for the routing-weight gradient), the routing weight (cc), int64 indices of the token
    gather, the weight gather and the un-permute. With trainable experts also the gathered input
    (h), the gated product (I, down_proj's input) and the bias gathers' int64 expert ids. Per
    token: the top-k int64 indices and softmax output (softmax over the top-k logits only), and
    with a trainable router its (autocast) input. Per layer: grouped_mm's int32 offsets, and
    under autocast over fp32 weights the router weight's 16-bit copy."""
    h, e, i, k = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size, spec.num_experts_per_tok
    if lora:  # peft does not convert gpt-oss: all-linear adapts attention only, experts frozen
        per_row = ce * (h + 6 * i) + cc + 3 * 8
    else:
        per_row = ce * (2 * h + 7 * i) + cc + 4 * 8
    per_tok = k * per_row + 8 * k + cc * k + (0 if lora else cc * h)
    fixed = 4 * e + (2 * e * h if autocast and w == 4 else 0)
    return tokens * per_tok + fixed


__all__ = ["ExpertAdapter", "attention_problems", "default_attention", "sink_eager_backward_bytes",
           "sink_eager_bytes", "sink_experts_backward_bytes",
           "sink_routed_bytes", "expert_adapters", "expert_lora_parameters",
           "expert_trainable_shapes", "moe_problems", "routed_activation_bytes", "router_activation_bytes"]
