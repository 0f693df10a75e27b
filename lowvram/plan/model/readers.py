"""config.json and GGUF headers -> ModelSpec: the fields each architecture's transformers
configuration class leaves to defaults, the mixture-of-experts layouts, and the model_types the
analytic planner knows (anything else is refused, never estimated as a dense Llama).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from lowvram.errors import ModelError
from lowvram.plan.model.models import ModelSpec

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
    # gpt-oss: GptOssRMSNorm multiplies its weight into the fp32 normalized x (like OLMo-2's)
    "gpt_oss": dict(attention_sinks=True, expert_bias=True, norm_weight_fp32=True),
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
    if mt == "gpt_oss":  # GptOssConfig.attention_bias defaults to True (q, k, v and o)
        out["qkv_bias"] = out["out_bias"] = bool(cfg.get("attention_bias", True))
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
        return multimodal_spec_from_config(cfg, name)
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
    if mt == "gpt_oss":
        # GptOssConfig: layer_types given, or every other layer sliding (window 128 by default);
        # one rotary table for both types
        types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        arch["sliding_window"] = int(cfg.get("sliding_window") or 128)
        arch["sliding_layers"] = sum(1 for lt in types if lt == "sliding_attention")
    if mt in ("gemma3_text", "gpt_oss") and types:
        arch["first_layer_sliding"] = types[0] == "sliding_attention"
        arch["last_layer_sliding"] = types[-1] == "sliding_attention"
    arch["sliding_cache"] = _sliding_cache(mt, cfg, arch)
    window = arch.get("sliding_window") or cfg.get("sliding_window")
    # the window caps generate's cache only where the spec knows which layers slide: counted
    # (sliding_layers: Gemma-3, gpt-oss) or every one (no layer_types, Mistral); layer_types that
    # mix kinds in another family (Qwen2's use_sliding_window) keep every token counted
    known = bool(arch.get("sliding_layers")) or not cfg.get("layer_types")
    if arch["sliding_cache"] and known and isinstance(window, int) and window > 0:
        arch["cache_window"] = window
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


# Config classes that derive layer_types from use_sliding_window (transformers 5
# configuration_qwen2.py / qwen3 / qwen3_moe / smollm3): a sliding_window in their config.json
# makes no sliding layer unless use_sliding_window is on
_USE_SLIDING_WINDOW = ("qwen2", "qwen3", "qwen3_moe", "smollm3")


def _sliding_cache(mt: str, cfg: dict, arch: dict) -> bool:
    """ModelSpec.sliding_cache: whether transformers' DynamicCache makes a DynamicSlidingWindowLayer
    for some layer (cache_utils.py get_layer_types_and_kwargs: layer_types with a sliding or
    chunked layer; without layer_types, every layer of a config with a sliding_window)."""
    types = cfg.get("layer_types")
    if types:
        return any(t in ("sliding_attention", "chunked_attention") for t in types)
    if arch.get("sliding_layers"):
        return True
    if mt in _USE_SLIDING_WINDOW:
        return bool(cfg.get("use_sliding_window")) and cfg.get("sliding_window") is not None
    return cfg.get("sliding_window") is not None or cfg.get("attention_chunk_size") is not None


def _gemma3_layer_types(cfg: dict, layers: int) -> list[str]:
    """Gemma3TextConfig.layer_types: given, or every sliding_window_pattern-th layer (default 6)
    full attention and the others sliding (configuration_gemma3.py)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def read_config(path: Path, name: str) -> ModelSpec:
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


# The language model's model_type when a multimodal config's text_config leaves it out
# (Gemma3Config: Gemma3TextConfig; LlavaConfig: LlamaConfig; Mistral3Config: MistralConfig).
_TEXT_MODEL_TYPE = {"gemma3": "gemma3_text", "llava": "llama", "mistral3": "mistral",
                    "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "mllama": "mllama_text_model"}
# Gemma3TextConfig's defaults (transformers 5 configuration_gemma3.py), which Gemma-3's published
# config.json files rely on: google/gemma-3-4b-it's text_config names neither the heads nor the
# vocabulary.
_TEXT_DEFAULTS = {"gemma3_text": dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
    sliding_window=4096, rope_theta=1_000_000),
    # MllamaTextConfig's (configuration_mllama.py)
    "mllama_text_model": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38])}


def multimodal_spec_from_config(cfg: dict, name: str) -> ModelSpec:
    """The ModelSpec of a multimodal config.json (gemma3, llava, mistral3): the language model
    from its text_config, with the vision tower and projector in ``vision``; other multimodal
    families are refused by vision_spec_from_config."""
    from dataclasses import replace

    from lowvram.plan.model.vision import vision_spec_from_config

    mt = cfg.get("model_type")
    if "vision_config" not in cfg:
        raise _refuse(name, f"the multimodal model_type '{mt}' (a text_config without a "
                      "vision_config)")
    vision = vision_spec_from_config(cfg, name, text_hidden_size=0)
    text = {k: v for k, v in (cfg.get("text_config") or {}).items() if v is not None}
    if mt == "qwen2_5_vl":
        # Qwen2.5-VL's published config.json is flat: the language model's keys at the top level
        # (Qwen2_5_VLConfig pops them into its text_config); its text model is Qwen2's block
        # (Qwen2_5_VLDecoderLayer: biased q/k/v, Qwen2MLP) with M-RoPE positions: the 3-row
        # position ids are an expanded view for text, and Qwen2_5_VLRotaryEmbedding's cos/sin
        # are (batch, seq, head_dim), one table a row (Qwen2's broadcast one (1, seq, head_dim)
        # table): what activations.head_activation_bytes counts per token
        if not text:
            text = {k: v for k, v in cfg.items() if k != "vision_config" and v is not None}
        text["model_type"] = "qwen2"
    if mt == "qwen3_vl":
        # Qwen3-VL's text_config (model_type qwen3_vl_text) is Qwen3's block: Qwen3VLTextAttention
        # with q_norm/k_norm over one head and no biases (attention_bias false), Qwen3VLTextMLP
        # gated; its interleaved M-RoPE tables are (batch, seq, head_dim) like Qwen2.5-VL's
        # (Qwen3VLTextRotaryEmbedding, cast to the hidden states' dtype), and the deepstack
        # features are added only with images (Qwen3VLTextModel._deepstack_process)
        if text.get("attention_bias"):
            raise _refuse(name, "Qwen3-VL with attention_bias true (biased q/k/v/o)")
        text["model_type"] = "qwen3"
    text.setdefault("model_type", _TEXT_MODEL_TYPE.get(mt, "llama"))
    for key, value in _TEXT_DEFAULTS.get(text["model_type"], {}).items():
        text.setdefault(key, value)
    # transformers ties by the top-level value (PreTrainedModel's tied-weights mapping); without
    # one, the text_config's says what the checkpoint holds (Mistral-3's has an lm_head, and
    # from_pretrained does not tie two different tensors), and Gemma-3's has none (Gemma3Config
    # default True); Qwen3VLConfig's top-level default is False, whatever its text_config says
    if "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    elif mt == "gemma3":
        text.setdefault("tie_word_embeddings", True)
    elif mt == "qwen3_vl":
        text["tie_word_embeddings"] = False
    if cfg.get("_name_or_path"):
        text.setdefault("_name_or_path", cfg["_name_or_path"])
    if text["model_type"] == "mllama_text_model":
        return _mllama_spec(text, name, vision)
    spec = spec_from_config(text, name)
    return replace(spec, vision=replace(vision, text_hidden_size=spec.hidden_size))


def _mllama_spec(text: dict, name: str, vision) -> ModelSpec:
    """Llama-3.2-Vision's language model (modeling_mllama.py MllamaTextModel): Llama's
    self-attention blocks (MllamaSelfAttentionDecoderLayer: Llama's attention, RMSNorms and gated
    MLP, Llama's rotary) with cross-attention blocks at text_config.cross_attention_layers, which
    the forward skips without images (ModelSpec.cross_attention_layers); embed_tokens has
    vocab_size + 8 rows; MllamaForConditionalGeneration ties nothing (its _tied_weights_keys is
    commented out)."""
    from dataclasses import replace

    cross = tuple(int(i) for i in text["cross_attention_layers"])
    flat = {**text, "model_type": "llama", "tie_word_embeddings": False,
            "num_hidden_layers": int(text["num_hidden_layers"]) - len(cross)}
    flat.pop("head_dim", None)  # MllamaTextSelfAttention: hidden_size // num_attention_heads
    spec = spec_from_config(flat, name)
    return replace(spec, cross_attention_layers=cross, embedding_extra_rows=8,
                   vision=replace(vision, text_hidden_size=spec.hidden_size))

