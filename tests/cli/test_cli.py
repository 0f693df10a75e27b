"""CLI basics: help without heavy imports, validate, dry-run, env, error/hint lines, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from lowvram.cli import app
from tests.conftest import REPO

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def test_help_imports_no_heavy_modules():
    code = (
        "import sys; from lowvram.cli import app\n"
        "from typer.testing import CliRunner\n"
        "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output\n"
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'datasets', 'bitsandbytes') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == ""


def test_python_m_lowvram_version():
    out = subprocess.run([sys.executable, "-m", "lowvram", "version"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "0.1.0"


def test_validate_ok_and_json(quickstart_model):  # validate checks the model folder exists
    r = run("validate", str(REPO / "recipes/quickstart.yaml"))
    assert r.exit_code == 0 and r.stdout.startswith("ok ")
    r = run("validate", str(REPO / "recipes/quickstart.yaml"), "--json")
    assert json.loads(r.stdout)["valid"] is True


def test_validate_errors_one_error_line_and_hint(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("model:\n  name_or_path: x\ndata:\n  datasets: [{path: a.jsonl}]\ntraining:\n  learning_rte: 1\n")
    r = run("validate", str(p))
    assert r.exit_code == 1
    lines = r.stderr.splitlines()
    assert lines[0] == "error: 1 problem in the recipe:"
    assert lines[1].strip() == f"{p}:6: training.learning_rte: unknown key 'learning_rte'; did you mean 'learning_rate'?"
    assert lines[-1].startswith("hint: ")
    assert "Traceback" not in r.output


def test_missing_recipe_exit_1():
    r = run("validate", "does-not-exist.yaml")
    assert r.exit_code == 1
    assert r.stderr.splitlines() == [
        "error: recipe file not found: does-not-exist.yaml",
        "hint: pass the path to a .yaml recipe, e.g. recipes/quickstart.yaml",
    ]


def test_invalid_yaml_exit_1(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("model: [unclosed\n")
    r = run("validate", str(p))
    assert r.exit_code == 1 and r.stderr.startswith(f"error: {p}:2: invalid YAML")


def test_usage_error_exit_2():
    assert run("validate").exit_code == 2
    assert run("train", "--no-such-flag", "x.yaml").exit_code == 2


def test_set_override_on_cli(tmp_path):
    r = run("validate", str(REPO / "recipes/quickstart.yaml"), "--set", "training.seq_len=-3")
    assert r.exit_code == 1
    assert "--set training.seq_len=-3: training.seq_len: Input should be greater than 0" in r.stderr


def test_train_dry_run_prints_resolved_recipe_and_plan(quickstart_model, monkeypatch):
    """... and reads the cards once (issue 43 item 3: the real detect_hardware, counted)."""
    import lowvram.hardware

    calls, real = [], lowvram.hardware.detect_hardware
    monkeypatch.setattr(lowvram.hardware, "detect_hardware", lambda *a, **k: calls.append(a) or real(*a, **k))
    r = run("train", str(REPO / "recipes/quickstart.yaml"), "--dry-run", "--set", "training.learning_rate=5e-4")
    assert r.exit_code == 0, r.output
    assert len(calls) == 1
    assert "learning_rate: 0.0005" in r.stdout
    assert "warmup_ratio:" in r.stdout  # defaults filled in
    assert "dry run: nothing was trained." in r.stdout
    r = run("train", str(REPO / "recipes/quickstart.yaml"), "--dry-run", "--json")
    data = json.loads(r.stdout)
    assert data["recipe"]["training"]["seq_len"] == 192
    assert data["plan"]["lora"] is True


def test_env_block():
    r = run("env")
    assert r.exit_code == 0
    for name in ("lowvram", "torch", "transformers", "peft", "bitsandbytes", "accelerate", "host RAM"):
        assert name in r.stdout
