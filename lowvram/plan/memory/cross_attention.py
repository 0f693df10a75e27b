"""Llama-3.2-Vision (mllama) with images: its cross-attention layers run and train, its tiles go
through the vision tower, and the language model attends to them through those layers. No torch.

Sources (transformers 5, modeling_mllama.py / processing_mllama.py / image_processing_mllama.py):
- MllamaImageProcessor cuts an image into at most max_image_tiles tiles of image_size and pads
  every image to max_image_tiles tiles (pack_images): pixel_values are float32
  b x images x T x 3 x side x side whatever the image's size, T = the tower's max_num_tiles (the
  tile embeddings are sized for it: a checkpoint has no smaller tile count to plan).
- MllamaVisionModel runs every tile: P + 1 positions (the patches and a class token) padded to a
  multiple of 8, its local encoder over an image's T tiles at once (an aspect-ratio attention
  mask b x 1 x T(P+1) x T(P+1) in the tower's dtype), every hidden state kept for the
  intermediate layers the projector reads, then the gated global encoder; the projector gives
  ``cross_attention_states`` b x V x h_text with V = images x T x (P + 1) (MllamaModel.forward).
- MllamaModel._prepare_cross_attention_mask repeats the collator's b x s x images x T mask
  (int64, lowvram.train.data.images.ImageCollator) over the P + 1 positions: b x 1 x s x V in
  the model's dtype, alive through the step beside cross_attention_states (saved by every cross
  layer's k/v projections and SDPA).
- MllamaCrossAttentionDecoderLayer has a self-attention layer's Linears (q/k/v/o and the MLP:
  lowvram trains them with images, lowvram.train.build.vision.frozen_modules), so the planner
  counts each as one more decoder layer (its weights, gradients, optimizer state, adapters,
  checkpoint and a layer's saved activations: active_setup), plus what it saves beside a
  self-attention layer's (cross_layer_extra_bytes). That is derived, not fitted: autograd saves
  a product's operand only for the other operand's gradient (PyTorch derivatives.yaml), and F.linear
  its input for the weight's gradient and its weight for the input's, so what a cross layer
  saves follows from what trains. The source lines (transformers 5.25 modeling_mllama.py, peft
  0.21 tuners/lora/layer.py, transformers integrations/sdpa_attention.py):
  - 711 ``residual + self.cross_attn_attn_gate.tanh() * hidden_states`` and 718 (the MLP's, after
    717 ``full_text_row_masked_out_mask[:, 0] * hidden_states``): the gated tensor is saved for
    the gate's gradient only. Full fine-tuning trains the gates; LoRA freezes them (no adapter on
    a one-element Parameter), so under LoRA neither tanh gate saves anything but its scalar.
  - 441 ``self.q_norm(query_states)`` and 449 ``self.k_norm(key_states)`` (MllamaTextRMSNorm,
    391-394): the float32 upcast and the rsqrt per head where the input needs a gradient, and the
    cast-back output (394 ``self.weight * hidden_states.to(input_dtype)``) where the weight trains.
    q always needs one (the text hidden states do); k only where k_proj trains or is adapted: it
    reads 444 ``self.k_proj(cross_attention_states)``, the frozen projector's output.
  - 444/445 k_proj and v_proj read the vision tokens: their trained weights (or lora_A, peft
    layer.py 1100-1102 ``lora_B(lora_A(dropout(x)))`` on x cast to the fp32 adapter) save
    vision-token inputs, no autocast copy of the weight (the input needs no gradient), and the
    self-attention layer's text-side keys, values and k/v adapter tensors are not there;
    sdpa_attention.py 127/128 ``repeat_kv`` with a mask: keys and values at every head.
  - 1356 ``cross_attention_states = self.multi_modal_projector(...)`` (16-bit under autocast)
    outlives the forward only where a Linear saves it (states_saved), and the prepared mask
    (1369) only where SDPA saves it itself rather than its bf16 copy (late_parts).
  Checked against the live bytes of a real step on tiny configs (tests/plan/
  test_cross_attention_saved.py: each cross layer's saved tensors equal the plan's, LoRA q/v and
  all-linear, full, fp32 / bf16 / bf16-mixed) and the simulated step at full size
  (bench/simulate_full_size.py --images).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from lowvram.plan.memory.states import target_linears

if TYPE_CHECKING:
    from lowvram.plan.setup import RunSetup


def is_active(setup: RunSetup) -> bool:
    """Image data on a model with cross-attention layers (Llama-3.2-Vision)."""
    return bool(setup.images_per_row) and bool(setup.model.cross_attention_layers or setup.cross_layers)


def active_setup(setup: RunSetup) -> RunSetup:
    """The setup with Mllama's cross-attention layers counted as decoder layers of the language
    model (model.num_layers; cross_layers says which of them they are), for image data; the setup
    itself otherwise."""
    spec = setup.model
    if not setup.images_per_row or not spec.cross_attention_layers:
        return setup
    n = len(spec.cross_attention_layers)
    return replace(setup, model=replace(spec, num_layers=spec.num_layers + n, cross_attention_layers=()),
                   cross_layers=spec.cross_attention_layers)


def vision_tokens(setup: RunSetup) -> int:
    """V: the vision tokens a row's text attends to, images x tiles x (patches + class token)."""
    v = setup.model.vision
    return setup.images_per_row * v.max_num_tiles * (v.patches + 1)


def cross_params_left_bytes(setup: RunSetup, w: int) -> int:
    """What the cross-attention layers hold beyond a self-attention layer's parameters (counted
    with the decoder layers): q_norm and k_norm (head_dim each) and the two one-element gates,
    in the weights' dtype (trained; their gradients and optimizer state, a few bytes, not counted)."""
    return len(setup.cross_layers) * (2 * setup.model.head_dim + 2) * w


def step_kept_bytes(setup: RunSetup, w: int) -> int:
    """Alive through the whole step: the collator's int64 cross_attention_mask (b x s x images x
    T) of the step's micro-batches and of the next (images.batches_alive), and
    cross_params_left_bytes."""
    from lowvram.plan.memory.images import batches_alive

    v = setup.model.vision
    collated = batches_alive(setup) * 8 * setup.micro_batch_size * setup.seq_len * setup.images_per_row * v.max_num_tiles
    return collated + cross_params_left_bytes(setup, w)


def late_parts(setup: RunSetup, w: int, autocast: bool) -> tuple[int, int]:
    """(alive until the backward has passed the cross-attention layers, one cross layer's extra
    saved tensors): cross_attention_states (b x V x h_text, the projector's output: 16-bit under
    autocast) with the prepared b x 1 x s x V mask and b x s row mask (the model's dtype ``w``),
    and cross_layer_extra_bytes. Without checkpointing every cross layer keeps its extra until its
    backward; with it one layer's, in its recompute. The first decoder layers run before the first
    cross layer (Llama-3.2-Vision's at index 3), so their backward, the last, sees none of it:
    memory's first-layer moments leave it out, and a moment of its own counts the first cross
    layer's backward (its recompute) with nearly every gradient made."""
    b, s, tokens = setup.micro_batch_size, setup.seq_len, vision_tokens(setup)
    lin = 2 if autocast else w
    states = b * tokens * setup.model.hidden_size * lin if states_saved(setup, autocast) else 0
    # the prepared mask: under autocast over fp32 weights SDPA saves its bf16 copy instead
    # (cross_layer_extra_bytes), and the fp32 mask is freed with the forward, unless a
    # checkpoint keeps it as its layer's input
    mask_saved = setup.gradient_checkpointing or not (autocast and w == 4)
    masks = b * s * (tokens * mask_saved + 1) * w
    return states + masks, cross_layer_extra_bytes(setup, w, autocast)


def states_saved(setup: RunSetup, autocast: bool) -> bool:
    """Whether cross_attention_states itself outlives the forward: a checkpoint keeps its
    layer's inputs; otherwise only a Linear reading it keeps it, to make its weight's gradient:
    k_proj / v_proj trained (full fine-tuning; under autocast the states are 16-bit already, no
    cast), or their adapters' lora_A without autocast or dropout (peft hands x itself to lora_A
    when its dtype is the adapter's). Under LoRA with autocast lora_A saves its own bf16 cast
    (cross_layer_extra_bytes), and with no adapter on k_proj / v_proj nothing reads it for a
    gradient: it is freed when the forward ends."""
    if setup.gradient_checkpointing or not setup.lora:
        return True
    adapted = {x.name for x in target_linears(setup)}
    return not autocast and not setup.lora_dropout and bool(adapted & {"k_proj", "v_proj"})


def cross_layer_extra_bytes(setup: RunSetup, res: int, autocast: bool) -> int:
    """One cross-attention layer's saved tensors beyond a self-attention layer's, in the same
    run: what autograd saves follows from which operands need a gradient (PyTorch saves a
    product's operand only for the other operand's gradient), so it depends on what trains
    (the source lines: the module docstring).

    Per text token: q_norm's float32 input and rsqrt per head, and its cast-back output where its
    weight trains (full fine-tuning); the two tanh gates save the tensor they scale only where
    the gate trains (full fine-tuning: LoRA freezes them and gives them no adapter); the row mask
    saved by its product; less what the self-attention layer saves there that the cross layer
    saves over the vision tokens instead: SDPA's keys and values, and k_proj's / v_proj's
    trained paths (full fine-tuning under autocast over fp32 weights: their bf16 input casts;
    LoRA: each targeted adapter's cast input, lora_A output and dropout). Per vision token:
    SDPA's keys and values (every head's, repeated by repeat_kv with a mask, unless one kv
    head); k_norm's float32 input and rsqrt where k needs a gradient (k_proj trained or
    adapted), its output where its weight trains; the k/v adapters' saved tensors; under
    autocast over fp32 weights SDPA's bf16 copy of the fp32 mask (per text token too)."""
    from lowvram.plan.memory.activations import _lora_dropout_bytes

    spec = setup.model
    b, s, h, heads = setup.micro_batch_size, setup.seq_len, spec.hidden_size, spec.num_heads
    kv_heads, q, kv = spec.num_kv_heads, spec.q_dim, spec.kv_dim
    lin = 2 if autocast else res  # matmul outputs
    full = not setup.lora
    adapted = {x.name for x in target_linears(setup)} if setup.lora else set()
    kv_adapters = len(adapted & {"k_proj", "v_proj"})
    r = setup.lora_r
    # text side: q_norm (fp32 input, rsqrt per head, trained weight: its cast-back output)
    text = 4 * q + 4 * heads + (lin * q if full else 0)
    if full:  # the gates' products save the attention output and the row-masked MLP output
        text += lin * h + res * h
    text -= lin * 2 * kv  # the self-attention's SDPA keys and values over the text
    if full and autocast and res == 4:
        text -= 2 * 2 * h  # its k_proj / v_proj bf16 casts of the fp32 normed input
    # the self-attention's k/v adapters over the text (activations.layer_activation_bytes' terms)
    per_adapter = _lora_dropout_bytes(setup, h, autocast) + (2 * h + 2 * r if autocast else lin * r)
    text -= kv_adapters * per_adapter
    if setup.lora and not autocast and not setup.lora_dropout and kv_adapters and "q_proj" not in adapted:
        text -= lin * h  # lora_A's shared x: the cross layer's q_proj, unadapted, saves none
    # vision side
    width = spec.head_dim if kv_heads == 1 else heads * spec.head_dim  # repeat_kv with a mask
    vision = 2 * width * lin
    if full or "k_proj" in adapted:  # k_norm on a k that needs a gradient
        vision += 4 * kv + 4 * kv_heads + (lin * kv if full else 0)
    vision += kv_adapters * (_lora_dropout_bytes(setup, h, autocast, mask=False)
                             + (2 * h + 2 * r if autocast else lin * r))
    if autocast and res == 4:
        vision += 2 * s  # SDPA's bf16 copy of the fp32 b x 1 x s x V mask
    # per layer: F.linear saves its weight only for its input's gradient, and the vision tokens
    # need none: no autocast bf16 copy of k_proj's / v_proj's fp32 weights, nor of their lora_A's
    fixed = 0
    if autocast and res == 4 and setup.quantization == "none":
        fixed -= 2 * 2 * h * kv
    if autocast and setup.lora:
        fixed -= kv_adapters * 2 * r * h
    return int(b * s * text + b * vision_tokens(setup) * vision + fixed)


def tower_forward_bytes(setup: RunSetup, res: int, lin: int) -> int:
    """The frozen MllamaVisionModel's largest working set (module docstring): the aspect-ratio
    mask, the local encoder's hidden states (all kept, layers + 1) and its last layer's
    temporaries (the attention side's six n x L x h tensors, the MLP's gelu over the
    intermediate width, images.ATTENTION_SIDE_TENSORS / ACTIVATION_TENSORS of SigLIP's layer,
    which Mllama's matches), then the concatenated output (vision_output_dim wide) beside the
    projector's output."""
    from lowvram.plan.memory.images import (
        ACTIVATION_TENSORS,
        ATTENTION_SIDE_TENSORS,
        MLP_SIDE_TENSORS,
    )

    v = setup.model.vision
    n = setup.micro_batch_size * setup.images_per_row
    positions = -(-(v.patches + 1) // 8) * 8  # padded to a multiple of 8
    length = v.max_num_tiles * positions
    state = n * length * v.hidden_size
    mask = n * length * length * res
    attention = state * res + (ATTENTION_SIDE_TENSORS["siglip"] - 1) * state * lin
    mlp = MLP_SIDE_TENSORS * state * res + ACTIVATION_TENSORS["siglip"] * n * length * v.intermediate_size * lin
    encoder = mask + (v.num_layers + 1) * state * res + max(attention, mlp)
    output = n * length * v.output_dim * res * 2 + n * v.max_num_tiles * (v.patches + 1) * setup.model.hidden_size * lin
    return max(encoder, output + mask)
