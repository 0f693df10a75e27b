"""Generated accelerate configs load in accelerate and match the plan's backend."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.types import Plan
from lowvram.train.run.launch import (
    LaunchSpec,
    accelerate_config,
    launch_command,
    write_config,
)
from lowvram.units import shell_line

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


def test_fsdp_config_is_accepted_by_accelerate_launch(tmp_path):
    # accelerate launch refuses cpu_ram_efficient_loading without sync_module_states.
    cfg = accelerate_config(dataclasses.replace(BASE, offload="fsdp"), LaunchSpec(gpus=2))
    assert cfg["fsdp_config"]["fsdp_cpu_ram_efficient_loading"] is True
    assert cfg["fsdp_config"]["fsdp_sync_module_states"] is True


def test_launch_command_cpu_and_rendezvous(tmp_path):
    spec = LaunchSpec(gpus=2, cpu=True, rdzv_timeout_s=7)
    cmd = launch_command(tmp_path / "c.yaml", tmp_path / "r.yaml", spec=spec, plan_path=tmp_path / "p.json", plan=BASE)
    assert "--multi_gpu" in cmd  # MULTI_CPU alone would start one process
    assert cmd[cmd.index("--rdzv_conf") + 1] == "timeout=7"
    assert cmd[cmd.index("--plan") + 1] == str(tmp_path / "p.json")
    assert cmd.index("--rdzv_conf") < cmd.index("lowvram.train.run.worker")  # launcher flags first
    fsdp = launch_command(tmp_path / "c.yaml", tmp_path / "r.yaml", spec=spec,
                          plan=dataclasses.replace(BASE, offload="fsdp"))
    assert "--multi_gpu" not in fsdp  # it would turn FSDP off


def test_several_nodes_need_main_address():
    with pytest.raises(LowvramError, match="needs --main-address"):
        accelerate_config(BASE, LaunchSpec(gpus=2, nodes=2))


def test_one_node_picks_a_free_port():
    assert accelerate_config(BASE, LaunchSpec(gpus=2))["main_process_port"] == 0


def test_missing_deepspeed_says_what_to_install(monkeypatch):
    import importlib.util

    from lowvram.train.run import launch

    real = importlib.util.find_spec
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name: None if name == "deepspeed" else real(name))
    with pytest.raises(LowvramError) as err:
        launch.check_backend_installed(dataclasses.replace(BASE, offload="zero3-offload"))
    assert "not installed" in err.value.message and "lowvram[deepspeed]" in err.value.hint
    launch.check_backend_installed(dataclasses.replace(BASE, offload="fsdp"))  # FSDP: nothing extra


def test_plan_round_trips_through_json(tmp_path):
    from lowvram.train.run.launch import read_plan, write_plan

    plan = dataclasses.replace(BASE, reasons={"offload": "why"}, breakdown={"weights": 1}, host_ram_bytes=5)
    assert read_plan(write_plan(plan, tmp_path)) == plan


def test_request_round_trips_through_json(tmp_path):
    """A launched rank rebuilds the parent's Replanner from launch-request.json (no recipe model)."""
    from lowvram.plan.choose.replan import Replanner
    from lowvram.plan.choose.request import PlanRequest
    from lowvram.plan.model.catalog import resolve_model
    from lowvram.train.run.launch import read_replanner, write_request

    request = PlanRequest(model=resolve_model("qwen2.5-7b"), seq_len=2048, lora=True, lora_targets=("q_proj", "v_proj"),
                          sources={"lora": "the recipe"})
    replanner = Replanner(request)
    again = read_replanner(write_request(replanner, tmp_path))
    assert again == replanner
    assert again.peak_at(BASE, 512) == replanner.peak_at(BASE, 512)
    assert read_replanner(write_request(Replanner(), tmp_path)) == Replanner()
    assert read_replanner(None) == Replanner()


# --------------------------------------------------------------------------------------------
# The chooser with several GPUs: DDP, then FSDP2 full shard, then FSDP with CPU offload


def _choose(model: str, gpus: int, vram: str = "24GB", **fields):
    from lowvram.plan.choose.choose import choose_plan
    from lowvram.plan.choose.request import Budget, PlanRequest
    from lowvram.plan.model.catalog import resolve_model
    from lowvram.units import parse_size

    budget = Budget(parse_size(vram), "cuda")
    return choose_plan(PlanRequest(model=resolve_model(model), gpus=gpus, **fields), budget)


def test_ddp_when_the_model_fits_each_card():
    c = _choose("llama-2-7b", 2, quantization="nf4-dq", lora=True)
    assert c.plan.offload == "none" and "DDP" in c.plan.reasons["offload"]


def test_fsdp_when_it_must_be_sharded():
    c = _choose("llama-3.1-8b", 4, lora=False)
    assert c.fits and c.plan.offload == "fsdp"
    assert "DDP (a full copy per GPU) would peak at" in c.plan.reasons["offload"]
    assert c.plan.host_ram_bytes and c.plan.gpus == 4


def test_fsdp_offload_when_sharding_is_not_enough():
    c = _choose("llama-2-70b", 2, vram="16GB", quantization="nf4-dq", lora=True)
    assert c.fits and c.plan.offload == "fsdp-offload"
    assert "fsdp without CPU offload would peak at" in c.plan.reasons["offload"]


def test_sharding_comes_before_lora_and_8bit_optimizer():
    # Exact training (sharded) is preferred to changing what is trained when both fit.
    c = _choose("llama-3.1-8b", 4)
    assert c.plan.offload == "fsdp" and c.plan.lora is False and c.plan.optimizer == "adamw"


def test_recipe_can_force_the_backend():
    c = _choose("llama-3.1-8b", 4, lora=False, offload="zero3", sources={"offload": "the recipe"})
    assert c.plan.offload == "zero3" and c.plan.reasons["offload"] == "set by the recipe"


def test_the_search_never_pairs_fsdp_with_a_bitsandbytes_optimizer():
    """Issue 24 item 1: `lowvram plan --model llama-2-7b --method full --gpus 2 --vram 32GB`
    returned fsdp + adamw_8bit, which fails at the first step (bitsandbytes has no DTensor
    support: tests/train/test_fsdp2_step.py). Now neither the plan nor any alternative pairs them, and
    the reason says why the optimizer stays adamw."""
    from typer.testing import CliRunner

    from lowvram.cli import app
    from lowvram.vocab import BNB_OPTIMIZERS

    r = CliRunner().invoke(app, ["plan", "--model", "llama-2-7b", "--method", "full", "--gpus", "2",
                                 "--vram", "32GB", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    t = d["techniques"]
    assert t["offload"].startswith("fsdp") and t["optimizer"] == "adamw"
    assert "cannot step FSDP2's sharded parameters" in d["reasons"]["optimizer"]
    for model, gpus, vram in [("llama-2-7b", 2, "32GB"), ("llama-3.1-8b", 4, "24GB"), ("llama-2-13b", 2, "40GB"),
                              ("llama-2-70b", 4, "80GB"), ("qwen2.5-1.5b", 2, "8GB")]:
        for method in ({"lora": False}, {}):
            c = _choose(model, gpus, vram, **method)
            for s in [c.chosen.setup, *(a.setup for a in c.alternatives)]:
                assert not (s.offload.startswith("fsdp") and s.optimizer in BNB_OPTIMIZERS), (model, s)


@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"])
def test_a_fixed_bitsandbytes_optimizer_with_fsdp_is_refused(optimizer):
    with pytest.raises(LowvramError, match="cannot step FSDP2's sharded parameters") as e:
        _choose("llama-2-7b", 2, lora=False, optimizer=optimizer, offload="fsdp")
    assert e.value.hint.startswith("use --optimizer adamw with --offload fsdp") and "--offload none (DDP)" in e.value.hint
    # a fixed 8-bit optimizer alone: the search shards without FSDP (DDP, or DeepSpeed ZeRO)
    c = _choose("llama-2-7b", 2, vram="32GB", lora=False, optimizer=optimizer)
    assert not c.plan.offload.startswith("fsdp")


# issue 41 item 12: DeepSpeed's CPU Adam (every offload that moves the optimizer to the CPU) is
# JIT-built by deepspeed at optimizer creation; a machine without a compiler, ninja or Python.h
# failed inside a worker after the model load. Checked before the launch now, and planned around.
def test_cpu_adam_build_problems_read_the_real_deepspeed_and_path(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.git_version_info import installed_ops

    from lowvram.deps import cpu_adam_build_problems

    assert installed_ops["cpu_adam"] is False  # the wheel ships no built op: the JIT path runs
    assert cpu_adam_build_problems({"PATH": "/usr/bin:/bin"}) == []  # this machine has g++ and ninja
    empty = tmp_path / "bin"
    empty.mkdir()
    problems = cpu_adam_build_problems({"PATH": str(empty)})
    assert problems == ["no C++ compiler (c++) on PATH", "no ninja on PATH"]
    assert cpu_adam_build_problems({"PATH": "/usr/bin:/bin", "CXX": "no-such-cxx"}) == [
        "no C++ compiler (no-such-cxx, $CXX) on PATH"]


def test_a_prebuilt_cpu_adam_needs_no_compiler(tmp_path):
    from lowvram.deps import _cpu_adam_prebuilt

    built = tmp_path / "git_version_info_installed.py"
    built.write_text("version='0.19.8'\ninstalled_ops={'cpu_adam': True, 'fused_adam': False}\n")
    assert _cpu_adam_prebuilt(str(built))
    built.write_text("installed_ops={'cpu_adam': False}\n")
    assert not _cpu_adam_prebuilt(str(built))
    assert not _cpu_adam_prebuilt(str(tmp_path / "missing.py"))


@pytest.mark.parametrize("offload", ["optimizer", "full", "zero2-offload", "zero3-offload"])
def test_an_offload_that_runs_cpu_adam_is_refused_before_the_launch_without_a_compiler(
        offload, tmp_path, monkeypatch, tiny_model_dir):
    pytest.importorskip("deepspeed")
    from lowvram.recipe import parse_recipe
    from lowvram.train.run import launch
    from lowvram.train.types import TrainOptions

    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{name_or_path: {tiny_model_dir}}}\ndata: {{datasets: [{{path: d.jsonl, format: text}}]}}\n"
                      "training: {output_dir: out}\n")
    plan = dataclasses.replace(BASE, offload=offload, gpus=1, lora=False)
    options = TrainOptions(recipe_path=str(recipe), processes=LaunchSpec(gpus=1))
    with pytest.raises(LowvramError) as err:
        launch.prepare_launch(parse_recipe(recipe.read_text(), source=recipe), plan, options)
    assert f"offload {offload} runs DeepSpeed's CPU Adam" in err.value.message
    assert "no C++ compiler (c++) on PATH; no ninja on PATH" in err.value.message
    assert "apt-get install g++" in err.value.hint and "techniques.offload: none" in err.value.hint
    assert not (tmp_path / "out").exists()  # refused before the run folder (and the model load)
    launch.check_cpu_adam_buildable(dataclasses.replace(plan, offload="zero3"))  # ZeRO-3 on GPU: Adam there


def test_plans_say_when_cpu_adam_cannot_be_built(monkeypatch, tmp_path):
    from lowvram.plan.choose.choose import choose_plan
    from lowvram.plan.choose.request import Budget, PlanRequest
    from lowvram.plan.model.catalog import resolve_model
    from lowvram.planning.budget import missing_extras

    pytest.importorskip("deepspeed")
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert "cpu_adam" in missing_extras()
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert "cpu_adam" not in missing_extras()
    req = PlanRequest(resolve_model("llama-2-7b"), seq_len=2048, batch_size=1)
    c = choose_plan(req, Budget(5 * 10**9, missing_extras=("cpu_adam",)))
    assert c.plan.offload == "full"  # nothing else fits 5 GB: kept, with the note, refused at launch
    note = next(n for n in c.notes if "CPU Adam" in n)
    assert "cannot be built here" in note and "lowvram[" not in note  # no pip extra to install
    assert choose_plan(req, Budget(5 * 10**9)).notes == ()
