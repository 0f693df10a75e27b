"""bench/gpu_check.py, the prepared GPU memory check, kept working without a GPU.

Its --dry-run runs the same code (build once per technique, warm-up step, measured step,
summary, JSON) on CPU with a tiny Llama, measuring live tensor bytes instead of the CUDA
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


@pytest.mark.slow  # ~1 min on 2 cores (make test-all); the failing-row test below runs the dry run on 3 rows
def test_dry_run_measures_every_technique_at_both_lengths(tmp_path, monkeypatch, capsys):
    pytest.importorskip("bitsandbytes")
    gc = _load()
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gc.main(["--dry-run"]) == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = data["rows"]
    assert {r["technique"] for r in rows} == {name for name, _ in gc.TECHNIQUES}
    assert len(rows) == 2 * len(gc.TECHNIQUES)
    for r in rows:
        assert "allocated" in r, r
        err = (r["predicted_tensors"] - r["allocated"]) / r["allocated"]
        assert abs(err) <= 0.03, r  # the CPU model is exact to a few tenths of a percent here
        assert r["predicted"] == r["predicted_tensors"]  # no CUDA overheads on CPU
    by = {(r["technique"], r["seq_len"]): r["allocated"] for r in rows}
    assert by[("full bf16", 128)] > by[("full bf16", 64)]  # the second length really ran
    out = capsys.readouterr().out
    assert "suggested cuda_overheads(): context_bytes=0" in out
    assert f"cases measured: {len(rows)} of {len(rows)}" in out


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

    def flaky(probe, spec, kw, seq_lens, saved):
        rows = real(probe, spec, kw, seq_lens, saved)
        if kw.get("optimizer") == "adafactor":  # the first length measured, then the second breaks
            yield next(rows)
            raise RuntimeError("CUDA Setup failed despite GPU being available")
        yield from rows

    monkeypatch.setattr(gc, "run_technique", flaky)
    # the failing row and the rows around it (the whole dry run is the test above)
    keep = ("full bf16 adafactor", "lora bf16")
    monkeypatch.setattr(gc, "TECHNIQUES", [t for t in gc.TECHNIQUES if t[0] in keep])
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gc.main(["--dry-run"]) == 0
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    broken = [r for r in rows if r["technique"] == "full bf16 adafactor"]
    assert [r["seq_len"] for r in broken] == [64, 128]
    assert "allocated" in broken[0]  # written as it came, before the second length failed
    assert broken[1]["error"].startswith("RuntimeError: CUDA Setup failed")
    assert sum("allocated" in r for r in rows) == len(rows) - 1


def test_nothing_measured_is_a_failure(tmp_path, monkeypatch, capsys):
    # issue 24 item 11: every row failed and the script still exited 0 ("no case measured")
    gc = _load()

    def broken(probe, spec, kw, seq_lens, saved):
        raise ModuleNotFoundError("No module named 'pydantic'")
        yield  # a generator, as the real one

    monkeypatch.setattr(gc, "run_technique", broken)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gc.main(["--dry-run", "--only", "lora bf16"]) == 1
    captured = capsys.readouterr()
    assert "# no case measured" in captured.out
    assert "error: no case measured" in captured.err
    assert captured.out.index("# versions: python ") < captured.out.index("# gpu_check ")
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [r["error"] for r in rows] == ["ModuleNotFoundError: No module named 'pydantic'"] * 2


def _gpu_check_sh(tmp_path, *args):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable,
               LOWVRAM_SITE=str(tmp_path / "site"), LOWVRAM_WHEELS=str(tmp_path))  # no wheels here
    return subprocess.run(["bash", str(SCRIPT.with_suffix(".sh")), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_shell_script_prints_versions_then_measures_row_by_row(tmp_path):
    done = _gpu_check_sh(tmp_path, "--dry-run", "--only", "lora bf16")
    assert done.returncode == 0, done.stdout + done.stderr
    out = (tmp_path / "gpu_check.txt").read_text()
    assert out.index("# versions: python ") < out.index("# gpu_check ") < out.index("lora bf16")
    assert "transformers " in out and "bitsandbytes " in out and "pydantic " in out
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [(r["technique"], r["seq_len"]) for r in rows] == [("lora bf16", 64), ("lora bf16", 128)]
    assert all("allocated" in r for r in rows)


def test_the_shell_script_passes_a_failure_through_tee(tmp_path):
    # set -o pipefail: without it `python ... | tee` exits with tee's 0 whatever python returned
    done = _gpu_check_sh(tmp_path, "--dry-run", "--only", "no such technique")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: no technique 'no such technique'" in (tmp_path / "gpu_check.txt").read_text()
