"""The data formats' fields, and a format recognised from a file's columns when the recipe leaves
``format:`` out (``auto``), as Axolotl and LLaMA-Factory users expect of the common layouts.

Pure and light (no datasets, no torch): ``load_recipe`` peeks at the first row of each local data
file (a line of JSON Lines, the first object of a JSON list, a CSV header, a Parquet schema) so
the whole program sees a concrete format, printed with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Field names of each format: (required, optional). chat and sharegpt also name the keys inside
# each message (role, content), so any message layout maps onto OpenAI's.
FORMAT_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "alpaca": (("instruction", "output"), ("input",)),
    "chat": (("messages",), ("role", "content")),
    "sharegpt": (("messages",), ("role", "content")),
    "image_chat": (("messages",), ("images",)),  # lowvram.train.data.images
    "completion": (("prompt", "completion"), ()),
    "text": (("text",), ()),
    "preference": (("chosen", "rejected"), ("prompt",)),  # lowvram.train.data.preference
    "unpaired": (("prompt", "completion", "label"), ()),  # training.objective kto (data/preference.py)
    "prompt": (("prompt",), ()),  # training.objective grpo / rloo: prompts the model completes
}

# The columns each format reads when fields: does not map them (sharegpt: ShareGPT's own names).
DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "sharegpt": {"messages": "conversations", "role": "from", "content": "value"},
}

# ShareGPT's speaker tags (as LLaMA-Factory's and Axolotl's ShareGPT readers know them) -> OpenAI roles.
SHAREGPT_ROLES: dict[str, str] = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "function_call": "assistant",
    "system": "system",
    "observation": "tool", "tool": "tool", "function": "tool",
}

# Column layouts recognised when format: is left out, most specific first: (columns present,
# format, fields). A pair such as prompt/response reads as completion with its column mapped.
_LAYOUTS: tuple[tuple[frozenset[str], str, dict[str, str]], ...] = (
    (frozenset({"messages", "images"}), "image_chat", {}),
    (frozenset({"prompt", "chosen", "rejected"}), "preference", {}),
    (frozenset({"chosen", "rejected"}), "preference", {}),
    (frozenset({"prompt", "completion", "label"}), "unpaired", {}),
    (frozenset({"messages"}), "chat", {}),
    (frozenset({"conversations"}), "sharegpt", {}),
    (frozenset({"instruction", "output"}), "alpaca", {}),
    (frozenset({"instruction", "response"}), "alpaca", {"output": "response"}),
    (frozenset({"prompt", "completion"}), "completion", {}),
    (frozenset({"prompt", "response"}), "completion", {"completion": "response"}),
    (frozenset({"question", "answer"}), "completion", {"prompt": "question", "completion": "answer"}),
    (frozenset({"input", "output"}), "completion", {"prompt": "input", "completion": "output"}),
    (frozenset({"text"}), "text", {}),
)


@dataclass(frozen=True)
class Recognised:
    format: str
    fields: dict[str, str]
    reason: str  # "recognised from the columns prompt, response"


def unknown_field(fmt: str, fields: dict[str, str]) -> tuple[str, str, tuple[str, ...]] | None:
    """(key, did-you-mean tip, the format's fields) of the first ``fields:`` key the format lacks."""
    import difflib

    required, optional = FORMAT_FIELDS[fmt]
    known = required + optional
    for key in fields:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            return key, f"did you mean '{close[0]}'? " if close else "", known
    return None


def column_of(fmt: str, fields: dict[str, str], field: str) -> str:
    """The column (or message key) a format's field is read from."""
    return fields.get(field, DEFAULT_COLUMNS.get(fmt, {}).get(field, field))


def recognise(first_row: object) -> Recognised | None:
    """The format of a row's column layout, or None when no known layout matches."""
    if not isinstance(first_row, dict):
        return None
    columns = {str(c) for c in first_row}
    for needed, fmt, fields in _LAYOUTS:
        if needed <= columns:
            if fmt == "chat" and _looks_sharegpt(first_row.get("messages")):
                fmt, fields = "sharegpt", {"messages": "messages"}
            elif fmt == "sharegpt" and not _looks_sharegpt(first_row.get("conversations")):
                fmt, fields = "chat", {"messages": "conversations"}
            shown = ", ".join(sorted(needed))
            return Recognised(fmt, dict(fields), f"recognised from the columns {shown}")
    return None


def _looks_sharegpt(messages: object) -> bool:
    return (isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict)
            and "from" in messages[0] and "value" in messages[0])


_PEEK_BYTES = 1 << 20  # a first row bigger than this is not guessed at (format: must be set)


def first_row(path: Path) -> object | None:
    """The first row of a local data file (None when it cannot be read cheaply: the data check
    reports why). Only regular files are opened."""
    try:
        if not path.is_file():
            return None
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            return _parquet_columns(path)
        with path.open("rb") as f:
            head = f.read(_PEEK_BYTES).decode("utf-8-sig", errors="replace")
    except OSError:
        return None
    if suffix in (".jsonl", ".ndjson"):
        line = next((ln for ln in head.split("\n") if ln.strip()), "")
        return _loads(line)
    if suffix == ".json":
        return _first_json_object(head)
    if suffix == ".csv":
        import csv

        header = next(csv.reader(head.splitlines()[:1]), [])
        return dict.fromkeys(header, "") if header else None
    if suffix == ".txt":
        return {"text": ""}
    return None


def _loads(text: str) -> object | None:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _first_json_object(head: str) -> object | None:
    text = head.lstrip()
    if text.startswith("{"):  # {"data": [...]} wrapper, or JSON Lines in a .json file
        whole = _loads(text)
        if isinstance(whole, dict) and len(whole) == 1 and isinstance(next(iter(whole.values())), list):
            rows = next(iter(whole.values()))
            return rows[0] if rows else None
        return whole if whole is not None else _loads(text.split("\n", 1)[0])
    if text.startswith("["):
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[1:].lstrip())
        except ValueError:
            return None
        return obj
    return None


def _parquet_columns(path: Path) -> dict | None:
    try:
        import pyarrow.parquet as pq

        return dict.fromkeys(pq.read_schema(path).names, "")
    except Exception:  # noqa: BLE001 - not a parquet file: the data check says so
        return None
