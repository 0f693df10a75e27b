"""All printing happens here: rich tables for people, JSON for scripts. No arithmetic.

rich is imported inside the functions (``lowvram --help`` must stay instant). rich turns colour
off by itself when stdout is not a terminal; NO_COLOR is honoured too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def gib(n: int | float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB"


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
        shown = {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)
        t.add_row(name, shown, plan.reasons.get(name, ""))
    t.add_row("micro_batch_size", str(plan.micro_batch_size), f"x {plan.grad_accum} accumulation x {plan.gpus} GPU(s)")
    if plan.predicted_peak_bytes is not None:
        budget = gib(plan.budget_bytes) if plan.budget_bytes else "no budget"
        t.add_row("predicted peak", gib(plan.predicted_peak_bytes), f"budget {budget}")
    return t


def show_dry_run(recipe, plan, as_json: bool = False) -> None:
    if as_json:
        print_json({"recipe": recipe.model_dump(mode="json"), "plan": plan.to_dict()})
        return
    c = console()
    c.print("# resolved recipe (defaults filled in)", markup=False)
    c.print(recipe.to_yaml(), markup=False)
    c.print(_plan_table(plan))
    c.print("dry run: nothing was trained.")


def show_plan_brief(recipe, plan) -> None:
    """Printed before the model is loaded (nanoGPT habit: show the numbers that matter first)."""
    c = console()
    c.print(_plan_table(plan))
    tokens = plan.effective_batch * recipe.training.seq_len
    c.print(f"tokens per optimizer step (at most): {tokens:,}")


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
        ("peak memory (measured)", gib(m.get("peak_memory_bytes"))),
        ("peak memory (predicted)", gib(m.get("predicted_peak_bytes"))),
    ]
    for k, v in rows:
        t.add_row(k, "-" if v is None else str(v))
    console().print(t)


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
