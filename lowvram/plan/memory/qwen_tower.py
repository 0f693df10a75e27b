"""The frozen Qwen2.5-VL / Qwen3-VL vision tower's forward (model.visual) at the largest image the
pixel limits allow (plan/model/image_size.py): its working set beyond the weights and the batch's
pixel values. No torch.

Sources (transformers 5.25, modeling_qwen2_5_vl.py / modeling_qwen3_vl.py), read and measured
with the live-bytes tracker on 1-3 layer towers (tests/plan/test_qwen_tower.py):
- the tower runs all the micro-batch's images as one sequence of N patches (n images x P
  patches), its attention split per image (Qwen3-VL, and Qwen2.5-VL's fullatt_block_indexes) or
  per window of window_size px (Qwen2.5-VL's other blocks) by cu_seqlens: SDPA per chunk
  (``attention_interface`` in a list comprehension), the chunks' outputs kept in the list
  until the concatenation and the output projection are done.
- ``get_image_features`` casts the pixel values to the tower's dtype (``pixel_values.type``), a
  copy alive through the whole forward when the tower is 16-bit.
- the rotary position embeddings: cos and sin, N x head_dim, float32 (Qwen2.5-VL: permuted into
  window order, copies), alive through every block; Qwen3-VL also keeps its interpolated learned
  position embeddings (N x h, ``pos_embeds``) beside the hidden states.
- a block's attention side, at its output projection: the block's input (the caller's name), the
  norm's output, qkv (3 N h), q and k after rope (2), the chunks' outputs and their
  concatenation (2), the projection's output: 10 N h (Qwen3-VL: + pos_embeds, 11).
- its MLP side: the input, the residual after attention, the norm's output (3 N h; Qwen3-VL + 1)
  beside Qwen2.5-VL's gated MLP (act(gate), up, their product: 3 N I) or Qwen3-VL's plain one
  (fc1, act: 2 N I).
- Qwen3-VL: each deepstack merger's output (N/4 x h_text), kept for the language model.
- eager attention: a chunk's scores and their softmax (heads x L x L each, the largest chunk L:
  one image's patches; SDPA on the CPU and CUDA materializes none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowvram.plan.model.image_size import patches_per_image

if TYPE_CHECKING:
    from lowvram.plan.setup import RunSetup

# tensors of N x h alive at a block's attention output projection / beside its MLP, per tower
# (the module docstring; measured exactly in fp32 on 1-3 layer towers)
ATTENTION_SIDE = {"qwen2_5_vl": 10, "qwen3_vl": 11}
MLP_SIDE = {"qwen2_5_vl": 3, "qwen3_vl": 4}
MLP_ACTIVATIONS = {"qwen2_5_vl": 3, "qwen3_vl": 2}
# apply_rotary_pos_emb_vision with 16-bit q and k: their float32 copies, q's rotated result, and
# k * cos, rotate_half(k), rotate_half(k) * sin, all N x h float32, at k's last product
ROPE_FLOAT_TENSORS = 6
# bytes per patch of the index tensors alive through the forward: the 2-D position ids (N x 2
# int64); Qwen3-VL adds the position grid's interpolation indices and weights (N x 4 int64, fp32)
INDEX_BYTES = {"qwen2_5_vl": 16, "qwen3_vl": 16 + 32 + 16}


# Qwen2_5_VLVisionConfig defaults: the first full-attention block (fullatt_block_indexes [7, 15,
# 23, 31]) and the window (window_size 112 px); the other blocks attend within a window
QWEN25_FIRST_FULL_BLOCK = 7
QWEN25_WINDOW_PX = 112


def eager_chunk(v, per_image: int) -> int:
    """The longest sequence one attention call sees: an image (Qwen3-VL, Qwen2.5-VL's full
    blocks), or Qwen2.5-VL's window of (window_size / patch)^2 patches when the tower is too
    shallow to reach a full-attention block."""
    if v.tower == "qwen3_vl" or v.num_layers > QWEN25_FIRST_FULL_BLOCK:
        return per_image
    side = QWEN25_WINDOW_PX // v.merge_size // v.patch_size * v.merge_size
    return min(per_image, side * side)


def qwen_tower_forward_bytes(setup: RunSetup, res_bytes: int, lin_bytes: int) -> int:
    """The largest working set of the tower's forward and its merger (module docstring).
    ``res_bytes``: bytes per element of its residual stream and norms (its weights' dtype);
    ``lin_bytes``: of its Linear outputs (16-bit under autocast)."""
    v = setup.model.vision
    n = setup.micro_batch_size * setup.images_per_row
    per_image = patches_per_image(v)
    patches = n * per_image
    h, i = v.hidden_size, v.intermediate_size
    qwen3 = v.tower == "qwen3_vl"
    state = patches * h
    row = v.num_channels * v.temporal_patch_size * v.patch_size ** 2  # a patch's pixel values
    # alive through every block: cos and sin (fp32), the index tensors, a 16-bit tower's cast of
    # the pixels (get_image_features), Qwen3-VL's pos_embeds (fp32: the interpolation weights)
    cast = patches * row * res_bytes if res_bytes != 4 else 0
    pos = state * 4 if qwen3 else 0
    # the patch embedding: under autocast the pixels' and the Conv3d weight's bf16 copies
    # beside its output (the tower's own cast is in ``kept``)
    autocast = res_bytes == 4 and lin_bytes != 4
    embedding = (patches * row + h * row) * lin_bytes * autocast + state * lin_bytes
    if qwen3:  # pos_embed(indices) (N x 4 x h) times the fp32 weights, beside the embedding
        embedding = max(embedding, state * lin_bytes + 4 * state * res_bytes + 4 * state * 4)
    units = 2  # the block's input and its norm's output
    attention = units * state * res_bytes + (ATTENTION_SIDE[v.tower] - units - qwen3) * state * lin_bytes
    if lin_bytes != 4:  # 16-bit q, k: the rope's float32 working copies
        attention = max(attention, units * state * res_bytes + 3 * state * lin_bytes + ROPE_FLOAT_TENSORS * state * 4)
    if setup.attention == "eager":  # a chunk's scores and softmax, before its output and the projection's
        chunk = eager_chunk(v, per_image)
        attention = max(attention, attention - 3 * state * lin_bytes + 2 * v.num_heads * chunk ** 2 * 4)
    mlp = (MLP_SIDE[v.tower] - qwen3) * state * res_bytes + MLP_ACTIVATIONS[v.tower] * patches * i * lin_bytes
    deepstack = v.deepstack_mergers * (patches // v.merge_size ** 2) * v.text_hidden_size * lin_bytes
    # the merger's first Linear (h m^2 wide, on N / m^2 rows: N x h elements): the last hidden
    # state, its norm's output and the Linear's output; under autocast also their bf16 input
    # and the weight's bf16 copy (frozen weights are cast per call: autocast caches only leaves
    # that require grad)
    wide = h * v.merge_size ** 2
    merger = 2 * state * res_bytes + state * lin_bytes + autocast * (state * 2 + wide * wide * 2)
    index = INDEX_BYTES[v.tower] * patches + cast
    rotary = 2 * patches * (h // v.num_heads) * 4
    return index + max(embedding, rotary + pos + deepstack + max(attention, mlp, merger))
