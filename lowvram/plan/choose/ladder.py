"""A plan's explanation as a ladder: from the run as asked, one technique of the technique table
(plan/choose/techniques.py) after another in tier order, each rung with the peak it leaves, the bytes it
saves and its step-time cost. It explains; the search (plan/choose/search.py) chooses."""

from __future__ import annotations

from dataclasses import replace

from lowvram.plan.choose import techniques as tq
from lowvram.plan.choose.explain import Estimator
from lowvram.plan.choose.request import Budget, PlanRequest, Rung, fits_budget
from lowvram.plan.choose.search import (
    allowed_micro_batches,
    auto_precision,
    divisors_descending,
    fixed_micro_batch_size,
    largest_micro_batch_size,
    loss_options,
    sized_loss_chunk,
)
from lowvram.plan.memory.grpo import grpo_setup, steps_per_generation_options
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.model import moe
from lowvram.plan.setup import RunSetup, offload_conflict

# --------------------------------------------------------------------------------------------
# The ladder: what each technique saves and costs, applied one after another


def _plain_attention(req: PlanRequest) -> str:
    """The plain run's attention: eager, but SDPA for Llama-3.2-Vision with images (eager over its
    tiles is not modelled: plan/memory/images.py image_problems)."""
    return "sdpa" if req.images_per_row and req.model.cross_attention_layers else "eager"


def build_ladder(req: PlanRequest, budget: Budget, estimate: Estimator = estimate_memory) -> tuple[Rung, ...]:
    """Peaks from the plain run (fp32, eager, full batch, AdamW, full fine-tuning) up the ladder.

    Techniques the user fixed are applied from the start and their rung is marked ``fixed``.
    """
    largest = fixed_micro_batch_size(req) or largest_micro_batch_size(req)
    s = RunSetup(
        model=req.model, precision=req.mixed_precision or "fp32", quantization=req.quantization or "none",
        lora=bool(req.lora) or (req.quantization not in (None, "none")), lora_r=req.lora_r,
        lora_targets=req.lora_targets, lora_dropout=req.lora_dropout, optimizer=req.optimizer or "adamw",
        gradient_checkpointing=bool(req.gradient_checkpointing), attention=req.attention or _plain_attention(req),
        loss=loss_options(req, budget)[0] if req.loss else "standard", micro_batch_size=largest,
        seq_len=req.seq_len,
        grad_accum=largest_micro_batch_size(req) // largest, gpus=req.gpus, offload=req.offload or "none",
        device=budget.device, expandable_segments=budget.expandable_segments,
        activation_offload=bool(req.activation_offload and req.gradient_checkpointing) and budget.device == "cuda",
        packing=req.packing, images_per_row=req.images_per_row, tiled_mlp=bool(req.tiled_mlp) and not req.model.is_moe,
        tiled_mlp_shards=req.tiled_mlp_shards,
        objective=req.objective, precompute_ref=req.precompute_ref,
    )
    s = _with_generation(s, req)
    s = sized_loss_chunk(s, budget, estimate)
    est = estimate(s)
    rungs = [Rung("baseline", "as asked", est.peak_bytes, 0, 1.0, fits_budget(est, budget),
                  host_ram_bytes=est.cpu_ram_bytes)]
    for t in tq.LADDER:
        fixed_name = {"mixed_precision": "mixed_precision", "gradient_accumulation": "micro_batch_size"}.get(t.name, t.name)
        fixed = req.fixed(fixed_name) or (t.name == "gradient_accumulation" and req.fixed("grad_accum"))
        if (t.name == "offload" and budget.device == "cpu") or (t is tq.ACTIVATION_OFFLOAD and budget.device != "cuda"):
            continue
        if t is tq.ACTIVATION_OFFLOAD and req.gradient_checkpointing is False:
            fixed = True  # it needs checkpointing, which the user turned off
        if t is tq.TILED_MLP and req.model.is_moe:
            continue  # a dense MLP only (setup.tiled_mlp_conflict)
        if req.grpo is not None and (t is tq.TILED_MLP or t.name == "offload"):
            continue  # not modelled for grpo/rloo (plan/memory/grpo.py)
        if req.model.vision is not None and (t is tq.TILED_MLP or t.name == "offload"):
            continue  # not modelled with a vision tower (vision.vision_problems)
        if fixed:
            rungs.append(Rung(t.name, str(t.value), est.peak_bytes, 0, 1.0, fits_budget(est, budget), fixed=True,
                              host_ram_bytes=est.cpu_ram_bytes))
            continue
        before = s
        if t is tq.MIXED_PRECISION:
            s = replace(s, precision=auto_precision(budget, req.weight_dtype))
        elif t is tq.MICRO_BATCH:
            # the smallest micro-batch the objective allows (kto: 2, preference.min_micro_batch_size)
            sizes = allowed_micro_batches(req, divisors_descending(largest_micro_batch_size(req))) or [1]
            s = _with_generation(replace(s, micro_batch_size=sizes[-1],
                                         grad_accum=largest_micro_batch_size(req) // sizes[-1]), req)
        else:
            settings = dict(t.settings)
            if moe.attention_problems(s.model, settings.get("attention", s.attention)):
                continue  # gpt-oss trains with eager attention only
            if "loss" in settings and req.objective != "sft":
                continue  # a preference objective keeps TRL's own loss
            if offload_conflict(settings.get("optimizer", s.optimizer), settings.get("offload", s.offload)):
                if req.fixed("optimizer") or "offload" not in settings:
                    continue  # the user's optimizer (or offload) rules this rung out
                settings["optimizer"] = "adamw"  # DeepSpeed's CPU Adam takes its place
            s = replace(s, **settings)
        s = sized_loss_chunk(s, budget, estimate)  # the chunked loss's chunk sized to the budget
        new = estimate(s)
        slowdown = tq.setup_slowdown(s, largest_micro_batch_size(req)) / tq.setup_slowdown(before, largest_micro_batch_size(req))
        value = s.precision if t is tq.MIXED_PRECISION else (
            f"micro-batch {s.micro_batch_size} x {s.grad_accum}" if t is tq.MICRO_BATCH else
            {True: "on", False: "off"}.get(t.value, str(t.value)))
        rungs.append(Rung(t.name, value, new.peak_bytes, est.peak_bytes - new.peak_bytes, slowdown,
                          fits_budget(new, budget), host_ram_bytes=new.cpu_ram_bytes))
        est = new
    return tuple(rungs)


def _with_generation(s: RunSetup, req: PlanRequest) -> RunSetup:
    """grpo/rloo: the largest generation batch the request allows at the setup's micro-batch."""
    if req.grpo is None:
        return s
    ks = steps_per_generation_options(req.grpo, s.micro_batch_size, s.grad_accum, s.gpus) or [s.grad_accum]
    return replace(s, grpo=grpo_setup(req.grpo, ks[0]))


__all__ = [
    "build_ladder",
]
