"""lowvram.vocab: every table keyed by a technique's values covers exactly those values, and the
names it hands to libraries are names those libraries know."""

from __future__ import annotations

import typing

import pytest

from lowvram import vocab
from lowvram.plan.choose import techniques as tq
from lowvram.plan.types import Plan
from lowvram.recipe import TechniquesSection
from lowvram.train.run.launch import BACKENDS


def _literal(section, name: str) -> set:
    return set(typing.get_args(section.model_fields[name].annotation)) - {int}


@pytest.mark.parametrize("name, values", [
    ("mixed_precision", vocab.PRECISIONS), ("quantization", vocab.QUANTIZATIONS),
    ("optimizer", vocab.OPTIMIZERS), ("offload", vocab.OFFLOADS),
])
def test_every_recipe_word_means_a_plan_value(name, values):
    """auto aside, each value a recipe may write is a Plan value once on/off are spelled out."""
    for word in _literal(TechniquesSection, name) - {"auto", vocab.ANY_OPTIMIZER}:  # any-that-fits: a search setting
        on = vocab.ON_VALUES.get(name, values[0])
        assert vocab.on_off(word, on, vocab.OFF_VALUES[name]) in values, (name, word)


def test_recipe_offers_every_plan_value_but_none():
    t = TechniquesSection
    assert _literal(t, "quantization") == {*vocab.SWITCH, *vocab.QUANTIZATIONS} - {"none"}
    assert _literal(t, "offload") == {*vocab.SWITCH, *vocab.OFFLOADS} - {"none"}
    assert _literal(t, "attention") == {"auto", *vocab.ATTENTIONS}
    assert _literal(t, "loss") == {"auto", *vocab.LOSSES}


def test_plan_techniques_are_the_canonical_names():
    plan = Plan(device="cpu", mixed_precision="fp32", gradient_checkpointing=False, micro_batch_size=1,
                grad_accum=1, lora=False, quantization="none", optimizer="adamw", offload="none",
                attention="sdpa", loss="standard")
    assert tuple(plan.techniques()) == vocab.CANONICAL


@pytest.mark.parametrize("table, values", [
    (tq.PRECISION_SLOWDOWN, vocab.PRECISIONS), (tq.QUANTIZATION_SLOWDOWN, vocab.QUANTIZATIONS),
    (tq.OPTIMIZER_SLOWDOWN, vocab.OPTIMIZERS), (tq.OFFLOAD_SLOWDOWN, vocab.OFFLOADS),
    (tq.ATTENTION_SLOWDOWN, vocab.ATTENTIONS), (BACKENDS, vocab.OFFLOADS),
    (vocab.WEIGHT_DTYPE, vocab.PRECISIONS), (vocab.COMPUTE_DTYPE, vocab.PRECISIONS),
])
def test_tables_cover_exactly_the_values(table, values):
    assert set(table) == set(values)


def test_names_handed_to_libraries_exist():
    torch = pytest.importorskip("torch")
    from transformers.training_args import OptimizerNames

    known = {o.value for o in OptimizerNames}
    assert set(vocab.TRAINER_OPTIMIZERS.values()) <= known
    for name in vocab.DTYPES:
        assert isinstance(getattr(torch, name), torch.dtype)


def test_training_computes_in_the_vocabulary_dtypes():
    """train/build/model.py's compute dtype (its own rule) agrees with vocab's precision -> dtype table
    (the weight dtype is read from vocab.WEIGHT_DTYPE itself: nothing to compare)."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from lowvram.train.build.model import compute_dtype

    for precision in vocab.PRECISIONS:
        plan = SimpleNamespace(mixed_precision=precision)
        assert compute_dtype(plan) == getattr(torch, vocab.COMPUTE_DTYPE[precision]), precision
