"""The technique table: the eight memory techniques plus the attention kernel and the loss, one
canonical name each, the settings each implies, what it saves, and what it costs in step time
(``slowdown``, step time relative to not using it), with the source.

``tier`` is each technique's place in the explanation a plan prints (:mod:`lowvram.plan.choose.ladder`
climbs them in that order) and groups the alternatives shown; it does not order the search,
which ranks candidates by what the plan gives up, then speed (:func:`lowvram.plan.choose.search.rank`).

The speed factors are rules of thumb from the cited sources, not measurements of this code; they
rank plans, they do not predict wall time. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lowvram.plan.constants import OPTIMIZER_STEP_TIMES
from lowvram.plan.memory.tiled import tiled_mlp_slowdown


@dataclass(frozen=True)
class Technique:
    """One technique at one value: the setting it applies and what it costs."""

    name: str  # canonical technique name (one of lowvram.vocab.CANONICAL)
    value: object  # the value of that technique when this rung is used
    tier: int  # its place in the explained ladder (plan/choose/ladder.py); not the search's order
    slowdown: float  # step time with / without it (1.0 = free; < 1 = faster)
    saves: str  # the memory component(s) it shrinks
    source: str  # where the slowdown figure comes from
    settings: dict = field(default_factory=dict)  # RunSetup fields it implies

    @property
    def cost_percent(self) -> int:
        return round((self.slowdown - 1.0) * 100)


# Tiers, cheapest first (issue 4): free precision/kernels < smaller micro-batch < recomputation
# < 8-bit optimizer state < training adapters only < a quantized base < offload to the CPU.
TIER_FREE = 0
TIER_MICRO_BATCH = 1
TIER_CHECKPOINTING = 2
TIER_OPTIMIZER = 3
TIER_LORA = 4
TIER_QUANTIZATION = 5
TIER_OFFLOAD = 6

MIXED_PRECISION = Technique(
    "mixed_precision", "bf16", TIER_FREE, 1.0, "weights, gradients, optimizer, activations",
    "16-bit tensor-core math is faster than fp32, not slower (NVIDIA, 'Train With Mixed "
    "Precision' user guide; Micikevicius et al. 2018)",
    {"precision": "bf16"},
)
SDPA = Technique(
    "attention", "sdpa", TIER_FREE, 1.0, "activations (no s x s attention matrix)",
    "PyTorch scaled_dot_product_attention (flash / memory-efficient kernels) is faster than "
    "eager attention (PyTorch 2.0 SDPA docs; Dao et al. 2022, FlashAttention)",
    {"attention": "sdpa"},
)
CHUNKED_LOSS = Technique(
    "loss", "chunked", TIER_FREE, 1.02, "logits (no full fp32 copy of b x s x V)",
    "chunked cross-entropy recomputes nothing expensive; Liger Kernel's fused linear "
    "cross-entropy (Hsu et al. 2024, arXiv:2410.10989) keeps throughput; ~1-3% for a plain "
    "chunked loop (our estimate)",
    {"loss": "chunked"},
)
FUSED_LOSS = Technique(
    "loss", "fused", TIER_FREE, 1.0, "logits (one chunk, in the compute dtype; gradients made in forward)",
    "Liger Kernel's fused linear cross-entropy keeps throughput while cutting the loss' memory "
    "(Hsu et al. 2024, arXiv:2410.10989, sec. 4); taken as free",
    {"loss": "fused"},
)
MICRO_BATCH = Technique(
    "gradient_accumulation", "on", TIER_MICRO_BATCH, 1.0, "activations, logits (per micro-batch)",
    "same effective batch, same maths; only GPU utilisation drops when a micro-batch holds few "
    "tokens (see micro_batch_slowdown)",
    {},
)
GRADIENT_CHECKPOINTING = Technique(
    "gradient_checkpointing", True, TIER_CHECKPOINTING, 1.25, "activations",
    "one extra forward per step: ~20% (Hugging Face 'Efficient training on a single GPU') to "
    "~33% (Chen et al. 2016, 'Training Deep Nets with Sublinear Memory Cost')",
    {"gradient_checkpointing": True},
)
ACTIVATION_OFFLOAD = Technique(
    "activation_offload", True, TIER_CHECKPOINTING, 1.1,
    "activations (checkpointed layer inputs moved to pinned host RAM)",
    "every layer's input crosses PCIe twice per step, on the compute stream in transformers' "
    "offload (save_on_cpu; AWS SageMaker's model-parallel docs: PyTorch's native activation "
    "offloading leaves the GPU idle during the fetch); Unsloth/NVIDIA measured 207-279 ms per step "
    "for the serialized reload of 8B-14B QLoRA checkpoints at 55.7 GB/s, Unsloth's overlapped "
    "offload ~1% (unslothai/unsloth README); 2 x layers x t x h x 2 bytes over ~25 GB/s PCIe 4 "
    "against the step's compute gives ~5-10% (our estimate, the upper end taken)",
    {"activation_offload": True, "gradient_checkpointing": True},
)
TILED_MLP = Technique(
    "tiled_mlp", True, TIER_CHECKPOINTING, 1.2,
    "activations (each layer's MLP tensors: one shard of ceil(seq_len / hidden) at a time)",
    "the MLP's forward runs once more per step (DeepSpeed TiledMLP's docstring; '25% more "
    "computation' with checkpointing, DeepSpeed PR #7664), weighted by the MLP's share of a "
    "block's matmuls: ~1.2 at Llama shapes (lowvram.plan.memory.tiled.tiled_mlp_slowdown)",
    {"tiled_mlp": True},
)
OPTIMIZER_8BIT = Technique(
    "optimizer", "adamw_8bit", TIER_OPTIMIZER, 1.03, "optimizer (2 bytes/param instead of 8)",
    "block-wise 8-bit Adam matches 32-bit Adam's results at about the same speed (Dettmers et "
    "al. 2022, '8-bit Optimizers via Block-wise Quantization'); a few % with bitsandbytes",
    {"optimizer": "adamw_8bit"},
)
LORA = Technique(
    "lora", True, TIER_LORA, 0.8, "gradients, optimizer (adapters only)",
    "no weight gradients or optimizer state for the base: ~25% faster per step on GPT-3 "
    "(Hu et al. 2021, LoRA, sec. 4.2); trains adapters, not the model",
    {"lora": True},
)
QUANTIZATION_4BIT = Technique(
    "quantization", "nf4-dq", TIER_QUANTIZATION, 1.35, "weights (about 4.13 bits/param)",
    "each 4-bit layer is dequantized in forward and backward: QLoRA is ~30-40% slower than "
    "LoRA on a bf16 base (Dettmers et al. 2023, QLoRA; Hugging Face bitsandbytes 4-bit blog)",
    {"quantization": "nf4-dq", "lora": True},
)
OFFLOAD_OPTIMIZER = Technique(
    "offload", "optimizer", TIER_OFFLOAD, 1.7, "optimizer, master weights (moved to CPU RAM)",
    "optimizer step on the CPU plus PCIe transfers each step (Ren et al. 2021, ZeRO-Offload); "
    "~1.5-2x at small batch (our estimate)",
    {"offload": "optimizer"},
)
OFFLOAD_FULL = Technique(
    "offload", "full", TIER_OFFLOAD, 4.0, "weights, optimizer (parameters streamed from CPU)",
    "every layer's weights cross PCIe twice per step (Rajbhandari et al. 2021, ZeRO-Infinity); "
    "several times slower (our estimate)",
    {"offload": "full"},
)

# The ladder in the order the chooser climbs it (and report.py shows it).
LADDER = (
    MIXED_PRECISION, SDPA, CHUNKED_LOSS, MICRO_BATCH, GRADIENT_CHECKPOINTING, ACTIVATION_OFFLOAD,
    TILED_MLP, OPTIMIZER_8BIT, LORA, QUANTIZATION_4BIT, OFFLOAD_OPTIMIZER, OFFLOAD_FULL,
)

# Step-time factors of values a user can fix (relative to the default value of that technique).
OPTIMIZER_SLOWDOWN = {
    "adamw": 1.0, "adamw_8bit": 1.03, "paged_adamw_8bit": 1.05, "paged_adamw_32bit": 1.03,
    "adafactor": 1.05, "sgd": 0.98,
    # GaLore, APOLLO, LOMO, AdaLomo, torchao's low-bit AdamW and AdamW in the backward: each from
    # a published same-batch measurement against AdamW (or an estimate that says so), with the setup
    # and the arithmetic, in the constants table (constants.OPTIMIZER_STEP_TIMES, docs/constants.md)
    **{f.optimizer: f.value for f in OPTIMIZER_STEP_TIMES},
}
QUANTIZATION_SLOWDOWN = {
    "none": 1.0, "nf4": 1.35, "nf4-dq": 1.35, "fp4": 1.35,
    # LLM.int8 mixed-precision decomposition is slow (Dettmers et al. 2022, LLM.int8()).
    "int8": 1.5,
}
OFFLOAD_SLOWDOWN = {
    "none": 1.0, "optimizer": 1.7, "full": 4.0,
    # Sharding across GPUs costs communication, offload to CPU costs PCIe (ZeRO papers).
    "zero2": 1.1, "zero3": 1.2, "fsdp": 1.2, "zero2-offload": 1.8, "zero3-offload": 4.0,
    "fsdp-offload": 4.0,
}
LOSS_SLOWDOWN = {"standard": 1.0, "chunked": CHUNKED_LOSS.slowdown, "fused": FUSED_LOSS.slowdown}
ATTENTION_SLOWDOWN = {"sdpa": 1.0, "flash_attention_2": 1.0, "eager": 1.3}
PRECISION_SLOWDOWN = {
    "bf16": 1.0, "fp16": 1.0, "bf16-mixed": 1.05, "fp16-mixed": 1.05,
    # fp32 has no tensor-core path on most cards (NVIDIA mixed precision guide): ~2-3x slower.
    "fp32": 2.5,
}


def fused_loss_unavailable(budget, model) -> str | None:
    """Why Liger Kernel's fused linear cross-entropy cannot run under ``budget`` (a request.Budget)
    for ``model`` (a ModelSpec); None when it can. It needs CUDA (Triton kernels), the `liger`
    extra, and a model type Liger patches (``model`` None: an architecture not read, whose type is
    not known before training loads it: only CUDA and the extra are checked)."""
    if budget.device != "cuda":
        return "Liger Kernel's fused loss needs CUDA"
    if "liger" in budget.missing_extras:
        return "Liger Kernel is not installed (pip install 'lowvram[liger]')"
    if model is not None and model.model_type not in LIGER_MODEL_TYPES:
        return f"Liger Kernel does not patch {model.model_type} models"
    return None


def fused_loss_fallback(asked_by: str, budget, model) -> str:
    """The reason of a fixed ``fused`` loss that cannot run here (fused_loss_unavailable): the
    chunked loss runs instead (lowvram.plan.choose.search.loss_options)."""
    return (f"chunked: {asked_by} asked for fused, but {fused_loss_unavailable(budget, model)}; "
            "the chunked loss runs instead")


# flash-attn 2 runs on Ampere or newer (compute capability 8.0) and on fp16/bf16 tensors only: its
# kernels raise "FlashAttention only supports Ampere GPUs or newer." and "FlashAttention only
# support fp16 and bf16 data type" at the first forward (flash-attn csrc/flash_attn/flash_api.cpp).
# Under *-mixed, transformers casts fp32 q/k/v to the autocast dtype first
# (transformers/integrations/flash_attention.py get_target_dtype); in pure fp32 there is none.
FLASH_ATTENTION_MIN_CAPABILITY = (8, 0)


def flash_attention_unavailable(budget, precision: str) -> str | None:
    """Why flash_attention_2 cannot run under ``budget`` (a request.Budget) at ``precision``; None
    when it can. A card not queried (--vram) counts as bf16-capable, i.e. Ampere or newer (the
    budget says so); a detected card's bf16 is compute capability >= 8.0 (lowvram.hardware)."""
    if budget.device != "cuda":
        return f"flash-attn runs on CUDA GPUs only (this is a {budget.device.upper()} run)"
    cc = budget.compute_capability
    if (cc is not None and tuple(cc) < FLASH_ATTENTION_MIN_CAPABILITY) or (cc is None and not budget.bf16):
        have = f"compute capability {cc[0]}.{cc[1]}" if cc else "a card without bf16"
        return f"flash-attn 2 needs an Ampere or newer GPU (compute capability 8.0), this is {have}"
    if precision == "fp32":
        return "precision fp32 keeps q, k and v in fp32, and flash-attn computes in fp16/bf16 only"
    return None


def flash_attention_hint(budget, precision: str, spell=lambda key, value: f"{key} {value}") -> str:
    """What to set instead of an unavailable flash_attention_2; ``spell(key, value)`` writes a
    setting as the caller's user writes it (a flag, a recipe key)."""
    sdpa = spell("attention", "sdpa")
    if budget.device == "cuda" and precision == "fp32" and flash_attention_unavailable(budget, "bf16") is None:
        return (f"use a 16-bit precision ({spell('mixed_precision', 'bf16')}, bf16-mixed or fp16-mixed) "
                f"with it, or {sdpa} (PyTorch's kernels, any dtype)")
    return f"use {sdpa} (PyTorch's flash/memory-efficient kernels where the card has them)"


# Model types liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN patches (v0.8.2),
# among those the planner models; any other type would silently keep the full-logits loss.
LIGER_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2",
                     "gemma3_text", "phi3", "olmo2", "smollm3", "granite", "glm4")


# Below this many tokens per micro-batch a GPU is not kept busy (our rule of thumb).
_FULL_UTILISATION_TOKENS = 2048


def micro_batch_slowdown(micro_batch_size: int, seq_len: int, largest_micro_batch: int) -> float:
    """Step-time factor of running ``micro_batch_size`` instead of ``largest_micro_batch``.

    Accumulation keeps the maths; what changes is utilisation, modelled as
    (tokens / 2048) ** 0.1 below 2048 tokens (our rule of thumb: a halving costs ~7%).
    """

    def utilisation(tokens: int) -> float:
        return min(1.0, (max(tokens, 1) / _FULL_UTILISATION_TOKENS) ** 0.1)

    return utilisation(largest_micro_batch * seq_len) / utilisation(micro_batch_size * seq_len)


def setup_slowdown(setup, largest_micro_batch: int) -> float:
    """Step time of a RunSetup relative to bf16 + SDPA + full fine-tuning on the GPU."""
    factor = PRECISION_SLOWDOWN.get(setup.precision, 1.0)
    factor *= ATTENTION_SLOWDOWN.get(setup.attention, 1.0)
    factor *= LOSS_SLOWDOWN.get(setup.loss, 1.0)
    factor *= micro_batch_slowdown(setup.micro_batch_size, setup.seq_len, largest_micro_batch)
    factor *= GRADIENT_CHECKPOINTING.slowdown if setup.gradient_checkpointing else 1.0
    factor *= ACTIVATION_OFFLOAD.slowdown if setup.activation_offload else 1.0
    factor *= tiled_mlp_slowdown(setup) if getattr(setup, "tiled_mlp", False) else 1.0
    factor *= OPTIMIZER_SLOWDOWN.get(setup.optimizer, 1.0)
    factor *= LORA.slowdown if setup.lora else 1.0
    factor *= QUANTIZATION_SLOWDOWN.get(setup.quantization, 1.0)
    factor *= OFFLOAD_SLOWDOWN.get(setup.offload, 1.0)
    return factor


def setup_tier(setup) -> int:
    """The highest ladder tier a RunSetup uses (0 = only free techniques)."""
    tier = TIER_FREE
    if setup.gradient_checkpointing or getattr(setup, "tiled_mlp", False):
        tier = TIER_CHECKPOINTING
    if setup.optimizer != "adamw":
        tier = TIER_OPTIMIZER
    if setup.lora:
        tier = TIER_LORA
    if setup.quantization != "none":
        tier = TIER_QUANTIZATION
    if setup.offload != "none":
        tier = TIER_OFFLOAD
    return tier
