"""A training run as the memory model sees it (RunSetup), its estimate (MemoryEstimate), the
CUDA overheads beyond tensors, and which optimizer each offload allows. The bottom of plan/'s
memory model: the modules of the terms (states, activations, backward, sharding) build on it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import lru_cache, wraps
from operator import attrgetter

from lowvram.plan import constants as fitted
from lowvram.plan.model.models import ModelSpec
from lowvram.vocab import BNB_OPTIMIZERS

BREAKDOWN_KEYS = ("weights", "gradients", "optimizer", "activations", "logits", "cuda_context",
                  "allocator")

# DeepSpeed offloads that run the optimizer on the CPU. There DeepSpeed's own CPU Adam takes the
# place of the Trainer's optimizer (accelerate.utils.deepspeed.map_pytorch_optim_to_deepspeed,
# called from Accelerator._prepare_deepspeed when offload_optimizer is set): only adamw keeps
# its meaning (a bitsandbytes 8-bit AdamW would silently become Adam with L2 decay).
DEEPSPEED_CPU_OPTIMIZER = ("optimizer", "full", "zero2-offload", "zero3-offload")


# FSDP2 shards every parameter as a torch DTensor; bitsandbytes' optimizers (8-bit and paged,
# vocab.BNB_OPTIMIZERS) call their own kernels (torch.ops.bitsandbytes.optimizer_update_8bit_blockwise
# / optimizer_update_32bit, bitsandbytes/optim/optimizer.py and functional.py) on the shards, and
# bitsandbytes 0.50 registers no DTensor sharding rule for them: the first optimizer step raises
# ("got mixed torch.Tensor and DTensor" on GPUs, "does not have a sharding strategy registered"
# in one process; tests/train/test_fsdp2_step.py runs it). torch's optimizers take DTensors.
FSDP_OFFLOADS = ("fsdp", "fsdp-offload")


def offload_conflict(optimizer: str, offload: str) -> str | None:
    """Why ``optimizer`` cannot run under ``offload`` (None when it can)."""
    if offload in DEEPSPEED_CPU_OPTIMIZER and optimizer != "adamw":
        return (f"offload {offload} runs DeepSpeed's CPU Adam on the CPU; optimizer {optimizer} "
                "cannot run there")
    if offload in FSDP_OFFLOADS and optimizer in BNB_OPTIMIZERS:
        return (f"optimizer {optimizer} (bitsandbytes) cannot step FSDP2's sharded parameters "
                "(bitsandbytes has no DTensor support: the first optimizer step fails)")
    return None


# The rules between techniques that hold for every run, stated once: the recipe schema, the plan
# request, the fixed defaults and the memory model each ask here and add their own hint.
def quantization_conflict(quantization: str, lora: bool) -> str | None:
    """Why ``quantization`` cannot train without LoRA (None when it can): bitsandbytes' 4/8-bit
    weights hold no gradient, only adapters on top of them train (QLoRA)."""
    if quantization not in ("none", "off", "auto") and not lora:
        return f"quantization {quantization} needs lora: a quantized base cannot be trained directly"
    return None


def activation_offload_conflict(activation_offload: bool, gradient_checkpointing: bool) -> str | None:
    """Why activation offload cannot run (None when it can): transformers' offload moves the
    checkpointed layer inputs to host RAM, and without checkpointing there are none."""
    if activation_offload and not gradient_checkpointing:
        return ("activation_offload needs gradient_checkpointing: it moves the checkpointed layer "
                "inputs to host RAM")
    return None


def tiled_mlp_conflict(tiled_mlp: bool, is_moe: bool) -> str | None:
    """Why the tiled MLP cannot run (None when it can): lowvram tiles a dense MLP module (one
    function of the hidden states, lowvram.train.build.tiled_mlp); a mixture of experts routes each
    token to its own experts, which lowvram does not tile."""
    if tiled_mlp and is_moe:
        return "tiled_mlp needs a dense MLP: this model's MLP is a mixture of experts"
    return None


def offload_conflict_hint(optimizer: str, offload: str, spell=lambda key, value: f"{key} {value}") -> str:
    """What to set instead, for an ``offload_conflict``; ``spell(key, value)`` writes a setting
    as the caller's user writes it (a flag, a recipe key)."""
    if offload in FSDP_OFFLOADS:
        return (f"use {spell('optimizer', 'adamw')} with {spell('offload', offload)} (FSDP2 shards "
                f"AdamW's state over the GPUs already), or keep {optimizer} with {spell('offload', 'none')} (DDP)")
    if optimizer in BNB_OPTIMIZERS:
        return f"use {spell('optimizer', 'adamw')} with it (DeepSpeed's CPU Adam runs in its place)"
    return (f"use {spell('optimizer', 'adamw')} with it, or {spell('offload', 'fsdp-offload')} (FSDP2 "
            "keeps your optimizer, its step on the CPU)")


@dataclass(frozen=True)
class GrpoSetup:
    """What a grpo/rloo step's memory depends on beyond an SFT setup (RunSetup.grpo; the terms:
    lowvram.plan.memory.grpo). micro_batch_size counts completions (TRL's per_device_train_batch_size)."""

    num_generations: int = 8
    prompt_len: int = 512  # grpo.max_prompt_length
    completion_len: int = 256  # grpo.max_completion_length
    steps_per_generation: int = 1  # micro-steps per generation round (resolved)
    num_iterations: int = 1
    beta: float = 0.0  # > 0: reference log-probs (a frozen copy under full fine-tuning)
    engine: str = "generate"  # generate | paged | vllm (grpo.ENGINES)
    rloo: bool = False  # RLOOTrainer: old log-probs always computed


@dataclass(frozen=True)
class RunSetup:
    """One training run, as the memory model sees it."""

    model: ModelSpec
    precision: str = "bf16"  # bf16/fp16: weights stored and trained in 16 bit; *-mixed: fp32 + autocast
    quantization: str = "none"  # none | nf4 | nf4-dq | fp4 | int8 (needs lora)
    lora: bool = False
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ("all-linear",)
    lora_dropout: float = 0.0  # lora.dropout: > 0 saves a dropped input and a mask per adapter
    lora_use_dora: bool = False  # lora.use_dora: DoRA's magnitudes and weight-norm temporaries (plan/memory/dora.py)
    lora_init: str = "default"  # lora.init: pissa's SVD at model build (plan/memory/lora_init.py)
    optimizer: str = "adamw"
    galore_rank: int = 128  # galore.rank: optimizer galore_adamw's projection rank (plan/memory/optimizers/)
    gradient_checkpointing: bool = False
    attention: str = "sdpa"  # sdpa | eager | flash_attention_2
    loss: str = "standard"  # standard | chunked
    # loss chunked: tokens per logits chunk; CHUNK_TOKENS unless the budget needs fewer
    # (search.sized_loss_chunk: halved down to MIN_CHUNK_TOKENS while the plan does not fit)
    loss_chunk_tokens: int = 1024
    micro_batch_size: int = 1
    seq_len: int = 512
    grad_accum: int = 1
    gpus: int = 1
    offload: str = "none"
    # techniques.activation_offload: checkpointed layer inputs in pinned host RAM (needs
    # gradient_checkpointing; no effect on a CPU: activation_offloaded)
    activation_offload: bool = False
    # data.packing: several samples per window, so SDPA gets a block-diagonal mask in every
    # layer (activations.masked_layers)
    packing: bool = False
    # the rows are right-padded to the batch's longest and carry an attention_mask (TRL's
    # preference collators, lowvram.plan.memory.preference.policy_setup): SDPA gets a b x 1 x s x s
    # mask in every layer (activations.masked_layers)
    padded: bool = False
    # data.images_per_row with image_chat data (0: text): lowvram.plan.memory.images
    images_per_row: int = 0
    # Llama-3.2-Vision with images: which of model.num_layers are its cross-attention layers
    # (set by lowvram.plan.memory.cross_attention.active_setup; () otherwise)
    cross_layers: tuple[int, ...] = ()
    # techniques.tiled_mlp: each decoder layer's MLP computed over the sequence in shards and
    # recomputed shard by shard in the backward (DeepSpeed's TiledMLP, lowvram.plan.memory.tiled);
    # tiled_mlp_shards 0 = DeepSpeed's rule, ceil(seq_len / hidden_size) (tiled.tiled_mlp_shards)
    tiled_mlp: bool = False
    tiled_mlp_shards: int = 0
    device: str = "cuda"  # "cpu": no CUDA context, no allocator slack
    # PyTorch's expandable_segments on CUDA (setup.expandable_segments_set): the allocator
    # slack's churn share is smaller with it (CudaOverheads)
    expandable_segments: bool = True
    # True: peft prepare_model_for_kbit_training (non-quantized params -> fp32). lowvram trains
    # QLoRA without that upcast (lowvram.train.build.model.prepare_kbit_model), so False is the default.
    kbit_prepare: bool = False
    # training.objective (lowvram.plan.memory.preference): dpo/orpo/simpo run chosen + rejected in one
    # forward of 2 x micro_batch_size rows; precompute_ref: DPO's reference log-probs computed
    # before training (preference.precompute_ref_log_probs), no reference copy or forward per step
    objective: str = "sft"
    precompute_ref: bool = False
    # training.objective grpo/rloo: the generation and scoring phases (lowvram.plan.memory.grpo); None otherwise
    grpo: GrpoSetup | None = None


# Terms computed once per the fields they read. The search asks the same terms of hundreds of
# setups that differ in fields a term does not read: the activation and backward terms
# (activations, tiled, backward's layer terms, dora) read no optimizer, offload, sharding,
# accumulation or loss (ACTIVATION_FIELDS); the model states (states, sharding, the optimizers'
# state, a preference objective's reference copy) read STATE_FIELDS. tests/plan/test_floor.py
# checks that each cached term ignores the fields left out of its key.
_NOT_ACTIVATION_FIELDS = ("optimizer", "galore_rank", "offload", "gpus", "grad_accum", "loss",
                          "loss_chunk_tokens", "expandable_segments")
ACTIVATION_FIELDS = tuple(f.name for f in fields(RunSetup) if f.name not in _NOT_ACTIVATION_FIELDS)
STATE_FIELDS = ("model", "precision", "quantization", "kbit_prepare", "lora", "lora_r", "lora_targets",
                "lora_use_dora", "optimizer", "galore_rank", "offload", "gpus", "device", "objective",
                "precompute_ref", "grpo")
_TERM_CACHE_SIZE = 8192  # entries per cached term; emptied when full (one process plans many models)


def cached_on(names: tuple[str, ...]) -> Callable[[Callable], Callable]:
    """A decorator: ``term(setup, *args, **kwargs)`` computed once per (the setup's ``names``
    fields, its other arguments), for a term that reads no other field of the setup.
    ``term.uncached`` is the term itself, ``term.key_fields`` the names."""
    key_of = attrgetter(*names)

    def decorator(term: Callable) -> Callable:
        cache: dict = {}
        missing = object()

        @wraps(term)
        def cached(setup: RunSetup, *args, **kwargs):
            key = (key_of(setup), args, tuple(kwargs.items()))
            value = cache.get(key, missing)
            if value is missing:
                if len(cache) >= _TERM_CACHE_SIZE:
                    cache.clear()
                value = cache[key] = term(setup, *args, **kwargs)
            return value

        cached.uncached = term
        cached.key_fields = names
        return cached

    return decorator


per_activations = cached_on(ACTIVATION_FIELDS)
per_states = cached_on(STATE_FIELDS)


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    trainable_parameters: int
    peak_bytes: int
    breakdown: dict[str, int]  # BREAKDOWN_KEYS, bytes at the peak moment, summing to peak_bytes
    peak_phase: str  # "forward_backward", "optimizer_step" (or "between_steps", "generation", "lora_init")
    cpu_ram_bytes: int
    persistent_bytes: int
    # the moment that binds (a key of lowvram.plan.memory.moments.MOMENTS, or "optimizer_step")
    peak_moment: str = ""
    # the allocator term's named parts (CudaOverheads.allocator_parts; empty off CUDA), summing
    # to breakdown["allocator"]
    allocator_parts: dict[str, int] = field(default_factory=dict)
    # the tensor bytes at the peak allocated once and kept (weights, optimizer state): the
    # allocator's loaded_once share is taken on them, its churn share on the rest
    allocated_once_bytes: int = 0


# Host RAM of one training process before any tensor of the run: torch + CUDA libraries
# (constants.PROCESS_HOST_BYTES). estimate_memory and lowvram.check.simulate add it.
PROCESS_HOST_BYTES: int = fitted.PROCESS_HOST_BYTES.value


@dataclass(frozen=True)
class CudaOverheads:
    """Memory a CUDA process holds beyond tensors. Fitted on published measurements; not yet
    calibrated on a GPU by this project (bench/gpu_check.py).

    The caching allocator's slack (reserved - allocated at the peak, and the kernels training loads
    beyond the initial context) has two shares: one on the bytes allocated once and kept (the
    weights loaded at start, the optimizer state made at the first step), whose blocks are packed
    as they were made; one on what churns (activations, logits, gradients, temporaries: freed and
    allocated again every step, leaving blocks the next step's sizes do not fill), smaller with
    PyTorch's expandable_segments, which ``lowvram train`` sets unless the user set
    PYTORCH_CUDA_ALLOC_CONF (lowvram.train.build.allocator)."""

    context_bytes: int
    once_fraction: float  # slack on bytes allocated once (weights, optimizer state)
    churn_fraction: float  # slack on the rest of the tensor peak, expandable_segments off
    churn_fraction_expandable: float  # the same with expandable_segments on
    calibrated: bool = False

    def allocator_parts(self, once_bytes: int, churn_bytes: int, expandable_segments: bool) -> dict[str, int]:
        """The allocator term's two named parts, bytes: ``loaded_once`` and ``churn``."""
        churn = self.churn_fraction_expandable if expandable_segments else self.churn_fraction
        return {"loaded_once": int(self.once_fraction * once_bytes), "churn": int(churn * churn_bytes)}


@lru_cache(maxsize=1)  # constants: one object, asked for by every estimate
def cuda_overheads() -> CudaOverheads:
    """Fitted on published GPU measurements (bench/published_accuracy.py over bench/gpu_truth; not
    yet measured by this project's bench/gpu_check.py, hence calibrated=False):
    constants.CUDA_CONTEXT_BYTES (the median of three published nvidia-smi readings right after
    CUDA init), constants.ALLOCATOR_ONCE_FRACTION (a bound from four published load-time pairs of
    reserved and allocated bytes), constants.ALLOCATOR_CHURN_FRACTION (least squares over nine
    single-GPU Trainer runs without expandable segments) and
    constants.ALLOCATOR_CHURN_FRACTION_EXPANDABLE (that share times a bound from two published runs
    measured with expandable segments off and on), each with its sources and error
    (docs/constants.md)."""
    return CudaOverheads(context_bytes=fitted.CUDA_CONTEXT_BYTES.value,
                         once_fraction=fitted.ALLOCATOR_ONCE_FRACTION.value,
                         churn_fraction=fitted.ALLOCATOR_CHURN_FRACTION.value,
                         churn_fraction_expandable=fitted.ALLOCATOR_CHURN_FRACTION_EXPANDABLE.value)


def expandable_segments_set(alloc_conf: str | None) -> bool:
    """Whether a CUDA run has PyTorch's expandable segments, from its PYTORCH_CUDA_ALLOC_CONF
    (None: unset, so ``lowvram train`` sets ``expandable_segments:True``; lowvram.train.build.allocator).
    The caller reads the environment (lowvram.planning.budget); plan/ reads none."""
    if alloc_conf is None:
        return True
    options = {k.strip().lower(): v.strip().lower() for k, _, v in
               (part.partition(":") for part in alloc_conf.split(",")) if k.strip()}
    return options.get("expandable_segments") == "true"


__all__ = [
    "ACTIVATION_FIELDS", "cached_on", "per_activations", "per_states", "PROCESS_HOST_BYTES", "STATE_FIELDS",
    "BREAKDOWN_KEYS", "cuda_overheads", "CudaOverheads", "DEEPSPEED_CPU_OPTIMIZER", "expandable_segments_set",
    "FSDP_OFFLOADS",
    "GrpoSetup", "MemoryEstimate", "offload_conflict", "offload_conflict_hint", "RunSetup", "tiled_mlp_conflict",
]
