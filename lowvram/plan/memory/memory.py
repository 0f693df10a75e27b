"""Peak memory of one training step: pure functions, bytes in, bytes out (no torch).

Every constant cites its source: a paper or doc, or "measured: bench/plan_accuracy.py", which
runs real steps of small Llama-style models on CPU under lowvram.livebytes' exact live-bytes
tracker and compares them with these formulas (tests/plan/test_accuracy.py pins them at 3%).
Symbols: h hidden, I MLP width, V vocabulary, a attention heads, s seq_len,
t = micro_batch_size x seq_len tokens. The fitted constants are in :mod:`lowvram.plan.constants`
(docs/constants.md).

The terms live below this module: the run and its estimate in :mod:`lowvram.plan.setup`, exact
model states in :mod:`lowvram.plan.memory.states`, saved activations in :mod:`lowvram.plan.memory.activations`,
the loss and the backward in :mod:`lowvram.plan.memory.backward`, multi-GPU sharding in
:mod:`lowvram.plan.memory.sharding`. This module checks a setup and finds the peak, phase by phase.
"""

from __future__ import annotations

from dataclasses import replace

from lowvram.errors import LowvramError
from lowvram.plan import constants as fitted
from lowvram.plan.memory import (
    cross_attention,
    dora,
    grpo,
    lora_init,
    optimizers,
    preference,
    tiled,
)
from lowvram.plan.memory.activations import (
    activation_offload_host_bytes,
    dtypes,
    head_activation_bytes,
    moe_layer_after_experts_bytes,
    recomputed_mask_bytes,
)
from lowvram.plan.memory.backward import (
    backward_gradient_bytes,
    chunked_head_gradient_bytes,
    dequantized_weight_bytes,
    eager_softmax_backward_bytes,
    logits_bytes,
    mlp_backward_floor_bytes,
)
from lowvram.plan.memory.floor import checkpoint_bytes, model_states, saved_activation_bytes
from lowvram.plan.memory.image_moment import between_steps_moment, step_kept_bytes, with_images
from lowvram.plan.memory.moments import Moment
from lowvram.plan.memory.sharding import layer_weight_bytes
from lowvram.plan.memory.states import (
    dtype_bytes,
    gradient_bytes,
    trainable_tensors,
)
from lowvram.plan.model import moe
from lowvram.plan.model.layer import describe_layer
from lowvram.plan.model.models import block_linears, embedding_numel, moe_numel
from lowvram.plan.model.vision import packing_problem, vision_problems
from lowvram.plan.setup import (
    BREAKDOWN_KEYS,
    PROCESS_HOST_BYTES,
    MemoryEstimate,
    RunSetup,
    activation_offload_conflict,
    cuda_overheads,
    offload_conflict,
    quantization_conflict,
    tiled_mlp_conflict,
)
from lowvram.vocab import ATTENTIONS, LOSSES, OFFLOADS, OPTIMIZERS, PRECISIONS, QUANTIZATIONS

# --------------------------------------------------------------------------------------------
# The peak


def _check(setup: RunSetup) -> None:
    problems = [f"{k} {v!r} (known: {', '.join(opts)})" for k, v, opts in [
        ("precision", setup.precision, PRECISIONS), ("quantization", setup.quantization, QUANTIZATIONS),
        ("optimizer", setup.optimizer, OPTIMIZERS), ("offload", setup.offload, OFFLOADS),
        ("attention", setup.attention, ATTENTIONS),
        ("loss", setup.loss, LOSSES), ("device", setup.device, ("cuda", "cpu")),
    ] if v not in opts]
    problems += [p for p in (quantization_conflict(setup.quantization, setup.lora),
                             activation_offload_conflict(setup.activation_offload, setup.gradient_checkpointing),
                             tiled_mlp_conflict(setup.tiled_mlp, setup.model.is_moe)) if p]
    if cross_attention.is_active(setup) and setup.attention == "eager":
        problems.append("attention eager with Llama-3.2-Vision images (not modelled: plan/memory/images.py)")
    if setup.loss == "fused" and setup.device != "cuda":
        problems.append("loss fused needs CUDA (Liger Kernel's Triton kernels); use chunked")
    problems += moe.moe_problems(setup.model, setup.lora, setup.lora_r, setup.lora_targets,
                                 setup.lora_dropout)
    problems += moe.attention_problems(setup.model, setup.attention)
    problems += dora.dora_problems(setup)
    problems += lora_init.init_problems(setup)
    if problem := lora_init.init_name_problem(setup.lora_init):
        problems.append(problem)
    problems += vision_problems(setup.model.vision, setup.offload, setup.objective, setup.optimizer,
                                setup.tiled_mlp)
    if packed := packing_problem(setup.model.vision, setup.packing):
        problems.append(packed)
    problems += optimizers.optimizer_problems(setup)
    conflict = offload_conflict(setup.optimizer, setup.offload)
    if conflict:
        problems.append(conflict)
    if setup.tiled_mlp_shards < 0:
        problems.append("tiled_mlp_shards must be >= 1 (0: ceil(seq_len / hidden_size))")
    if setup.objective not in preference.OBJECTIVES:
        problems.append(f"objective {setup.objective!r} (known: {', '.join(preference.OBJECTIVES)})")
    elif (preference.is_preference(setup) or setup.objective in grpo.GRPO_OBJECTIVES) and setup.loss != "standard":
        problems.append(f"loss {setup.loss} does not apply to objective {setup.objective}: TRL computes its own")
    if (setup.objective in grpo.GRPO_OBJECTIVES) != (setup.grpo is not None):
        problems.append(f"objective {setup.objective} with{'out' if setup.grpo is None else ''} the grpo settings")
    elif setup.grpo is not None:
        problems += grpo.grpo_problems(setup)
    if min(setup.micro_batch_size, setup.seq_len, setup.grad_accum, setup.gpus, setup.lora_r) < 1:
        problems.append("micro_batch_size, seq_len, grad_accum, gpus and lora_r must be >= 1")
    if problems:
        raise LowvramError("cannot estimate memory: " + "; ".join(problems),
                           "use the values listed in `lowvram keys`")


validate_setup = _check  # public name: simulate.py validates the same way


def _forward_backward_peak(setup: RunSetup, acts: int, logits: int, grads: int,
                           layer_grads: int) -> Moment:
    """The highest moment of forward + backward (:class:`Moment`; its name in ``MOMENTS``).

    Candidates: the start of the backward (every saved activation plus the logits; logits_bytes);
    the backward of the last decoder layer and of the first. Going down the layers, saved
    activations (or checkpoints) are freed and gradients made at a fixed rate per layer, so the
    peak is at one end: with long sequences the start, with short ones or checkpointing the
    first layer (nearly every gradient made; backward_gradient_bytes). With gradient
    checkpointing each layer's backward first recomputes it (recompute_bytes). Under autocast
    (*-mixed) with checkpointing the end of the forward also counts: autocast caches a 16-bit
    copy of every trainable fp32 weight it casts until the forward ends (torch autocast
    ``cached_cast``: leaves that require grad; without checkpointing the copies are saved
    activations already). FSDP adds the unsharded gradients of the layers in their backward
    (layer_grads: two layers'); in the first layer's backward there is no next layer to
    prefetch, so one layer's gathered weights and gradients fewer. A tiled MLP (lowvram.plan.memory.tiled)
    saves x instead of its tensors and adds its shard-by-shard backward as moments of its own.
    Measured on CPU (bench/plan_accuracy.py, bench/multi_process_accuracy.py, tests).
    """
    spec = setup.model
    # Llama-3.2-Vision with images (plan/memory/cross_attention.py): alive until the backward has
    # passed its cross layers, so in every moment but the first decoder layer's
    states, cross_extra = (cross_attention.late_parts(setup, dtype_bytes(setup)[0], dtypes(setup)[2])
                           if setup.cross_layers else (0, 0))
    ckpt = setup.gradient_checkpointing
    late = states + (0 if ckpt else len(setup.cross_layers) * cross_extra)
    first_acts, acts = acts, acts + late
    total = model_states(setup).all_gradients
    # This process's share of each gradient (DDP all, FSDP 1/N, offloaded none); with
    # accumulation every gradient exists already (counted as kept gradients).
    share = grads / total if total and setup.grad_accum == 1 else 0.0
    head_g, late_g = backward_gradient_bytes(setup)
    fsdp = setup.offload in ("fsdp", "fsdp-offload")
    not_gathered = layer_weight_bytes(setup) if fsdp else 0  # layer 0: no prefetch
    late_layer_grads = layer_grads // fitted.FSDP_LAYER_GRADIENTS.value if fsdp else layer_grads  # one layer's
    candidates = [Moment("backward_start", acts, logits, chunked_head_gradient_bytes(setup))]
    if spec.tie_word_embeddings and not setup.lora:
        # The very end of the backward, with a tied embedding: every gradient exists (lm_head's
        # in the shared .grad) when the embedding's dense gradient arrives and is accumulated
        # into it: constants.TIED_EMBEDDING_GRADIENT_COPIES more V x h tensors
        # (embedding_dense_backward then AccumulateGrad's sum). Peaks at short sequences
        # (Qwen2.5-0.5B full bf16, seq 256: +0.5 GiB, found by the simulated step).
        w, _ = dtype_bytes(setup)
        tied = fitted.TIED_EMBEDDING_GRADIENT_COPIES.of(w * embedding_numel(spec))
        candidates.append(Moment("tied_embedding_gradient", 0, 0, int(share * total) + tied))
    r, c, autocast = dtypes(setup)
    t = setup.micro_batch_size * setup.seq_len
    hidden_grads = 2 * r * t * spec.hidden_size  # a decoder layer's incoming and outgoing gradients
    layer = describe_layer(spec)
    sinks = layer.attention == "sinks" and setup.attention == "eager"  # gpt-oss: its own backward terms
    if sinks:  # its s x s gradients and its experts' backward in one decoder layer
        sink_scores = moe.sink_eager_backward_bytes(spec, setup.micro_batch_size, setup.seq_len,
                                                    2 if autocast else c, dtype_bytes(setup)[0])
        sink_experts = moe.sink_experts_backward_bytes(spec, t, dtype_bytes(setup)[0], setup.lora)
    if setup.gradient_checkpointing:
        checkpoints, one_layer = checkpoint_bytes(setup, first_acts)
        checkpoints += late
        # gradients made when the backward reaches the last decoder layer, and the first
        last_grads = layer_grads + int(share * head_g)
        first_grads = late_layer_grads + int(share * late_g)
        # the recomputed layer's additive SDPA mask, in the last layer and in layer 0
        # (recomputed_mask_bytes: a full-attention layer between sliding ones makes none)
        mask_last, mask_first = recomputed_mask_bytes(setup, last=True), recomputed_mask_bytes(setup, last=False)
        rec = tiled.recompute_bytes(setup) - mask_last + dora.saved_layer_bytes(setup) + dora.recompute_backward_bytes(setup)
        if setup.cross_layers:  # the first cross layer's recompute: the layers before it checkpointed
            before = (setup.cross_layers[0] + 1) * one_layer
            candidates.append(Moment("cross_layer_recompute", before + rec + cross_extra + states + mask_first, 0,
                                     first_grads, not_gathered))
        candidates += [Moment("last_layer_recompute", checkpoints + rec + cross_extra + mask_last, 0, last_grads),
                       Moment("first_layer_recompute", one_layer + rec + mask_first, 0, first_grads, not_gathered)]
        if dora.dora_on(setup):  # an adapted Linear's magnitude backward in the recompute (plan/memory/dora.py)
            mag = tiled.layer_activation_bytes(setup) + hidden_grads + dora.magnitude_backward_bytes(setup)
            candidates += [Moment("dora_magnitude_backward", checkpoints + mag + mask_last, 0, last_grads),
                           Moment("dora_magnitude_backward", one_layer + mag + mask_first, 0, first_grads,
                                  not_gathered)]
        if setup.tiled_mlp:  # the recomputed layer's MLP backward, shard by shard
            # the recomputed layer's saved tensors, and the additive mask its SDPA made (measured:
            # tiled seed 12, Gemma-3 LoRA with checkpointing, held its (2, 1, 512, 512) bf16 mask
            # at the peak, in layer 0, a sliding-window layer)
            layer = tiled.layer_activation_bytes(setup)
            candidates += tiled.tiled_mlp_moments(setup, checkpoints + layer + mask_last, one_layer + layer + mask_first,
                                                  last_grads, first_grads, not_gathered)
        if dora.dora_on(setup):  # the recompute forms DoRA's weight norm again (plan/memory/dora.py)
            # the layer's saved tensors up to the Linear whose norm is formed (the attention's or all)
            norm = dora.recompute_weight_norm_bytes(setup, tiled.layer_activation_bytes(setup),
                                                    tiled.layer_activation_bytes(setup, attention_side=True))
            norm += hidden_grads  # in the backward: its gradients
            candidates += [Moment("dora_weight_norm", checkpoints + norm, 0, last_grads),
                           Moment("dora_weight_norm", one_layer + norm, 0, first_grads, not_gathered)]
        if setup.attention == "eager":
            # The recomputed layer's softmax backward: its s x s gradients (eager_softmax_backward
            # _bytes; gpt-oss: moe.sink_eager_backward_bytes) beside the layer's activations, every
            # checkpoint and the masks they keep (activation_bytes), and the hidden-state gradients
            # in the last decoder layer (every checkpoint) and in the first (nearly every gradient
            # made: full fine-tuning peaks there; a Gemma-3 full bf16 run was 3.4% over without it)
            scores = sink_scores if sinks else eager_softmax_backward_bytes(setup)
            attention_side = tiled.layer_activation_bytes(setup, attention_side=True) + scores + hidden_grads
            candidates += [Moment("last_layer_softmax_backward", checkpoints + attention_side, 0, last_grads),
                           Moment("first_layer_softmax_backward", one_layer + attention_side, 0, first_grads,
                                  not_gathered)]
            if sinks:
                # gpt-oss: the recomputed layer's experts backward, as without checkpointing (a
                # 2-layer LoRA fp32 run through lowvram train, b4 s256, was 13% over without it)
                candidates.append(Moment("last_layer_experts_backward",
                                         checkpoints + tiled.layer_activation_bytes(setup) + sink_experts + hidden_grads,
                                         0, last_grads))
        if autocast and dtype_bytes(setup)[0] == 4 and not setup.lora:  # LoRA: frozen, not cached
            cache = c * sum(lin.numel for lin in block_linears(spec)) * spec.num_layers
            forward_logits = logits * fitted.LOGITS_FORWARD_BYTES.value // fitted.LOGITS_LOSS_BYTES.value  # no gradient yet
            candidates.append(Moment("forward_end_autocast_cache", acts + cache, forward_logits))
    else:
        first_layer = tiled.layer_activation_bytes(setup, first=True)
        if sinks:  # gpt-oss: s x s gradients; the experts' backward
            candidates.append(Moment("last_layer_softmax_backward", acts + sink_scores, 0, int(share * head_g)))
            candidates.append(Moment("last_layer_experts_backward", acts + sink_experts + hidden_grads, 0,
                                     int(share * head_g)))
        # the last decoder layer's backward, every layer's activations alive (the loss's logits
        # freed): its MLP product's gradients with a 4/8-bit base's dequantized weight, and eager
        # attention's s x s gradients (measured: held-out fuzz seeds 420 and 470, a
        # small-vocabulary QLoRA and an eager LoRA run, were 3.0% and 5.9% above their plans)
        if setup.quantization != "none" and not setup.tiled_mlp:  # tiled: its own moment below
            candidates.append(Moment("last_layer_mlp_backward",
                                     acts + mlp_backward_floor_bytes(setup) + dequantized_weight_bytes(setup),
                                     0, int(share * head_g)))
        if layer.experts == "routed" and not setup.lora:
            # the last layer's routed experts' backward makes their weight gradients (E x 3 x I x
            # h, full fine-tuning) with every layer's activations alive (measured: held-out seed
            # 1301, Mixtral full fp32, b2 s64, was 3.2% above its plan with a (4, 512, 128)
            # gate_up and a (4, 128, 256) down_proj gradient at its peak)
            experts = int(share * dtype_bytes(setup)[0] * moe_numel(spec))
            candidates.append(Moment("last_layer_expert_weight_gradients", acts + hidden_grads, 0,
                                     int(share * head_g) + experts))
        eager = eager_softmax_backward_bytes(setup)
        if eager:
            # at the last layer's softmax backward its MLP's and o_proj's saved tensors are freed
            # (measured: held-out seed 855, Phi-3 full fp32, eager, 512 tokens, 10.5% under its
            # plan with them)
            done = tiled.layer_activation_bytes(setup) - tiled.layer_activation_bytes(setup, attention_side=True)
            candidates.append(Moment("last_layer_softmax_backward", acts - done + eager + hidden_grads, 0,
                                     int(share * head_g)))
        if setup.cross_layers:  # the first cross layer's backward: the layers before it alive
            before = first_layer + (setup.cross_layers[0] - 1) * tiled.layer_activation_bytes(setup)
            candidates.append(Moment("cross_layer_backward", before + tiled.layer_activation_bytes(setup)
                                     + cross_extra + states + tiled.layer_backward_bytes(setup), 0,
                                     late_layer_grads + int(share * late_g), not_gathered))
        candidates.append(Moment("first_layer_backward", first_layer + tiled.layer_backward_bytes(setup)
                                 + dora.saved_layer_bytes(setup) + dora.backward_bytes(setup), 0,
                                 late_layer_grads + int(share * late_g), not_gathered))
        if setup.tiled_mlp:  # the last and first layers' MLP backward, shard by shard
            candidates += tiled.tiled_mlp_moments(setup, acts, first_layer, int(share * head_g),
                                                  late_layer_grads + int(share * late_g), not_gathered)
        if dora.dora_on(setup):  # the last layer's forward forms DoRA's weight norm (plan/memory/dora.py)
            candidates.append(Moment("dora_weight_norm",
                                     acts - head_activation_bytes(setup) + dora.weight_norm_bytes(setup)))
    if optimizers.in_backward(setup):
        candidates = _layerwise_moments(setup, candidates, acts)
    return max(candidates, key=lambda m: m.bytes)  # the first of equals, as listed


def _layerwise_moments(setup: RunSetup, candidates: list[Moment], acts: int) -> list[Moment]:
    """Layerwise GaLore (plan/memory/optimizers/): each parameter is stepped and its gradient dropped
    in its post-accumulate-grad hook (transformers _setup_low_rank_optimizer ``optimizer_hook``),
    so no moment holds the gradients made so far. The backward's own moments keep only, with a
    tied embedding, lm_head's share of its gradient (held in AccumulateGrad's input buffer until
    the embedding's share arrives at the end). A hook runs between the autograd engine's nodes,
    so a step's working set sits beside a layer's saved (or recomputed) activations and the
    hidden-state gradients, not beside an op's backward temporaries; its own moments:
    ``layerwise_layer_step`` (the largest decoder-layer tensor's gradient and step, at the last
    layer: every activation or checkpoint alive), ``layerwise_head_step`` (untied lm_head, the
    first hook, right after the loss's backward) and ``layerwise_embedding_step`` (the last).
    Measured: held-out seed 333 (OLMo-2 bf16, checkpointing) was 11% under a plan that added the
    step to the recompute's peak (bench/results/plan_fuzz_galore_layerwise_heldout_300-379.txt).

    LOMO and AdaLomo (optimizers.lomo_step_bytes): the same moments, but a tensor hook steps the
    parameter accumulated before it, so every backward moment also holds that one gradient
    (optimizers.lomo_pending_bytes) and a step sits beside the next parameter's gradient."""
    spec = setup.model
    w = dtype_bytes(setup)[0]
    shapes = trainable_tensors(setup)
    if optimizers.lomo(setup):
        block = optimizers.lomo_step_bytes(setup, w, shapes, "block")
        embedding = optimizers.lomo_step_bytes(setup, w, shapes, "head")
        pending = optimizers.lomo_pending_bytes(setup, w, shapes)
    else:
        block = optimizers.layerwise_step_bytes(setup, w, shapes, "block")
        embedding = optimizers.layerwise_step_bytes(setup, w, shapes, "head")  # (V, h), never projected
        pending = 0
    tied = w * embedding_numel(spec) if spec.tie_word_embeddings else 0
    out = []
    for m in candidates:
        if m.name == "tied_embedding_gradient":
            out.append(replace(m, gradients=max(m.gradients - int(gradient_bytes(setup)), embedding)))
        elif m.gradients:
            out.append(replace(m, gradients=tied + pending))
        else:
            out.append(m)
    r, _, _ = dtypes(setup)
    hidden_grad = r * setup.micro_batch_size * setup.seq_len * spec.hidden_size
    below_head = acts - head_activation_bytes(setup)  # every layer's activations, or the checkpoints
    layer = tiled.layer_activation_bytes(setup) if setup.gradient_checkpointing else 0  # recomputed
    hidden_grads = 2 * hidden_grad
    if optimizers.lomo(setup) and describe_layer(spec).experts == "routed":
        # LOMO in an MoE layer: the block tensors are stepped once the backward has left the
        # routed experts (their weight gradients come out of grouped_mm's backward, the
        # attention's after them), so the layer holds its dense block and router
        # (activations.moe_layer_after_experts_bytes) and three hidden-state gradients: the
        # layer's incoming one, the experts' input gradient and the router's. The experts'
        # own two steps (optimizers.lomo_experts_steps): gate_up's at the router's hook, and
        # down_proj's at gate_up's, beside what grouped_mm's backward for gate_up leaves (the
        # routed rows' gathered input and its gradient, gate_up's output gradient; the stored
        # dtype: grouped_mm is not autocast). Measured: held-out seeds 534 (Mixtral bf16,
        # checkpointing: 10.8% under a plan with the whole layer and gate_up's step beside
        # down_proj's gradient) and 406 (fp32: 4.5% under)
        rest = moe_layer_after_experts_bytes(setup)
        if setup.gradient_checkpointing:
            layer = rest
        else:
            below_head -= tiled.layer_activation_bytes(setup) - rest
        hidden_grads = 3 * hidden_grad
        at_gate_up, at_router = optimizers.lomo_experts_steps(setup, w)
        rows = setup.micro_batch_size * setup.seq_len * spec.num_experts_per_tok
        left = w * rows * (2 * spec.moe_intermediate_size + 2 * spec.hidden_size)
        block = max(block, at_router)
        out.append(Moment("lomo_experts_step", below_head + layer + hidden_grads + left, 0, at_gate_up + tied))
    out.append(Moment("layerwise_layer_step", below_head + layer + hidden_grads, 0, block + tied))
    if not spec.tie_word_embeddings:
        out.append(Moment("layerwise_head_step", below_head + hidden_grad, 0, embedding))
        out.append(Moment("layerwise_embedding_step", 0, 0, embedding))
    return out


def _generation_peak(setup: RunSetup, grads: int) -> tuple[Moment, int]:
    """grpo/rloo: the highest moment of the generation phase (generate's prefill and last token,
    the no-grad scoring forward), with the gradients alive when a round starts inside an
    accumulation (grpo.grads_at_generation), and its bytes beside the weights and optimizer state."""
    moments = grpo.generation_moments(setup)
    scoring = grpo.scoring_moment(setup)
    if scoring is not None:
        moments.append(scoring)
    kept = grads if grpo.grads_at_generation(setup) else 0
    top = replace(max(moments, key=lambda m: m.bytes), gradients=kept)
    return top, top.bytes


def estimate_memory(setup: RunSetup, phase: str | None = None) -> MemoryEstimate:
    """Peak bytes of a steady-state step (optimizer state already allocated). ``phase``
    (grpo/rloo): "generation" or "training" for that phase's peak alone (phase_estimates)."""
    _check(setup)
    setup = cross_attention.active_setup(setup)  # Llama-3.2-Vision with images: its cross layers train
    st = model_states(setup)
    weights, grads, optim, host = st.weights, st.gradients, st.optimizer, st.host
    gathered, layer_grads, buckets = st.gathered, st.layer_gradients, st.buckets
    pref = preference.is_preference(setup)
    rl = setup.grpo is not None  # grpo/rloo: the training forward of b completions (plan/memory/grpo.py)
    core = preference.policy_setup(setup) if pref else grpo.policy_setup(setup) if rl else setup  # chosen + rejected: 2b rows
    acts = saved_activation_bytes(core)  # DoRA's saved tensors in every layer included
    logits = (preference.objective_logits_bytes(setup) if pref else grpo.logprob_bytes(setup) if rl
              else logits_bytes(setup))
    kept_grads = grads if setup.grad_accum > 1 else 0  # accumulation keeps grads across micro-steps
    kept_grads += buckets
    live_weights = weights + gathered  # FSDP: shards plus the units gathered for compute
    persistent = weights + optim + kept_grads  # what lives across steps
    moment = _forward_backward_peak(core, acts, logits, grads, layer_grads)
    if setup.images_per_row:  # format image_chat (plan/memory/images.py)
        moment = with_images(setup, moment)
    if pref and preference.reference_forward_bytes(setup):
        # DPO: the reference forward (no_grad) after the policy's, every saved activation alive
        # (lowvram.plan.memory.preference; TRL DPOTrainer._compute_loss)
        ref = Moment("reference_forward", acts + preference.dpo_saved_bytes(setup)
                     + preference.reference_forward_bytes(setup))
        moment = max((moment, ref), key=lambda m: m.bytes)
    kept_grads += moment.gradients
    acts, logits = moment.activations, moment.logits
    live_weights -= moment.not_gathered
    fb = live_weights + optim + kept_grads + acts + logits
    # layerwise GaLore: optimizer.step() is LayerWiseDummyOptimizer's no-op (LOMO's: accelerate's
    # AcceleratedOptimizer.step returns for it), every gradient was applied and dropped in the
    # backward (plan/memory/optimizers/)
    step_grads = 0 if optimizers.in_backward(setup) else grads
    step_images = step_kept_bytes(setup)  # images: the batches the Trainer holds through the step
    step = weights + optim + step_grads + buckets + st.step_temp + step_images
    # images: between two steps, the last step's micro-batches beside the next step's (image_moment.py)
    nb = between_steps_moment(setup)
    between = weights + optim + buckets + nb.bytes if setup.images_per_row else 0
    # lora.init pissa: an SVD per adapted Linear at model build, before any optimizer state or
    # activation (plan/memory/lora_init.py)
    # (its working tensors net of the adapters not yet made or still 16-bit: lora_init.init_bytes)
    init = Moment("lora_init", lora_init.init_bytes(setup)) if lora_init.is_svd_init(setup.lora_init) else None
    gen, generation = _generation_peak(setup, grads) if rl and phase != "training" else (None, 0)
    if gen is not None and (phase == "generation" or weights + optim + generation > max(fb, step, between)):
        phase, peak_moment = "generation", gen.name
        # the generation round's cache and working tensors beside the model states (plan/memory/grpo.py)
        parts = dict(weights=weights, gradients=gen.gradients, optimizer=optim, activations=gen.activations,
                     logits=gen.logits)
    elif setup.lora and init is not None and weights + init.bytes > max(fb, step, between):
        phase = peak_moment = init.name
        # the SVD's fp32 factors, product and residual: working copies of one weight
        parts = dict(weights=weights + init.bytes, gradients=0, optimizer=0, activations=0, logits=0)
    elif between > max(fb, step):
        phase, peak_moment = "between_steps", nb.name
        parts = dict(weights=weights, gradients=buckets, optimizer=optim, activations=nb.bytes, logits=0)
    elif fb >= step:
        phase, peak_moment = "forward_backward", moment.name
        parts = dict(weights=live_weights, gradients=kept_grads, optimizer=optim, activations=acts,
                     logits=logits)
    else:
        phase = peak_moment = "optimizer_step"
        # step temporaries are working memory of the optimizer: reported under "optimizer"
        parts = dict(weights=weights, gradients=step_grads + buckets,
                     optimizer=step - weights - step_grads - buckets - step_images,
                     activations=step_images, logits=0)
    tensors = sum(parts.values())
    slack = {}
    once = min(weights + optim, tensors)
    if setup.device == "cuda":
        ov = cuda_overheads()
        # the allocator slack's two shares (setup.CudaOverheads): on what is allocated once and
        # kept (the weights loaded at start, the optimizer state of the first step), and on the
        # rest of the tensor peak, which churns every step
        slack = ov.allocator_parts(once, tensors - once, setup.expandable_segments)
        parts["cuda_context"] = ov.context_bytes
        parts["allocator"] = sum(slack.values())
    else:
        parts["cuda_context"] = 0
        parts["allocator"] = 0
    breakdown = {k: int(parts[k]) for k in BREAKDOWN_KEYS}
    # Host RAM: what is offloaded, plus the process itself (PROCESS_HOST_BYTES) plus one
    # checkpoint shard staged while loading (constants.CHECKPOINT_SHARD_BYTES).
    process = PROCESS_HOST_BYTES
    host += activation_offload_host_bytes(setup)
    staging = min(st.parameters * dtype_bytes(setup)[0], fitted.CHECKPOINT_SHARD_BYTES.value)
    if setup.device == "cpu":
        cpu_ram = sum(breakdown.values()) + host + process
    else:
        cpu_ram = host + process + staging
    return MemoryEstimate(
        parameters=st.parameters + (st.trainable if setup.lora else 0),
        trainable_parameters=st.trainable,
        peak_bytes=sum(breakdown.values()),
        breakdown=breakdown,
        peak_phase=phase,
        peak_moment=peak_moment,
        cpu_ram_bytes=int(cpu_ram),
        persistent_bytes=int(persistent),
        allocator_parts=slack,
        allocated_once_bytes=int(once),
    )


def phase_estimates(setup: RunSetup) -> dict[str, MemoryEstimate]:
    """grpo/rloo: each phase's own peak (its binding moment, its breakdown); {} otherwise."""
    if setup.grpo is None:
        return {}
    return {p: estimate_memory(setup, p) for p in ("generation", "training")}


__all__ = [
    "estimate_memory", "phase_estimates", "validate_setup",
]
