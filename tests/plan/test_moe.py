"""Mixture-of-experts and refusals in the analytic planner (lowvram.plan.model.models / plan.moe).

Parameter counts are exact against the transformers 5 model built from the same config.json on
the meta device; LoRA trainable counts exact against peft's own adapters on that model.
"""

from __future__ import annotations

import json

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.memory.states import lora_parameters
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.model.models import count_parameters
from lowvram.plan.model.readers import spec_from_config
from lowvram.plan.setup import RunSetup

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128)
CONFIGS = {
    "mixtral": dict(BASE, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(BASE, model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=48, shared_expert_intermediate_size=80),
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=48, head_dim=32),
    "olmoe": dict(BASE, model_type="olmoe", num_experts=8, num_experts_per_tok=2,
                  pad_token_id=0, eos_token_id=1),
    "qwen3": dict(BASE, model_type="qwen3", head_dim=32),
    "gpt_oss": dict(BASE, model_type="gpt_oss", num_local_experts=8, num_experts_per_tok=2,
                    head_dim=16, sliding_window=8),
}


def _meta_model(cfg: dict):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    c = dict(cfg)
    config = AutoConfig.for_model(c.pop("model_type"), **c)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_count_equals_transformers(name):
    spec = spec_from_config(CONFIGS[name], name)
    model = _meta_model(CONFIGS[name])
    assert count_parameters(spec) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"])
@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "v_proj")])
def test_lora_trainable_count_equals_peft(name, targets):
    from peft import LoraConfig, get_peft_model

    spec = spec_from_config(CONFIGS[name], name)
    model = get_peft_model(_meta_model(CONFIGS[name]), LoraConfig(
        r=4, target_modules="all-linear" if targets == ("all-linear",) else list(targets),
        lora_dropout=0.0))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    setup = RunSetup(spec, lora=True, lora_r=4, lora_targets=targets)
    assert lora_parameters(setup) == trainable


def test_experts_stay_unquantized_under_qlora():
    spec = spec_from_config(CONFIGS["mixtral"], "m")
    bf16 = estimate_memory(RunSetup(spec, device="cpu", lora=True)).breakdown["weights"]
    nf4 = estimate_memory(RunSetup(spec, device="cpu", lora=True, quantization="nf4")).breakdown["weights"]
    # bitsandbytes swaps nn.Linear only: attention shrinks, the fused experts (E*3*I*h) do not
    experts = 2 * 2 * 8 * 3 * 96 * 64
    assert bf16 - nf4 < 2 * 2 * (64 * 64 * 2 + 2 * 64 * 32)
    assert nf4 > experts


def test_analytic_moe_plan_counts_the_experts():
    # Mixtral-8x7B's shape (MixtralConfig defaults: "similar to Mixtral-7B-v0.1"): 46.7B parameters
    cfg = dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=32000, num_local_experts=8, num_experts_per_tok=2)
    spec = spec_from_config(cfg, "mixtral")
    assert count_parameters(spec) == 46_702_792_704
    est = estimate_memory(RunSetup(spec, lora=True, quantization="nf4"))
    assert est.peak_bytes > 80 * 2**30  # the experts stay bf16: no 24 GB card holds it


def test_partial_fused_target_and_dropout_are_refused():
    spec = spec_from_config(CONFIGS["qwen3_moe"], "q")
    with pytest.raises(LowvramError, match="fused with up_proj"):
        estimate_memory(RunSetup(spec, lora=True, lora_targets=("gate_proj",)))


REFUSED = [
    (dict(BASE, model_type="llama4", text_config=dict(BASE), vision_config={}),
     "vision tower of model_type 'llama4'"),  # Llama-3.2-Vision (mllama) is modelled
    (dict(BASE, model_type="qwen3_vl_moe", text_config=dict(BASE), vision_config={}),
     "Qwen3-VL-MoE (model_type 'qwen3_vl_moe')"),  # Qwen2.5-VL and Qwen3-VL are modelled (plan/model/vision.py)
    (dict(BASE, model_type="dbrx"), "model_type 'dbrx'"),
    (dict(BASE, model_type="phimoe", num_local_experts=16, num_experts_per_tok=2),
     "mixture-of-experts layout of model_type 'phimoe'"),
    (dict(CONFIGS["qwen3_moe"], mlp_only_layers=[0]), "dense layers among the sparse"),
]


@pytest.mark.parametrize("cfg, what", REFUSED, ids=[r[1][:20] for r in REFUSED])
def test_unmodelled_configs_are_refused_with_a_simulate_hint(tmp_path, cfg, what):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LowvramError) as e:
        resolve_model(str(tmp_path))
    assert "does not model" in e.value.message and what in e.value.message
    assert "--simulate" in e.value.hint


def test_cli_refuses_instead_of_a_dense_estimate(tmp_path):
    from typer.testing import CliRunner

    from lowvram.cli import app

    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, model_type="phimoe",
                                                         num_local_experts=16)))
    r = CliRunner().invoke(app, ["plan", "--model", str(tmp_path), "--vram", "24GB"])
    assert r.exit_code == 1
    assert "does not model" in r.stderr and "--simulate" in r.stderr


# The analytic plan against the real step on a scaled-down MoE (2 layers, 8 experts, top-2):
# fake tensors (the simulated step) in bf16 and real CPU tensors through the exact live-bytes
# tracker in fp32 (FakeTensorMode's grouped_mm accepts bf16 only). Measured: Mixtral LoRA bf16
# -0.34% (seq 256) / -0.77% (1024), every other case within 0.3%; the same numbers come out of
# the real CPU step. With gradient checkpointing the plan is -0.8% to +9.5% of a real CPU step on
# these tiny models (the fitted recompute share of the dense part); pure-bf16 Mixtral is the
# close case (below).
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("lora", [False, True])
def test_analytic_equals_the_simulated_step_on_a_small_moe(name, lora):
    pytest.importorskip("torch")
    from lowvram.check.simulate import simulate_memory

    spec = spec_from_config(CONFIGS[name], name)
    setup = RunSetup(spec, seq_len=256, micro_batch_size=1, device="cpu", precision="bf16", lora=lora)
    est, sim = estimate_memory(setup), simulate_memory(setup)
    assert abs(est.peak_bytes - sim.peak_bytes) / sim.peak_bytes < 0.01, (est.breakdown, sim.breakdown)


@pytest.mark.parametrize("name,lora", [("mixtral", True), ("qwen3_moe", False)])
def test_analytic_equals_a_real_cpu_step_on_a_small_moe(name, lora):
    pytest.importorskip("torch")
    from lowvram.check.step import measure_setup
    spec = spec_from_config(CONFIGS[name], name)
    setup = RunSetup(spec, seq_len=256, micro_batch_size=1, device="cpu", precision="fp32", lora=lora)
    measured = measure_setup(setup).peak_bytes
    # measured: Mixtral LoRA 8,442,360 vs 8,442,112 planned; Qwen3-MoE full 6,978,096 vs 7,053,824
    # (+1.1%: full fine-tuning's last-layer candidate counts the experts' weight gradients beside
    # every activation, though some of that layer's routed ones are freed by then; it was 0.1%
    # before that candidate, and held-out seed 1301, Mixtral full fp32, 3.2% above its plan)
    error = (estimate_memory(setup).peak_bytes - measured) / measured
    assert (-0.005 < error < 0.005) if lora else (-0.005 < error < 0.015), error


@pytest.mark.parametrize("seq_len", [256, 1024])
def test_checkpointed_moe_backward_is_not_underpredicted(seq_len):
    """A checkpointed MoE layer's backward starts at its experts' combine, whose gradients are
    fp32 even over bf16 experts (fp32 routing weights): a pure-bf16 2-layer Mixtral was 3.7% /
    7.4% under a real CPU step while they were counted in the weights' dtype."""
    pytest.importorskip("torch")
    from lowvram.check.step import measure_setup

    spec = spec_from_config(CONFIGS["mixtral"], "mixtral")
    setup = RunSetup(spec, seq_len=seq_len, micro_batch_size=1, device="cpu", precision="bf16",
                     gradient_checkpointing=True)
    measured = measure_setup(setup).peak_bytes
    # measured: 3,758,528 (256) and 7,951,808 (1024); planned -0.28% / -0.83% of them
    assert -0.01 < (estimate_memory(setup).peak_bytes - measured) / measured < 0.05


# gpt-oss: the published configs' exact counts (GptOssForCausalLM on the meta device gives the
# same: 20,914,757,184 and 116,829,156,672; the model cards say 21B and 117B)
@pytest.mark.parametrize("name, params", [("gpt-oss-20b", 20_914_757_184),
                                          ("gpt-oss-120b", 116_829_156_672)])
def test_gpt_oss_catalog_counts(name, params):
    spec = resolve_model(name)
    assert count_parameters(spec) == params
    assert spec.sliding_layers == spec.num_layers // 2 and spec.sliding_window == 128


def test_gpt_oss_config_equals_its_catalog_entry(tmp_path):
    cfg = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
               num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
               vocab_size=201088, num_local_experts=32, num_experts_per_tok=4,
               sliding_window=128, tie_word_embeddings=False, rope_theta=150000)
    spec = spec_from_config(cfg, "g")
    assert count_parameters(spec) == count_parameters(resolve_model("gpt-oss-20b"))


def test_gpt_oss_sdpa_is_refused_with_the_eager_hint():
    spec = spec_from_config(CONFIGS["gpt_oss"], "g")
    with pytest.raises(LowvramError, match="set attention: eager"):
        estimate_memory(RunSetup(spec, attention="sdpa"))
    # under QLoRA only attention is 4-bit: the experts and the router stay bf16
    bf16 = estimate_memory(RunSetup(spec, attention="eager", lora=True)).breakdown["weights"]
    nf4 = estimate_memory(RunSetup(spec, attention="eager", lora=True,
                                   quantization="nf4")).breakdown["weights"]
    assert 2 * 2 * 8 * (3 * 96 * 64) < nf4 < bf16


# 2-layer gpt-oss through lowvram train's builders, eager attention (the only path that trains),
# b2 s256: measured LoRA bf16 8,760,976 vs 9,045,488 planned (-3.15%), LoRA fp32 -2.66%, full
# bf16 -6.76%; and the differential test's seed 8 (LoRA r8 fp32, h128, I256, 4 experts, s128),
# +4.50% before the experts' backward was a candidate of the peak, now -1.9%.
@pytest.mark.parametrize("cfg, setup_kw", [
    (CONFIGS["gpt_oss"], dict(seq_len=256, micro_batch_size=2, precision="bf16", lora=True)),
    (dict(BASE, model_type="gpt_oss", hidden_size=128, intermediate_size=256, head_dim=32,
          vocab_size=512, num_local_experts=4, num_experts_per_tok=2, sliding_window=128),
     dict(seq_len=128, micro_batch_size=1, precision="fp32", lora=True, lora_r=8)),
], ids=["lora-bf16", "fuzz-seed-8"])
def test_gpt_oss_analytic_plan_near_a_real_cpu_step(cfg, setup_kw):
    pytest.importorskip("torch")
    from lowvram.check.step import measure_setup

    spec = spec_from_config(cfg, "g")
    setup = RunSetup(spec, device="cpu", attention="eager", **setup_kw)
    measured = measure_setup(setup).peak_bytes
    planned = estimate_memory(setup).peak_bytes
    assert -0.10 < (measured - planned) / planned < 0.03


def test_cli_plans_gpt_oss_with_eager_and_refuses_sdpa(tmp_path):
    from typer.testing import CliRunner

    from lowvram.cli import app

    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        tie_word_embeddings=False)))
    r = CliRunner().invoke(app, ["plan", "--model", str(tmp_path), "--vram", "80GB", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["techniques"]["attention"] == "eager"
    assert out["parameters"] == 20_914_757_184 + out["trainable_parameters"]  # + LoRA adapters
    r = CliRunner().invoke(app, ["plan", "--model", str(tmp_path), "--vram", "80GB", "--attention", "sdpa"])
    assert r.exit_code == 1 and "set attention: eager" in r.stderr


def test_gpt_oss_mxfp4_checkpoint_trains_dequantized(tmp_path):
    """gpt-oss's published checkpoint is MXFP4 (quantization_config.quant_method): train loads it
    with Mxfp4Config(dequantize=True), so the experts are the bf16 tensors the planner counts;
    bitsandbytes on top of it is refused with a hint."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from lowvram.difftest import random_case, write_model
    from lowvram.train.build.model import checkpoint_quant_method, load_base_model

    model_dir = write_model(random_case(8, families=("gpt_oss",)), tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    assert checkpoint_quant_method(str(model_dir)) is None
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (model_dir / "config.json").write_text(json.dumps(config))
    assert checkpoint_quant_method(str(model_dir)) == "mxfp4"
    recipe = SimpleNamespace(model=SimpleNamespace(trust_remote_code=False, revision=None,
                                                   name_or_path=str(model_dir)))
    plan = SimpleNamespace(precision="bf16", mixed_precision="bf16", dtype="auto", attention="eager",
                           quantization="none", device="cpu", offload="none", lora=True, lora_init="default")
    try:
        model = load_base_model(recipe, plan, str(model_dir))
    except AttributeError as e:  # a Plan field the stand-in lacks: name it
        pytest.fail(f"stand-in plan lacks {e}")
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype.is_floating_point and experts.gate_up_proj.element_size() == 2
    with pytest.raises(LowvramError, match="MXFP4"):
        load_base_model(recipe, SimpleNamespace(**{**vars(plan), "quantization": "nf4"}), str(model_dir))


def test_gpt_oss_generate_and_merge_load_the_mxfp4_base_as_train_does(tmp_path, monkeypatch):
    """issue 41 item 9: train loads an MXFP4 checkpoint with Mxfp4Config(dequantize=True);
    generate and merge (train/after/artifacts.py) loaded it with no quantization_config, which on a CUDA
    card with Triton keeps the experts packed (quantizer_mxfp4.validate_environment dequantizes
    only without them): the trained expert adapters do not fit and merge saves packed tensors
    without their config. The real from_pretrained runs; its keyword arguments are read."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from lowvram.difftest import random_case, write_model
    from lowvram.plan.types import Plan
    from lowvram.train.after.artifacts import BaseModel, load_base, load_trained_base

    model_dir = write_model(random_case(8, families=("gpt_oss",)), tmp_path / "m")
    plain = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)  # before the mark
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (model_dir / "config.json").write_text(json.dumps(config))
    seen = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def recording(cls, *args, **kwargs):
        seen.append(kwargs.get("quantization_config"))
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(recording))
    base = BaseModel(str(model_dir), "test")
    plan = Plan(device="cpu", mixed_precision="bf16", gradient_checkpointing=False, micro_batch_size=1,
                grad_accum=1, lora=True, quantization="none", optimizer="adamw", offload="none",
                attention="eager", loss="standard")
    loaded = [load_base(base, "bfloat16", "cpu"), load_trained_base(base, plan, "cpu")]
    assert len(seen) == 2
    for q, model in zip(seen, loaded, strict=True):
        assert isinstance(q, Mxfp4Config) and q.dequantize is True
        names = {n for n, _ in model.named_parameters()}
        assert not any(n.endswith(("_blocks", "_scales")) for n in names)  # bf16 experts, as trained
        assert names == {n for n, _ in plain.named_parameters()}
