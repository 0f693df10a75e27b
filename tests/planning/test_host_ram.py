"""--host-ram (issue 26 item 4): host RAM is part of the fit, this machine's available memory by
default, so a plan for another machine is reproducible and a plan that would swap says so."""

import json

from typer.testing import CliRunner

import lowvram.hardware
from lowvram.cli import app
from lowvram.planning.budget import make_budget

GIB = 2**30
FULL_8B = ["plan", "--model", "llama-3.1-8b", "--method", "full", "--seq-len", "2048", "--batch-size", "1",
           "--vram", "24GB", "--optimizer", "adamw"]  # AdamW: only DeepSpeed's optimizer offload fits


def test_the_default_is_this_machines_available_memory(monkeypatch):
    monkeypatch.delenv("LOWVRAM_HOST_RAM", raising=False)
    monkeypatch.setattr(lowvram.hardware, "host_memory", lambda: (64 * GIB, 40 * GIB))
    b = make_budget("24GB")
    assert b.host_ram_bytes == 40 * GIB and b.host_ram_source == "available on this machine"
    b = make_budget("24GB", host_ram="256GiB")
    assert b.host_ram_bytes == 256 * GIB and b.host_ram_source == "--host-ram 256GiB"
    monkeypatch.setenv("LOWVRAM_HOST_RAM", "128GiB")
    assert make_budget("24GB").host_ram_source == "LOWVRAM_HOST_RAM 128GiB"


def test_a_plan_that_would_swap_says_so(monkeypatch):
    """Llama-3.1-8B full fine-tuning on a 24 GB card fits only with DeepSpeed's optimizer offload,
    which keeps 126 GiB in host RAM: with 32 GiB the plan does not fit and says why."""
    r = CliRunner().invoke(app, [*FULL_8B, "--host-ram", "32GiB"])
    assert r.exit_code == 0, r.output
    assert "host RAM: 32.00 GiB (--host-ram 32GiB)" in r.output
    assert "does not fit: the lowest-memory plan peaks at" in r.output
    assert "more than the 32.00 GiB --host-ram 32GiB: it would swap" in " ".join(r.output.split())
    d = json.loads(CliRunner().invoke(app, [*FULL_8B, "--host-ram", "32GiB", "--json"]).stdout)
    assert d["fits"] is False and d["cpu_ram_bytes"] > 32 * GIB and d["host_ram_bytes"] == 32 * GIB


def test_enough_host_ram_and_the_same_plan_on_any_machine(monkeypatch):
    plans = []
    for available in (8 * GIB, 512 * GIB):  # what this machine has does not matter with --host-ram
        monkeypatch.setattr(lowvram.hardware, "host_memory", lambda a=available: (a, a))
        d = json.loads(CliRunner().invoke(app, [*FULL_8B, "--host-ram", "256GiB", "--json"]).stdout)
        plans.append((d["fits"], d["techniques"]["offload"], d["peak_bytes"], d["cpu_ram_bytes"]))
    assert plans[0] == plans[1] and plans[0][:2] == (True, "optimizer")
    assert 120 * GIB < plans[0][3] <= 256 * GIB
