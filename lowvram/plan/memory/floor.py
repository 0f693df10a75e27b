"""What a run holds on each GPU whatever its activations: the model states after sharding
(weights, gradients, optimizer state, the engine's gathered units and buckets), computed once per
trained state, and the floor of the peak: bytes no estimate of the setup can come in under.

The search (plan/choose/search.py) and the limits (plan/choose/limits.py) read the floor to skip setups that
cannot fit before estimating them: a floor above the budget proves the estimate would be above it
too, so what is chosen never changes (tests/plan/test_floor.py holds the floor under the estimate
of every candidate of a grid of requests; the golden snapshot, tests/golden/, is unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

from lowvram.plan.memory import dora, grpo, preference, tiled
from lowvram.plan.memory.activations import (
    activation_offloaded,
    eager_mask_bytes,
    head_activation_bytes,
    offloaded_layer_input_bytes,
)
from lowvram.plan.memory.backward import CHUNK_TOKENS, MIN_CHUNK_TOKENS, logits_bytes
from lowvram.plan.memory.sharding import shard, sharding_overhead_bytes
from lowvram.plan.memory.states import (
    gradient_bytes,
    optimizer_bytes,
    optimizer_step_temp_bytes,
    trainable_parameters,
    weight_bytes,
)
from lowvram.plan.model.models import model_numel
from lowvram.plan.setup import BREAKDOWN_KEYS, RunSetup, cuda_overheads, per_activations, per_states


@dataclass(frozen=True)
class ModelStates:
    """One process's model states, bytes (memory.estimate_memory's terms of them)."""

    weights: int  # on the GPU after sharding/offload, a DPO reference copy included
    gradients: int  # this process's share
    optimizer: int
    host: int  # offloaded to host RAM, per process
    gathered: int  # FSDP / ZeRO-3 units gathered for compute (sharding_overhead_bytes)
    layer_gradients: int  # FSDP: the layers' unsharded gradients in their backward
    buckets: int  # DDP / ZeRO gradient buckets
    step_temp: int  # temporaries inside optimizer.step() (states.optimizer_step_temp_bytes)
    parameters: int  # models.model_numel
    trainable: int  # states.trainable_parameters
    all_gradients: int  # states.gradient_bytes: every gradient, unsharded


@per_states
def model_states(setup: RunSetup) -> ModelStates:
    """The model states of ``setup`` (the search asks them of hundreds of setups that differ only
    in activations)."""
    weights, grads, optim, host = shard(setup, weight_bytes(setup), gradient_bytes(setup), optimizer_bytes(setup))
    gathered, layer_grads, buckets = sharding_overhead_bytes(setup)
    if preference.is_preference(setup):  # DPO full fine-tuning: the frozen reference copy
        weights += shard(setup, preference.reference_weight_bytes(setup), 0, 0)[0]
    if setup.grpo is not None:  # beta > 0 under full fine-tuning: the frozen reference copy; vLLM's share
        weights += shard(setup, grpo.reference_weight_bytes(setup), 0, 0)[0] + grpo.engine_share(setup)
    return ModelStates(weights, grads, optim, host, gathered, layer_grads, buckets,
                       optimizer_step_temp_bytes(setup), model_numel(setup.model), trainable_parameters(setup),
                       gradient_bytes(setup))


@per_activations
def saved_activation_bytes(core: RunSetup) -> int:
    """Every layer's saved activations (or checkpoints) at the start of the backward
    (tiled.activation_bytes, + DoRA's saved tensors without checkpointing) of ``core`` (a
    preference objective's policy setup: preference.policy_setup)."""
    acts = tiled.activation_bytes(core)
    if not core.gradient_checkpointing:  # DoRA's saved tensors in every layer (plan/memory/dora.py)
        acts += core.model.num_layers * dora.saved_layer_bytes(core)
    return acts


def checkpoint_bytes(core: RunSetup, acts: int) -> tuple[int, int]:
    """With gradient checkpointing, of ``acts`` (saved_activation_bytes): the checkpoints alive
    when the backward recomputes the last decoder layer, and when it recomputes the first (one
    layer's, with the masks kept to the end of the backward: layer 0's checkpoint). Offloaded
    (activations.activation_offloaded): only the recomputed layer's input is back on the GPU."""
    checkpoints = acts - head_activation_bytes(core)
    masks = eager_mask_bytes(core)  # kept to the end of the backward (layer 0's checkpoint)
    one_layer = (checkpoints - masks) // max(1, core.model.num_layers) + masks
    if activation_offloaded(core):
        checkpoints = one_layer = checkpoints + offloaded_layer_input_bytes(core)
    return checkpoints, one_layer


@per_activations
def _activation_moments(core: RunSetup) -> tuple[int, int]:
    """(saved activations, the last layer's recompute without its gradients: memory's
    last_layer_recompute; 0 without checkpointing)."""
    acts = saved_activation_bytes(core)
    if not core.gradient_checkpointing:
        return acts, 0
    return acts, checkpoint_bytes(core, acts)[0] + tiled.recompute_bytes(core)


def peak_floor_bytes(setup: RunSetup) -> int:
    """Bytes memory.estimate_memory(setup).peak_bytes is never below, at a fraction of its cost.

    The estimate's forward-backward phase holds the weights (+ gathered units), the optimizer
    state, the kept gradients and buckets, and its largest moment, which is never below the start
    of the backward (every saved activation plus the logits; memory._forward_backward_peak lists
    it first and takes the max) nor, with checkpointing, below the last decoder layer's recompute
    (every checkpoint and the recomputed layer); its tensor peak is at least that phase, and the
    CUDA context and the allocator slack (non-decreasing in the tensor peak) come on top. The
    floor is that sum without the moments' gradients (and DoRA's recompute terms), and with a
    chunked loss the logits of the chunk the search may size it down to that keeps the least
    (search.sized_estimate). Less one byte per
    breakdown part, for the estimate's rounding of each to an int."""
    st = model_states(setup)
    if preference.is_preference(setup):
        core = preference.policy_setup(setup)
        logits = preference.objective_logits_bytes(setup)
    elif setup.grpo is not None:  # grpo/rloo: the training phase's start of the backward
        core = grpo.policy_setup(setup)
        logits = grpo.logprob_bytes(setup)
    else:
        core = setup
        logits = logits_bytes(setup)
        if setup.loss == "chunked" and setup.micro_batch_size * setup.seq_len > MIN_CHUNK_TOKENS:
            # the chunked loss's bytes grow with the chunk: the least is at the smallest, or where
            # a chunk holds all t tokens, the standard loss's (logits_bytes)
            logits = min(logits, logits_bytes(setup, MIN_CHUNK_TOKENS), logits_bytes(setup, CHUNK_TOKENS))
    acts, recompute = _activation_moments(core)
    moment = max(acts + logits, recompute)
    kept = (st.gradients if setup.grad_accum > 1 else 0) + st.buckets
    tensors = st.weights + st.gathered + st.optimizer + kept + moment
    floor = tensors - len(BREAKDOWN_KEYS)
    if setup.device != "cuda":
        return floor
    ov = cuda_overheads()
    once = min(st.weights + st.optimizer, tensors)
    return floor + ov.context_bytes + sum(ov.allocator_parts(once, tensors - once, setup.expandable_segments).values())


__all__ = ["checkpoint_bytes", "ModelStates", "model_states", "peak_floor_bytes", "saved_activation_bytes"]
