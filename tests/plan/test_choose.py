"""The automatic technique choice: fake budgets, real memory model, no torch."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.choose import techniques as tq
from lowvram.plan.choose.choose import choose_plan
from lowvram.plan.choose.request import Budget, PlanRequest, safety_margin_bytes, vram_needed_bytes
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.serialize import choice_to_dict
from lowvram.plan.setup import BREAKDOWN_KEYS, MemoryEstimate
from lowvram.vocab import CANONICAL

GB = 10**9


@pytest.fixture(scope="module")
def llama7b():
    return resolve_model("llama-2-7b")


def _plan(spec, gb: float, **fixed):
    return choose_plan(PlanRequest(spec, **fixed), Budget(int(gb * GB)))


@pytest.mark.parametrize(
    "gb, lora, quant",
    [
        (80, False, "none"),  # full fine-tuning fits on an 80 GB card
        (24, True, "none"),  # LoRA on a bf16 base
        (12, True, "nf4-dq"),  # QLoRA
        (8, True, "nf4-dq"),
    ],
)
def test_llama7b_choice_by_card(llama7b, gb, lora, quant):
    c = _plan(llama7b, gb)
    assert c.fits
    assert c.plan.lora is lora
    assert c.plan.quantization == quant
    assert c.plan.mixed_precision == "bf16"  # never silent fp32 on a GPU
    assert c.plan.attention == "sdpa"
    assert c.plan.offload == "none"
    assert c.plan.predicted_peak_bytes <= c.budget.usable_bytes
    assert c.plan.effective_batch == 16


def test_cheaper_tiers_first(llama7b):
    """80 GB: full fine-tuning without checkpointing; 8 GB needs checkpointing on top of QLoRA."""
    assert _plan(llama7b, 80).plan.gradient_checkpointing is False
    assert _plan(llama7b, 8).plan.gradient_checkpointing is True


def test_budget_margin_is_stated_and_subtracted():
    b = Budget(24 * GB)
    assert b.safety_margin_bytes == safety_margin_bytes(24 * GB) == int(24 * GB * 0.05)
    assert b.usable_bytes == 24 * GB - b.safety_margin_bytes
    assert Budget(2 * GB).safety_margin_bytes == 256 * 2**20  # floor
    assert Budget(vram_needed_bytes(10 * GB)).usable_bytes >= 10 * GB


def test_forced_full_is_never_turned_into_lora(llama7b):
    c = _plan(llama7b, 24, lora=False, sources={"lora": "--method full"})
    assert c.plan.lora is False and c.plan.quantization == "none"
    assert "--method full" in c.plan.reasons["lora"]


@pytest.mark.parametrize(
    "fixed",
    [
        {"gradient_checkpointing": False},
        {"optimizer": "adamw_8bit"},
        {"loss": "chunked"},
        {"attention": "eager"},
        {"mixed_precision": "fp16-mixed"},
        {"offload": "none", "lora": True, "quantization": "none"},
        {"grad_accum": 2},
    ],
)
def test_fixed_choices_are_respected(llama7b, fixed):
    c = _plan(llama7b, 12, **fixed)
    s = c.chosen.setup
    got = {
        "gradient_checkpointing": s.gradient_checkpointing, "optimizer": s.optimizer,
        "loss": s.loss, "attention": s.attention, "mixed_precision": s.precision,
        "offload": s.offload, "lora": s.lora, "quantization": s.quantization,
        "grad_accum": s.grad_accum,
    }
    for k, v in fixed.items():
        assert got[k] == v


@pytest.mark.parametrize("batch, gpus", [(16, 1), (12, 1), (8, 2), (7, 1), (32, 4)])
def test_effective_batch_is_kept(llama7b, batch, gpus):
    for gb in (8, 24, 80):
        c = _plan(llama7b, gb, batch_size=batch, gpus=gpus)
        assert c.plan.micro_batch_size * c.plan.grad_accum * c.plan.gpus == batch


def test_nothing_fits(llama7b):
    c = _plan(llama7b, 4, lora=False, sources={"lora": "--method full"})
    assert not c.fits
    assert c.min_vram_bytes > 4 * GB
    assert Budget(c.min_vram_bytes).usable_bytes >= c.chosen.peak_bytes
    assert c.suggestion and "--method full" in c.suggestion  # releasing it is the best change
    assert c.plan.lora is False


def test_nothing_fits_even_fully_auto():
    c = _plan(resolve_model("llama-2-70b"), 2)
    assert not c.fits
    assert c.suggestion
    assert any("card with at least" in s for s in c.suggestions)


def test_reasons_carry_numbers(llama7b):
    c = _plan(llama7b, 8)
    assert set(c.plan.reasons) == set(CANONICAL)
    r = c.plan.reasons["gradient_checkpointing"]
    assert r.startswith("on:") and "GiB" in r and "> budget" in r and "~25% slower" in r
    assert "nf4-dq" in c.plan.reasons["quantization"] and "GiB" in c.plan.reasons["quantization"]


def test_breakdown_sums_and_limits(llama7b):
    c = _plan(llama7b, 12)
    d = choice_to_dict(c)
    assert sum(d["breakdown"].values()) == d["peak_bytes"]
    assert set(d["breakdown"]) == set(BREAKDOWN_KEYS)
    json.dumps(d)  # plain data
    s = c.chosen.setup
    assert c.max_seq_len >= s.seq_len
    fits = lambda est: est.peak_bytes <= c.budget.usable_bytes  # noqa: E731
    assert fits(estimate_memory(replace(s, seq_len=c.max_seq_len)))
    if c.max_seq_len < s.model.max_position_embeddings:
        assert not fits(estimate_memory(replace(s, seq_len=c.max_seq_len + 1)))
    assert fits(estimate_memory(replace(s, micro_batch_size=c.max_micro_batch_size)))
    assert not fits(estimate_memory(replace(s, micro_batch_size=c.max_micro_batch_size + 1)))


def test_alternatives_and_ladder(llama7b):
    c = _plan(llama7b, 12)
    assert c.alternatives and all(a.setup != c.chosen.setup for a in c.alternatives)
    names = [r.technique for r in c.ladder]
    assert names[0] == "baseline"
    order = [t.name for t in tq.LADDER]
    assert names[1:] == order
    peaks = [r.peak_bytes for r in c.ladder]
    assert peaks[-1] < peaks[0]


def test_no_bf16_card_gets_fp16_mixed(llama7b):
    c = choose_plan(PlanRequest(llama7b), Budget(24 * GB, bf16=False))
    assert c.plan.mixed_precision == "fp16-mixed"


def test_cpu_budget_plans_a_cpu_run():
    spec = resolve_model("qwen2.5-0.5b")
    c = choose_plan(PlanRequest(spec, seq_len=256), Budget(16 * GB, device="cpu", bf16=False))
    assert c.plan.device == "cpu"
    assert c.plan.mixed_precision == "fp32"
    assert c.plan.offload == "none"
    assert c.chosen.estimate.breakdown["cuda_context"] == 0


@pytest.mark.parametrize(
    "fixed, words",
    [
        ({"seq_len": 0}, "seq_len"),
        ({"batch_size": -4}, "batch_size"),
        ({"gpus": 0}, "gpus"),
        ({"lora": False, "quantization": "nf4"}, "needs lora"),
        ({"batch_size": 10, "gpus": 3}, "not divisible"),
        ({"grad_accum": 3}, "not divisible"),
        ({"micro_batch_size": 4, "grad_accum": 2}, "!= batch_size"),
    ],
)
def test_impossible_values(llama7b, fixed, words):
    with pytest.raises(LowvramError) as e:
        _plan(llama7b, 24, **fixed)
    assert words in e.value.message and e.value.hint


def test_search_picks_the_fastest_plan_of_the_first_level_with_a_fake_estimator(llama7b):
    """Not the ladder's order: the 8-bit optimizer (~3%) beats checkpointing (~25%, an earlier
    rung) when either alone fits; LoRA only when no full fine-tuning plan fits."""

    def fake(setup):
        peak = 100
        peak -= 40 if setup.gradient_checkpointing else 0
        peak -= 40 if setup.optimizer == "adamw_8bit" else 0
        peak -= 50 if setup.lora else 0
        peak *= GB
        bd = dict.fromkeys(BREAKDOWN_KEYS, 0) | {"weights": peak}
        return MemoryEstimate(1, 1, peak, bd, "forward_backward", 0, peak)

    req = PlanRequest(llama7b, batch_size=1)
    c = choose_plan(req, Budget(1000 * GB, device="cpu"), estimate=fake)  # everything fits
    assert not c.chosen.setup.gradient_checkpointing and not c.chosen.setup.lora
    budget = Budget(vram_needed_bytes(60 * GB), device="cpu")  # 60 fits, 100 does not
    s = choose_plan(req, budget, estimate=fake).chosen.setup
    assert s.optimizer == "adamw_8bit" and not s.gradient_checkpointing and not s.lora
    # the ladder climbs checkpointing first: its rung already fits
    rungs = {r.technique: r for r in choose_plan(req, budget, estimate=fake).ladder}
    assert rungs["gradient_checkpointing"].fits
    budget = Budget(vram_needed_bytes(20 * GB), device="cpu")  # only both together, or LoRA + one
    s = choose_plan(req, budget, estimate=fake).chosen.setup
    assert s.optimizer == "adamw_8bit" and s.gradient_checkpointing and not s.lora
    budget = Budget(vram_needed_bytes(15 * GB), device="cpu")  # no full fine-tuning plan fits
    s = choose_plan(req, budget, estimate=fake).chosen.setup
    assert s.lora and s.optimizer == "adamw_8bit" and not s.gradient_checkpointing  # 3% < 25%


def test_a_plan_that_needs_a_missing_extra_says_so_and_names_one_that_needs_nothing_more(llama7b):
    req = PlanRequest(llama7b, seq_len=2048, batch_size=1)
    c = choose_plan(req, Budget(5 * GB, missing_extras=("deepspeed",)))
    assert c.fits and c.plan.offload == "full"  # nothing without DeepSpeed fits 5 GB (QLoRA fits 6)
    note = next(n for n in c.notes if "deepspeed" in n)
    assert "pip install 'lowvram[deepspeed]'" in note and "none fits" in note
    c = choose_plan(replace(req, gpus=2, batch_size=2), Budget(40 * GB, missing_extras=("deepspeed",)),)
    assert not any("deepspeed" in n for n in c.notes)  # FSDP2 needs nothing more
    fixed = choose_plan(replace(req, offload="zero3-offload", gpus=2, batch_size=2),
                        Budget(40 * GB, missing_extras=("deepspeed",)))
    note = next(n for n in fixed.notes if "deepspeed" in n)
    assert "nothing more" not in note  # offload fixed: every plan needs DeepSpeed
    assert choose_plan(req, Budget(6 * GB)).notes == ()  # installed: nothing to say


def test_plan_for_recipe_uses_the_chooser_and_falls_back(tmp_path):
    """The entry `lowvram train` uses: predicted when config.json is there, fixed defaults if not."""
    from lowvram.hardware import Device, Hardware
    from lowvram.planning.entry import plan_for_recipe
    from lowvram.recipe import parse_recipe

    hw = Hardware("cuda", (Device(0, "fake 24GB", 24 * GB, 24 * GB, (8, 6), True),))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 1000, "max_position_embeddings": 512,
    }))
    text = "model: {name_or_path: %s}\ndata: {datasets: [{path: d.jsonl}]}\n"
    r = parse_recipe(text % "m", "r.yaml", source=tmp_path / "r.yaml")
    plan = plan_for_recipe(r, hardware=hw)
    assert plan.predicted_peak_bytes and plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.mixed_precision == "bf16" and plan.effective_batch == r.training.batch_size
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "model.gguf").write_bytes(b"GGUF")
    r = parse_recipe(text % "g", "r.yaml", source=tmp_path / "r.yaml")
    plan = plan_for_recipe(r, hardware=hw)
    assert plan.predicted_peak_bytes is None
    assert plan.reasons["memory"].startswith("memory not predicted")


def test_plan_fits_compares_peak_with_budget():
    from lowvram.plan.types import Plan

    base = dict(device="cuda", mixed_precision="bf16", gradient_checkpointing=False, micro_batch_size=1,
                grad_accum=1, lora=True, quantization="none", optimizer="adamw", offload="none",
                attention="sdpa", loss="standard")
    assert Plan(**base, predicted_peak_bytes=10, budget_bytes=10).fits is True
    assert Plan(**base, predicted_peak_bytes=11, budget_bytes=10).fits is False
    assert Plan(**base).fits is None


def test_deepspeed_offload_plans_use_adamw_and_a_fixed_8bit_optimizer_is_refused(llama7b):
    # Offload is the last resort: a 70B-class squeeze on a small card reaches it.
    spec = resolve_model("llama-2-13b")
    c = _plan(spec, 6, lora=False)
    assert c.plan.offload in ("optimizer", "full")
    assert c.plan.optimizer == "adamw"  # DeepSpeed's CPU Adam: never adamw_8bit with it
    assert "DeepSpeed's CPU Adam" in c.plan.reasons["optimizer"]
    for a in c.alternatives:
        assert not (a.setup.offload in ("optimizer", "full") and a.setup.optimizer != "adamw")
    rungs = {r.value: r for r in c.ladder if r.technique == "offload"}
    assert set(rungs) == {"optimizer", "full"}
    with pytest.raises(LowvramError, match="DeepSpeed's CPU Adam") as e:
        _plan(llama7b, 24, optimizer="adamw_8bit", offload="optimizer")
    assert "--optimizer adamw" in e.value.hint
    # an 8-bit optimizer the user fixed: the ladder leaves out the DeepSpeed offload rungs
    c = _plan(spec, 6, lora=False, optimizer="adamw_8bit")
    assert c.plan.offload not in ("optimizer", "full")
    assert not [r for r in c.ladder if r.technique == "offload"]


@pytest.mark.parametrize("model, seq_len, batch, gb, loss, slowdown", [
    ("llama-3.1-8b", 2048, 8, 76, "chunked", 1.03 * 1.02),
    ("llama-3.2-3b", 4096, 1, 36, "chunked", 1.03 * 1.02),
])
def test_search_finds_plans_the_ladder_missed(model, seq_len, batch, gb, loss, slowdown):
    """docs/planner.md's two examples: the ladder's first rung that fits is checkpointing (~25%); the
    search takes the 8-bit optimizer without checkpointing."""
    c = choose_plan(PlanRequest(resolve_model(model), seq_len=seq_len, batch_size=batch), Budget(gb * GB))
    s = c.chosen.setup
    assert (s.optimizer, s.gradient_checkpointing, s.lora, s.loss) == ("adamw_8bit", False, False, loss)
    assert c.chosen.slowdown == pytest.approx(slowdown)
    first_fit = next(r for r in c.ladder if r.fits)
    assert first_fit.technique == "gradient_checkpointing"


def test_longest_seq_len_and_largest_micro_batch_over_all_plans():
    """Answered over every plan the request allows, not only under the chosen one."""
    spec = resolve_model("llama-3.1-8b")
    budget = Budget(12 * GB)
    c = choose_plan(PlanRequest(spec, seq_len=2048, batch_size=1, lora=True, quantization="nf4-dq",
                                loss="standard"), budget)
    n, s = c.longest
    assert n > c.max_seq_len  # the chosen plan (standard loss fixed) reaches less
    assert s.quantization == "nf4-dq" and s.loss == "standard"  # fixed choices stay fixed
    assert estimate_memory(s).peak_bytes <= budget.usable_bytes
    assert estimate_memory(replace(s, seq_len=n + 1)).peak_bytes > budget.usable_bytes
    m, sm = c.largest_micro
    assert m >= c.max_micro_batch_size and sm.seq_len == 2048
    assert estimate_memory(sm).peak_bytes <= budget.usable_bytes
    d = choice_to_dict(c)
    assert d["longest_seq_len"] == n and "nf4-dq" in d["longest_seq_len_plan"]
    # auto loss: the chunked loss reaches further than the standard loss fixed above
    no_liger = replace(budget, missing_extras=("liger",))
    free = choose_plan(PlanRequest(spec, seq_len=2048, batch_size=1, lora=True, quantization="nf4-dq"), no_liger)
    assert free.longest[0] > n and free.longest[1].loss == "chunked"


def test_eager_attention_with_checkpointing_is_planned_and_chosen():
    """Eager attention + checkpointing is modelled (the recomputed layer's softmax backward and the
    masks the checkpoints keep; bench/plan_fuzz.py runs it through lowvram train): at 8k tokens
    of Llama-2-7B on 40 GB, eager needs checkpointing and the chooser takes it."""
    spec = resolve_model("llama-2-7b")
    req = PlanRequest(spec, seq_len=8192, batch_size=1, lora=True, attention="eager")
    c = choose_plan(req, Budget(40 * GB))
    assert c.chosen.setup.attention == "eager" and c.chosen.setup.gradient_checkpointing
    off = estimate_memory(replace(c.chosen.setup, gradient_checkpointing=False)).peak_bytes
    assert c.chosen.estimate.peak_bytes < off
    fixed = choose_plan(PlanRequest(spec, seq_len=2048, batch_size=1, mixed_precision="bf16-mixed",
                                    attention="eager", gradient_checkpointing=True), Budget(80 * GB))
    assert fixed.chosen.setup.gradient_checkpointing and fixed.chosen.setup.attention == "eager"


def test_flash_attention_is_refused_where_it_cannot_run_and_never_picked(llama7b):
    """Issue 24 item 8: fp32, cards before Ampere (compute capability < 8.0) and CPU runs cannot
    run flash-attn 2; a fixed flash_attention_2 there is refused, and the search never picks it."""
    fixed = {"attention": "flash_attention_2", "sources": {"attention": "--attention flash_attention_2"}}
    for budget, precision, why in [
        (Budget(24 * GB), "fp32", "precision fp32 keeps q, k and v in fp32"),
        (Budget(24 * GB, bf16=False, compute_capability=(7, 5)), None, "compute capability 7.5"),
        (Budget(24 * GB, bf16=False, compute_capability=(7, 5)), "fp16-mixed", "compute capability 7.5"),
        (Budget(24 * GB, "cpu", bf16=False), None, "CUDA GPUs only"),
    ]:
        with pytest.raises(LowvramError, match=why) as e:
            choose_plan(PlanRequest(llama7b, mixed_precision=precision, **fixed), budget)
        assert "--attention sdpa" in e.value.hint
    for budget, precision in [(Budget(24 * GB, compute_capability=(8, 0)), None), (Budget(24 * GB), "bf16-mixed"),
                              (Budget(80 * GB, compute_capability=(9, 0)), "fp16-mixed")]:
        c = choose_plan(PlanRequest(llama7b, mixed_precision=precision, **fixed), budget)
        assert c.plan.attention == "flash_attention_2"
    for gb in (8, 24, 80):
        c = _plan(llama7b, gb)
        assert all(a.setup.attention != "flash_attention_2" for a in (c.chosen, *c.alternatives))


def test_bloom_plans_eager_attention_the_only_one_transformers_has_for_it():
    """Found by tests/check/test_library_configs.py: transformers' Bloom has no SDPA (or flash) path, so
    the sdpa plans lowvram made for bloom-7b1 failed in from_pretrained."""
    spec = resolve_model("bloom-7b1")
    c = _plan(spec, 24, lora=True)
    assert c.plan.attention == "eager" and "only eager attention for bloom" in c.plan.reasons["attention"]
    assert all(a.setup.attention == "eager" for a in c.alternatives)
    with pytest.raises(LowvramError, match="only eager attention"):
        _plan(spec, 24, lora=True, attention="sdpa")


def test_limits_break_ties_by_what_the_optimizer_gives_up():
    """The longest-seq_len plan of a full fine-tune that reaches the searched top with AdamW keeps
    AdamW: AdamW in the backward (measured a little faster, x 0.99: constants.OPTIMIZER_STEP_TIMES)
    and APOLLO (x 1.0, under 8-bit AdamW's 1.03) reach no further and give up more, so they win no tie."""
    c = _plan(resolve_model("gpt2"), 80, seq_len=1024, batch_size=16)
    assert tq.OPTIMIZER_SLOWDOWN["adamw_in_backward"] < 1.0
    assert c.longest[1].optimizer == "adamw"
    tiny = _plan(resolve_model("tinyllama"), 24, seq_len=8192, batch_size=1)
    assert tiny.longest[1].optimizer in ("adamw", "adamw_8bit")
