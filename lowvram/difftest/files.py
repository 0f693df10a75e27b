"""A drawn case's files: a tiny random-init model folder of its family (config, weights, a
tokenizer trained here), its data file and the recipe a user would write for it."""

from __future__ import annotations

import json
import random
from pathlib import Path

from lowvram.difftest.cases import MOE_FAMILIES, WORDS, Case, image_tokens

# --------------------------------------------------------------------------------------------
# Building a case's files


def _config(case: Case, vocab: int, pad_id: int, eos_id: int, image_token_ids: dict | None = None):
    from transformers import AutoConfig

    kw = dict(
        hidden_size=case.hidden, intermediate_size=case.intermediate, num_hidden_layers=case.layers,
        num_attention_heads=case.heads, num_key_value_heads=case.kv_heads,
        head_dim=case.hidden // case.heads, vocab_size=vocab, max_position_embeddings=1024,
        tie_word_embeddings=case.tie, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None,
    )
    if case.family in MOE_FAMILIES:
        kw.update(num_local_experts=case.experts, num_experts=case.experts,
                  num_experts_per_tok=case.experts_per_tok, moe_intermediate_size=case.intermediate // 2)
        if case.family in ("mixtral", "gpt_oss"):
            kw["intermediate_size"] = case.intermediate // 2
    if case.family == "qwen3_moe":
        kw.update(decoder_sparse_step=1, mlp_only_layers=[])
    if case.family == "gemma":
        kw["hidden_activation"] = "gelu_pytorch_tanh"
    text_family = {"gemma3": "gemma3_text", "llava": "llama", "mistral3": "mistral",
                   "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "mllama": "llama"}.get(case.family, case.family)
    if text_family == "gemma3_text":  # alternate sliding (128 tokens) and full attention layers
        kw.update(sliding_window=128, layer_types=[
            "full_attention" if i % 2 else "sliding_attention" for i in range(case.layers)])
    cfg = AutoConfig.for_model(text_family, **kw)
    for name in ("attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(cfg, name):
            setattr(cfg, name, 0.0)  # the family's dropout is its own test (tests/check/test_simulate.py)
    if case.vision_layers:
        cfg = _multimodal(case, cfg, image_token_ids)
    return cfg


def _multimodal(case: Case, text, image_token_ids: dict | None = None):
    """The Gemma3Config / Mistral3Config / LlavaConfig around ``text`` (check.builders'
    multimodal_config): the case's vision tower, two heads and an MLP twice its width, Gemma-3's
    image pooled to a quarter of its patches, each family's own projector defaults; the image
    token inside the vocabulary (text-only data never holds it; an image case's: the tokenizer's
    image tokens, lowvram.testing.image_token_config)."""
    from lowvram.check.builders import multimodal_config
    from lowvram.plan.model.vision import VisionSpec

    if case.family == "mllama":
        return multimodal_config(text, _mllama_tower(case, text), False,
                                 cross_attention_layers=mllama_cross_layers(case),
                                 **(image_token_ids or {"image_token_index": text.vocab_size - 1}))
    tower, projector = {"gemma3": ("siglip", "gemma3"), "mistral3": ("pixtral", "mistral3"),
                        "llava": ("clip", "llava"), "qwen2_5_vl": ("qwen2_5_vl", "qwen2_5_vl"),
                        "qwen3_vl": ("qwen3_vl", "qwen3_vl")}[case.family]
    qwen = tower in ("qwen2_5_vl", "qwen3_vl")
    patches = (case.vision_image // case.vision_patch) ** 2
    v = VisionSpec(tower=tower, projector=projector, num_layers=case.vision_layers,
                   hidden_size=case.vision_hidden, intermediate_size=2 * case.vision_hidden, num_heads=2,
                   patch_size=case.vision_patch, image_size=case.vision_image, num_channels=3,
                   tokens_per_image=image_tokens(case),
                   text_hidden_size=text.hidden_size, projector_bias=tower == "clip" or qwen,
                   merge_size=2 if tower == "pixtral" or qwen else 1,
                   temporal_patch_size=2 if qwen else 1,
                   # Qwen3-VL: a learned position grid of the image's patches, a deepstack merger
                   # per tower layer (the published 27-layer tower feeds three)
                   position_embeddings=patches if tower == "qwen3_vl" else 0,
                   deepstack_mergers=case.vision_layers if tower == "qwen3_vl" else 0)
    if qwen:  # Qwen2_5_VLConfig's / Qwen3VLConfig's name for it (an image case: the tokenizer's)
        return multimodal_config(text, v, case.tie, **(image_token_ids or {"image_token_id": text.vocab_size - 1}))

    return multimodal_config(text, v, case.tie, **(image_token_ids or {"image_token_index": text.vocab_size - 1}))


def mllama_cross_layers(case: Case) -> tuple[int, ...]:
    """Where a mllama case's cross-attention layers sit among its case.layers + cross_layers
    decoder layers: after the first self-attention layer, then every other (Llama-3.2-Vision's
    sit at 3, 8, 13, ...: between self-attention layers)."""
    return tuple(1 + 2 * i for i in range(case.cross_layers))


def _mllama_tower(case: Case, text):
    """A mllama case's VisionSpec: the case's local layers, one gated global layer, four tiles in
    the processor's eight layouts, the projector reading the last and one intermediate layer."""
    from lowvram.plan.model.vision import VisionSpec

    return VisionSpec(tower="mllama", projector="mllama", num_layers=case.vision_layers,
                      hidden_size=case.vision_hidden, intermediate_size=2 * case.vision_hidden, num_heads=2,
                      patch_size=case.vision_patch, image_size=case.vision_image, num_channels=3,
                      tokens_per_image=1, text_hidden_size=text.hidden_size, global_layers=1,
                      max_num_tiles=4, aspect_ratios=8, output_dim=2 * case.vision_hidden)


def write_model(case: Case, folder: Path) -> Path:
    """Random-init model + a BPE tokenizer trained here, as a from_pretrained folder (an image
    case: the tokenizer with the family's image tokens, and the processor beside it)."""
    import torch

    from lowvram.testing import (
        build_processor,
        build_tokenizer,
        build_vision_tokenizer,
        image_token_config,
    )
    from lowvram.train.build.model import has_vision, model_class

    tok = build_vision_tokenizer(case.family) if case.images else build_tokenizer()
    image_ids = image_token_config(case.family, tok) if case.images else None
    cfg = _config(case, max(case.vocab, len(tok)), tok.pad_token_id, tok.eos_token_id, image_ids)
    torch.manual_seed(case.seed)
    model = model_class(has_vision(cfg)).from_config(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    if case.images:
        build_processor(cfg, tok).save_pretrained(folder)
    return folder


def write_data(case: Case, path: Path, rows: int = 24) -> Path:
    """Text rows longer than seq_len: every batch is full (truncated). With packing, what packing
    is for: short samples, four to a window, each exactly seq_len / 4 tokens with its eos, so the
    windows are full and hold several samples (their position_ids restart, and SDPA gets the
    block-diagonal mask a user's packed run gets)."""
    rng = random.Random(case.seed)
    if case.images:
        return _write_image_data(case, path, rng, rows)
    if case.num_generations:  # format prompt: prompts of exactly max_prompt_length tokens
        from lowvram.testing import texts_of_exact_length

        with open(path, "w") as f:
            for text in texts_of_exact_length(case.prompt_len, rows, rng, tuple(WORDS)):
                f.write(json.dumps({"prompt": text}) + "\n")
        return path
    if case.objective != "sft":
        # pairs as a user's are: a chosen longer than seq_len (TRL cuts it there: every batch
        # reaches seq_len) and a shorter rejected, so the batch's rows are padded and carry their
        # attention_mask, as with real pairs of unequal lengths (SDPA's masks: plan.activations)
        if case.pair_tokens:
            return _write_short_pairs(case, path, rng, rows)
        with open(path, "w") as f:
            for i in range(rows):
                chosen = " " + " ".join(rng.choice(WORDS) for _ in range(case.seq_len))
                rejected = " " + " ".join(rng.choice(WORDS) for _ in range(case.seq_len // 4))
                f.write(json.dumps({"prompt": f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(6)),
                                    "chosen": chosen, "rejected": rejected}) + "\n")
        return path
    if case.packing:
        return _write_packed_data(case, path, rng, 4 * rows)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(3 * case.seq_len))}) + "\n")
    return path


def _write_short_pairs(case: Case, path: Path, rng: random.Random, rows: int) -> Path:
    """Pairs of exact token lengths (made_short_pairs): prompt 8, chosen pair_tokens, rejected a
    quarter of it (" the" is one token, so the leading space keeps each count)."""
    from lowvram.testing import texts_of_exact_length

    prompts = texts_of_exact_length(8, rows, rng, tuple(WORDS))
    chosen = texts_of_exact_length(case.pair_tokens, rows, rng, tuple(WORDS))
    rejected = texts_of_exact_length(max(4, case.pair_tokens // 4), rows, rng, tuple(WORDS))
    with open(path, "w") as f:
        for p, c, r in zip(prompts, chosen, rejected, strict=True):
            f.write(json.dumps({"prompt": p, "chosen": " " + c, "rejected": " " + r}) + "\n")
    return path


def _write_image_data(case: Case, path: Path, rng: random.Random, rows: int) -> Path:
    """image_chat rows: the row's images (PNGs of 24-96 px a side, which the processor resizes to
    the tower's) and a short question first, then an answer longer than seq_len, so every row is
    cut to seq_len after its image tokens."""
    from lowvram.testing import write_images

    files = write_images(path.parent / "images", rows * case.images, seed=case.seed,
                         side=case.image_side or rng.choice([24, 48, 96]))
    with open(path, "w") as f:
        for i in range(rows):
            names = [f"images/{p.name}" for p in files[i * case.images:(i + 1) * case.images]]
            user = [{"type": "image"} for _ in names] + [{"type": "text", "text": "Describe the picture."}]
            answer = " ".join(rng.choice(WORDS) for _ in range(3 * case.seq_len))
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": answer}],
                                "images": names}) + "\n")
    return path


def _write_packed_data(case: Case, path: Path, rng: random.Random, rows: int) -> Path:
    """Rows of exactly seq_len / 4 - 1 tokens (+ the eos lowvram's text format appends)."""
    from lowvram.testing import texts_of_exact_length

    with open(path, "w") as f:
        for text in texts_of_exact_length(case.seq_len // 4 - 1, rows, rng, tuple(WORDS)):
            f.write(json.dumps({"text": text}) + "\n")
    return path


def recipe_text(case: Case, model_dir: Path, data: Path, out: Path) -> str:
    """The recipe a user would write for this case: only keys that change memory are set."""
    t = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"datasets": [{"path": str(data), "format": "text"}]},
        "training": {"seq_len": case.seq_len, "batch_size": case.micro_batch_size * case.grad_accum,
                     "micro_batch_size": case.micro_batch_size, "max_steps": 2, "logging_steps": 1,
                     "save_steps": 100, "output_dir": str(out), "report_to": "none"},
        "techniques": {
            "mixed_precision": case.precision,
            "gradient_checkpointing": "on" if case.gradient_checkpointing else "off",
            "lora": "off" if case.method == "full" else "on",
            "quantization": "nf4-dq" if case.method == "qlora" else "off",
            "optimizer": case.optimizer, "loss": case.loss, "attention": case.attention,
            "offload": "off",
        },
    }
    if case.images:
        t["data"]["datasets"][0]["format"] = "image_chat"
        t["data"]["images_per_row"] = case.images
        if case.max_pixels:  # and the processor's floor down to one token (min_pixels <= max_pixels)
            t["data"]["max_pixels"] = case.max_pixels
            t["data"]["min_pixels"] = (2 * case.vision_patch) ** 2
    if case.tiled_mlp:
        t["techniques"]["tiled_mlp"] = case.tiled_mlp_shards or "on"
    if case.num_generations:
        t["data"]["datasets"][0]["format"] = "prompt"
        t["training"]["objective"] = case.objective
        t["training"]["seq_len"] = case.prompt_len + case.completion_len
        t["grpo"] = {"num_generations": case.num_generations, "max_prompt_length": case.prompt_len,
                     "max_completion_length": case.completion_len, "beta": case.beta,
                     "steps_per_generation": case.steps_per_generation, "rewards": ["length"]}
    elif case.objective != "sft":
        t["data"]["datasets"][0]["format"] = "preference"
        t["training"]["objective"] = case.objective
        t["preference"] = {"precompute_ref_log_probs": case.precompute_ref}
        if case.objective != "kto":
            t["preference"]["loss_type"] = case.loss_type
    if case.model_dtype != "auto":
        t["model"]["dtype"] = case.model_dtype
    if case.optimizer.startswith(("galore", "apollo")):
        t["galore"] = {"rank": case.galore_rank}
    if case.packing:
        t["data"]["packing"] = True
    if case.validation:
        t["data"]["validation"] = case.validation
    if case.method != "full":
        targets = case.lora_targets
        t["lora"] = {"r": case.lora_r, "alpha": 2 * case.lora_r,
                     "target_modules": targets if isinstance(targets, str) else list(targets)}
        if case.lora_dropout:
            t["lora"]["dropout"] = case.lora_dropout
        if case.use_dora:
            t["lora"]["use_dora"] = True
        if case.lora_init != "default":
            t["lora"]["init"] = case.lora_init
    import yaml

    return yaml.safe_dump(t, sort_keys=False)
