"""A multimodal checkpoint's processor for format image_chat: its image processor, tokenizer and
chat template, with data.max_pixels / data.min_pixels applied (Qwen-VL), and the config's image
token. Training loads it beside the model (load_image_inputs); the data check (`validate`, `lowvram
data`) from the folder's config.json alone, without the weights (local_image_inputs)."""

from __future__ import annotations

from pathlib import Path

from lowvram.errors import DataError, LowvramError, ModelError
from lowvram.train.build.model import _first_line
from lowvram.train.build.vision import has_vision

# multimodal families whose processor sizes each image within min/max_pixels (dynamic resolution)
QWEN_VL_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")


def load_image_inputs(recipe, source: str, model, max_pixels: int | None = None):
    """Format image_chat: the checkpoint's processor and the config's image token (image_inputs);
    None when no dataset is image_chat. ``max_pixels``: the plan's (data.max_pixels auto)."""
    if not any(d.format == "image_chat" for d in recipe.data.datasets):
        return None
    return image_inputs(recipe, source, model.config, max_pixels)


def image_inputs(recipe, source: str, config, max_pixels: int | None = None):
    """The processor of ``source`` (AutoProcessor: image processor, tokenizer and chat template;
    Qwen-VL's without its video processor) and ``config``'s image token. Its max_pixels: the
    recipe's data.max_pixels, or under auto ``max_pixels`` (the size the plan chose:
    Plan.max_pixels), or without either the processor's own."""
    from lowvram.train.data.build import ImageInputs

    if not has_vision(config):
        raise DataError(f"format image_chat needs a model with a vision tower; {source} has none "
                        f"(model_type {getattr(config, 'model_type', '?')})",
                        "use a multimodal checkpoint (Gemma-3 4B+, Llava) or format: chat")
    from transformers import AutoProcessor

    model_type = getattr(config, "model_type", "")
    try:
        if model_type in QWEN_VL_MODEL_TYPES:  # its processor without the video one (needs torchvision)
            from lowvram.processors import load_image_only_processor

            processor = load_image_only_processor(source, model_type, recipe.model.revision,
                                                  recipe.model.trust_remote_code)
        else:
            processor = AutoProcessor.from_pretrained(source, revision=recipe.model.revision,
                                                      trust_remote_code=recipe.model.trust_remote_code)
    except (OSError, ValueError, TypeError, ImportError) as e:
        processor = None
        why = _first_line(e)
    else:
        why = f"AutoProcessor gave a {type(processor).__name__}"
    if processor is None or not hasattr(processor, "image_processor") or not hasattr(processor, "image_token"):
        raise ModelError(f"format image_chat needs the model's processor and {source} has none usable ({why})",
                         "a multimodal checkpoint folder holds processor_config.json and "
                         "preprocessor_config.json beside the tokenizer files")
    if model_type in QWEN_VL_MODEL_TYPES:  # data.max_pixels / min_pixels: the plan sized the images by them
        own = processor.image_processor.size  # a SizeDict (or a dict) with shortest_edge / longest_edge
        size = {k: own[k] if isinstance(own, dict) else getattr(own, k) for k in ("shortest_edge", "longest_edge")}
        asked = max_pixels if recipe.data.max_pixels == "auto" else recipe.data.max_pixels
        size.update({k: n for k, n in (("longest_edge", asked),
                                        ("shortest_edge", recipe.data.min_pixels)) if n is not None})
        processor.image_processor.size = size
    return ImageInputs(processor, int(config.image_token_id), cross_attention=model_type == "mllama")


def local_image_inputs(recipe):
    """(image_inputs, None) of the recipe's model folder when a dataset is image_chat and the
    folder is on this machine (its config.json and processor files; no weights loaded), else
    (None, why). A model without a vision tower is the DataError training would raise."""
    from lowvram.train.build.model import resolve_model_location

    try:
        source = resolve_model_location(recipe)
    except LowvramError as e:
        return None, e.message
    if not Path(source).is_dir():
        return None, f"{recipe.model.name_or_path} is a hub id: image tokens are counted with its processor on this machine"
    from lowvram.train.build.quiet import quiet_libraries

    quiet_libraries()  # before transformers imports torch (torchao's import lines)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=recipe.model.trust_remote_code)
    except (OSError, ValueError) as e:
        return None, f"the config of {source} cannot be read ({_first_line(e)})"
    try:
        return image_inputs(recipe, source, config), None
    except ModelError as e:
        return None, e.message
