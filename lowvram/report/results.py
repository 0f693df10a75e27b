"""Printing after training: `lowvram runs`, `show`, `merge`, `generate`."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from lowvram.metrics import OBJECTIVE_METRIC_KEYS
from lowvram.report.console import console, number_cell, print_json, setting_cell, techniques_label
from lowvram.units import mem, sparkline


def show_merge_plan(mp) -> None:
    """Printed before anything is loaded: what will be merged, where, and the memory it needs."""
    c = console(stderr=True)
    c.print(f"merge: {mp.run_dir} + base {mp.base.source} (found via {mp.base.found_via})", markup=False)
    gpu = (f"{mem(mp.needed_bytes)} of GPU memory ({mem(mp.gpu_free_bytes or 0)} free) and "
           if mp.device == "cuda" else "")
    c.print(f"needs {gpu}{mem(mp.ram_bytes)} of host RAM ({mem(mp.host_available_bytes)} available) and "
            f"{mem(mp.disk_bytes)} of disk in {mp.disk_folder} ({mem(mp.disk_free_bytes)} free); "
            f"on the {'GPU' if mp.device == 'cuda' else 'CPU'}: {mp.counted}", markup=False)
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


_STATUS_STYLE = {"finished": "green", "interrupted": "yellow", "failed": "red", "diverged": "red", "stopped": "red"}


def show_runs(runs, folder, as_json: bool = False) -> None:
    if as_json:
        print_json([r.to_dict(full=False) for r in runs])
        return
    c = console()
    if not runs:
        c.print(f"no runs in {folder} (a run folder holds recipe.yaml and plan.json)", markup=False)
        return
    from rich.markup import escape
    from rich.table import Table

    rows = [_run_cells(r, folder) for r in runs]
    if c.width < NARROW_COLUMNS:  # the table's eight columns would collapse: a block per run
        from rich.text import Text

        c.print(f"Runs in {folder} (peak memory: predicted / measured)", markup=False)
        for r, cells in zip(runs, rows, strict=True):
            line = Text(cells["run"] + "  ")
            line.append(cells["status"], style=_STATUS_STYLE.get(r.status, ""))
            line.append(f"  {cells['time']}  peak {cells['peak']}  loss {cells['loss']}")
            c.print(line)
            c.print(Text(f"  {cells['techniques']} · {cells['model']} · recipe {cells['recipe']}"))
        return
    t = Table(title=f"Runs in {folder} (peak memory: predicted / measured)")
    t.add_column("run", no_wrap=True)
    t.add_column("recipe")
    t.add_column("model")
    t.add_column("techniques")
    t.add_column("peak", justify="right")
    t.add_column("loss", justify="right", no_wrap=True)
    t.add_column("time", justify="right", no_wrap=True)
    t.add_column("status", no_wrap=True)
    for r, cells in zip(runs, rows, strict=True):
        style = _STATUS_STYLE.get(r.status, "")
        status = escape(cells["status"])
        t.add_row(*(escape(cells[k]) for k in ("run", "recipe", "model", "techniques", "peak", "loss", "time")),
                  f"[{style}]{status}[/{style}]" if style else status)
    c.print(t)


# `lowvram runs` below this console width lists a block of two lines per run (an 80-column
# terminal would squeeze the table's recipe, model, techniques and peak columns to nothing)
NARROW_COLUMNS = 100


def _run_cells(r, folder) -> dict[str, str]:
    """One run's cells in `lowvram runs` (plain text)."""
    objective = (r.recipe.get("training") or {}).get("objective", "sft")
    margin = r.metrics.get("rewards_margins") if r.metrics is not None else None
    reward = r.metrics.get("reward") if r.metrics is not None else None  # grpo/rloo
    return {
        "run": _relative(r.path, folder), "recipe": r.recipe_name, "model": Path(r.model).name or r.model,
        "techniques": ("" if objective == "sft" else f"{objective}, ") + techniques_label(r.techniques),
        "peak": f"{mem(r.predicted_peak_bytes)} / {mem(r.measured_peak_bytes)}",
        "loss": number_cell(r.final_loss, 3) + (f" (margin {margin:+.3f})" if margin is not None else "")
        + (f" (reward {reward:+.3f})" if reward is not None else ""),
        "time": f"{r.runtime_s:.0f} s" if r.runtime_s is not None else "-",
        "status": r.status + (f", {len(r.exports)} export(s)" if r.exports else "")
        + (f", {len(r.evals)} eval(s)" if r.evals else ""),
    }


def _relative(path: str, folder) -> str:
    try:
        return str(Path(path).relative_to(folder)) if Path(path) != Path(folder) else str(path)
    except ValueError:
        return str(path)


def warn_damaged(runs) -> None:
    """One `warning:` line on stderr per damaged file of the listed runs, naming the run (`lowvram
    runs` exits 0 with them: the other runs are listed; `lowvram show RUN` says how to repair)."""
    lines = [f"warning: run {r.name}: {line}; `lowvram show {r.path}` says how to repair it\n"
             for r in runs for line in r.damaged]
    sys.stderr.write("".join(lines))
    sys.stderr.flush()


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
    g = rec.get("grpo")  # grpo/rloo: the row is the prompt + the completion, not training.seq_len
    rows = (f"prompt {g.get('max_prompt_length', '-')} + completion {g.get('max_completion_length', '-')} tokens, "
            f"{g.get('num_generations', '-')} per prompt" if tr.get("objective") in ("grpo", "rloo") and g
            else f"seq_len {tr.get('seq_len', '-')}")
    c.print(f"model: {r.model}; data: {ds or '-'}; {rows}, batch {tr.get('batch_size', '-')}, "
            f"lr {tr.get('learning_rate', '-')}, max_steps {tr.get('max_steps') or '-'}"
            + (f"; objective {tr['objective']}" if tr.get("objective", "sft") != "sft" else ""), markup=False)
    p = Table(title="Plan")
    p.add_column("technique")
    p.add_column("setting")
    p.add_column("why")
    for name, value in r.techniques.items():
        key = "gradient_accumulation" if name == "grad_accum" else name
        p.add_row(key, setting_cell(value), r.reasons.get(key, ""))
    c.print(p)
    shown = {"gradient_accumulation" if name == "grad_accum" else name for name in r.techniques}
    for key, why in r.reasons.items():  # the plan's other reasons: an OOM retry, the data's length
        if key not in shown:
            c.print(f"{key}: {why}", markup=False, soft_wrap=True)
    m = r.metrics  # RunMetrics, or None without a readable metrics.json
    t = Table(title="Metrics")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("steps", r.steps), ("first train loss", number_cell(r.first_loss)), ("final train loss", number_cell(r.final_loss)),
        ("eval loss", number_cell(r.eval_loss)),
        ("runtime", f"{r.runtime_s:.1f} s" if r.runtime_s is not None else None),
        ("tokens/s", number_cell(m.tokens_per_s, 1) if m is not None and m.tokens_per_s is not None else None),
        ("peak memory (predicted)", mem(r.predicted_peak_bytes)),
        (f"peak memory ({(m.peak_memory_kind if m is not None else None) or 'measured'})", mem(r.measured_peak_bytes)),
        ("trainable / total params", f"{m.trainable_params:,} / {m.total_params:,}"
         if m is not None and m.trainable_params is not None and m.total_params is not None else None),
    ]
    if m is not None and m.worst_batch_peak_bytes is not None:  # training.worst_batch_first
        rows.append((f"worst batch first ({m.worst_batch_tokens} tokens, forward and backward)",
                     mem(m.worst_batch_peak_bytes)))
    if m is not None and m.nonfinite_steps:  # training.on_nonfinite skip
        rows.append(("non-finite steps skipped", ", ".join(str(s) for s in m.nonfinite_steps)))
    # preference objectives: TRL's reward metrics and each objective's own terms (kto's KL, orpo's
    # log odds, orpo's and simpo's NLL), last logged values (lowvram.train.build.preference)
    rows += [(f"{key.replace('_', '/', 1)} (last)", number_cell(m.get(key), 3))
             for key in ("rewards_chosen", "rewards_rejected", "rewards_margins", "rewards_accuracies")
             if m is not None and m.get(key) is not None]
    rows += [(f"{key} (last)", number_cell(m.get(key), 3)) for key in OBJECTIVE_METRIC_KEYS
             if m is not None and m.get(key) is not None]
    rows += _rl_rows(m)
    for k, v in rows:
        t.add_row(k, "-" if v is None else str(v))
    c.print(t)
    history = (m.reward_history if m is not None else None) or []
    if history:
        c.print(f"reward {sparkline([v for _, v in history])}  (steps {history[0][0]}-{history[-1][0]}: "
                f"{history[0][1]:+.3f} -> {history[-1][1]:+.3f})", markup=False)
    margins = (m.get("rewards_margins_history") if m is not None else None) or []
    if margins:
        c.print(f"reward margin {sparkline([v for _, v in margins])}  (steps {margins[0][0]}-{margins[-1][0]}: "
                f"{margins[0][1]:.3f} -> {margins[-1][1]:.3f})", markup=False)
    if r.loss_history:
        finite = [v for _, v in r.loss_history if math.isfinite(v)] or [math.nan]
        c.print(f"loss {sparkline([v for _, v in r.loss_history])}  (steps {r.loss_history[0][0]}-"
                f"{r.loss_history[-1][0]}, {max(finite):.3f} max, {min(finite):.3f} min)", markup=False)
        from lowvram.report.training import warn_climb

        if (m.get("reward") if m is not None else None) is None:  # grpo/rloo: the loss measures no divergence
            warn_climb(r.loss_history)
    if r.eval_history:
        c.print("eval loss: " + ", ".join(f"step {s} {v:.3f}" for s, v in r.eval_history), markup=False)
    c.print(f"checkpoints: {', '.join(r.checkpoints) or 'none'}", markup=False)
    if r.status in ("diverged", "stopped") and r.stop:
        at = f" at step {r.stop['step']}" if r.stop.get("step") is not None else ""
        c.print(f"stopped by lowvram{at}: {r.stop.get('message', '')}", markup=False)
        if r.stop.get("hint"):
            c.print(f"hint: {r.stop['hint']}", markup=False)
    if r.status in ("interrupted", "stopped"):  # stopped: its cause mended (e.g. the reward code), it goes on
        from lowvram.past_runs import resume_command

        # The run's other --set flags are in its recipe.yaml; output_dir is the one that locates it.
        here = f"training.output_dir={Path(r.path).resolve()}"
        lead = "resume with" if r.status == "interrupted" else "once mended, resume with"
        c.print(f"{lead}: {resume_command(r.recipe_path or 'RECIPE', [here])}", markup=False)
    if r.files:
        c.print(f"files: {', '.join(r.files)}", markup=False)
    from lowvram.report.exports import export_rows

    for row in export_rows(list(r.exports)):
        c.print(f"export: {row}", markup=False)
    from lowvram.report.evals import eval_lines

    for line in eval_lines(list(r.evals)):
        c.print(f"eval: {line}", markup=False)


def _rl_rows(m) -> list[tuple[str, str | None]]:
    """grpo/rloo: the reward (last logged mean +- std), each reward function's, the completion
    length, the truncated completions and the clip ratio (metrics.json, lowvram.train.build.grpo)."""
    if m is None or m.reward is None:
        return []
    rows = [("reward (last, mean ± std)", f"{m.reward:+.3f} ± {m.reward_std or 0:.3f}")]
    rows += [(f"reward {name} (last)", f"{f.get('mean', 0):+.3f} ± {f.get('std', 0):.3f}")
             for name, f in (m.reward_functions or {}).items()]
    if m.completion_length is not None:
        rows.append(("completion length (last, tokens)", number_cell(m.completion_length, 1)))
    if m.truncated_completions is not None:
        rows.append(("completions cut at max_completion_length", f"{m.truncated_completions:.0%}"))
    if m.clip_ratio is not None:
        rows.append(("clip ratio (last)", number_cell(m.clip_ratio, 3)))
    return rows
