"""Never lose a run: a run killed with SIGKILL resumes to the same weights, partial checkpoints are
never resumed from, SIGINT/SIGTERM save and print the resume command, a full disk leaves the last
checkpoint intact, outputs are written atomically, and no secret from the environment leaks.

The subprocess tests run `python -m lowvram train` on the tiny model (two at a time: 2 cores)."""

from __future__ import annotations

import errno
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lowvram.errors import LowvramError
from lowvram.runfiles import MARKER, write_atomic
from lowvram.train.run.checkpoints import complete_checkpoints as checkpoints
from lowvram.train.run.checkpoints import mark_complete
from lowvram.train.run.folder import prepare_output_dir
from lowvram.train.run.oom import EMULATE_ENV
from tests.train.test_e2e import metrics, train, write_recipe

SECRETS = {"HF_TOKEN": "secret-hf-xyz", "WANDB_API_KEY": "secret-wandb-xyz", "MY_SERVICE_SECRET": "secret-svc-xyz"}


def _env(**extra) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", **extra}
    env.pop(EMULATE_ENV, None)
    return env


def _start(args: list[str], cwd: Path, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lowvram", "train", *args], cwd=cwd, env=_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen, prefix: str) -> list[str]:
    """Read stdout until a line starts with ``prefix``; the lines read."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"process ended before {prefix!r}: {''.join(lines)}{proc.stderr.read()}")


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "adapter_model.safetensors"))


# --------------------------------------------------------------------------------------------
# SIGKILL in the middle, then --resume


@pytest.mark.slow  # `make test-all` (the default suite's time on 2 cores)
def test_sigkill_then_resume_equals_an_uninterrupted_run_and_no_secret_leaks(tmp_path, tiny_model_dir):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), run_dir.mkdir()
    args, short = dict(steps=6, save_steps=2), ["--set", "training.logging_steps=2"]
    ref = _start([str(write_recipe(ref_dir, tiny_model_dir, **args)), *short], ref_dir, **SECRETS)
    killed = _start([str(write_recipe(run_dir, tiny_model_dir, **args)), *short], run_dir)
    _wait_for(killed, "step 2: checkpoint saved")  # printed before the marker: a race we accept
    killed.kill()
    killed.wait(30)
    out = run_dir / "out"
    assert killed.returncode == -signal.SIGKILL and not (out / "metrics.json").exists()

    resumed = subprocess.run([sys.executable, "-m", "lowvram", "train", str(run_dir / "recipe.yaml"), *short, "--resume"],
                             cwd=run_dir, env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    ref_out, ref_err = ref.communicate(timeout=300)
    assert ref.returncode == 0, ref_err

    m, r = metrics(out), metrics(ref_dir / "out")
    assert m["resumed_from"] and int(m["resumed_from"].rpartition("-")[2]) >= 2 and m["steps"] == 6
    assert m["train_loss"] == pytest.approx(r["train_loss"], abs=1e-4)
    a, b = _weights(out), _weights(ref_dir / "out")
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4

    # No token from the environment in the output of the reference run or in any file it wrote.
    leaks = [n for n, v in SECRETS.items() if v in ref_out or v in ref_err]
    leaks += [str(p) for p in (ref_dir / "out").rglob("*") if p.is_file()
              and any(v.encode() in p.read_bytes() for v in SECRETS.values())]
    assert not leaks


# --------------------------------------------------------------------------------------------
# Partial checkpoints


def _checkpoint(out: Path, step: int, marked: bool = True) -> Path:
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(b"w" * 100)
    (d / "optimizer.pt").write_bytes(b"o" * 50)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if marked:
        mark_complete(d)
    return d


def test_partial_checkpoints_are_never_resumed_from(tmp_path):
    out = tmp_path / "out"
    _checkpoint(out, 2)
    _checkpoint(out, 4)
    (out / "checkpoint-4" / "optimizer.pt").write_bytes(b"o" * 10)  # truncated after the marker
    _checkpoint(out, 6, marked=False)  # the process died before the marker
    (out / "checkpoint-8").mkdir()  # died at once
    assert [p.name for p in checkpoints(out)] == ["checkpoint-2"]
    assert prepare_output_dir(out, resume=True, overwrite=False).name == "checkpoint-2"
    (out / "checkpoint-2" / MARKER).write_text('{"files": {"optimizer.pt"')  # a torn marker
    with pytest.raises(LowvramError, match="no checkpoint to resume from"):
        prepare_output_dir(out, resume=True, overwrite=False)


def test_unmarked_checkpoints_need_a_readable_trainer_state(tmp_path):
    """Folders from another tool or an older lowvram (no markers anywhere)."""
    out = tmp_path / "out"
    _checkpoint(out, 2, marked=False)
    _checkpoint(out, 4, marked=False)
    (out / "checkpoint-4" / "trainer_state.json").write_text('{"global_st')
    assert [p.name for p in checkpoints(out)] == ["checkpoint-2"]


# --------------------------------------------------------------------------------------------
# SIGINT / SIGTERM


def test_sigint_and_sigterm_save_a_checkpoint_and_print_the_resume_command(tmp_path, tiny_model_dir):
    procs = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        d = tmp_path / sig.name
        d.mkdir()
        recipe = d / "my recipe.yaml"
        write_recipe(d, tiny_model_dir, steps=200, save_steps=100).rename(recipe)
        sets = ["--set", "training.output_dir=out dir", "--set", "training.learning_rate=0.001"]
        procs[sig] = (d, recipe, sets, _start([str(recipe), *sets], d))
    for sig, (*_, proc) in procs.items():
        _wait_for(proc, "step 1/")
        proc.send_signal(sig)
    commands = {}
    for sig, (d, recipe, sets, proc) in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], err
        assert f"{sig.name}: saving a checkpoint at the end of this step" in err
        assert "Traceback" not in err
        saved = checkpoints(d / "out dir")
        assert len(saved) == 1 and f"error: interrupted by {sig.name} at step {saved[0].name[11:]}; " \
                                   f"checkpoint saved: {saved[0]}" in err
        hint = next(line for line in err.splitlines() if line.startswith("hint: resume with: "))
        commands[sig] = command = hint[len("hint: resume with: "):]
        assert shlex.split(command) == ["lowvram", "train", str(recipe), "--resume", *sets]
        assert not (d / "out dir" / "metrics.json").exists()

    # The printed command resumes (capped one step further to keep the test short).
    d, recipe, sets, _ = procs[signal.SIGINT]
    step = int(checkpoints(d / "out dir")[0].name[11:])
    result = train(*shlex.split(commands[signal.SIGINT])[2:], "--set", f"training.max_steps={step + 1}")
    assert result.exit_code == 0, result.output
    m = metrics(d / "out dir")
    assert m["steps"] == step + 1 and m["resumed_from"].endswith(f"checkpoint-{step}")


# --------------------------------------------------------------------------------------------
# Disk full, atomic writes


def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    import torch

    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if "checkpoint-4" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=6, save_steps=2)
    result = train(str(recipe))
    assert result.exit_code == 1
    out = tmp_path / "out"
    assert f"error: disk full while writing {out}/checkpoint-4/" in result.output
    assert "(removed the partial checkpoint-4)" in result.output
    assert f"hint: free space on that disk (df -h {out}); the last complete checkpoint checkpoint-2 is intact, " \
           f"then lowvram train {recipe} --resume" in result.output
    assert [p.name for p in checkpoints(out)] == ["checkpoint-2"] and not (out / "checkpoint-4").exists()
    assert not (out / "metrics.json").exists()


def test_write_atomic_keeps_the_old_file_when_the_disk_is_full(tmp_path, monkeypatch):
    path = tmp_path / "metrics.json"
    write_atomic(path, '{"old": true}\n')

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(OSError):
        write_atomic(path, '{"new": true}\n')
    assert path.read_text() == '{"old": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]  # no temp file left
