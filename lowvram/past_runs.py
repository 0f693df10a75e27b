"""Find and describe finished, interrupted and failed runs (`lowvram runs`, `lowvram show`).

A run folder is what `lowvram train` leaves in ``output_dir``: ``recipe.yaml`` (the resolved
recipe), ``plan.json``, ``metrics.json`` when it finished, ``checkpoint-*`` folders. No torch here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from lowvram.errors import LowvramError
from lowvram.metrics import RunMetrics, metrics_problem, read_metrics
from lowvram.runfiles import (
    CHECKPOINT_GLOB,
    EVALS,
    EXPORTS,
    MANIFEST,
    METRICS,
    PLAN,
    RECIPE,
    checkpoint_number,
    lock_holder,
)
from lowvram.units import shell_line
from lowvram.vocab import PLAN_KEYS

MARKERS = (RECIPE, PLAN)
TECHNIQUE_KEYS = PLAN_KEYS  # the techniques of an older plan.json without its "techniques"


@dataclass(frozen=True)
class RunInfo:
    path: str
    name: str
    model: str
    status: str  # running (its lock is held) | finished | interrupted (checkpoints, no metrics.json) | failed
    # (neither) | diverged / stopped (lowvram stopped it: a non-finite step, the user's reward code; ``stop``)
    recipe_path: str | None = None
    techniques: dict = field(default_factory=dict)
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    first_loss: float | None = None
    final_loss: float | None = None
    eval_loss: float | None = None
    steps: int | None = None
    runtime_s: float | None = None
    checkpoints: tuple[str, ...] = ()
    adapter: bool = False
    loss_history: tuple[tuple[int, float], ...] = ()
    eval_history: tuple[tuple[int, float], ...] = ()
    reasons: dict = field(default_factory=dict)
    files: tuple[str, ...] = ()  # loss.png, TensorBoard logs, the model files
    damaged: tuple[str, ...] = ()  # "PATH is damaged: why" for each run file that does not parse
    recipe: dict = field(default_factory=dict)
    metrics: RunMetrics | None = None  # None: no readable metrics.json (not finished, or damaged)
    exports: tuple[dict, ...] = ()  # exports.json: the GGUF files `lowvram export` wrote from it
    evals: tuple[dict, ...] = ()  # evals.json: base vs trained scores of each `lowvram eval`
    stop: dict = field(default_factory=dict)  # why lowvram stopped it (manifest's "stop": status, message, hint, step)

    @property
    def recipe_name(self) -> str:
        """The recipe file's name (runs written before it was recorded: the folder's name)."""
        return Path(self.recipe_path).stem if self.recipe_path else self.name

    def to_dict(self, full: bool = True) -> dict:
        d = asdict(self)
        d["metrics"] = self.metrics.to_dict() if self.metrics is not None else {}
        d["recipe_name"] = self.recipe_name
        if not full:
            for k in ("recipe", "metrics", "loss_history", "eval_history", "reasons", "files"):
                d.pop(k)
        return d


def read_json(path: Path) -> dict:
    if not path.is_file():  # missing, or a FIFO that would block the reader (_damaged_files names it)
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_json_value(path: Path):
    """A JSON file's value, of any type; None when missing or unreadable."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_yaml_dict(path: Path) -> dict:
    """A YAML mapping file (a run's recipe.yaml) as a dict; {} when missing or unreadable."""
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in MARKERS)


def _checkpoints(path: Path) -> tuple[str, ...]:
    def step(p: Path) -> int:
        n = checkpoint_number(p)
        return -1 if n is None else n

    return tuple(p.name for p in sorted(path.glob(CHECKPOINT_GLOB), key=step) if p.is_dir())


def _status(metrics: RunMetrics | None, checkpoints: tuple[str, ...], stop: dict) -> str:
    if metrics is not None and metrics.status:
        return metrics.status
    if metrics is not None:
        return "finished"
    if stop.get("status") in ("diverged", "stopped"):  # lowvram stopped it on purpose (train.run.manifest)
        return stop["status"]
    return "interrupted" if checkpoints else "failed"


def read_run(path: str | Path) -> RunInfo:
    """Describe one run folder; LowvramError if it is not one."""
    p = Path(path)
    if not p.exists():
        raise LowvramError(f"run folder not found: {p}", "list runs with `lowvram runs runs/`")
    if not is_run_dir(p):
        present = ", ".join(sorted(x.name for x in p.iterdir())[:6]) if p.is_dir() else "not a folder"
        raise LowvramError(
            f"{p} is not a lowvram run (no recipe.yaml or plan.json; has: {present or 'nothing'})",
            "pass the training.output_dir of a `lowvram train` run; `lowvram runs DIR` lists them",
        )
    metrics = read_metrics(p / METRICS)
    plan = read_json(p / PLAN)
    try:
        text = (p / RECIPE).read_text() if (p / RECIPE).is_file() else ""
        recipe = yaml.safe_load(text) or {}
    except (OSError, yaml.YAMLError):
        text, recipe = "", {}
    # `lowvram train` writes "# recipe: /path/to/recipe.yaml" as the first line.
    head = text.split("\n", 1)[0]
    recipe_path = head[len("# recipe: "):].strip() if head.startswith("# recipe: ") else None
    recipe = recipe if isinstance(recipe, dict) else {}
    ckpts = _checkpoints(p)
    damaged = _damaged_files(p)
    stop = read_json(p / MANIFEST).get("stop")
    stop = stop if isinstance(stop, dict) else {}
    techniques = plan.get("techniques") or {k: plan[k] for k in TECHNIQUE_KEYS if k in plan}
    m = metrics or RunMetrics()
    return RunInfo(
        path=str(p), name=p.name, recipe_path=recipe_path,
        model=str((recipe.get("model") or {}).get("name_or_path", "?")),
        # a process trains in it now (its lock): half-written files are not damage
        status="running" if lock_holder(p) else "damaged" if damaged else _status(metrics, ckpts, stop),
        techniques=techniques,
        predicted_peak_bytes=m.predicted_peak_bytes if m.predicted_peak_bytes is not None else plan.get("predicted_peak_bytes"),
        measured_peak_bytes=m.peak_memory_bytes,
        first_loss=m.first_loss, final_loss=m.train_loss,
        eval_loss=m.eval_loss, steps=m.steps,
        runtime_s=m.runtime_s, checkpoints=ckpts,
        adapter=(p / "adapter_config.json").is_file(),
        loss_history=_pairs(m.loss_history), eval_history=_pairs(m.eval_history),
        reasons=dict(plan.get("reasons") or {}),
        files=tuple(n for n in ("loss.png", "runs", "adapter_model.safetensors", "model.safetensors",
                                "model.safetensors.index.json") if (p / n).exists()),
        recipe=recipe, metrics=metrics, damaged=damaged, exports=_rows(p / EXPORTS), stop=stop,
        evals=_rows(p / EVALS),
    )


def _rows(path: Path) -> tuple[dict, ...]:
    """The records of a JSON list file (exports.json, evals.json); none when it does not parse."""
    rows = read_json_value(path)
    return tuple(r for r in rows if isinstance(r, dict)) if isinstance(rows, list) else ()


def _damaged_files(p: Path) -> tuple[str, ...]:
    """The run's own files that exist and do not parse (read as empty above, they would make a
    finished run look failed or interrupted): metrics.json (also: one that parses but does not
    match its schema, lowvram.metrics), plan.json, recipe.yaml."""
    from lowvram.inputfiles import not_ordinary
    from lowvram.runfiles import file_problem

    out = []
    for n in (METRICS, PLAN, RECIPE):  # a FIFO or a device in their place: never opened
        why = not_ordinary(p / n)
        if why:
            out.append(f"{p / n} is damaged: it is {why}, not an ordinary file")
    if out:
        return tuple(out)
    for n in (METRICS, PLAN):
        why = file_problem(p / n) if (p / n).is_file() else None
        if why is None and n == METRICS and (p / n).is_file():
            why = metrics_problem(read_json_value(p / n))
        if why:
            out.append(f"{p / n} is damaged: {why}")
    try:
        yaml.safe_load((p / RECIPE).read_text()) if (p / RECIPE).is_file() else None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        out.append(f"{p / RECIPE} is damaged: not valid YAML ({str(e).splitlines()[0]})")
    except OSError:
        pass  # unreadable: read_run already shows no recipe
    return tuple(out)


def damaged_error(runs: list[RunInfo]) -> LowvramError | None:
    """One error naming every damaged run file of ``runs`` (`lowvram show`, `lowvram runs`)."""
    lines = [line for r in runs for line in r.damaged]
    if not lines:
        return None
    return LowvramError("\n  ".join(lines) if len(lines) == 1 else
                        f"{len(lines)} run files are damaged:\n  " + "\n  ".join(lines),
                        "restore the file from a copy; a damaged metrics.json can be removed instead: "
                        "`lowvram train RECIPE --resume` writes it again from the last complete checkpoint")


def _pairs(rows) -> tuple[tuple[int, float], ...]:
    out = []
    for row in rows or ():
        if isinstance(row, (list, tuple)) and len(row) == 2:
            out.append((int(row[0]), float(row[1])))
    return tuple(out)


def list_runs(root: str | Path) -> list[RunInfo]:
    """Every run folder at or below ``root`` (two levels deep), newest first."""
    base = Path(root)
    if not base.is_dir():
        raise LowvramError(f"folder not found: {base}", "runs are written to each recipe's training.output_dir (default runs/)")
    if is_run_dir(base):
        return [read_run(base)]
    found = []
    for child in sorted(base.iterdir()):
        if child.is_dir() and not child.name.startswith((CHECKPOINT_GLOB.rstrip("*"), ".")):
            if is_run_dir(child):
                found.append(child)
            else:
                found += [g for g in sorted(child.iterdir()) if g.is_dir() and is_run_dir(g)]
    found.sort(key=lambda d: max((f.lstat().st_mtime for f in d.iterdir()), default=0), reverse=True)
    return [_read_listed_run(d) for d in found]


def _read_listed_run(d: Path) -> RunInfo:
    """read_run, or a damaged RunInfo naming why the folder cannot be read (`lowvram runs` goes on)."""
    try:
        return read_run(d)
    except OSError as e:
        return RunInfo(path=str(d), name=d.name, model="?", status="damaged",
                       damaged=(f"{d} cannot be read: {e.strerror or e}",))


def resume_command(recipe_path: str | Path, overrides: Sequence[str] = (), vram: str | None = None) -> str:
    """`lowvram train RECIPE --resume` with the same --set flags, quoted for a POSIX shell (what
    an interrupted run prints, and `lowvram show` of one)."""
    args = ["lowvram", "train", str(recipe_path), "--resume"]
    for item in overrides or ():
        args += ["--set", item]
    if vram:
        args += ["--vram", vram]
    return shell_line(args)
