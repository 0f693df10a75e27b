"""The reward functions of a grpo/rloo run (``grpo.rewards``): the user's own, imported from a file
or a module, and lowvram's built-ins; checked before any model loads (``lowvram validate`` and the
start of ``lowvram train``) and guarded while training.

A reward has TRL 1.16's signature (grpo_trainer.py ``_calculate_rewards``): it is called with
``prompts``, ``completions`` and ``completion_ids`` (one per completion), the dataset's other
columns (one value per completion), and ``trainer_state``, ``log_extra`` and ``log_metric``, all as
keyword arguments, and returns one float (or None: no reward) per completion. Completions are text
for text prompts, a one-message list ``[{"role": "assistant", "content": ...}]`` for chat prompts.

The user's code runs in the training process, with its permissions (it is theirs: docs/grpo.md).
No torch here: validate imports and calls the rewards on a sample row without it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowvram.errors import LowvramError
from lowvram.recipe import Recipe
from lowvram.recipe.grpo import BUILTIN_REWARDS, RewardSpec

# The keyword arguments TRL passes to every reward besides the dataset's columns.
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
SIGNATURE_HINT = "def my_reward(prompts, completions, **kwargs) -> list[float]: TRL's reward signature"
# format's default: reasoning in <think>, the answer in <answer> (TRL's think_format_reward and the
# DeepSeek-R1 template); matched against the whole completion, newlines included.
DEFAULT_FORMAT = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"
CHARS_PER_TOKEN = 2  # length's default target: half of max_completion_length tokens, in characters


class RewardError(LowvramError):
    """A reward function that cannot be loaded, or failed on a sample or in a run (``step``: the
    step of the run it failed in)."""

    def __init__(self, message: str, hint: str = "", step: int | None = None) -> None:
        super().__init__(message, hint)
        self.step = step


@dataclass(frozen=True)
class Reward:
    name: str  # TRL logs rewards/<name>/mean and /std
    function: Callable[..., list]
    weight: float
    source: str  # the reference as the recipe wrote it
    settings: dict = field(default_factory=dict)


def completion_text(completion: Any) -> str:
    """The text of a completion: itself, or the content of its last message (chat prompts)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


# --------------------------------------------------------------------------------------------
# Built-ins


def _final_answer(text: str) -> str:
    """What a completion answers: the last \\boxed{...}, the text after the last ``####`` or
    ``answer:``, the last <answer>...</answer>, else the whole completion; stripped, lower case,
    without a trailing period."""
    for pattern in (r"\\boxed\{([^{}]*)\}", r"<answer>(.*?)</answer>", r"####\s*(.+)", r"answer\s*(?:is|:)\s*(.+)"):
        found = re.findall(pattern, text, flags=re.IGNORECASE | re.DOTALL)
        if found:
            text = found[-1]
            break
    return text.strip().rstrip(".").strip().lower()


def exact_match(prompts, completions, **kwargs) -> list[float | None]:
    """1.0 where the completion's final answer (_final_answer) equals the row's ``answer`` (or
    ``solution``) column, 0.0 where not; None for a row without one."""
    answers = kwargs.get("answer", kwargs.get("solution"))
    if answers is None:
        raise RewardError("reward exact_match needs an 'answer' or 'solution' column in the data",
                          "add the column, or map it with fields, or use another reward")
    return [None if a is None else float(_final_answer(completion_text(c)) == _final_answer(str(a)))
            for c, a in zip(completions, answers, strict=True)]


def format_reward(pattern: str) -> Callable[..., list[float]]:
    compiled = re.compile(pattern, re.DOTALL)

    def format(prompts, completions, **kwargs) -> list[float]:  # noqa: A001 - the recipe's name, TRL logs it
        """1.0 where the whole completion matches the pattern, else 0.0."""
        return [float(compiled.fullmatch(completion_text(c)) is not None) for c in completions]

    return format


def length_reward(target: int) -> Callable[..., list[float]]:
    def length(prompts, completions, **kwargs) -> list[float]:
        """1.0 at ``target`` characters, falling linearly to 0.0 at none and at twice the target."""
        return [max(0.0, 1.0 - abs(len(completion_text(c)) - target) / target) for c in completions]

    return length


def _builtin(spec: RewardSpec, recipe: Recipe) -> Callable[..., list]:
    if spec.function == "exact_match":
        return exact_match
    if spec.function == "format":
        try:
            return format_reward(spec.pattern or DEFAULT_FORMAT)
        except re.error as e:
            raise RewardError(f"reward format: pattern {spec.pattern!r} is not a regular expression ({e})",
                              "write a Python regular expression (re module), quoted in the YAML") from None
    return length_reward(spec.target or recipe.grpo.max_completion_length * CHARS_PER_TOKEN // 2)


# --------------------------------------------------------------------------------------------
# Loading


def _spec(item: str | RewardSpec) -> RewardSpec:
    return RewardSpec(function=item) if isinstance(item, str) else item


def _import_file(path: Path, ref: str):
    if not path.is_file():
        raise RewardError(f"reward {ref}: file not found: {path}",
                          "a reward file is relative to the recipe; fix grpo.rewards or create the file")
    name = f"lowvram_reward_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # the file may import its neighbours
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise RewardError(f"reward {ref}: syntax error in {path.name} line {e.lineno}: {e.msg}",
                          "fix the file; `python -c 'import ast,sys; ast.parse(open(sys.argv[1]).read())' FILE` "
                          "shows the same") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed on import: name it
        raise RewardError(f"reward {ref}: importing {path.name} raised {type(e).__name__}: {e}",
                          "fix the module so that it imports (it runs in the training process)") from None
    finally:
        sys.path.remove(str(path.parent))
    return module


def _import_module(where: str, ref: str):
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise RewardError(f"reward {ref}: no module named {e.name!r}",
                          "install it in this environment, or name a file: path/to/file.py:function") from None
    except SyntaxError as e:
        raise RewardError(f"reward {ref}: syntax error in {Path(e.filename or where).name} line {e.lineno}: {e.msg}",
                          "fix the module") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed on import: name it
        raise RewardError(f"reward {ref}: importing {where} raised {type(e).__name__}: {e}",
                          "fix the module so that it imports (it runs in the training process)") from None


def _user_function(ref: str, recipe: Recipe) -> Callable[..., list]:
    where, _, name = ref.rpartition(":")
    module = _import_file(recipe.resolve_path(where), ref) if where.endswith(".py") else _import_module(where, ref)
    function = getattr(module, name, None)
    if function is None:
        found = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise RewardError(f"reward {ref}: {where} has no function {name!r}",
                          f"its functions: {', '.join(found) or 'none'}")
    if not callable(function):
        raise RewardError(f"reward {ref}: {name} is a {type(function).__name__}, not a function", SIGNATURE_HINT)
    if inspect.iscoroutinefunction(function):
        raise RewardError(f"reward {ref}: {name} is async; lowvram calls rewards synchronously",
                          "make it a plain def (TRL's async rewards are not supported by lowvram)")
    return function


def load_rewards(recipe: Recipe) -> list[Reward]:
    """The recipe's rewards, imported (a file relative to the recipe, a module, a built-in)."""
    out: list[Reward] = []
    for item in recipe.grpo.rewards:
        out.append(_load_reward(item, recipe, out))
    return out


def _load_reward(item: str | RewardSpec, recipe: Recipe, loaded: list[Reward]) -> Reward:
    spec = _spec(item)
    builtin = spec.function in BUILTIN_REWARDS
    if not builtin and (spec.pattern is not None or spec.target is not None):
        raise RewardError(f"reward {spec.function}: pattern and target are the built-ins' settings "
                          "(format's and length's)", "remove them, or read your own settings in your function")
    function = _builtin(spec, recipe) if builtin else _user_function(spec.function, recipe)
    name = getattr(function, "__name__", spec.function.rpartition(":")[2])
    if any(r.name == name for r in loaded):
        raise RewardError(f"two rewards are named {name!r}: TRL logs each reward by its function's name",
                          "rename one of the functions")
    return Reward(name=name, function=function, weight=spec.weight, source=spec.function,
                  settings={k: v for k, v in (("pattern", spec.pattern), ("target", spec.target)) if v})


# --------------------------------------------------------------------------------------------
# Checking: the signature, then one call on a sample row


def signature_problem(function: Callable, columns: tuple[str, ...]) -> str | None:
    """Why TRL cannot call ``function`` with its arguments and ``columns`` (None when it can)."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return None  # a builtin or C function: the sample call tells
    kinds = inspect.Parameter
    any_keyword = any(p.kind == kinds.VAR_KEYWORD for p in params.values())
    passed = (*TRL_ARGUMENTS, *columns)
    positional_only = [n for n, p in params.items() if p.kind == kinds.POSITIONAL_ONLY]
    if positional_only:
        return f"takes {positional_only[0]!r} positionally only; TRL passes every argument by keyword"
    refused = [n for n in passed if not any_keyword and n not in params]
    if refused:
        return (f"does not take {', '.join(map(repr, refused[:4]))}{' ...' if len(refused) > 4 else ''}: TRL passes "
                f"{', '.join(TRL_ARGUMENTS)} and the data's columns ({', '.join(columns) or 'none'}); add **kwargs")
    needed = [n for n, p in params.items() if p.default is p.empty and p.kind in (kinds.POSITIONAL_OR_KEYWORD,
              kinds.KEYWORD_ONLY) and n not in passed]
    if needed:
        return (f"needs {', '.join(map(repr, needed))}, which the data has no column of "
                f"(its columns: {', '.join(columns) or 'none'})")
    return None


@dataclass(frozen=True)
class SampleState:
    """What a reward sees as ``trainer_state`` in validate's sample call: transformers' TrainerState's
    counters at the start of a run (the real TrainerState while training)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    log_history: tuple = ()


def _sample_call(reward: Reward, row: dict, recipe: Recipe) -> None:
    """Call ``reward`` as TRL would on two completions of ``row``'s prompt; RewardError if it
    raises or returns other than one number (or None) per completion."""
    prompt = row["prompt"]
    answer = str(row.get("answer", row.get("solution", "42")))
    texts = ["", answer]
    completions = texts if isinstance(prompt, str) else [[{"role": "assistant", "content": t}] for t in texts]
    columns = {k: [v, v] for k, v in row.items() if k != "prompt"}
    kwargs = {"prompts": [prompt, prompt], "completions": completions, "completion_ids": [[], [0]],
              "trainer_state": SampleState(max_steps=recipe.training.max_steps or 0),
              "log_extra": lambda column, values: None, "log_metric": lambda name, value: None, **columns}
    try:
        out = reward.function(**kwargs)
    except RewardError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code failed: name it and the row
        raise RewardError(f"reward {reward.source} raised {type(e).__name__} on a sample row: {e}",
                          f"it was called with prompts, completions (2, {'text' if isinstance(prompt, str) else 'messages'})"
                          f" and the columns {', '.join(columns) or '(none)'}; fix the function") from None
    problem = returned_problem(out, 2)
    if problem:
        raise RewardError(f"reward {reward.source} {problem} on a sample row", SIGNATURE_HINT)


def returned_problem(out: Any, expected: int) -> str | None:
    """Why ``out`` is not one number (or None) for each of ``expected`` completions."""
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
        return f"returned {type(out).__name__}, not a list of numbers (one per completion)"
    if len(out) != expected:
        return f"returned {len(out)} values for {expected} completions (one per completion)"
    for value in out:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
            return f"returned {type(value).__name__} {value!r:.40}, not a number (or None)"
        if isinstance(value, str):
            return f"returned text {value!r:.40}, not a number"
    return None


def check_rewards(recipe: Recipe) -> list[Reward]:
    """Import every reward, check its signature against the data's columns and call it once on the
    first row (``lowvram validate``, and ``lowvram train`` before the model loads). Every reward's
    problem at once: one is its own error and hint; several are listed under one error."""
    from lowvram.train.data.prompts import load_prompts

    problems: list[RewardError] = []
    rewards: list[Reward] = []
    for item in recipe.grpo.rewards:
        try:
            rewards.append(_load_reward(item, recipe, rewards))
        except RewardError as e:
            problems.append(e)
    rows, _ = load_prompts(recipe, first=1)
    if not rows:
        raise RewardError("no prompt row to try the rewards on", "check the data files")
    row = rows[0]
    columns = tuple(k for k in row if k != "prompt")
    for reward in rewards:
        try:
            problem = signature_problem(reward.function, columns)
            if problem:
                raise RewardError(f"reward {reward.source} {problem}", SIGNATURE_HINT)
            _sample_call(reward, row, recipe)
        except RewardError as e:
            problems.append(e)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise RewardError(f"{len(problems)} rewards cannot be used:\n" + "\n".join(
            f"  {p.message}" + (f" ({p.hint})" if p.hint else "") for p in problems),
            "fix each reward above and run `lowvram validate RECIPE` again")
    return rewards


# --------------------------------------------------------------------------------------------
# Training


def guarded(reward: Reward, resume_hint: str) -> Callable[..., list]:
    """``reward.function`` as TRL calls it in a run: a raise, or a return that is not one number per
    completion, ends the run with one error naming the reward and the step (the checkpoints
    written so far stay whole: ``resume_hint`` says how to go on)."""
    function = reward.function

    @functools.wraps(function)
    def call(*args, **kwargs):
        state = kwargs.get("trainer_state")
        step = getattr(state, "global_step", 0) + 1  # the step being made
        try:
            out = function(*args, **kwargs)
        except RewardError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: name it and the step
            raise RewardError(f"reward {reward.source} raised {type(e).__name__} at step {step}: {e}",
                              resume_hint, step) from None
        problem = returned_problem(out, len(kwargs.get("completions", ())))
        if problem:
            raise RewardError(f"reward {reward.source} {problem} at step {step}", resume_hint, step)
        return [None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in out]

    return call
