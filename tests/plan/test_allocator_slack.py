"""The allocator term's two named parts (issue 26 item 3): 1.5% of what is allocated once
(weights, optimizer state), and a share of what churns, 13% with expandable segments (what
`lowvram train` sets) and 23% without; the plan reads PYTORCH_CUDA_ALLOC_CONF as training will."""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.setup import RunSetup, cuda_overheads, expandable_segments_set
from lowvram.planning.budget import make_budget

GIB = 2**30
QLORA_8B = RunSetup(resolve_model("llama-3.1-8b"), lora=True, lora_r=32, quantization="nf4-dq",
                    gradient_checkpointing=True, activation_offload=True, tiled_mlp=True,
                    optimizer="adamw_torch_4bit", loss="chunked", loss_chunk_tokens=128, seq_len=2972)


def _tensors(est) -> int:
    return est.peak_bytes - est.breakdown["cuda_context"] - est.breakdown["allocator"]


@pytest.mark.parametrize("expandable, churn", [(True, 0.13), (False, 0.23)])
def test_two_shares_on_what_is_allocated_once_and_what_churns(expandable, churn):
    est = estimate_memory(replace(QLORA_8B, expandable_segments=expandable))
    b = est.breakdown
    once = b["weights"] + b["optimizer"]  # one GPU: the weights are all live at the peak
    assert est.allocated_once_bytes == once
    assert est.allocator_parts == {"loaded_once": int(0.015 * once), "churn": int(churn * (_tensors(est) - once))}
    assert b["allocator"] == sum(est.allocator_parts.values())
    assert sum(b.values()) == est.peak_bytes


def test_the_same_tensors_either_way_and_no_slack_on_a_cpu():
    on, off = (estimate_memory(replace(QLORA_8B, expandable_segments=e)) for e in (True, False))
    assert _tensors(on) == _tensors(off) and on.breakdown["allocator"] < off.breakdown["allocator"]
    cpu = estimate_memory(replace(QLORA_8B, device="cpu"))
    assert cpu.breakdown["allocator"] == 0 and cpu.allocator_parts == {}


def test_weights_loaded_once_take_the_small_share():
    """Llama-3.3-70B QLoRA: 38.35 GiB of 4-bit weights. The single 12% share of every tensor took
    4.96 GiB at 1,024 tokens; the loaded_once share takes 1.5% of them."""
    s = RunSetup(resolve_model("llama-3.3-70b"), lora=True, lora_r=32, quantization="nf4-dq",
                 gradient_checkpointing=True, loss="chunked", seq_len=1024)
    est = estimate_memory(s)
    b = est.breakdown
    assert b["weights"] > 38 * GIB
    assert est.allocator_parts["loaded_once"] == int(0.015 * (b["weights"] + b["optimizer"])) < GIB
    assert b["allocator"] < 0.03 * _tensors(est)


@pytest.mark.parametrize("conf, expandable", [
    (None, True),  # unset: lowvram train sets expandable_segments:True (lowvram.train.build.allocator)
    ("expandable_segments:True", True),
    ("max_split_size_mb:128, expandable_segments:true", True),
    ("expandable_segments:False", False),
    ("max_split_size_mb:128", False),  # set by the user without them: PyTorch's default, off
    ("", False),
])
def test_the_run_has_expandable_segments_as_training_will(conf, expandable):
    assert expandable_segments_set(conf) is expandable


def test_planning_reads_the_variable(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert make_budget("24GB", host_ram="64GiB").expandable_segments is True
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert make_budget("24GB", host_ram="64GiB").expandable_segments is False


def test_the_plan_shows_the_parts_and_their_source(monkeypatch):
    args = ["plan", "--model", "llama-3.1-8b", "--method", "qlora", "--lora-r", "32", "--offload", "none",
            "--seq-len", "2972", "--batch-size", "1", "--vram", "8GB", "--host-ram", "160GiB"]
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    d = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    a = d["allocator"]
    assert a["expandable_segments"] is True and a["fractions"] == {"loaded_once": 0.015, "churn": 0.13}
    assert sum(a["parts"].values()) == d["breakdown"]["allocator"]
    assert a["on_bytes"]["loaded_once"] == d["breakdown"]["weights"] + d["breakdown"]["optimizer"]
    assert "ALLOCATOR_CHURN_FRACTION_EXPANDABLE" in a["source"]
    out = " ".join(CliRunner(env={"COLUMNS": "200"}).invoke(app, args).output.split())
    assert "loaded once: 1.5% x" in out and "churn: 13% x" in out and "(expandable segments)" in out
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    off = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert off["allocator"]["fractions"]["churn"] == cuda_overheads().churn_fraction == 0.23
    assert off["peak_bytes"] > d["peak_bytes"]


def test_the_8gb_row_and_the_70b_on_48gb():
    """docs/planner.md, Long context: at Unsloth's 2,972 tokens the 8 GB row's plan (no tiled MLP:
    its shard's backward costs more than it saves at this length) peaks 0.15 GiB over its 7.41 GiB
    budget, less than its 0.17 GiB churn share; the 70B fits a 48 GB card."""
    est = estimate_memory(replace(QLORA_8B, tiled_mlp=False))
    assert estimate_memory(QLORA_8B).peak_bytes > est.peak_bytes
    budget = 0.975 * 8 * GIB * 0.95
    assert f"{est.peak_bytes / GIB:.2f}" == "7.56" and f"{budget / GIB:.2f}" == "7.41"
    assert f"{est.allocator_parts['churn'] / GIB:.2f}" == "0.17"
    assert est.peak_bytes - est.allocator_parts["churn"] < budget < est.peak_bytes
