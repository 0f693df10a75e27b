"""Typer's option adapters built on demand (lowvram.cliparams): every option of every command
coerces each value as Typer's own coercion does, and a plan from flags imports no pydantic."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import typer.core
from typer import _click
from typer.main import get_command

from lowvram import cliparams
from lowvram.cli import app
from tests.conftest import REPO

# What a command line hands an option: strings (numbers, paths, choices, junk), and None or a
# tuple where the option was not given or is repeatable.
VALUES = [None, "12GB", "llama-3.1-8b", "3", "-1", " 4 ", "0x10", "1e-4", "2.5", "true", "no", "", "bf16",
          "\udcff", "a\x00b", ("a=1", "b=2"), ()]


def _outcome(runtime, value, param, ctx):
    try:
        return ("ok", runtime.coerce(value, param=param, ctx=ctx))
    except Exception as err:  # the error Typer shows for the value
        return ("error", type(err).__name__, str(err))


def _params():
    group = get_command(app)
    for name, command in group.commands.items():
        for param in command.params:
            if isinstance(param, typer.core._TyperParameter):
                yield name, command, param


def test_installed_with_this_typer():
    assert cliparams.install() is True
    assert getattr(typer.core.build_runtime_param, "on_demand", False)


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_every_option_coerces_as_typer_does(value):
    on_demand = typer.core.build_runtime_param
    typer_build = on_demand.typer_build
    checked = 0
    for name, command, param in _params():
        if value is None and param.required:
            continue  # never reached: click reports the missing argument first
        ctx = _click.Context(command, info_name=name)
        desc = param.type_descriptor
        want = _outcome(typer_build(desc), value, param, ctx)
        got = _outcome(on_demand(desc), value, param, ctx)
        assert got == want, (name, param.name, desc.annotation, value)
        checked += 1
    assert checked > 60  # the options of every command


def test_plan_from_flags_imports_no_pydantic():
    """Typer 0.29 built a pydantic adapter for each of plan's 31 options (0.1 s of CPU of a
    0.5 s command); the flags given here are strings and a switch."""
    code = textwrap.dedent("""\
        import contextlib, io, sys
        from lowvram import cli
        sys.argv = ["lowvram", "plan", "--model", "llama-3.1-8b", "--vram", "12GB", "--json"]
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                cli.main()
            except SystemExit as e:
                assert not e.code, e.code
        assert '"fits": true' in out.getvalue(), out.getvalue()[:200]
        print(",".join(m for m in ("pydantic", "yaml", "rich") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_a_bad_number_is_refused_as_before():
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", "--vram", "12GB", "--seq-len", "lots"])
    assert r.exit_code == 2
    assert "Invalid value for '--seq-len'" in r.output
