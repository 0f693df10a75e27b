"""Write a transformers causal LM as a GGUF file with the maintained `gguf` package (llama.cpp's
own gguf-py): GGUFWriter, its tensor-name maps (gguf.get_tensor_name_map) and SpecialVocab for the
merges, special token ids and chat template. What is written follows llama.cpp's
convert_hf_to_gguf.py for the families below (its LlamaModel / Qwen2Model / Qwen3Model): the
metadata keys, the byte-level BPE vocabulary (tokenizer.ggml.model "gpt2"), the q/k row permutation
of the llama architecture (undone by transformers' LlamaTensorProcessor._reverse_permute_weights on
load), 1-D tensors (norms, biases) kept in F32, and Q8_0 only for rows a multiple of its 32-wide block
(others F16, as llama.cpp's converter does).

Only what transformers' GGUF loader reads back is written, so every export is checked (gguf_check.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lowvram.errors import LowvramError

# transformers model_type -> llama.cpp architecture name (gguf.MODEL_ARCH_NAMES values). Mistral is
# written as llama, as llama.cpp's converter does (MistralModel.model_arch = MODEL_ARCH.LLAMA).
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
QUANTIZATIONS = ("f16", "bf16", "q8_0")
K_QUANTS = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k",
            "q4_0", "q4_1", "q5_0", "q5_1")

# tokenizer.ggml.pre: the pre-tokenizer names llama.cpp (llama-vocab.cpp) and transformers' GGUF
# tokenizer reader agree on, recognised from tokenizer.json's pre_tokenizer (llama.cpp's converter
# recognises them by hashing a test string's tokens; the structure says the same for these).
_LLAMA3_REGEX_START = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
_QWEN2_REGEX_START = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"


@dataclass(frozen=True)
class TensorPlan:
    name: str  # the GGUF name
    shape: tuple[int, ...]
    kind: str  # f32 | f16 | bf16 | q8_0


def family_of(config: dict) -> str:
    """The llama.cpp architecture of a config.json, or LowvramError naming what can be exported."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise LowvramError(f"cannot export a {model_type!r} model to GGUF yet: the GGUF writer handles "
                           f"{', '.join(sorted(FAMILIES))} (verified by reading the file back)",
                           "merge it (`lowvram merge RUN --out DIR`) and convert DIR with llama.cpp's "
                           "convert_hf_to_gguf.py")
    scaling = config.get("rope_scaling") or {}
    params = config.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or params.get("rope_type") or "default"
    if rope_type != "default":
        raise LowvramError(f"cannot export a model with {rope_type!r} rope scaling to GGUF yet: transformers' "
                           "GGUF loader cannot read it back, so the file could not be checked",
                           "merge it (`lowvram merge RUN --out DIR`) and convert DIR with llama.cpp's "
                           "convert_hf_to_gguf.py")
    return FAMILIES[model_type]


def rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)


def head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """tokenizer.ggml.pre for a byte-level BPE tokenizer.json, or LowvramError."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        regex = (parts[0].get("pattern") or {}).get("Regex", "")
        if regex.startswith(_LLAMA3_REGEX_START):
            return "llama-bpe"
        if regex.startswith(_QWEN2_REGEX_START):
            return "qwen2"
    raise LowvramError(f"the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds)) or 'none'}) is not one the "
                       "GGUF writer knows (GPT-2, SmolLM, Llama-3 or Qwen2 byte-level BPE)",
                       "convert the merged folder with llama.cpp's convert_hf_to_gguf.py")


def tensor_kind(name: str, shape: tuple[int, ...], quantization: str) -> str:
    """F32 for 1-D tensors (norms, biases), the chosen type for matrices; Q8_0 needs rows in 32s."""
    if len(shape) < 2:
        return "f32"
    if quantization == "q8_0" and shape[-1] % 32 != 0:
        return "f16"
    return quantization


def tensor_bytes(shape: tuple[int, ...], kind: str) -> int:
    n = 1
    for d in shape:
        n *= d
    return {"f32": 4 * n, "f16": 2 * n, "bf16": 2 * n, "q8_0": n // 32 * 34}[kind]


def planned_tensors(config: dict, quantization: str) -> list[TensorPlan]:
    """Every tensor the file will hold, from config.json alone (no weights), for the disk plan."""
    h, layers, ff, v = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"], config["vocab_size"]
    hd, nh, nkv = head_dim(config), config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    arch = family_of(config)
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (v, h)), ("output_norm.weight", (h,))]
    if not config.get("tie_word_embeddings", False):
        shapes.append(("output.weight", (v, h)))
    for i in range(layers):
        b = f"blk.{i}."
        shapes += [(b + "attn_norm.weight", (h,)), (b + "ffn_norm.weight", (h,)),
                   (b + "attn_q.weight", (nh * hd, h)), (b + "attn_k.weight", (nkv * hd, h)),
                   (b + "attn_v.weight", (nkv * hd, h)), (b + "attn_output.weight", (h, nh * hd)),
                   (b + "ffn_gate.weight", (ff, h)), (b + "ffn_up.weight", (ff, h)), (b + "ffn_down.weight", (h, ff))]
        if arch == "qwen2":
            shapes += [(b + "attn_q.bias", (nh * hd,)), (b + "attn_k.bias", (nkv * hd,)), (b + "attn_v.bias", (nkv * hd,))]
        if arch == "qwen3":
            shapes += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]
    return [TensorPlan(n, s, tensor_kind(n, s, quantization)) for n, s in shapes]


# --------------------------------------------------------------------------------------------
# Writing


def _permute(w, n_head: int):
    """llama.cpp's LlamaModel.permute: q/k rows reordered from HF's rotate-half to GGML's rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens and their types as llama.cpp's converter lists them (get_vocab_base): special added
    tokens CONTROL, other added tokens USER_DEFINED, the rows past the tokenizer [PADn] UNUSED."""
    import gguf

    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    specials = set(tokenizer.all_special_tokens)
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        t = reverse[i]
        tokens.append(t)
        if t in added:
            types.append(gguf.TokenType.CONTROL if t in specials else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def write_gguf(model, tokenizer, tokenizer_dir: Path, path: Path, quantization: str, name: str) -> None:
    """Write ``model`` (a transformers causal LM, any dtype, on the CPU) and its tokenizer to ``path``."""
    import json

    import gguf
    import numpy as np
    import torch

    config = model.config.to_dict()
    arch_name = family_of(config)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    tok_json = json.loads((tokenizer_dir / "tokenizer.json").read_text()) if (tokenizer_dir / "tokenizer.json").is_file() else {}
    if (tok_json.get("model") or {}).get("type") != "BPE":
        raise LowvramError("the GGUF writer handles byte-level BPE tokenizers (tokenizer.json with a BPE model) only",
                           "convert the merged folder with llama.cpp's convert_hf_to_gguf.py")
    pre = pre_tokenizer_name(tok_json)
    n_layers, nh = config["num_hidden_layers"], config["num_attention_heads"]
    nkv = config.get("num_key_value_heads") or nh
    ftype = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quantization]

    w = gguf.GGUFWriter(path, arch_name)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(int(config["max_position_embeddings"]))
    w.add_embedding_length(int(config["hidden_size"]))
    w.add_block_count(n_layers)
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(head_dim(config))
    w.add_value_length(head_dim(config))
    w.add_rope_dimension_count(head_dim(config))
    w.add_rope_freq_base(rope_theta(config))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_vocab_size(int(config["vocab_size"]))

    tokens, types = _vocab(tokenizer, int(config["vocab_size"]))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=len(tokens))
    if tokenizer.chat_template and special.chat_template is None:
        special.chat_template = tokenizer.chat_template
    special.add_to_gguf(w, quiet=True)

    names = gguf.get_tensor_name_map(arch, n_layers)
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
    tied = bool(config.get("tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reads a missing output.weight as token_embd.weight
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        new = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise LowvramError(f"the GGUF writer has no name for the tensor {hf_name}",
                               "convert the merged folder with llama.cpp's convert_hf_to_gguf.py")
        data = tensor.detach().to("cpu", torch.float32).numpy()
        if arch_name == "llama" and new.endswith("attn_q.weight"):
            data = _permute(data, nh)
        elif arch_name == "llama" and new.endswith("attn_k.weight"):
            data = _permute(data, nkv)
        kind = tensor_kind(new, data.shape, quantization)
        packed = gguf.quants.quantize(np.ascontiguousarray(data), qtype[kind])
        w.add_tensor(new, packed, raw_dtype=qtype[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
