"""Held-out data for `lowvram eval`: the samples training held out (data.validation: the same
fraction, chosen with the same seed, or the named split), or the rows of a given file, each
tokenized exactly as training tokenized it (read.py -> format.py -> tokenize.py, collate.hold_out),
with the prompt a model answers at inference and the reference answer of prompt-answer rows.

tests/train/test_eval.py checks that the held-out samples are the very rows of build_datasets' eval set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lowvram.errors import DataError
from lowvram.recipe import DatasetSpec, Recipe
from lowvram.train.data.collate import hold_out
from lowvram.train.data.format import (
    CHAT_FORMATS,
    ChatRenderer,
    format_example,
    message_list,
    row_spec,
    segments,
)
from lowvram.train.data.read import Row, concrete_spec, load_rows
from lowvram.train.data.tokenize import Counts, prompt_ids, tokenize_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The formats whose rows are a language-modelling sample (the others are preference pairs, prompts
# for RL, or images: their loss is not a token loss of one text).
EVAL_FORMATS = ("alpaca", "chat", "sharegpt", "completion", "text")


@dataclass(frozen=True)
class EvalRow:
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX on the untrained tokens, as in training
    prompt_ids: list[int] | None  # the tokens before the answer (None: a text row, no prompt)
    answer: str | None  # the reference: output / completion column, or the last assistant message
    where: str  # file:line


@dataclass(frozen=True)
class EvalSet:
    rows: list[EvalRow]
    source: str  # what was read, for the report: "data.validation 0.1 (held out with seed 42)", a file
    skipped_bad_rows: int
    dropped: int  # rows with no trained token left after the cut to seq_len


def held_out_set(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> EvalSet:
    """The rows training evaluated on (data.validation), tokenized as training did."""
    data = recipe.data
    if data.validation is None:
        raise DataError("the run held no data out: its recipe has no data.validation",
                        "pass --data FILE (rows in the recipe's format), or train with data.validation: 0.1")
    counts = Counts()
    pairs: list[tuple[tuple, Row, DatasetSpec]] = []
    for spec in data.datasets:
        rows = load_rows(recipe, spec, spec.split, spec.max_samples)
        spec = _checked(concrete_spec(spec, rows))
        if isinstance(data.validation, str):  # a named split: every row of it is evaluated
            rows = load_rows(recipe, spec, data.validation, None)
        pairs += _samples(rows, spec, recipe, tokenizer, counts)
    if isinstance(data.validation, float):  # the same samples build_datasets holds out (same seed)
        _, pairs = hold_out(pairs, data.validation, recipe.training.seed)
        source = f"data.validation {data.validation:g} (held out with seed {recipe.training.seed})"
    else:
        source = f"data.validation split '{data.validation}'"
    return _eval_set(pairs, recipe, tokenizer, source, counts)


def file_set(recipe: Recipe, tokenizer: PreTrainedTokenizerBase, path: Path) -> EvalSet:
    """Every row of ``path``, read with the recipe's first dataset's format, fields and roles
    (format auto: recognised from the file's columns), tokenized as training did."""
    first = recipe.data.datasets[0]
    spec = first.model_copy(update={"path": str(path.resolve()), "split": "train", "max_samples": None,
                                    "name": None})
    if spec.format not in EVAL_FORMATS and spec.format != "auto":  # a preference/RL run: read the file's own layout
        spec = DatasetSpec(path=str(path.resolve()))
    counts = Counts()
    rows = load_rows(recipe, spec, "train", None)
    spec = _checked(concrete_spec(spec, rows))
    return _eval_set(_samples(rows, spec, recipe, tokenizer, counts), recipe, tokenizer, str(path), counts)


def _checked(spec: DatasetSpec) -> DatasetSpec:
    if spec.format not in EVAL_FORMATS:
        raise DataError(f"{spec.path}: format {spec.format} has no token loss to evaluate",
                        f"pass --data FILE with rows of one of {', '.join(EVAL_FORMATS)} (e.g. question/answer)")
    return spec


def _samples(rows: list[Row], spec: DatasetSpec, recipe: Recipe, tokenizer, counts: Counts) -> list:
    kept: list[Row] = []
    samples = tokenize_rows(rows, spec, recipe, tokenizer, counts, kept=kept)
    return [(s, row, spec) for s, row in zip(samples, kept, strict=True)]


def _eval_set(pairs: list, recipe: Recipe, tokenizer, source: str, counts: Counts) -> EvalSet:
    if not pairs:
        raise DataError(f"no rows to evaluate in {source}",
                        f"skipped bad rows: {counts.skipped}, dropped as too long: {counts.dropped}")
    renderers: dict[int, ChatRenderer] = {}
    out = []
    for (ids, labels), row, spec in pairs:
        chat = None
        if spec.format in CHAT_FORMATS:
            chat = renderers.setdefault(id(spec), ChatRenderer(tokenizer, spec, last_only=recipe.data.train_on == "last"))
        segs = segments(row.data, spec, chat)
        out.append(EvalRow(list(ids), list(labels), prompt_ids(segs, tokenizer, chat is not None),
                           _answer(row.data, spec), row.where))
    return EvalSet(out, source, counts.skipped, counts.dropped)


def _answer(row: dict, spec: DatasetSpec) -> str | None:
    """The reference answer: the alpaca output / completion column, or the last assistant
    message's text (a chat row); None for a text row or an assistant turn that is not text."""
    spec = row_spec(row, spec)
    if spec.format in CHAT_FORMATS:
        _, messages = message_list(row, spec)
        last = next((m for m in reversed(messages) if m["role"] == "assistant"), None)
        content = last.get("content") if last else None
        return content if isinstance(content, str) else None
    if spec.format == "text":
        return None
    return format_example(row, spec)[1]
