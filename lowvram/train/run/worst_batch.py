"""Worst batch first (``training.worst_batch_first``): before the run, one forward and backward on
the batch with the most tokens that the run can draw (the plan's micro-batch of the longest rows;
with images, the rows with the most images among them), so that a peak the plan missed shows at
step 0 and not at step 120 (an OOM there goes to the re-plan, recover.py, like any other). Its
measured peak is printed beside the plan's. It costs one forward and backward.

The run is not changed by it: no optimizer exists yet (the Trainer makes it in ``train()``), so no
weight, moment or learning-rate step moves; the gradients are dropped (set to None, as before
it); the random generators are restored (dropout draws from them); the data order is the
sampler's own generator, untouched. tests/train/test_worst_batch.py checks the losses with and
without it are identical.

Where it cannot run as the step runs it is off under ``auto`` and refused under ``on``: several
processes or offload (the model is sharded only when the Trainer prepares it), an optimizer that
steps inside the backward (the backward would update the weights), the fused loss (Liger patches
the model in ``train()``), preference objectives (TRL tokenizes the pairs itself).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.vocab import IN_BACKWARD_OPTIMIZERS

if TYPE_CHECKING:
    from transformers import Trainer

    from lowvram.plan.types import Plan
    from lowvram.recipe import Recipe


@dataclass(frozen=True)
class WorstBatch:
    rows: tuple[int, ...]  # training rows (indices of the train set as built)
    tokens: int  # the longest row: the batch is padded to it
    peak_bytes: int | None  # measured through the backward (None: nothing measures it here)
    seconds: float


def _why_not(recipe: Recipe, plan: Plan, processes: int) -> str | None:
    """Why the worst-batch step cannot run as the run's steps do, or None."""
    if recipe.training.objective != "sft":
        return f"training.objective {recipe.training.objective}: TRL tokenizes the pairs in its own loop"
    if processes > 1 or plan.offload != "none":
        return "several processes or offload: the model is sharded only when the Trainer's loop starts"
    if plan.optimizer in IN_BACKWARD_OPTIMIZERS:
        return f"optimizer {plan.optimizer} steps inside the backward: the check would update the weights"
    if plan.loss == "fused":
        return "loss fused: Liger patches the model only when the Trainer's loop starts"
    return None


def wanted(recipe: Recipe, plan: Plan, processes: int) -> bool:
    """training.worst_batch_first: auto is on for a GPU plan; on where it cannot run is refused."""
    asked = recipe.training.worst_batch_first
    if asked == "off" or (asked == "auto" and plan.device != "cuda"):
        return False
    why = _why_not(recipe, plan, processes)
    if why and asked == "on":
        raise LowvramError(f"training.worst_batch_first: on cannot run here ({why})",
                           "set training.worst_batch_first: off (or auto, which skips it where it cannot run)")
    return why is None


def worst_batch_first(recipe: Recipe, plan: Plan, trainer: Trainer, dataset, at_data: dict) -> WorstBatch | None:
    """The worst batch's step where training.worst_batch_first asks for it, reported; None where
    it does not run. An OOM in it propagates (TrainingOOM at step 0: recover.py re-plans)."""
    if not wanted(recipe, plan, trainer.accelerator.num_processes):
        return None
    found = run_worst_batch(trainer, dataset, plan)
    report(found, plan, at_data)
    return found


def worst_rows(dataset, micro_batch_size: int) -> tuple[int, ...]:
    """The ``micro_batch_size`` rows with the most tokens (then the most images): the largest
    batch any shuffle of the run can put together."""
    lengths = [len(ids) for ids in dataset["input_ids"]]
    images = ([len(x or ()) for x in dataset["images"]] if "images" in dataset.column_names
              else [0] * len(lengths))
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], images[i]), reverse=True)
    return tuple(order[:micro_batch_size])


def run_worst_batch(trainer: Trainer, dataset, plan: Plan) -> WorstBatch:
    """One forward and backward of ``trainer``'s loss on the worst batch, measured; the model's
    gradients and the random generators are left as they were. An OOM propagates."""

    from lowvram.train.data.collate import ROW_COLUMN

    rows = worst_rows(dataset, plan.micro_batch_size)
    batch = trainer.data_collator([dataset[i] for i in rows])
    batch.pop(ROW_COLUMN, None)
    device = trainer.args.device
    inputs = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
    model = trainer.model
    rng = _rng_state()
    tracker = _tracker(plan, model)
    t0 = time.perf_counter()
    try:
        model.train()  # as the Trainer's training_step sets it (dropout, checkpointing)
        with tracker if tracker is not None else _nothing(), trainer.accelerator.autocast():
            loss = trainer.compute_loss(model, inputs)
            loss.backward()
            del loss
        peak = _peak(plan, tracker)
    except Exception as e:
        from lowvram.train.run.oom import TrainingOOM, is_oom, requested_bytes

        if not is_oom(e):
            raise
        measured = _peak(plan, tracker)
        raise TrainingOOM(0, measured + requested_bytes(str(e)) if measured is not None else None, plan,
                          f"the worst batch ({len(rows)} rows of up to {inputs['input_ids'].shape[-1]} tokens): "
                          + (str(e).splitlines() or ["out of memory"])[0]) from None
    finally:
        model.zero_grad(set_to_none=True)
        _restore_rng(rng)
    return WorstBatch(rows, int(inputs["input_ids"].shape[-1]), peak, time.perf_counter() - t0)


def report(found: WorstBatch, plan: Plan, at_data: dict | None = None) -> None:
    """One line: the batch, its measured peak beside the plan's (at the data's longest row, which
    this batch reaches, where run.py predicted it there), and what it cost."""
    from lowvram.units import mem

    measured = f"peak {mem(found.peak_bytes)} measured" if found.peak_bytes is not None else "ran"
    planned = ""
    if at_data and at_data.get("predicted_peak_bytes_at_data") and at_data.get("data_longest_tokens") == found.tokens:
        planned = (f"; the plan predicts {mem(at_data['predicted_peak_bytes_at_data'])} for a whole step at "
                   f"{found.tokens} tokens ({mem(plan.predicted_peak_bytes)} at seq_len)")
    elif plan.predicted_peak_bytes:
        planned = f"; the plan predicts {mem(plan.predicted_peak_bytes)} for a whole step"
    sys.stdout.write(f"worst batch first: {len(found.rows)} rows of up to {found.tokens} tokens, forward and "
                     f"backward: {measured}{planned} (its optimizer step adds the optimizer's state); "
                     f"{found.seconds:.1f} s, one step (training.worst_batch_first)\n")
    sys.stdout.flush()


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _tracker(plan: Plan, model):
    """On CUDA: the allocator's peak, reset here; on the CPU: live tensor bytes, capped like the
    run's on an emulated card (train/run/oom.py LOWVRAM_EMULATE_VRAM)."""
    if plan.device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()
        return None
    if plan.device != "cpu":
        return None
    from lowvram.livebytes import LiveBytes
    from lowvram.train.run.oom import emulated_vram_bytes

    tracker = LiveBytes(cap_bytes=emulated_vram_bytes())
    tracker.register(model)
    return tracker


def _peak(plan: Plan, tracker) -> int | None:
    if tracker is not None:
        return int(tracker.peak_bytes)
    if plan.device == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    return None


def _rng_state() -> dict:
    import random

    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
