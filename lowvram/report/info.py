"""Printing what is not a plan or a run: `lowvram validate`, `lowvram keys` (also docs/recipes.md's
recipe reference), `lowvram env`."""

from __future__ import annotations

import sys
from pathlib import Path

from lowvram.report.console import console, print_json
from lowvram.units import gib


def show_validated(recipe, path: Path, data=None, as_json: bool = False) -> None:
    """``data``: the data check's report (lowvram.train.data.check.DataReport), printed below."""
    if as_json:
        out = {"valid": True, "recipe": recipe.model_dump(mode="json")}
        if data is not None:
            from lowvram.report.data import data_json

            out["data"] = data_json(data)
        print_json(out)
        return
    c = console()
    ds = ", ".join(f"{d.path} ({d.format})" for d in recipe.data.datasets)
    t, g = recipe.training, recipe.grpo
    if t.objective in ("grpo", "rloo"):  # rows are prompt + completion; the rewards were called on a sample
        names = ", ".join(r if isinstance(r, str) else r.function for r in g.rewards)
        shape = (f"{t.objective}: {t.batch_size} completions per step, {g.num_generations} per prompt, up to "
                 f"{g.max_prompt_length} + {g.max_completion_length} tokens; rewards {names} (each scored a sample row)")
    else:
        shape = f"seq_len {t.seq_len}, batch {t.batch_size}"
    c.print(f"[green]ok[/green] {path}: model {recipe.model.name_or_path}; data {ds}; {shape}", markup=True)
    if data is not None:
        from lowvram.report.data import data_lines, print_image_table

        print_image_table(c, data)
        for line in data_lines(data):
            c.print(f"  {line}", markup=False)


def keys_markdown(rows) -> str:
    """The recipe reference as a Markdown table (also in docs/recipes.md, written by lowvram.docs; a test keeps them equal)."""
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
