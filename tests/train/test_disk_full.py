"""A full disk on a real filesystem (issue 24, item 12): the run's folder on a small tmpfs that
fills up in the middle of a checkpoint or of the final save. `lowvram train` must end with one
`error:` line naming the file that did not fit and a `hint:`, exit 1, no traceback, the partial
checkpoint removed; after space is freed, `--resume` finishes the run.

The disk is filled for real while the run trains: a TrainerCallback writes a filler file that
leaves room for exactly the files written before the target and half of the target (sized from
the run's own earlier checkpoint on the same tmpfs, its files in the order their mtimes give).
Needs root to mount the tmpfs; skipped otherwise. Earlier tests patched the writers and missed
the Rust writers' errors (safetensors' SafetensorError, tokenizers' plain Exception).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lowvram.train.run import recover, signals
from lowvram.train.run.checkpoints import complete_checkpoints
from tests.train.test_e2e import metrics, train, write_recipe

PAGE = os.sysconf("SC_PAGE_SIZE")
NO_TENSORBOARD = ("--set", "training.report_to=none")  # its event file grows with every log line


@pytest.fixture
def tmpfs(tmp_path):
    """tmp_path/out on a 4 MiB tmpfs (the tiny run needs under 1 MiB), unmounted afterwards."""
    out = tmp_path / "out"
    out.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(out)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield out
    finally:
        subprocess.run(["umount", "-l", str(out)], check=False)


def _pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _room_for(folder: Path, target: str) -> int:
    """Bytes of the files ``folder`` wrote before ``target``, plus half of ``target``, in pages.
    loss.png (written after the final weights, not in a checkpoint): room for the final files,
    the manifest's rewrite and 4 of the plot's ~13 pages."""
    files = sorted((p for p in folder.iterdir() if p.is_file()), key=lambda p: p.stat().st_mtime_ns)
    names = [p.name for p in files]
    if target == "loss.png":  # the final save writes what Trainer.save_model writes: up to training_args.bin
        final = files[:names.index("training_args.bin") + 1]
        manifest = folder.parent / "lowvram-run.json"
        return sum(_pages(p.stat().st_size) for p in final) + _pages(manifest.stat().st_size) + 4 * PAGE
    i = names.index(target)
    return sum(_pages(p.stat().st_size) for p in files[:i]) + _pages(files[i].stat().st_size) // PAGE // 2 * PAGE


def _fill(out: Path, room: int) -> None:
    st = os.statvfs(out)
    with (out / "filler").open("wb") as f:
        f.write(b"\0" * (st.f_bavail * st.f_frsize - room))


def _fill_the_disk(monkeypatch, out: Path, target: str, final: bool) -> None:
    """Fill ``out`` before checkpoint-4 (from checkpoint-2's sizes) or before the final save (from
    checkpoint-4's), leaving room up to the middle of ``target``."""
    from transformers import TrainerCallback

    class FillTheDisk(TrainerCallback):
        # After the run's own callbacks: checkpoint-4 is recorded in the manifest (on_step_end)
        # or marked complete (on_save) before the disk fills.
        def on_step_end(self, args, state, control, **kwargs):
            if not final and state.global_step == 4:
                _fill(out, _room_for(out / "checkpoint-2", target))

        def on_save(self, args, state, control, **kwargs):
            if final and state.global_step == 4:
                _fill(out, _room_for(out / "checkpoint-4", target))

    make = signals.make_callbacks
    monkeypatch.setattr(signals, "make_callbacks", lambda stop: [*make(stop), FillTheDisk()])


def _full_disk_then_resume(tmp_path, tiny_model_dir, monkeypatch, out, target, final):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=4, save_steps=2)
    _fill_the_disk(monkeypatch, out, target, final)
    result = train(str(recipe), *NO_TENSORBOARD)  # asserts no "Traceback"
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # no exception escaped the CLI
    lines = [line for line in result.output.splitlines() if line.startswith(("error:", "hint:"))]
    kept, where = ("checkpoint-4", out / target) if final else ("checkpoint-2", out / "checkpoint-4" / target)
    gone = "" if final else " (removed the partial checkpoint-4)"
    cmd = recover.resume_command(recipe, [NO_TENSORBOARD[1]])
    assert lines == [f"error: disk full while writing {where}{gone}",
                     f"hint: free space on that disk (df -h {out}); the last complete checkpoint {kept} is "
                     f"intact, then {cmd}"], result.output
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-2", *(["checkpoint-4"] if final else [])]
    assert not (out / "checkpoint-4").exists() or final
    assert not (out / "metrics.json").exists() and not list(out.glob(".final-*"))

    monkeypatch.undo()  # the disk fills no more
    (out / "filler").unlink()  # the user frees space
    resumed = train(str(recipe), "--resume", *NO_TENSORBOARD)
    assert resumed.exit_code == 0, resumed.output
    m = metrics(out)
    assert m["steps"] == 4 and m["resumed_from"] == str(out / kept)
    assert (out / "adapter_model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def test_disk_full_in_a_checkpoints_tokenizer_on_a_real_tmpfs_is_an_error_and_resumes(
        tmp_path, tiny_model_dir, monkeypatch, tmpfs):
    """The failure a new user met: tokenizers' Tokenizer.save raises a plain
    ``Exception: No space left on device (os error 28)`` inside the Trainer's checkpoint."""
    _full_disk_then_resume(tmp_path, tiny_model_dir, monkeypatch, tmpfs, "tokenizer.json", final=False)


def test_disk_full_in_the_final_adapter_on_a_real_tmpfs_is_an_error_and_resumes(
        tmp_path, tiny_model_dir, monkeypatch, tmpfs):
    """safetensors' SafetensorError, and the final files are written into a temporary folder that
    is gone when the error is shown: the error names the file as it would be in the run folder."""
    _full_disk_then_resume(tmp_path, tiny_model_dir, monkeypatch, tmpfs, "adapter_model.safetensors", final=True)


@pytest.mark.slow
@pytest.mark.parametrize("target,final", [("adapter_model.safetensors", False), ("optimizer.pt", False),
                                          ("trainer_state.json", False), ("tokenizer.json", True),
                                          ("loss.png", True)])
def test_disk_full_on_every_write_on_a_real_tmpfs(tmp_path, tiny_model_dir, monkeypatch, tmpfs, target, final):
    _full_disk_then_resume(tmp_path, tiny_model_dir, monkeypatch, tmpfs, target, final)


def test_disk_full_while_merging_on_a_real_tmpfs_is_an_error_and_keeps_nothing(tmp_path, tiny_model_dir, tmpfs,
                                                                                  monkeypatch):
    """`lowvram merge --out` on a disk without room for the merged weights (the tiny model's
    model.safetensors is ~0.4 MiB; 4 MiB minus a filler leaves 64 KiB): refused by merge's plan
    before anything loads, with the figures; and where the disk fills between the plan and the
    write (another program writing: the plan's free-space reading is made to predate the filler),
    the real write's ENOSPC is the disk-full error, and nothing of it is kept."""
    from lowvram.train.after import footprint
    from tests.train.test_after_training import cli

    run = tmp_path / "run"
    run.mkdir()
    recipe = write_recipe(run, tiny_model_dir, steps=1)
    assert train(str(recipe), *NO_TENSORBOARD).exit_code == 0
    _fill(tmpfs, 64 * 1024)
    merged = tmpfs / "merged"
    planned = cli("merge", str(run / "out"), "--out", str(merged))
    assert planned.exit_code == 1 and isinstance(planned.exception, SystemExit), planned.output
    assert f"error: merge needs 0.6 MiB of disk in {tmpfs}" in planned.output and "0.1 MiB free" in planned.output
    assert "hint: free space there, or merge to a disk with room for it (--out)" in planned.output
    assert sorted(p.name for p in tmpfs.iterdir()) == ["filler"]

    monkeypatch.setattr(footprint, "disk_free", lambda path: (tmpfs, 4 * 1024 * 1024))  # read before the filler
    result = cli("merge", str(run / "out"), "--out", str(merged))
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = [line for line in result.output.splitlines() if line.startswith(("error:", "hint:"))]
    assert lines == [f"error: disk full while writing {merged}/model.safetensors (the merged model did not fit; "
                     "nothing of it was kept)",
                     f"hint: free space on that disk (df -h {tmpfs}) and merge again, or merge to a disk with room "
                     "for it (--out)"], result.output
    assert sorted(p.name for p in tmpfs.iterdir()) == ["filler"]


def test_quota_and_the_rust_writers_words_count_as_disk_full():
    """EDQUOT as an OSError and in the Rust writers' text (errno 122 on Linux), any exception
    class; the torch serializer's own words only from a RuntimeError (they are not the OS's)."""
    import errno

    from lowvram.train.diskfull import is_disk_full

    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(Exception("Disk quota exceeded (os error 122)"))  # tokenizers' Tokenizer.save
    assert is_disk_full(ValueError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert not is_disk_full(ValueError("unexpected pos 12 vs 10"))
    assert not is_disk_full(Exception("Error while deserializing header: invalid header length"))
