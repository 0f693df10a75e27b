"""Generated accelerate configs load in accelerate and match the plan's backend."""

from __future__ import annotations

import dataclasses

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.types import Plan
from lowvram.train.launch import (
    LaunchSpec,
    accelerate_config,
    launch_command,
    shell_line,
    write_config,
)

BASE = Plan(device="cuda", mixed_precision="bf16", gradient_checkpointing=True, micro_batch_size=2,
            grad_accum=4, lora=True, quantization="none", optimizer="adamw", offload="none",
            attention="sdpa", loss="standard", gpus=2)


def load(cfg, tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig

    return ClusterConfig.from_yaml_file(yaml_file=str(write_config(cfg, tmp_path)))


def test_ddp_config_loads(tmp_path):
    c = load(accelerate_config(BASE, LaunchSpec(gpus=2)), tmp_path)
    assert str(c.distributed_type) in ("MULTI_GPU", "DistributedType.MULTI_GPU")
    assert c.num_processes == 2 and c.mixed_precision == "no"


def test_cpu_ddp_uses_gloo_multi_cpu(tmp_path):
    c = load(accelerate_config(BASE, LaunchSpec(gpus=2, cpu=True)), tmp_path)
    assert "MULTI_CPU" in str(c.distributed_type) and c.use_cpu is True


def test_fsdp2_offload(tmp_path):
    plan = dataclasses.replace(BASE, offload="fsdp-offload", mixed_precision="bf16-mixed")
    cfg = accelerate_config(plan, LaunchSpec(gpus=4), layer_cls="LlamaDecoderLayer")
    c = load(cfg, tmp_path)
    assert "FSDP" in str(c.distributed_type)
    assert c.fsdp_config["fsdp_version"] == 2 and c.fsdp_config["fsdp_offload_params"] is True
    assert c.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    assert c.mixed_precision == "bf16"


@pytest.mark.parametrize("offload,stage,opt,param", [
    ("zero2", 2, "none", "none"), ("optimizer", 2, "cpu", "none"), ("zero3", 3, "none", "none"),
    ("zero3-offload", 3, "cpu", "cpu"),
])
def test_deepspeed_stages(tmp_path, offload, stage, opt, param):
    c = load(accelerate_config(dataclasses.replace(BASE, offload=offload), LaunchSpec(gpus=2)), tmp_path)
    ds = c.deepspeed_config
    assert (ds["zero_stage"], ds["offload_optimizer_device"], ds["offload_param_device"]) == (stage, opt, param)
    assert ds["gradient_accumulation_steps"] == 4


def test_several_nodes(tmp_path):
    cfg = accelerate_config(BASE, LaunchSpec(gpus=8, nodes=2, node_rank=1, main_address="10.0.0.1:29501"))
    assert (cfg["num_processes"], cfg["num_machines"], cfg["machine_rank"]) == (16, 2, 1)
    assert (cfg["main_process_ip"], cfg["main_process_port"]) == ("10.0.0.1", 29501)


def test_bad_main_address():
    with pytest.raises(LowvramError, match="HOST:PORT"):
        accelerate_config(BASE, LaunchSpec(gpus=2, nodes=2, main_address="nohost"))


def test_fsdp_refuses_int8():
    plan = dataclasses.replace(BASE, offload="fsdp", quantization="int8")
    with pytest.raises(LowvramError, match="FSDP cannot shard"):
        accelerate_config(plan, LaunchSpec(gpus=2))


def test_launch_command_is_argv_not_shell(tmp_path):
    cmd = launch_command(tmp_path / "c.yaml", tmp_path / "r.yaml", ["training.output_dir=a b; rm -rf /"])
    assert cmd[1:4] == ["-m", "accelerate.commands.launch", "--config_file"]
    assert cmd[-1] == "training.output_dir=a b; rm -rf /"
    assert "'training.output_dir=a b; rm -rf /'" in shell_line(cmd)
