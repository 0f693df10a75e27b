"""``data.max_pixels: auto`` (issue 47): the chooser lowers a Qwen-VL processor's max_pixels, on
the processor's grid, when no plan fits at the processor's own.

What each kind of knob changes (as GRPO's knobs: plan/memory/grpo.py, serialize's "knobs"): every
technique the search turns on changes the memory and the speed (or, asked for with optimizer
any-that-fits, the optimizer's algorithm), never what the model sees; a lower max_pixels changes
the data: each image larger than it is scaled down by the processor (fewer image tokens, less
detail). So it is the last resort. The start is the processor's own max_pixels (the checkpoint's
preprocessor_config.json, else Qwen2VLImageProcessor's 1,003,520: plan/model/image_size.py),
capped so data.images_per_row images leave a token of text in seq_len (images.image_problems);
where some plan the request allows fits there it stays. Where none does, it is the largest
max_pixels on the grid (tokens x (patch x merge)^2 px, never under min_pixels) at which some plan
fits: each candidate setup, lowest floor first, is bisected over the grid above the best found so
far (limits._largest_fitting, on the command's one Estimates pool); the peak only grows with the
image. The search then picks the plan at that size as usual. Where nothing fits even at the
smallest, the plan is made there and refused as usual (its binding moment, what would help).

Gemma-3 and Llava (fixed-size towers) and Llama-3.2-Vision (fixed tiles) have no pixel limit:
auto is their fixed size, said in the reason. Mistral-3 images stay refused (images.image_problems).
"""

from __future__ import annotations

from dataclasses import replace

from lowvram.plan.choose.explain import Estimator
from lowvram.plan.choose.limits import _fits, _largest_fitting
from lowvram.plan.choose.pool import CandidatePool
from lowvram.plan.choose.request import Budget, PlanRequest, Rung
from lowvram.plan.model.image_size import (
    FIXED_SIZE_TOWERS,
    pixel_limits,
    pixels_per_token,
    square_side,
    token_grid,
)
from lowvram.plan.model.vision import QWEN_VL_TOWERS

CHANGES = ("the data: each image larger than max_pixels is scaled down by the processor (fewer image tokens, "
           "less detail); lowered only when no plan fits at the processor's own, after every technique, which "
           "change the memory and the speed but not what the model sees")


def _asked(req: PlanRequest) -> bool:
    v = req.model.vision if req.model is not None else None
    return req.max_pixels_auto and bool(req.images_per_row) and v is not None


def lowerable(req: PlanRequest) -> bool:
    """data.max_pixels auto on image data for a Qwen-VL model (a tower with a pixel limit)."""
    return _asked(req) and req.model.vision.tower in QWEN_VL_TOWERS


def at_tokens(req: PlanRequest, tokens: int) -> PlanRequest:
    """``req`` with max_pixels at ``tokens`` image tokens on the grid (the model sized again)."""
    return replace(req, max_pixels=tokens * pixels_per_token(req.model.vision))


def auto_ceiling(req: PlanRequest) -> PlanRequest:
    """auto: the processor's own max_pixels, lowered on the grid only as far as a row of
    images_per_row images (of the tokens the plan counts: the bound, or the data's where measured)
    needs to keep a token of text in seq_len (else unchanged)."""
    if not lowerable(req):
        return req
    lo, _ = token_grid(req.model.vision, req.max_pixels, req.min_pixels)
    room = (req.seq_len - 1) // req.images_per_row
    return at_tokens(req, room) if lo <= room < req.model.vision.tokens_per_image else req


def largest_fitting(req: PlanRequest, budget: Budget, estimate: Estimator, pool: CandidatePool) -> PlanRequest:
    """``req`` (nothing fits at its max_pixels: ``pool`` is its candidates) at the largest max_pixels
    on the grid at which some candidate fits; at the smallest (min_pixels) when none does."""
    lo, hi = token_grid(req.model.vision, req.max_pixels, req.min_pixels)
    models: dict[int, object] = {}

    def model_at(t: int):
        if t not in models:
            models[t] = at_tokens(req, t).model
        return models[t]

    best = lo - 1
    if hi <= lo:
        return req  # already the smallest on the grid
    for o in sorted(pool.options, key=lambda o: (o.floor, o.index)):  # the leanest setups first
        def fits(t: int, s=o.setup) -> bool:
            return _fits(replace(s, model=model_at(t)), budget, estimate)

        if best + 1 >= hi or not fits(best + 1):
            continue  # this setup cannot go further than the best so far
        best = _largest_fitting(best + 1, hi - 1, fits)
    return at_tokens(req, max(best, lo))


def pixels_rung(start: tuple[Rung, ...], lowered: tuple[Rung, ...], value: str) -> Rung:
    """The ladder's last rung: max_pixels lowered, from the last technique's peak at the
    processor's own to the same plan's at the chosen size."""
    a, b = start[-1], lowered[-1]
    return Rung("max_pixels", value, b.peak_bytes, a.peak_bytes - b.peak_bytes, 1.0, b.fits,
                host_ram_bytes=b.host_ram_bytes)


def auto_pixels(asked: PlanRequest, chosen: PlanRequest, fits: bool) -> tuple[dict, dict[str, str]]:
    """(the plan's JSON "max_pixels_auto", its reason) for data.max_pixels auto; ({}, {}) without it.
    ``asked``: the request as made (the processor's own max_pixels); ``chosen``: as planned."""
    if not _asked(asked):
        return {}, {}
    v = asked.model.vision
    if v.tower not in QWEN_VL_TOWERS:
        size = (f"its processor cuts every image into {v.max_num_tiles} tiles of {v.image_size} px (the checkpoint "
                "fixes the count)" if v.tower == "mllama" else
                f"its processor resizes every image to {v.image_size} x {v.image_size} px ({v.tokens_per_image} "
                "tokens an image)" if v.tower in FIXED_SIZE_TOWERS else "its images are not sized by max_pixels")
        return ({"applies": False, "lowered": False, "reason": f"no pixel limit: {size}"},
                {"max_pixels": f"auto: the fixed size, no pixel limit to lower ({size})"})
    unit2 = pixels_per_token(v)
    _, t = token_grid(v, chosen.max_pixels, chosen.min_pixels)
    own_px = pixel_limits(v, asked.max_pixels, asked.min_pixels)[1]
    lo_px, px = pixel_limits(v, chosen.max_pixels, chosen.min_pixels)
    own_tokens, tokens = asked.model.vision.tokens_per_image, chosen.model.vision.tokens_per_image
    side = square_side(px)
    data = {"applies": True, "processor_max_pixels": own_px, "max_pixels": px, "min_pixels": lo_px,
            "pixels_per_token": unit2, "square_side": side, "processor_tokens_per_image": own_tokens,
            "tokens_per_image": tokens, "lowered": px < own_px, "fits": fits, "changes": CHANGES}
    at = f"max_pixels {px:,} (about {side} x {side})"
    if px == own_px:
        verdict = "a plan fits at it" if fits else "no plan fits, and it is the smallest the grid allows (min_pixels)"
        return data, {"max_pixels": f"auto: the processor's own {at}, {tokens:,} tokens an image: {verdict}"}
    room = (asked.seq_len - 1) // asked.images_per_row
    why = (f"{asked.images_per_row} image(s) of {own_tokens:,} tokens leave no text in seq_len {asked.seq_len}"
           if room < own_tokens and t == room else "no plan fits at it")
    cost = (f"{own_tokens:,} -> {tokens:,} tokens an image: images larger than {side} x {side} are scaled down "
            "(less detail)")
    if not fits:
        text = (f"auto: the processor's own max_pixels is {own_px:,} ({own_tokens:,} tokens an image) and "
                f"{why}; none fits even at the smallest on its {unit2:,}-px grid (not under min_pixels), {at}, "
                f"where it is planned: {cost}")
    else:
        nxt = "" if t == room else f"; one step larger, {(t + 1) * unit2:,}, fits no plan"
        text = (f"auto: the processor's own max_pixels is {own_px:,} ({own_tokens:,} tokens an image) and {why}; "
                f"lowered to {at}, the largest on its {unit2:,}-px grid that fits{nxt}: {cost}; lowered last, after "
                "every technique (they change the memory and the speed, not what the model sees)")
    return data, {"max_pixels": text}


__all__ = ["CHANGES", "at_tokens", "auto_ceiling", "auto_pixels", "largest_fitting", "lowerable", "pixels_rung"]
