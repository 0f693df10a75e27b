"""Never lose a run, part 2 (issue 15), each failure through the CLI as a user runs it:
--overwrite deletes only what a run wrote; --resume at the last step trains nothing more (also
after a SIGKILL in the final save); one process per run folder; disk full on every checkpoint
write; a changed recipe is refused before anything is rewritten; a checkpoint corrupted in place
is skipped for the previous one."""

from __future__ import annotations

import errno
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.train.run import lock, manifest
from lowvram.train.run.checkpoints import complete_checkpoints as checkpoints
from tests.train.test_e2e import metrics, train, write_recipe
from tests.train.test_resume import _env, _start, _wait_for, _weights

# --------------------------------------------------------------------------------------------
# 1. --overwrite deletes only what a run wrote


def test_overwrite_never_deletes_a_folder_that_holds_no_lowvram_run(tmp_path, tiny_model_dir):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "train.py").write_text("print('mine')\n")
    (project / "data" / "mydata.jsonl").write_text('{"a": 1}\n')
    (project / "checkpoint-500").mkdir()
    (project / "checkpoint-500" / "config.json").write_text("{}")
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=1)
    for extra in ([], ["--overwrite"]):
        result = train(str(recipe), "--set", f"training.output_dir={project}", *extra)
        assert result.exit_code == 1, result.output
        assert f"error: training.output_dir {project} is not empty and holds no lowvram run" in result.output
    assert sorted(str(p.relative_to(project)) for p in project.rglob("*")) == [
        "checkpoint-500", "checkpoint-500/config.json", "data", "data/mydata.jsonl", "train.py"]


def test_overwrite_deletes_only_the_files_the_run_wrote(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2, save_steps=1)
    assert train(str(recipe)).exit_code == 0
    out = tmp_path / "out"
    listed = manifest.read(out)["paths"]
    assert {"recipe.yaml", "plan.json", "metrics.json", "checkpoint-1", "checkpoint-2",
            "adapter_model.safetensors", "tokenizer.json"} <= set(listed)
    assert set(listed) >= {p.name for p in out.iterdir()} - {manifest.MANIFEST}  # everything it wrote is listed
    (out / "notes.txt").write_text("my notes on this run")  # added by the user afterwards
    (out / "analysis").mkdir()
    (out / "analysis" / "plot.py").write_text("...")
    replaced = train(str(recipe), "--overwrite", "--set", "training.save_steps=100")
    assert replaced.exit_code == 0, replaced.output
    assert "--overwrite kept what the run did not write" in replaced.output and "notes.txt" in replaced.output
    assert (out / "notes.txt").read_text() == "my notes on this run" and (out / "analysis" / "plot.py").is_file()
    assert not (out / "checkpoint-1").exists() and metrics(out)["steps"] == 2


def test_home_folder_is_never_an_output_dir(tmp_path, tiny_model_dir, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=1)
    for value in ("~", "~/"):
        result = train(str(recipe), "--set", f"training.output_dir={value}")
        assert result.exit_code == 1, result.output
        assert f"error: training.output_dir {home} is your home folder" in result.output
    assert list(home.iterdir()) == []
    # `~/...` is the home folder's subfolder, not a folder named "~" (and never YAML's null).
    result = CliRunner().invoke(app, ["train", str(recipe), "--dry-run", "--json", "--set", "training.output_dir=~/runs/a"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["recipe"]["training"]["output_dir"] == "~/runs/a"


def test_overwrite_refuses_a_folder_that_holds_the_recipe(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=1, extra="")
    result = train(str(recipe), "--overwrite", "--set", f"training.output_dir={tmp_path}")
    assert result.exit_code == 1 and f"--overwrite would delete from {tmp_path}, which holds the recipe" in result.output
    assert recipe.is_file()


# --------------------------------------------------------------------------------------------
# 2. Resume at the last step


_KILL_IN_FINAL_SAVE = textwrap.dedent("""
    import os, signal, sys
    real_replace = os.replace

    def replace(src, dst, *a, **k):  # the final save moves its files out of .final-*: die there
        if "/.final-" in str(src):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst, *a, **k)

    os.replace = replace
    sys.argv = ["lowvram", "train", *sys.argv[1:]]
    from lowvram.cli import main
    main()
""")


@pytest.mark.slow  # `make test-all` (the default suite's time on 2 cores)
def test_sigkill_in_the_final_save_then_resume_equals_an_uninterrupted_run(tmp_path, tiny_model_dir):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = _start([str(write_recipe(ref_dir, tiny_model_dir, steps=4, save_steps=2))], ref_dir)
    recipe = write_recipe(run_dir, tiny_model_dir, steps=4, save_steps=2)
    killed = subprocess.run([sys.executable, "-c", _KILL_IN_FINAL_SAVE, str(recipe)], cwd=run_dir, env=_env(),
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    out = run_dir / "out"
    assert [p.name for p in checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert list(out.glob(".final-*")) and not (out / "metrics.json").exists()
    assert ref.wait(300) == 0, ref.stderr.read()

    resumed = train(str(recipe), "--resume")  # the interrupted run finishes without a step
    assert resumed.exit_code == 0, resumed.output
    assert "checkpoint-4 is at the last step (4): finishing without training" in resumed.output
    assert "step 5/" not in resumed.output and not list(out.glob(".final-*"))
    m, r = metrics(out), metrics(ref_dir / "out")
    assert m["steps"] == 4 and m["resumed_from"].endswith("checkpoint-4")
    assert m["train_loss"] == r["train_loss"] and m["loss_history"] == r["loss_history"]
    a, b = _weights(out), _weights(ref_dir / "out")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
    again = train(str(recipe), "--resume")  # now finished: refused, nothing rewritten (issue 42)
    assert again.exit_code == 1 and "holds a finished run (4 steps)" in again.output
    assert metrics(out) == m


def _hashes(folder) -> dict:
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resume_on_a_finished_run_changes_no_file_and_says_how_to_train_more(tmp_path, tiny_model_dir):
    """Issue 42 item 5: `--resume` after a finished run rewrote its metrics.json (the runtime, the
    peak) and warned of a prediction error that was not there. Now it is refused before planning,
    every file as it was; raising training.max_steps continues from the final checkpoint."""
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2)
    assert train(str(recipe)).exit_code == 0
    out = tmp_path / "out"
    before = _hashes(out)
    resumed = train(str(recipe), "--resume")
    assert resumed.exit_code == 1, resumed.output
    assert f"error: {out} holds a finished run (2 steps): --resume continues an unfinished run, so nothing " \
        "was trained and no file was changed" in resumed.output
    assert "hint: to train more, raise training.max_steps: `--resume --set training.max_steps=4` continues " \
        "from its final checkpoint; or start a new run with --set training.output_dir=runs/new" in resumed.output
    assert "predicted peak" not in resumed.output and "please report" not in resumed.output  # before planning
    assert _hashes(out) == before
    more = train(str(recipe), "--resume", "--set", "training.max_steps=4")
    assert more.exit_code == 0, more.output
    m = metrics(out)
    assert m["steps"] == 4 and m["resumed_from"].endswith("checkpoint-2") and "step 3/4" in more.output


def test_usage_errors_and_folder_refusals_come_before_the_plan(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=1)
    both = train(str(recipe), "--resume", "--overwrite")
    assert both.exit_code == 2 and "error: --resume and --overwrite contradict each other" in both.output
    assert "predicted peak" not in both.output
    assert train(str(recipe)).exit_code == 0
    again = train(str(recipe))
    assert again.exit_code == 1 and "already holds a finished run" in again.output
    assert "predicted peak" not in again.output


# --------------------------------------------------------------------------------------------
# 3. One process per run folder


def test_a_second_process_on_a_running_run_gets_an_error_naming_the_holder(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=200, save_steps=100)
    first = _start([str(recipe)], tmp_path)
    try:
        _wait_for(first, "step 1/")
        for extra in (["--overwrite"], ["--resume"], []):
            second = train(str(recipe), *extra)
            assert second.exit_code == 1, second.output
            assert f"error: {tmp_path / 'out'} is in use by pid {first.pid} on {socket.gethostname()}" in second.output
            assert "hint: wait for it to finish, or stop it" in second.output
        assert first.poll() is None and (tmp_path / "out" / "plan.json").is_file()
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == 143 and not lock.lock_path(tmp_path / "out").exists()  # released on exit


def test_a_stale_lock_is_named_and_taken_over(tmp_path, tiny_model_dir):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "out"
    lock.lock_path(out).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                               "started": 1.0e9, "command": "lowvram train"}))
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=1)
    result = train(str(recipe))
    assert result.exit_code == 0, result.output
    assert f"note: took over a stale lock on {out}: pid {dead.pid} on {socket.gethostname()}" in result.output
    assert "is no longer running" in result.output and not lock.lock_path(out).exists()


def test_the_lock_is_taken_by_one_of_two_and_merge_out_is_locked(tmp_path):
    out = tmp_path / "merged"
    held = lock.acquire(out, "test")
    try:
        other = subprocess.run([sys.executable, "-c", f"from lowvram.train.run.lock import acquire; acquire({str(out)!r}, 'x')"],
                               env=_env(), capture_output=True, text=True, timeout=60)
        assert other.returncode != 0 and f"is in use by pid {os.getpid()}" in other.stderr
        result = CliRunner().invoke(app, ["merge", str(tmp_path / "run"), "--out", str(out)])
        assert result.exit_code == 1 and f"error: {out} is in use by pid {os.getpid()}" in result.output
    finally:
        lock.release(out, held)
    assert not lock.lock_path(out).exists()


# --------------------------------------------------------------------------------------------
# 4. Disk full on every checkpoint and final write


def _fail(exc):
    def raiser(*args, **kwargs):
        raise exc
    return raiser


def _patch_torch_save(monkeypatch, file_name: str, exc: Exception) -> None:
    import torch

    real = torch.save

    def save(obj, f, *args, **kwargs):
        if str(f).endswith(f"checkpoint-4/{file_name}"):
            raise exc
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def _patch_method(monkeypatch, owner, name: str, where: str, exc: Exception) -> None:
    real = getattr(owner, name)

    def method(self, path, *args, **kwargs):
        if where in str(path):
            raise exc
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(owner, name, method)


ENOSPC = OSError(errno.ENOSPC, "No space left on device")
TORCH_FULL = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4160 vs 4052")
TORCH_WRITER = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")


@pytest.mark.parametrize("what", ["optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
                                  "final tokenizer", "final adapter"])
def test_disk_full_on_any_write_is_an_error_and_hint_with_the_partial_checkpoint_removed(
        tmp_path, tiny_model_dir, monkeypatch, what):
    from transformers import PreTrainedTokenizerBase, Trainer, TrainerState

    final = what.startswith("final")
    if what in ("optimizer.pt", "rng_state.pth"):
        _patch_torch_save(monkeypatch, what, TORCH_FULL)
    elif what == "scheduler.pt":
        _patch_torch_save(monkeypatch, what, TORCH_WRITER)
    elif what == "trainer_state.json":
        _patch_method(monkeypatch, TrainerState, "save_to_json", "checkpoint-4", ENOSPC)
    elif what == "final tokenizer":
        _patch_method(monkeypatch, PreTrainedTokenizerBase, "save_pretrained", "/.final-", ENOSPC)
    else:
        _patch_method(monkeypatch, Trainer, "save_model", "/.final-", ENOSPC)
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=4, save_steps=2)
    result = train(str(recipe))
    out = tmp_path / "out"
    assert result.exit_code == 1, result.output
    assert "error: disk full while writing " in result.output
    kept = "checkpoint-4" if final else "checkpoint-2"
    assert f"hint: free space on that disk (df -h {out}); the last complete checkpoint {kept} is intact, " \
           f"then lowvram train {recipe} --resume" in result.output
    if not final:
        assert "(removed the partial checkpoint-4)" in result.output and not (out / "checkpoint-4").exists()
    assert [p.name for p in checkpoints(out)] == (["checkpoint-2", "checkpoint-4"] if final else ["checkpoint-2"])
    assert not list(out.glob(".final-*")) and not (out / "metrics.json").exists()


def test_torch_serializer_errors_count_as_disk_full():
    from lowvram.train.run.recover import is_disk_full

    assert is_disk_full(TORCH_FULL) and is_disk_full(TORCH_WRITER) and is_disk_full(ENOSPC)
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = ENOSPC
    assert is_disk_full(wrapped)
    assert not is_disk_full(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


# --------------------------------------------------------------------------------------------
# 5. A changed recipe on --resume


def test_resume_with_a_changed_recipe_is_refused_before_anything_is_rewritten(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2, save_steps=2)
    assert train(str(recipe)).exit_code == 0
    out = tmp_path / "out"
    (out / "metrics.json").unlink()  # as if stopped before its final save (a finished run is refused first)
    before = {n: (out / n).read_bytes() for n in ("recipe.yaml", "plan.json", manifest.MANIFEST)}
    for change, line in [("training.learning_rate=5e-4", "training.learning_rate: 0.003 -> 0.0005"),
                         ("training.seq_len=32", "training.seq_len: 64 -> 32"),
                         ("lora.r=4", "lora.r: 8 -> 4"),
                         ("training.batch_size=8", "training.batch_size: 4 -> 8"),
                         ("training.lr_scheduler=cosine", "training.lr_scheduler: 'constant' -> 'cosine'")]:
        result = train(str(recipe), "--resume", "--set", change)
        assert result.exit_code == 1, result.output
        assert f"error: --resume would continue the run in {out} with different settings, mixing two runs:" in result.output
        assert line in result.output, result.output
        assert "hint: resume with the run's own settings" in result.output and "--overwrite" in result.output
    with (tmp_path / "data.jsonl").open("a") as f:  # the same file name, other rows
        f.write(json.dumps({"instruction": "Add 1 and 1.", "input": "", "output": "2"}) + "\n")
    result = train(str(recipe), "--resume")
    assert result.exit_code == 1 and "data file data.jsonl changed since the run started" in result.output
    assert {n: (out / n).read_bytes() for n in before} == before


def test_resume_with_a_safe_change_says_so(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2, save_steps=1)
    assert train(str(recipe), "--set", "training.max_steps=1").exit_code == 0
    (tmp_path / "out" / "metrics.json").unlink()  # as if stopped after checkpoint-1
    result = train(str(recipe), "--resume", "--set", "training.logging_steps=2")
    assert result.exit_code == 0, result.output
    assert "note: resuming with a changed setting that does not change the training: " \
           "training.logging_steps: 1 -> 2" in result.output
    assert "training.max_steps: 1 -> 2" in result.output  # a constant schedule: more steps change no step taken
    assert metrics(tmp_path / "out")["steps"] == 2


# --------------------------------------------------------------------------------------------
# 6. Checkpoints checked by content


def test_a_checkpoint_corrupted_in_place_is_skipped_for_the_previous_one(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=4, save_steps=2)
    assert train(str(recipe)).exit_code == 0
    out = tmp_path / "out"

    def corrupt(step: int) -> None:
        with (out / f"checkpoint-{step}" / "adapter_model.safetensors").open("r+b") as f:
            f.write(b"\xff" * 8)  # same size: the marker's sizes still match

    corrupt(4)
    (out / "metrics.json").unlink()  # as if stopped before its final save (a finished run is refused first)
    result = train(str(recipe), "--resume")
    assert result.exit_code == 0, result.output
    assert "note: skipped checkpoint-4 (adapter_model.safetensors changed after it was written" in result.output
    m = metrics(out)
    assert m["resumed_from"].endswith("checkpoint-2") and m["steps"] == 4

    corrupt(2)
    corrupt(4)  # written again by the resumed run
    (out / "metrics.json").unlink()
    result = train(str(recipe), "--resume")
    assert result.exit_code == 1
    assert f"error: no checkpoint to resume from in {out} (checkpoint folders: checkpoint-2, checkpoint-4); " \
           "skipped checkpoint-4 (adapter_model.safetensors changed" in result.output
    assert "checkpoint-2 (adapter_model.safetensors changed" in result.output and "hint:" in result.output


# --------------------------------------------------------------------------------------------
# 7. validate and --dry-run read the recipe's files


def test_validate_and_dry_run_find_a_missing_data_file_and_model_folder(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, data="missing.jsonl")
    for args in (["validate", str(recipe)], ["train", str(recipe), "--dry-run"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1, result.output
        assert f"data file not found: {tmp_path / 'missing.jsonl'}" in result.output
    recipe = write_recipe(tmp_path, "./no/such/model")
    result = CliRunner().invoke(app, ["validate", str(recipe)])
    assert result.exit_code == 1 and "model not found: ./no/such/model" in result.output
    (tmp_path / "bad.jsonl").write_text('{"instruction": "a", "output": "b"}\n{"instruction": \n')
    recipe = write_recipe(tmp_path, tiny_model_dir, data="bad.jsonl")
    result = CliRunner().invoke(app, ["validate", str(recipe)])
    assert result.exit_code == 1 and "bad.jsonl:2: invalid JSON" in result.output
    ok = CliRunner().invoke(app, ["validate", str(write_recipe(tmp_path, tiny_model_dir))])
    assert ok.exit_code == 0, ok.output


def test_show_gives_the_resume_command_of_an_interrupted_run(tmp_path):
    run = tmp_path / "runs" / "a"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "recipe.yaml").write_text("# recipe: /work/my recipe.yaml\nmodel: {name_or_path: m}\n")
    (run / "plan.json").write_text(json.dumps({"grad_accum": 4, "lora": True, "reasons": {}}))
    result = CliRunner().invoke(app, ["show", str(run)])
    assert result.exit_code == 0, result.output
    assert "interrupted" in result.output and "gradient_accumulation" in result.output
    assert "grad_accum " not in result.output
    expected = shlex.join(["lowvram", "train", "/work/my recipe.yaml", "--resume", "--set", f"training.output_dir={run}"])
    assert f"resume with: {expected}" in result.output


def test_a_run_from_before_manifests_is_overwritten_by_its_known_files_only(tmp_path):
    from lowvram.train.run.folder import prepare_output_dir

    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (out / "checkpoint-9").mkdir()  # not a Trainer checkpoint: kept
    for name in ("recipe.yaml", "plan.json", "metrics.json", "adapter_model.safetensors", "mine.txt"):
        (out / name).write_text("x")
    manifest.record(out, "checkpoint-4")  # a resumed old run starts its manifest with what it holds
    assert {"recipe.yaml", "plan.json", "checkpoint-2", "checkpoint-4"} <= set(manifest.read(out)["paths"])
    assert prepare_output_dir(out, resume=False, overwrite=True) is None
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-9", manifest.MANIFEST, "mine.txt"]
