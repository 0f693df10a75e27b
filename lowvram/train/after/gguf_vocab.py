"""The tokenizer of a GGUF file, as llama.cpp's convert_hf_to_gguf.py writes it, from the fast
tokenizer's tokenizer.json:

- byte-level BPE (GPT-2, SmolLM, Llama-3, Qwen2): tokenizer.ggml.model "gpt2", the merges, and the
  pre-tokenizer's name (``pre_tokenizer_name``) - its _set_vocab_gpt2;
- SentencePiece-style BPE with byte fallback (Gemma, Llama-2, Phi-3: ▁-marked pieces, <0xNN> byte
  tokens): tokenizer.ggml.model "llama" with a score and a type per token - its
  _set_vocab_sentencepiece. The score of a piece is minus the rank of the merge that makes it (the
  order a SentencePiece BPE model ranks its pieces in; llama.cpp's tokenizer merges the
  highest-scored pair first, which is then BPE's order). The merges are written too: transformers'
  GGUF reader rebuilds the tokenizer from them when present (gguf_tokenizer_mapping.get_merges).

Both carry the special token ids, add-BOS/EOS and the chat template through gguf.SpecialVocab.
"""

from __future__ import annotations

import re

from lowvram.errors import LowvramError

_CONVERT_HINT = "convert the merged folder with llama.cpp's convert_hf_to_gguf.py"

# tokenizer.ggml.pre: the pre-tokenizer names llama.cpp (llama-vocab.cpp) and transformers' GGUF
# tokenizer reader agree on, recognised from tokenizer.json's pre_tokenizer (llama.cpp's converter
# recognises them by hashing a test string's tokens; the structure says the same for these).
_LLAMA3_REGEX_START = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
_QWEN2_REGEX_START = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def tokenizer_kind(tokenizer_json: dict) -> str:
    """"gpt2" (byte-level BPE) or "llama" (SentencePiece-style BPE with byte fallback), or LowvramError."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE":
        raise LowvramError(f"the GGUF writer handles BPE tokenizers only (this tokenizer.json holds a "
                           f"{model.get('type') or 'missing'} model)", _CONVERT_HINT)
    return "llama" if model.get("byte_fallback") else "gpt2"


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
                       "GGUF writer knows (GPT-2, SmolLM, Llama-3 or Qwen2 byte-level BPE)", _CONVERT_HINT)


def _adds_space_prefix(tokenizer_json: dict) -> bool:
    """Whether the tokenizer puts a ▁ before the text (Llama-2/Phi-3: a Prepend normalizer or a
    Metaspace pre-tokenizer that prepends; Gemma: neither)."""
    def walk(node, key):
        if not node:
            return []
        return list(node.get(key) or []) if node.get("type") == "Sequence" else [node]

    normalizers = walk(tokenizer_json.get("normalizer"), "normalizers")
    pres = walk(tokenizer_json.get("pre_tokenizer"), "pretokenizers")
    return (any(n.get("type") == "Prepend" for n in normalizers)
            or any(p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never" for p in pres))


def _types(tokenizer, vocab_size: int, byte_tokens: bool):
    """(token text or None, gguf.TokenType) per id, as llama.cpp's converter types them: special
    added tokens CONTROL, other added tokens USER_DEFINED, <0xNN> BYTE (SentencePiece), the
    tokenizer's unk UNKNOWN, the rows past the tokenizer UNUSED."""
    import gguf

    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    specials = set(tokenizer.all_special_tokens)
    out = []
    for i in range(vocab_size):
        t = reverse.get(i)
        if t is None:
            out.append((None, gguf.TokenType.UNUSED))
        elif byte_tokens and _BYTE_TOKEN.fullmatch(t):
            out.append((t, gguf.TokenType.BYTE))
        elif byte_tokens and t == tokenizer.unk_token:
            out.append((t, gguf.TokenType.UNKNOWN))
        elif t in added or (byte_tokens and t in specials):
            out.append((t, gguf.TokenType.CONTROL if t in specials else gguf.TokenType.USER_DEFINED))
        else:
            out.append((t, gguf.TokenType.NORMAL))
    return out


def _merge_scores(tokenizer_json: dict) -> dict[str, float]:
    """Minus the rank of the first merge that makes each piece."""
    scores: dict[str, float] = {}
    for rank, m in enumerate(tokenizer_json["model"].get("merges") or ()):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        scores.setdefault(a + b, -float(rank))
    return scores


def write_vocab(w, tokenizer, tokenizer_dir, vocab_size: int) -> None:
    """The tokenizer, its special tokens and chat template into GGUFWriter ``w``."""
    import json
    import logging

    import gguf

    # SpecialVocab logs what it cannot parse of a post-processor's pair template (not written)
    logging.getLogger("gguf.vocab").setLevel(logging.ERROR)
    tok_json = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    kind = tokenizer_kind(tok_json)
    rows = _types(tokenizer, vocab_size, byte_tokens=kind == "llama")
    tokens = [t if t is not None else f"[PAD{i}]" for i, (t, _) in enumerate(rows)]
    w.add_tokenizer_model(kind)
    if kind == "gpt2":
        w.add_tokenizer_pre(pre_tokenizer_name(tok_json))
    else:
        scores = _merge_scores(tok_json)
        w.add_tokenizer_pre("default")
        w.add_token_scores([scores.get(t, 0.0) if t is not None else -10000.0 for t, _ in rows])
        w.add_add_space_prefix(_adds_space_prefix(tok_json))
    w.add_token_list(tokens)
    w.add_token_types([ty for _, ty in rows])
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=len(tokens))
    if tokenizer.chat_template and special.chat_template is None:
        special.chat_template = tokenizer.chat_template
    special.add_to_gguf(w, quiet=True)
