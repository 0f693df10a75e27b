"""Tiled MLP (issue 26, item 1): DeepSpeed's TiledMLP wired to transformers / peft MLP modules
(lowvram.train.build.tiled_mlp) trains the same as the plain MLP, and the planner counts it per shard
(lowvram.plan.memory.tiled) as named moments; auto takes it only where it is the cheapest way to fit."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.choose.choose import choose_plan
from lowvram.plan.choose.request import Budget, PlanRequest
from lowvram.plan.memory import tiled
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.memory.moments import MOMENTS
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.setup import RunSetup
from lowvram.plan.types import Plan
from lowvram.planning.from_recipe import tiled_mlp_fields
from lowvram.recipe import parse_recipe

GiB = 2**30


def _plan(**kw) -> Plan:
    base = dict(device="cpu", mixed_precision="fp32", gradient_checkpointing=False, micro_batch_size=2,
                grad_accum=1, lora=True, quantization="none", optimizer="adamw", offload="none",
                attention="sdpa", loss="standard", lora_r=4, lora_alpha=8, seq_len=96)
    return Plan(**{**base, **kw})


def _loss_and_grads(model_dir, plan, ids):
    import torch
    from transformers import AutoModelForCausalLM

    from lowvram.train.build.model import load_kwargs, prepare_model

    model = prepare_model(AutoModelForCausalLM.from_pretrained(model_dir, **load_kwargs(plan)), plan, seed=0)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=plan.mixed_precision == "bf16-mixed"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("targets", [("all-linear",), ("gate_proj",)])
@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_tiled_mlp_trains_as_the_plain_mlp(tiny_model_dir, checkpointing, targets, quantization):
    """Loss and every LoRA gradient equal (allclose) with and without tiling, with checkpointing
    too, over a 16-bit and a 4-bit (bitsandbytes nf4) base; LoRA on gate_proj alone: layer 0's
    MLP input needs no gradient, and its adapters still get theirs."""
    import torch


    pytest.importorskip("deepspeed")
    torch.manual_seed(0)
    ids = torch.randint(4, 500, (2, 96))
    plan = _plan(gradient_checkpointing=checkpointing, lora_targets=targets, quantization=quantization)
    loss, grads = _loss_and_grads(tiny_model_dir, plan, ids)
    tiled_loss, tiled_grads = _loss_and_grads(tiny_model_dir, replace(plan, tiled_mlp=True, tiled_mlp_shards=5), ids)
    assert tiled_loss == pytest.approx(loss, rel=1e-6)
    assert grads.keys() == tiled_grads.keys() and len(grads) > 0
    for name, g in grads.items():
        torch.testing.assert_close(tiled_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert any("layers.0.mlp" in n for n in grads)


def test_tiled_mlp_keeps_the_forward_autocast_in_its_recompute(tiny_model_dir):
    """Under bf16 autocast the shard recompute in the backward runs in the forward's autocast
    (TiledMLP's backward runs outside the Trainer's autocast): gradients as without tiling."""
    import torch

    pytest.importorskip("deepspeed")
    torch.manual_seed(0)
    ids = torch.randint(4, 500, (2, 96))
    plan = _plan(mixed_precision="bf16-mixed")
    loss, grads = _loss_and_grads(tiny_model_dir, plan, ids)
    tiled_loss, tiled_grads = _loss_and_grads(tiny_model_dir, replace(plan, tiled_mlp=True, tiled_mlp_shards=3), ids)
    assert tiled_loss == pytest.approx(loss, rel=1e-3)
    for name, g in grads.items():  # bf16 matmuls over other shapes: bf16 rounding apart
        torch.testing.assert_close(tiled_grads[name], g, rtol=2e-2, atol=2e-3, msg=name)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_recompute_draws_the_forwards_dropout_masks(tiny_model_dir, checkpointing):
    """lora.dropout 0.3: one shard draws the masks the plain MLP draws, and its recompute in the
    backward draws them again (the forward's random state), so the gradients are the plain ones."""
    import torch

    pytest.importorskip("deepspeed")
    ids = torch.randint(4, 500, (2, 96), generator=torch.Generator().manual_seed(0))
    plan = _plan(lora_dropout=0.3, gradient_checkpointing=checkpointing)
    torch.manual_seed(1)
    loss, grads = _loss_and_grads(tiny_model_dir, plan, ids)
    torch.manual_seed(1)
    tiled_loss, tiled_grads = _loss_and_grads(tiny_model_dir, replace(plan, tiled_mlp=True, tiled_mlp_shards=1), ids)
    assert tiled_loss == pytest.approx(loss, rel=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(tiled_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_mlp_modules_are_the_dense_mlps(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from lowvram.train.build.tiled_mlp import enable_tiled_mlp

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert enable_tiled_mlp(model) == model.config.num_hidden_layers
    assert enable_tiled_mlp(model) == model.config.num_hidden_layers  # twice: still the original inside


# --------------------------------------------------------------------------------------------
# The planner


@pytest.fixture(scope="module")
def llama8b():
    return resolve_model("llama-3.1-8b")


def test_shards_follow_deepspeeds_rule(llama8b):
    s = RunSetup(llama8b, seq_len=32768, tiled_mlp=True)
    assert tiled.tiled_mlp_shards(s) == 8  # ceil(32768 / 4096)
    assert tiled.tiled_mlp_shards(replace(s, seq_len=32769)) == 9
    assert tiled.tiled_mlp_shards(replace(s, tiled_mlp_shards=3)) == 3


def test_tiled_layer_saves_x_instead_of_its_mlp(llama8b):
    """A Llama LoRA bf16 layer: SwiGLU's gate, silu(gate), up (3 x I) and the adapters' casts go;
    TiledMLP's saved x (t x h) comes; without checkpointing the saving is per layer."""
    s = RunSetup(llama8b, precision="bf16", lora=True, seq_len=8192)
    on = replace(s, tiled_mlp=True)
    t, h = 8192, llama8b.hidden_size
    saved = tiled.layer_activation_bytes(on)
    plain = tiled.layer_activation_bytes(s)
    mlp_tensors = plain - tiled.layer_activation_bytes(tiled.without_mlp(s))
    assert saved == plain - mlp_tensors + 2 * t * h
    assert mlp_tensors >= 2 * 3 * t * llama8b.intermediate_size  # gate, silu(gate), up at least
    layers = llama8b.num_layers
    assert tiled.activation_bytes(s) - tiled.activation_bytes(on) == layers * (plain - saved)


def test_the_tiled_backward_is_counted_per_shard(llama8b):
    """One shard's recompute: twice the shards, about half the shard term."""
    s = RunSetup(llama8b, precision="bf16", lora=True, seq_len=32768, tiled_mlp=True, tiled_mlp_shards=4)
    base = 2 * 2 * 32768 * llama8b.hidden_size  # the incoming gradient and x_grad
    four = tiled.tiled_mlp_backward_bytes(s) - base
    eight = tiled.tiled_mlp_backward_bytes(replace(s, tiled_mlp_shards=8)) - base
    assert four == pytest.approx(2 * eight, rel=1e-6)


@pytest.mark.parametrize("gc", [False, True])
def test_tiled_peak_is_a_named_moment_and_lower(llama8b, gc):
    s = RunSetup(llama8b, precision="bf16", lora=True, quantization="nf4-dq", seq_len=32768,
                 gradient_checkpointing=gc, loss="chunked")
    plain, on = estimate_memory(s), estimate_memory(replace(s, tiled_mlp=True))
    assert on.peak_bytes < plain.peak_bytes
    assert on.peak_moment in MOMENTS
    assert "last_layer_tiled_mlp_backward" in MOMENTS and "first_layer_tiled_mlp_backward" in MOMENTS


def test_moe_refuses_tiling():
    spec = resolve_model("mixtral-8x7b")
    with pytest.raises(LowvramError, match="tiled_mlp needs a dense MLP"):
        estimate_memory(RunSetup(spec, lora=True, tiled_mlp=True))
    with pytest.raises(LowvramError, match="tiled_mlp needs a dense MLP"):
        choose_plan(PlanRequest(spec, lora=True, tiled_mlp=True), Budget(80 * GiB))
    c = choose_plan(PlanRequest(spec, lora=True, seq_len=65536, batch_size=1), Budget(80 * GiB))
    assert not c.chosen.setup.tiled_mlp and c.plan.reasons["tiled_mlp"].startswith("off: the MLP is a mixture")


def test_auto_takes_tiling_only_as_the_cheapest_way_to_fit(llama8b):
    """Llama-3.1-8B QLoRA at 32k tokens on 24 GiB: activation offload (x1.10) fits and is cheaper
    than tiling (~x1.2), so auto offloads; with activation offload off, tiling is what fits."""
    req = PlanRequest(llama8b, lora=True, quantization="nf4-dq", seq_len=32768, batch_size=1)
    budget = Budget(24 * GiB)
    c = choose_plan(req, budget)
    assert c.fits and c.chosen.setup.activation_offload and not c.chosen.setup.tiled_mlp
    assert c.plan.reasons["tiled_mlp"].startswith("off: fits without it")
    longer = replace(req, activation_offload=False, seq_len=40960)
    assert not choose_plan(replace(longer, tiled_mlp=False), budget).fits
    t = choose_plan(longer, budget)
    assert t.fits and t.chosen.setup.tiled_mlp and t.plan.tiled_mlp
    assert t.plan.reasons["tiled_mlp"].startswith("on (10 shard(s) of the sequence): without it the peak")
    assert tiled.tiled_mlp_slowdown(t.chosen.setup) == pytest.approx(1 + tiled.mlp_matmul_share(t.chosen.setup) / 4)


def test_slowdown_from_the_mlp_share(llama8b):
    s = RunSetup(llama8b, tiled_mlp=True)
    share = tiled.mlp_matmul_share(s)
    assert share == pytest.approx(3 * 4096 * 14336 / (3 * 4096 * 14336 + 2 * 4096 * 4096 + 2 * 4096 * 1024))
    assert tiled.tiled_mlp_slowdown(s) == pytest.approx(1 + share / 3)
    assert tiled.tiled_mlp_slowdown(replace(s, tiled_mlp=False)) == 1.0


def test_recipe_key_and_flag():
    good = ("model: {name_or_path: m}\ndata: {datasets: [{path: d.jsonl}]}\n")
    for value, fields in [("on", {"tiled_mlp": True}), ("off", {"tiled_mlp": False}), ("auto", {}),
                          ("8", {"tiled_mlp": True, "tiled_mlp_shards": 8}), ("yes", {"tiled_mlp": True})]:
        r = parse_recipe(good + f"techniques: {{tiled_mlp: {value}}}\n", "r.yaml")
        assert tiled_mlp_fields(r.techniques.tiled_mlp) == fields, value
    with pytest.raises(LowvramError, match="must be a positive integer"):
        parse_recipe(good + "techniques: {tiled_mlp: 0}\n", "r.yaml")
    with pytest.raises(LowvramError, match="unknown tiled_mlp 'sometimes'"):
        tiled_mlp_fields("sometimes")


def test_plan_flag_fixes_tiling():
    from typer.testing import CliRunner

    from lowvram.cli import app

    out = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", "--method", "qlora", "--vram", "24GiB",
                                   "--seq-len", "16384", "--batch-size", "1", "--tiled-mlp", "4", "--json"])
    assert out.exit_code == 0, out.output
    import json

    data = json.loads(out.stdout)
    assert data["techniques"]["tiled_mlp"] is True
    assert data["reasons"]["tiled_mlp"] == "set by --tiled-mlp 4; 4 shard(s) of the sequence"


# --------------------------------------------------------------------------------------------
# Issue 26 item 3: the CUDA allocator's expandable segments


def test_expandable_segments_unless_the_user_set_the_allocator():
    from lowvram.train.build.allocator import ALLOC_CONF, set_expandable_segments

    env: dict[str, str] = {}
    assert set_expandable_segments(env) and env == {ALLOC_CONF: "expandable_segments:True"}
    mine = {ALLOC_CONF: "max_split_size_mb:128"}
    assert not set_expandable_segments(mine) and mine == {ALLOC_CONF: "max_split_size_mb:128"}


def test_lowvram_train_sets_it_in_the_launchers_environment(tmp_path, tiny_model_dir, monkeypatch):
    """`lowvram train` sets it before planning (before anything initialises CUDA); accelerate's
    ranks get os.environ (lowvram.train.run.launch.run_launch)."""
    import os

    from typer.testing import CliRunner

    from lowvram.cli import app
    from tests.train.test_e2e import write_recipe

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    path = write_recipe(tmp_path, tiny_model_dir, steps=1, techniques="lora: on")
    out = CliRunner().invoke(app, ["train", str(path), "--dry-run"])
    assert out.exit_code == 0, out.output
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:native")
    assert CliRunner().invoke(app, ["train", str(path), "--dry-run"]).exit_code == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "backend:native"


@pytest.mark.parametrize("lora", [False, True])
def test_under_ddp_each_mlp_parameter_takes_its_gradient_once_per_backward(tiny_model_dir, monkeypatch, lora):
    """DDP's reducer marks a parameter ready at its AccumulateGrad hook and raises the second time
    ("Expected to mark a variable ready only once", issue 41 item 3; tests/train/test_multi_gpu.py
    runs it over gloo): TiledMLP runs one backward per shard, so under DDP every shard but the last
    differentiates aliases of the parameters (lowvram.train.build.tiled_mlp). Each MLP parameter's
    AccumulateGrad fires once, with the plain MLP's gradient; the other parameters are untouched."""
    import collections

    import torch

    pytest.importorskip("deepspeed")
    monkeypatch.setenv("WORLD_SIZE", "2")  # what accelerate launch gives each DDP worker
    torch.manual_seed(0)
    ids = torch.randint(4, 500, (2, 12))
    plan = _plan(lora=lora, gradient_checkpointing=True)
    loss, grads = _loss_and_grads(tiny_model_dir, plan, ids)

    import lowvram.train.build.model as model_module

    fired: collections.Counter = collections.Counter()
    prepare = model_module.prepare_model

    def counting(model, plan, seed=None):
        model = prepare(model, plan, seed)
        for name, p in model.named_parameters():
            if p.requires_grad and ".mlp." in name:
                p.register_post_accumulate_grad_hook(lambda _p, name=name: fired.update([name]))
        return model

    monkeypatch.setattr(model_module, "prepare_model", counting)
    tiled_plan = replace(plan, tiled_mlp=True, tiled_mlp_shards=4)
    tiled_loss, tiled_grads = _loss_and_grads(tiny_model_dir, tiled_plan, ids)
    mlp = [n for n in grads if ".mlp." in n]
    assert mlp and fired == dict.fromkeys(mlp, 1)  # before: 4 each, one per shard
    assert tiled_loss == pytest.approx(loss, rel=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(tiled_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_two_rows_with_fewer_positions_than_shards_by_row(tiny_model_dir):
    """TiledMLP's forward chunks the positions, its backward the flattened rows: 9 positions in 4
    chunks are 3 (of 3), 2 x 9 rows are 4 (of 5). lowvram hands it the flattened rows, so both
    passes cut the same shards and the recompute replays each shard's own random state (before:
    IndexError in that replay, and with two rows the wrong dropout masks)."""
    import torch

    pytest.importorskip("deepspeed")
    ids = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    plan = _plan()
    loss, grads = _loss_and_grads(tiny_model_dir, plan, ids)
    tiled_loss, tiled_grads = _loss_and_grads(tiny_model_dir, replace(plan, tiled_mlp=True, tiled_mlp_shards=4), ids)
    assert tiled_loss == pytest.approx(loss, rel=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(tiled_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
