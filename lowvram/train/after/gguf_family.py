"""The model families the GGUF writer handles: which llama.cpp architecture each is, the metadata
keys and tensor changes llama.cpp's convert_hf_to_gguf.py writes for it (its LlamaModel,
Qwen2Model, Qwen3Model, Gemma2Model, Gemma3Model, Phi3MiniModel), and what is refused.

Every family here is read back and checked (gguf_check.py): by transformers' GGUF loader where it
knows the architecture (transformers/integrations/ggml.py GGUF_CONFIG_MAPPING,
modeling_gguf_pytorch_utils.TENSOR_PROCESSORS), else by gguf_readback.py (olmo2, smollm3). The loader rebuilds the config from the file's keys and takes the
config class's defaults for the rest: a model whose config differs from those defaults in a key
the file does not carry back (``Family.defaults_only``) could not be checked, and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowvram.errors import LowvramError


@dataclass(frozen=True)
class Family:
    arch: str  # gguf.MODEL_ARCH_NAMES value
    permute_qk: bool = False  # llama's q/k row order (LlamaModel.permute; undone by LlamaTensorProcessor)
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + w): GGUF stores w + 1 (Gemma2Model.modify_tensors)
    defaults_only: tuple[str, ...] = ()  # config keys the loader takes from the class defaults


FAMILIES = {
    # Mistral is written as llama, as llama.cpp's converter does (MistralModel.model_arch = LLAMA).
    "llama": Family("llama", permute_qk=True),
    "mistral": Family("llama", permute_qk=True),
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),
    "gemma2": Family("gemma2", norm_offset=1.0, defaults_only=(
        "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation",
        "layer_types")),
    "gemma3_text": Family("gemma3", norm_offset=1.0, defaults_only=(
        "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation",
        "layer_types", "use_bidirectional_attention")),
    "phi3": Family("phi3", defaults_only=("hidden_act",)),
    # Read back by gguf_readback.py (transformers' loader does not know these architectures).
    "olmo2": Family("olmo2"),
    # llama.cpp's smollm3 takes every 4th layer as the one without rope (SmolLM3's default
    # no_rope_layer_interval); the file cannot say otherwise
    "smollm3": Family("smollm3", permute_qk=True, defaults_only=("no_rope_layers", "no_rope_layer_interval",
                                                                 "use_sliding_window", "layer_types")),
}
# The architectures transformers' GGUF loader reads back (integrations/ggml.py GGUF_CONFIG_MAPPING);
# the others are read back by gguf_readback.py.
READ_BY_TRANSFORMERS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")

# Families llama.cpp defines that the writer does not handle, and why.
REFUSED = {
    "gemma3": "a Gemma-3 with its vision tower (Gemma3ForConditionalGeneration): the writer handles the "
              "text-only Gemma-3 (gemma3_text)",
}

_CONVERT_HINT = "merge it (`lowvram merge RUN --out DIR`) and convert DIR with llama.cpp's convert_hf_to_gguf.py"


def _names() -> str:
    return ", ".join(sorted(FAMILIES))


def rope_parameters(config: dict) -> dict[str, dict]:
    """The rope settings per attention kind ("all" unless the config splits them, as Gemma-3's
    full_attention / sliding_attention do), from rope_parameters or the older rope_scaling."""
    params = config.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return params
    scaling = config.get("rope_scaling") or {}
    merged = {**scaling, **params}
    if "rope_theta" not in merged and config.get("rope_theta") is not None:
        merged["rope_theta"] = config["rope_theta"]
    return {"all": merged}


def rope_theta(config: dict) -> float:
    params = rope_parameters(config)
    main = params.get("full_attention") or params.get("all") or {}
    return float(main.get("rope_theta") or 10000.0)


def head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def family_of(config: dict) -> Family:
    """The family of a config.json, or LowvramError naming what can be exported."""
    model_type = config.get("model_type")
    if model_type in REFUSED:
        raise LowvramError(f"cannot export a {model_type!r} model to GGUF: {REFUSED[model_type]}", _CONVERT_HINT)
    if model_type not in FAMILIES:
        raise LowvramError(f"cannot export a {model_type!r} model to GGUF yet: the GGUF writer handles "
                           f"{_names()} (verified by reading the file back)", _CONVERT_HINT)
    for kind, params in rope_parameters(config).items():
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type == "llama3" and model_type == "llama":
            continue  # written as rope_freqs and checked (rope_factors, gguf_check.py)
        if rope_type != "default":
            raise LowvramError(f"cannot export a model with {rope_type!r} rope scaling to GGUF yet: transformers' "
                               "GGUF loader cannot read it back, so the file could not be checked", _CONVERT_HINT)
        if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise LowvramError("cannot export a model with partial rotary embeddings to GGUF yet: transformers' "
                               "GGUF loader cannot read them back, so the file could not be checked", _CONVERT_HINT)
        # llama.cpp's gemma3 takes 10000 as the sliding layers' rope base (llama-model.cpp), as does
        # Gemma3TextConfig's default
        if kind == "sliding_attention" and float(params.get("rope_theta", 10000.0)) != 10000.0:
            raise LowvramError("cannot export a Gemma-3 whose sliding layers' rope base is not 10000 to GGUF: "
                               "llama.cpp assumes 10000", _CONVERT_HINT)
    family = FAMILIES[model_type]
    _refuse_unreadable(config, model_type, family)
    return family


def _refuse_unreadable(config: dict, model_type: str, family: Family) -> None:
    """Refuse a config that differs from its class defaults in a key the loader does not read."""
    if not family.defaults_only:
        return
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type, num_hidden_layers=config["num_hidden_layers"]).to_dict()
    differ = [k for k in family.defaults_only if k in config and config[k] != default.get(k)]
    if differ:
        shown = ", ".join(f"{k}={config[k]!r} (default {default.get(k)!r})" for k in differ)
        raise LowvramError(f"cannot export this {model_type} model to GGUF with a check: transformers' GGUF loader "
                           f"takes {shown} from the defaults, so the file read back would differ", _CONVERT_HINT)


def uses_llama3_rope(config: dict) -> bool:
    return any((p.get("rope_type") or p.get("type")) == "llama3" for p in rope_parameters(config).values())


def rope_factors(config):
    """Llama-3.1's rope scaling as llama.cpp reads it: the rope_freqs tensor, one factor per
    frequency that divides it (llama.cpp's rope: theta = pos * base^(-2i/d) / factor_i), i.e. the
    default inverse frequencies over the ones transformers' own llama3 rope computes
    (modeling_rope_utils._compute_llama3_parameters) - what convert_hf_to_gguf.py's
    LlamaModel.generate_extra_tensors writes. ``config``: a transformers config object."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    if attention_factor != 1.0:
        raise LowvramError("this llama3 rope scaling scales attention, which llama.cpp's rope_freqs cannot say",
                           _CONVERT_HINT)
    dim = head_dim(config.to_dict())
    base = float(config.rope_parameters["rope_theta"])
    default = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return (default / scaled.double()).float()


def write_metadata(w, config: dict, family: Family) -> None:
    """The model's hyperparameters under llama.cpp's keys, as convert_hf_to_gguf.py writes them."""
    hd = head_dim(config)
    nh = int(config["num_attention_heads"])
    w.add_context_length(int(config["max_position_embeddings"]))
    w.add_embedding_length(int(config["hidden_size"]))
    w.add_block_count(int(config["num_hidden_layers"]))
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_head_count(nh)
    w.add_head_count_kv(int(config.get("num_key_value_heads") or nh))
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(rope_theta(config))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_vocab_size(int(config["vocab_size"]))
    if family.arch == "gemma2":
        w.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
        w.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
        w.add_sliding_window(int(config["sliding_window"]))
    elif family.arch == "gemma3":
        if config.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
        if "sliding_attention" in (config.get("layer_types") or ()):
            w.add_sliding_window(int(config["sliding_window"]))
    elif family.arch == "phi3":
        # Phi3MiniModel.set_gguf_parameters: 0 tells Phi-4 (no sliding window) from Phi-3
        w.add_rope_scaling_orig_ctx_len(int(config.get("original_max_position_embeddings")
                                            or config["max_position_embeddings"]))
        w.add_sliding_window(int(config.get("sliding_window") or 0))


def converted(family: Family, gguf_name: str, data, config: dict):
    """A tensor (numpy, float32) as the file stores it: q/k rows permuted for llama's rope, Gemma's
    norm weights + 1."""
    nh = int(config["num_attention_heads"])
    if family.permute_qk and gguf_name.endswith("attn_q.weight"):
        return _permute(data, nh)
    if family.permute_qk and gguf_name.endswith("attn_k.weight"):
        return _permute(data, int(config.get("num_key_value_heads") or nh))
    if family.norm_offset and gguf_name.endswith("norm.weight"):
        return data + family.norm_offset
    return data


def _permute(w, n_head: int):
    """llama.cpp's LlamaModel.permute: q/k rows reordered from HF's rotate-half to GGML's rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(family: Family, config: dict, hf_shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """HF tensor name -> GGUF name for the tensors the file holds (gguf's own tensor-name map);
    the tied lm_head and rotary buffers are left out. LowvramError for a tensor with no name."""
    import gguf

    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family.arch)
    names = gguf.get_tensor_name_map(arch, int(config["num_hidden_layers"]))
    tied = bool(config.get("tie_word_embeddings", False))
    out = {}
    for hf_name in hf_shapes:
        if (tied and hf_name == "lm_head.weight") or hf_name.endswith("rotary_emb.inv_freq"):
            continue  # llama.cpp reads a missing output.weight as token_embd.weight
        new = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise LowvramError(f"the GGUF writer has no name for the tensor {hf_name}", _CONVERT_HINT)
        out[hf_name] = new
    return out
