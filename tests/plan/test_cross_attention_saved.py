"""What a Llama-3.2-Vision cross-attention layer saves for its backward, against the plan
(lowvram.plan.memory.cross_attention.cross_layer_extra_bytes / late_parts).

A tiny mllama model built as `lowvram train` builds it (train's prepare_model, images on) runs
one image + text forward under torch.autograd.graph.saved_tensors_hooks: the bytes the cross
layer saves beyond what a self-attention layer of the same run saves equal the plan's count,
with the tanh gates trained (full fine-tuning) and frozen (LoRA), LoRA on q/v and on every
Linear, in fp32, bf16 and bf16-mixed. The count it replaced, fitted on fully trained layers,
planned tiny LoRA steps 3-6% above the real ones (tests/check/test_simulate_images.py checks the
whole step)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

from lowvram.plan.memory import cross_attention  # noqa: E402
from lowvram.plan.memory.states import dtype_bytes, dtypes  # noqa: E402
from tests.check.test_simulate_images import _mllama_config, _setup  # noqa: E402

QV = ("q_proj", "v_proj")
CASES = {
    "lora q/v bf16": dict(precision="bf16", lora=True, lora_targets=QV),
    "lora all-linear bf16": dict(precision="bf16", lora=True),
    "lora k/o bf16": dict(precision="bf16", lora=True, lora_targets=("k_proj", "o_proj")),
    "lora all-linear fp32": dict(precision="fp32", lora=True),
    "lora q/v bf16-mixed": dict(precision="bf16-mixed", lora=True, lora_targets=QV),
    "full fp32": dict(precision="fp32"),
    "full bf16": dict(precision="bf16"),
    "full bf16-mixed": dict(precision="bf16-mixed"),
}


def _saved_by_layer(setup, cfg, folder) -> dict[int, int]:
    """Bytes of the distinct storages each decoder layer's forward saves for the backward (its
    parameters and its inputs left out: the plan counts those elsewhere)."""
    from transformers import AutoConfig

    from lowvram.check.builders import autocast_dtype, setup_plan
    from lowvram.check.simulate_images import image_batch
    from lowvram.train.build.model import has_vision, load_kwargs, model_class, prepare_model

    torch.manual_seed(0)
    config = AutoConfig.for_model(**cfg)
    config._attn_implementation = setup.attention
    plan = setup_plan(setup)
    model = prepare_model(model_class(has_vision(config)).from_config(config, dtype=load_kwargs(plan)["dtype"]),
                          plan, images=True)
    model.train()
    batch = image_batch(setup, model.config, folder)
    layers = next(m for n, m in model.named_modules() if n.endswith("language_model.layers"))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    state: dict = {"layer": None, "inputs": set()}
    saved: dict[int, dict[int, int]] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if state["layer"] is not None and key not in params and key not in state["inputs"]:
            saved.setdefault(state["layer"], {})[key] = t.untyped_storage().nbytes()
        return t

    def enter(i):
        def hook(module, args, kwargs):
            values = [*args, *kwargs.values()]
            values += [x for v in kwargs.values() if isinstance(v, tuple) for x in v]
            state["layer"] = i
            state["inputs"] = {v.untyped_storage().data_ptr() for v in values if torch.is_tensor(v)}
        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(enter(i), with_kwargs=True)
        layer.register_forward_hook(lambda *_: state.update(layer=None))
    dtype = autocast_dtype(setup)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            model(**batch)
    return {i: sum(d.values()) for i, d in saved.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_a_cross_layer_saves_what_the_plan_counts(tmp_path, name):
    setup, cfg = _setup(tmp_path, _mllama_config, None, CASES[name])
    active = cross_attention.active_setup(setup)
    assert active.cross_layers == (1,)  # layers 0 and 2 self-attention, 1 cross-attention
    saved = _saved_by_layer(setup, cfg, tmp_path)
    extra = cross_attention.cross_layer_extra_bytes(active, dtype_bytes(active)[0], dtypes(active)[2])
    # the two tanh gates' one-element outputs (4 bytes each at most) are not counted
    assert abs(saved[1] - saved[2] - extra) <= 8, (name, saved, extra)
