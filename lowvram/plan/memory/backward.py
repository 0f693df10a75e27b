"""What the loss and the backward add: the logits around the loss (standard, chunked, Liger's fused
linear cross-entropy), one layer's recompute and backward, and the gradients made so far.
Symbols as in :mod:`lowvram.plan.memory.memory`."""

from __future__ import annotations

from dataclasses import replace

from lowvram.plan import constants as fitted
from lowvram.plan.memory.activations import (
    dtypes,
    eager_bytes,
    layer_activation_bytes,
    linear_sources,
    lora_dropout_layer_bytes,
    mlp_elementwise_bytes,
    normed_bytes,
    qk_norm_activation_bytes,
    recomputed_mask_bytes,
)
from lowvram.plan.memory.states import dtype_bytes, gradient_bytes, target_linears
from lowvram.plan.model.layer import describe_layer
from lowvram.plan.model.models import (
    block_linears,
    dense_view,
    embedding_numel,
    lm_head_numel,
    norm_numel,
)
from lowvram.plan.model.moe import expert_adapters
from lowvram.plan.setup import RunSetup, per_states

# Tokens per chunk of the chunked cross-entropy: the default of RunSetup.loss_chunk_tokens (and of
# lowvram.train.build.loss); the search halves it down to MIN_CHUNK_TOKENS where the budget needs it
# (search.sized_loss_chunk). Each chunk is one (chunk x h) @ (h x V) product: at 128 rows a GEMM
# still fills the card's tiles, so the step time is not counted as changing.
CHUNK_TOKENS = 1024
MIN_CHUNK_TOKENS = 128


def recompute_bytes(setup: RunSetup, last: bool = True) -> int:
    """With checkpointing: one layer's recomputed activations and what its backward makes while
    they are alive (layer_backward_bytes): the peak when the logits are small (chunked loss,
    small vocabulary; bench/plan_accuracy.py "checkpointing + chunked" cases). ``last``: the last
    decoder layer's recompute, else layer 0's (their masks: recomputed_mask_bytes)."""
    if not setup.gradient_checkpointing:
        return 0
    return layer_activation_bytes(setup) + layer_backward_bytes(setup) + recomputed_mask_bytes(setup, last)


def layer_backward_bytes(setup: RunSetup) -> int:
    """What one decoder layer's backward makes while its saved tensors are alive: the incoming
    and outgoing hidden-state gradients (2 x t*h) and its intermediates' gradients, as a share of
    the layer's activations, measured on CPU (bench/plan_accuracy.py, small-logits cases; the
    share taken is at or above each measurement): constants.BACKWARD_SHARE_FULL (full fine-tuning
    and fp32), BACKWARD_SHARE_LORA (LoRA over 16-bit weights), BACKWARD_SHARE_LORA_AUTOCAST (LoRA
    under autocast with fp32 weights), BACKWARD_SHARE_FULL_AUTOCAST (full fine-tuning under
    autocast), each with its measured shares. A 4/8-bit base's dequantized weight is a moment of
    its own inside the layer's backward, not a term on the share (quantized_base_backward_bytes)."""
    r, c, autocast = dtypes(setup)
    t = setup.micro_batch_size * setup.seq_len
    # Eager attention's s x s part has a backward of its own (eager_softmax_backward_bytes, a
    # peak candidate of its own in memory.py); the shares are of the rest.
    eager = eager_bytes(setup)
    dropout, widest = lora_dropout_layer_bytes(setup)
    spec = setup.model
    # An MoE layer: the share is of its dense part (attention, a shared expert); the routed
    # experts' backward starts at their combine (moe_combine_backward_bytes). With the routed
    # tensors in the share, held-out seeds 349 and 350 (Mixtral QLoRA, Qwen3-MoE LoRA, with
    # checkpointing) were 12.1% and 10.8% over their plans.
    shared_part = replace(setup, model=dense_view(spec)) if describe_layer(spec).experts == "routed" else setup
    layer = layer_activation_bytes(shared_part) - eager - dropout
    mixed = autocast and dtype_bytes(setup)[0] == 4
    # the shares were measured on Llama-style blocks (constants.SHARE_BLOCK_NORMS): what further norms
    # save (Gemma-3's post-norms, q/k norms) makes no gradients in proportion under LoRA (frozen:
    # fp32 upcasts) and in pure fp32 (held-out seeds 861 and 1127, Gemma-3 full fp32 with
    # checkpointing, were 12.8% and 10.2% under their plans); not under 16-bit full fine-tuning,
    # where taking them out put a 2-layer Gemma-3, full bf16 with checkpointing, 3.9% under its
    # simulated step (tests/plan/test_families.py)
    if setup.lora or (r == 4 and not autocast):
        layer -= _extra_norm_saved_bytes(setup)
    if setup.lora and c == 2:
        share = fitted.BACKWARD_SHARE_LORA_AUTOCAST if mixed else fitted.BACKWARD_SHARE_LORA
    else:
        share = fitted.BACKWARD_SHARE_FULL_AUTOCAST if mixed else fitted.BACKWARD_SHARE_FULL
    backward = share.of(layer)
    # lora.dropout: its masks and dropped inputs make no gradients of their own (not in the
    # share); the backward multiplies the widest adapter's fp32 input gradient by the mask, one
    # more fp32 t x d_in. Under autocast lora_A saved a 16-bit cast of the dropped input, so that
    # gradient is new beside every saved tensor (measured: a Gemma LoRA run, dropout 0.05 under
    # bf16-mixed with checkpointing, was 3.2% above its plan with the masks inside the share).
    # Outside autocast lora_A saved the fp32 dropped input itself (activations._lora_dropout_bytes)
    # and its backward frees it as the gradient is made: the gradient is alive in that Linear's
    # backward only, beside the layer's incoming gradient, not beside the MLP product's gradients
    # after it (measured with the live-bytes tracker: held-out seed 878 of the mllama draw, QLoRA
    # fp32 on down_proj and v_proj with dropout and checkpointing, peaked 11.09% under a plan that
    # stacked it on the MLP floor; its backward held one (4, 128, 512) fp32 input gradient)
    drop_grad = 4 * t * widest if dropout else 0
    hidden_in = r * t * setup.model.hidden_size
    stacked, own = (drop_grad, 0) if autocast else (0, hidden_in + drop_grad)
    # a merged expert weight's gradient lives beside the share (one fused expert parameter at a
    # time); a 4/8-bit base's dequantized weight in its own moment (quantized_base_backward_bytes)
    shared = max(backward + 2 * r * t * setup.model.hidden_size + expert_weight_gradient_bytes(setup),
                 mlp_backward_floor_bytes(setup), quantized_base_backward_bytes(setup), own,
                 adapter_forward_bytes(setup), moe_combine_backward_bytes(setup),
                 post_norm_backward_bytes(setup))
    return shared + stacked


def _extra_norm_saved_bytes(setup: RunSetup) -> int:
    """What a decoder layer's norms beyond a Llama block's two save (the fp32 upcast of the input
    and the rsqrt per norm, and the normalized input for a trainable weight, as in
    layer_activation_bytes): Gemma-3's post-attention and post-MLP norms, q/k norms. Held-out fuzz
    seed 272 (Gemma-3 QLoRA on k_proj with checkpointing) was 12.4% over its plan with them
    inside the share."""
    spec = setup.model
    t = setup.micro_batch_size * setup.seq_len
    extra = max(0, describe_layer(spec).norms - fitted.SHARE_BLOCK_NORMS.value)
    normed = 0 if setup.lora else normed_bytes(setup) * spec.hidden_size  # a trainable weight's
    return t * (extra * (4 * spec.hidden_size + 4 + normed) + qk_norm_activation_bytes(setup))


def expert_weight_gradient_bytes(setup: RunSetup) -> int:
    """LoRA on fused experts (peft's ParamWrapper, lowvram.plan.model.moe): grouped_mm's backward makes
    the gradient of the merged weight (base + B@A), weight-sized in the stored dtype, before
    baddbmm's backward turns it into the factors' gradients: the largest adapted expert parameter,
    once (0 without expert adapters). Measured with the live-bytes tracker in lowvram train:
    ten-family seed 96 made eager + checkpointing (Qwen3-MoE LoRA all-linear, fp32, b1 s64; the
    same with SDPA) was 4.0% above its plan without it, a (8, 128, 192) merged down_proj gradient
    beside both merged weights at its peak."""
    spec = setup.model
    if not setup.lora or describe_layer(spec).experts == "none":
        return 0
    experts = [a for a in expert_adapters(spec, setup.lora_r, setup.lora_targets) if a.name != "router"]
    return dtype_bytes(setup)[0] * max((a.base_numel for a in experts), default=0)


def dequantized_weight_bytes(setup: RunSetup) -> int:
    """A 4/8-bit base's largest block Linear dequantized in the compute dtype: bitsandbytes'
    MatMul4Bit dequantizes the whole weight in forward and backward (0 without quantization;
    constants.DEQUANTIZED_WEIGHTS, measured with the simulated step)."""
    if setup.quantization == "none":
        return 0
    _, c, _ = dtypes(setup)
    return fitted.DEQUANTIZED_WEIGHTS.of(c * max(lin.numel for lin in block_linears(setup.model)))


def quantized_base_backward_bytes(setup: RunSetup) -> int:
    """A 4/8-bit base Linear's backward inside a decoder layer's: bitsandbytes 0.50
    ``MatMul4Bit.backward`` makes ``grad_A = grad_output @ dequantize_4bit(W)``, the whole weight
    dequantized (dequantized_weight_bytes) beside its output's gradient and the input gradient it
    makes (t x d_out and t x d_in in the gradient's dtype, the activations' compute dtype), with
    the layer's incoming hidden-state gradient (r x t*h); the largest over the block's Linears
    (0 without quantization). The share's intermediate gradients are not stacked on it: the
    weight is freed when the one matmul returns, and the gradients made before it by that
    Linear's adapters and the nodes after it are mostly consumed by then. Measured with the
    live-bytes tracker: extended seed 142 (SmolLM3 QLoRA DoRA on o_proj, bf16 with
    checkpointing) peaked at the recomputed MLP product's backward with no dequantized weight
    alive; with the weight stacked on the share its last_layer_recompute was 13.3% above that
    peak (once its DoRA weight-norm moment was counted as it runs), with this moment 5.55%. At
    seq 256 the 7B simulated steps need the weight (constants.DEQUANTIZED_WEIGHTS)."""
    if setup.quantization == "none":
        return 0
    r, c, autocast = dtypes(setup)
    g = 2 if autocast else c  # the gradients' dtype: the matmuls' outputs
    t = setup.micro_batch_size * setup.seq_len
    widest = max(g * t * (lin.d_in + lin.d_out) for lin in block_linears(setup.model))
    return dequantized_weight_bytes(setup) + widest + r * t * setup.model.hidden_size


def eager_softmax_backward_bytes(setup: RunSetup) -> int:
    """Eager attention's backward in the last decoder layer, with every layer's saved tensors
    alive (no checkpointing): the probabilities' gradient cast back to fp32 and the softmax's
    input gradient, two fp32 s x s tensors per head (transformers' eager_attention_forward takes
    the softmax in fp32), less the 16-bit copy of the probabilities, freed by then. Measured with
    the live-bytes tracker on held-out fuzz seed 470 (3-layer Llama LoRA, bf16-mixed, b4 s512,
    chunked loss: 5.9% above its plan without it). gpt-oss has its own (moe.sink_eager_backward_bytes)."""
    spec = setup.model
    if setup.attention != "eager" or describe_layer(spec).attention == "sinks":
        return 0
    _, c, autocast = dtypes(setup)
    cc = 2 if autocast else c
    cells = spec.num_heads * setup.micro_batch_size * setup.seq_len**2
    return 8 * cells - (cc * cells if cc != 4 else 0)


def post_norm_backward_bytes(setup: RunSetup) -> int:
    """A block that ends with a norm (OLMo-2: ``residual + post_feedforward_layernorm(mlp)``)
    starts its backward with that RMSNorm's, in fp32, beside all the layer's saved tensors: the
    incoming gradient (r x t*h), its fp32 cast and the fp32 t x h temporaries of the
    normalization's backward seen at the peak (constants.POST_NORM_BACKWARD_TEMPORARIES, with
    its measurement; LoRA only: full fine-tuning's share of the layer covers it)."""
    spec = setup.model
    if not describe_layer(spec).norm_after or not setup.lora:  # full fine-tuning: its share covers it
        return 0
    r, _, _ = dtypes(setup)
    return (r + fitted.POST_NORM_BACKWARD_TEMPORARIES.value * 4) * setup.micro_batch_size * setup.seq_len * spec.hidden_size


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
    if describe_layer(spec).mlp != "gated":  # routed experts: moe_combine_backward_bytes
        return 0
    r, _, _ = dtypes(setup)
    e = mlp_elementwise_bytes(setup)
    t = setup.micro_batch_size * setup.seq_len
    down = block_linears(spec)[-1]
    down_saved = not setup.lora or down in target_linears(setup)
    return r * t * spec.hidden_size + e * t * spec.intermediate_size * (2 if down_saved else 3)


def adapter_forward_bytes(setup: RunSetup) -> int:
    """The most one adapted Linear's forward holds beside the layer's saved tensors while the
    backward recomputes its layer (or, without checkpointing, at the last layer), from peft's
    ``lora.Linear.forward`` (and bnb ``Linear4bit.forward``, which clones the base result):
    peft's fp32 cast of a 16-bit input for the fp32 adapter (``_cast_input_dtype``: 4 x d_in,
    under autocast; without that cast the MLP floor and the share cover the layer, measured), the
    base result and lora_B's output (2 x d_out in the matmul's dtype; a 4/8-bit base casts back
    to the input's dtype and clones its result: 3 x d_out), the input itself
    where nothing saves it (the MLP product of a frozen down_proj), and three hidden-size tensors
    of the layer's frame (the incoming gradient, the residual and the normed input).
    Measured with the live-bytes tracker on a 2-layer Llama, LoRA bf16 on down_proj only with
    checkpointing: 5.3% above its plan without this; QLoRA bf16 on up_proj only 8.0%."""
    spec = setup.model
    if not setup.lora or describe_layer(spec).experts != "none":
        return 0
    r, c, autocast = dtypes(setup)
    cc = 2 if autocast else c
    e = mlp_elementwise_bytes(setup)
    quantized = setup.quantization != "none"
    t = setup.micro_batch_size * setup.seq_len
    names = {lin.name for lin in target_linears(setup)}
    best = 0
    for lin, src in zip(block_linears(spec), linear_sources(spec), strict=True):
        if lin.name not in names:
            continue
        x_bytes = {"attn_out": cc, "mlp_act": e}.get(src, r)
        if not autocast or x_bytes == 4:
            continue  # no cast: the MLP floor and the share cover it (measured)
        unsaved_input = e * lin.d_in if src == "mlp_act" else 0  # a frozen down_proj saves no input
        results = 3 * x_bytes if quantized else 2 * cc  # bnb casts back to x's dtype and clones
        best = max(best, 3 * r * spec.hidden_size + unsaved_input + 4 * lin.d_in + results * lin.d_out)
    return t * best


def moe_combine_backward_bytes(setup: RunSetup) -> int:
    """An MoE layer's backward starts at its routed experts' combine (transformers 5
    integrations/moe.py ``grouped_mm_experts_forward``: ``weighted_out[inv_perm]`` then
    ``.view(t, k, h).sum(1)``): the incoming hidden gradient, the sum's expanded gradient made
    contiguous and the index's backward (zeros and their index_put), k x t x h each in fp32 (the
    fp32 routing weights promote ``proj_out * routing_weights``, also over bf16 experts).
    Measured with the live-bytes tracker on a tiny Mixtral, full fine-tuning bf16-mixed with
    checkpointing (held-out fuzz seed 244: 3.7% above its plan without it; the term is 1.75 MiB
    where 1.50 MiB was measured; a 2-layer Mixtral in pure bf16, seq 1024, was 7.4% under a real
    CPU step with the experts' dtype here). gpt-oss's experts combine their own way (not counted
    here)."""
    spec = setup.model
    if describe_layer(spec).experts != "routed":  # gpt-oss's biased experts: not counted here
        return 0
    r, _, _ = dtypes(setup)
    t = setup.micro_batch_size * setup.seq_len
    # fp32 whatever the weights: the fp32 routing weights promote ``proj_out * weights``
    return r * t * spec.hidden_size + 3 * 4 * spec.num_experts_per_tok * t * spec.hidden_size


@per_states
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


def logits_bytes(setup: RunSetup, chunk: int | None = None) -> int:
    """Logits around the loss: transformers upcasts logits to fp32 for cross-entropy
    (transformers loss/loss_utils.py ForCausalLMLoss: ``logits.float()``); in its backward the
    saved log-softmax, the incoming gradient and the input gradient coexist:
    constants.LOGITS_LOSS_BYTES x t x V (measured: bench/plan_accuracy.py). Chunked loss
    (lowvram.train.build.loss) keeps one chunk of setup.loss_chunk_tokens tokens' logits, plus the gradient of all
    final hidden states, accumulated chunk by chunk next to the current chunk's
    (constants.CHUNKED_LOSS_HIDDEN_GRADIENTS x t*h in the hidden dtype), and the flat int64
    targets. ``chunk``: the chunked loss's tokens per chunk if not the setup's."""
    spec = setup.model
    t = setup.micro_batch_size * setup.seq_len
    if setup.loss == "fused":
        return fused_loss_bytes(setup)
    chunk = chunk or setup.loss_chunk_tokens
    if setup.loss == "chunked" and t > chunk:  # one chunk: the same as the standard loss
        r, _, _ = dtypes(setup)
        return (fitted.LOGITS_LOSS_BYTES.of(chunk * spec.vocab_size)
                + fitted.CHUNKED_LOSS_HIDDEN_GRADIENTS.of(r * t * spec.hidden_size) + 8 * t)
    return fitted.LOGITS_LOSS_BYTES.of(t * spec.vocab_size)


def chunked_head_gradient_bytes(setup: RunSetup) -> int:
    """The chunked loss's lm_head weight gradient at the loss, full fine-tuning: each chunk's
    backward makes lm_head's V x h gradient, which AccumulateGrad sums into ``.grad``, so with
    more than one chunk one V x h gradient more than the plan's kept gradients is alive beside a
    chunk's logits: without accumulation the ``.grad`` an earlier chunk made, with accumulation
    (its ``.grad`` a kept gradient already) the chunk's new one. Measured: the emulated-card
    cell (1B/1024 Llama full bf16, two 128-token chunks, micro-batch 2 x 8) held one (2048, 128)
    bf16 tensor more than its plan at its peak (+4.3%; +3.6% with AdamW, +3.8% with 8-bit AdamW),
    and a 2-layer Llama at micro-batch 4 x 512 without accumulation one (8192, 128), beside
    three fp32 chunk x V tensors (tests/plan/test_accuracy.py). A LoRA lm_head is frozen."""
    t = setup.micro_batch_size * setup.seq_len
    if setup.loss != "chunked" or setup.lora or t <= setup.loss_chunk_tokens:
        return 0
    return dtype_bytes(setup)[0] * lm_head_numel(setup.model)


def chunk_resized(setup: RunSetup) -> bool:
    """The chunked loss runs with a chunk smaller than CHUNK_TOKENS (the budget needed it)."""
    return setup.loss == "chunked" and setup.loss_chunk_tokens != CHUNK_TOKENS


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
    "adapter_forward_bytes", "backward_gradient_bytes", "CHUNK_TOKENS", "chunk_resized", "chunked_head_gradient_bytes", "MIN_CHUNK_TOKENS", "dequantized_weight_bytes",
    "eager_softmax_backward_bytes", "expert_weight_gradient_bytes", "fused_loss_bytes",
    "fused_loss_chunk_tokens", "layer_backward_bytes", "logits_bytes", "mlp_backward_floor_bytes",
    "moe_combine_backward_bytes", "post_norm_backward_bytes", "quantized_base_backward_bytes",
    "recompute_bytes",
]
