"""Image + text data, format ``image_chat``: chat messages whose content holds image parts, and
an ``images`` column of image files, rendered through the model's processor and chat template.

The row shape is TRL's SFTTrainer's (``messages`` with ``{"type": "image"}`` and ``{"type":
"text", "text": ...}`` content parts, and an ``images`` list) and LLaMA-Factory's multimodal
ShareGPT (an ``<image>`` placeholder inside text content counts as an image part too). Image paths
are relative to the data file. Each image part becomes the processor's placeholder in the chat
template's text; the processor (transformers Gemma3Processor / LlavaProcessor
``replace_image_token``) expands it into the image's tokens, tokens_per_image of them
(lowvram.plan.model.vision). Labels are on assistant turns only (ChatRenderer's segments) and never on
an image token. The dataset keeps the token ids and the image paths: pixel values are made per
batch by :class:`ImageCollator` (the processor's image processor), not stored.

A row whose file is missing, not an image PIL can open, larger than :data:`IMAGE_MAX_PIXELS`, or
whose placeholders and images differ in number is an error by file and row (or skipped and
counted with data.skip_bad_rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowvram.errors import DataError
from lowvram.recipe import DatasetSpec, Recipe
from lowvram.train.data.collate import PadCollator
from lowvram.train.data.format import (
    MESSAGES_EXPECTED,
    ChatRenderer,
    check_fields,
    message_list,
    short_repr,
)
from lowvram.train.data.read import BadRow, Row
from lowvram.train.data.tokenize import trains_all
from lowvram.train.types import IGNORE_INDEX

# The largest image accepted, in pixels (width x height): 4096 x 4096. The processors resize every
# image to the tower's side (896 px for Gemma-3, 336 for Llava-1.5), so a larger file only costs
# decoding time and host memory; PIL itself refuses from 2 x 89,478,485 pixels (a decompression
# bomb, PIL.Image.MAX_IMAGE_PIXELS) and this limit stops well below that with a row to fix.
IMAGE_MAX_PIXELS = 4096 * 4096

ImageSample = tuple[list[int], list[int], list[str]]  # input_ids, labels, image paths


class BadImage(BadRow):
    """A row whose image cannot be used; carries its own hint."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


def open_image(path: Path, shown: str):
    """The image at ``path`` decoded and in RGB, or BadImage naming ``shown`` (the row's entry)."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise BadImage(f"image file not found: {shown} ({path})",
                       "paths in images are relative to the data file; check the file exists")
    try:
        with Image.open(path) as img:
            pixels = img.width * img.height
            if pixels > IMAGE_MAX_PIXELS:
                raise BadImage(f"image {shown} is {img.width} x {img.height} = {pixels:,} pixels, over the "
                               f"limit of {IMAGE_MAX_PIXELS:,} (4096 x 4096)",
                               "resize it (the processor resizes every image to the vision tower's side anyway)")
            img.load()
            return img.convert("RGB")
    except BadImage:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise BadImage(f"image {shown} cannot be opened as an image ({type(e).__name__}: {e})",
                       "replace the file with a valid PNG, JPEG or WebP image") from None


def image_messages(row: dict, spec: DatasetSpec) -> list[dict]:
    """The row's messages with text or content-part content (the chat template renders both)."""
    column, messages = message_list(row, spec)
    expected = MESSAGES_EXPECTED
    out = []
    for j, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    continue
                if kind == "video":
                    raise BadImage(f"field '{column}', message {j}, part {k}: video is not supported (format "
                                   "image_chat trains on still images)",
                                   "drop the video parts, or give a few of its frames as images")
                if kind != "image":
                    raise BadRow(f"field '{column}', message {j}, part {k}: expected {{type: text, text}} "
                                 f"or {{type: image}}, got {short_repr(part)}")
            # Keep only type/text: Arrow loading fills absent keys with None
            content = [{"type": "image"} if p["type"] == "image" else {"type": "text", "text": p["text"]}
                       for p in content]
        elif not isinstance(content, str):
            got = type(content).__name__ if "content" in m else "no content"
            raise BadRow(f"field '{column}', message {j}: 'content' must be text or a list of parts, got {got}")
        out.append({**m, "content": content})
    if not any(m["role"] == "assistant" and _text_of(m["content"]).strip() for m in out):
        raise BadRow(f"field '{column}': {expected} with at least one non-empty assistant message")
    return out


def _text_of(content: str | list[dict]) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _is_image(value: Any) -> bool:
    """A hub dataset's image: a decoded PIL image, or datasets' {bytes, path} form."""
    if isinstance(value, dict):
        return isinstance(value.get("bytes"), bytes) or isinstance(value.get("path"), str)
    return hasattr(value, "save") and hasattr(value, "size")


def image_paths(row: dict, spec: DatasetSpec) -> list:
    """The row's images: file paths (str), or a hub dataset's images (datasets' Image feature)."""
    column = spec.fields.get("images", "images")
    value = row.get(column)
    if value is None:
        return []
    if isinstance(value, str) or _is_image(value):
        return [value]
    if not isinstance(value, list) or not all((isinstance(p, str) and p) or _is_image(p) for p in value):
        raise BadRow(f"field '{column}': expected a list of image file paths (or a dataset's images), "
                     f"got {short_repr(value)}")
    return list(value)


def stored_image(value: Any, folder: Path) -> Path:
    """A hub dataset's image written once as a file under ``folder`` (named by its content), so
    the collator reads it per batch like a local file and the dataset keeps a path."""
    import hashlib
    import io

    if isinstance(value, dict) and not isinstance(value.get("bytes"), bytes):
        return Path(value["path"])  # datasets' form of a file it did not embed
    if isinstance(value, dict):
        data = value["bytes"]
    else:
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        data = buf.getvalue()
    path = folder / (hashlib.sha256(data).hexdigest()[:32] + ".img")
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return path


@dataclass
class ImageChatTokenizer:
    """Renders and tokenizes image_chat rows with the model's processor.

    ``image_token_id``: the model config's image_token_id, the token each image becomes
    tokens_per_image of (never a label); ``base``: the folder image paths are relative to."""

    processor: Any
    spec: DatasetSpec
    image_token_id: int
    base: Path
    max_images: int
    train_all: bool = False  # data.train_on: all
    last_only: bool = False  # data.train_on: last
    cache: Path | None = None  # where a hub dataset's images are written (a temporary folder)
    # the processor expands each placeholder into the image's tokens (Gemma-3, Llava); False for
    # Llama-3.2-Vision, whose <|image|> stays one token (MllamaProcessor.replace_image_token) and whose
    # processor call would put a bos token into every piece (build_string_from_input): the
    # tokenizer tokenizes its pieces, the collator makes the tiles
    expands: bool = True

    def __post_init__(self) -> None:
        self.chat = ChatRenderer(self.processor, self.spec, eos=self.processor.tokenizer.eos_token,
                                 last_only=self.last_only)
        self.placeholder = self.processor.image_token

    def _path(self, entry: Any) -> str:
        if not isinstance(entry, str):  # a hub dataset's image
            if self.cache is None:
                import atexit
                import shutil
                import tempfile

                self.cache = Path(tempfile.mkdtemp(prefix="lowvram-images-"))
                atexit.register(shutil.rmtree, self.cache, True)
            return str(stored_image(entry, self.cache))
        p = Path(entry).expanduser()
        return str(p if p.is_absolute() else self.base / p)

    def sample(self, row: Any) -> ImageSample:
        """(input_ids, labels, image paths) of one row, untruncated."""
        if isinstance(row, BadRow):
            raise row
        if not isinstance(row, dict):
            raise BadRow(f"expected an object with fields, got {type(row).__name__} {short_repr(row)}")
        messages = image_messages(row, self.spec)
        if row.get("videos"):
            raise BadImage("the row has videos: video is not supported (format image_chat trains on still images)",
                           "drop the videos column, or give a few of each video's frames as images")
        paths = image_paths(row, self.spec)
        segs = self.chat.segments_of(messages)
        placeholders = sum(text.count(self.placeholder) for text, _ in segs)
        column = self.spec.fields.get("images", "images")
        if placeholders != len(paths):
            raise BadImage(f"{placeholders} image placeholder(s) in the messages ({{type: image}} parts or "
                           f"'{self.placeholder}') but {len(paths)} image(s) in '{column}'",
                           "give one image file per {type: image} part, in order")
        if not paths and not self.expands:  # MllamaImageProcessor takes no row without an image
            raise BadImage("a row without an image: Llama-3.2-Vision's image processor takes none, and a batch "
                           "cannot mix rows with and without images",
                           "give the row an image, or train text rows in a run of their own (format chat)")
        if len(paths) > self.max_images:
            raise BadImage(f"{len(paths)} images in the row, more than data.images_per_row "
                           f"({self.max_images}), the number the plan counts",
                           f"raise data.images_per_row to {len(paths)} (the plan then counts that many)")
        resolved = [self._path(s) for s in paths]
        shown = [f"'{s}'" if isinstance(s, str) else f"{column}[{j}] (an image of the dataset)"
                 for j, s in enumerate(paths)]
        images = [open_image(Path(r), s) for r, s in zip(resolved, shown, strict=True)]
        ids: list[int] = []
        labels: list[int] = []
        used = 0
        for text, trained in segs:
            n = text.count(self.placeholder)
            if n and self.expands:
                piece = self.processor(text=[text], images=[images[used:used + n]], add_special_tokens=False)
                self._check_grid(piece, shown[used:used + n])
                piece = [int(i) for i in piece["input_ids"][0]]
                used += n
            else:
                piece = self.processor.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids += piece
            labels += [IGNORE_INDEX if (not (trained or self.train_all) or i == self.image_token_id) else i
                       for i in piece]
        return ids, labels, resolved

    def _check_grid(self, piece, shown: list[str]) -> None:
        """A Qwen-VL image over the plan's bound (a sliver: smart_resize keeps one unit for its
        short side and floors the long one, past max_pixels): refused by file and row."""
        grids = piece.get("image_grid_thw")
        bound = image_token_bound(self.processor) if grids is not None else None
        if bound is None:
            return
        merge = int(self.processor.image_processor.merge_size) ** 2
        for grid, name in zip(grids, shown, strict=True):
            tokens = int(grid[0]) * int(grid[1]) * int(grid[2]) // merge
            if tokens > bound:
                raise BadImage(f"image {name} costs {tokens} tokens, more than the {bound} the plan counts at "
                               f"data.max_pixels (its aspect ratio keeps it over max_pixels after resizing)",
                               "crop or pad the image nearer to a square, or raise data.max_pixels")


def image_token_bound(processor) -> int | None:
    """The most tokens a Qwen-VL image may cost, the plan's bound (plan/model/image_size.py):
    size.longest_edge (max_pixels) // (patch * merge)^2; None for a fixed-size processor."""
    images = getattr(processor, "image_processor", None)
    size, merge = getattr(images, "size", None), getattr(images, "merge_size", None)
    longest = (size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None))
    if not longest or not merge:
        return None
    return int(longest) // (int(images.patch_size) * int(merge)) ** 2


def image_tokenizer(spec: DatasetSpec, recipe: Recipe, processor, image_token_id: int,
                    expands: bool = True) -> ImageChatTokenizer:
    """The ImageChatTokenizer training renders a dataset's rows with (the data check's too)."""
    return ImageChatTokenizer(processor, spec, image_token_id, recipe.resolve_path(spec.path).parent,
                              recipe.data.images_per_row, train_all=trains_all(recipe),
                              last_only=recipe.data.train_on == "last", expands=expands)


def fit_to_seq_len(ids: list[int], labels: list[int], seq_len: int, image_token_id: int):
    """(ids, labels, outcome) of a sample cut to seq_len: outcome None (it fits), "cut" (text
    after its images cut off) or "dropped" (no trained token left: training drops it); a cut
    into its image tokens is a BadImage (the images would not match their tokens)."""
    if len(ids) <= seq_len:
        return ids, labels, None
    n_image = ids.count(image_token_id)
    if ids[:seq_len].count(image_token_id) != n_image:
        raise BadImage(f"the row is {len(ids)} tokens, and training.seq_len {seq_len} would cut "
                       f"into its images' {n_image} tokens",
                       "raise training.seq_len, or put the images before the long text")
    ids, labels = ids[:seq_len], labels[:seq_len]
    return ids, labels, "dropped" if all(lab == IGNORE_INDEX for lab in labels) else "cut"


def bad_image_row(row: Row, e: BadRow) -> DataError:
    """A row training cannot read, by file and row, with its own hint or the data one."""
    hint = getattr(e, "hint", None) or ("fix the row, map your column names with fields: {...}, or set "
                                        "data.skip_bad_rows: true to skip and count bad rows")
    return DataError(f"{row.where}: {e}", hint)


def tokenize_image_rows(rows: list[Row], spec: DatasetSpec, recipe: Recipe, processor, image_token_id: int,
                        counts, expands: bool = True) -> list[ImageSample]:
    """The (input_ids, labels, image paths) samples of an image_chat dataset, cut to seq_len;
    a row whose image tokens would be cut is an error (fit_to_seq_len)."""
    check_fields(spec)
    tok = image_tokenizer(spec, recipe, processor, image_token_id, expands)
    out: list[ImageSample] = []
    for row in rows:
        try:
            ids, labels, paths = tok.sample(row.data)
            ids, labels, outcome = fit_to_seq_len(ids, labels, recipe.training.seq_len, image_token_id)
        except BadRow as e:
            if recipe.data.skip_bad_rows:
                counts.skipped += 1
                continue
            raise bad_image_row(row, e) from None
        counts.truncated += outcome is not None
        if outcome == "dropped":
            counts.dropped += 1
            continue
        out.append((ids, labels, paths))
    return out


@dataclass(frozen=True)
class ImageCollator:
    """PadCollator's batch plus the images' pixel values (the processor's image processor, all the
    batch's images in row order, as the model's get_image_features takes them) and, for a model
    whose processor returns them (Gemma-3), token_type_ids: 1 on image tokens, which makes
    Gemma-3's attention bidirectional within an image (modeling_gemma3 create_masks_for_vision_model).
    Qwen2.5-VL / Qwen3-VL: also each image's image_grid_thw (its patch grid, which the tower and the
    merger read) and mm_token_type_ids (1 on image tokens), from which the model computes its
    M-RoPE position ids (modeling_qwen2_5_vl.py compute_3d_position_ids: only with both, and no
    position_ids in the batch: lowvram never packs image rows).

    ``cross_attention`` (Llama-3.2-Vision): the images per row as MllamaImageProcessor takes them
    (a list per row: pixel_values b x images x max_image_tiles x 3 x side x side, aspect_ratio_ids,
    aspect_ratio_mask) and the cross_attention_mask (b x seq x images x tiles: each text token
    sees the tiles of the images before it) made by MllamaProcessor's own functions from the
    padded input_ids, as its __call__ makes it (processing_mllama.py
    get_cross_attention_token_mask, convert_sparse_cross_attention_mask_to_dense)."""

    pad: PadCollator
    image_processor: Any
    image_token_id: int
    token_type_ids: bool
    cross_attention: bool = False
    mm_token_type_ids: bool = False

    def __call__(self, features: list[dict]) -> dict:
        rows = [list(f.get("images") or []) for f in features]
        batch = self.pad([{k: v for k, v in f.items() if k != "images"} for f in features])
        if self.cross_attention:
            if any(rows):
                batch.update(self._tiles(rows, batch["input_ids"]))
            return batch
        paths = [p for row in rows for p in row]
        if paths:
            images = [open_image(Path(p), p) for p in paths]
            pixels = self.image_processor(images=images, return_tensors="pt")
            batch["pixel_values"] = pixels["pixel_values"]
            if "image_grid_thw" in pixels:
                batch["image_grid_thw"] = pixels["image_grid_thw"]
        if self.token_type_ids:
            batch["token_type_ids"] = (batch["input_ids"] == self.image_token_id).long()
        if self.mm_token_type_ids:
            batch["mm_token_type_ids"] = (batch["input_ids"] == self.image_token_id).int()
        return batch

    def _tiles(self, rows: list[list[str]], input_ids) -> dict:
        import torch
        from transformers.models.mllama.processing_mllama import (
            convert_sparse_cross_attention_mask_to_dense,
            get_cross_attention_token_mask,
        )

        if not all(rows):  # refused up front (ImageChatTokenizer.sample, build_datasets)
            raise DataError("a batch mixes rows with and without images, which Llama-3.2-Vision's image "
                            "processor does not take", "give every image_chat row an image, or train the "
                            "text rows in a run of their own")
        out = self.image_processor(images=[[open_image(Path(p), p) for p in row] for row in rows],
                                   return_tensors="pt")
        tokens = [get_cross_attention_token_mask(r, self.image_token_id) for r in input_ids.tolist()]
        mask = convert_sparse_cross_attention_mask_to_dense(
            tokens, num_tiles=out.pop("num_tiles"), max_num_tiles=self.image_processor.max_image_tiles,
            length=input_ids.shape[1])
        return {**out, "cross_attention_mask": torch.from_numpy(mask)}


def make_image_collator(processor, image_token_id: int, pad: PadCollator, cross_attention: bool = False) -> ImageCollator:
    names = getattr(processor, "model_input_names", [])
    return ImageCollator(pad, processor.image_processor, image_token_id,
                         "token_type_ids" in names and not cross_attention, cross_attention,
                         "mm_token_type_ids" in names)
