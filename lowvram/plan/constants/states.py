"""Fitted constants of the model states: the optimizer step's temporaries (states,
optimizers), the tied embedding's gradient copies at the end of the backward and FSDP's gathered
layers and gradients (sharding, memory). Entries of the one table
(lowvram/plan/constants/__init__.py)."""

from __future__ import annotations

from fractions import Fraction

from lowvram.plan.constants.entry import FittedConstant

# --------------------------------------------------------------------------------------------
# The optimizer step (states.optimizer_step_temp_bytes)

ADAFACTOR_TEMP_BYTES_FP32 = FittedConstant(
    "ADAFACTOR_TEMP_BYTES_FP32", 8, "8 bytes x largest tensor",
    "transformers' Adafactor step temporaries for fp32 parameters (it works one tensor at a time "
    "on fp32 copies: grad.float(), update, p.float())",
    "states.optimizer_step_temp_bytes",
    "bench/plan_accuracy.py", "in the CPU matrix", "no published row")

ADAFACTOR_TEMP_BYTES_16BIT = FittedConstant(
    "ADAFACTOR_TEMP_BYTES_16BIT", 16, "16 bytes x largest tensor",
    "the same for 16-bit parameters", "states.optimizer_step_temp_bytes",
    "bench/plan_accuracy.py", "in the CPU matrix", "no published row")

TORCHAO_8BIT_STEP_TEMP_BYTES = FittedConstant(
    "TORCHAO_8BIT_STEP_TEMP_BYTES", Fraction(257, 32), "257/32 bytes x largest quantized tensor",
    "torchao AdamW8bit's compiled step (torch.compile of optim/adam.py single_param_adam, one "
    "parameter at a time): the buffers inductor keeps for one quantized parameter, the fp32 "
    "exp_avg and exp_avg_sq before they are re-quantized (8 bytes/element) and one fp32 absmax "
    "per 256-element block of each; a tensor kept in full precision (under 4096 elements or not "
    "a multiple of the block) steps in place (0)",
    "states.optimizer_step_temp_bytes (optimizers.torchao_step_temp_bytes)",
    "the real AdamW8bit step on the CPU (torch 2.13, torchao 0.18, inductor's C++ backend) under "
    "the live-bytes tracker with compiled code followed (lowvram.livebytes), and torch.profiler's "
    "memory events: 8.03 bytes/element for fp32 and bf16 parameters alike "
    "(tests/plan/test_torchao.py)",
    "exact on the CPU", "not measured on CUDA (Triton's fusion may differ)")

TORCHAO_4BIT_STEP_TEMP_BYTES = FittedConstant(
    "TORCHAO_4BIT_STEP_TEMP_BYTES", Fraction(833, 32), "833/32 bytes x largest quantized tensor",
    "the same for AdamW4bit: the fp32 moments, the unpacked 4-bit codes and their packing "
    "(26 bytes/element) and the two absmax vectors",
    "states.optimizer_step_temp_bytes (optimizers.torchao_step_temp_bytes)",
    "as TORCHAO_8BIT_STEP_TEMP_BYTES: 26.03 bytes/element for fp32 and bf16 parameters "
    "(tests/plan/test_torchao.py); the eager step (no compile) makes 53-57",
    "exact on the CPU", "not measured on CUDA (Triton's fusion may differ)")


# --------------------------------------------------------------------------------------------
# The end of the backward, and FSDP (memory, sharding)

TIED_EMBEDDING_GRADIENT_COPIES = FittedConstant(
    "TIED_EMBEDDING_GRADIENT_COPIES", 2, "2 x vocabulary x hidden x weight bytes",
    "the very end of the backward with a tied embedding: its dense gradient "
    "(embedding_dense_backward) and AccumulateGrad's sum into lm_head's .grad",
    "memory._forward_backward_peak (tied_embedding_gradient)",
    "simulated step, Qwen2.5-0.5B full bf16, seq 256 (-12% without it; measured 2.0 x V*h*w)",
    "within 2.5%", "no published row")

FSDP_GATHERED_LAYERS = FittedConstant(
    "FSDP_GATHERED_LAYERS", 2, "root + 2 layers of weights",
    "FSDP2: decoder layers whose full weights are gathered at the peak beside the root (the "
    "all-gather output and the parameters copied out of it, or the next layer prefetched)",
    "sharding.sharding_overhead_bytes",
    "bench/multi_process_accuracy.py (gloo, CPU)", "+0.4% to +7.9%",
    "FSDP1 2-GPU Trainer rows (in the fitting source): full -5% to -11%, LoRA -7% to -11%, "
    "QLoRA +21% to +23%")

FSDP_LAYER_GRADIENTS = FittedConstant(
    "FSDP_LAYER_GRADIENTS", 2, "2 layers of gradients",
    "FSDP2: decoder layers' full-size gradients and reduce-scatter input alive in a layer's "
    "backward (one fewer at the first layer: nothing left to prefetch)",
    "sharding.sharding_overhead_bytes, memory._forward_backward_peak",
    "bench/multi_process_accuracy.py (gloo, CPU)", "+0.4% to +7.9%",
    "FSDP1 2-GPU Trainer rows (in the fitting source): full -5% to -11%, LoRA -7% to -11%, "
    "QLoRA +21% to +23%")


# --------------------------------------------------------------------------------------------
# The Trainer's batches (images.batches_alive, images.batches_between_steps): counts read off the
# code, measured exactly with the live-bytes tracker; image data's pixel values make them matter

_BATCHES_MEASURED = ("the live-bytes tracker (lowvram.livebytes, snapshot at the peak) through `lowvram train` "
                     "on a tiny Qwen2.5-VL, one 640 x 480 image a row (1564 x 1176 float32 pixel values a "
                     "micro-batch), full fp32: at the peak 3 micro-batches' pixels at 1 x 1, 5 at 1 x 2, "
                     "9 at 1 x 4 (tests/train/test_accumulation_batches.py)")

PREFETCHED_BATCHES = FittedConstant(
    "PREFETCHED_BATCHES", 1, "1 micro-batch",
    "the micro-batch accelerate's DataLoaderShard fetches before it yields the current one "
    "(accelerate 1.16 data_loader.py L573-590: ``next_batch = next(dataloader_iter)`` before "
    "``yield current_batch``, to know the last batch), beside the step's grad_accum micro-batches "
    "the Trainer holds in ``batch_samples`` (transformers 5.25 trainer.py L1918, L2332-2336 "
    "get_batch_samples). On a CUDA run the prefetched batch is still on the host (send_to_device "
    "runs on it only at its turn, L583-585): an upper bound there by one micro-batch",
    "images.batches_alive, images.batches_between_steps",
    "read off the code; " + _BATCHES_MEASURED,
    "exact on the CPU", "29 held-out image recipes at micro-batch 1 x 2 accumulation, five families (bench/results/plan_fuzz_accumulation_images_heldout_4800-4899.txt): all within target, -2.62% to +1.06%")

STEP_BATCH_LISTS = FittedConstant(
    "STEP_BATCH_LISTS", 2, "2 x grad_accum micro-batches (+ PREFETCHED_BATCHES)",
    "between two optimizer steps, while the Trainer fetches the next step's micro-batches: the "
    "step before's ``batch_samples`` list is rebound only when get_batch_samples returns "
    "(transformers 5.25 trainer.py L1918; its loop variable ``inputs`` holds the last of them too, "
    "L1932), so its grad_accum micro-batches live beside the next step's grad_accum and the one "
    "prefetched after them; the gradients are gone by then (``model.zero_grad()``, L1991: "
    "set_to_none, torch nn/modules/module.py L2948), the weights and optimizer state are not",
    "images.batches_between_steps (image_moment.between_steps_bytes: the moment next_step_batches)",
    "read off the code; " + _BATCHES_MEASURED,
    "exact on the CPU (before: 1 x 2 +19.2% to +25.9% above the plan, 1 x 4 +46.5%)",
    "29 held-out image recipes at micro-batch 1 x 2 accumulation, five families (bench/results/plan_fuzz_accumulation_images_heldout_4800-4899.txt): all within target, -2.62% to +1.06%")
