"""The data as the model sees it (`lowvram data`, and the data lines of `validate`): files and
formats, token statistics, rendered samples with the trained tokens marked (colour on a terminal,
[[brackets]] when piped or NO_COLOR)."""

from __future__ import annotations

import dataclasses

from lowvram.report.console import console, print_json


def data_json(report) -> dict:
    return dataclasses.asdict(report)


def data_lines(report) -> list[str]:
    """Plain lines: each file's format and rows, the token statistics (or why none)."""
    lines = [f"note: {n}" for n in report.notes]
    for f in report.files:
        if not f.local:
            lines.append(f"{f.path}: a hub dataset (format {f.format}), checked when it downloads")
            continue
        how = "a spread sample of" if f.sampled else "all"
        bad = f", {f.bad_rows} bad (skipped: data.skip_bad_rows)" if f.bad_rows else ""
        lines.append(f"{f.path}: format {f.format}, {how} {f.rows} rows read{bad}")
    t = report.tokens
    if t is not None:
        share = t.trained_tokens / t.total_tokens if t.total_tokens else 0.0
        lines.append(f"tokens per sample: min {t.min_tokens}, median {t.median_tokens}, p95 {t.p95_tokens}, "
                     f"max {t.max_tokens} (seq_len {t.seq_len}); {t.samples} samples")
        lines.append(f"cut to seq_len: {t.truncated} sample(s), of which {t.dropped} dropped (no trained token "
                     f"left); trained tokens {t.trained_tokens:,} of {t.total_tokens:,} ({share:.0%})")
        if t.max_tokens < t.seq_len:
            lines.append(f"the longest sample has {t.max_tokens} tokens: the plan sizes each for seq_len "
                         f"{t.seq_len} (a smaller seq_len needs less memory and cuts nothing)")
    elif report.skipped_tokens:
        lines.append(f"tokens: not counted ({report.skipped_tokens})")
    if report.tokens is not None and report.skipped_tokens:
        lines.append(report.skipped_tokens)
    return lines


def show_data(report, as_json: bool = False) -> None:
    if as_json:
        print_json(data_json(report))
        return
    c = console()
    plain = c.no_color or not c.is_terminal
    for s in report.samples:
        c.print(f"--- {s.where}: {s.tokens} tokens, {s.trained_tokens} trained "
                + ("(trained text in [[ ]])" if plain else "(trained text in green)"), markup=False)
        if plain:
            c.print("".join(f"[[{text}]]" if trained else text for text, trained in s.pieces), markup=False)
        else:
            from rich.text import Text

            out = Text()
            for text, trained in s.pieces:
                out.append(text, style="bold green" if trained else "dim")
            c.print(out)
    for line in data_lines(report):
        c.print(line, markup=False)
