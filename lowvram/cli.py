"""The `lowvram` command line: each command parses, calls one library function, renders.

No torch, transformers, peft, datasets or rich at import time: `lowvram --help` stays instant.
Errors the user can fix are printed as one `error:` line and one `hint:` line on stderr, with the
exit codes documented in :mod:`lowvram.errors`.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated

import typer

from lowvram import cliparams, vocab
from lowvram.errors import EXIT_USAGE, LowvramError
from lowvram.report.console import print_error

cliparams.install()  # Typer builds an option's pydantic adapter only for a value that needs one
app = typer.Typer(
    name="lowvram",
    help="Fine-tune LLMs on the GPU you have: plan peak memory, pick memory techniques, train.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def handle_errors(fn):
    """Turn LowvramError into `error:`/`hint:` on stderr and its exit code (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LowvramError as err:
            print_error(err)
            raise typer.Exit(err.exit_code) from None
        except KeyboardInterrupt:  # click would turn it into "Aborted!" and exit 1
            sys.stderr.write("\nerror: interrupted\n")
            raise typer.Exit(130) from None

    return wrapper


RecipeArg = Annotated[Path, typer.Argument(help="Path to a YAML recipe.", show_default=False, metavar="RECIPE")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a recipe key, e.g. --set training.learning_rate=1e-4 (repeatable)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object (for scripts).")]


@app.command()
@handle_errors
def validate(recipe: RecipeArg, set_: SetOpt = None, json_: JsonOpt = False,
             gpus: Annotated[int, typer.Option("--gpus", min=1, help="Processes the run will have (`train --gpus N`): grpo/rloo's generation batch is checked against them.")] = 1) -> None:
    """Check a recipe without loading anything heavy; report every problem at once."""
    from lowvram.planning.from_recipe import check_grpo_processes
    from lowvram.recipe import load_recipe
    from lowvram.report.info import show_validated

    r = load_recipe(recipe, set_ or [])
    check_grpo_processes(r, gpus)  # TRL's rule on the generation batch with that many processes
    from lowvram.train.run.preflight import check_inputs, check_seq_len, check_shape

    check_seq_len(r)  # seq_len past the model's positions (the catalog knows them with nothing downloaded)
    check_inputs(r)  # files, the model folder, or a hub model that cannot be downloaded now
    check_shape(r)  # a batch the local rows cannot fill
    if r.training.objective in ("grpo", "rloo"):  # the rewards import and score a sample row (no model)
        from lowvram.train.build.grpo import check_grpo

        check_grpo(r)
    from lowvram.train.run.preflight import check_recipe_data

    show_validated(r, recipe, check_recipe_data(r), as_json=json_)  # every row, as training reads it


@app.command()
@handle_errors
def data(
    recipe: RecipeArg,
    set_: SetOpt = None,
    samples: Annotated[int, typer.Option("--samples", "-n", min=0, help="Rendered samples to print.")] = 3,
    json_: JsonOpt = False,
) -> None:
    """Show the data as the model will see it: rendered samples with the trained tokens marked,
    token lengths, what seq_len cuts; every row checked against its format (no model loaded)."""
    from lowvram.recipe import load_recipe
    from lowvram.report.data import show_data
    from lowvram.train.run.preflight import check_inputs, check_recipe_data

    r = load_recipe(recipe, set_ or [])
    check_inputs(r)
    show_data(check_recipe_data(r, samples=samples), as_json=json_)


@app.command()
@handle_errors
def train(
    recipe: RecipeArg,
    set_: SetOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the resolved recipe and plan, then exit.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the last checkpoint in output_dir.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a finished run in output_dir.")] = False,
    vram: Annotated[str | None, typer.Option("--vram", help="GPU memory to plan for: 24GB is a card sold as 24 GB (97.5% of 24 GiB, as CUDA reports it); 24GiB, 22000MB are exact (default: detected).")] = None,
    json_: JsonOpt = False,
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs (processes) per node; > 1 launches accelerate with DDP, FSDP or DeepSpeed as the plan chose.")] = 1,
    nodes: Annotated[int, typer.Option("--nodes", min=1, help="Machines; run the same command on each with its --node-rank.")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", min=0, help="This machine's rank (0 = the main node).")] = 0,
    main_address: Annotated[str | None, typer.Option("--main-address", help="HOST:PORT of node 0 (several nodes).", metavar="HOST:PORT")] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="Run the processes on the CPU (gloo); the default without a GPU.")] = False,
    rdzv_timeout: Annotated[int, typer.Option("--rdzv-timeout", min=1, help="Seconds the nodes wait for each other at start-up.")] = 300,
    print_launch: Annotated[bool, typer.Option("--print-launch", help="Write the accelerate config into output_dir, print the launch command, do not train.")] = False,
    no_track_memory: Annotated[bool, typer.Option("--no-track-memory", help="CPU runs: do not measure live tensor bytes (the measured peak is then process RSS; ~5-30% faster on tiny models).")] = False,
    max_retries: Annotated[int, typer.Option("--max-retries", min=0, help="Out of memory: re-plan cheaper and retry at most this many times.")] = 3,
    no_recover: Annotated[bool, typer.Option("--no-recover", help="Out of memory: stop with the error instead of re-planning.")] = False,
) -> None:
    """Fine-tune a model as the recipe says, with the memory techniques the plan chose."""
    from lowvram.report.training import show_started, show_train_outcome
    from lowvram.session import train_recipe
    from lowvram.train.types import LaunchSpec, TrainOptions

    options = TrainOptions(
        recipe_path=recipe, overrides=tuple(set_ or ()), vram=vram, dry_run=dry_run, resume=resume,
        overwrite=overwrite, print_launch=print_launch, track_memory=not no_track_memory,
        recover=not no_recover, max_retries=max_retries,
        processes=LaunchSpec(gpus=gpus, nodes=nodes, node_rank=node_rank, main_address=main_address, cpu=cpu,
                             rdzv_timeout_s=rdzv_timeout),
    )
    outcome = train_recipe(options, started=show_started)
    show_train_outcome(outcome, as_json=json_)
    if outcome.exit_code != 0:
        raise typer.Exit(outcome.exit_code)


def _opt(flag: str | list[str], help_: str, metavar: str | None = None):
    """An option; ``flag`` a list: its canonical spelling first, then the aliases kept."""
    flags = [flag] if isinstance(flag, str) else flag
    return typer.Option(*flags, help=help_, metavar=metavar, show_default=False)


def _values(values: tuple[str, ...], note: str | None = None) -> str:
    """A flag's help from the vocabulary: 'a | b | c (note).'"""
    return " | ".join(values) + (f" ({note})." if note else ".")


@app.command()
@handle_errors
def plan(
    recipe: Annotated[Path | None, typer.Argument(help="Optional YAML recipe; flags override it.", show_default=False, metavar="[RECIPE]")] = None,
    model: Annotated[str | None, _opt("--model", "Catalog name, hub id or folder with config.json.", "M")] = None,
    method: Annotated[str | None, _opt("--method", "full | lora | qlora (shorthand for lora + quantization).", "METHOD")] = None,
    lora_r: Annotated[int | None, _opt("--lora-r", "LoRA rank.", "N")] = None,
    lora_targets: Annotated[str | None, _opt("--lora-targets", "q_proj,v_proj | all-linear | ...", "LIST")] = None,
    mixed_precision: Annotated[str | None, _opt(["--mixed-precision", "--precision"], _values(vocab.PRECISIONS), "P")] = None,
    quantization: Annotated[str | None, _opt(["--quantization", "--quant"], _values(vocab.QUANTIZATIONS, "needs LoRA"), "Q")] = None,
    optimizer: Annotated[str | None, _opt(["--optimizer", "--optim"], _values(vocab.OPTIMIZERS), "O")] = None,
    loss: Annotated[str | None, _opt("--loss", _values(vocab.LOSSES), "L")] = None,
    attention: Annotated[str | None, _opt(["--attention", "--attn"], _values(vocab.ATTENTIONS), "A")] = None,
    batch_size: Annotated[int | None, _opt("--batch-size", "Effective batch = micro_batch_size x grad_accum x GPUs (default 16).", "N")] = None,
    seq_len: Annotated[int | None, _opt("--seq-len", "Tokens per sample (default 1024).", "N")] = None,
    gradient_accumulation: Annotated[int | None, _opt(["--gradient-accumulation", "--grad-accum"], "Fix the accumulation steps (micro-batch follows).", "N")] = None,
    gradient_checkpointing: Annotated[bool | None, typer.Option("--gradient-checkpointing/--no-gradient-checkpointing", help="Fix gradient checkpointing on or off.", show_default=False)] = None,
    activation_offload: Annotated[bool | None, typer.Option("--activation-offload/--no-activation-offload", help="Fix activation offloading (checkpointed layer inputs in pinned host RAM; needs checkpointing, a GPU) on or off.", show_default=False)] = None,
    tiled_mlp: Annotated[str | None, _opt("--tiled-mlp", "auto | on | off | N: each layer's MLP over the sequence in N shards, recomputed shard by shard (on: ceil(seq_len / hidden_size)); ~20% slower.", "T")] = None,
    packing: Annotated[bool | None, typer.Option("--packing/--no-packing", help="Plan for data.packing: several samples per seq_len window (SDPA then keeps a b x s x s mask per layer).", show_default=False)] = None,
    images_per_row: Annotated[int | None, _opt("--images-per-row", "Plan image + text rows of up to N images (data.images_per_row; a vision model).", "N")] = None,
    max_pixels: Annotated[str | None, _opt("--max-pixels", "Qwen-VL: the largest image in pixels (data.max_pixels; default the processor's, 1003520): bounds each image's tokens; auto: lowered on the processor's grid only if nothing fits. Implies --images-per-row 1.", "N|auto")] = None,
    min_pixels: Annotated[int | None, _opt("--min-pixels", "Qwen-VL: the smallest image in pixels (data.min_pixels).", "N")] = None,
    gpus: Annotated[int | None, _opt("--gpus", "Data-parallel GPUs (default 1).", "N")] = None,
    offload: Annotated[str | None, _opt("--offload", _values(vocab.OFFLOADS, "the last six: several GPUs"), "KIND")] = None,
    objective: Annotated[str | None, _opt("--objective", "sft | dpo | orpo | simpo | kto | grpo | rloo (training.objective; preference: 2 rows per pair, kto 1 row, DPO and KTO a reference; grpo/rloo: generation, then training on the completions).", "OBJ")] = None,
    num_generations: Annotated[int | None, _opt("--num-generations", "grpo/rloo: completions per prompt (grpo.num_generations, default 8; the search never lowers it).", "N")] = None,
    max_completion_length: Annotated[int | None, _opt("--max-completion-length", "grpo/rloo: tokens generated per completion (default 256).", "N")] = None,
    max_prompt_length: Annotated[int | None, _opt("--max-prompt-length", "grpo/rloo: prompt tokens (default 512).", "N")] = None,
    generation_batch_size: Annotated[int | None, _opt("--generation-batch-size", "grpo/rloo: completions per generation round, all GPUs (default: auto, the batch size or less).", "N")] = None,
    beta: Annotated[float | None, _opt("--beta", "grpo/rloo: KL weight; > 0 adds reference log-probs (a frozen copy under full fine-tuning).", "F")] = None,
    generation: Annotated[str | None, _opt("--generation", "grpo/rloo: auto | generate | paged | vllm (the engine).", "E")] = None,
    generation_table: Annotated[bool, typer.Option("--generation-table", help="grpo/rloo: the largest num_generations x max_completion_length on 8-80 GB cards, the plan that reaches it and what binds.")] = False,
    vram: Annotated[str | None, _opt("--vram", "GPU memory to plan for: 24GB is a card sold as 24 GB (97.5% of 24 GiB, as CUDA reports it); 24GiB, 22000MB are exact (default: LOWVRAM_VRAM, else detected).", "SIZE")] = None,
    host_ram: Annotated[str | None, _opt("--host-ram", "Host RAM the plan may use (offloaded activations and optimizer state, pinned), e.g. 64GiB (default: LOWVRAM_HOST_RAM, else what this machine has available).", "SIZE")] = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
    check: Annotated[bool, typer.Option("--check", help="Exit 0 if the plan fits, 1 if not.")] = False,
    list_models: Annotated[bool, typer.Option("--list-models", help="List the models known without a download.")] = False,
    context_table: Annotated[bool, typer.Option("--context-table", help="The longest seq_len over every plan on 8, 12, 16, 24, 40, 48 and 80 GB cards (batch 1), the plan that reaches it and what binds.")] = False,
    image_table: Annotated[bool, typer.Option("--image-table", help="Qwen-VL: the largest max_pixels on 8-80 GB cards for --images-per-row images (default 1) beside --seq-len text tokens (batch 1), the plan that reaches it and what binds.")] = False,
    simulate: Annotated[bool, typer.Option("--simulate", help="Also run the chosen plan's real training step on fake tensors (exact peak, no allocation; imports torch, ~5-15 s for 7B). Accepts any config.json transformers can build.")] = False,
) -> None:
    """Predict peak memory and pick the cheapest memory techniques that fit the budget.

    Every flag given fixes that choice; the rest is chosen so the run fits --vram. Without a GPU
    and without --vram (or LOWVRAM_VRAM), the plan is for a CPU run in the available host RAM.
    """
    from lowvram.planning import entry
    from lowvram.report.plans import show_models, show_plan, show_unpredicted_plan

    if list_models:
        show_models(entry.list_models(), as_json=json_)
        return
    r = None
    if recipe is not None:
        from lowvram.planning.from_recipe import recipe_model_ref
        from lowvram.recipe import load_recipe

        r = load_recipe(recipe, set_ or [])
    elif set_:  # no recipe: the schema's defaults + the sets (never silently ignored)
        from lowvram.planning.from_recipe import recipe_from_sets

        r = recipe_from_sets(model, set_)
    model_ref = model or (recipe_model_ref(r) if r else None)
    if model_ref:
        _fetch_hub_config(model_ref, explicit=model is not None)
    grpo_flags = dict(num_generations=num_generations, max_completion_length=max_completion_length,
                      max_prompt_length=max_prompt_length, generation_batch_size=generation_batch_size,
                      beta=beta, generation=generation)
    if generation_table:
        from lowvram.errors import UsageError
        from lowvram.report.grpo import show_generation_table

        if vram or simulate or check or context_table:
            given = "--vram" if vram else ("--simulate" if simulate else "--check" if check else "--context-table")
            raise UsageError(f"--generation-table plans every card size itself: {given} does not apply",
                             "drop it, or run `lowvram plan` without --generation-table for one card")
        show_generation_table(entry.generation_table(
            r, model=model, method=method, lora_r=lora_r, lora_targets=lora_targets,
            mixed_precision=mixed_precision, quantization=quantization, optimizer=optimizer,
            attention=attention, batch_size=batch_size, gradient_checkpointing=gradient_checkpointing,
            gpus=gpus, objective=objective, **grpo_flags), as_json=json_)
        return
    if image_table:
        from lowvram.errors import UsageError
        from lowvram.report.image_table import show_image_table

        if given := next((f for f, on in (("--vram", vram), ("--simulate", simulate), ("--check", check),
                                          ("--context-table", context_table), ("--max-pixels", max_pixels)) if on), None):
            raise UsageError(f"--image-table plans every card and image size itself: {given} does not apply",
                             "drop it, or run `lowvram plan --max-pixels N --vram SIZE` for one card and size")
        show_image_table(entry.image_table(
            r, model=model, method=method, lora_r=lora_r, lora_targets=lora_targets,
            mixed_precision=mixed_precision, quantization=quantization, optimizer=optimizer, loss=loss,
            attention=attention, seq_len=seq_len, images_per_row=images_per_row, min_pixels=min_pixels,
            gradient_checkpointing=gradient_checkpointing, activation_offload=activation_offload, gpus=gpus,
            offload=offload, host_ram=host_ram), as_json=json_)
        return
    if context_table:
        from lowvram.errors import UsageError
        from lowvram.plan.serialize import context_table_to_dict
        from lowvram.report.plans import show_context_table

        if vram or simulate or check:
            given = "--vram" if vram else ("--simulate" if simulate else "--check")
            raise UsageError(f"--context-table plans every card size itself: {given} does not apply",
                               "drop it, or run `lowvram plan` without --context-table for one card")
        req, rows, budget = entry.context_table(
            r, model=model, method=method, lora_r=lora_r, lora_targets=lora_targets,
            mixed_precision=mixed_precision, quantization=quantization, optimizer=optimizer, loss=loss,
            attention=attention, batch_size=batch_size or 1, seq_len=seq_len,
            gradient_accumulation=gradient_accumulation, gradient_checkpointing=gradient_checkpointing,
            activation_offload=activation_offload, packing=packing, gpus=gpus, offload=offload,
            tiled_mlp=None if tiled_mlp == "auto" else tiled_mlp, objective=objective, host_ram=host_ram)
        show_context_table(context_table_to_dict(req, rows, budget), as_json=json_)
        return
    if simulate and model_ref:
        from lowvram.check.configs import register_for_simulation

        register_for_simulation(model_ref)
    from lowvram.train.run.preflight import measured_images

    images = measured_images(r) if r and not model and {max_pixels, min_pixels, images_per_row} == {None} else None  # image_chat data
    result = entry.make_plan(
        r, model=model, vram=vram, images=images, method=method, lora_r=lora_r, lora_targets=lora_targets,
        mixed_precision=mixed_precision, quantization=quantization, optimizer=optimizer, loss=loss,
        attention=attention, batch_size=batch_size, seq_len=seq_len,
        gradient_accumulation=gradient_accumulation, gradient_checkpointing=gradient_checkpointing,
        activation_offload=activation_offload, packing=packing, gpus=gpus, offload=offload,
        tiled_mlp=None if tiled_mlp == "auto" else tiled_mlp,
        objective=objective, host_ram=host_ram, images_per_row=images_per_row, max_pixels=max_pixels,
        min_pixels=min_pixels, **grpo_flags,
    )
    from lowvram.plan.choose.request import Choice
    from lowvram.plan.serialize import choice_to_dict

    if not isinstance(result, Choice):
        show_unpredicted_plan(result, r.model.name_or_path if r else str(model), as_json=json_)
        if check:
            raise typer.Exit(1)
        return
    data = choice_to_dict(result)
    if simulate:
        from lowvram.check.simulate import simulate_plan

        data["simulated"] = simulate_plan(result.chosen.setup, model_ref, data["peak_bytes"])
    show_plan(data, as_json=json_)
    if not result.fits:
        from lowvram.report.plans import show_not_fitting

        show_not_fitting(data)  # the verdict on stderr, where a script and a reader both see it
        if check:
            raise typer.Exit(1)


def _fetch_hub_config(model_ref: str, explicit: bool) -> None:
    """A hub id the catalog and the hub cache do not know: fetch its config.json (that file only).
    A recipe's model that cannot be fetched keeps the fixed plan with its note; --model errors."""
    from lowvram.errors import LowvramError
    from lowvram.hub import ensure_config

    try:
        ensure_config(model_ref)
    except LowvramError:
        if explicit:
            raise


@app.command()
@handle_errors
def keys(json_: JsonOpt = False) -> None:
    """List every recipe key with its type, default and meaning (from the schema)."""
    from lowvram.recipe import describe_schema
    from lowvram.report.info import show_keys

    show_keys(describe_schema(), as_json=json_)


@app.command()
@handle_errors
def env(json_: JsonOpt = False) -> None:
    """Print versions and devices: paste this block into bug reports."""
    from lowvram.hardware import collect_env
    from lowvram.report.info import show_env

    show_env(collect_env(), as_json=json_)


@app.command()
@handle_errors
def version() -> None:
    """Print the lowvram version."""
    from lowvram import __version__

    typer.echo(__version__)


RunArg = Annotated[Path, typer.Argument(help="A run folder (training.output_dir of `lowvram train`).", show_default=False, metavar="RUN_DIR")]


@app.command()
@handle_errors
def merge(
    run_dir: RunArg,
    out: Annotated[Path, typer.Option("--out", help="Folder for the merged model (new or empty).", show_default=False, metavar="DIR")],
    dtype: Annotated[str, _opt("--dtype", "auto (the run's weight dtype; a 4/8-bit base: its compute dtype) | bfloat16 | float16 | float32.", "D")] = "auto",
    json_: JsonOpt = False,
) -> None:
    """Merge a run's LoRA adapter into its base model and save a plain transformers folder."""
    from lowvram.report.results import show_merge_plan, show_merge_result
    from lowvram.train.after.merge import merge_run, plan_merge
    from lowvram.train.run.lock import run_lock

    with run_lock(out, "lowvram merge --out"):
        mp = plan_merge(run_dir, out, dtype=dtype)
        if not json_:
            show_merge_plan(mp)
        show_merge_result(merge_run(mp), as_json=json_)


@app.command()
@handle_errors
def export(
    run_dir: Annotated[Path, typer.Argument(help="A run folder (an adapter run is merged on the fly, a full run read as it is) or a checkpoint.", show_default=False, metavar="RUN_DIR")],
    gguf: Annotated[bool, typer.Option("--gguf", help="Write one GGUF file (llama.cpp, Ollama, LM Studio) and an Ollama Modelfile beside it.")] = False,
    quantization: Annotated[str, _opt("--quantization", "f16 (default) | bf16 | q8_0; K-quants (q4_k_m...) through llama.cpp's llama-quantize when one is here.", "Q")] = "f16",
    out: Annotated[Path | None, _opt("--out", "The .gguf file to write (default: RUN_DIR/gguf-Q/NAME-Q.gguf; the Modelfile goes beside it).", "PATH")] = None,
    llama_quantize: Annotated[Path | None, _opt("--llama-quantize", "llama.cpp's llama-quantize for a K-quant (default: the one on PATH); never downloaded or built.", "PATH")] = None,
    json_: JsonOpt = False,
) -> None:
    """Export a run's model to GGUF, read it back and check it against the model, write an Ollama Modelfile."""
    from lowvram.errors import UsageError
    from lowvram.report.exports import show_export_plan, show_export_result
    from lowvram.train.after.export import export_run, plan_export

    if not gguf:
        raise UsageError("pass --gguf (the one export format so far)", "e.g. lowvram export runs/quickstart --gguf --quantization q8_0")
    ep = plan_export(run_dir, quantization.lower(), out, llama_quantize)
    if not json_:
        show_export_plan(ep)
    show_export_result(export_run(ep), as_json=json_)


@app.command()
@handle_errors
def generate(
    run_dir: Annotated[Path, typer.Argument(help="A run folder, a checkpoint or a merged folder.", show_default=False, metavar="RUN_DIR")],
    prompt: Annotated[str | None, _opt("--prompt", "Text to answer.", "TEXT")] = None,
    interactive: Annotated[bool, typer.Option("--interactive", help="Chat in the terminal (/reset forgets, /exit ends).")] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Most tokens to generate.", min=1)] = 256,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature (0 = greedy).", min=0.0)] = 0.7,
    greedy: Annotated[bool, typer.Option("--greedy", help="Always take the most likely token (deterministic).")] = False,
    format_: Annotated[str, typer.Option("--format", help="auto | chat | alpaca | raw (auto: the run's training format, else the chat template).")] = "auto",
    cpu: Annotated[bool, typer.Option("--cpu", help="Load and generate on the CPU (slower; for a model the GPU cannot hold).")] = False,
) -> None:
    """Load a trained model and stream its answer to a prompt (or chat with --interactive)."""
    from lowvram.errors import UsageError
    from lowvram.report.results import show_generator, stream_text, write_stream
    from lowvram.train.after.generate import (
        GenerationSettings,
        chat_loop,
        load_generator,
        stream_reply,
    )

    if (prompt is None) == (not interactive):
        raise UsageError("pass --prompt TEXT or --interactive (one of them)", 'e.g. lowvram generate runs/quickstart --prompt "Hello"')
    settings = GenerationSettings(max_new_tokens, temperature, greedy)
    gen = load_generator(run_dir, prompt_format=format_, cpu=cpu)
    show_generator(gen)
    if interactive:
        chat_loop(gen, settings, input, write_stream)
        return
    stream_text(stream_reply(gen, [{"role": "user", "content": prompt}], settings))


@app.command(name="eval")
@handle_errors
def eval_(
    run_dir: Annotated[Path, typer.Argument(help="A finished run folder or one of its checkpoints.", show_default=False, metavar="RUN_DIR")],
    data: Annotated[Path | None, _opt("--data", "Rows to evaluate on, read in the recipe's data format (default: the rows training held out, data.validation).", "FILE")] = None,
    tasks: Annotated[str | None, _opt("--tasks", "lm-eval tasks, comma-separated (the [eval] extra).", "NAME[,NAME]")] = None,
    task_dir: Annotated[Path | None, _opt("--task-dir", "Folder of lm-eval task YAML files (default: lm-eval's own tasks).", "DIR")] = None,
    answers: Annotated[int, typer.Option("--answers", min=0, help="Prompt-answer rows answered greedily for exact match / contains (0: loss only).")] = 32,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Most tokens per answer (at most the longest reference + 32).")] = 256,
    cpu: Annotated[bool, typer.Option("--cpu", help="Evaluate on the CPU even when the GPU holds the model.")] = False,
    json_: JsonOpt = False,
) -> None:
    """Score a trained run and its base side by side: held-out loss and perplexity, exact-match
    answers, lm-eval tasks; recorded in the run's evals.json."""
    from lowvram.report.evals import progress, show_eval_plan, show_eval_result
    from lowvram.train.after.evaluate import plan_eval, run_eval

    names = tuple(t.strip() for t in (tasks or "").split(",") if t.strip())
    ep = plan_eval(run_dir, data, names, task_dir, answers=answers, max_new_tokens=max_new_tokens, cpu=cpu)
    if not json_:
        show_eval_plan(ep)
    show_eval_result(run_eval(ep, None if json_ else progress), as_json=json_)


@app.command()
@handle_errors
def runs(
    folder: Annotated[Path | None, typer.Argument(help="Folder with run folders, or one run (default: runs/).", show_default=False, metavar="[DIR]")] = None,
    json_: JsonOpt = False,
) -> None:
    """List runs: recipe, model, techniques, predicted vs measured peak, final loss, status."""
    from lowvram.past_runs import list_runs
    from lowvram.report.results import show_runs

    if folder is None and not Path("runs").is_dir():  # nothing trained here yet: not an error
        show_runs([], Path("runs"), as_json=json_)
        return
    folder = folder or Path("runs")
    found = list_runs(folder)
    show_runs(found, folder, as_json=json_)
    from lowvram.report.results import warn_damaged

    warn_damaged(found)  # on stderr, exit 0: a script listing runs goes on past one damaged run


@app.command()
@handle_errors
def show(run_dir: RunArg, json_: JsonOpt = False) -> None:
    """One run in detail: recipe, plan and reasons, metrics, loss curve, checkpoints."""
    from lowvram.past_runs import damaged_error, read_run
    from lowvram.report.results import show_run

    info = read_run(run_dir)
    if (err := damaged_error([info])) is not None:
        raise err
    show_run(info, as_json=json_)


def main() -> None:
    try:
        app()
    except LowvramError as err:  # errors raised outside a command body
        print_error(err)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main() or 0)

__all__ = ["app", "main", "EXIT_USAGE"]
