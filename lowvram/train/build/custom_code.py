"""Models that need their own Python code (``auto_map`` in config.json, an unknown model_type):
no such code ever runs without the opt-in, ``model.trust_remote_code: true`` (issue 42, item 7).

lowvram always passes ``trust_remote_code`` to transformers explicitly (left None, transformers
asks on the terminal): the recipe's choice in training, the run's (its recipe.yaml, or a merged
folder's lowvram_merge.json) in ``generate`` and ``merge``. transformers then refuses the model's
code with a ValueError; these turn it into one error/hint naming the key. No torch here.
"""

from __future__ import annotations

from lowvram.errors import ModelError


def is_custom_code_refusal(e: BaseException) -> bool:
    """transformers' refusal to run a model's own code without the opt-in
    (dynamic_module_utils.resolve_trust_remote_code: "... contains custom code ... Please pass the
    argument `trust_remote_code=True`")."""
    return isinstance(e, ValueError) and "trust_remote_code" in str(e) and "custom code" in str(e)


def custom_code_refused(name: str) -> ModelError:
    """Training a model that needs its own code, without model.trust_remote_code."""
    return ModelError(f"{name} needs the Python code shipped with it (auto_map in its config.json), and "
                      "model.trust_remote_code is off: lowvram never runs a model's own code without it",
                      "if you trust that code, set model.trust_remote_code: true in the recipe (the code runs "
                      "with your user's rights), or use a model that transformers supports natively")


def custom_code_error(source: str, found_via: str) -> ModelError:
    """The model needs its own Python code and the run did not opt in."""
    return ModelError(
        f"{source} needs the Python code shipped with it (auto_map in its config.json; found via {found_via}), "
        "and the run did not opt in to running it: model.trust_remote_code is off",
        "if you trust that code, set model.trust_remote_code: true in the run's recipe.yaml (lowvram never "
        "runs a model's own code without it); the code runs with your user's rights",
    )
