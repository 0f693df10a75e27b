"""The largest catalog model each card fine-tunes (issue 27 item 5): for 8, 12, 16, 24, 48 and
80 GB cards (as sold, `--vram NGB`), seq_len 2048, batch 1, the largest catalog model whose plan
fits with full fine-tuning (on the GPU: `--offload none`), LoRA and QLoRA, and the plan that does it.

    PYTHONPATH=. python bench/full_finetune_table.py [--out FILE]

Catalog models are tried from the largest down per card and method (a plan answers in about a
second); the first that fits is the row. Host RAM is fixed at 1 TiB (`--host-ram`) and nothing is
offloaded, so the table is the same on every machine and says what the card itself holds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
CARDS = (8, 12, 16, 24, 48, 80)
METHODS = ("full", "lora", "qlora")


def largest(models: list[tuple[str, int]], card: int, method: str):
    """(model, params, choice) of the largest model whose plan fits, or None."""
    from lowvram.errors import LowvramError
    from lowvram.planning.entry import make_plan

    for name, params in models:
        try:
            c = make_plan(model=name, method=method, vram=f"{card}GB", host_ram="1TiB", seq_len=2048,
                          batch_size=1, offload="none", optimizer="any-that-fits")  # the whole table: every optimizer
        except LowvramError:
            continue  # a request this model refuses (e.g. GaLore on an MoE): the next one
        if getattr(c, "fits", False):
            return name, params, c
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "full_finetune_table.txt"), help="results file ('' for none)")
    args = ap.parse_args()
    from lowvram.plan.model.catalog import catalog_names, resolve_model
    from lowvram.plan.model.models import model_numel

    models = sorted(((n, model_numel(resolve_model(n))) for n in catalog_names()),
                    key=lambda m: -m[1])
    lines = ["| card | full fine-tuning | LoRA | QLoRA |", "| --- | --- | --- | --- |"]
    details = []
    for card in CARDS:
        cells = []
        for method in METHODS:
            hit = largest(models, card, method)
            if hit is None:
                cells.append("nothing")
                continue
            name, params, c = hit
            s = c.chosen.setup
            cells.append(f"{name} ({params / 1e9:.1f}B)")
            details.append(f"{card} GB {method}: {name}, peak {c.chosen.peak_bytes / 2**30:.2f} of "
                           f"{c.budget.usable_bytes / 2**30:.2f} GiB, optimizer {s.optimizer}, "
                           f"checkpointing {'on' if s.gradient_checkpointing else 'off'}, loss {s.loss}, "
                           f"binds at {c.chosen.estimate.peak_moment}")
        lines.append(f"| {card} GB | " + " | ".join(cells) + " |")
    text = "\n".join(lines + [""] + details)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
