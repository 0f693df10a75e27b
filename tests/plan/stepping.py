"""Measuring one optimizer step's bytes with lowvram's live-bytes tracker (shared by the
optimizer tests: GaLore, APOLLO)."""

from __future__ import annotations

from typing import NamedTuple


class StepBytes(NamedTuple):
    """Live tensor bytes around one ``opt.step()``: before it, at its peak and after it."""

    before: int
    peak: int
    after: int


def measure_steps(p, opt, steps: int) -> list[StepBytes]:
    """``steps`` steps of ``opt`` over the one parameter ``p``, each with a fresh random gradient,
    each measured by its own tracker (the parameter, its gradient and the optimizer's state
    registered as already alive)."""
    import torch

    from lowvram.livebytes import LiveBytes

    measured = []
    for _ in range(steps):
        p.grad = torch.randn_like(p)
        tracker = LiveBytes()
        tracker.register(p, p.grad, opt)
        with tracker:
            before = tracker.current_bytes
            opt.step()
            measured.append(StepBytes(before, tracker.peak_bytes, tracker.current_bytes))
    return measured
