"""The planner's fitted constants (lowvram.plan.constants): one table, every entry with its
source, read by the terms at call time, and docs/constants.md generated from it."""

from __future__ import annotations

import re
from dataclasses import replace
from fractions import Fraction

import pytest

from lowvram.plan import constants as k
from lowvram.plan.memory.activations import _attention_dropout_bytes
from lowvram.plan.memory.backward import CHUNK_TOKENS, logits_bytes
from lowvram.plan.memory.sharding import (
    layer_weight_bytes,
    root_weight_bytes,
    sharding_overhead_bytes,
)
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.setup import RunSetup, cuda_overheads
from tests.conftest import REPO


def test_every_constant_has_its_source():
    names = [c.name for c in k.CONSTANTS]
    assert len(names) == len(set(names)) and len(names) >= 20
    for c in k.CONSTANTS:
        assert getattr(k, c.name) is c, c.name  # the name it is read by
        for field in ("shown", "meaning", "used_in", "fitted_on", "in_sample", "held_out"):
            assert getattr(c, field).strip(), f"{c.name} has no {field}"
        assert isinstance(c.value, (int, float, Fraction)) and c.value > 0, c.name
        assert c.used_in.split(".")[0] in {"setup", "states", "activations", "backward", "memory", "moe",
                                           "sharding", "request", "dora", "preference", "cards", "tiled", "grpo",
                                           "cross_attention", "images"}, c.name


def test_docs_constants_is_generated_from_the_table():
    path = REPO / "docs" / "constants.md"
    assert path.read_text() == k.markdown_table(), "run `make docs` (python -m lowvram.docs)"
    rows = [line for line in path.read_text().splitlines() if line.startswith("| `")]
    assert [re.match(r"\| `(\w+)`", r).group(1) for r in rows] == [c.name for c in k.CONSTANTS]
    assert all(line.count(" | ") == 6 for line in rows)  # seven cells: no stray "|" in a cell


def test_of_keeps_integer_math():
    assert k.FittedConstant("X", Fraction(3, 8), "", "", "", "", "", "").of(1001) == 1001 * 3 // 8 == 375
    assert k.BACKWARD_SHARE_LORA.of(7) == 3 and k.BACKWARD_SHARE_FULL.of(7) == 1
    assert k.SINK_EAGER_BACKWARD_SOFTMAXES.of(5) == 7  # 3 * 5 // 2
    assert k.FSDP_GATHERED_LAYERS.of(11) == 22


def _setup(**kw) -> RunSetup:
    return RunSetup(model=resolve_model("llama-3.2-1b"), **kw)


def test_terms_read_the_table():
    assert cuda_overheads().context_bytes == k.CUDA_CONTEXT_BYTES.value == 300 * 2**20
    ov = cuda_overheads()
    assert ov.once_fraction == k.ALLOCATOR_ONCE_FRACTION.value == 0.015
    assert ov.churn_fraction == k.ALLOCATOR_CHURN_FRACTION.value == 0.23
    assert ov.churn_fraction_expandable == k.ALLOCATOR_CHURN_FRACTION_EXPANDABLE.value == 0.13
    s = _setup(micro_batch_size=2, seq_len=1024)
    t, v, h = 2048, 128256, 2048
    assert logits_bytes(s) == 12 * t * v
    chunked = replace(s, loss="chunked")
    assert logits_bytes(chunked) == 12 * CHUNK_TOKENS * v + 2 * 2 * t * h + 8 * t
    gpt2 = RunSetup(model=resolve_model("gpt2"), device="cpu", micro_batch_size=2, seq_len=128)
    assert _attention_dropout_bytes(gpt2) == 12 * 12 * 128**2 * 2
    fsdp = _setup(offload="fsdp", gpus=2)
    assert sharding_overhead_bytes(fsdp)[0] == root_weight_bytes(fsdp) + 2 * layer_weight_bytes(fsdp)


@pytest.mark.parametrize("name, value", [("LOGITS_LOSS_BYTES", 13), ("CPU_ATTENTION_DROPOUT_BYTES", 3)])
def test_a_changed_entry_changes_the_term(monkeypatch, name, value):
    """The terms look the table up when they run: one entry is the one place to change."""
    monkeypatch.setattr(k, name, replace(getattr(k, name), value=value))
    assert logits_bytes(_setup(seq_len=100)) == (13 if name == "LOGITS_LOSS_BYTES" else 12) * 100 * 128256
    gpt2 = RunSetup(model=resolve_model("gpt2"), device="cpu", seq_len=64)
    assert _attention_dropout_bytes(gpt2) == (3 if name == "CPU_ATTENTION_DROPOUT_BYTES" else 12) * 12 * 64**2


def test_comments_cite_documents_in_the_repository():
    """No module cites a document that lives outside the repository (the development notes)."""
    outside = re.compile(r"memory-model\.md|stack-notes\.md|STYLE\.md|/work/shared|shared/reference")
    hits = [f"{p.relative_to(REPO)}:{n}" for p in sorted((REPO / "lowvram").rglob("*.py"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if outside.search(line)]
    assert hits == []


def test_every_new_optimizer_has_a_sourced_step_time():
    """GaLore, APOLLO, LOMO, AdaLomo, torchao's AdamW and AdamW in the backward: one entry each, with
    its setup, its arithmetic and its source, and the search's speed key reads that entry."""
    from lowvram import vocab
    from lowvram.plan.choose import techniques as tq

    names = [f.optimizer for f in k.OPTIMIZER_STEP_TIMES]
    assert len(names) == len(set(names))
    assert set(names) == set(vocab.PROJECTED_OPTIMIZERS + vocab.LOMO_OPTIMIZERS + vocab.TORCHAO_OPTIMIZERS
                             + vocab.FUSED_BACKWARD_OPTIMIZERS)
    for f in k.OPTIMIZER_STEP_TIMES:
        assert f.value > 0 and all(getattr(f, a).strip() for a in ("measured_on", "derived", "source")), f
        assert tq.OPTIMIZER_SLOWDOWN[f.optimizer] == f.value
    estimates = {f.optimizer for f in k.OPTIMIZER_STEP_TIMES if f.source.startswith("estimate")}
    assert estimates == {"lomo", "adalomo"}  # the two with no same-batch measurement, said so


def test_step_times_follow_the_published_numbers():
    """The factors are the arithmetic of the cited tables (APOLLO's Table 7, GaLore's Table 11,
    torchtune's and torchao's READMEs), not numbers typed in."""
    s = {f.optimizer: f.value for f in k.OPTIMIZER_STEP_TIMES}
    assert k.apollo_table7_ratio(2.874, 0.173, 0.712) == pytest.approx(3.176, abs=1e-3)  # GaLore, 7B
    assert k.apollo_table7_ratio(0.371, 0.036, 1.069) == pytest.approx(1.204, abs=1e-3)  # GaLore, 1B
    assert k.apollo_table7_ratio(0.051, 0.036, 1.069) == pytest.approx(1.009, abs=1e-3)  # APOLLO, 1B
    assert k.apollo_table7_ratio(0.159, 0.173, 0.712) == pytest.approx(0.989, abs=1e-3)  # APOLLO, 7B
    assert s["galore_adamw"] == s["galore_adamw_layerwise"] == 3.18
    assert s["galore_adamw_8bit"] == round(3.176 * 1.03, 2) == 3.27
    assert s["galore_adamw_8bit_layerwise"] == round(3.176 * 1.03 * 1109.38 / 1019.63, 2) == 3.56
    assert s["apollo_adamw"] == s["apollo_adamw_layerwise"] == 1.0
    assert s["adamw_in_backward"] == round(7210 / 7309, 2) == 0.99
    assert s["adamw_torch_8bit"] == s["adamw_torch_4bit"] == round(3200 / 2900, 2) == 1.1
    # where two forms rank on speed alone (request.optimizer_given_up) the order is the tables':
    # APOLLO before GaLore, 32-bit GaLore before 8-bit, the whole step before the per-layer one
    assert s["apollo_adamw"] < s["galore_adamw"] < s["galore_adamw_8bit"]
    assert s["apollo_adamw_layerwise"] < s["galore_adamw_layerwise"] < s["galore_adamw_8bit_layerwise"]


def test_docs_constants_lists_the_step_times():
    text = (REPO / "docs" / "constants.md").read_text()
    section = text[text.index("## Step-time factors of the optimizers"):]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| optimizer")]
    assert [r.split(" | ")[0][2:] for r in rows] == [f.optimizer for f in k.OPTIMIZER_STEP_TIMES]
