"""lowvram.check.step: the measured Trainer step saves nothing (issue 41 item 6)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def test_a_measured_trainer_step_writes_no_checkpoint(monkeypatch):
    """transformers' DefaultFlowCallback saves at the last step when the save strategy is "steps"
    (trainer_callback.py on_step_end): every case of the GPU check wrote weights, optimizer state,
    scheduler and RNG after its measurement. The real Trainer runs; its save is watched."""
    from transformers import Trainer

    from lowvram.check.cases import tiny_llama_spec
    from lowvram.check.step import measure_setup
    from lowvram.plan.setup import RunSetup

    saves = []
    real = Trainer._save_checkpoint

    def watched(self, *args, **kwargs):
        saves.append(self.args.output_dir)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_save_checkpoint", watched)
    setup = RunSetup(tiny_llama_spec(hidden_size=64, num_layers=1, vocab_size=256), seq_len=32,
                     precision="bf16", lora=True)
    step = measure_setup(setup)
    assert step.peak_bytes > 0  # the step was measured
    assert saves == []
