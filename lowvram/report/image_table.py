"""`lowvram plan --image-table`: the largest max_pixels per card (lowvram.plan.choose.image_table
makes the numbers; printing only)."""

from __future__ import annotations

from lowvram.report.console import console, print_json
from lowvram.units import gib


def show_image_table(data: dict, as_json: bool = False) -> None:
    """Per card: the largest max_pixels (and its tokens an image), the row's seq_len,
    the plan that reaches it and the moment that binds one rung larger."""
    if as_json:
        print_json(data)
        return
    from rich.table import Table

    n = data["images_per_row"]
    t = Table(title=f"Largest image per card: {data['model']}, {n} image{'s' if n > 1 else ''} a row beside "
                    f"{data['text_tokens']:,} text tokens")
    for col, right in (("card", False), ("budget", True), ("max_pixels", True),
                       ("tokens / image", True), ("seq_len", True), ("with", False), ("next size binds at", False)):
        t.add_column(col, justify="right" if right else "left")
    for r in data["rows"]:
        if not r["plan"]:
            t.add_row(r["card"], gib(r["budget_bytes"]), "does not fit", "-", "-", "-", "-")
            continue
        t.add_row(r["card"], gib(r["budget_bytes"]), f"{r['max_pixels']:,}",
                  f"{r['image_tokens']:,}", f"{r['seq_len']:,}", r["techniques_used"],
                  r["binds"] or "(the ladder's top)")
    c = console()
    c.print(t)
    ladder = data["ladder_tokens"]
    c.print(f"cards as sold, less the 5% safety margin; batch 1; max_pixels on the processor's grid (tokens x "
            f"{data['pixels_per_token']:,} px), tried at {ladder[0]} to {ladder[-1]:,} tokens an image; set it as "
            "data.max_pixels (or --max-pixels); the moments: docs/planner.md#models-with-a-vision-tower", markup=False)


__all__ = ["show_image_table"]
