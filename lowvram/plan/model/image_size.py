"""How large an image gets in the vision tower and how many tokens it costs the language model,
from the recipe's pixel limits (data.max_pixels / data.min_pixels, None: the processor's own).

One key for every family, each mapping it to its processor's rule:
- Qwen2.5-VL, Qwen3-VL (dynamic resolution): Qwen2VLImageProcessor resizes an image with
  ``smart_resize`` (image_processing_qwen2_vl.py, transformers 5.25) to sides that are multiples
  of ``patch_size * merge_size`` (28 px for Qwen2.5-VL, 32 for Qwen3-VL) whose product lies within
  ``size.shortest_edge`` .. ``size.longest_edge`` (the min_pixels / max_pixels of its
  preprocessor_config.json; class defaults 56 * 56 and 28 * 28 * 1280). Its pixel values are one
  row per patch, ``(grid_t * grid_h * grid_w, channels * temporal_patch_size * patch^2)``
  float32 (a still image repeated over temporal_patch_size frames: Qwen2VLImageProcessor.patchify),
  and the processor puts ``grid_h * grid_w / merge^2`` image tokens in the text
  (Qwen2_5_VLProcessor.replace_image_token). So an image costs at most
  ``max_pixels // (patch * merge)^2`` tokens (smart_resize never exceeds max_pixels: it floors
  both sides once the rounded product is over it), at least ``ceil(min_pixels / unit^2)``.
- Gemma-3, Llava (fixed size): every image is resized to the tower's image_size; their tokens
  do not depend on max_pixels (refused with a hint: the key does not apply).
- Llama-3.2-Vision (tiles) and Mistral-3 (longest edge) map the same key through their own
  knobs (:func:`image_geometry` names them not sized yet).

``data.max_pixels: auto`` lets the chooser lower max_pixels on this grid (plan/choose/pixels.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lowvram.plan.model.vision import QWEN_VL_TOWERS, VisionSpec

# Qwen2VLImageProcessor.size (image_processing_qwen2_vl.py, the Qwen-VL families' image
# processor in transformers 5.25): shortest_edge (min_pixels) and longest_edge (max_pixels)
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 28 * 28 * 1280
# the towers whose image size is fixed by their processor (data.max_pixels does not apply)
FIXED_SIZE_TOWERS = ("siglip", "clip")


IMAGE_SIZE_HINT = ("set data.max_pixels (lowvram plan --max-pixels) for a Qwen2.5-VL or Qwen3-VL model, "
                   "at least one image token and no less than data.min_pixels; leave it out for other models")


@dataclass(frozen=True)
class ImageGeometry:
    """The largest image one row's image brings, as the plan sizes it."""

    max_pixels: int  # the pixel limit used (the recipe's, or the processor's own)
    min_pixels: int
    patches: int  # the tower's sequence for this image (before the patch merger)
    tokens: int  # image tokens in the language model's sequence
    pixel_values_bytes: int  # the image processor's float32 pixel values of this image


def image_size_problem(v: VisionSpec | None, max_pixels: int | None, min_pixels: int | None) -> str | None:
    """Why the pixel limits cannot apply to this model (None when they can)."""
    if max_pixels is None and min_pixels is None:
        return None
    if v is None:
        return "data.max_pixels / data.min_pixels apply to a model with a vision tower (this model has none)"
    if v.tower in FIXED_SIZE_TOWERS:
        return (f"data.max_pixels / data.min_pixels do not apply to a {v.projector} tower: its processor "
                f"resizes every image to {v.image_size} x {v.image_size} px ({v.tokens_per_image} tokens)")
    if v.tower not in QWEN_VL_TOWERS:
        return f"data.max_pixels / data.min_pixels are not mapped for the {v.tower} tower yet"
    lo, hi = pixel_limits(v, max_pixels, min_pixels)
    unit = v.patch_size * v.merge_size
    if hi < unit * unit:
        return f"data.max_pixels {hi:,} is under one image token ({unit} x {unit} = {unit * unit:,} px)"
    if lo > hi:
        return f"data.min_pixels {lo:,} is above data.max_pixels {hi:,}"
    return None


def pixel_limits(v: VisionSpec, max_pixels: int | None, min_pixels: int | None) -> tuple[int, int]:
    """(min_pixels, max_pixels) with the processor's defaults filled in."""
    return (QWEN_MIN_PIXELS if min_pixels is None else min_pixels,
            QWEN_MAX_PIXELS if max_pixels is None else max_pixels)


def image_geometry(v: VisionSpec, max_pixels: int | None = None, min_pixels: int | None = None) -> ImageGeometry:
    """The largest image the limits allow (Qwen-VL: max_pixels // unit^2 tokens, 4 patches a
    token); a fixed-size tower's one size."""
    c = v.num_channels
    if v.tower in QWEN_VL_TOWERS:
        lo, hi = pixel_limits(v, max_pixels, min_pixels)
        unit = v.patch_size * v.merge_size
        tokens = max(1, hi // (unit * unit))
        patches = tokens * v.merge_size ** 2
        row = c * v.temporal_patch_size * v.patch_size ** 2
        return ImageGeometry(hi, lo, patches, tokens, 4 * patches * row)
    side = v.image_size
    return ImageGeometry(side * side, side * side, v.patches, v.tokens_per_image, 4 * c * side * side)


def pixels_per_token(v: VisionSpec) -> int:
    """The processor's grid: one image token is (patch x merge)^2 pixels (Qwen2.5-VL 784, Qwen3-VL
    1,024), so max_pixels = tokens x this is the largest image of that many tokens."""
    return (v.patch_size * v.merge_size) ** 2


def token_grid(v: VisionSpec, max_pixels: int | None, min_pixels: int | None) -> tuple[int, int]:
    """(fewest, most) tokens an image may be limited to on the grid between the pixel limits: the
    smallest max_pixels on the grid not under min_pixels (never below one token), and the tokens
    max_pixels itself allows (image_geometry)."""
    lo, hi = pixel_limits(v, max_pixels, min_pixels)
    unit2 = pixels_per_token(v)
    return max(1, -(-lo // unit2)), max(1, hi // unit2)


def square_side(max_pixels: int) -> int:
    """The side of a square image of max_pixels pixels (an image larger than it is scaled down)."""
    from math import isqrt

    return isqrt(max_pixels)


def patches_per_image(v: VisionSpec) -> int:
    """The tower's sequence for the largest image of a (sized_vision) VisionSpec."""
    return v.tokens_per_image * v.merge_size ** 2 if v.tower in QWEN_VL_TOWERS else v.patches


def pixel_values_bytes(v: VisionSpec) -> int:
    """The image processor's float32 pixel values of the largest image of a sized VisionSpec."""
    if v.tower in QWEN_VL_TOWERS:
        return 4 * patches_per_image(v) * v.num_channels * v.temporal_patch_size * v.patch_size ** 2
    return 4 * v.num_channels * v.image_size ** 2


def sized_vision(v: VisionSpec, max_pixels: int | None, min_pixels: int | None,
                 image_tokens: int | None = None) -> VisionSpec:
    """The VisionSpec at these limits: a Qwen-VL tower's tokens_per_image (the largest image's)
    and image_size (the largest square side within max_pixels, as vision._qwen_vl_spec sizes
    it); others unchanged. ``image_tokens``: the costliest image the data really has (measured
    under the processor by lowvram.train.data.image_check), which the plan sizes for when it is
    under the limits' bound."""
    if v.tower not in QWEN_VL_TOWERS:
        return v
    g = image_geometry(v, max_pixels, min_pixels)
    unit = v.patch_size * v.merge_size
    side = max(unit, int(g.max_pixels ** 0.5) // unit * unit)
    tokens = min(g.tokens, image_tokens) if image_tokens else g.tokens
    return replace(v, tokens_per_image=max(1, tokens), image_size=side)


def sized_model(model, max_pixels: int | None, min_pixels: int | None, image_tokens: int | None = None):
    """``model`` (a ModelSpec) with its Qwen-VL tower sized (sized_vision); unchanged without
    limits or measured images, or where the limits do not apply (idempotent)."""
    v = getattr(model, "vision", None)
    if v is None or not (max_pixels or min_pixels or image_tokens) or image_size_problem(v, max_pixels, min_pixels):
        return model
    return replace(model, vision=sized_vision(v, max_pixels, min_pixels, image_tokens))
