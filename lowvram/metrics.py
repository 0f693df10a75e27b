"""The schema of ``metrics.json``: what a finished run measured, written by train/ and read by
`lowvram runs` / `lowvram show` (past_runs.py, report/).

One frozen dataclass, :class:`RunMetrics`, with a ``schema_version``. Files written before the
schema (no ``schema_version``) are version 0: the same keys, read the same way. A file of a newer
version than this lowvram knows, or one whose values have the wrong types, is a damaged file
(:func:`metrics_problem`): the readers give error/hint instead of showing half a run. Keys this
schema does not name (a newer lowvram's) are kept in ``other`` and written back unchanged.
No torch, nothing of lowvram but the standard library.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA_VERSION = 1  # 0: the files of lowvram before the schema (the same keys, no version)

Pairs = list[list[float]]  # [[step, value], ...]


@dataclass(frozen=True)
class RunMetrics:
    """A finished run's metrics.json. Memory in bytes; ``None``: not measured on this run."""

    schema_version: int = SCHEMA_VERSION
    # Loss and time
    first_loss: float | None = None
    train_loss: float | None = None  # the last logged training loss
    eval_loss: float | None = None
    steps: int | None = None
    runtime_s: float | None = None  # this session's training (tokens/s are over it)
    train_runtime_s: float | None = None  # the Trainer's train_runtime
    tokens_seen: int | None = None
    tokens_per_s: float | None = None
    # The measured peak (train/run/run.py _peak_memory: live tensor bytes on CPU, CUDA counters on a GPU)
    peak_memory_bytes: int | None = None
    peak_memory_kind: str | None = None  # what measured it: "live tensor bytes (exact, CPU)", ...
    peak_rss_bytes: int | None = None  # CPU with live-byte tracking only
    peak_reserved_bytes: int | None = None  # CUDA only
    beyond_reserved_bytes: int | None = None  # CUDA only
    memory_comparison: list[dict] | None = None  # lowvram.gpumemory rows: part, predicted, measured
    # The prediction it is compared with
    predicted_peak_bytes: int | None = None
    predicted_device: str | None = None
    data_longest_tokens: int | None = None  # data shorter than seq_len: the peak predicted there
    predicted_peak_bytes_at_data: int | None = None
    data_windows_one_sample: bool | None = None  # packing on, no window holds two samples
    memory_history: Pairs = field(default_factory=list)  # [[step, peak bytes since the last log], ...]
    # Processes
    processes: int | None = None
    distributed_type: str | None = None  # accelerate's DistributedType value
    sharded_parameters: int | None = None
    peak_memory_bytes_per_rank: list[int] | None = None
    # Data and model
    train_rows: int | None = None
    eval_rows: int | None = None
    truncated: int | None = None
    skipped_bad_rows: int | None = None
    packed: bool | None = None
    load_s: float | None = None
    gguf_cache_hit: bool | None = None
    trainable_params: int | None = None
    total_params: int | None = None
    resumed_from: str | None = None
    loss_history: Pairs = field(default_factory=list)
    eval_history: Pairs = field(default_factory=list)
    # A preference objective (dpo/orpo/simpo, train/build/preference.py): TRL's reward metrics, the last
    # value and the history ([[step, value], ...]); absent for SFT
    rewards_chosen: float | None = None
    rewards_rejected: float | None = None
    rewards_margins: float | None = None
    rewards_accuracies: float | None = None
    rewards_chosen_history: Pairs | None = None
    rewards_rejected_history: Pairs | None = None
    rewards_margins_history: Pairs | None = None
    rewards_accuracies_history: Pairs | None = None
    # each objective's own terms (train/build/preference.py OBJECTIVE_METRICS): kto's KL estimate,
    # orpo's log odds ratio and chosen log odds, orpo's and simpo's NLL on the chosen rows
    kl: float | None = None
    log_odds_ratio: float | None = None
    log_odds_chosen: float | None = None
    nll_loss: float | None = None
    kl_history: Pairs | None = None
    log_odds_ratio_history: Pairs | None = None
    log_odds_chosen_history: Pairs | None = None
    nll_loss_history: Pairs | None = None
    # grpo/rloo (train/build/grpo.py rl_metrics): TRL's summed reward (mean and std over the logged
    # steps' completions, last and history), each reward function's (name -> {mean, std, history}),
    # the mean completion length in tokens, the share of completions cut at max_completion_length,
    # and the share of tokens whose probability ratio was clipped (GRPO's clip_ratio/region_mean)
    reward: float | None = None
    reward_std: float | None = None
    reward_history: Pairs | None = None
    reward_functions: dict | None = None
    completion_length: float | None = None
    completion_length_history: Pairs | None = None
    truncated_completions: float | None = None
    clip_ratio: float | None = None
    clip_ratio_history: Pairs | None = None
    # Out-of-memory retries (train/run/recover.py): absent when the run was not trained through it
    oom_retries: list[dict] | None = None
    final_plan: dict | None = None  # after a retry: the techniques the run ended with
    # training.on_nonfinite skip (train/run/guard.py): the steps whose loss or gradient norm was not
    # finite and whose update was skipped; absent when none was
    nonfinite_steps: list[int] | None = None
    # training.worst_batch_first (train/run/worst_batch.py): the longest batch's length and its
    # forward-and-backward peak, measured before the run; absent when it did not run
    worst_batch_tokens: int | None = None
    worst_batch_peak_bytes: int | None = None
    status: str | None = None  # read only: a status an older writer recorded
    other: dict = field(default_factory=dict)  # keys this schema does not know, kept as they were

    def to_dict(self) -> dict:
        """The JSON object of metrics.json (the situational keys only where they were measured)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "other"}
        for name in _SITUATIONAL:
            if d[name] is None:
                del d[name]
        return {**d, **self.other}

    @classmethod
    def from_dict(cls, data: dict) -> RunMetrics:
        """A metrics.json object, of any version up to SCHEMA_VERSION; ValueError naming the first
        key whose value has the wrong type, or a version this lowvram cannot read."""
        problem = _problem(data)
        if problem:
            raise ValueError(problem)
        known = {k: data[k] for k in _TYPES if k in data}
        other = {k: v for k, v in data.items() if k not in _TYPES}
        return cls(**{**known, "schema_version": int(data.get("schema_version", 0))}, other=other)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def get(self, key: str, default=None):
        """The value of a metrics.json key (an unknown key: ``other``'s), like dict.get."""
        return self.to_dict().get(key, default)

    def __getitem__(self, key: str):
        return self.to_dict()[key]


# A preference objective's own terms as metrics.json keys (TRL's log names; train/build/preference.py)
OBJECTIVE_METRIC_KEYS = ("kl", "log_odds_ratio", "log_odds_chosen", "nll_loss")

# grpo/rloo's keys (train/build/grpo.py rl_metrics)
RL_METRIC_KEYS = ("reward", "reward_std", "reward_history", "reward_functions", "completion_length",
                  "completion_length_history", "truncated_completions", "clip_ratio", "clip_ratio_history")

# Keys written only where the run measured them (as metrics.json has always done).
_SITUATIONAL = ("peak_rss_bytes", "peak_reserved_bytes", "beyond_reserved_bytes", "memory_comparison",
                "data_longest_tokens", "predicted_peak_bytes_at_data", "data_windows_one_sample",
                "oom_retries", "final_plan", "status", "nonfinite_steps",
                "worst_batch_tokens", "worst_batch_peak_bytes",
                *(f"rewards_{m}{h}" for m in ("chosen", "rejected", "margins", "accuracies") for h in ("", "_history")),
                *(f"{m}{h}" for m in OBJECTIVE_METRIC_KEYS for h in ("", "_history")),
                *RL_METRIC_KEYS)


_HINTS = typing.get_type_hints(RunMetrics)
_TYPES = {f.name: _HINTS[f.name] for f in dataclasses.fields(RunMetrics) if f.name != "other"}


def _members(hint) -> tuple[list[type], bool]:
    """(the types a field's hint allows, whether it allows None): ``int | None`` -> ([int], True),
    ``list[list[float]]`` -> ([list], False)."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    members = typing.get_args(hint) if union else (hint,)
    return [typing.get_origin(a) or a for a in members if a is not type(None)], type(None) in members


def _accepts(hint, value) -> bool:
    """Whether a JSON ``value`` is of the field's type (numbers: any JSON number, never true or
    false)."""
    kinds, optional = _members(hint)
    if value is None:
        return optional
    for base in kinds:
        # A count or a byte size is a JSON number (an older writer's or a script's may be a float).
        if base in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if base in (str, bool, list, dict) and isinstance(value, base):
            return True
    return False


def _problem(data) -> str | None:
    if not isinstance(data, dict):
        return f"not a JSON object (a {type(data).__name__})"
    version = data.get("schema_version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        return f"schema_version is {version!r}, not a version number"
    if version > SCHEMA_VERSION:
        return (f"schema_version {version} is newer than this lowvram reads ({SCHEMA_VERSION}): "
                "upgrade lowvram to read it")
    for name, hint in _TYPES.items():
        if name in data and not _accepts(hint, data[name]):
            return f"{name} is {data[name]!r}, which is not {_describe(hint)}"
    return None


def _describe(hint) -> str:
    names = {int: "a number", float: "a number", str: "a string", bool: "true or false", list: "a list",
             dict: "an object"}
    kinds, optional = _members(hint)
    return " or ".join(names.get(k, str(k)) for k in kinds) + (" or null" if optional else "")


# A loss "several times its first value over a window" (issue 42): each of the last
# CLIMB_WINDOW logged losses at least CLIMB_FACTOR times the first. A policy threshold, not a
# fitted constant: a falling or noisy run stays far below it (a tiny model's first loss is ~ln
# of its vocabulary, the floor of a random guess), a run at learning_rate 0.99 crossed it within
# four steps (0.31 -> 75.7 in the fault trials).
CLIMB_FACTOR = 3.0
CLIMB_WINDOW = 3


def loss_climb(history) -> float | None:
    """How many times its first value the loss stands at, when each of the last CLIMB_WINDOW
    values of ``history`` ([[step, loss], ...]) is at least CLIMB_FACTOR times the first (the
    run is diverging); None otherwise, or when the first loss is not a positive number."""
    values = [float(v) for _, v in history or ()]
    if len(values) <= CLIMB_WINDOW or not math.isfinite(values[0]) or values[0] <= 0:
        return None
    last = values[-CLIMB_WINDOW:]
    if all(not math.isfinite(v) or v >= CLIMB_FACTOR * values[0] for v in last) and math.isfinite(last[-1]):
        return last[-1] / values[0]
    return None


def climb_warning(history) -> str | None:
    """The warning line for a diverging loss (progress, the run summary, `lowvram show`), or None."""
    factor = loss_climb(history)
    if factor is None:
        return None
    first, last = float(history[0][1]), float(history[-1][1])
    return (f"the loss climbed from {first:.4g} to {last:.4g} ({factor:.1f}x its first value over the last "
            f"{CLIMB_WINDOW} logged steps): the run is diverging; lower training.learning_rate")


def metrics_problem(data) -> str | None:
    """Why a parsed metrics.json cannot be read as RunMetrics, or None."""
    return _problem(data)


def read_metrics(path: Path) -> RunMetrics | None:
    """The metrics.json at ``path``; None when it is missing, does not parse or does not match the
    schema (runs.py names such a file as damaged), or is not an ordinary file (a FIFO would block)."""
    if not Path(path).is_file():
        return None
    try:
        return RunMetrics.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None
