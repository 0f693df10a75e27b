"""One cell of bench/emulated_cards.py end to end (issue 13, item 6): the auto plan for a scaled
Llama-3.2-1B (1/1024) on an emulated 12 GB card (12 MiB) trains through lowvram's run_training
under the live-bytes cap without running out of memory, peaks within 1% of its prediction and
uses at least 70% of its budget."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("emulated_cards", REPO / "bench" / "emulated_cards.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    """The bench's setting (its --threads): two OpenMP threads crawl on a shared 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_one_emulated_cell(bench, tmp_path, one_thread, monkeypatch):
    monkeypatch.delenv("LOWVRAM_EMULATE_VRAM", raising=False)
    name, _real, shape = bench.MODELS[0]
    # two steps: the optimizer state is made in the first, so the second is the steady state planned
    recipe = bench.write_recipe(tmp_path, bench.save_model(tmp_path / "model", shape), steps=2)
    cell = bench.run_cell(recipe, 12, name)
    # with torchao installed (lowvram[torchao]) its 8-bit AdamW, which also quantizes the
    # embedding's moments, lets full fine-tuning fit; without, LoRA
    torchao = importlib.util.find_spec("torchao") is not None
    want = "bf16, full, checkpointing, adamw_torch_8bit, micro-batch 1 x 16" if torchao else "bf16, LoRA, micro-batch 1 x 16"
    assert cell.fits and cell.plan == want
    # The budget: 12 MiB less the 5% margin (its 256 MiB floor scaled by 1/1024 does not bind).
    assert cell.budget_bytes == 12 * 2**20 - int(12 * 2**20 * 0.05)
    assert not cell.oom and cell.measured_bytes is not None
    assert cell.measured_bytes == pytest.approx(cell.predicted_bytes, rel=0.01)
    assert cell.fill >= bench.TARGET and cell.ok
    assert "LOWVRAM_EMULATE_VRAM" not in __import__("os").environ  # the cap is set for the run only
