"""optimizer adamw_in_backward: AdamW stepped inside the backward, one parameter at a time, each
gradient freed as soon as its step is done (lowvram.plan.memory.optimizers).

PyTorch's pattern ("How to save memory by fusing the optimizer step into the backward pass",
pytorch.org/tutorials/intermediate/optimizer_step_in_backward_tutorial; torchtune's
``optimizer_in_bwd``): one optimizer per parameter, stepped and zeroed by
``Tensor.register_post_accumulate_grad_hook``. No maintained implementation plugs into the Hugging
Face Trainer for a plain optimizer (its layerwise machinery, ``_setup_low_rank_optimizer``, is
reached only by the GaLore and APOLLO names), so these few lines are ours and reuse that
machinery's pieces: the per-parameter optimizers are the Trainer's own ``adamw_torch_fused``
(``Trainer.get_optimizer_cls_and_kwargs``, with its weight-decay split), the Trainer holds
transformers' ``LayerWiseDummyOptimizer`` (its ``step``/``zero_grad`` do nothing), and
``get_scheduler`` gives each parameter's optimizer its own scheduler stepped in a hook, as for
layerwise GaLore.
"""

from __future__ import annotations


def in_backward_trainer_class(base):
    """``base`` (a Trainer class) whose optimizer steps each parameter in its gradient hook."""

    class InBackwardTrainer(base):
        def create_optimizer(self, model=None):
            if self.optimizer is None:
                self.optimizer = install_optimizer_in_backward(self, model or self.model)
            return self.optimizer

    InBackwardTrainer.__name__ = f"InBackward{base.__name__}"
    return InBackwardTrainer


def install_optimizer_in_backward(trainer, model):
    """One ``args.optim`` optimizer per trainable parameter, stepped and zeroed (``.grad = None``)
    by a post-accumulate-grad hook; returns the Trainer's no-op ``LayerWiseDummyOptimizer``."""
    from transformers import Trainer
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(trainer.args, model)
    decay = set(trainer.get_decay_parameter_names(model))
    optimizers = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            wd = trainer.args.weight_decay if name in decay else 0.0
            optimizers[p] = optimizer_cls([{"params": [p], "weight_decay": wd}], **kwargs)

    def step_and_free(p):
        if p.grad is not None:
            optimizers[p].step()
            optimizers[p].zero_grad(set_to_none=True)

    for p in optimizers:
        p.register_post_accumulate_grad_hook(step_and_free)
    return LayerWiseDummyOptimizer(optimizer_dict=optimizers, lr=trainer.args.learning_rate)


__all__ = ["in_backward_trainer_class", "install_optimizer_in_backward"]
