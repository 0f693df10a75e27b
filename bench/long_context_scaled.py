"""The long-context plans of the README's context table run at scaled shapes on the CPU (issue 26,
item 6): for each card, the plan `lowvram plan --model llama-3.1-8b --method qlora --lora-r 32
--offload none --context-table` chooses at its longest seq_len (4-bit QLoRA, checkpointing,
activation offload, the tiled MLP, torchao's 4-bit AdamW, the chunked loss), its techniques fixed
in a recipe for the 8B/1024 Llama of bench/emulated_cards.py, trained through
lowvram.train.run.run on a card emulated by the live-bytes cap, and measured against its own plan.

- **Model**: bench/emulated_cards.py's 8B/1024 (hidden 256, 8 layers, intermediate 896, 8 heads,
  2 kv heads, vocabulary 2048): 1/16 of Llama-3.1-8B's width, 1/4 of its layers.
- **Sequence**: the real row's longest seq_len x 256 / 4096 (the width's ratio). Per token, a
  layer keeps tensors of h and I wide; the weights hold h x h and h x I. Keeping seq_len / hidden
  as it is at full size keeps the per-token terms' share of the peak against the weights (the
  regime the context table is about), and keeps DeepSpeed's shard count, ceil(seq_len / hidden),
  the real plan's. The vocabulary (1/64) makes the logits relatively smaller, so the chunked loss
  binds less here than at full size; its chunk is sized by the scaled plan, as `lowvram train`
  sizes it.
- **Adapters**: rank 32 x 256 / 4096 = 2, on all linear layers (adapters scale with rank x width).
- **Card**: 1 GiB emulated (SCALED_CARD_GIB x 1/1024): room for the scaled plan, which is checked
  against its own prediction (the plan-truth target: measured no more than 3% above, never more
  than 10% off), not against a 1/1024 card.
- **On a CPU** activation offload moves nothing (the planner counts the checkpoints on the device,
  lowvram.plan.setup.RunSetup.activation_offload); ``--cuda`` (a GPU lent) runs the real rows at
  full size on the card the row names, with it.

    PYTHONPATH=. python bench/long_context_scaled.py [--cards 8 12 16 24] [--steps 3] [--out FILE]
    PYTHONPATH=. python bench/long_context_scaled.py --cuda --cards 24   # on a GPU: the real row
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the offline environment, the repo on sys.path, the 1 GiB emulated card and bench/emulated_cards.py's loader
from full_finetune_scaled import REPO, SCALED_CARD_GIB, _emulated_cards  # noqa: E402

RESULTS = REPO / "bench" / "results" / "long_context_scaled.txt"
SCALED_HIDDEN = 256  # bench/emulated_cards.py's 8B/1024
REQUEST = dict(model="llama-3.1-8b", method="qlora", lora_r=32, offload="none", host_ram="1TiB")


def real_rows(cards: tuple[int, ...]):
    """The context table's rows, as `lowvram plan --context-table` gives them."""
    from lowvram.planning.entry import context_table

    _req, rows, _budget = context_table(cards=cards, **REQUEST)
    return rows


def scaled_seq_len(row) -> int:
    """The row's longest seq_len at the scaled model's width (seq_len / hidden kept)."""
    return max(64, round(row.longest * SCALED_HIDDEN / row.setup.model.hidden_size))


def run_row(row, steps: int, work: Path) -> dict:
    """One card's plan, its techniques fixed, trained at scaled shapes on the emulated card."""
    ec = _emulated_cards()
    _name, _real, shape = ec.MODELS[2]
    assert shape["hidden"] == SCALED_HIDDEN
    s = row.setup
    seq_len = scaled_seq_len(row)
    rank = max(1, s.lora_r * SCALED_HIDDEN // s.model.hidden_size)
    folder = work / row.card.replace(" ", "")
    folder.mkdir(parents=True)
    model_dir = ec.save_model(folder / "model", shape, max_positions=seq_len)
    recipe = ec.fixed_recipe(folder, model_dir, s, steps, seq_len,
                             extra=f"lora: {{r: {rank}, alpha: {2 * rank}, target_modules: all-linear}}\n")
    t0 = time.perf_counter()
    with contextlib.chdir(folder):
        cell = ec.run_cell(recipe, SCALED_CARD_GIB, "8B/1024")
    ratio = cell.measured_bytes / cell.predicted_bytes - 1 if cell.measured_bytes else None
    ok = ratio is not None and not cell.oom and ratio <= 0.03 and abs(ratio) <= 0.10
    return dict(card=row.card, real_len=row.longest, seq_len=seq_len, rank=rank, plan=cell.plan,
                predicted=cell.predicted_bytes, measured=cell.measured_bytes, ratio=ratio, oom=cell.oom,
                ok=ok, seconds=time.perf_counter() - t0)


def run_cuda_row(row, steps: int, work: Path) -> dict:  # pragma: no cover - needs a GPU
    """--cuda: the real row at full size on the card it names (the caching allocator capped at
    that card less the context the driver shows in use), the plan's own techniques and seq_len,
    random bf16 weights of the catalog's config; measured: the whole card's use."""
    import torch
    from transformers import AutoModelForCausalLM

    from lowvram import gpumemory
    from lowvram.check.builders import hf_config
    from lowvram.plan.choose.search import describe_setup
    from lowvram.plan.model.catalog import resolve_model
    from lowvram.planning.entry import make_plan
    from lowvram.testing import build_tokenizer
    from lowvram.train.run.oom import TrainingOOM
    from lowvram.train.run.run import run_training
    from lowvram.train.types import TrainOptions

    ec = _emulated_cards()
    card_gib = int(row.card.split()[0])
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    context = total - free - torch.cuda.memory_reserved()
    folder = work / row.card.replace(" ", "")
    model_dir = folder / "model"
    tokenizer = build_tokenizer()
    config = hf_config(resolve_model(REQUEST["model"]))
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(model_dir)
    del model
    torch.cuda.empty_cache()
    tokenizer.save_pretrained(model_dir)
    recipe_path = ec.fixed_recipe(folder, model_dir, row.setup, steps, row.longest,
                                  extra=f"lora: {{r: {row.setup.lora_r}, target_modules: all-linear}}\n")
    from lowvram.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    choice = make_plan(recipe=recipe, vram=f"{card_gib}GB", host_ram=REQUEST["host_ram"])
    plan = choice.plan
    torch.cuda.set_per_process_memory_fraction((card_gib * 2**30 - context) / total)
    t0 = time.perf_counter()
    try:
        result = run_training(recipe, plan, TrainOptions(overwrite=True, track_memory=None))
        rows = {r["what"]: r for r in result.metrics.memory_comparison or []}
        measured, oom = rows.get(gpumemory.DEVICE, {}).get("measured_bytes"), False
    except TrainingOOM as e:
        measured, oom = e.measured_peak_bytes, True
    ratio = measured / plan.predicted_peak_bytes - 1 if measured else None
    ok = ratio is not None and not oom and ratio <= 0.03 and abs(ratio) <= 0.10
    return dict(card=row.card, real_len=row.longest, seq_len=row.longest, rank=row.setup.lora_r,
                plan=describe_setup(choice.chosen.setup), predicted=plan.predicted_peak_bytes,
                measured=measured, ratio=ratio, oom=oom, ok=ok, seconds=time.perf_counter() - t0)


def table(results: list[dict], unit: float, unit_name: str) -> str:
    head = (f"{'card':>6}  {'real len':>8}  {'run len':>7}  {'r':>2}  {'planned':>10}  {'measured':>10}  "
            f"{'error':>7}  {'ok':3}  plan")
    lines = [head, "-" * 100]
    for r in results:
        measured = "-" if r["measured"] is None else f"{r['measured'] / unit:.3f}"
        error = "-" if r["ratio"] is None else f"{r['ratio']:+.2%}"
        ok = "yes" if r["ok"] else ("OOM" if r["oom"] else "NO")
        lines.append(f"{r['card']:>6}  {r['real_len']:>8,}  {r['seq_len']:>7,}  {r['rank']:>2}  "
                     f"{r['predicted'] / unit:>10.3f}  {measured:>10}  {error:>7}  {ok:3}  {r['plan']}")
    good = sum(r["ok"] for r in results)
    lines += ["", f"planned / measured in {unit_name}; error = measured / planned - 1; {good} of {len(results)} "
              "within the plan-truth target (measured <= plan +3%, |error| <= 10%) without OOM"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cards", type=int, nargs="+", default=[8, 12, 16, 24],
                    help="card sizes in GB, rows of the context table (default 8 12 16 24: the scaled "
                         "40-80 GB rows are 11k-24k tokens, minutes of CPU attention each)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cuda", action="store_true", help="the real rows at full size on a CUDA GPU")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (bench/emulated_cards.py --threads)")
    ap.add_argument("--out", default=None, help=f"results file (default {RESULTS}; --cuda: $OUT; '' for none)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = real_rows(tuple(args.cards))
    results = []
    with tempfile.TemporaryDirectory(prefix="long-context-") as d:
        for row in rows:
            if row.setup is None:
                print(f"{row.card}: nothing fits at one token; skipped", flush=True)
                continue
            run = run_cuda_row if args.cuda else run_row
            results.append(run(row, args.steps, Path(d)))
            print(table(results[-1:], *((2**30, "GiB") if args.cuda else (2**20, "MiB"))).splitlines()[2], flush=True)
    unit = (2**30, "GiB") if args.cuda else (2**20, "MiB")
    header = (f"# bench/long_context_scaled.py{' --cuda' if args.cuda else ''}, {time.strftime('%Y-%m-%d')}: the "
              f"context table's plans (llama-3.1-8b QLoRA r=32, batch 1, --offload none), "
              + ("at full size" if args.cuda else f"their techniques fixed for the 8B/1024 Llama at seq_len x "
                 f"{SCALED_HIDDEN}/4096, {SCALED_CARD_GIB} MiB emulated card")
              + f", {args.steps} steps through lowvram train; {time.perf_counter() - t0:.0f} s on this machine\n")
    text = header + table(results, *unit)
    print()
    print(text)
    out = args.out
    if out is None:
        out = str(Path(os.environ.get("OUT", ".")) / "long_context_scaled.txt") if args.cuda else str(RESULTS)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
