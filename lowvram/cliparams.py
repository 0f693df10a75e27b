"""Typer's option coercion, built only for a value that needs it.

Typer 0.29 coerces every option of a command through a pydantic ``TypeAdapter`` that it builds
when the option is parsed, given or not (typer/core.py ``_TyperParameter.process_value``, typer/
_coercion.py ``build_runtime_param``): for `lowvram plan`'s 31 options that is pydantic's import and
31 adapters, about 0.1 s of CPU of a 0.5 s command (bench/results/plan_speed-2026-12-06.txt), where
the options given are two strings. Here the adapter is built on the first value that needs one:

- an option not given (None) coerces to None, or () when repeatable, whatever its type: Typer's
  own ``RuntimeParam.coerce`` says so before it looks at the adapter, and it runs unchanged;
- a ``str`` option's str value is that str: Typer's str adapter is ``_parse_cli_str`` (``str(value)``)
  then pydantic's str, which returns a str as it is (lone surrogates and NULs included);
- every other value goes to the adapter Typer builds, so numbers, paths, choices and lists are
  validated (and refused, with their messages) exactly as before.

tests/cli/test_cliparams.py compares each option of every command against Typer's own coercion.
With a Typer whose coercion is shaped otherwise, ``install`` leaves it alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def install() -> bool:
    """Make Typer build each option's adapter on demand; False where this Typer has no such hook."""
    try:
        from typer import _coercion, core
    except ImportError:  # pragma: no cover - another Typer
        return False
    build = getattr(core, "build_runtime_param", None)
    runtime = getattr(_coercion, "RuntimeParam", None)
    if build is None or runtime is None or not hasattr(runtime, "_coerce_value"):
        return False  # pragma: no cover - another Typer
    if getattr(build, "on_demand", False):
        return True

    @dataclass(frozen=True)
    class OnDemand(runtime):
        """Typer's RuntimeParam for one option, its adapter built on the first value that needs it."""

        descriptor: Any = None
        built: list = field(default_factory=list)  # [Typer's RuntimeParam] once built

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            if type(value) is str and self.annotation is str and self.parameter_info.parser is None:
                return value
            if not self.built:
                self.built.append(build(self.descriptor))
            return self.built[0]._coerce_value(value, param=param, ctx=ctx)

    def on_demand(descriptor: Any) -> Any:
        if descriptor.file_annotation is not None:
            return build(descriptor)  # files open without pydantic
        return OnDemand(parameter_info=descriptor.parameter_info, annotation=descriptor.annotation,
                        descriptor=descriptor)

    on_demand.on_demand = True
    on_demand.typer_build = build
    core.build_runtime_param = on_demand
    return True


__all__ = ["install"]
