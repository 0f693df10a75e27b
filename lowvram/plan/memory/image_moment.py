"""Image data's place in a step (format image_chat): what images keep beside every moment of the
forward and backward and through the optimizer step, the frozen vision tower's forward as a
moment of its own, vision_encoder_forward (its terms: images.py, qwen_tower.py,
cross_attention.py), and the moment between two steps when the Trainer has fetched the next
step's micro-batches beside the last step's, next_step_batches."""

from __future__ import annotations

from dataclasses import replace

from lowvram.plan.memory import cross_attention, images
from lowvram.plan.memory.moments import Moment
from lowvram.plan.memory.states import dtype_bytes, dtypes
from lowvram.plan.setup import RunSetup


def with_images(setup: RunSetup, moment: Moment) -> Moment:
    """Image data: the batch's pixel values (and, under LoRA with checkpointing, the embedding leaf)
    beside every moment, and the frozen vision tower's forward as a moment of its own
    (plan/memory/images.py; only the text embeddings made before it, no saved activation, no gradient
    made yet; with accumulation the kept gradients are counted by the caller). The model output's
    image_outputs (the tower's hidden states, the image features) are freed with the output
    before the backward's peak: measured, a Gemma-3 run with a 256-wide tower was 7.9% below a plan
    that kept them."""
    moment = replace(moment, activations=moment.activations + images_kept_bytes(setup))
    return max((moment, vision_moment(setup)), key=lambda m: m.bytes)


def images_kept_bytes(setup: RunSetup) -> int:
    """What image data keeps beside every moment: the pixels, the embedding leaf, and
    Llama-3.2-Vision's cross-attention inputs (cross_attention.step_kept_bytes)."""
    r, _, _ = dtypes(setup)
    kept = images.pixel_bytes(setup) + images.scattered_embedding_bytes(setup, r)
    if setup.cross_layers:  # its late terms: _forward_backward_peak
        kept += cross_attention.step_kept_bytes(setup, dtype_bytes(setup)[0])
    return kept


def vision_moment(setup: RunSetup) -> Moment:
    """The frozen vision tower's forward (vision_encoder_forward): what image data keeps beside
    the tower's and projector's working set (plan/memory/images.py; Llama-3.2-Vision's:
    cross_attention.py), beside the weights."""
    setup = cross_attention.active_setup(setup)  # as estimate_memory sees it (a no-op once applied)
    r, _, autocast = dtypes(setup)
    w = dtype_bytes(setup)[0]  # the tower's weights: its residual stream and layer norms
    lin = 2 if autocast else w  # its Linear outputs
    kept = images_kept_bytes(setup)
    if setup.cross_layers:  # Llama-3.2-Vision: the tiles reach the text through cross-attention
        return Moment("vision_encoder_forward", kept + images.text_embedding_bytes(setup, r)
                      + cross_attention.tower_forward_bytes(setup, w, lin))
    return Moment("vision_encoder_forward", kept + images.encoder_forward_bytes(setup, w, lin, r))


def step_kept_bytes(setup: RunSetup) -> int:
    """What image data keeps through the optimizer step: the collated inputs of the step's
    micro-batches and of the next (images.batches_alive; Llama-3.2-Vision's cross_attention_mask
    too, and its cross layers' extra parameters: cross_attention.step_kept_bytes); the embedding
    leaf (scattered_embedding_bytes) is an activation, gone by then."""
    if not setup.images_per_row:
        return 0
    kept = images.pixel_bytes(setup)
    if setup.cross_layers:
        kept += cross_attention.step_kept_bytes(setup, dtype_bytes(setup)[0])
    return kept


def between_steps_bytes(setup: RunSetup) -> int:
    """Image data between two optimizer steps (the moment next_step_batches): the collated inputs
    of images.batches_between_steps micro-batches (the step before's, the next step's and the
    one prefetched: constants.STEP_BATCH_LISTS), beside the weights and the optimizer state, no
    gradient (zero_grad set them to None) and no activation. Llama-3.2-Vision: each micro-batch's
    int64 cross_attention_mask too (images.cross_mask_bytes) and its cross layers' extra parameters."""
    if not setup.images_per_row:
        return 0
    batches = images.batches_between_steps(setup)
    kept = batches * images.micro_batch_pixel_bytes(setup)
    if setup.cross_layers:
        kept += batches * images.cross_mask_bytes(setup)
        kept += cross_attention.cross_params_left_bytes(setup, dtype_bytes(setup)[0])
    return kept


def between_steps_moment(setup: RunSetup) -> Moment:
    """next_step_batches: between_steps_bytes beside the weights, the optimizer state (and the
    gradient buckets of a distributed engine), which the caller adds."""
    return Moment("next_step_batches", between_steps_bytes(setup))
