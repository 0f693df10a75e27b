"""Out-of-memory recovery: the chooser's next cheaper plan, OOM recognition, and the whole loop
through `lowvram train` on the tiny model with an emulated card (LOWVRAM_EMULATE_VRAM)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from lowvram.plan.choose.choose import choose_plan, next_cheaper
from lowvram.plan.choose.request import Budget, PlanRequest
from lowvram.plan.model.catalog import resolve_model
from lowvram.train.run import oom, recover, signals
from tests.train.test_e2e import metrics, train, write_recipe

# Live tensor bytes of the tiny LoRA run (seq_len 64, batch 4), measured on CPU: micro-batch 4 peaks
# at 4,069,452 bytes, micro-batch 2 x 2 at 2,483,836. A 3.5 MiB card holds only the second.
CARD = "3.5MiB"


# --------------------------------------------------------------------------------------------
# The chooser


def _plan(**fixed):
    req = PlanRequest(model=resolve_model("llama-2-7b"), seq_len=2048, batch_size=16, **fixed)
    return req, choose_plan(req, Budget(80 * 2**30, "cuda")).plan


@pytest.mark.slow  # `make test-all` (the default suite's time on 2 cores)
def test_next_cheaper_steps_down_and_keeps_the_effective_batch():
    req, plan = _plan()
    seen, new = [plan], plan
    while (nxt := next_cheaper(new, req, new.predicted_peak_bytes)) is not None:
        assert nxt.effective_batch == plan.effective_batch
        assert nxt.predicted_peak_bytes <= 0.9 * new.predicted_peak_bytes
        assert nxt.mixed_precision == plan.mixed_precision
        assert "out of memory" in nxt.reasons["retry"]
        seen.append(nxt)
        new = nxt
    # Down the ladder: checkpointing before LoRA, a quantized base last.
    assert len(seen) >= 4
    first = {name: next(i for i, p in enumerate(seen) if getattr(p, name)) for name in ("gradient_checkpointing", "lora")}
    assert 0 < first["gradient_checkpointing"] < first["lora"]
    assert seen[-1].lora and any(p.quantization != "none" for p in seen) and seen[-1].offload != "none"


def test_next_cheaper_uses_the_lower_of_measured_and_predicted():
    req, plan = _plan()
    # Measured far below the prediction (the card was smaller than planned): plan for the measurement.
    low = next_cheaper(plan, req, plan.predicted_peak_bytes // 3)
    assert low.predicted_peak_bytes <= 0.9 * plan.predicted_peak_bytes // 3
    # Measured above the prediction: at least one rung below the predicted peak.
    high = next_cheaper(plan, req, plan.predicted_peak_bytes * 2)
    assert high.predicted_peak_bytes <= 0.9 * plan.predicted_peak_bytes


def test_next_cheaper_respects_fixed_settings():
    req, plan = _plan(gradient_checkpointing=False, lora=False, optimizer="adamw")
    new = next_cheaper(plan, req, plan.predicted_peak_bytes)
    assert new is not None and not new.gradient_checkpointing and not new.lora and new.optimizer == "adamw"
    assert new.predicted_peak_bytes <= 0.9 * plan.predicted_peak_bytes and new.effective_batch == 16
    # All but activation offload fixed: the re-plan offloads the checkpointed layer inputs.
    req, plan = _plan(gradient_checkpointing=True, lora=True, quantization="nf4-dq", optimizer="adamw",
                      micro_batch_size=1, offload="full", loss="chunked")
    new = next_cheaper(plan, req, plan.predicted_peak_bytes)
    assert new is not None and new.activation_offload and not plan.activation_offload
    # Everything fixed and micro-batch 1 already: nothing cheaper exists.
    req, plan = _plan(gradient_checkpointing=True, lora=True, quantization="nf4-dq", optimizer="adamw",
                      micro_batch_size=1, offload="full", loss="chunked", activation_offload=True)
    assert next_cheaper(plan, req, plan.predicted_peak_bytes) is None
    assert next_cheaper(replace(plan, predicted_peak_bytes=None), req, 10**9) is None


def test_oom_errors_are_recognised():
    import torch

    assert oom.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert oom.is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert oom.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert not oom.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not oom.is_oom(ValueError("CUDA out of memory"))
    assert oom.requested_bytes("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has") == 2 * 2**30
    assert oom.requested_bytes("Tried to allocate 20.50 MiB") == int(20.5 * 2**20)
    assert oom.requested_bytes("emulated card of 10 bytes") == 0


def test_describe_change():
    _, plan = _plan()
    new = replace(plan, gradient_checkpointing=True, micro_batch_size=2, grad_accum=8)
    assert recover.describe_change(plan, new) == "gradient_checkpointing on, micro-batch 2 x 8"


# --------------------------------------------------------------------------------------------
# The loop, end to end through the CLI on an emulated card


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    """An uninterrupted run on no memory cap: its losses are what every recovery must reach."""
    d = tmp_path_factory.mktemp("ref")
    recipe = write_recipe(d, tiny_model_dir, steps=4, save_steps=2)
    result = train(str(recipe))
    assert result.exit_code == 0, result.output
    return metrics(d / "out")


def test_oom_on_emulated_card_retries_with_a_smaller_micro_batch(tmp_path, tiny_model_dir, monkeypatch, reference):
    monkeypatch.setenv(oom.EMULATE_ENV, CARD)
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=4, save_steps=2)
    result = train(str(recipe))
    assert result.exit_code == 0, result.output
    assert re.search(r"OOM at step 1 \(measured 3\.\d MiB\); retrying with micro-batch 2 x 2; starting over "
                     r"\(retry 1 of 3\)", result.output), result.output
    m = metrics(tmp_path / "out")
    assert [(r["step"], r["changed"], r["resumed_from"]) for r in m["oom_retries"]] == [(1, "micro-batch 2 x 2", None)]
    assert m["oom_retries"][0]["measured_peak_bytes"] > 3.5 * 2**20
    assert m["final_plan"]["micro_batch_size"] == 2 and m["final_plan"]["gradient_accumulation"] == 2
    assert m["peak_memory_bytes"] <= 3.5 * 2**20
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert (plan["micro_batch_size"], plan["grad_accum"]) == (2, 2) and "retry" in plan["reasons"]
    # Same effective batch: the same training, step for step.
    assert m["train_loss"] == pytest.approx(reference["train_loss"], abs=1e-4)


def raise_oom_in_step_3(monkeypatch, micro_batch_size: int = 4) -> None:
    """Every Trainer made from now on raises CUDA's OOM as step 3 begins while its micro-batch is
    ``micro_batch_size`` (as a longer batch would): the retry, at a smaller one, gets past it."""
    import torch
    from transformers import TrainerCallback

    class OomInStep3(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2 and args.per_device_train_batch_size == micro_batch_size:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    make = signals.make_callbacks
    monkeypatch.setattr(signals, "make_callbacks", lambda stop: [*make(stop), OomInStep3()])


def test_oom_after_a_checkpoint_resumes_from_it(tmp_path, tiny_model_dir, monkeypatch, reference):
    """An OOM in step 3 (as a longer batch would cause): the retry continues from checkpoint-2."""
    raise_oom_in_step_3(monkeypatch)
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=4, save_steps=2)
    result = train(str(recipe))
    assert result.exit_code == 0, result.output
    assert "OOM at step 3 " in result.output and "resuming from checkpoint-2" in result.output
    m = metrics(tmp_path / "out")
    assert m["oom_retries"][0]["resumed_from"].endswith("checkpoint-2")
    assert m["resumed_from"].endswith("checkpoint-2") and m["steps"] == 4
    assert m["train_loss"] == pytest.approx(reference["train_loss"], abs=1e-4)


def test_no_recover_and_exhausted_retries_fail_clearly(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv(oom.EMULATE_ENV, CARD)
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2)
    off = train(str(recipe), "--no-recover")
    assert off.exit_code == 1
    assert re.search(r"error: out of memory at step 1 \(measured 3\.\d MiB, predicted 4\.2 MiB\)", off.output), off.output
    assert "the largest part of the predicted peak is activations" in off.output
    assert "hint: automatic recovery is off (--no-recover)" in off.output
    assert not (tmp_path / "out" / "metrics.json").exists()

    capped = train(str(recipe), "--max-retries", "0", "--overwrite")
    assert capped.exit_code == 1 and "hint: --max-retries 0 reached" in capped.output

    monkeypatch.setenv(oom.EMULATE_ENV, "1MiB")  # about the weights and optimizer state alone
    tiny = train(str(recipe), "--overwrite")
    assert tiny.exit_code == 1 and "Traceback" not in tiny.output
    assert "hint: no cheaper plan keeps the effective batch and the recipe's fixed settings" in tiny.output


def test_readme_examples_have_the_printed_formats():
    """docs/troubleshooting.md's out-of-memory and interrupt lines are in the formats the tests
    above check."""
    from tests.conftest import REPO

    section = (REPO / "docs" / "troubleshooting.md").read_text()
    blocks = [b for b in re.findall(r"```text\n(.*?)```", section, re.S)
              if b.startswith(("OOM at step", "error: interrupted"))]
    assert len(blocks) == 2
    oom = blocks[0].strip()
    assert re.fullmatch(r"OOM at step \d+ \(measured [\d.]+ GiB\); retrying with [a-z_0-9 ,x-]+; "
                        r"(resuming from checkpoint-\d+|starting over) \(retry \d+ of \d+\)", oom)
    _, plan = _plan()
    change = oom.split("retrying with ")[1].split(";")[0]
    new = replace(plan, gradient_checkpointing=True, micro_batch_size=2, grad_accum=8)
    assert recover.describe_change(plan, new) == change
    err, hint = blocks[1].strip().splitlines()
    assert re.fullmatch(r"error: interrupted by SIGINT at step (\d+); checkpoint saved: \S+/checkpoint-\1", err)
    assert hint == "hint: resume with: " + recover.resume_command(
        "recipes/qwen2.5-1.5b-lora.yaml", ["training.output_dir=runs/my run"])
    assert "`--max-retries` (default 3)" in section and "`--no-recover`" in section



def test_retry_loads_its_model_after_the_failed_attempt_is_collected(tmp_path, tiny_model_dir, monkeypatch):
    """Issue 24 item 4: the retry loads its model only once the first attempt's model (with its
    optimizer and Trainer) is collected, and _free_memory runs after that (torch.cuda.empty_cache
    can only return blocks that are free). bf16-mixed: accelerate's prepare_model wraps the
    forward in autocast as a method bound to the model (accelerator.py, ``model.forward =
    MethodType(...)``), a reference cycle that only the collector frees. The OOM is raised inside
    the real Trainer's first step; the spies only record weakrefs around the real functions.
    Automatic collection is off, so an incidental collection between the attempts cannot hide a
    reference the loop keeps."""
    import gc
    import weakref

    import torch
    from transformers import TrainerCallback

    from lowvram.train.build import model as model_mod

    raised: list[bool] = []

    class OomInStep1(TrainerCallback):  # the first attempt only (whatever cheaper plan the retry takes)
        def on_step_begin(self, args, state, control, **kwargs):
            if not raised:
                raised.append(True)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    make = signals.make_callbacks
    monkeypatch.setattr(signals, "make_callbacks", lambda stop: [*make(stop), OomInStep1()])
    models: list[weakref.ref] = []
    alive_at_load: list[bool] = []
    alive_after_free: list[bool] = []
    real_load, real_free = model_mod.load_model, recover._free_memory

    def load_spy(recipe, plan):
        alive_at_load.append(any(ref() is not None for ref in models))
        loaded = real_load(recipe, plan)
        models.append(weakref.ref(loaded.model))
        return loaded

    def free_spy():
        real_free()
        alive_after_free.append(any(ref() is not None for ref in models))

    monkeypatch.setattr(model_mod, "load_model", load_spy)
    monkeypatch.setattr(recover, "_free_memory", free_spy)
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2, techniques="lora: on, mixed_precision: bf16-mixed")
    gc.disable()
    try:
        result = train(str(recipe))
    finally:
        gc.enable()
    assert result.exit_code == 0, result.output
    assert "OOM at step 1" in result.output and "retry 1 of 3" in result.output, result.output
    assert len(models) == 2
    assert alive_after_free == [False], "the first attempt's model outlived _free_memory (empty_cache frees nothing)"
    assert alive_at_load == [False, False], "the first attempt's model was alive when the retry loaded its own"


def test_a_paged_optimizers_state_is_not_retried_beside_in_the_same_process():
    """issue 41 item 7: bitsandbytes never frees a paged optimizer's unified memory (no free in its
    library; GlobalPageManager keeps every buffer): an in-process retry would train beside the
    failed attempt's whole state. The retry is refused with the command that resumes in a new
    process; nothing is refused while no paged state is held, nor for other optimizers."""
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    import dataclasses as dc

    import torch

    from lowvram.plan.types import Plan
    from lowvram.train.run.recover import paged_state_kept

    plan = Plan(device="cuda", mixed_precision="bf16", gradient_checkpointing=True, micro_batch_size=1,
                grad_accum=1, lora=False, quantization="none", optimizer="paged_adamw_32bit", offload="none",
                attention="sdpa", loss="standard")
    pages = bnb_functional.GlobalPageManager.get_instance().paged_tensors
    kept = list(pages)
    try:
        pages.clear()
        assert paged_state_kept(plan) is None
        pages.append(torch.empty(3 * 2**20 // 4, dtype=torch.float32))
        why = paged_state_kept(plan)
        assert why.startswith("the failed attempt's paged_adamw_32bit state (3.0 MiB of CUDA unified memory)")
        assert why.endswith("resume in a new process")
        assert paged_state_kept(dc.replace(plan, optimizer="adamw_8bit")) is None
        assert paged_state_kept(dc.replace(plan, device="cpu")) is None
    finally:
        pages[:] = kept
