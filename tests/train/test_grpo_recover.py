"""GRPO/RLOO runs that run out of memory, resume, or run as two processes (issue 44 items 1 and 8),
through `lowvram train` with TRL's own GRPOTrainer on tiny Llamas built from configs:

- an OOM in the training phase (an emulated card below the first plan's fused-head tile) retries
  with a smaller micro-batch and the same generation batch: the same completions, the same rewards;
- an OOM in the generation phase (a model with a wide KV cache, generation batch 32) retries with a
  smaller generation batch and nothing else (num_generations is never lowered: the algorithm);
- an OOM after a checkpoint resumes from it, and the rewards' histories go on as one run;
- a checkpoint inside a generation round (num_iterations 2) is refused by --resume and skipped by the
  retry (TRL keeps the round's completions in memory only);
- `--gpus 2 --cpu`: two processes over gloo share each generation batch; `validate --gpus` checks
  TRL's divisibility rule first.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from tests.train.test_grpo import REWARD_FILE, recipe_text, write_prompts

pytest.importorskip("trl")


def cli(*args: str, env: dict | None = None):
    result = CliRunner().invoke(app, list(args), env=env)
    assert "Traceback" not in (result.output or ""), result.output
    return result


def metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def setup(tmp: Path, model, prompts: int = 16, **kw) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    write_prompts(tmp / "p.jsonl", n=prompts)
    (tmp / "rewards.py").write_text(REWARD_FILE)
    (tmp / "r.yaml").write_text(recipe_text(model, **kw))
    return tmp / "r.yaml"


def auto_micro(text: str) -> str:
    """The recipe with its micro-batch left to the planner (it takes the whole batch of 4 at once)."""
    return text.replace(" micro_batch_size: 2,", "")


# ---------------------------------------------------------------------------------- what the user is told


def test_a_retry_names_the_generation_batch_it_changed():
    from lowvram.plan.types import Plan
    from lowvram.train.run.recover import describe_change

    base = dict(device="cuda", mixed_precision="bf16", gradient_checkpointing=False, lora=True, quantization="none",
                optimizer="adamw", offload="none", attention="sdpa", loss="standard")
    plan = Plan(**base, micro_batch_size=1, grad_accum=32, generation="generate", steps_per_generation=32,
                generation_batch_size=32)
    assert describe_change(plan, replace(plan, steps_per_generation=16, generation_batch_size=16)) == \
        "generation batch 16 (2 rounds per step)"
    assert describe_change(plan, replace(plan, micro_batch_size=2, grad_accum=16, steps_per_generation=16)) == \
        "micro-batch 2 x 16"  # the same 32 completions generated at once
    sft = Plan(**base, micro_batch_size=4, grad_accum=1)
    assert describe_change(sft, replace(sft, micro_batch_size=2, grad_accum=2)) == "micro-batch 2 x 2"


@pytest.mark.parametrize("grpo, gpus, words, hint", [
    (", generation_batch_size: 6", 2, "grpo.generation_batch_size 6 does not split over 2 processes at "
     "micro_batch_size 2: TRL needs it divisible by micro-batch x processes (2 x 2 = 4) and by num_generations 2",
     "use a generation_batch_size that is a multiple of 4, or leave it auto"),
    (", steps_per_generation: 1", 1, None, None),  # 2 x 1 x 1 = 2: whole groups of 2
    ("", 3, "training.batch_size 4 is not divisible by 3 processes", "a multiple of 3"),
])
def test_validate_checks_the_generation_batch_for_the_processes(tmp_path, tiny_model_dir, grpo, gpus, words, hint):
    """TRL's GRPOConfig raises only when training starts (after the model loads, in every rank);
    `validate --gpus N` and `plan --gpus N` say it first, with the multiple to use."""
    recipe = setup(tmp_path, tiny_model_dir, grpo=grpo)
    result = cli("validate", str(recipe), "--gpus", str(gpus))
    if words is None:
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 1, result.output
    assert f"error: {words}" in " ".join(result.output.split()) and hint in result.output, result.output
    planned = cli("plan", str(recipe), "--gpus", str(gpus))  # the planner's own check: an error, not a crash
    assert planned.exit_code == 1 and "error: " in planned.output, planned.output
    if "generation_batch_size" in grpo:
        assert words in " ".join(planned.output.split()), planned.output


def test_validate_counts_prompts_not_completions(tmp_path, tiny_model_dir):
    """A grpo step takes batch_size / num_generations prompts (each completed num_generations times)."""
    recipe = setup(tmp_path, tiny_model_dir, prompts=2)  # batch 4 = 2 prompts x 2 generations
    assert cli("validate", str(recipe)).exit_code == 0
    write_prompts(tmp_path / "p.jsonl", n=1)
    result = cli("validate", str(recipe))
    assert result.exit_code == 1
    assert ("the data holds 1 prompts, fewer than one generation batch needs: 4 completions are 2 prompts x 2 "
            "generations") in " ".join(result.output.split()), result.output


# ---------------------------------------------------------------------------------- resume inside a round


def test_resume_inside_a_generation_round_is_refused(tmp_path, tiny_model_dir):
    """num_iterations 2: TRL trains two optimizer steps on each generation batch and keeps its
    completions in memory only; a checkpoint after the first of the two cannot be resumed as the
    run would have gone on. --resume names the last one that can."""
    recipe = setup(tmp_path, tiny_model_dir, steps=3, save_steps=1, grpo=", num_iterations: 2")
    first = cli("train", str(recipe), "--no-track-memory")
    assert first.exit_code == 0, first.output
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    recipe.write_text(recipe.read_text().replace("max_steps: 3", "max_steps: 4"))
    again = cli("train", str(recipe), "--resume", "--no-track-memory")
    assert again.exit_code == 1, again.output
    text = " ".join(again.output.split())
    assert ("error: --resume cannot continue the run exactly: checkpoint-3 is inside a generation round: TRL "
            "regenerates every 4 micro-steps (steps_per_generation 2 x num_iterations 2), every 2 optimizer "
            "steps here") in text, text
    assert "hint: resume from checkpoint-2 (a round's end) by removing the checkpoints after it" in text
    shutil.rmtree(out / "checkpoint-3")
    resumed = cli("train", str(recipe), "--resume", "--no-track-memory")
    assert resumed.exit_code == 0, resumed.output
    m = metrics(out)
    assert m["resumed_from"].endswith("checkpoint-2") and m["steps"] == 4
    # TRL logs the rewards where it generates (every 2 steps here): step 1 before the resume, 3 after
    assert [s for s, _ in m["reward_history"]] == [1, 3]


# ---------------------------------------------------------------------------------- OOM re-plan


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    """The uninterrupted run, no memory cap: micro-batch 4 (the planner's choice), 4 steps."""
    d = tmp_path_factory.mktemp("grpo-ref")
    recipe = setup(d, tiny_model_dir, steps=4, save_steps=2)
    recipe.write_text(auto_micro(recipe.read_text()))
    result = cli("train", str(recipe))
    assert result.exit_code == 0, result.output
    return metrics(d / "out")


@pytest.mark.slow  # `make test-all`: three tiny GRPO runs through the CLI
def test_oom_in_the_training_phase_retries_with_a_smaller_micro_batch(tmp_path, tiny_model_dir, monkeypatch,
                                                                       reference):
    """Live tensor bytes (CPU) of this run: micro-batch 4 peaks at 7.6 MiB in the training phase (TRL's
    fused LM head's tile of 4 x 14 positions x 32,768), 2 x 2 at 4.6 MiB; a 6 MiB card holds the
    second. The generation batch stays 4 (steps_per_generation 2): the same completions, so the
    same rewards step for step."""
    from lowvram.train.run import oom

    monkeypatch.setenv(oom.EMULATE_ENV, "6MiB")
    recipe = setup(tmp_path, tiny_model_dir, steps=4, save_steps=2)
    recipe.write_text(auto_micro(recipe.read_text()))
    result = cli("train", str(recipe))
    assert result.exit_code == 0, result.output
    assert "objective grpo: 4 completions per step (2 prompts x 2 generations); generation batch 4 (1 round " \
           "per step, engine generate)" in result.output
    assert re.search(r"OOM at step 1 \(measured [67]\.\d MiB\); retrying with micro-batch 2 x 2; starting over "
                     r"\(retry 1 of 3\)", result.output), result.output
    m = metrics(tmp_path / "out")
    assert m["final_plan"]["micro_batch_size"] == 2 and m["peak_memory_bytes"] <= 6 * 2**20
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert (plan["generation_batch_size"], plan["steps_per_generation"]) == (4, 2)
    assert m["reward_history"] == reference["reward_history"]


def oom_when(monkeypatch, step: int, micro_batch_size: int | None = None) -> None:
    """Every Trainer made from now on raises CUDA's OOM as ``step`` begins (while its micro-batch is
    ``micro_batch_size``, if given), as a longer batch would."""
    import torch
    from transformers import TrainerCallback

    from lowvram.train.run import signals

    class Oom(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step - 1 and micro_batch_size in (None, args.per_device_train_batch_size):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    make = signals.make_callbacks
    monkeypatch.setattr(signals, "make_callbacks", lambda stop: [*make(stop), Oom()])


@pytest.mark.slow
def test_oom_after_a_checkpoint_resumes_and_the_rewards_go_on(tmp_path, tiny_model_dir, monkeypatch, reference):
    """An OOM as step 3 begins: the retry (micro-batch 2 x 2) resumes from checkpoint-2; the
    Trainer restores the random state, so steps 3-4 sample the uninterrupted run's completions:
    the reward, each function's and the completion length histories are the reference's, and
    `show` / `runs` read the run as one."""
    oom_when(monkeypatch, 3, micro_batch_size=4)
    recipe = setup(tmp_path, tiny_model_dir, steps=4, save_steps=2)
    recipe.write_text(auto_micro(recipe.read_text()))
    result = cli("train", str(recipe))
    assert result.exit_code == 0, result.output
    assert re.search(r"OOM at step 3 \(measured [\d.]+ [MG]iB\); retrying with micro-batch 2 x 2; resuming from "
                     r"checkpoint-2 \(retry 1 of 3\)", result.output), result.output
    m = metrics(tmp_path / "out")
    assert m["resumed_from"].endswith("checkpoint-2") and m["steps"] == 4
    assert m["reward_history"] == reference["reward_history"]
    for name in ("short", "exact_match"):
        assert m["reward_functions"][name]["history"] == reference["reward_functions"][name]["history"]
    assert m["completion_length_history"] == reference["completion_length_history"]
    shown = cli("show", str(tmp_path / "out"))
    assert shown.exit_code == 0 and f"{m['reward']:+.3f}" in shown.output and "reward short (last)" in shown.output
    listed = cli("runs", str(tmp_path), env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and f"(reward {m['reward']:+.3f})" in listed.output


@pytest.mark.slow
def test_a_retry_skips_a_checkpoint_inside_a_generation_round(tmp_path, tiny_model_dir, monkeypatch):
    """num_iterations 2, a checkpoint every step: the OOM as step 4 begins finds checkpoint-3 inside
    a round; the retry removes it and resumes from checkpoint-2, which ends one."""
    oom_when(monkeypatch, 4, micro_batch_size=4)
    recipe = setup(tmp_path, tiny_model_dir, steps=4, save_steps=1, grpo=", num_iterations: 2")
    recipe.write_text(auto_micro(recipe.read_text()))
    result = cli("train", str(recipe), "--no-track-memory")
    assert result.exit_code == 0, result.output
    assert "OOM at step 4; retrying with micro-batch 2 x 2; resuming from checkpoint-2 (retry 1 of 3)" in result.output
    m = metrics(tmp_path / "out")
    assert m["resumed_from"].endswith("checkpoint-2") and m["steps"] == 4


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """Four layers of keys and values 256 wide: the cache of 32 rows x 56 tokens outgrows the
    training phase's fused-head tile (56 positions x 32,768 at micro-batch 1)."""
    from lowvram.testing import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("wide-llama"), hidden=256, layers=4, heads=4, kv_heads=4,
                           intermediate=256)


@pytest.mark.slow
def test_oom_in_the_generation_phase_retries_with_a_smaller_generation_batch(tmp_path, wide_model_dir, monkeypatch):
    """Batch 32 completions (8 prompts x 4), micro-batch 1: the first plan generates all 32 at once
    (planned 26.8 MB at generation_decode; training 21.0 MB). On a 24 MiB card (25.2 MB) generation
    runs out of memory (measured: at 25.2 MB); the re-plan halves the generation batch (two rounds
    of 16 per step, planned 18.3 MB; the run then peaks at 20.4 MB, in training) and changes nothing
    else: not the micro-batch, not num_generations."""
    from lowvram.train.run import oom

    monkeypatch.setenv(oom.EMULATE_ENV, "24MiB")
    recipe = setup(tmp_path, wide_model_dir, prompts=32, steps=1)
    recipe.write_text(recipe.read_text().replace("batch_size: 4, micro_batch_size: 2", "batch_size: 32, micro_batch_size: 1")
                      .replace("num_generations: 2, max_completion_length: 6", "num_generations: 4, max_completion_length: 48")
                      .replace("rewards: [rewards.py:short, exact_match]", "rewards: [rewards.py:short]"))
    result = cli("train", str(recipe))
    assert result.exit_code == 0, result.output
    assert "objective grpo: 32 completions per step (8 prompts x 4 generations); generation batch 32" in result.output
    assert re.search(r"OOM at step 1 \(measured 24\.\d MiB\); retrying with generation batch 16 \(2 rounds per "
                     r"step\); starting over \(retry 1 of 3\)", result.output), result.output
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert (plan["micro_batch_size"], plan["grad_accum"]) == (1, 32)
    assert (plan["generation_batch_size"], plan["steps_per_generation"]) == (16, 16)
    m = metrics(tmp_path / "out")
    assert m["peak_memory_bytes"] <= 24 * 2**20 and m["steps"] == 1
    assert [r["changed"] for r in m["oom_retries"]] == ["generation batch 16 (2 rounds per step)"]


# ---------------------------------------------------------------------------------- two processes


@pytest.mark.slow  # two processes launched through accelerate and torchrun: ~30 s of CPU
def test_two_processes_share_each_generation_batch(tmp_path, tiny_model_dir):
    """`lowvram train --gpus 2 --cpu`: DDP over gloo, micro-batch 2 per process, one generation
    batch of 4 completions per step split between the ranks (TRL's RepeatSampler gives both the
    same prompts, each rank generates its slice, the rewards are gathered for the groups)."""
    from tests.train.test_multi_gpu import lowvram

    recipe = setup(tmp_path, tiny_model_dir, steps=2)
    two = lowvram("train", str(recipe), "--gpus", "2", "--cpu", cwd=tmp_path)
    assert two.returncode == 0, two.stdout + two.stderr
    assert "error" not in two.stderr.lower() and "Traceback" not in two.stderr
    m = metrics(tmp_path / "out")
    assert m["processes"] == 2 and m["distributed_type"] == "MULTI_CPU" and len(m["peak_memory_bytes_per_rank"]) == 2
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert (plan["gpus"], plan["micro_batch_size"], plan["grad_accum"], plan["generation_batch_size"]) == (2, 2, 1, 4)
    # every step trained 4 completions of 8 + 6 tokens across the two ranks (TRL's gathered num_tokens)
    assert m["tokens_seen"] == 2 * 4 * (8 + 6)
    assert [s for s, _ in m["reward_history"]] == [1, 2] and set(m["reward_functions"]) == {"short", "exact_match"}
    assert "step 2/2" in two.stdout and "reward " in two.stdout


@pytest.mark.slow
def test_a_reward_that_raises_in_a_rank_ends_with_one_error_and_the_checkpoint_intact(tmp_path, tiny_model_dir):
    """Two processes, a reward that raises as step 3 scores (tests/train/test_grpo.py has the same in
    one process): one error naming the function and the step, no traceback, checkpoint-2 whole."""
    from lowvram.train.run.checkpoints import complete_checkpoints
    from tests.train.test_grpo import RAISES_AT_STEP_3
    from tests.train.test_multi_gpu import lowvram

    recipe = setup(tmp_path, tiny_model_dir, steps=4, save_steps=2, rewards="[rewards.py:short, rewards.py:fragile]")
    (tmp_path / "rewards.py").write_text(RAISES_AT_STEP_3)
    r = lowvram("train", str(recipe), "--gpus", "2", "--cpu", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.count("error: ") == 1, r.stderr
    assert "error: reward rewards.py:fragile raised ZeroDivisionError at step 3: no" in r.stderr
    assert "hint: " in r.stderr and "--resume" in r.stderr and "Traceback" not in r.stderr
    assert [c.name for c in complete_checkpoints(tmp_path / "out")] == ["checkpoint-2"]
