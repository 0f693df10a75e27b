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
    labels, backward, clip, optimizer.step(), zero_grad(set_to_none=True), as the transformers
    Trainer runs them. The simulator's step (no Trainer can be built on fake tensors): real runs
    are measured through the Trainer itself (:func:`measure_trainer_step`), and
    tests/test_plan_simulate.py checks that the two agree.

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
    """A transformers config for a ModelSpec of a family the analytic planner models."""
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
    kw.update(_moe_config_kwargs(spec))
    if spec.sliding_window:  # Gemma-3: its default layer pattern, the spec's window
        kw["sliding_window"] = spec.sliding_window
    cfg = AutoConfig.for_model(spec.model_type, **kw)
    cfg._attn_implementation = attention
    # the spec's dropout, under whichever names this config class uses
    for name, value in (("resid_pdrop", spec.resid_dropout), ("embd_pdrop", spec.embd_dropout),
                        ("attn_pdrop", spec.attn_dropout), ("attention_dropout", spec.attn_dropout)):
        if hasattr(cfg, name):
            setattr(cfg, name, value)
    return cfg


def _moe_config_kwargs(spec: ModelSpec) -> dict:
    """The MoE fields of a spec under its config class's names (see models._MOE_ARCH)."""
    if not spec.is_moe:
        return {}
    if spec.model_type in ("mixtral", "olmoe"):
        return dict(num_local_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                    intermediate_size=spec.moe_intermediate_size)
    kw = dict(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
              moe_intermediate_size=spec.moe_intermediate_size, mlp_only_layers=[],
              decoder_sparse_step=1)
    if spec.model_type == "qwen2_moe":
        kw.update(shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                  qkv_bias=spec.qkv_bias)
    return kw


def setup_plan(setup, device: str = "cpu"):
    """The Plan ``lowvram train`` runs a RunSetup with: what train's builders read (alpha 2r)."""
    from lowvram.plan.search import plan_for_setup

    return plan_for_setup(setup, device, 2 * setup.lora_r)


def build_model(setup, workdir: str | None = None, seed: int = 0, device: str = "cpu",
                saved_dir: str | None = None):
    """The model a RunSetup trains, random init, on ``device``, loaded and prepared by the
    functions ``lowvram train`` uses (lowvram.train.model: ``load_kwargs`` for dtype, attention
    and bitsandbytes, ``prepare_model`` for k-bit preparation, adapters and checkpointing).

    Unquantized models are built from their config on ``device`` directly (what
    ``from_pretrained`` of a random checkpoint gives, without writing one: a 7B model on a GPU
    in seconds). Quantized ones go through ``from_pretrained`` (bitsandbytes quantizes while
    loading) from a random-init checkpoint: saved to ``saved_dir`` once and reused when it
    already holds one, else to a temporary folder.
    """
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from lowvram.train.model import load_kwargs, prepare_model

    torch.manual_seed(seed)
    plan = setup_plan(setup, device)
    kwargs = load_kwargs(plan)
    cfg = hf_config(setup.model, setup.attention)
    if setup.quantization == "none":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=kwargs["dtype"])
        return prepare_model(model, plan, seed)

    def load(d):
        if not os.path.exists(os.path.join(d, "config.json")):
            with torch.device(device):
                AutoModelForCausalLM.from_config(cfg, dtype=kwargs["dtype"]).save_pretrained(d)
        return AutoModelForCausalLM.from_pretrained(d, **kwargs)

    if saved_dir is not None:
        model = load(saved_dir)
    else:
        with tempfile.TemporaryDirectory(dir=workdir) as d:
            model = load(d)
    return prepare_model(model, plan, seed)


class _OptimizerOf:
    """What ``transformers.Trainer.create_optimizer`` reads of its Trainer: that method builds
    the optimizer here, so the optimizer measured is the one a run gets (param groups, the
    8-bit embedding override, fused AdamW), also on fake tensors where no Trainer can be made."""

    optimizer = None
    optimizer_cls_and_kwargs = None

    def __init__(self, model, args) -> None:
        from transformers import Trainer

        self.model, self.args = model, args
        self.get_decay_parameter_names = Trainer.get_decay_parameter_names.__get__(self)
        self.get_optimizer_cls_and_kwargs = Trainer.get_optimizer_cls_and_kwargs


def build_optimizer(model, name: str, lr: float = 1e-4):
    """The optimizer ``lowvram train`` makes for the plan optimizer ``name``: the Trainer's own
    ``create_optimizer`` over ``lowvram.vocab.TRAINER_OPTIMIZERS`` (adamw -> adamw_torch_fused)."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    from lowvram.vocab import TRAINER_OPTIMIZERS

    device = next(model.parameters()).device.type
    args = TrainingArguments(output_dir=tempfile.gettempdir(), optim=TRAINER_OPTIMIZERS[name], learning_rate=lr,
                             report_to=[], use_cpu=device == "cpu")
    return Trainer.create_optimizer(_OptimizerOf(model, args))


def make_batch(setup, seed: int = 0, device: str = "cpu") -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, setup.model.vocab_size, (setup.micro_batch_size, setup.seq_len), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def autocast_dtype(setup):
    """The dtype the Trainer's autocast uses for a setup's precision (None for fp32; the rule is
    train/model.py's)."""
    from lowvram.train.model import autocast_dtype as for_precision

    return for_precision(setup.precision)


class TrackerProbe:
    """Exact live tensor bytes of one step (LiveBytes), per phase. ``start`` registers what exists
    before the step (weights, optimizer state) and enters the mode; ``mark`` closes a phase."""

    device = "cpu"

    def __init__(self, breakdown: bool = False, logits_dim: int | None = None) -> None:
        self.breakdown, self.logits_dim = breakdown, logits_dim
        self.tracker = None

    def start(self, model, optimizer) -> None:
        gc.collect()
        self.tracker = LiveBytes(snapshot=self.breakdown, logits_dim=self.logits_dim)
        self.tracker.register(model, tag="weights")
        self.tracker.register(optimizer, tag="optimizer")
        self.start_bytes = self.tracker.current_bytes
        self.phases: dict[str, int] = {}
        self.tracker.reset_peak()
        self.tracker.__enter__()

    def mark(self, phase: str) -> None:
        self.phases[phase] = self.tracker.peak_bytes
        self.tracker.reset_peak()

    def stop(self, last_phase: str) -> StepMemory:
        self.mark(last_phase)
        self.tracker.__exit__(None, None, None)
        parts = self.tracker.peak_breakdown() if self.breakdown else {}
        peak_phase = max(self.phases, key=self.phases.get)
        out = StepMemory(peak_bytes=self.phases[peak_phase], peak_phase=peak_phase,
                         start_bytes=self.start_bytes, end_bytes=self.tracker.current_bytes,
                         phases=dict(self.phases), breakdown=parts)
        self.tracker = None
        return out

    def release(self) -> None:
        if self.tracker is not None:  # a step that failed half-way: leave the mode
            self.tracker.__exit__(None, None, None)
            self.tracker = None
        gc.collect()


def _step_recipe(setup, output_dir: str):
    """The smallest recipe whose training section gives this setup's TrainingArguments."""
    import yaml

    from lowvram.recipe import parse_recipe

    text = yaml.safe_dump({
        "model": {"name_or_path": "random-init"},
        "data": {"datasets": [{"path": "none.jsonl", "format": "text"}]},
        "training": {"seq_len": setup.seq_len, "batch_size": setup.micro_batch_size * setup.grad_accum,
                     "micro_batch_size": setup.micro_batch_size, "max_steps": 2, "learning_rate": 1e-4,
                     "lr_scheduler": "constant", "logging_steps": 1, "save_steps": 1000,
                     "output_dir": output_dir, "report_to": "none"},
    })
    return parse_recipe(text)


def measure_trainer_step(model, setup, probe=None, device: str = "cpu", seed: int = 0):
    """Two optimizer steps of ``setup`` through the Trainer ``lowvram train`` builds
    (lowvram.train.trainer: build_training_args + build_trainer, its optimizer, autocast,
    checkpointing, chunked loss, clipping): the first makes the optimizer state, the second is
    measured with ``probe`` (TrackerProbe on a CPU; bench/gpu_check.py's CUDA probe), from its
    start to its end, with the forward/backward and the optimizer step as phases."""
    import tempfile
    from types import SimpleNamespace

    import torch
    from transformers import TrainerCallback, default_data_collator

    from lowvram.train.trainer import build_trainer, build_training_args

    probe = probe or TrackerProbe()
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(2 * setup.micro_batch_size * setup.grad_accum):
        ids = torch.randint(0, setup.model.vocab_size, (setup.seq_len,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    result: dict = {}

    class Measure(TrainerCallback):
        measuring = False

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1:  # the second step: optimizer state exists
                self.measuring = True
                probe.start(kw["model"], kw["optimizer"])

        def on_pre_optimizer_step(self, args, state, control, **kw):
            if self.measuring:
                probe.mark("forward_backward")

        def on_step_end(self, args, state, control, **kw):
            if self.measuring:
                self.measuring = False
                result["step"] = probe.stop("optimizer_step")

    with tempfile.TemporaryDirectory() as out:
        recipe = _step_recipe(setup, out)
        args = build_training_args(recipe, setup_plan(setup, device))
        trainer = build_trainer(SimpleNamespace(model=model, tokenizer=None), SimpleNamespace(train=rows, eval=None),
                                args, default_data_collator, callbacks=[Measure()], loss=setup.loss)
        try:
            trainer.train()
        finally:
            probe.release()
    return result["step"]


def measure_setup(setup, breakdown: bool = False) -> StepMemory:
    """Build ``setup`` on the CPU with train's builders and measure its second Trainer step."""
    model = build_model(setup)
    return measure_trainer_step(model, setup, TrackerProbe(breakdown, setup.model.vocab_size))


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
    # lora.dropout > 0: a dropped copy of each adapter's input and its mask (+30-45% activations)
    ("lora fp32 dropout 0.1", dict(precision="fp32", lora=True, lora_dropout=0.1)),
    ("lora bf16-mixed dropout 0.05", dict(precision="bf16-mixed", lora=True, lora_dropout=0.05)),
    ("qlora nf4-dq dropout 0.1 q,v", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                          lora_dropout=0.1, lora_targets=("q_proj", "v_proj"))),
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
