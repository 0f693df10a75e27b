"""DoRA (lora.use_dora) and rsLoRA (lora.use_rslora): the planner's terms (lowvram.plan.memory.dora)
against peft's own layers, its constraints, and DoRA runs through `lowvram train` at the
differential test's target (issue 27)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.memory import dora
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.memory.states import lora_parameters, magnitude_shapes
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.setup import RunSetup

LLAMA7 = resolve_model("llama-2-7b")


def test_dora_adds_one_fp32_magnitude_per_output_row():
    lora = RunSetup(LLAMA7, lora=True, lora_r=16)
    with_dora = replace(lora, lora_use_dora=True)
    # Llama-2-7B all-linear: q,k,v,o 4096 + gate,up 11008 + down 4096 outputs, 32 layers
    assert lora_parameters(with_dora) - lora_parameters(lora) == 32 * (5 * 4096 + 2 * 11008)
    assert len(magnitude_shapes(with_dora)) == 32 * 7
    assert magnitude_shapes(replace(with_dora, lora=False)) == []


def test_dora_weight_norm_of_llama_down_proj():
    # the largest temporary is down_proj's (d_in 11008): under autocast the bf16 identity beside
    # 19 bytes per element of the 16-bit weight, + the identity x A
    s = RunSetup(LLAMA7, lora=True, lora_r=16, lora_use_dora=True, precision="bf16")
    assert dora.weight_norm_bytes(s) == 2 * 11008**2 + 19 * 11008 * 4096 + 4 * 11008 * 16
    # fp32, no autocast: the fp32 identity, 16 bytes per element
    f = replace(s, precision="fp32")
    assert dora.weight_norm_bytes(f) == 4 * 11008**2 + 16 * 11008 * 4096 + 4 * 11008 * 16
    # a 4-bit base adds its dequantized 16-bit weight
    q = replace(s, quantization="nf4-dq")
    assert dora.weight_norm_bytes(q) - dora.weight_norm_bytes(s) == 2 * 11008 * 4096


def test_dora_saved_tensors_per_adapted_linear():
    # q_proj only, bf16 under autocast: the base output and the bf16 adapter output, t x 4096 each
    s = RunSetup(LLAMA7, lora=True, lora_targets=("q_proj",), lora_use_dora=True, precision="bf16",
                 micro_batch_size=1, seq_len=512)
    assert dora.saved_layer_bytes(s) == 512 * 4096 * (2 + 2) + 8 * 4096
    # with dropout, peft multiplies the dropped input by a saved bf16 copy of the weight
    d = replace(s, lora_dropout=0.05)
    assert dora.saved_layer_bytes(d) == 512 * 4096 * (2 + 2) + 8 * 4096 + 2 * 4096 * 4096


def test_dora_saves_a_4bit_bases_result_in_its_inputs_dtype():
    # bitsandbytes casts a 4-bit base's result back to x's dtype, fp32 under bf16-mixed (the
    # residual): q_proj's base output in fp32, the adapter's in bf16 (held-out extended seed 130)
    s = RunSetup(LLAMA7, lora=True, lora_targets=("q_proj",), lora_use_dora=True, precision="bf16-mixed",
                 quantization="nf4-dq", micro_batch_size=1, seq_len=512)
    assert dora.saved_layer_bytes(s) == 512 * 4096 * (4 + 2) + 8 * 4096
    # without the 4-bit base autocast makes it bf16
    assert dora.saved_layer_bytes(replace(s, quantization="none")) == 512 * 4096 * (2 + 2) + 8 * 4096


def test_dora_saves_a_biased_base_result_in_the_biases_dtype():
    # peft's ``base_result - bias``: under bf16-mixed the fp32 bias promotes Qwen2's q_proj result
    # (held-out extended seed 160); o_proj has no bias; pure bf16 keeps it 16-bit
    qwen = resolve_model("qwen2.5-0.5b")
    s = RunSetup(qwen, lora=True, lora_targets=("q_proj", "o_proj"), lora_use_dora=True, precision="bf16-mixed",
                 micro_batch_size=1, seq_len=512)
    assert dora.saved_layer_bytes(s) == 512 * 896 * (4 + 2) + 512 * 896 * (2 + 2) + 2 * 8 * 896
    assert dora.saved_layer_bytes(replace(s, precision="bf16")) == 2 * (512 * 896 * (2 + 2) + 8 * 896)


def test_dora_checkpointed_moments_hold_what_is_alive_then():
    # Llama-2-7B gate/up/down, bf16 (autocast), 512 tokens: each adapted Linear saves its base and
    # adapter outputs (t x d_out, 2 + 2 bytes) and mag_norm_scale (8 x d_out)
    s = RunSetup(LLAMA7, lora=True, lora_targets=("gate_proj", "up_proj", "down_proj"), lora_use_dora=True,
                 precision="bf16", micro_batch_size=1, seq_len=512, gradient_checkpointing=True)
    gate = 512 * 11008 * 4 + 8 * 11008
    down = 512 * 4096 * 4 + 8 * 4096
    assert dora.saved_layer_bytes(s) == 2 * gate + down
    # up_proj's magnitude backward: down_proj's DoRA tensors freed (the backward runs in reverse),
    # gate's and up's alive, beside 14 bytes per token x d_out of its own (not every Linear's)
    assert dora.magnitude_backward_bytes(s) == 2 * gate + 14 * 512 * 11008
    # the recompute's own moment: the widest Linear's output gradients upcast, 2 fp32 t x d_out
    # (none outside autocast)
    assert dora.recompute_backward_bytes(s) == 8 * 512 * 11008
    assert dora.recompute_backward_bytes(replace(s, precision="fp32")) == 0
    assert dora.magnitude_backward_bytes(replace(s, precision="fp32")) == 2 * (512 * 11008 * 8 + 8 * 11008) + 8 * 512 * 11008
    # the recompute's weight norm: down_proj's input (d_in 11008) cast to fp32 and copied in 16 bit
    assert dora.recompute_input_bytes(s) == 8 * 512 * 11008
    assert dora.recompute_input_bytes(replace(s, precision="fp32")) == 0
    assert dora.magnitude_backward_bytes(replace(s, lora_use_dora=False)) == 0


def test_dora_costs_memory_and_names_its_moment():
    s = RunSetup(LLAMA7, lora=True, lora_r=16, precision="bf16", seq_len=256, gradient_checkpointing=True)
    plain, with_dora = estimate_memory(s), estimate_memory(replace(s, lora_use_dora=True))
    assert with_dora.peak_bytes > plain.peak_bytes + dora.weight_norm_bytes(replace(s, lora_use_dora=True)) // 2
    assert with_dora.peak_moment == "dora_weight_norm"


def test_dora_on_fused_moe_experts_is_refused():
    moe = resolve_model("qwen3-30b-a3b")
    with pytest.raises(LowvramError, match="use_dora on fused MoE experts"):
        estimate_memory(RunSetup(moe, lora=True, lora_use_dora=True))
    # attention only: allowed
    estimate_memory(RunSetup(moe, lora=True, lora_use_dora=True, lora_targets=("q_proj", "v_proj")))


def test_dora_without_lora_is_refused_by_the_recipe():
    from pydantic import ValidationError

    from lowvram.recipe.schema import Recipe

    data = {"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d.jsonl"}]},
            "lora": {"use_dora": True}}
    Recipe.model_validate(data)
    with pytest.raises(ValidationError, match="use_dora needs LoRA"):
        Recipe.model_validate({**data, "techniques": {"lora": "off"}})


def test_the_plan_carries_dora_and_rslora_to_peft(tmp_path):
    """The planned run's LoraConfig (lowvram's prepare_model) as peft builds it: DoRA magnitudes on
    every adapted Linear, rsLoRA's alpha / sqrt(r) scaling, and the trainable count the plan says."""
    pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    from lowvram.check.builders import hf_config
    from lowvram.plan.choose.search import plan_for_setup
    from lowvram.train.build.model import count_params, prepare_model

    spec = replace(resolve_model("llama-3.2-1b"), num_layers=2, hidden_size=64, intermediate_size=128,
                   num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256)
    setup = RunSetup(spec, precision="fp32", lora=True, lora_r=4, lora_use_dora=True, device="cpu")
    plan = plan_for_setup(setup, "cpu", 8, lora_use_rslora=True)
    torch.manual_seed(0)
    model = prepare_model(AutoModelForCausalLM.from_config(hf_config(spec)), plan, seed=0)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert "default" in q.lora_magnitude_vector and q.scaling["default"] == 8 / 4**0.5
    assert count_params(model)[0] == estimate_memory(setup).trainable_parameters


def _dora_case(**changes):
    from lowvram.difftest import TEN_FAMILIES, random_case

    # a 2-layer Llama wide enough (h 256, I 1024) at 64 tokens that DoRA's weight norm binds
    base = replace(random_case(5, families=TEN_FAMILIES), family="llama", hidden=256, heads=4, kv_heads=2,
                   intermediate=1024, layers=2, vocab=512, tie=False, seq_len=64, micro_batch_size=1,
                   grad_accum=1, packing=False, validation=None, optimizer="adamw", loss="standard",
                   attention="sdpa", lora_targets="all-linear", lora_dropout=0.0, use_dora=True, lora_r=8,
                   model_dtype="auto")
    return replace(base, **changes)


DORA_RUNS = {
    "lora fp32": dict(method="lora", precision="fp32"),
    "lora bf16 checkpointing": dict(method="lora", precision="bf16", gradient_checkpointing=True),
    "qlora bf16-mixed dropout": dict(method="qlora", precision="bf16-mixed", lora_dropout=0.1),
    "qlora bf16-mixed": dict(method="qlora", precision="bf16-mixed"),  # fp32 base results (seed 130)
    # the MLP's magnitude backward binds (extended seeds 123/128: 12-15% under the stacked plan)
    "lora bf16 checkpointing mlp 512 tokens": dict(method="lora", precision="bf16", model_dtype="bfloat16",
                                                   gradient_checkpointing=True, micro_batch_size=2, seq_len=256,
                                                   lora_targets=["gate_proj", "up_proj", "down_proj"],
                                                   loss="chunked"),
}


# The default run keeps two (the MLP's magnitude backward with checkpointing; QLoRA under autocast
# with dropout); `make test-all` (-m slow) runs every one (issue 43 item 4: each ~20 s on 2 cores)
DORA_DEFAULT = ("qlora bf16-mixed dropout", "lora bf16 checkpointing mlp 512 tokens")


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DORA_DEFAULT else pytest.mark.slow)
                                  for n in DORA_RUNS])
def test_dora_runs_stay_within_their_plan(name, tmp_path):
    pytest.importorskip("torch")
    from lowvram.difftest import ANY_LIMIT, OVER_LIMIT, run_case

    case = _dora_case(**DORA_RUNS[name])
    out = run_case(case, tmp_path)
    assert out.error is None, out.error
    assert out.ok, (f"{case.label()}: measured {out.measured_bytes:,} predicted {out.predicted_bytes:,} "
                    f"({out.ratio:+.2%}; limits +{OVER_LIMIT:.0%}, +-{ANY_LIMIT:.0%})")
