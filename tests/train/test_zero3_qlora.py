"""ZeRO-3 with a 4-bit base follows peft's ZeRO-3 QLoRA recipe (peft docs "DeepSpeed", accelerate's
QLoRA + ZeRO-3 example): the packed weights are stored in the compute dtype, and the model is
loaded while the TrainingArguments' DeepSpeed weakref makes ``is_deepspeed_zero3_enabled()`` true
(issue 24 item 7). The environment is the one accelerate's own launcher derives from the config
lowvram writes; the model is loaded by lowvram's loader through the real from_pretrained."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from lowvram.planning.fixed import resolve_fixed
from lowvram.recipe import parse_recipe
from lowvram.train.run import launch


def _recipe(tmp_path, model_dir):
    (tmp_path / "data.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n')
    return parse_recipe(f"""\
model: {{name_or_path: {model_dir}}}
data: {{datasets: [{{path: data.jsonl, format: alpaca}}]}}
training: {{max_steps: 1, batch_size: 2, seq_len: 32, output_dir: out}}
techniques: {{lora: on}}
""", source=tmp_path / "recipe.yaml")


def _launched_env(plan, tmp_path) -> dict[str, str]:
    """The ACCELERATE_* variables `accelerate launch` gives a worker for this plan's config
    (accelerate commands/launch.py launch_command -> utils/launch.py prepare_deepspeed_cmd_env)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    config = tmp_path / "accelerate.yaml"
    config.write_text(yaml.safe_dump(launch.accelerate_config(plan, launch.LaunchSpec(gpus=1))))
    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(config), "x.py"]))
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as launch_command sets it
    _, env = prepare_deepspeed_cmd_env(args)
    return {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}


@pytest.mark.parametrize("offload", ["zero3", "zero3-offload", "full", "fsdp"])
def test_a_sharded_4bit_base_is_stored_in_the_compute_dtype(tmp_path, tiny_model_dir, offload):
    import torch

    from lowvram.train.build.model import quantization_config

    plan = replace(resolve_fixed(_recipe(tmp_path, tiny_model_dir)), lora=True, quantization="nf4-dq",
                   mixed_precision="bf16", offload=offload, device="cuda")
    assert quantization_config(plan).bnb_4bit_quant_storage == torch.bfloat16
    # ZeRO-2 shards no parameter: the packed bytes stay uint8 (bitsandbytes' default).
    assert quantization_config(replace(plan, offload="zero2")).bnb_4bit_quant_storage == torch.uint8


def test_zero3_qlora_loads_with_zero3_enabled(tmp_path, tiny_model_dir, monkeypatch):
    pytest.importorskip("deepspeed", reason="transformers' HfDeepSpeedConfig needs the deepspeed package")
    import torch
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    from lowvram.train.run import run

    recipe = _recipe(tmp_path, tiny_model_dir)
    # fp32: TrainingArguments refuses bf16 on a machine without a bf16 GPU unless use_cpu.
    plan = replace(resolve_fixed(recipe), lora=True, quantization="nf4", mixed_precision="fp32",
                   offload="zero3", device="cuda")
    env = _launched_env(plan, tmp_path)
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3" and env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "true"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    seen = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):  # records, then the real from_pretrained
        seen.append((is_deepspeed_zero3_enabled(), kwargs.get("quantization_config"), kwargs.get("device_map")))
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    try:
        args, loaded = run._arguments_then_model(recipe, plan)
        assert args.deepspeed_plugin is not None and args.deepspeed_plugin.zero_stage == 3
    finally:
        AcceleratorState._reset_state(True)
    [(zero3, q, device_map)] = seen
    assert zero3, "from_pretrained ran before the TrainingArguments' DeepSpeed weakref existed"
    assert q.bnb_4bit_quant_storage == torch.float32 and device_map is None  # ZeRO-3 refuses a device_map
    packed = [p for p in loaded.model.parameters() if type(p).__name__ == "Params4bit"]
    assert packed and {p.dtype for p in packed} == {torch.float32}
