"""A training step measured byte by byte with the live-bytes tracker (:mod:`lowvram.livebytes`),
the models, optimizers and batches it runs on, and the accuracy matrices of the memory model.

torch and friends are imported inside functions (importing lowvram stays instant).
"""

from __future__ import annotations

import gc
import os
from contextlib import nullcontext
from dataclasses import dataclass, field

# The tracker lived here; livebytes.py holds it now (these names stay importable from here).
from lowvram.livebytes import LiveBytes, iter_tensors, memory_history_callback  # noqa: F401
from lowvram.plan.models import ModelSpec

# --------------------------------------------------------------------------------------------
# A training step, as the Hugging Face Trainer does it


@dataclass
class StepMemory:
    peak_bytes: int
    peak_phase: str  # forward | backward | optimizer_step
    start_bytes: int  # live before the step: weights, optimizer state, inputs (+ kept grads)
    end_bytes: int  # live after zero_grad
    phases: dict[str, int] = field(default_factory=dict)  # peak bytes within each phase
    # with breakdown=True: bytes alive at the peak by kind (weights, optimizer, gradients,
    # logits, other), summing to peak_bytes
    breakdown: dict[str, int] = field(default_factory=dict)


def _one_step(model, optimizer, batch, autocast_dtype, max_grad_norm, grad_accum, tracker=None,
              chunked_loss=False):
    import torch

    def phase(name):
        if tracker is not None:
            tracker.set_phase(name)

    model.train()
    for _ in range(grad_accum):
        phase("forward")
        # accelerate (Trainer) wraps forward in autocast and converts outputs to fp32
        ctx = torch.autocast(batch["input_ids"].device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
        with ctx:
            if chunked_loss:  # lowvram.train.loss, as the Trainer runs it for loss: chunked
                from lowvram.train.loss import causal_lm_chunked_loss

                loss, out = causal_lm_chunked_loss(model, batch)
            else:
                out = model(**batch)
                loss = out["loss"] if isinstance(out, dict) else out.loss
        if autocast_dtype is not None and out.get("logits") is not None:
            out["logits"] = out["logits"].float()  # accelerate convert_outputs_to_fp32
        del out
        loss = loss / grad_accum
        phase("backward")
        loss.backward()
        del loss
    phase("optimizer_step")
    if max_grad_norm:
        params = [p for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_training_step(
    model,
    optimizer,
    batch: dict,
    *,
    autocast_dtype=None,
    max_grad_norm: float = 1.0,
    grad_accum: int = 1,
    warmup: bool = True,
    cap_bytes: int | None = None,
    breakdown: bool = False,
    logits_dim: int | None = None,
    chunked_loss: bool = False,
) -> StepMemory:
    """Peak live tensor bytes of one steady-state step: model.train(), loss from the model with
    labels, backward, clip, optimizer.step(), zero_grad(set_to_none=True) (transformers Trainer).

    ``warmup`` runs one untracked step first so the optimizer state exists (else the peak is low).
    ``breakdown`` also sorts the bytes alive at the peak by kind (``logits_dim``: the vocabulary
    size, to recognise logits by their last dimension).
    """
    if warmup:
        _one_step(model, optimizer, batch, autocast_dtype, max_grad_norm, grad_accum,
                  chunked_loss=chunked_loss)
    gc.collect()
    tracker = LiveBytes(cap_bytes, snapshot=breakdown, logits_dim=logits_dim)
    tracker.register(model, tag="weights")
    tracker.register(optimizer, tag="optimizer")
    tracker.register(batch, tag="inputs")
    hooks = []
    if breakdown:
        for p in model.parameters():
            if p.requires_grad:
                hooks.append(p.register_post_accumulate_grad_hook(
                    lambda q: tracker.tag(q.grad, "gradients")))
    start = tracker.current_bytes
    tracker.reset_peak()
    phases: dict[str, int] = {}
    orig_set = tracker.set_phase

    def set_phase(name):
        prev = tracker.counter.phase
        if prev in phases or prev in ("forward", "backward", "optimizer_step"):
            phases[prev] = max(phases.get(prev, 0), tracker.peak_bytes)
        tracker.reset_peak()
        orig_set(name)

    tracker.set_phase = set_phase  # per-phase peaks
    overall = start
    with tracker:
        _one_step(model, optimizer, batch, autocast_dtype, max_grad_norm, grad_accum, tracker,
                  chunked_loss=chunked_loss)
    set_phase("done")
    for h in hooks:
        h.remove()
    parts = tracker.peak_breakdown() if breakdown else {}
    gc.collect()
    overall = max(phases.values()) if phases else start
    peak_phase = max(phases, key=phases.get) if phases else "setup"
    return StepMemory(peak_bytes=overall, peak_phase=peak_phase, start_bytes=start,
                      end_bytes=tracker.current_bytes, phases=phases, breakdown=parts)


# --------------------------------------------------------------------------------------------
# Building the model and optimizer of a RunSetup (tests, benches, simulation)


def hf_config(spec: ModelSpec, attention: str = "sdpa"):
    """A transformers config for a Llama-family ModelSpec (llama, mistral, qwen2)."""
    from transformers import AutoConfig

    kw = dict(
        hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        vocab_size=spec.vocab_size, tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=spec.max_position_embeddings,
    )
    if spec.rope_theta:
        kw["rope_theta"] = spec.rope_theta
    cfg = AutoConfig.for_model(spec.model_type, **kw)
    cfg._attn_implementation = attention
    # the spec's dropout, under whichever names this config class uses
    for name, value in (("resid_pdrop", spec.resid_dropout), ("embd_pdrop", spec.embd_dropout),
                        ("attn_pdrop", spec.attn_dropout), ("attention_dropout", spec.attn_dropout)):
        if hasattr(cfg, name):
            setattr(cfg, name, value)
    return cfg


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "bf16-mixed": "float32",
           "fp16-mixed": "float32", "fp32": "float32"}


def build_model(setup, workdir: str | None = None, seed: int = 0, device: str = "cpu",
                saved_dir: str | None = None):
    """The model a RunSetup trains, random init, on ``device``: transformers + peft +
    bitsandbytes, prepared as lowvram's trainer does (base frozen, no fp32 upcast; with
    setup.kbit_prepare, peft's prepare_model_for_kbit_training instead).

    Unquantized models are initialised on ``device`` directly (a 7B model on a GPU in seconds).
    Quantized ones go through ``from_pretrained`` (bitsandbytes quantizes while loading) from
    a random-init checkpoint: saved to ``saved_dir`` once and reused when it already holds one,
    else to a temporary folder.
    """
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    dtype = getattr(torch, _DTYPES[setup.precision])
    cfg = hf_config(setup.model, setup.attention)
    if setup.quantization == "none":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        return finish_model(model, setup)
    from transformers import BitsAndBytesConfig

    if setup.quantization == "int8":
        qc = BitsAndBytesConfig(load_in_8bit=True)
    else:
        qc = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="fp4" if setup.quantization == "fp4" else "nf4",
            bnb_4bit_use_double_quant=setup.quantization == "nf4-dq",
            bnb_4bit_compute_dtype=torch.bfloat16 if setup.precision != "fp32" else torch.float32,
        )

    def load(d):
        if not os.path.exists(os.path.join(d, "config.json")):
            with torch.device(device):
                AutoModelForCausalLM.from_config(cfg, dtype=dtype).save_pretrained(d)
        return AutoModelForCausalLM.from_pretrained(
            d, quantization_config=qc, device_map={"": device}, dtype=dtype,
            attn_implementation=setup.attention)

    if saved_dir is not None:
        model = load(saved_dir)
    else:
        with tempfile.TemporaryDirectory(dir=workdir) as d:
            model = load(d)
    return finish_model(model, setup)


def finish_model(model, setup):
    """What training does after loading (shared with simulate.py): k-bit preparation when the
    setup asks for peft's, checkpointing, no KV cache, LoRA adapters."""
    if setup.quantization != "none" and setup.kbit_prepare:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=setup.gradient_checkpointing)
    if setup.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    if setup.lora:
        from peft import LoraConfig, get_peft_model

        targets = "all-linear" if "all-linear" in setup.lora_targets else list(setup.lora_targets)
        model = get_peft_model(model, LoraConfig(
            r=setup.lora_r, lora_alpha=2 * setup.lora_r, lora_dropout=0.0,
            target_modules=targets, task_type="CAUSAL_LM"))
    return model


def build_optimizer(model, name: str, lr: float = 1e-4):
    """The optimizer the Trainer builds for ``optim`` (adamw = adamw_torch_fused, its default)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if name == "paged_adamw_32bit":
        import bitsandbytes as bnb

        return bnb.optim.PagedAdamW32bit(params, lr=lr)
    if name in ("adamw_8bit", "paged_adamw_8bit"):
        import bitsandbytes as bnb

        cls = bnb.optim.AdamW8bit if name == "adamw_8bit" else bnb.optim.PagedAdamW8bit
        opt = cls(params, lr=lr)
        # As the Trainer does (Trainer.create_optimizer): embeddings keep 32-bit state.
        manager = bnb.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
        return opt
    if name == "adafactor":
        from transformers.optimization import Adafactor

        # Trainer's optim="adafactor": scale_parameter=False, relative_step=False
        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ValueError(f"unknown optimizer {name}")


def make_batch(setup, seed: int = 0, device: str = "cpu") -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, setup.model.vocab_size, (setup.micro_batch_size, setup.seq_len), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def autocast_dtype(setup):
    """The dtype the Trainer's autocast uses for a setup's precision (None for fp32)."""
    import torch

    return {"bf16": torch.bfloat16, "bf16-mixed": torch.bfloat16, "fp16": torch.float16,
            "fp16-mixed": torch.float16}.get(setup.precision)


def measure_setup(setup, **kw) -> StepMemory:
    """Build, warm up and measure one step of ``setup`` on CPU."""
    model = build_model(setup)
    opt = build_optimizer(model, setup.optimizer)
    return measure_training_step(model, opt, make_batch(setup), autocast_dtype=autocast_dtype(setup),
                                 grad_accum=setup.grad_accum, chunked_loss=setup.loss == "chunked", **kw)


# --------------------------------------------------------------------------------------------
# The accuracy matrix (tests/test_plan_accuracy.py, bench/plan_accuracy.py)


def tiny_llama_spec(hidden_size: int = 256, num_layers: int = 4, vocab_size: int = 4096) -> ModelSpec:
    """A small Llama (GQA: heads of 64, half as many kv heads; untied head) for CPU steps."""
    heads = max(2, hidden_size // 64)
    return ModelSpec(
        name="tiny-llama", hf_id=None, model_type="llama", hidden_size=hidden_size,
        intermediate_size=(hidden_size * 8 // 3 + 15) // 16 * 16, num_layers=num_layers, num_heads=heads,
        num_kv_heads=heads // 2, head_dim=hidden_size // heads, vocab_size=vocab_size,
        tie_word_embeddings=False, max_position_embeddings=2048,
    )


# (case name, RunSetup keyword arguments); every case runs on tiny_llama_spec() on CPU.
ACCURACY_MATRIX: list[tuple[str, dict]] = [
    ("full fp32", dict(precision="fp32")),
    ("full bf16", dict(precision="bf16")),
    ("full bf16-mixed", dict(precision="bf16-mixed")),
    ("full bf16 + checkpointing", dict(precision="bf16", gradient_checkpointing=True)),
    ("full fp32 + checkpointing", dict(precision="fp32", gradient_checkpointing=True)),
    ("full bf16 b2 s256", dict(precision="bf16", micro_batch_size=2, seq_len=256)),
    ("full bf16 b2 s512", dict(precision="bf16", micro_batch_size=2)),
    ("full bf16 s256", dict(precision="bf16", seq_len=256)),
    ("full bf16 accum 2", dict(precision="bf16", grad_accum=2)),
    ("full bf16 adamw_8bit", dict(precision="bf16", optimizer="adamw_8bit")),
    ("full bf16 adafactor", dict(precision="bf16", optimizer="adafactor")),
    ("full bf16 eager", dict(precision="bf16", attention="eager")),
    ("lora bf16", dict(precision="bf16", lora=True)),
    ("lora fp32", dict(precision="fp32", lora=True)),
    ("lora bf16-mixed", dict(precision="bf16-mixed", lora=True)),
    ("lora bf16 q,v r8", dict(precision="bf16", lora=True, lora_r=8, lora_targets=("q_proj", "v_proj"))),
    ("lora bf16 + checkpointing", dict(precision="bf16", lora=True, gradient_checkpointing=True)),
    ("qlora nf4", dict(precision="bf16", lora=True, quantization="nf4")),
    ("qlora nf4-dq", dict(precision="bf16", lora=True, quantization="nf4-dq")),
    ("qlora nf4-dq + checkpointing", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                          gradient_checkpointing=True)),
    ("qlora nf4-dq b2 s256 adamw_8bit", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                             micro_batch_size=2, seq_len=256, optimizer="adamw_8bit")),
    ("full bf16 chunked loss b8 s1024", dict(precision="bf16", loss="chunked", micro_batch_size=8,
                                             seq_len=1024)),
    # Checkpointing with small logits (chunked loss): the peak is a layer's recompute + backward.
    ("lora bf16 + ckpt + chunked b2 s2048", dict(precision="bf16", lora=True, gradient_checkpointing=True,
                                                 loss="chunked", micro_batch_size=2, seq_len=2048)),
    ("qlora nf4-dq + ckpt + chunked b2 s2048", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                                    gradient_checkpointing=True, loss="chunked",
                                                    micro_batch_size=2, seq_len=2048)),
]


# Small logits (vocabulary 512, tiny_llama_spec(vocab_size=512)): the peak moves into the
# backward (checkpointed layers, nearly every gradient made) or, under autocast with fp32
# weights, to the end of the forward. bench/plan_accuracy.py runs these after the matrix above.
SMALL_LOGITS_MATRIX: list[tuple[str, dict]] = [
    ("full fp32 + ckpt b2 s256", dict(precision="fp32", gradient_checkpointing=True, micro_batch_size=2, seq_len=256)),
    ("full bf16 + ckpt b2 s256", dict(precision="bf16", gradient_checkpointing=True, micro_batch_size=2, seq_len=256)),
    ("full bf16 + ckpt b2 s1024", dict(precision="bf16", gradient_checkpointing=True, micro_batch_size=2, seq_len=1024)),
    ("full bf16-mixed + ckpt b2 s256", dict(precision="bf16-mixed", gradient_checkpointing=True, micro_batch_size=2,
                                            seq_len=256)),
    ("full bf16 b2 s32", dict(precision="bf16", micro_batch_size=2, seq_len=32)),
    ("lora fp32 + ckpt b2 s256", dict(precision="fp32", lora=True, gradient_checkpointing=True, micro_batch_size=2,
                                      seq_len=256)),
    ("lora bf16 + ckpt b2 s1024", dict(precision="bf16", lora=True, gradient_checkpointing=True, micro_batch_size=2,
                                       seq_len=1024)),
    ("lora bf16-mixed + ckpt b2 s256", dict(precision="bf16-mixed", lora=True, gradient_checkpointing=True,
                                            micro_batch_size=2, seq_len=256)),
    ("qlora nf4-dq + ckpt b2 s1024", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                          gradient_checkpointing=True, micro_batch_size=2, seq_len=1024)),
]
