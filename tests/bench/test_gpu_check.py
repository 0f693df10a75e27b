"""bench/gpu_check.py, the prepared GPU memory check, kept working without a GPU.

Its --dry-run runs the same code (every case of its plan: build once per case, warm-up step,
measured step, the child processes, summary, JSON) on CPU with a tiny Llama, measuring live tensor bytes instead of the CUDA
allocator; so the first GPU run does not fail on something a CPU could have caught.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _no_saved_model(*folders):
    """No checkpoint-* folder and no model or optimizer file anywhere under ``folders``."""
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            assert not [d for d in dirs if d.startswith("checkpoint-")], (root, dirs)
            assert not [f for f in files if f.endswith((".safetensors", ".bin", ".pt", ".pth"))], (root, files)


def _dry_run(gc, tmp_path, monkeypatch, *args):
    """The dry run with its Trainer folders under tmp_path/scratch and every temporary folder
    (a QLoRA base used to be saved to one) under tmp_path/tmp, both kept to be looked at."""
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the children's
    monkeypatch.setenv("OUT", str(tmp_path))
    code = gc.main(["--dry-run", "--scratch", str(tmp_path / "scratch"), *args])
    return code, json.loads((tmp_path / "gpu_check.json").read_text())["rows"]


@pytest.mark.slow  # ~3 min on 2 cores (make test-all); the fast test below runs three of the cases
def test_dry_run_measures_every_case_of_the_plan_and_saves_nothing(tmp_path, monkeypatch, capsys):
    pytest.importorskip("bitsandbytes")
    gc = _load()
    code, rows = _dry_run(gc, tmp_path, monkeypatch)
    assert code == 0
    plan = gc.plan_cases(cuda=False)
    assert [r["case"] for r in rows] == [c.name for c in plan for _ in c.seq_lens]
    for r in rows:
        assert "allocated" in r or "outside_allocator" in r, r
        assert r["written_bytes"] == 0 and r["written_files"] == [], r
        if "allocated" in r:
            err = (r["predicted_tensors"] - r["allocated"]) / r["allocated"]
            assert abs(err) <= 0.03, r  # the CPU model is exact to a few tenths of a percent here
            assert r["predicted"] == r["predicted_tensors"]  # no CUDA overheads on CPU
    by = {(r["case"], r["seq_len"]): r["allocated"] for r in rows if "allocated" in r}
    assert by[("qlora 7b", 128)] > by[("qlora 7b", 64)]  # the second length really ran
    assert [r["expandable_segments"] for r in rows if r["kind"] == "churn"] == [False]
    _no_saved_model(tmp_path)
    out = capsys.readouterr().out
    assert f"cases measured: {len(rows)} of {len(rows)}" in out


def test_the_plan_fits_one_device_call_most_informative_first():
    """issue 41 item 6: one call of at most 8 minutes on either lent kind, the QLoRA rows first,
    then the allocator's churn without expandable segments, the memory outside the allocator, and
    each technique's first step; the dry run's plan is the same but for the CUDA-only rows."""
    gc = _load()
    plan = gc.plan_cases(cuda=True)
    assert gc.plan_seconds(plan) <= gc.BUDGET_S <= 8 * 60 - 60  # a minute left for installs and imports
    assert [c.kind for c in plan[:4]] == ["step", "churn", "outside", "outside"]
    assert plan[0].technique.startswith("qlora") and len(plan[0].seq_lens) >= 3
    assert {c.technique for c in plan if c.kind == "step"} >= {t for t, _ in gc.TECHNIQUES + gc.CUDA_TECHNIQUES}
    dry = gc.plan_cases(cuda=False)
    assert [c.name for c in dry] == [c.name for c in plan if c.technique not in dict(gc.CUDA_TECHNIQUES)]


def test_dry_run_cases_save_no_checkpoint_and_no_model_file(tmp_path, monkeypatch):
    """issue 41 item 6: the Trainer of each measured step saved a full checkpoint at its last step
    (DefaultFlowCallback with save_strategy steps), and a QLoRA case saved its random-init base.
    Three cases of the plan (a quantized step, the churn child, the NCCL child) in the dry run."""
    pytest.importorskip("bitsandbytes")
    gc = _load()
    code, rows = _dry_run(gc, tmp_path, monkeypatch, "--only",
                          "first step: qlora nf4-dq + ckpt,churn without expandable segments,outside: one nccl rank")
    assert code == 0
    assert [r["case"] for r in rows] == ["churn without expandable segments", "outside: one nccl rank",
                                         "first step: qlora nf4-dq + ckpt"]
    assert all("allocated" in r or "outside_allocator" in r for r in rows), rows
    assert all(r["written_files"] == [] for r in rows), rows
    _no_saved_model(tmp_path)


def test_a_case_is_not_started_past_the_disk_or_time_budget(tmp_path, monkeypatch):
    gc = _load()
    monkeypatch.setattr(gc, "DISK_RESERVE_BYTES", 2**62)  # more than any disk has free
    code, rows = _dry_run(gc, tmp_path, monkeypatch, "--only", "first step: lora bf16")
    assert code == 1 and rows[0]["skipped"].startswith("disk budget: ")
    monkeypatch.setattr(gc, "DISK_RESERVE_BYTES", 0)
    monkeypatch.setenv("OUT", str(tmp_path / "t"))
    (tmp_path / "t").mkdir()
    assert gc.main(["--dry-run", "--budget-s", "5", "--only", "first step: lora bf16"]) == 1
    rows = json.loads((tmp_path / "t" / "gpu_check.json").read_text())["rows"]
    assert rows[0]["skipped"] == "time budget: ~12 s estimated, 5 s left"


def test_summary_derives_the_overheads_from_measurements():
    gc = _load()
    rows = [
        dict(predicted=1200, predicted_tensors=1000, predicted_once=200, allocated=1000, reserved=1100,
             outside_allocator=600),
        dict(predicted=2300, predicted_tensors=2100, allocated=2000, reserved=2050,
             outside_allocator=700),
        dict(seq_len=2048, skipped="predicted over 90% of the device"),
    ]
    lines = gc.summarize(rows, baseline=100)
    assert lines[0] == "cases measured: 2 of 3"
    assert "worst |error| 5.00%, worst under-prediction +0.00%" in lines[1]
    assert "up to 10.0%" in lines[3]  # (1100 - 1000) / 1000
    # device really used: 1100 + 600 - 100 = 1600 > 1200 predicted; 2050 + 700 - 100 = 2650 > 2300
    assert "2 of 2" in lines[4]
    # the churn share: (1100 - 1000 - 0.015 x 200) / (1000 - 200) = 0.12125, over (2050 - 2000) / 2000
    assert lines[5] == ("suggested cuda_overheads(): context_bytes=600, churn_fraction_expandable=0.121 "
                        "(once_fraction 0.015 kept)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_it_says_so(capsys):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    assert _load().main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no CUDA GPU") and "hint: run with --dry-run" in err


def test_a_failing_row_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    gc = _load()
    real = gc.run_technique

    def flaky(probe, spec, kw, seq_lens, out_dir):
        rows = real(probe, spec, kw, seq_lens, out_dir)
        if kw.get("optimizer") == "adafactor":  # the case measured, then it breaks
            yield next(rows)
            raise RuntimeError("CUDA Setup failed despite GPU being available")
        yield from rows

    monkeypatch.setattr(gc, "run_technique", flaky)
    monkeypatch.setattr(gc, "plan_cases", lambda cuda=True: [
        gc.Case("adafactor two lengths", "step", "m", "full bf16 adafactor", (1, 2), 1),
        gc.Case("lora", "step", "m", "lora bf16", (1,), 1)])
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gc.main(["--dry-run"]) == 0
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    broken = [r for r in rows if r["case"] == "adafactor two lengths"]
    assert [r["seq_len"] for r in broken] == [64, 128]
    assert "allocated" in broken[0]  # written as it came, before the second length failed
    assert broken[1]["error"].startswith("RuntimeError: CUDA Setup failed")
    assert sum("allocated" in r for r in rows) == len(rows) - 1


def test_nothing_measured_is_a_failure(tmp_path, monkeypatch, capsys):
    # issue 24 item 11: every row failed and the script still exited 0 ("no case measured")
    gc = _load()

    def broken(probe, spec, kw, seq_lens, out_dir):
        raise ModuleNotFoundError("No module named 'pydantic'")
        yield  # a generator, as the real one

    monkeypatch.setattr(gc, "run_technique", broken)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gc.main(["--dry-run", "--only", "first step: lora bf16"]) == 1
    captured = capsys.readouterr()
    assert "# no case measured" in captured.out
    assert "error: no case measured" in captured.err
    assert captured.out.index("# versions: python ") < captured.out.index("# gpu_check ")
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [r["error"] for r in rows] == ["ModuleNotFoundError: No module named 'pydantic'"]


def _gpu_check_sh(tmp_path, *args):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable,
               LOWVRAM_SITE=str(tmp_path / "site"), LOWVRAM_WHEELS=str(tmp_path))  # no wheels here
    return subprocess.run(["bash", str(SCRIPT.with_suffix(".sh")), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_shell_script_prints_versions_then_measures_row_by_row(tmp_path):
    done = _gpu_check_sh(tmp_path, "--dry-run", "--only", "lora bf16")
    assert done.returncode == 0, done.stdout + done.stderr
    out = (tmp_path / "gpu_check.txt").read_text()
    assert out.index("# versions: python ") < out.index("# gpu_check ") < out.index("first step: lora bf16")
    assert "transformers " in out and "bitsandbytes " in out and "pydantic " in out
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [(r["technique"], r["seq_len"]) for r in rows] == [("lora bf16", 64)]
    assert all("allocated" in r for r in rows)


def test_the_shell_script_passes_a_failure_through_tee(tmp_path):
    # set -o pipefail: without it `python ... | tee` exits with tee's 0 whatever python returned
    done = _gpu_check_sh(tmp_path, "--dry-run", "--only", "no such technique")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: no case or technique 'no such technique'" in (tmp_path / "gpu_check.txt").read_text()


def test_summary_names_the_outside_readings_and_both_churn_shares():
    gc = _load()
    rows = [
        dict(predicted=1200, predicted_tensors=1000, allocated=1000, reserved=1100, outside_allocator=600),
        dict(predicted=1200, predicted_tensors=1000, allocated=1000, reserved=1200, outside_allocator=600,
             expandable_segments=False),
        dict(case="outside: one nccl rank", outside_allocator=900, gpus=1),
    ]
    lines = gc.summarize(rows, baseline=100)
    assert lines[0] == "cases measured: 3 of 3"
    assert lines[1].startswith("outside the allocator, outside: one nccl rank: 0.000 GiB (800 bytes; the plan's cuda_context ")
    assert lines[-1].startswith("suggested cuda_overheads(): context_bytes=500, churn_fraction_expandable=0.100, "
                                "churn_fraction=0.200")
