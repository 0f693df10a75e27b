"""Format a raw row as text segments, each marked trained or not: alpaca / completion / text
through their prompt, chat through the tokenizer's chat template (assistant turns trained)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lowvram.errors import DataError
from lowvram.recipe import DatasetSpec
from lowvram.recipe.formats import SHAREGPT_ROLES, column_of, recognise, unknown_field
from lowvram.train.data.read import BadRow

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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

Segments = list[tuple[str, bool]]  # (text, trained)
# The formats rendered by the tokenizer's chat template (image_chat: by the processor's).
CHAT_FORMATS = ("chat", "sharegpt")


def format_example(row: dict, spec: DatasetSpec) -> tuple[str, str]:
    """(prompt, response) text of an alpaca / completion / text row; text gives ("", text).

    Raises ``ValueError`` for a chat spec (chat needs the tokenizer: see ``_chat_segments``) and
    ``BadRow`` (a ``ValueError`` too) naming the field for a malformed row.
    """
    spec = row_spec(row, spec)
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


def row_spec(row: dict, spec: DatasetSpec) -> DatasetSpec:
    """``spec``, or with format auto the format this row's columns name (recipe/formats.py)."""
    if spec.format != "auto":
        return spec
    found = recognise(row)
    if found is None:
        raise BadRow(f"cannot tell the data format from the columns ({', '.join(map(str, row)) or 'none'}); "
                     "set format: and map your columns with fields: {...}")
    return spec.model_copy(update={"format": found.format, "fields": {**found.fields, **spec.fields}})


def _text_field(row: dict, spec: DatasetSpec, field: str, required: bool = True) -> str:
    column = column_of(spec.format, spec.fields, field)
    shown = f"'{field}'" if column == field else f"'{field}' (column '{column}')"
    if column not in row or row[column] is None:
        if not required:
            return ""
        present = ", ".join(map(str, row)) or "none"
        raise BadRow(f"missing field {shown}; expected text (columns present: {present})")
    value = row[column]
    if not isinstance(value, str):
        raise BadRow(f"field {shown}: expected text, got {type(value).__name__} {short_repr(value)}")
    if required and not value.strip():
        raise BadRow(f"field {shown}: expected non-empty text, got an empty string")
    return value


def short_repr(value: Any) -> str:
    s = repr(value)
    return s if len(s) <= 40 else s[:37] + "..."


def check_fields(spec: DatasetSpec) -> None:
    """The schema checks fields: of a recipe's format; this checks a format recognised from rows."""
    if wrong := unknown_field(spec.format, spec.fields):
        key, tip, known = wrong
        raise DataError(
            f"{spec.path}: fields: '{key}' is not a field of format {spec.format}",
            f"{tip}fields maps {spec.format}'s fields ({', '.join(known)}) to your column names",
        )


def segments(row: Any, spec: DatasetSpec, chat: ChatRenderer | None) -> Segments:
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(f"expected an object with fields, got {type(row).__name__} {short_repr(row)}")
    if chat is not None:
        return chat.segments(row, spec)
    prompt, response = format_example(row, spec)
    return [(prompt, False), (response, True)]


class ChatRenderer:
    """Splits a conversation into template text segments; assistant turns are the trained ones.

    The template renders the conversation up to each assistant turn (with the generation prompt)
    and up to the end of that turn; the turn's text is the difference. This needs a template that
    renders incrementally (each render a prefix of the next), which holds for ChatML, Llama 3,
    Mistral, Gemma and Qwen templates; a row where it fails is reported, not silently mis-masked.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, spec: DatasetSpec, eos: str | None = None,
                 last_only: bool = False) -> None:
        """``tokenizer``: what renders the template (a tokenizer, or a multimodal processor, whose
        apply_chat_template takes the same arguments); ``eos``: its end token when it is no
        tokenizer."""
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{spec.path}: format {spec.format} needs a chat template and the "
                f"{'tokenizer' if eos is None else 'processor'} has no chat template",
                "use a chat model's tokenizer (model.tokenizer) or format: alpaca",
            )
        self.tokenizer = tokenizer
        self.eos = (tokenizer.eos_token if eos is None else eos) or ""
        self.last_only = last_only  # data.train_on: last (only the final assistant turn is trained)

    def _render(self, messages: list, generation_prompt: bool) -> str:
        if not messages:
            return ""
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # noqa: BLE001 - jinja raise_exception and template errors
            raise BadRow(f"the chat template rejected the messages: {e}") from None

    def segments(self, row: dict, spec: DatasetSpec) -> Segments:
        return self.segments_of(_messages(row, spec))

    def segments_of(self, messages: list[dict]) -> Segments:
        full = self._render(messages, False)
        out: Segments = []
        pos = 0
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for i in turns[-1:] if self.last_only else turns:
            before = self._render(messages[:i], True)
            upto = self._render(messages[: i + 1], False)
            if not (upto.startswith(before) and full.startswith(upto) and len(before) >= pos):
                raise BadRow(
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


MESSAGES_EXPECTED = "expected a list of {role, content} objects"
# OpenAI message keys a chat template renders besides role and content (tool calls and results).
_TOOL_KEYS = ("tool_calls", "name", "tool_call_id")


def message_list(row: dict, spec: DatasetSpec) -> tuple[str, list[dict]]:
    """The row's messages column and its list in OpenAI's layout: each message a dict whose
    ``role`` is mapped through data's ``roles`` (sharegpt: ShareGPT's tags) and whose text is under
    ``content`` (BadRow when a message has no role). The content is the caller's to check (text
    here, text or parts for image_chat)."""
    column = column_of(spec.format, spec.fields, "messages")
    role_key = column_of(spec.format, spec.fields, "role")
    content_key = column_of(spec.format, spec.fields, "content")
    expected = MESSAGES_EXPECTED if role_key == "role" and content_key == "content" else \
        f"expected a list of {{{role_key}, {content_key}}} objects"
    if column not in row or row[column] is None:
        present = ", ".join(map(str, row)) or "none"
        raise BadRow(f"missing field '{column}'; {expected} (columns present: {present})")
    messages = row[column]
    if not isinstance(messages, list) or not messages:
        raise BadRow(f"field '{column}': {expected}, got {type(messages).__name__} {short_repr(messages)}")
    roles = {**(SHAREGPT_ROLES if spec.format == "sharegpt" else {}), **spec.roles}
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get(role_key), str) or not m[role_key]:
            raise BadRow(f"field '{column}', message {j}: {expected}, got {short_repr(m)}")
        role = roles.get(m[role_key], m[role_key])
        if spec.format == "sharegpt" and role not in SHAREGPT_ROLES.values():
            raise BadRow(f"field '{column}', message {j}: unknown speaker '{m[role_key]}' (map it with "
                         f"roles: {{{m[role_key]}: assistant}}, or user, system, tool; known: {', '.join(SHAREGPT_ROLES)})")
        msg = {k: v for k, v in m.items() if k in _TOOL_KEYS and v is not None}
        msg["role"] = role
        if content_key in m:
            msg["content"] = m[content_key]
        out.append(msg)
    return column, out


def _messages(row: dict, spec: DatasetSpec) -> list[dict]:
    column, messages = message_list(row, spec)
    content_key = column_of(spec.format, spec.fields, "content")
    for j, m in enumerate(messages):
        if m.get("content") is None and m.get("tool_calls"):
            m["content"] = ""  # an assistant turn that only calls tools
        if not isinstance(m.get("content"), str):
            got = type(m.get("content")).__name__ if "content" in m else "no content"
            raise BadRow(f"field '{column}', message {j}: '{content_key}' must be text, got {got}")
    if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in messages):
        roles = sorted({m["role"] for m in messages})
        tip = "" if "assistant" in roles else f" (roles present: {', '.join(roles)}; map yours with roles: {{...}})"
        raise BadRow(f"field '{column}': {MESSAGES_EXPECTED} with at least one non-empty assistant message{tip}")
    return messages
