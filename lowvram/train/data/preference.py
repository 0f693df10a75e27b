"""Preference pairs (``format: preference``) for TRL's trainers: each row's prompt, chosen and
rejected, checked here so a bad row is named by file and line, then handed to TRL as a
``datasets.Dataset`` of ``prompt``/``chosen``/``rejected``. TRL tokenizes them itself (DPOTrainer
._prepare_dataset, ORPO/CPO tokenize_row), with the model's chat template for messages.

A row's fields are text, or conversational: a list of ``{role, content}`` messages. No ``prompt``
field: the prompt is the shared start of chosen and rejected (TRL's ``extract_prompt``). A text
prompt with message completions becomes one user message, a text completion after a message
prompt one assistant message, so each row is plainly text or plainly conversational, as TRL's
``is_conversational`` requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lowvram.errors import DataError, LowvramError
from lowvram.recipe import DatasetSpec, Recipe
from lowvram.train.data.format import check_fields, short_repr
from lowvram.train.data.read import BadRow, Row, concrete_spec, load_rows
from lowvram.train.data.tokenize import Counts

TRL_HINT = "pip install 'lowvram[preference]' (TRL 1.16)"


def require_trl():
    """TRL, or a LowvramError naming the extra that installs it."""
    try:
        import trl
    except ImportError:
        raise LowvramError("training.objective dpo/orpo/simpo/kto trains through TRL, which is not installed",
                           TRL_HINT) from None
    return trl


@dataclass(frozen=True)
class PreferenceBundle:
    train: Any  # datasets.Dataset: prompt, chosen, rejected
    eval: Any | None
    skipped_bad_rows: int
    pairs: int


def _column(spec: DatasetSpec, field: str) -> str:
    return spec.fields.get(field, field)


def _value(row: dict, spec: DatasetSpec, field: str, required: bool = True):
    """A field as text or a message list; raises BadRow naming it."""
    column = _column(spec, field)
    shown = f"'{field}'" if column == field else f"'{field}' (column '{column}')"
    if column not in row or row[column] is None:
        if not required:
            return None
        present = ", ".join(map(str, row)) or "none"
        raise BadRow(f"missing field {shown}; expected text or a list of messages (columns present: {present})")
    value = row[column]
    if isinstance(value, str):
        if not value.strip():
            raise BadRow(f"field {shown}: expected non-empty text, got an empty string")
        return value
    if isinstance(value, list) and value and all(_is_message(m) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise BadRow(f"field {shown}: expected text or a list of {{role, content}} messages, got "
                 f"{type(value).__name__} {short_repr(value)}")


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and bool(m["role"]) and isinstance(m.get("content"), str)


def _as_messages(value, role: str):
    return [{"role": role, "content": value}] if isinstance(value, str) else value


def _empty(value) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return not value or all(not m["content"].strip() for m in value)


def preference_pair(row: Any, spec: DatasetSpec) -> dict:
    """{prompt, chosen, rejected} of one raw row, all text or all messages; BadRow if malformed."""
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(f"expected an object with fields, got {type(row).__name__} {short_repr(row)}")
    chosen, rejected = _value(row, spec, "chosen"), _value(row, spec, "rejected")
    prompt = _value(row, spec, "prompt", required=False)
    if prompt is None:
        if isinstance(chosen, str) != isinstance(rejected, str):
            raise BadRow("chosen and rejected must both be text or both be messages when there is no prompt field")
        from trl.data_utils import extract_prompt  # the shared start, as TRL itself finds it

        pair = extract_prompt({"chosen": chosen, "rejected": rejected})
        prompt, chosen, rejected = pair["prompt"], pair["chosen"], pair["rejected"]
        if _empty(prompt):
            raise BadRow("no prompt: there is no 'prompt' field and chosen and rejected share no start "
                         "(add a prompt field, or map one with fields: {prompt: ...})")
    if chosen == rejected:
        raise BadRow("chosen and rejected are identical: the pair prefers nothing")
    if _empty(chosen) or _empty(rejected):
        raise BadRow("chosen or rejected is empty after the prompt")
    if any(not isinstance(v, str) for v in (prompt, chosen, rejected)):
        prompt, chosen, rejected = (_as_messages(prompt, "user"), _as_messages(chosen, "assistant"),
                                    _as_messages(rejected, "assistant"))
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


# Labels KTO reads as desirable / undesirable (TRL wants a bool; JSON true/false, 1/0 and the words)
# (True == 1 and False == 0 as dict keys, so JSON's 1/0 read as the bools)
_LABELS = {True: True, False: False, "true": True, "false": False,
           "desirable": True, "undesirable": False, "good": True, "bad": False}


def unpaired_row(row: Any, spec: DatasetSpec) -> dict:
    """{prompt, completion, label} of one raw ``format: unpaired`` row (training.objective kto):
    a prompt, one completion, and whether it is desirable; BadRow if malformed."""
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(f"expected an object with fields, got {type(row).__name__} {short_repr(row)}")
    prompt, completion = _value(row, spec, "prompt"), _value(row, spec, "completion")
    column = _column(spec, "label")
    raw = row.get(column)
    # only scalars are looked up (a list or object label is a bad row, not a TypeError)
    key = raw.strip().lower() if isinstance(raw, str) else raw if isinstance(raw, (bool, int, float)) else None
    if key is None or key not in _LABELS:
        raise BadRow(f"field 'label' must be true (desirable) or false (undesirable), got {short_repr(raw)}")
    if _empty(completion):
        raise BadRow("completion is empty")
    if isinstance(prompt, str) != isinstance(completion, str):
        prompt, completion = _as_messages(prompt, "user"), _as_messages(completion, "assistant")
    return {"prompt": prompt, "completion": completion, "label": _LABELS[key]}


def preference_rows(rows: list[Row], spec: DatasetSpec, recipe: Recipe, counts: Counts) -> list[dict]:
    spec = concrete_spec(spec, rows)
    check_fields(spec)
    read = unpaired_row if spec.format == "unpaired" else preference_pair
    out = []
    for row in rows:
        try:
            out.append(read(row.data, spec))
        except BadRow as e:
            if recipe.data.skip_bad_rows:
                counts.skipped += 1
                continue
            raise DataError(
                f"{row.where}: {e}",
                "fix the row, map your column names with fields: {prompt: ..., "
                + ("completion: ..., label: ...}, " if spec.format == "unpaired" else "chosen: ..., rejected: ...}, ")
                + "or set data.skip_bad_rows: true to skip and count bad rows",
            ) from None
    return out


def _dataset(pairs: list[dict]):
    import datasets

    # One kind per dataset: TRL reads the first row to tell text from messages (is_conversational),
    # and pairs from unpaired rows (KTOTrainer unpairs a dataset whose first row has chosen).
    if len({isinstance(p.get("chosen", p.get("completion")), str) for p in pairs}) > 1:
        raise DataError("the preference rows mix text and messages",
                        "give every row text fields, or every row message lists (one dataset each)")
    if len({"chosen" in p for p in pairs}) > 1:
        raise DataError("the datasets mix preference pairs and unpaired rows",
                        "give training.objective kto one kind: format preference or format unpaired")
    return datasets.Dataset.from_list(pairs)


def build_preference_datasets(recipe: Recipe) -> PreferenceBundle:
    """The recipe's preference pairs as TRL's train (and eval) datasets."""
    import random

    require_trl()
    data = recipe.data
    counts = Counts()
    train: list[dict] = []
    held: list[dict] = []
    for spec in data.datasets:
        train += preference_rows(load_rows(recipe, spec, spec.split, spec.max_samples), spec, recipe, counts)
        if isinstance(data.validation, str):
            held += preference_rows(load_rows(recipe, spec, data.validation, None), spec, recipe, counts)
    if not train:
        raise DataError("no preference pairs left after checking the rows",
                        f"check the data (skipped bad rows: {counts.skipped})")
    if isinstance(data.validation, float):
        order = list(range(len(train)))
        random.Random(recipe.training.seed).shuffle(order)
        n_eval = max(1, round(len(train) * data.validation))
        if n_eval >= len(train):
            raise DataError(f"data.validation {data.validation} leaves no training pairs out of {len(train)}",
                            "lower data.validation or add pairs")
        held = [train[i] for i in sorted(order[:n_eval])]
        train = [train[i] for i in sorted(order[n_eval:])]
    return PreferenceBundle(train=_dataset(train), eval=_dataset(held) if held else None,
                            skipped_bad_rows=counts.skipped, pairs=len(train))
