"""Several GPUs: generate an accelerate config for the backend the plan chose, and the command.

lowvram never runs its own distributed engine: it writes an ``accelerate`` config (DDP, FSDP2 or
DeepSpeed ZeRO, with CPU offload where the plan says so) and starts ``accelerate launch`` on
``python -m lowvram.train.worker``, which runs the same training code as a single-GPU run.

Config keys follow accelerate's ``ClusterConfig`` (accelerate/commands/config/config_args.py)
and its launch flags (accelerate/commands/launch.py); DeepSpeed keys follow accelerate's
DeepSpeed plugin (``zero_stage``, ``offload_optimizer_device``, ``offload_param_device``).
No torch import here: ``--print-launch`` is instant.
"""

from __future__ import annotations

import importlib.util
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from lowvram.errors import LowvramError
from lowvram.plan.types import Plan

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


@dataclass(frozen=True)
class LaunchSpec:
    gpus: int = 1  # processes per node
    nodes: int = 1
    node_rank: int = 0
    main_address: str | None = None  # HOST:PORT of rank 0 (several nodes)
    cpu: bool = False  # processes on CPU with the gloo backend (tests, machines without GPUs)


def _precision(plan: Plan) -> str:
    # Weights stored in bf16/fp16 need no autocast; *-mixed means fp32 master weights + autocast.
    return {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(plan.mixed_precision, "no")


def _main_address(spec: LaunchSpec) -> tuple[str, int]:
    if not spec.main_address:
        return "127.0.0.1", 29500
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
    if backend == "fsdp" and plan.quantization not in ("none", "nf4", "nf4-dq", "fp4"):
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
            "gradient_clipping": 1.0,
            "zero3_init_flag": stage == 3,
            "zero3_save_16bit_model": stage == 3,
        }
    return cfg


def check_backend_installed(plan: Plan) -> None:
    if backend_for(plan) == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise LowvramError(
            f"the plan needs DeepSpeed (offload: {plan.offload}) and it is not installed",
            "pip install 'lowvram[deepspeed]'  (or set techniques.offload: fsdp / fsdp-offload, which need nothing extra)",
        )


def write_config(cfg: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "accelerate_config.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(
        "# Generated by lowvram for this plan; edit it and run the command lowvram printed.\n"
        + yaml.safe_dump(cfg, sort_keys=False)
    )
    tmp.replace(path)
    return path


def launch_command(config_path: Path, recipe_path: Path, overrides: list[str] | tuple = (), extra: list[str] | tuple = ()) -> list[str]:
    """argv for `accelerate launch` on the worker; never run through a shell."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_path),
           "-m", "lowvram.train.worker", str(recipe_path)]
    for item in overrides:
        cmd += ["--set", item]
    return cmd + list(extra)


def shell_line(cmd: list[str]) -> str:
    """The command as a user would paste it into a shell."""
    return " ".join(shlex.quote(c) for c in cmd)
