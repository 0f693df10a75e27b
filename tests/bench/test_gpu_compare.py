"""GPU numbers compared like with like (issue 13, item 5), on the CPU with a faked ``torch.cuda``:
detection of two cards with different free memory, the budget from the tightest card used, the
CUDA context counted once, and the run summary's three pairs (tensors vs max_memory_allocated,
tensors + slack vs max_memory_reserved, context vs what mem_get_info shows beyond reserved) in
the table and in --json."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import transformers.trainer_callback  # noqa: F401 - imported before torch.cuda is faked (its import probes CUDA)

from lowvram import gpumemory
from lowvram.metrics import RunMetrics
from lowvram.plan.choose.request import safety_margin_bytes
from lowvram.plan.setup import cuda_overheads
from lowvram.plan.types import Plan
from lowvram.report import training as report
from lowvram.train.types import RunResult

GiB, MiB = 2**30, 2**20
REAL_CONTEXT = 500 * MiB  # what the fake driver takes for a context: not the plan's 300 MiB


class FakeCuda:
    """Two cards, a driver whose mem_get_info creates the context first (as CUDA does), and the
    caching allocator's counters. Counts every mem_get_info call."""

    def __init__(self, free=(20 * GiB, 10 * GiB), total=24 * GiB):
        self.total = total
        self.free_before = list(free)  # free memory before this process touched the card
        self.context = [False] * len(free)
        self.calls = [0] * len(free)
        self.allocated_peak = self.reserved_peak = self.reserved = 0

    def mem_get_info(self, i=None):
        i = 0 if i is None else i
        self.calls[i] += 1
        self.context[i] = True
        return self.free_before[i] - REAL_CONTEXT - self.reserved * (i == 0), self.total

    def get_device_properties(self, i):
        return SimpleNamespace(name=f"Fake GPU {i}", major=8, minor=6, total_memory=self.total)

    def reset_peak_memory_stats(self, *a):
        self.allocated_peak = self.reserved_peak = 0

    def install(self, monkeypatch):
        import torch

        import lowvram.hardware as hardware

        # The faked torch.cuda lives in this process: the probe reads it here, not in a child.
        monkeypatch.setattr(hardware, "probe_cuda",
                            lambda indices=None: hardware.devices_from(hardware.read_cards(None if indices is None else list(indices))))

        for name, fn in {
            "is_available": lambda: True, "device_count": lambda: len(self.free_before),
            "current_device": lambda: 0, "mem_get_info": self.mem_get_info,
            "get_device_properties": self.get_device_properties,
            "max_memory_allocated": lambda *a: self.allocated_peak,
            "max_memory_reserved": lambda *a: self.reserved_peak,
            "memory_reserved": lambda *a: self.reserved,
            "reset_peak_memory_stats": self.reset_peak_memory_stats,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        return self


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.delenv("LOWVRAM_VRAM", raising=False)
    return FakeCuda().install(monkeypatch)


def test_two_cards_free_read_once_and_the_budget_is_the_tightest_card(cuda):
    from lowvram.hardware import detect_hardware
    from lowvram.planning.budget import make_budget

    hw = detect_hardware()
    assert cuda.calls == [1, 1]  # free memory read once per card
    assert hw.kind == "cuda" and hw.context_in_free and hw.bf16
    free0, free1 = 20 * GiB - REAL_CONTEXT, 10 * GiB - REAL_CONTEXT
    assert [d.free_bytes for d in hw.devices] == [free0, free1]
    assert hw.free_bytes(1) == free0 and hw.free_bytes(2) == free1 and hw.free_bytes(8) == free1
    context = cuda_overheads().context_bytes
    one, two = make_budget(hardware=hw), make_budget(hardware=hw, gpus=2)
    # The context is already out of the free memory: the plan's cuda_context term is added back.
    assert one.vram_bytes == free0 + context and two.vram_bytes == free1 + context
    assert "GPU 1 (Fake GPU 1), the least free of GPUs 0-1" in two.source
    assert "counted once" in two.source
    assert cuda.calls == [1, 1]  # planning read nothing more


def test_a_one_gpu_run_reads_only_its_card(cuda):
    """`lowvram train` on one GPU plans through make_budget(gpus=1): card 1 is never read (no
    context on it, not even in the probe's child), its free memory is unknown and unused."""
    import json

    from lowvram.hardware import detect_hardware, devices_from, read_cards
    from lowvram.planning.budget import make_budget

    budget = make_budget(gpus=1)
    assert cuda.calls == [1, 0]
    assert budget.vram_bytes == 20 * GiB - REAL_CONTEXT + cuda_overheads().context_bytes
    hw = detect_hardware(gpus=1)
    assert [d.free_bytes for d in hw.devices] == [20 * GiB - REAL_CONTEXT, None] and hw.free_bytes(1) is not None
    # What the child prints parses back to the same cards (the probe's JSON round trip).
    assert devices_from(json.loads(json.dumps(read_cards([0])))) == hw.devices


def test_the_context_is_counted_once_in_the_fit(cuda):
    """The plan's peak holds a 300 MiB context term; free memory read after the 500 MiB real
    context holds none. The fit test is then tensors + slack <= free - margin, exactly."""
    from lowvram.hardware import detect_hardware
    from lowvram.planning.entry import make_plan

    hw = detect_hardware()
    choice = make_plan(model="llama-2-7b", hardware=hw, method="lora", seq_len=2048, batch_size=8, gpus=2)
    free1 = 10 * GiB - REAL_CONTEXT
    b = choice.plan.breakdown
    context = cuda_overheads().context_bytes
    assert b["cuda_context"] == context
    assert choice.budget.usable_bytes == free1 + context - safety_margin_bytes(free1 + context)
    assert choice.fits and choice.plan.predicted_peak_bytes - context <= free1 - safety_margin_bytes(free1 + context)
    # Taken off twice (the budget = free memory, the peak with its context term), the usable
    # budget would be smaller by the whole modelled context.
    twice = safety_margin_bytes(free1)
    assert choice.budget.usable_bytes - (free1 - twice) == context - (safety_margin_bytes(free1 + context) - twice)


def test_a_hand_built_free_size_keeps_its_context():
    """A Hardware built by hand (or a --vram size) still holds the context: the budget is as given."""
    from lowvram.hardware import Device, Hardware
    from lowvram.planning.budget import make_budget

    hw = Hardware("cuda", (Device(0, "A", 24 * GiB, 12 * GiB, (8, 6), True), Device(1, "B", 24 * GiB, 9 * GiB, (8, 6), True)))
    assert not hw.context_in_free
    assert make_budget(hardware=hw).vram_bytes == 12 * GiB
    assert make_budget(hardware=hw, gpus=2).vram_bytes == 9 * GiB


BREAKDOWN = {"weights": 600 * MiB, "gradients": 100 * MiB, "optimizer": 200 * MiB, "activations": 90 * MiB,
             "logits": 34 * MiB, "cuda_context": 300 * MiB, "allocator": 120 * MiB}
TENSORS = 1024 * MiB  # the first five


def _plan() -> Plan:
    return Plan(device="cuda", mixed_precision="bf16", gradient_checkpointing=False, micro_batch_size=1,
                grad_accum=1, lora=True, quantization="none", optimizer="adamw", offload="none",
                attention="sdpa", loss="standard", predicted_peak_bytes=sum(BREAKDOWN.values()),
                budget_bytes=20 * GiB, breakdown=BREAKDOWN)


def _measured_run(cuda) -> dict:
    """A run's counters: a logging interval peaks at 1.05 GiB allocated (the history resets the
    peak), the rest at less; at the end the allocator reserves 1.1 GiB and the driver shows
    400 MiB more in use than that (context and kernels)."""
    from lowvram.livebytes import memory_history_callback
    from lowvram.train.run.run import _peak_memory

    history = memory_history_callback("cuda")
    cuda.allocated_peak, cuda.reserved_peak = int(1.05 * GiB), int(1.25 * GiB)
    history.on_log(None, SimpleNamespace(global_step=1), None)
    cuda.allocated_peak, cuda.reserved_peak, cuda.reserved = 900 * MiB, 1100 * MiB, 1100 * MiB
    cuda.free_before[0] = cuda.total - 400 * MiB + REAL_CONTEXT  # total - free - reserved = 400 MiB
    return _peak_memory(_plan(), None, history, BREAKDOWN)


def test_summary_compares_like_with_like(cuda, capsys):
    m = _measured_run(cuda)
    assert cuda.calls[0] == 1  # mem_get_info read once, at the end
    assert m["peak_memory_bytes"] == int(1.05 * GiB) and m["peak_reserved_bytes"] == int(1.25 * GiB)
    assert m["beyond_reserved_bytes"] == 400 * MiB
    rows = {r["what"]: r for r in m["memory_comparison"]}
    assert [r["what"] for r in m["memory_comparison"]] == [gpumemory.TENSORS, gpumemory.RESERVED,
                                                           gpumemory.CONTEXT, gpumemory.DEVICE]
    t, r, c, d = (rows[k] for k in (gpumemory.TENSORS, gpumemory.RESERVED, gpumemory.CONTEXT, gpumemory.DEVICE))
    assert (t["predicted_bytes"], t["measured_bytes"], t["measured_by"]) == (TENSORS, int(1.05 * GiB), "max_memory_allocated")
    assert t["error"] == pytest.approx(0.05, abs=1e-4)
    assert (r["predicted_bytes"], r["measured_bytes"]) == (TENSORS + 120 * MiB, int(1.25 * GiB))
    assert r["error"] == pytest.approx(1.25 * 1024 / 1144 - 1, abs=1e-4)
    assert (c["predicted_bytes"], c["measured_bytes"]) == (300 * MiB, 400 * MiB)
    assert c["error"] == pytest.approx(1 / 3, abs=1e-4)
    assert (d["predicted_bytes"], d["measured_bytes"]) == (sum(BREAKDOWN.values()), int(1.25 * GiB) + 400 * MiB)
    assert not any(x["gpu_calibrated"] for x in m["memory_comparison"])  # none measured on a GPU here

    result = RunResult(output_dir="/nonexistent",
                       metrics=RunMetrics.from_dict({"steps": 1, "predicted_peak_bytes": sum(BREAKDOWN.values()), **m}))
    report.show_train_result(result)
    out, err = capsys.readouterr()
    assert "Memory: predicted vs measured, like with like" in out
    lines = out.splitlines()
    for part, *cells in (("tensors ", "1.00 GiB", "1.05 GiB", "max_memory_allocated", "+5.0%"),
                         ("tensors + slack", "1.12 GiB", "1.25 GiB", "max_memory_reserved", "+11.9%"),
                         ("CUDA context", "300.0 MiB", "400.0 MiB", "total - free - reserved", "+33.3%"),
                         ("whole card", "1.41 GiB", "1.64 GiB", "reserved peak + beyond", "+16.3%")):
        row = next(line for line in lines if part in line)
        assert all(c in row for c in cells), (row, cells)
    assert "not yet calibrated on a GPU" in out
    # The tensors are 5% above their prediction: no warning. Compared with the whole predicted
    # peak (context and slack included) the same run used to read -26% and warn.
    assert "off the predicted" not in err
    report.show_train_result(result, as_json=True)
    data = json.loads(capsys.readouterr().out)
    assert data["metrics"]["memory_comparison"] == m["memory_comparison"]
    assert data["metrics"]["memory_comparison"][2]["measured_bytes"] == 400 * MiB


def test_the_warning_is_about_tensors(cuda, capsys):
    m = _measured_run(cuda)
    over = [dict(r) for r in m["memory_comparison"]]
    over[0].update(measured_bytes=int(1.3 * TENSORS), error=0.3)
    report.show_train_result(RunResult(output_dir="/nonexistent", metrics=RunMetrics.from_dict({**m, "memory_comparison": over})))
    err = capsys.readouterr().err
    assert "measured peak 1.30 GiB is +30% off the predicted 1.00 GiB" in err
