"""What the search takes and returns: the Budget (a card's usable bytes after the safety margin),
the PlanRequest (what the user fixed, the rest on auto) and its validation, and a Candidate, a Rung of
the ladder and the Choice; the levels a plan gives up (plan_level) and the extras it needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from lowvram.errors import LowvramError
from lowvram.plan.choose.techniques import flash_attention_hint, flash_attention_unavailable
from lowvram.plan.constants import SAFETY_MARGIN_FRACTION, SAFETY_MARGIN_MIN_BYTES
from lowvram.plan.memory import lora_init, optimizers, preference, sharding
from lowvram.plan.memory.grpo import (
    GRPO_OBJECTIVES,
    GrpoRequest,
    generation_batch_problem,
    grpo_request_problem,
)
from lowvram.plan.memory.images import IMAGE_HINT, image_problems
from lowvram.plan.model import moe
from lowvram.plan.model.image_size import IMAGE_SIZE_HINT, image_size_problem, sized_model
from lowvram.plan.model.models import ModelSpec
from lowvram.plan.model.vision import PACKING_HINT, VISION_HINT, packing_problem, vision_problems
from lowvram.plan.setup import (
    DEEPSPEED_CPU_OPTIMIZER,
    MemoryEstimate,
    RunSetup,
    activation_offload_conflict,
    offload_conflict,
    offload_conflict_hint,
    quantization_conflict,
    tiled_mlp_conflict,
)
from lowvram.plan.types import Plan
from lowvram.vocab import (
    EIGHT_BIT_DEVICES,
    FULL_ONLY_OPTIMIZERS,
    FUSED_BACKWARD_OPTIMIZERS,
    GALORE_8BIT_OPTIMIZERS,
    IN_BACKWARD_OPTIMIZERS,
    LAYERWISE_OPTIMIZERS,
    LOMO_OPTIMIZERS,
    PROJECTED_OPTIMIZERS,
    TORCHAO_OPTIMIZERS,
)

# Safety margin: memory the plan leaves unused for what the model does not see (other processes
# on the card, fragmentation spikes, the first-step warm-up): chosen, in lowvram.plan.constants.
MARGIN_FRACTION: float = SAFETY_MARGIN_FRACTION.value
MIN_MARGIN_BYTES: int = SAFETY_MARGIN_MIN_BYTES.value

# The offloads that shard the model states over several GPUs (lowvram.plan.choose.search.TIER_SHARD).
SHARDED = ("zero2", "zero3", "fsdp")


def safety_margin_bytes(vram_bytes: int) -> int:
    return max(MIN_MARGIN_BYTES, int(vram_bytes * MARGIN_FRACTION))


def vram_needed_bytes(peak_bytes: int, min_margin_bytes: int = MIN_MARGIN_BYTES) -> int:
    """Smallest card (free bytes) whose budget after the margin holds ``peak_bytes``."""
    return max(peak_bytes + min_margin_bytes, int(peak_bytes / (1 - MARGIN_FRACTION)) + 1)


@dataclass(frozen=True)
class Budget:
    """What the plan must fit in. Bytes."""

    vram_bytes: int  # free memory of the card (or the --vram override, or host RAM on CPU)
    device: str = "cuda"  # "cuda" | "mps" | "cpu"
    bf16: bool = True  # the card supports bf16
    bf16_known: bool = True  # False: assumed (a --vram budget; no card was queried)
    # The lowest CUDA compute capability of the cards used (None: not queried, e.g. --vram)
    compute_capability: tuple[int, int] | None = None
    # host RAM a plan may use (pinned offloaded activations, offloaded optimizer state, the
    # process): --host-ram, else this machine's available memory; None: not checked
    host_ram_bytes: int | None = None
    host_ram_source: str = ""  # where host_ram_bytes came from, shown to the user
    source: str = ""  # where vram_bytes came from, shown to the user
    notes: tuple[str, ...] = ()
    # Optional extras not installed here ("deepspeed"): plans that need one rank after the plans
    # that need nothing more (lowvram.planning.make_budget fills it; tests pass their own).
    missing_extras: tuple[str, ...] = ()
    # PyTorch's expandable segments in the run (setup.expandable_segments_set of the run's
    # PYTORCH_CUDA_ALLOC_CONF; lowvram.planning.make_budget reads it): the allocator slack's churn
    # share is smaller with them
    expandable_segments: bool = True
    # The margin's floor: MIN_MARGIN_BYTES on a real card; an emulated card scaled down
    # (bench/emulated_cards.py) scales it by the same factor.
    min_margin_bytes: int = MIN_MARGIN_BYTES

    @property
    def safety_margin_bytes(self) -> int:
        return max(self.min_margin_bytes, int(self.vram_bytes * MARGIN_FRACTION))

    @property
    def usable_bytes(self) -> int:
        return self.vram_bytes - self.safety_margin_bytes


def fits_budget(est: MemoryEstimate, budget: Budget) -> bool:
    """The estimate fits the card (less the margin) and, where planned for this machine, its host RAM."""
    if est.peak_bytes > budget.usable_bytes:
        return False
    # Offload needs the host RAM too, when we know it (planning for this machine).
    return budget.host_ram_bytes is None or budget.device == "cpu" or est.cpu_ram_bytes <= budget.host_ram_bytes


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for. ``None`` = auto (the chooser decides); anything else is fixed."""

    # None: the architecture could not be read; only lowvram.plan.choose.unpredicted plans such a request
    model: ModelSpec | None
    seq_len: int = 1024
    batch_size: int = 16  # effective batch: micro_batch_size x grad_accum x gpus
    gpus: int = 1
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ("all-linear",)
    lora_alpha: int = 32  # no memory effect; carried into the Plan for training
    lora_dropout: float = 0.0
    lora_use_dora: bool = False  # lora.use_dora: DoRA's magnitude and per-forward weight norm (plan/memory/dora.py)
    lora_use_rslora: bool = False  # no memory effect; carried into the Plan for training
    lora_init: str = "default"  # lora.init: pissa's SVD at model build (plan/memory/lora_init.py)
    galore_rank: int = 128  # galore.*: optimizer galore_adamw (plan/memory/optimizers/)
    galore_update_proj_gap: int = 200  # no memory effect; carried into the Plan for training
    galore_scale: float = 0.25  # no memory effect; carried into the Plan for training
    # training.max_grad_norm written in the recipe (> 0): the user asks for gradient clipping, which
    # a layerwise optimizer cannot do (plan/memory/optimizers/): refused when fixed, never searched
    gradient_clipping: bool = False
    weight_dtype: str | None = None  # model.dtype fixed in the recipe: auto precision follows it
    mixed_precision: str | None = None
    gradient_checkpointing: bool | None = None
    grad_accum: int | None = None
    micro_batch_size: int | None = None
    lora: bool | None = None
    quantization: str | None = None
    optimizer: str | None = None
    # optimizer any-that-fits (vocab.ANY_OPTIMIZER): with optimizer None, the search also tries the
    # optimizers that change the algorithm (GaLore, APOLLO, LOMO); plain auto keeps to AdamW's
    optimizer_any: bool = False
    offload: str | None = None
    activation_offload: bool | None = None
    # techniques.tiled_mlp (lowvram.plan.memory.tiled): None = auto; its shards, 0 = ceil(seq_len / hidden)
    tiled_mlp: bool | None = None
    tiled_mlp_shards: int = 0
    attention: str | None = None
    loss: str | None = None
    # data.packing (a data setting, not a technique): several samples per window, so SDPA gets a
    # block-diagonal mask in every layer (lowvram.plan.memory.activations.masked_layers)
    packing: bool = False
    # data.images_per_row when a dataset is format image_chat (0: text data): the images each row
    # brings, their pixels and the vision tower's forward (lowvram.plan.memory.images)
    images_per_row: int = 0
    # data.max_pixels / min_pixels (None: the processor's own): model.vision sized (plan/model/image_size.py)
    max_pixels: int | None = None  # with max_pixels_auto: the start, the processor's own (plan/choose/pixels.py)
    min_pixels: int | None = None
    max_pixels_auto: bool = False  # data.max_pixels auto: the chooser may lower max_pixels, last of all
    image_tokens: int | None = None  # the data's costliest image, measured (lowvram train): sizes it below the limits
    # training.objective and DPO's precompute_ref_log_probs (lowvram.plan.memory.preference): a preference
    # objective plans 2 x micro_batch_size rows per forward, its own loss, DPO's reference
    objective: str = "sft"
    precompute_ref: bool = False
    # training.objective grpo/rloo: the grpo section (lowvram.plan.memory.grpo); seq_len is then
    # max_prompt_length + max_completion_length and batch_size counts completions
    grpo: GrpoRequest | None = None
    # Where each fixed choice came from ("--optimizer", "the recipe"), for the reasons.
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:  # the pixel limits (and the data's images) size a Qwen-VL tower
        object.__setattr__(self, "model", sized_model(self.model, self.max_pixels, self.min_pixels, self.image_tokens))

    def fixed(self, name: str) -> bool:
        return getattr(self, name) is not None


@dataclass(frozen=True)
class Candidate:
    setup: RunSetup
    estimate: MemoryEstimate
    ladder_tier: float  # the explained ladder's tier (groups the alternatives shown; not the search order)
    slowdown: float  # step time relative to bf16 + SDPA + full fine-tuning, largest micro-batch
    fits: bool

    @property
    def peak_bytes(self) -> int:
        return self.estimate.peak_bytes


@dataclass(frozen=True)
class Rung:
    """One row of the ladder: the peak after applying one more technique."""

    technique: str
    value: str
    peak_bytes: int
    saved_bytes: int
    slowdown: float
    fits: bool
    fixed: bool = False  # the user fixed this technique otherwise; the rung is skipped
    host_ram_bytes: int = 0  # what the rung needs of host RAM: "fits: no (host RAM)" when only that is short


@dataclass(frozen=True)
class Choice:
    """The chooser's answer: the plan and everything the report shows about it."""

    plan: Plan
    request: PlanRequest
    budget: Budget
    chosen: Candidate
    fits: bool
    alternatives: tuple[Candidate, ...]
    ladder: tuple[Rung, ...]
    max_seq_len: int  # longest seq_len that fits under this plan (0: none)
    max_micro_batch_size: int  # largest micro-batch that fits at this seq_len (0: none)
    min_vram_bytes: int  # smallest card that holds the lowest-peak plan allowed
    # Over every plan the request allows (not only the chosen one): the longest seq_len at
    # micro-batch 1 and the largest micro-batch at this seq_len, with the plan that reaches each.
    longest: tuple[int, RunSetup | None] = (0, None)
    largest_micro: tuple[int, RunSetup | None] = (0, None)
    suggestion: str | None = None  # when nothing fits: the single change that helps most
    suggestions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    max_pixels_auto: dict = field(default_factory=dict)  # data.max_pixels auto: what it chose (choose/pixels.py)


# --------------------------------------------------------------------------------------------
# Validation


def fixed_micro_batch_size(req: PlanRequest) -> int | None:
    """The micro-batch the request fixes: its own, or the per-GPU batch over a fixed accumulation
    (None: the search tries every divisor of the per-GPU batch). validate_request checks that
    they divide."""
    if req.micro_batch_size is not None:
        return req.micro_batch_size
    if req.grad_accum is not None:
        return req.batch_size // req.gpus // req.grad_accum
    return None


def validate_request(req: PlanRequest) -> None:
    """Impossible values -> one LowvramError naming the flag and a fix. The one statement of
    the batch arithmetic (batch_size = micro_batch_size x gradient_accumulation x GPUs) and of the
    rules between fixed techniques, for the search and for a plan not predicted alike."""
    positive = {
        "seq_len": req.seq_len, "batch_size": req.batch_size, "gpus": req.gpus, "lora_r": req.lora_r,
    }
    for name, value in positive.items():
        if value is None or value <= 0:
            flag = "--" + name.replace("_", "-")
            raise LowvramError(f"{name} must be a positive integer, got {value}", f"e.g. {flag} {_EXAMPLE[name]}")
    for name in ("grad_accum", "micro_batch_size"):
        value = getattr(req, name)
        if value is not None and value <= 0:
            shown = {"grad_accum": "gradient_accumulation"}.get(name, name)
            raise LowvramError(f"{shown} must be a positive integer, got {value}", "leave it out to let the planner choose")
    conflict = quantization_conflict(req.quantization or "none", req.lora is not False)
    if conflict:
        raise LowvramError(conflict, "use --method qlora (or lora), or --quantization none for full fine-tuning")
    conflict = activation_offload_conflict(bool(req.activation_offload), req.gradient_checkpointing is not False)
    if conflict:
        raise LowvramError(conflict, "drop --no-gradient-checkpointing, or the activation offload")
    conflict = tiled_mlp_conflict(bool(req.tiled_mlp), req.model is not None and req.model.is_moe)
    if conflict:
        raise LowvramError(conflict, "use --tiled-mlp off (or auto)")
    if req.objective != "sft" and (req.tiled_mlp or req.lora_use_dora or req.optimizer in FULL_ONLY_OPTIMIZERS):
        # TRL's preference trainers with these: not modelled (plan/memory/preference.py counts SFT's terms on 2b rows)
        what = "tiled_mlp" if req.tiled_mlp else "lora.use_dora" if req.lora_use_dora else f"optimizer {req.optimizer}"
        raise LowvramError(f"objective {req.objective} with {what} is not modelled",
                           f"train {req.objective} without {what}, or plan it as objective sft")
    problems = vision_problems(req.model.vision if req.model is not None else None, req.offload,
                               req.objective, req.optimizer, req.tiled_mlp)
    if problems:
        raise LowvramError("; ".join(problems), VISION_HINT)
    if req.model is not None and (problem := image_size_problem(req.model.vision, req.max_pixels, req.min_pixels)):
        raise LowvramError(problem, IMAGE_SIZE_HINT)
    if req.model is not None and (problems := image_problems(req.model, req.images_per_row, req.seq_len,
                                                                  req.attention or "sdpa")):
        raise LowvramError("; ".join(problems), IMAGE_HINT)
    packed = packing_problem(req.model.vision if req.model is not None else None, req.packing)
    if packed:
        raise LowvramError(packed, PACKING_HINT)
    if (req.objective in GRPO_OBJECTIVES) != (req.grpo is not None):
        raise LowvramError(f"objective {req.objective} {'needs' if req.grpo is None else 'takes no'} grpo settings",
                           "plan grpo and rloo with their grpo section (training.objective grpo or rloo)")
    if req.grpo is not None and (problem := grpo_request_problem(req.grpo, req.batch_size, req.gpus, req.offload,
                                                                          req.attention)):
        raise LowvramError(*problem)
    smallest = preference.min_micro_batch_size(req.objective)
    if smallest > 1 and (fixed_micro_batch_size(req) or req.batch_size // max(1, req.gpus)) < smallest:
        raise LowvramError(f"objective {req.objective} needs a micro-batch of at least {smallest} rows per GPU "
                           "(TRL estimates KTO's KL term from the other rows of the batch)",
                           f"set training.batch_size (and micro_batch_size, if fixed) to {smallest} or more per "
                           "GPU, with gradient_accumulation leaving at least that many per micro-batch")
    if req.tiled_mlp and req.lora_use_dora:  # DoRA's per-forward weight norm inside MLP shards: not modelled
        raise LowvramError("tiled_mlp with lora.use_dora is not modelled (DoRA forms each adapted layer's "
                           "dense weight in every forward, and a tiled MLP runs that forward once per shard)",
                           "set techniques.tiled_mlp: off (or auto) with DoRA, or lora.use_dora: false")
    if req.lora is not False and (problems := lora_init.init_conflicts(
            req.lora_init, req.quantization or "none", req.lora_use_dora,
            req.model is not None and bool(moe.expert_adapters(req.model, req.lora_r, req.lora_targets)),
            req.gpus, req.offload or "none")):
        raise LowvramError("; ".join(problems), "lora.init default trains with any of these")
    if req.tiled_mlp_shards < 0:
        raise LowvramError(f"tiled_mlp shards must be a positive integer, got {req.tiled_mlp_shards}",
                           "e.g. --tiled-mlp 8, or --tiled-mlp on for ceil(seq_len / hidden_size)")
    if req.optimizer is not None and req.offload is not None:
        conflict = offload_conflict(req.optimizer, req.offload)
        if conflict:
            flag = {"optimizer": "--optimizer", "offload": "--offload"}
            raise LowvramError(conflict, offload_conflict_hint(req.optimizer, req.offload,
                                                               lambda key, value: f"{flag[key]} {value}"))
    if (req.optimizer in LOMO_OPTIMIZERS + FUSED_BACKWARD_OPTIMIZERS
            and (req.lora or req.offload not in (None, "none"))):
        other = "adamw" if req.optimizer in FUSED_BACKWARD_OPTIMIZERS else "adamw_8bit"
        raise LowvramError(f"optimizer {req.optimizer} steps full weights inside the backward: it runs "
                           "without LoRA and without DeepSpeed/FSDP",
                           f"use --method full --offload none with it, or --optimizer {other}")
    if req.optimizer in PROJECTED_OPTIMIZERS and (req.lora or req.offload not in (None, "none")):
        raise LowvramError(f"optimizer {req.optimizer} projects the gradients of full weights on unsharded "
                           "parameters: it runs without LoRA and without DeepSpeed/FSDP",
                           "use --method full --offload none with it, or --optimizer adamw_8bit")
    if req.optimizer in TORCHAO_OPTIMIZERS and req.offload not in (None, "none"):
        raise LowvramError(f"optimizer {req.optimizer} under offload {req.offload} is not planned: DeepSpeed "
                           "flattens the parameters torchao quantizes per tensor, and FSDP2's sharded "
                           "low-bit state was not measured",
                           "use --offload none with it (one GPU or DDP), or --optimizer adamw with the offload")
    if req.batch_size % req.gpus:
        raise LowvramError(
            f"batch_size {req.batch_size} is not divisible by {req.gpus} GPUs",
            f"use a batch size that is a multiple of {req.gpus}",
        )
    per_gpu = req.batch_size // req.gpus
    if req.grad_accum is not None and per_gpu % req.grad_accum:
        raise LowvramError(
            f"batch_size {req.batch_size} is not divisible by gradient_accumulation {req.grad_accum} x {req.gpus} GPU(s)",
            "make batch_size = micro_batch_size x gradient_accumulation x GPUs",
        )
    if req.micro_batch_size is not None and per_gpu % req.micro_batch_size:
        raise LowvramError(
            f"batch_size {req.batch_size} is not divisible by micro_batch_size {req.micro_batch_size} x {req.gpus} GPU(s)",
            "make batch_size = micro_batch_size x gradient_accumulation x GPUs",
        )
    if req.micro_batch_size is not None and req.grad_accum is not None:
        if req.micro_batch_size * req.grad_accum != per_gpu:
            raise LowvramError(
                f"micro_batch_size {req.micro_batch_size} x gradient_accumulation {req.grad_accum} x {req.gpus} GPU(s) "
                f"!= batch_size {req.batch_size}",
                "fix two of the three and let the planner derive the third",
            )
    if req.grpo is not None and (problem := generation_batch_problem(req.grpo, req.batch_size, req.gpus,
                                                                      fixed_micro_batch_size(req))):
        raise LowvramError(*problem)


def check_optimizer(req: PlanRequest, budget: Budget, precision: str | None = None) -> None:
    """A fixed GaLore form that cannot run as asked -> LowvramError (the search never picks one:
    lowvram.plan.choose.search.candidate_setups). 8-bit: CUDA or the CPU; layerwise: gradient accumulation 1,
    one process, no gradient clipping (plan/memory/optimizers/, transformers _setup_low_rank_optimizer).
    ``precision``: the run's (fixed, or the card's auto choice); any optimizer stepped in the backward
    is refused under fp16 loss scaling (optimizers.scaled_gradient_problem)."""
    o = req.optimizer
    if o == "adalomo" and budget.device != "cuda":
        raise LowvramError(f"optimizer adalomo needs a CUDA GPU: lomo_optim's AdaLomo makes its state with "
                           f".cuda(), and this plan is for {budget.device}",
                           "set techniques.optimizer: lomo to train here, or train on a CUDA GPU")
    _check_fp16_in_backward(req, precision or req.mixed_precision or "")
    if o in GALORE_8BIT_OPTIMIZERS and budget.device not in EIGHT_BIT_DEVICES:
        other = "galore_adamw_layerwise" if o in LAYERWISE_OPTIMIZERS else "galore_adamw"
        raise LowvramError(f"optimizer {o} needs a CUDA GPU or the CPU: bitsandbytes 0.50 has no 8-bit "
                           f"optimizer kernel for {budget.device}, and this plan is for {budget.device}",
                           f"set techniques.optimizer: {other} to train here, or train on a CUDA GPU")
    if o not in IN_BACKWARD_OPTIMIZERS:
        return
    other = ("adamw_8bit" if o in LOMO_OPTIMIZERS else "adamw" if o in FUSED_BACKWARD_OPTIMIZERS
             else o.replace("_8bit", "").replace("_layerwise", ""))
    accumulation = req.grad_accum
    fixed_micro = fixed_micro_batch_size(req)
    if accumulation is None and fixed_micro is not None:
        accumulation = req.batch_size // req.gpus // fixed_micro
    if accumulation not in (None, 1):
        raise LowvramError(f"optimizer {o} steps each parameter inside the backward, so it cannot "
                           f"accumulate gradients (gradient_accumulation {accumulation}; "
                           + ("every micro-batch's backward would step the weights)" if o in LOMO_OPTIMIZERS
                              else "transformers raises 'does not support gradient accumulation')"),
                           "set training.batch_size equal to micro_batch_size (gradient_accumulation 1), "
                           f"or use optimizer {other}")
    if req.gpus > 1:
        raise LowvramError(f"optimizer {o} runs in one process only ("
                           + ("its hooks step on each rank's own gradient"
                              if o in LOMO_OPTIMIZERS + FUSED_BACKWARD_OPTIMIZERS else
                              "transformers raises NotImplementedError for layerwise GaLore under DDP")
                           + f"), and {req.gpus} GPUs were asked for", f"use --gpus 1, or optimizer {other}")
    if req.gradient_clipping:
        raise LowvramError(f"optimizer {o} cannot clip gradients: each parameter is stepped as soon as its "
                           "gradient exists, before the Trainer's clip_grad_norm_ (which would clip nothing)",
                           f"set training.max_grad_norm: 0 (no clipping), or use optimizer {other}")


def _check_fp16_in_backward(req: PlanRequest, precision: str) -> None:
    o = req.optimizer
    if o not in IN_BACKWARD_OPTIMIZERS or not precision.startswith("fp16"):
        return
    why = ("accelerate's GradScaler backward runs instead of LOMO's fused_backward, so its hooks would "
           "step with scaled gradients" if o in LOMO_OPTIMIZERS else optimizers.FP16_IN_BACKWARD_WHY)
    asked = (f"set by {req.sources['mixed_precision']}" if req.sources.get("mixed_precision") else
             "asked" if req.mixed_precision else "the card has no bf16")
    other = optimizers.in_backward_alternative(o)
    raise LowvramError(f"optimizer {o} cannot train in {precision} ({asked}): {why}",
                       f"set techniques.optimizer: {other}" + (" (or techniques.mixed_precision: bf16 or fp32)"
                                                              if req.mixed_precision else
                                                              " (fp16-mixed trains with loss scaling on this card)"))


def optimizer_given_up(setup: RunSetup) -> int:
    """What a plan's optimizer gives up, beyond speed, within a plan_level (the search's second
    key): 0 AdamW and its 8-bit forms, bitsandbytes' and torchao's (the same results: Dettmers et
    al. 2022); 1 torchao's 4-bit AdamW (every update full-rank and adaptive, its moments rounded to
    4 bits: Li et al. 2023); 2 AdamW in the backward (AdamW's update; gives up clipping,
    accumulation and several processes: plan/memory/optimizers/); 3 GaLore, plain or 8-bit (all weights
    trained, but each decoder Linear's update is low-rank, Zhao et al. 2024; its 8-bit moments give
    up nothing more, so speed decides between the two; APOLLO with them); 4 layerwise GaLore and
    APOLLO (also no gradient clipping, no gradient accumulation, one process); 5 AdaLomo (those, and
    no first moment: Adafactor-like, Lv et al. 2024); 6 LOMO (those, and plain SGD: no moments, no
    weight decay)."""
    if setup.optimizer in LOMO_OPTIMIZERS:
        return 5 if setup.optimizer == "adalomo" else 6
    # APOLLO ranks with GaLore: its update is the full raw gradient scaled channel-wise from moments
    # kept in a random rank-r space (Zhu et al. 2025), no closer to AdamW than GaLore's; speed decides
    if setup.optimizer in LAYERWISE_OPTIMIZERS:
        return 4
    if setup.optimizer in PROJECTED_OPTIMIZERS:
        return 3
    if setup.optimizer in FUSED_BACKWARD_OPTIMIZERS:
        return 2
    return 1 if setup.optimizer == "adamw_torch_4bit" else 0


_EXAMPLE = {"seq_len": 1024, "batch_size": 16, "gpus": 1, "lora_r": 16}


def check_attention(req: PlanRequest, budget: Budget, precision: str) -> None:
    """A fixed flash_attention_2 that cannot run under ``budget`` at ``precision`` -> LowvramError
    (the search never picks flash_attention_2 itself: lowvram.plan.choose.search.technique_options)."""
    if req.attention != "flash_attention_2":
        return
    why = flash_attention_unavailable(budget, precision)
    if why:
        src = req.sources.get("attention", "--attention")
        flags = {"mixed_precision": "--mixed-precision", "attention": "--attention"}
        # a flag is named with its source; the recipe (or --set) by its key
        what, spell = ((f"attention flash_attention_2 (set by {src})", lambda key, value: f"{flags[key]} {value}")
                       if src.startswith("--") else
                       ("techniques.attention: flash_attention_2", lambda key, value: f"techniques.{key}: {value}"))
        raise LowvramError(f"{what} cannot run here: {why}", flash_attention_hint(budget, precision, spell))


# What a plan gives up, beyond speed: the search picks the fastest plan within the first of these
# levels that has a plan that fits. Level 0 trains the whole model with the same maths (precision,
# kernels, chunked loss, micro-batch + accumulation, checkpointing, 8-bit optimizer state, which
# matches 32-bit Adam's results: Dettmers et al. 2022; sharding over several GPUs); 1 trains
# adapters only (LoRA); 2 on a quantized base (QLoRA); 3 moves model states to CPU RAM (host RAM,
# PCIe, several times slower). Inside a level speed decides, not the ladder's order: the 8-bit
# optimizer (~3%) is taken before checkpointing (~25%) when either alone fits.
LEVEL_NAMES = ("full fine-tuning on the GPU", "LoRA", "QLoRA", "offload to CPU RAM")

# Optional extras each offload needs (pyproject.toml [project.optional-dependencies]).
# "cpu_adam" is no pip extra: DeepSpeed's CPU Adam, which the offloads that move the optimizer to the
# CPU run (setup.DEEPSPEED_CPU_OPTIMIZER), JIT-built at first use (a C++ compiler, ninja, Python.h)
EXTRAS = {o: ("deepspeed",) + (("cpu_adam",) if o in DEEPSPEED_CPU_OPTIMIZER else ())
          for o in sharding.ZERO_OFFLOADS}
# what each non-pip requirement is, for the plan's note
BUILT_EXTRAS = {"cpu_adam": "DeepSpeed's CPU Adam, built at its first use (it needs a C++ compiler, ninja "
                            "and the Python headers: apt-get install g++ python3-dev; pip install ninja)"}


def plan_level(setup: RunSetup) -> int:
    """The LEVEL_NAMES index of a plan."""
    if setup.offload not in ("none",) + SHARDED:
        return 3
    if setup.quantization != "none":
        return 2
    return 1 if setup.lora else 0


def missing_extras(setup: RunSetup, budget: Budget) -> tuple[str, ...]:
    """The extras ``setup`` needs that are not installed where the plan will run."""
    # a tiled MLP runs DeepSpeed's TiledMLP (lowvram.train.build.tiled_mlp)
    needs = EXTRAS.get(setup.offload, ()) + (("deepspeed",) if setup.tiled_mlp else ())
    return tuple(dict.fromkeys(e for e in needs if e in budget.missing_extras))


__all__ = [
    "BUILT_EXTRAS", "Budget", "Candidate", "check_attention", "check_optimizer", "Choice", "optimizer_given_up", "EXTRAS", "fits_budget", "fixed_micro_batch_size", "LEVEL_NAMES", "MARGIN_FRACTION", "MIN_MARGIN_BYTES",
    "missing_extras", "plan_level", "PlanRequest", "Rung", "safety_margin_bytes", "SHARDED",
    "validate_request", "vram_needed_bytes",
]
