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
    if report.images is not None:
        lines += image_lines(report.images)
    return lines


OUTCOMES = {"cut": "cut after its images (as text rows are cut)", "dropped": "dropped (no trained token left "
            "after the cut)", "refused": "refused: the cut would fall inside its images", "skipped": "skipped "
            "(the cut would fall inside its images; data.skip_bad_rows)"}


def image_lines(im) -> list[str]:
    """format image_chat measured (train/data/image_check.py ImageReport): tokens per image, the
    longest row, the rows over seq_len by file and row."""
    limits = (f", min_pixels {im.min_pixels:,}, max_pixels {im.max_pixels:,}" if im.max_pixels else "")
    lines = [f"images: {len(im.images)} in {im.rows} rows; tokens per image under {im.processor}{limits}: "
             f"min {im.min_image_tokens}, median {im.median_image_tokens}, max {im.max_image_tokens}; "
             f"up to {im.max_images_per_row} image(s) a row"]
    r = im.longest_row
    if r is not None:
        lines.append(f"longest image row: {r.where}, {r.tokens} tokens ({r.image_tokens} image + "
                     f"{r.tokens - r.image_tokens} text, {r.images} image(s)); seq_len {im.seq_len}")
    for o in im.over_seq_len[:MAX_ROWS]:
        lines.append(f"over seq_len {im.seq_len}: {o.where}, {o.tokens} tokens ({o.image_tokens} image): "
                     f"{OUTCOMES[o.outcome]}")
    if len(im.over_seq_len) > MAX_ROWS:
        lines.append(f"over seq_len {im.seq_len}: ... and {len(im.over_seq_len) - MAX_ROWS} more rows (--json lists all)")
    return lines


MAX_ROWS = 20  # images and rows listed by name; --json lists every one


def print_image_table(c, report) -> None:
    """The costliest images (MAX_ROWS), each with its row, size and tokens, as a rich table."""
    im = report.images
    if im is None or not im.images:
        return
    from rich.table import Table

    shown = sorted(im.images, key=lambda i: -i.tokens)[:MAX_ROWS]
    more = len(im.images) - len(shown)
    t = Table(title=f"Image tokens under {im.processor} (costliest first)"
              + (f"; {more} more in --json" if more else ""))
    for name, justify in (("row", "left"), ("image", "left"), ("size (px)", "right"), ("tokens", "right")):
        t.add_column(name, justify=justify)
    for i in shown:
        t.add_row(i.where, i.image, f"{i.width} x {i.height}", f"{i.tokens:,}")
    c.print(t)


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
    print_image_table(c, report)
    for line in data_lines(report):
        c.print(line, markup=False)
