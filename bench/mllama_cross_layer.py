"""What one Llama-3.2-Vision cross-attention layer saves for its backward beyond a self-attention
layer's, every parameter trained (full fine-tuning): the measurement the fitted
CROSS_LAYER_TEXT_TOKEN came from. lowvram/plan/memory/cross_attention.py now derives the count
from the source (the gates and norms save only where they train) and
tests/plan/test_cross_attention_saved.py checks it against a real model's layers under LoRA and
full fine-tuning; this script stays as the isolated-layer probe.

One MllamaCrossAttentionDecoderLayer and one MllamaSelfAttentionDecoderLayer (transformers 5,
SDPA) run forward under torch.autograd.graph.saved_tensors_hooks; the bytes of the distinct
storages each saves (its parameters, its input, the cross_attention_states and the mask left
out: the planner counts those elsewhere) are compared at 40/80 text tokens and 24/48 vision
tokens: the slope per text token (cross minus self, per hidden element) and per vision token.

    .venv/bin/python bench/mllama_cross_layer.py
"""

from __future__ import annotations


def saved_bytes(attn: str, dtype: str, autocast: bool, text: int, vision: int, cross: bool,
                kv_heads: int = 2, hidden: int = 64, batch: int = 2) -> int:
    import torch
    from transformers import MllamaTextConfig
    from transformers.models.mllama.modeling_mllama import (
        MllamaCrossAttentionDecoderLayer,
        MllamaRotaryEmbedding,
        MllamaSelfAttentionDecoderLayer,
    )

    cfg = MllamaTextConfig(hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=4,
                           num_key_value_heads=kv_heads, num_hidden_layers=2, cross_attention_layers=[1],
                           vocab_size=100, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = attn
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    layer = (MllamaCrossAttentionDecoderLayer(cfg, 1) if cross else MllamaSelfAttentionDecoderLayer(cfg, 0)).to(dt)
    x = torch.randn(batch, text, hidden, dtype=dt, requires_grad=True)
    states = torch.randn(batch, vision, hidden, dtype=dt)
    mask = torch.zeros(batch, 1, text, vision, dtype=dt)
    rows = torch.ones(batch, 1, text, 1, dtype=dt)
    outside = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    outside |= {t.untyped_storage().data_ptr() for t in (x, states, mask)}
    seen: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in outside:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if cross:
                layer(x, states, mask, None, rows)
            else:
                pos = torch.arange(text)[None]
                layer(x, attention_mask=None, position_ids=pos, position_embeddings=MllamaRotaryEmbedding(cfg)(x, pos))
    return sum(seen.values())


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    print("hidden kv_heads mode      text-token bytes per hidden element (cross - self)   vision-token bytes")
    for hidden, kv_heads in ((64, 2), (128, 4), (128, 1), (64, 4)):
        for dtype, autocast in (("fp32", False), ("bf16", False), ("fp32", True)):
            args = ("sdpa", dtype, autocast)

            def at(text, vision, cross, args=args, kv_heads=kv_heads, hidden=hidden):
                return saved_bytes(*args, text, vision, cross, kv_heads, hidden)

            c1, c2, c3 = at(40, 24, True), at(80, 24, True), at(40, 48, True)
            s1, s2 = at(40, 24, False), at(80, 24, False)
            mode = "autocast" if autocast else dtype
            print(f"{hidden:6} {kv_heads:8} {mode:9} {((c2 - c1) - (s2 - s1)) / 80 / hidden:10.4f} "
                  f"{(c3 - c1) / 48:42.1f}")


if __name__ == "__main__":
    main()
