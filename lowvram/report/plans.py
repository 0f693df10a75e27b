"""Printing a plan: `lowvram plan` (the dict from lowvram.plan.choose.choose.choice_to_dict, bytes
inside), the plan table before `lowvram train`, --dry-run, --print-launch, --list-models."""

from __future__ import annotations

from lowvram.plan.memory.moments import describe_moment
from lowvram.report.console import console, print_json, setting_cell, techniques_label
from lowvram.units import gib, percent, shell_line


def _plan_table(plan):
    from rich.table import Table

    t = Table(title="Plan", show_lines=False)
    t.add_column("technique")
    t.add_column("setting")
    t.add_column("why")
    for name, value in plan.techniques().items():
        t.add_row(name, setting_cell(value), plan.reasons.get(name, ""))
    t.add_row("micro_batch_size", str(plan.micro_batch_size), f"x {plan.grad_accum} accumulation x {plan.gpus} GPU(s)")
    if "memory" in plan.reasons:  # the architecture could not be read: no prediction
        t.add_row("memory", "not predicted", plan.reasons["memory"])
    if "images" in plan.reasons:  # format image_chat sized on the data (plan/choose/explain.py)
        t.add_row("images", "measured", plan.reasons["images"])
    if "max_pixels" in plan.reasons:  # data.max_pixels auto (plan/choose/pixels.py)
        t.add_row("max_pixels", f"{plan.max_pixels:,}" if plan.max_pixels else "fixed size", plan.reasons["max_pixels"])
    if plan.predicted_peak_bytes is not None:
        budget = gib(plan.budget_bytes) if plan.budget_bytes else "no budget"
        verdict = "does not fit: over the budget" if plan.fits is False else "budget"
        t.add_row("predicted peak", gib(plan.predicted_peak_bytes), f"{verdict} {budget}")
    return t


def _warn_remote_code(c, recipe) -> None:
    if recipe.model.trust_remote_code:
        c.print("warning: model.trust_remote_code is on: Python code shipped with the model will run "
                "on this machine (turn it off unless you trust the model's source)", markup=False)


def show_dry_run(recipe, plan, as_json: bool = False, data=None) -> None:
    """``data``: the data check's report (a rendered sample, token counts), printed after the plan."""
    from lowvram.report.data import data_json, show_data

    if as_json:
        print_json({"recipe": recipe.model_dump(mode="json"), "plan": plan.to_dict(),
                    **({"data": data_json(data)} if data is not None else {})})
        return
    c = console()
    c.print("# resolved recipe (defaults filled in)", markup=False)
    c.print(recipe.to_yaml(), markup=False)
    c.print(_plan_table(plan))
    if data is not None:
        c.print("# the data as the model sees it (`lowvram data RECIPE` shows more)", markup=False)
        show_data(data)
    _warn_remote_code(c, recipe)
    c.print("dry run: nothing was trained.")


def show_plan_brief(recipe, plan) -> None:
    """Printed before the model is loaded (nanoGPT habit: show the numbers that matter first)."""
    c = console()
    c.print(_plan_table(plan))
    _warn_remote_code(c, recipe)
    for note in recipe.notes:  # a data format recognised from the columns
        c.print(f"note: {note}", markup=False)
    tokens = plan.effective_batch * recipe.training.seq_len
    objective = recipe.training.objective
    if objective in ("grpo", "rloo"):  # batch_size counts completions; a row is prompt + completion
        g = recipe.grpo
        tokens = plan.effective_batch * (g.max_prompt_length + g.max_completion_length)
        rounds = max(1, plan.grad_accum // max(1, plan.steps_per_generation))
        c.print(f"objective {objective}: {plan.effective_batch:,} completions per step "
                f"({plan.effective_batch // g.num_generations:,} prompts x {g.num_generations} generations); "
                f"generation batch {plan.generation_batch_size:,} ({rounds} round{'s' * (rounds > 1)} per step, "
                f"engine {plan.generation}), generated, scored by the rewards, then trained on (TRL)", markup=False)
    elif objective == "kto":  # unpaired rows, one forward each (TRL's KTOTrainer)
        c.print(f"objective kto: {plan.effective_batch:,} unpaired completions per step, each labelled "
                "desirable or not, one forward each, plus a no-grad KL forward of mismatched rows (TRL)",
                markup=False)
    elif objective != "sft":  # preference pairs: chosen and rejected, two rows of seq_len each
        tokens *= 2
        c.print(f"objective {objective}: {plan.effective_batch:,} pairs per step, each chosen + rejected "
                "in one forward (TRL)", markup=False)
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


_BAR_WIDTH = 30


def _bar(part: int, whole: int) -> str:
    if whole <= 0 or part <= 0:
        return ""
    return "█" * max(1, round(_BAR_WIDTH * part / whole))


def show_not_fitting(data: dict) -> None:
    """The verdict of a plan that does not fit as an `error:` line on stderr (it would be lost in
    the middle of the plan on stdout), with the changes that would fit, ranked."""
    from lowvram.errors import LowvramError
    from lowvram.report.console import print_error

    peak, head = data["peak_bytes"], data["headroom_bytes"]
    if head >= 0:
        verdict = (f"does not fit: the lowest-memory plan peaks at {gib(peak)} on the card but needs "
                   f"{gib(data['cpu_ram_bytes'])} of host RAM, more than the {gib(data['host_ram_bytes'])} "
                   f"{data['host_ram_source']}")
    else:
        verdict = (f"does not fit: the lowest-memory plan peaks at {gib(peak)}, {gib(-head)} over the "
                   f"{gib(data['budget_bytes'])} budget")
    changes = list(data.get("suggestions") or [])
    if head >= 0:
        changes.insert(0, "--host-ram SIZE plans for a machine with more host RAM")
    if changes:
        verdict += "; changes that would fit, the smallest first:\n" + "\n".join(f"  {c}" for c in changes)
    print_error(LowvramError(verdict, "apply one of the changes above (as a flag, or the recipe key it names) "
                                      "and run `lowvram plan` again"))


def show_plan(data: dict, as_json: bool = False) -> None:
    """The chosen setup with reasons, the breakdown, headroom, ladder and limits."""
    if as_json:
        print_json(data)
        return
    from rich.table import Table

    c = console()
    n = data["parameters"]
    c.print(f"[bold]lowvram plan[/bold]: {data['model']} ({n / 1e9:.2f}B params), seq_len {data['seq_len']}"
            f"{' packed' if data.get('packing') else ''}, batch {data['batch_size']}, {data['device']}")
    c.print(f"budget: {gib(data['vram_bytes'])} ({data['vram_source']}) - safety margin "
            f"{gib(data['safety_margin_bytes'])} = {gib(data['budget_bytes'])}")
    if data["device"] != "cpu" and data.get("host_ram_source"):
        other = "; --host-ram SIZE plans for another machine" if "--host-ram" not in data["host_ram_source"] else ""
        c.print(f"host RAM: {gib(data['host_ram_bytes'])} ({data['host_ram_source']}{other})", markup=False)
    if data.get("grpo"):  # grpo/rloo: generation, then training on the completions (lowvram.plan.memory.grpo)
        from lowvram.report.grpo import show_grpo_phases

        show_grpo_phases(c, data)
    elif data.get("objective"):  # dpo/orpo/simpo: chosen + rejected in one forward (lowvram.plan.memory.preference)
        rows = ("each example is 1 row of seq_len (an unpaired completion)" if data["objective"] == "kto"
                else "each pair is 2 rows of seq_len (chosen + rejected)")
        c.print(f"objective: {data['objective']}: {rows}; reference model: {data['reference_model']}", markup=False)
    vision = data.get("vision")
    if vision:  # a multimodal checkpoint (lowvram.plan.model.vision)
        c.print(f"vision tower: {vision['tower']} ({vision['layers']} layers) + {vision['projector']} "
                f"projector, {vision['parameters'] / 1e6:.1f}M params, loaded with the language model, "
                f"frozen and not quantized: {gib(vision['weight_bytes'])} of the weights; "
                + (f"{vision['tokens_per_image']} tokens per image" if not vision.get("cross_attention")
                   else "its images reach the language model through cross-attention (one token an image)")
                + (f"; {data['images_per_row']} image(s) per row ("
                   + ("measured on the data" if data["reasons"].get("images") else "data.images_per_row")
                   + "): their tokens in seq_len, their pixels and the tower's forward counted"
                   if data.get("images_per_row") else ""),
                markup=False)
        if data["reasons"].get("images"):  # sized on the data's images (plan/choose/explain.py)
            c.print(f"images: {data['reasons']['images']}", markup=False)
        image = vision.get("image")
        if image:  # the largest image the plan sizes for (lowvram.plan.model.image_size)
            limit = (f"data.max_pixels {image['max_pixels']:,} (min {image['min_pixels']:,}): "
                     if image.get("max_pixels") and not data["reasons"].get("images") else "")
            binds = " (binds: the peak)" if data.get("peak_moment") == "vision_encoder_forward" else ""
            c.print(f"images: {limit}up to {image['tokens_per_image']:,} tokens an image ({image['patches_per_image']:,} "
                    f"patches in the tower, {gib(image['pixel_values_bytes'])} of pixel values); the tower's forward "
                    f"(vision_encoder_forward) {gib(image['encoder_forward_bytes'])} beside the weights{binds}",
                    markup=False)
        cross = vision.get("cross_attention")
        if cross:  # Llama-3.2-Vision (lowvram.plan.model.models.ModelSpec.cross_attention_layers)
            state = ("trained with the images (LoRA: adapters where lora.target_modules names their Linears), "
                     "their activations and their keys and values over the tiles counted" if cross.get("trained")
                     else "frozen, no adapters): {w} of the weights; skipped without images, so they hold no "
                     "activations")
            c.print(f"cross-attention layers: {cross['layers']} of the language model, "
                    f"{cross['parameters'] / 1e6:.1f}M params, loaded ({'quantized, ' if cross['quantized'] else ''}"
                    + (f"{gib(cross['weight_bytes'])} of the weights): {state}" if cross.get("trained")
                       else state.format(w=gib(cross['weight_bytes']))), markup=False)
    for note in data.get("notes", ()):
        c.print(f"note: {note}", markup=False)

    t = Table(title="Chosen setup")
    t.add_column("technique")
    t.add_column("setting")
    t.add_column("why")
    for name, value in data["techniques"].items():
        t.add_row(name, setting_cell(value), data["reasons"].get(name, ""))
    auto = data.get("max_pixels_auto")
    if auto:  # data.max_pixels auto (plan/choose/pixels.py): the size chosen and what it costs
        t.add_row("max_pixels", f"{auto['max_pixels']:,}" if auto["applies"] else "fixed size",
                  data["reasons"].get("max_pixels", ""))
    c.print(t)

    peak = data["peak_bytes"]
    sim = data.get("simulated")  # `lowvram plan --simulate`
    b = Table(title=f"Peak memory ({_peak_title(data)})")
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
        if name == "weights" and vision:
            b.add_row("  vision tower", gib(vision["weight_bytes"]), *([""] if sim else []),
                      "", *([""] if checked else []))
            if vision.get("cross_attention"):
                b.add_row("  cross-attention", gib(vision["cross_attention"]["weight_bytes"]),
                          *([""] if sim else []), "", *([""] if checked else []))
        if name == "allocator" and data.get("allocator"):
            for label, part_bytes in _allocator_rows(data["allocator"]):
                b.add_row(label, gib(part_bytes), *([""] if sim else []), "", *([""] if checked else []))
    extra = [f"[bold]{gib(sim['peak_bytes'])}[/bold]"] if sim else []
    b.add_row("[bold]peak[/bold]", f"[bold]{gib(peak)}[/bold]", *extra, "", *([""] if checked else []))
    c.print(b)
    moment = describe_moment(data.get("peak_moment", ""), data.get("techniques") or {})
    if moment:
        c.print(f"peak at {data['peak_moment']}: {moment}", markup=False)
    for note in (sim or {}).get("notes", ()):
        c.print(f"note: {note}", markup=False)
    if sim:
        c.print(f"simulated (the real step on fake tensors, {sim['seconds']:.1f} s): peak "
                f"{gib(sim['peak_bytes'])} ({sim['peak_phase'].replace('_', ' ')}); analytic "
                f"{gib(sim['analytic_peak_bytes'])}, {100 * sim['difference']:+.2f}% vs simulated")
    head = data["headroom_bytes"]
    if data["fits"]:
        of = f" of {gib(data['host_ram_bytes'])}" if data.get("host_ram_bytes") and data["device"] != "cpu" else ""
        c.print(f"[green]fits[/green]: peak {gib(peak)} of {gib(data['budget_bytes'])} budget, "
                f"{gib(head)} headroom; host RAM needed {gib(data['cpu_ram_bytes'])}{of}")
        if data.get("gpus", 1) > 1:
            n = data["gpus"]
            c.print(f"{n} GPUs: {gib(peak)} per GPU, host RAM {gib(data['cpu_ram_bytes'])} per GPU process "
                    f"({gib(n * data['cpu_ram_bytes'])} for {n} processes on one node); "
                    f"train with: lowvram train RECIPE --gpus {n}", markup=False)
    elif head >= 0:  # the card holds it; host RAM does not (lowvram.plan.choose.request.fits_budget)
        c.print(f"[red]does not fit[/red]: the lowest-memory plan peaks at {gib(peak)} on the card, but needs "
                f"{gib(data['cpu_ram_bytes'])} of host RAM, more than the {gib(data['host_ram_bytes'])} "
                f"{data['host_ram_source']}: it would swap (--host-ram SIZE plans for a machine with more)",
                markup=True)
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
    ladder.add_column("fits", no_wrap=True)
    usable = data["budget_bytes"]
    for r in data["ladder"]:
        # "no (host RAM)": the card holds the peak, this machine's RAM not what the rung offloads
        fits = "[green]yes[/green]" if r["fits"] else "no (host RAM)" if r["peak_bytes"] <= usable else "no"
        if r["fixed"]:
            ladder.add_row(r["technique"], "fixed by you", gib(r["peak_bytes"]), "-", "-", fits)
            continue
        speed = "-" if r["technique"] == "baseline" else percent(r["slowdown"])
        saves = ("-" if r["technique"] == "baseline" else gib(r["saved_bytes"]) if r["saved_bytes"] >= 0
                 else f"adds {gib(-r['saved_bytes'])}")  # a rung can cost memory (a chunk sized to the budget)
        ladder.add_row(r["technique"], r["value"], gib(r["peak_bytes"]), saves, speed, fits)
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

    if data.get("grpo"):
        c.print("how far the budget goes: lowvram plan --objective grpo ... --generation-table", markup=False)
        return
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
    from lowvram.plan.memory.calibration import CHECKED

    return [CHECKED.get(checked.get(name, ""), "-")]


def _plan_label(alt: dict) -> str:
    return f"{techniques_label(alt['techniques'])}, micro {alt['micro_batch_size']}x{alt['grad_accum']}"


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


def show_context_table(data: dict, as_json: bool = False) -> None:
    """`lowvram plan --context-table`: the longest seq_len on each card size, its plan, what binds."""
    if as_json:
        print_json(data)
        return
    from rich.table import Table

    t = Table(title=f"Longest seq_len over every plan: {data['model']}")
    t.add_column("card")
    t.add_column("budget", justify="right")
    t.add_column("longest seq_len", justify="right")
    t.add_column("host RAM", justify="right")
    t.add_column("with")
    t.add_column("one token more binds at")
    beyond = False
    for r in data["rows"]:
        if not r["plan"]:
            t.add_row(r["card"], gib(r["budget_bytes"]), "does not fit", "-", "-", "-")
            continue
        beyond |= r["beyond_positions"]
        t.add_row(r["card"], gib(r["budget_bytes"]), f"{r['longest_seq_len']:,}" + ("*" if r["beyond_positions"] else ""),
                  gib(r["host_ram_bytes"]), r["techniques_used"], r["binds"] or "(the search's end)")
    c = console()
    c.print(t)
    if beyond:
        c.print(f"* past the model's max_position_embeddings ({data['max_position_embeddings']:,}): the memory "
                "fits, the model needs RoPE scaling to use it", markup=False)
    c.print("cards as sold (--vram NGB: 97.5% of N GiB as CUDA reports it), less the 5% safety margin; "
            f"batch 1; host RAM up to {gib(data['host_ram_bytes'])} ({data['host_ram_source']}); "
            "the moments: docs/planner.md#long-context", markup=False)


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


def _allocator_rows(alloc: dict) -> list[tuple[str, int]]:
    """The allocator term's parts as breakdown rows: the share and the bytes it is taken on."""
    mode = "expandable segments" if alloc["expandable_segments"] else "no expandable segments"
    names = {"loaded_once": "  loaded once: {} x {} (weights, optimizer)", "churn": "  churn: {} x {} (" + mode + ")"}
    return [(names[k].format(f"{100 * alloc['fractions'][k]:g}%", gib(alloc["on_bytes"][k])), alloc["parts"][k])
            for k in ("loaded_once", "churn")]


def _peak_title(data: dict) -> str:
    """The phase, and the named moment when it is one of forward + backward's."""
    phase = data["peak_phase"].replace("_", " ")
    moment = data.get("peak_moment", "")
    return f"{phase}: {moment}" if moment and moment != data["peak_phase"] else phase
