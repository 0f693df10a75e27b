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
  checkpoint and a layer's saved activations: active_setup), plus what differs from a
  self-attention layer: its q/k RMSNorms over a head (q_norm, k_norm), its two tanh gates (each
  saves the tensor it scales), no rotary, and keys and values over the V vision tokens (k_norm's
  input, float32 statistics and output; SDPA's keys and values, repeated to every head by
  repeat_kv with a mask unless one kv head; under autocast bf16 copies of
  cross_attention_states and of the mask). cross_layer_extra_bytes counts them, per text token
  and per vision token, from the saved tensors of one MllamaCrossAttentionDecoderLayer against one
  MllamaSelfAttentionDecoderLayer (torch.autograd.graph.saved_tensors_hooks, four shapes of
  h, heads and kv heads, fp32 / bf16 / bf16 autocast: bench/mllama_cross_layer.py; exact at
  those shapes; the per-text-token term is the fitted constants.CROSS_LAYER_TEXT_TOKEN).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from lowvram.plan import constants as fitted

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
    states = b * tokens * setup.model.hidden_size * lin + b * s * (tokens + 1) * w
    return states, cross_layer_extra_bytes(setup, w, autocast)


def cross_layer_extra_bytes(setup: RunSetup, res: int, autocast: bool) -> int:
    """One cross-attention layer's saved tensors beyond a self-attention layer's (module
    docstring): per text token constants.CROSS_LAYER_TEXT_TOKEN's bytes per hidden element
    less the self-attention's keys and values (per kv element), plus per-head statistics; per
    vision token k_norm's float32 input and statistics and its output, SDPA's keys and values
    (every head's, unless one kv head), and under autocast three bf16 copies of
    cross_attention_states and the mask's bf16 copy."""
    spec = setup.model
    b, s, h, heads = setup.micro_batch_size, setup.seq_len, spec.hidden_size, spec.num_heads
    kv_heads = spec.num_kv_heads
    kv = kv_heads * spec.head_dim
    mode = "autocast" if autocast else ("fp32" if res == 4 else "bf16")
    per_h, per_kv, per_head = fitted.layers.CROSS_LAYER_TEXT_BYTES[mode]  # constants CROSS_LAYER_TEXT_TOKEN
    text = b * s * (per_h * h - per_kv * kv + per_head * heads)
    width = spec.head_dim if kv_heads == 1 else heads * spec.head_dim  # repeat_kv with a mask
    lin = 2 if autocast else res
    per_vision = 4 * kv + 4 * kv_heads + 2 * width * lin
    if autocast:
        per_vision += 3 * h * 2 + s * 2
    else:
        per_vision += kv * res
    return int(text + b * vision_tokens(setup) * per_vision)


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
