"""What to change when nothing fits: the setting that frees the most (a shorter sequence, a fixed
technique released) and a smaller model of the catalog that would fit."""

from __future__ import annotations

from dataclasses import replace

from lowvram.errors import LowvramError
from lowvram.plan.cards import card_words
from lowvram.plan.choose.explain import Estimator
from lowvram.plan.choose.limits import CARD_SIZES_GB, max_fitting_seq_len
from lowvram.plan.choose.pool import CandidatePool
from lowvram.plan.choose.request import (
    Budget,
    Candidate,
    PlanRequest,
    fits_budget,
    vram_needed_bytes,
)
from lowvram.plan.constants import CARD_REPORTED_FRACTION
from lowvram.plan.memory.optimizers import optimizer_problems
from lowvram.plan.model import moe
from lowvram.plan.model.catalog import catalog_names, resolve_model
from lowvram.plan.model.models import model_numel
from lowvram.plan.model.vision import vision_problems
from lowvram.plan.setup import RunSetup
from lowvram.units import gib
from lowvram.vocab import ANY_OPTIMIZER

# --------------------------------------------------------------------------------------------
# Nothing fits: what would help


def suggest_changes(req: PlanRequest, budget: Budget, lowest: Candidate, estimate: Estimator) -> tuple[str, ...]:
    """Single changes that make it fit, the one that keeps the most of the request first."""
    out = []
    # 1. Release a choice the user fixed (the planner could then pick a cheaper setting).
    for name, flag in _RELEASABLE.items():
        if not req.fixed(name):
            continue
        freed = replace(req, **{name: None})
        if name == "lora":
            freed = replace(freed, quantization=None if req.quantization in (None, "none") else req.quantization)
        best = _best_fit(freed, budget, estimate)
        if best:
            source = req.sources.get(name, flag)
            value = _describe(name, best.setup)
            out.append(f"drop {source} and let the planner choose {name}: {value} fits "
                       f"(peak {gib(best.peak_bytes)})")
    # 1b. The optimizers that change the algorithm, which auto never picks unasked.
    if opt_in := _any_optimizer_fits(req, budget, estimate):
        out.append(opt_in)
    # 1b'. Smaller images (data.max_pixels auto), which change the data: never lowered unasked
    if smaller := _smaller_images_fit(req, budget, estimate):
        out.append(smaller)
    # 1c. The method released, on the smallest card of the usual sizes where it fits.
    if req.fixed("lora") and not any(s.startswith(f"drop {req.sources.get('lora', '--method')}") for s in out):
        if bigger := _larger_card_fits(replace(req, lora=None, quantization=None), budget, estimate):
            out.append(f"drop {req.sources.get('lora', '--method')}: {bigger}")
    # 2. A shorter sequence under the lowest-peak plan.
    max_seq = max_fitting_seq_len(lowest.setup, budget, estimate)
    if max_seq >= 1:
        out.append(f"shorter sequences: --seq-len {_round_down(max_seq)} fits "
                   f"(asked {req.seq_len}) with the lowest-memory plan")
    # 3. A smaller model of the catalog.
    smaller = _smaller_model(req, budget, lowest, estimate)
    if smaller:
        out.append(smaller)
    out.append(f"a card with at least {gib(vram_needed_bytes(lowest.peak_bytes))} free")
    return tuple(out)


_RELEASABLE = {
    "lora": "--method", "quantization": "--quantization", "offload": "--offload", "optimizer": "--optimizer",
    "gradient_checkpointing": "--no-gradient-checkpointing", "mixed_precision": "--mixed-precision",
    "loss": "--loss", "attention": "--attention", "micro_batch_size": "micro_batch_size",
    "grad_accum": "--gradient-accumulation", "activation_offload": "--activation-offload",
}


def _best_fit(req: PlanRequest, budget: Budget, estimate: Estimator) -> Candidate | None:
    """min(fitting, key=search.rank) over the plans ``req`` allows, estimated lazily (plan/choose/pool.py)."""
    return CandidatePool(req, budget, estimate).best_fitting(shown=True)


def _any_optimizer_fits(req: PlanRequest, budget: Budget, estimate: Estimator) -> str | None:
    """optimizer any-that-fits, when the plan would then fit: the optimizer it would take and what
    it changes (auto keeps to AdamW's family: vocab.ANY_OPTIMIZER)."""
    if req.optimizer is not None or req.optimizer_any:
        return None
    best = _best_fit(replace(req, optimizer_any=True), budget, estimate)
    if best is None:
        return None
    o = best.setup.optimizer
    what = ("SGD without momentum, no gradient clipping or accumulation" if o == "lomo" else
            "a factored second moment, no gradient clipping or accumulation" if o == "adalomo" else
            "AdamW on gradients projected to galore.rank" if "galore" in o else
            "AdamW moments from a random projection (APOLLO)")
    return (f"techniques.optimizer: {ANY_OPTIMIZER} (--optimizer {ANY_OPTIMIZER}): {o} fits (peak "
            f"{gib(best.peak_bytes)}), but it changes the training algorithm: {what}")


def _smaller_images_fit(req: PlanRequest, budget: Budget, estimate: Estimator) -> str | None:
    """Qwen-VL images not on auto: the largest max_pixels on the processor's grid at which a plan
    fits (plan/choose/pixels.py), when one does."""
    from lowvram.plan.choose import pixels

    asked = replace(req, max_pixels_auto=True)
    if req.max_pixels_auto or not pixels.lowerable(asked):
        return None
    lower = pixels.largest_fitting(asked, budget, estimate, CandidatePool(asked, budget, estimate))
    best = _best_fit(lower, budget, estimate)
    if best is None:
        return None
    v = lower.model.vision
    px = lower.max_pixels
    return (f"smaller images: data.max_pixels: auto (--max-pixels auto) lowers it to {px:,} (about "
            f"{int(px ** 0.5)} x {int(px ** 0.5)}; {req.model.vision.tokens_per_image:,} -> {v.tokens_per_image:,} "
            f"tokens an image), where it fits (peak {gib(best.peak_bytes)}), but larger images lose detail")


def _larger_card_fits(req: PlanRequest, budget: Budget, estimate: Estimator) -> str | None:
    """The smallest card of the usual sizes, larger than this budget, on which ``req`` fits."""
    for gb in CARD_SIZES_GB:
        card = replace(budget, vram_bytes=CARD_REPORTED_FRACTION.of(gb * 2**30), source=card_words(gb))
        if card.vram_bytes <= budget.vram_bytes:
            continue
        best = _best_fit(req, card, estimate)
        if best is not None:
            method = ("full fine-tuning" if not best.setup.lora else
                      "LoRA" if best.setup.quantization == "none" else f"QLoRA ({best.setup.quantization})")
            return f"{method} fits {card_words(gb)} (peak {gib(best.peak_bytes)})"
    return None


def _describe(name: str, s: RunSetup) -> str:
    value = {
        "lora": "LoRA" if s.lora else "full fine-tuning", "quantization": s.quantization,
        "offload": s.offload, "optimizer": s.optimizer, "mixed_precision": s.precision,
        "gradient_checkpointing": "on" if s.gradient_checkpointing else "off", "loss": s.loss,
        "attention": s.attention, "micro_batch_size": s.micro_batch_size, "grad_accum": s.grad_accum,
        "activation_offload": "on" if s.activation_offload else "off",
    }[name]
    return str(value)


def _round_down(n: int) -> int:
    return n if n < 64 else n - n % 64


def _smaller_model(req: PlanRequest, budget: Budget, lowest: Candidate, estimate: Estimator) -> str | None:
    size = model_numel(req.model)
    best: tuple[int, str] | None = None
    for name in catalog_names():
        try:
            spec = resolve_model(name)
        except LowvramError:
            continue
        n = model_numel(spec)
        if n >= size or (best and n <= best[0]):
            continue
        if moe.attention_problems(spec, lowest.setup.attention):
            continue  # gpt-oss cannot run this setup's attention
        other = replace(lowest.setup, model=spec, tiled_mlp=lowest.setup.tiled_mlp and not spec.is_moe)
        if optimizer_problems(other) or vision_problems(spec.vision, other.offload, other.objective,
                                                        other.optimizer, other.tiled_mlp):
            continue  # a GaLore setup on an MoE or GPT-2 model (plan/memory/optimizers/), an offload
            # or a tiled MLP with a vision tower (plan/model/vision.py)
        if fits_budget(estimate(other), budget):
            best = (n, name)
    if best is None:
        return None
    return f"a smaller model: --model {best[1]} ({best[0] / 1e9:.1f}B parameters) fits"


__all__ = [
    "suggest_changes",
]
