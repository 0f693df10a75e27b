"""Printing `lowvram eval`: the plan (before loading, on stderr), base vs trained side by side, and
a run's evaluations for `show` and `runs`."""

from __future__ import annotations

import sys

from lowvram.report.console import console, print_json
from lowvram.units import mem


def show_eval_plan(plan) -> None:
    c = console(stderr=True)
    what = f"base + adapter {plan.run_dir}" if plan.kind == "adapter" else f"full model {plan.run_dir}"
    c.print(f"eval: {what} against its base {plan.base_source}", markup=False)
    c.print(f"data: {plan.data}: {plan.rows} rows, {plan.tokens:,} trained tokens; {plan.answers} answered "
            f"by greedy generation" + (f"; lm-eval tasks: {', '.join(plan.tasks)}" if plan.tasks else ""), markup=False)
    context = " + the CUDA context" if plan.device == "cuda" else ""
    where = "GPU" if plan.device == "cuda" else "CPU"
    c.print(f"needs {mem(plan.needed_bytes)} (weights {mem(plan.weights_bytes)} + logits {mem(plan.logits_bytes)}{context}); "
            f"on the {where} ({mem(plan.available_bytes)} available)", markup=False)
    for note in plan.notes:
        c.print(f"note: {note}", markup=False)


def progress(text: str) -> None:
    sys.stderr.write(f"{text}\n")
    sys.stderr.flush()


def score_rows(base: dict, trained: dict) -> list[tuple[str, str, str, str]]:
    """(metric, base, trained, change) rows: loss and perplexity (lower is better), exact match and
    contains (fractions), then each lm-eval task metric."""
    rows = [("held-out loss", _num(base.get("loss")), _num(trained.get("loss")), _diff(base.get("loss"), trained.get("loss"))),
            ("perplexity", _num(base.get("perplexity"), 2), _num(trained.get("perplexity"), 2),
             _ratio(base.get("perplexity"), trained.get("perplexity")))]
    for key, label in (("exact_match", "exact match"), ("contains", "contains answer")):
        if base.get(key) is not None or trained.get(key) is not None:
            rows.append((label, _pct(base.get(key)), _pct(trained.get(key)), _points(base.get(key), trained.get(key))))
    tasks = dict(base.get("tasks") or {})
    for name, value in (trained.get("tasks") or {}).items():
        rows.append((name, _num(tasks.get(name)), _num(value), _diff(tasks.get(name), value)))
    return rows


def show_eval_result(result, as_json: bool = False) -> None:
    if as_json:
        print_json(result.to_dict())
        return
    from dataclasses import asdict

    from rich.table import Table

    c = console()
    p = result.plan
    t = Table(title=f"{p.run_dir}: base vs trained on {p.data}")
    for col in ("", "base", "trained", "change"):
        t.add_column(col, justify="left" if not col else "right")
    for row in score_rows(asdict(result.base), asdict(result.trained)):
        t.add_row(*row)
    c.print(t)
    answered = (f"; exact match / contains over {p.answers} greedy answers (normalised: case, spaces, trailing "
                "punctuation; numbers as numbers)" if p.answers else "")
    c.print(f"{p.rows} rows, {p.tokens:,} trained tokens{answered}; {result.seconds:.1f} s on "
            f"{'the GPU' if p.device == 'cuda' else 'the CPU'}", markup=False, style="dim")
    for (where, ref, before), (_, _, after) in zip(result.base.samples, result.trained.samples, strict=False):
        c.print(f"  {where}: expected {_short(ref)!r}; base {_short(before)!r}; trained {_short(after)!r}", markup=False)
    if result.recorded:
        c.print(f"recorded in {result.recorded}", markup=False)


def eval_lines(evals: list[dict]) -> list[str]:
    """One line per evaluation of a run (show)."""
    out = []
    for e in evals:
        b, t = e.get("base") or {}, e.get("trained") or {}
        line = (f"{e.get('data')} ({e.get('rows')} rows): loss {_num(b.get('loss'))} -> {_num(t.get('loss'))}, "
                f"perplexity {_num(b.get('perplexity'), 2)} -> {_num(t.get('perplexity'), 2)}")
        if t.get("exact_match") is not None:
            line += f", exact match {_pct(b.get('exact_match'))} -> {_pct(t.get('exact_match'))}"
        for name, value in (t.get("tasks") or {}).items():
            line += f", {name} {_num((b.get('tasks') or {}).get(name))} -> {_num(value)}"
        out.append(line + (f" [{e['when']}]" if e.get("when") else ""))
    return out


def _num(x, nd: int = 4) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _diff(a, b) -> str:
    return "-" if a is None or b is None else f"{b - a:+.4f}"


def _ratio(a, b) -> str:
    return "-" if not a or b is None else f"{b / a - 1:+.1%}"


def _points(a, b) -> str:
    return "-" if a is None or b is None else f"{(b - a) * 100:+.1f} pts"


def _short(text: str, n: int = 60) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."
