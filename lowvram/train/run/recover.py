"""Never lose a run: re-plan after out of memory, and turn a full disk into an error that says
what is intact.

- **Out of memory**: :func:`train_with_recovery` catches the OOM that :func:`run_training` raises
  as :class:`TrainingOOM` (oom.py), frees memory, asks the chooser for the next cheaper plan that
  keeps the effective batch (:func:`lowvram.plan.choose.choose.next_cheaper`) and continues from the last
  complete checkpoint (checkpoints.py), or starts over when the checkpoint cannot carry over
  (e.g. another optimizer). With several processes the workers write their OOM to
  ``oom-rank{R}.json`` and :func:`launch_with_recovery` re-plans and launches them again the same way.
- **Disk full**: ``ENOSPC`` while writing becomes an ``error:``/``hint:``; the previous checkpoint
  is untouched (the Trainer rotates old checkpoints only after a new one is written).

Interrupts (SIGINT/SIGTERM) are signals.py's. No torch or transformers at import time (the CLI
imports this module for its flags).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.past_runs import resume_command
from lowvram.plan.choose.replan import Replanner
from lowvram.plan.types import Plan
from lowvram.runfiles import CHECKPOINT_GLOB, OOM_REPORT, is_read_only
from lowvram.train.diskfull import is_disk_full, written_file
from lowvram.train.run.checkpoints import (
    complete_checkpoints,
    mid_generation_cycle,
    partial_checkpoints,
)
from lowvram.train.run.oom import EXTRA_METRICS_ENV, REPORT_ENV, TrainingOOM, collect_oom_reports
from lowvram.train.run.signals import TrainingInterrupted
from lowvram.train.types import RetryLog, RunResult, TrainOptions

if TYPE_CHECKING:
    from lowvram.recipe import Recipe
    from lowvram.train.run.launch import Launch

DEFAULT_MAX_RETRIES = TrainOptions.max_retries
Notify = Callable[[str], None]  # one line for the user (stderr by default)


# --------------------------------------------------------------------------------------------
# The retry loop


@dataclass(frozen=True)
class Retry:
    step: int
    measured_peak_bytes: int | None
    changed: str  # "gradient_checkpointing on, micro-batch 2 x 2"
    resumed_from: str | None

    def to_dict(self) -> dict:
        return {"step": self.step, "measured_peak_bytes": self.measured_peak_bytes,
                "changed": self.changed, "resumed_from": self.resumed_from}


def describe_change(old: Plan, new: Plan) -> str:
    """What a retry changed, in the canonical technique names."""
    parts = []
    for name, value in new.techniques().items():
        if name in ("gradient_accumulation",) or old.techniques()[name] == value:
            continue
        shown = {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value
        parts.append(f"{name} {shown}")
    if (old.micro_batch_size, old.grad_accum) != (new.micro_batch_size, new.grad_accum):
        parts.append(f"micro-batch {new.micro_batch_size} x {new.grad_accum}")
    parts += _generation_change(old, new)
    return ", ".join(parts) or "the same settings"


def _generation_change(old: Plan, new: Plan) -> list[str]:
    """grpo/rloo: the generation batch (completions generated at once, all processes) and the
    engine, where the re-plan changed them (num_generations it never changes: the algorithm)."""
    parts = []
    if old.generation and old.generation != new.generation:
        parts.append(f"generation {new.generation}")
    if old.generation_batch_size != new.generation_batch_size and new.generation_batch_size:
        rounds = max(1, new.grad_accum // max(1, new.steps_per_generation))
        parts.append(f"generation batch {new.generation_batch_size} ({rounds} round{'s' * (rounds > 1)} per step)")
    return parts


def _carries_over(old: Plan, new: Plan) -> bool:
    """A checkpoint's optimizer state and weights load into the new plan's Trainer (the same
    optimizer, adapters and engine: DDP, FSDP and DeepSpeed write different checkpoints)."""
    return (old.optimizer, old.lora, old.offload) == (new.optimizer, new.lora, new.offload)


def _free_memory() -> None:
    """Collect the failed attempt, then return its blocks to the card. The collector is needed:
    under mixed precision accelerate's prepare_model binds the autocast forward to the model
    (accelerate/accelerator.py, ``model.forward = MethodType(..., model)``), a reference cycle
    that reference counting never frees; empty_cache only returns blocks already free."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


def _without_frames(err: TrainingOOM) -> TrainingOOM:
    """``err`` without what keeps the failed attempt alive. Its traceback holds run_training's
    frame (the model, the optimizer, the Trainer in its locals) and, through ``__context__`` (set
    even by ``raise ... from None``, PEP 415), the original OOM whose traceback reaches down into
    the model's forward. The retry needs only the message, the step, the measured peak and the
    plan."""
    err.__traceback__ = None
    err.__context__ = err.__cause__ = None
    return err


def _final_failure(err: TrainingOOM, retries: list[Retry], why: str) -> LowvramError:
    from lowvram.units import mem as gib  # MiB below 1 GiB

    plan = err.plan
    parts = {k: v for k, v in (plan.breakdown or {}).items() if v}
    if parts:
        top = max(parts, key=parts.get)
        where = f"; the largest part of the predicted peak is {top} ({gib(parts[top])} of {gib(plan.predicted_peak_bytes)})"
    else:
        where = ""
    tried = f" after {len(retries)} retr{'y' if len(retries) == 1 else 'ies'}" if retries else ""
    return LowvramError(
        f"{err.message}{tried}{where}",
        f"{why}; lower training.seq_len or micro_batch_size, choose a smaller model, "
        "or use a card with more memory (`lowvram plan RECIPE --vram SIZE` shows what fits)",
    )


def _disk_full(exc: BaseException, out: Path, hint_cmd: str) -> LowvramError:
    name = written_file(exc, out)  # before the partial folder goes
    removed = []
    for p in partial_checkpoints(out):  # cannot be resumed from; frees the space it took
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    last = complete_checkpoints(out)
    kept = f"the last complete checkpoint {last[-1].name} is intact" if last else "no complete checkpoint was written"
    gone = f" (removed the partial {', '.join(removed)})" if removed else ""
    name = name or (out / removed[0] if removed else out)
    then = f", then {hint_cmd}" if last and hint_cmd else ""
    return LowvramError(f"disk full while writing {name}{gone}",
                        f"free space on that disk (df -h {shlex.quote(str(out))}); {kept}{then}")


def _read_only(exc: BaseException, out: Path, hint_cmd: str) -> LowvramError:
    """The run's storage turned read-only while it wrote (a filesystem remounted read-only after
    an I/O error, ext4's errors=remount-ro): nothing more can be written or removed there."""
    name = written_file(exc, out) or out
    last = complete_checkpoints(out)
    kept = f"the last complete checkpoint {last[-1].name} is intact" if last else "no complete checkpoint was written"
    then = f", then {hint_cmd}" if last and hint_cmd else ""
    return LowvramError(f"{out} became read-only while writing {name}",
                        f"check the disk (dmesg) and make it writable again (mount -o remount,rw); {kept}{then}")


def _stderr_line(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def train_with_recovery(recipe: Recipe, plan: Plan, options: TrainOptions, replanner: Replanner | None = None,
                        notify: Notify | None = None) -> RunResult:
    """run_training, retried with ``replanner``'s next cheaper plan after an out-of-memory error
    (built above train/ by lowvram.planning.entry.replanner_for; None: no retry can be planned);
    the output folder is locked for the whole time (lock.py)."""
    from lowvram.train.build.trainer import output_dir
    from lowvram.train.run.lock import run_lock

    notify = notify or _stderr_line
    out = output_dir(recipe)
    with run_lock(out, options.lock_label, notify):
        return _train_loop(recipe, plan, out, options, replanner, notify)


def _train_loop(recipe: Recipe, plan: Plan, out: Path, options: TrainOptions, replanner: Replanner | None,
                notify: Notify) -> RunResult:
    from lowvram.train.run.run import run_training

    resume_cmd = options.resume_command
    retries: list[Retry] = []
    first = True
    while True:
        try:
            return run_training(recipe, plan, options, prepared=not first, retries=_retry_log(retries, plan),
                                replanner=replanner)
        except TrainingOOM as e:
            err = _without_frames(e)
        except TrainingInterrupted as e:
            if resume_cmd:
                e.hint = f"resume with: {resume_cmd}"
            raise
        except Exception as e:
            if is_disk_full(e):
                raise _disk_full(e, out, resume_cmd) from None
            if is_read_only(e):
                raise _read_only(e, out, resume_cmd) from None
            if isinstance(e, LowvramError) and getattr(e, "step", None) is not None:
                _record_stop(out, e)  # stopped mid-run (a diverged step, the user's reward code), not a refusal
            raise
        first = False
        _free_memory()  # err holds no frame now: the failed attempt's model, optimizer and Trainer go

        def through_accelerate(new: Plan, failed: Plan = plan) -> str | None:
            paged = paged_state_kept(failed)
            if paged:
                return paged + f": {resume_cmd or 'lowvram train RECIPE --resume'}"
            if new.offload == "none":
                return None
            return (f"the next cheaper plan offloads (offload {new.offload}), which runs through "
                    f"accelerate: {resume_cmd or 'lowvram train RECIPE'} --set techniques.offload={new.offload}")

        new, ckpts = _next_attempt(replanner, err, plan, retries, out, options, refuse=through_accelerate,
                                   num_iterations=recipe.grpo.num_iterations)
        _record_retry(err, plan, new, ckpts, retries, options.max_retries, notify)
        del err
        plan, options = new, dataclasses.replace(options, resume=True, overwrite=False)


def paged_state_kept(plan: Plan) -> str | None:
    """Why an in-process retry after ``plan`` failed cannot start (None: it can). A paged
    bitsandbytes optimizer on CUDA leaves its whole state in CUDA unified memory that bitsandbytes
    never frees (hardware.paged_state_bytes; no free function in its library, the buffers stay in
    the process-wide GlobalPageManager): a retry in this process would train beside the failed
    attempt's state. A new process starts without it."""
    from lowvram.hardware import paged_state_bytes

    if plan.device != "cuda" or not plan.optimizer.startswith("paged_"):
        return None
    held = paged_state_bytes()
    if not held:
        return None
    from lowvram.units import mem

    return (f"the failed attempt's {plan.optimizer} state ({mem(held)} of CUDA unified memory) cannot be freed "
            "inside this process (bitsandbytes never frees paged buffers): resume in a new process")


def _retry_log(retries: list[Retry], plan: Plan) -> RetryLog:
    """What metrics.json says about the retries so far (and, after one, the plan it ended with)."""
    final = {**plan.techniques(), "micro_batch_size": plan.micro_batch_size} if retries else None
    return RetryLog(tuple(r.to_dict() for r in retries), final)


def _next_attempt(replanner: Replanner | None, err: TrainingOOM, plan: Plan, retries: list[Retry], out: Path,
                  options: TrainOptions, refuse: Callable[[Plan], str | None] | None = None,
                  num_iterations: int = 1) -> tuple[Plan, list[Path]]:
    """(next cheaper plan, checkpoints to resume from) after ``err``, or the final error when
    recovery is off, spent or impossible (``refuse(new)``: why this caller cannot run the plan).
    Checkpoints that cannot carry over to the new plan are removed: the retry starts over; so are
    grpo/rloo checkpoints inside a generation round of the new plan (``num_iterations``: the
    recipe's grpo.num_iterations), back to the last that ends one."""
    if not options.recover:
        raise _final_failure(err, [], "automatic recovery is off (--no-recover)")
    if len(retries) >= options.max_retries:
        raise _final_failure(err, retries, f"--max-retries {options.max_retries} reached")
    new = replanner.next_cheaper(err.plan, err.measured_peak_bytes) if replanner is not None else None
    if new is None:
        raise _final_failure(err, retries, "no cheaper plan keeps the effective batch and the recipe's fixed settings")
    why = refuse(new) if refuse else None
    if why:
        raise _final_failure(err, retries, why)
    ckpts = complete_checkpoints(out)
    if ckpts and not _carries_over(plan, new):
        for p in out.glob(CHECKPOINT_GLOB):  # written for another optimizer/weights/engine: start over
            shutil.rmtree(p, ignore_errors=True)
        ckpts = []
    while ckpts and new.generation and mid_generation_cycle(ckpts[-1], new.grad_accum, new.steps_per_generation,
                                                            num_iterations):
        shutil.rmtree(ckpts.pop(), ignore_errors=True)  # inside a generation round: not resumable exactly
    return new, ckpts


def _record_retry(err: TrainingOOM, plan: Plan, new: Plan, ckpts: list[Path], retries: list[Retry],
                  max_retries: int, notify: Notify) -> None:
    retry = Retry(err.step, err.measured_peak_bytes, describe_change(plan, new),
                  str(ckpts[-1]) if ckpts else None)
    retries.append(retry)
    notify(_retry_line(err, retry, len(retries), max_retries))


def _retry_line(err: TrainingOOM, retry: Retry, n: int, max_retries: int) -> str:
    from lowvram.units import mem as gib  # MiB below 1 GiB

    measured = f" (measured {gib(err.measured_peak_bytes)})" if err.measured_peak_bytes else ""
    start = f"resuming from {Path(retry.resumed_from).name}" if retry.resumed_from else "starting over"
    return f"OOM at step {err.step}{measured}; retrying with {retry.changed}; {start} (retry {n} of {max_retries})"


__all__ = ["describe_change", "is_disk_full", "launch_with_recovery", "resume_command", "train_with_recovery"]


# --------------------------------------------------------------------------------------------
# Several processes (`lowvram train --gpus N`): the launcher re-plans, the workers report


def launch_with_recovery(recipe: Recipe, plan: Plan, options: TrainOptions, launched: Launch,
                         notify: Notify | None = None, replanner: Replanner | None = None) -> int:
    """run_launch, re-launched with the next cheaper plan when the workers run out of memory.

    The same loop as train_with_recovery, one level up: the workers report their OOM
    (write_oom_report), this process asks the chooser for the next cheaper plan for the same
    number of GPUs, writes its accelerate config and launches again, from the last complete
    checkpoint when it carries over. Returns the launcher's exit code (0: trained)."""
    from lowvram.train.run import launch

    notify = notify or _stderr_line
    spec = options.processes
    out = launched.output_dir
    for stale in out.glob(OOM_REPORT.format(rank="*")):
        stale.unlink(missing_ok=True)
    retries: list[Retry] = []
    while True:
        extra = json.dumps(_retry_log(retries, plan).to_dict())
        rc = launch.run_launch(launched, spec, track_memory=options.track_memory is not False,
                               env={REPORT_ENV: "1", EXTRA_METRICS_ENV: extra})
        err = collect_oom_reports(out, plan) if rc != 0 else None
        if err is None:
            return rc
        if options.recover and spec.nodes > 1:
            raise _final_failure(err, retries, "automatic recovery runs on one node only (every node would "
                                 "have to agree on the new plan)")
        new, ckpts = _next_attempt(replanner, err, plan, retries, out, options,
                                   num_iterations=recipe.grpo.num_iterations)
        try:
            again = dataclasses.replace(options, resume=bool(ckpts), overwrite=False, print_launch=False)
            launched = launch.prepare_launch(recipe, new, again, check_output=False, replanner=replanner)
        except LowvramError as e:
            raise _final_failure(err, retries, f"the next cheaper plan ({describe_change(plan, new)}) cannot "
                                 f"run here: {e.message}") from None
        _record_retry(err, plan, new, ckpts, retries, options.max_retries, notify)
        plan = new


def _record_stop(out: Path, e: LowvramError) -> None:
    """The run folder says why lowvram stopped the run (manifest.record_stop), so `show` does not
    offer to resume a diverged run as if it had been interrupted. Best effort: the error itself
    still reaches the user if the folder cannot be written."""
    from lowvram.train.run import manifest
    from lowvram.train.run.guard import TrainingDiverged

    status = "diverged" if isinstance(e, TrainingDiverged) else "stopped"
    try:
        manifest.record_stop(out, status, e.message, e.hint or "", e.step)
    except OSError:
        pass
