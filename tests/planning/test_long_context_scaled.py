"""bench/long_context_scaled.py end to end (issue 26, item 6): a row of the README's context table
(Llama-3.1-8B QLoRA r=32, batch 1, --offload none) has its plan's techniques run at 1/16 width
through lowvram's run_training on the CPU, within the plan-truth target of the scaled plan. The
12 GB row (1,654 scaled tokens, 7 tiled-MLP shards) in the default suite; the bench's own rows
are in bench/results/long_context_scaled.txt."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # `make test-all`: about a minute of CPU training
def test_a_context_table_row_runs_at_scaled_shapes_within_its_plan(monkeypatch, tmp_path):
    pytest.importorskip("torchao")
    pytest.importorskip("bitsandbytes")
    spec = importlib.util.spec_from_file_location("long_context_scaled", REPO / "bench" / "long_context_scaled.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    out = tmp_path / "out.txt"
    monkeypatch.setattr(sys, "argv", ["long_context_scaled.py", "--cards", "12", "--steps", "2", "--out", str(out)])
    import torch

    threads = torch.get_num_threads()
    try:
        assert bench.main() == 0  # one torch thread (--threads 1): two crawl on a shared 2-core machine
    finally:
        torch.set_num_threads(threads)
    text = out.read_text()
    row = next(line for line in text.splitlines() if line.strip().startswith("12 GB"))
    real_len, run_len = (int(x.replace(",", "")) for x in row.split()[2:4])
    assert run_len == round(real_len * 256 / 4096)  # seq_len / hidden kept from the real row
    for technique in ("QLoRA nf4-dq", "checkpointing", "tiled MLP", "adamw_torch_4bit", "chunked"):
        assert technique in row
    assert row.split()[8] == "yes" and "1 of 1 within the plan-truth target" in text
