"""A training step measured byte by byte with the live-bytes tracker (:mod:`lowvram.livebytes`):
the Trainer ``lowvram train`` builds, run for two steps on a model from builders.py, the second
one measured (measure_trainer_step); and the same step spelled out without a Trainer
(measure_training_step: the simulator's, which cannot build a Trainer on fake tensors).

torch and friends are imported inside functions (importing lowvram stays instant).
"""

from __future__ import annotations

import gc
from contextlib import nullcontext
from dataclasses import dataclass, field

from lowvram.check.builders import build_model, setup_plan
from lowvram.livebytes import LiveBytes
from lowvram.plan.memory.backward import CHUNK_TOKENS


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


def one_step(model, optimizer, batch, autocast_dtype, max_grad_norm, grad_accum, tracker=None,
              chunked_loss=False, chunk_tokens: int = CHUNK_TOKENS):
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
            if chunked_loss:  # lowvram.train.build.loss, as the Trainer runs it for loss: chunked
                from lowvram.train.build.loss import causal_lm_chunked_loss

                loss, out = causal_lm_chunked_loss(model, batch, chunk_tokens=chunk_tokens)
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
    chunk_tokens: int = CHUNK_TOKENS,
    kept: tuple = (),
) -> StepMemory:
    """Peak live tensor bytes of one steady-state step: model.train(), loss from the model with
    labels, backward, clip, optimizer.step(), zero_grad(set_to_none=True), as the transformers
    Trainer runs them. The simulator's step (no Trainer can be built on fake tensors): real runs
    are measured through the Trainer itself (:func:`measure_trainer_step`), and
    tests/check/test_simulate.py checks that the two agree.

    ``warmup`` runs one untracked step first so the optimizer state exists (else the peak is low).
    ``breakdown`` also sorts the bytes alive at the peak by kind (``logits_dim``: the vocabulary
    size, to recognise logits by their last dimension). ``kept``: more batches alive beside the
    step (the Trainer's other micro-batches), counted as inputs.
    """
    if warmup:
        one_step(model, optimizer, batch, autocast_dtype, max_grad_norm, grad_accum,
                  chunked_loss=chunked_loss, chunk_tokens=chunk_tokens)
    gc.collect()
    tracker = LiveBytes(cap_bytes, snapshot=breakdown, logits_dim=logits_dim)
    tracker.register(model, tag="weights")
    tracker.register(optimizer, tag="optimizer")
    tracker.register(batch, *kept, tag="inputs")
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
        one_step(model, optimizer, batch, autocast_dtype, max_grad_norm, grad_accum, tracker,
                  chunked_loss=chunked_loss, chunk_tokens=chunk_tokens)
    set_phase("done")
    for h in hooks:
        h.remove()
    parts = tracker.peak_breakdown() if breakdown else {}
    gc.collect()
    overall = max(phases.values()) if phases else start
    peak_phase = max(phases, key=phases.get) if phases else "setup"
    return StepMemory(peak_bytes=overall, peak_phase=peak_phase, start_bytes=start,
                      end_bytes=tracker.current_bytes, phases=phases, breakdown=parts)


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


def measure_trainer_step(model, setup, probe=None, device: str = "cpu", seed: int = 0,
                         output_dir: str | None = None):
    """Two optimizer steps of ``setup`` through the Trainer ``lowvram train`` builds
    (lowvram.train.build.trainer: build_training_args + build_trainer, its optimizer, autocast,
    checkpointing, chunked loss, clipping): the first makes the optimizer state, the second is
    measured with ``probe`` (TrackerProbe on a CPU; bench/gpu_check.py's CUDA probe), from its
    start to its end, with the forward/backward and the optimizer step as phases.

    Nothing is saved: transformers' DefaultFlowCallback saves at the last step whenever the save
    strategy is "steps" (trainer_callback.py on_step_end), which wrote weights, optimizer state,
    scheduler and RNG after every measured case (7B full fine-tuning: more than the GPU check's
    64 GiB disk); the measured Trainer runs with save_strategy "no". ``output_dir``: the Trainer's
    folder (default a temporary one, removed after)."""
    import tempfile
    from types import SimpleNamespace

    import torch
    from transformers import TrainerCallback, default_data_collator
    from transformers.trainer_utils import SaveStrategy

    from lowvram.train.build.trainer import build_trainer, build_training_args

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

    with tempfile.TemporaryDirectory() as tmp:
        out = output_dir or tmp
        recipe = _step_recipe(setup, out)
        args = build_training_args(recipe, setup_plan(setup, device))
        args.save_strategy = SaveStrategy.NO  # a measured step writes no checkpoint
        trainer = build_trainer(SimpleNamespace(model=model, tokenizer=None), SimpleNamespace(train=rows, eval=None),
                                args, default_data_collator, callbacks=[Measure()], loss=setup.loss,
                                loss_chunk_tokens=setup.loss_chunk_tokens, optimizer=setup.optimizer)
        try:
            trainer.train()
        finally:
            probe.release()
    return result["step"]


def measure_setup(setup, breakdown: bool = False) -> StepMemory:
    """Build ``setup`` on the CPU with train's builders and measure its second Trainer step."""
    model = build_model(setup)
    return measure_trainer_step(model, setup, TrackerProbe(breakdown, setup.model.vocab_size))
