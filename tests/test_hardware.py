"""The cards are read in a child process (issue 24 item 6): the process that plans and launches
the workers keeps no CUDA context while they train, and a run reads only the cards it uses.

On this CPU machine the child really runs (this interpreter, torch, lowvram.hardware.read_cards)
and really answers: no card. ``torch.cuda.is_available`` is faked True in this process only, so
detection takes its CUDA branch; every torch.cuda call that would read a card or create a
context here raises. What a CPU cannot show is said in tests/bench/test_gpu_compare.py's FakeCuda tests
(which card is read) and in the issue's report (the driver's side)."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from lowvram import hardware
from lowvram.cli import app
from lowvram.errors import LowvramError


@pytest.fixture
def cuda_here_is_forbidden(monkeypatch):
    import torch

    def forbidden(*args, **kwargs):
        raise AssertionError("the launching process touched CUDA")

    monkeypatch.delenv("LOWVRAM_VRAM", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("device_count", "mem_get_info", "get_device_properties", "set_device", "init", "current_device"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    yield
    assert not torch.cuda.is_initialized()


def test_detection_reads_the_cards_in_a_child_process(cuda_here_is_forbidden):
    hw = hardware.detect_hardware(gpus=1)
    assert hw.kind == "cuda" and hw.devices == () and hw.context_in_free  # the child saw no card here


def test_the_launcher_path_touches_no_card_in_this_process(cuda_here_is_forbidden, tmp_path, tiny_model_dir):
    from tests.train.test_e2e import write_recipe

    recipe = write_recipe(tmp_path, tiny_model_dir, steps=1)
    result = CliRunner().invoke(app, ["train", str(recipe), "--gpus", "2"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "error: --gpus 2 but this machine has 0 visible CUDA GPU(s)" in result.output  # the child's count


def test_a_probe_that_cannot_run_is_an_error_with_a_hint(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(LowvramError) as e:
        hardware.probe_cuda([0])
    assert "cannot read the GPUs' memory" in e.value.message and "exit 1" in e.value.message
    assert "-c 'import torch; print(torch.cuda.mem_get_info())'" in e.value.hint
