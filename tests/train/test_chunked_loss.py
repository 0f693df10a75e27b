"""Chunked cross-entropy (lowvram.train.build.loss): the same loss and gradients as transformers'
standard causal-LM loss, less memory, and the planner's prediction of it."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

from lowvram.check.cases import tiny_llama_spec  # noqa: E402
from lowvram.check.step import measure_setup  # noqa: E402
from lowvram.plan.memory.backward import logits_bytes  # noqa: E402
from lowvram.plan.memory.memory import estimate_memory  # noqa: E402
from lowvram.plan.setup import RunSetup  # noqa: E402
from lowvram.train.build.loss import causal_lm_chunked_loss  # noqa: E402


def _model_and_batch(seed: int = 0):
    from transformers import LlamaForCausalLM

    from lowvram.testing import tiny_llama_config

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=300))
    ids = torch.randint(0, 300, (3, 40))
    labels = ids.clone()
    labels[0, :10] = -100  # a masked prompt
    labels[2, 25:] = -100  # padding
    return model, {"input_ids": ids, "labels": labels}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk_tokens", [7, 1024])
def test_same_loss_and_gradients_as_standard(chunk_tokens):
    model, batch = _model_and_batch()
    standard = model(**batch).loss
    standard.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    loss, _ = causal_lm_chunked_loss(model, batch, chunk_tokens=chunk_tokens)
    loss.backward()
    got = _grads(model)
    assert loss.item() == pytest.approx(standard.item(), abs=1e-5)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)


def test_num_items_in_batch_averages_over_accumulation():
    """Two micro-batches normalized by the tokens of both (what the Trainer passes as
    num_items_in_batch) sum to the loss of the whole batch."""
    model, batch = _model_and_batch()
    whole = model(**batch).loss
    n = int((batch["labels"][:, 1:] != -100).sum())
    halves = [{k: v[s] for k, v in batch.items()} for s in (slice(0, 1), slice(1, 3))]
    total = sum(causal_lm_chunked_loss(model, h, num_items_in_batch=torch.tensor(n), chunk_tokens=16)[0]
                for h in halves)
    assert total.item() == pytest.approx(whole.item(), abs=1e-5)


def test_peak_drops_and_matches_the_plan():
    """Vocabulary 16x the hidden size, 2048 tokens: the logits dominate; chunked keeps one
    1024-token chunk's. The drop measured equals the drop predicted (within 3% of the peak)."""
    spec = tiny_llama_spec(hidden_size=64, num_layers=2, vocab_size=8192)
    setups = {loss: RunSetup(spec, precision="fp32", micro_batch_size=2, seq_len=1024, loss=loss, device="cpu")
              for loss in ("standard", "chunked")}
    measured = {k: measure_setup(s).peak_bytes for k, s in setups.items()}
    predicted = {k: estimate_memory(s).peak_bytes for k, s in setups.items()}
    assert measured["chunked"] < 0.6 * measured["standard"], measured
    for k in setups:
        assert abs(predicted[k] - measured[k]) <= 0.03 * measured[k], (k, predicted[k], measured[k])
    saved_measured = measured["standard"] - measured["chunked"]
    saved_predicted = logits_bytes(setups["standard"]) - logits_bytes(setups["chunked"])
    assert abs(saved_predicted - saved_measured) <= 0.03 * saved_measured, (saved_predicted, saved_measured)


def test_trainer_uses_chunked_loss_when_planned():
    from lowvram.train.build.loss import chunked_loss_trainer_class

    cls = chunked_loss_trainer_class()
    from transformers import Trainer

    assert issubclass(cls, Trainer) and cls.compute_loss is not Trainer.compute_loss
