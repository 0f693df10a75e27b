"""The recipe's data checked as training will read it, without loading the model: `validate`,
`train --dry-run` and `lowvram data`.

Every row of each local file (files up to ``FULL_CHECK_BYTES``; beyond, ``SPREAD_ROWS`` JSON Lines
rows spread evenly over the file) goes through the same readers training uses (format.py,
preference.py, images.py), so a row without the format's fields is reported by file and line in
seconds, all at once. With a tokenizer that is on this machine, the rows are also tokenized as
training will: the length distribution, what ``seq_len`` cuts or drops, and rendered samples with
the trained tokens marked.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.recipe import DatasetSpec, Recipe
from lowvram.train.data.format import CHAT_FORMATS, _messages, format_example
from lowvram.train.data.read import BadRow, Row, concrete_spec, is_local, jsonl_rows, load_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lowvram.train.data.build import ImageInputs
    from lowvram.train.data.image_check import ImageReport

FULL_CHECK_BYTES = 64 << 20  # files up to 64 MiB: every row checked (a few seconds at most)
SPREAD_ROWS = 2000  # larger JSON Lines files: this many rows, spread evenly over the file
MAX_LISTED = 20  # problems printed; the rest are counted
PREFERENCE_FORMATS = ("preference", "unpaired")


@dataclass(frozen=True)
class FileCheck:
    path: str  # as the recipe wrote it
    format: str  # the concrete format (recognised when the recipe left it out)
    rows: int  # rows read (all of them, or the spread sample)
    bad_rows: int
    sampled: bool  # a spread sample of a large file, not every row
    local: bool = True  # False: a hub dataset, checked when it downloads


@dataclass(frozen=True)
class TokenStats:
    samples: int
    seq_len: int
    min_tokens: int
    median_tokens: int
    p95_tokens: int
    max_tokens: int
    truncated: int  # samples longer than seq_len: cut to it
    dropped: int  # of those, left with no trained token: dropped by training
    trained_tokens: int  # tokens that carry the loss, after the cut
    total_tokens: int


@dataclass(frozen=True)
class RenderedSample:
    where: str  # file:line of the row
    pieces: tuple[tuple[str, bool], ...]  # (text as decoded, trained)
    tokens: int
    trained_tokens: int


@dataclass(frozen=True)
class DataReport:
    files: tuple[FileCheck, ...]
    problems: tuple[str, ...]  # "file:line: what is wrong", all of them
    notes: tuple[str, ...]  # formats recognised from the columns
    tokens: TokenStats | None = None
    samples: tuple[RenderedSample, ...] = ()
    tokenizer: str | None = None  # what tokenized the rows, or why nothing did
    skipped_tokens: str | None = None
    images: ImageReport | None = None  # format image_chat measured under the processor (image_check.py)


@dataclass
class _Rows:
    spec: DatasetSpec
    rows: list[Row] = field(default_factory=list)


def check_data(recipe: Recipe, tokenizer: PreTrainedTokenizerBase | None = None, samples: int = 0,
               images: ImageInputs | None = None) -> DataReport:
    """Every local data file's rows against its format and fields; with ``tokenizer``, the token
    statistics and ``samples`` rendered samples; with ``images`` (the model's processor), the
    image_chat rows measured too (image_check.py). Raises nothing for bad rows: they are listed."""
    files: list[FileCheck] = []
    problems: list[str] = []
    good: list[_Rows] = []
    for spec in recipe.data.datasets:
        path = recipe.resolve_path(spec.path)
        if not is_local(path, spec.path):
            files.append(FileCheck(spec.path, spec.format, 0, 0, sampled=False, local=False))
            continue
        try:
            rows, sampled = _read(recipe, spec, path)
            spec = concrete_spec(spec, rows)
        except LowvramError as e:
            problems.append(e.message)
            continue
        found = [(row, row_problem(row.data, spec)) for row in rows]  # each row read once
        bad = [f"{row.where}: {msg}" for row, msg in found if msg]
        problems += bad
        files.append(FileCheck(spec.path, spec.format, len(rows), len(bad), sampled))
        good.append(_Rows(spec, [row for row, msg in found if not msg]))
    report = DataReport(tuple(files), tuple(problems), tuple(recipe.notes))
    if tokenizer is None or (problems and not recipe.data.skip_bad_rows):
        return report
    return _with_tokens(report, recipe, tokenizer, good, samples, images)


def _read(recipe: Recipe, spec: DatasetSpec, path: Path) -> tuple[list[Row], bool]:
    suffix = path.suffix.lower()
    if path.is_file() and suffix in (".jsonl", ".ndjson") and path.stat().st_size > FULL_CHECK_BYTES:
        return _spread_rows(path), True
    return load_rows(recipe, spec, spec.split, spec.max_samples), False


def _spread_rows(path: Path) -> list[Row]:
    """About SPREAD_ROWS rows at even byte offsets of a large JSON Lines file (the first line
    starting at or after each offset), named by their line number; one pass, bounded reads."""
    size = path.stat().st_size
    step = size / SPREAD_ROWS
    rows: list[Row] = []
    next_at, pos, line_no, whole = 0.0, 0, 1, True
    with path.open("rb") as f:
        while chunk := f.readline(FULL_CHECK_BYTES):
            start, pos = pos, pos + len(chunk)
            ends = chunk.endswith(b"\n")
            if whole and start >= next_at and chunk.strip():
                while next_at <= start:
                    next_at += step
                text = chunk.decode("utf-8", errors="replace") if ends or pos == size else None
                rows += ([Row(r.data, f"{path.name}:{line_no}") for r in jsonl_rows(text, path.name)] if text
                         else [Row(BadRow(f"a line longer than {FULL_CHECK_BYTES >> 20} MiB"), f"{path.name}:{line_no}")])
            whole = ends  # the next chunk starts a line only when this one ended one
            line_no += ends
    return rows


def row_problem(row: object, spec: DatasetSpec) -> str | None:
    """What training's reader would say of this row (None when it reads)."""
    from lowvram.train.data.images import image_messages, image_paths
    from lowvram.train.data.preference import preference_pair, unpaired_row

    try:
        if isinstance(row, BadRow):
            raise row
        if not isinstance(row, dict):
            return f"expected an object with fields, got {type(row).__name__}"
        if spec.format in CHAT_FORMATS:
            _messages(row, spec)
        elif spec.format == "image_chat":
            image_messages(row, spec)
            image_paths(row, spec)
        elif spec.format == "preference":
            preference_pair(row, spec)
        elif spec.format == "unpaired":
            unpaired_row(row, spec)
        elif spec.format == "prompt":  # grpo / rloo: a prompt, text or messages; other columns go to the rewards
            from lowvram.train.data.prompts import prompt_row

            prompt_row(row, spec)
        else:
            format_example(row, spec)
    except BadRow as e:
        return str(e)
    return None


def _with_tokens(report: DataReport, recipe: Recipe, tokenizer, good: list[_Rows], n_samples: int,
                 images: ImageInputs | None = None) -> DataReport:
    from lowvram.train.data.tokenize import Counts, tokenize_rows

    sft = recipe.training.objective == "sft"  # TRL tokenizes the rows of the other objectives itself
    text = [g for g in good if sft and g.spec.format not in (*PREFERENCE_FORMATS, "image_chat")]
    pictured = [g for g in good if sft and images is not None and g.spec.format == "image_chat"]
    skipped = sorted({g.spec.format for g in good} - {g.spec.format for g in text + pictured})
    counts = Counts()
    lengths: list[int] = []
    samples: list[RenderedSample] = []
    trained = total = 0
    for g in text:
        for ids, labels in tokenize_rows(g.rows, g.spec, recipe, tokenizer, counts, lengths=lengths):
            trained += sum(lab != -100 for lab in labels)
            total += len(ids)
        for row in g.rows[:max(0, n_samples - len(samples))]:  # each as training cuts it
            samples += [_render(tokenizer, ids, labels, row.where)
                        for ids, labels in tokenize_rows([row], g.spec, recipe, tokenizer, Counts())]
    measured, problems = _measure_images(recipe, images, pictured)
    if measured is not None:
        lengths += measured.lengths
        counts.truncated += sum(r.outcome in ("cut", "dropped") for r in measured.rows)
        counts.dropped += sum(r.outcome == "dropped" for r in measured.rows)
        for where, ids, labels in measured.samples:
            trained += sum(lab != -100 for lab in labels)
            total += len(ids)
            if len(samples) < n_samples:
                samples.append(_render(images.processor.tokenizer, ids, labels, where, images.image_token_id))
    stats = None
    if lengths:
        ordered = sorted(lengths)
        stats = TokenStats(
            samples=len(lengths), seq_len=recipe.training.seq_len, min_tokens=ordered[0],
            median_tokens=int(statistics.median(ordered)), p95_tokens=ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
            max_tokens=ordered[-1], truncated=counts.truncated, dropped=counts.dropped, trained_tokens=trained,
            total_tokens=total)
    note = (f"format {', '.join(skipped)}" + ("" if sft else f" under training.objective {recipe.training.objective}")
            + ": tokenized at train time (TRL, or the processor for images), not counted here" if skipped else None)
    return DataReport(report.files, report.problems + problems, report.notes, stats, tuple(samples),
                      getattr(tokenizer, "name_or_path", None), note,
                      measured.report() if measured is not None else None)


def _measure_images(recipe: Recipe, images: ImageInputs | None, groups: list[_Rows]):
    """The image_chat groups' rows measured under the processor (image_check.ImageMeasure), and
    the rows training refuses, by file and row; (None, ()) without image rows."""
    if not groups or images is None:
        return None, ()
    from lowvram.train.data.image_check import ImageMeasure

    measure = ImageMeasure(recipe, images.processor, images.image_token_id, expands=not images.cross_attention)
    for g in groups:
        measure.add(g.rows, g.spec)
    return measure, tuple(measure.problems)


def _render(tokenizer, ids: list[int], labels: list[int], where: str, image_token: int | None = None) -> RenderedSample:
    """The sample as decoded text, in runs of trained / untrained tokens; a run of image tokens
    is shown as one "<N image tokens>" piece."""
    pieces: list[tuple[str, bool]] = []

    def kind(i: int) -> tuple[bool, bool]:
        return labels[i] != -100, ids[i] == image_token

    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or kind(i) != kind(start):
            text = (f"<{i - start} image tokens>" if ids[start] == image_token
                    else tokenizer.decode(ids[start:i]))
            pieces.append((text, labels[start] != -100))
            start = i
    trained = sum(lab != -100 for lab in labels)
    return RenderedSample(where, tuple(pieces), len(ids), trained)
