"""`lowvram plan` for grpo/rloo: the two phases, the binding moment, the engine's share; the
generation table (`--generation-table`). Printing only: the numbers come from lowvram.plan.memory.grpo."""

from __future__ import annotations

from lowvram.plan.memory.moments import MOMENTS
from lowvram.report.console import console, print_json
from lowvram.units import gib


def show_grpo_phases(c, data: dict) -> None:
    """The generation side of a grpo/rloo plan, before the chosen setup."""
    g = data["grpo"]
    c.print(f"objective {data['objective']}: {g['num_generations']} completions per prompt, prompt "
            f"{g['max_prompt_length']} + completion {g['max_completion_length']} tokens; batch "
            f"{data['batch_size']} completions per step; generation batch {g['generation_batch_size']} "
            f"({g['generation_rounds_per_step']} round(s) per step, engine {g['generation']}); "
            f"reference: {g['reference']}; old log-probs: {'computed' if g['old_logprobs'] else 'not needed'}",
            markup=False)
    for name in ("generation", "training"):
        p = g["phases"][name]
        mark = "  <- binds" if name == g["binds"] else ""
        what = MOMENTS.get(p["moment"], ("",))[0]
        c.print(f"  {name} phase: peak {gib(p['peak_bytes'])} at {p['moment']}{mark}"
                + (f" ({what})" if what and mark else ""), markup=False)
    share = g["engine_share"]
    value = (f"paged_num_blocks {share['paged_num_blocks']}" if "paged_num_blocks" in share else
             f"vllm_gpu_memory_utilization {share['vllm_gpu_memory_utilization']}"
             if "vllm_gpu_memory_utilization" in share else "no reservation")
    c.print(f"  engine share: {value}, {gib(share['bytes'] or 0)}: {share['reason']}", markup=False)
    c.print(f"  knobs: generation_batch_size: {g['knobs']['generation_batch_size']}; num_generations: "
            f"{g['knobs']['num_generations']}", markup=False)


def show_generation_table(data: dict, as_json: bool = False) -> None:
    """`lowvram plan --generation-table`: per card, the largest num_generations x
    max_completion_length, the plan that reaches it and what binds."""
    if as_json:
        print_json(data)
        return
    from rich.table import Table

    t = Table(title=f"Largest generation per card: {data['model']} ({data['objective']}, prompt "
                    f"{data['max_prompt_length']} tokens)")
    for col, right in (("card", False), ("budget", True), ("generations x completion", True),
                       ("tokens generated", True), ("with", False), ("binds at", False)):
        t.add_column(col, justify="right" if right else "left")
    for r in data["rows"]:
        if not r["plan"]:
            t.add_row(r["card"], gib(r["budget_bytes"]), "does not fit", "-", "-", "-")
            continue
        t.add_row(r["card"], gib(r["budget_bytes"]), f"{r['num_generations']} x {r['max_completion_length']:,}",
                  f"{r['num_generations'] * r['max_completion_length']:,}", r["plan"], r["binds"])
    console().print(t)
    console().print("cards as sold, less the 5% safety margin; one prompt's group per step (batch = "
                    "num_generations); each completion length tried at 8, 16, 32 and 64 generations, the "
                    "most tokens shown; the moments: docs/grpo.md#memory", markup=False)
