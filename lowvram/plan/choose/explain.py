"""Why the plan is what it is, in English: one line per technique with the numbers behind it.

Each reason compares the chosen setup with the same setup without the technique (another
estimate), so the numbers are the memory model's, never restated. The search is choose.py's;
it calls :func:`technique_reasons` for the plan it chose. Pure: no torch, no CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from lowvram.plan.choose import techniques as tq
from lowvram.plan.choose.request import fits_budget
from lowvram.plan.memory import activations, backward, optimizers, states, tiled
from lowvram.plan.model import moe
from lowvram.plan.model.image_size import image_geometry
from lowvram.plan.model.vision import QWEN_VL_TOWERS
from lowvram.plan.setup import DEEPSPEED_CPU_OPTIMIZER, FSDP_OFFLOADS, MemoryEstimate, RunSetup
from lowvram.units import gib, percent
from lowvram.vocab import FULL_ONLY_OPTIMIZERS, TORCHAO_OPTIMIZERS

Estimator = Callable[[RunSetup], MemoryEstimate]

# A sharded plan one step cheaper on the GPU: the same without CPU offload, or DDP.
_ONE_STEP_CHEAPER = {"fsdp": "none", "zero3": "none", "zero2": "none", "fsdp-offload": "fsdp",
                     "zero3-offload": "zero3", "zero2-offload": "zero2"}


_COMPONENTS = {
    "weights": states.weight_bytes, "gradients": states.gradient_bytes,
    "optimizer": states.optimizer_bytes, "activations": tiled.activation_bytes,
    "logits": backward.logits_bytes,
}


def divisors_descending(n: int) -> list[int]:
    """Every divisor of ``n``, largest first, in sqrt(n) steps (the micro-batch sizes a batch
    allows: walking 1..n never finished for a batch of 10^12)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def _chunk_words(c, estimate: Estimator) -> str:
    """A chunk sized below CHUNK_TOKENS (search.sized_loss_chunk), and what the default would peak at."""
    s = c.setup
    whole = replace(s, loss_chunk_tokens=backward.CHUNK_TOKENS)
    return (f"{s.loss_chunk_tokens}-token chunks, sized to the budget ({backward.CHUNK_TOKENS}-token "
            f"chunks would peak at {gib(estimate(whole).peak_bytes)}; the loss keeps "
            f"{gib(backward.logits_bytes(s))} instead of {gib(backward.logits_bytes(whole))})")


def technique_reasons(c, req, budget, estimate: Estimator, largest_micro: int) -> dict[str, str]:
    """One line per technique for the chosen candidate ``c`` (request.Candidate) of ``req``
    (request.PlanRequest) under ``budget`` (request.Budget): what it is set to and the numbers
    behind it, each measured against the peak without it. ``largest_micro``: the micro-batch
    that holds the whole batch in one pass per GPU."""
    s = c.setup
    r: dict[str, str] = {}
    limit = budget.usable_bytes

    estimates: dict[RunSetup, MemoryEstimate] = {}

    def estimate_of(setup: RunSetup) -> MemoryEstimate:  # each alternative estimated once
        if setup not in estimates:
            estimates[setup] = estimate(setup)
        return estimates[setup]

    def without(component: str | tuple, what: str = "without it the peak", **change) -> str:
        changed = replace(s, **change)
        other = estimate_of(changed)
        comps = (component,) if isinstance(component, str) else component
        if s.offload == "none" and changed.offload == "none":
            # Component sizes, not their share at the peak moment (which may be another phase).
            was = sum(_COMPONENTS[k](changed) for k in comps)
            now = sum(_COMPONENTS[k](s) for k in comps)
        else:  # offload moves components off the GPU: what stays there is in the breakdown
            was = sum(other.breakdown[k] for k in comps)
            now = sum(c.estimate.breakdown[k] for k in comps)
        name = "+".join(comps)
        verdict = ">" if other.peak_bytes > limit else "<="
        text = (f"{what} would be {gib(other.peak_bytes)} {verdict} budget {gib(limit)} "
                f"({name} {gib(was)} -> {gib(now)})")
        if other.peak_bytes <= limit and not fits_budget(other, budget):  # the card, not the host RAM
            text += f", but it needs {gib(other.cpu_ram_bytes)} of CPU RAM > {gib(budget.host_ram_bytes)} available"
        return text

    def fixed(name: str) -> str | None:
        src = req.sources.get(name)
        return f"set by {src}" if src else None

    # mixed precision
    if req.fixed("mixed_precision"):
        r["mixed_precision"] = fixed("mixed_precision") or "set"
        if s.precision == "fp32" and budget.device != "cpu":
            r["mixed_precision"] += "; fp32 on a GPU: 4 bytes/weight and no tensor cores (~2.5x slower)"
    elif budget.device == "cpu":
        r["mixed_precision"] = "fp32: CPU run (bf16 on CPU is slower here); mixed precision applies on a GPU"
    elif s.precision == "bf16":
        how = "the card supports bf16" if budget.bf16_known else "bf16 assumed (budget from --vram/LOWVRAM_VRAM: the card is not queried; pass --mixed-precision fp16-mixed for cards before Ampere)"
        r["mixed_precision"] = f"bf16: {how}; 2 bytes/weight instead of 4, no speed cost"
    else:
        r["mixed_precision"] = "fp16-mixed: the card has no bf16; fp16 autocast, fp32 master weights, loss scaling"

    # attention
    r["attention"] = fixed("attention") or "sdpa: never stores the s x s attention matrix; fastest kernel in torch"
    if s.model.attention_sinks and not req.fixed("attention"):
        r["attention"] = (f"eager: {s.model.model_type}'s attention sinks have no SDPA path in "
                          "transformers; keeps b x a x s x (s+1) scores")
    elif s.model.model_type in moe.EAGER_ONLY_MODEL_TYPES and not req.fixed("attention"):
        r["attention"] = (f"eager: transformers has only eager attention for {s.model.model_type} "
                          "(no SDPA or flash path); keeps b x a x s x s scores")
    elif s.attention == "eager":
        r["attention"] += "; eager keeps b x a x s x s scores (upcast to fp32)"

    # loss
    if req.fixed("loss") and req.loss != s.loss:  # fused asked, not available here
        r["loss"] = (f"{tq.fused_loss_fallback(req.sources.get('loss', 'the recipe'), budget, s.model)} "
                     f"(logits {gib(c.estimate.breakdown['logits'])})")
    elif req.fixed("loss"):
        r["loss"] = fixed("loss") or "set"
        if backward.chunk_resized(s):
            r["loss"] += f"; {_chunk_words(c, estimate)}"
    elif s.loss == "fused":
        r["loss"] = (f"fused (Liger Kernel): {without('logits', 'the chunked loss', loss='chunked')}; "
                     f"no full logits, one {backward.fused_loss_chunk_tokens(s)}-token chunk")
    elif s.loss == "chunked":
        r["loss"] = f"chunked: {without('logits', loss='standard')}; {percent(tq.CHUNKED_LOSS.slowdown)}"
        if backward.chunk_resized(s):
            r["loss"] += f"; {_chunk_words(c, estimate)}"
    else:
        r["loss"] = f"standard: fits without chunking (logits {gib(c.estimate.breakdown['logits'])})"

    # micro-batch and accumulation
    largest = largest_micro
    batch = f"micro-batch {s.micro_batch_size} x {s.grad_accum} steps x {s.gpus} GPU(s) = batch {req.batch_size}"
    if req.fixed("grad_accum") or req.fixed("micro_batch_size"):
        src = fixed("grad_accum") or fixed("micro_batch_size") or "set"
        r["gradient_accumulation"] = f"{batch}; {src}"
    elif s.micro_batch_size == largest:
        r["gradient_accumulation"] = f"{batch}: the whole batch fits in one pass"
    else:
        bigger = min(d for d in divisors_descending(largest) if d > s.micro_batch_size)
        other = estimate(replace(s, micro_batch_size=bigger, grad_accum=largest // bigger))
        if other.peak_bytes > limit:
            why = f"micro-batch {bigger} would peak at {gib(other.peak_bytes)} > budget {gib(limit)}"
        elif not fits_budget(other, budget):  # the card holds it, host RAM does not
            why = (f"micro-batch {bigger} would peak at {gib(other.peak_bytes)} <= budget {gib(limit)}, but needs "
                   f"{gib(other.cpu_ram_bytes)} of host RAM > {gib(budget.host_ram_bytes)} available")
        else:  # nothing fits: the plan shown is the lowest-peak one
            why = (f"micro-batch {bigger} would peak higher ({gib(other.peak_bytes)}); no plan fits, so the "
                   "lowest-memory one is shown")
        r["gradient_accumulation"] = (
            f"{batch}: {why}; {percent(tq.micro_batch_slowdown(s.micro_batch_size, s.seq_len, largest))}")

    # gradient checkpointing
    if req.fixed("gradient_checkpointing"):
        r["gradient_checkpointing"] = fixed("gradient_checkpointing") or "set"
    elif s.gradient_checkpointing:
        r["gradient_checkpointing"] = (f"on: {without('activations', gradient_checkpointing=False, activation_offload=False)}; "
                                       f"{percent(tq.GRADIENT_CHECKPOINTING.slowdown)}")
    else:
        r["gradient_checkpointing"] = f"off: activations {gib(c.estimate.breakdown['activations'])} fit; recomputing would cost {percent(tq.GRADIENT_CHECKPOINTING.slowdown)}"

    # activation offload
    r["activation_offload"] = _activation_offload_reason(c, req, budget, without, fixed)

    # tiled MLP
    r["tiled_mlp"] = _tiled_mlp_reason(c, req, without, fixed)

    # optimizer
    if req.fixed("optimizer"):
        r["optimizer"] = fixed("optimizer") or "set"
    elif s.optimizer in FULL_ONLY_OPTIMIZERS + TORCHAO_OPTIMIZERS:
        r["optimizer"] = (f"{s.optimizer}: {without('optimizer', 'with 8-bit AdamW the peak', optimizer='adamw_8bit')}; "
                          f"{optimizers.given_up(s)}")
    elif s.optimizer != "adamw":
        r["optimizer"] = f"{s.optimizer}: {without('optimizer', optimizer='adamw')}; {percent(tq.OPTIMIZER_8BIT.slowdown)}"
    elif s.offload in DEEPSPEED_CPU_OPTIMIZER:
        r["optimizer"] = (f"adamw: offload {s.offload} runs DeepSpeed's CPU Adam, its fp32 state and "
                          "master weights in CPU RAM (16 bytes per trained parameter)")
    elif s.offload in FSDP_OFFLOADS:
        # lowvram.plan.setup.offload_conflict: the search never pairs FSDP with bitsandbytes
        r["optimizer"] = (f"adamw: 8-bit AdamW (bitsandbytes) cannot step FSDP2's sharded parameters (no "
                          f"DTensor support), so {s.offload} keeps torch AdamW; its state " +
                          ("in CPU RAM with the shards" if s.offload == "fsdp-offload" else
                           f"{gib(c.estimate.breakdown['optimizer'])} per GPU at the peak"))
    else:
        r["optimizer"] = f"adamw: optimizer state {gib(c.estimate.breakdown['optimizer'])} fits"
    if not req.fixed("optimizer") and s.precision.startswith("fp16") and req.lora is False and req.objective == "sft":
        # search.candidate_setups drops them (full fine-tuning asked: search.in_backward_options)
        r["optimizer"] += (f"; under {s.precision} no optimizer stepped in the backward is tried "
                           f"(adamw_in_backward, layerwise GaLore and APOLLO, LOMO): {optimizers.FP16_IN_BACKWARD_WHY}")

    # LoRA
    trained = f"{c.estimate.trainable_parameters / 1e6:,.1f}M of {c.estimate.parameters / 1e6:,.1f}M params trained"
    if req.fixed("lora"):
        r["lora"] = f"{fixed('lora') or 'set'}; {trained}"
    elif s.lora:
        r["lora"] = (f"on (r={s.lora_r}, {','.join(s.lora_targets)}): "
                     f"{without(('weights', 'gradients', 'optimizer'), 'full fine-tuning', lora=False, quantization='none')}; {trained}")
        full = replace(s, lora=False, quantization="none")
        if fits_budget(estimate_of(full), budget):
            # Both fit at the same search level (an offloaded plan): the faster one was chosen.
            r["lora"] += (f"; chosen as the faster of the two (step time x{tq.setup_slowdown(s, largest_micro):.2f} "
                          f"vs x{tq.setup_slowdown(full, largest_micro):.2f} for full fine-tuning)")
    else:
        r["lora"] = f"off: full fine-tuning fits ({trained})"

    # quantization
    if req.fixed("quantization"):
        r["quantization"] = fixed("quantization") or "set"
    elif s.quantization != "none":
        r["quantization"] = (f"{s.quantization}: {without('weights', f'a {s.precision} base', quantization='none')}; "
                             f"{percent(tq.QUANTIZATION_4BIT.slowdown)}")
    else:
        r["quantization"] = f"none: {s.precision} base weights {gib(c.estimate.breakdown['weights'])} fit"

    # offload
    if req.fixed("offload"):
        r["offload"] = fixed("offload") or "set"
    elif s.gpus > 1 and s.offload in _ONE_STEP_CHEAPER:
        r["offload"] = _shard_reason(c, estimate, limit)
    elif s.offload != "none":
        r["offload"] = (f"{s.offload}: {without(('weights', 'optimizer'), offload='none')}; "
                        f"{percent(tq.OFFLOAD_SLOWDOWN[s.offload])}; needs {gib(c.estimate.cpu_ram_bytes)} CPU RAM")
    else:
        r["offload"] = "none: everything stays on the GPU" if budget.device != "cpu" else "none: CPU run"
        if s.gpus > 1:
            r["offload"] = (f"none (DDP): each of {s.gpus} {'processes' if budget.device == 'cpu' else 'GPUs'} "
                            f"holds a full copy; peak {gib(c.peak_bytes)} per "
                            f"{'process' if budget.device == 'cpu' else 'GPU'} fits")
    return r


def _activation_offload_reason(c, req, budget, without, fixed) -> str:
    s = c.setup
    host = gib(activations.activation_offload_host_bytes(s))
    if budget.device != "cuda":
        asked = " (asked for, ignored)" if req.activation_offload else ""
        return (f"off{asked}: a {budget.device.upper()} run keeps activations in host RAM already; there "
                "is no device memory to free (transformers' offload pins host memory for a CUDA card)")
    if req.fixed("activation_offload"):
        text = fixed("activation_offload") or "set"
        return f"{text}; {host} of layer inputs in pinned host RAM" if s.activation_offload else text
    if s.activation_offload:
        return (f"on: {without('activations', activation_offload=False)}; {host} of checkpointed "
                f"layer inputs in pinned host RAM; {percent(tq.ACTIVATION_OFFLOAD.slowdown)}")
    if s.gradient_checkpointing:
        return (f"off: the checkpoints ({gib(activations.activation_bytes(s))} of activations) fit on the "
                f"GPU; offloading them would cost {percent(tq.ACTIVATION_OFFLOAD.slowdown)}")
    return "off: needs gradient checkpointing, which this plan does not use"


def _tiled_mlp_reason(c, req, without, fixed) -> str:
    s = c.setup
    if s.model.is_moe:
        return "off: the MLP is a mixture of experts (lowvram tiles a dense MLP only)"
    if s.model.vision is not None:
        return "off: not modelled with a vision tower loaded (the tower's MLPs would be tiled too)"
    cost = percent(tiled.tiled_mlp_slowdown(replace(s, tiled_mlp=True)))
    shards = tiled.tiled_mlp_shards(s)
    if req.fixed("tiled_mlp"):
        text = fixed("tiled_mlp") or "set"
        return f"{text}; {shards} shard(s) of the sequence" if s.tiled_mlp else text
    if s.tiled_mlp:
        return (f"on ({shards} shard(s) of the sequence): {without('activations', tiled_mlp=False)}; "
                f"{cost}")
    return f"off: fits without it; tiling each layer's MLP would cost {cost}"


def _shard_reason(c, estimate: Estimator, limit: int) -> str:
    """Why the model states are sharded (and offloaded): the per-GPU peak one step cheaper."""
    s = c.setup
    cheaper = _ONE_STEP_CHEAPER[s.offload]
    other = estimate(replace(s, offload=cheaper))
    what = "DDP (a full copy per GPU)" if cheaper == "none" else f"{cheaper} without CPU offload"
    verdict = ">" if other.peak_bytes > limit else "<="
    how = {"fsdp": "FSDP2 full shard: weights, gradients and optimizer state split over",
           "zero3": "DeepSpeed ZeRO-3: weights, gradients and optimizer state split over",
           "zero2": "DeepSpeed ZeRO-2: gradients and optimizer state split over"}
    base = s.offload.removesuffix("-offload")
    text = (f"{s.offload}: {how[base]} {s.gpus} GPUs, {gib(c.peak_bytes)} per GPU; "
            f"{what} would peak at {gib(other.peak_bytes)} {verdict} budget {gib(limit)}; "
            f"{percent(tq.OFFLOAD_SLOWDOWN[s.offload])}")
    if s.offload.endswith("-offload"):
        text += f"; needs {gib(c.estimate.cpu_ram_bytes)} CPU RAM per GPU process"
    if base == "fsdp":
        text += "; needs nothing beyond torch (zero3 would need deepspeed)"
    return text


def data_images_reason(req) -> dict[str, str]:
    """Format image_chat sized on the data (``req.image_tokens``: `lowvram train` and `lowvram
    plan RECIPE` measured it under the model's processor, lowvram.train.run.preflight.
    measured_images): what the plan counts, beside the bound the pixel limits alone give."""
    v = req.model.vision
    if not req.image_tokens or not req.images_per_row or v is None:
        return {}
    bound = image_geometry(v, req.max_pixels, req.min_pixels).tokens
    n, t = req.images_per_row, v.tokens_per_image
    limits = (f"; data.max_pixels alone allows {bound:,} an image" if v.tower in QWEN_VL_TOWERS and bound > t else "")
    return {"images": f"sized on the data, measured under the model's processor: up to {n} image(s) a row, "
                      f"{t:,} tokens each ({n * t:,} a row: the most image tokens a row of the data holds){limits}"}
