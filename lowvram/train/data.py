"""Datasets for training: load, format (alpaca / chat / completion / text), mask, truncate, pack.

``build_datasets(recipe, tokenizer)`` turns the recipe's ``data`` section into tokenized
``datasets.Dataset`` objects with ``input_ids``, ``attention_mask`` and ``labels`` columns, and
``make_collator`` pads them per batch.

Loading:

- ``.jsonl`` / ``.ndjson`` / ``.json`` and ``.txt`` are read with the standard library, so a bad row
  is reported by its exact line and one row with a number where text is expected does not make
  Arrow's type inference reject the whole file. A ``.json`` file holds a list of objects (or JSON
  Lines). A ``.txt`` file gives one ``text`` row per non-blank line.
- ``.csv`` and ``.parquet`` go through ``datasets.load_dataset`` (csv columns are read as text, so
  an answer such as ``42`` stays the string ``"42"``).
- Anything else that is not an existing file is a hub id: ``datasets.load_dataset(path, name,
  split=...)``.

Every sample becomes a list of text *segments*, each marked trained or not (the prompt is not,
the response is). Segments are tokenized separately and concatenated, so the prompt/response
boundary is exact and the training tokens are the ones the model sees at inference, where the
prompt is tokenized alone and the answer is generated after it. Labels are ``-100`` on
untrained segments unless ``data.train_on_inputs`` is true.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowvram.errors import DataError
from lowvram.recipe import DatasetSpec, Recipe

if TYPE_CHECKING:  # pragma: no cover
    import datasets

IGNORE_INDEX = -100  # the label torch's cross_entropy (and transformers' loss) skips

# The Stanford Alpaca prompt (github.com/tatsu-lab/stanford_alpaca, train.py PROMPT_DICT).
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)

# Field names of each format: (required, optional).
FORMAT_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "alpaca": (("instruction", "output"), ("input",)),
    "chat": (("messages",), ()),
    "completion": (("prompt", "completion"), ()),
    "text": (("text",), ()),
}

LOCAL_SUFFIXES = (".json", ".jsonl", ".ndjson", ".csv", ".parquet", ".txt")
# Suffixes that name a file, never a hub dataset: a missing or unsupported file, not a hub id.
_FILE_LIKE_SUFFIXES = (
    ".tsv", ".xlsx", ".xls", ".arrow", ".gz", ".zip", ".bz2", ".xz", ".tar", ".pkl", ".pickle",
    ".yaml", ".yml", ".md", ".xml", ".html", ".feather", ".orc", ".avro",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


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


@dataclass(frozen=True)
class DataBundle:
    train: datasets.Dataset  # input_ids, attention_mask, labels (+ position_ids when packed)
    eval: datasets.Dataset | None
    stats: DataStats


@dataclass(frozen=True)
class _Row:
    """One raw row and where it came from, for error messages."""

    data: Any
    where: str  # "file.jsonl:12" or "file.csv: row 3"


@dataclass
class _Counts:
    skipped: int = 0
    truncated: int = 0
    dropped: int = 0


class _BadRow(ValueError):
    """A malformed row; becomes a DataError (or a skip) with the row's location."""


# --------------------------------------------------------------------------------------------
# Public API


def build_datasets(recipe: Recipe, tokenizer) -> DataBundle:
    """Load, format, tokenize, mask, truncate (and pack) the recipe's datasets."""
    data = recipe.data
    counts = _Counts()
    split_eval = isinstance(data.validation, str)
    train_samples: list[tuple[list[int], list[int]]] = []
    eval_samples: list[tuple[list[int], list[int]]] = []
    for spec in data.datasets:
        rows = _load_rows(recipe, spec, spec.split, spec.max_samples)
        train_samples += _tokenize_rows(rows, spec, recipe, tokenizer, counts)
        if split_eval:
            eval_rows = _load_rows(recipe, spec, data.validation, None)
            eval_samples += _tokenize_rows(eval_rows, spec, recipe, tokenizer, counts)
    if not train_samples:
        raise DataError(
            "no training samples left after formatting and truncation",
            f"check the data (skipped bad rows: {counts.skipped}, dropped as too long: "
            f"{counts.dropped}) or raise training.seq_len",
        )
    if isinstance(data.validation, float):
        train_samples, eval_samples = _hold_out(train_samples, data.validation, recipe.training.seed)
    n_samples = len(train_samples)
    if data.packing:
        train_cols = _pack(train_samples, recipe.training.seq_len)
    else:
        train_cols = _columns(train_samples)
    train = _to_dataset(train_cols)
    eval_ds = _to_dataset(_columns(eval_samples)) if data.validation is not None else None
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
    )
    return DataBundle(train=train, eval=eval_ds, stats=stats)


def format_example(row: dict, spec: DatasetSpec) -> tuple[str, str]:
    """(prompt, response) text of an alpaca / completion / text row; text gives ("", text).

    Raises ``ValueError`` for a chat spec (chat needs the tokenizer: see ``_chat_segments``) and
    ``_BadRow`` (a ``ValueError`` too) naming the field for a malformed row.
    """
    if spec.format == "alpaca":
        instruction = _text_field(row, spec, "instruction")
        output = _text_field(row, spec, "output")
        extra = _text_field(row, spec, "input", required=False)
        if extra:
            prompt = ALPACA_PROMPT.format(instruction=instruction, input=extra)
        else:
            prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)
        return prompt, output
    if spec.format == "completion":
        return _text_field(row, spec, "prompt"), _text_field(row, spec, "completion")
    if spec.format == "text":
        return "", _text_field(row, spec, "text")
    raise ValueError("chat rows are rendered by the tokenizer's chat template, not format_example")


@dataclass(frozen=True)
class PadCollator:
    """Right-pads a batch to its longest row (rounded up to ``pad_to_multiple_of``).

    input_ids get ``pad_id``, labels ``-100``. No attention_mask by default (``padding_mask``
    False): in a causal LM a right-padded tail is never seen by a real token (each token attends
    only to earlier positions), so the mask changes nothing the loss sees, and without it
    transformers takes SDPA's ``is_causal`` path instead of building a b x 1 x s x s mask, which
    on CPU also forces the math kernel that stores the attention matrix (measured: +13% peak at
    seq 224 on the tiny Llama, tests/test_fit_to_card.py). It keeps the run on the shape the
    planner models. ``padding_mask=True`` adds attention_mask ``1``/``0`` for other uses. Packed rows (with
    ``position_ids``) get no attention_mask: transformers then reads the sample boundaries from
    the position_ids resets and keeps attention inside each sample; the padding tail gets its
    own run of positions so it forms a separate block. That detection is skipped when the model
    builds a KV cache, so train packed data with ``model.config.use_cache = False``
    (transformers 5.24, ``masking_utils._preprocess_mask_arguments``).
    """

    pad_id: int
    pad_to_multiple_of: int | None = None
    padding_mask: bool = False

    def __call__(self, features: list[dict]) -> dict:
        import torch

        longest = max(len(f["input_ids"]) for f in features)
        m = self.pad_to_multiple_of
        if m:
            longest = -(-longest // m) * m
        packed = "position_ids" in features[0]
        batch: dict[str, list] = {"input_ids": [], "labels": []}
        if packed or self.padding_mask:
            batch["position_ids" if packed else "attention_mask"] = []
        for f in features:
            ids = list(f["input_ids"])
            n = longest - len(ids)
            batch["input_ids"].append(ids + [self.pad_id] * n)
            labels = list(f["labels"]) if "labels" in f else list(ids)
            batch["labels"].append(labels + [IGNORE_INDEX] * n)
            if packed:
                batch["position_ids"].append(list(f["position_ids"]) + list(range(n)))
            elif self.padding_mask:
                mask = list(f["attention_mask"]) if "attention_mask" in f else [1] * len(ids)
                batch["attention_mask"].append(mask + [0] * n)
        return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}


def make_collator(tokenizer, pad_to_multiple_of: int | None = None, padding_mask: bool = False) -> PadCollator:
    """Dynamic per-batch padding with the tokenizer's pad id (its eos id if it has no pad)."""
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    if pad_id is None:
        raise DataError(
            "the tokenizer has neither a pad token nor an eos token",
            "use the tokenizer of a causal language model (it defines eos_token)",
        )
    return PadCollator(pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of, padding_mask=padding_mask)


# --------------------------------------------------------------------------------------------
# Loading


def _load_rows(recipe: Recipe, spec: DatasetSpec, split: str, max_samples: int | None) -> list[_Row]:
    path = recipe.resolve_path(spec.path)
    suffix = path.suffix.lower()
    if suffix in LOCAL_SUFFIXES or path.exists() or suffix in _FILE_LIKE_SUFFIXES or not _HUB_ID.match(spec.path):
        if split != "train":
            raise DataError(
                f"{spec.path}: a local file has only the 'train' split, not '{split}'",
                "set data.validation to a fraction (e.g. 0.1) or list the eval file as its own dataset",
            )
        rows = _load_local(path, spec.path)
    else:
        rows = _load_hub(spec, split, max_samples)
    return rows[:max_samples] if max_samples else rows


def _load_local(path: Path, shown: str) -> list[_Row]:
    if not path.exists():
        raise DataError(
            f"data file not found: {path}",
            f"'{shown}' is resolved relative to the recipe file; check the path or use an absolute one",
        )
    if path.is_dir():
        raise DataError(f"{path} is a folder, not a data file", "point path at a .jsonl, .json, .csv, .parquet or .txt file")
    suffix = path.suffix.lower()
    if suffix not in LOCAL_SUFFIXES:
        raise DataError(
            f"{path}: unknown data file extension '{path.suffix}'",
            "use .jsonl, .json, .csv, .parquet or .txt (a hub dataset id has no file extension)",
        )
    name = path.name
    if suffix == ".parquet":
        rows = _load_parquet(path, name)
    else:
        text = _read_text(path)
        if suffix in (".jsonl", ".ndjson"):
            rows = list(_jsonl_rows(text, name))
        elif suffix == ".json":
            rows = _json_rows(text, name)
        elif suffix == ".txt":
            rows = [_Row({"text": line}, f"{name}:{i}") for i, line in enumerate(text.splitlines(), 1) if line.strip()]
        else:
            rows = _load_csv(path, text, name)
    if not rows:
        raise DataError(f"{path}: the data file has no rows", "add examples to the file or remove it from data.datasets")
    return rows


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
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


def _jsonl_rows(text: str, name: str) -> Iterator[_Row]:
    # Only "\n" ends a row: str.splitlines() also splits at U+2028, U+0085, \x1c..., which JSON
    # strings may hold raw (a trailing "\r" is JSON whitespace).
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            yield _Row(json.loads(line), f"{name}:{i}")
        except json.JSONDecodeError as e:
            yield _Row(_BadRow(f"invalid JSON: {e.msg} (column {e.colno})"), f"{name}:{i}")


def _json_rows(text: str, name: str) -> list[_Row]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several JSON values: JSON Lines in a .json file
            return list(_jsonl_rows(text, name))
        raise DataError(
            f"{name}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}",
            "a .json data file holds a list of objects; use .jsonl for one object per line",
        ) from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}, a common wrapper
    if not isinstance(data, list):
        raise DataError(f"{name}: expected a list of objects, got a {type(data).__name__}",
                        "a .json data file holds a list of objects, e.g. [{\"instruction\": ...}]")
    return [_Row(r, f"{name}: row {i}") for i, r in enumerate(data, 1)]


def _load_csv(path: Path, text: str, name: str) -> list[_Row]:
    import csv

    import datasets

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
    return [_Row(r, f"{name}: row {i}") for i, r in enumerate(ds, 1)]


def _load_parquet(path: Path, name: str) -> list[_Row]:
    import datasets

    if path.stat().st_size == 0:
        raise DataError(f"{path}: the data file is empty", "write the parquet file again")
    try:
        ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{path}: cannot read as Parquet: {_root_cause(e)}",
                        "check the file is a Parquet table (e.g. written by pandas.DataFrame.to_parquet)") from None
    return [_Row(r, f"{name}: row {i}") for i, r in enumerate(ds, 1)]


def _load_hub(spec: DatasetSpec, split: str, max_samples: int | None) -> list[_Row]:
    import datasets

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
    return [_Row(r, f"{spec.path}[{split}]: row {i}") for i, r in enumerate(ds, 1)]


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"


# --------------------------------------------------------------------------------------------
# Formatting and tokenization

Segments = list[tuple[str, bool]]  # (text, trained)


def _text_field(row: dict, spec: DatasetSpec, field: str, required: bool = True) -> str:
    column = spec.fields.get(field, field)
    shown = f"'{field}'" if column == field else f"'{field}' (column '{column}')"
    if column not in row or row[column] is None:
        if not required:
            return ""
        present = ", ".join(map(str, row)) or "none"
        raise _BadRow(f"missing field {shown}; expected text (columns present: {present})")
    value = row[column]
    if not isinstance(value, str):
        raise _BadRow(f"field {shown}: expected text, got {type(value).__name__} {_short(value)}")
    if required and not value.strip():
        raise _BadRow(f"field {shown}: expected non-empty text, got an empty string")
    return value


def _short(value: Any) -> str:
    s = repr(value)
    return s if len(s) <= 40 else s[:37] + "..."


def _check_fields(spec: DatasetSpec) -> None:
    import difflib

    required, optional = FORMAT_FIELDS[spec.format]
    known = required + optional
    for key in spec.fields:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            tip = f"did you mean '{close[0]}'? " if close else ""
            raise DataError(
                f"{spec.path}: fields: '{key}' is not a field of format {spec.format}",
                f"{tip}fields maps {spec.format}'s fields ({', '.join(known)}) to your column names",
            )


def _segments(row: Any, spec: DatasetSpec, chat: _ChatRenderer | None) -> Segments:
    if isinstance(row, _BadRow):
        raise row
    if not isinstance(row, dict):
        raise _BadRow(f"expected an object with fields, got {type(row).__name__} {_short(row)}")
    if chat is not None:
        return chat.segments(row, spec)
    prompt, response = format_example(row, spec)
    return [(prompt, False), (response, True)]


class _ChatRenderer:
    """Splits a conversation into template text segments; assistant turns are the trained ones.

    The template renders the conversation up to each assistant turn (with the generation prompt)
    and up to the end of that turn; the turn's text is the difference. This needs a template that
    renders incrementally (each render a prefix of the next), which holds for ChatML, Llama 3,
    Mistral, Gemma and Qwen templates; a row where it fails is reported, not silently mis-masked.
    """

    def __init__(self, tokenizer, spec: DatasetSpec) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{spec.path}: format chat needs a chat template and the tokenizer has no chat template",
                "use a chat model's tokenizer (model.tokenizer) or format: alpaca",
            )
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token or ""

    def _render(self, messages: list, generation_prompt: bool) -> str:
        if not messages:
            return ""
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # noqa: BLE001 - jinja raise_exception and template errors
            raise _BadRow(f"the chat template rejected the messages: {e}") from None

    def segments(self, row: dict, spec: DatasetSpec) -> Segments:
        messages = _messages(row, spec)
        full = self._render(messages, False)
        out: Segments = []
        pos = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], True)
            upto = self._render(messages[: i + 1], False)
            if not (upto.startswith(before) and full.startswith(upto) and len(before) >= pos):
                raise _BadRow(
                    "the chat template does not render this conversation incrementally, so the "
                    "assistant turns cannot be located (set data.train_on_inputs: true to train on all)"
                )
            turn = full[len(before):len(upto)]
            if self.eos and self.eos not in turn:
                turn += self.eos  # the template has no end-of-turn token: teach the model to stop
            out += [(full[pos:len(before)], False), (turn, True)]
            pos = len(upto)
        out.append((full[pos:], False))
        return out


def _messages(row: dict, spec: DatasetSpec) -> list[dict]:
    column = spec.fields.get("messages", "messages")
    if column not in row or row[column] is None:
        present = ", ".join(map(str, row)) or "none"
        raise _BadRow(f"missing field '{column}'; expected a list of {{role, content}} (columns present: {present})")
    messages = row[column]
    expected = "expected a list of {role, content} objects"
    if not isinstance(messages, list) or not messages:
        raise _BadRow(f"field '{column}': {expected}, got {type(messages).__name__} {_short(messages)}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise _BadRow(f"field '{column}', message {j}: {expected}, got {_short(m)}")
        if not isinstance(m.get("content"), str):
            got = type(m.get("content")).__name__ if "content" in m else "no content"
            raise _BadRow(f"field '{column}', message {j}: 'content' must be text, got {got}")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise _BadRow(f"field '{column}': {expected} with at least one non-empty assistant message")
    # Keep only role/content: extra keys (name, weight, ...) may be None after Arrow loading.
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _special_prefix(tokenizer) -> list[int]:
    """Token ids the tokenizer puts before a text by default (a BOS), found by comparison."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            return list(full[:k])
    return []


def _tokenize_rows(rows: list[_Row], spec: DatasetSpec, recipe: Recipe, tokenizer,
                   counts: _Counts) -> list[tuple[list[int], list[int]]]:
    _check_fields(spec)
    chat = _ChatRenderer(tokenizer, spec) if spec.format == "chat" else None
    all_segments: list[Segments] = []
    for row in rows:
        try:
            all_segments.append(_segments(row.data, spec, chat))
        except _BadRow as e:
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
    train_all = recipe.data.train_on_inputs
    out = []
    for segs in all_segments:
        ids, labels = list(prefix), [IGNORE_INDEX] * len(prefix)
        for text, trained in segs:
            piece = ids_of[text]
            if trained and eos:
                piece = piece + eos
            ids += piece
            labels += piece if (trained or train_all) else [IGNORE_INDEX] * len(piece)
        if len(ids) > seq_len:
            counts.truncated += 1
            ids, labels = ids[:seq_len], labels[:seq_len]
            if all(lab == IGNORE_INDEX for lab in labels):
                counts.dropped += 1
                continue
        out.append((ids, labels))
    return out


def _batch_tokenize(tokenizer, texts: Iterable[str]) -> dict[str, list[int]]:
    unique = list(dict.fromkeys(t for t in texts if t))  # prompts repeat (alpaca header, chat)
    ids: dict[str, list[int]] = {"": []}
    for start in range(0, len(unique), 1000):
        chunk = unique[start:start + 1000]
        encoded = tokenizer(chunk, add_special_tokens=False)["input_ids"]
        ids.update(zip(chunk, encoded, strict=True))
    return ids


# --------------------------------------------------------------------------------------------
# Split, pack, columns


def _hold_out(samples: list, fraction: float, seed: int) -> tuple[list, list]:
    """Hold out ``fraction`` of the samples (at least one), chosen with the recipe seed."""
    if len(samples) < 2:
        raise DataError(
            f"data.validation: {fraction} needs at least 2 samples, got {len(samples)}",
            "add data or remove data.validation",
        )
    n_eval = min(len(samples) - 1, max(1, round(len(samples) * fraction)))
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    held = set(order[:n_eval])
    train = [s for i, s in enumerate(samples) if i not in held]
    evals = [s for i, s in enumerate(samples) if i in held]
    return train, evals


def _columns(samples: list[tuple[list[int], list[int]]]) -> dict[str, list]:
    return {
        "input_ids": [ids for ids, _ in samples],
        "attention_mask": [[1] * len(ids) for ids, _ in samples],
        "labels": [labels for _, labels in samples],
    }


def _pack(samples: list[tuple[list[int], list[int]]], seq_len: int) -> dict[str, list]:
    """Greedy in-order packing of whole samples into windows of at most ``seq_len`` tokens.

    Samples are never split (each is already <= seq_len). ``position_ids`` restart at 0 for each
    sample; with no attention_mask in the batch (see ``PadCollator``) and ``use_cache`` off,
    transformers builds a block-diagonal causal mask from them, so attention does not cross
    sample boundaries (tests/test_data.py checks the logits equal unpacked ones). Each
    sample keeps its own labels, so no loss crosses a boundary either (a sample's first token is
    never a label: it is predicted from nothing of its own).
    """
    cols: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": [], "position_ids": []}
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []

    def flush() -> None:
        if ids:
            cols["input_ids"].append(list(ids))
            cols["attention_mask"].append([1] * len(ids))
            cols["labels"].append(list(labels))
            cols["position_ids"].append(list(positions))
            ids.clear(), labels.clear(), positions.clear()

    for s_ids, s_labels in samples:
        if len(ids) + len(s_ids) > seq_len:
            flush()
        ids.extend(s_ids)
        labels.extend([IGNORE_INDEX] + s_labels[1:])
        positions.extend(range(len(s_ids)))
    flush()
    return cols


def _to_dataset(cols: dict[str, list]) -> datasets.Dataset:
    import datasets

    features = datasets.Features({k: datasets.Sequence(datasets.Value("int32")) for k in cols})
    return datasets.Dataset.from_dict(cols, features=features)


__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "DataBundle",
    "DataStats",
    "IGNORE_INDEX",
    "PadCollator",
    "build_datasets",
    "format_example",
    "make_collator",
]
