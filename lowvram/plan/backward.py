"""What the loss and the backward add: the logits around the loss (standard, chunked, Liger's fused
linear cross-entropy), one layer's recompute and backward, and the gradients made so far.
Symbols as in :mod:`lowvram.plan.memory`."""

from __future__ import annotations

from lowvram.plan.activations import (
    dtypes,
    eager_bytes,
    layer_activation_bytes,
    lora_dropout_layer_bytes,
    sliding_window_bytes,
)
from lowvram.plan.models import block_linears, embedding_numel, lm_head_numel, norm_numel
from lowvram.plan.setup import RunSetup
from lowvram.plan.states import dtype_bytes, gradient_bytes, target_linears

# Tokens per chunk of the chunked cross-entropy (lowvram.train.loss uses the same number).
CHUNK_TOKENS = 1024


def recompute_bytes(setup: RunSetup) -> int:
    """With checkpointing: one layer's recomputed activations and what its backward makes while
    they are alive (layer_backward_bytes): the peak when the logits are small (chunked loss,
    small vocabulary; bench/plan_accuracy.py "checkpointing + chunked" cases)."""
    if not setup.gradient_checkpointing:
        return 0
    return layer_activation_bytes(setup) + layer_backward_bytes(setup) + sliding_window_bytes(setup)


def layer_backward_bytes(setup: RunSetup) -> int:
    """What one decoder layer's backward makes while its saved tensors are alive: the incoming
    and outgoing hidden-state gradients (2 x t*h) and its intermediates' gradients, as a share of
    the layer's activations, measured on CPU (bench/plan_accuracy.py, small-logits cases; the
    share taken is at or above each measurement): full fine-tuning and fp32 0.19-0.22 -> 1/4;
    LoRA over 16-bit weights 0.46-0.47 -> 1/2 (the adapter path's gradients are fp32 beside
    16-bit activations); LoRA under autocast with fp32 weights 0.32-0.38 -> 3/8; full
    fine-tuning under autocast 0.02 -> 1/8 (its activations include the 16-bit weight copies,
    which make no gradients). A 4/8-bit base adds the dequantized weight of its largest linear
    in the compute dtype (bitsandbytes MatMul4Bit dequantizes the whole weight in forward and
    backward; measured with the simulated step: Llama-2-7B QLoRA + checkpointing at seq 256 was
    -1.4% without it, Phi-3-mini -2.7%, now +0.5% / +0.9%)."""
    r, c, autocast = dtypes(setup)
    t = setup.micro_batch_size * setup.seq_len
    # Eager attention's s x s part has a backward of its own (below); the shares are of the rest.
    eager = eager_bytes(setup)
    dropout, widest = lora_dropout_layer_bytes(setup)
    layer = layer_activation_bytes(setup) - eager - dropout
    mixed = autocast and dtype_bytes(setup)[0] == 4
    if setup.lora and c == 2:
        backward = layer * 3 // 8 if mixed else layer // 2
    else:
        backward = layer // 8 if mixed else layer // 4
    dequant = 0
    if setup.quantization != "none":
        dequant = c * max(lin.numel for lin in block_linears(setup.model))
    # Eager attention: the softmax backward's fp32 gradients beside the saved scores, measured
    # 0.7-2.0 x a*s^2*b beyond them (eager + checkpointing on a 3-layer Llama, b4 s512: LoRA bf16,
    # QLoRA, full bf16, LoRA fp32; two of them in tests/test_plan_accuracy.py); 2 taken.
    scores = 2 * setup.model.num_heads * setup.seq_len**2 * setup.micro_batch_size if eager else 0
    # lora.dropout: its masks and dropped inputs make no gradients of their own (not in the
    # share); the backward multiplies the widest adapter's fp32 input gradient by the mask, one
    # more fp32 t x d_in (measured: a Gemma LoRA run, dropout 0.05 under bf16-mixed with
    # checkpointing, was 3.2% above its plan with the masks inside the share)
    drop_grad = 4 * t * widest if dropout else 0
    # the dequantized weight lives for one linear's backward, not beside the MLP product's
    shared = max(backward + 2 * r * t * setup.model.hidden_size + dequant, mlp_backward_floor_bytes(setup))
    return shared + scores + drop_grad


def mlp_backward_floor_bytes(setup: RunSetup) -> int:
    """The least a gated MLP's backward holds beside the layer's saved tensors, from PyTorch's
    autograd: at the product ``act(gate) * up`` (MulBackward0) the incoming hidden gradient
    (r x t*h), the product's gradient and the two it makes (3 x t*I in the matmuls' dtype), less
    down_proj's saved input when one was saved (full fine-tuning or an adapter on down_proj: its
    backward, just before, frees it). The share above was measured on all-linear runs, where this
    is about what it gives; with a frozen gate and down_proj the saved tensors are fewer but these
    gradients are not (held-out fuzz seed 206, Llama LoRA on o/up/v in fp32 with checkpointing,
    was 14.5% above its plan)."""
    spec = setup.model
    if spec.is_moe or spec.mlp != "gated":
        return 0
    r, c, autocast = dtypes(setup)
    cc = 2 if autocast else c
    t = setup.micro_batch_size * setup.seq_len
    down = block_linears(spec)[-1]
    down_saved = not setup.lora or down in target_linears(setup)
    return r * t * spec.hidden_size + cc * t * spec.intermediate_size * (2 if down_saved else 3)


def backward_gradient_bytes(setup: RunSetup) -> tuple[int, int]:
    """Trainable gradients that exist when the backward recomputes its first checkpointed layer
    (the last decoder layer: the head's gradients, lm_head and final norm, with a tied embedding's)
    and its last one (the first decoder layer: every gradient but the embedding's and that
    layer's own, except its last linear's, the first its backward makes). Autograd writes each
    .grad as the backward reaches the parameter (PyTorch autograd; measured: the peak of a
    checkpointed full fine-tuning step holds all but the embedding's and most of layer 0's)."""
    total = gradient_bytes(setup)
    spec = setup.model
    layers = max(1, spec.num_layers)
    if setup.lora:  # adapters only inside the decoder layers
        per_layer = total // layers
        return 0, total - per_layer
    w, _ = dtype_bytes(setup)
    head = w * (lm_head_numel(spec) + norm_numel(spec))
    if spec.tie_word_embeddings:
        head += w * embedding_numel(spec)
    embed = 0 if spec.tie_word_embeddings else w * embedding_numel(spec)
    per_layer = (total - head - embed) // layers
    last_linear = w * block_linears(spec)[-1].numel
    return head, total - embed - per_layer + last_linear


def logits_bytes(setup: RunSetup) -> int:
    """Logits around the loss: transformers upcasts logits to fp32 for cross-entropy
    (ForCausalLMLoss); in its backward the saved log-softmax, the incoming gradient and the
    input gradient coexist, 12*t*V fp32 bytes (memory-model.md "Logits and loss"; measured:
    bench/plan_accuracy.py). Chunked loss (lowvram.train.loss) keeps one chunk of CHUNK_TOKENS
    tokens' logits, plus the gradient of all final hidden states, accumulated chunk by chunk
    next to the current chunk's (2 x t*h in the hidden dtype), and the flat int64 targets
    (measured: bench/plan_accuracy.py; the
    same error as the standard loss, within 2%)."""
    spec = setup.model
    t = setup.micro_batch_size * setup.seq_len
    if setup.loss == "fused":
        return fused_loss_bytes(setup)
    if setup.loss == "chunked" and t > CHUNK_TOKENS:  # one chunk: the same as the standard loss
        r, _, _ = dtypes(setup)
        return 12 * CHUNK_TOKENS * spec.vocab_size + 2 * r * t * spec.hidden_size + 8 * t
    return 12 * t * spec.vocab_size


def fused_loss_chunk_tokens(setup: RunSetup) -> int:
    """Rows of one logits chunk in Liger Kernel's fused linear cross-entropy
    (liger_kernel/ops/fused_linear_cross_entropy.py, ``fused_linear_cross_entropy_forward``,
    v0.8.2): inc_factor = ceil(V / h), chunk = next_power_of_2(ceil(t / inc_factor)), so that a
    chunk's logits are about as large as the hidden states; at most t."""
    spec = setup.model
    t = setup.micro_batch_size * setup.seq_len
    inc = -(-spec.vocab_size // spec.hidden_size)
    rows = -(-t // inc)
    return min(t, 1 << (rows - 1).bit_length())


def fused_loss_bytes(setup: RunSetup) -> int:
    """Liger Kernel's fused linear cross-entropy (loss: fused; Hsu et al. 2024, arXiv:2410.10989),
    from ``fused_linear_cross_entropy_forward`` (v0.8.2): the forward computes the loss and the
    gradients at once, chunk by chunk, and keeps them for the backward. Alive at its highest:
    ``grad_input`` (zeros_like the hidden states, r*t*h, saved for the backward), one chunk's
    logits in the compute dtype (their gradient is written in place), the chunk's
    ``grad_logits @ weight`` product before it is copied into grad_input (rows*h), the fp32
    ``loss_1d`` (4t), the ``target != ignore_index`` mask (t) and the shifted int64 labels (8t).
    A trainable lm_head (full fine-tuning) adds ``grad_weight`` (zeros_like the weight) and, off
    the fp32-accumulator addmm path (bf16/fp16 weights), ``torch.mm(...).float()``: a V x h
    product in the compute dtype and its fp32 copy. No full logits, ever (the model returns none
    in training: liger's lce_forward skips them when labels are given). From the source, not
    measured (Liger needs a GPU)."""
    spec = setup.model
    t = setup.micro_batch_size * setup.seq_len
    h, v = spec.hidden_size, spec.vocab_size
    r, c, autocast = dtypes(setup)
    cc = 2 if autocast else c
    rows = fused_loss_chunk_tokens(setup)
    total = r * t * h + cc * rows * v + cc * rows * h + (4 + 1 + 8) * t
    if not setup.lora:
        w, _ = dtype_bytes(setup)
        total += w * v * h
        if not (w == 4 and cc == 2):  # the addmm path (fp32 grad_weight, 16-bit logits) makes none
            total += cc * v * h + (4 * v * h if cc != 4 else 0)
    return total


__all__ = [
    "backward_gradient_bytes", "CHUNK_TOKENS", "fused_loss_bytes", "fused_loss_chunk_tokens",
    "layer_backward_bytes", "logits_bytes", "mlp_backward_floor_bytes", "recompute_bytes",
]
