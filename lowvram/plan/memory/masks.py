"""The attention masks a decoder layer saves or keeps: SDPA's b x 1 x s x s mask with packed
samples, padded rows, Gemma-3's images or sliding windows (which layers get one, what it adds to a
layer's saved tensors, in the recomputed layer and across checkpoints), and eager attention's
additive masks under checkpointing. Symbols as in :mod:`lowvram.plan.memory.memory`."""

from __future__ import annotations

from lowvram.plan.memory.images import bidirectional_image_masks
from lowvram.plan.memory.states import dtypes
from lowvram.plan.model.layer import describe_layer
from lowvram.plan.setup import RunSetup


def _per_row_masks(setup: RunSetup) -> bool:
    """SDPA gets a b x 1 x s x s mask in every layer: packed samples, padded rows with their
    attention_mask, or Gemma-3's image masks (plan/memory/images.py)."""
    return setup.packing or setup.padded or bidirectional_image_masks(setup)


def masked_layers(setup: RunSetup) -> int:
    """How many decoder layers call SDPA with an attention mask (0 without SDPA: eager attention
    adds its mask to the scores and saves none of it; flash-attention reads packed samples from
    the varlen kwargs the collator sends, no mask: collate.flash_varlen_kwargs).

    With data.packing, each seq_len window holds several samples and their position_ids restart
    at 0 (lowvram.train.data.collate.pack): transformers builds a block-diagonal b x 1 x s x s mask
    (masking_utils find_packed_sequence_indices) for every layer. Padded rows with their
    attention_mask (``setup.padded``: TRL's preference collators pad chosen and rejected to the
    batch's longest row) get one in every layer too: sdpa_mask ANDs the padding mask into the
    causal one (padding_mask_function) and skips the mask only when no position is padded
    (_ignore_causal_mask_sdpa: ``padding_mask is None or fast_all(padding_mask)``), which the
    planner does not take (a chosen and a rejected of one length each, over a whole batch, is rare;
    a batch without padding is below the plan). Without packing or padding lowvram's collator
    sends no attention_mask (PadCollator), so only Gemma-3's sliding-window layers get one, from
    seq_len >= sliding_window on (masking_utils _ignore_causal_mask_sdpa skips it below the
    window). The planner takes packed windows to hold more than one sample (what packing is for);
    a window of one sample gets no mask, which is below the plan."""
    if setup.attention != "sdpa":
        return 0
    spec = setup.model
    if _per_row_masks(setup):
        return spec.num_layers
    if spec.sliding_layers and setup.seq_len >= spec.sliding_window:
        return spec.sliding_layers
    return 0


def masked_attention_bytes(setup: RunSetup) -> int:
    """What one decoder layer whose SDPA gets a mask (masked_layers) saves beyond one without:
    with a mask sdpa_attention_forward expands k and v to all heads (use_gqa_in_sdpa: only
    without a mask), and SDPA saves the additive mask it makes from the bool one
    (convert_boolean_attn_mask: b x 1 x s x s in the query's dtype). Measured with
    saved_tensors_hooks on a 2-layer Gemma-3 (q, expanded k and v, out, mask), and with the
    live-bytes tracker in lowvram train on packed data: a 2-layer SmolLM3 LoRA fp32 run, b4 s512,
    held two (4, 1, 500, 500) fp32 masks at its peak, 21.5% above its plan before packing was a
    plan input."""
    if not masked_layers(setup):
        return 0
    spec = setup.model
    _, c, autocast = dtypes(setup)
    cc = 2 if autocast else c
    t = setup.micro_batch_size * setup.seq_len
    # one kv head: repeat_kv's expand + reshape stays a view (no copy; measured at Gemma-3-1B size)
    expanded = 2 * (spec.q_dim - spec.kv_dim) if spec.num_kv_heads > 1 else 0
    return cc * (t * expanded + setup.micro_batch_size * setup.seq_len**2)


def recomputed_mask_bytes(setup: RunSetup, last: bool) -> int:
    """masked_attention_bytes in the layer a checkpointed backward recomputes: the last decoder
    layer (``last``) or layer 0. Packed or padded rows mask every layer; otherwise only the
    sliding-window layers get a mask (masked_layers), and a full-attention layer's SDPA runs
    causal without one (ModelSpec.first_layer_sliding / last_layer_sliding). Measured with the
    live-bytes tracker: held-out tiled seed 50 (a 2-layer Gemma-3, layer 0 sliding, layer 1
    full; LoRA bf16-mixed, checkpointing, b2 s1024) held its (2, 1, 1024, 1024) bf16 mask in
    layer 0's recompute only: 22.41 MiB at layer 1's peak, 25.21 MiB at layer 0's."""
    if not masked_layers(setup):
        return 0
    spec = setup.model
    if not _per_row_masks(setup) and not (spec.last_layer_sliding if last else spec.first_layer_sliding):
        return 0
    return masked_attention_bytes(setup)


def _checkpointed_mask_bytes(setup: RunSetup) -> int:
    """With checkpointing, the bool masks SDPA's masks are made from are inputs the checkpoints
    keep for the recompute, one per attention type. Without padding or packing the sliding-window
    mask depends on no row, so it is built once for the batch (measured: (1, 1, 512, 512) bool
    in lowvram train on a 2-layer Gemma-3, b4 s512, whose plan was 2.9% low without it). Packed
    samples, or padded rows with their attention_mask (``setup.padded``: the mask function ANDs
    each row's padding in, masking_utils padding_mask_function), make it b x 1 x s x s, one per
    attention type (measured: a (4, 1, 512, 512) bool at the peak of preference seed 12, a
    3-layer Gemma-3 ORPO LoRA run, b2 s512 of pairs = 4 rows, 3.4% above a plan that counted one
    (1, 1, 512, 512)); so do Gemma-3's image masks (plan/memory/images.py)."""
    if not masked_layers(setup):
        return 0
    spec = setup.model
    s = setup.seq_len
    if not _per_row_masks(setup):
        return s * s
    return describe_layer(spec).attention_types * setup.micro_batch_size * s * s


def eager_mask_bytes(setup: RunSetup) -> int:
    """With eager attention and checkpointing, the additive float masks transformers builds
    (masking_utils eager_mask: b x 1 x s x s in the embeddings' dtype; one more for sliding-window
    layers, Gemma-3 and gpt-oss) are inputs every checkpoint keeps for its recompute, alive through
    forward and backward (measured with the live-bytes tracker in lowvram train: a 2-layer Qwen2
    LoRA bf16, b2 s512, held a (2, 1, 512, 512) bf16 mask at its peak; a Gemma LoRA fp32 run the
    same in fp32). Without checkpointing nothing saves them: freed when the forward ends."""
    if setup.attention != "eager" or not setup.gradient_checkpointing:
        return 0
    r, _, _ = dtypes(setup)
    return describe_layer(setup.model).attention_types * r * setup.micro_batch_size * setup.seq_len**2
