"""A diverged run never passes for a converged one: every optimizer step's loss and gradient norm
are read as they are (transformers' ``logging_nan_inf_filter`` is off: it logs a non-finite step
as the window's average, 0.0 after a log), and the first non-finite one stops the run with
error/hint (``training.on_nonfinite: stop``) or has its update skipped, up to
``training.nonfinite_skips`` times (``skip``). A run whose gradient norm is exactly zero for its
first steps trains nothing and stops; on fp16 with a loss scaler, a run of skipped scaler steps
stops too (the scale fell that many times in a row: fp16 overflows at every step).

Checkpoints are rotated here, not by the Trainer: a checkpoint counts against
``training.save_total_limit`` only once the step after it is known finite, so the last finite
checkpoint is never rotated away by the ones a diverging run writes (and a stopped run wrote none
after it). No final model is written after a stop (run.py never reaches its save).

transformers is imported at module level because the callback subclasses TrainerCallback; only
run.py imports this module, inside run_training.
"""

from __future__ import annotations

import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import TrainerCallback

from lowvram.errors import LowvramError
from lowvram.runfiles import checkpoint_number
from lowvram.train.data.collate import ROW_COLUMN

if TYPE_CHECKING:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

ZERO_GRAD_STEPS = 3  # a gradient norm of exactly 0.0 at each of the first this many steps: nothing trains
# Skipped loss-scaler steps in a row before the run stops: GradScaler starts at 2**16 and halves
# at each overflow (torch.amp.GradScaler), so a healthy fp16 run skips a few steps at its start
# and then rarely; 2**16 / 2**10 = 64 is a scale at which a loss with ordinary gradients no
# longer overflows, so ten in a row means every step overflows whatever the scale.
SCALER_SKIPS = 10


class TrainingDiverged(LowvramError):
    """A non-finite loss or gradient norm (or a run that trains nothing): the run stopped there."""

    def __init__(self, message: str, hint: str, step: int) -> None:
        super().__init__(message, hint)
        self.step = step


@dataclass
class StepRecord:
    """What the Trainer's training_step saw in the optimizer step under way: each micro-batch's
    loss (a detached tensor, read once per step) and the training rows it held; the Trainer's
    gradient norm of the step."""

    losses: list = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    grad_norm: float | None = None

    def reset(self) -> None:
        self.losses.clear()
        self.rows.clear()
        self.grad_norm = None

    def loss(self) -> float | None:
        """The step's loss as the Trainer sums it (each micro-batch's loss is already divided by
        the accumulation steps), or None before any micro-batch."""
        if not self.losses:
            return None
        import torch

        return float(torch.stack([x.float().reshape(()) for x in self.losses]).sum())


RECORD_ATTRIBUTE = "lowvram_steps"  # the StepRecord that build_trainer set on its Trainer


def record_steps(trainer: Trainer) -> StepRecord:
    """Wrap ``trainer.training_step`` (its documented override point) so that each micro-batch's
    loss and rows are recorded, and the row index (data/collate.py ROW_COLUMN) is taken out of the
    batch before the model sees it; and the Trainer's gradient norm of each step (its
    ``_get_grad_norm``, the number it logs: the pre-clip norm, over every rank)."""
    record = StepRecord()
    inner = trainer.training_step

    def training_step(model, inputs, *args, **kwargs):
        rows = inputs.pop(ROW_COLUMN, None) if isinstance(inputs, dict) else None
        loss = inner(model, inputs, *args, **kwargs)
        record.losses.append(loss.detach())
        if rows is not None:
            record.rows.extend(int(r) for r in rows.reshape(-1).tolist())
        return loss

    trainer.training_step = training_step
    grad_norm_of = getattr(trainer, "_get_grad_norm", None)
    if grad_norm_of is not None:  # transformers 5.23+: tests/train/test_guard.py checks it is there
        def get_grad_norm(*args, **kwargs):
            norm = grad_norm_of(*args, **kwargs)
            record.grad_norm = None if norm is None else float(norm)
            return norm

        trainer._get_grad_norm = get_grad_norm  # noqa: SLF001 - the Trainer's own number, as it logs it
    setattr(trainer, RECORD_ATTRIBUTE, record)
    return record


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


def rows_text(rows: list[int], limit: int = 8) -> str:
    """'training rows 3, 17, 22 and 40' (indices of the train set as built: the data files in the
    recipe's order, less skipped and held-out rows; windows when packed)."""
    if not rows:
        return ""
    shown = sorted(set(rows))
    more = f" and {len(shown) - limit} more" if len(shown) > limit else ""
    listed = ", ".join(str(r) for r in shown[:limit])
    return f"training row{'s' if len(shown) > 1 else ''} {listed}{more}"


class NonFiniteGuard(TrainerCallback):
    """Stops (or skips) at a non-finite step, stops a run that trains nothing, rotates checkpoints.

    ``policy``: training.on_nonfinite; ``skips``: training.nonfinite_skips; ``save_limit``:
    training.save_total_limit; ``in_backward``: the optimizer steps inside the backward
    (vocab.IN_BACKWARD_OPTIMIZERS): its gradients are gone and its update made before this sees
    the step, so only the loss is checked and a non-finite step stops (it cannot be skipped).
    ``zero_grads``: whether a zero gradient norm at the first steps stops the run (not under an RL
    objective, where a group of equal rewards has no advantage and so no gradient).
    :meth:`attach` gives it the Trainer once built (the callback is passed to it first, so that
    its corrected loss reaches the progress line after it)."""

    def __init__(self, policy: str = "stop", skips: int = 3, save_limit: int | None = None,
                 in_backward: bool = False, learning_rate: float | None = None, notify=None,
                 zero_grads: bool = True) -> None:
        self.trainer: Trainer | None = None
        self.record = StepRecord()
        self.policy = policy
        self.skips = skips
        self.save_limit = save_limit
        self.in_backward = in_backward
        self.zero_grads = zero_grads  # off for RL objectives: equal rewards in a group give zero gradients
        self.learning_rate = learning_rate
        self.notify = notify or (lambda text: (sys.stdout.write(text + "\n"), sys.stdout.flush()))
        self.skipped: list[int] = []  # the steps whose update was skipped (metrics.json: nonfinite_steps)
        self.last_finite: tuple[int, float] | None = None  # (step, loss)
        self.finite_through = 0  # the last step known finite: checkpoints before it are confirmed
        self._zero_steps = 0
        self._zero_open = True  # still within the first steps, all with a zero gradient norm
        self._scaler_skips = 0
        self._window: list[float] = []  # finite step losses since the last log
        self._window_skipped = False
        self._loss_before = None
        self._saved = False  # a checkpoint was written since the last rotation

    def attach(self, trainer: Trainer) -> NonFiniteGuard:
        """Read ``trainer``'s steps; the guard becomes its first callback, so its corrections reach
        the report_to trackers and the progress line that come after it."""
        self.trainer = trainer
        self.record = getattr(trainer, RECORD_ATTRIBUTE, None) or record_steps(trainer)
        handler = trainer.callback_handler
        if self in handler.callbacks:
            handler.callbacks.remove(self)
        handler.callbacks.insert(0, self)
        return self

    # -- the checks --------------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.finite_through = state.global_step  # a resumed run: the steps before it were taken

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.record.reset()
        tr_loss = getattr(self.trainer, "_tr_loss", None)  # the Trainer's running sum since its last log
        self._loss_before = tr_loss.detach().clone() if tr_loss is not None else None

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        step = state.global_step + 1  # the step under way (global_step counts finished ones)
        loss, norm = self.record.loss(), self.record.grad_norm
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        # Under a loss scaler an infinite gradient is the scaler's to skip (on_optimizer_step counts
        # those); a non-finite loss is the forward's overflow, which no scale fixes.
        bad = not _finite(loss) or (scaler is None and not _finite(norm))
        if self._any_rank(bad):
            self._nonfinite(step, loss, norm)
            return
        if loss is not None:
            self.last_finite = (step, loss)
            self._window.append(loss)
        if self.zero_grads and not self.in_backward:
            self._check_zero_gradients(step, norm)
        self.finite_through = step
        if self._saved:  # the checkpoint before this step is confirmed now
            self._saved = False
            self._rotate(args, state)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._saved = True

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if getattr(self.trainer.accelerator, "scaler", None) is None:
            return
        if self.trainer.accelerator.optimizer_step_was_skipped:
            self._scaler_skips += 1
            if self._scaler_skips >= SCALER_SKIPS:
                self._stop(state.global_step + 1, f"the fp16 loss scaler skipped {self._scaler_skips} steps in a row "
                           "(each gradient overflowed fp16, whatever the scale)")
        else:
            self._scaler_skips = 0

    def _any_rank(self, bad: bool) -> bool:
        """Whether any process saw a non-finite step (every rank must stop at the same step)."""
        acc = self.trainer.accelerator
        if acc.num_processes <= 1:
            return bad
        import torch

        flag = torch.tensor([1.0 if bad else 0.0], device=acc.device)
        return bool(acc.reduce(flag, reduction="sum").item() > 0)

    def _nonfinite(self, step: int, loss: float | None, norm: float | None) -> None:
        what = (f"the loss is {loss}" if not _finite(loss) else f"the gradient norm is {norm}") + f" at step {step}"
        if self.policy == "skip" and self.in_backward:
            what += " (training.on_nonfinite skip: an optimizer that steps in the backward made its update already)"
        elif self.policy == "skip" and getattr(self.trainer, "is_deepspeed_enabled", False):
            what += " (training.on_nonfinite skip: DeepSpeed keeps the gradients itself, so none is skipped)"
        elif self.policy == "skip" and len(self.skipped) < self.skips:
            self._skip(step, what)
            return
        elif self.policy == "skip":
            what += f", after {len(self.skipped)} skipped non-finite step(s) (training.nonfinite_skips {self.skips})"
        self._stop(step, what)

    def _skip(self, step: int, what: str) -> None:
        """No update from this step: every gradient set to None, which torch's and bitsandbytes'
        optimizers skip (no moment, no weight decay); the Trainer's running loss is put back to
        what it was before the step, so its later logs stay finite."""
        for p in self.trainer.model.parameters():
            p.grad = None
        if self._loss_before is not None:
            self.trainer._tr_loss.copy_(self._loss_before)  # noqa: SLF001 - the Trainer's running loss
        self.skipped.append(step)
        self._window_skipped = True
        rows = rows_text(self.record.rows)
        self.notify(f"warning: {what}; its update skipped ({len(self.skipped)} of {self.skips} allowed"
                    + (f"; the batch held {rows}" if rows else "") + ")")

    def _check_zero_gradients(self, step: int, norm: float | None) -> None:
        if not self._zero_open or norm is None:
            return
        if norm != 0.0:  # only the first steps count: a norm of 0 later is a converged batch
            self._zero_open = False
            return
        self._zero_steps += 1
        if self._zero_steps >= ZERO_GRAD_STEPS:
            raise TrainingDiverged(
                f"the gradient norm is exactly 0 at each of the first {ZERO_GRAD_STEPS} steps (to step {step}): "
                "the run trains nothing; stopped, no final model written",
                "every label of these batches is masked or the trainable weights are cut off from the loss: "
                "check data.train_on_inputs and the format's fields, raise training.seq_len (prompts longer "
                "than it leave no response), or check lora.target_modules",
                step,
            )

    def _stop(self, step: int, what: str) -> None:
        from lowvram.train.run.checkpoints import complete_checkpoints

        last = (f"the last finite loss was {self.last_finite[1]:.4f} at step {self.last_finite[0]}"
                if self.last_finite else "no step before it was finite")
        kept = complete_checkpoints(Path(self.trainer.args.output_dir))
        kept_text = (f"checkpoints kept: {', '.join(p.name for p in kept)} (the last is the newest finite one)"
                     if kept else "no checkpoint was written before it")
        rows = rows_text(self.record.rows)
        lr = f" {self.learning_rate:g}" if self.learning_rate is not None else ""
        raise TrainingDiverged(
            f"{what}; {last}; stopped, no final model written; {kept_text}"
            + (f"; the batch held {rows}" if rows else ""),
            f"usually the learning rate is too high (training.learning_rate{lr}: try 10x lower), or fp16 runs a "
            "model trained in bf16 (techniques.mixed_precision: bf16 or fp32 where the card allows), or the "
            "batch's data; train again with --overwrite, or set training.on_nonfinite: skip to skip such steps",
            step,
        )

    # -- what the run shows ------------------------------------------------------------------

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict | None = None, **kwargs):
        """A window with a skipped step: its loss is the mean of its finite steps (the Trainer
        divides by every step of the window), or none at all where every step was skipped (never a
        0.0), in the progress line, the trackers and the history alike (the guard is the first
        callback: attach)."""
        if logs is None or "loss" not in logs:
            return
        entry = state.log_history[-1] if state.log_history and "loss" in state.log_history[-1] else {}
        if self._window_skipped and not self._window:
            logs.pop("loss")
            entry.pop("loss", None)
        elif self._window_skipped and self.trainer.accelerator.num_processes == 1:
            logs["loss"] = sum(self._window) / len(self._window)
            if entry:
                entry["loss"] = logs["loss"]
        self._window.clear()
        self._window_skipped = False

    # -- checkpoints -------------------------------------------------------------------------

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.finite_through = state.global_step + 1  # the run ended finite: its last checkpoint counts
        self._rotate(args, state)

    def _rotate(self, args: TrainingArguments, state: TrainerState) -> None:
        """Keep the newest ``save_limit`` confirmed checkpoints (a step after each was finite) and
        every one not yet confirmed; remove the older ones (the Trainer's own rotation is off)."""
        if not self.save_limit or not args.should_save:
            return
        from lowvram.train.run.checkpoints import complete_checkpoints

        done = complete_checkpoints(Path(args.output_dir))
        confirmed = [p for p in done if (checkpoint_number(p) or 0) < self.finite_through]
        for p in confirmed[:-self.save_limit]:
            shutil.rmtree(p, ignore_errors=True)


def require_trained_tokens(stats) -> None:
    """Refuse, before training, data whose every label is masked (``stats``: data.build.DataStats):
    the loss would be 0 and the gradients 0 at every step, a run that trains nothing."""
    if stats.trained_tokens is None or stats.trained_tokens > 0:
        return
    from lowvram.errors import DataError

    raise DataError(
        f"no token of the {stats.train_rows} training rows is trained: every label is masked (or only a "
        "row's first token is, which nothing predicts), so the loss would be 0 at every step",
        "raise training.seq_len (a prompt as long as it leaves no response), check the format's fields, "
        "or set data.train_on_inputs: true",
    )


def require_finite_weights(model) -> None:
    """Before the final save: every trainable weight is finite (a run never writes a NaN model)."""
    import torch

    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP2 shard: this rank's part
        if local.numel() and not bool(torch.isfinite(local).all()):
            raise TrainingDiverged(
                f"the trained weight {name} holds NaN or infinite values at the end of the run; "
                "no final model written",
                "lower training.learning_rate and train again with --overwrite",
                -1,
            )


def guard_for(recipe, plan) -> NonFiniteGuard:
    """The run's guard, as its recipe and plan say (attach it to the Trainer once built)."""
    from lowvram.plan.memory.preference import RL_OBJECTIVES
    from lowvram.vocab import IN_BACKWARD_OPTIMIZERS

    t = recipe.training
    return NonFiniteGuard(t.on_nonfinite, t.nonfinite_skips, t.save_total_limit,
                          in_backward=plan.optimizer in IN_BACKWARD_OPTIMIZERS, learning_rate=t.learning_rate,
                          zero_grads=t.objective not in RL_OBJECTIVES)
