"""All printing happens here: rich tables for people, JSON for scripts. No arithmetic.

rich is imported inside the functions (``lowvram --help`` must stay instant). rich turns colour
off by itself when stdout is not a terminal; NO_COLOR is honoured too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lowvram.errors import error_text
from lowvram.units import gib, mem, percent, shell_line, sparkline


def console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def print_error(err) -> None:
    """A LowvramError as one `error:` line (plus any further lines of its message) and one
    `hint:` line on stderr; no traceback (the CLI and the demo; a launched worker writes the
    same text, errors.error_text)."""
    sys.stderr.write(error_text(err))
    sys.stderr.flush()


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def show_validated(recipe, path: Path, as_json: bool = False) -> None:
    if as_json:
        print_json({"valid": True, "recipe": recipe.model_dump(mode="json")})
        return
    c = console()
    ds = ", ".join(f"{d.path} ({d.format})" for d in recipe.data.datasets)
    c.print(f"[green]ok[/green] {path}: model {recipe.model.name_or_path}; data {ds}; "
            f"seq_len {recipe.training.seq_len}, batch {recipe.training.batch_size}")


def _plan_table(plan):
    from rich.table import Table

    t = Table(title="Plan", show_lines=False)
    t.add_column("technique")
    t.add_column("setting")
    t.add_column("why")
    for name, value in plan.techniques().items():
        t.add_row(name, _setting(value), plan.reasons.get(name, ""))
    t.add_row("micro_batch_size", str(plan.micro_batch_size), f"x {plan.grad_accum} accumulation x {plan.gpus} GPU(s)")
    if "memory" in plan.reasons:  # the architecture could not be read: no prediction
        t.add_row("memory", "not predicted", plan.reasons["memory"])
    if plan.predicted_peak_bytes is not None:
        budget = gib(plan.budget_bytes) if plan.budget_bytes else "no budget"
        verdict = "does not fit: over the budget" if plan.fits is False else "budget"
        t.add_row("predicted peak", gib(plan.predicted_peak_bytes), f"{verdict} {budget}")
    return t


def _warn_remote_code(c, recipe) -> None:
    if recipe.model.trust_remote_code:
        c.print("warning: model.trust_remote_code is on: Python code shipped with the model will run "
                "on this machine (turn it off unless you trust the model's source)", markup=False)


def show_dry_run(recipe, plan, as_json: bool = False) -> None:
    if as_json:
        print_json({"recipe": recipe.model_dump(mode="json"), "plan": plan.to_dict()})
        return
    c = console()
    c.print("# resolved recipe (defaults filled in)", markup=False)
    c.print(recipe.to_yaml(), markup=False)
    c.print(_plan_table(plan))
    _warn_remote_code(c, recipe)
    c.print("dry run: nothing was trained.")


def show_plan_brief(recipe, plan) -> None:
    """Printed before the model is loaded (nanoGPT habit: show the numbers that matter first)."""
    c = console()
    c.print(_plan_table(plan))
    _warn_remote_code(c, recipe)
    tokens = plan.effective_batch * recipe.training.seq_len
    c.print(f"tokens per optimizer step (at most): {tokens:,}")


def show_launch(recipe, plan, spec, launch, print_only: bool = False) -> None:
    """Several GPUs: the plan with memory per GPU and host RAM per node, then the command."""
    c = console()
    if not print_only:
        show_plan_brief(recipe, plan)
    unit = "process" if spec.cpu else "GPU"
    backend = {"ddp": "DDP", "fsdp": "FSDP2", "deepspeed": "DeepSpeed ZeRO"}[launch.backend]
    c.print(f"{spec.world_size} {unit}(s) on {spec.nodes} node(s), {backend} (offload: {plan.offload})",
            markup=False)
    if plan.predicted_peak_bytes is not None:
        c.print(f"predicted memory per {unit}: {gib(plan.predicted_peak_bytes)}", markup=False)
    if plan.host_ram_bytes is not None:
        c.print(f"predicted host RAM per node: {gib(plan.host_ram_bytes * spec.gpus)} "
                f"({spec.gpus} x {gib(plan.host_ram_bytes)})", markup=False)
    c.print(f"accelerate config: {launch.config_path}", markup=False)
    c.print(f"{'command' if print_only else 'launching'}: {shell_line(launch.command)}", markup=False,
            soft_wrap=True)
    if print_only:
        c.print("--print-launch: nothing was trained; run the command above (on every node).", markup=False)


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
        ("first train loss", _f(m.get("first_loss"))),
        ("final train loss", _f(m.get("train_loss"))),
        ("eval loss", _f(m.get("eval_loss"))),
        ("runtime", f"{m['runtime_s']:.1f} s" if m.get("runtime_s") is not None else "-"),
        ("tokens/s", _f(m.get("tokens_per_s"), 1)),
        (f"peak memory ({m.get('peak_memory_kind') or 'measured'})", mem(m.get("peak_memory_bytes"))),
        *([("processes", f"{m['processes']} ({_DISTRIBUTED.get(m.get('distributed_type'), m.get('distributed_type'))}"
            + (f", {m['sharded_parameters']} sharded parameters" if m.get("sharded_parameters") else "") + ")"),
           ("peak memory per rank", ", ".join(mem(b) for b in m["peak_memory_bytes_per_rank"]))]
          if m.get("peak_memory_bytes_per_rank") else []),
        ("peak memory (predicted)", mem(m.get("predicted_peak_bytes"))),
        *([(f"  at the longest row ({m['data_longest_tokens']} tokens)", mem(m["predicted_peak_bytes_at_data"]))]
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


def _f(x, nd: int = 4) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def keys_markdown(rows) -> str:
    """The recipe reference as a Markdown table (also pasted in the README; a test keeps them equal)."""
    out = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, typ, default, help_ in rows:
        out.append(f"| `{key}` | {typ} | {default} | {help_} |")
    return "\n".join(out)


def show_keys(rows, as_json: bool = False) -> None:
    if as_json:
        print_json([{"key": k, "type": t, "default": d, "help": h} for k, t, d, h in rows])
        return
    sys.stdout.write(keys_markdown(rows) + "\n")


def show_env(info: dict, as_json: bool = False) -> None:
    if as_json:
        print_json(info)
        return
    lines = ["```", "lowvram env"]
    for k, v in info.get("versions", {}).items():
        lines.append(f"- {k}: {v}")
    hw = info.get("hardware", {})
    if "error" in hw:
        lines.append(f"- hardware: detection failed: {hw['error']}")
    else:
        lines.append(f"- device kind: {hw.get('kind')}")
        for d in hw.get("devices", ()):
            lines.append(f"- device {d['index']}: {d['name']}, {gib(d['free_bytes'])} free of {gib(d['total_bytes'])}, "
                         f"compute capability {d.get('compute_capability')}, bf16 {d.get('bf16')}")
        lines.append(f"- host RAM: {gib(hw.get('host_available_bytes'))} available of {gib(hw.get('host_total_bytes'))}")
    lines.append("```")
    sys.stdout.write("\n".join(lines) + "\n")


# --------------------------------------------------------------------------------------------
# `lowvram plan`: renders the dict from lowvram.plan.serialize.choice_to_dict (bytes inside)

_BAR_WIDTH = 30


def _bar(part: int, whole: int) -> str:
    if whole <= 0 or part <= 0:
        return ""
    return "█" * max(1, round(_BAR_WIDTH * part / whole))


def _setting(value) -> str:
    return {True: "on", False: "off"}[value] if isinstance(value, bool) else str(value)


def show_plan(data: dict, as_json: bool = False) -> None:
    """The chosen setup with reasons, the breakdown, headroom, ladder and limits."""
    if as_json:
        print_json(data)
        return
    from rich.table import Table

    c = console()
    n = data["parameters"]
    c.print(f"[bold]lowvram plan[/bold]: {data['model']} ({n / 1e9:.2f}B params), seq_len {data['seq_len']}, "
            f"batch {data['batch_size']}, {data['device']}")
    c.print(f"budget: {gib(data['vram_bytes'])} ({data['vram_source']}) - safety margin "
            f"{gib(data['safety_margin_bytes'])} = {gib(data['budget_bytes'])}")
    for note in data.get("notes", ()):
        c.print(f"note: {note}", markup=False)

    t = Table(title="Chosen setup")
    t.add_column("technique")
    t.add_column("setting")
    t.add_column("why")
    for name, value in data["techniques"].items():
        t.add_row(name, _setting(value), data["reasons"].get(name, ""))
    c.print(t)

    peak = data["peak_bytes"]
    sim = data.get("simulated")  # `lowvram plan --simulate`
    b = Table(title=f"Peak memory ({data['peak_phase'].replace('_', ' ')})")
    b.add_column("component")
    b.add_column("size", justify="right")
    if sim:
        b.add_column("simulated", justify="right")
    b.add_column("")
    checked = data.get("checked") or {}
    if checked:
        b.add_column("GPU-calibrated")
    for name, value in data["breakdown"].items():
        extra = [gib(sim["breakdown"].get(name, 0))] if sim else []
        b.add_row(name, gib(value), *extra, _bar(value, peak), *_checked(checked, name))
    extra = [f"[bold]{gib(sim['peak_bytes'])}[/bold]"] if sim else []
    b.add_row("[bold]peak[/bold]", f"[bold]{gib(peak)}[/bold]", *extra, "", *([""] if checked else []))
    c.print(b)
    if sim:
        c.print(f"simulated (the real step on fake tensors, {sim['seconds']:.1f} s): peak "
                f"{gib(sim['peak_bytes'])} ({sim['peak_phase'].replace('_', ' ')}); analytic "
                f"{gib(sim['analytic_peak_bytes'])}, {100 * sim['difference']:+.2f}% vs simulated")
    head = data["headroom_bytes"]
    if data["fits"]:
        c.print(f"[green]fits[/green]: peak {gib(peak)} of {gib(data['budget_bytes'])} budget, "
                f"{gib(head)} headroom; CPU RAM needed {gib(data['cpu_ram_bytes'])}")
        if data.get("gpus", 1) > 1:
            n = data["gpus"]
            c.print(f"{n} GPUs: {gib(peak)} per GPU, host RAM {gib(data['cpu_ram_bytes'])} per GPU process "
                    f"({gib(n * data['cpu_ram_bytes'])} for {n} processes on one node); "
                    f"train with: lowvram train RECIPE --gpus {n}", markup=False)
    else:
        c.print(f"[red]does not fit[/red]: the lowest-memory plan peaks at {gib(peak)}, "
                f"{gib(-head)} over the {gib(data['budget_bytes'])} budget; it needs a card with "
                f"{gib(data['min_vram_bytes'])} free")
        if data.get("suggestion"):
            c.print(f"[bold]most helpful change[/bold]: {data['suggestion']}", markup=True)
        for other in data.get("suggestions", [])[1:]:
            c.print(f"  or: {other}", markup=False)

    ladder = Table(title="Ladder: each technique applied on top of the ones above")
    ladder.add_column("technique")
    ladder.add_column("setting")
    ladder.add_column("peak", justify="right")
    ladder.add_column("saves", justify="right")
    ladder.add_column("speed")
    ladder.add_column("fits")
    for r in data["ladder"]:
        if r["fixed"]:
            ladder.add_row(r["technique"], "fixed by you", gib(r["peak_bytes"]), "-", "-", "yes" if r["fits"] else "no")
            continue
        speed = "-" if r["technique"] == "baseline" else percent(r["slowdown"])
        saves = "-" if r["technique"] == "baseline" else gib(r["saved_bytes"])
        ladder.add_row(r["technique"], r["value"], gib(r["peak_bytes"]), saves, speed,
                       "[green]yes[/green]" if r["fits"] else "no")
    c.print(ladder)

    if data["alternatives"]:
        a = Table(title="Other plans considered (best of each ladder tier)")
        a.add_column("plan")
        a.add_column("peak", justify="right")
        a.add_column("fits")
        a.add_column("speed vs chosen", justify="right")
        for alt in data["alternatives"]:
            a.add_row(_plan_label(alt), gib(alt["peak_bytes"]), "yes" if alt["fits"] else "no",
                      f"{alt['relative_speed']:.2f}x")
        c.print(a)

    c.print(f"under this plan: longest seq_len that fits {data['max_seq_len']:,}; largest micro-batch "
            f"at seq_len {data['seq_len']}: {data['max_micro_batch_size']}")
    if data.get("longest_seq_len_plan"):
        c.print(f"over all plans: longest seq_len {data['longest_seq_len']:,} "
                f"({data['longest_seq_len_plan']})")
    if data.get("largest_micro_batch_plan"):
        c.print(f"over all plans: largest micro-batch at seq_len {data['seq_len']}: "
                f"{data['largest_micro_batch_size']} ({data['largest_micro_batch_plan']})")


def _checked(checked: dict, name: str) -> list[str]:
    """The breakdown table's last cell: what the part was checked against (plan.calibration)."""
    if not checked:
        return []
    from lowvram.plan.calibration import CHECKED

    return [CHECKED.get(checked.get(name, ""), "-")]


def _plan_label(alt: dict) -> str:
    return f"{_techniques_label(alt['techniques'])}, micro {alt['micro_batch_size']}x{alt['grad_accum']}"


def show_unpredicted_plan(plan, model: str, as_json: bool = False) -> None:
    """A plan from fixed defaults: the model's architecture could not be read."""
    if as_json:
        print_json({
            "model": model, "fits": None, "peak_bytes": None, "breakdown": None,
            "techniques": plan.techniques(), "micro_batch_size": plan.micro_batch_size,
            "grad_accum": plan.grad_accum, "reasons": dict(plan.reasons),
        })
        return
    console().print(_plan_table(plan))


def show_models(rows: list[tuple[str, str, int]], as_json: bool = False) -> None:
    """`lowvram plan --list-models`: catalog name, hub id, parameters."""
    if as_json:
        print_json([{"name": n, "hf_id": h, "parameters": p} for n, h, p in rows])
        return
    from rich.table import Table

    t = Table(title="Models lowvram knows without a download")
    t.add_column("name")
    t.add_column("hub id")
    t.add_column("params", justify="right")
    for n, h, p in rows:
        t.add_row(n, h or "-", f"{p / 1e9:.2f}B")
    console().print(t)


# --------------------------------------------------------------------------------------------
# After training: `lowvram merge`, `generate`, `runs`, `show`


def show_merge_plan(mp) -> None:
    """Printed before anything is loaded: what will be merged, where, and the memory it needs."""
    c = console(stderr=True)
    c.print(f"merge: {mp.run_dir} + base {mp.base.source} (found via {mp.base.found_via})", markup=False)
    params = f"{mp.parameters:,} parameters" if mp.parameters is not None else "parameters unknown"
    where = "GPU" if mp.device == "cuda" else "CPU"
    c.print(f"needs {mem(mp.needed_bytes)} ({params} x {mp.dtype} + adapter {mem(mp.adapter_bytes)}) "
            f"on the {where}; host RAM available {mem(mp.host_available_bytes)}"
            + (f", GPU free {mem(mp.gpu_free_bytes)}" if mp.gpu_free_bytes is not None else ""), markup=False)
    for note in mp.notes:
        c.print(f"note: {note}", markup=False)


def show_merge_result(result, as_json: bool = False) -> None:
    if as_json:
        print_json(result.to_dict())
        return
    c = console()
    c.print(f"[green]merged[/green] into {result.out_dir} in {result.seconds:.1f} s "
            f"(process peak RSS {mem(result.peak_rss_bytes)})")
    c.print(f"files: {', '.join(result.files)}", markup=False)
    c.print(f"load it with AutoModelForCausalLM.from_pretrained({result.out_dir!r}), "
            f"or: lowvram generate {result.out_dir} --prompt ...", markup=False)


def show_generator(gen) -> None:
    """On stderr, so stdout carries only the generated text."""
    console(stderr=True).print(f"model: {gen.source} on {gen.device}; prompt format: {gen.prompt_format}",
                               markup=False, style="dim")


def write_stream(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def stream_text(chunks) -> None:
    for chunk in chunks:
        write_stream(chunk)
    write_stream("\n")


def _techniques_label(t: dict) -> str:
    """A plan's techniques in a few words (alternatives in `lowvram plan`, rows of `lowvram runs`)."""
    parts = [str(t.get("mixed_precision", "?"))]
    parts.append("LoRA" if t.get("lora") else "full")
    if t.get("quantization", "none") != "none":
        parts.append(str(t["quantization"]))
    if t.get("gradient_checkpointing"):
        parts.append("checkpointing")
    if t.get("activation_offload"):
        parts.append("activation offload")
    if t.get("optimizer", "adamw") != "adamw":
        parts.append(str(t["optimizer"]))
    if t.get("offload", "none") != "none":
        parts.append(f"offload {t['offload']}")
    if t.get("loss", "standard") != "standard":
        parts.append(f"{t['loss']} loss")
    return ", ".join(parts)


_STATUS_STYLE = {"finished": "green", "interrupted": "yellow", "failed": "red"}


def show_runs(runs, folder, as_json: bool = False) -> None:
    if as_json:
        print_json([r.to_dict(full=False) for r in runs])
        return
    c = console()
    if not runs:
        c.print(f"no runs in {folder} (a run folder holds recipe.yaml and plan.json)", markup=False)
        return
    from rich.table import Table

    t = Table(title=f"Runs in {folder} (peak memory: predicted / measured)")
    t.add_column("run", no_wrap=True)
    t.add_column("recipe")
    t.add_column("model")
    t.add_column("techniques")
    t.add_column("peak", justify="right")
    t.add_column("loss", justify="right", no_wrap=True)
    t.add_column("time", justify="right", no_wrap=True)
    t.add_column("status", no_wrap=True)
    for r in runs:
        style = _STATUS_STYLE.get(r.status, "")
        t.add_row(_relative(r.path, folder), r.recipe_name, Path(r.model).name or r.model, _techniques_label(r.techniques),
                  f"{mem(r.predicted_peak_bytes)} / {mem(r.measured_peak_bytes)}", _f(r.final_loss, 3),
                  f"{r.runtime_s:.0f} s" if r.runtime_s is not None else "-",
                  f"[{style}]{r.status}[/{style}]" if style else r.status)
    c.print(t)


def _relative(path: str, folder) -> str:
    try:
        return str(Path(path).relative_to(folder)) if Path(path) != Path(folder) else str(path)
    except ValueError:
        return str(path)


def show_run(r, as_json: bool = False) -> None:
    if as_json:
        print_json(r.to_dict())
        return
    from rich.table import Table

    c = console()
    style = _STATUS_STYLE.get(r.status, "")
    c.print(f"[bold]{r.path}[/bold]: [{style}]{r.status}[/{style}]" if style else f"{r.path}: {r.status}")
    rec = r.recipe
    tr = rec.get("training") or {}
    ds = ", ".join(f"{d.get('path')} ({d.get('format')})" for d in (rec.get("data") or {}).get("datasets", []))
    c.print(f"recipe: {r.recipe_path or '(not recorded)'}", markup=False)
    c.print(f"model: {r.model}; data: {ds or '-'}; seq_len {tr.get('seq_len', '-')}, batch {tr.get('batch_size', '-')}, "
            f"lr {tr.get('learning_rate', '-')}, max_steps {tr.get('max_steps') or '-'}", markup=False)
    p = Table(title="Plan")
    p.add_column("technique")
    p.add_column("setting")
    p.add_column("why")
    for name, value in r.techniques.items():
        key = "gradient_accumulation" if name == "grad_accum" else name
        p.add_row(key, _setting(value), r.reasons.get(key, ""))
    c.print(p)
    m = r.metrics
    t = Table(title="Metrics")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("steps", r.steps), ("first train loss", _f(r.first_loss)), ("final train loss", _f(r.final_loss)),
        ("eval loss", _f(r.eval_loss)),
        ("runtime", f"{r.runtime_s:.1f} s" if r.runtime_s is not None else None),
        ("tokens/s", _f(m.get("tokens_per_s"), 1) if m.get("tokens_per_s") is not None else None),
        ("peak memory (predicted)", mem(r.predicted_peak_bytes)),
        (f"peak memory ({m.get('peak_memory_kind') or 'measured'})", mem(r.measured_peak_bytes)),
        ("trainable / total params", f"{m['trainable_params']:,} / {m['total_params']:,}"
         if m.get("trainable_params") is not None and m.get("total_params") is not None else None),
    ]
    for k, v in rows:
        t.add_row(k, "-" if v is None else str(v))
    c.print(t)
    if r.loss_history:
        lo, hi = min(v for _, v in r.loss_history), max(v for _, v in r.loss_history)
        c.print(f"loss {sparkline([v for _, v in r.loss_history])}  (steps {r.loss_history[0][0]}-"
                f"{r.loss_history[-1][0]}, {hi:.3f} max, {lo:.3f} min)", markup=False)
    if r.eval_history:
        c.print("eval loss: " + ", ".join(f"step {s} {v:.3f}" for s, v in r.eval_history), markup=False)
    c.print(f"checkpoints: {', '.join(r.checkpoints) or 'none'}", markup=False)
    if r.status == "interrupted":
        from pathlib import Path

        from lowvram.train.recover import resume_command

        # The run's other --set flags are in its recipe.yaml; output_dir is the one that locates it.
        here = f"training.output_dir={Path(r.path).resolve()}"
        c.print(f"resume with: {resume_command(r.recipe_path or 'RECIPE', [here])}", markup=False)
    if r.files:
        c.print(f"files: {', '.join(r.files)}", markup=False)
