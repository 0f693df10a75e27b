"""Format image_chat measured on the data (`validate`, `lowvram data`, and the plan of
`lowvram train`): what each image costs in the language model's sequence under the model's own
processor, the longest row in text + image tokens, the most images a row holds, and the rows
training cuts, drops or refuses at ``training.seq_len``, by file and row.

Each row goes through the tokenizer training uses (images.ImageChatTokenizer: the processor and
the chat template, so a row's tokens are the ones training gets) and is cut as training cuts it
(images.fit_to_seq_len). An image's tokens are the processor's own count from the image's size
(``processor._get_num_multimodal_tokens``, transformers 5.25, the function vLLM reads a
processor's placeholder count from): Qwen2.5-VL / Qwen3-VL
``image_processor.get_number_of_image_patches`` (smart_resize within size.shortest_edge /
longest_edge, the min/max_pixels data.max_pixels sets) over merge_size^2; Gemma-3 its
image_seq_length; Llava its crop size over the patch size (+ the CLS token under strategy
"full"). Llama-3.2-Vision's processor keeps one <|image|> token an image (its tiles reach the
language model through cross-attention): 1.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from lowvram.recipe import DatasetSpec, Recipe
from lowvram.train.data.images import bad_image_row, fit_to_seq_len, image_tokenizer
from lowvram.train.data.read import BadRow, Row


@dataclass(frozen=True)
class ImageCost:
    """One image of the data: its row, its entry, its size and the tokens it costs."""

    where: str  # file:line of the row
    image: str  # the row's entry: the path as written, or images[j] for a dataset's image
    width: int
    height: int
    tokens: int


@dataclass(frozen=True)
class RowCost:
    """A row's tokens as training reads it, before the cut at seq_len."""

    where: str
    tokens: int  # text + image tokens
    image_tokens: int
    images: int
    outcome: str = "fits"  # fits, cut (text after its images cut off), dropped (no trained token left),
    # refused (seq_len would cut into its images: an error), skipped (refused, data.skip_bad_rows)


@dataclass(frozen=True)
class ImageReport:
    """The image rows of a recipe's data, measured under its processor."""

    processor: str  # the processor's class
    min_pixels: int | None  # Qwen-VL: size.shortest_edge / longest_edge as the run sets them
    max_pixels: int | None
    seq_len: int
    rows: int  # image_chat rows measured
    images: tuple[ImageCost, ...]  # every image, in row order
    max_images_per_row: int
    min_image_tokens: int  # tokens an image costs over the data's images (0: no image)
    median_image_tokens: int
    max_image_tokens: int
    longest_row: RowCost | None  # of the rows training keeps, the one with the most tokens (text + image)
    over_seq_len: tuple[RowCost, ...]  # rows longer than seq_len and what training does with them


def image_token_counts(processor, sizes: list[tuple[int, int]], expands: bool = True) -> list[int]:
    """The tokens each image of ``sizes`` ((height, width) each) costs in the sequence, as the
    processor counts them (module docstring); ``expands`` False: one token an image (mllama)."""
    if not sizes:
        return []
    if not expands:
        return [1] * len(sizes)
    data = processor._get_num_multimodal_tokens(image_sizes=[list(s) for s in sizes])
    return [int(n) for n in data["num_image_tokens"]]


def pixel_limits_of(processor) -> tuple[int | None, int | None]:
    """(min_pixels, max_pixels) of a Qwen-VL image processor (size.shortest_edge / longest_edge),
    (None, None) for a fixed-size one."""
    images = getattr(processor, "image_processor", None)
    size = getattr(images, "size", None)
    if size is None or getattr(images, "merge_size", None) is None:
        return None, None

    def get(key: str) -> int | None:
        value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
        return int(value) if value else None

    return get("shortest_edge"), get("longest_edge")


def image_size(path) -> tuple[int, int]:
    """(height, width) from the file's header (PIL reads no pixel data for it)."""
    from PIL import Image

    with Image.open(path) as img:
        return img.height, img.width


@dataclass
class ImageMeasure:
    """Accumulates image_chat datasets' rows (:meth:`add`), then :meth:`report`."""

    recipe: Recipe
    processor: object
    image_token_id: int
    expands: bool = True
    images: list[ImageCost] = field(default_factory=list)
    rows: list[RowCost] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # "file:line: what", rows training refuses
    lengths: list[int] = field(default_factory=list)  # each sample's tokens before the cut
    samples: list[tuple[str, list[int], list[int]]] = field(default_factory=list)  # (where, ids, labels) as cut
    skipped: int = 0

    def add(self, rows: list[Row], spec: DatasetSpec) -> None:
        tok = image_tokenizer(spec, self.recipe, self.processor, self.image_token_id, self.expands)
        column = spec.fields.get("images", "images")
        seq_len = self.recipe.training.seq_len
        for row in rows:
            try:
                ids, labels, paths = tok.sample(row.data)
            except BadRow as e:
                self._refused(row, e)
                continue
            entries = _entries(row.data, column, len(paths))
            sizes = [image_size(p) for p in paths]
            costs = image_token_counts(self.processor, sizes, self.expands)
            self.images += [ImageCost(row.where, entry, w, h, n)
                            for entry, (h, w), n in zip(entries, sizes, costs, strict=True)]
            cost = RowCost(row.where, len(ids), ids.count(self.image_token_id), len(paths))
            try:
                ids, labels, outcome = fit_to_seq_len(ids, labels, seq_len, self.image_token_id)
            except BadRow as e:
                self.rows.append(_with(cost, "skipped" if self.recipe.data.skip_bad_rows else "refused"))
                self._refused(row, e)
                continue
            self.rows.append(_with(cost, outcome or "fits"))
            self.lengths.append(cost.tokens)
            if outcome != "dropped":
                self.samples.append((row.where, ids, labels))

    def _refused(self, row: Row, e: BadRow) -> None:
        if self.recipe.data.skip_bad_rows:
            self.skipped += 1
        else:
            self.problems.append(bad_image_row(row, e).message)

    def report(self) -> ImageReport:
        lo, hi = pixel_limits_of(self.processor)
        kept = [r for r in self.rows if r.outcome in ("fits", "cut")]  # the rows training trains on
        longest = max(kept, key=lambda r: r.tokens, default=None)  # the first of the longest
        tokens = sorted(i.tokens for i in self.images) or [0]
        return ImageReport(
            processor=type(self.processor).__name__, min_pixels=lo, max_pixels=hi,
            seq_len=self.recipe.training.seq_len, rows=len(self.rows), images=tuple(self.images),
            max_images_per_row=max((r.images for r in self.rows), default=0),
            min_image_tokens=tokens[0], median_image_tokens=int(statistics.median(tokens)),
            max_image_tokens=tokens[-1], longest_row=longest,
            over_seq_len=tuple(r for r in self.rows if r.outcome != "fits"))


def _with(cost: RowCost, outcome: str) -> RowCost:
    return RowCost(cost.where, cost.tokens, cost.image_tokens, cost.images, outcome)


def _entries(row: dict, column: str, n: int) -> list[str]:
    """How the row names each of its images: the path as written, else images[j]."""
    value = row.get(column)
    value = [value] if not isinstance(value, list) else value
    return [v if isinstance(v, str) else f"{column}[{j}]" for j, v in enumerate(value[:n])] + [
        f"{column}[{j}]" for j in range(len(value), n)]


def data_image_extent(recipe: Recipe, processor, expands: bool = True) -> tuple[int, int, int] | None:
    """(the most images a row holds, the most image tokens a row holds, the costliest image's
    tokens) over every row of the recipe's image_chat datasets, from each row's image list and
    each file's header under the processor (image_token_counts; no pixel decoded, no row
    rendered): what the plan of `lowvram train` is sized for. None when a dataset is not a local
    file (a hub dataset: the plan bounds from data.images_per_row and the pixel limits). A row
    training refuses (a missing image, more images than data.images_per_row) is left to the
    data check, which names it."""
    from lowvram.train.data.images import image_paths
    from lowvram.train.data.read import is_local, load_rows

    per_row = row_tokens = largest = 0
    for spec in recipe.data.datasets:
        if spec.format != "image_chat":
            continue
        path = recipe.resolve_path(spec.path)
        if not is_local(path, spec.path):
            return None
        for row in load_rows(recipe, spec, spec.split, spec.max_samples):
            try:
                entries = image_paths(row.data, spec) if isinstance(row.data, dict) else []
                sizes = [_stored_size(e, path.parent) for e in entries]
            except (BadRow, OSError, ValueError):
                continue
            if not sizes or len(sizes) > recipe.data.images_per_row:
                continue
            tokens = image_token_counts(processor, sizes, expands)
            per_row, row_tokens = max(per_row, len(tokens)), max(row_tokens, sum(tokens))
            largest = max(largest, *tokens)
    return (per_row, row_tokens, largest) if per_row else None


def _stored_size(entry, base: Path) -> tuple[int, int]:
    """(height, width) of a row's image: a file (relative to the data file) or a dataset's image."""
    import io

    if isinstance(entry, str):
        p = Path(entry).expanduser()
        return image_size(str(p if p.is_absolute() else base / p))
    if isinstance(entry, dict):
        if isinstance(entry.get("bytes"), bytes):
            return image_size(io.BytesIO(entry["bytes"]))
        return image_size(entry["path"])
    return entry.height, entry.width  # a decoded PIL image
