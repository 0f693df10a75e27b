"""activation_offload that holds when a library switches checkpointing off and on again.

transformers 5.25 keeps two entry points: ``activation_checkpointing_enable(kwargs, every_n_layers,
offload)``, which the Trainer calls after popping ``every_n_layers`` and ``offload`` out of
``activation_checkpointing_kwargs`` (trainer.py, "Activate activation checkpointing"), and the
deprecated ``gradient_checkpointing_enable(kwargs)``, which passes the dict on whole. TRL 1.16
re-enables checkpointing through the second after each reference forward with
``args.gradient_checkpointing_kwargs`` (trl/models/utils.py ``disable_gradient_checkpointing``;
dpo_trainer.py ``_compute_loss`` and ``compute_ref_log_probs``, kto_trainer.py alike), and
TrainingArguments copies ``activation_checkpointing_kwargs`` there, ``offload: True`` included. So
the layers get ``partial(checkpoint, use_reentrant=False, offload=True)``: no ``save_on_cpu`` around
the checkpoint (the stray key is dropped by the layer's forward), and from the second forward on
every checkpointed layer input stays on the GPU, which the plan counted in host RAM
(lowvram.plan.memory.activations.offloaded_layer_input_bytes).

``hold_offload`` gives the model an instance ``gradient_checkpointing_enable`` that reads those two
keys as the Trainer does. transformers calls an instance override from
``activation_checkpointing_enable`` too (``_is_overridden``: "a wrapper set on the instance"), so
every path that enables checkpointing goes through it.
"""

from __future__ import annotations

import weakref


def _transformers_model(model):
    """The PreTrainedModel under a peft wrapper (peft forwards unknown attributes to it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def hold_offload(model) -> None:
    """Make ``offload`` and ``every_n_layers`` in the kwargs of ``gradient_checkpointing_enable``
    mean what they mean in the Trainer's ``activation_checkpointing_kwargs``."""
    base = _transformers_model(model)
    ref = weakref.ref(base)  # the model's own attribute: no reference cycle keeps it alive

    def gradient_checkpointing_enable(gradient_checkpointing_kwargs=None, every_n_layers: int = 1,
                                      offload: bool = False):
        kwargs = dict(gradient_checkpointing_kwargs or {})
        every_n_layers = kwargs.pop("every_n_layers", every_n_layers)
        offload = kwargs.pop("offload", offload)
        ref()._activation_checkpointing_enable(kwargs or None, every_n_layers, offload)

    base.gradient_checkpointing_enable = gradient_checkpointing_enable
