"""One decoder layer's no-grad forward inside transformers' ``generate`` (grpo/rloo's generation
phase, lowvram.plan.memory.grpo.generation_moments): what is alive at its highest point, beside
the KV cache, in the weights' dtype (TRL 1.16 GRPOTrainer._generate_single_turn runs generate
under ``torch.no_grad`` without autocast, with the model in training mode: LoRA dropout is on).

Read from the code that allocates it (transformers 5 modeling_llama.py / modeling_gemma3.py /
modeling_olmo2.py / modeling_phi3.py, peft 0.21 tuners/lora/layer.py Linear.forward, bitsandbytes
0.50 backends/default/ops.py gemm_4bit) and checked with the live-bytes tracker inside generate
(bench/plan_fuzz.py --grpo --grpo-generation: the prefill of in-sample seed 150, Gemma-3 LoRA
bf16, 27.85 MB measured against 25.2 MB counted before this module: the embeddings, the layer's
input and the rotary tables were not counted).

- **Held by the model's forward** through every layer: the embeddings (``inputs_embeds``, the
  model forward's local), the layer's input (the loop's ``hidden_states``, until the layer
  returns), the residual after attention and the MLP's normed input (none in OLMo-2's post-norm
  block); the rotary cos/sin of each layer type (``position_embeddings``; fp32 in OLMo-2); the
  attention mask of each layer type (rows x tokens x cached: bool in SDPA, the weights' dtype in
  eager), and eager attention's probabilities (the decoder layer's ``_`` until it returns).
- **Attention side**: q, k, v and their rotated copies, keys and values repeated to every query
  head (``repeat_kv``; never with a padding mask in SDPA), eager's scores and fp32 softmax; a LoRA
  adapter on q_proj (the widest) adds its transients (below).
- **MLP side** (gated): ``down(act(gate(x)) * up(x))`` holds act, up and their product; under
  LoRA the adapted Linear's fp32 path: peft casts its input to the adapters' fp32
  (``_cast_input_dtype``, a copy in 16-bit), lora_B's output and its scaled copy beside the base
  output (``result + lora_B(lora_A(dropout(x))) * scaling``), and with dropout on, the dropout's
  noise and output at down_proj (the widest input). Phi-3's fused gate_up output is twice as wide.
- **Autocast** (full fine-tuning in a *-mixed precision, :func:`generation_dtypes`): the 16-bit
  copies of the block weights autocast caches through the forward (:func:`autocast_cache_bytes`).
- **A 4-bit base** dequantizes each weight whole in the compute dtype for its matmul
  (backward.dequantized_weight_bytes), beside that Linear's input and output.
"""

from __future__ import annotations

from lowvram.plan import constants as fitted
from lowvram.plan.memory.activations import linear_sources
from lowvram.plan.memory.backward import dequantized_weight_bytes
from lowvram.plan.memory.states import dtype_bytes, target_linears
from lowvram.plan.model.layer import describe_layer
from lowvram.plan.model.models import block_linears
from lowvram.plan.setup import RunSetup

_ADAPTER = fitted.GENERATION_ADAPTER_OUT_BYTES.value  # lora_B's fp32 output and its scaled copy, per element


def generation_dtypes(setup: RunSetup) -> tuple[int, int, int, int]:
    """(residual stream, compute, keys, values): bytes per element in generate. Under LoRA or
    QLoRA, peft's ``generate`` calls the base model's own forward, outside the autocast wrapper
    accelerate put on the PeftModel's: everything in the weights' dtype (measured: in-sample
    seed 153, SmolLM3 LoRA bf16-mixed, an fp32 cache). Full fine-tuning in a *-mixed precision:
    TRL unwraps the model with accelerate's ``unwrap_model`` (keep_fp32_wrapper=True), whose
    forward keeps accelerate's autocast: Linears in the 16-bit compute dtype, the residual stream
    in the fp32 weights' dtype, values 16-bit, keys fp32 where the rotary embedding promotes them
    (cos/sin in the stream's fp32: modeling_llama.py apply_rotary_pos_emb), 16-bit where it casts
    them back (OLMo-2's ``.to(q_type)``); measured: in-sample seed 165, Llama full bf16-mixed,
    an fp32 key and a bf16 value cache."""
    w, c = dtype_bytes(setup)
    if setup.lora or w == c:
        return w, w, w, w
    return w, c, (c if setup.model.rotary_fp32 else w), c


def _adapted(setup: RunSetup) -> set[str]:
    return {lin.name for lin in target_linears(setup)} if setup.lora else set()


def held_bytes(setup: RunSetup, rows: int, tokens: int, cached: int) -> int:
    """What the model's forward keeps through a layer of rows x tokens: the embeddings, the
    layer's input, the residual after attention, the MLP's normed input; the rotary tables; the
    attention masks."""
    m = setup.model
    layer = describe_layer(m)
    r, w, _, _ = generation_dtypes(setup)
    t = rows * tokens
    stream = (3 if layer.norm_after else 4) * r * t * m.hidden_size
    rot = max(2, int(m.head_dim * m.partial_rotary_factor) // 2 * 2)
    rotary = 0 if m.learned_positions else 2 * t * rot * (4 if m.rotary_fp32 else r) * m.rotary_tables
    # SDPA's mask is bool, eager's additive in the weights' dtype
    masks = rows * tokens * cached * layer.attention_types * (w if setup.attention == "eager" else 1)
    return stream + rotary + masks + autocast_cache_bytes(setup)


def autocast_cache_bytes(setup: RunSetup) -> int:
    """Full fine-tuning under autocast with fp32 weights: autocast keeps the 16-bit copy of every
    trainable leaf weight it casts until the forward's autocast exits (aten autocast_mode.cpp
    cached_cast: a leaf that requires grad, whatever the grad mode), so the last layer runs
    beside a 16-bit copy of every block Linear (memory's forward_end_autocast_cache; measured:
    in-sample seed 165, 2.38 MB of such copies at its last token)."""
    r, c, _, _ = generation_dtypes(setup)
    if setup.lora or r == c:
        return 0
    return c * sum(lin.numel for lin in block_linears(setup.model)) * setup.model.num_layers


def _cast_bytes(w: int, t: int, d_in: int) -> int:
    """peft's fp32 copy of an adapted Linear's input (none when the input is fp32 already)."""
    return 4 * t * d_in if w < 4 else 0


def attention_side_bytes(setup: RunSetup, rows: int, tokens: int, cached: int, cache_update: int = 0) -> int:
    """The attention's highest stage (keys and values past the cache update are the cache's):
    q_proj's adapter beside its base output; the rotary embedding (q, q x cos, rotate_half(q) and
    its x sin, k and v before the cache takes them); the attention itself (the rotated q, keys
    and values repeated to every query head, eager's scores and fp32 softmax, the output and its
    token-major copy for o_proj); ``cache_update``: what the layer's cache update holds beside
    the cache (the generate engine's ``torch.cat``: its old keys)."""
    m = setup.model
    w = generation_dtypes(setup)[1]
    t = rows * tokens
    q, kv = m.q_dim, m.kv_dim
    rotary = w * t * (4 * q + 2 * kv)
    repeated = 2 * w * rows * m.num_heads * cached * m.head_dim if m.num_kv_heads < m.num_heads else 0
    core = 3 * w * t * q + repeated
    if setup.attention == "eager":  # the scores and their fp32 softmax
        core += rows * m.num_heads * tokens * cached * (w + 4)
    adapted = _adapted(setup)
    lora = 0
    qs = [lin for lin, src in zip(block_linears(m), linear_sources(m), strict=True)
          if src == "norm_attn" and lin.name in adapted and lin.d_out >= q]
    if qs:  # q_proj's (or Phi-3's qkv_proj's) adapter: its base output, input copy, lora_B and scale
        d = max(lin.d_out for lin in qs)
        lora = w * t * d + _cast_bytes(w, t, m.hidden_size) + _ADAPTER * t * d
    return max(rotary, core, lora, cache_update)


def mlp_side_bytes(setup: RunSetup, rows: int, tokens: int) -> int:
    m = setup.model
    layer = describe_layer(m)
    w = generation_dtypes(setup)[1]
    t = rows * tokens
    h = m.hidden_size
    width = m.intermediate_size or 4 * h
    adapted = _adapted(setup)
    lins = {lin.name: lin for lin in target_linears(setup)} if adapted else {}
    up_names = [n for n, lin in lins.items() if lin.d_in == h and lin.d_out in (width, 2 * width)]
    down_names = [n for n, lin in lins.items() if lin.d_in == width]
    if layer.fused_gate_up:
        # gate_up's output [t, 2W] (gate and up its views), act(gate), their product
        base = 4 * w * t * width
        up = (2 * w * t * width + _cast_bytes(w, t, h) + _ADAPTER * t * 2 * width) if up_names else 0
    else:
        base = 3 * w * t * width  # act(gate), up, their product
        # at up_proj's adapter: act(gate), up's base output, the fp32 input copy, lora_B and its scale
        up = (2 * w * t * width + _cast_bytes(w, t, h) + _ADAPTER * t * width) if up_names else 0
    down = 0
    if down_names:
        # the product (down's input), its fp32 copy, the base output, then lora_B and its scale
        # or, with dropout, the dropout's noise and output over the input width
        adapter = max(_ADAPTER * t * h, (8 * t * width) if setup.lora_dropout > 0 else 0)
        down = w * t * width + _cast_bytes(w, t, width) + w * t * h + adapter
    quant = 0
    if setup.quantization != "none":  # a 4-bit Linear's weight dequantized for its matmul
        quant = dequantized_weight_bytes(setup) + 2 * w * t * width
    return max(base, up, down, quant)


def layer_bytes(setup: RunSetup, rows: int, tokens: int, cached: int, cache_update: int = 0) -> int:
    """One decoder layer's no-grad forward of rows x tokens attending to ``cached`` positions,
    with what the model's forward holds beside it (the KV cache not included; ``cache_update``:
    attention_side_bytes)."""
    m = setup.model
    # eager attention returns its probabilities, which the decoder layer binds to ``_``
    # (``hidden_states, _ = self.self_attn(...)``) until it returns: alive beside the MLP
    # (SDPA returns None there)
    probabilities = 0
    if setup.attention == "eager":
        probabilities = generation_dtypes(setup)[1] * rows * m.num_heads * tokens * cached
    return held_bytes(setup, rows, tokens, cached) + max(
        attention_side_bytes(setup, rows, tokens, cached, cache_update), mlp_side_bytes(setup, rows, tokens) + probabilities)


__all__ = ["attention_side_bytes", "autocast_cache_bytes", "generation_dtypes", "held_bytes", "layer_bytes", "mlp_side_bytes"]
