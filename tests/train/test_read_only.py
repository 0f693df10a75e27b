"""Read-only storage, every case, on a real read-only tmpfs (issue 42, item 4): a new run, a
`--resume`, `--print-launch` and `merge --out` into a read-only folder each end with one `error:`
naming the folder and a `hint:`, exit 1, no traceback, nothing written anywhere else; storage that
turns read-only in the middle of a run (remounted between two steps) is an error naming the run
folder, and --resume finishes the run once it is writable again; `generate`, `runs` and `show`
read a run on read-only storage as they read any other. And `lowvram runs` over a folder where one
run's files are damaged (garbage, or a FIFO in place of metrics.json) warns about that run by name
on stderr and exits 0, listing the others.

Needs root to mount the tmpfs; skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.train.test_after_training import cli
from tests.train.test_e2e import metrics, train, write_recipe

NO_TENSORBOARD = ("--set", "training.report_to=none")
TRAIN_HINT = "hint: set training.output_dir to a folder on writable storage (--set training.output_dir=DIR); nothing was written"


def _mount(folder: Path, *options: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=16m", *options)), "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")


def _remount(folder: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(folder)], check=True, capture_output=True)


@pytest.fixture
def ro(tmp_path):
    """tmp_path/ro: an empty read-only tmpfs, unmounted afterwards."""
    folder = tmp_path / "ro"
    folder.mkdir()
    _mount(folder, "ro")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir) -> Path:
    """A finished 2-step LoRA run with checkpoints at steps 1 and 2."""
    tmp = tmp_path_factory.mktemp("finished")
    recipe = write_recipe(tmp, tiny_model_dir, steps=2, save_steps=1)
    result = train(str(recipe), *NO_TENSORBOARD)
    assert result.exit_code == 0, result.output
    return tmp / "out"


@pytest.fixture
def ro_run(tmp_path, finished):
    """A copy of the finished run on a tmpfs remounted read-only: tmp_path/disk/out."""
    disk = tmp_path / "disk"
    disk.mkdir()
    _mount(disk)
    try:
        shutil.copytree(finished, disk / "out")
        _remount(disk, "ro")
        yield disk / "out"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def error_lines(result) -> list[str]:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    return [line for line in result.output.splitlines() if line.startswith(("error:", "hint:"))]


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_new_run_in_a_read_only_folder_names_it(tmp_path, tiny_model_dir, ro):
    """The output folder is the read-only mount itself (its parent writable): this one ended in
    OSError's traceback from the manifest's first write."""
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2, extra="")
    before = _listing(tmp_path)
    result = train(str(recipe), "--set", f"training.output_dir={ro}", *NO_TENSORBOARD)
    assert error_lines(result) == [f"error: training.output_dir {ro} cannot be written: Read-only file system",
                                   TRAIN_HINT]
    assert _listing(tmp_path) == before  # no lock file left beside it, nothing anywhere else


def test_a_run_below_a_read_only_folder_names_the_folder(tmp_path, tiny_model_dir, ro):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2)
    out = ro / "runs" / "new"
    result = train(str(recipe), "--set", f"training.output_dir={out}", *NO_TENSORBOARD)
    assert error_lines(result) == [
        f"error: {ro}, the folder that would hold training.output_dir {out}, cannot be written: Read-only file system",
        TRAIN_HINT]


def test_print_launch_into_a_read_only_folder_names_it(tmp_path, tiny_model_dir, ro):
    """--print-launch writes the accelerate config into output_dir (no lock): a traceback before."""
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2)
    result = train(str(recipe), "--print-launch", "--set", f"training.output_dir={ro}", *NO_TENSORBOARD)
    assert error_lines(result) == [f"error: training.output_dir {ro} cannot be written: Read-only file system",
                                   TRAIN_HINT]


def test_resume_and_overwrite_on_read_only_storage_name_the_folder(tmp_path, tiny_model_dir, ro_run):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2, save_steps=1)
    before = _listing(ro_run)
    for flags in (("--resume", "--set", "training.max_steps=3"), ("--overwrite",)):
        result = train(str(recipe), *flags, "--set", f"training.output_dir={ro_run}", *NO_TENSORBOARD)
        assert error_lines(result) == [
            f"error: training.output_dir {ro_run} cannot be written: Read-only file system", TRAIN_HINT]
    assert _listing(ro_run) == before


def test_merge_into_a_read_only_folder_names_it(ro_run, ro):
    result = cli("merge", str(ro_run), "--out", str(ro / "merged"))
    assert error_lines(result) == [
        f"error: {ro}, the folder that would hold --out {ro / 'merged'}, cannot be written: Read-only file system",
        "hint: merge into a folder on writable storage (--out DIR)"]


def test_a_run_on_read_only_storage_is_read_as_any_other(ro_run, tmp_path):
    """generate, runs, show and merge from it (into a writable folder) only read the run."""
    assert cli("generate", str(ro_run), "--prompt", "hi", "--max-new-tokens", "2").exit_code == 0
    listed = cli("runs", str(ro_run.parent))
    assert listed.exit_code == 0 and "finished" in listed.stdout and not listed.stderr, listed.output
    assert cli("show", str(ro_run)).exit_code == 0
    assert cli("merge", str(ro_run), "--out", str(tmp_path / "merged")).exit_code == 0


# `lowvram train` in a child whose run remounts its own disk read-only after step 3, before the
# checkpoint of step 4 (the child's lock stays on the read-only disk: stale once it has exited).
_REMOUNT_AFTER_STEP_3 = """
import subprocess, sys
from transformers import TrainerCallback
from lowvram.train.run import signals

DISK = sys.argv.pop()

class RemountReadOnly(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            subprocess.run(["mount", "-o", "remount,ro", DISK], check=True)

make = signals.make_callbacks
signals.make_callbacks = lambda stop: [*make(stop), RemountReadOnly()]
from lowvram.cli import main
main()
"""


@pytest.mark.slow
def test_storage_that_turns_read_only_mid_run_names_the_folder_and_resumes(tmp_path, tiny_model_dir):
    """The run's disk remounted read-only after step 3 (as ext4's errors=remount-ro does after an
    I/O error): an error naming the run folder; once writable again, --resume finishes the run."""
    disk = tmp_path / "disk"
    disk.mkdir()
    _mount(disk)
    out = disk / "out"
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=4, save_steps=2)
    args = ["train", str(recipe), "--set", f"training.output_dir={out}", *NO_TENSORBOARD]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    try:
        failed = subprocess.run([sys.executable, "-c", _REMOUNT_AFTER_STEP_3, *args, str(disk)], capture_output=True,
                                text=True, timeout=600, env=env)
        assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
        lines = [line for line in failed.stderr.splitlines() if line.startswith(("error:", "hint:"))]
        assert lines[0].startswith(f"error: {out} became read-only while writing {out}/"), lines
        assert lines[1].startswith("hint: check the disk (dmesg) and make it writable again (mount -o remount,rw); "
                                   "the last complete checkpoint checkpoint-2 is intact, then lowvram train"), lines
        _remount(disk, "rw")
        resumed = subprocess.run([sys.executable, "-m", "lowvram", *args, "--resume"], capture_output=True, text=True,
                                 timeout=600, env=env)
        assert resumed.returncode == 0, resumed.stderr
        assert metrics(out)["steps"] == 4 and metrics(out)["resumed_from"] == str(out / "checkpoint-2")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# --------------------------------------------------------------------------------------------
# `lowvram runs` goes on past a damaged run


def test_runs_warns_about_a_damaged_run_by_name_and_exits_0(tmp_path, finished):
    """One run with garbage in metrics.json, one with a FIFO in its place (read, it would block
    the listing for ever: a subprocess with a timeout), one whole: all three listed, two warnings."""
    root = tmp_path / "runs"
    for name in ("good", "garbage", "fifo"):
        shutil.copytree(finished, root / name)
    (root / "garbage" / "metrics.json").write_text('{"steps": 2, "train_')
    (root / "fifo" / "metrics.json").unlink()
    os.mkfifo(root / "fifo" / "metrics.json")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "lowvram", "runs", str(root)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"warning: run fifo: {root}/fifo/metrics.json is damaged: it is a FIFO (named pipe), not an ordinary "
        f"file; `lowvram show {root}/fifo` says how to repair it",
        f"warning: run garbage: {root}/garbage/metrics.json is damaged: not valid JSON (Unterminated string "
        f"starting at: line 1 column 14 (char 13)); `lowvram show {root}/garbage` says how to repair it"]
    rows = {line.split()[1]: line for line in done.stdout.splitlines() if line.startswith("│ ") and line.split()[1] in
            ("good", "garbage", "fifo")}
    assert "finished" in rows["good"] and "damaged" in rows["garbage"] and "damaged" in rows["fifo"], done.stdout
