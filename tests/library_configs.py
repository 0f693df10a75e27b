"""What the libraries make of a Plan, built with lowvram's own builders and checked by each
library's own validation, on the CPU (tests/check/test_library_configs.py, the FSDP2/DeepSpeed
regression tests).

The accelerate config is lowvram's (train.launch.accelerate_config, written by write_config);
the environment a launched worker gets from it is accelerate's own (its ``accelerate launch``
argument processing: commands/launch.py ``_validate_launch_command``, then
utils/launch.py ``prepare_deepspeed_cmd_env`` / ``prepare_multi_gpu_env``); TrainingArguments
are lowvram's build_training_args under that environment. Two things are faked, and only
these: the bf16 device probe TrainingArguments makes (``is_torch_bf16_gpu_available``: there
is no Ampere card here) and, for DeepSpeed's batch-size check, the world size (no process group
is started). Everything else runs as it would on the GPU machine.

Validated per plan (validate_plan): accelerate launch's parsing of lowvram's written config
(_validate_launch_command, prepare_*_env); TrainingArguments.__post_init__ under that environment
(every check but the bf16 device probe); accelerate's FullyShardedDataParallelPlugin and
DeepSpeedPlugin as the Accelerator / TrainingArguments build them from it; transformers'
HfTrainerDeepSpeedConfig trainer_config_process + trainer_config_finalize (with deepspeed
installed); BitsAndBytesConfig.post_init; from_config with the plan's dtype and
attn_implementation (transformers' attention-implementation check) on the meta device; peft's
LoraConfig + get_peft_model target matching and transformers' checkpointing switch, through
lowvram's prepare_model, on a 2-layer meta copy of the model's architecture. Not validated (they
need a GPU): bitsandbytes' quantizer environment check and the quantization itself, the
Accelerator's process group (NCCL), fully_shard on CUDA, DeepSpeed's engine initialisation.
"""

from __future__ import annotations

import contextlib
import importlib.util
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

    from lowvram.train.run.launch import write_config

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
    accelerate state reset before and after, and transformers' ZeRO-3 weakref dropped after, so
    each plan starts as a fresh worker."""
    from accelerate.state import AcceleratorState

    saved = {k: v for k, v in os.environ.items() if k.startswith(_LAUNCH_PREFIXES)}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)
        AcceleratorState._reset_state(reset_partial_state=True)
        unset_hf_deepspeed_config()  # ZeRO-3 TrainingArguments leave a global weakref behind


def training_arguments(recipe, plan):
    """lowvram's build_training_args for ``plan`` on this CPU machine: bf16 is accepted as on an
    Ampere card (TrainingArguments' only device probe, faked); every other check is real."""
    import transformers.training_args as ta

    from lowvram.train.build.trainer import build_training_args

    with mock.patch.object(ta, "is_torch_bf16_gpu_available", lambda: True):
        return build_training_args(recipe, plan)


def meta_model(model_config):
    """The model of ``model_config`` on the meta device (no memory), for the Trainer's DeepSpeed
    finalisation, which reads its config; built outside a launched block (under ZeRO-3,
    transformers would build it inside deepspeed.zero.Init)."""
    import torch

    from lowvram.train.build.model import has_vision, model_class

    with torch.device("meta"):
        return model_class(has_vision(model_config)).from_config(model_config)


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


# --------------------------------------------------------------------------------------------
# Every plan the search returns for CUDA cards, and the libraries' verdict on its configuration

CARDS_GB = (8, 12, 16, 24, 40, 48, 80)
GPU_COUNTS = (1, 2, 4)
METHOD_NAMES = (None, "full", "lora", "qlora")  # None: --method left to the planner


def searched_plan(name: str, method: str | None, card_gb: int, gpus: int):
    """What `lowvram plan --model NAME [--method M] --vram {card_gb}GB [--gpus N]` chooses, by the
    planning layer's own request and budget builders (no hardware queried: a bf16 card). Plans
    that need DeepSpeed count as runnable (the extra may be installed where they run); Liger's
    fused loss only where liger_kernel is installed, as make_budget says. None: nothing fits."""
    from dataclasses import replace

    from lowvram.plan.choose.choose import choose_plan
    from lowvram.plan.model.catalog import resolve_model
    from lowvram.planning.budget import make_budget, missing_extras
    from lowvram.planning.from_recipe import build_request, flag_choices

    fields, sources = flag_choices(method, gpus=gpus if gpus > 1 else None)
    budget = make_budget(f"{card_gb}GB", None, gpus)
    budget = replace(budget, missing_extras=tuple(e for e in missing_extras() if e != "deepspeed"))
    choice = choose_plan(build_request(resolve_model(name), None, fields, sources), budget)
    return choice.plan if choice.fits else None


def config_key(name: str, plan) -> tuple:
    """What a plan hands the libraries (two plans with the same key build the same configurations)."""
    return (name, plan.mixed_precision, plan.quantization, plan.lora, plan.optimizer, plan.offload,
            plan.attention, plan.loss, plan.gradient_checkpointing, plan.activation_offload, plan.gpus,
            plan.micro_batch_size, plan.grad_accum, plan.lora_targets)


def _small_config(name: str, attention: str):
    """The model's own architecture (lowvram.check.builders.hf_config of its catalog spec) cut to
    two decoder layers: the module names LoRA targets and the attention classes are the same."""
    from dataclasses import replace

    from lowvram.check.builders import hf_config
    from lowvram.plan.model.catalog import resolve_model

    return hf_config(replace(resolve_model(name), num_layers=2), attention)


def validate_plan(name: str, plan, work: Path) -> list[str]:
    """Build every configuration ``plan`` hands the libraries, with lowvram's own builders, and run
    each library's own validation on it; a rejection raises. Returns what was validated."""
    import torch

    from lowvram.train.build.model import (
        has_vision,
        load_kwargs,
        model_class,
        prepare_model,
        quantization_config,
    )
    from lowvram.train.run.launch import LaunchSpec, accelerate_config

    done = []
    # from_pretrained arguments: dtype and attention implementation through transformers' own
    # checks (from_config on the meta device); the BitsAndBytesConfig through its post_init.
    cfg = _small_config(name, plan.attention)
    vision = has_vision(cfg)
    kwargs = load_kwargs(plan, vision)
    q = quantization_config(plan, vision)
    if q is not None:
        q.post_init()
        assert kwargs["quantization_config"].to_dict() == q.to_dict()
        done.append("BitsAndBytesConfig")
    with torch.device("meta"):
        model = model_class(vision).from_config(cfg, dtype=kwargs["dtype"], attn_implementation=kwargs["attn_implementation"])
    done.append("from_pretrained dtype/attn_implementation")
    # LoRA (peft's LoraConfig and get_peft_model matching its targets) and checkpointing, as
    # lowvram.train.build.model.prepare_model applies them
    model = prepare_model(model, plan, seed=0)
    if plan.lora:
        done.append("LoraConfig")
    recipe = _recipe(work, plan)
    launched_run = plan.gpus > 1 or plan.offload != "none"
    env = launch_environment(accelerate_config(plan, LaunchSpec(gpus=plan.gpus)), work) if launched_run else {}
    if launched_run:
        done.append("accelerate launch config")
    with launched(env):
        args = training_arguments(recipe, plan)
        done.append("TrainingArguments")
        if env.get("ACCELERATE_USE_FSDP") == "true":
            from accelerate.utils import FullyShardedDataParallelPlugin

            plugin = FullyShardedDataParallelPlugin()  # what the Accelerator builds from this env
            assert plugin.fsdp_version == 2 and plugin.cpu_ram_efficient_loading
            done.append("FullyShardedDataParallelPlugin")
        if env.get("ACCELERATE_USE_DEEPSPEED") == "true":
            assert args.deepspeed_plugin is not None
            done.append("DeepSpeedPlugin")
    if env.get("ACCELERATE_USE_DEEPSPEED") == "true" and importlib.util.find_spec("deepspeed") is not None:
        ds_model = meta_model(cfg)  # outside the block: under ZeRO-3 it would go to zero.Init
        with launched(env):
            args = training_arguments(recipe, plan)
            ds = finalize_deepspeed(args, ds_model, plan.gpus)
        assert ds["train_micro_batch_size_per_gpu"] == plan.micro_batch_size
        done.append("HfTrainerDeepSpeedConfig")
    return done


def _recipe(work: Path, plan):
    """A recipe with the schema's training defaults and the plan's batch (what build_training_args reads)."""
    from lowvram.recipe import parse_recipe

    batch = plan.micro_batch_size * plan.grad_accum * plan.gpus
    return parse_recipe(f"""
model: {{name_or_path: unused}}
data: {{datasets: [{{path: data.jsonl, format: completion}}]}}
training: {{output_dir: {work / "out"}, batch_size: {batch}, seq_len: {plan.seq_len}}}
""", source=work / "recipe.yaml")
