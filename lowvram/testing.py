"""Tiny models and tokenizers built locally, for tests, benchmarks and examples.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained in a fraction of a
second on a few sentences, the model is a random-init Llama built from a config.
"""

from __future__ import annotations

import json
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


def build_tokenizer(vocab_size: int = 512, chat_template: bool = True, extra_specials: dict | None = None):
    """A byte-level BPE tokenizer with ChatML specials, trained here in well under a second.
    ``extra_specials``: named model-specific special tokens (e.g. image_token: "<image>"), in the
    vocabulary and as tokenizer attributes (transformers' model_specific_special_tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", *(extra_specials or {}).values()]
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
    named = {k: v for k, v in (extra_specials or {}).items() if k != "bos_token"}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=(extra_specials or {}).get("bos_token"),
        eos_token="<|im_end|>" if chat_template else "<|endoftext|>",
        pad_token="<pad>",
        unk_token=None,
        **({"model_specific_special_tokens": named} if named else {}),
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


# Gemma's turn template (its tokenizer_config.json chat_template, without the system-prompt folding).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
    " + message['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def build_sentencepiece_tokenizer(style: str = "gemma", vocab_size: int = 600):
    """A SentencePiece-style tokenizer (BPE over "▁"-marked words with byte fallback: the
    layout of Gemma's and Llama-2/Phi-3's tokenizer.model as their fast tokenizers hold it),
    trained here on the test corpus. ``style`` "gemma": GemmaTokenizer (<pad> <eos> <bos> <unk>,
    no prefix space, the turn specials); "llama": LlamaTokenizer (<unk> <s> </s>, a prefix space,
    Phi-3's <|user|> <|assistant|> <|end|> <|endoftext|> added after the vocabulary)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer, LlamaTokenizer

    tok = Tokenizer(models.BPE())
    if style == "gemma":
        head = ["<pad>", "<eos>", "<bos>", "<unk>"]
    else:
        head = ["<unk>", "<s>", "</s>"]
    # sentencepiece's split_by_whitespace: pieces never span two words
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first" if style == "llama" else "never")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    trained = json.loads(tok.to_str())["model"]
    vocab = {t: i for i, t in enumerate(head + [f"<0x{b:02X}>" for b in range(256)])}
    for t in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    if style == "gemma":
        for t in ("<start_of_turn>", "<end_of_turn>"):
            vocab[t] = len(vocab)
        out = GemmaTokenizer(vocab=vocab, merges=merges, mask_token=None, add_bos_token=True,
                             additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
        out.chat_template = GEMMA_CHAT_TEMPLATE
        return out
    out = LlamaTokenizer(vocab=vocab, merges=merges, add_prefix_space=True, legacy=False, add_bos_token=True)
    # Phi-3's tokenizer.json (the legacy Llama-2 layout): the ▁ prefix comes from a normalizer, so
    # text after a special token gets one too, as llama.cpp's SentencePiece tokenizer does
    out.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                             normalizers.Replace(" ", "\u2581")])
    out.backend_tokenizer.pre_tokenizer = None
    out.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]})
    out.eos_token, out.pad_token = "<|end|>", "<|endoftext|>"
    out.chat_template = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}"
                         "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
    return out


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


# ChatML with content parts (TRL's and transformers' multimodal message shape): a part
# {"type": "image"} renders as the processor's image placeholder, {"type": "text"} as its text.
IMAGE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '@IMAGE@' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The image specials of each family's tokenizer, as the real checkpoints name them: Gemma-3's
# tokenizer_config.json (boi/eoi around image_soft_token repeated mm_tokens_per_image times),
# Llava's "<image>" (llava-hf/llava-1.5-7b-hf added_tokens).
GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                       "eoi_token": "<end_of_image>"}
LLAVA_IMAGE_TOKENS = {"image_token": "<image>"}
# Llama-3.2-Vision's (meta-llama/Llama-3.2-11B-Vision-Instruct tokenizer_config.json): one <|image|>
# token an image, the <|begin_of_text|> bos MllamaProcessor puts after leading image tokens, and the
# <|python_tag|> its __init__ looks up
MLLAMA_IMAGE_TOKENS = {"image_token": "<|image|>", "bos_token": "<|begin_of_text|>",
                       "python_token": "<|python_tag|>"}
# Qwen2.5-VL's and Qwen3-VL's (Qwen/Qwen2.5-VL-7B-Instruct tokenizer_config.json added tokens):
# an image renders as <|vision_start|><|image_pad|><|vision_end|>, the processor expanding
# <|image_pad|> into the image's tokens
QWEN_VL_IMAGE_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                        "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}
QWEN_VL_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
_FAMILY_IMAGE_TOKENS = {"gemma3": GEMMA3_IMAGE_TOKENS, "llava": LLAVA_IMAGE_TOKENS, "mllama": MLLAMA_IMAGE_TOKENS,
                        **dict.fromkeys(QWEN_VL_FAMILIES, QWEN_VL_IMAGE_TOKENS)}


def build_vision_tokenizer(family: str, vocab_size: int = 512):
    """build_tokenizer() with the image special tokens of ``family`` (gemma3, llava, mllama,
    qwen2_5_vl or qwen3_vl), as the tokenizer attributes the family's processor reads."""
    return build_tokenizer(vocab_size, extra_specials=_FAMILY_IMAGE_TOKENS.get(family, LLAVA_IMAGE_TOKENS))


def image_token_config(family: str, tokenizer) -> dict:
    """The top-level config keys that name the tokenizer's image tokens (Gemma3Config /
    LlavaConfig image_token_index; Gemma-3's boi/eoi_token_index)."""
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in
           _FAMILY_IMAGE_TOKENS.get(family, LLAVA_IMAGE_TOKENS).items()}
    if family in QWEN_VL_FAMILIES:  # Qwen2_5_VLConfig / Qwen3VLConfig: *_token_id
        return {f"{k}_id": i for k, i in ids.items()}
    out = {"image_token_index": ids["image_token"]}
    if family == "gemma3":
        out.update(boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"])
    return out


def build_processor(config, tokenizer):
    """The processor of a tiny multimodal ``config`` (Gemma3Config or LlavaConfig) around a
    build_vision_tokenizer() tokenizer: Gemma3Processor with a Gemma3ImageProcessor at the
    tower's image_size and mm_tokens_per_image tokens per image; LlavaProcessor with a
    CLIPImageProcessor (shortest edge and center crop at image_size) and the tower's patch size,
    CLS counted (num_additional_image_tokens 1, dropped by the "default" select strategy);
    MllamaProcessor with a MllamaImageProcessor cutting images into tiles of image_size, at most
    max_num_tiles of them; Qwen-VL: qwen_vl_processor."""
    if config.model_type in QWEN_VL_FAMILIES:
        return qwen_vl_processor(config, tokenizer)
    side = config.vision_config.image_size
    if config.model_type == "gemma3":
        from transformers import Gemma3ImageProcessorPil, Gemma3Processor

        images = Gemma3ImageProcessorPil(size={"height": side, "width": side})
        return Gemma3Processor(images, tokenizer, image_seq_length=config.mm_tokens_per_image,
                               chat_template=IMAGE_CHAT_TEMPLATE.replace("@IMAGE@", tokenizer.boi_token))
    if config.model_type == "llava":
        from transformers import CLIPImageProcessorPil, LlavaProcessor

        images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        return LlavaProcessor(images, tokenizer, patch_size=config.vision_config.patch_size,
                              vision_feature_select_strategy=config.vision_feature_select_strategy,
                              num_additional_image_tokens=1,
                              chat_template=IMAGE_CHAT_TEMPLATE.replace("@IMAGE@", tokenizer.image_token))
    if config.model_type == "mllama":
        from transformers import MllamaImageProcessorPil, MllamaProcessor

        images = MllamaImageProcessorPil(size={"height": side, "width": side},
                                         max_image_tiles=config.vision_config.max_num_tiles)
        return MllamaProcessor(images, tokenizer,
                               chat_template=IMAGE_CHAT_TEMPLATE.replace("@IMAGE@", tokenizer.image_token))
    raise ValueError(f"no tiny processor for model_type {config.model_type!r} (gemma3, llava, mllama, qwen2_5_vl, qwen3_vl)")


def qwen_vl_processor(config, tokenizer, min_pixels: int | None = None, max_pixels: int | None = None):
    """Qwen2_5_VLProcessor / Qwen3VLProcessor around a build_vision_tokenizer() tokenizer, without a
    video processor (lowvram.processors): the image processor the checkpoints use
    (Qwen2VLImageProcessor, PIL backend) at the tower's patch, merge and temporal sizes, its pixel
    limits the class defaults unless given, the chat template rendering an image part as
    <|vision_start|><|image_pad|><|vision_end|> like the real one. Saved, it is what a checkpoint
    holds: preprocessor_config.json, the tokenizer and its chat template."""
    from transformers import Qwen2VLImageProcessorPil

    from lowvram.processors import image_only_processor

    v = config.vision_config
    size = dict(Qwen2VLImageProcessorPil.size)
    size.update({k: n for k, n in (("shortest_edge", min_pixels), ("longest_edge", max_pixels)) if n is not None})
    images = Qwen2VLImageProcessorPil(size=size, patch_size=v.patch_size, merge_size=v.spatial_merge_size,
                                      temporal_patch_size=v.temporal_patch_size)
    tokenizer.chat_template = IMAGE_CHAT_TEMPLATE.replace("@IMAGE@", "<|vision_start|><|image_pad|><|vision_end|>")
    return image_only_processor(config.model_type, images, tokenizer, tokenizer.chat_template)


def write_images(folder: str | Path, count: int, side: int = 48, seed: int = 0) -> list[Path]:
    """``count`` small PNG images (random colored rectangles on a gradient), made with PIL."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        img = Image.new("RGB", (side, side), tuple(rng.randrange(256) for _ in range(3)))
        draw = ImageDraw.Draw(img)
        for _ in range(3):
            x0, y0 = rng.randrange(side // 2), rng.randrange(side // 2)
            draw.rectangle([x0, y0, x0 + rng.randrange(4, side // 2), y0 + rng.randrange(4, side // 2)],
                           fill=tuple(rng.randrange(256) for _ in range(3)))
        path = out / f"image_{i}.png"
        img.save(path)
        paths.append(path)
    return paths


def write_image_chat(path: str | Path, rows: int = 8, side: int = 48, seed: int = 0,
                     answer_words: int = 12) -> Path:
    """A tiny image_chat jsonl beside an ``images/`` folder of PNGs (write_images): each row one
    image, a question and an answer (TRL's messages + images shape)."""
    import json
    import random

    rng = random.Random(seed)
    path = Path(path)
    images = write_images(path.parent / "images", rows, side, seed)
    words = "red green blue square corner left right top bottom small large shape color".split()
    with open(path, "w") as f:
        for img in images:
            answer = " ".join(rng.choice(words) for _ in range(answer_words))
            f.write(json.dumps({
                "messages": [{"role": "user", "content": [{"type": "image"},
                                                          {"type": "text", "text": "What is in the picture?"}]},
                             {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                "images": [f"images/{img.name}"]}) + "\n")
    return path


_CUSTOM_MARKER = "import pathlib\npathlib.Path({marker!r}).write_text('custom code ran')\n"


def save_custom_code_model(out_dir: str | Path, tiny_model: str | Path, marker: str | Path) -> Path:
    """A copy of ``tiny_model`` (save_tiny_model's folder) that needs its own Python code: its
    config.json names an unknown model_type and an ``auto_map`` to configuration_marker.py and
    modeling_marker.py beside it (a Llama under other names), and each of them writes ``marker``
    when it is imported. Only ``trust_remote_code=True`` may make that file appear."""
    import json
    import shutil

    out = Path(out_dir)
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="lowvram_marker", architectures=["MarkerForCausalLM"],
                  auto_map={"AutoConfig": "configuration_marker.MarkerConfig",
                            "AutoModelForCausalLM": "modeling_marker.MarkerForCausalLM"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    head = _CUSTOM_MARKER.format(marker=str(Path(marker).resolve()))
    (out / "configuration_marker.py").write_text(
        head + "from transformers import LlamaConfig\n\n\nclass MarkerConfig(LlamaConfig):\n"
        "    model_type = 'lowvram_marker'\n")
    (out / "modeling_marker.py").write_text(
        head + "from transformers import LlamaForCausalLM\n\nfrom .configuration_marker import MarkerConfig\n\n\n"
        "class MarkerForCausalLM(LlamaForCausalLM):\n    config_class = MarkerConfig\n")
    return out
