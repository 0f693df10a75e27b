"""`lowvram train` as one library call: :func:`train_recipe` takes a :class:`TrainOptions` and
returns a :class:`TrainOutcome`; the CLI parses the flags into the one and renders the other.

The recipe is loaded, the hardware read and the run planned **once**; then the run either trains
in this process (train/run/recover.py: the lock, the out-of-memory retries, resume) or is launched
through accelerate (train/run/launch.py: several processes, the CPU's gloo, or a plan that offloads
through FSDP/DeepSpeed on one GPU), with the plan and its request in the run folder for the
workers. It sits above train/ and planning/, which never import each other; it prints nothing
(``started`` is the caller's: the plan is shown before the model loads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.hardware import Hardware
from lowvram.plan.types import Plan
from lowvram.recipe import Recipe
from lowvram.train.run.launch import Launch
from lowvram.train.types import LaunchSpec, RunResult, TrainOptions

if TYPE_CHECKING:
    from lowvram.train.data.check import DataReport


@dataclass(frozen=True)
class PlannedRun:
    """The run as planned, before it starts: ``launch`` is set when accelerate runs it."""

    recipe: Recipe
    plan: Plan
    processes: LaunchSpec | None = None  # None: this process trains
    launch: Launch | None = None


@dataclass(frozen=True)
class TrainOutcome:
    """What `lowvram train` did: only planned (``--dry-run``), wrote the launch files
    (``--print-launch``), or trained (``result``; None on a node other than rank 0, whose
    node 0 reports). ``exit_code``: the launcher's, when a launched process failed."""

    planned: PlannedRun
    dry_run: bool = False
    print_only: bool = False
    result: RunResult | None = None
    exit_code: int = 0
    data: DataReport | None = None  # the data check (--dry-run: token counts and a rendered sample)


Started = Callable[[PlannedRun], None]


def train_recipe(options: TrainOptions, started: Started | None = None) -> TrainOutcome:
    """Plan the recipe of ``options`` once and train it (or only plan it, or write its launch).
    ``started(planned)`` is called once the run is about to start (after the plan fits, for a
    launch after its files are written), so the caller can show the plan first."""
    from lowvram.planning.entry import plan_for_recipe
    from lowvram.planning.from_recipe import recipe_model_ref
    from lowvram.recipe import load_recipe
    from lowvram.train.build.allocator import set_expandable_segments

    set_expandable_segments()  # before anything initialises CUDA (the probe, the model); launched ranks inherit it
    if options.recipe_path is None:
        raise ValueError("lowvram train needs a recipe file (TrainOptions.recipe_path)")
    recipe = load_recipe(options.recipe_path, list(options.overrides))
    from lowvram.train.run.preflight import check_ordinary_inputs

    check_ordinary_inputs(recipe)  # a FIFO or a device among the inputs: said at once, never opened
    if not options.dry_run:  # before planning and loading; the rows are counted once built (run.py)
        from lowvram.train.run.preflight import check_seq_len

        check_seq_len(recipe)
        if not options.print_launch:
            _refuse_output_dir_early(recipe, options)
    from lowvram.train.run.preflight import check_recipe_data

    # every row against its format before the plan and the model (seconds, not a model load later)
    data = check_recipe_data(recipe, samples=1, tokens=options.dry_run)
    _fetch_config(recipe_model_ref(recipe))  # plan a hub model before downloading it
    if not options.dry_run and not options.print_launch:
        from lowvram.train.run.preflight import check_model_download

        check_model_download(recipe)  # a hub model not cached, with no network: said now, not after retries
    asked = options.processes.several or options.print_launch  # the flags ask for accelerate
    spec, hardware = _processes(options, asked)
    from lowvram.train.run.preflight import measured_images

    images = measured_images(recipe)  # format image_chat: the plan is sized for the data's images
    plan = plan_for_recipe(recipe, vram=options.vram, hardware=hardware, gpus=spec.world_size, images=images)
    launched = asked or (plan.offload != "none" and not options.dry_run)  # FSDP/DeepSpeed on one GPU too
    if launched and not asked:
        spec = _one_launched_process(spec, hardware)
    planned = PlannedRun(recipe, plan, spec if launched else None)
    if options.dry_run:
        if not launched:
            from lowvram.train.run.preflight import check_inputs

            check_inputs(recipe)
        return TrainOutcome(planned, dry_run=True, data=data)
    if not options.print_launch:
        from lowvram.planning.entry import require_fit

        require_fit(plan, options.recipe_path)
    options = dataclasses.replace(options, processes=spec)
    if launched:
        return _launch(recipe, plan, options, started or _quiet, images)
    (started or _quiet)(planned)
    from lowvram.planning.entry import replanner_for
    from lowvram.train.run.recover import train_with_recovery

    result = train_with_recovery(recipe, plan, options, replanner=replanner_for(recipe, images))
    return TrainOutcome(planned, result=result)


def _quiet(planned: PlannedRun) -> None:
    pass


def _refuse_output_dir_early(recipe: Recipe, options: TrainOptions) -> None:
    """A usage error or a run folder that refuses this run (train/run/folder.py refuse_early), said
    before the plan is made; checked again under the lock when the run starts. A folder another
    process holds is left to the lock's own error, which names the holder."""
    from lowvram.train.build.trainer import output_dir
    from lowvram.train.run.folder import refuse_early
    from lowvram.train.run.lock import held_by_another

    out = output_dir(recipe)
    if options.resume and options.overwrite or not held_by_another(out):
        refuse_early(out, options.resume, options.overwrite, recipe)


def _fetch_config(model_ref: str) -> None:
    """A hub id the catalog and the hub cache do not know: fetch its config.json; a model that
    cannot be fetched keeps the fixed plan with its note (planning.entry)."""
    from lowvram.hub import ensure_config

    try:
        ensure_config(model_ref)
    except LowvramError:
        pass


def _processes(options: TrainOptions, asked: bool) -> tuple[LaunchSpec, Hardware]:
    """The processes (``asked``: the flags ask for accelerate) and the hardware they use. Only
    the cards this node's processes use are read (--cpu: none), in a child process: a launcher
    must hold no CUDA context while its workers train (hardware.py)."""
    from lowvram.hardware import detect_hardware
    from lowvram.train.run import launch

    spec = options.processes
    hardware = detect_hardware(options.vram, gpus=0 if spec.cpu else spec.gpus)
    if asked:
        if spec.cpu or hardware.kind == "cpu":  # no GPU: the processes run on the CPU (gloo)
            spec = dataclasses.replace(spec, cpu=True)
            hardware = dataclasses.replace(hardware, kind="cpu", devices=())
        if spec.node_rank >= spec.nodes:
            raise LowvramError(f"--node-rank {spec.node_rank} with --nodes {spec.nodes}",
                               f"use a rank from 0 to {spec.nodes - 1}")
        launch.check_devices(spec, hardware)
    return spec, dataclasses.replace(hardware, devices=hardware.devices[:spec.gpus])  # the cards this node uses


def _one_launched_process(spec: LaunchSpec, hardware: Hardware) -> LaunchSpec:
    """One process whose plan offloads (FSDP/DeepSpeed): through accelerate as well, on the CPU
    where there is no GPU (where the launch then refuses DeepSpeed with its error/hint)."""
    from lowvram.train.run import launch

    spec = dataclasses.replace(spec, cpu=hardware.kind == "cpu")
    launch.check_devices(spec, hardware)
    return spec


def _launch(recipe: Recipe, plan: Plan, options: TrainOptions, started: Started,
            images: tuple[int, int] | None = None) -> TrainOutcome:
    """`accelerate launch` the worker on each process, with the plan made here."""
    from lowvram.train.run import launch

    if options.print_launch:
        prepared = launch.prepare_launch(recipe, plan, options)
        return TrainOutcome(PlannedRun(recipe, plan, options.processes, prepared), print_only=True)
    from lowvram.metrics import read_metrics
    from lowvram.planning.entry import replanner_for
    from lowvram.runfiles import METRICS
    from lowvram.train.build.trainer import output_dir
    from lowvram.train.run.lock import run_lock
    from lowvram.train.run.recover import launch_with_recovery

    replanner = replanner_for(recipe, images)
    with run_lock(output_dir(recipe), "lowvram train --gpus"):
        prepared = launch.prepare_launch(recipe, plan, options, replanner=replanner)
        planned = PlannedRun(recipe, plan, options.processes, prepared)
        started(planned)
        rc = launch_with_recovery(recipe, plan, options, prepared, replanner=replanner)
    if rc != 0 or options.processes.node_rank != 0:
        return TrainOutcome(planned, exit_code=rc)
    metrics = read_metrics(prepared.output_dir / METRICS)
    if metrics is None:
        raise LowvramError(f"the training processes finished but {prepared.output_dir / METRICS} cannot be read",
                           f"`lowvram show {prepared.output_dir}` names what is wrong with it")
    return TrainOutcome(planned, result=RunResult(output_dir=str(prepared.output_dir), metrics=metrics,
                                                  resumed_from=metrics.resumed_from))
