"""Read a recipe's dataset into raw rows, each with where it came from (for error messages).

- ``.jsonl`` / ``.ndjson`` / ``.json`` and ``.txt`` are read with the standard library, so a bad row
  is reported by its exact line and one row with a number where text is expected does not make
  Arrow's type inference reject the whole file. A ``.json`` file holds a list of objects (or JSON
  Lines). A ``.txt`` file gives one ``text`` row per non-blank line.
- ``.csv`` and ``.parquet`` go through ``datasets.load_dataset`` (csv columns are read as text, so
  an answer such as ``42`` stays the string ``"42"``).
- Anything else that is not an existing file is a hub id: ``datasets.load_dataset(path, name,
  split=...)``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowvram.errors import DataError
from lowvram.hub import HUB_ID
from lowvram.inputfiles import (
    LineTooLong,
    bounded_lines,
    line_limit_bytes,
    open_ordinary,
    require_ordinary,
    too_long_error,
)
from lowvram.recipe import DatasetSpec, Recipe

LOCAL_SUFFIXES = (".json", ".jsonl", ".ndjson", ".csv", ".parquet", ".txt")
# Suffixes that name a file, never a hub dataset: a missing or unsupported file, not a hub id.
FILE_LIKE_SUFFIXES = (
    ".tsv", ".xlsx", ".xls", ".arrow", ".gz", ".zip", ".bz2", ".xz", ".tar", ".pkl", ".pickle",
    ".yaml", ".yml", ".md", ".xml", ".html", ".feather", ".orc", ".avro",
)


@dataclass(frozen=True)
class Row:
    """One raw row and where it came from, for error messages."""

    data: Any
    where: str  # "file.jsonl:12" (a line of a text file: JSON Lines, JSON, CSV, .txt) or "file.parquet: row 3"


class BadRow(ValueError):
    """A malformed row; becomes a DataError (or a skip) with the row's location."""


def is_local(path: Path, shown: str) -> bool:
    """A data path names a local file (``shown`` as the recipe wrote it), not a hub dataset id."""
    suffix = path.suffix.lower()
    return suffix in LOCAL_SUFFIXES or path.exists() or suffix in FILE_LIKE_SUFFIXES or not HUB_ID.match(shown)


def load_rows(recipe: Recipe, spec: DatasetSpec, split: str, max_samples: int | None) -> list[Row]:
    path = recipe.resolve_path(spec.path)
    limit = line_limit_bytes(recipe.training.seq_len)
    if is_local(path, spec.path):
        if split != "train":
            raise DataError(
                f"{spec.path}: a local file has only the 'train' split, not '{split}'",
                "set data.validation to a fraction (e.g. 0.1) or list the eval file as its own dataset",
            )
        rows = _load_local(path, spec.path, recipe.training.seq_len)
    else:
        rows = _load_hub(spec, split, max_samples)
    rows = rows[:max_samples] if max_samples else rows
    for row in rows:  # a .json list, a CSV or Parquet row, a hub row: the same bound as a line
        if _text_chars(row.data) > limit:
            raise too_long_error(row.where, recipe.training.seq_len, "row")
    return rows


def _load_local(path: Path, shown: str, seq_len: int) -> list[Row]:
    if not path.exists():
        raise DataError(
            f"data file not found: {path}",
            f"'{shown}' is resolved relative to the recipe file; check the path or use an absolute one",
        )
    if path.is_dir():
        raise DataError(f"{path} is a folder, not a data file", "point path at a .jsonl, .json, .csv, .parquet or .txt file")
    require_ordinary(path, "data file", DATA_HINT)  # a FIFO would block, /dev/zero never end
    suffix = path.suffix.lower()
    if suffix not in LOCAL_SUFFIXES:
        raise DataError(
            f"{path}: unknown data file extension '{path.suffix}'",
            "use .jsonl, .json, .csv, .parquet or .txt (a hub dataset id has no file extension)",
        )
    name = path.name
    if suffix == ".parquet":
        rows = _load_parquet(path, name)
    elif suffix in (".jsonl", ".ndjson", ".txt"):
        rows = _line_rows(path, name, seq_len, as_text=suffix == ".txt")
    else:
        text = _read_text(path)
        rows = _json_rows(text, name) if suffix == ".json" else _load_csv(path, text, name)
    if not rows:
        raise DataError(f"{path}: the data file has no rows", "add examples to the file or remove it from data.datasets")
    return rows


DATA_HINT = "point data.datasets[].path at a regular .jsonl, .json, .csv, .parquet or .txt file"


def _read_text(path: Path) -> str:
    with open_ordinary(path, "data file", DATA_HINT) as f:
        raw = f.read()
    if not raw.strip():
        raise DataError(f"{path}: the data file is empty", "add examples to the file or remove it from data.datasets")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(
            f"{path}: not UTF-8 text (byte {e.start}, line {line})",
            "re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
        ) from None


def _line_rows(path: Path, name: str, seq_len: int, as_text: bool) -> list[Row]:
    """JSON Lines (or .txt) read line by line, each line at most line_limit_bytes(seq_len): one
    enormous line is an error naming it before it is decoded, parsed or tokenized."""
    rows, blank = [], True
    with open_ordinary(path, "data file", DATA_HINT) as f:
        try:
            for number, offset, raw in bounded_lines(f, line_limit_bytes(seq_len)):
                if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # utf-8-sig's byte-order mark
                    raw, offset = raw[3:], offset + 3
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{path}: not UTF-8 text (byte {offset + e.start}, line {number})",
                        "re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
                    ) from None
                blank = blank and not line.strip()
                if as_text:  # one sample per non-blank line, as str.splitlines() cuts it
                    rows += [Row({"text": t}, f"{name}:{number}") for t in line.splitlines() if t.strip()]
                else:
                    rows += jsonl_rows(line.rstrip("\n"), name, first=number)
        except LineTooLong as e:
            raise too_long_error(f"{path}:{e.line}", seq_len) from None
    if blank:
        raise DataError(f"{path}: the data file is empty", "add examples to the file or remove it from data.datasets")
    return rows


def _text_chars(value: Any) -> int:
    """Characters of text in a row (its strings, nested in lists and dicts)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_chars(v) for v in value)
    return 0


def jsonl_rows(text: str, name: str, first: int = 1) -> Iterator[Row]:
    # Only "\n" ends a row: str.splitlines() also splits at U+2028, U+0085, \x1c..., which JSON
    # strings may hold raw (a trailing "\r" is JSON whitespace). ``first``: the number of text's
    # first line in its file.
    for i, line in enumerate(text.split("\n"), first):
        if not line.strip():
            continue
        try:
            yield Row(json.loads(line), f"{name}:{i}")
        except json.JSONDecodeError as e:
            yield Row(BadRow(f"invalid JSON: {e.msg} (column {e.colno})"), f"{name}:{i}")


def _json_rows(text: str, name: str) -> list[Row]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several JSON values: JSON Lines in a .json file
            return list(jsonl_rows(text, name))
        raise DataError(
            f"{name}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}",
            "a .json data file holds a list of objects; use .jsonl for one object per line",
        ) from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}, a common wrapper
    if not isinstance(data, list):
        raise DataError(f"{name}: expected a list of objects, got a {type(data).__name__}",
                        "a .json data file holds a list of objects, e.g. [{\"instruction\": ...}]")
    lines = _element_lines(text, len(data))
    if None in lines or len(set(lines)) != len(lines):  # elements share lines: name them by number
        return [Row(r, f"{name}: row {i}") for i, r in enumerate(data, 1)]
    return [Row(r, f"{name}:{line}") for r, line in zip(data, lines, strict=True)]


def _element_lines(text: str, count: int) -> list[int | None]:
    """The line each element of the file's array starts on (``FILE:LINE``, as for JSON Lines), or
    Nones when the array cannot be walked (e.g. a {"data": [...]} wrapper with odd keys)."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0 or (text.lstrip().startswith("{") and text.find(":") > start):
        return [None] * count
    pos, out = start + 1, []
    ws = " \t\r\n,"
    for _ in range(count):
        while pos < len(text) and text[pos] in ws:
            pos += 1
        out.append(text.count("\n", 0, pos) + 1)
        try:
            _, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return [None] * count
    return out


def _datasets():
    """``datasets`` with its progress bars off (they would print "Generating train split" on the
    user's terminal for every file)."""
    import datasets

    datasets.disable_progress_bars()
    return datasets


def _load_csv(path: Path, text: str, name: str) -> list[Row]:
    import csv

    datasets = _datasets()

    header = next(csv.reader(text.splitlines()), [])
    if not header:
        raise DataError(f"{path}: the data file is empty", "the first line of a .csv file names the columns")
    # Every column as text: "42" stays "42"; keep_default_na=False keeps "NA" and empty cells as
    # strings (an empty cell is then reported as empty, not as a missing field).
    features = datasets.Features({c: datasets.Value("string") for c in header})
    try:
        ds = datasets.load_dataset("csv", data_files=str(path), split="train", features=features,
                                   keep_default_na=False)
    except Exception as e:  # noqa: BLE001 - pandas/arrow raise many kinds
        raise DataError(f"{path}: cannot read as CSV: {_root_cause(e)}",
                        "check the quoting and that every line has the header's columns") from None
    lines = _record_lines(text)
    if len(lines) != len(ds):  # pandas and the csv module disagree on this file: rows, not lines
        return [Row(r, f"{name}: row {i}") for i, r in enumerate(ds, 1)]
    return [Row(r, f"{name}:{line}") for r, line in zip(ds, lines, strict=True)]


def _record_lines(text: str) -> list[int]:
    """The line each data record of a CSV text starts on (the header is line 1; a quoted field
    may span lines; blank lines hold no record, as pandas reads them)."""
    import csv
    import io

    reader = csv.reader(io.StringIO(text))
    starts, end = [], 0
    try:
        for record in reader:
            if record:
                starts.append(end + 1)
            end = reader.line_num
    except csv.Error:
        return []
    return starts[1:]


def _load_parquet(path: Path, name: str) -> list[Row]:
    datasets = _datasets()

    if path.stat().st_size == 0:
        raise DataError(f"{path}: the data file is empty", "write the parquet file again")
    try:
        ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{path}: cannot read as Parquet: {_root_cause(e)}",
                        "check the file is a Parquet table (e.g. written by pandas.DataFrame.to_parquet)") from None
    return [Row(r, f"{name}: row {i}") for i, r in enumerate(ds, 1)]


def _load_hub(spec: DatasetSpec, split: str, max_samples: int | None) -> list[Row]:
    datasets = _datasets()

    # A slice lets the hub loader stop early on large datasets.
    sliced = f"{split}[:{max_samples}]" if max_samples else split
    try:
        ds = datasets.load_dataset(spec.path, spec.name, split=sliced)
    except Exception as e:  # noqa: BLE001 - network, auth, missing config or split
        raise DataError(
            f"cannot load dataset '{spec.path}'"
            + (f" (config {spec.name})" if spec.name else "") + f" split '{split}': {_root_cause(e)}",
            "no local file has that path, so it was read as a hub id: check the file path (relative "
            "to the recipe), or the hub id, config name, split and network (HF_DATASETS_OFFLINE=1 "
            "blocks downloads)",
        ) from None
    return [Row(r, f"{spec.path}[{split}]: row {i}") for i, r in enumerate(ds, 1)]


def concrete_spec(spec: DatasetSpec, rows: list[Row]) -> DatasetSpec:
    """The spec with a concrete format: as written, or (format auto: a hub dataset, or a file
    load_recipe could not peek into) recognised from the first row's columns."""
    from lowvram.recipe.formats import recognise

    if spec.format != "auto":
        return spec
    first = next((r.data for r in rows if isinstance(r.data, dict)), None)
    found = recognise(first)
    if found is None:
        columns = ", ".join(map(str, first)) if isinstance(first, dict) else "none"
        raise DataError(
            f"{spec.path}: cannot tell the data format from the columns ({columns})",
            "set its format: (alpaca, chat, sharegpt, completion, text, preference, ...) and map your "
            "column names with fields: {...}; `lowvram keys` lists them",
        )
    return spec.model_copy(update={"format": found.format, "fields": {**found.fields, **spec.fields}})


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"
