"""Tokenize formatted rows: each segment alone, concatenated, so the prompt/response boundary is
exact and the training tokens are the ones the model sees at inference, where the prompt is
tokenized alone and the answer is generated after it. Labels are ``IGNORE_INDEX`` on untrained
segments unless ``data.train_on_inputs`` is true; samples longer than ``training.seq_len`` are cut."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lowvram.errors import DataError
from lowvram.recipe import DatasetSpec, Recipe
from lowvram.train.data.format import CHAT_FORMATS, ChatRenderer, Segments, check_fields, segments
from lowvram.train.data.read import BadRow, Row
from lowvram.train.types import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class Counts:
    skipped: int = 0
    truncated: int = 0
    dropped: int = 0


def _special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids the tokenizer puts before a text by default (a BOS), found by comparison."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            return list(full[:k])
    return []


def tokenize_rows(rows: list[Row], spec: DatasetSpec, recipe: Recipe, tokenizer: PreTrainedTokenizerBase,
                   counts: Counts, lengths: list[int] | None = None,
                   kept: list[Row] | None = None) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each row, cut to seq_len; ``lengths`` collects each sample's tokens
    before the cut (the data check's statistics), ``kept`` the row of each sample returned (`lowvram
    eval` scores the held-out rows' answers)."""
    check_fields(spec)
    chat = (ChatRenderer(tokenizer, spec, last_only=recipe.data.train_on == "last")
            if spec.format in CHAT_FORMATS else None)
    all_segments: list[Segments] = []
    sources: list[Row] = []
    for row in rows:
        try:
            all_segments.append(segments(row.data, spec, chat))
            sources.append(row)
        except BadRow as e:
            if recipe.data.skip_bad_rows:
                counts.skipped += 1
                continue
            raise DataError(
                f"{row.where}: {e}",
                "fix the row, map your column names with fields: {...}, or set "
                "data.skip_bad_rows: true to skip and count bad rows",
            ) from None
    if not all_segments:
        return []
    # Chat templates write their own BOS and end-of-turn tokens; other formats get the
    # tokenizer's default prefix (BOS) and an eos after the response so the model learns to stop.
    prefix = [] if chat is not None else _special_prefix(tokenizer)
    eos = [] if chat is not None else [tokenizer.eos_token_id]
    if chat is None and tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos token", "use the tokenizer of a causal language model")
    ids_of = _batch_tokenize(tokenizer, (t for segs in all_segments for t, _ in segs))
    seq_len = recipe.training.seq_len
    train_all = trains_all(recipe)
    out = []
    for segs, row in zip(all_segments, sources, strict=True):
        ids, labels = list(prefix), [IGNORE_INDEX] * len(prefix)
        for text, trained in segs:
            piece = ids_of[text]
            if trained and eos:
                piece = piece + eos
            ids += piece
            labels += piece if (trained or train_all) else [IGNORE_INDEX] * len(piece)
        if lengths is not None:
            lengths.append(len(ids))
        if len(ids) > seq_len:
            counts.truncated += 1
            ids, labels = ids[:seq_len], labels[:seq_len]
            if all(lab == IGNORE_INDEX for lab in labels):
                counts.dropped += 1
                continue
        out.append((ids, labels))
        if kept is not None:
            kept.append(row)
    return out


def prompt_ids(segs: Segments, tokenizer: PreTrainedTokenizerBase, chat: bool) -> list[int] | None:
    """The tokens before the last trained segment, tokenized as tokenize_rows does (each segment
    alone, the default prefix for non-chat formats): the prompt a model answers at inference.
    None when nothing comes before it (format text)."""
    last = max((i for i, (_, trained) in enumerate(segs) if trained), default=None)
    if not last:
        return None
    ids = [] if chat else _special_prefix(tokenizer)
    for text, _ in segs[:last]:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    return ids


def trains_all(recipe: Recipe) -> bool:
    """Every token carries the loss (data.train_on: all, or its older spelling train_on_inputs)."""
    return recipe.data.train_on == "all" or recipe.data.train_on_inputs


def _batch_tokenize(tokenizer: PreTrainedTokenizerBase, texts: Iterable[str]) -> dict[str, list[int]]:
    unique = list(dict.fromkeys(t for t in texts if t))  # prompts repeat (alpaca header, chat)
    ids: dict[str, list[int]] = {"": []}
    for start in range(0, len(unique), 1000):
        chunk = unique[start:start + 1000]
        encoded = tokenizer(chunk, add_special_tokens=False)["input_ids"]
        ids.update(zip(chunk, encoded, strict=True))
    return ids
