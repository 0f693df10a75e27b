"""The accuracy matrices of the memory model: the small Llama and the setups that
tests/plan/test_accuracy.py and bench/plan_accuracy.py measure (step.py) against the plan."""

from __future__ import annotations

from lowvram.plan.model.models import ModelSpec


def tiny_llama_spec(hidden_size: int = 256, num_layers: int = 4, vocab_size: int = 4096) -> ModelSpec:
    """A small Llama (GQA: heads of 64, half as many kv heads; untied head) for CPU steps."""
    heads = max(2, hidden_size // 64)
    return ModelSpec(
        name="tiny-llama", hf_id=None, model_type="llama", hidden_size=hidden_size,
        intermediate_size=(hidden_size * 8 // 3 + 15) // 16 * 16, num_layers=num_layers, num_heads=heads,
        num_kv_heads=heads // 2, head_dim=hidden_size // heads, vocab_size=vocab_size,
        tie_word_embeddings=False, max_position_embeddings=2048,
    )


# (case name, RunSetup keyword arguments); every case runs on tiny_llama_spec() on CPU.
ACCURACY_MATRIX: list[tuple[str, dict]] = [
    ("full fp32", dict(precision="fp32")),
    ("full bf16", dict(precision="bf16")),
    ("full bf16-mixed", dict(precision="bf16-mixed")),
    ("full bf16 + checkpointing", dict(precision="bf16", gradient_checkpointing=True)),
    ("full fp32 + checkpointing", dict(precision="fp32", gradient_checkpointing=True)),
    ("full bf16 b2 s256", dict(precision="bf16", micro_batch_size=2, seq_len=256)),
    ("full bf16 b2 s512", dict(precision="bf16", micro_batch_size=2)),
    ("full bf16 s256", dict(precision="bf16", seq_len=256)),
    ("full bf16 accum 2", dict(precision="bf16", grad_accum=2)),
    ("full bf16 adamw_8bit", dict(precision="bf16", optimizer="adamw_8bit")),
    ("full bf16 adafactor", dict(precision="bf16", optimizer="adafactor")),
    ("full bf16 eager", dict(precision="bf16", attention="eager")),
    ("lora bf16", dict(precision="bf16", lora=True)),
    ("lora fp32", dict(precision="fp32", lora=True)),
    ("lora bf16-mixed", dict(precision="bf16-mixed", lora=True)),
    ("lora bf16 q,v r8", dict(precision="bf16", lora=True, lora_r=8, lora_targets=("q_proj", "v_proj"))),
    ("lora bf16 + checkpointing", dict(precision="bf16", lora=True, gradient_checkpointing=True)),
    # lora.dropout > 0: a dropped copy of each adapter's input and its mask (+30-45% activations)
    ("lora fp32 dropout 0.1", dict(precision="fp32", lora=True, lora_dropout=0.1)),
    ("lora bf16-mixed dropout 0.05", dict(precision="bf16-mixed", lora=True, lora_dropout=0.05)),
    ("qlora nf4-dq dropout 0.1 q,v", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                          lora_dropout=0.1, lora_targets=("q_proj", "v_proj"))),
    ("qlora nf4", dict(precision="bf16", lora=True, quantization="nf4")),
    ("qlora nf4-dq", dict(precision="bf16", lora=True, quantization="nf4-dq")),
    ("qlora nf4-dq + checkpointing", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                          gradient_checkpointing=True)),
    ("qlora nf4-dq b2 s256 adamw_8bit", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                             micro_batch_size=2, seq_len=256, optimizer="adamw_8bit")),
    ("full bf16 chunked loss b8 s1024", dict(precision="bf16", loss="chunked", micro_batch_size=8,
                                             seq_len=1024)),
    # Checkpointing with small logits (chunked loss): the peak is a layer's recompute + backward.
    ("lora bf16 + ckpt + chunked b2 s2048", dict(precision="bf16", lora=True, gradient_checkpointing=True,
                                                 loss="chunked", micro_batch_size=2, seq_len=2048)),
    ("qlora nf4-dq + ckpt + chunked b2 s2048", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                                    gradient_checkpointing=True, loss="chunked",
                                                    micro_batch_size=2, seq_len=2048)),
]


# Small logits (vocabulary 512, tiny_llama_spec(vocab_size=512)): the peak moves into the
# backward (checkpointed layers, nearly every gradient made) or, under autocast with fp32
# weights, to the end of the forward. bench/plan_accuracy.py runs these after the matrix above.
SMALL_LOGITS_MATRIX: list[tuple[str, dict]] = [
    ("full fp32 + ckpt b2 s256", dict(precision="fp32", gradient_checkpointing=True, micro_batch_size=2, seq_len=256)),
    ("full bf16 + ckpt b2 s256", dict(precision="bf16", gradient_checkpointing=True, micro_batch_size=2, seq_len=256)),
    ("full bf16 + ckpt b2 s1024", dict(precision="bf16", gradient_checkpointing=True, micro_batch_size=2, seq_len=1024)),
    ("full bf16-mixed + ckpt b2 s256", dict(precision="bf16-mixed", gradient_checkpointing=True, micro_batch_size=2,
                                            seq_len=256)),
    ("full bf16 b2 s32", dict(precision="bf16", micro_batch_size=2, seq_len=32)),
    ("lora fp32 + ckpt b2 s256", dict(precision="fp32", lora=True, gradient_checkpointing=True, micro_batch_size=2,
                                      seq_len=256)),
    ("lora bf16 + ckpt b2 s1024", dict(precision="bf16", lora=True, gradient_checkpointing=True, micro_batch_size=2,
                                       seq_len=1024)),
    ("lora bf16-mixed + ckpt b2 s256", dict(precision="bf16-mixed", lora=True, gradient_checkpointing=True,
                                            micro_batch_size=2, seq_len=256)),
    ("qlora nf4-dq + ckpt b2 s1024", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                          gradient_checkpointing=True, micro_batch_size=2, seq_len=1024)),
]
