"""One technique vocabulary: the names of the techniques, the values each takes, the on/off words,
and the few facts that hang on a value (its dtype, its Trainer name). The recipe schema, the
planner, the CLI and training all read these; none spells them again.

The bottom of the package: imports nothing. One canonical name per technique, the same in YAML,
``--help``, plan output and code.
"""

from __future__ import annotations

# The eight memory techniques, one canonical name each (the same in YAML, --help, plan output
# and code), plus two first-class knobs.
TECHNIQUES = (
    "mixed_precision",
    "gradient_checkpointing",
    "gradient_accumulation",
    "lora",
    "quantization",
    "optimizer",
    "offload",
    "activation_offload",
    "tiled_mlp",
)
KNOBS = ("attention", "loss")
CANONICAL = TECHNIQUES + KNOBS
# Each as the Plan (and a run's plan.json) names its field: accumulation is the Plan's grad_accum.
PLAN_KEYS = tuple({"gradient_accumulation": "grad_accum"}.get(n, n) for n in CANONICAL)

# The values a Plan holds.
# bf16/fp16: weights stored and trained in 16 bit; *-mixed: fp32 weights + autocast; fp32: none.
PRECISIONS = ("bf16", "fp16", "bf16-mixed", "fp16-mixed", "fp32")
QUANTIZATIONS = ("none", "nf4", "nf4-dq", "fp4", "int8")  # a quantized base needs LoRA
# FSDP shards a 4-bit base stored in the compute dtype (peft's QLoRA + FSDP guide), never int8.
FSDP_QUANTIZATIONS = ("none", "nf4", "nf4-dq", "fp4")
# Optimizer -> the Trainer's TrainingArguments.optim (transformers OptimizerNames).
TRAINER_OPTIMIZERS = {
    "adamw": "adamw_torch_fused",  # the step the planner models: in place, no temporaries
    "adamw_8bit": "adamw_bnb_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit",
    "paged_adamw_32bit": "paged_adamw_32bit",
    "adafactor": "adafactor",
    "sgd": "sgd",
    # GaLore (Zhao et al. 2024; galore-torch, the `galore` extra): AdamW on each decoder Linear's
    # gradient projected to `galore.rank` (lowvram.plan.memory.optimizers); full fine-tuning, one GPU
    "galore_adamw": "galore_adamw",
    # its 8-bit state (galore_torch AdamW8bit, a bitsandbytes Optimizer2State: blockwise uint8
    # moments; on the CPU through lowvram.train.build.galore_cpu) and its layerwise forms (one
    # optimizer per parameter stepped in a post-accumulate-grad hook: transformers
    # trainer_optimizer._setup_low_rank_optimizer), the Trainer's own optim names
    "galore_adamw_8bit": "galore_adamw_8bit",
    "galore_adamw_layerwise": "galore_adamw_layerwise",
    "galore_adamw_8bit_layerwise": "galore_adamw_8bit_layerwise",
    # LOMO (Lv et al. 2024) and AdaLomo (Lv et al. 2024; lomo-optim, the `lomo` extra): SGD, or
    # AdaLomo's factored second moment, fused into the backward by each parameter's gradient hook
    # (lomo_optim.Lomo / AdaLomo; the Trainer calls fused_backward: lowvram.plan.memory.optimizers)
    "lomo": "lomo",
    "adalomo": "adalomo",
    # torchao's low-bit AdamW (torchao.optim AdamW4bit / AdamW8bit, the `torchao` extra): block-wise
    # quantized moments (Li et al. 2023; Dettmers et al. 2022), the step compiled by torch.compile
    "adamw_torch_4bit": "adamw_torch_4bit",
    "adamw_torch_8bit": "adamw_torch_8bit",
    # APOLLO (Zhu et al. 2025; apollo-torch, the `apollo` extra): AdamW moments of each decoder
    # Linear's gradient projected by a random rank-`galore.rank` matrix, scaling the raw gradient
    # channel-wise; wired by the Trainer like GaLore (optim_target_modules, its layerwise form)
    "apollo_adamw": "apollo_adamw",
    "apollo_adamw_layerwise": "apollo_adamw_layerwise",
    # AdamW stepped in the backward, one parameter at a time (PyTorch's optimizer-in-backward
    # pattern, lowvram.train.build.in_backward): the Trainer's fused AdamW per parameter
    "adamw_in_backward": "adamw_torch_fused",
}
OPTIMIZERS = tuple(TRAINER_OPTIMIZERS)
# Optimizers that come from bitsandbytes (as the quantizations other than none do), and those of
# them that keep 8-bit state.
BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")
OPTIMIZERS_8BIT = ("adamw_8bit", "paged_adamw_8bit")
# APOLLO's forms: GaLore's Trainer wiring, a random projection (lowvram.plan.memory.optimizers).
APOLLO_OPTIMIZERS = ("apollo_adamw", "apollo_adamw_layerwise")
# Optimizers that project the gradients of the decoder Linears (GaLore, APOLLO): full fine-tuning only.
PROJECTED_OPTIMIZERS = ("galore_adamw", "galore_adamw_8bit", "galore_adamw_layerwise",
                        "galore_adamw_8bit_layerwise") + APOLLO_OPTIMIZERS
# GaLore with bitsandbytes-style 8-bit moments (galore_torch AdamW8bit).
GALORE_8BIT_OPTIMIZERS = ("galore_adamw_8bit", "galore_adamw_8bit_layerwise")
# Where they step: where bitsandbytes 0.50 registers optimizer_update_8bit_blockwise, CUDA and the
# CPU (backends/cpu/ops.py; galore_torch's torch.cuda.synchronize() there: lowvram.train.build.galore_cpu).
EIGHT_BIT_DEVICES = ("cuda", "cpu")
# Stepped one parameter at a time inside the backward (transformers LayerWiseDummyOptimizer):
# gradient accumulation 1, no gradient clipping, one process.
LAYERWISE_OPTIMIZERS = ("galore_adamw_layerwise", "galore_adamw_8bit_layerwise", "apollo_adamw_layerwise")
# LOMO's forms: each parameter stepped by its own gradient hook (lomo_optim), full fine-tuning only.
LOMO_OPTIMIZERS = ("lomo", "adalomo")
# torchao's low-bit AdamW (lowvram.plan.memory.optimizers): one torch.compile'd step per parameter.
TORCHAO_OPTIMIZERS = ("adamw_torch_4bit", "adamw_torch_8bit")
# A plain optimizer stepped per parameter in its post-accumulate-grad hook (lowvram.train.build.in_backward).
FUSED_BACKWARD_OPTIMIZERS = ("adamw_in_backward",)
# Every optimizer that steps inside the backward: gradient accumulation 1, no clipping, one process.
IN_BACKWARD_OPTIMIZERS = LAYERWISE_OPTIMIZERS + LOMO_OPTIMIZERS + FUSED_BACKWARD_OPTIMIZERS
# Optimizers that train full weights only (no LoRA, no DeepSpeed/FSDP).
# optimizer any-that-fits: auto, and the search may also pick the optimizers that change the
# training algorithm (GaLore/APOLLO's projected moments, LOMO/AdaLomo's SGD); plain auto keeps to
# the AdamW family (AdamW, 8-bit, 4-bit, paged, offloaded, stepped in the backward).
ANY_OPTIMIZER = "any-that-fits"
FULL_ONLY_OPTIMIZERS = PROJECTED_OPTIMIZERS + LOMO_OPTIMIZERS + FUSED_BACKWARD_OPTIMIZERS
# Optimizer -> (the pyproject extra it needs, the module that extra installs).
OPTIMIZER_EXTRAS = {o: ("galore", "galore_torch") for o in PROJECTED_OPTIMIZERS} | {
    o: ("apollo", "apollo_torch") for o in APOLLO_OPTIMIZERS} | {
    o: ("lomo", "lomo_optim") for o in LOMO_OPTIMIZERS} | {o: ("torchao", "torchao") for o in TORCHAO_OPTIMIZERS}
# Offload or shard: optimizer/full on one GPU (DeepSpeed ZeRO-Offload/-Infinity), the rest with
# several GPUs (DeepSpeed ZeRO-2/3, FSDP2), "-offload" adding CPU offload.
OFFLOADS = ("none", "optimizer", "full", "zero2", "zero2-offload", "zero3", "zero3-offload",
            "fsdp", "fsdp-offload")
ATTENTIONS = ("sdpa", "eager", "flash_attention_2")
# standard: transformers' loss over the full logits; chunked: lowvram.train.build.loss (any device);
# fused: Liger Kernel's fused linear cross-entropy (CUDA, with the `liger` extra installed).
LOSSES = ("standard", "chunked", "fused")

# What a recipe may write instead of a value: auto (the planner decides), on, off.
SWITCH = ("auto", "on", "off")
# true/false and the YAML 1.1 words yes/no/y/n mean on/off for a technique.
ON_OFF_WORDS = {"yes": "on", "y": "on", "no": "off", "n": "off", "on": "on", "off": "off"}
# The value `on` stands for, per technique that has one.
ON_VALUES = {
    "quantization": "nf4-dq",
    "optimizer": "adamw_8bit",
    "offload": "optimizer",
}
# The value `off` stands for (also what a technique is without a memory model to choose it).
OFF_VALUES = {
    "mixed_precision": "fp32",
    "quantization": "none",
    "optimizer": "adamw",
    "offload": "none",
}


def on_off(value, on, off):
    """``value`` with the words on/off replaced by ``on``/``off``; any other value unchanged."""
    return {"on": on, "off": off}.get(value, value)


# Dtype names (torch attribute names), as model.dtype and `lowvram merge --dtype` write them.
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}  # bytes per element of each
# Precision -> dtype the weights are stored in (*-mixed keeps fp32 master weights).
WEIGHT_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "bf16-mixed": "float32",
                "fp16-mixed": "float32", "fp32": "float32"}
# Precision -> dtype the matmuls run in (autocast; a 4-bit base's compute dtype).
COMPUTE_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "bf16-mixed": "bfloat16",
                 "fp16-mixed": "float16", "fp32": "float32"}
