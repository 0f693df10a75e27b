"""The named moments of a training step: the instants whose live bytes the planner compares.

A step's peak is the largest of a few moments; each has a name here, what is alive at it, and
where the term was derived or measured. :func:`lowvram.plan.memory.memory.estimate_memory` reports the
moment that binds (``MemoryEstimate.peak_moment``; ``peak_moment`` in ``lowvram plan --json``),
so a plan says *where* its peak is, not only which phase. A new term (a technique, an objective,
a model kind) adds a moment here or a named part of one.

Sources: "measured" names the live-bytes tracker (lowvram.livebytes) through ``lowvram train``
(bench/plan_fuzz.py, seed numbers in bench/results/) or a real CPU step (bench/plan_accuracy.py);
library files are the code that allocates what the moment counts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Moment:
    """Bytes alive at one instant of forward + backward, beside the weights and optimizer state."""

    name: str  # a key of MOMENTS
    activations: int  # saved activations, checkpoints and the working tensors of the moment
    logits: int = 0
    gradients: int = 0  # parameter gradients made by then (this process's share)
    not_gathered: int = 0  # FSDP: one unit's gathered weights not held (layer 0: nothing to prefetch)

    @property
    def bytes(self) -> int:
        return self.activations + self.logits + self.gradients - self.not_gathered


# name: (what is alive, source). The optimizer step is the other phase (estimate_memory).
MOMENTS: dict[str, tuple[str, str]] = {
    "backward_start": (
        "every saved activation (or checkpoint) and the logits with their gradient, at the loss "
        "(chunked, full fine-tuning: lm_head's new weight gradient beside the accumulated one)",
        "activations.activation_bytes, backward.logits_bytes, backward.chunked_head_gradient_bytes; "
        "measured: bench/plan_accuracy.py, bench/emulated_cards.py"),
    "tied_embedding_gradient": (
        "the end of the backward with a tied embedding: every gradient and two V x h tensors "
        "(embedding_dense_backward, then AccumulateGrad's sum into lm_head's .grad)",
        "measured: 2.0 x V*h*w, Qwen2.5-0.5B full bf16 at 256 tokens (simulated step)"),
    "last_layer_recompute": (
        "checkpointing: the last decoder layer recomputed and its backward, every checkpoint alive "
        "(its SDPA mask where that layer has one: activations.recomputed_mask_bytes)",
        "backward.recompute_bytes; measured: held-out seeds (bench/results/plan_fuzz_heldout*.txt)"),
    "first_layer_recompute": (
        "checkpointing: the first decoder layer recomputed and its backward, nearly every gradient made "
        "(its SDPA mask as above)",
        "backward.recompute_bytes, backward.backward_gradient_bytes; measured as above"),
    "cross_layer_recompute": (
        "Llama-3.2-Vision with images and checkpointing: the first cross-attention layer recomputed "
        "and its backward, the layers before it checkpointed, cross_attention_states and its mask "
        "alive, nearly every gradient made",
        "cross_attention.late_parts; measured: bench/results/plan_fuzz_mllama_images_*.txt"),
    "cross_layer_backward": (
        "Llama-3.2-Vision with images: the first cross-attention layer's backward, the layers before "
        "it and its own saved tensors (its vision-token keys and values) alive, nearly every gradient made",
        "cross_attention.late_parts; measured as above"),
    "last_layer_softmax_backward": (
        "eager attention: the last layer's softmax backward, its s x s gradients beside its "
        "attention-side activations (gpt-oss: its sink backward)",
        "activations.eager_softmax_backward_bytes, moe.sink_eager_backward_bytes; measured: seeds 470, 855"),
    "first_layer_softmax_backward": (
        "eager attention with checkpointing: the first layer's softmax backward, nearly every gradient made",
        "measured: held-out seeds 1000-1099 (a Gemma-3 full bf16 run was 3.4% over without it)"),
    "last_layer_experts_backward": (
        "gpt-oss: the last layer's experts backward beside every activation or checkpoint",
        "moe.sink_experts_backward_bytes; measured: a 2-layer LoRA fp32 run, b4 s256 (13% over without it)"),
    "forward_end_autocast_cache": (
        "*-mixed full fine-tuning with checkpointing: the forward's end, autocast's 16-bit copy of "
        "every trainable fp32 weight still cached (torch autocast cached_cast)",
        "torch/csrc/autograd autocast cached_cast (leaves that require grad); measured on CPU steps"),
    "last_layer_mlp_backward": (
        "a 4/8-bit base without checkpointing: the last layer's MLP product gradients and the "
        "dequantized weight beside every activation",
        "backward.mlp_backward_floor_bytes, backward.dequantized_weight_bytes; measured: seed 420"),
    "last_layer_expert_weight_gradients": (
        "MoE full fine-tuning without checkpointing: the last layer's routed experts' weight "
        "gradients (E x 3 x I x h) beside every activation",
        "measured: held-out seed 1301 (Mixtral full fp32, b2 s64)"),
    "last_layer_tiled_mlp_backward": (
        "tiled MLP: the last decoder layer's MLP backward, one shard recomputed with autograd, "
        "beside every activation or checkpoint (and the recomputed layer's), the incoming "
        "gradient and x_grad",
        "tiled.tiled_mlp_backward_bytes, from DeepSpeed 0.19 ulysses_sp.TiledMLP.backward; "
        "measured: bench/tiled_mlp.py"),
    "first_layer_tiled_mlp_backward": (
        "tiled MLP: the first decoder layer's MLP backward, one shard recomputed, nearly every "
        "gradient made",
        "tiled.tiled_mlp_backward_bytes (as above)"),
    "last_layer_tiled_mlp_norm_backward": (
        "tiled MLP: the last decoder layer's norm before the MLP, its fp32 backward once TiledMLP's "
        "is done (x freed; x_grad, the residual gradient and the norm's temporaries alive)",
        "tiled.pre_mlp_norm_backward_delta; measured: held-out tiled seed 27 (Gemma-3 LoRA fp32, "
        "3.94% over without it)"),
    "first_layer_tiled_mlp_norm_backward": (
        "tiled MLP: the first decoder layer's norm before the MLP, its backward (as above), nearly "
        "every gradient made",
        "tiled.pre_mlp_norm_backward_delta (as above)"),
    "dora_magnitude_backward": (
        "checkpointing with lora.use_dora: an adapted Linear's backward in the recomputed layer, "
        "its magnitude gradient's t x d_out temporaries beside the DoRA tensors saved up to it",
        "peft tuners/lora/dora.py DoraLinearLayer.forward; dora.magnitude_backward_bytes; measured: tests/plan/test_dora.py"),
    "dora_weight_norm": (
        "lora.use_dora: an adapted layer's forward (or its recompute) forms B@A through an fp32 "
        "identity and the norm of weight + scaling x B@A: dense d_out x d_in temporaries beside "
        "every activation or checkpoint",
        "peft tuners/lora/dora.py DoraLinearLayer; dora.weight_norm_bytes; measured: tests/plan/test_dora.py"),
    "lora_init": (
        "lora.init pissa: at model build, before any optimizer state or activation, the widest adapted "
        "Linear's SVD (fp32 factors, B@A and the residual, an fp32 copy of a 16-bit weight) beside "
        "the loaded weights and the adapters",
        "peft tuners/lora/layer.py LoraLayer.pissa_init; lora_init.init_bytes; measured: "
        "tests/plan/test_lora_init.py"),
    "first_layer_backward": (
        "without checkpointing: the first decoder layer's backward, nearly every gradient made",
        "activations.layer_activation_bytes(first=True), backward.layer_backward_bytes"),
    "layerwise_layer_step": (
        "layerwise GaLore: the last decoder layer's largest tensor stepped in its post-accumulate-"
        "grad hook (its gradient, the step's temporaries, a renewal's SVD) beside every activation "
        "or checkpoint, the recomputed layer's and the hidden-state gradients; the backward's own "
        "moments then hold no gradients made so far (a tied lm_head's share only). LOMO and "
        "AdaLomo: the step of the tensor accumulated before, at the next one's tensor hook, beside "
        "that incoming gradient; the backward's moments hold the one gradient not yet stepped",
        "transformers trainer_optimizer._setup_low_rank_optimizer (optimizer_hook, "
        "register_post_accumulate_grad_hook); optimizers.layerwise_step_bytes; lomo_optim "
        "Lomo/AdaLomo fuse_update, optimizers.lomo_step_bytes; measured: "
        "bench/results/plan_fuzz_galore_layerwise*.txt, plan_fuzz_lomo*.txt"),
    "lomo_experts_step": (
        "LOMO or AdaLomo in an MoE layer (fused routed experts): down_proj's step at gate_up_proj's "
        "hook, beside gate_up's incoming gradient and what grouped_mm's backward leaves (the routed "
        "rows' input, its gradient, gate_up's output gradient), the layer's dense block and router, "
        "every checkpoint (gate_up's own step, at the router's hook: layerwise_layer_step)",
        "lomo_optim Lomo fuse_update, transformers integrations/moe.py grouped_mm; "
        "optimizers.lomo_experts_steps; measured: bench/results/plan_fuzz_lomo*.txt (seeds 406, 534)"),
    "layerwise_head_step": (
        "layerwise GaLore, untied lm_head: the first post-accumulate-grad hook, lm_head's gradient "
        "and its AdamW step beside every saved activation (or checkpoint) but the head's and the "
        "hidden-state gradient (LOMO, AdaLomo: its step at the final norm's hook)",
        "transformers trainer_optimizer._setup_low_rank_optimizer (optimizer_hook, "
        "register_post_accumulate_grad_hook); optimizers.layerwise_step_bytes; measured: "
        "bench/results/plan_fuzz_galore_layerwise*.txt"),
    "layerwise_embedding_step": (
        "layerwise GaLore, LOMO or AdaLomo, untied: the embedding's gradient and step, the last "
        "hook of the backward",
        "as layerwise_head_step"),
    "vision_encoder_forward": (
        "format image_chat: the frozen vision tower's and projector's forward, before any decoder "
        "layer: the text embeddings, the pixels, the last encoder layer's temporaries beside the "
        "encoder's input (then Llava's every-layer hidden states beside its projector), then the "
        "image features scattered into the embeddings; no saved activation, no gradient yet",
        "images.tower_forward_bytes, images.encoder_forward_bytes; transformers 5.25 "
        "modeling_siglip.py, modeling_clip.py, LlavaModel.get_image_features, Gemma3Model.forward; "
        "measured: exact on 1-4 layer towers (tests/plan/test_images.py), bench/results/plan_fuzz_images*.txt"),
    "next_step_batches": (
        "format image_chat, between two optimizer steps (the phase between_steps): the Trainer has "
        "fetched the next step's micro-batches while the last step's are still held, so their "
        "pixel values (Llama-3.2-Vision: and cross-attention masks) of 2 x grad_accum + 1 "
        "micro-batches beside the weights and the optimizer state; no gradient, no activation",
        "image_moment.between_steps_bytes, constants.STEP_BATCH_LISTS, PREFETCHED_BATCHES; "
        "transformers 5.25 trainer.py _run_epoch L1918 get_batch_samples, L1991 zero_grad; "
        "accelerate data_loader.py DataLoaderShard.__iter__; measured: "
        "tests/train/test_accumulation_batches.py"),
    "reference_forward": (
        "DPO without precomputed reference log-probs: the reference's no-grad forward after the "
        "policy's, every saved activation of the 2b concatenated rows alive beside the reference's "
        "last hidden states and its fused log-prob head's tiles",
        "plan.preference.reference_forward_bytes; TRL 1.16 DPOTrainer._compute_loss, "
        "trl/kernels/chunked_logprob.py"),
    "generation_prefill": (
        "grpo/rloo: generate's prompt forward over the generation batch (micro_batch_size x "
        "steps_per_generation rows x max_prompt_length), no grad, no autocast: the prompt's KV cache "
        "and one layer's working tensors beside the weights, the optimizer state and, inside an "
        "accumulation, the gradients",
        "plan.grpo.generation_moments; TRL 1.16 GRPOTrainer._generate_single_turn, transformers "
        "generation/utils.py, cache_utils.py DynamicLayer.update"),
    "generation_decode": (
        "grpo/rloo: generate's last token: the whole KV cache (rows x (prompt + completion)), the "
        "last layer's torch.cat copy, its keys and values repeated to every head (repeat_kv) and the "
        "sampling logits (fp32 copy, softmax); paged: the PagedAttentionCache the plan sized",
        "plan.grpo.generation_moments, kv_cache_bytes, sampling_bytes; transformers "
        "integrations/sdpa_attention.py use_gqa_in_sdpa, generation/utils.py _sample"),
    "scoring_forward": (
        "grpo/rloo: the no-grad log-prob forward of micro_batch_size rows after generation (old "
        "log-probs when generation and optimizer steps do not line up, RLOO always; reference log-probs "
        "where beta > 0): one layer's working tensors or the fused head's forward tiles",
        "plan.grpo.scoring_moment; TRL 1.16 GRPOTrainer._generate_and_score_completions L2630-2740"),
}


def describe_moment(name: str, techniques: dict) -> str | None:
    """What is alive at moment ``name`` in words that fit the plan's own techniques (the MOMENTS
    text names every case; the peak line of a plan names its case only)."""
    entry = MOMENTS.get(name)
    if entry is None:
        return None
    if name != "backward_start":
        return entry[0]
    kept = "every layer's checkpoint" if techniques.get("gradient_checkpointing") else "every saved activation"
    loss = techniques.get("loss", "standard")
    logits = {"chunked": "one chunk's logits and their gradient", "fused": "the fused loss's chunk"}.get(
        loss, "the full logits and their gradient")
    head = ("; lm_head's new weight gradient beside the accumulated one" if loss == "chunked"
            and techniques.get("lora") is False else "")
    return f"{kept} and {logits}, at the loss{head}"
