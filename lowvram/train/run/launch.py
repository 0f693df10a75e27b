"""Several GPUs: generate an accelerate config for the backend the plan chose, and the command.

lowvram never runs its own distributed engine: it writes an ``accelerate`` config (DDP, FSDP2 or
DeepSpeed ZeRO, with CPU offload where the plan says so) and starts ``accelerate launch`` on
``python -m lowvram.train.run.worker``, which runs the same training code as a single-GPU run.

Config keys follow accelerate's ``ClusterConfig`` (accelerate/commands/config/config_args.py)
and its launch flags (accelerate/commands/launch.py); DeepSpeed keys follow accelerate's
DeepSpeed plugin (``zero_stage``, ``offload_optimizer_device``, ``offload_param_device``).
No torch import here: ``--print-launch`` is instant.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import yaml

from lowvram.errors import LowvramError
from lowvram.hardware import Hardware
from lowvram.plan.choose.replan import Replanner
from lowvram.plan.types import Plan
from lowvram.recipe import Recipe
from lowvram.runfiles import CONFIG, LAUNCH_LOG, LAUNCH_PLAN, LAUNCH_REQUEST, write_atomic
from lowvram.train.types import LaunchSpec, TrainOptions
from lowvram.vocab import FSDP_QUANTIZATIONS

# plan.offload -> (backend, ZeRO stage, offload optimizer, offload params)
BACKENDS: dict[str, tuple[str, int, bool, bool]] = {
    "none": ("ddp", 0, False, False),
    "zero2": ("deepspeed", 2, False, False),
    "zero2-offload": ("deepspeed", 2, True, False),
    "optimizer": ("deepspeed", 2, True, False),  # ZeRO-Offload: optimizer states + step on CPU
    "zero3": ("deepspeed", 3, False, False),
    "zero3-offload": ("deepspeed", 3, True, True),
    "full": ("deepspeed", 3, True, True),  # ZeRO-Infinity style: params and optimizer on CPU
    "fsdp": ("fsdp", 0, False, False),
    "fsdp-offload": ("fsdp", 0, True, True),
}


def _precision(plan: Plan) -> str:
    # Weights stored in bf16/fp16 need no autocast; *-mixed means fp32 master weights + autocast.
    return {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(plan.mixed_precision, "no")


def _main_address(spec: LaunchSpec) -> tuple[str, int]:
    if not spec.main_address:
        if spec.nodes > 1:
            raise LowvramError(
                f"--nodes {spec.nodes} needs --main-address HOST:PORT (where --node-rank 0 runs)",
                "e.g. --main-address 10.0.0.1:29500 on every node",
            )
        return "127.0.0.1", 0  # one machine: accelerate picks a free port
    host, _, port = spec.main_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LowvramError(
            f"--main-address must be HOST:PORT, got {spec.main_address!r}",
            "e.g. --main-address 10.0.0.1:29500 (the machine with --node-rank 0)",
        )
    return host, int(port)


def backend_for(plan: Plan) -> str:
    return BACKENDS[plan.offload][0]


def accelerate_config(plan: Plan, spec: LaunchSpec, layer_cls: str | None = None) -> dict:
    """The accelerate config for this plan (a dict written as YAML)."""
    backend, stage, off_opt, off_params = BACKENDS[plan.offload]
    if backend == "fsdp" and plan.quantization not in FSDP_QUANTIZATIONS:
        raise LowvramError(
            f"FSDP cannot shard a {plan.quantization} base",
            "use quantization nf4/nf4-dq with FSDP (peft's QLoRA + FSDP), or offload: zero3",
        )
    host, port = _main_address(spec)
    total = spec.gpus * spec.nodes
    cfg: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "num_machines": spec.nodes,
        "machine_rank": spec.node_rank,
        "num_processes": total,
        "main_process_ip": host,
        "main_process_port": port,
        "mixed_precision": _precision(plan),
        "use_cpu": spec.cpu,
        "rdzv_backend": "static",
        "same_network": True,
        "main_training_function": "main",
        "debug": False,
    }
    if backend == "ddp":
        cfg["distributed_type"] = "MULTI_CPU" if spec.cpu else ("MULTI_GPU" if total > 1 else "NO")
    elif backend == "fsdp":
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = {
            # FSDP2 (per-parameter sharding, fully_shard) where accelerate supports it.
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_offload_params": off_params,
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            # accelerate refuses cpu_ram_efficient_loading without it: rank 0 loads the weights,
            # the others receive them.
            "fsdp_sync_module_states": True,
            # Gradient checkpointing goes through the Trainer (use_reentrant=False), not FSDP.
            "fsdp_activation_checkpointing": False,
        }
        if layer_cls:
            cfg["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = layer_cls
    else:
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = {
            "zero_stage": stage,
            "offload_optimizer_device": "cpu" if off_opt else "none",
            "offload_param_device": "cpu" if off_params else "none",
            "gradient_accumulation_steps": plan.grad_accum,
            # "auto": the Trainer fills it from training.max_grad_norm. A number here must equal
            # max_grad_norm, or HfTrainerDeepSpeedConfig.trainer_config_process (transformers/
            # integrations/deepspeed.py, fill_match) refuses the run at train start; accelerate
            # passes "auto" through (DeepSpeedPlugin.__post_init__, ACCELERATE_GRADIENT_CLIPPING).
            "gradient_clipping": "auto",
            "zero3_init_flag": stage == 3,
            "zero3_save_16bit_model": stage == 3,
        }
    return cfg


def write_plan(plan: Plan, out_dir: Path) -> Path:
    """The parent's plan for the workers (``--plan``); not named plan.json (the run writes that)."""
    import json

    path = out_dir / LAUNCH_PLAN
    write_atomic(path, json.dumps(plan.to_dict(), indent=2) + "\n")
    return path


def read_plan(path: Path) -> Plan:
    import json

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise LowvramError(f"cannot read the launch plan {path}: {e}",
                           "run `lowvram train RECIPE --gpus N` (it writes the plan and the config)") from None
    return Plan.from_dict(data)


def write_request(replanner: Replanner, out_dir: Path) -> Path:
    """The plan's request for the workers (``--request``): what their Replanner asks again."""
    import json

    path = out_dir / LAUNCH_REQUEST
    write_atomic(path, json.dumps(replanner.to_dict(), indent=2) + "\n")
    return path


def read_replanner(path: Path | None) -> Replanner:
    """The Replanner of write_request's file; without one, a Replanner that predicts nothing."""
    import json

    if path is None:
        return Replanner()
    try:
        return Replanner.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise LowvramError(f"cannot read the launch request {path}: {e}",
                           "run `lowvram train RECIPE --gpus N` (it writes the plan and the request)") from None


def check_backend_installed(plan: Plan) -> None:
    if backend_for(plan) == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise LowvramError(
            f"the plan needs DeepSpeed (offload: {plan.offload}) and it is not installed",
            "pip install 'lowvram[deepspeed]'  (or set techniques.offload: fsdp / fsdp-offload, which need nothing extra)",
        )


def check_cpu_adam_buildable(plan: Plan) -> None:
    """An offload that runs DeepSpeed's CPU Adam (plan.setup.DEEPSPEED_CPU_OPTIMIZER) on a machine
    that cannot build it (deepspeed JIT-compiles the op at optimizer creation: deps.cpu_adam_build_problems):
    refused here, before the workers load the model, instead of a compile error inside a worker."""
    from lowvram.deps import cpu_adam_build_problems
    from lowvram.plan.setup import DEEPSPEED_CPU_OPTIMIZER

    if plan.offload not in DEEPSPEED_CPU_OPTIMIZER or plan.device == "cpu":
        return
    problems = cpu_adam_build_problems()
    if problems:
        raise LowvramError(
            f"offload {plan.offload} runs DeepSpeed's CPU Adam, which DeepSpeed builds at its first use, and "
            f"it cannot be built here: {'; '.join(problems)}",
            "install what is missing (apt-get install g++ python3-dev; pip install ninja; about a minute "
            "of compiling at the first run), or prebuild it (DS_BUILD_CPU_ADAM=1 pip install deepspeed), "
            "or set techniques.offload: none (--gpus N: fsdp-offload keeps the optimizer on the CPU "
            "without DeepSpeed)")


def write_config(cfg: dict, out_dir: Path) -> Path:
    path = out_dir / CONFIG
    write_atomic(path, "# Generated by lowvram for this plan; edit it and run the command lowvram printed.\n"
                 + yaml.safe_dump(cfg, sort_keys=False))
    return path


def launch_command(config_path: Path, recipe_path: Path, overrides: list[str] | tuple = (),
                   extra: list[str] | tuple = (), spec: LaunchSpec | None = None,
                   plan_path: Path | None = None, plan: Plan | None = None,
                   request_path: Path | None = None) -> list[str]:
    """argv for `accelerate launch` on the worker; never run through a shell.

    ``plan_path``: the parent's plan as JSON, so every rank trains with exactly that plan;
    ``request_path``: its request, so the ranks predict without the recipe's model.
    """
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_path)]
    if spec is not None:
        if spec.cpu and spec.world_size > 1 and (plan is None or backend_for(plan) == "ddp"):
            # accelerate starts MULTI_CPU runs as one process (it expects mpirun); --multi_gpu
            # makes it start torchrun with N processes, each of which trains on the CPU (use_cpu,
            # gloo) because the Trainer is built with use_cpu. FSDP configs go through torchrun
            # already (and --multi_gpu would switch FSDP off).
            cmd.append("--multi_gpu")
        cmd += ["--rdzv_conf", f"timeout={spec.rdzv_timeout_s}"]
    cmd += ["-m", "lowvram.train.run.worker", str(recipe_path)]
    if plan_path is not None:
        cmd += ["--plan", str(plan_path)]
    if request_path is not None:
        cmd += ["--request", str(request_path)]
    for item in overrides:
        cmd += ["--set", item]
    return cmd + list(extra)


# --------------------------------------------------------------------------------------------
# `lowvram train --gpus N`: check, write the files, start accelerate, explain failures


def check_devices(spec: LaunchSpec, hardware: Hardware) -> None:
    """--gpus must not exceed the GPUs this node can see (CPU runs: any number of processes)."""
    if spec.cpu:
        return
    visible = len(hardware.devices) if hardware.kind == "cuda" else 0
    if spec.gpus > visible:
        raise LowvramError(
            f"--gpus {spec.gpus} but this machine has {visible} visible CUDA GPU(s)",
            f"use --gpus {max(visible, 1)} (per node; --nodes for more machines), check CUDA_VISIBLE_DEVICES, "
            "or pass --cpu to run the processes on the CPU",
        )


# CPU runs (--cpu): DDP and FSDP2 run over gloo. accelerate alone would drop the FSDP plugin on
# the CPU (see lowvram.train.build.trainer.configure_cpu_fsdp_state, which works around it); DeepSpeed's
# ZeRO needs GPUs.


def check_plan_for_launch(plan: Plan, spec: LaunchSpec) -> None:
    if spec.cpu and backend_for(plan) == "deepspeed":
        raise LowvramError(
            f"offload {plan.offload} cannot run on the CPU: DeepSpeed ZeRO needs GPUs",
            "set techniques.offload: off (DDP over gloo) or fsdp (FSDP2 over gloo) for a CPU run, or run on GPUs",
        )
    if spec.cpu and plan.offload == "fsdp-offload":
        raise LowvramError(
            "offload fsdp-offload moves shards to CPU RAM, and a CPU run keeps everything there already",
            "set techniques.offload: fsdp for a CPU run (FSDP2 over gloo)",
        )


@dataclass(frozen=True)
class Launch:
    command: list[str]
    config_path: Path
    plan_path: Path
    output_dir: Path
    backend: str  # ddp | fsdp | deepspeed (BACKENDS), for the report


def prepare_launch(recipe: Recipe, plan: Plan, options: TrainOptions, check_output: bool = True,
                   replanner: Replanner | None = None) -> Launch:
    """Check the output folder (unless only printing, ``options.print_launch``, or
    ``check_output=False`` when a retry re-launches into it), write the config, the plan and its
    request (``replanner``), build argv for ``options.processes``."""
    from lowvram.train.build.trainer import output_dir

    spec, print_only = options.processes, options.print_launch
    if options.recipe_path is None:
        raise ValueError("a launch needs the recipe's file (TrainOptions.recipe_path): the workers load it")
    accelerate_config(plan, spec)  # FSDP + int8, a bad --main-address: before touching files
    check_plan_for_launch(plan, spec)
    if not print_only:
        check_backend_installed(plan)
        check_cpu_adam_buildable(plan)
    out = output_dir(recipe)
    if print_only:
        from lowvram.runfiles import require_writable
        from lowvram.train.run.lock import folder_words

        require_writable(out, *folder_words("lowvram train --print-launch"))
    if not print_only and check_output:
        from lowvram.train.run.folder import prepare_output_dir

        prepare_output_dir(out, options.resume, options.overwrite, recipe=recipe, plan=plan)
    cfg_path = write_config(accelerate_config(plan, spec), out)
    plan_path = write_plan(plan, out)
    request_path = write_request(replanner, out) if replanner is not None else None
    extra = ["--resume"] if options.resume else []
    cmd = launch_command(cfg_path, Path(options.recipe_path).resolve(), list(options.overrides), extra, spec,
                         plan_path, plan, request_path)
    return Launch(cmd, cfg_path, plan_path, out, backend_for(plan))


# torchrun / c10d messages that mean the processes never found each other.
_RENDEZVOUS_FAILURES = ("RendezvousTimeoutError", "DistNetworkError", "RendezvousConnectionError",
                        "Socket Timeout", "timed out", "Connection refused", "client socket has timed out")


class _StderrFilter:
    """Which lines of the launcher's stderr reach the user: not Python tracebacks, not torchrun's
    failure summary and glog lines (all kept in launch.log); the worker's error/hint is shown."""

    _GLOG = re.compile(r"^\[?[WEIF]\d{4} \d\d:\d\d:\d\d|^frame #\d+: |^Exception raised from |^<omitting python frames>")

    def __init__(self) -> None:
        self.traceback = False
        self.summary = 0  # ==== rules seen inside torchrun's ChildFailedError summary

    def __call__(self, line: str) -> bool:
        if "Traceback (most recent call last)" in line:
            self.traceback = True
            return False
        if self.traceback:
            if line[:1].isspace() or not line.strip():
                return False
            self.traceback = False
            if "ChildFailedError" in line:
                self.summary = 1
                return False
            return True  # the exception line itself
        if "ChildFailedError" in line:
            self.summary = 1
            return False
        if self.summary:
            if line.startswith("====="):
                self.summary += 1
                if self.summary > 2:
                    self.summary = 0
            return False
        return not self._GLOG.match(line)


def run_launch(launch: Launch, spec: LaunchSpec, stderr: TextIO | None = None, track_memory: bool = True,
               env: dict[str, str] | None = None) -> int:
    """Run accelerate (argv, no shell); stream its output; tracebacks go to launch.log only.

    A rendezvous that fails (a node cannot reach --main-address within spec.rdzv_timeout_s)
    raises LowvramError; any other failure returns the exit code (the worker printed its error).
    """
    import collections
    import os
    import subprocess

    stderr = stderr or sys.stderr
    log_path = launch.output_dir / LAUNCH_LOG
    tail: collections.deque[str] = collections.deque(maxlen=400)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if not track_memory:  # `--no-track-memory`: read by lowvram.train.run.run in every worker
        env["LOWVRAM_TRACK_MEMORY"] = "0"
    proc = subprocess.Popen(launch.command, stderr=subprocess.PIPE, text=True, env=env)
    shown = _StderrFilter()
    with log_path.open("w", encoding="utf-8") as log:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.write(line)
            tail.append(line)
            if shown(line):
                stderr.write(line)
                stderr.flush()
    rc = proc.wait()
    if rc == 0:
        return 0
    text = "".join(tail)
    if "error: " in text and "hint: " in text:
        return rc  # the worker's own error/hint was printed above
    from lowvram.train.run.oom import has_oom_reports

    if has_oom_reports(launch.output_dir):
        return rc  # out of memory: the caller re-plans (lowvram.train.run.recover.launch_with_recovery)
    if any(s in text for s in _RENDEZVOUS_FAILURES):
        host, port = _main_address(spec)
        where = f"{host}:{port}" if spec.nodes > 1 else "the local processes"
        raise LowvramError(
            f"the training processes could not meet: node {spec.node_rank} did not reach {where} "
            f"within {spec.rdzv_timeout_s} s",
            "start --node-rank 0 first, check --main-address (reachable host, open port, same on every "
            f"node), or raise --rdzv-timeout; full log: {log_path}",
        )
    raise LowvramError(
        f"a training process failed (exit {rc})",
        f"the last lines above show the cause; full log with tracebacks: {log_path}",
    )
