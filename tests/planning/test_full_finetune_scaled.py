"""bench/full_finetune_scaled.py end to end (issue 27, "done when"): the Llama-3.1-8B full
fine-tuning plan for a 24 GiB card (layerwise 8-bit GaLore) has its techniques run at 1/1024 scale
through lowvram's run_training on the CPU, within the plan-truth target of the scaled plan."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_8b_24gib_plan_runs_at_scaled_shapes_within_its_plan(capsys, monkeypatch, tmp_path):
    pytest.importorskip("galore_torch")
    import torch

    spec = importlib.util.spec_from_file_location("full_finetune_scaled", REPO / "bench" / "full_finetune_scaled.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["full_finetune_scaled.py", "--steps", "2", "--out", str(tmp_path / "out.txt")])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two OpenMP threads crawl on a shared 2-core machine
    try:
        assert bench.main() == 0
    finally:
        torch.set_num_threads(threads)
    out = (tmp_path / "out.txt").read_text()
    real, scaled = out.splitlines()[:2]
    assert "llama-3.1-8b, 24 GiB card" in real and "fits" in real and "galore_adamw_8bit_layerwise" in real
    assert "rank 8" in scaled and "galore_adamw_8bit_layerwise" in scaled and "checkpointing" in scaled
    assert "no OOM: yes" in out
