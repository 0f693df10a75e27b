"""The search space and its order: the options left on auto, one RunSetup per combination, a
Candidate per setup (its peak, step time, whether it fits the budget), and the ranking of candidates
(:func:`rank`). Also a setup in words (describe_setup) and as a Plan (plan_for_setup)."""

from __future__ import annotations

import itertools
from dataclasses import replace

from lowvram.plan.choose import techniques as tq
from lowvram.plan.choose.explain import Estimator, divisors_descending
from lowvram.plan.choose.request import (
    SHARDED,
    Budget,
    Candidate,
    PlanRequest,
    fits_budget,
    fixed_micro_batch_size,
    missing_extras,
    optimizer_given_up,
    plan_level,
)
from lowvram.plan.memory import preference
from lowvram.plan.memory.backward import CHUNK_TOKENS, MIN_CHUNK_TOKENS, chunk_resized, logits_bytes
from lowvram.plan.memory.grpo import (
    generation_rounds,
    generation_rows,
    grpo_setup,
    steps_per_generation_options,
)
from lowvram.plan.memory.lora_init import is_svd_init
from lowvram.plan.memory.optimizers import galore_targets, optimizer_problems
from lowvram.plan.model import moe
from lowvram.plan.setup import (
    MemoryEstimate,
    RunSetup,
    activation_offload_conflict,
    offload_conflict,
    quantization_conflict,
)
from lowvram.plan.types import Plan, dtype_precision
from lowvram.vocab import (
    EIGHT_BIT_DEVICES,
    FULL_ONLY_OPTIMIZERS,
    IN_BACKWARD_OPTIMIZERS,
    PROJECTED_OPTIMIZERS,
    TORCHAO_OPTIMIZERS,
)

# Several GPUs (issue 6): sharding the model states is exact (same result as DDP) and costs
# communication (~1.2x, techniques.OFFLOAD_SLOWDOWN), about what gradient checkpointing costs; so
# it is tried right after checkpointing, before the 8-bit optimizer, LoRA and a quantized base.
# Offload to CPU RAM (fsdp-offload) stays on the last tier. FSDP2 comes before DeepSpeed ZeRO-3:
# the same memory (ZeRO-3 = FSDP full shard, 16P/N) and it needs nothing beyond torch.
TIER_SHARD = tq.TIER_CHECKPOINTING + 0.5
MULTI_GPU_OFFLOADS = ["none", "fsdp", "fsdp-offload"]


# --------------------------------------------------------------------------------------------
# Candidates


def auto_precision(budget: Budget, weight_dtype: str | None = None) -> str:
    """bf16 where the card has it, else fp16-mixed; fp32 on a CPU. A fixed model.dtype picks the
    precision that stores weights in it (lowvram.plan.types.dtype_precision)."""
    if weight_dtype is not None:
        return dtype_precision(weight_dtype, budget.device, budget.bf16)
    if budget.device == "cpu":
        return "fp32"
    return "bf16" if budget.bf16 else "fp16-mixed"


def technique_options(req: PlanRequest, budget: Budget) -> dict[str, list]:
    """The values each technique may take under ``req``: the one it fixes (after the loss'
    fallback), or on auto the values the search tries. The search plans every combination
    (candidate_setups); a plan whose memory cannot be predicted takes one default from each list
    (lowvram.plan.choose.unpredicted)."""
    fixed_micro = fixed_micro_batch_size(req)
    on_gpu = budget.device != "cpu"

    def pick(name: str, auto: list) -> list:
        value = getattr(req, name)
        return [value] if value is not None else auto

    return {
        "precision": pick("mixed_precision", [auto_precision(budget, req.weight_dtype)]),
        # an architecture not read (model None): SDPA, what every model without a quirk gets
        "attention": pick("attention", [moe.default_attention(req.model) if req.model else "sdpa"]),
        "loss": loss_options(req, budget),
        "micro_batch_size": [fixed_micro] if fixed_micro is not None else allowed_micro_batches(
            req, divisors_descending(req.batch_size // req.gpus)),
        "gradient_checkpointing": pick("gradient_checkpointing", [False, True]),
        # CUDA only: on a CPU (or MPS's unified memory) there is no device memory to free
        # (activations.activation_offloaded)
        "activation_offload": pick("activation_offload", [False, True]) if budget.device == "cuda" else [False],
        # a dense MLP only (setup.tiled_mlp_conflict)
        # and not with DoRA (the two together are not modelled: validate_request refuses them)
        "tiled_mlp": (pick("tiled_mlp", [False, True]) if (req.model is None or not req.model.is_moe)
                      and not req.lora_use_dora and req.objective == "sft" and not _vision(req)
                      else [False]),
        # auto keeps to the AdamW family; the optimizers that change the algorithm (GaLore, APOLLO,
        # LOMO) only where the recipe opts in (optimizer: any-that-fits, request.optimizer_any)
        "optimizer": pick("optimizer", ["adamw", "adamw_8bit"] + torchao_options(budget)
                          + in_backward_options(req) + (galore_options(req, budget) + apollo_options(req, budget)
                                                        + lomo_options(req, budget) if req.optimizer_any else [])),
        "lora": pick("lora", [False, True]),
        "quantization": pick("quantization", ["none", "nf4-dq"]),
        "offload": pick("offload", _auto_offloads(req, on_gpu)),
    }


def torchao_options(budget: Budget) -> list[str]:
    """torchao's 8-bit and 4-bit AdamW on auto, where torchao is installed: for LoRA and full
    fine-tuning alike, with offload none (candidate_setups). The 8-bit form ranks with AdamW and
    bitsandbytes' 8-bit AdamW (the same training; the slower step, so chosen where it is leaner:
    it quantizes the embedding too), the 4-bit form after them and before GaLore
    (request.optimizer_given_up)."""
    return [] if "torchao" in budget.missing_extras else ["adamw_torch_8bit", "adamw_torch_4bit"]


def _full_fine_tuning_asked(req: PlanRequest) -> bool:
    """Full fine-tuning the user asked for (lora fixed off: with lora on auto, LoRA stays the
    answer to a model too big to train whole), of a known architecture without a vision tower,
    for sft: where the search tries the optimizers that train full weights only."""
    return req.lora is False and req.objective == "sft" and req.model is not None and not _vision(req)


def galore_options(req: PlanRequest, budget: Budget) -> list[str]:
    """GaLore's forms the search tries on auto: only for full fine-tuning the user asked for
    (lora fixed off: with lora on auto, LoRA stays the answer to a model too big to train whole)
    and only where galore_torch is installed (vocab.OPTIMIZER_EXTRAS); the 8-bit forms only where
    bitsandbytes has their kernel (CUDA and the CPU: optimizers.EIGHT_BIT_DEVICES), the layerwise ones not when the recipe asks for gradient clipping. They rank after
    AdamW and 8-bit AdamW (request.optimizer_given_up); each setup is checked again in
    candidate_setups (optimizers.optimizer_problems: MoE, GPT-2, several GPUs, accumulation)."""
    if not _full_fine_tuning_asked(req) or "galore" in budget.missing_extras:
        return []
    eight = budget.device in EIGHT_BIT_DEVICES
    out = ["galore_adamw"] + (["galore_adamw_8bit"] if eight else [])
    if not req.gradient_clipping:
        out += ["galore_adamw_layerwise"] + (["galore_adamw_8bit_layerwise"] if eight else [])
    return out


def in_backward_options(req: PlanRequest) -> list[str]:
    """AdamW in the backward on auto: full fine-tuning asked for (sft, a known architecture), not
    when the recipe asks for gradient clipping; it needs no extra. It ranks after torchao's 4-bit
    AdamW and before GaLore (request.optimizer_given_up)."""
    if not _full_fine_tuning_asked(req) or req.gradient_clipping:
        return []
    return ["adamw_in_backward"]


def apollo_options(req: PlanRequest, budget: Budget) -> list[str]:
    """APOLLO's forms on auto: as GaLore's (full fine-tuning asked for, sft, a known architecture;
    the layerwise form not with gradient clipping), where apollo_torch is installed; they rank
    with GaLore's (request.optimizer_given_up) and run on the CPU too."""
    if not _full_fine_tuning_asked(req) or "apollo" in budget.missing_extras:
        return []
    return ["apollo_adamw"] + ([] if req.gradient_clipping else ["apollo_adamw_layerwise"])


def lomo_options(req: PlanRequest, budget: Budget) -> list[str]:
    """LOMO's forms on auto: as GaLore's (full fine-tuning asked for, sft, a known architecture),
    where lomo_optim is installed, not when the recipe asks for gradient clipping; AdaLomo on CUDA
    only. They rank after layerwise GaLore (request.optimizer_given_up: AdaLomo, then LOMO)."""
    if not _full_fine_tuning_asked(req) or req.gradient_clipping or "lomo" in budget.missing_extras:
        return []
    return (["adalomo"] if budget.device == "cuda" else []) + ["lomo"]


def allowed_micro_batches(req: PlanRequest, sizes: list[int]) -> list[int]:
    """The sizes the objective trains with (kto: 2 or more, preference.min_micro_batch_size)."""
    smallest = preference.min_micro_batch_size(req.objective)
    return [m for m in sizes if m >= smallest]


def loss_options(req: PlanRequest, budget: Budget) -> list[str]:
    """standard, chunked, and Liger's fused loss where it can run. A fixed ``fused`` that cannot
    run here becomes the chunked loss (the fallback; the reason says why)."""
    if req.objective != "sft":
        return ["standard"]  # TRL computes the preference loss its own way (lowvram.plan.memory.preference)
    fused_ok = tq.fused_loss_unavailable(budget, req.model) is None
    if req.loss is not None:
        return ["chunked" if req.loss == "fused" and not fused_ok else req.loss]
    return ["standard", "chunked"] + (["fused"] if fused_ok else [])


def _vision(req: PlanRequest) -> bool:
    """A vision tower loaded: no offload, tiled MLP or GaLore on auto (vision.vision_problems)."""
    return req.model is not None and req.model.vision is not None


def _auto_offloads(req: PlanRequest, on_gpu: bool) -> list[str]:
    if not on_gpu or _vision(req) or req.grpo is not None:
        return ["none"]  # a CPU run (several processes: DDP over gloo); grpo: not modelled offloaded
    return MULTI_GPU_OFFLOADS if req.gpus > 1 else ["none", "optimizer", "full"]


def candidate_setups(req: PlanRequest, budget: Budget) -> list[RunSetup]:
    """One RunSetup per combination of technique_options that the rules between techniques
    allow (lowvram.plan.setup: quantization needs LoRA, activation offload needs checkpointing,
    DeepSpeed's CPU Adam and FSDP2 keep their optimizers)."""
    o = technique_options(req, budget)
    per_gpu = req.batch_size // req.gpus
    out = []
    for precision, attention, loss, micro, gc, act_off, tiled_mlp, optim, lora, quant, offload in itertools.product(
            o["precision"], o["attention"], o["loss"], o["micro_batch_size"], o["gradient_checkpointing"],
            o["activation_offload"], o["tiled_mlp"], o["optimizer"], o["lora"], o["quantization"], o["offload"]):
        if (activation_offload_conflict(act_off, gc) or quantization_conflict(quant, lora)
                or offload_conflict(optim, offload)):
            continue
        # GaLore projects the full weights' gradients, unsharded and unflattened (plan/memory/optimizers/)
        if optim in FULL_ONLY_OPTIMIZERS and (lora or offload != "none"):
            continue
        # PiSSA's SVD needs a float base weight, in one process (plan/memory/lora_init.py)
        if lora and is_svd_init(req.lora_init) and (quant != "none" or offload != "none"):
            continue
        if optim in TORCHAO_OPTIMIZERS and offload != "none":  # not planned under DeepSpeed/FSDP2
            continue
        if optim in IN_BACKWARD_OPTIMIZERS and per_gpu // micro != 1:  # stepped in the backward: no accumulation
            continue
        # fp16's GradScaler unscales after the backward: LOMO's fused_backward never runs, and the
        # other hooks would step with scaled gradients (optimizers.scaled_gradient_problem)
        if optim in IN_BACKWARD_OPTIMIZERS and precision.startswith("fp16"):
            continue
        base = RunSetup(
            model=req.model, precision=precision, quantization=quant,
            lora=lora, lora_r=req.lora_r, lora_targets=req.lora_targets,
            lora_dropout=req.lora_dropout,
            lora_use_dora=req.lora_use_dora and lora,
            lora_init=req.lora_init if lora else "default",
            galore_rank=req.galore_rank,
            optimizer=optim, gradient_checkpointing=gc,
            attention=attention, loss=loss, micro_batch_size=micro,
            seq_len=req.seq_len, grad_accum=per_gpu // micro,
            gpus=req.gpus, offload=offload, device=budget.device,
            expandable_segments=budget.expandable_segments,
            activation_offload=act_off, packing=req.packing, images_per_row=req.images_per_row,
            tiled_mlp=tiled_mlp, tiled_mlp_shards=req.tiled_mlp_shards,
            objective=req.objective, precompute_ref=req.precompute_ref,
        )
        if req.grpo is None:
            out.append(base)
        else:  # grpo/rloo: one setup per generation batch the request allows (plan/memory/grpo.py)
            out += [replace(base, grpo=grpo_setup(req.grpo, k))
                    for k in steps_per_generation_options(req.grpo, micro, per_gpu // micro, req.gpus)]
    if req.optimizer is None:  # GaLore on auto: only where it runs (a fixed one is refused with its reason)
        out = [s for s in out if s.optimizer not in FULL_ONLY_OPTIMIZERS or not optimizer_problems(s)]
    return out


def largest_micro_batch_size(req: PlanRequest) -> int:
    return req.batch_size // req.gpus


def sized_loss_chunk(setup: RunSetup, budget: Budget, estimate: Estimator) -> RunSetup:
    """The chunked loss's chunk sized to what is left of the budget: CHUNK_TOKENS (1024) when the
    plan fits with it, else halved until it fits, down to MIN_CHUNK_TOKENS (the smallest peak
    when nothing fits). Other losses, and tokens within one chunk, are left as they are."""
    return sized_estimate(setup, budget, estimate)[0]


def sized_estimate(setup: RunSetup, budget: Budget, estimate: Estimator) -> tuple[RunSetup, MemoryEstimate]:
    """:func:`sized_loss_chunk` and the estimate of the setup it returns."""
    t = setup.micro_batch_size * setup.seq_len
    if setup.loss != "chunked" or t <= MIN_CHUNK_TOKENS:
        return setup, estimate(setup)
    whole = replace(setup, loss_chunk_tokens=CHUNK_TOKENS)
    est = estimate(whole)
    if fits_budget(est, budget):
        return whole, est
    smallest = replace(setup, loss_chunk_tokens=MIN_CHUNK_TOKENS)
    if _too_far_over(est, whole, smallest, budget):
        return whole, est
    low = estimate(smallest)
    if not fits_budget(low, budget):  # the peak only grows with the chunk
        return smallest, low
    chunk = CHUNK_TOKENS // 2
    while chunk > MIN_CHUNK_TOKENS:
        sized = replace(setup, loss_chunk_tokens=chunk)
        sized_est = estimate(sized)
        if fits_budget(sized_est, budget):
            return sized, sized_est
        chunk //= 2
    return smallest, low


def _too_far_over(est: MemoryEstimate, whole: RunSetup, smallest: RunSetup, budget: Budget) -> bool:
    """A smaller chunk saves at most its logits (and the allocator slack on them, well under 2x):
    a plan further over the budget than that stays over it, without estimating it again."""
    return est.peak_bytes - budget.usable_bytes > 2 * (logits_bytes(whole) - logits_bytes(smallest))


def sized_fits(setup: RunSetup, budget: Budget, estimate: Estimator) -> bool:
    """Whether :func:`sized_estimate`'s setup fits, in at most two estimates: the whole chunk, and
    the smallest where the whole does not fit (where the smallest fits, the halving finds a
    chunk that fits; where it does not, none does)."""
    t = setup.micro_batch_size * setup.seq_len
    if setup.loss != "chunked" or t <= MIN_CHUNK_TOKENS:
        return fits_budget(estimate(setup), budget)
    whole = replace(setup, loss_chunk_tokens=CHUNK_TOKENS)
    est = estimate(whole)
    if fits_budget(est, budget):
        return True
    smallest = replace(setup, loss_chunk_tokens=MIN_CHUNK_TOKENS)
    return not _too_far_over(est, whole, smallest, budget) and fits_budget(estimate(smallest), budget)


def candidate(setup: RunSetup, req: PlanRequest, budget: Budget, estimate: Estimator) -> Candidate:
    setup, est = sized_estimate(setup, budget, estimate)
    largest = largest_micro_batch_size(req)
    return Candidate(setup, est, candidate_tier(setup, largest), tq.setup_slowdown(setup, largest),
                     fits_budget(est, budget))


def candidate_tier(setup: RunSetup, largest_micro: int) -> float:
    """The ladder tier a candidate is shown under (its alternatives group)."""
    tier = tq.setup_tier(setup)
    if setup.offload in SHARDED and setup.gpus > 1:
        tier = max(tq.setup_tier(replace(setup, offload="none")), TIER_SHARD)
    if setup.micro_batch_size < largest_micro:
        tier = max(tier, tq.TIER_MICRO_BATCH)
    return tier


def rank(c: Candidate, budget: Budget | None = None) -> tuple:
    """Search order among fitting plans: the lowest level (plan_level), then what the optimizer
    gives up (request.optimizer_given_up: AdamW and its 8-bit forms, torchao's 4-bit AdamW, GaLore, layerwise GaLore,
    AdaLomo, LOMO), then plans
    that need no missing extra, then the fastest (techniques.setup_slowdown); ties in speed go to the larger
    micro-batch (fewer passes), then to the smaller peak."""
    return rank_order(c.setup, c.slowdown, budget) + (c.peak_bytes,)


def rank_order(setup: RunSetup, slowdown: float, budget: Budget | None = None) -> tuple:
    """:func:`rank` without the peak: known before the setup is estimated (plan/choose/pool.py)."""
    missing = bool(missing_extras(setup, budget)) if budget else False
    # grpo/rloo: fewer generation rounds per optimizer step first (grpo.generation_rounds; 0 otherwise)
    return (plan_level(setup), optimizer_given_up(setup), missing, generation_rounds(setup), round(slowdown, 6),
            -setup.micro_batch_size)


def describe_setup(s: RunSetup) -> str:
    """A plan in a few words, for notes."""
    parts = [s.precision, ("QLoRA " + s.quantization) if s.quantization != "none" else
             ("LoRA" if s.lora else "full")]
    parts += technique_words(s)
    parts.append(f"micro-batch {s.micro_batch_size} x {s.grad_accum}")
    if s.grpo is not None:  # the generation batch per GPU and the engine (plan/memory/grpo.py)
        parts.append(f"generation batch {generation_rows(s) * s.gpus} ({s.grpo.engine})")
    return ", ".join(parts)


def technique_words(s: RunSetup) -> list[str]:
    """The techniques a plan turns on beyond its precision and method, a few words each."""
    parts = ["checkpointing"] if s.gradient_checkpointing else []
    parts += ["activation offload"] if s.activation_offload else []
    parts += ["tiled MLP"] if s.tiled_mlp else []
    parts += [s.optimizer] if s.optimizer != "adamw" else []
    parts += [f"{s.loss} loss" + (f" ({s.loss_chunk_tokens}-token chunks)" if chunk_resized(s) else "")
              ] if s.loss != "standard" else []
    parts += [f"offload {s.offload}"] if s.offload != "none" else []
    return parts


def plan_for_setup(setup: RunSetup, device: str, lora_alpha: int, lora_use_rslora: bool = False,
                   galore_update_proj_gap: int = 200, galore_scale: float = 0.25, **extra) -> Plan:
    """The Plan that runs ``setup``: every setting the memory model read (lowvram.measure builds
    its runs from this too); ``extra``: reasons and the predictions."""
    s = setup
    return Plan(
        device=device, expandable_segments=s.expandable_segments,
        mixed_precision=s.precision, gradient_checkpointing=s.gradient_checkpointing,
        micro_batch_size=s.micro_batch_size, grad_accum=s.grad_accum, lora=s.lora,
        quantization=s.quantization, optimizer=s.optimizer, offload=s.offload, attention=s.attention,
        loss=s.loss, gpus=s.gpus, activation_offload=s.activation_offload, seq_len=s.seq_len,
        tiled_mlp=s.tiled_mlp, tiled_mlp_shards=s.tiled_mlp_shards, loss_chunk_tokens=s.loss_chunk_tokens,
        lora_r=s.lora_r, lora_alpha=lora_alpha, lora_dropout=s.lora_dropout, lora_targets=tuple(s.lora_targets),
        lora_use_dora=s.lora_use_dora, lora_use_rslora=lora_use_rslora and s.lora, lora_init=s.lora_init,
        galore_rank=s.galore_rank, galore_update_proj_gap=galore_update_proj_gap, galore_scale=galore_scale,
        optimizer_target_modules=galore_targets(s.model) if s.optimizer in PROJECTED_OPTIMIZERS else (), **extra,
    )


__all__ = [
    "auto_precision", "candidate", "candidate_setups", "candidate_tier", "rank_order", "describe_setup", "fixed_micro_batch_size",
    "allowed_micro_batches", "apollo_options", "galore_options", "in_backward_options", "lomo_options", "torchao_options",
    "largest_micro_batch_size", "loss_options", "MULTI_GPU_OFFLOADS", "plan_for_setup", "rank",
    "sized_estimate", "sized_fits", "sized_loss_chunk", "technique_options", "technique_words", "TIER_SHARD",
]
