"""What the libraries make of a Plan, built with lowvram's own builders and checked by each
library's own validation, on the CPU (tests/test_library_configs.py, the FSDP2/DeepSpeed
regression tests).

The accelerate config is lowvram's (train.launch.accelerate_config, written by write_config);
the environment a launched worker gets from it is accelerate's own (its ``accelerate launch``
argument processing: commands/launch.py ``_validate_launch_command``, then
utils/launch.py ``prepare_deepspeed_cmd_env`` / ``prepare_multi_gpu_env``); TrainingArguments
are lowvram's build_training_args under that environment. Two things are faked, and only
these: the bf16 device probe TrainingArguments makes (``is_torch_bf16_gpu_available``: there
is no Ampere card here) and, for DeepSpeed's batch-size check, the world size (no process group
is started). Everything else runs as it would on the GPU machine.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from unittest import mock

# The variables accelerate launch sets that the worker's libraries read.
_LAUNCH_PREFIXES = ("ACCELERATE_", "FSDP_")


def launch_environment(cfg: dict, out_dir: Path) -> dict[str, str]:
    """The ACCELERATE_*/FSDP_* environment ``accelerate launch --config_file`` gives a worker for
    lowvram's config ``cfg`` (written with train.launch.write_config), by accelerate's own code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    from lowvram.train.launch import write_config

    path = write_config(cfg, out_dir)
    args = launch_command_parser().parse_args(["--config_file", str(path), "worker.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        # what accelerate's launch_command does before deepspeed_launcher (commands/launch.py)
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(_LAUNCH_PREFIXES)}


@contextlib.contextmanager
def launched(env: dict[str, str]):
    """``env`` set (and every other ACCELERATE_*/FSDP_* variable removed) for the block; the
    accelerate state reset before and after, so each plan starts as a fresh worker."""
    from accelerate.state import AcceleratorState

    saved = {k: v for k, v in os.environ.items() if k.startswith(_LAUNCH_PREFIXES)}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)
        AcceleratorState._reset_state(reset_partial_state=True)


def training_arguments(recipe, plan):
    """lowvram's build_training_args for ``plan`` on this CPU machine: bf16 is accepted as on an
    Ampere card (TrainingArguments' only device probe, faked); every other check is real."""
    import transformers.training_args as ta

    from lowvram.train.trainer import build_training_args

    with mock.patch.object(ta, "is_torch_bf16_gpu_available", lambda: True):
        return build_training_args(recipe, plan)


def meta_model(model_config):
    """The model of ``model_config`` on the meta device (no memory), for the Trainer's DeepSpeed
    finalisation, which reads its config; built outside a launched block (under ZeRO-3,
    transformers would build it inside deepspeed.zero.Init)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config)


def finalize_deepspeed(args, model, world_size: int, steps: int = 10) -> dict:
    """The Trainer's DeepSpeed configuration steps on ``args`` (built under a DeepSpeed launch
    environment): transformers' propagate_args_to_deepspeed (HfTrainerDeepSpeedConfig
    trainer_config_process: the mismatch check against max_grad_norm, batch sizes, lr...) and
    trainer_config_finalize (the ``auto`` sizes from ``model``'s hidden size), with ``world_size``
    faked. transformers' HfTrainerDeepSpeedConfig needs the deepspeed package installed."""
    from types import SimpleNamespace

    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import propagate_args_to_deepspeed

    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=args.deepspeed_plugin))
    with mock.patch.object(TrainingArguments, "world_size", new_callable=mock.PropertyMock,
                           return_value=world_size):
        propagate_args_to_deepspeed(accelerator, args)
        args.deepspeed_plugin.hf_ds_config.trainer_config_finalize(args, model, steps)
    return args.deepspeed_plugin.deepspeed_config
