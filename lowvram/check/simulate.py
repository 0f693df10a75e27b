"""Exact mode: the real training step of a RunSetup under FakeTensorMode, measured byte by byte.

``simulate_memory`` builds the transformers (+ peft, + bitsandbytes) model of a setup with fake
tensors (shapes and dtypes, no data: a 7B model in ~0.4 GB of RAM) with ``lowvram train``'s own
builders (lowvram.train.build.model.load_kwargs / prepare_model, the Trainer's create_optimizer),
runs the Trainer's step as :func:`lowvram.check.step.measure_training_step` spells it out (a
Trainer cannot be built on fake tensors: a warm-up step, then a tracked one: forward with labels
under autocast, backward, clip, optimizer.step, zero_grad) and reads the peak off the live-bytes
tracker. On a small Llama it equals the real Trainer step measured on a CPU
(:func:`lowvram.check.step.measure_setup`) to within a few KiB (tests/check/test_simulate.py);
at full size it checks the analytic model (bench/simulate_full_size.py).

FakeTensorMode needs eight workarounds, each explained where it is applied below as [W1]..[W7]
(and [W8], image inputs whose values the model reads: lowvram.check.simulate_images).
CUDA is not simulated [W7]: the tensors are the same on CUDA, and the context and allocator
slack come from :func:`lowvram.plan.setup.cuda_overheads`, as in the analytic model.

torch, transformers, peft and bitsandbytes are imported only here, inside functions.
"""

from __future__ import annotations

from contextlib import contextmanager

from lowvram.errors import LowvramError
from lowvram.plan.memory.memory import validate_setup
from lowvram.plan.model.models import model_numel
from lowvram.plan.setup import (
    BREAKDOWN_KEYS,
    PROCESS_HOST_BYTES,
    MemoryEstimate,
    RunSetup,
    cuda_overheads,
)
from lowvram.vocab import OPTIMIZERS_8BIT


def unsupported(setup: RunSetup) -> list[str]:
    """Why a setup cannot be simulated (empty when it can): one line per reason."""
    out = []
    if setup.gpus > 1 or setup.offload != "none":
        out.append(f"offload {setup.offload!r} / {setup.gpus} GPUs: the simulation runs one "
                   "process on one device; sharding and CPU offload are modelled analytically only")
    if setup.attention == "flash_attention_2":
        out.append("attention 'flash_attention_2' needs a CUDA kernel (fake CUDA does not run on a "
                   "CPU build of torch); simulate with sdpa, which stores the same tensors")
    if setup.loss in ("chunked", "fused"):
        out.append(f"loss {setup.loss!r} is not part of the transformers step that is simulated")
    if setup.activation_offload:
        out.append("activation_offload moves tensors between the GPU and pinned host RAM; the "
                   "simulation runs one device (the offload is modelled analytically only)")
    if setup.quantization == "int8":
        out.append("quantization 'int8': bitsandbytes Int8Params cannot wrap a fake tensor")
    from lowvram.check.simulate_images import image_problem

    if problem := image_problem(setup):
        out.append(problem)
    return out


# --------------------------------------------------------------------------------------------
# Workarounds for fake tensors


def _packed_sequence_indices(position_ids):
    """masking_utils.find_packed_sequence_indices without its ``.all()`` (fake tensors have no data)."""
    import torch

    diff = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (diff != 1).cumsum(-1)


@contextmanager
def _fake_friendly(packing: bool = False):
    """[W1] transformers takes fake tensors for tracing and builds a 4D mask: make it take the
    SDPA ``is_causal`` path of a real unpadded batch. [W2] ``nn.Module._apply`` swaps tensors,
    which fails for fake params (``.to()``, peft's adapter moves): re-create them instead."""
    import torch
    import transformers.masking_utils as mu
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers.utils.import_utils import is_tracing

    orig_apply = torch.nn.Module._apply

    def apply(self, fn, recurse=True):
        own = [t for t in (*self._parameters.values(), *self._buffers.values()) if t is not None]
        if not any(isinstance(t, FakeTensor) for t in own):
            if recurse:
                for m in self.children():
                    m._apply(fn)
            return orig_apply(self, fn, recurse=False)
        if recurse:
            for m in self.children():
                m._apply(fn)
        for key, p in self._parameters.items():
            if p is None:
                continue
            with torch.no_grad():
                new = fn(p)
            if new is not p:  # a no-op .to() keeps the very tensor (and weight tying)
                self._parameters[key] = torch.nn.Parameter(new, requires_grad=p.requires_grad)
        for key, b in self._buffers.items():
            if b is not None:
                self._buffers[key] = fn(b)
        return self

    saved = (mu.is_tracing, mu.find_packed_sequence_indices)
    mu.is_tracing = lambda tensor=None: is_tracing()  # ignore "fake tensor means tracing"
    # one sequence per row, or with packing (make_batch's restarting position_ids) the sample
    # index of each token, without the data-dependent "is anything packed" check
    mu.find_packed_sequence_indices = _packed_sequence_indices if packing else (lambda position_ids: None)
    torch.nn.Module._apply = apply
    try:
        yield
    finally:
        mu.is_tracing, mu.find_packed_sequence_indices = saved
        torch.nn.Module._apply = orig_apply


def _quantize_4bit(model, setup: RunSetup, weight_dtype, compute_dtype) -> None:
    """[W3] Replace the block Linears by bitsandbytes Linear4bit as transformers' bnb loader
    does (every nn.Linear except the output embedding): the module is built on meta outside
    fake mode, the weight quantized with ``bnb.functional.quantize_4bit`` under fake mode (bnb
    registers fake kernels) and the quant state attached to the packed tensor."""
    import bitsandbytes as bnb
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    dq = setup.quantization == "nf4-dq"
    qtype = "fp4" if setup.quantization == "fp4" else "nf4"
    from lowvram.train.build.model import VISION_MODULES, has_vision

    head = model.get_output_embeddings()
    # lowvram's BitsAndBytesConfig skips the vision tower and projector (train.model.quantization_config)
    skip = VISION_MODULES if has_vision(model.config) else ()
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is torch.nn.Linear and m is not head
               and not any(name == v or name.startswith(v + ".") for v in skip)]
    for name, lin in targets:
        with unset_fake_temporarily():
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                  compute_dtype=compute_dtype, compress_statistics=dq,
                                  quant_type=qtype, quant_storage=torch.uint8, device="meta")
        w = torch.empty(lin.out_features, lin.in_features, dtype=weight_dtype)
        packed, qs = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=dq,
                                                  quant_type=qtype, quant_storage=torch.uint8)
        del w
        # a Params4bit cannot wrap a fake tensor: a Parameter with Params4bit's attributes
        weight = torch.nn.Parameter(packed, requires_grad=False)
        for key, value in dict(quant_state=qs, blocksize=64, compress_statistics=dq,
                               quant_type=qtype, quant_storage=torch.uint8, module=q,
                               bnb_quantized=True).items():
            setattr(weight, key, value)
        q.weight = weight
        if lin.bias is not None:
            q.bias = lin.bias
        q.quant_state = qs
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, q)
    # [W5] peft's prepare_model_for_kbit_training and LoRA dispatch look for these flags
    model.is_loaded_in_4bit = True
    model.is_quantized = True
    model.quantization_method = "bitsandbytes"


def _fill_bnb_maps() -> None:
    """[W4] bitsandbytes builds its dynamic quantization map with ``.tolist()``: fill the cache
    once with real tensors, before fake mode (used by double quantization)."""
    import bitsandbytes.functional as F
    import torch

    F.quantize_blockwise(torch.zeros(256))


# --------------------------------------------------------------------------------------------
# Building


def _config(setup: RunSetup, config):
    from lowvram.check.builders import hf_config
    if config is None:
        return hf_config(setup.model, setup.attention)
    if isinstance(config, dict):
        from transformers import AutoConfig

        cfg = dict(config)
        cfg.pop("quantization_config", None)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = setup.attention
    return config


def _build_model(setup: RunSetup, config, mode):
    """The model of ``setup`` with fake tensors, prepared as lowvram.check.builders.build_model does."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from lowvram.check.builders import setup_plan
    from lowvram.train.build.model import (
        has_vision,
        load_kwargs,
        model_class,
        precision_compute_dtype,
        prepare_model,
    )

    plan = setup_plan(setup)
    dtype = load_kwargs(plan)["dtype"]
    cfg = _config(setup, config)
    build = model_class(has_vision(cfg)).from_config
    with mode:
        try:
            try:
                model = build(cfg, dtype=dtype)
            except DataDependentOutputException:
                # e.g. SigLIP's initialisation reads tensor values, which fake tensors do not
                # have: the values do not matter to memory, so build without initialising them
                with _no_init_weights():
                    model = build(cfg, dtype=dtype)
                model.tie_weights()  # tying runs in the initialisation that was skipped
        except (ValueError, KeyError, TypeError) as e:
            hint = ("this architecture has no SDPA in transformers: add --attention eager"
                    if "attention implementation" in str(e)
                    else "pass a causal LM's config.json (AutoModelForCausalLM)")
            raise LowvramError(f"transformers cannot build this config: {str(e)[:200]}",
                               hint) from None
        except DataDependentOutputException:
            raise LowvramError(
                f"transformers builds this config ({cfg.model_type}) with a step that reads tensor "
                "values, which fake tensors do not have: it cannot be simulated",
                "use `lowvram plan` without --simulate (the analytic plan), or plan the language "
                "model alone by saving its text_config as a config.json and passing that folder") from None
        if setup.quantization != "none":
            _quantize_4bit(model, setup, dtype, precision_compute_dtype(setup.precision))
        model = prepare_model(model, plan, images=bool(setup.images_per_row))  # as lowvram train after loading
    return model


def _no_init_weights():
    """transformers' context that skips weight initialisation (transformers.initialization in
    transformers 5, modeling_utils before)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def _parameters(model) -> int:
    """Parameters as the unquantized model counts them (a Linear4bit holds in x out weights)."""
    import torch

    n = 0
    seen = set()
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if name == "weight" and p.dtype == torch.uint8 and hasattr(m, "in_features"):
                n += m.in_features * m.out_features
            else:
                n += p.numel()
    return n


# --------------------------------------------------------------------------------------------
# The simulation


def simulate_memory(setup: RunSetup, config=None) -> MemoryEstimate:
    """Peak bytes of one steady-state step of ``setup``, from the real step on fake tensors.

    ``config``: a transformers config (or config.json dict) to build instead of the catalog shape
    of ``setup.model`` (any causal LM transformers can build). Breakdown keys as in
    :func:`lowvram.plan.memory.memory.estimate_memory`; CUDA context and allocator slack added for
    ``device="cuda"``.
    """
    validate_setup(setup)
    problems = unsupported(setup)
    if problems:
        raise LowvramError("cannot simulate this setup: " + "; ".join(problems),
                           "use `lowvram plan` without --simulate for the analytic estimate")
    from dataclasses import replace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from lowvram.check.builders import autocast_dtype, build_optimizer
    from lowvram.check.step import measure_training_step
    from lowvram.train.build.model import quiet_libraries

    quiet_libraries()
    # From the second micro-step on, every micro-step holds the same tensors (the gradients of
    # the first are alive): two micro-steps give the peak of any accumulation count.
    kept = _kept_batches(setup)  # as many as the Trainer holds at the asked accumulation
    setup = replace(setup, grad_accum=min(setup.grad_accum, 2))

    if setup.optimizer in OPTIMIZERS_8BIT or setup.quantization == "nf4-dq":
        _fill_bnb_maps()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _fake_friendly(setup.packing):
        model = _build_model(setup, config, mode)
        parameters = _parameters(model)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        base = parameters - (trainable if setup.lora else 0)
        if config is None and base != model_numel(setup.model):
            raise LowvramError(
                f"cannot simulate {setup.model.name}: its catalog shape rebuilt as a "
                f"{setup.model.model_type} model has {base:,} parameters, not "
                f"{model_numel(setup.model):,}",
                "pass the model's config.json folder: --model path/to/folder --simulate")
        # [W4] bnb 8-bit optimizers: construct outside fake mode, maps filled with real tensors
        opt = build_optimizer(model, setup.optimizer)
        if hasattr(opt, "fill_qmap"):
            opt.fill_qmap()
        vocab = model.get_output_embeddings().out_features
        with _batches(setup, model, mode, vocab, kept) as (batch, kept):
            # [W6] measure_training_step warms the optimizer state up before tracking
            step = measure_training_step(model, opt, batch, autocast_dtype=autocast_dtype(setup),
                                         grad_accum=setup.grad_accum, breakdown=True,
                                         logits_dim=vocab, kept=kept)
        del model, opt, batch, kept
    return _estimate(setup, step, parameters, trainable)


def _kept_batches(setup: RunSetup) -> int:
    """Image data: the micro-batches the Trainer holds beside the one in the step (the rest of
    the step's and the next: plan/memory/images.py batches_alive); text: none (its ids are small)."""
    from lowvram.plan.memory.images import batches_alive

    return batches_alive(setup) - 1 if setup.images_per_row else 0


@contextmanager
def _batches(setup: RunSetup, model, mode, vocab: int, kept: int):
    """(the step's batch, ``kept`` more the Trainer holds beside it) as fake tensors, inside ``mode``:
    text (builders.make_batch), or image + text (simulate_images: the run's ImageCollator; [W8])."""
    import torch

    from lowvram.check.builders import make_batch

    if not setup.images_per_row:
        with mode, torch.no_grad():
            batch = make_batch(_with_vocab(setup, vocab))
        with mode:
            yield batch, ()
        return
    import tempfile
    from pathlib import Path

    from lowvram.check import simulate_images as si

    with tempfile.TemporaryDirectory() as folder:
        real = si.image_batch(setup, model.config, Path(folder))
    real.update(si.precomputed_inputs(model, real))
    with si.valued_constants(), mode:
        batch = si.fake_batch(mode, real)
        kept = tuple(si.fake_batch(mode, {k: t.clone() for k, t in real.items()})
                     for _ in range(kept))
        yield batch, kept


def _with_vocab(setup: RunSetup, vocab: int) -> RunSetup:
    from dataclasses import replace

    return replace(setup, model=replace(setup.model, vocab_size=vocab))


def _estimate(setup: RunSetup, step, parameters: int, trainable: int) -> MemoryEstimate:
    """StepMemory -> MemoryEstimate. Untagged bytes at the peak are activations (forward and
    backward) or optimizer-step temporaries (reported under "optimizer", as estimate_memory
    does); the batch's input ids and labels count as activations."""
    b = step.breakdown
    phase = "optimizer_step" if step.peak_phase == "optimizer_step" else "forward_backward"
    other = b.get("other", 0)
    parts = dict(weights=b.get("weights", 0), gradients=b.get("gradients", 0),
                 optimizer=b.get("optimizer", 0) + (other if phase == "optimizer_step" else 0),
                 activations=b.get("inputs", 0) + (0 if phase == "optimizer_step" else other),
                 logits=b.get("logits", 0))
    tensors = sum(parts.values())
    ov = cuda_overheads()
    cuda = setup.device == "cuda"
    # the allocator slack's shares as estimate_memory takes them: on the weights and optimizer
    # state (allocated once), on the rest (churn)
    once = min(parts["weights"] + b.get("optimizer", 0), tensors)
    slack = ov.allocator_parts(once, tensors - once, setup.expandable_segments) if cuda else {}
    parts["cuda_context"] = ov.context_bytes if cuda else 0
    parts["allocator"] = sum(slack.values())
    breakdown = {k: int(parts[k]) for k in BREAKDOWN_KEYS}
    process = PROCESS_HOST_BYTES  # as estimate_memory
    peak = sum(breakdown.values())
    return MemoryEstimate(
        parameters=parameters, trainable_parameters=trainable, peak_bytes=peak,
        breakdown=breakdown, peak_phase=phase,
        cpu_ram_bytes=peak + process if not cuda else process,
        persistent_bytes=step.start_bytes,
        allocator_parts=slack,
        allocated_once_bytes=int(once),
    )


# --------------------------------------------------------------------------------------------
# `lowvram plan --simulate`


def simulable(setup: RunSetup) -> tuple[RunSetup, tuple[str, ...]]:
    """The setup the simulation can run in place of ``setup``, and a note for each change: the
    standard loss for the chunked or fused one, no activation offload, sdpa for flash attention,
    one process without sharding or CPU offload (each of those is modelled analytically only).
    Image + text data is simulated with its images (simulate_images)."""
    from dataclasses import replace

    changes, notes = {}, []
    if setup.loss in ("chunked", "fused"):
        changes["loss"] = "standard"
        notes.append(f"simulated with the standard loss: the {setup.loss} loss is not part of the "
                     "transformers step that is simulated (its logits are modelled analytically)")
    if setup.activation_offload:
        changes["activation_offload"] = False
        notes.append("simulated without activation offload (one device: the checkpoints stay on it)")
    if setup.attention == "flash_attention_2":
        changes["attention"] = "sdpa"
        notes.append("simulated with sdpa attention, which stores the same tensors as flash_attention_2")
    if setup.gpus > 1 or setup.offload != "none":
        changes.update(gpus=1, offload="none")
        notes.append(f"simulated as one process with nothing offloaded: offload {setup.offload!r} "
                     f"over {setup.gpus} GPU(s) is modelled analytically only")
    return (replace(setup, **changes) if changes else setup), tuple(notes)


def simulate_plan(setup: RunSetup, model_ref: str | None, analytic_peak_bytes: int) -> dict:
    """The ``simulated`` object of `lowvram plan --simulate --json` (bytes; lowvram.report.plans
    renders). A plan the step cannot run as it is (chunked loss, activation offload, ...) is
    simulated as :func:`simulable` changes it, with its notes, against the analytic peak of
    that same setup."""
    import time

    t0 = time.perf_counter()
    from lowvram.plan.model.catalog import local_config

    simulated, notes = simulable(setup)
    if notes:
        from lowvram.plan.memory.memory import estimate_memory

        analytic_peak_bytes = estimate_memory(simulated).peak_bytes
    sim = simulate_memory(simulated, local_config(model_ref))
    return {
        "notes": list(notes),
        "peak_bytes": sim.peak_bytes,
        "peak_phase": sim.peak_phase,
        "breakdown": dict(sim.breakdown),
        "analytic_peak_bytes": analytic_peak_bytes,
        "difference": round((analytic_peak_bytes - sim.peak_bytes) / sim.peak_bytes, 5),
        "parameters": sim.parameters,
        "trainable_parameters": sim.trainable_parameters,
        "seconds": round(time.perf_counter() - t0, 2),
    }


__all__ = ["simulable", "simulate_memory", "simulate_plan", "unsupported"]
