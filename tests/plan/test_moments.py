"""The peak names the moment that binds (lowvram.plan.moments), and every moment has a name."""

import json
import re
from pathlib import Path

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.catalog import resolve_model
from lowvram.plan.memory import estimate_memory
from lowvram.plan.moments import MOMENTS
from lowvram.plan.setup import RunSetup

PLAN = Path(__file__).resolve().parents[2] / "lowvram" / "plan"
MEMORY = PLAN / "memory.py"


def test_every_moment_the_planner_builds_is_named_and_described():
    source = MEMORY.read_text() + (PLAN / "tiled.py").read_text()  # tiled.tiled_mlp_moments
    built = set(re.findall(r'Moment\(\s*"([a-z_]+)"', source))
    assert built == set(MOMENTS), (built ^ set(MOMENTS))
    for name, (what, source) in MOMENTS.items():
        assert what and source, name


@pytest.mark.parametrize("setup, moment", [
    # QLoRA with checkpointing under FSDP: the last layer's recompute beside every checkpoint (its
    # unsharded gradients); on one GPU the first layer's, nearly every adapter gradient made
    (dict(model="llama-2-13b", quantization="nf4", lora=True, gradient_checkpointing=True, offload="fsdp",
          gpus=2), "last_layer_recompute"),
    (dict(model="llama-2-13b", quantization="nf4", lora=True, gradient_checkpointing=True),
     "first_layer_recompute"),
    # full fine-tuning with checkpointing at 4 x 2048: the first layer's, nearly every gradient made
    (dict(model="llama-2-13b", precision="bf16-mixed", gradient_checkpointing=True, micro_batch_size=4,
          seq_len=2048), "first_layer_recompute"),
    (dict(model="llama-2-13b", precision="bf16-mixed", gradient_checkpointing=True, micro_batch_size=4,
          seq_len=2048, attention="eager"), "first_layer_softmax_backward"),
    # without checkpointing, a long sequence: the loss's logits beside every saved activation
    (dict(model="llama-3.2-1b", seq_len=4096), "backward_start"),
    # Llama-3.2-1B ties its embedding: at 512 tokens the embedding's gradient arriving binds
    (dict(model="llama-3.2-1b", precision="bf16-mixed"), "tied_embedding_gradient"),
    # a 4-bit 70B base without checkpointing: the last layer's MLP backward, weight dequantized
    (dict(model="llama-2-70b", quantization="nf4", lora=True), "last_layer_mlp_backward"),
    # fp32 master weights and AdamW state at 512 tokens: the optimizer step binds
    (dict(model="llama-2-13b", precision="bf16-mixed"), "optimizer_step"),
])
def test_the_estimate_names_the_moment_that_binds(setup, moment):
    spec = resolve_model(setup.pop("model"))
    est = estimate_memory(RunSetup(model=spec, **setup))
    assert est.peak_moment == moment
    assert est.peak_phase == ("optimizer_step" if moment == "optimizer_step" else "forward_backward")


def test_every_catalog_estimate_names_a_known_moment():
    from lowvram.plan.catalog import catalog_names

    seen = set()
    for name in catalog_names():
        spec = resolve_model(name)
        for kw in (dict(), dict(lora=True, gradient_checkpointing=True), dict(attention="eager", seq_len=2048),
                   dict(precision="bf16-mixed", gradient_checkpointing=True, seq_len=128)):
            try:
                est = estimate_memory(RunSetup(model=spec, **kw))
            except LowvramError:  # a setting the family cannot run (Bloom: eager attention only)
                continue
            assert est.peak_moment in MOMENTS or est.peak_moment == "optimizer_step", (name, kw)
            seen.add(est.peak_moment)
    assert len(seen) >= 5, seen  # the grid reaches several moments, not one default


def test_plan_json_and_table_say_the_moment(tmp_path):
    from typer.testing import CliRunner

    from lowvram.cli import app

    args = ["plan", "--model", "llama-3.1-8b", "--method", "qlora", "--vram", "16GiB", "--seq-len", "16384"]
    out = CliRunner().invoke(app, [*args, "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert (data["peak_phase"], data["peak_moment"]) == ("forward_backward", "last_layer_recompute")
    table = CliRunner().invoke(app, args)
    assert "Peak memory (forward backward: last_layer_recompute)" in table.stdout
    assert "peak at last_layer_recompute: checkpointing: the last decoder layer recomputed" in table.stdout
