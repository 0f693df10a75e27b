"""loss: fused (Liger) with a validation set (issue 41 item 5): the evaluation takes the fused path
too, so the full (tokens x vocabulary) logits the plan never counts are not built.

Liger's patched forward fuses only when ``skip_logits`` is true, by default in training mode
(liger_kernel/transformers/model/llama.py ``lce_forward``: ``if skip_logits is None: skip_logits =
self.training and (labels is not None or ...)``). transformers' eval loop passes ``skip_logits=True``
when the Trainer runs Liger and evaluates the loss only (trainer.py ``prediction_step``: ``if
self.args.use_liger_kernel and prediction_loss_only``; transformers 5.23, 5.24 and 5.25 alike), and
``Trainer.evaluate`` is loss-only without ``compute_metrics``, which lowvram never sets. So
evaluation needs no planner term: the fused moment in eval mode holds less than in training (no
activations saved, no input gradient: liger ops/fused_linear_cross_entropy.py allocates
grad_weight only when the input requires a gradient).

Liger cannot run on a CPU (Triton kernels) and is not a test dependency, so its forward is given
here with its own branch structure and the fused kernel replaced by lowvram's chunked
cross-entropy (the same loss without full logits); everything else is the Trainer's own eval loop.
If transformers stops passing ``skip_logits``, this fails and the planner needs an eval term.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

VOCAB, SEQ, ROWS, BATCH = 8192, 128, 4, 2


def _liger_lce_forward(calls: list, chunk_tokens: int = 32):
    """Liger 0.8.2's lce_forward for Llama, the fused Triton kernel replaced as the module says."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from lowvram.train.build.loss import chunked_cross_entropy

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, skip_logits=None,
                logits_to_keep=0, num_items_in_batch=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            **kwargs).last_hidden_state
        if skip_logits and labels is None:
            raise ValueError("skip_logits is True, but labels and shift_labels are None")
        if skip_logits is None:
            skip_logits = self.training and labels is not None
        calls.append({"training": self.training, "fused": bool(skip_logits)})
        if skip_logits:
            loss = chunked_cross_entropy(hidden, labels, self.lm_head, num_items_in_batch, chunk_tokens)
            return CausalLMOutputWithPast(loss=loss, logits=None)
        logits = self.lm_head(hidden)
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size,
                                                                 num_items_in_batch=num_items_in_batch)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    return forward


def test_evaluation_with_the_fused_loss_builds_no_full_logits(tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from lowvram.livebytes import LiveBytes
    from lowvram.testing import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(VOCAB))
    ids = torch.randint(4, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": r, "labels": r} for r in ids]
    with torch.no_grad():  # the standard loss of the eval rows, full logits, before patching
        expected = sum(model(input_ids=ids[i:i + BATCH], labels=ids[i:i + BATCH]).loss.item()
                       for i in range(0, ROWS, BATCH)) / (ROWS // BATCH)

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_eval_batch_size=BATCH,
                             eval_strategy="no", save_strategy="no")
    trainer = Trainer(model=model, args=args, eval_dataset=rows)
    # What `use_liger_kernel=True` does to the model (Trainer.__init__'s apply_liger_kernel) needs
    # liger_kernel; the flag the eval loop reads is set after it, and the forward is Liger's.
    trainer.args.use_liger_kernel = True
    calls: list = []
    monkeypatch.setattr(LlamaForCausalLM, "forward", _liger_lce_forward(calls))

    with LiveBytes() as tracker:
        tracker.register(model)
        metrics = trainer.evaluate()
    assert calls and all(c == {"training": False, "fused": True} for c in calls), calls
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-5)
    full_logits = BATCH * SEQ * VOCAB * 4  # one batch's fp32 logits, what the unfused eval builds
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # the fused stand-in holds one 32-token chunk's logits and log-softmax (2 x 1 MiB) at most
    assert tracker.peak_bytes - weights < full_logits / 2, (tracker.peak_bytes, weights, full_logits)
