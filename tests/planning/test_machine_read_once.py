"""One pass from the flags to a Budget (issue 43 item 3): a command reads the machine once
(planning.budget.read_machine) and hands it down: the cards at most once (detect_hardware, the
real one, counted), the host RAM once, even for the seven cards of the context table. `lowvram
train --dry-run` is counted in tests/cli/test_cli.py (its dry-run test)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import lowvram.hardware
from lowvram.cli import app


@pytest.fixture
def reads(monkeypatch):
    """Counts of the real detect_hardware and host_memory calls of one command."""
    counts = {"detect_hardware": 0, "host_memory": 0}
    for name in counts:
        real = getattr(lowvram.hardware, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(lowvram.hardware, name, counted)
    monkeypatch.delenv("LOWVRAM_HOST_RAM", raising=False)  # conftest sets it: read the machine's
    monkeypatch.delenv("LOWVRAM_VRAM", raising=False)
    return counts


def _run(*args: str) -> None:
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 0, r.output


def test_plan_for_a_card_size_reads_no_card_and_the_host_once(reads):
    _run("plan", "--model", "llama-3.1-8b", "--vram", "12GB", "--json")
    assert reads == {"detect_hardware": 0, "host_memory": 1}


def test_the_context_table_reads_the_host_once_for_seven_cards(reads):
    _run("plan", "--model", "qwen2.5-0.5b", "--method", "qlora", "--context-table", "--json")
    assert reads == {"detect_hardware": 0, "host_memory": 1}


def test_plan_without_a_size_reads_the_cards_once(reads):
    _run("plan", "--model", "qwen2.5-0.5b", "--json")
    assert reads["detect_hardware"] == 1 and reads["host_memory"] == 1  # detect_hardware reads it
