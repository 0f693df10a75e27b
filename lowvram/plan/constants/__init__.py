"""The planner's fitted constants, in one table: every number of the memory model that was set
from measurements (or chosen) rather than derived from the code it models, with what it means,
what it was fitted on, which runs were in sample and which were held out.

The terms (:mod:`lowvram.plan.setup`, :mod:`lowvram.plan.memory.states`, :mod:`lowvram.plan.memory.activations`,
:mod:`lowvram.plan.memory.backward`, :mod:`lowvram.plan.memory.memory`, :mod:`lowvram.plan.model.moe`,
:mod:`lowvram.plan.memory.sharding`, :mod:`lowvram.plan.choose.request`, :mod:`lowvram.plan.memory.dora`,
:mod:`lowvram.plan.memory.preference`) read their values from here; exact
math (bytes per dtype, int64 indices, a tensor's shape) stays where it is derived. The docs
table, ``docs/constants.md``, is generated from :data:`CONSTANTS` (:func:`markdown_table`;
``python -m lowvram.docs`` or ``make docs`` writes it, and tests/plan/test_constants.py fails
when it drifts). A new fitted constant is one more entry in its part, with its measurement.

Sources named below: ``bench/plan_accuracy.py`` (real steps of small models on a CPU under the
live-bytes tracker, lowvram.livebytes), the simulated step (lowvram.check.simulate: the real
step on fake tensors), ``bench/plan_fuzz.py`` (held-out fuzz seeds through ``lowvram train``,
results in bench/results/), ``bench/published_accuracy.py`` over ``bench/gpu_truth/`` (published
GPU measurements) and ``bench/multi_process_accuracy.py`` (FSDP2 over gloo).

The table is one, its entries are kept by the part of the step they feed: card.py (what surrounds
the tensors: CUDA context, allocator slack, host RAM, the budget's margin, a card's size),
states.py (the optimizer step's temporaries, FSDP's gathered layers and gradients), layers.py (one
decoder layer's backward and saved tensors, gpt-oss's sinks, DoRA) and logits.py (the logits, the
loss, the preference objectives' loss path); entry.py holds FittedConstant, step_times.py the
optimizers' step-time factors (not memory). Each entry is read here by its name
(``fitted.CUDA_CONTEXT_BYTES``).
"""

from __future__ import annotations

from lowvram.plan.constants import card, layers, logits, states
from lowvram.plan.constants.card import CARD_READINGS, CardReading
from lowvram.plan.constants.entry import FittedConstant
from lowvram.plan.constants.step_times import (
    OPTIMIZER_STEP_TIMES,
    StepTimeFactor,
    apollo_table7_ratio,
)

# The table, part by part (the order of docs/constants.md): every FittedConstant of each part,
# each also read here by its name (``fitted.CUDA_CONTEXT_BYTES``, the terms look it up when they run).
CONSTANTS: tuple[FittedConstant, ...] = tuple(
    v for part in (card, states, layers, logits) for v in vars(part).values() if isinstance(v, FittedConstant))
globals().update((c.name, c) for c in CONSTANTS)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """docs/constants.md: the intro and one row per constant of :data:`CONSTANTS`."""
    head = [
        "# Fitted constants",
        "",
        "<!-- generated from lowvram/plan/constants/ by `python -m lowvram.docs` (`make docs`);",
        "     tests/plan/test_constants.py fails when this file drifts from the code -->",
        "",
        "Every constant of the planner that was set from measurements (or chosen) rather than derived",
        "from the code it models: the memory model, `lowvram/plan/memory/memory.py` and the modules of its",
        "terms, which read each value from `lowvram/plan/constants/`. Exact math (bytes per dtype,",
        "int64 indices, a tensor's shape) is not listed: it stays where it is derived, with its source.",
        "",
        "| constant | value | what it means | used in | fitted on | in sample | held out |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [f"| `{c.name}` | {_cell(c.shown)} | {_cell(c.meaning)} | `{c.used_in}` | {_cell(c.fitted_on)} "
            f"| {_cell(c.in_sample)} | {_cell(c.held_out)} |" for c in CONSTANTS]
    cards = [
        "", "## Cards as sold and as CUDA reports them", "",
        "What `CARD_REPORTED_FRACTION` rests on: published Linux readings of a card's total memory",
        "(PyTorch's out-of-memory message, deviceQuery). `--vram 12GB` is a card sold as 12 GB,",
        f"12 GiB of memory, planned as {float(card.CARD_REPORTED_FRACTION.value):.1%} of it; `12000MB` or "
        "`11.5GiB` are read exactly.", "",
        "| card | sold as | CUDA reports | share | source |", "|---|---|---|---|---|",
    ] + [f"| {r.card} | {r.sold_gib} GiB | {r.reported_bytes / 2**30:.2f} GiB | {r.fraction:.1%} "
         f"| {_cell(r.source)} |" for r in CARD_READINGS]
    steps = [
        "", "## Step-time factors of the optimizers", "",
        "Not memory: each optimizer's step time over plain AdamW's, same model, same batch (the search",
        "ranks plans of one kind by it, `lowvram/plan/choose/techniques.py`; it does not predict wall time).",
        "Each rests on a published measurement of both, or is an estimate that says so;",
        "`bench/optimizer_step_time.py` cross-checks them on the CPU (not a GPU number).", "",
        "| optimizer | factor | measured on | how the ratio to AdamW comes out | source |", "|---|---|---|---|---|",
    ] + [f"| {f.optimizer} | {f.value:g} | {_cell(f.measured_on)} | {_cell(f.derived)} | {_cell(f.source)} |"
         for f in OPTIMIZER_STEP_TIMES]
    return "\n".join(head + rows + cards + steps) + "\n"


__all__ = ["CARD_READINGS", "CONSTANTS", "OPTIMIZER_STEP_TIMES", "CardReading", "FittedConstant", "StepTimeFactor",
           "apollo_table7_ratio", "markdown_table"] + [c.name for c in CONSTANTS]
