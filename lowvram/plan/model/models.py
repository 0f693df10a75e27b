"""Model architecture facts (ModelSpec) and the parameter counts derived from them (no weights,
no torch); catalog.py resolves a name or path to a ModelSpec, readers.py reads config.json / GGUF.

Parameter counts are derived from the block structure (``block_linears`` + norms + embeddings)
and are exact: tests/plan/test_models.py builds the transformers model from the same fields on
the meta device and compares ``sum(p.numel())``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache

from lowvram.plan.model.vision import VisionSpec, projector_numel, tower_numel


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts of a causal LM that memory depends on."""

    name: str
    hf_id: str | None
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    mlp: str = "gated"  # "gated" (gate, up, down) or "plain" (fc1, fc2)
    norm: str = "rms"  # "rms" or "layer" (LayerNorm has weight + bias)
    qkv_bias: bool = False  # bias on q/k/v (Qwen2, GPT-2, OPT, Bloom, Phi-2)
    out_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False  # bias on the MLP projections
    lm_head_bias: bool = False  # Phi-2 has one
    fused_qkv: bool = False  # one qkv projection (Phi-3 qkv_proj, GPT-2 c_attn, Falcon/Bloom)
    fused_gate_up: bool = False  # Phi-3 gate_up_proj
    parallel_attn: bool = False  # attention and MLP read the same normed input (Phi-2, Falcon)
    norms_per_layer: int = 2
    embedding_norm: bool = False  # LayerNorm after the embedding (Bloom)
    learned_positions: int = 0  # rows of a learned position table (GPT-2, OPT)
    hidden_act: str = "silu"
    rope_theta: float | None = None
    partial_rotary_factor: float = 1.0
    # Dropout the config turns on in training (GPT-2: 0.1 each; Phi-2: residual 0.1): masks saved
    resid_dropout: float = 0.0  # after the attention output and the MLP (resid_pdrop)
    embd_dropout: float = 0.0  # on the embedding output (embd_pdrop)
    attn_dropout: float = 0.0  # on the attention probabilities (attn_pdrop / attention_dropout)
    # RMSNorm on q and k inside attention: "head" (Qwen3, Gemma-3: one head_dim weight each) or
    # "full" (OLMo-2, OLMoE: q_dim and kv_dim weights)
    qk_norm: str = ""
    # RMSNorms that apply their weight to the fp32 normalized x (Gemma-3: x * (1 + w.float());
    # OLMo-2: (w * x).to(dtype)): a trainable weight saves the fp32 x, not a 16-bit copy
    norm_weight_fp32: bool = False
    norm_after: bool = False  # OLMo-2: norms on the attention and MLP outputs, none before
    rotary_tables: int = 1  # Gemma-3: one cos/sin pair per layer type (sliding and full)
    rotary_fp32: bool = False  # OLMo-2: cos/sin stay fp32 (Olmo2RotaryEmbedding casts nothing)
    sliding_window: int = 0  # Gemma-3: tokens a sliding-attention layer sees
    sliding_layers: int = 0  # how many layers use it
    # with sliding_layers: whether layer 0 and the last layer are sliding-window layers (the ones
    # a checkpointed backward recomputes first and last). Gemma-3's pattern (every 6th layer
    # full) and gpt-oss' (every other) start sliding; 48 Gemma-3 layers, or an even number of
    # gpt-oss layers, end with a full-attention one (readers: from layer_types)
    first_layer_sliding: bool = True
    last_layer_sliding: bool = True
    # transformers' DynamicCache (generate) gives some layer a DynamicSlidingWindowLayer: the
    # config's layer_types name a sliding or chunked layer, or a sliding_window is set where the
    # config class derives no layer_types (cache_utils.py get_layer_types_and_kwargs: Mistral's
    # default 4096, whatever the length). Its update cats the keys and then the values while the
    # old ones are still the layer's (DynamicSlidingWindowLayer.update L242-247): one layer's old
    # keys and values alive at once (readers: _sliding_cache)
    sliding_cache: bool = False
    # with sliding_cache: the window of those DynamicSlidingWindowLayers, which keep only the last
    # window tokens (L244-247; 0: unknown, every token counted). Only generate's cache reads it
    # (plan/memory/grpo.py); sliding_window above is the attention's, for Gemma-3 and gpt-oss
    cache_window: int = 0
    # Mixture of experts (every decoder layer sparse; 0 = dense). transformers 5 stores a layer's
    # experts fused in two 3-D parameters (experts.gate_up_proj [E, 2I, h], experts.down_proj
    # [E, h, I]) and the router as a bare [E, h] weight: none of them is an nn.Linear.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # I of one expert
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on gated MLP + a sigmoid gate
    # gpt-oss (transformers 5 modeling_gpt_oss.py): a learned sink logit per head (attention
    # ``sinks`` [a]), a router with a bias, experts stored transposed with biases
    # (gate_up_proj [E, h, 2I] + gate_up_proj_bias [E, 2I], down_proj [E, I, h] + down_proj_bias
    # [E, h]) and a clamped SwiGLU (GptOssExperts._apply_gate)
    attention_sinks: bool = False
    expert_bias: bool = False
    # A multimodal checkpoint (Gemma-3 4B+, Llava): the vision tower and projector that
    # transformers loads with the language model (lowvram.plan.model.vision); every field above then
    # describes the language model (its text_config)
    vision: VisionSpec | None = None
    # Llama-3.2-Vision (mllama, modeling_mllama.py MllamaTextModel): the indices, among
    # num_layers + len(cross_attention_layers) decoder layers, of its MllamaCrossAttentionDecoderLayer
    # blocks. Without images (no cross_attention_states, no cache) the forward ``continue``s past
    # them: they hold weights (cross_attention_numel) and no activations; num_layers counts the
    # self-attention layers the forward runs. Its embed_tokens has vocab_size + 8 rows
    # (MllamaTextModel: nn.Embedding(config.vocab_size + 8, ...)), lm_head vocab_size.
    cross_attention_layers: tuple[int, ...] = ()
    embedding_extra_rows: int = 0

    def __hash__(self) -> int:
        # computed once (the planner hashes the same spec tens of thousands of times as a cache
        # key: models._per_model, setup.cached_on); equal specs hash equal, as the generated one
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        # a pickled spec leaves its hash behind: another process hashes strings differently
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def embedding_rows(self) -> int:
        """Rows of the token embedding (vocab_size, + Mllama's 8)."""
        return self.vocab_size + self.embedding_extra_rows

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class Linear:
    """One projection inside a decoder block: its module name (as peft matches it), shape, bias."""

    name: str
    d_in: int
    d_out: int
    bias: bool

    @property
    def numel(self) -> int:
        return self.d_in * self.d_out + (self.d_out if self.bias else 0)


# Module names per architecture, as in transformers' modeling files (what peft target_modules
# match): q, k, v, qkv (fused), o, gate, up, gate_up (fused), down, fc1, fc2.
_NAMES: dict[str, dict[str, str]] = {
    "default": dict(q="q_proj", k="k_proj", v="v_proj", o="o_proj", gate="gate_proj",
                    up="up_proj", down="down_proj", fc1="fc1", fc2="fc2"),
    "phi3": dict(qkv="qkv_proj", o="o_proj", gate_up="gate_up_proj", down="down_proj"),
    "phi": dict(q="q_proj", k="k_proj", v="v_proj", o="dense", fc1="fc1", fc2="fc2"),
    "gpt2": dict(qkv="c_attn", o="c_proj", fc1="c_fc", fc2="c_proj"),
    "falcon": dict(qkv="query_key_value", o="dense", fc1="dense_h_to_4h", fc2="dense_4h_to_h"),
    "bloom": dict(qkv="query_key_value", o="dense", fc1="dense_h_to_4h", fc2="dense_4h_to_h"),
    "opt": dict(q="q_proj", k="k_proj", v="v_proj", o="out_proj", fc1="fc1", fc2="fc2"),
}


# What depends only on the model is computed once per model: the functions below that take a
# ModelSpec alone are cached on it (a frozen, hashable dataclass; the search asks the same
# model's shapes tens of thousands of times per plan). They return tuples, never a list a caller
# could change under the cache.
_per_model = lru_cache(maxsize=256)


@_per_model
def block_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    """The projections of one decoder block (the ones LoRA adapts and bitsandbytes quantizes).

    An MoE block's nn.Linear modules are its attention and, where it has one, the shared expert
    and its one-output gate; the routed experts and the router are not Linears (moe_numel)."""
    if spec.is_moe:
        out = list(block_linears(dense_view(spec)))
        if spec.shared_expert_intermediate_size:
            out.append(Linear("shared_expert_gate", spec.hidden_size, 1, False))
        return tuple(out)
    n = _NAMES.get(spec.model_type, _NAMES["default"])
    h, q, kv, i = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    out: list[Linear] = []
    if spec.fused_qkv:
        out.append(Linear(n["qkv"], h, q + 2 * kv, spec.qkv_bias))
    else:
        out += [Linear(n["q"], h, q, spec.qkv_bias), Linear(n["k"], h, kv, spec.qkv_bias),
                Linear(n["v"], h, kv, spec.qkv_bias)]
    out.append(Linear(n["o"], q, h, spec.out_bias))
    if spec.mlp == "none":
        return tuple(out)
    if spec.mlp == "gated":
        if spec.fused_gate_up:
            out.append(Linear(n["gate_up"], h, 2 * i, spec.mlp_bias))
        else:
            out += [Linear(n["gate"], h, i, spec.mlp_bias), Linear(n["up"], h, i, spec.mlp_bias)]
        out.append(Linear(n["down"], i, h, spec.mlp_bias))
    else:
        out += [Linear(n["fc1"], h, i, spec.mlp_bias), Linear(n["fc2"], i, h, spec.mlp_bias)]
    return tuple(out)


@_per_model
def mlp_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    """The MLP's projections of one decoder block: block_linears after the attention's (q, k, v,
    o, or a fused qkv and o)."""
    return block_linears(spec)[2 if spec.fused_qkv else 4:]


def norm_numel(spec: ModelSpec) -> int:
    """Parameters of one norm: RMSNorm has a weight, LayerNorm a weight and a bias."""
    return spec.hidden_size * (2 if spec.norm == "layer" else 1)


@_per_model
def embedding_numel(spec: ModelSpec) -> int:
    """Token embedding (+ learned positions, + embedding norm)."""
    n = spec.embedding_rows * spec.hidden_size + spec.learned_positions * spec.hidden_size
    return n + (norm_numel(spec) if spec.embedding_norm else 0)


def lm_head_numel(spec: ModelSpec) -> int:
    """The output projection; 0 when it is tied to the embedding (counted once)."""
    if spec.tie_word_embeddings:
        return 0
    return spec.vocab_size * spec.hidden_size + (spec.vocab_size if spec.lm_head_bias else 0)


def qk_norm_numel(spec: ModelSpec) -> int:
    """q_norm + k_norm weights of one layer (RMSNorm over a head, or over all q / kv heads)."""
    if spec.qk_norm == "head":
        return 2 * spec.head_dim
    if spec.qk_norm == "full":
        return spec.q_dim + spec.kv_dim
    return 0


@_per_model
def dense_view(spec: ModelSpec) -> ModelSpec:
    """An MoE spec as the dense block its Linears form: attention plus the shared expert (a gated
    MLP of shared_expert_intermediate_size), or attention alone."""
    from dataclasses import replace

    shared = spec.shared_expert_intermediate_size
    return replace(spec, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                   shared_expert_intermediate_size=0, intermediate_size=shared,
                   mlp="gated" if shared else "none")


@_per_model
def expert_shapes(spec: ModelSpec) -> tuple[tuple[int, ...], ...]:
    """One MoE layer's parameters that are no nn.Linear and no norm: router [E, h],
    experts.gate_up_proj [E, 2I, h], experts.down_proj [E, h, I] (transformers 5 MixtralExperts /
    Qwen3MoeExperts / OlmoeExperts / Qwen2MoeExperts). gpt-oss (GptOssTopKRouter, GptOssExperts,
    GptOssAttention): router weight [E, h] and bias [E], gate_up_proj [E, h, 2I] and its bias
    [E, 2I], down_proj [E, I, h] and its bias [E, h], and the attention sinks [a]."""
    if not spec.is_moe:
        return ()
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    if spec.expert_bias:
        out = [(e, h), (e,), (e, h, 2 * i), (e, 2 * i), (e, i, h), (e, h)]
    else:
        out = [(e, h), (e, 2 * i, h), (e, h, i)]
    return tuple(out + ([(spec.num_heads,)] if spec.attention_sinks else []))


@_per_model
def moe_numel(spec: ModelSpec) -> int:
    """Router + routed experts of one layer."""
    total = 0
    for shape in expert_shapes(spec):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


@_per_model
def block_numel(spec: ModelSpec) -> int:
    return (sum(lin.numel for lin in block_linears(spec)) + spec.norms_per_layer * norm_numel(spec)
            + qk_norm_numel(spec) + moe_numel(spec))


@_per_model
def count_parameters(spec: ModelSpec) -> int:
    """Exact parameter count (tied embeddings counted once), as ``sum(p.numel())`` of the HF
    model; of a multimodal one, the language model's parameters the forward runs through (the
    vision tower and Mllama's cross-attention layers: model_numel)."""
    final_norm = norm_numel(spec)
    return (embedding_numel(spec) + spec.num_layers * block_numel(spec) + final_norm
            + lm_head_numel(spec))


@_per_model
def cross_attention_numel(spec: ModelSpec) -> int:
    """Mllama's cross-attention layers (modeling_mllama.py MllamaCrossAttentionDecoderLayer): q, k,
    v, o as the self-attention's (no bias), q_norm and k_norm over a head, input and
    post-attention RMSNorms, the MLP, and two one-element tanh gates (cross_attn_attn_gate,
    cross_attn_mlp_gate)."""
    per_layer = (sum(lin.numel for lin in block_linears(spec)) + 2 * norm_numel(spec)
                 + 2 * spec.head_dim + 2)
    return len(spec.cross_attention_layers) * per_layer


@_per_model
def vision_numel(spec: ModelSpec) -> int:
    """The vision tower + projector a multimodal checkpoint loads (0 for a text model)."""
    if spec.vision is None:
        return 0
    return tower_numel(spec.vision) + projector_numel(spec.vision)


@_per_model
def model_numel(spec: ModelSpec) -> int:
    """Every parameter transformers loads: the language model (count_parameters) and, for a
    multimodal checkpoint, its vision tower and projector (and Mllama's cross-attention layers)."""
    return count_parameters(spec) + cross_attention_numel(spec) + vision_numel(spec)


def spec_from_dict(data: dict) -> ModelSpec:
    """A ModelSpec from its ``dataclasses.asdict`` form (a saved plan request)."""
    data = dict(data)
    vision = data.pop("vision", None)
    data["cross_attention_layers"] = tuple(data.get("cross_attention_layers") or ())
    if "sliding_cache" not in data and data.get("sliding_layers"):
        # a catalog entry (catalog.json holds config fields only): layer_types with sliding layers
        # give generate's cache DynamicSlidingWindowLayers of the attention's window, as
        # readers._sliding_cache reads a config.json
        data.update(sliding_cache=True, cache_window=data.get("sliding_window") or 0)
    return ModelSpec(**data, vision=VisionSpec(**vision) if vision else None)
