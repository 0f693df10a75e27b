"""Printing a finished `lowvram train`: the run summary, and the warning when the measured peak
is far from the predicted one."""

from __future__ import annotations

from pathlib import Path

from lowvram.report.console import console, number_cell, print_json
from lowvram.units import mem, sparkline

# accelerate's DistributedType values, as the run summary names them
_DISTRIBUTED = {"MULTI_GPU": "DDP", "MULTI_CPU": "DDP over gloo", "FSDP": "FSDP", "DEEPSPEED": "DeepSpeed", "NO": "one process"}


def show_train_result(result, as_json: bool = False) -> None:
    m = result.metrics
    if as_json:
        print_json({"output_dir": result.output_dir, "metrics": m})
        return
    from rich.table import Table

    t = Table(title="Run summary")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("output_dir", result.output_dir),
        ("steps", m.get("steps")),
        ("first train loss", number_cell(m.get("first_loss"))),
        ("final train loss", number_cell(m.get("train_loss"))),
        ("eval loss", number_cell(m.get("eval_loss"))),
        ("runtime", f"{m['runtime_s']:.1f} s" if m.get("runtime_s") is not None else "-"),
        ("tokens/s", number_cell(m.get("tokens_per_s"), 1)),
        (f"peak memory ({m.get('peak_memory_kind') or 'measured'})", mem(m.get("peak_memory_bytes"))),
        *([("processes", f"{m['processes']} ({_DISTRIBUTED.get(m.get('distributed_type'), m.get('distributed_type'))}"
            + (f", {m['sharded_parameters']} sharded parameters" if m.get("sharded_parameters") else "") + ")"),
           ("peak memory per rank", ", ".join(mem(b) for b in m["peak_memory_bytes_per_rank"]))]
          if m.get("peak_memory_bytes_per_rank") else []),
        ("peak memory (predicted)", mem(m.get("predicted_peak_bytes"))),
        *([(f"  at the longest row ({m['data_longest_tokens']} tokens"
            + (", one sample per packed window)" if m.get("data_windows_one_sample") else ")"),
            mem(m["predicted_peak_bytes_at_data"]))]
          if m.get("predicted_peak_bytes_at_data") else []),
    ]
    if m.get("load_s") is not None:
        cache = {True: " (GGUF cache)", False: " (GGUF converted, cached now)"}.get(m.get("gguf_cache_hit"), "")
        rows.append(("model load", f"{m['load_s']:.1f} s{cache}"))
    if m.get("loss_history"):
        rows.append(("loss curve", sparkline([v for _, v in m["loss_history"]])))
    for k, v in rows:
        t.add_row(k, "-" if v is None else str(v))
    console().print(t)
    if len(m.get("memory_comparison") or ()) > 1:  # a CUDA run; the CPU's one pair is above
        console().print(_comparison_table(m["memory_comparison"]))
    _warn_prediction(m)
    if (Path(result.output_dir) / "loss.png").is_file():
        console().print(f"loss plot: {Path(result.output_dir) / 'loss.png'}", markup=False)


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


def _compared_tensors(metrics: dict) -> tuple[int | None, int | None]:
    """(predicted, measured) tensor bytes: the tensors pair of ``memory_comparison``, else (older
    metrics.json) the predicted peak and the measured one."""
    from lowvram.gpumemory import tensor_comparison

    row = tensor_comparison(metrics.get("memory_comparison"))
    if row is not None:
        return row["predicted_bytes"], row["measured_bytes"]
    return (metrics.get("predicted_peak_bytes_at_data") or metrics.get("predicted_peak_bytes"),
            metrics.get("peak_memory_bytes"))


def prediction_error(metrics: dict) -> float | None:
    """(measured - predicted) / predicted, when both are tensor memory of the same device.

    On data shorter than seq_len the prediction compared is the one at the longest row."""
    pred, meas = _compared_tensors(metrics)
    kind = metrics.get("peak_memory_kind") or ""
    if not pred or not meas or "RSS" in kind:  # process RSS is not tensor memory
        return None
    return (meas - pred) / pred


def _warn_prediction(m: dict) -> None:
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
