"""The planner's grpo/rloo terms (lowvram.plan.memory.grpo): exact cache bytes, the two phases, the
search's generation batch, the engine's share, the request's checks, `lowvram plan`'s answer."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.errors import LowvramError
from lowvram.plan.choose.choose import choose_plan
from lowvram.plan.choose.request import Budget, PlanRequest
from lowvram.plan.memory import grpo
from lowvram.plan.memory.grpo import GrpoRequest
from lowvram.plan.memory.memory import estimate_memory, phase_estimates
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.setup import GrpoSetup, RunSetup

QWEN = resolve_model("qwen2.5-1.5b")  # 28 layers, 2 kv heads of 128, vocab 151,936
runner = CliRunner()


def _setup(**kw) -> RunSetup:
    g = dict(prompt_len=512, completion_len=256, steps_per_generation=8)
    g.update(kw.pop("grpo", {}))
    base = dict(model=QWEN, precision="bf16", quantization="nf4", lora=True, micro_batch_size=2,
                seq_len=768, grad_accum=8, gradient_checkpointing=True, objective="grpo", grpo=GrpoSetup(**g))
    base.update(kw)
    return RunSetup(**base)


def test_kv_cache_is_every_layers_keys_and_values_in_the_weights_dtype():
    s = _setup()
    # 2 (k, v) x 28 layers x 16 rows x 2 kv heads x 128 x 768 tokens x 2 bytes (bf16, no autocast)
    assert grpo.generation_rows(s) == 16
    assert grpo.kv_cache_bytes(s, 16, 768) == 2 * 28 * 16 * 2 * 128 * 768 * 2 == 352_321_536
    fp32 = replace(s, precision="fp32", quantization="none", device="cpu")
    assert grpo.kv_cache_bytes(fp32, 16, 768) == 2 * 352_321_536


def test_paged_cache_is_whole_pages_per_row():
    s = _setup(grpo={"engine": "paged"})
    assert grpo.paged_num_blocks(s) == 16 * 3  # 768 tokens: 3 pages of 256 per row
    per_page = 2 * 28 * 2 * 128 * 256 * 2
    assert grpo.paged_cache_bytes(s) == (48 + 2) * per_page  # + transformers' two trash sectors


def test_each_phase_has_its_own_peak_and_the_step_the_larger():
    s = _setup()
    phases = phase_estimates(s)
    est = estimate_memory(s)
    assert set(phases) == {"generation", "training"}
    assert est.peak_bytes == max(p.peak_bytes for p in phases.values())
    assert phases["generation"].peak_moment in ("generation_prefill", "generation_decode", "scoring_forward")
    # a long completion makes the generation phase bind: the cache of 16 rows x 8,192 tokens
    long = _setup(micro_batch_size=1, grad_accum=16, seq_len=512 + 8192,
                  grpo={"completion_len": 8192, "steps_per_generation": 16})
    assert estimate_memory(long).peak_phase == "generation"
    assert estimate_memory(long).peak_moment == "generation_decode"


def test_generation_inside_an_accumulation_keeps_the_gradients():
    whole, half = _setup(), _setup(grpo={"steps_per_generation": 4})
    assert not grpo.grads_at_generation(whole) and grpo.grads_at_generation(half)
    assert not grpo.old_logprobs_computed(half)  # 8 % 4 == 0: the same policy, no old log-probs
    assert grpo.old_logprobs_computed(_setup(grpo={"rloo": True}))  # RLOO always
    assert grpo.old_logprobs_computed(_setup(grpo={"steps_per_generation": 16}))  # spans two optimizer steps
    g_whole, g_half = (phase_estimates(s)["generation"] for s in (whole, half))
    assert g_whole.breakdown["gradients"] == 0 and g_half.breakdown["gradients"] > 0


def test_reference_is_a_copy_only_under_full_fine_tuning():
    full = _setup(quantization="none", lora=False, grpo={"beta": 0.04})
    assert grpo.reference_weight_bytes(full) > 0
    assert grpo.reference_weight_bytes(_setup(grpo={"beta": 0.04})) == 0  # LoRA: the adapter disabled
    assert grpo.reference_weight_bytes(replace(full, grpo=replace(full.grpo, beta=0.0))) == 0
    assert estimate_memory(full).peak_bytes > estimate_memory(replace(full, grpo=replace(full.grpo, beta=0.0))).peak_bytes


def test_fused_head_tile_is_full_width_whatever_the_vocabulary():
    from lowvram.plan.memory import preference

    small = replace(QWEN, vocab_size=1000)
    s = _setup(model=small, device="cpu", precision="fp32", quantization="none")
    mm_buf, _ = preference.tile_bytes(s, 100)
    assert mm_buf == 100 * 32768 * 4  # trl/kernels/chunked_logprob.py: mm_buf is (min(N, 4096), 32768)


def test_non_grpo_setups_are_untouched():
    sft = RunSetup(model=QWEN, precision="bf16", lora=True, micro_batch_size=2, seq_len=768)
    assert sft.grpo is None and phase_estimates(sft) == {}
    assert estimate_memory(sft, "training") == estimate_memory(sft)


def _request(**kw) -> PlanRequest:
    g = GrpoRequest(**kw.pop("grpo", {}))
    base = dict(model=QWEN, seq_len=g.prompt_len + g.completion_len, batch_size=32, lora=True,
                quantization="nf4-dq", objective="grpo", grpo=g)
    base.update(kw)
    return PlanRequest(**base)


def test_the_search_lowers_the_generation_batch_before_anything_that_gives_up_more():
    req = _request(grpo={"completion_len": 4096}, gradient_checkpointing=True, micro_batch_size=1)
    roomy = choose_plan(req, Budget(80 * 2**30))
    assert roomy.plan.steps_per_generation == 32 and roomy.plan.generation_batch_size == 32
    tight = choose_plan(req, Budget(int(roomy.chosen.peak_bytes * 0.8)))
    assert tight.fits and tight.plan.steps_per_generation < 32
    assert tight.plan.generation_batch_size % 8 == 0  # whole groups: num_generations unchanged
    assert tight.chosen.setup.grpo.num_generations == 8


@pytest.mark.parametrize("kw, words", [
    ({"batch_size": 12}, "not divisible by grpo.num_generations 8"),
    ({"grpo": {"num_generations": 1}}, "at least 2"),
    ({"offload": "optimizer"}, "not modelled"),
    ({"grpo": {"generation_batch_size": 12}}, "not divisible by num_generations"),
])
def test_requests_trl_would_refuse_are_refused(kw, words):
    with pytest.raises(LowvramError) as e:
        choose_plan(_request(**kw), Budget(24 * 2**30))
    assert words in str(e.value) and e.value.hint


def test_vllm_share_is_what_the_budget_leaves_plus_its_copy():
    c = choose_plan(_request(grpo={"engine": "vllm"}), Budget(24 * 2**30))
    u = c.plan.vllm_gpu_memory_utilization
    assert 0 < u <= 0.95 and c.plan.generation == "vllm"
    # its own need (a 16-bit copy of the weights, the generation batch's cache) is inside the peak
    assert c.chosen.peak_bytes > choose_plan(_request(), Budget(24 * 2**30)).chosen.peak_bytes


def test_plan_cli_answers_with_both_phases_and_the_engine_share():
    args = ["plan", "--objective", "grpo", "--model", "qwen2.5-1.5b", "--method", "qlora", "--vram", "8GB"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "generation phase: peak" in r.output and "training phase: peak" in r.output
    assert "<- binds" in r.output and "engine share:" in r.output
    d = json.loads(runner.invoke(app, [*args, "--json", "--num-generations", "4", "--max-completion-length",
                                       "512", "--generation", "paged"]).stdout)
    g = d["grpo"]
    assert g["num_generations"] == 4 and g["max_completion_length"] == 512 and d["seq_len"] == 1024
    assert set(g["phases"]) == {"generation", "training"} and g["binds"] in g["phases"]
    assert g["engine_share"]["paged_num_blocks"] == g["generation_batch_size"] * 4  # 1,024 tokens: 4 pages
    assert d["peak_bytes"] == g["phases"][g["binds"]]["peak_bytes"]


def test_grpo_flags_need_a_grpo_objective():
    r = runner.invoke(app, ["plan", "--model", "qwen2.5-1.5b", "--vram", "8GB", "--num-generations", "4"])
    assert r.exit_code == 1 and "applies to objective grpo or rloo only" in r.stderr


def test_generation_table_rows_grow_with_the_card():
    from lowvram.plan.choose.grpo_table import generation_table
    from lowvram.planning.budget import make_budget

    req = _request(model=resolve_model("smollm2-135m"), batch_size=8)
    rows = generation_table(req, [(f"{n} GB", make_budget(f"{n}GB", None, 1, None)) for n in (8, 24)], estimate_memory)
    assert all(r.setup is not None for r in rows)
    tokens = [r.num_generations * r.max_completion_length for r in rows]
    assert tokens[0] < tokens[1] and all(r.binds for r in rows)
