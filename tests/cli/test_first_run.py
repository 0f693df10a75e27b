"""The first-run papercuts a new user met (issue 45): a training run listed as running, no network
said fast, no library noise on stderr, one GGUF conversion per file whatever its path, the right
hint for an empty data file, one spelling of offload's off."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

from typer.testing import CliRunner

from lowvram.cli import app
from tests.conftest import REPO

ROWS = [{"prompt": f"Say {w}", "completion": w} for w in ("one", "two", "three", "four")]


def write_recipe(tmp_path, model: str, data: str = "d.jsonl", **training) -> str:
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    doc = {"model": {"name_or_path": model}, "data": {"datasets": [{"path": data}]},
           "training": {"seq_len": 32, "batch_size": 2, "max_steps": 1, "report_to": "none",
                        "output_dir": str(tmp_path / "run"), **training}}
    (tmp_path / "r.yaml").write_text(json.dumps(doc))
    return str(tmp_path / "r.yaml")


def test_runs_lists_a_run_that_is_training_now_as_running(tmp_path):
    from lowvram.runfiles import lock_path

    run = tmp_path / "runs" / "live"
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text("model: {name_or_path: x}\n")
    listed = CliRunner().invoke(app, ["runs", str(tmp_path / "runs"), "--json"])
    assert json.loads(listed.stdout)[0]["status"] == "failed"  # no lock: what is left of a dead run
    lock_path(run).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                          "started": time.time(), "command": "lowvram train"}))
    listed = CliRunner().invoke(app, ["runs", str(tmp_path / "runs"), "--json"])
    assert listed.exit_code == 0 and json.loads(listed.stdout)[0]["status"] == "running"


def test_a_hub_model_with_no_network_is_said_in_seconds_by_validate_and_train(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")  # a closed port: connection refused
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    from lowvram import hub

    monkeypatch.setattr(hub, "_REACHABLE", {})
    recipe = write_recipe(tmp_path, "Qwen/Qwen2.5-0.5B-Instruct")  # a catalog model: planned without a download
    started = time.monotonic()
    result = CliRunner().invoke(app, ["validate", recipe])
    assert result.exit_code == 1, result.output
    assert "no network: http://127.0.0.1:1 cannot be reached, and model Qwen/Qwen2.5-0.5B-Instruct is not in the hub cache" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("hint: download the model where there is network")
    result = CliRunner().invoke(app, ["train", recipe])
    assert result.exit_code == 1 and "error: no network:" in result.stderr, result.output
    assert time.monotonic() - started < 30


def test_training_writes_no_library_noise_to_stderr(tmp_path, tiny_model_dir):
    (tmp_path / "d.csv").write_text("prompt,response\n" + "".join(f"{r['prompt']},{r['completion']}\n" for r in ROWS))
    recipe = write_recipe(tmp_path, str(tiny_model_dir), data="d.csv")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    out = subprocess.run([sys.executable, "-m", "lowvram", "train", recipe], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    for noise in ("Setting accelerator to CPU", "Skipping publisher trust check", "Generating train split",
                  "Traceback", "it/s]"):
        assert noise not in out.stderr, out.stderr
    assert out.stderr.strip() == "", out.stderr


def test_one_gguf_conversion_serves_every_copy_of_the_file(tmp_path):
    from lowvram.train.build.gguf import _gguf_key

    data = os.urandom(9 << 20)  # larger than both 4 MiB edges
    for folder in ("a", "b/c"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "m.gguf").write_bytes(data)
    os.utime(tmp_path / "b/c/m.gguf", (1, 1))
    assert _gguf_key(tmp_path / "a" / "m.gguf") == _gguf_key(tmp_path / "b/c" / "m.gguf")
    changed = bytearray(data)
    changed[-1] ^= 1  # the last tensor's bytes differ: another file
    (tmp_path / "a" / "m.gguf").write_bytes(bytes(changed))
    assert _gguf_key(tmp_path / "a" / "m.gguf") != _gguf_key(tmp_path / "b/c" / "m.gguf")
    shutil.rmtree(tmp_path / "b")


def test_an_empty_data_file_gets_the_data_hint_not_the_path_hint(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, str(tiny_model_dir))
    (tmp_path / "d.jsonl").write_text("\n\n")
    result = CliRunner().invoke(app, ["validate", recipe])
    assert result.exit_code == 1 and "the data file is empty" in result.stderr
    assert result.stderr.splitlines()[-1] == ("hint: add examples to the file (one JSON object per line for .jsonl) "
                                              "or remove it from data.datasets")


def test_offload_none_in_a_recipe_is_the_flags_spelling_of_off(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, str(tiny_model_dir))
    result = CliRunner().invoke(app, ["validate", recipe, "--set", "techniques.offload=none",
                                      "--set", "techniques.quantization=none"])
    assert result.exit_code == 0, result.output


def test_paths_in_messages_are_normalised(tmp_path, tiny_model_dir):
    (tmp_path / "sub").mkdir()
    recipe = write_recipe(tmp_path, str(tiny_model_dir), data="sub/../missing.jsonl")
    result = CliRunner().invoke(app, ["validate", recipe])
    assert result.exit_code == 1
    assert f"data file not found: {tmp_path / 'missing.jsonl'}" in result.stderr and "/../" not in result.stderr


def test_a_missing_quickstart_model_says_how_to_get_it(tmp_path):
    recipe = write_recipe(tmp_path, "../models/SmolLM2-135M-Instruct")
    result = CliRunner().invoke(app, ["validate", recipe])
    assert result.exit_code == 1 and "model not found: ../models/SmolLM2-135M-Instruct" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("hint: run `make demo`")
