"""Model architecture facts, from the offline catalog or a config.json (no weights, no torch).

``resolve_model`` answers in milliseconds: ``lowvram plan --model llama-7b`` must be instant.
Parameter counts are derived from the block structure (``block_linears`` + norms + embeddings)
and are exact: tests/test_plan_models.py builds the transformers model from the same fields on
the meta device and compares ``sum(p.numel())``.
"""

from __future__ import annotations

import difflib
import json
import os
import struct
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

from lowvram.errors import ModelError

_CATALOG = Path(__file__).with_name("catalog.json")


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
    # Mixture of experts (every decoder layer sparse; 0 = dense). transformers 5 stores a layer's
    # experts fused in two 3-D parameters (experts.gate_up_proj [E, 2I, h], experts.down_proj
    # [E, h, I]) and the router as a bare [E, h] weight: none of them is an nn.Linear.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # I of one expert
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on gated MLP + a sigmoid gate

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


def block_linears(spec: ModelSpec) -> list[Linear]:
    """The projections of one decoder block (the ones LoRA adapts and bitsandbytes quantizes).

    An MoE block's nn.Linear modules are its attention and, where it has one, the shared expert
    and its one-output gate; the routed experts and the router are not Linears (moe_numel)."""
    if spec.is_moe:
        out = block_linears(dense_view(spec))
        if spec.shared_expert_intermediate_size:
            out.append(Linear("shared_expert_gate", spec.hidden_size, 1, False))
        return out
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
        return out
    if spec.mlp == "gated":
        if spec.fused_gate_up:
            out.append(Linear(n["gate_up"], h, 2 * i, spec.mlp_bias))
        else:
            out += [Linear(n["gate"], h, i, spec.mlp_bias), Linear(n["up"], h, i, spec.mlp_bias)]
        out.append(Linear(n["down"], i, h, spec.mlp_bias))
    else:
        out += [Linear(n["fc1"], h, i, spec.mlp_bias), Linear(n["fc2"], i, h, spec.mlp_bias)]
    return out


def norm_numel(spec: ModelSpec) -> int:
    """Parameters of one norm: RMSNorm has a weight, LayerNorm a weight and a bias."""
    return spec.hidden_size * (2 if spec.norm == "layer" else 1)


def embedding_numel(spec: ModelSpec) -> int:
    """Token embedding (+ learned positions, + embedding norm)."""
    n = spec.vocab_size * spec.hidden_size + spec.learned_positions * spec.hidden_size
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


def dense_view(spec: ModelSpec) -> ModelSpec:
    """An MoE spec as the dense block its Linears form: attention plus the shared expert (a gated
    MLP of shared_expert_intermediate_size), or attention alone."""
    from dataclasses import replace

    shared = spec.shared_expert_intermediate_size
    return replace(spec, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                   shared_expert_intermediate_size=0, intermediate_size=shared,
                   mlp="gated" if shared else "none")


def expert_shapes(spec: ModelSpec) -> list[tuple[int, ...]]:
    """One MoE layer's parameters that are no nn.Linear: router [E, h], experts.gate_up_proj
    [E, 2I, h], experts.down_proj [E, h, I] (transformers 5 MixtralExperts / Qwen3MoeExperts /
    OlmoeExperts / Qwen2MoeExperts)."""
    if not spec.is_moe:
        return []
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    return [(e, h), (e, 2 * i, h), (e, h, i)]


def moe_numel(spec: ModelSpec) -> int:
    """Router + routed experts of one layer."""
    total = 0
    for shape in expert_shapes(spec):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def block_numel(spec: ModelSpec) -> int:
    return (sum(lin.numel for lin in block_linears(spec)) + spec.norms_per_layer * norm_numel(spec)
            + qk_norm_numel(spec) + moe_numel(spec))


def count_parameters(spec: ModelSpec) -> int:
    """Exact parameter count (tied embeddings counted once), as ``sum(p.numel())`` of the HF model."""
    final_norm = norm_numel(spec)
    return (embedding_numel(spec) + spec.num_layers * block_numel(spec) + final_norm
            + lm_head_numel(spec))


# --------------------------------------------------------------------------------------------
# Catalog and config.json


@lru_cache(maxsize=1)
def _catalog() -> dict[str, dict]:
    return json.loads(_CATALOG.read_text())["models"]


@lru_cache(maxsize=1)
def _aliases() -> dict[str, str]:
    out: dict[str, str] = {}
    for name, entry in _catalog().items():
        for key in [name, *entry.get("aliases", []), entry.get("hf_id") or ""]:
            if key:
                out[key.lower()] = name
                out[key.lower().rsplit("/", 1)[-1]] = out.get(key.lower().rsplit("/", 1)[-1], name)
    return out


def is_catalog_name(name: str) -> bool:
    """A catalog name, alias or hub id of a catalog entry (case-insensitive)."""
    return name.strip().lower() in _aliases()


def catalog_names() -> list[str]:
    """Canonical catalog names (aliases and hub ids resolve to these)."""
    return sorted(_catalog())


_SPEC_FIELDS = {f.name for f in fields(ModelSpec)}


def _from_catalog(name: str) -> ModelSpec:
    entry = {k: v for k, v in _catalog()[name].items() if k in _SPEC_FIELDS}
    return ModelSpec(name=name, **entry)


# Per-architecture defaults that config.json files leave out, from each model's
# transformers configuration class (configuration_<model>.py).
_ARCH: dict[str, dict] = {
    "llama": {}, "mistral": {}, "gemma": dict(norm_weight_fp32=True), "qwen2": dict(qkv_bias=True), "qwen3": {},
    "phi3": dict(fused_qkv=True, fused_gate_up=True),
    "phi": dict(mlp="plain", norm="layer", qkv_bias=True, out_bias=True, mlp_bias=True,
                lm_head_bias=True, norms_per_layer=1, parallel_attn=True),
    "gpt2": dict(mlp="plain", norm="layer", fused_qkv=True, qkv_bias=True, out_bias=True,
                 mlp_bias=True, resid_dropout=0.1, embd_dropout=0.1, attn_dropout=0.1),
    "falcon": dict(mlp="plain", norm="layer", fused_qkv=True, norms_per_layer=1,
                   parallel_attn=True),
    "bloom": dict(mlp="plain", norm="layer", fused_qkv=True, qkv_bias=True, out_bias=True,
                  mlp_bias=True, embedding_norm=True),
    "opt": dict(mlp="plain", norm="layer", qkv_bias=True, out_bias=True, mlp_bias=True),
}
_TIE_DEFAULT = {"gemma": True, "gemma3_text": True, "smollm3": True, "gpt2": True, "falcon": True,
                "bloom": True, "opt": True}

# Mixture-of-experts families whose layout the planner models (transformers 5 modeling_<type>.py:
# fused experts + a bare router weight; Qwen2-MoE adds a shared expert). Their config keys:
# Mixtral num_local_experts, the others num_experts; the expert width is intermediate_size
# (Mixtral, OLMoE) or moe_intermediate_size (Qwen2/3-MoE). Qwen3-MoE / OLMoE add q/k RMSNorms
# (per head / over all heads).
_MOE_ARCH: dict[str, dict] = {
    "mixtral": {}, "qwen3_moe": dict(qk_norm="head"), "olmoe": dict(qk_norm="full"),
    "qwen2_moe": dict(qkv_bias=True),
}
_ARCH.update({"qwen3": dict(qk_norm="head")})
# Dense families with norms or q/k norms beyond Llama's (transformers 5 modeling_<type>.py):
# Gemma-3 (Gemma3DecoderLayer): input, post-attention, pre-feedforward and post-feedforward
# RMSNorms, q_norm/k_norm over one head; OLMo-2 (Olmo2DecoderLayer): post-attention and
# post-feedforward RMSNorms only, q_norm/k_norm over all q / kv heads; SmolLM3: Llama's block
# (its NoPE layers skip the rotary, which has no parameters).
_ARCH.update({"gemma3_text": dict(qk_norm="head", norms_per_layer=4, norm_weight_fp32=True),
              "olmo2": dict(qk_norm="full", norm_weight_fp32=True, norm_after=True,
                            rotary_fp32=True),
              "smollm3": {}})
# Every model_type the analytic planner knows the block of (GGUF names included: llama.cpp
# writes the same architecture names for these). Anything else is refused, never estimated as a
# dense Llama: `lowvram plan --simulate` builds any config transformers can build.
KNOWN_MODEL_TYPES = frozenset(_ARCH) | frozenset(_MOE_ARCH)


def _refuse(name: str, what: str) -> ModelError:
    return ModelError(
        f"{name}: the analytic planner does not model {what}",
        "`lowvram plan --model DIR --simulate` runs the real training step of any config "
        "transformers can build (fake tensors, no download of weights)")


def _moe_fields(cfg: dict, mt: str, name: str) -> dict:
    """MoE fields of a config.json (empty for a dense model); refuses layouts not modelled."""
    experts = _first(cfg, "num_local_experts", "num_experts", "n_routed_experts")
    if not experts:
        return {}
    if mt not in _MOE_ARCH:
        raise _refuse(name, f"the mixture-of-experts layout of model_type '{mt}' ({experts} "
                      "experts): its expert, router and shared-expert parameters are not counted")
    sparse_step = cfg.get("decoder_sparse_step", 1) or 1
    if cfg.get("mlp_only_layers") or sparse_step != 1:
        raise _refuse(name, "an MoE model with dense layers among the sparse ones "
                      "(mlp_only_layers / decoder_sparse_step)")
    width_key = "moe_intermediate_size" if mt in ("qwen2_moe", "qwen3_moe") else "intermediate_size"
    inter = cfg.get(width_key)
    top_k = cfg.get("num_experts_per_tok")
    if not inter or not top_k:
        raise ModelError(f"{name}: MoE config.json lacks {width_key} or num_experts_per_tok",
                         "check the file is the model's config.json")
    out = dict(num_experts=int(experts), num_experts_per_tok=int(top_k),
               moe_intermediate_size=int(inter), **_MOE_ARCH[mt])
    if mt == "qwen2_moe":
        out["shared_expert_intermediate_size"] = int(cfg.get("shared_expert_intermediate_size") or 0)
        out["qkv_bias"] = bool(cfg.get("qkv_bias", True))
    return out


def _first(cfg: dict, *keys: str):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


def spec_from_config(cfg: dict, name: str) -> ModelSpec:
    """A ModelSpec from a transformers config.json dict; names every missing field at once.
    Multimodal configs, unknown model types and MoE layouts not modelled are refused."""
    mt = cfg.get("model_type", "llama")
    if "vision_config" in cfg or "text_config" in cfg:
        raise _refuse(name, f"the multimodal model_type '{mt}': AutoModelForCausalLM loads "
                      "its vision tower with the text model (or does not load it at all), and "
                      "only the text model would be counted")
    moe = _moe_fields(cfg, mt, name)
    if mt not in KNOWN_MODEL_TYPES:
        raise _refuse(name, f"model_type '{mt}' (known: {', '.join(sorted(KNOWN_MODEL_TYPES))})")
    h = _first(cfg, "hidden_size", "n_embd", "d_model")
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    vocab = _first(cfg, "vocab_size")
    missing = [k for k, v in [("hidden_size", h), ("num_hidden_layers", layers),
                              ("num_attention_heads", heads), ("vocab_size", vocab)] if v is None]
    inter = _first(cfg, "intermediate_size", "n_inner", "ffn_dim")
    if moe:
        inter = inter or 0  # unused by all-sparse MoE layers (Qwen3-MoE: dense-layer width)
    if inter is None and h is not None:
        if mt in ("gpt2", "falcon", "bloom"):
            inter = 4 * h  # these configs leave the MLP width implicit (4 x hidden)
        else:
            missing.append("intermediate_size")
    if missing:
        raise ModelError(
            f"{name}: config.json lacks {', '.join(missing)}",
            "lowvram needs these architecture fields; check the file is a causal LM's config.json",
        )
    arch = dict(_ARCH.get(mt, {}))
    kv = _first(cfg, "num_key_value_heads", "num_kv_heads")
    if kv is None:
        kv = 1 if cfg.get("multi_query") else heads
    head_dim = _first(cfg, "head_dim") or h // heads
    tie = cfg.get("tie_word_embeddings", _TIE_DEFAULT.get(mt, False))
    if mt == "qwen2" or cfg.get("attention_bias"):
        arch["qkv_bias"] = True
        if cfg.get("attention_bias"):
            arch["out_bias"] = True
    if cfg.get("mlp_bias"):
        arch["mlp_bias"] = True
    arch.update(moe)
    if mt == "falcon" and cfg.get("bias"):
        arch.update(qkv_bias=True, out_bias=True, mlp_bias=True)
    for field_name, keys in (("resid_dropout", ("resid_pdrop", "hidden_dropout", "resid_dropout")),
                             ("embd_dropout", ("embd_pdrop", "embedding_dropout")),
                             ("attn_dropout", ("attn_pdrop", "attention_dropout"))):
        value = _first(cfg, *keys)
        if isinstance(value, (int, float)):
            arch[field_name] = float(value)
    positions = _first(cfg, "max_position_embeddings", "n_positions", "seq_length") or 2048
    if mt == "gemma3_text":
        types = _gemma3_layer_types(cfg, layers)
        arch["rotary_tables"] = len(set(types))
        arch["sliding_window"] = int(cfg.get("sliding_window") or 4096)
        arch["sliding_layers"] = sum(1 for lt in types if lt == "sliding_attention")
    if mt == "gpt2":
        arch["learned_positions"] = positions
    if mt == "opt":
        arch["learned_positions"] = positions + 2  # OPT offsets positions by 2
    return ModelSpec(
        name=name, hf_id=cfg.get("_name_or_path") or None, model_type=mt, hidden_size=h,
        intermediate_size=inter, num_layers=layers, num_heads=heads, num_kv_heads=kv,
        head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=bool(tie),
        max_position_embeddings=positions,
        hidden_act=_first(cfg, "hidden_act", "hidden_activation", "activation_function")
        or ("gelu_pytorch_tanh" if mt == "gemma3_text" else "silu"),  # Gemma3TextConfig default
        rope_theta=cfg.get("rope_theta"),
        partial_rotary_factor=cfg.get("partial_rotary_factor", 1.0), **arch,
    )


def _gemma3_layer_types(cfg: dict, layers: int) -> list[str]:
    """Gemma3TextConfig.layer_types: given, or every sliding_window_pattern-th layer (default 6)
    full attention and the others sliding (configuration_gemma3.py)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def _read_config(path: Path, name: str) -> ModelSpec:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {path}: {e}", "pass a folder with a valid config.json") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{path} is not a JSON object", "pass a transformers config.json")
    return spec_from_config(cfg, name)


# GGUF metadata (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): little-endian
# header "GGUF", version, tensor count, key-value count, then typed key-value pairs and the
# tensor infos (name, dims, type, offset). Read with struct, never the tensor data: ~20 ms for
# SmolLM2-135M (the gguf package's GGUFReader takes ~1.8 s there: it maps every tensor).
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}


def _gguf_metadata(path: Path) -> tuple[dict, list[str]]:
    """(key-value metadata, tensor names) of a GGUF file; arrays of strings become their length."""
    import io

    def read(f, fmt):
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

    def string(f):
        return f.read(read(f, "<Q")).decode("utf-8", "replace")

    def value(f, vtype):
        if vtype in _GGUF_SCALARS:
            return read(f, _GGUF_SCALARS[vtype])
        if vtype == 8:
            return string(f)
        if vtype == 9:
            itype, n = read(f, "<I"), read(f, "<Q")
            if itype in _GGUF_SCALARS:
                f.seek(n * struct.calcsize(_GGUF_SCALARS[itype]), io.SEEK_CUR)
                return n
            for _ in range(n):
                value(f, itype)
            return n
        raise ValueError(f"unknown GGUF value type {vtype}")

    with path.open("rb") as raw:
        f = io.BufferedReader(raw, buffer_size=1 << 20)
        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        version = read(f, "<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = read(f, "<Q"), read(f, "<Q")
        meta = {}
        for _ in range(n_kv):
            key = string(f)
            meta[key] = value(f, read(f, "<I"))
        names = []
        for _ in range(n_tensors):
            names.append(string(f))
            f.seek(8 * read(f, "<I") + 4 + 8, io.SEEK_CUR)  # dims, type, offset
    return meta, names


def spec_from_gguf(path: Path, name: str) -> ModelSpec:
    """A ModelSpec from a GGUF file's metadata (llama.cpp key names, {arch}.*)."""
    try:
        meta, names = _gguf_metadata(path)
    except (OSError, ValueError, struct.error) as e:
        raise ModelError(f"cannot read the GGUF metadata of {path}: {e}",
                         "pass a folder with the model's config.json") from None
    arch = meta.get("general.architecture", "llama")

    def get(key):
        return meta.get(f"{arch}.{key}")

    h, heads = get("embedding_length"), get("attention.head_count")
    vocab = get("vocab_size") or meta.get("tokenizer.ggml.tokens")
    cfg = {
        "model_type": arch, "hidden_size": h, "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv") or heads, "vocab_size": vocab,
        "head_dim": get("attention.key_length") or get("rope.dimension_count"),
        "max_position_embeddings": get("context_length"), "rope_theta": get("rope.freq_base"),
        # llama.cpp writes no output.weight when the head is tied to the embedding
        "tie_word_embeddings": "output.weight" not in names,
    }
    return spec_from_config({k: v for k, v in cfg.items() if v is not None}, name)


def hub_cache_config(hub_id: str) -> Path | None:
    """The newest cached config.json of a hub id (huggingface_hub's cache layout), or None."""
    root = Path(os.environ.get("HF_HUB_CACHE") or Path(
        os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub")
    folder = root / ("models--" + hub_id.replace("/", "--"))
    found = sorted(folder.glob("snapshots/*/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


# Specs registered in this process for names the resolver cannot read itself (e.g. `lowvram
# plan --simulate` on a config.json whose fields only transformers can interpret).
_REGISTERED: dict[str, ModelSpec] = {}


def register_spec(name_or_path: str, spec: ModelSpec) -> None:
    """Make ``resolve_model(name_or_path)`` answer ``spec`` in this process."""
    _REGISTERED[name_or_path.strip()] = spec


def resolve_model(name_or_path: str) -> ModelSpec:
    """Catalog name/alias/hub id (case-insensitive), a folder or config.json, or a cached hub id."""
    key = name_or_path.strip()
    if key in _REGISTERED:
        return _REGISTERED[key]
    if key.lower() in _aliases():
        return _from_catalog(_aliases()[key.lower()])
    path = Path(key).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return _read_config(path / "config.json", path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return spec_from_gguf(ggufs[0], path.name)
        raise ModelError(
            f"{path} has no config.json",
            f"files there: {', '.join(sorted(p.name for p in path.iterdir())[:8]) or 'none'}; "
            "pass the folder that holds the model's config.json",
        )
    if path.is_file():
        if path.suffix == ".gguf":
            return spec_from_gguf(path, path.stem)
        return _read_config(path, path.parent.name)
    if "/" in key:
        cached = hub_cache_config(key)
        if cached is not None:
            return _read_config(cached, key)
    close = difflib.get_close_matches(key.lower(), list(_aliases()), n=3, cutoff=0.5)
    close_names = list(dict.fromkeys(_aliases()[c] for c in close))
    hint = (f"did you mean {', '.join(close_names)}? " if close_names else "") + (
        "known models: `lowvram plan --list-models`; or pass a local folder with config.json")
    raise ModelError(f"unknown model '{name_or_path}'", hint)
