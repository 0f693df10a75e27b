"""Each technique in the Plan reaches the real Trainer/model settings, and trains on CPU.

A few steps each on the tiny Llama; the captured model and optimizer show that the technique is
really in use (Linear4bit layers, uint8 optimizer state, a full model saved, ...).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lowvram.planning.fixed import resolve_fixed
from lowvram.recipe import load_recipe, parse_recipe
from tests.train.test_e2e import write_recipe


def _capture():
    from transformers import TrainerCallback

    class Capture(TrainerCallback):
        model = optimizer = None

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.model, self.optimizer = model, optimizer

    return Capture()


def _run(tmp_path, tiny_model_dir, techniques: str, steps: int = 3, **kw):
    from lowvram.train.run.run import run_training

    path = write_recipe(tmp_path, tiny_model_dir, steps=steps, techniques=techniques, **kw)
    recipe = load_recipe(path)
    cap = _capture()
    result = run_training(recipe, resolve_fixed(recipe), callbacks=[cap])
    return result.metrics, cap, tmp_path / "out"


def _inner_optimizer(opt):
    return getattr(opt, "optimizer", opt)  # accelerate wraps it


def test_adamw_8bit(tmp_path, tiny_model_dir):
    import torch

    # Full fine-tuning so some tensors reach bnb's min_8bit_size (4096 elements): the tiny
    # model's LoRA matrices are all smaller, and bnb keeps fp32 state for those.
    m, cap, out = _run(tmp_path, tiny_model_dir, "lora: off, optimizer: adamw_8bit")
    opt = _inner_optimizer(cap.optimizer)
    assert type(opt).__module__.startswith("bitsandbytes"), type(opt)
    dtypes = {s["state1"].dtype for s in opt.state.values() if "state1" in s}
    assert torch.uint8 in dtypes, dtypes
    assert m["steps"] == 3 and m["train_loss"] is not None


def test_qlora_nf4_with_checkpointing(tmp_path, tiny_model_dir):
    import bitsandbytes as bnb

    m, cap, out = _run(tmp_path, tiny_model_dir, "lora: on, quantization: nf4, gradient_checkpointing: on")
    layers = [mod for mod in cap.model.modules() if isinstance(mod, bnb.nn.Linear4bit)]
    assert layers, "base layers are not 4-bit"
    assert all(mod.weight.quant_type == "nf4" for mod in layers)
    assert cap.model.base_model.model.is_gradient_checkpointing
    assert m["steps"] == 3 and m["train_loss"] is not None
    assert (out / "adapter_model.safetensors").is_file()


def test_full_finetune_without_lora(tmp_path, tiny_model_dir):
    m, cap, out = _run(tmp_path, tiny_model_dir, "lora: off", steps=4)
    assert not hasattr(cap.model, "peft_config")
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    assert m["trainable_params"] == m["total_params"] > 0
    assert m["train_loss"] < m["first_loss"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # the saved run is a loadable model


def test_chat_format_dataset(tmp_path, tiny_model_dir):
    rows = [
        {"messages": [{"role": "user", "content": f"What is {a} plus {a}?"},
                      {"role": "assistant", "content": f"It is {2 * a}."}]}
        for a in range(24)
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = write_recipe(tmp_path, tiny_model_dir, steps=4, data="chat.jsonl")
    path.write_text(path.read_text().replace("format: alpaca", "format: chat"))
    from lowvram.train.run.run import run_training

    recipe = load_recipe(path)
    m = run_training(recipe, resolve_fixed(recipe)).metrics
    assert m["steps"] == 4 and m["train_rows"] == 24
    assert m["train_loss"] < m["first_loss"]


# ---- the mapping itself, without training ---------------------------------------------------

RECIPE = """
model: {name_or_path: x}
data: {datasets: [{path: d.jsonl}]}
training: {batch_size: 16, micro_batch_size: 2, warmup_ratio: 0.1, max_steps: 50, output_dir: o}
"""


@pytest.mark.parametrize(
    "name, expected",
    [("adamw", "adamw_torch_fused"), ("adamw_8bit", "adamw_bnb_8bit"), ("paged_adamw_8bit", "paged_adamw_8bit"),
     ("paged_adamw_32bit", "paged_adamw_32bit"), ("adafactor", "adafactor"), ("sgd", "sgd")],
)
def test_optimizer_names(name, expected):
    from lowvram.train.build.trainer import build_training_args

    recipe = parse_recipe(RECIPE)
    args = build_training_args(recipe, replace(resolve_fixed(recipe), optimizer=name))
    assert args.optim.value == expected


def test_training_args_follow_the_plan(tmp_path):
    from lowvram.train.build.trainer import build_training_args

    recipe = parse_recipe(RECIPE, source=tmp_path / "r.yaml")
    plan = replace(resolve_fixed(recipe), gradient_checkpointing=True, mixed_precision="bf16")
    args = build_training_args(recipe, plan, has_eval=True)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 8)
    assert args.bf16 and not args.fp16 and args.use_cpu
    assert args.activation_checkpointing and args.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert args.get_warmup_steps(50) == 5 and args.max_steps == 50
    assert args.remove_unused_columns is False and args.report_to == ["tensorboard"]
    assert args.output_dir == str(tmp_path / "o")
    cpu_fp32 = build_training_args(recipe, resolve_fixed(recipe))
    assert not cpu_fp32.bf16 and not cpu_fp32.fp16 and not cpu_fp32.activation_checkpointing


def test_quantization_configs():
    import torch

    from lowvram.train.build.model import quantization_config, weight_dtype

    recipe = parse_recipe(RECIPE)
    base = resolve_fixed(recipe)
    assert quantization_config(base) is None
    q = quantization_config(replace(base, quantization="nf4-dq", mixed_precision="bf16"))
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype == torch.bfloat16
    assert quantization_config(replace(base, quantization="fp4")).bnb_4bit_quant_type == "fp4"
    assert quantization_config(replace(base, quantization="int8")).load_in_8bit
    assert weight_dtype(replace(base, mixed_precision="bf16")) == torch.bfloat16
    assert weight_dtype(replace(base, mixed_precision="bf16-mixed")) == torch.float32
    assert weight_dtype(replace(base, mixed_precision="fp16")) == torch.float16
    assert weight_dtype(replace(base, mixed_precision="fp32")) == torch.float32


@pytest.mark.parametrize("offload", ["none", "fsdp"])
def test_count_params_of_a_4bit_base_for_any_quant_storage(tiny_model_dir, offload):
    """Issue 24 item 9: a real bitsandbytes 4-bit model on the CPU, loaded with lowvram's own
    from_pretrained arguments: uint8 storage (single GPU) and, for FSDP, the bf16 quant storage
    that packs four 4-bit values per element. Both count the unquantized model's parameters
    (count_params assumed uint8 and halved the FSDP total)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lowvram.train.build.model import count_params, load_kwargs

    plan = replace(resolve_fixed(parse_recipe(RECIPE)), quantization="nf4", mixed_precision="bf16",
                   offload=offload)
    kwargs = load_kwargs(plan)
    storage = torch.bfloat16 if offload == "fsdp" else torch.uint8
    assert kwargs["quantization_config"].bnb_4bit_quant_storage == storage
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, **kwargs)
    packed = [p for p in model.parameters() if p.__class__.__name__ == "Params4bit"]
    assert packed and {p.dtype for p in packed} == {storage}
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert count_params(model)[1] == sum(p.numel() for p in plain.parameters())


def test_offload_is_not_a_single_process_run():
    from lowvram.errors import LowvramError
    from lowvram.train.build.trainer import build_training_args

    recipe = parse_recipe(RECIPE)
    with pytest.raises(LowvramError, match="offload"):
        build_training_args(recipe, replace(resolve_fixed(recipe), offload="zero3"))


def test_pure_fp16_full_finetune_is_refused():
    from lowvram.errors import LowvramError
    from lowvram.train.build.trainer import build_training_args

    recipe = parse_recipe(RECIPE)
    with pytest.raises(LowvramError, match="fp16"):
        build_training_args(recipe, replace(resolve_fixed(recipe), mixed_precision="fp16", lora=False))


def test_gguf_conversion_is_cached(tmp_path, tiny_model_dir, monkeypatch):
    """The GGUF path without a real GGUF: from_pretrained(gguf_file=...) is faked with the tiny
    model carrying a GGUF quantization_config; load_model must copy it into a plain model,
    drop quantization_config, cache the folder, and read the cache the second time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowvram.train.build.model import load_model

    calls = []
    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def fake_model(src, *a, gguf_file=None, **k):
        if gguf_file is None:
            return real_model(src, *a, **k)
        calls.append(gguf_file)
        model = real_model(tiny_model_dir)
        model.config.quantization_config = {"quant_method": "gguf", "gguf_file": gguf_file}
        return model

    def fake_tok(src, *a, gguf_file=None, **k):
        return real_tok(tiny_model_dir if gguf_file else src, *a, **k)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fake_tok)
    monkeypatch.setenv("LOWVRAM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tiny.gguf").write_bytes(b"GGUF")
    recipe = parse_recipe(RECIPE.replace("name_or_path: x", "name_or_path: m, gguf_file: tiny.gguf"),
                          source=tmp_path / "r.yaml")
    plan = resolve_fixed(recipe)
    first = load_model(recipe, plan)
    second = load_model(recipe, plan)
    assert (first.gguf_cache_hit, second.gguf_cache_hit, calls) == (False, True, ["tiny.gguf"])
    cached = json.loads((tmp_path / "cache" / "gguf").glob("tiny-*/config.json").__next__().read_text())
    assert "quantization_config" not in cached
    reference = real_model(tiny_model_dir)
    got = second.model.get_base_model()
    for name, p in reference.named_parameters():
        assert torch.equal(p, got.get_parameter(name)), name


def test_activation_offload_on_a_cpu_runs_and_claims_nothing(tmp_path, tiny_model_dir):
    """A recipe's activation_offload: on trains on the CPU; the plan says why it is off there
    (activations already live in host RAM) instead of claiming memory it cannot free."""
    path = write_recipe(tmp_path, tiny_model_dir, steps=2,
                        techniques="lora: on, gradient_checkpointing: on, activation_offload: on")
    plan = resolve_fixed(load_recipe(path))
    assert plan.gradient_checkpointing and not plan.activation_offload
    assert plan.reasons["activation_offload"].startswith("off on the CPU")
    m, cap, out = _run(tmp_path, tiny_model_dir,
                       "lora: on, gradient_checkpointing: on, activation_offload: on", steps=2)
    assert m["steps"] == 2 and m["train_loss"] is not None


def test_trainer_wraps_each_checkpoint_with_transformers_offload(tmp_path, tiny_model_dir, monkeypatch):
    """A plan with activation_offload (a GPU plan's setting, run here on the CPU) reaches the
    Trainer as transformers' offload: save_on_cpu(pin_memory=True) around every decoder layer's
    checkpoint, packing exactly the layer inputs (b x s x h), nothing else (the memory model's
    offloaded_layer_input_bytes). save_on_cpu is replaced by a pass-through spy: pinned memory
    needs a GPU."""
    import torch
    import transformers.modeling_utils as mu
    from transformers import AutoConfig

    packed: list[tuple] = []
    pins: list[bool] = []

    class Spy(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self, pin_memory=False, device_type="cuda"):
            pins.append(pin_memory)

            def pack(t):
                # torch 2.11's non-reentrant checkpoint also saves a 0-element dummy per layer
                # (torch/utils/checkpoint.py, _checkpoint_without_reentrant_generator:
                # _NoopSaveInputs.apply(torch.empty((0,)), ...); gone in 2.13): 0 bytes, not counted
                if t.numel():
                    packed.append(tuple(t.shape))
                return t

            super().__init__(pack, lambda t: t)

    monkeypatch.setattr(mu, "save_on_cpu", Spy)
    from lowvram.train.run.run import run_training

    path = write_recipe(tmp_path, tiny_model_dir, steps=2, techniques="lora: on, gradient_checkpointing: on")
    recipe = load_recipe(path)
    plan = replace(resolve_fixed(recipe), activation_offload=True)
    result = run_training(recipe, plan)
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    micro_steps = 2 * plan.grad_accum
    assert pins and all(pins)  # pinned host memory, as on a GPU
    assert len(packed) == micro_steps * cfg.num_hidden_layers, packed
    assert {(s[0], s[2]) for s in packed} == {(plan.micro_batch_size, cfg.hidden_size)}
    assert result.metrics["steps"] == 2


def test_trainer_arguments_carry_the_plan():
    """Checkpointing kwargs and Liger's switch as the Trainer receives them."""
    from types import SimpleNamespace

    from lowvram.train.build.loss import LIGER_KERNEL_CONFIG, fused_loss_arguments
    from lowvram.train.build.model import checkpointing_kwargs

    assert checkpointing_kwargs(SimpleNamespace(activation_offload=False)) == {"use_reentrant": False}
    assert checkpointing_kwargs(SimpleNamespace(activation_offload=True)) == {"use_reentrant": False, "offload": True}
    assert fused_loss_arguments(SimpleNamespace(loss="chunked", device="cuda")) == {}
    assert LIGER_KERNEL_CONFIG["fused_linear_cross_entropy"] is True
    assert [k for k, v in LIGER_KERNEL_CONFIG.items() if v] == ["fused_linear_cross_entropy"]


def test_fused_loss_reaches_liger_through_the_trainer(monkeypatch, tiny_model_dir):
    """loss: fused -> TrainingArguments(use_liger_kernel=True, liger_kernel_config=...) -> transformers'
    apply_liger_kernel -> liger's _apply_liger_kernel_to_instance with only the fused loss on.
    Liger is faked (it needs CUDA); without it (or on a CPU) a fused plan is refused."""
    import importlib.util
    import sys
    import types
    from types import SimpleNamespace

    import transformers.integrations.liger as hf_liger
    from transformers import AutoModelForCausalLM

    from lowvram.errors import LowvramError
    from lowvram.train.build.loss import LIGER_KERNEL_CONFIG, fused_loss_arguments

    with pytest.raises(LowvramError, match="needs CUDA and the liger extra"):
        fused_loss_arguments(SimpleNamespace(loss="fused", device="cpu"))
    calls = []
    fake = types.ModuleType("liger_kernel.transformers")
    fake._apply_liger_kernel_to_instance = lambda model, **kw: calls.append((type(model).__name__, kw))
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "liger_kernel" else real_find_spec(name, *a))
    monkeypatch.setattr(hf_liger, "is_liger_kernel_available", lambda: True)
    args = fused_loss_arguments(SimpleNamespace(loss="fused", device="cuda"))
    assert args == {"use_liger_kernel": True, "liger_kernel_config": LIGER_KERNEL_CONFIG}
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    hf_liger.apply_liger_kernel(model, args["liger_kernel_config"])
    assert calls == [("LlamaForCausalLM", LIGER_KERNEL_CONFIG)]
