"""The rich console, error/hint lines (print_error), JSON output, and the cell formats the other
report modules share. rich is imported inside the functions (``lowvram --help`` must stay
instant); rich turns colour off by itself when stdout is not a terminal; NO_COLOR is honoured too.
"""

from __future__ import annotations

import json
import sys

from lowvram.errors import error_text


def console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def print_error(err) -> None:
    """A LowvramError as one `error:` line (plus any further lines of its message) and one
    `hint:` line on stderr; no traceback (the CLI and the demo; a launched worker writes the
    same text, errors.error_text)."""
    sys.stderr.write(error_text(err))
    sys.stderr.flush()


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def number_cell(x, nd: int = 4) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def setting_cell(value) -> str:
    return {True: "on", False: "off"}[value] if isinstance(value, bool) else str(value)


def techniques_label(t: dict) -> str:
    """A plan's techniques in a few words (alternatives in `lowvram plan`, rows of `lowvram runs`)."""
    parts = [str(t.get("mixed_precision", "?"))]
    parts.append("LoRA" if t.get("lora") else "full")
    if t.get("quantization", "none") != "none":
        parts.append(str(t["quantization"]))
    if t.get("gradient_checkpointing"):
        parts.append("checkpointing")
    if t.get("activation_offload"):
        parts.append("activation offload")
    if t.get("optimizer", "adamw") != "adamw":
        parts.append(str(t["optimizer"]))
    if t.get("offload", "none") != "none":
        parts.append(f"offload {t['offload']}")
    if t.get("loss", "standard") != "standard":
        parts.append(f"{t['loss']} loss")
    if t.get("tiled_mlp"):
        parts.append("tiled MLP")
    if t.get("attention", "sdpa") != "sdpa":
        parts.append(str(t["attention"]))
    return ", ".join(parts)
