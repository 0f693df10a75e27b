"""Prompts for online RL (training.objective grpo, rloo) through TRL's GRPOTrainer/RLOOTrainer:
each row's prompt, checked here so a bad row is named by file and line, then handed to TRL as a
``datasets.Dataset`` with a ``prompt`` column and every other column of the row, which TRL passes
to the reward functions as keyword arguments (grpo_trainer.py ``_calculate_rewards``: every key of
the row but prompt, completion and completion_ids). TRL tokenizes the prompts itself at each
generation (``_tokenize_prompts``: the chat template with the generation prompt for messages).

- ``format: prompt``: the ``prompt`` column (or the column ``fields: {prompt: ...}`` names), text or
  a list of ``{role, content}`` messages.
- ``format: chat``: the messages before the last assistant turn; that turn's text is handed to
  the rewards as ``answer`` (unless the row has an ``answer`` column).
- ``format: alpaca``: the Alpaca prompt of instruction and input (format.py); ``output`` is
  handed to the rewards as ``answer`` (likewise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lowvram.errors import DataError
from lowvram.recipe import DatasetSpec, Recipe
from lowvram.train.data.format import check_fields, format_example, message_list, short_repr
from lowvram.train.data.read import BadRow, Row, load_rows

# Keyword arguments TRL 1.16 passes to every reward itself (grpo_trainer.py _calculate_rewards), and
# the columns it leaves out of the rewards' arguments ("completion", L1584; rloo_trainer.py L1153):
# a column of one of these names would collide with it, or never reach the rewards.
TRL_REWARD_KWARGS = ("prompts", "completions", "completion", "completion_ids", "trainer_state", "log_extra",
                     "log_metric", "environments")
# Columns TRL reads as images (a vision-language prompt): not lowvram's text prompts.
_IMAGE_COLUMNS = ("image", "images")


@dataclass(frozen=True)
class PromptBundle:
    train: Any  # datasets.Dataset: prompt + the rows' other columns
    skipped_bad_rows: int
    prompts: int
    columns: tuple[str, ...]  # what the rewards receive besides prompts and completions


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and bool(m["role"]) and isinstance(m.get("content"), str)


def _prompt_value(row: dict, spec: DatasetSpec) -> tuple[str, Any]:
    """(the column, its text or message list) of format prompt; BadRow naming the field."""
    column = spec.fields.get("prompt", "prompt")
    shown = "'prompt'" if column == "prompt" else f"'prompt' (column '{column}')"
    if column not in row or row[column] is None:
        present = ", ".join(map(str, row)) or "none"
        raise BadRow(f"missing field {shown}; expected text or a list of messages (columns present: {present})")
    value = row[column]
    if isinstance(value, str):
        if not value.strip():
            raise BadRow(f"field {shown}: expected non-empty text, got an empty string")
        return column, value
    if isinstance(value, list) and value and all(_is_message(m) for m in value):
        if value[-1]["role"] == "assistant":
            raise BadRow(f"field {shown}: the messages end with an assistant turn; a prompt ends where the "
                         "model's completion starts (a user or system turn)")
        return column, [{"role": m["role"], "content": m["content"]} for m in value]
    raise BadRow(f"field {shown}: expected text or a list of {{role, content}} messages, got "
                 f"{type(value).__name__} {short_repr(value)}")


def _chat_prompt(row: dict, spec: DatasetSpec) -> tuple[str, list, str | None]:
    """(the messages column, the messages before the last assistant turn, that turn's text)."""
    column, messages = message_list(row, spec)
    for j, m in enumerate(messages):
        if not isinstance(m.get("content"), str):
            raise BadRow(f"field '{column}', message {j}: 'content' must be text")
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    prompt = messages if last is None else messages[:last]
    if not prompt or all(not m["content"].strip() for m in prompt):
        raise BadRow(f"field '{column}': no prompt before the last assistant turn")
    answer = None if last is None else messages[last]["content"]
    return column, [{"role": m["role"], "content": m["content"]} for m in prompt], answer


def prompt_row(row: Any, spec: DatasetSpec) -> dict:
    """{prompt, **the row's other columns} of one raw row; BadRow if malformed."""
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(f"expected an object with fields, got {type(row).__name__} {short_repr(row)}")
    if spec.format == "prompt":
        column, prompt = _prompt_value(row, spec)
        used, answer = {column}, None
    elif spec.format == "chat":
        column, prompt, answer = _chat_prompt(row, spec)
        used = {column}
    else:  # alpaca: the Stanford Alpaca prompt; output is the reference answer
        prompt, answer = format_example(row, spec)
        used = {spec.fields.get(f, f) for f in ("instruction", "input", "output")}
    clash = sorted(c for c in row if c not in used and c in (*TRL_REWARD_KWARGS, *_IMAGE_COLUMNS, "prompt"))
    if clash:
        raise BadRow(f"column '{clash[0]}' has a name TRL gives the rewards itself (or leaves out of them, or "
                     f"reads as the prompt or images; rename it with fields, or in the data): "
                     f"{', '.join(TRL_REWARD_KWARGS)}")
    out = {"prompt": prompt, **{k: v for k, v in row.items() if k not in used}}
    if answer is not None:
        out.setdefault("answer", answer)
    return out


def prompt_rows(rows: list[Row], spec: DatasetSpec, recipe: Recipe, counts: list[int]) -> list[dict]:
    """The checked prompts of ``rows``; a bad row is a DataError naming its file and line, or is
    skipped and counted (``counts[0]``) with data.skip_bad_rows."""
    check_fields(spec)
    out = []
    for row in rows:
        try:
            out.append(prompt_row(row.data, spec))
        except BadRow as e:
            if recipe.data.skip_bad_rows:
                counts[0] += 1
                continue
            raise DataError(f"{row.where}: {e}",
                            "fix the row, map your column names with fields: {prompt: ...}, or set "
                            "data.skip_bad_rows: true to skip and count bad rows") from None
    return out


def load_prompts(recipe: Recipe, first: int | None = None) -> tuple[list[dict], int]:
    """The recipe's checked prompt rows (``first``: at most that many per dataset, for validate's
    sample call) and the bad rows skipped."""
    counts = [0]
    rows: list[dict] = []
    for spec in recipe.data.datasets:
        limit = min(x for x in (first, spec.max_samples) if x) if (first or spec.max_samples) else None
        rows += prompt_rows(load_rows(recipe, spec, spec.split, limit), spec, recipe, counts)
    return rows, counts[0]


def build_prompt_dataset(recipe: Recipe, tokenizer: Any = None) -> PromptBundle:
    """The recipe's prompts as TRL's train dataset (``tokenizer``: the run's, whose chat template
    message prompts need; None: not checked)."""
    import datasets

    rows, skipped = load_prompts(recipe)
    if not rows:
        raise DataError("no prompts left after checking the rows", f"check the data (skipped bad rows: {skipped})")
    # TRL reads the first row to tell text from messages (is_conversational): one kind per run
    if len({isinstance(r["prompt"], str) for r in rows}) > 1:
        raise DataError("the prompts mix text and messages",
                        "give every row a text prompt, or every row a list of messages")
    # TRL renders message prompts with the tokenizer's chat template at the first generation
    # (grpo_trainer.py _tokenize_prompts: apply_chat_template, a ValueError mid-run without one)
    if tokenizer is not None and not isinstance(rows[0]["prompt"], str) and not getattr(tokenizer, "chat_template", None):
        where = ", ".join(spec.path for spec in recipe.data.datasets)
        raise DataError(f"{where}: the prompts are chat messages and the tokenizer has no chat template to render "
                        "them with", "use a chat model's tokenizer (model.tokenizer), or give text prompts "
                        "(format prompt with text, or format alpaca)")
    keys = set(rows[0])
    for r in rows:
        if set(r) != keys:
            raise DataError(f"the rows carry different columns ({', '.join(sorted(set(r) ^ keys))} in some rows only)",
                            "give every row the same columns: each is handed to the rewards by name")
    try:
        train = datasets.Dataset.from_list(rows)
    except Exception as e:  # noqa: BLE001 - pyarrow's type errors: a column of mixed types
        raise DataError(f"the prompt rows cannot form one table: {e}",
                        "give each column one type in every row (text, number or list)") from None
    return PromptBundle(train=train, skipped_bad_rows=skipped, prompts=len(rows),
                        columns=tuple(k for k in rows[0] if k != "prompt"))
