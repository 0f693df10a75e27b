"""lowvram.train.build.model: what loading the model leaves on the user's terminal."""

from __future__ import annotations

import logging

import pytest


def test_int8_on_cuda_does_not_log_at_every_linear_call(caplog):
    """issue 41 item 10: bitsandbytes' MatMul8bitLt (the int8 path on CUDA: autograd/_functions.py
    ``matmul`` takes MatMul8bitFp in training on the CPU only) logs "inputs will be cast ... to
    float16" at every call with bf16 inputs; the filter on the parent logger "bitsandbytes" never
    saw it (a logger's filters act on its own records only). Run here on the CPU, the same code."""
    bnb = pytest.importorskip("bitsandbytes")
    import torch
    from bitsandbytes.autograd._functions import MatMul8bitLt, MatmulLtState

    from lowvram.train.build.model import quiet_libraries

    quiet_libraries()
    a = torch.randn(4, 16, dtype=torch.bfloat16)
    weight = torch.randn(8, 16, dtype=torch.float16)
    source = "bitsandbytes.autograd._functions"
    with caplog.at_level(logging.WARNING, logger=source):
        for _ in range(3):
            out = MatMul8bitLt.apply(a, weight, None, None, MatmulLtState())
        assert out.shape == (4, 8)
        assert [r.getMessage() for r in caplog.records if r.name == source] == []
        # precise: another warning of the same logger still reaches the user
        logging.getLogger(source).warning("something else")
    assert [r.getMessage() for r in caplog.records if r.name == source] == ["something else"]
    assert bnb.__version__


@pytest.mark.parametrize("init, device, rank, where", [
    ("pissa", "cuda", "0", {"": 0}), ("pissa_niter_4", "cuda", "0", {"": 0}),
    ("pissa", "cuda", "1", {"": 1}),  # the process's own card (LOCAL_RANK)
    ("default", "cuda", "0", None),  # the Trainer moves a float base itself, as before
    ("pissa", "cpu", "0", None),
])
def test_pissa_loads_the_base_onto_the_gpu_so_its_svds_run_there(monkeypatch, tiny_model_dir, init, device,
                                                                 rank, where):
    """issue 41 item 8: without a device_map from_pretrained loads a float base to the CPU, and
    peft's pissa_init (get_peft_model, before the Trainer moves the model) runs every SVD on the
    weight's device: the CPU. The kwargs are the ones train and check load with."""
    import dataclasses

    from lowvram.planning.fixed import resolve_fixed
    from lowvram.recipe import parse_recipe
    from lowvram.train.build.model import load_kwargs

    monkeypatch.setenv("LOCAL_RANK", rank)
    recipe = parse_recipe(f"model: {{name_or_path: {tiny_model_dir}}}\n"
                          "data: {datasets: [{path: d.jsonl, format: text}]}\n"
                          f"lora: {{init: {init}}}\ntechniques: {{lora: on, quantization: off}}\n")
    plan = dataclasses.replace(resolve_fixed(recipe), device=device)
    assert plan.lora_init == init and plan.quantization == "none"
    assert load_kwargs(plan).get("device_map") == where


def test_pissa_init_runs_on_the_device_the_weight_is_on(tiny_model_dir):
    """What the device map relies on: peft's pissa_init decomposes the weight where it lies (the
    residual and the adapters come out on that device), so loading to the GPU moves the SVD there."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, device_map={"": "cpu"})
    calls = []
    real = torch.linalg.svd

    def svd(a, *args, **kw):
        calls.append(a.device.type)
        return real(a, *args, **kw)

    torch.linalg.svd = svd
    try:
        get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="pissa"))
    finally:
        torch.linalg.svd = real
    assert calls and set(calls) == {"cpu"}  # the weight's device: with device_map {"": 0}, cuda
