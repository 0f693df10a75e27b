"""Chunked cross-entropy: the causal-LM loss without the full (tokens x vocabulary) logits; and
the settings of Liger Kernel's fused linear cross-entropy (``loss: fused``), which replaces it on
CUDA where the ``liger`` extra is installed (this chunked loss is the fallback and the CPU loss).

transformers computes all logits, upcasts them to fp32 and keeps the log-softmax for backward:
about 12 bytes x tokens x V around the loss (lowvram.plan.constants.LOGITS_LOSS_BYTES), more than all
checkpointed activations for a 128k vocabulary. Here the decoder's final hidden states are cut
into chunks of ``CHUNK_TOKENS`` tokens; each chunk's lm_head + fp32 log-softmax runs under
``torch.utils.checkpoint`` (non-reentrant), so forward keeps nothing but the chunk's input and
backward recomputes one chunk at a time: one chunk's logits are alive, never all of them
(the approach of torchtune's CEWithChunkedOutputLoss and Liger's fused linear cross-entropy).

Same numbers as transformers' ForCausalLMLoss: labels shifted by one, -100 ignored, the sum
divided by ``num_items_in_batch`` (the Trainer counts the label tokens of the whole accumulated
batch, so gradient accumulation averages correctly) or by this batch's label tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lowvram.plan.memory.backward import CHUNK_TOKENS
from lowvram.train.types import IGNORE_INDEX

if TYPE_CHECKING:
    import torch

    from lowvram.plan.types import Plan


def shift_labels(labels: torch.Tensor):
    """Position i predicts token i+1; the last position has no target (ForCausalLMLoss)."""
    import torch.nn.functional as F

    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _chunk_loss_sum(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor):
    import torch.nn.functional as F

    logits = lm_head(hidden).float()  # the loss in fp32, whatever the compute dtype
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.nn.Module,
                          num_items_in_batch: Any = None, chunk_tokens: int = CHUNK_TOKENS):
    """Mean next-token cross-entropy from final hidden states ``(b, s, h)`` and unshifted labels
    ``(b, s)``, computing at most ``chunk_tokens`` tokens' logits at a time."""
    import torch
    from torch.utils.checkpoint import checkpoint

    targets = shift_labels(labels).reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(_chunk_loss_sum, lm_head, flat[start:end], targets[start:end],
                                   use_reentrant=False)
    if num_items_in_batch is None:
        num_items_in_batch = (targets != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _unwrap(model):
    """The transformers model under accelerate/DDP and peft wrappers."""
    inner = model
    while hasattr(inner, "module"):  # DDP / accelerate wrappers
        inner = inner.module
    if hasattr(inner, "get_base_model"):  # peft
        inner = inner.get_base_model()
    return inner


def causal_lm_chunked_loss(model, inputs: dict, num_items_in_batch: Any = None,
                           chunk_tokens: int = CHUNK_TOKENS, autocast=None):
    """Run ``model`` (possibly wrapped) without labels, catching the decoder's final hidden states
    with a forward hook, and return (loss, outputs). The model itself is asked for the logits of
    the last position only (``logits_to_keep=1``), so the full logits are never built; calling
    the model through its wrappers keeps DDP/FSDP hooks and peft adapters in play."""
    import contextlib

    base = _unwrap(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    lm_head = base.get_output_embeddings()
    caught: dict = {}

    def hook(_module: torch.nn.Module, _args: tuple, out):
        caught["h"] = out[0] if isinstance(out, tuple) else out.last_hidden_state

    inputs = dict(inputs)
    labels = inputs.pop("labels")
    handle = decoder.register_forward_hook(hook)
    try:
        outputs = model(**inputs, logits_to_keep=1)
    finally:
        handle.remove()
    with autocast if autocast is not None else contextlib.nullcontext():
        loss = chunked_cross_entropy(caught.pop("h"), labels, lm_head, num_items_in_batch, chunk_tokens)
    return loss, outputs


def chunked_loss_trainer_class(chunk_tokens: int = CHUNK_TOKENS):
    """A ``transformers.Trainer`` whose training loss is :func:`causal_lm_chunked_loss`, in
    chunks of ``chunk_tokens`` tokens (the plan's loss_chunk_tokens)."""
    from transformers import Trainer

    class ChunkedLossTrainer(Trainer):
        # The loss is normalized by num_items_in_batch (the whole accumulated batch) when the
        # Trainer passes it: it must not be divided by the accumulation steps again.
        loss_is_scaled_for_ga = None

        def compute_loss(self, model, inputs: dict, return_outputs=False, num_items_in_batch=None):
            if "labels" not in inputs:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            # accelerate wraps model.forward in autocast; the lm_head chunks run outside it, so
            # enter the same autocast here (checkpoint's recompute restores it).
            loss, outputs = causal_lm_chunked_loss(model, inputs, num_items_in_batch, chunk_tokens,
                                                   autocast=self.accelerator.autocast())
            self.loss_is_scaled_for_ga = num_items_in_batch is not None
            if num_items_in_batch is not None and self.args.average_tokens_across_devices:
                # num_items_in_batch counts every process's tokens (Trainer._get_num_items_in_batch);
                # DDP averages gradients, so scale back up as Trainer.compute_loss does.
                loss = loss * self.accelerator.num_processes
            return (loss, outputs) if return_outputs else loss

    return ChunkedLossTrainer


# Liger Kernel (``loss: fused``): transformers' ``use_liger_kernel`` flag patches the model through
# ``liger_kernel.transformers._apply_liger_kernel_to_instance(model, **config)``, which passes each
# model type's ``apply_liger_kernel_to_*`` the keywords it accepts. Only the fused linear
# cross-entropy is turned on: Liger's RMSNorm, SwiGLU/GeGLU, RoPE and LayerNorm kernels save other
# tensors than the transformers modules the planner models (lowvram.plan.memory.backward.fused_loss_bytes
# models the loss alone).
LIGER_KERNEL_CONFIG = {
    "fused_linear_cross_entropy": True, "cross_entropy": False, "rope": False, "rms_norm": False,
    "swiglu": False, "geglu": False, "layer_norm": False,
}


def fused_loss_arguments(plan: Plan) -> dict:
    """TrainingArguments for ``plan.loss``: Liger's fused loss for ``fused`` (the planner picks it
    only on CUDA with liger_kernel importable, lowvram.plan.choose.techniques.fused_loss_unavailable);
    nothing for the other losses. A plan made elsewhere (a launched worker without the extra) is
    refused rather than silently run with the full logits. Evaluation fuses too: Liger's forward
    fuses where ``skip_logits`` is true (by default in training mode only), and the Trainer's eval
    loop passes ``skip_logits=True`` for a loss-only evaluation with ``use_liger_kernel``
    (transformers 5.23-5.25 ``prediction_step``; lowvram sets no compute_metrics, so
    ``Trainer.evaluate`` is loss-only): tests/train/test_fused_loss_eval.py."""
    if plan.loss != "fused":
        return {}
    import importlib.util

    from lowvram.errors import LowvramError

    if plan.device != "cuda" or importlib.util.find_spec("liger_kernel") is None:
        raise LowvramError(
            "the plan uses loss fused (Liger Kernel), which needs CUDA and the liger extra here",
            "pip install 'lowvram[liger]', or set techniques.loss: chunked")
    return {"use_liger_kernel": True, "liger_kernel_config": dict(LIGER_KERNEL_CONFIG)}
