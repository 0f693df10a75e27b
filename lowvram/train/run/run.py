"""`lowvram train`: load, build data, train through transformers.Trainer, write the run folder.

A finished run folder holds the adapter (or full model), the tokenizer, ``recipe.yaml`` (the
resolved recipe), ``plan.json`` and ``metrics.json``; ``checkpoint-*`` folders come from the
Trainer. ``plan.json`` and ``recipe.yaml`` are written first (they mark the folder as a lowvram
run), ``metrics.json`` last (it marks the run finished).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.metrics import RunMetrics
from lowvram.plan.choose.replan import Replanner
from lowvram.plan.memory.preference import RL_OBJECTIVES
from lowvram.plan.types import Plan
from lowvram.recipe import Recipe
from lowvram.runfiles import METRICS, PLAN, RECIPE, require_intact, write_atomic
from lowvram.train.run.data_length import (
    longest_row,
    prediction_at_data_length,
    with_data_length_reason,
)
from lowvram.train.types import RetryLog, RunResult, TrainOptions

if TYPE_CHECKING:
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback

    from lowvram.gpumemory import MemoryComparison

_ONE_RUN = TrainOptions(track_memory=None)  # a call from code: LOWVRAM_TRACK_MEMORY, default on

# --------------------------------------------------------------------------------------------
# The run folder


def _save_final(trainer: Trainer, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """Adapter (or model) + tokenizer, each file moved into place whole.

    Every rank calls save_model (FSDP gathers the shards collectively); rank 0 writes."""
    from lowvram.train.run import manifest

    main = trainer.is_world_process_zero()
    tmp = Path(tempfile.mkdtemp(prefix=".final-", dir=out))
    try:
        trainer.save_model(str(tmp))
        _as_plain_lora(trainer, tmp)
        if not main:
            return
        tokenizer.save_pretrained(str(tmp))
        manifest.record(out, *sorted(f.name for f in tmp.iterdir()))
        for f in tmp.iterdir():
            dest = out / f.name
            if f.is_dir():
                shutil.rmtree(dest, ignore_errors=True)
            os.replace(f, dest)
    except Exception as e:
        _name_what_did_not_fit(e, tmp, out)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _as_plain_lora(trainer: Trainer, tmp: Path) -> None:
    """lora.init pissa: the saved adapter rewritten as the plain LoRA of what training changed,
    B A - B0 A0 at rank 2r (peft's ``path_initial_model_for_weight_conversion``, the conversion
    its PiSSA guide recommends; the initial adapters written at build, train.model
    _keep_initial_adapter), so it applies to the original base model like any adapter (the
    PiSSA adapter itself fits only the residual base made at build)."""
    from lowvram.train.build.model import INITIAL_ADAPTER_ATTRIBUTE

    model = trainer.accelerator.unwrap_model(trainer.model)
    initial = getattr(model, INITIAL_ADAPTER_ATTRIBUTE, None)
    if initial is not None:
        model.save_pretrained(str(tmp), path_initial_model_for_weight_conversion=initial)


def _name_what_did_not_fit(exc: Exception, tmp: Path, out: Path) -> None:
    """A full disk during the final save: an OSError naming the file of the run that did not fit
    (``tmp`` is removed before the error is shown; the Rust writers' errors name no file)."""
    from lowvram.train.diskfull import staged_file_that_did_not_fit

    what = staged_file_that_did_not_fit(exc, tmp, out)
    if what is not None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(what)) from exc


# --------------------------------------------------------------------------------------------
# Memory


def _memory_tracker(plan: Plan, model: PreTrainedModel, track: bool = True,
                    reference: PreTrainedModel | None = None) -> TorchDispatchMode | None:
    """On CPU: lowvram.livebytes' tracker (exact tensor bytes; ``track=False``, from
    --no-track-memory: none, unless an emulated card needs it); on CUDA: reset the peak.
    ``reference``: the trainer's frozen reference model (TRL's ``ref_model``: GRPO/RLOO with
    beta > 0, DPO/KTO full fine-tuning), loaded in the trainer's __init__ before the tracker
    starts, so registered like the weights (held-out seed 977 measured 18% under its plan
    without it)."""
    if plan.device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()
        return None
    if plan.device != "cpu":
        return None
    try:
        from lowvram.livebytes import LiveBytes
    except ImportError:
        return None
    from lowvram.train.run.oom import emulated_vram_bytes

    if not track and emulated_vram_bytes() is None:
        return None
    tracker = LiveBytes(cap_bytes=emulated_vram_bytes())  # LOWVRAM_EMULATE_VRAM: an emulated card
    tracker.register(model)  # weights exist before the mode starts counting
    if reference is not None:
        tracker.register(reference)
    return tracker


def _peak_memory(plan: Plan, tracker: TorchDispatchMode | None, history: TrainerCallback | None = None,
                 breakdown: dict[str, int] | None = None, init_peak_bytes: int = 0) -> dict:
    """The run's measured peak; ``history`` (livebytes.memory_history_callback) holds the peaks of
    the logging intervals, whose maximum is the run's peak. ``breakdown``: the prediction to
    compare with, part by part (``memory_comparison``: lowvram.gpumemory, like with like).
    ``init_peak_bytes``: the adapters' initialisation measured at model build (lora.init pissa on
    a CPU: train.model._with_adapters), before this tracker started."""
    from lowvram import gpumemory

    peak, reserved = history.finish() if history is not None else (0, 0)
    if tracker is not None:
        measured = max(peak, int(tracker.peak_bytes), init_peak_bytes)
        rows = gpumemory.compare_tensors(breakdown, measured, "live tensor bytes") if breakdown else ()
        return {"peak_memory_bytes": measured, "peak_memory_kind": "live tensor bytes (exact, CPU)",
                "peak_rss_bytes": _peak_rss(), **_comparison(rows)}
    if plan.device == "cuda":
        from dataclasses import replace

        from lowvram.hardware import read_cuda_memory

        r = read_cuda_memory()  # mem_get_info read once, at the end: every kernel is loaded by now
        r = replace(r, allocated_peak_bytes=max(peak, r.allocated_peak_bytes),
                    reserved_peak_bytes=max(reserved, r.reserved_peak_bytes))
        return {
            "peak_memory_bytes": r.allocated_peak_bytes,
            "peak_reserved_bytes": r.reserved_peak_bytes,
            "beyond_reserved_bytes": r.beyond_reserved_bytes,
            "peak_memory_kind": "cuda max_memory_allocated",
            **_comparison(gpumemory.compare_cuda(breakdown, r) if breakdown else ()),
        }
    # Whole-process RSS (Python, libraries, data, allocator caches): an upper bound on tensor
    # memory, not a measurement of it.
    return {"peak_memory_bytes": _peak_rss(), "peak_memory_kind": "process peak RSS (not tensor memory)"}


def _comparison(rows: tuple[MemoryComparison, ...]) -> dict:
    return {"memory_comparison": [r.to_dict() for r in rows]} if rows else {}


def _peak_rss() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux


# --------------------------------------------------------------------------------------------
# Training


def _loss_history(log_history: list[dict], key: str = "loss") -> list[list[float]]:
    return [[int(e["step"]), float(e[key])] for e in log_history if key in e and "step" in e]


def _gather_peaks(trainer: Trainer, out: Path, peak: dict) -> list[int] | None:
    """Several processes: each rank writes rank-K.json with its peak (on its own node's disk) and
    the peaks are gathered over the process group (nodes need not share a filesystem)."""
    acc = trainer.accelerator
    if acc.num_processes <= 1:
        return None
    write_atomic(out / f"rank-{acc.process_index}.json", json.dumps(peak) + "\n")
    from accelerate.utils import gather_object

    peaks = gather_object([int(peak["peak_memory_bytes"])])  # in rank order, on every rank
    return [int(b) for b in peaks] if trainer.is_world_process_zero() else None


def _distribution(trainer: Trainer) -> dict:
    """How the processes shared the model, read from the run itself: accelerate's distributed type
    (NO, MULTI_GPU, MULTI_CPU, FSDP, DEEPSPEED) and how many parameters FSDP2 holds as shards."""
    from torch.distributed.tensor import DTensor

    acc = trainer.accelerator
    kind = getattr(acc.distributed_type, "value", str(acc.distributed_type))
    sharded = sum(1 for p in trainer.model_wrapped.parameters() if isinstance(p, DTensor))
    return {"distributed_type": kind, "sharded_parameters": sharded}


def run_training(recipe: Recipe, plan: Plan, options: TrainOptions = _ONE_RUN, callbacks: Sequence[TrainerCallback] = (),
                 prepared: bool = False, retries: RetryLog | None = None,
                 replanner: Replanner | None = None) -> RunResult:
    """Train as the Plan says; returns the metrics also written to output_dir/metrics.json.

    ``options``: resume, overwrite and track_memory are read here (the rest is the launcher's).
    ``replanner`` (lowvram.planning, from the caller): the peak predicted at the data's longest
    row; without it metrics.json has the plan's prediction only. ``retries``: the out-of-memory
    retries before this attempt, for metrics.json (recover.py).

    ``prepared``: a launcher process already checked output_dir (``lowvram train --gpus N``);
    each rank only finds the checkpoint to resume from. Only rank 0 writes the run files.
    """
    from lowvram.train.build.trainer import output_dir

    out = output_dir(recipe)
    from lowvram.train.run.checkpoints import check_generation_round, complete_checkpoints

    if prepared:
        found = complete_checkpoints(out) if options.resume and out.is_dir() else []
        checkpoint = found[-1] if found else None
    else:
        from lowvram.train.run.folder import prepare_output_dir

        checkpoint = prepare_output_dir(out, options.resume, options.overwrite, recipe=recipe, plan=plan)
    at_end = checkpoint is not None and _finished_at(checkpoint, recipe)
    if checkpoint is not None and plan.generation and not at_end:  # grpo/rloo: at a generation round's end
        check_generation_round(checkpoint, plan.grad_accum, plan.steps_per_generation, recipe.grpo.num_iterations)

    from lowvram.train.build.model import resolve_model_location
    from lowvram.train.run.preflight import check_shape, model_files

    # A damaged model file names itself before a library fails on it (a hub id: no folder).
    require_intact(Path(resolve_model_location(recipe)), only=model_files(recipe))
    if recipe.training.objective in RL_OBJECTIVES:  # the rewards score a sample row before the model loads
        from lowvram.train.build.grpo import check_grpo

        check_grpo(recipe)
    args, loaded = _arguments_then_model(recipe, plan)

    from lowvram.train.build.processor import load_image_inputs
    from lowvram.train.data.build import build_datasets
    from lowvram.train.data.collate import make_collator
    from lowvram.train.data.images import make_image_collator

    images = load_image_inputs(recipe, loaded.source, loaded.model, plan.max_pixels)  # format image_chat
    bundle = build_datasets(recipe, loaded.tokenizer, images)
    from transformers.utils.generic import is_flash_attention_requested

    # flash-attention reads packed samples only from varlen kwargs in a batch of 2+ rows (collate.py)
    collator = make_collator(loaded.tokenizer, flash_varlen=is_flash_attention_requested(loaded.model.config),
                             rows=True)  # each step's rows, for its error (train/run/guard.py)
    if images is not None:  # pixel values per batch (data/images.py)
        collator = make_image_collator(images.processor, images.image_token_id, collator, images.cross_attention)
    if len(bundle.train) == 0:
        raise LowvramError("no training rows left after formatting", "check data.datasets and data.skip_bad_rows")
    check_shape(recipe, train_rows=len(bundle.train))  # the rows (windows) as built: hub data, packing
    from lowvram.train.run.guard import guard_for, require_finite_weights, require_trained_tokens

    require_trained_tokens(bundle.stats)
    from lowvram.train.build.trainer import build_trainer
    from lowvram.train.run import oom, signals
    from lowvram.train.run.progress import ProgressCallback

    progress = ProgressCallback()
    stop = signals.SignalStop()  # SIGINT/SIGTERM: checkpoint at the step's end, then stop
    guard = guard_for(recipe, plan)  # a non-finite step stops (or is skipped); checkpoint rotation
    trainer = build_trainer(
        loaded, bundle, args, collator,
        # signals' MarkComplete before the guard: the guard rotates complete checkpoints only
        callbacks=[*signals.make_callbacks(stop), guard, progress, *callbacks],
        loss=plan.loss, loss_chunk_tokens=plan.loss_chunk_tokens, optimizer=plan.optimizer, recipe=recipe,
    )
    guard.attach(trainer)

    at_data, compared_with = prediction_at_data_length(recipe, plan, bundle, replanner,
                                                       longest_row(recipe, bundle, trainer))
    plan = with_data_length_reason(plan, recipe, at_data)
    from lowvram.train.run.worst_batch import worst_batch_first

    worst = None if at_end else worst_batch_first(recipe, plan, trainer, bundle.train, at_data)  # OOM: re-plan
    main = trainer.is_world_process_zero()
    out.mkdir(parents=True, exist_ok=True)
    if main:  # several processes: rank 0 writes the run files
        from lowvram.train.run import manifest

        manifest.record(out, RECIPE, PLAN, METRICS, "loss.png",
                        *(["runs"] if recipe.training.report_to == "tensorboard" else []),
                        *(f"rank-{i}.json" for i in range(trainer.accelerator.num_processes)
                          if trainer.accelerator.num_processes > 1))
        # The comment names the recipe file (`lowvram runs` shows it; YAML loaders skip it).
        write_atomic(out / RECIPE, (f"# recipe: {Path(recipe.source).resolve()}\n" if recipe.source else "") + recipe.to_yaml())
        write_atomic(out / PLAN, json.dumps(plan.to_dict(), indent=2) + "\n")

    track_memory = options.track_memory
    if track_memory is None:  # launched workers: `--no-track-memory` reaches them through this variable
        track_memory = os.environ.get("LOWVRAM_TRACK_MEMORY", "1") != "0"
    tracker = _memory_tracker(plan, loaded.model, track_memory, getattr(trainer, "ref_model", None))
    from lowvram.livebytes import memory_history_callback

    mem_history = memory_history_callback(plan.device, tracker)
    trainer.add_callback(mem_history)
    t0 = time.perf_counter()
    try:
        with tracker if tracker is not None else contextlib.nullcontext(), stop.installed():
            if at_end:  # the last step is in the checkpoint: finish without training another
                train_out = _load_finished(trainer, checkpoint)
            else:
                train_out = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
            runtime = time.perf_counter() - t0  # training only: tokens/s
            # The final evaluation is part of the run's peak (eval batch = micro-batch; the eval
            # loop keeps the loss only, Trainer.evaluate's prediction_loss_only).
            eval_loss = None
            if bundle.eval is not None and stop.signum is None:
                eval_loss = float(trainer.evaluate()["eval_loss"])
    except Exception as e:
        progress.close()  # a bar on a terminal ends before the error is said
        if not oom.is_oom(e):
            raise
        raise oom.oom_error(e, trainer.state.global_step, plan, tracker) from None
    if stop.signum is not None:
        saved = complete_checkpoints(out)
        raise signals.TrainingInterrupted(stop.signum, trainer.state.global_step, saved[-1] if saved else None)
    from lowvram.train.build.model import INIT_PEAK_ATTRIBUTE

    peak = _peak_memory(plan, tracker, mem_history, compared_with,
                        getattr(loaded.model, INIT_PEAK_ATTRIBUTE, 0))
    per_rank = _gather_peaks(trainer, out, {**peak, "memory_history": mem_history.history})

    require_finite_weights(trainer.model)
    _save_final(trainer, loaded.tokenizer, out)
    from lowvram.train.build.grpo import rl_metrics
    from lowvram.train.build.preference import preference_metrics

    history = _loss_history(trainer.state.log_history)
    session_tokens = progress.session_tokens()
    s = bundle.stats
    metrics = RunMetrics(
        first_loss=history[0][1] if history else None,
        train_loss=history[-1][1] if history else None,
        eval_loss=eval_loss,
        steps=int(trainer.state.global_step),
        runtime_s=round(runtime, 3),
        train_runtime_s=round(float(train_out.metrics.get("train_runtime", runtime)) if train_out else 0.0, 3),
        tokens_seen=int(trainer.state.num_input_tokens_seen or progress.tokens_seen),
        tokens_per_s=round(session_tokens / runtime, 1) if runtime > 0 and session_tokens else None,
        **peak,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        predicted_device=plan.device,
        **at_data,
        memory_history=mem_history.history,  # [[step, peak bytes since the previous log], ...]
        processes=int(trainer.accelerator.num_processes),
        **_distribution(trainer),
        peak_memory_bytes_per_rank=per_rank,
        train_rows=s.train_rows,
        eval_rows=s.eval_rows,
        truncated=s.truncated,
        skipped_bad_rows=s.skipped_bad_rows,
        packed=s.packed,
        load_s=round(loaded.load_s, 3),
        gguf_cache_hit=loaded.gguf_cache_hit,
        trainable_params=loaded.trainable_params,
        total_params=loaded.total_params,
        resumed_from=str(checkpoint) if checkpoint else None,
        loss_history=history,
        eval_history=_loss_history(trainer.state.log_history, "eval_loss"),
        **preference_metrics(trainer.state.log_history),  # dpo/orpo/simpo: rewards/* (train/build/preference.py)
        **rl_metrics(trainer.state.log_history),  # grpo/rloo: the rewards per function (train/build/grpo.py)
        **(retries.to_dict() if retries is not None else {}),
        nonfinite_steps=guard.skipped or None,  # training.on_nonfinite skip: the steps whose update was skipped
        worst_batch_tokens=worst.tokens if worst else None,
        worst_batch_peak_bytes=worst.peak_bytes if worst else None,
    )
    if per_rank:  # the largest rank: what must fit one card
        metrics = dataclasses.replace(metrics, peak_memory_bytes=max(per_rank))
    if main:
        _plot(metrics, out)  # before metrics.json: a plot the disk had no room for leaves the run unfinished
        write_atomic(out / METRICS, metrics.to_json())
    return RunResult(output_dir=str(out), metrics=metrics, resumed_from=str(checkpoint) if checkpoint else None)


def _arguments_then_model(recipe: Recipe, plan: Plan):
    """(TrainingArguments, LoadedModel), in that order. Under ``accelerate launch`` with DeepSpeed,
    TrainingArguments.__post_init__ makes the DeepSpeedPlugin whose HfDeepSpeedConfig sets
    transformers' global weakref (accelerate utils/dataclasses.py set_deepspeed_weakref); only
    with it alive does from_pretrained see ``is_deepspeed_zero3_enabled()`` (modeling_utils
    get_init_context: zero.Init, or for a 4-bit base the meta device and the quantized state),
    as peft's ZeRO-3 QLoRA recipe and accelerate's example do. The datasets come later: whether
    there is an evaluation set follows from data.validation (data/build.py)."""
    from lowvram.train.build.model import load_model, quiet_libraries
    from lowvram.train.build.trainer import build_training_args

    quiet_libraries()
    args = build_training_args(recipe, plan, has_eval=recipe.data.validation is not None)
    sys.stdout.write(f"loading {recipe.model.name_or_path} ...\n")  # seconds for a large model: not silence
    sys.stdout.flush()
    return args, load_model(recipe, plan)


def _finished_at(checkpoint: Path, recipe: Recipe) -> bool:
    """Whether ``checkpoint`` holds the run's last step (max_steps, or the step count the run
    started with when it trains for epochs): resuming from it trains nothing more."""
    from lowvram.train.run.checkpoints import checkpoint_step

    step, run_max = checkpoint_step(checkpoint)
    target = recipe.training.max_steps or run_max
    if target is not None and step > target:
        raise LowvramError(
            f"{checkpoint.name} is at step {step}, past training.max_steps {target}",
            f"resume with training.max_steps {step} or more, or start over with --overwrite",
        )
    return target is not None and step >= target


def _load_finished(trainer: Trainer, checkpoint: Path):
    """The Trainer as it stood at the end of the run: the checkpoint's weights and state (loss
    history, tokens seen). transformers' own resume would take one more step before it checks
    max_steps (its loop tests the stop condition after a step)."""
    from transformers import TrainerState

    trainer._load_from_checkpoint(str(checkpoint))  # noqa: SLF001 - the Trainer's own loader (adapters, shards)
    trainer.state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    sys.stdout.write(f"{checkpoint.name} is at the last step ({trainer.state.global_step}): finishing without training\n")
    sys.stdout.flush()
    return None


def _plot(metrics: RunMetrics, out: Path) -> None:
    """loss.png next to metrics.json (written before it); a plotting problem never fails a
    finished run, a full disk does (an OSError naming loss.png: recover._disk_full's error)."""
    import warnings

    from lowvram.train.diskfull import is_disk_full
    from lowvram.train.run.plots import LOSS_PNG

    try:
        from lowvram.train.run.plots import save_loss_plot

        save_loss_plot(metrics, out)
    except Exception as e:  # noqa: BLE001 - e.g. matplotlib missing or a bad font cache
        if is_disk_full(e):  # a full disk is the run's error (recover._disk_full), not a plotting one
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / LOSS_PNG)) from e
        warnings.warn(f"loss.png not written: {e}", stacklevel=2)
