"""`lowvram plan --image-table`: per card, the largest data.max_pixels a Qwen2.5-VL / Qwen3-VL
request reaches at its text length and images per row, over every plan it allows, the plan that
reaches it and what binds one rung larger.

The rungs are image-token counts on the processor's grid (max_pixels = tokens x (patch x merge)^2:
Qwen2VLImageProcessor's smart_resize puts at most max_pixels // unit^2 tokens in the text,
plan/model/image_size.py), from 16 tokens to the checkpoints' own 16,384 (Qwen2.5-VL's
preprocessor_config.json max_pixels 12,845,056 = 16,384 x 28^2; Qwen3-VL's longest_edge
16,777,216 = 16,384 x 32^2). A row is ``text`` tokens beside images_per_row images of the largest
size, so a plan at rung t has seq_len = text + images_per_row x t (the image tokens are part of
the language model's sequence: plan/memory/images.py). The search is the context table's
(limits.py): each plan in speed order that reaches the best rung so far is searched by bisection
over the rungs (the peak grows with the image), on the one Estimates pool the cards share."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lowvram.errors import LowvramError
from lowvram.plan.choose.explain import Estimator
from lowvram.plan.choose.limits import _fits, _largest_fitting, _limit_setups, plan_speed
from lowvram.plan.choose.pool import Estimates
from lowvram.plan.choose.request import Budget, PlanRequest
from lowvram.plan.choose.search import (
    describe_setup,
    sized_estimate,
    sized_loss_chunk,
    technique_words,
)
from lowvram.plan.model.image_size import FIXED_SIZE_TOWERS, pixel_limits, sized_vision
from lowvram.plan.model.vision import QWEN_VL_TOWERS, VisionSpec
from lowvram.plan.setup import RunSetup

# image tokens per image (each a max_pixels of tokens x unit^2), roughly x1.25-1.5 apart
TOKEN_LADDER: tuple[int, ...] = (16, 32, 64, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536, 2048,
                                 2560, 3072, 4096, 5120, 6144, 8192, 10240, 12288, 16384)

IMAGE_TABLE_HINT = ("--image-table sizes Qwen2.5-VL and Qwen3-VL images (dynamic resolution); for another "
                    "vision model plan its images with `lowvram plan --model M --images-per-row N --vram SIZE`")


@dataclass(frozen=True)
class ImageRow:
    """The largest max_pixels over every plan on one card (setup None: not even the smallest rung fits)."""

    card: str
    usable_bytes: int
    max_pixels: int  # 0: nothing fits
    image_tokens: int  # per image, at max_pixels
    seq_len: int  # text + images_per_row x image_tokens
    setup: RunSetup | None
    peak_bytes: int
    host_ram_bytes: int
    binds: str  # the moment of the same plan one rung larger ("" at the ladder's top or nothing fits)


def image_table_problem(v: VisionSpec | None) -> str | None:
    """Why a model has no pixel knob the table could turn (None for the Qwen-VL towers)."""
    if v is None:
        return "--image-table needs a vision model (this model has no vision tower)"
    if v.tower in QWEN_VL_TOWERS:
        return None
    if v.tower in FIXED_SIZE_TOWERS:
        return (f"--image-table has no pixel limit to turn for a {v.projector} model: its processor resizes "
                f"every image to {v.image_size} x {v.image_size} px ({v.tokens_per_image} tokens each)")
    if v.tower == "mllama":
        return (f"--image-table has no pixel limit to turn for Llama-3.2-Vision: its processor cuts every image "
                f"into {v.max_num_tiles} tiles of {v.image_size} px (the checkpoint's tile embeddings fix the "
                "count), and one <|image|> token a row reaches them through cross-attention")
    return (f"--image-table cannot size {v.projector} images: their plan is not modelled (no run has measured "
            "them; transformers' PixtralProcessor needs torchvision, which the CPU build of torch here cannot load)")


def rungs(req: PlanRequest, text: int) -> tuple[int, ...]:
    """The ladder's token counts at or above min_pixels whose rows stay within the model's positions."""
    v = req.model.vision
    unit2 = (v.patch_size * v.merge_size) ** 2
    lo, _ = pixel_limits(v, None, req.min_pixels)
    return tuple(t for t in TOKEN_LADDER if t * unit2 >= lo
                 and text + req.images_per_row * t <= req.model.max_position_embeddings)


def at_rung(s: RunSetup, text: int, tokens: int, min_pixels: int | None) -> RunSetup:
    """``s`` with each image at ``tokens`` tokens (max_pixels on the grid) and its row that much longer."""
    v = s.model.vision
    unit2 = (v.patch_size * v.merge_size) ** 2
    sized = sized_vision(v, tokens * unit2, min_pixels)
    return replace(s, model=replace(s.model, vision=sized), seq_len=text + s.images_per_row * tokens)


def largest_image(req: PlanRequest, budget: Budget, estimate: Estimates, text: int
                  ) -> tuple[int, RunSetup | None]:
    """(index into rungs(req, text) + 1 of the largest image some plan fits (0: none), that plan)."""
    ladder = rungs(req, text)
    best: tuple[int, RunSetup | None] = (0, None)
    for s in sorted(_limit_setups(req, budget), key=plan_speed):
        fits = lambda i, s=s: _fits(at_rung(s, text, ladder[i - 1], req.min_pixels), budget, estimate)  # noqa: E731
        if best[1] is not None and not fits(best[0]):
            continue
        n = _largest_fitting(1, len(ladder), fits, beyond=best[0])
        if n > best[0]:
            best = (n, sized_loss_chunk(at_rung(s, text, ladder[n - 1], req.min_pixels), budget, estimate))
    return best


def image_table(req: PlanRequest, cards: list[tuple[str, Budget]], estimate: Estimator, text: int) -> list[ImageRow]:
    """One ImageRow per (card, budget): ``req`` (images_per_row set, a Qwen-VL model) at ``text`` text tokens."""
    if problem := image_table_problem(req.model.vision):
        raise LowvramError(problem, IMAGE_TABLE_HINT)
    estimate = Estimates.of(estimate)  # the cards share what they estimate
    ladder = rungs(req, text)
    if not ladder:
        raise LowvramError(f"{text:,} text tokens and {req.images_per_row} image(s) of {TOKEN_LADDER[0]} tokens or "
                           f"more are past {req.model.name}'s {req.model.max_position_embeddings:,} positions",
                           "lower --seq-len (the text tokens) or --images-per-row")
    rows = []
    for card, budget in cards:
        n, s = largest_image(req, budget, estimate, text)
        if s is None:
            rows.append(ImageRow(card, budget.usable_bytes, 0, 0, 0, None, 0, 0, ""))
            continue
        tokens = ladder[n - 1]
        binds = "" if n == len(ladder) else sized_estimate(
            at_rung(s, text, ladder[n], req.min_pixels), budget, estimate)[1].peak_moment
        est = estimate(s)
        unit2 = (s.model.vision.patch_size * s.model.vision.merge_size) ** 2
        rows.append(ImageRow(card, budget.usable_bytes, tokens * unit2, tokens, s.seq_len, s, est.peak_bytes,
                             est.cpu_ram_bytes, binds))
    return rows


def image_table_to_dict(req: PlanRequest, rows: list[ImageRow], text: int) -> dict:
    """`lowvram plan --image-table --json`: the request in words and one row per card."""
    v = req.model.vision
    return {"model": req.model.name, "text_tokens": text, "images_per_row": req.images_per_row,
            "pixels_per_token": (v.patch_size * v.merge_size) ** 2, "ladder_tokens": list(rungs(req, text)),
            "rows": [{"card": r.card, "budget_bytes": r.usable_bytes, "max_pixels": r.max_pixels or None,
                      "image_tokens": r.image_tokens or None, "seq_len": r.seq_len or None,
                      "plan": describe_setup(r.setup) if r.setup else None,
                      "techniques_used": (", ".join(technique_words(r.setup)) or "nothing") if r.setup else None,
                      "peak_bytes": r.peak_bytes, "host_ram_bytes": r.host_ram_bytes, "binds": r.binds or None}
                     for r in rows]}


__all__ = ["IMAGE_TABLE_HINT", "ImageRow", "TOKEN_LADDER", "image_table", "image_table_problem",
           "image_table_to_dict", "largest_image", "rungs"]
