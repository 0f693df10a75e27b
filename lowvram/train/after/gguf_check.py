"""Read an exported GGUF back with transformers' own GGUF loader and compare it with the model it
was written from, on fixed prompts: the same token ids from both tokenizers (with and without
the BOS/EOS each adds), the largest logit
difference relative to the largest logit (its scale), and how often the top token agrees.

Bounds (measured, docs/runs.md "Export to GGUF"): F16 and BF16 round each weight once (F16: 11
significant bits, BF16: 8), Q8_0 stores blocks of 32 weights as int8 with one F16 scale.
"""

from __future__ import annotations

import contextlib
import copy
import io
from dataclasses import asdict, dataclass
from pathlib import Path

from lowvram.train.after.gguf_family import (
    FAMILIES,
    READ_BY_TRANSFORMERS,
    rope_factors,
    uses_llama3_rope,
)
from lowvram.train.after.gguf_readback import load_back

# Largest |logit difference| / largest |logit| of the reference, per quantization; and the least
# share of positions whose top token must agree. Measured on the tiny test Llama and SmolLM2-135M
# (docs/runs.md "Export to GGUF" has the figures); set about 3x above the worst seen.
RELATIVE_TOLERANCE = {"f16": 0.005, "bf16": 0.03, "q8_0": 0.15}
TOP1_AT_LEAST = {"f16": 0.99, "bf16": 0.95, "q8_0": 0.90}
# llama-quantize's types (llama_quantize.py): NOT measured here (no llama-quantize on the machine
# that built this). Their rounding step is 4 (6-bit) to 60 (2-bit) times Q8_0's, so the logit
# difference is reported, not bounded (1.0: the logit scale itself); what is checked is the
# tokenization and a top-1 share far below a sound 2..6-bit file and far above a broken layout
# (a wrong head order or norm agrees on a few percent of positions).
for _q in ("q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k", "q4_0", "q4_1", "q5_0", "q5_1"):
    RELATIVE_TOLERANCE[_q], TOP1_AT_LEAST[_q] = 1.0, 0.6
for _q in ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l"):
    RELATIVE_TOLERANCE[_q], TOP1_AT_LEAST[_q] = 1.0, 0.4

PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Gradient checkpointing recomputes activations during the backward pass to save memory.",
)


@dataclass(frozen=True)
class Agreement:
    prompts: int
    tokens: int
    same_tokenization: bool
    max_abs_diff: float
    logit_scale: float  # largest |logit| of the reference
    relative_diff: float
    tolerance: float
    top1_agreement: float
    top1_at_least: float
    # Llama-3.1's rope scaling: the file's rope_freqs equal the factors of transformers' own
    # llama3 rope (None: no rope scaling in the file)
    rope_freqs_match: bool | None = None
    # "transformers" (its GGUF loader), or "gguf" (gguf_readback.py: gguf's reader and
    # dequantizers, the config from the file's keys) for an architecture transformers does not read
    read_back_by: str = "transformers"

    @property
    def ok(self) -> bool:
        return (self.same_tokenization and self.relative_diff <= self.tolerance
                and self.top1_agreement >= self.top1_at_least and self.rope_freqs_match is not False)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def fixed_prompts(tokenizer) -> list[str]:
    """The plain prompts, and one through the tokenizer's chat template (its special tokens)."""
    prompts = list(PROMPTS)
    if getattr(tokenizer, "chat_template", None):
        try:
            prompts.append(tokenizer.apply_chat_template(
                [{"role": "user", "content": "Explain LoRA in one sentence."}], tokenize=False,
                add_generation_prompt=True))
        except Exception:  # a template that needs other fields: the plain prompts still check  # noqa: BLE001
            pass
    return prompts


def compare(reference, tokenizer, gguf_path: Path, quantization: str) -> Agreement:
    """``reference``: the model the file was written from (cast to float32 here, in place)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = reference.float().eval()
    folder, name = str(gguf_path.parent), gguf_path.name
    # Llama-3.1's rope scaling: transformers' loader does not read the file's rope_freqs, so the
    # factors are compared with transformers' own llama3 rope here, and the weights loaded under
    # the model's config (its rope scaling) are compared as every file's are.
    rope = rope_freqs_match(reference.config, gguf_path) if uses_llama3_rope(reference.config.to_dict()) else None
    config = {"config": copy.deepcopy(reference.config)} if rope is not None else {}
    # transformers' GGUF reader draws a plain tqdm bar ("Converting and de-quantizing GGUF
    # tensors...", modeling_gguf_pytorch_utils.py) that its progress-bar switch does not reach.
    model_type = reference.config.model_type
    by = "transformers" if FAMILIES[model_type].arch in READ_BY_TRANSFORMERS else "gguf"
    with contextlib.redirect_stderr(io.StringIO()):
        if by == "gguf":
            loaded, loaded_tok = load_back(gguf_path, model_type)
        else:
            loaded_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, **config).eval()
    same, worst, scale, agree, total = True, 0.0, 0.0, 0, 0
    for text in fixed_prompts(tokenizer):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        # with and without the tokenizer's own BOS/EOS (tokenizer.ggml.add_bos_token)
        same = (same and ids == loaded_tok(text, add_special_tokens=False)["input_ids"]
                and tokenizer(text)["input_ids"] == loaded_tok(text)["input_ids"])
        x = torch.tensor([ids])
        with torch.no_grad():
            a, b = reference(input_ids=x).logits[0], loaded(input_ids=x).logits[0]
        worst = max(worst, float((a - b).abs().max()))
        scale = max(scale, float(a.abs().max()))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(ids)
    del loaded
    return Agreement(len(fixed_prompts(tokenizer)), total, same, round(worst, 6), round(scale, 6),
                     round(worst / scale, 6) if scale else 0.0, RELATIVE_TOLERANCE[quantization],
                     round(agree / total, 6) if total else 1.0, TOP1_AT_LEAST[quantization], rope, by)


def rope_freqs_match(config, gguf_path: Path) -> bool:
    """The file's rope_freqs tensor (read with gguf's GGUFReader) against rope_factors(config)."""
    import gguf
    import numpy as np

    stored = next((t for t in gguf.GGUFReader(gguf_path).tensors if t.name == "rope_freqs.weight"), None)
    if stored is None:
        return False
    want = rope_factors(config).numpy()
    got = np.asarray(stored.data, dtype=np.float32).reshape(-1)
    return got.shape == want.shape and bool(np.allclose(got, want, rtol=1e-6, atol=0))
