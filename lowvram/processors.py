"""The processor of a Qwen2.5-VL / Qwen3-VL checkpoint for image + text training, without its video
processor: AutoProcessor builds Qwen2_5_VLProcessor / Qwen3VLProcessor with a video processor that
needs torchvision (Qwen2VLVideoProcessor, Qwen3VLVideoProcessor: ``requires_backends``), which
lowvram does not install; video is refused anyway (lowvram.train.data.images). The same processor
class, its image processor (AutoImageProcessor: the PIL backend without torchvision), tokenizer and
chat template, so the text and the image tokens are the checkpoint's own."""

from __future__ import annotations

from pathlib import Path

# the chat template's files beside a checkpoint's tokenizer (transformers 5: processor_config.json's
# or chat_template.jinja; older checkpoints: chat_template.json)
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
# the special tokens Qwen2_5_VLProcessor / Qwen3VLProcessor read from the tokenizer (with their
# defaults when the tokenizer does not name them)
SPECIAL_TOKENS = (("image_token", "<|image_pad|>"), ("video_token", "<|video_pad|>"),
                  ("vision_start_token", "<|vision_start|>"), ("vision_end_token", "<|vision_end|>"))


def image_only_processor(model_type: str, image_processor, tokenizer, chat_template: str | None):
    """The family's processor class over an image processor and a tokenizer (no video)."""
    from transformers import ProcessorMixin, Qwen2_5_VLProcessor, Qwen3VLProcessor

    base = Qwen3VLProcessor if model_type == "qwen3_vl" else Qwen2_5_VLProcessor

    class ImageOnlyProcessor(base):  # get_attributes reads this __init__: image_processor, tokenizer
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            for name, default in SPECIAL_TOKENS:  # as the family's own __init__ sets them
                token = getattr(tokenizer, name, None) or default
                setattr(self, name, token)
                setattr(self, name + "_id", tokenizer.convert_tokens_to_ids(token))

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = base.__name__
    return ImageOnlyProcessor(image_processor, tokenizer, chat_template=chat_template)


def load_image_only_processor(source: str, model_type: str, revision: str | None = None,
                              trust_remote_code: bool = False):
    """image_only_processor of a checkpoint folder or hub id: its preprocessor_config.json, its
    tokenizer and its chat template (the tokenizer's, else the processor's template file)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    kw = dict(revision=revision, trust_remote_code=trust_remote_code)
    images = AutoImageProcessor.from_pretrained(source, **kw)
    tokenizer = AutoTokenizer.from_pretrained(source, **kw)
    template = getattr(tokenizer, "chat_template", None) or _template_file(source, revision)
    return image_only_processor(model_type, images, tokenizer, template)


def _template_file(source: str, revision: str | None) -> str | None:
    import json

    from transformers.utils import cached_file

    for name in TEMPLATE_FILES:
        local = Path(source).expanduser() / name
        path = local if local.is_file() else cached_file(source, name, revision=revision,
                                                         _raise_exceptions_for_missing_entries=False)
        if path is None or not Path(path).is_file():
            continue
        text = Path(path).read_text()
        return json.loads(text).get("chat_template") if name.endswith(".json") else text
    return None
