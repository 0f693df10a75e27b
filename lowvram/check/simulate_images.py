"""`lowvram plan --simulate` with images: the image + text batch of a plan made the way `lowvram train`
makes it, for the simulated step (lowvram.check.simulate) to run on fake tensors.

The batch comes from lowvram's own ImageCollator (lowvram.train.data.images) over PNG images of the
largest size the plan allows, through the family's transformers image processor: Qwen2.5-VL and
Qwen3-VL (Qwen2VLImageProcessor at the plan's pixel limit: an image of exactly tokens_per_image
tokens, its sides multiples of patch x merge), Llama-3.2-Vision (MllamaImageProcessor: every image
padded to max_num_tiles tiles of image_size), Gemma-3 and Llava (resized to image_size). Each row
holds images_per_row images, their placeholder tokens expanded as the family's processor expands
them (Qwen: <|vision_start|> + tokens x <|image_pad|> + <|vision_end|>; Gemma-3: <start_of_image> +
mm_tokens_per_image x <image_soft_token> + <end_of_image>; Llava: tokens_per_image x <image>;
Llama-3.2-Vision: one <|image|>), never labelled, and random text to seq_len.

Fake tensors have no values, and these models read some (how many image tokens a row holds, each
image's grid, the packed tower's sequence lengths): the batch's integer tensors become fake
tensors that keep their values (FakeTensorMode's constants, which it propagates through any op on
constants alone), and the tower's index tensors that transformers computes from the grid with
factory functions (vision_utils.get_vision_*: positions, cu_seqlens, window index, Qwen3-VL's
interpolation taps) are computed before the step with those same functions and passed as the
``image_*`` keyword arguments transformers accepts for precomputed values
(utils.generic.accepts_precomputed_kwargs) [W8]. Their bytes are the batch's (a few hundred KiB at
16,384 patches), alive through the step where the model frees them after the tower.

The Trainer holds the step's grad_accum micro-batches and the next (plan/memory/images.py
batches_alive): the simulation keeps that many copies of the batch alive beside the step.

Mistral-3 (Pixtral) images are refused: the plan does not model them. torch and transformers are
imported inside the functions."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from lowvram.plan.model.image_size import QWEN_MIN_PIXELS
from lowvram.plan.model.vision import QWEN_VL_TOWERS
from lowvram.plan.setup import RunSetup

SIMULATED_PROJECTORS = ("qwen2_5_vl", "qwen3_vl", "mllama", "gemma3", "llava")
# integer inputs the models read values of (kept as constants); the pixels stay plain fake tensors
_VALUED = ("input_ids", "labels", "image_grid_thw", "mm_token_type_ids", "token_type_ids")
TEXT_IDS = 30_000  # random text ids below every family's special tokens


def image_problem(setup: RunSetup) -> str | None:
    """Why the images of ``setup`` cannot be simulated (None when they can, or there are none)."""
    v = setup.model.vision
    if not setup.images_per_row or v is None:
        return None
    if v.projector not in SIMULATED_PROJECTORS:
        return (f"images with a {v.projector} model are not simulated (the plan does not model them: "
                "transformers' PixtralProcessor needs torchvision)")
    return None


def _grid(tokens: int) -> tuple[int, int]:
    """(rows, columns) of merged tokens, rows * columns == tokens, as square as it goes."""
    rows = max(d for d in range(1, int(tokens ** 0.5) + 1) if tokens % d == 0)
    return rows, tokens // rows


def image_processor(setup: RunSetup):
    """The family's transformers image processor at the plan's image size."""
    v = setup.model.vision
    side = v.image_size
    if v.tower in QWEN_VL_TOWERS:
        from transformers import Qwen2VLImageProcessorPil

        unit = v.patch_size * v.merge_size
        most = v.tokens_per_image * unit * unit
        return Qwen2VLImageProcessorPil(size={"shortest_edge": min(QWEN_MIN_PIXELS, most), "longest_edge": most},
                                        patch_size=v.patch_size, merge_size=v.merge_size,
                                        temporal_patch_size=v.temporal_patch_size)
    if v.tower == "mllama":
        from transformers import MllamaImageProcessorPil

        return MllamaImageProcessorPil(size={"height": side, "width": side}, max_image_tiles=v.max_num_tiles)
    if v.projector == "gemma3":
        from transformers import Gemma3ImageProcessorPil

        return Gemma3ImageProcessorPil(size={"height": side, "width": side})
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})


def _image_pixels(setup: RunSetup) -> tuple[int, int]:
    """(width, height) of the largest image the plan allows."""
    v = setup.model.vision
    if v.tower in QWEN_VL_TOWERS:
        unit = v.patch_size * v.merge_size
        rows, cols = _grid(v.tokens_per_image)
        return cols * unit, rows * unit
    if v.tower == "mllama":  # 2 x 2 tiles' worth: the processor pads to max_num_tiles anyway
        return 2 * v.image_size, 2 * v.image_size
    return v.image_size, v.image_size


def _placeholder(config, v) -> tuple[list[int], int]:
    """(the tokens one image puts in a row, the image token id the collator marks)."""
    if v.tower in QWEN_VL_TOWERS:
        pad = config.image_token_id
        return [config.vision_start_token_id, *[pad] * v.tokens_per_image, config.vision_end_token_id], pad
    if v.tower == "mllama":
        return [config.image_token_index], config.image_token_index
    if v.projector == "gemma3":
        image = config.image_token_index
        return [config.boi_token_index, *[image] * v.tokens_per_image, config.eoi_token_index], image
    return [config.image_token_index] * v.tokens_per_image, config.image_token_index


def image_batch(setup: RunSetup, config, folder: Path, seed: int = 0) -> dict:
    """The micro-batch `lowvram train` gives the model (real tensors): ImageCollator over
    micro_batch_size rows of seq_len tokens, images_per_row images each."""
    import torch
    from PIL import Image

    from lowvram.train.data.collate import PadCollator
    from lowvram.train.data.images import ImageCollator

    v = setup.model.vision
    width, height = _image_pixels(setup)
    path = folder / "image.png"
    Image.new("RGB", (width, height), (120, 80, 40)).save(path)
    image, image_id = _placeholder(config, v)
    if len(image) * setup.images_per_row >= setup.seq_len:  # the plan refuses it (images.image_problems)
        from lowvram.errors import LowvramError

        raise LowvramError(f"{setup.images_per_row} image(s) of {len(image)} tokens leave no room for text in "
                           f"seq_len {setup.seq_len}", "raise training.seq_len, or lower data.max_pixels")
    specials = {image_id, *image}
    g = torch.Generator().manual_seed(seed)
    features = []
    for _ in range(setup.micro_batch_size):
        images = image * setup.images_per_row
        text = torch.randint(0, min(TEXT_IDS, config.get_text_config().vocab_size),
                             (setup.seq_len - len(images),), generator=g).tolist()
        text = [0 if t in specials else t for t in text]
        ids = text[:8] + images + text[8:]
        labels = [-100 if i in specials else i for i in ids]
        features.append({"input_ids": ids, "labels": labels, "images": [str(path)] * setup.images_per_row})
    collate = ImageCollator(PadCollator(pad_id=0), image_processor(setup), image_id,
                            token_type_ids=v.projector == "gemma3", cross_attention=v.tower == "mllama",
                            mm_token_type_ids=v.tower in QWEN_VL_TOWERS)
    return dict(collate(features))


def precomputed_inputs(model, batch: dict) -> dict:
    """[W8] The Qwen-VL inputs the model computes from the batch's values with factory functions:
    the text's M-RoPE position ids (the model's own get_rope_index, as its forward calls it without
    position_ids) and the tower's index tensors (transformers' vision_utils functions, the
    tower's first step), as the keyword arguments transformers takes precomputed (``image_*``)."""
    from transformers import vision_utils as vu

    grid = batch.get("image_grid_thw")
    inner = getattr(model.get_base_model() if hasattr(model, "get_base_model") else model, "model", None)
    visual = getattr(inner, "visual", None)
    if grid is None or visual is None:
        return {}
    cfg = visual.config
    positions, _ = inner.get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                        image_grid_thw=grid)
    out = {"position_ids": positions, "image_position_ids": vu.get_vision_position_ids(grid, cfg.spatial_merge_size),
           "image_cu_seqlens": vu.get_vision_cu_seqlens(grid)}
    if hasattr(cfg, "window_size"):  # Qwen2.5-VL's window attention
        out["image_window_index"], out["image_cu_window_seqlens"] = vu.get_vision_window_index(
            grid, cfg.spatial_merge_size, cfg.window_size, cfg.patch_size)
    if getattr(visual, "num_grid_per_side", None):  # Qwen3-VL's learned positions, resampled
        out["image_interp_indices"], out["image_interp_weights"] = vu.get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=cfg.spatial_merge_size)
    return out


def fake_batch(mode, batch: dict) -> dict:
    """``batch`` as fake tensors: integer inputs keep their values (constants), float ones do not."""
    import torch

    conv = mode.fake_tensor_converter
    out = {}
    for k, t in batch.items():
        valued = k in _VALUED or (k.startswith("image_") and not t.is_floating_point())
        out[k] = conv.from_real_tensor(mode, t, make_constant=True) if valued else mode.from_tensor(t)
        if valued and not isinstance(out[k].constant, torch.Tensor):
            raise AssertionError(k)
    return out


@contextmanager
def valued_constants():
    """[W8] FakeTensorMode keeps an op's result as a constant only up to CONSTANT_NUMEL_LIMIT
    elements (1): let the batch's integer tensors (b x s at most) keep their values through the
    ops on them alone."""
    import torch._subclasses.fake_tensor as ft

    saved = ft.CONSTANT_NUMEL_LIMIT
    ft.CONSTANT_NUMEL_LIMIT = 1 << 40
    try:
        yield
    finally:
        ft.CONSTANT_NUMEL_LIMIT = saved


__all__ = ["SIMULATED_PROJECTORS", "fake_batch", "image_batch", "image_problem",
           "precomputed_inputs", "valued_constants"]
