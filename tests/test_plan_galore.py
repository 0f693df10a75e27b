"""optimizer galore_adamw (GaLore, galore-torch): its state counted by the planner
(lowvram.plan.optimizers) against the real optimizer the Trainer builds from lowvram's
TrainingArguments, its constraints, and runs through `lowvram train` (issue 27)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.catalog import resolve_model
from lowvram.plan.memory import estimate_memory
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
