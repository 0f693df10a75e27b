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
from typing import TYPE_CHECKING, Any

from lowvram.errors import LowvramError
from lowvram.runfiles import require_intact
from lowvram.train.after.artifacts import (
    BaseModel,
    LoadSize,
    dense_size,
    find_base_model,
    load_adapter,
    load_base,
    load_pretrained,
    load_run_tokenizer,
    load_trained_base,
    merge_dtype,
    read_adapter_run,
    refuse_if_short,
    run_prompt_format,
    trained_plan,
    trained_size,
    trusts_code,
)
from lowvram.units import mem

if TYPE_CHECKING:
    from lowvram.hardware import Hardware

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


def load_generator(path: str | Path, prompt_format: str = "auto", dtype: str = "auto", cpu: bool = False) -> Generator:
    """A run folder (base + adapter), a checkpoint, a merged folder or a full fine-tune; on the
    GPU when there is one (``cpu``: on the CPU)."""
    from lowvram.train.build.model import quiet_libraries

    quiet_libraries()
    import torch

    if prompt_format not in FORMATS:
        raise LowvramError(f"unknown --format {prompt_format!r}", f"use one of {', '.join(FORMATS)}")
    p = Path(path)
    device = "cuda" if torch.cuda.is_available() and not cpu else "cpu"
    if (p / "adapter_config.json").is_file():
        p, adapter, recipe, plan = read_adapter_run(p)
        base = find_base_model(p, adapter, recipe)
        model = load_adapter(_load_run_base(base, recipe, plan, dtype, device, p), p)
        source = f"{base.source} + adapter {p}"
        tok_source = p if (p / "tokenizer_config.json").is_file() else Path(base.source)
        trust = base.trust_remote_code
    elif (p / "config.json").is_file():
        from lowvram.hardware import detect_hardware

        require_intact(p)  # a merged or full fine-tuned folder: its weights and config
        check_fits(dense_size(BaseModel(str(p), "folder"), _stored_dtype(p) if dtype == "auto" else dtype, p),
                   device, detect_hardware(gpus=1))
        trust = trusts_code(p)  # the run's (or the merge's) model.trust_remote_code
        model = load_pretrained(p, trust, dtype=getattr(torch, dtype) if dtype != "auto" else "auto",
                                device_map={"": device})
        source, tok_source = str(p), p
    else:
        read_adapter_run(p)  # raises the precise error: not a run / unfinished run
        raise LowvramError(f"no model in {p}", "pass a run folder or a merged folder")  # pragma: no cover
    tokenizer = load_run_tokenizer(tok_source, trust)
    model.eval()
    fmt = choose_format(prompt_format, run_prompt_format(p), bool(getattr(tokenizer, "chat_template", None)))
    return Generator(model, tokenizer, fmt, source, device)


def _load_run_base(base: BaseModel, recipe: dict, plan: dict, dtype: str, device: str, folder: Path):
    """A run's base, checked against the free memory first. A QLoRA run's base is loaded as it
    trained (4/8-bit, the same BitsAndBytesConfig: train/build/model.py's builder), as Unsloth and
    Axolotl load a QLoRA adapter for inference; ``--dtype`` loads it dequantized instead (what
    `lowvram merge` needs)."""
    quantized = plan.get("quantization", "none") != "none" and dtype == "auto"
    dt = merge_dtype(recipe, plan, dtype)
    size = trained_size(base, plan) if quantized else dense_size(base, dt, folder)
    from lowvram.hardware import detect_hardware

    check_fits(size, device, detect_hardware(gpus=1))  # generate uses the first card
    return load_trained_base(base, trained_plan(plan), device) if quantized else load_base(base, dt, device)


def _stored_dtype(folder: Path) -> str:
    """The dtype ``dtype="auto"`` loads a folder in: config.json's ``dtype`` (transformers 5;
    ``torch_dtype`` before), else float32 (transformers' default)."""
    import json

    from lowvram.vocab import DTYPE_BYTES

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    stored = config.get("dtype") or config.get("torch_dtype")
    return stored if stored in DTYPE_BYTES else "float32"


def check_fits(size: LoadSize, device: str, hw: Hardware) -> None:
    """The weights (a lower bound: the replies' KV cache and activations come on top, small for
    short replies) against the free memory of the device they load on (merge's check, shared)."""
    if device == "cuda":
        free = hw.devices[0].free_bytes if hw.devices else 0
        ram = f"{mem(hw.host_available_bytes)} of host RAM available"
        refuse_if_short("generate", size, free, f"GPU memory on {hw.devices[0].name if hw.devices else 'the GPU'}",
                        f"pass --cpu to generate on the CPU (slower; {ram}), use a card with more memory, "
                        "or free the GPU (nvidia-smi shows what holds it)")
    else:
        refuse_if_short("generate", size, hw.host_available_bytes, "host RAM",
                        "close other programs, or generate on a machine with more RAM or on a GPU that holds it")


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
