"""After training, on a tiny Llama through the real CLI: merge (same logits as base + adapter),
generate (streams tokens), runs/show (finished, interrupted, failed), loss.png, TensorBoard
logs, and the user errors (not a run, base model missing, merge that does not fit in RAM)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.errors import LowvramError
from tests.train.test_e2e import write_recipe


def cli(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert "Traceback" not in (result.output or ""), result.output
    return result


def assert_user_error(result, *needles: str) -> None:
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert sum(x.startswith("error: ") for x in lines) == 1, result.output
    assert sum(x.startswith("hint: ") for x in lines) == 1, result.output
    for n in needles:
        assert n in result.output, result.output


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A finished 4-step LoRA run with a validation split and a checkpoint at step 2."""
    tmp = tmp_path_factory.mktemp("after")
    recipe = write_recipe(tmp, tiny_model_dir, steps=4, save_steps=2, validation="0.1")
    result = cli("train", str(recipe))
    assert result.exit_code == 0, result.output
    return tmp / "out"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# --------------------------------------------------------------------------------------------
# What a run writes


def test_run_writes_plot_tensorboard_and_sparkline(run_dir):
    m = json.loads((run_dir / "metrics.json").read_text())
    # Runs record memory per logging step, so the plot has the loss panel and the memory panel.
    assert m["memory_history"] and all(b > 0 for _, b in m["memory_history"])
    assert png_size(run_dir / "loss.png") == (800, 700)
    assert list((run_dir / "runs").rglob("events.out.tfevents.*")), "no TensorBoard log"
    assert [s for s, _ in m["eval_history"]] == [4]
    assert (run_dir / "recipe.yaml").read_text().startswith("# recipe: ")


def test_plot_with_memory_panel(tmp_path):
    from lowvram.train.run.plots import save_loss_plot

    metrics = {"loss_history": [[1, 3.0], [2, 2.0], [3, 1.5]], "eval_history": [[3, 1.8]],
               "memory_history": [[1, 2**30], [2, 2**31], [3, 2**31]], "predicted_peak_bytes": 3 * 2**30}
    assert png_size(save_loss_plot(metrics, tmp_path)) == (800, 700)
    assert save_loss_plot({}, tmp_path / "none") is None


# --------------------------------------------------------------------------------------------
# merge


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merge_gives_same_logits_as_base_plus_adapter(run_dir, tiny_model_dir, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    result = cli("merge", str(run_dir), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "needs" in result.output and "merged" in result.output
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert json.loads((out / "lowvram_merge.json").read_text())["prompt_format"] == "alpaca"

    ids = torch.tensor([[5, 17, 42, 99, 7, 300, 12, 64]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    plain = _logits(base, ids)
    adapted = _logits(PeftModel.from_pretrained(base, str(run_dir)).eval(), ids)
    merged = _logits(AutoModelForCausalLM.from_pretrained(out).eval(), ids)
    assert (adapted - plain).abs().max() > 1e-3, "the adapter did not change the model"
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)

    again = cli("merge", str(run_dir), "--out", str(out))
    assert_user_error(again, "is not empty")


def test_merge_refuses_when_host_ram_is_too_small(run_dir, tmp_path, monkeypatch):
    import lowvram.hardware

    monkeypatch.setattr(lowvram.hardware, "host_memory", lambda: (2**30, 100 * 2**10))  # 100 KiB free
    result = cli("merge", str(run_dir), "--out", str(tmp_path / "m"))
    assert_user_error(result, "merge needs", "host RAM", "0.1 MiB available", "--dtype bfloat16")
    assert not (tmp_path / "m").exists()


def test_merge_disk_too_small_refused_before_loading(run_dir, small_disk):
    """A real 64 KiB tmpfs: the merged folder (the model in float32 + the tokenizer) cannot fit."""
    result = cli("merge", str(run_dir), "--out", str(small_disk / "m"))
    assert_user_error(result, "merge needs", "of disk in", str(small_disk), "free", "--out")
    assert list(small_disk.iterdir()) == []


def _card(monkeypatch, free_bytes: int, host_bytes: int):
    """The hardware merge reads, as a CUDA machine with one card of ``free_bytes`` free and
    ``host_bytes`` of host RAM available (the planning is what is tested, not the card)."""
    import lowvram.hardware as hardware

    card = hardware.Device(0, "emulated card", 8 * 2**30, free_bytes)
    monkeypatch.setattr(hardware, "detect_hardware",
                        lambda *a, **k: hardware.Hardware("cuda", (card,), 2 * host_bytes, host_bytes))


def test_merge_picks_the_device_by_what_fits(run_dir, tmp_path, monkeypatch):
    from lowvram.plan.setup import cuda_overheads
    from lowvram.train.after.merge import plan_merge

    context = cuda_overheads().context_bytes
    _card(monkeypatch, 4 * 2**30, 4 * 2**30)
    mp = plan_merge(run_dir, tmp_path / "m")
    model = 4 * mp.parameters
    assert mp.device == "cuda" and mp.needed_bytes == model + mp.adapter_bytes + 128 * 64 * 8 + context
    assert mp.ram_bytes == model  # safetensors copies a GPU model to host memory to save it

    _card(monkeypatch, context, 4 * 2**30)  # the card cannot hold the model: the CPU
    mp = plan_merge(run_dir, tmp_path / "m")
    assert mp.device == "cpu" and mp.ram_bytes == model + mp.adapter_bytes + 128 * 64 * 8
    assert any("on the CPU (slower)" in n for n in mp.notes)

    _card(monkeypatch, 4 * 2**30, 100 * 2**10)  # neither: refused with both figures
    with pytest.raises(LowvramError, match=r"merge needs .* of host RAM .* 0\.1 MiB available; on the GPU it needs"):
        plan_merge(run_dir, tmp_path / "m")


def test_merge_json_and_plan_numbers(run_dir, tmp_path):
    from lowvram.plan.model.catalog import resolve_model
    from lowvram.plan.model.models import count_parameters
    from lowvram.train.after.merge import plan_merge

    mp = plan_merge(run_dir, tmp_path / "m")
    n = count_parameters(resolve_model(mp.base.source))
    adapter = (run_dir / "adapter_model.safetensors").stat().st_size
    assert (mp.parameters, mp.dtype, mp.device) == (n, "float32", "cpu")
    # the model, the adapter, and one layer's LoRA delta (float32 + its cast): the tiny Llama's
    # largest adapted matrix is its 128 x 64 MLP
    assert mp.needed_bytes == mp.ram_bytes == 4 * n + adapter + 128 * 64 * (4 + 4)
    tokenizer = sum(f.stat().st_size for f in run_dir.glob("*token*") if f.is_file())
    assert mp.disk_bytes == 4 * n + tokenizer + 64 * 1024
    assert mp.base.found_via == "adapter_config.json"


# --------------------------------------------------------------------------------------------
# generate


def test_generate_streams_tokens(run_dir, tmp_path):
    result = cli("generate", str(run_dir), "--prompt", "Add 2 and 3.", "--greedy", "--max-new-tokens", "8")
    assert result.exit_code == 0, result.output
    assert "prompt format: alpaca" in result.output
    text = result.stdout.strip()
    assert text, result.output

    # The same tokens as transformers' greedy generate on base + adapter with the Alpaca prompt.
    import torch

    from lowvram.train.after.generate import load_generator
    from lowvram.train.data.format import ALPACA_PROMPT_NO_INPUT

    gen = load_generator(run_dir)
    inputs = gen.tokenizer(ALPACA_PROMPT_NO_INPUT.format(instruction="Add 2 and 3."), return_tensors="pt")
    with torch.no_grad():
        ids = gen.model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=gen.tokenizer.pad_token_id)
    expected = gen.tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text == expected.split("\n### ")[0].strip()


def test_generate_interactive_and_chat_template(run_dir):
    result = CliRunner().invoke(app, ["generate", str(run_dir), "--interactive", "--format", "chat",
                                      "--max-new-tokens", "4", "--temperature", "0.9"],
                                input="hello\n/reset\nsummarize this\n/exit\n")
    assert result.exit_code == 0, result.output
    assert "prompt format: chat" in result.output
    assert result.stdout.count("model> ") == 2


def test_generate_needs_prompt_or_interactive(run_dir):
    result = cli("generate", str(run_dir))
    assert result.exit_code == 2 and "error: pass --prompt TEXT or --interactive" in result.output


# --------------------------------------------------------------------------------------------
# runs / show


@pytest.fixture()
def runs_root(run_dir, tmp_path) -> Path:
    root = tmp_path / "runs"
    shutil.copytree(run_dir, root / "done")
    shutil.copytree(run_dir, root / "stopped")
    for name in ("metrics.json", "adapter_model.safetensors", "adapter_config.json", "loss.png"):
        (root / "stopped" / name).unlink()
    (root / "crashed").mkdir()
    for name in ("recipe.yaml", "plan.json"):
        shutil.copy(run_dir / name, root / "crashed" / name)
    (root / "not-a-run").mkdir()
    return root


def test_runs_lists_finished_interrupted_failed(runs_root):
    result = cli("runs", str(runs_root), "--json")
    assert result.exit_code == 0, result.output
    rows = {Path(r["path"]).name: r for r in json.loads(result.stdout)}
    assert set(rows) == {"done", "stopped", "crashed"}
    assert {k: r["status"] for k, r in rows.items()} == {"done": "finished", "stopped": "interrupted", "crashed": "failed"}
    done = rows["done"]
    assert done["recipe_name"] == "recipe" and done["steps"] == 4 and done["final_loss"] > 0
    assert done["techniques"]["lora"] is True and done["measured_peak_bytes"] > 0
    assert rows["stopped"]["checkpoints"] == ["checkpoint-2", "checkpoint-4"]

    table = cli("runs", str(runs_root))
    assert table.exit_code == 0, table.output
    for word in ("finished", "interrupted", "failed", "LoRA"):
        assert word in table.output


def test_show_one_run(run_dir):
    result = cli("show", str(run_dir))
    assert result.exit_code == 0, result.output
    for word in ("finished", "Plan", "Metrics", "checkpoint-2", "eval loss", "loss.png"):
        assert word in result.output, word
    assert any(ch in result.output for ch in "▁▂▃▄▅▆▇█")
    data = json.loads(cli("show", str(run_dir), "--json").stdout)
    assert data["status"] == "finished" and len(data["loss_history"]) == 4


def test_merge_an_interrupted_run_points_to_checkpoints(runs_root):
    result = cli("merge", str(runs_root / "stopped"), "--out", str(runs_root / "m"))
    assert_user_error(result, "no adapter_config.json", "interrupted", "checkpoint-4")


# --------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("command", [["merge", "--out", "x"], ["generate", "--prompt", "hi"], ["show"], ["runs"]])
def test_not_a_run(command, tmp_path):
    folder = tmp_path / "random"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    args = [command[0], str(folder), *command[1:]]
    result = cli(*args)
    if command[0] == "runs":  # a folder without runs is not an error
        assert result.exit_code == 0 and "no runs in" in result.output
        return
    assert_user_error(result, "is not a lowvram run", "notes.txt")


def test_missing_run_folder(tmp_path):
    assert_user_error(cli("show", str(tmp_path / "nope")), "run folder not found")
    assert_user_error(cli("runs", str(tmp_path / "nope")), "folder not found")


def test_base_model_not_found(run_dir, tmp_path):
    moved = tmp_path / "orphan"
    shutil.copytree(run_dir, moved, ignore=shutil.ignore_patterns("checkpoint-*", "runs"))
    cfg = json.loads((moved / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(cfg))
    recipe = (moved / "recipe.yaml").read_text()
    old = next(line for line in recipe.splitlines() if line.strip().startswith("name_or_path:"))
    (moved / "recipe.yaml").write_text(recipe.replace(old, "  name_or_path: ./gone-too"))
    for command in (["merge", str(moved), "--out", str(tmp_path / "m")], ["generate", str(moved), "--prompt", "hi"]):
        assert_user_error(cli(*command), "base model of", "not found", "gone-too")


def test_merge_qlora_run_loads_the_base_dequantized(tmp_path, tiny_model_dir):
    """An NF4 (QLoRA) run merges into the full-precision base: no quantization_config, and the
    same logits as that base + the adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2, techniques="lora: on, quantization: nf4")
    assert cli("train", str(recipe)).exit_code == 0
    run = tmp_path / "out"
    assert json.loads((run / "plan.json").read_text())["quantization"] == "nf4"
    result = cli("merge", str(run), "--out", str(tmp_path / "merged"))
    assert result.exit_code == 0, result.output
    assert "loaded dequantized in float32" in result.output
    # the peak counted is the dequantized base (4 bytes per parameter here; 2 in bfloat16), never the 4-bit one
    from lowvram.train.after.merge import plan_merge

    fp32, bf16 = plan_merge(run, tmp_path / "m32"), plan_merge(run, tmp_path / "m16", dtype="bfloat16")
    adapter = (run / "adapter_model.safetensors").stat().st_size
    assert fp32.ram_bytes == 4 * fp32.parameters + adapter + 128 * 64 * 8
    assert bf16.ram_bytes == 2 * fp32.parameters + adapter + 128 * 64 * 6
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())

    ids = torch.tensor([[5, 17, 42, 99, 7, 300]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapted = _logits(PeftModel.from_pretrained(base, str(run)).eval(), ids)
    merged = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval(), ids)
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------
# The README's "Using the result" commands, run as written on a tiny run copied to runs/quickstart


def readme_after_training_commands() -> list[str]:
    from tests.conftest import REPO

    section = (REPO / "README.md").read_text().split("## Using the result", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:sh|text)\n(.*?)```", section, re.S)
    return [line.split("  #", 1)[0].strip() for b in blocks for line in b.splitlines() if line.startswith("lowvram ")]


def test_readme_using_the_result(run_dir, tmp_path, monkeypatch):
    cmds = readme_after_training_commands()
    assert {c.split()[1] for c in cmds} == {"runs", "show", "generate", "merge", "export", "eval"}
    shutil.copytree(run_dir, tmp_path / "runs" / "quickstart")
    monkeypatch.chdir(tmp_path)
    for cmd in cmds:
        result = CliRunner().invoke(app, shlex.split(cmd)[1:], input="hello\n/exit\n")
        assert result.exit_code == 0, (cmd, result.output)
    assert (tmp_path / "runs" / "quickstart-merged" / "model.safetensors").is_file()
