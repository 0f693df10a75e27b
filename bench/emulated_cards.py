"""Plan truth on emulated cards (issue 13, item 6): every auto plan that says "fits" runs 5 steps
of `lowvram train` without running out of memory and uses at least 70% of its budget.

Cards of 6, 8, 12, 16 and 24 GiB and three model sizes, scaled down by SCALE = 1/1024 so the
whole grid trains on a 2-core CPU in minutes:

- **Cards**: 6-24 MiB. ``LOWVRAM_EMULATE_VRAM`` caps the CPU live-bytes tracker
  (lowvram.livebytes.LiveBytes ``cap_bytes``; lowvram.train.run.oom.emulated_vram_bytes): any
  operation that leaves more tensor bytes alive than the card raises torch.OutOfMemoryError, as
  the card would.
- **Models**: random-init Llamas with 1/1024 of the parameters of Llama-3.2-1B (1.24B),
  Llama-3.2-3B (3.21B) and Llama-3.1-8B (8.03B): 1.3M, 3.1M and 7.9M parameters (vocabulary
  2048, hidden 128/192/256, 4/6/8 layers). Their weights are 1/1024 of the real ones' bytes.
- **Work**: 16 sequences of 128 tokens per optimizer step (packed windows, so every batch is
  full length, the shape the plan is made for), bf16 weights (``model.dtype: bfloat16``: the
  plan a bf16 card gets). Activations scale with tokens x hidden x layers and the logits with
  tokens x vocabulary; with 1/16 of the tokens of a 2048-token sequence, 1/16-1/32 of the hidden
  size and 1/64 of a 128k vocabulary, each lands within a few times 1/1024 of a real run's. The
  point is not to reproduce a real card's plan but to check the planner's promise on every
  plan it picks: a plan that says "fits" fits, and does not waste the card.
- **Budget**: what `lowvram train --vram SIZE` plans for on a machine without a GPU (a CPU run:
  no CUDA context or allocator slack in the plan, lowvram.plan.memory.memory.estimate_memory) minus
  the safety margin, 5% of the card with a floor of 256 MiB (lowvram.plan.choose.request.Budget) that is
  scaled by SCALE too (the floor never binds on a real card of 6 GB or more: 5% of 6 GB is
  300 MB). The "% budget" column is measured peak / that budget.

Every cell: plan with the chooser (every technique auto; lowvram.planning.build_request and
choose_plan on the budget above, as `lowvram train` does), then lowvram.train.run.run.run_training
for 5 steps under the emulated card (no OOM recovery: an OOM is a failure here). The measured
peak is the run's exact live tensor bytes.

    python bench/emulated_cards.py              # the grid, table on stdout, bench/results/emulated_cards.txt
    python bench/emulated_cards.py --plan-only  # the plans only (seconds)
    python bench/emulated_cards.py --cuda       # on a GPU: real-size cards and models (see run_cuda)

``--cuda`` (a GPU lent): SCALE = 1, the real-size shapes; each card is emulated with
torch.cuda.set_per_process_memory_fraction(card / total), which caps the caching allocator, and
the plan is made for a CUDA card of that size (its context and slack terms included).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("NO_COLOR", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's lowvram

SCALE = 1 / 1024
CARDS_GIB = (6, 8, 12, 16, 24)
STEPS = 5
BATCH, SEQ_LEN, VOCAB = 16, 128, 2048
# LoRA rank 16 on Llama-3.1-8B (hidden 4096, 32 layers) is 42M adapter parameters; rank 1 on the
# scaled 8B (hidden 256, 8 layers) is 1/1024 of that (adapters scale with rank x hidden x layers).
LORA_R = 1
TARGET = 0.70  # a plan that fits uses at least this share of its budget

# name, the model it stands for, Llama shape at SCALE (hidden, layers, intermediate, heads, kv heads)
MODELS = (
    ("1B/1024", "Llama-3.2-1B", dict(hidden=128, layers=4, intermediate=384, heads=4, kv_heads=2)),
    ("3B/1024", "Llama-3.2-3B", dict(hidden=192, layers=6, intermediate=512, heads=6, kv_heads=2)),
    ("8B/1024", "Llama-3.1-8B", dict(hidden=256, layers=8, intermediate=896, heads=8, kv_heads=2)),
)
RESULTS = Path(__file__).resolve().parent / "results" / "emulated_cards.txt"


@dataclass(frozen=True)
class Cell:
    card_gib: int
    model: str
    plan: str  # lowvram.plan.choose.search.describe_setup, or why there is none
    fits: bool
    predicted_bytes: int | None = None
    budget_bytes: int | None = None
    measured_bytes: int | None = None
    oom: bool = False
    seconds: float = 0.0
    min_card_bytes: int | None = None  # the smallest card the lowest plan fits (a plan that does not fit)

    @property
    def fill(self) -> float | None:
        """Measured peak / the plan's budget."""
        if self.measured_bytes is None or not self.budget_bytes:
            return None
        return self.measured_bytes / self.budget_bytes

    @property
    def ok(self) -> bool | None:
        """No OOM and at least TARGET of the budget used; None for a plan that does not fit."""
        if not self.fits:
            return None
        return not self.oom and self.fill is not None and self.fill >= TARGET


# --------------------------------------------------------------------------------------------
# The models, the data and the recipe


def save_model(out: Path, shape: dict, max_positions: int = 4 * SEQ_LEN) -> Path:
    """A random-init Llama of ``shape`` with a VOCAB-entry config and a local BPE tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    from lowvram.testing import build_tokenizer, tiny_llama_config

    if (out / "config.json").exists():
        return out
    tokenizer = build_tokenizer()
    config = tiny_llama_config(VOCAB, max_positions=max_positions, **shape)
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_data(path: Path, rows: int = 400, seq_len: int = SEQ_LEN) -> Path:
    """Text rows of exactly seq_len / 4 tokens with their eos: packing puts four samples in every
    window (what packing is for; the plan counts the block-diagonal mask it makes), ``rows`` / 4
    full windows."""
    import random

    from lowvram.testing import texts_of_exact_length

    rng = random.Random(0)
    words = ("memory gradient adapter quantized layer token budget card optimizer checkpoint "
             "activation logits batch sequence weight fits plan lowvram peak").split()
    with path.open("w") as f:
        for text in texts_of_exact_length(seq_len // 4 - 1, rows, rng, tuple(words)):
            f.write(json.dumps({"text": text}) + "\n")
    return path


def write_recipe(folder: Path, model_dir: Path, steps: int = STEPS, seq_len: int = SEQ_LEN,
                 lora_r: int = LORA_R) -> Path:
    """Every technique auto; model.dtype bfloat16 (the plan of a bf16 card)."""
    if not (folder / "data.jsonl").exists():
        write_data(folder / "data.jsonl", rows=max(400, 2 * 4 * steps * BATCH), seq_len=seq_len)
    path = folder / "recipe.yaml"
    path.write_text(_recipe_head(model_dir, steps, f"batch_size: {BATCH}", seq_len)
                    + f"lora: {{r: {lora_r}, alpha: {2 * lora_r}}}\n")
    return path


def _recipe_head(model_dir: Path, steps: int, batch: str, seq_len: int) -> str:
    """The model (bf16), the packed data and the training section every recipe here shares."""
    return f"""\
model: {{name_or_path: {model_dir}, dtype: bfloat16}}
data:
  datasets: [{{path: data.jsonl, format: text}}]
  packing: true
training: {{max_steps: {steps}, {batch}, seq_len: {seq_len},
           learning_rate: 1.0e-4, logging_steps: 1, save_steps: 1000, output_dir: out}}
"""


def fixed_recipe(folder: Path, model_dir: Path, setup, steps: int, seq_len: int, extra: str = "") -> Path:
    """A recipe for ``model_dir`` with every technique of the plan ``setup`` (a RunSetup) fixed,
    none auto: a real-size plan's choices replayed on a scaled model. Batch 1 x seq_len (one packed
    window per step, this bench's data); ``extra``: further YAML sections (``lora:``, ``galore:``)."""
    on = {True: '"on"', False: '"off"'}
    if not (folder / "data.jsonl").exists():
        write_data(folder / "data.jsonl", rows=4 * (steps + 2), seq_len=seq_len)
    path = folder / "recipe.yaml"
    path.write_text(_recipe_head(model_dir, steps, "batch_size: 1, micro_batch_size: 1", seq_len) + f"""\
techniques:
  mixed_precision: {setup.precision}
  gradient_checkpointing: {on[setup.gradient_checkpointing]}
  activation_offload: {on[setup.activation_offload]}
  lora: {on[setup.lora]}
  quantization: {'"off"' if setup.quantization == "none" else setup.quantization}
  optimizer: {setup.optimizer}
  loss: {setup.loss}
  attention: {setup.attention}
  tiled_mlp: {on[setup.tiled_mlp]}
  offload: "off"
{extra}""")
    return path


# --------------------------------------------------------------------------------------------
# One cell


def plan_cell(recipe_path: Path, card_bytes: int, scale: float, device: str = "cpu"):
    """The chooser's answer for the recipe on a card of ``card_bytes`` (every technique auto)."""
    from lowvram.plan.choose.choose import choose_plan
    from lowvram.plan.choose.request import MIN_MARGIN_BYTES, Budget
    from lowvram.planning.from_recipe import build_request, recipe_model
    from lowvram.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    budget = Budget(card_bytes, device, bf16=True, source=f"emulated card of {card_bytes} bytes",
                    min_margin_bytes=int(MIN_MARGIN_BYTES * scale))
    return recipe, choose_plan(build_request(recipe_model(recipe), recipe), budget)


def run_cell(recipe_path: Path, card_gib: int, model: str, scale: float = SCALE, train: bool = True) -> Cell:
    """Plan, then train STEPS steps under the emulated card (CPU: the live-bytes cap)."""
    from lowvram.plan.choose.search import describe_setup
    from lowvram.planning.budget import check_runnable
    from lowvram.planning.entry import replanner_for
    from lowvram.train.run.oom import EMULATE_ENV, TrainingOOM

    card = int(card_gib * 2**30 * scale)
    recipe, choice = plan_cell(recipe_path, card, scale)
    plan = choice.plan
    cell = Cell(card_gib, model, describe_setup(choice.chosen.setup), choice.fits,
                plan.predicted_peak_bytes, plan.budget_bytes,
                min_card_bytes=None if choice.fits else choice.min_vram_bytes)
    if not choice.fits or not train:
        return cell
    from lowvram.hardware import Hardware
    from lowvram.train.run.run import run_training
    from lowvram.train.types import TrainOptions

    check_runnable(plan, Hardware("cpu"))
    os.environ[EMULATE_ENV] = str(card)
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            result = run_training(recipe, plan, TrainOptions(overwrite=True), replanner=replanner_for(recipe))
    except TrainingOOM as e:
        return replace(cell, oom=True, measured_bytes=e.measured_peak_bytes, seconds=time.perf_counter() - t0)
    finally:
        os.environ.pop(EMULATE_ENV, None)
    return replace(cell, measured_bytes=int(result.metrics.peak_memory_bytes), seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# The grid and its table


def _mib(n: int | None, scale: float) -> str:
    """Bytes at the bench's scale, and (scaled back) the real-size equivalent."""
    if n is None:
        return "-"
    return f"{n / 2**20:.2f} MiB" if scale != 1 else f"{n / 2**30:.2f} GiB"


def table(cells: list[Cell], scale: float) -> str:
    head = f"{'card':>6}  {'model':8}  {'plan':62}  {'predicted':>10}  {'measured':>10}  {'% budget':>8}  ok"
    lines = [head, "-" * len(head)]
    for c in cells:
        fill = "-" if c.fill is None else f"{100 * c.fill:.1f}%"
        ok = {None: "no fit", True: "yes", False: "OOM" if c.oom else "no"}[c.ok]
        card = f"{c.card_gib} GB" if scale == 1 else f"{c.card_gib} MiB"
        plan = c.plan if c.fits else f"does not fit; needs a {_mib(c.min_card_bytes, scale)} card"
        lines.append(f"{card:>6}  {c.model:8}  {plan[:62]:62}  {_mib(c.predicted_bytes, scale):>10}  "
                     f"{_mib(c.measured_bytes, scale):>10}  {fill:>8}  {ok}")
    run = [c for c in cells if c.fits]
    good = [c for c in run if c.ok]
    lines.append("")
    lines.append(f"{len(run)} of {len(cells)} cells fit; {len(good)} of them ran {STEPS} steps without OOM "
                 f"at >= {100 * TARGET:.0f}% of the budget; OOM: {sum(c.oom for c in run)}")
    return "\n".join(lines)


def grid(work: Path, scale: float = SCALE, train: bool = True, cards=CARDS_GIB, models=MODELS,
         echo=print) -> list[Cell]:
    cells = []
    for name, _real, shape in models:
        folder = work / name.replace("/", "_")
        folder.mkdir(parents=True, exist_ok=True)
        recipe = write_recipe(folder, save_model(folder / "model", shape))
        for card in cards:
            cell = run_cell(recipe, card, name, scale, train)
            cells.append(cell)
            echo(table([cell], scale).splitlines()[2])
    return cells


def run_cuda(work: Path) -> list[Cell]:  # pragma: no cover - needs a GPU
    """--cuda: real-size cards and models on one GPU (not run here: no GPU so far).

    Each card caps this process's caching allocator at (card - the context the driver shows in
    use now) / the GPU's memory with torch.cuda.set_per_process_memory_fraction: tensors and
    allocator slack get what a card of that size leaves after its context. The plan is made for a
    CUDA card of that size (its cuda_context and allocator terms included); the measured peak is
    the whole card's use (lowvram.gpumemory: reserved peak + what is in use beyond it). Real
    work: seq_len 2048, LoRA rank 16, the models' real configs (catalog), random weights."""
    import torch

    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    context = total - free - torch.cuda.memory_reserved()
    cells = []
    for _name, real, _shape in MODELS:
        recipe = _cuda_recipe(work, real)
        for card in CARDS_GIB:
            torch.cuda.set_per_process_memory_fraction((card * 2**30 - context) / total)
            cell = _cuda_cell(recipe, card, real)
            cells.append(cell)
            print(table([cell], 1).splitlines()[2], flush=True)
    return cells


def _cuda_recipe(work: Path, real: str) -> Path:  # pragma: no cover - needs a GPU
    """A folder with the real model's catalog config, random bf16 weights and the local tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from lowvram.check.builders import hf_config
    from lowvram.plan.model.catalog import resolve_model
    from lowvram.testing import build_tokenizer

    folder = work / real
    model_dir = folder / "model"
    tokenizer = build_tokenizer()
    config = hf_config(resolve_model(real.lower()))
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    with torch.device("cuda"):  # random init on the GPU: seconds, not minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(model_dir)
    del model
    torch.cuda.empty_cache()
    tokenizer.save_pretrained(model_dir)
    return write_recipe(folder, model_dir, seq_len=2048, lora_r=16)


def _cuda_cell(recipe_path: Path, card: int, model: str) -> Cell:  # pragma: no cover - needs a GPU
    import torch

    from lowvram import gpumemory
    from lowvram.plan.choose.search import describe_setup
    from lowvram.train.run.oom import TrainingOOM
    from lowvram.train.run.run import run_training
    from lowvram.train.types import TrainOptions

    recipe, choice = plan_cell(recipe_path, card * 2**30, 1.0, "cuda")
    cell = Cell(card, model.split("-")[-1], describe_setup(choice.chosen.setup), choice.fits,
                choice.plan.predicted_peak_bytes, choice.plan.budget_bytes,
                min_card_bytes=None if choice.fits else choice.min_vram_bytes)
    if not choice.fits:
        return cell
    torch.cuda.empty_cache()
    try:
        result = run_training(recipe, choice.plan, TrainOptions(overwrite=True, track_memory=None))
    except TrainingOOM as e:
        return replace(cell, oom=True, measured_bytes=e.measured_peak_bytes)
    rows = {r["what"]: r for r in result.metrics.memory_comparison or []}
    return replace(cell, measured_bytes=rows.get(gpumemory.DEVICE, {}).get("measured_bytes"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan-only", action="store_true", help="plans only, no training")
    ap.add_argument("--cuda", action="store_true", help="real-size cards on a CUDA GPU")
    ap.add_argument("--out", type=Path, default=None, help=f"results file (default {RESULTS}; --cuda: $OUT)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on the shared 2-core machine two OpenMP threads "
                         "spin against other processes; a 128x384 bf16 matmul took 16 ms with 2, 0.09 ms with 1)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="emulated-cards-") as tmp:
        if args.cuda:
            cells, scale = run_cuda(Path(tmp)), 1.0
        else:
            cells, scale = grid(Path(tmp), train=not args.plan_only), SCALE
    text = table(cells, scale)
    header = (f"# bench/emulated_cards.py{' --cuda' if args.cuda else ''}{' --plan-only' if args.plan_only else ''}, "
              f"{time.strftime('%Y-%m-%d')}: {STEPS} steps of lowvram train per cell, batch {BATCH} x seq_len "
              f"{SEQ_LEN}, scale {'1' if scale == 1 else '1/1024'}, {args.threads} torch thread(s); "
              f"{time.perf_counter() - t0:.0f} s on this machine\n"
              "# predicted: the plan's peak; measured: exact live tensor bytes (CUDA: the whole card's use);"
              " % budget: measured / (card - safety margin)\n")
    print()
    print(header + text)
    out = args.out or (Path(os.environ.get("OUT", ".")) / "emulated_cards.txt" if args.cuda else RESULTS)
    if not args.plan_only:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(header + text + "\n")


if __name__ == "__main__":
    main()
