"""optimizer galore_adamw (GaLore, galore-torch): its state counted by the planner
(lowvram.plan.optimizers) against the real optimizer the Trainer builds from lowvram's
TrainingArguments, its constraints, and runs through `lowvram train` (issue 27)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.catalog import resolve_model
from lowvram.plan.memory import estimate_memory
from lowvram.plan.models import block_linears
from lowvram.plan.setup import RunSetup
from lowvram.plan.states import optimizer_bytes

LLAMA = resolve_model("llama-3.2-1b")
# q,k,v,o + gate/up/down of a 2-layer Llama (h 64, kv 32, I 160): some projections wider than
# tall, some taller, a rank (8) below every side and one (48) above the kv width
TINY = replace(LLAMA, num_layers=2, hidden_size=64, intermediate_size=160, num_heads=4, num_kv_heads=2,
               head_dim=16, vocab_size=256, tie_word_embeddings=False)


def _state_bytes_after_one_step(precision: str, rank: int, tmp_path) -> int:
    """Bytes of every tensor storage in the Trainer's GaLoreAdamW state after one step."""
    pytest.importorskip("galore_torch")
    import torch
    from transformers import AutoModelForCausalLM, Trainer

    from lowvram.check.builders import hf_config
    from lowvram.plan.search import plan_for_setup
    from lowvram.recipe.schema import Recipe
    from lowvram.train.model import prepare_model
    from lowvram.train.trainer import build_training_args

    setup = RunSetup(TINY, precision=precision, optimizer="galore_adamw", galore_rank=rank, device="cpu")
    plan = plan_for_setup(setup, "cpu", 16)
    recipe = Recipe.model_validate({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d"}]},
                                    "training": {"output_dir": str(tmp_path), "report_to": "none", "max_steps": 1}})
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = prepare_model(AutoModelForCausalLM.from_config(hf_config(TINY), dtype=dtype), plan, seed=0)
    trainer = Trainer(model=model, args=build_training_args(recipe, plan))
    opt = trainer.create_optimizer()
    ids = torch.randint(0, 256, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    seen, total = set(), 0
    for state in opt.state.values():
        for v in state.values():
            tensors = [v] if isinstance(v, torch.Tensor) else [getattr(v, "ortho_matrix", None)]
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in seen:
                    seen.add(t.untyped_storage()._cdata)
                    total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("rank", [8, 48])
def test_galore_state_is_the_real_optimizers(precision, rank, tmp_path):
    setup = RunSetup(TINY, precision=precision, optimizer="galore_adamw", galore_rank=rank)
    assert optimizer_bytes(setup) == _state_bytes_after_one_step(precision, rank, tmp_path)


def test_galore_keeps_less_state_than_8bit_adamw_on_a_3b_model():
    s = RunSetup(resolve_model("llama-3.2-3b"), precision="bf16", gradient_checkpointing=True, seq_len=2048)
    assert optimizer_bytes(replace(s, optimizer="galore_adamw")) < optimizer_bytes(replace(s, optimizer="adamw_8bit")) // 3


@pytest.mark.parametrize(("changes", "why"), [
    (dict(lora=True), "with lora there are none"),
    (dict(offload="zero2", gpus=2), "cannot run under offload zero2"),
    (dict(model=resolve_model("qwen3-30b-a3b")), "MoE model"),
])
def test_galore_constraints_are_refused_before_training(changes, why):
    with pytest.raises(LowvramError, match=why):
        estimate_memory(replace(RunSetup(LLAMA, optimizer="galore_adamw"), **changes))


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-0.5b", "phi-3-mini"])
def test_galore_and_dora_plans_pass_the_libraries_validation(name, tmp_path):
    """What a GaLore plan and a DoRA plan hand the libraries, through their own validation
    (tests/library_configs.py): TrainingArguments with optim galore_adamw and its target modules;
    peft's LoraConfig with use_dora on the model's Linears (prepare_model on a 2-layer meta copy)."""
    pytest.importorskip("galore_torch")
    from lowvram.plan.search import plan_for_setup
    from tests.library_configs import validate_plan

    spec = resolve_model(name)
    galore = plan_for_setup(RunSetup(spec, precision="bf16", optimizer="galore_adamw"), "cuda", 16)
    assert set(galore.optimizer_target_modules) == {lin.name for lin in block_linears(spec)}
    (tmp_path / "g").mkdir()
    assert "TrainingArguments" in validate_plan(name, galore, tmp_path / "g")
    for quant in ("none", "nf4-dq"):
        d = plan_for_setup(RunSetup(spec, precision="bf16", lora=True, lora_use_dora=True, quantization=quant),
                           "cuda", 32, lora_use_rslora=True)
        (tmp_path / quant).mkdir()
        assert "LoraConfig" in validate_plan(name, d, tmp_path / quant)


# Seeds of the extended draw (lowvram.difftest.random_case(..., extended=True), ten families)
# that train with galore_adamw, run through `lowvram train` (measured 2026-12-02)
GALORE_SEEDS = {
    1: "Gemma full bf16, checkpointing, eager, packed, rank 16, accumulation 2: +0.17%",
}


@pytest.mark.parametrize("seed", list(GALORE_SEEDS))
def test_galore_runs_stay_within_their_plan(seed, tmp_path):
    pytest.importorskip("galore_torch")
    from lowvram.difftest import ANY_LIMIT, OVER_LIMIT, TEN_FAMILIES, random_case, run_case

    case = random_case(seed, families=TEN_FAMILIES, extended=True)
    assert case.optimizer == "galore_adamw"
    out = run_case(case, tmp_path)
    assert out.error is None, out.error
    assert out.ok, (f"{case.label()}: measured {out.measured_bytes:,} predicted {out.predicted_bytes:,} "
                    f"({out.ratio:+.2%}; limits +{OVER_LIMIT:.0%}, +-{ANY_LIMIT:.0%})")
