"""Format a raw row as text segments, each marked trained or not: alpaca / completion / text
through their prompt, chat through the tokenizer's chat template (assistant turns trained)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lowvram.errors import DataError
from lowvram.recipe import DatasetSpec
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

# Field names of each format: (required, optional).
FORMAT_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "alpaca": (("instruction", "output"), ("input",)),
    "chat": (("messages",), ()),
    "image_chat": (("messages",), ("images",)),  # lowvram.train.data.images
    "completion": (("prompt", "completion"), ()),
    "text": (("text",), ()),
    "preference": (("chosen", "rejected"), ("prompt",)),  # lowvram.train.data.preference
    "unpaired": (("prompt", "completion", "label"), ()),  # training.objective kto (data/preference.py)
    "prompt": (("prompt",), ()),  # training.objective grpo, rloo (data/prompts.py); other columns pass through
}


Segments = list[tuple[str, bool]]  # (text, trained)


def format_example(row: dict, spec: DatasetSpec) -> tuple[str, str]:
    """(prompt, response) text of an alpaca / completion / text row; text gives ("", text).

    Raises ``ValueError`` for a chat spec (chat needs the tokenizer: see ``_chat_segments``) and
    ``BadRow`` (a ``ValueError`` too) naming the field for a malformed row.
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


def _text_field(row: dict, spec: DatasetSpec, field: str, required: bool = True) -> str:
    column = spec.fields.get(field, field)
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

    def __init__(self, tokenizer: PreTrainedTokenizerBase, spec: DatasetSpec, eos: str | None = None) -> None:
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
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
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


def message_list(row: dict, spec: DatasetSpec) -> tuple[str, list[dict]]:
    """The row's messages column and its list, each message a dict with a role (BadRow if not);
    the content is the caller's to check (text here, text or parts for image_chat)."""
    column = spec.fields.get("messages", "messages")
    if column not in row or row[column] is None:
        present = ", ".join(map(str, row)) or "none"
        raise BadRow(f"missing field '{column}'; expected a list of {{role, content}} (columns present: {present})")
    messages = row[column]
    if not isinstance(messages, list) or not messages:
        raise BadRow(f"field '{column}': {MESSAGES_EXPECTED}, got {type(messages).__name__} {short_repr(messages)}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise BadRow(f"field '{column}', message {j}: {MESSAGES_EXPECTED}, got {short_repr(m)}")
    return column, messages


def _messages(row: dict, spec: DatasetSpec) -> list[dict]:
    column, messages = message_list(row, spec)
    expected = MESSAGES_EXPECTED
    for j, m in enumerate(messages):
        if not isinstance(m.get("content"), str):
            got = type(m.get("content")).__name__ if "content" in m else "no content"
            raise BadRow(f"field '{column}', message {j}: 'content' must be text, got {got}")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise BadRow(f"field '{column}': {expected} with at least one non-empty assistant message")
    # Keep only role/content: extra keys (name, weight, ...) may be None after Arrow loading.
    return [{"role": m["role"], "content": m["content"]} for m in messages]
