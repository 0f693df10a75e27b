"""`lowvram plan --simulate` for any causal LM transformers can build: the config.json of a local
folder or a cached hub id, and a Llama-shaped ModelSpec stand-in for a model_type the analytic
planner does not read (the simulation then builds the real model from the config).

transformers is imported inside the functions."""

from __future__ import annotations

from lowvram.errors import LowvramError
from lowvram.plan.model.catalog import local_config


def spec_from_transformers(cfg: dict, name: str):
    """A ModelSpec for a config.json lowvram's reader does not understand, through the
    transformers config class (its attribute_map maps e.g. n_embd -> hidden_size). The analytic
    estimate from it is approximate; the simulation builds the real model from ``cfg``."""
    from dataclasses import replace

    from transformers import AutoConfig

    from lowvram.plan.model.models import ModelSpec
    from lowvram.plan.model.readers import spec_from_config

    if "model_type" not in cfg:
        raise LowvramError(f"{name}: config.json has no model_type",
                           "transformers needs model_type to build the model")
    try:
        c = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "quantization_config"})
    except (ValueError, KeyError, TypeError) as e:
        raise LowvramError(f"{name}: transformers cannot read this config: {e}",
                           "pass a causal LM's config.json") from None
    tc = c.get_text_config() if hasattr(c, "get_text_config") else c

    def get(*keys):
        for k in keys:
            v = getattr(tc, k, None)
            if isinstance(v, int):
                return v
        return None

    h = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head")
    if h is None or heads is None:
        raise LowvramError(f"{name}: no hidden size / attention heads in the config",
                           "pass a decoder-only causal LM's config.json")
    # A Llama-shaped stand-in (the analytic planner refuses this model_type): only the
    # techniques are chosen from it; the simulation builds the real model from ``cfg``.
    flat = dict(model_type="llama", hidden_size=h, num_attention_heads=heads,
                num_hidden_layers=get("num_hidden_layers", "n_layer", "num_layers"),
                vocab_size=get("vocab_size"),
                intermediate_size=get("intermediate_size", "n_inner", "ffn_dim") or 4 * h,
                num_key_value_heads=get("num_key_value_heads") or heads,
                head_dim=get("head_dim") or h // heads,
                tie_word_embeddings=bool(getattr(tc, "tie_word_embeddings", False)),
                max_position_embeddings=get("max_position_embeddings", "n_positions") or 2048)
    spec = spec_from_config(flat, name)
    if isinstance(spec, ModelSpec):
        spec = replace(spec, hf_id=None, model_type=cfg["model_type"])
    return spec


def register_for_simulation(model_ref: str) -> None:
    """--simulate accepts a config.json lowvram's reader cannot interpret: read it through
    transformers instead, and register that spec for ``model_ref`` in this process."""
    from pathlib import Path

    from lowvram.errors import ModelError
    from lowvram.plan.model.catalog import register_spec, resolve_model

    try:
        resolve_model(model_ref)
    except ModelError:
        cfg = local_config(model_ref)
        if cfg is None:
            raise
        register_spec(model_ref, spec_from_transformers(cfg, Path(model_ref).name))
