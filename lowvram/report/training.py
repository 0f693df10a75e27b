"""Printing a finished `lowvram train`: the run summary, and the warning when the measured peak
is far from the predicted one."""

from __future__ import annotations

from pathlib import Path

from lowvram.report.console import console, number_cell, print_json
from lowvram.units import mem, sparkline

# accelerate's DistributedType values, as the run summary names them
_DISTRIBUTED = {"MULTI_GPU": "DDP", "MULTI_CPU": "DDP over gloo", "FSDP": "FSDP", "DEEPSPEED": "DeepSpeed", "NO": "one process"}


def show_started(planned) -> None:
    """Before the run starts (lowvram.session.PlannedRun): the plan in brief, or with several
    processes the plan per GPU and the launch command."""
    from lowvram.report.plans import show_launch, show_plan_brief

    if planned.launch is None:
        show_plan_brief(planned.recipe, planned.plan)
    else:
        show_launch(planned.recipe, planned.plan, planned.processes, planned.launch)


def show_train_outcome(outcome, as_json: bool = False) -> None:
    """What `lowvram train` did (lowvram.session.TrainOutcome): the dry run's plan, the launch
    files, or the run summary (nothing on a node whose node 0 reports, or after a failed launch)."""
    from lowvram.report.plans import show_dry_run, show_launch

    p = outcome.planned
    if outcome.dry_run:
        show_dry_run(p.recipe, p.plan, as_json=as_json, data=outcome.data)
    elif outcome.print_only:
        show_launch(p.recipe, p.plan, p.processes, p.launch, print_only=True)
    elif outcome.result is not None:
        show_train_result(outcome.result, as_json=as_json)


def show_train_result(result, as_json: bool = False) -> None:
    """``result``: lowvram.train.types.RunResult, whose ``metrics`` is a lowvram.metrics.RunMetrics."""
    m = result.metrics
    if as_json:
        print_json({"output_dir": result.output_dir, "metrics": m.to_dict()})
        return
    from rich.table import Table

    t = Table(title="Run summary")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("output_dir", result.output_dir),
        ("steps", m.steps),
        ("first train loss", number_cell(m.first_loss)),
        ("final train loss", number_cell(m.train_loss)),
        ("eval loss", number_cell(m.eval_loss)),
        ("runtime", f"{m.runtime_s:.1f} s" if m.runtime_s is not None else "-"),
        ("tokens/s", number_cell(m.tokens_per_s, 1)),
        (f"peak memory ({m.peak_memory_kind or 'measured'})", mem(m.peak_memory_bytes)),
        *([("processes", f"{m.processes} ({_DISTRIBUTED.get(m.distributed_type, m.distributed_type)}"
            + (f", {m.sharded_parameters} sharded parameters" if m.sharded_parameters else "") + ")"),
           ("peak memory per rank", ", ".join(mem(b) for b in m.peak_memory_bytes_per_rank))]
          if m.peak_memory_bytes_per_rank else []),
        ("peak memory (predicted)", mem(m.predicted_peak_bytes)),
        *([(f"  at the longest row ({m.data_longest_tokens} tokens"
            + (", one sample per packed window)" if m.data_windows_one_sample else ")"),
            mem(m.predicted_peak_bytes_at_data))]
          if m.predicted_peak_bytes_at_data else []),
    ]
    if m.load_s is not None:
        cache = {True: " (GGUF cache)", False: " (GGUF converted, cached now)"}.get(m.gguf_cache_hit, "")
        rows.append(("model load", f"{m.load_s:.1f} s{cache}"))
    if m.loss_history:
        rows.append(("loss curve", sparkline([v for _, v in m.loss_history])))
    if m.worst_batch_peak_bytes is not None:  # training.worst_batch_first
        rows.append((f"worst batch first ({m.worst_batch_tokens} tokens, forward and backward)",
                     mem(m.worst_batch_peak_bytes)))
    if m.nonfinite_steps:  # training.on_nonfinite skip
        rows.append(("non-finite steps skipped", ", ".join(str(s) for s in m.nonfinite_steps)))
    for k, v in rows:
        t.add_row(k, "-" if v is None else str(v))
    console().print(t)
    if len(m.memory_comparison or ()) > 1:  # a CUDA run; the CPU's one pair is above
        console().print(_comparison_table(m.memory_comparison))
    _warn_prediction(m)
    if m.get("reward") is None:  # grpo/rloo: the loss is no measure of divergence
        warn_climb(m.loss_history)
    if (Path(result.output_dir) / "loss.png").is_file():
        console().print(f"loss plot: {Path(result.output_dir) / 'loss.png'}", markup=False)


def warn_climb(history) -> None:
    """A loss that climbed far above its first value (lowvram.metrics.loss_climb): a warning on
    stderr under the run summary and `lowvram show`."""
    from lowvram.metrics import climb_warning

    text = climb_warning(history)
    if text:
        console(stderr=True).print(f"warning: {text}", markup=False)


PREDICTION_TOLERANCE = 0.10  # beyond this, the planner is wrong for this run: ask for a report


# An over-prediction only wastes headroom: below this much it is not worth a report (a test-sized
# model's fixed overheads are a large share of a 1 MiB peak). An under-prediction always is.
OVER_PREDICTION_FLOOR_BYTES = 64 * 2**20


def _comparison_table(rows: list[dict]):
    """The plan against the run, part by part, each with the counter that measures exactly it
    (lowvram.gpumemory); the parts not calibrated on a GPU are named under the table."""
    from rich.table import Table

    t = Table(title="Memory: predicted vs measured, like with like")
    for name, justify in (("part", "left"), ("predicted", "right"), ("measured", "right"),
                          ("measured by", "left"), ("error", "right")):
        t.add_column(name, justify=justify)
    for r in rows:
        err = "-" if r.get("error") is None else f"{100 * r['error']:+.1f}%"
        t.add_row(r["what"], mem(r["predicted_bytes"]), mem(r["measured_bytes"]), r["measured_by"], err)
    raw = [r["what"] for r in rows if not r["gpu_calibrated"]]
    if raw:
        t.caption = f"not yet calibrated on a GPU (bench/gpu_check.py): {', '.join(raw)}"
    return t


def _compared_tensors(metrics) -> tuple[int | None, int | None]:
    """(predicted, measured) tensor bytes: the tensors pair of ``memory_comparison``, else (older
    metrics.json) the predicted peak and the measured one. ``metrics``: a RunMetrics, or the
    dict of a metrics.json (both have ``get``)."""
    from lowvram.gpumemory import tensor_comparison

    row = tensor_comparison(metrics.get("memory_comparison"))
    if row is not None:
        return row["predicted_bytes"], row["measured_bytes"]
    return (metrics.get("predicted_peak_bytes_at_data") or metrics.get("predicted_peak_bytes"),
            metrics.get("peak_memory_bytes"))


def prediction_error(metrics) -> float | None:
    """(measured - predicted) / predicted, when both are tensor memory of the same device.

    On data shorter than seq_len the prediction compared is the one at the longest row."""
    pred, meas = _compared_tensors(metrics)
    kind = metrics.get("peak_memory_kind") or ""
    if not pred or not meas or "RSS" in kind:  # process RSS is not tensor memory
        return None
    return (meas - pred) / pred


def _warn_prediction(m) -> None:
    err = prediction_error(m)
    if err is None or abs(err) <= PREDICTION_TOLERANCE:
        return
    pred, meas = _compared_tensors(m)
    if err < 0 and pred - meas < OVER_PREDICTION_FLOOR_BYTES:
        return
    console(stderr=True).print(
        f"warning: measured peak {mem(meas)} is {100 * err:+.0f}% off the predicted "
        f"{mem(pred)}; please report it with the output of `lowvram env`, "
        "the recipe and plan.json", markup=False)
