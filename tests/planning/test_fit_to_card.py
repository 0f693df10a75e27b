"""Issue 4, "Fit the run to the card": `lowvram train` measures its peak and it agrees with the
plan; bad budgets and cards get an error and a hint; the --dry-run plan is stable."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.hardware import Device, Hardware
from lowvram.units import parse_size

RTX_4070 = Hardware("cuda", (Device(0, "NVIDIA GeForce RTX 4070", 12 * 10**9, 12 * 10**9, (8, 9), True),),
                    64 * 10**9, 60 * 10**9)
T4 = Hardware("cuda", (Device(0, "Tesla T4", 16 * 10**9, 15 * 10**9, (7, 5), False),), 32 * 10**9, 30 * 10**9)
MPS = Hardware("mps", (Device(0, "Apple MPS", 16 * 10**9, 16 * 10**9, None, True),), 32 * 10**9, 30 * 10**9)


def fake_card(monkeypatch, hw: Hardware) -> None:
    """detect_hardware() answers with a fake Hardware (no CUDA involved)."""
    import lowvram.hardware

    monkeypatch.setattr(lowvram.hardware, "detect_hardware", lambda vram=None, gpus=None: dataclasses.replace(
        hw, vram_override_bytes=parse_size(vram) if vram else None))


def invoke(*args: str):
    result = CliRunner().invoke(app, list(args), terminal_width=100)
    assert "Traceback" not in (result.output or ""), result.output
    return result


def write_long_rows(path: Path, n: int = 24) -> None:
    """Every row is longer than seq_len 64: each batch is exactly micro_batch x seq_len tokens,
    the shape the plan predicts for (variable lengths would peak lower than the plan)."""
    with path.open("w") as f:
        for i in range(n):
            out = " ".join(str(i + j) for j in range(60))
            f.write(json.dumps({"instruction": f"Count from {i}.", "input": "", "output": out}) + "\n")


def write_recipe(tmp: Path, model_dir, techniques: str, steps: int = 3) -> Path:
    write_long_rows(tmp / "data.jsonl")
    path = tmp / "recipe.yaml"
    path.write_text(f"""\
model: {{name_or_path: {model_dir}}}
data:
  datasets: [{{path: data.jsonl, format: alpaca}}]
training: {{max_steps: {steps}, learning_rate: 1.0e-3, batch_size: 4, micro_batch_size: 4, seq_len: 64,
           logging_steps: 1, save_steps: 100, output_dir: out}}
lora: {{r: 8, alpha: 16, dropout: 0.0}}
techniques: {{{techniques}, gradient_accumulation: 1}}
""")
    return path


COMBOS = {
    "full fp32": "lora: off, mixed_precision: fp32",
    "lora": "lora: on, mixed_precision: fp32",
    "qlora nf4-dq": "lora: on, quantization: nf4-dq, mixed_precision: bf16",
    "adamw_8bit": "lora: off, optimizer: adamw_8bit, mixed_precision: fp32",
    "gradient checkpointing": "lora: off, gradient_checkpointing: on, mixed_precision: fp32",
    "chunked loss": "lora: off, loss: chunked, mixed_precision: fp32",
}


@pytest.mark.parametrize("name", list(COMBOS))
def test_measured_peak_matches_plan(name, tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, COMBOS[name])
    result = invoke("train", str(recipe))
    assert result.exit_code == 0, result.output
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    measured, predicted = m["peak_memory_bytes"], m["predicted_peak_bytes"]
    assert m["peak_memory_kind"].startswith("live tensor bytes") and m["predicted_device"] == "cpu"
    assert abs(measured - predicted) <= 0.03 * measured, f"{name}: measured {measured:,} predicted {predicted:,}"
    assert [s for s, _ in m["memory_history"]] == [1, 2, 3]
    assert max(b for _, b in m["memory_history"]) == measured
    assert "peak memory (predicted)" in result.output and "warning" not in result.output


def test_short_data_is_compared_with_the_prediction_at_its_longest_row(tmp_path, tiny_model_dir):
    # seq_len 256 but every row is shorter: batches are padded to their longest row, so the run
    # peaks well below the seq_len plan; the plan at the data's longest row must match instead.
    recipe = write_recipe(tmp_path, tiny_model_dir, "lora: on, mixed_precision: fp32", steps=6)
    recipe.write_text(recipe.read_text().replace("seq_len: 64", "seq_len: 256"))
    result = invoke("train", str(recipe))
    assert result.exit_code == 0, result.output
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert 64 < m["data_longest_tokens"] < 256
    measured, at_data = m["peak_memory_bytes"], m["predicted_peak_bytes_at_data"]
    assert measured < 0.9 * m["predicted_peak_bytes"]  # the seq_len plan alone would warn
    assert abs(measured - at_data) <= 0.03 * measured, f"measured {measured:,} predicted {at_data:,}"
    assert "at the longest row" in result.output and "warning" not in result.output


def test_train_refuses_a_plan_that_does_not_fit(recipe_8b, monkeypatch):
    # Llama-3-8B full fine-tuning with offload off on a 12 GB card: no technique left can fit it.
    fake_card(monkeypatch, RTX_4070)
    args = ("--set", "techniques.lora=off", "--set", "techniques.offload=off")
    result = invoke("train", str(recipe_8b), *args)
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert lines[0].startswith("error: the run does not fit: predicted peak ") and "budget" in lines[0]
    assert lines[1].startswith(f"hint: `lowvram plan {recipe_8b}` names the smallest budget")
    assert not (recipe_8b.parent / "out").exists()  # refused before anything was loaded or written
    dry = invoke("train", str(recipe_8b), *args, "--dry-run")
    assert dry.exit_code == 0 and "does not fit" in dry.stdout


def test_no_track_memory(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("LOWVRAM_TRACK_MEMORY", raising=False)
    recipe = write_recipe(tmp_path, tiny_model_dir, "lora: on, mixed_precision: fp32", steps=1)
    result = invoke("train", str(recipe), "--no-track-memory")
    assert "LOWVRAM_TRACK_MEMORY" not in __import__("os").environ  # an argument, not a process-wide switch
    assert result.exit_code == 0, result.output
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert "RSS" in m["peak_memory_kind"] and m["memory_history"] == []


def test_prediction_far_off_is_a_warning(capsys):
    from lowvram.metrics import RunMetrics
    from lowvram.report.training import prediction_error, show_train_result
    from lowvram.train.types import RunResult

    m = {"steps": 1, "peak_memory_bytes": 130 * 2**20, "predicted_peak_bytes": 100 * 2**20,
         "peak_memory_kind": "live tensor bytes (exact, CPU)"}
    show_train_result(RunResult(output_dir="/nonexistent", metrics=RunMetrics.from_dict(m)))
    err = capsys.readouterr().err
    assert "+30% off the predicted" in err and "lowvram env" in err
    assert prediction_error({**m, "peak_memory_kind": "process peak RSS"}) is None
    # over-predicted by 11%, but by 0.1 MiB: headroom wasted is too small to report
    small = {**m, "peak_memory_bytes": 1_000_000, "predicted_peak_bytes": 1_124_000}
    show_train_result(RunResult(output_dir="/nonexistent", metrics=RunMetrics.from_dict(small)))
    assert "off the predicted" not in capsys.readouterr().err
    big = {**m, "peak_memory_bytes": 1 * 2**30, "predicted_peak_bytes": 1.2 * 2**30}
    show_train_result(RunResult(output_dir="/nonexistent", metrics=RunMetrics.from_dict(big)))
    assert "-17% off the predicted" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Bad input: error + hint, exit 1, no traceback


@pytest.fixture
def recipe_8b(tmp_path) -> Path:
    """A recipe on a catalog-shaped model: a folder holding only Llama-3-8B's config.json."""
    cfg = tmp_path / "llama-3-8b"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}))
    # --dry-run checks that the data file exists and its first row parses
    (tmp_path / "data.jsonl").write_text(json.dumps({"instruction": "Say hi.", "output": "Hi."}) + "\n")
    path = tmp_path / "recipe.yaml"
    path.write_text("""\
model: {name_or_path: llama-3-8b}
data:
  datasets: [{path: data.jsonl, format: alpaca}]
training: {max_steps: 10, batch_size: 16, seq_len: 2048, output_dir: out}
""")
    return path


@pytest.mark.parametrize("vram,message", [
    ("twelve", "cannot read memory size 'twelve'"),
    ("12XB", "cannot read memory size '12XB'"),
    ("300MB", "--vram 300MB (0.28 GiB) is no more than the CUDA context alone"),
])
def test_bad_vram(recipe_8b, vram, message, monkeypatch):
    fake_card(monkeypatch, RTX_4070)
    result = invoke("train", str(recipe_8b), "--dry-run", "--vram", vram)
    assert result.exit_code == 1
    assert f"error: {message}" in result.output and "hint: " in result.output


def test_bf16_forced_on_a_card_without_bf16(recipe_8b, monkeypatch):
    fake_card(monkeypatch, T4)
    result = invoke("train", str(recipe_8b), "--dry-run", "--set", "techniques.mixed_precision=bf16")
    assert result.exit_code == 1
    assert "error: techniques.mixed_precision: bf16 needs bf16, which Tesla T4 does not support" in result.output
    assert "hint: set techniques.mixed_precision: fp16-mixed" in result.output


def test_4bit_without_bitsandbytes_support(recipe_8b, monkeypatch):
    fake_card(monkeypatch, MPS)
    result = invoke("train", str(recipe_8b), "--dry-run", "--set", "techniques.quantization=nf4",
                    "--set", "techniques.lora=on")
    assert result.exit_code == 1
    assert "error: quantization nf4 need bitsandbytes: bitsandbytes has no Apple MPS support" in result.output
    assert "hint: set techniques.quantization: off" in result.output

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    fake_card(monkeypatch, RTX_4070)
    result = invoke("train", str(recipe_8b), "--dry-run", "--set", "techniques.quantization=nf4-dq",
                    "--set", "techniques.lora=on")
    assert result.exit_code == 1 and "bitsandbytes is not installed" in result.output
    assert "pip install bitsandbytes" in result.output


@pytest.mark.parametrize("hw, settings, error, hint", [
    ("T4", [], "flash-attn 2 needs an Ampere or newer GPU (compute capability 8.0), this is compute "
     "capability 7.5", "hint: use techniques.attention: sdpa"),
    ("RTX_4070", ["techniques.mixed_precision=fp32"], "precision fp32 keeps q, k and v in fp32",
     "hint: use a 16-bit precision (techniques.mixed_precision: bf16, bf16-mixed or fp16-mixed) with it, "
     "or techniques.attention: sdpa"),
    ("MPS", [], "flash-attn runs on CUDA GPUs only", "hint: use techniques.attention: sdpa"),
])
def test_flash_attention_where_it_cannot_run_is_refused(recipe_8b, monkeypatch, hw, settings, error, hint):
    """Issue 24 item 8: flash-attn raises at the first forward on cards before Ampere and on fp32
    tensors; `lowvram train` refuses both before loading the model."""
    fake_card(monkeypatch, {"T4": T4, "RTX_4070": RTX_4070, "MPS": MPS}[hw])
    overrides = [a for kv in ["techniques.attention=flash_attention_2", *settings] for a in ("--set", kv)]
    result = invoke("train", str(recipe_8b), "--dry-run", *overrides)
    assert result.exit_code == 1, result.output
    assert "error: techniques.attention: flash_attention_2 cannot run here: " + error in result.output
    assert hint in result.output
    # the same card with a 16-bit precision (or sdpa) plans
    if hw == "RTX_4070":
        ok = invoke("train", str(recipe_8b), "--dry-run", "--set", "techniques.attention=flash_attention_2")
        assert ok.exit_code == 0 and "flash_attention_2" in ok.output, ok.output


# --------------------------------------------------------------------------------------------
# --dry-run is stable


def test_dry_run_snapshot(recipe_8b, monkeypatch):
    fake_card(monkeypatch, RTX_4070)
    result = invoke("train", str(recipe_8b), "--dry-run", "--vram", "12GB")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("│ ") and "│" in line[2:]]
    rows = {}
    last = None
    for line in lines:
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells[0]:
            last = cells[0]
            rows[last] = cells[1]
    assert rows == SNAPSHOT, repr(rows)


# Llama-3-8B, batch 16 x seq 2048, on a 12 GB card: what `lowvram train --dry-run` must show.
SNAPSHOT = {
    "mixed_precision": "bf16", "gradient_checkpointing": "on", "gradient_accumulation": "16",
    "lora": "on", "quantization": "nf4-dq", "optimizer": "adamw", "offload": "none", "activation_offload": "off", "tiled_mlp": "off",
    "attention": "sdpa", "loss": "standard", "micro_batch_size": "1", "predicted peak": "10.25 GiB",
}
