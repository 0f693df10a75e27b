"""A diverged run never passes for a converged one (issue 42 item 1), through the real CLI on the
tiny Llama: a NaN step stops the run with error/hint, keeps the last finite checkpoint whatever
save_total_limit says and writes no final model; training.on_nonfinite skip skips it and shows no
non-finite step as a number; data whose every label is masked is refused before training.

The NaN is real: the tiny model's embedding row of one token ("Q", in one data row only) is
infinite, so the batch holding that row overflows in the forward as an fp16 run does."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.train.run.checkpoints import complete_checkpoints
from lowvram.train.run.guard import NonFiniteGuard, StepRecord, record_steps, rows_text
from tests.train.test_e2e import metrics, train, write_recipe

POISONED_ROW = 15  # the data row that says "Q"; with seed 42 its batch is step 4 of 5


@pytest.fixture(scope="module")
def poisoned_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with the embedding row of the token "Q" set to +inf (a real weight)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("poisoned") / "model"
    shutil.copytree(tiny_model_dir, out)
    (q,) = AutoTokenizer.from_pretrained(out)("Q", add_special_tokens=False)["input_ids"]
    f = next(out.glob("*.safetensors"))
    weights = load_file(str(f))
    weights["model.embed_tokens.weight"][q] = math.inf
    save_file(weights, str(f), metadata={"format": "pt"})
    return out


def _poisoned_data(path: Path) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(48):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            out = "Q" if i == POISONED_ROW else f"The answer is {a + b}."
            f.write(json.dumps({"instruction": f"Add {a} and {b}.", "input": "", "output": out}) + "\n")


def _recipe(tmp_path: Path, model: Path, extra: str = "") -> Path:
    _poisoned_data(tmp_path / "data.jsonl")
    return write_recipe(tmp_path, model, steps=5, save_steps=1,
                        extra=extra + "\n" if extra else "")


def _finite_adapter(folder: Path) -> bool:
    from safetensors.torch import load_file

    return all(bool(t.isfinite().all()) for t in load_file(str(folder / "adapter_model.safetensors")).values())


def test_a_nan_step_stops_keeps_the_last_finite_checkpoint_and_writes_no_model(tmp_path, poisoned_model):
    recipe = _recipe(tmp_path, poisoned_model)
    text = recipe.read_text().replace("output_dir: out", "output_dir: out\n  save_total_limit: 1")
    recipe.write_text(text)
    result = train(str(recipe))
    assert result.exit_code == 1, result.output
    assert "error: the loss is nan at step 4; the last finite loss was " in result.output
    assert "at step 3; stopped, no final model written" in result.output
    assert f"the batch held training rows 8, {POISONED_ROW}, 17, 37" in result.output  # the data order of seed 42
    assert "hint: usually the learning rate is too high (training.learning_rate 0.003" in result.output
    assert "fp16 runs a model trained in bf16" in result.output
    assert "loss nan" not in result.output and "loss 0.0000" not in result.output
    out = tmp_path / "out"
    # save_total_limit 1: checkpoint-3 is not confirmed (step 4 was not finite), so checkpoint-2,
    # the last one a finite step followed, is kept beside it; both hold finite weights.
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]
    assert all(_finite_adapter(p) for p in complete_checkpoints(out))
    assert not (out / "adapter_model.safetensors").exists() and not (out / "metrics.json").exists()
    # show and runs say it diverged (not "interrupted", with no resume offered that would diverge again)
    shown = CliRunner().invoke(app, ["show", str(out)])
    assert shown.exit_code == 0 and ": diverged" in shown.output, shown.output
    assert "stopped by lowvram at step 4: the loss is nan at step 4" in shown.output
    assert "hint: usually the learning rate is too high" in shown.output and "resume with" not in shown.output
    listed = CliRunner().invoke(app, ["runs", str(out)], env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and "diverged" in listed.output and "interrupted" not in listed.output


def test_on_nonfinite_skip_skips_the_step_and_shows_no_nonfinite_loss(tmp_path, poisoned_model):
    recipe = _recipe(tmp_path, poisoned_model, extra="")
    text = recipe.read_text().replace("output_dir: out", "output_dir: out\n  on_nonfinite: skip\n  save_total_limit: 1")
    recipe.write_text(text)
    result = train(str(recipe))
    assert result.exit_code == 0, result.output
    assert "warning: the loss is nan at step 4; its update skipped (1 of 3 allowed" in result.output
    m = metrics(tmp_path / "out")
    assert m["nonfinite_steps"] == [4] and m["steps"] == 5
    # the skipped step has no loss (never a 0.0 or a NaN); every other step its own
    assert [s for s, _ in m["loss_history"]] == [1, 2, 3, 5]
    assert all(math.isfinite(v) and v > 1.0 for _, v in m["loss_history"]), m["loss_history"]
    assert "loss nan" not in result.output and "loss 0.0000" not in result.output
    assert "non-finite steps skipped" in result.output
    shown = CliRunner().invoke(app, ["show", str(tmp_path / "out")])
    assert shown.exit_code == 0 and "non-finite steps skipped" in shown.output and "4" in shown.output
    assert _finite_adapter(tmp_path / "out")  # the skipped step's NaN never reached the weights
    assert [p.name for p in complete_checkpoints(tmp_path / "out")] == ["checkpoint-5"]


def test_data_whose_every_label_is_masked_is_refused_before_training(tmp_path, tiny_model_dir):
    """seq_len 1 on text rows: each row's one label is its first token, which nothing predicts;
    the run trained with loss 0.0 and gradient norm 0.0 at every step, silently."""
    (tmp_path / "text.jsonl").write_text((json.dumps({"text": "The quick brown fox jumps over the lazy dog."}) + "\n") * 16)
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=3, data="text.jsonl")
    recipe.write_text(recipe.read_text().replace("format: alpaca", "format: text").replace("seq_len: 64", "seq_len: 1"))
    result = train(str(recipe))
    assert result.exit_code == 1, result.output
    assert "error: no token of the 16 training rows is trained: every label is masked" in result.output
    assert "hint: raise training.seq_len" in result.output
    assert "step 1/" not in result.output and not (tmp_path / "out" / "metrics.json").exists()


def test_a_finite_but_climbing_loss_is_a_warning_in_progress_summary_and_show(tmp_path, tiny_model_dir):
    """All weights at learning_rate 0.9: the loss goes 6.3 -> 15 -> 81 -> 32 -> 23, finite; it
    passed in silence with exit 0."""
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=5, techniques="lora: off, mixed_precision: fp32")
    recipe.write_text(recipe.read_text().replace("learning_rate: 3.0e-3", "learning_rate: 0.9\n  max_grad_norm: 0"))
    result = train(str(recipe))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    step5 = next(line for line in lines if line.startswith("step 5/5"))
    assert "warning: diverging, loss" in step5 and "x its first" in step5
    assert sum("warning: the loss climbed from 6.265 to" in line for line in lines) == 2  # progress, summary
    assert "the run is diverging; lower training.learning_rate" in result.output
    shown = CliRunner().invoke(app, ["show", str(tmp_path / "out")])
    assert shown.exit_code == 0 and "warning: the loss climbed from 6.265 to" in shown.output


def test_loss_climb_and_sparkline_of_nonfinite_values():
    from lowvram.metrics import loss_climb
    from lowvram.units import sparkline

    assert loss_climb([[1, 2.0], [2, 1.5], [3, 1.0], [4, 0.9]]) is None
    assert loss_climb([[1, 2.0], [2, 7.0], [3, 6.0], [4, 8.0]]) == 4.0
    assert loss_climb([[1, 2.0], [2, 7.0], [3, 5.0], [4, 8.0]]) is None  # 5.0 < 3 x 2.0: not each of the window
    assert loss_climb([[1, 2.0], [2, 8.0], [3, 8.0]]) is None  # too few values for a window after the first
    assert sparkline([3.0, math.nan, 1.0]) == "█×▁"


# --------------------------------------------------------------------------------------------
# The pieces, on a real Trainer


def test_record_steps_reads_the_trainers_own_grad_norm_and_takes_the_rows_out(tiny_model_dir, tmp_path):
    """transformers' Trainer still has the _get_grad_norm that record_steps wraps, and the row
    index never reaches the model (a forward with it would fail on an unexpected keyword)."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    trainer = Trainer(model=model, args=args)
    assert hasattr(trainer, "_get_grad_norm")
    record = record_steps(trainer)
    trainer.current_gradient_accumulation_steps = 1  # set by the Trainer's loop before each step
    ids = torch.tensor([[5, 6, 7, 8]])
    loss = trainer.training_step(model, {"input_ids": ids, "labels": ids, "lowvram_row": torch.tensor([3])})
    assert record.rows == [3] and float(record.losses[0]) == pytest.approx(float(loss))
    assert record.loss() == pytest.approx(float(loss))
    assert trainer._get_grad_norm(model) > 0 and record.grad_norm == pytest.approx(float(trainer._get_grad_norm(model)))


def test_rotation_counts_a_checkpoint_only_once_the_step_after_it_is_finite(tmp_path):
    from transformers import TrainingArguments

    from lowvram.train.run.checkpoints import mark_complete

    for step in (2, 4, 6):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        (d / "adapter_model.safetensors").write_bytes(b"w" * 10)
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        mark_complete(d)
    guard = NonFiniteGuard(save_limit=1)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    guard.finite_through = 6  # step 6 was finite, step 7 not yet known: checkpoint-6 is not confirmed
    guard._rotate(args, None)
    assert sorted(p.name for p in complete_checkpoints(tmp_path)) == ["checkpoint-4", "checkpoint-6"]
    guard.finite_through = 7
    guard._rotate(args, None)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-6"]


def test_rows_text_and_step_record():
    assert rows_text([]) == ""
    assert rows_text([7]) == "training row 7"
    assert rows_text(list(range(12, 0, -1))) == "training rows 1, 2, 3, 4, 5, 6, 7, 8 and 4 more"
    assert StepRecord().loss() is None


def test_a_run_of_skipped_loss_scaler_steps_stops_the_run(tiny_model_dir, tmp_path):
    """fp16 with a loss scaler (a GPU's): torch's own GradScaler, on the CPU, in the Trainer's own
    loop through accelerate (set where accelerate sets it on a GPU, before the loop prepares the
    optimizer). At a scale of 1e38 that hardly backs off every scaled loss overflows (as fp16
    gradients that overflow at any scale do), the scaler skips every step; an overflowing
    gradient is the scaler's to skip (no stop at the first), ten skipped steps in a row stop it."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from lowvram.train.run.guard import SCALER_SKIPS, TrainingDiverged

    ids = [[5, 6, 7, 8, 9, 10]] * 64
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=20,
                             per_device_train_batch_size=2, optim="adamw_torch", logging_steps=1,
                             logging_nan_inf_filter=False, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), args=args, train_dataset=data)
    guard = NonFiniteGuard()
    trainer.add_callback(guard)
    guard.attach(trainer)
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1e38, backoff_factor=0.999)
    with pytest.raises(TrainingDiverged, match=f"the fp16 loss scaler skipped {SCALER_SKIPS} steps in a row"):
        trainer.train()
    assert trainer.state.global_step == SCALER_SKIPS - 1  # the tenth skipped step stops before it counts
