"""User-facing errors and exit codes.

The CLI prints ``error: <message>`` and ``hint: <hint>`` on stderr, no traceback, and exits with
``exit_code``. Exit codes are part of the interface (scripts rely on them):

- 0: success
- 1: user error (bad recipe, missing file, a plan that does not fit with ``--check``)
- 2: command-line usage error
- 130 / 143: interrupted by SIGINT / SIGTERM
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_USER = 1
EXIT_USAGE = 2
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class LowvramError(Exception):
    """An error the user can fix; carries a one-line hint."""

    exit_code = EXIT_USER

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


def error_text(err: LowvramError) -> str:
    """``err`` as the user sees it: one ``error:`` line (plus any further lines of its message)
    and one ``hint:`` line, each ending in a newline (lowvram.report.console.print_error, a launched worker)."""
    lines = str(err.message).splitlines() or [""]
    text = f"error: {lines[0]}\n" + "".join(f"{extra}\n" for extra in lines[1:])
    return text + (f"hint: {err.hint}\n" if err.hint else "")


class RecipeError(LowvramError):
    """A recipe that does not validate. ``problems`` lists every problem, one line each."""

    def __init__(self, problems: list[str], hint: str = "") -> None:
        n = len(problems)
        head = f"{n} problem{'s' if n != 1 else ''} in the recipe:"
        super().__init__(head + "\n  " + "\n  ".join(problems), hint or "fix the keys above and run `lowvram validate RECIPE` again")
        self.problems = problems


class UsageError(LowvramError):
    exit_code = EXIT_USAGE


class DataError(LowvramError):
    """A dataset that cannot be loaded or formatted (names file and row)."""


class ModelError(LowvramError):
    """A model that cannot be found or loaded."""
