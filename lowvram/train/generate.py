"""`lowvram generate`: try a trained model. Loads a run's base + adapter, a merged folder or a
full fine-tune, and streams the reply token by token (transformers ``TextIteratorStreamer``).

Prompt format: an Alpaca-format run is prompted with the Alpaca template it trained on (a chat
template would show the model a format it never saw); otherwise the tokenizer's chat template
when it has one, else the raw text. ``--format`` overrides the choice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowvram.errors import LowvramError
from lowvram.runfiles import require_intact
from lowvram.train.artifacts import (
    find_base_model,
    load_adapter,
    load_base,
    merge_dtype,
    read_adapter_run,
    run_prompt_format,
)

FORMATS = ("auto", "chat", "alpaca", "raw")


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    temperature: float = 0.7
    greedy: bool = False

    def kwargs(self) -> dict:
        if self.greedy or self.temperature <= 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature}


@dataclass
class Generator:
    model: Any
    tokenizer: Any
    prompt_format: str  # chat | alpaca | raw
    source: str  # what was loaded, for the report
    device: str


# --------------------------------------------------------------------------------------------
# Which prompt format


def choose_format(requested: str, trained: str | None, has_chat_template: bool) -> str:
    if requested != "auto":
        if requested == "chat" and not has_chat_template:
            raise LowvramError("--format chat: this tokenizer has no chat template",
                               "use --format alpaca or --format raw")
        return requested
    if trained == "alpaca":
        return "alpaca"
    return "chat" if has_chat_template else "raw"


def render_prompt(gen: Generator, messages: list[dict]) -> str:
    """The text the model sees for a conversation (alpaca/raw: the last user message only)."""
    if gen.prompt_format == "chat":
        return gen.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = messages[-1]["content"]
    if gen.prompt_format == "alpaca":
        from lowvram.train.data.format import ALPACA_PROMPT_NO_INPUT

        return ALPACA_PROMPT_NO_INPUT.format(instruction=text)
    return text


# --------------------------------------------------------------------------------------------
# Loading


def load_generator(path: str | Path, prompt_format: str = "auto", dtype: str = "auto") -> Generator:
    """A run folder (base + adapter), a checkpoint, a merged folder or a full fine-tune."""
    from lowvram.train.model import quiet_libraries

    quiet_libraries()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if prompt_format not in FORMATS:
        raise LowvramError(f"unknown --format {prompt_format!r}", f"use one of {', '.join(FORMATS)}")
    p = Path(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if (p / "adapter_config.json").is_file():
        p, adapter, recipe, plan = read_adapter_run(p)
        base = find_base_model(p, adapter, recipe)
        model = load_adapter(load_base(base, merge_dtype(recipe, plan, dtype), device), p)
        source = f"{base.source} + adapter {p}"
        tok_source = p if (p / "tokenizer_config.json").is_file() else Path(base.source)
    elif (p / "config.json").is_file():
        require_intact(p)  # a merged or full fine-tuned folder: its weights and config
        kwargs = {"dtype": getattr(torch, dtype) if dtype != "auto" else "auto", "device_map": {"": device}}
        model = AutoModelForCausalLM.from_pretrained(str(p), **kwargs)
        source, tok_source = str(p), p
    else:
        read_adapter_run(p)  # raises the precise error: not a run / unfinished run
        raise LowvramError(f"no model in {p}", "pass a run folder or a merged folder")  # pragma: no cover
    require_intact(Path(tok_source))
    tokenizer = AutoTokenizer.from_pretrained(str(tok_source))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    fmt = choose_format(prompt_format, run_prompt_format(p), bool(getattr(tokenizer, "chat_template", None)))
    return Generator(model, tokenizer, fmt, source, device)


# --------------------------------------------------------------------------------------------
# Generating


def stream_reply(gen: Generator, messages: list[dict], settings: GenerationSettings) -> Iterator[str]:
    """Yield the reply's text piece by piece while generate() runs in a thread."""
    import torch
    from transformers import TextIteratorStreamer

    tok = gen.tokenizer
    text = render_prompt(gen, messages)
    # A chat template already writes the special tokens (BOS etc.); do not add them twice.
    inputs = tok(text, return_tensors="pt", add_special_tokens=gen.prompt_format != "chat").to(gen.model.device)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    kwargs = dict(**inputs, streamer=streamer, max_new_tokens=settings.max_new_tokens,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **settings.kwargs())
    if gen.prompt_format == "alpaca":  # the model may go on with the next "### Instruction:"
        kwargs.update(stop_strings=["\n### "], tokenizer=tok)
    failure: list[BaseException] = []

    def work() -> None:
        try:
            with torch.no_grad():
                gen.model.generate(**kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            failure.append(e)
            streamer.end()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    yield from streamer
    thread.join()
    if failure:
        raise failure[0]


def chat_loop(gen: Generator, settings: GenerationSettings, read: Callable[[str], str],
              write: Callable[[str], None]) -> int:
    """Read a line, stream the reply, repeat; /reset forgets, /exit (or EOF) ends. Returns turns."""
    messages: list[dict] = []
    turns = 0
    while True:
        try:
            line = read("you> ").strip()
        except EOFError:
            write("\n")
            return turns
        if line in ("/exit", "/quit"):
            return turns
        if line == "/reset":
            messages = []
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        write("model> ")
        reply = "".join(_echo(stream_reply(gen, messages, settings), write))
        write("\n")
        turns += 1
        # Alpaca and raw prompts have no turns: each question stands alone.
        messages = [*messages, {"role": "assistant", "content": reply}] if gen.prompt_format == "chat" else []


def _echo(chunks: Iterator[str], write: Callable[[str], None]) -> Iterator[str]:
    for c in chunks:
        write(c)
        yield c
