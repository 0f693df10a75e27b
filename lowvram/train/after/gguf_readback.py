"""Read back a GGUF of an architecture llama.cpp defines but transformers' GGUF loader does not
(olmo2, smollm3), for the check (gguf_check.py), from maintained parts only:

- the tensors: gguf's GGUFReader and its dequantizers (gguf.quants.dequantize, what transformers'
  loader uses), named back through gguf's own tensor-name map, and the writer's changes undone
  by transformers' own tensor processors (LlamaTensorProcessor's reverse q/k permutation: the
  same code that checks the llama family);
- the config: rebuilt from the file's metadata keys (context length, sizes, head counts, rope
  base, RMS epsilon, vocabulary, tied output), the config class's defaults for the rest, as
  transformers' loader does for the architectures it knows;
- the tokenizer: transformers' GGUF tokenizer reader (integrations/gguf), which reads any
  architecture's vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from lowvram.errors import LowvramError

# The transformers tensor processor that undoes what llama.cpp's converter does to each
# architecture, stated here apart from the writer's table so that a writer mistake is not undone
# by its own mirror: SmolLM3Model is a LlamaModel (q/k permuted), Olmo2Model a plain TextModel.
_PROCESSOR_OF = {"smollm3": "llama", "olmo2": None}


def _fields(reader) -> dict:
    out = {}
    for key, f in reader.fields.items():
        if not f.data or key.startswith("tokenizer.ggml.") and key not in ("tokenizer.ggml.model",):
            continue
        value = f.parts[f.data[0]]
        out[key] = bytes(value).decode() if f.types[0].name == "STRING" else value.tolist()[0]
    return out


def config_from_metadata(reader, model_type: str) -> dict:
    """The transformers config (a dict) the file's metadata describes."""
    meta = _fields(reader)
    arch = meta["general.architecture"]
    key = lambda name: meta[f"{arch}.{name}"]  # noqa: E731
    names = {t.name for t in reader.tensors}
    config = {
        "model_type": model_type,
        "max_position_embeddings": key("context_length"),
        "hidden_size": key("embedding_length"),
        "num_hidden_layers": key("block_count"),
        "intermediate_size": key("feed_forward_length"),
        "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base"),
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "tie_word_embeddings": "output.weight" not in names,
    }
    if f"{arch}.attention.key_length" in meta:
        config["head_dim"] = key("attention.key_length")
    for token in ("bos", "eos", "padding"):
        if f"tokenizer.ggml.{token}_token_id" in reader.fields:
            f = reader.fields[f"tokenizer.ggml.{token}_token_id"]
            config[f"{'pad' if token == 'padding' else token}_token_id"] = int(f.parts[f.data[0]][0])
    return config


def load_back(gguf_path: Path, model_type: str):
    """(model in float32, tokenizer) as the file describes them."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from lowvram.train.after.gguf_family import FAMILIES, gguf_names

    family = FAMILIES[model_type]
    reader = gguf.GGUFReader(gguf_path)
    config = config_from_metadata(reader, model_type)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32).eval()
    state = model.state_dict()
    to_hf = {g: hf for hf, g in gguf_names(family, config, {k: tuple(v.shape) for k, v in state.items()}).items()}
    processor = TENSOR_PROCESSORS.get(_PROCESSOR_OF[family.arch] or "", TensorProcessor)(config=config)
    loaded = {}
    for t in reader.tensors:
        if t.name not in to_hf:
            raise LowvramError(f"the GGUF holds a tensor {t.name} the model has no place for",
                               "report it with the run's config.json")
        weights = processor.process(gguf.quants.dequantize(t.data, t.tensor_type), t.name).weights
        loaded[to_hf[t.name]] = torch.from_numpy(weights.copy()).float().reshape(state[to_hf[t.name]].shape)
    missing = set(to_hf.values()) - set(loaded)
    if missing:
        raise LowvramError(f"the GGUF lacks {len(missing)} tensor(s) of the model ({sorted(missing)[0]} ...)",
                           "report it with the run's config.json")
    model.load_state_dict(loaded, strict=False)
    if config["tie_word_embeddings"]:
        model.tie_weights()
    return model, _tokenizer(gguf_path)


def _tokenizer(gguf_path: Path):
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(gguf_path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{k: v for k, v in tokenizer_config.items()
                                                                  if k != "chat_template"})
