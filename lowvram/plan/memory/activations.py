"""What the forward saves for the backward: one decoder layer's activations (dropout, eager
attention, q/k norms, experts), the head's, the sliding-window masks, all layers' with or without
checkpointing, and activation offloading to host RAM. Fitted terms, each with its measurement;
symbols as in :mod:`lowvram.plan.memory.memory`. The attention masks a layer saves are in masks.py,
offloading in activation_offload.py, the dtypes in states.py (all read through here too)."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from lowvram.plan import constants as fitted
from lowvram.plan.memory.activation_offload import (
    activation_offload_host_bytes,
    activation_offloaded,
    offloaded_layer_input_bytes,
)
from lowvram.plan.memory.masks import (
    _checkpointed_mask_bytes,
    eager_mask_bytes,
    masked_attention_bytes,
    masked_layers,
    recomputed_mask_bytes,
)
from lowvram.plan.memory.states import dtype_bytes, dtypes, target_linears
from lowvram.plan.model import moe
from lowvram.plan.model.layer import describe_layer
from lowvram.plan.model.models import ModelSpec, block_linears, dense_view
from lowvram.plan.setup import RunSetup

# --------------------------------------------------------------------------------------------
# Activations


@lru_cache(maxsize=256)  # per model, as models.block_linears
def linear_sources(spec: ModelSpec) -> tuple[str, ...]:
    """Which tensor feeds each block linear: the attention norm, the attention output, the MLP
    norm, or the MLP activation (same order as block_linears)."""
    out = []
    for lin in block_linears(spec):
        d_in = lin.d_in
        if len(out) < (1 if spec.fused_qkv else 3):
            out.append("norm_attn")
        elif len(out) == (1 if spec.fused_qkv else 3):
            out.append("attn_out")
        elif d_in == spec.intermediate_size:
            out.append("mlp_act")
        else:
            out.append("norm_attn" if spec.parallel_attn else "norm_mlp")
    return tuple(out)


def _first_layer_grads(setup: RunSetup) -> tuple[bool, bool, bool, bool]:
    """Which parts of decoder layer 0 carry a gradient under LoRA: (attention, residual after
    attention, MLP gate branch, MLP up branch). The embedding is frozen, so autograd records (and
    saves for) nothing upstream of the first adapter: with LoRA on down_proj only, layer 0 saves
    nothing but down_proj's input (measured on a 3-layer Phi-3: the plan was 15% high). Standard
    pre-norm gated blocks only, with two norms or Gemma-2/3's four (input, post-attention,
    pre-feedforward, post-feedforward: held-out fuzz seed 653, Gemma-3 LoRA on gate/down_proj
    with eager attention, was 19.8% under its plan with layer 0's scores counted), and OLMo-2's
    post-norm block (_post_norm_block: the attention reads the layer's input itself, the MLP the
    residual after it; measured with the live-bytes tracker: held-out seed 1703, OLMo-2 LoRA on
    up_proj only, fp32, b1 s256, no checkpointing, was 11.8% under its plan with all of layer 0
    counted: its attention, norms and gate saved nothing); other layouts count everything (over,
    never under)."""
    if not _layer_zero_traced(setup):
        return True, True, True, True
    spec = setup.model
    names = {lin.name for lin in target_linears(setup)}
    pairs = list(zip(block_linears(spec), linear_sources(spec), strict=True))
    adapted = {src for lin, src in pairs if lin.name in names}  # the inputs some adapter reads
    attn = "norm_attn" in adapted
    resid = attn or "attn_out" in adapted
    mlp_in = [lin for lin, src in pairs if src == "norm_mlp"]
    # [gate, up] or [gate_up] (one tensor: both branches)
    gate = resid or mlp_in[0].name in names
    up = resid or mlp_in[-1].name in names
    return attn, resid, gate, up


def mlp_elementwise_bytes(setup: RunSetup) -> int:
    """Bytes per element of the MLP's activation, product and their gradients: the matmul
    outputs' dtype under full fine-tuning; under LoRA fp32 when the compute is fp32 or a quantized
    base's Linear4bit casts its output back to an fp32 residual (prepare_model_for_kbit_training),
    else 16-bit (measured with saved_tensors_hooks)."""
    r, c, autocast = dtypes(setup)
    if not setup.lora:
        return 2 if autocast else c
    return 4 if (setup.quantization != "none" and r == 4) or c == 4 else 2


def layer_activation_bytes(setup: RunSetup, first: bool = False, attention_side: bool = False,
                           traced: RunSetup | None = None) -> int:
    """Bytes autograd saves for one decoder layer (no recomputation).

    ``traced``: the run whose layer 0 the LoRA terms trace (_first_layer_grads), when ``setup``
    is part of its block (lowvram.plan.memory.tiled: the block without its tiled MLP, whose layout alone
    is no standard block).

    ``attention_side``: only what is still alive when the backward reaches the attention's
    scores, the MLP's and o_proj's saved tensors freed: the input norm, q/k norms, q, k, v, the
    q/k/v projections' inputs and adapters, the scores (eager_softmax_backward_bytes' setting).

    Counted tensor by tensor from what autograd saves (PyTorch derivatives.yaml saves only what a
    backward needs), checked with saved_tensors_hooks and the live-bytes tracker
    (measured: bench/plan_accuracy.py, bench/plan_fuzz.py). Llama block, t tokens, pure bf16 full
    fine-tuning: t*(20h + 4h_kv + 8I + 4a + 8) at q_dim = h, i.e. the Korthikanti et al. 2022 count
    without dropout; RMSNorm saves its fp32 upcast (4h) and rsqrt (4); SDPA saves q, k, v, out and
    an fp32 logsumexp per head; SwiGLU saves gate, silu(gate), up and their product.
    """
    spec = setup.model
    layer = describe_layer(spec)
    if layer.experts != "none":
        if attention_side:  # the routed experts are freed by then: the dense block's attention
            return layer_activation_bytes(replace(setup, model=dense_view(spec)), attention_side=True)
        return _moe_layer_activation_bytes(setup, first)
    r, c, autocast = dtypes(setup)
    t = setup.micro_batch_size * setup.seq_len
    h, i = spec.hidden_size, spec.intermediate_size
    full = not setup.lora
    cc = 2 if autocast else c  # dtype of matmul outputs under autocast
    attn_grad, resid_grad, gate_grad, up_grad = _first_layer_grads(traced or setup) if first else (True,) * 4
    grad_of = {"norm_attn": not first or full, "attn_out": attn_grad, "norm_mlp": resid_grad,
               "mlp_act": gate_grad or up_grad}
    per_tok = qk_norm_activation_bytes(setup) if attn_grad else 0
    fixed = 0
    # norms: fp32 upcast of the input + rsqrt; a trainable weight also saves the normalized x
    for n in range(layer.norms):
        # the norms on the attention's output and the MLP's input (n = 1, and Gemma's n = 2)
        after_attention = n == 1 or (n == 2 and layer.norms == 4)
        if first and not full and layer.norm_after:
            # OLMo-2: n 0 normalizes the attention's output, n 1 the MLP's; each saves only where
            # its input needs a gradient (an adapter upstream of it in layer 0)
            if not (resid_grad if n == 0 else resid_grad or gate_grad or up_grad or _mlp_out_adapted(setup)):
                continue
        elif first and not full and (n == 0 or (after_attention and not resid_grad)):
            continue  # LoRA: no gradient flows into the embedding output
        if attention_side and (n > 0 or layer.norm_after):
            continue  # the norms after the attention (and OLMo-2's post-norms) are done
        per_tok += 4 * h + 4 + (normed_bytes(setup) * h if full else 0)
    fixed += _norm_weight_fixed_bytes(setup)
    if attn_grad:
        # attention (SDPA / flash): q, k, v, out + fp32 logsumexp per head
        per_tok += cc * (2 * spec.q_dim + 2 * spec.kv_dim) + 4 * spec.num_heads
    if spec.resid_dropout and not attention_side:
        # dropout masks on the attention output and the MLP output: bool from CUDA's fused
        # kernel (native_dropout); on a CPU ATen multiplies by a noise tensor of the input dtype
        per_tok += 2 * h * (1 if setup.device == "cuda" else cc)
    if layer.fused_qkv_rotated and attn_grad:
        # Fused qkv + rotary (Phi-3): q and k are rotated into new tensors, but v stays a view of
        # the fused output, whose whole storage SDPA keeps alive (constants.FUSED_QKV_ROTARY_COPIES)
        per_tok += fitted.FUSED_QKV_ROTARY_COPIES.of(cc * (spec.q_dim + spec.kv_dim))
    # MLP elementwise: silu saves its input (gate) and the product saves each factor the other
    # branch needs a gradient for: silu(gate) for up's, up for gate's
    e = 0 if attention_side else mlp_elementwise_bytes(setup)
    if layer.mlp == "gated":
        per_tok += e * i * (2 * gate_grad + up_grad)  # gate out (silu input), up out; silu out
    else:
        # act input; transformers' gelu_new is composed in Python (NewGELUActivation:
        # 0.5*x*(1+tanh(...))), so autograd also saves the tanh output, 0.5*x and 1+tanh
        per_tok += e * i * (4 if spec.hidden_act in ("gelu_new", "gelu_fast") else 1)
    # o_proj's input as it is (what a Linear saves without a cast): SDPA's saved output, unless
    # that is a copy (LayerSpec.attention_output_copied, Phi-3: measured with the live-bytes
    # tracker on a CPU, a Phi-3 LoRA run on o_proj was 3.4% above its plan without it) or SDPA
    # saved nothing (layer 0 with frozen attention under LoRA)
    attn_out_extra = cc * spec.q_dim if (layer.attention_output_copied or not attn_grad) else 0
    targets = {lin for lin in target_linears(setup)} if setup.lora else set()
    shared: set[str] = set()
    for lin, src in zip(block_linears(spec), linear_sources(spec), strict=True):
        if attention_side and src != "norm_attn":
            continue
        src_fp32 = src.startswith("norm") and r == 4
        if full:
            if autocast and dtype_bytes(setup)[0] == 4:
                fixed += 2 * lin.d_in * lin.d_out  # autocast's bf16 weight copy, saved
                if src_fp32 and autocast:
                    per_tok += 2 * lin.d_in  # bf16 cast of the fp32 input, per linear
                elif src not in shared and src in ("mlp_act", "norm_attn", "norm_mlp"):
                    per_tok += cc * lin.d_in
                    shared.add(src)
                elif src == "attn_out":
                    per_tok += attn_out_extra  # a 16-bit input: autocast's cast is a no-op
            elif src not in shared:
                per_tok += attn_out_extra if src == "attn_out" else c * lin.d_in  # one input, shared
                shared.add(src)
        else:
            if autocast and setup.quantization == "none" and dtype_bytes(setup)[0] == 4:
                fixed += 2 * lin.d_in * lin.d_out  # frozen fp32 base: bf16 copy for grad input
            if lin in targets:
                # no mask where x needs no gradient (layer 0 upstream of every adapter)
                per_tok += _lora_dropout_bytes(setup, lin.d_in, autocast, mask=grad_of[src])
                if autocast:
                    per_tok += 2 * lin.d_in + 2 * setup.lora_r  # peft casts x; lora_A output
                    fixed += 2 * setup.lora_r * (lin.d_in + lin.d_out)  # bf16 adapter copies
                else:
                    if not setup.lora_dropout and src not in shared:
                        # lora_A saves x (shared by the adapters reading it)
                        per_tok += attn_out_extra if src == "attn_out" else c * lin.d_in
                        shared.add(src)
                    per_tok += c * setup.lora_r
    attention = eager_bytes(setup) + _attention_dropout_bytes(setup) if attn_grad else 0
    if first and attn_grad and not _first_layer_value_grad(traced or setup):
        attention -= _eager_copy_bytes(setup)
    if first and attn_grad and not _first_layer_scores_grad(traced or setup) and _eager_copy_bytes(setup):
        attention -= 4 * spec.num_heads * setup.seq_len**2 * setup.micro_batch_size
    return t * per_tok + fixed + attention


def _first_layer_value_grad(setup: RunSetup) -> bool:
    """Whether layer 0's v needs a gradient: under LoRA only when v_proj (or a fused qkv) is
    adapted, nothing upstream of it being trainable (other layouts: assumed, as _first_layer_grads).

    OLMo-2's post-norm block too (LayerSpec.norm_after; modeling_olmo2.py Olmo2DecoderLayer:
    ``self_attn(hidden_states)`` on the layer's input itself, its norms after the attention and
    the MLP): layer 0's v_proj reads the frozen embedding output with no norm between. Measured
    with the live-bytes tracker: held-out tiled seed 48 (OLMo-2 LoRA on q/k/o/gate/down_proj,
    bf16-mixed, eager, b1 s512, no checkpointing) peaked at the last layer's softmax backward
    with layer 0's fp32 probabilities alive and no 16-bit copy of them, 11.15% under its plan
    with that copy counted."""
    return not _layer_zero_traced(setup) or _adapted(setup, ("v_proj", "qkv_proj"))


def _mlp_out_adapted(setup: RunSetup) -> bool:
    """Whether the MLP's output projection (down_proj, reading the activation) has an adapter."""
    names = {lin.name for lin in target_linears(setup)}
    return any(lin.name in names for lin, src in zip(block_linears(setup.model), linear_sources(setup.model),
                                                     strict=True) if src == "mlp_act")


def _first_layer_scores_grad(setup: RunSetup) -> bool:
    """Whether layer 0's attention scores need a gradient: under LoRA only when q_proj or k_proj
    (or a fused qkv) is adapted (other layouts: assumed, as _first_layer_grads). Without it eager
    attention's fp32 softmax saves no output (its input needs no gradient); the 16-bit copy the
    matmul with v saves for v's gradient stays (in fp32 that matmul saves the softmax output
    itself: eager_bytes' one s x s term). Measured with the live-bytes tracker: held-out seed
    1729 (Llama LoRA on v/o/down_proj, bf16-mixed, eager, b2 s256, no checkpointing) peaked at
    the loss's backward with one fp32 (2, 4, 256, 256) softmax output alive, layer 1's, and both
    layers' bf16 copies, 10.8% under its plan with layer 0's counted."""
    return not _layer_zero_traced(setup) or _adapted(setup, ("q_proj", "k_proj", "qkv_proj"))


def _layer_zero_traced(setup: RunSetup) -> bool:
    """Whether the layer-0 rules trace which of its tensors need a gradient: under LoRA, in a
    standard pre-norm gated block or OLMo-2's post-norm one; elsewhere every tensor is assumed to
    (over, never under)."""
    layer = describe_layer(setup.model)
    return setup.lora and (layer.standard_block or _post_norm_block(layer))


def _adapted(setup: RunSetup, names: tuple[str, ...]) -> bool:
    """Whether any of the Linears ``names`` has an adapter."""
    return any(lin.name in names for lin in target_linears(setup))


def _post_norm_block(layer) -> bool:
    """OLMo-2's layout: a gated block with its two norms on the attention's and the MLP's
    outputs, none before (LayerSpec.norm_after), attention and MLP in sequence."""
    return layer.norm_after and layer.norms == 2 and not layer.parallel_attn and layer.mlp == "gated"


def _eager_copy_bytes(setup: RunSetup) -> int:
    """The 16-bit copy of eager attention's probabilities, which the matmul with v saves only for
    v's gradient (0 in fp32, where it saves the softmax output itself; 0 for gpt-oss). Layer 0
    under LoRA with v frozen keeps none (measured: held-out seed 1397, Qwen2 QLoRA on k_proj and
    down_proj, bf16-mixed, eager, 512 tokens, 12.0% under its plan with it)."""
    if setup.attention != "eager" or describe_layer(setup.model).attention == "sinks":
        return 0
    _, c, autocast = dtypes(setup)
    cc = 2 if autocast else c
    return 0 if cc == 4 else cc * setup.model.num_heads * setup.seq_len**2 * setup.micro_batch_size


def lora_dropout_layer_bytes(setup: RunSetup) -> tuple[int, int]:
    """(bytes, widest d_in): what lora.dropout adds to one decoder layer's saved tensors
    (_lora_dropout_bytes over its adapted Linears), and the widest adapted input."""
    if not setup.lora or not setup.lora_dropout or describe_layer(setup.model).experts != "none":
        return 0, 0
    _, _, autocast = dtypes(setup)
    t = setup.micro_batch_size * setup.seq_len
    lins = target_linears(setup)
    return (t * sum(_lora_dropout_bytes(setup, lin.d_in, autocast) for lin in lins),
            max((lin.d_in for lin in lins), default=0))


def _lora_dropout_bytes(setup: RunSetup, d_in: int, autocast: bool, mask: bool = True) -> int:
    """Per token, what lora.dropout > 0 adds to one adapted Linear (peft ``lora.Linear.forward``:
    ``lora_B(lora_A(dropout(x)))`` on x cast to the fp32 adapter dtype; each adapter has its own
    dropout module, so nothing is shared between q, k and v). The dropout keeps its mask: bool
    from CUDA's fused kernel (``native_dropout``), on a CPU a noise tensor of x's dtype (ATen
    ``_dropout``: ``x * noise``, noise saved). Without autocast lora_A saves the dropped fp32
    input itself (instead of x, which several adapters share); under autocast it saves its
    16-bit cast, counted with the adapter either way. No mask where x needs no gradient (the
    first layer's q/k/v under LoRA: autograd records no dropout node). Measured: tests/plan/test_accuracy.py
    dropout cases (a new user's recipe with dropout 0.05 was 40% above the plan before this)."""
    if not setup.lora_dropout:
        return 0
    mask_bytes = (1 if setup.device == "cuda" else 4) if mask else 0
    return d_in * (mask_bytes + (0 if autocast else 4))


def qk_norm_activation_bytes(setup: RunSetup) -> int:
    """Per token: q_norm and k_norm (RMSNorm, Qwen3 / OLMo-2 / OLMoE) save their fp32 upcast and
    rsqrt, and with trainable weights the normalized input, like the block's norms."""
    spec = setup.model
    if not spec.qk_norm:
        return 0
    r, _, _ = dtypes(setup)
    width = spec.q_dim + spec.kv_dim
    rows = spec.num_heads + spec.num_kv_heads if spec.qk_norm == "head" else 2
    return 4 * width + 4 * rows + (normed_bytes(setup) * width if not setup.lora else 0)


def normed_bytes(setup: RunSetup) -> int:
    """Bytes per element of the normalized x an RMSNorm with a trainable weight saves: the residual
    dtype where the weight multiplies the cast-back x (LlamaRMSNorm), fp32 where it multiplies
    the fp32 x (Gemma3RMSNorm, Olmo2RMSNorm; measured with saved_tensors_hooks)."""
    return 4 if describe_layer(setup.model).norm_weight_fp32 else dtypes(setup)[0]


def _norm_weight_fixed_bytes(setup: RunSetup) -> int:
    """Gemma3RMSNorm saves its fp32 (1 + weight) for the input gradient, trainable or frozen: 4
    bytes per weight element of one layer's norms and q/k norms (measured with
    saved_tensors_hooks)."""
    spec = setup.model
    if not describe_layer(spec).norm_saves_fp32_weight:
        return 0
    return 4 * (describe_layer(spec).norms * spec.hidden_size + 2 * spec.head_dim)


def _moe_layer_activation_bytes(setup: RunSetup, first: bool) -> int:
    """An MoE layer: its Linears as a dense block (attention, a shared expert) plus the router and
    routed experts (lowvram.plan.model.moe.routed_activation_bytes)."""
    spec = setup.model
    dense = layer_activation_bytes(replace(setup, model=dense_view(spec)), first)
    w, c = dtype_bytes(setup)
    _, _, autocast = dtypes(setup)
    cc = 2 if autocast else c
    # the router reads the MLP norm's output, which a trainable shared-expert Linear saves already
    shared_saves = bool(spec.shared_expert_intermediate_size) and (
        not setup.lora or any(lin.name in ("gate_proj", "up_proj") for lin in target_linears(setup)))
    t = setup.micro_batch_size * setup.seq_len
    if describe_layer(spec).experts == "routed_biased":  # gpt-oss: its own router, biased experts, clamped SwiGLU
        return dense + moe.sink_routed_bytes(spec, t, w, cc, w, autocast, setup.lora)
    # transformers' grouped_mm is not autocast-enabled (integrations/moe.py casts the input to
    # the weights' dtype): the routed experts compute in the stored dtype, fp32 under *-mixed;
    # the router is an autocast linear (its saved input is the 16-bit copy).
    return dense + moe.routed_activation_bytes(spec, t, w, w, autocast, setup.lora, setup.lora_r,
                                               setup.lora_targets, shared_saves, router_c=cc)


def moe_layer_after_experts_bytes(setup: RunSetup) -> int:
    """What an MoE layer (routed experts without biases) still saves once the backward has left
    its routed experts: the dense block (attention, norms, a shared expert) and the router's share
    (moe.router_activation_bytes), its input included when no shared-expert Linear saved it (as in
    :func:`_moe_layer_activation_bytes`). LOMO steps the fused experts there (plan/memory/memory.py)."""
    spec = setup.model
    dense = layer_activation_bytes(replace(setup, model=dense_view(spec)))
    _, c = dtype_bytes(setup)
    _, _, autocast = dtypes(setup)
    shared_saves = bool(spec.shared_expert_intermediate_size) and (
        not setup.lora or any(lin.name in ("gate_proj", "up_proj") for lin in target_linears(setup)))
    t = setup.micro_batch_size * setup.seq_len
    router_grad = not setup.lora or any(a.name == "router" for a in moe.expert_adapters(
        spec, setup.lora_r, setup.lora_targets))
    return dense + moe.router_activation_bytes(spec, t, 2 if autocast else c, router_grad and not shared_saves)


def _attention_dropout_bytes(setup: RunSetup) -> int:
    """Attention dropout under SDPA: CUDA's flash and memory-efficient kernels drop inside the
    kernel (a random seed is saved, nothing s x s); on a CPU SDPA falls back to its math path
    and keeps the probabilities, the dropout noise and the dropped probabilities in fp32:
    constants.CPU_ATTENTION_DROPOUT_BYTES x a*s^2*b (measured with the simulated step, GPT-2)."""
    spec = setup.model
    if not spec.attn_dropout or setup.attention != "sdpa" or setup.device == "cuda":
        return 0
    return fitted.CPU_ATTENTION_DROPOUT_BYTES.of(spec.num_heads * setup.seq_len**2 * setup.micro_batch_size)


def eager_bytes(setup: RunSetup) -> int:
    """Eager attention stores the s x s scores: softmax in fp32 (saved) and its 16-bit copy
    (saved by the matmul with v): (4 + c)*a*s^2*b (Korthikanti et al. 2022 sec. 4.1, with
    transformers' fp32 softmax upcast). In fp32 the cast back is a no-op: the matmul saves the
    softmax output itself, 4*a*s^2*b (a plain fp32 LoRA run was 17% under its plan with 8)."""
    if setup.attention != "eager":
        return 0
    _, c, autocast = dtypes(setup)
    cc = 2 if autocast else c
    if describe_layer(setup.model).attention == "sinks":  # gpt-oss: its own eager path (lowvram.plan.model.moe)
        return moe.sink_eager_bytes(setup.model, setup.micro_batch_size, setup.seq_len, cc,
                                    dtype_bytes(setup)[0])
    return 4 * setup.model.num_heads * setup.seq_len**2 * setup.micro_batch_size + _eager_copy_bytes(setup)


def head_activation_bytes(setup: RunSetup) -> int:
    """Final norm, lm_head input, rotary cos/sin, labels (not the logits: logits_bytes)."""
    spec = setup.model
    r, c, autocast = dtypes(setup)
    t = setup.micro_batch_size * setup.seq_len
    h = spec.hidden_size
    full = not setup.lora
    per_tok = 4 * h + 4 + (normed_bytes(setup) * h if full else 0) + 8  # final norm; int64 labels
    # rotary cos and sin, shared by all layers (of a type: Gemma-3 has two tables)
    per_tok += 2 * spec.head_dim * (4 if spec.rotary_fp32 else r) * spec.rotary_tables
    if spec.embd_dropout and full:  # its mask (as above); LoRA: no gradient flows there
        per_tok += h * (1 if setup.device == "cuda" else r)
    if full:
        per_tok += 2 * h if (autocast and r == 4) else c * h
    fixed = 0
    w = dtype_bytes(setup)[0]
    head_fp32 = w == 4 or (setup.quantization != "none" and setup.kbit_prepare)
    if autocast and head_fp32:
        fixed += 2 * spec.vocab_size * h  # autocast's bf16 copy of lm_head, saved for backward
    return t * per_tok + fixed


def activation_bytes(setup: RunSetup) -> int:
    """All layers' saved activations at the start of backward.

    Gradient checkpointing (Chen et al. 2016; transformers checkpoints each decoder layer,
    use_reentrant=False): each layer keeps only its input (r*t*h); at the peak one layer is
    recomputed (its saved tensors alive again).
    """
    spec = setup.model
    r, _, _ = dtypes(setup)
    t = setup.micro_batch_size * setup.seq_len
    head = head_activation_bytes(setup)
    if setup.gradient_checkpointing:
        kept = 0 if activation_offloaded(setup) else spec.num_layers  # offloaded: in host RAM
        return (kept * r * t * spec.hidden_size + head + _checkpointed_mask_bytes(setup)
                + eager_mask_bytes(setup))
    # layer 0 (sliding in Gemma-3, masked with packing) saves no mask when its attention makes no
    # gradient (LoRA with no adapter upstream of it: _first_layer_grads; measured: a 2-layer
    # OLMo-2 LoRA on o_proj, packed, held one of its two layers' masks)
    masks = masked_layers(setup)
    if masks and not _first_layer_grads(setup)[0]:
        masks -= 1
    return (layer_activation_bytes(setup, first=True)
            + (spec.num_layers - 1) * layer_activation_bytes(setup) + head
            + masks * masked_attention_bytes(setup))


__all__ = [
    "activation_bytes", "activation_offload_host_bytes", "activation_offloaded", "dtypes",
    "linear_sources", "mlp_elementwise_bytes", "qk_norm_activation_bytes",
    "eager_bytes", "head_activation_bytes", "layer_activation_bytes", "lora_dropout_layer_bytes",
    "masked_attention_bytes", "masked_layers", "recomputed_mask_bytes", "moe_layer_after_experts_bytes", "normed_bytes",
    "offloaded_layer_input_bytes",
]
