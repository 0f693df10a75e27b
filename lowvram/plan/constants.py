"""The planner's fitted constants, in one table: every number of the memory model that was set
from measurements (or chosen) rather than derived from the code it models, with what it means,
what it was fitted on, which runs were in sample and which were held out.

The terms (:mod:`lowvram.plan.setup`, :mod:`lowvram.plan.states`, :mod:`lowvram.plan.activations`,
:mod:`lowvram.plan.backward`, :mod:`lowvram.plan.memory`, :mod:`lowvram.plan.moe`,
:mod:`lowvram.plan.sharding`, :mod:`lowvram.plan.request`, :mod:`lowvram.plan.dora`,
:mod:`lowvram.plan.preference`) read their values from here; exact
math (bytes per dtype, int64 indices, a tensor's shape) stays where it is derived. The docs
table, ``docs/constants.md``, is generated from :data:`CONSTANTS` (:func:`markdown_table`;
``python -m lowvram.docs`` or ``make docs`` writes it, and tests/plan/test_constants.py fails
when it drifts). A new fitted constant is one more entry here, with its measurement.

Sources named below: ``bench/plan_accuracy.py`` (real steps of small models on a CPU under the
live-bytes tracker, lowvram.livebytes), the simulated step (lowvram.check.simulate: the real
step on fake tensors), ``bench/plan_fuzz.py`` (held-out fuzz seeds through ``lowvram train``,
results in bench/results/), ``bench/published_accuracy.py`` over ``bench/gpu_truth/`` (published
GPU measurements) and ``bench/multi_process_accuracy.py`` (FSDP2 over gloo).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class FittedConstant:
    """One fitted (or chosen) number of the memory model and where it came from."""

    name: str  # the module-level name below
    value: int | float | Fraction
    shown: str  # the value as the docs write it ("300 MiB", "3/8 of ...")
    meaning: str  # what it counts
    used_in: str  # the term(s) that read it
    fitted_on: str  # the measurements (or the judgement) it was set from
    in_sample: str  # how the fit does on its own measurements
    held_out: str  # how it does on runs it was not fitted on

    def of(self, n: int) -> int:
        """``n`` scaled by this constant, in integers where it is a fraction (``n * p // q``)."""
        v = self.value
        if isinstance(v, Fraction):
            return n * v.numerator // v.denominator
        if isinstance(v, int):
            return n * v
        return int(v * n)


# --------------------------------------------------------------------------------------------
# CUDA overheads (setup.cuda_overheads)

CUDA_CONTEXT_BYTES = FittedConstant(
    "CUDA_CONTEXT_BYTES", 300 * 2**20, "300 MiB",
    "device memory of the CUDA context (libraries, kernels) beyond every tensor",
    "setup.cuda_overheads().context_bytes",
    "median of 3 published nvidia-smi readings right after CUDA init with lazy module loading "
    "(~300 MB in pytorch/pytorch#107667, ~400 MB in #109888, 256 MiB in invoke-ai/InvokeAI#9413; "
    "bench/gpu_truth/cuda_context.yaml)",
    "readings 256-400 MiB",
    "no held-out nvidia-smi row is scored; Unsloth's longest-context-per-card rows (information "
    "only, settings assumed) come out -10% to +1%")

ALLOCATOR_ONCE_FRACTION = FittedConstant(
    "ALLOCATOR_ONCE_FRACTION", 0.015, "0.015 x (weights + optimizer state)",
    "the caching allocator's slack (reserved - allocated) on the bytes allocated once and kept: "
    "the weights loaded at start, the optimizer state made at the first step",
    "setup.cuda_overheads().allocator_parts: loaded_once",
    "a stated bound, not a mean: the largest share of reserved - allocated over allocated in 4 "
    "published pairs read right after the model was loaded, before any step (1.46%, rounded up; "
    "torchtune's own loaders, bf16 and NF4 quantized on the GPU, expandable segments off; "
    "bench/gpu_truth/allocator_pairs.yaml). No such pair is published for transformers + "
    "bitsandbytes or with expandable segments on: both are taken at the same bound",
    "load pairs: 0.14% to 1.46% (least squares 0.9%)",
    "as ALLOCATOR_CHURN_FRACTION (the two are scored together)")

ALLOCATOR_CHURN_FRACTION = FittedConstant(
    "ALLOCATOR_CHURN_FRACTION", 0.23, "0.23 x (tensors - once)",
    "the caching allocator's slack on what churns (activations, logits, gradients, "
    "temporaries: freed and allocated again every step) and the kernels training loads beyond the "
    "initial context, with expandable segments off (a PYTORCH_CUDA_ALLOC_CONF the user set "
    "without them)",
    "setup.cuda_overheads().allocator_parts: churn",
    "least-squares slope, through the origin, of (nvidia-smi peak - peak allocated - context - "
    "ALLOCATOR_ONCE_FRACTION x once) over (peak allocated - once) in 9 single-GPU Hugging Face "
    "Trainer runs of the fms-acceleration benchmark (expandable segments off; once = the plan's "
    "weights and optimizer state, or stated arithmetic for the 4 runs the planner cannot plan; "
    "bench/gpu_truth/fms_acceleration.yaml)",
    "device from the measured allocated: median |error| 4.6%, worst -19.7% / +4.6% (the old single "
    "12% of all tensors: 6.4%, -18.4% / +6.4%)",
    "see bench/results/published_accuracy.txt (held-out reserved rows and overhead checks)")

ALLOCATOR_CHURN_FRACTION_EXPANDABLE = FittedConstant(
    "ALLOCATOR_CHURN_FRACTION_EXPANDABLE", 0.13, "0.13 x (tensors - once)",
    "ALLOCATOR_CHURN_FRACTION with PyTorch's expandable segments on (what `lowvram train` sets "
    "unless PYTORCH_CUDA_ALLOC_CONF is set)",
    "setup.cuda_overheads().allocator_parts: churn",
    "ALLOCATOR_CHURN_FRACTION x 0.55, rounded up: 0.55 is the larger of two published upper bounds "
    "of slack(on) / slack(off) for one run measured both ways, (reserved on - allocated floor) / "
    "(reserved off - allocated floor): 0.455 for torchtune's Llama-3-8B QLoRA "
    "(meta-pytorch/torchtune#1185: 16.39 -> 10.83 GiB reserved, >= 6.19 GiB allocated), 0.54 for "
    "a 2-GPU Qwen2.5-7B run (nvidia-cosmos/cosmos-rl#388: 126.97 -> 96.61 GB, >= 60.81 GB). No "
    "published run gives reserved and peak allocated with expandable segments on",
    "a bound: both runs' slack fell by at least 45%",
    "not scored: every published row with a measured slack ran without expandable segments")

# --------------------------------------------------------------------------------------------
# Host RAM (setup.PROCESS_HOST_BYTES, memory.estimate_memory)

PROCESS_HOST_BYTES = FittedConstant(
    "PROCESS_HOST_BYTES", 2 * 2**30, "2 GiB",
    "host RAM of one training process before any tensor of the run (torch + CUDA libraries)",
    "setup.PROCESS_HOST_BYTES (memory.estimate_memory, check.simulate)",
    "RSS of an idle `import torch` process", "--", "not measured")

CHECKPOINT_SHARD_BYTES = FittedConstant(
    "CHECKPOINT_SHARD_BYTES", 5 * 10**9, "5 GB",
    "host RAM of one checkpoint shard staged while loading (at most the whole model)",
    "memory.estimate_memory (cpu_ram_bytes)",
    "not fitted: transformers' default max_shard_size (5GB) for the shards a hub checkpoint is "
    "saved in", "--", "not measured")

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
    "chunked loss (lowvram.train.loss, chunks of backward.CHUNK_TOKENS): the gradient of all "
    "final hidden states, accumulated chunk by chunk next to the current chunk's (2 x t x h in "
    "the hidden dtype), beside one chunk's logits (LOGITS_LOSS_BYTES)",
    "backward.logits_bytes",
    "bench/plan_accuracy.py chunked cases", "within 2% (the same error as the standard loss)",
    "no published row")

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
# The budget (request.Budget): chosen, not fitted

SAFETY_MARGIN_FRACTION = FittedConstant(
    "SAFETY_MARGIN_FRACTION", 0.05, "5% of the card",
    "memory a plan leaves unused for what the model does not see (other processes on the card, "
    "fragmentation spikes, the first-step warm-up)",
    "request.MARGIN_FRACTION (Budget, vram_needed_bytes)",
    "chosen, not fitted: a judgement", "--", "not measured")

SAFETY_MARGIN_MIN_BYTES = FittedConstant(
    "SAFETY_MARGIN_MIN_BYTES", 256 * 2**20, "at least 256 MiB",
    "the safety margin's floor on a real card", "request.MIN_MARGIN_BYTES",
    "chosen, not fitted: a judgement", "--", "not measured")


@dataclass(frozen=True)
class CardReading:
    """A card's total memory as CUDA reports it on Linux (torch.cuda.mem_get_info's total, the
    "total capacity" of PyTorch's out-of-memory message, deviceQuery's global memory), published."""

    card: str
    sold_gib: int  # the size it is sold as ("12 GB" is 12 GiB of memory chips)
    reported_bytes: int
    source: str  # where the reading was published

    @property
    def fraction(self) -> float:
        return self.reported_bytes / (self.sold_gib * 2**30)


def _gib_shown(gib: float) -> int:
    """A reading shown as "23.65 GiB": the bytes it stands for, rounded down."""
    return int(gib * 2**30)


# Linux readings: Windows (WDDM) shows the size as sold (24.00 GiB for a Titan RTX in
# lllyasviel/FramePack#79, 12.00 GiB for an RTX 3060 in ToTheBeginning/PuLID#13), Linux a little
# less: the driver keeps the rest. nvidia-smi's total is the size as sold on consumer cards
# (12288MiB for an RTX 3060 in geerlingguy/raspberry-pi-pcie-devices#790, 24576MiB for an RTX 3090
# in noonghunna/club-3090#390) and is not what CUDA lets a process allocate.
CARD_READINGS: tuple[CardReading, ...] = (
    CardReading("GeForce RTX 3080 10 GB", 10, _gib_shown(9.78), "zai-org/CogVideo#34 (OOM message)"),
    CardReading("GeForce RTX 3060 12 GB", 12, _gib_shown(11.75), "Kunhao-Liu/StyleGaussian#12 (OOM message)"),
    CardReading("RTX A4000 16 GB", 16, _gib_shown(15.61), "DengKaiCQ/VGGT-Long#6 (OOM message)"),
    CardReading("GeForce RTX 3090 24 GB", 24, _gib_shown(23.70),
                "GaoLii/DSP#10, xiaoxiangAQ/GAS-Net#7 (OOM messages)"),
    CardReading("GeForce RTX 4090 24 GB", 24, _gib_shown(23.61),
                "pinokiofactory/flux-webui#11 (23.61 GiB; 23.64-23.68 in ali-vilab/VGen#104, "
                "MotrixLab/AiOS#29, zai-org/CogVideo#36)"),
    CardReading("GeForce RTX 5090 32 GB", 32, 33_677_180_928,
                "aikitoria/open-gpu-kernel-modules#1 (deviceQuery: 32117 MBytes)"),
    CardReading("A100-SXM4-40GB", 40, 42_298_834_944,
                "bottlerocket-os/bottlerocket#3873 (deviceQuery: 40339 MBytes; nvidia-smi 40960MiB)"),
)

CARD_REPORTED_FRACTION = FittedConstant(
    "CARD_REPORTED_FRACTION", Fraction(39, 40), "97.5% of the size as sold",
    "the share of a card's memory (as sold: --vram 12GB is a 12 GiB card) that CUDA reports as the "
    "card's total on Linux; the budget of --vram NGB",
    "cards.read_vram (Budget.vram_bytes)",
    "the lowest of the published readings in the card table below (RTX A4000: 15.61 of 16 GiB, "
    "97.6%), rounded down",
    "every reading at or above it (97.6%-98.8%)", "--")


# --------------------------------------------------------------------------------------------
# DoRA (plan/dora.py): peft's weight norm and magnitude backward, per element

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
# Preference objectives (plan/preference.py): bytes per logit of ORPO's and SimPO's loss path

_PREFERENCE_FIT = ("TRL 1.16's own loss functions under the live-bytes tracker (2b = 4 rows, s = 128, "
                   "V = 1024; the hidden states' gradient included)")
ORPO_LOGIT_BYTES = FittedConstant(
    "ORPO_LOGIT_BYTES", 18, "18 B / logit",
    "peak bytes per logit of the 2b rows in ORPO's loss path (fp32 logits)",
    "preference.objective_logits_bytes", _PREFERENCE_FIT, "18.7 measured",
    "held-out seeds 12-23 (bench/plan_fuzz.py --preference), re-planned after TRL's disable_dropout "
    "(plan/preference.py policy_setup): -0.8% to +3.4% (seed 12; 16-bit runs' logits measure at the "
    "fp32 count); seeds 40-51: none above its plan by over 0.7%")
SIMPO_LOGIT_BYTES = FittedConstant(
    "SIMPO_LOGIT_BYTES", 16, "16 B / logit",
    "peak bytes per logit of the 2b rows in SimPO's (CPO) loss path (fp32 logits)",
    "preference.objective_logits_bytes", _PREFERENCE_FIT,
    "16.7 measured (a first count of 12 left 5 of 6 seeds up to 29% over their plan)",
    "held-out seeds 12-23, re-planned after TRL's disable_dropout: -2.7% to -0.3%; seeds 40-51: "
    "-1.4% to -0.2%")


# grpo/rloo (plan/grpo.py): the loss's per-token tensors over the completion
GRPO_LOSS_TOKEN_BYTES = FittedConstant(
    "GRPO_LOSS_TOKEN_BYTES", 48, "48 B / completion token",
    "GRPO's and RLOO's loss beside the fused head at the start of the backward: fp32 per-token "
    "tensors over the completion (log ratio, its exp and clamp, the two surrogate terms, their "
    "minimum and the masked sums; TRL 1.16 GRPOTrainer._compute_loss L3020-3200)",
    "grpo.loss_token_bytes", "counted in TRL's _compute_loss: 12 fp32 tensors of b x C",
    "measured with the in-sample GRPO runs (docs/accuracy.md, GRPO)",
    "held-out GRPO runs (docs/accuracy.md)")

CONSTANTS: tuple[FittedConstant, ...] = tuple(
    v for v in dict(globals()).values() if isinstance(v, FittedConstant))


# --------------------------------------------------------------------------------------------
# Step-time factors of the optimizers beyond AdamW's forms (techniques.OPTIMIZER_SLOWDOWN, the
# search's speed key): not memory, but numbers set from measurements like the ones above, so kept
# in the same way: each with the setup it was measured on and how its ratio to AdamW comes out.


@dataclass(frozen=True)
class StepTimeFactor:
    """One optimizer's step time over plain AdamW's, same model, same batch: from a published
    measurement of both where one exists, else an estimate that says so."""

    optimizer: str  # the plan optimizer (lowvram.vocab.OPTIMIZERS)
    value: float  # step time with it / with AdamW (techniques.setup_slowdown multiplies it in)
    measured_on: str  # the published setup: model, batch, hardware, the numbers read
    derived: str  # how the ratio to AdamW comes out of them (or why it is an estimate)
    source: str  # the paper table / README the numbers are read from


def apollo_table7_ratio(step_s: float, adamw_step_s: float, backward_s: float) -> float:
    """A step's time over AdamW's from APOLLO's Table 7 (optimizer step and backward seconds on one
    A100): forward + backward + optimizer step, the forward taken as half the backward (one matmul
    per weight against the backward's two; Kaplan et al. 2020's 2N and 4N FLOPs per token)."""
    fwd_bwd = 1.5 * backward_s
    return (fwd_bwd + step_s) / (fwd_bwd + adamw_step_s)


_APOLLO_T7 = ("APOLLO's Table 7 (Zhu et al. 2025, MLSys, arXiv:2412.05270): optimizer step time on one "
              "A100-80GB at seq_len 1024, LLaMA-1B at batch 16 and LLaMA-7B at batch 4 (the largest AdamW "
              "fits), the mean of 400 steps after 100 of warm-up, projections renewed every 200 steps: "
              "backward 1.069 / 0.712 s; step AdamW 0.036 / 0.173, APOLLO 0.051 / 0.159, GaLore 0.371 / "
              "2.874 s (1B / 7B)")
_APOLLO_SRC = "APOLLO paper Table 7 (sec. 5.3, 'Negligible Optimizer Step Overhead')"
_GALORE_T11 = ("GaLore's Table 11 (Zhao et al. 2024, ICML, arXiv:2403.03507, App. E): pre-training "
               "LLaMA-1B at a token batch of 256, tokens/s with the whole step / per layer: AdamW 1256.98 / "
               "1354.37, 8-bit Adam 1569.89 / 1205.31, 8-bit GaLore 1109.38 / 1019.63")
_GALORE_SRC = "GaLore paper Table 11 and sec. 5 ('Throughput overhead of GaLore')"
_IN_BACKWARD = ("torchtune's README 'Optimization flags' table (pytorch/torchtune bd2a0fc7c): Llama 3.2 3B, "
                "full_finetune_single_device, batch 2 of packed 4096-token sequences, bf16, one A100, with "
                "compile, chunked cross-entropy and activation checkpointing: 7210 tokens/s, 7309 once the "
                "AdamW step is fused into the backward")
_APOLLO_T7_AGAIN = "APOLLO's Table 7 (the setup under apollo_adamw)"
_GALORE_7B = apollo_table7_ratio(2.874, 0.173, 0.712)  # 3.18: SVD renewals dominate at 7B
# bitsandbytes' 8-bit step over the 32-bit one: adamw_8bit's factor (techniques.OPTIMIZER_8BIT)
_BNB_8BIT = 1.03
_GALORE_PER_LAYER = 1109.38 / 1019.63  # 8-bit GaLore's per-layer form, GaLore's Table 11: 1.088
_LOMO_ESTIMATE = (
    "no published step time of both at one batch was found: LOMO's paper sets its throughput against "
    "AdamW and SGD run under ZeRO-3 over RTX 3090s (about 11x for 7B, from the communication LOMO does "
    "without: OpenLMLab/LOMO#2), and AdaLomo's paper (arXiv:2310.10195) was not read here. An estimate: ")
_LOMO_WALK = (
    "; each parameter's hook walks model.named_parameters() (lomo_optim 0.1.1): 291 x 291 checks per "
    "backward for Llama-3.1-8B, 0.23 s on this project's CPU, host work the GPU's queued kernels hide "
    "when the step is GPU-bound; bench/results/optimizer_step_time.txt is the CPU cross-check")

OPTIMIZER_STEP_TIMES: tuple[StepTimeFactor, ...] = (
    StepTimeFactor(
        "adamw_in_backward", round(7210 / 7309, 2), _IN_BACKWARD,
        "7210 / 7309 = 0.986: the per-parameter fused AdamW in the backward is no slower; GaLore's Table 11 "
        "agrees (AdamW per layer 1256.98 / 1354.37 = 0.93 on LLaMA-1B at 256 tokens)",
        "torchtune README ('+ Fuse optimizer step into backward' row)"),
    StepTimeFactor(
        "apollo_adamw", 1.0, _APOLLO_T7,
        f"{apollo_table7_ratio(0.051, 0.036, 1.069):.3f} at 1B, {apollo_table7_ratio(0.159, 0.173, 0.712):.3f} "
        "at 7B (apollo_table7_ratio; without any forward at most 1.014): taken as AdamW's step time",
        _APOLLO_SRC),
    StepTimeFactor(
        "apollo_adamw_layerwise", 1.0, _APOLLO_T7_AGAIN,
        "as apollo_adamw: the same 32-bit step one parameter at a time in the backward, which costs AdamW "
        "nothing (adamw_in_backward); APOLLO's per-layer form itself is not measured",
        _APOLLO_SRC),
    StepTimeFactor(
        "galore_adamw", round(_GALORE_7B, 2), _APOLLO_T7_AGAIN,
        f"{_GALORE_7B:.2f} at 7B (apollo_table7_ratio), where the SVD of every projected matrix each 200 "
        f"steps (about ten minutes at 7B, APOLLO sec. 5.4) dominates; "
        f"{apollo_table7_ratio(0.371, 0.036, 1.069):.2f} at 1B, and GaLore's own Table 11 gives 8-bit "
        "GaLore 1256.98 / 1109.38 = 1.13 at 1B. Taken at 7B: lowvram reaches for GaLore only past what "
        "AdamW's forms fit (3B and up on 24 GB); a larger galore.update_proj_gap renews less often (not "
        "modelled)", _APOLLO_SRC + "; " + _GALORE_SRC),
    StepTimeFactor(
        "galore_adamw_layerwise", round(_GALORE_7B, 2), _APOLLO_T7_AGAIN,
        "as galore_adamw: galore_torch's 32-bit step already runs one parameter at a time; the per-layer "
        "form moves it into the backward, which costs a 32-bit step nothing (adamw_in_backward)",
        _APOLLO_SRC),
    StepTimeFactor(
        "galore_adamw_8bit", round(_GALORE_7B * _BNB_8BIT, 2), _APOLLO_T7_AGAIN,
        "galore_adamw x 1.03 (bitsandbytes' 8-bit step, adamw_8bit's factor): no table measures GaLore "
        "with both moment widths; GaLore's Table 11 (under galore_adamw_8bit_layerwise) has 8-bit GaLore at "
        "1.13 x AdamW on LLaMA-1B",
        _APOLLO_SRC + "; " + _GALORE_SRC),
    StepTimeFactor(
        "galore_adamw_8bit_layerwise", round(_GALORE_7B * _BNB_8BIT * _GALORE_PER_LAYER, 2), _GALORE_T11,
        f"galore_adamw_8bit x {_GALORE_PER_LAYER:.3f}: 8-bit GaLore 1109.38 tokens/s with the whole step, "
        "1019.63 per layer (GaLore sec. 5: 'improving the throughput by 8.8%' without per-layer updates); "
        "bitsandbytes' per-parameter steps cost its 8-bit Adam more (1569.89 / 1205.31 = 1.30)",
        _GALORE_SRC),
    StepTimeFactor(
        "lomo", 1.05, "not measured at one batch against AdamW",
        _LOMO_ESTIMATE + "an SGD step per parameter on fp32 copies inside the backward (AdamW's in-backward "
        "form costs nothing: adamw_in_backward)" + _LOMO_WALK,
        "estimate (lomo_optim's source); OpenLMLab/LOMO#2"),
    StepTimeFactor(
        "adalomo", 1.1, "not measured at one batch against AdamW",
        _LOMO_ESTIMATE + "LOMO's hook with Adafactor's factored second moment and a norm per update "
        "(AdaLomo's step), taken at twice LOMO's cost; GaLore's Table 11 measured transformers' "
        "Adafactor at 2.2 x AdamW (1256.98 / 581.02) at 256 tokens, where the step weighs most"
        + _LOMO_WALK.replace("is the CPU cross-check", "cannot cross-check it (AdaLomo needs CUDA)"),
        "estimate (lomo_optim's source); GaLore paper Table 11"),
    StepTimeFactor(
        "adamw_torch_8bit", round(3200 / 2900, 2),
        "torchao's Llama-2-7B full-bf16 fine-tune on one A100 with torchtune 52d1b838: 3200 tokens/s with "
        "fused AdamW, 2900 with ao's 8-bit AdamW", "3200 / 2900 = 1.10; the first step's compiles (once "
        "per shape) are not in the factor", "pytorch/ao torchao/optim/README.md"),
    StepTimeFactor(
        "adamw_torch_4bit", round(3200 / 2900, 2),
        "the same benchmark: 2900 tokens/s with ao's 4-bit AdamW", "3200 / 2900 = 1.10, as adamw_torch_8bit",
        "pytorch/ao torchao/optim/README.md"),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """docs/constants.md: the intro and one row per constant of :data:`CONSTANTS`."""
    head = [
        "# Fitted constants",
        "",
        "<!-- generated from lowvram/plan/constants.py by `python -m lowvram.docs` (`make docs`);",
        "     tests/plan/test_constants.py fails when this file drifts from the code -->",
        "",
        "Every constant of the planner that was set from measurements (or chosen) rather than derived",
        "from the code it models: the memory model, `lowvram/plan/memory.py` and the modules of its",
        "terms, which read each value from `lowvram/plan/constants.py`. Exact math (bytes per dtype,",
        "int64 indices, a tensor's shape) is not listed: it stays where it is derived, with its source.",
        "",
        "| constant | value | what it means | used in | fitted on | in sample | held out |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [f"| `{c.name}` | {_cell(c.shown)} | {_cell(c.meaning)} | `{c.used_in}` | {_cell(c.fitted_on)} "
            f"| {_cell(c.in_sample)} | {_cell(c.held_out)} |" for c in CONSTANTS]
    cards = [
        "", "## Cards as sold and as CUDA reports them", "",
        "What `CARD_REPORTED_FRACTION` rests on: published Linux readings of a card's total memory",
        "(PyTorch's out-of-memory message, deviceQuery). `--vram 12GB` is a card sold as 12 GB,",
        f"12 GiB of memory, planned as {float(CARD_REPORTED_FRACTION.value):.1%} of it; `12000MB` or "
        "`11.5GiB` are read exactly.", "",
        "| card | sold as | CUDA reports | share | source |", "|---|---|---|---|---|",
    ] + [f"| {r.card} | {r.sold_gib} GiB | {r.reported_bytes / 2**30:.2f} GiB | {r.fraction:.1%} "
         f"| {_cell(r.source)} |" for r in CARD_READINGS]
    steps = [
        "", "## Step-time factors of the optimizers", "",
        "Not memory: each optimizer's step time over plain AdamW's, same model, same batch (the search",
        "ranks plans of one kind by it, `lowvram/plan/techniques.py`; it does not predict wall time).",
        "Each rests on a published measurement of both, or is an estimate that says so;",
        "`bench/optimizer_step_time.py` cross-checks them on the CPU (not a GPU number).", "",
        "| optimizer | factor | measured on | how the ratio to AdamW comes out | source |", "|---|---|---|---|---|",
    ] + [f"| {f.optimizer} | {f.value:g} | {_cell(f.measured_on)} | {_cell(f.derived)} | {_cell(f.source)} |"
         for f in OPTIMIZER_STEP_TIMES]
    return "\n".join(head + rows + cards + steps) + "\n"


__all__ = ["CARD_READINGS", "CONSTANTS", "OPTIMIZER_STEP_TIMES", "CardReading", "FittedConstant", "StepTimeFactor",
           "apollo_table7_ratio", "markdown_table"] + [c.name for c in CONSTANTS]
