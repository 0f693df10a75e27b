"""Activation offloading (techniques.activation_offload): the checkpointed layer inputs moved to
host RAM, what stays on the device and what the host holds. Symbols as in
:mod:`lowvram.plan.memory.memory`."""

from __future__ import annotations

from lowvram.plan.memory.states import dtypes
from lowvram.plan.setup import RunSetup


def activation_offloaded(setup: RunSetup) -> bool:
    """Whether the checkpointed layer inputs leave the device: activation_offload with gradient
    checkpointing, on a GPU. On a CPU host RAM is the device memory: transformers' offload path
    (``save_on_cpu`` around the checkpoint) has nowhere to move them (``tensor.cpu()`` of a CPU
    tensor is itself; its pinned variant needs a GPU), so nothing is saved and nothing is
    claimed: the live-bytes tracker would see the same tensors."""
    return setup.activation_offload and setup.gradient_checkpointing and setup.device == "cuda"


def offloaded_layer_input_bytes(setup: RunSetup) -> int:
    """One checkpointed decoder layer's input (r*t*h), the only tensor its checkpoint saves.

    transformers' ``activation_checkpointing_enable(offload=True)`` (modeling_utils
    ``_activation_checkpointing_enable``: ``save_on_cpu(pin_memory=True)`` *around*
    ``torch.utils.checkpoint.checkpoint``): the non-reentrant checkpoint saves the positional
    inputs through ``_NoopSaveInputs`` outside its own saved-tensor hooks, so the outer
    ``save_on_cpu`` packs exactly those into pinned host RAM; everything the layer's forward saves
    goes to the checkpoint's own (inner) hooks and is dropped, as without offload. The layer's
    keyword arguments (rotary cos/sin, masks, position ids) ride in a ``functools.partial``
    (GradientCheckpointingLayer), not through the checkpoint, so they stay on the GPU, counted
    as without offload. In the backward ``unpack_from_cpu`` copies the input back for that
    layer's recompute: one layer's input on the GPU at a time."""
    r, _, _ = dtypes(setup)
    return r * setup.micro_batch_size * setup.seq_len * setup.model.hidden_size


def activation_offload_host_bytes(setup: RunSetup) -> int:
    """Pinned host RAM of the offloaded layer inputs: every decoder layer's, from its forward to
    its backward (``save_on_cpu`` allocates one pinned tensor per packed input). PyTorch's
    pinned-memory allocator rounds each block up to a power of two and caches it
    (ATen/core/CachingHostAllocator.h ``allocate``: ``PowerOf2Ceil(size)`` below
    ``pinned_max_round_threshold``, unlimited by default), so a 10,429-token Llama-3.1-8B input
    of 81.5 MiB holds 128 MiB."""
    if not activation_offloaded(setup):
        return 0
    size = offloaded_layer_input_bytes(setup)
    return setup.model.num_layers * (1 << (size - 1).bit_length())
