"""Light types of a training run, no torch here: what `lowvram train` is asked
(:class:`TrainOptions`, the one object the train chain passes down) and what it returns
(:class:`RunResult`; lowvram.report.training renders it), and the label id both sides of a batch
agree on (:data:`IGNORE_INDEX`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lowvram.metrics import RunMetrics
from lowvram.past_runs import resume_command

# The label of a token the loss skips: torch's cross_entropy ignore_index default and transformers'
# ForCausalLMLoss (-100). data/ writes it on untrained tokens and padding; build/loss.py skips it.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class LaunchSpec:
    """The processes of `lowvram train --gpus N` (accelerate launch): how many, where."""

    gpus: int = 1  # processes per node
    nodes: int = 1
    node_rank: int = 0
    main_address: str | None = None  # HOST:PORT of rank 0 (several nodes)
    cpu: bool = False  # processes on CPU with the gloo backend (tests, machines without GPUs)
    # Seconds the nodes wait for each other at start-up (torchrun's static rendezvous; its default
    # is 600 s). A node that cannot reach --main-address fails after this instead of hanging.
    rdzv_timeout_s: int = 300

    @property
    def world_size(self) -> int:
        return self.gpus * self.nodes

    @property
    def several(self) -> bool:
        """Whether the flags alone ask for accelerate (several processes, or the CPU's gloo)."""
        return self.world_size > 1 or self.cpu


@dataclass(frozen=True)
class TrainOptions:
    """`lowvram train RECIPE [flags]`, parsed: every flag once, typed (cli.train builds it)."""

    recipe_path: Path | None = None  # None: a recipe built in code (tests, bench); no resume command
    overrides: tuple[str, ...] = ()  # --set key=value, in order
    vram: str | None = None  # --vram: the budget instead of the detected free memory
    dry_run: bool = False
    resume: bool = False
    overwrite: bool = False
    print_launch: bool = False  # write the accelerate config, print the command, do not train
    processes: LaunchSpec = field(default_factory=LaunchSpec)
    # --no-track-memory turns it off; None: read LOWVRAM_TRACK_MEMORY (a launched worker, whose
    # launcher sets it from the flag: lowvram.train.run.launch.run_launch)
    track_memory: bool | None = True
    recover: bool = True  # out of memory: re-plan cheaper and retry (--no-recover: stop)
    max_retries: int = 3

    @property
    def resume_command(self) -> str:
        """The command that continues this run ("" without a recipe file)."""
        if self.recipe_path is None:
            return ""
        return resume_command(self.recipe_path, self.overrides, self.vram)

    @property
    def lock_label(self) -> str:
        """The command a one-process run names in the run folder's lock (lock.py)."""
        return "lowvram train" + (" --resume" if self.resume else "") + (" --overwrite" if self.overwrite else "")


@dataclass(frozen=True)
class RetryLog:
    """What metrics.json says about the out-of-memory retries so far (recover.py), and after one
    the plan the run ended with; the launcher hands it to its workers as JSON
    (oom.EXTRA_METRICS_ENV)."""

    oom_retries: tuple[dict, ...] = ()
    final_plan: dict | None = None

    def to_dict(self) -> dict:
        out: dict = {"oom_retries": list(self.oom_retries)}
        if self.final_plan is not None:
            out["final_plan"] = self.final_plan
        return out

    @classmethod
    def from_dict(cls, data: dict) -> RetryLog:
        return cls(tuple(data.get("oom_retries") or ()), data.get("final_plan"))


@dataclass(frozen=True)
class RunResult:
    output_dir: str
    metrics: RunMetrics = field(default_factory=RunMetrics)  # what metrics.json holds
    resumed_from: str | None = None
