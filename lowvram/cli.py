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

from lowvram.errors import EXIT_USAGE, LowvramError

app = typer.Typer(
    name="lowvram",
    help="Fine-tune LLMs on the GPU you have: plan peak memory, pick memory techniques, train.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def print_error(err: LowvramError) -> None:
    lines = str(err.message).splitlines() or [""]
    sys.stderr.write(f"error: {lines[0]}\n")
    for extra in lines[1:]:
        sys.stderr.write(f"{extra}\n")
    if err.hint:
        sys.stderr.write(f"hint: {err.hint}\n")
    sys.stderr.flush()


def handle_errors(fn):
    """Turn LowvramError into `error:`/`hint:` on stderr and its exit code (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LowvramError as err:
            print_error(err)
            raise typer.Exit(err.exit_code) from None

    return wrapper


RecipeArg = Annotated[Path, typer.Argument(help="Path to a YAML recipe.", show_default=False, metavar="RECIPE")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a recipe key, e.g. --set training.learning_rate=1e-4 (repeatable)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object (for scripts).")]


@app.command()
@handle_errors
def validate(recipe: RecipeArg, set_: SetOpt = None, json_: JsonOpt = False) -> None:
    """Check a recipe without loading anything heavy; report every problem at once."""
    from lowvram import report
    from lowvram.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    report.show_validated(r, recipe, as_json=json_)


@app.command()
@handle_errors
def train(
    recipe: RecipeArg,
    set_: SetOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the resolved recipe and plan, then exit.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the last checkpoint in output_dir.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a finished run in output_dir.")] = False,
    vram: Annotated[str | None, typer.Option("--vram", help="Memory budget, e.g. 24GB (default: detected).")] = None,
    json_: JsonOpt = False,
) -> None:
    """Fine-tune a model as the recipe says, with the memory techniques the plan chose."""
    from lowvram import report
    from lowvram.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    from lowvram.plan.resolve import plan_for_recipe

    plan = plan_for_recipe(r, vram=vram)
    if dry_run:
        report.show_dry_run(r, plan, as_json=json_)
        return
    report.show_plan_brief(r, plan)
    from lowvram.train.run import run_training

    result = run_training(r, plan, resume=resume, overwrite=overwrite)
    report.show_train_result(result, as_json=json_)


@app.command()
@handle_errors
def keys(json_: JsonOpt = False) -> None:
    """List every recipe key with its type, default and meaning (from the schema)."""
    from lowvram import report
    from lowvram.recipe import describe_schema

    report.show_keys(describe_schema(), as_json=json_)


@app.command()
@handle_errors
def env(json_: JsonOpt = False) -> None:
    """Print versions and devices: paste this block into bug reports."""
    from lowvram import report
    from lowvram.hardware import collect_env

    report.show_env(collect_env(), as_json=json_)


@app.command()
@handle_errors
def version() -> None:
    """Print the lowvram version."""
    from lowvram import __version__

    typer.echo(__version__)


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
