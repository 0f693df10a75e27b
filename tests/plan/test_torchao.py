"""optimizers adamw_torch_8bit and adamw_torch_4bit (torchao's low-bit AdamW): their state and the
compiled step's buffers counted by the planner (lowvram.plan.memory.optimizers) against the real classes
the Trainer builds, the live-bytes tracker on compiled code against torch.profiler, their
constraints, the search's use of them, and runs through `lowvram train` (issue 27)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.memory.optimizers import torchao_state_bytes, torchao_step_temp_bytes
from lowvram.plan.memory.states import optimizer_bytes, optimizer_step_temp_bytes, trainable_tensors
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.setup import RunSetup

LLAMA = resolve_model("llama-3.2-1b")
TINY = replace(LLAMA, num_layers=2, hidden_size=64, intermediate_size=160, num_heads=4, num_kv_heads=2,
               head_dim=16, vocab_size=256, tie_word_embeddings=False)


def test_torchao_state_is_exact_for_the_tiny_llama():
    """Quantized (>= 4096 elements, a multiple of 256): two moments of codes + fp32 scales + qmap;
    k/v_proj (2048) and the norms stay in their dtype; a CPU plan adds each step scalar and two lr."""
    h, kv, i, v = 64, 32, 160, 256
    quantized = [h * h, h * h, i * h, i * h, i * h] * 2 + [v * h, v * h]  # q, o, MLP x 2 layers, emb, head
    plain = [kv * h, kv * h, h, h] * 2 + [h]  # k, v, two norms x 2 layers, final norm
    tensors = len(quantized) + len(plain)
    for optimizer, code, qmap in (("adamw_torch_8bit", 1.0, 256), ("adamw_torch_4bit", 0.5, 16)):
        setup = RunSetup(TINY, precision="bf16", optimizer=optimizer, device="cuda")
        expected = sum(2 * (int(code * n) + 4 * (n // 256) + 4 * qmap) for n in quantized)
        expected += sum(2 * 2 * n for n in plain)
        assert optimizer_bytes(setup) == torchao_state_bytes(setup, 2, trainable_tensors(setup)) == expected
        cpu = replace(setup, device="cpu")
        assert optimizer_bytes(cpu) == expected + 4 * tensors + 8
    assert optimizer_bytes(RunSetup(TINY, precision="bf16", optimizer="adamw_torch_8bit")) == 283_264


@pytest.mark.parametrize("optimizer", ["adamw_torch_8bit", "adamw_torch_4bit"])
@pytest.mark.parametrize("lora", [False, True])
def test_torchao_state_is_the_real_optimizers(optimizer, lora, tmp_path, monkeypatch):
    """The Trainer's AdamW8bit / AdamW4bit on the tiny Llama after one step: the storage of every
    state tensor (codes, scales, qmaps, plain moments, step scalars) and the groups' lr tensors
    equal the plan's, byte for byte. The step runs eagerly here (torch.compile made the identity:
    the state does not depend on it; the compiled step's buffers: the next test)."""
    pytest.importorskip("torchao")
    import torch
    from transformers import AutoModelForCausalLM, Trainer

    from lowvram.check.builders import hf_config
    from lowvram.livebytes import iter_tensors
    from lowvram.plan.choose.search import plan_for_setup
    from lowvram.recipe.schema import Recipe
    from lowvram.train.build.trainer import build_training_args

    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    setup = RunSetup(TINY, precision="fp32", optimizer=optimizer, device="cpu", lora=lora, lora_r=8)
    plan = plan_for_setup(setup, "cpu", 16)
    recipe = Recipe.model_validate({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d"}]},
                                    "training": {"output_dir": str(tmp_path), "report_to": "none", "max_steps": 1}})
    model = AutoModelForCausalLM.from_config(hf_config(TINY), dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    trainer = Trainer(model=model, args=build_training_args(recipe, plan))
    opt = trainer.create_optimizer()
    assert type(opt).__name__ == {"adamw_torch_8bit": "AdamW8bit", "adamw_torch_4bit": "AdamW4bit"}[optimizer]
    ids = torch.randint(0, 256, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    def plain(t):  # an OptimState8bit/4bit wraps its codes, scale and qmap (it owns no storage)
        flatten = getattr(type(t), "__tensor_flatten__", None)
        return [u for name in flatten(t)[0] for u in plain(getattr(t, name))] if flatten else [t]

    tensors = [u for t in iter_tensors(opt.state) for u in plain(t)]
    assert any(u.dtype == torch.uint8 for u in tensors) != lora  # r=8 adapters: under 4096 elements
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    lrs = [g["lr"] for g in opt.param_groups]
    assert len(lrs) == 2 and all(lr.numel() == 1 and lr.dtype == torch.float32 for lr in lrs)
    assert sum(storages.values()) + 4 * len(lrs) == optimizer_bytes(setup)


@pytest.mark.parametrize("optimizer", ["adamw_torch_8bit", "adamw_torch_4bit"])
def test_the_compiled_step_makes_what_the_plan_counts(optimizer):
    """One quantized parameter's compiled step (torch.compile, inductor's C++ backend): the
    buffers above what lives before and after, under the live-bytes tracker (which follows
    compiled code) and under torch.profiler's memory events (to its scalars), equal the plan's
    (constants.TORCHAO_*BIT_STEP_TEMP_BYTES); a parameter kept in full precision steps in place."""
    pytest.importorskip("torchao")
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torchao.optim import AdamW4bit, AdamW8bit

    from lowvram.livebytes import LiveBytes

    cls = AdamW8bit if optimizer == "adamw_torch_8bit" else AdamW4bit
    setup = RunSetup(TINY, precision="fp32", optimizer=optimizer, device="cpu")
    for shape in ((512, 256), (1000, 65)):  # quantized; not a multiple of 256 (kept in fp32)
        p = torch.nn.Parameter(torch.randn(*shape))
        p.grad = torch.randn_like(p)
        opt = cls([p], lr=1e-3, block_size=256)
        tracker = LiveBytes()
        tracker.register(p, p.grad)
        with tracker:
            opt.step()  # compiles; the state is made
            tracker.reset_peak()
            before = tracker.current_bytes
            opt.step()
            tracked = tracker.peak_bytes - before
            assert tracker.current_bytes == before
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            opt.step()
        now = peak = 0
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        for e in sorted(events, key=lambda e: e.start_ns()):
            now += e.nbytes()
            peak = max(peak, now)
        planned = torchao_step_temp_bytes(setup, [shape])
        assert tracked == planned
        assert 0 <= peak - planned <= 16  # the profiler also sees the step's fp32 scalars (bias corrections)
    assert optimizer_step_temp_bytes(setup) == torchao_step_temp_bytes(setup, [(256, 64)])


@pytest.mark.parametrize(("changes", "why"), [
    (dict(offload="zero2"), "not planned"),
    (dict(offload="fsdp"), "not planned"),
])
def test_torchao_under_offload_is_refused_by_the_memory_model(changes, why):
    from lowvram.plan.memory.optimizers import optimizer_problems

    setup = replace(RunSetup(LLAMA, precision="bf16", optimizer="adamw_torch_4bit", device="cuda"), **changes)
    problems = optimizer_problems(setup)
    assert problems and why in problems[0]
    assert optimizer_problems(replace(setup, offload="none")) == []


def test_a_fixed_torchao_optimizer_with_an_offload_is_refused_with_a_hint():
    from lowvram.plan.choose.choose import choose_plan
    from lowvram.plan.choose.request import Budget, PlanRequest

    with pytest.raises(LowvramError) as e:
        choose_plan(PlanRequest(model=LLAMA, batch_size=1, optimizer="adamw_torch_8bit", offload="zero2",
                                gpus=1), Budget(24 * 2**30))
    assert "is not planned" in e.value.message and "--offload none" in e.value.hint


@pytest.mark.parametrize(("budget_changes", "expected"), [
    ({}, {"adamw_torch_8bit", "adamw_torch_4bit"}),
    (dict(missing_extras=("torchao",)), set()),  # torchao not installed: never searched
])
def test_torchao_forms_are_searched_only_where_installed(budget_changes, expected):
    from lowvram.plan.choose.request import Budget, PlanRequest
    from lowvram.plan.choose.search import candidate_setups

    setups = candidate_setups(PlanRequest(model=LLAMA, batch_size=1), Budget(24 * 2**30, **budget_changes))
    ao = [s for s in setups if s.optimizer.startswith("adamw_torch")]
    assert {s.optimizer for s in ao} == expected
    assert all(s.offload == "none" for s in ao)
    assert {s.lora for s in ao} == ({False, True} if expected else set())


def test_torchao_ranks_with_8bit_adamw_and_4bit_before_galore():
    from lowvram.plan.choose.request import optimizer_given_up

    rank = {o: optimizer_given_up(RunSetup(LLAMA, optimizer=o)) for o in
            ("adamw", "adamw_8bit", "adamw_torch_8bit", "adamw_torch_4bit", "adamw_in_backward", "galore_adamw",
             "galore_adamw_layerwise", "adalomo", "lomo")}
    assert rank == {"adamw": 0, "adamw_8bit": 0, "adamw_torch_8bit": 0, "adamw_torch_4bit": 1,
                    "adamw_in_backward": 2, "galore_adamw": 3, "galore_adamw_layerwise": 4, "adalomo": 5, "lomo": 6}


def test_torchao_8bit_is_leaner_than_bitsandbytes_by_the_embedding():
    """bitsandbytes' 8-bit AdamW keeps the embedding's moments in fp32 under the Trainer; torchao
    quantizes it too: 8 x V x h bytes -> about 2 x V x h."""
    setup = RunSetup(LLAMA, precision="bf16", optimizer="adamw_8bit", device="cuda")
    v, h = LLAMA.vocab_size, LLAMA.hidden_size
    saved = optimizer_bytes(setup) - optimizer_bytes(replace(setup, optimizer="adamw_torch_8bit"))
    assert 5.9 * v * h < saved < 6.0 * v * h


def test_torchao_plans_map_to_the_trainers_optim_names(tmp_path):
    pytest.importorskip("torchao")
    from lowvram.plan.choose.search import plan_for_setup
    from lowvram.recipe.schema import Recipe
    from lowvram.train.build.trainer import build_training_args

    recipe = Recipe.model_validate({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d"}]},
                                    "training": {"output_dir": str(tmp_path), "report_to": "none"}})
    for optimizer in ("adamw_torch_8bit", "adamw_torch_4bit"):
        plan = plan_for_setup(RunSetup(TINY, precision="fp32", optimizer=optimizer, device="cpu"), "cpu", 16)
        args = build_training_args(recipe, plan)
        assert args.optim == optimizer and args.max_grad_norm == 1.0 and not args.optim_args


def test_a_cpu_without_a_compiler_is_refused_with_a_hint(monkeypatch):
    pytest.importorskip("torchao")
    import shutil

    from lowvram.plan.choose.search import plan_for_setup
    from lowvram.train.build.trainer import projected_optimizer_arguments

    monkeypatch.setattr(shutil, "which", lambda _: None)
    plan = plan_for_setup(RunSetup(TINY, precision="fp32", optimizer="adamw_torch_4bit", device="cpu"), "cpu", 16)
    with pytest.raises(LowvramError) as e:
        projected_optimizer_arguments(plan)
    assert "C++ compiler" in str(e.value) and "adamw_8bit" in e.value.hint


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_torchao_runs_stay_within_their_plan(seed, tmp_path):
    """torchao runs through `lowvram train` on the CPU, the step compiled, within the plan-truth
    target (bench/results/plan_fuzz_torchao_heldout_*.txt: the held-out seeds)."""
    pytest.importorskip("torchao")
    from lowvram.difftest import TEN_FAMILIES, made_torchao, random_case, run_case

    case = made_torchao(random_case(seed, families=TEN_FAMILIES))
    assert case.optimizer.startswith("adamw_torch")
    out = run_case(case, tmp_path)
    assert out.error is None, out.error
    assert out.ok, f"{case.label()}: {out.ratio:+.2%}"
