"""Mixture-of-experts terms of the memory model: pure functions of a RunSetup (no torch).

What transformers 5 and peft do with an MoE layer (read from transformers 5.24 modeling_mixtral /
modeling_qwen3_moe / modeling_olmoe / modeling_qwen2_moe, integrations/moe.py, integrations/
bitsandbytes.py, and peft 0.21 tuners/lora/layer.py ParamWrapper, utils/
transformers_weight_conversion.py), each checked on tiny models (tests/test_plan_moe.py):

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
"""

from __future__ import annotations

from dataclasses import dataclass

from lowvram.plan.models import ModelSpec, expert_shapes

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
        return expert_shapes(spec)
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
    h, e, i, k = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size, spec.num_experts_per_tok
    adapters = expert_adapters(spec, lora_r, targets) if lora else []
    # Frozen experts (LoRA on attention only): grouped_mm's backward for its input reads the
    # weights alone, so neither the gathered input nor the activation product (down_proj's
    # input) is saved: c*h + 3c*I per row (measured with saved_tensors_hooks, tiny Qwen3-MoE).
    experts_grad = not lora or any(a.name != "router" for a in adapters)
    per_row = (2 * c * h + 4 * c * i if experts_grad else c * h + 3 * c * i) + 4 + 24
    per_tok = k * per_row + 4 * e + 12 * k + 4
    router_grad = not lora or any(a.name == "router" for a in adapters)
    if router_grad and not router_input_counted:
        per_tok += (router_c or c) * h
    fixed = sum(w * a.base_numel + (2 * a.numel if autocast else 0) for a in adapters)
    return tokens * per_tok + fixed


__all__ = ["ExpertAdapter", "expert_adapters", "expert_lora_parameters",
           "expert_trainable_shapes", "moe_problems", "routed_activation_bytes"]
