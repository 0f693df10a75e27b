"""Tiny models and tokenizers built locally, for tests, benchmarks and examples.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained in a fraction of a
second on a few sentences, the model is a random-init Llama built from a config.
"""

from __future__ import annotations

from pathlib import Path

# ChatML, the template SmolLM2 and Qwen use; generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\n### Input:\n### Response:\n",
    "Gradient checkpointing recomputes activations during the backward pass to save memory.",
    "LoRA trains small low-rank adapters instead of all the weights of the model.",
    "Quantization stores the frozen base model in four or eight bits per weight.",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ? ! , . : ;",
    "What is the capital of France? The capital of France is Paris.",
    "user assistant system hello world answer question translate summarize explain",
]


def build_tokenizer(vocab_size: int = 512, chat_template: bool = True):
    """A byte-level BPE tokenizer with ChatML specials, trained here in well under a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>" if chat_template else "<|endoftext|>",
        pad_token="<pad>",
        unk_token=None,
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def texts_of_exact_length(tokens: int, rows: int, rng, words: tuple[str, ...]) -> list[str]:
    """``rows`` texts of exactly ``tokens`` tokens of build_tokenizer() (the default one). Its
    byte-level pre-tokenizer splits at spaces, so a text's tokens are the sum of its words';
    " the" is one token and fills the rest exactly. For packed data whose windows are full:
    rows of seq_len / k - 1 tokens (+ the eos lowvram's text format appends) pack k to a window."""
    tok = build_tokenizer()

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    cost = {w: count(" " + w) for w in words}
    filler, first = " the", "the"
    if count(filler) != 1 or count(first) > tokens:
        raise ValueError(f"cannot make texts of {tokens} tokens")
    out = []
    for _ in range(rows):
        text, n = first, count(first)
        while True:
            w = rng.choice(words)
            if n + cost[w] > tokens - max(cost.values()):
                break
            text, n = text + " " + w, n + cost[w]
        out.append(text + filler * (tokens - n))
    return out


def tiny_llama_config(vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                      intermediate: int = 128, max_positions: int = 1024):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=3, bos_token_id=None,
    )


def save_tiny_model(out_dir: str | Path, seed: int = 0, chat_template: bool = True, **config_kwargs) -> Path:
    """Write a random-init tiny Llama and its tokenizer to ``out_dir`` (a from_pretrained folder)."""
    import torch
    from transformers import LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(chat_template=chat_template)
    config = tiny_llama_config(len(tokenizer), **config_kwargs)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
