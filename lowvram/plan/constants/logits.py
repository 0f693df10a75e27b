"""Fitted constants of the head: the logits and the loss around them (backward.logits_bytes,
memory's forward_end_autocast_cache) and the preference objectives' loss path (preference).
Entries of the one table (lowvram/plan/constants/__init__.py)."""

from __future__ import annotations

from lowvram.plan.constants.entry import FittedConstant

# --------------------------------------------------------------------------------------------
# The loss (backward.logits_bytes, memory's forward_end_autocast_cache)

LOGITS_LOSS_BYTES = FittedConstant(
    "LOGITS_LOSS_BYTES", 12, "12 x tokens x vocabulary bytes",
    "logits around the loss: transformers upcasts them to fp32 for cross-entropy "
    "(ForCausalLMLoss); in its backward the saved log-softmax, the incoming gradient and the "
    "input gradient coexist",
    "backward.logits_bytes",
    "exact CPU bytes (bench/plan_accuracy.py)", "in the CPU matrix",
    "torchtune (the same fp32 upcast) LoRA rows +2% to +10% (reserved); LitGPT's bf16 chunked "
    "loss keeps about 2, not 12")

LOGITS_FORWARD_BYTES = FittedConstant(
    "LOGITS_FORWARD_BYTES", 10, "10 of the 12 bytes",
    "logits at the end of the forward, before their gradient exists (the autocast-cache moment)",
    "memory._forward_backward_peak (forward_end_autocast_cache)",
    "bench/plan_accuracy.py *-mixed full fine-tuning with checkpointing (CPU steps)",
    "in the CPU matrix", "no published row")

CHUNKED_LOSS_HIDDEN_GRADIENTS = FittedConstant(
    "CHUNKED_LOSS_HIDDEN_GRADIENTS", 2, "one 1024-token chunk + 2 x tokens x hidden + int64 targets",
    "chunked loss (lowvram.train.build.loss, chunks of backward.CHUNK_TOKENS): the gradient of all "
    "final hidden states, accumulated chunk by chunk next to the current chunk's (2 x t x h in "
    "the hidden dtype), beside one chunk's logits (LOGITS_LOSS_BYTES)",
    "backward.logits_bytes",
    "bench/plan_accuracy.py chunked cases", "within 2% (the same error as the standard loss)",
    "no published row")


# --------------------------------------------------------------------------------------------
# Preference objectives (plan/memory/preference.py): bytes per logit of ORPO's and SimPO's loss path

_PREFERENCE_FIT = ("TRL 1.16's own loss functions under the live-bytes tracker (2b = 4 rows, s = 128, "
                   "V = 1024; the hidden states' gradient included)")
ORPO_LOGIT_BYTES = FittedConstant(
    "ORPO_LOGIT_BYTES", 18, "18 B / logit",
    "peak bytes per logit of the 2b rows in ORPO's loss path (fp32 logits)",
    "preference.objective_logits_bytes", _PREFERENCE_FIT, "18.7 measured",
    "held-out seeds 12-23 (bench/plan_fuzz.py --preference), re-planned after TRL's disable_dropout "
    "(plan/memory/preference.py policy_setup): -0.8% to +3.4% (seed 12; 16-bit runs' logits measure at the "
    "fp32 count); seeds 40-51: none above its plan by over 0.7%")
SIMPO_LOGIT_BYTES = FittedConstant(
    "SIMPO_LOGIT_BYTES", 16, "16 B / logit",
    "peak bytes per logit of the 2b rows in SimPO's (CPO) loss path (fp32 logits)",
    "preference.objective_logits_bytes", _PREFERENCE_FIT,
    "16.7 measured (a first count of 12 left 5 of 6 seeds up to 29% over their plan)",
    "held-out seeds 12-23, re-planned after TRL's disable_dropout: -2.7% to -0.3%; seeds 40-51: "
    "-1.4% to -0.2%")

# grpo/rloo (plan/memory/grpo.py): the loss's per-token tensors over the completion
GRPO_LOSS_TOKEN_BYTES = FittedConstant(
    "GRPO_LOSS_TOKEN_BYTES", 48, "48 B / completion token",
    "GRPO's and RLOO's loss beside the fused head at the start of the backward: fp32 per-token "
    "tensors over the completion (log ratio, its exp and clamp, the two surrogate terms, their "
    "minimum and the masked sums; TRL 1.16 GRPOTrainer._compute_loss L3020-3200)",
    "grpo.loss_token_bytes", "counted in TRL's _compute_loss: 12 fp32 tensors of b x C",
    "in-sample grpo/rloo runs through lowvram train (bench/plan_fuzz.py --grpo, seeds 100-111, 150-153)",
    "held-out grpo/rloo seeds 200-217 (docs/accuracy.md)")

# grpo/rloo's generation phase (plan/memory/nograd.py): peft's fp32 adapter path in generate's no-grad forward
GENERATION_ADAPTER_OUT_BYTES = FittedConstant(
    "GENERATION_ADAPTER_OUT_BYTES", 8, "8 B / adapted Linear output element",
    "generate's no-grad forward under LoRA/QLoRA (no autocast, model in training mode): beside an adapted "
    "Linear's base output, lora_B's fp32 output and its scaled copy (then the scaled copy and the fp32 sum); "
    "peft 0.21 tuners/lora/layer.py Linear.forward ``result + lora_B(lora_A(dropout(x))) * scaling``, with "
    "the fp32 input copy (_cast_input_dtype) and dropout's noise and output counted apart",
    "grpo.generation_moments (nograd.attention_side_bytes, nograd.mlp_side_bytes)",
    "counted in peft's code; checked with the live-bytes tracker inside generate through lowvram train "
    "(bench/plan_fuzz.py --grpo --grpo-generation, the prefill's last MLP)",
    "in-sample generation-bound seeds 150-153, 156, 162, 165: the generation transient -1.7% to -0.1% of the "
    "measured (it was 5-12% under before the forward's held tensors, autocast and the paged mask were counted)",
    "held-out generation-bound seeds 900+ (docs/accuracy.md)")
