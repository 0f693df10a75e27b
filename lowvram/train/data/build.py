"""Datasets for training: ``build_datasets(recipe, tokenizer)`` turns the recipe's ``data``
section into tokenized ``datasets.Dataset`` objects with ``input_ids``, ``attention_mask`` and
``labels`` columns (read.py -> format.py -> tokenize.py -> collate.py); ``make_collator``
(collate.py) pads them per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lowvram.errors import DataError
from lowvram.plan.memory.preference import RL_OBJECTIVES
from lowvram.recipe import Recipe
from lowvram.train.data.collate import ROW_COLUMN, columns, hold_out, pack, to_dataset
from lowvram.train.data.images import tokenize_image_rows
from lowvram.train.data.read import concrete_spec, load_rows
from lowvram.train.data.tokenize import Counts, tokenize_rows
from lowvram.train.types import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:  # pragma: no cover
    import datasets


@dataclass(frozen=True)
class ImageInputs:
    """What format image_chat renders with: the model's processor (AutoProcessor) and the
    config's image_token_id (the token each image is expanded into)."""

    processor: object
    image_token_id: int
    # Llama-3.2-Vision (MllamaProcessor): one image token an image in the sequence, the tiles
    # reach the language model through its cross-attention layers (data/images.py ImageCollator)
    cross_attention: bool = False


@dataclass(frozen=True)
class DataStats:
    train_rows: int  # rows of the train Dataset (windows when packed)
    eval_rows: int
    skipped_bad_rows: int  # rows skipped because data.skip_bad_rows was true
    truncated: int  # samples longer than seq_len (cut, or dropped below)
    train_tokens: int  # non-pad tokens in the train set
    response_tokens: int  # tokens with a label != -100 in the train set
    packed: bool
    dropped_no_response: int = 0  # of `truncated`: dropped, no trained token left after the cut
    train_samples: int = 0  # samples in the train set before packing
    # tokens the loss trains on: labels != -100 after the causal shift (a row's first label is
    # never predicted); None for preference pairs (TRL tokenizes them)
    trained_tokens: int | None = None


@dataclass(frozen=True)
class DataBundle:
    train: datasets.Dataset  # input_ids, attention_mask, labels (+ position_ids when packed)
    eval: datasets.Dataset | None
    stats: DataStats


def build_datasets(recipe: Recipe, tokenizer: PreTrainedTokenizerBase, images: ImageInputs | None = None) -> DataBundle:
    """Load, format, tokenize, mask, truncate (and pack) the recipe's datasets. A preference
    objective: the checked prompt/chosen/rejected pairs, which TRL tokenizes (data/preference.py).
    ``images``: the model's processor and image token, for format image_chat (data/images.py);
    every sample then carries its image paths (none for a text dataset beside it)."""
    if recipe.training.objective in RL_OBJECTIVES:
        return _prompt_bundle(recipe, tokenizer)
    if recipe.training.objective != "sft":
        return _preference_bundle(recipe)
    data = recipe.data
    counts = Counts()
    split_eval = isinstance(data.validation, str)
    train_samples: list[tuple] = []
    eval_samples: list[tuple] = []
    with_images = any(spec.format == "image_chat" for spec in data.datasets)
    if with_images and images is None:
        raise DataError("format image_chat needs a model with a vision tower and its processor",
                        "use a multimodal checkpoint (Gemma-3 4B+, Llava) or format: chat")

    if with_images and images.cross_attention and not all(spec.format == "image_chat" for spec in data.datasets):
        raise DataError("Llama-3.2-Vision cannot mix text datasets with image_chat ones: its image processor "
                        "takes no row without an image, and a batch would mix them",
                        "train the text datasets in a run of their own, or give their rows images")

    def samples(rows: list, spec) -> list:
        if spec.format == "image_chat":
            return tokenize_image_rows(rows, spec, recipe, images.processor, images.image_token_id, counts,
                                       expands=not images.cross_attention)
        out = tokenize_rows(rows, spec, recipe, tokenizer, counts)
        return [(ids, labels, []) for ids, labels in out] if with_images else out

    for spec in data.datasets:
        rows = load_rows(recipe, spec, spec.split, spec.max_samples)
        spec = concrete_spec(spec, rows)
        train_samples += samples(rows, spec)
        if split_eval:
            eval_rows = load_rows(recipe, spec, data.validation, None)
            eval_samples += samples(eval_rows, spec)
    if not train_samples:
        raise DataError(
            "no training samples left after formatting and truncation",
            f"check the data (skipped bad rows: {counts.skipped}, dropped as too long: "
            f"{counts.dropped}) or raise training.seq_len",
        )
    if isinstance(data.validation, float):
        train_samples, eval_samples = hold_out(train_samples, data.validation, recipe.training.seed)
    n_samples = len(train_samples)
    if data.packing:
        train_cols = pack(train_samples, recipe.training.seq_len)
    else:
        train_cols = columns(train_samples)
    train = to_dataset(train_cols)
    train = train.add_column(ROW_COLUMN, list(range(len(train))))  # the step's rows, by index (train/run/guard.py)
    eval_ds = to_dataset(columns(eval_samples)) if data.validation is not None else None
    stats = DataStats(
        train_rows=len(train),
        eval_rows=len(eval_ds) if eval_ds is not None else 0,
        skipped_bad_rows=counts.skipped,
        truncated=counts.truncated,
        train_tokens=sum(len(ids) for ids in train_cols["input_ids"]),
        response_tokens=sum(sum(lab != IGNORE_INDEX for lab in labs) for labs in train_cols["labels"]),
        packed=data.packing,
        dropped_no_response=counts.dropped,
        train_samples=n_samples,
        trained_tokens=sum(sum(lab != IGNORE_INDEX for lab in labs[1:]) for labs in train_cols["labels"]),
    )
    return DataBundle(train=train, eval=eval_ds, stats=stats)


def _preference_bundle(recipe: Recipe) -> DataBundle:
    from lowvram.train.data.preference import build_preference_datasets

    pairs = build_preference_datasets(recipe)
    stats = DataStats(train_rows=pairs.pairs, eval_rows=len(pairs.eval) if pairs.eval is not None else 0,
                      skipped_bad_rows=pairs.skipped_bad_rows, truncated=0, train_tokens=0,
                      response_tokens=0, packed=False, train_samples=pairs.pairs)
    return DataBundle(train=pairs.train, eval=pairs.eval, stats=stats)


def _prompt_bundle(recipe: Recipe, tokenizer: PreTrainedTokenizerBase | None) -> DataBundle:
    """grpo, rloo: the checked prompts, which TRL tokenizes at each generation (data/prompts.py)."""
    from lowvram.train.data.prompts import build_prompt_dataset

    prompts = build_prompt_dataset(recipe, tokenizer)
    stats = DataStats(train_rows=prompts.prompts, eval_rows=0, skipped_bad_rows=prompts.skipped_bad_rows,
                      truncated=0, train_tokens=0, response_tokens=0, packed=False, train_samples=prompts.prompts)
    return DataBundle(train=prompts.train, eval=None, stats=stats)
