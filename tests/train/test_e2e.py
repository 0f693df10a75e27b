"""`lowvram train` end to end on a tiny Llama, through the real CLI: outputs, falling loss,
--resume, --overwrite, and user errors without tracebacks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lowvram.cli import app

RUN_FILES = ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "recipe.yaml", "plan.json", "metrics.json")


def write_alpaca(path: Path, n: int = 48, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"instruction": f"Add {a} and {b}.", "input": "", "output": f"The answer is {a + b}."}) + "\n")
    return path


def write_recipe(tmp: Path, model_dir: Path | str, *, steps: int = 8, save_steps: int = 100, extra: str = "",
                 techniques: str = "lora: on", data: str = "data.jsonl", validation: str = "null") -> Path:
    if not (tmp / "data.jsonl").exists():
        write_alpaca(tmp / "data.jsonl")
    recipe = tmp / "recipe.yaml"
    recipe.write_text(f"""\
model: {{name_or_path: {model_dir}}}
data:
  datasets: [{{path: {data}, format: alpaca}}]
  validation: {validation}
training:
  max_steps: {steps}
  learning_rate: 3.0e-3
  lr_scheduler: constant
  warmup_ratio: 0.0
  batch_size: 4
  seq_len: 64
  logging_steps: 1
  save_steps: {save_steps}
  output_dir: out
lora: {{r: 8, alpha: 16, dropout: 0.0}}
techniques: {{{techniques}}}
{extra}""")
    return recipe


def train(*args: str):
    result = CliRunner().invoke(app, ["train", *args])
    assert "Traceback" not in (result.output or ""), result.output
    return result


def metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def test_train_cli_writes_run_and_loss_falls(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=8, validation="0.1")
    result = train(str(recipe))
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    for name in RUN_FILES:
        assert (out / name).is_file(), name
    m = metrics(out)
    assert m["steps"] == 8
    assert m["train_loss"] < m["first_loss"] - 0.3, m["loss_history"]
    assert m["eval_loss"] is not None and m["eval_rows"] > 0
    assert m["train_rows"] == 43 and m["truncated"] == 0 and m["skipped_bad_rows"] == 0
    assert m["peak_memory_bytes"] > 0 and m["peak_memory_kind"]
    assert m["tokens_per_s"] > 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["lora"] is True and plan["device"] == "cpu"
    assert "max_steps: 8" in (out / "recipe.yaml").read_text()
    assert "Run summary" in result.output and "loss" in result.output
    assert not list(out.glob(".*")), "temp files left behind"


def test_overwrite_protection(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=1)
    assert train(str(recipe)).exit_code == 0
    again = train(str(recipe))
    assert again.exit_code == 1
    assert "already holds a finished run" in again.output and "--overwrite" in again.output
    replaced = train(str(recipe), "--overwrite", "--set", "training.max_steps=2")
    assert replaced.exit_code == 0, replaced.output
    assert metrics(tmp_path / "out")["steps"] == 2


def test_foreign_output_dir_is_never_deleted(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    result = train(str(recipe), "--overwrite")
    assert result.exit_code == 1 and "holds no lowvram run" in result.output
    assert (tmp_path / "out" / "precious.txt").read_text() == "keep me"


def _interrupt_after(step: int):
    """A TrainerCallback that simulates Ctrl-C right after `step`."""
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                raise KeyboardInterrupt

    return Interrupt()


def test_resume_continues_from_last_checkpoint(tmp_path, tiny_model_dir):
    from lowvram.planning.fixed import resolve_fixed
    from lowvram.recipe import load_recipe
    from lowvram.train.run.run import run_training

    # The uninterrupted reference run.
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref = write_recipe(ref_dir, tiny_model_dir, steps=4, save_steps=2)
    assert train(str(ref)).exit_code == 0
    reference = metrics(ref_dir / "out")["loss_history"]

    recipe_path = write_recipe(tmp_path, tiny_model_dir, steps=4, save_steps=2)
    recipe = load_recipe(recipe_path)
    with pytest.raises(KeyboardInterrupt):
        run_training(recipe, resolve_fixed(recipe), callbacks=[_interrupt_after(3)])
    out = tmp_path / "out"
    assert not (out / "metrics.json").exists()
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists()

    fresh = train(str(recipe_path))
    assert fresh.exit_code == 1 and "unfinished run" in fresh.output and "--resume" in fresh.output

    resumed = train(str(recipe_path), "--resume")
    assert resumed.exit_code == 0, resumed.output
    m = metrics(out)
    assert m["steps"] == 4 and m["resumed_from"].endswith("checkpoint-2")
    # Same data order, optimizer state and RNG: the steps after the checkpoint match the reference.
    assert [s for s, _ in m["loss_history"]] == [s for s, _ in reference]
    assert [x for _, x in m["loss_history"][-2:]] == pytest.approx([x for _, x in reference[-2:]], abs=1e-4)
    assert m["first_loss"] == pytest.approx(reference[0][1], abs=1e-6)  # history restored too


def test_resume_without_checkpoint(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2)
    result = train(str(recipe), "--resume")
    assert result.exit_code == 1
    assert "no checkpoint to resume from" in result.output and "hint:" in result.output


def test_unknown_model_path(tmp_path):
    recipe = write_recipe(tmp_path, "./no/such/model")
    result = train(str(recipe))
    assert result.exit_code == 1
    assert "error: model not found: ./no/such/model" in result.output
    assert "hint:" in result.output


def test_missing_dataset_file(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, data="missing.jsonl")
    result = train(str(recipe))
    assert result.exit_code == 1, result.output
    assert "error:" in result.output and "missing.jsonl" in result.output
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_missing_gguf_file(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir)
    text = recipe.read_text().replace(f"name_or_path: {tiny_model_dir}}}",
                                      f"name_or_path: {tiny_model_dir}, gguf_file: nope.gguf}}")
    recipe.write_text(text)
    result = train(str(recipe))
    assert result.exit_code == 1, result.output
    assert "error: GGUF file not found" in result.output and "nope.gguf" in result.output


def test_unknown_hub_id_offline(tmp_path):
    recipe = write_recipe(tmp_path, "nobody-here/no-such-model-xyz")
    result = train(str(recipe))
    assert result.exit_code == 1
    # said before planning and loading (hub.download_problem), not after huggingface_hub's retries
    assert ("error: model nobody-here/no-such-model-xyz is not in the hub cache and HF_HUB_OFFLINE is set"
            in result.output)
    assert "hint: download the model where there is network" in result.output


def _fake_state(step: int, max_steps: int = 10, tokens: int = 0):
    from types import SimpleNamespace

    return SimpleNamespace(global_step=step, max_steps=max_steps, num_input_tokens_seen=tokens)


def test_progress_plain_lines_and_history():
    import io

    from lowvram.train.run.progress import ProgressCallback

    stream = io.StringIO()
    cb = ProgressCallback(tty=False, stream=stream)
    cb.on_train_begin(None, _fake_state(0), None)
    for step in (1, 2):
        cb.on_step_end(None, _fake_state(step, tokens=100 * step), None)
        cb.on_log(None, _fake_state(step, tokens=100 * step), None, logs={"loss": 3.0 - step, "learning_rate": 1e-3})
    cb.on_log(None, _fake_state(2), None, logs={"eval_loss": 1.5})
    cb.on_train_end(None, _fake_state(2, tokens=200), None)
    text = stream.getvalue()
    assert "training: 10 steps" in text and "step 2/10  loss 1.0000" in text and "eval loss 1.5000" in text
    assert cb.losses == [(1, 2.0), (2, 1.0)] and cb.eval_losses == [(2, 1.5)]
    assert cb.session_tokens() == 200


def test_progress_bar_on_a_terminal():
    from lowvram.train.run.progress import ProgressCallback

    cb = ProgressCallback(tty=True)
    cb.on_train_begin(None, _fake_state(3), None)  # resumed at step 3
    assert cb._progress is not None
    cb.on_log(None, _fake_state(4), None, logs={"loss": 2.0})
    cb.on_step_end(None, _fake_state(4, tokens=50), None)
    cb.on_train_end(None, _fake_state(10, tokens=80), None)
    assert cb._progress is None and cb.losses == [(4, 2.0)]
