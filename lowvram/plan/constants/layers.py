"""Fitted constants of one decoder layer: the backward's working memory over the saved activations
(backward, tiled), the forward's extra saved tensors (activations), gpt-oss's attention sinks
(moe) and DoRA's weight norm and magnitude (dora). Entries of the one table
(lowvram/plan/constants/__init__.py)."""

from __future__ import annotations

from fractions import Fraction

from lowvram.plan.constants.entry import FittedConstant

# --------------------------------------------------------------------------------------------
# One decoder layer's backward (backward.layer_backward_bytes and its neighbours)

_SHARE_FITTED_ON = ("bench/plan_accuracy.py small-logits CPU cases (chunked loss, small "
                    "vocabulary): the backward's working memory over the layer's activations; "
                    "the share taken is at or above each measurement")
_SHARE_IN_SAMPLE = "CPU matrix worst 2.52%"
_SHARE_HELD_OUT = "GPU LoRA rows median 5.5% (all terms together)"

BACKWARD_SHARE_FULL = FittedConstant(
    "BACKWARD_SHARE_FULL", Fraction(1, 4), "1/4 of the layer's activations",
    "what one decoder layer's backward makes beside its saved tensors (the hidden-state gradients "
    "aside): full fine-tuning in 16 bit, and every run in pure fp32",
    "backward.layer_backward_bytes",
    _SHARE_FITTED_ON + "; measured shares 0.19-0.22", _SHARE_IN_SAMPLE, _SHARE_HELD_OUT)

BACKWARD_SHARE_FULL_AUTOCAST = FittedConstant(
    "BACKWARD_SHARE_FULL_AUTOCAST", Fraction(1, 8), "1/8 of the layer's activations",
    "the same, full fine-tuning under autocast over fp32 weights (its activations include the "
    "16-bit weight copies, which make no gradients)",
    "backward.layer_backward_bytes",
    _SHARE_FITTED_ON + "; measured share 0.02", _SHARE_IN_SAMPLE, _SHARE_HELD_OUT)

BACKWARD_SHARE_LORA = FittedConstant(
    "BACKWARD_SHARE_LORA", Fraction(1, 2), "1/2 of the layer's activations",
    "the same, LoRA over 16-bit weights (the adapter path's gradients are fp32 beside 16-bit "
    "activations)",
    "backward.layer_backward_bytes",
    _SHARE_FITTED_ON + "; measured shares 0.46-0.47", _SHARE_IN_SAMPLE, _SHARE_HELD_OUT)

BACKWARD_SHARE_LORA_AUTOCAST = FittedConstant(
    "BACKWARD_SHARE_LORA_AUTOCAST", Fraction(3, 8), "3/8 of the layer's activations",
    "the same, LoRA under autocast over fp32 weights",
    "backward.layer_backward_bytes",
    _SHARE_FITTED_ON + "; measured shares 0.32-0.38", _SHARE_IN_SAMPLE, _SHARE_HELD_OUT)

SHARE_BLOCK_NORMS = FittedConstant(
    "SHARE_BLOCK_NORMS", 2, "2 norms (a Llama block's)",
    "the norms per layer of the blocks the shares were measured on: under LoRA and in pure fp32 "
    "the share is of the activations less what further norms save (the fp32 upcasts of Gemma-3's "
    "post-norms, q/k norms), which make no gradients in proportion; not under 16-bit full "
    "fine-tuning (taking them out there put a 2-layer Gemma-3, full bf16 with checkpointing, 3.9% "
    "under its simulated step)",
    "backward.layer_backward_bytes (backward._extra_norm_saved_bytes)",
    "held-out fuzz seed 272 (Gemma-3 QLoRA on k_proj with checkpointing: -12.4% with them inside "
    "the share) and seeds 861 and 1127 (Gemma-3 full fp32 with checkpointing: 12.8% and 10.2% "
    "under their plans with them): the three were 10-13% off",
    "300 fuzz seeds within target", "200 fresh held-out seeds (bench/results/plan_fuzz_heldout*.txt)")

PRE_NORM_BACKWARD_TEMPORARIES = FittedConstant(
    "PRE_NORM_BACKWARD_TEMPORARIES", 5, "one hidden-state gradient + 5 fp32 t x h",
    "a Llama-style block (two norms, before attention and MLP) with a tiled MLP: once TiledMLP's "
    "backward is done, the RMSNorm before the MLP runs its backward in fp32 (LlamaRMSNorm: "
    "x.float(), x * rsqrt(x.pow(2).mean(-1) + eps), the weight applied in the input dtype) beside "
    "the attention side's saved tensors: 5 fp32 temporaries (mul, mul, pow, mul.Scalar, "
    "div.Scalar) and one 16-bit hidden-state gradient seen at the peak",
    "tiled.pre_mlp_norm_backward_delta",
    "the live-bytes tracker's dump of the context table's 16 GB plan at 1/16 width "
    "(bench/long_context_scaled.py: Llama 8B/1024 QLoRA bf16, checkpointing, tiled MLP, packed, "
    "2,960 tokens), 4.6% over its plan without this moment",
    "bench/long_context_scaled.py's rows (bench/results/long_context_scaled.txt)",
    "tiled held-out seeds (bench/results/plan_fuzz_tiled_heldout*.txt)")

POST_NORM_BACKWARD_TEMPORARIES = FittedConstant(
    "POST_NORM_BACKWARD_TEMPORARIES", 6, "incoming gradient + 6 fp32 t x h",
    "a block that ends with a norm (OLMo-2, LoRA): that RMSNorm's backward in fp32 beside the "
    "layer's saved tensors: the incoming gradient's fp32 cast and 5 temporaries (mul, mul, pow, "
    "mul.Scalar, div.Scalar) seen at the peak",
    "backward.post_norm_backward_bytes",
    "the live-bytes tracker's dump of a 2-layer OLMo-2 LoRA step; simulated step, 2-layer OLMo-2 "
    "LoRA bf16 + checkpointing (-2.2% without it; full fine-tuning: its share covers it, -0.8%)",
    "+1.6%", "200 fresh held-out seeds (bench/results/plan_fuzz_heldout*.txt)")

DEQUANTIZED_WEIGHTS = FittedConstant(
    "DEQUANTIZED_WEIGHTS", 1, "the largest block linear in the compute dtype",
    "a 4/8-bit base's dequantization temporary: bitsandbytes' MatMul4Bit dequantizes a whole "
    "weight in forward and backward; one (the largest) is alive at a time",
    "backward.dequantized_weight_bytes (quantized_base_backward_bytes, a moment of its own in "
    "layer_backward_bytes; memory's last_layer_mlp_backward)",
    "simulated step, Llama-2-7B and Phi-3-mini QLoRA + checkpointing, seq 256 (-1.4% and -2.7% "
    "without it, +0.5% / +0.9% with it)",
    "full-size simulation worst 0.58%", "GPU QLoRA rows: 20.7% under (README accuracy table)")


# --------------------------------------------------------------------------------------------
# Saved activations (activations.layer_activation_bytes and its neighbours)

FUSED_QKV_ROTARY_COPIES = FittedConstant(
    "FUSED_QKV_ROTARY_COPIES", 1, "q and k outputs once more per layer",
    "fused qkv + rotary (Phi-3): q and k are rotated into new tensors, but v stays a view of the "
    "fused output, whose whole storage SDPA keeps alive",
    "activations.layer_activation_bytes",
    "simulated step, Phi-3-mini LoRA (-3% without it)", "within 2.5%",
    "LitGPT Phi-3 LoRA -8.1% (its own model code)")

CPU_ATTENTION_DROPOUT_BYTES = FittedConstant(
    "CPU_ATTENTION_DROPOUT_BYTES", 12, "12 x heads x seq^2 x batch bytes",
    "attention dropout under SDPA on a CPU (its math path keeps the probabilities, the dropout "
    "noise and the dropped probabilities in fp32; CUDA's kernels drop inside the kernel)",
    "activations._attention_dropout_bytes",
    "simulated step, GPT-2 (12.1-12.5 measured)", "within 2.5%", "CPU only")


# --------------------------------------------------------------------------------------------
# gpt-oss (moe.sink_*)

SINK_EAGER_BACKWARD_SOFTMAXES = FittedConstant(
    "SINK_EAGER_BACKWARD_SOFTMAXES", Fraction(3, 2), "1.5 softmax-sized (s x (s+1)) tensors",
    "gpt-oss eager backward in the last decoder layer: the probabilities' gradient padded back to "
    "s+1 columns and the softmax's input gradient, in the softmax's dtype",
    "moe.sink_eager_backward_bytes",
    "six 2-layer gpt-oss CPU steps (fp32 / bf16 / bf16-mixed, full and LoRA, b2 s256; live-bytes "
    "tracker): without it the plans were 4-25% low, with two tensors 2-11% high",
    "-5.7% to +2.9%", "gpt-oss recipes through `lowvram train` (README)")

SINK_EXPERTS_BACKWARD_FROZEN = FittedConstant(
    "SINK_EXPERTS_BACKWARD_FROZEN", 5, "5 x routed rows x I element-bytes",
    "gpt-oss routed experts' backward with frozen experts (LoRA): the clamped SwiGLU's "
    "elementwise gradients and the strided gate/up slices' zero-filled [rows, 2I] gradients",
    "moe.sink_experts_backward_bytes",
    "2-layer gpt-oss CPU steps (fp32; b1-2, s128-256, I 48-256; measured up to 4.7)",
    "differential-test seed 8 (a LoRA fp32 recipe, +4.5% over its plan before)",
    "gpt-oss recipes through `lowvram train` (README)")

SINK_EXPERTS_BACKWARD_TRAINABLE = FittedConstant(
    "SINK_EXPERTS_BACKWARD_TRAINABLE", 2, "2 x routed rows x I element-bytes",
    "the same with trainable experts (full fine-tuning). Documented as 2.5 before, but the code "
    "was `5 // 2`, which is 2 in Python: 2 is what every plan so far used",
    "moe.sink_experts_backward_bytes",
    "2-layer gpt-oss CPU steps (fp32; b1-2, s128-256; measured up to 2.4)",
    "measured up to 2.4 (above the 2 applied)", "gpt-oss recipes through `lowvram train` (README)")


# --------------------------------------------------------------------------------------------
# DoRA (plan/memory/dora.py): peft's weight norm and magnitude backward, per element

_DORA_FIT = ("the live-bytes tracker on one peft DoRA Linear (d_in x d_out 1024 x 256 to 256 x 2048, "
             "64 tokens; tests/plan/test_dora.py)")
DORA_NORM_BYTES_FP32 = FittedConstant(
    "DORA_NORM_BYTES_FP32", 16, "16 B / weight element",
    "DoRA's forward transient per element of the widest adapted weight, fp32 weights: B@A, the "
    "scaled product, their sum and the norm's working tensor (beside the fp32 identity)",
    "dora.weight_norm_bytes", _DORA_FIT, "16.4-17.2 measured in fp32; 14.7-14.8 under autocast "
    "over fp32 weights (a 2-layer Llama under bf16-mixed was +2.9% over its plan at 15)",
    "extended fuzz seeds 100-133 (bench/results/plan_fuzz_issue27-2026-12-02.txt): 9 of 13 within "
    "the target; misses +4.3% (Phi-3), +5.5% (OLMo-2 QLoRA), -12.1% and -14.6% (long, checkpointed)")
DORA_NORM_BYTES_16BIT_AUTOCAST = FittedConstant(
    "DORA_NORM_BYTES_16BIT_AUTOCAST", 19, "19 B / weight element",
    "as DORA_NORM_BYTES_FP32, 16-bit weights under autocast (+ their fp32 copy)",
    "dora.weight_norm_bytes", _DORA_FIT, "18.7-18.8 measured", "as DORA_NORM_BYTES_FP32")
DORA_NORM_BYTES_16BIT = FittedConstant(
    "DORA_NORM_BYTES_16BIT", 20, "20 B / weight element",
    "as DORA_NORM_BYTES_FP32, 16-bit weights without autocast",
    "dora.weight_norm_bytes", _DORA_FIT, "chosen one above the autocast figure (not measured apart)",
    "as DORA_NORM_BYTES_FP32")
DORA_MAGNITUDE_BACKWARD_BYTES = FittedConstant(
    "DORA_MAGNITUDE_BACKWARD_BYTES", 8, "8 B / (token x d_out)",
    "the magnitude gradient's temporaries in the widest adapted Linear's backward, outside "
    "autocast: 2 fp32 t x d_out", "dora.backward_bytes", _DORA_FIT, "2 fp32 tensors, as peft's "
    "code makes them", "as DORA_NORM_BYTES_FP32")
DORA_MAGNITUDE_BACKWARD_BYTES_AUTOCAST = FittedConstant(
    "DORA_MAGNITUDE_BACKWARD_BYTES_AUTOCAST", 14, "14 B / (token x d_out)",
    "as DORA_MAGNITUDE_BACKWARD_BYTES under autocast: the bf16 outputs' gradients upcast and cast "
    "back around the fp32 combine", "dora.backward_bytes", _DORA_FIT,
    "3.3-3.4 fp32 t x d_out measured, taken as 3.5", "as DORA_NORM_BYTES_FP32")
DORA_RECOMPUTE_INPUT_BYTES = FittedConstant(
    "DORA_RECOMPUTE_INPUT_BYTES", 8, "8 B / (token x d_in)",
    "with checkpointing and 16-bit activations: the widest adapted input at the recompute's DoRA "
    "weight norm, peft's fp32 cast for the fp32 adapters (4) and a 16-bit copy (2), + 2 fitted",
    "dora.recompute_input_bytes", "the live-bytes tracker at extended seed 111's peak (Phi-3 LoRA "
    "DoRA bf16, checkpointing: a (4, 128, 512) fp32 cast and its bf16 copy; ~0.5 MiB more not "
    "attributed)", "6 attributed tensor by tensor; 8 brings seed 111 from +4.31% to +0.29%",
    "extended seeds 100-169 in sample (bench/results/plan_fuzz_extended_100-169_dora.txt), held "
    "out 170-199 and 230-259 (plan_fuzz_extended_heldout_*.txt)")


# --------------------------------------------------------------------------------------------
# Llama-3.2-Vision's cross-attention layer with images: no fitted constant. What one cross layer
# saves beside a self-attention layer's is derived tensor by tensor from the source lines
# (modeling_mllama.py 391-394, 441-449, 711, 717-718, 1356, 1369; peft lora/layer.py 1100-1102;
# sdpa_attention.py 127-128), cited in lowvram/plan/memory/cross_attention.py and checked against
# a real step's saved tensors (tests/plan/test_cross_attention_saved.py). It replaced the fitted
# CROSS_LAYER_TEXT_TOKEN (fitted on fully trained layers: under LoRA the frozen tanh gates save
# nothing, and the plan of Llama-3.2-11B-Vision LoRA bf16 was 2.6% above its simulated step).
