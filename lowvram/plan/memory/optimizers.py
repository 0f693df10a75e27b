"""Optimizers beyond AdamW's kin, counted from their source: GaLore (optimizer galore_adamw) and
its 8-bit and layerwise forms (galore_adamw_8bit, galore_adamw_layerwise,
galore_adamw_8bit_layerwise: the Trainer's own optim names).

GaLore (Zhao et al. 2024, "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank
Projection"), as galore-torch 1.0 implements it (``galore_torch/adamw.py`` AdamW.step,
``galore_projector.py`` GaLoreProjector, proj_type "std") and the Trainer wires it
(transformers ``trainer_optimizer._get_galore_optimizer`` / ``_setup_low_rank_optimizer``: the
``optim_target_modules`` Linears' weights in a group with ``rank``, every other parameter in a
plain AdamW group). For a target weight of d_out x d_in (m x n), k = min(m, n), q = min(rank, k):

- **State**: the projected gradient is m x q (m >= n: ``grad @ P.T``, P = Vh[:rank]) or q x n
  (``P.T @ grad``, P = U[:, :rank]); exp_avg and exp_avg_sq have its shape, in the gradient's dtype.
  The projector P: a 16-bit parameter keeps a copy in its dtype (``.type(original_type)``); an
  fp32 one keeps a *view* of the SVD factor, which holds the whole factor's storage alive (Vh: k x
  n, U: m x k, fp32). Other parameters: AdamW's two moments in their dtype.
- **Step temporaries**: ``denom = exp_avg_sq.sqrt()`` and ``exp_avg / denom`` (two state-sized
  tensors); a target's ``project_back`` makes the full m x n update and ``* scale`` a second; so
  2 x the largest tensor of either group in the parameter dtype. Every ``update_proj_gap`` steps
  (and at the first) the projector is renewed: ``torch.linalg.svd`` of the gradient in fp32 (a
  copy unless fp32) gives U (m x k), S and Vh (k x n), beside the old projector. LAPACK's or
  cuSOLVER's own workspace is not counted (the live-bytes tracker sees tensors only).

**8-bit** (``galore_torch/adamw8bit.py`` AdamW8bit, a bitsandbytes 0.50 ``Optimizer2State``):
a target's step projects the gradient, swaps ``p.data`` for a zeroed tensor of the projected
shape (``p.saved_data = p.data.clone()``: a second m x n weight while the full gradient is still
``p.grad``), then ``init_state`` sizes the state by that projected ``p``: below ``min_8bit_size``
(4096 elements) two fp32 moments, else two uint8 moments and one fp32 absmax per 256-element block
each (``blocksize = 256``). Every other parameter the same rule on its own shape; the embedding is
*not* kept in 32 bit (the Trainer's ``register_module_override`` runs only when "bitsandbytes" is
in the class's path, and galore_torch's is not). AdamW8bit hands ``percentile_clipping=100`` to
the positional slot of ``max_unorm``, so every state also gets a 4-byte ``unorm_vec``; each
optimizer makes the two 256-entry fp32 maps (``name2qmap``) on the CPU, and one that has an 8-bit
state moves them to its device (:func:`_qmaps_bytes`). bitsandbytes
updates in place; the projection back makes two m x n tensors (``project_back``, ``* scale``)
added into ``saved_data``. Its step calls ``torch.cuda.synchronize()`` unconditionally; on a
machine without CUDA lowvram.train.build.galore_cpu makes that call a no-op (bitsandbytes 0.50 steps CPU
tensors with its CPU kernels, whose fp32 working copies live inside one operator: the live-bytes
tracker does not see them, and on CUDA the kernel updates in place).

**Layerwise** (transformers ``_setup_low_rank_optimizer``, ``is_layerwise``): one optimizer per
parameter (``optimizer_dict[param] = optimizer_cls([{"params": [param], ...}])``), stepped and
zeroed (``zero_grad``: ``.grad = None``) by ``register_post_accumulate_grad_hook`` as soon as the
parameter's gradient is accumulated; the Trainer's optimizer is ``LayerWiseDummyOptimizer``, whose
``step`` does nothing. So no full set of gradients is ever alive: inside the backward, one
parameter's gradient and its step's temporaries (the SVD at a renewal too) beside what the
backward holds then (:func:`layerwise_step_bytes`; the moments in plan/memory/memory.py). What it gives
up: gradient accumulation (``ValueError`` "does not support gradient accumulation" unless
``gradient_accumulation_steps == 1``), several processes (``NotImplementedError`` under DDP), and
gradient clipping: the Trainer's ``clip_grad_norm_`` runs after the backward, on parameters whose
gradients the hooks already applied and set to None (it clips nothing and logs a norm of 0).

Measured: the state of a real GaLoreAdamW / AdamW8bit after one Trainer step, plain and layerwise,
and the 8-bit step's temporaries (tests/plan/test_galore.py, exact), and whole runs through
``lowvram train`` (the differential test's GaLore draws, bench/plan_fuzz.py --galore 8bit).

**LOMO** (optimizer lomo; Lv et al. 2024, "Full Parameter Fine-tuning for Large Language Models
with Limited Resources") and **AdaLomo** (optimizer adalomo; Lv et al. 2024, "AdaLomo:
Low-memory Optimization with Adaptive Learning Rate"), as lomo-optim 0.1.1 implements them
(``lomo_optim/lomo.py`` Lomo, ``lomo_optim/adalomo.py`` AdaLomo) and the Trainer wires them
(transformers ``trainer_optimizer._get_lomo_optimizer``: ``Lomo(model, lr=learning_rate)``, no
weight decay, no clipping; ``Trainer.training_step`` passes ``learning_rate`` to
``accelerator.backward``, which calls ``optimizer.fused_backward(loss, lr)``; accelerate's
``AcceleratedOptimizer.step`` returns at once for them). Each trainable parameter gets a *tensor*
hook (``p.register_hook(grad_func)``): it runs when the parameter's gradient has been computed,
before it is accumulated into ``.grad``, and steps every parameter whose ``.grad`` is set (the one
accumulated before it) and sets that ``.grad`` to None; ``fused_backward`` calls it once more
after ``loss.backward()`` for the last. So at a hook: the incoming gradient, the previous
parameter's gradient and its step's temporaries, beside what the backward holds then
(:func:`lomo_step_bytes`); between hooks, one accumulated gradient (:func:`lomo_pending_bytes`).

- **State**: LOMO none (SGD, no momentum). AdaLomo: Adafactor's factored second moment in fp32
  for every parameter, made in ``__init__`` with ``.cuda()``: a matrix's row (``shape[0]``)
  and column (``shape[1]``) means, a vector's full ``exp_avg_sq`` (:func:`lomo_state_bytes`).
- **Step temporaries** of one n-element parameter (``fuse_update``): LOMO's ``grad_fp32 =
  p.grad.to(torch.float32)`` and ``p_fp32 = p.data.to(torch.float32)`` are the tensors
  themselves in fp32 (nothing beyond the gradient) and copies of 16-bit ones (the 16-bit
  gradient dropped by ``p.grad = None`` before ``p_fp32``): 8n bytes. AdaLomo: ``update =
  (grad_fp32**2) + eps`` (two fp32 tensors at once beside the fp32 gradient), then
  ``_approx_sq_grad`` (a third while ``update`` is still held), then ``p_fp32``: 12n bytes at
  every turn, either dtype.

What they give up: LOMO is SGD without momentum or weight decay (the Trainer hands it only the
learning rate); AdaLomo keeps no first moment (Adafactor-like, with its grouped update
normalisation); both: gradient accumulation (each micro-batch's backward would step the weights;
transformers does not refuse it), gradient clipping (the Trainer never calls ``grad_norm``, the
second backward LOMO's clipping needs; its ``clip_grad_norm_`` afterwards finds no gradients),
several processes (the non-ZeRO hook steps on the local gradient: DDP ranks would drift apart),
and fp16 (accelerate's ``backward`` takes its GradScaler branch before the LOMO one, so
``fused_backward`` never runs and the hooks step with scaled gradients). AdaLomo needs CUDA
(``.cuda()`` in ``__init__``) and weights of 2 dimensions at most (its row mean of a 3-D fused
expert weight has the wrong shape).

Measured: AdaLomo's state against the real class (``.cuda`` stubbed on the CPU) and LOMO's and
AdaLomo's step working sets (tests/plan/test_lomo.py, exact), and LOMO whole runs through
``lowvram train`` (bench/plan_fuzz.py --lomo; AdaLomo cannot run on the CPU).

**APOLLO** (optimizers apollo_adamw, apollo_adamw_layerwise; Zhu et al. 2025, "APOLLO: SGD-like
Memory, AdamW-level Performance"), as apollo-torch 1.0.3 implements it (``apollo_torch/apollo.py``
AdamW.step, ``random_projector.py`` GradientProjector) and the Trainer wires it
(``_get_apollo_optimizer``: rank 128, proj "random", scale_type "channel", update_proj_gap 200,
scale 1.0, proj_type "std"; then GaLore's ``_setup_low_rank_optimizer``, layerwise included). For
a target weight of m x n and r = rank (*not* capped by the weight's dimensions: a random
projection of any rank):

- **State**: the projector ``stable_randn`` (r x n when m >= n, else m x r), in the parameter's
  dtype (fp32 generated, ``.type(original_type)`` for 16 bit); exp_avg and exp_avg_sq of the
  projected gradient (m x r or r x n) in the gradient's dtype; ``scaled_grad``, a 0-d norm in the
  parameter's dtype. Other parameters: AdamW's two moments.
- **Step temporaries** of a target: the projected gradient, ``denom`` and ``norm_grad``
  (three projected-size tensors) and the channel-wise ``grad_scaling_factor`` (a vector over the
  larger side) while ``scaled_grad = p.grad * grad_scaling_factor``, its 0-d norm and its
  norm-growth-limited copy ``scaled_grad / limiter`` (two m x n) are made; at a renewal (the first
  step, then every update_proj_gap) the new projector in fp32 twice (``stable_randn(...) /
  sqrt(rank)``) beside the old one. Other parameters: ``denom`` and ``exp_avg / denom``.

What it gives up: the update is AdamW's only through a channel-wise scale estimated in a random
rank-r space (the paper's claim: AdamW-level results at SGD-like memory); as GaLore no LoRA, MoE,
GPT-2 or DeepSpeed/FSDP, and the layerwise form the in-backward limits. Measured: the state and
one step's working set of the real optimizer (tests/plan/test_apollo.py) and whole runs through
``lowvram train`` (bench/plan_fuzz.py --apollo).

**AdamW in the backward** (optimizer adamw_in_backward; lowvram.train.build.in_backward, PyTorch's
pattern "How to save memory by fusing the optimizer step into the backward pass", torchtune's
``optimizer_in_bwd``): the Trainer's fused AdamW, one per parameter, stepped and its gradient set
to None by ``register_post_accumulate_grad_hook`` (the Trainer holds ``LayerWiseDummyOptimizer``).
AdamW's state, and its fused step works in place (no temporaries, as for adamw); the moments are
layerwise GaLore's: one parameter's gradient alive beside the backward, never the full set. What it
gives up: the in-backward limits only (no gradient clipping, no accumulation, one process); the
update is AdamW's. Measured: whole runs through ``lowvram train`` (bench/plan_fuzz.py
--in-backward).

**torchao's low-bit AdamW** (optimizers adamw_torch_8bit and adamw_torch_4bit, the Trainer's own
names; torchao 0.18 ``torchao/optim/adam.py`` AdamW8bit / AdamW4bit, ``subclass_8bit.py`` /
``subclass_4bit.py``; Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", and Li
et al. 2023, "Memory Efficient Optimizers with 4-bit States"), as the Trainer wires them
(transformers ``trainer_optimizer._get_torchao_optimizer``: ``block_size`` 256 unless optim_args
say otherwise, for the 4-bit form too, whose own default is 128; the Trainer's two weight-decay
groups):

- **State** (``_AdamBase._new_buffer``): a tensor of at least 4096 elements whose size is a
  multiple of the block gets two quantized moments, each ``codes`` (uint8: n bytes at 8 bit, n / 2
  packed at 4 bit), ``scale`` (one fp32 per 256-element block) and ``qmap`` (fp32: 256 entries at 8
  bit, 16 at 4 bit); every other tensor two ``zeros_like`` moments in its own dtype. ``step`` is
  ``torch.tensor(0.0)``: a CPU scalar per parameter (4 bytes, counted on a CPU plan only), and so
  is each group's ``lr`` tensor (:func:`torchao_state_bytes`). Every tensor is quantized, the
  embedding too (bitsandbytes' 8-bit AdamW keeps the embedding in 32 bit under the Trainer).
- **Step temporaries**: ``step()`` calls ``torch.compile(single_param_adam, fullgraph=True,
  dynamic=False)`` per parameter; what the compiled kernel keeps for one quantized parameter was
  measured (constants.TORCHAO_8BIT_STEP_TEMP_BYTES / _4BIT_: the fp32 moments before
  re-quantization and the block absmaxes), a full-precision one steps in place
  (:func:`torchao_step_temp_bytes`). The first step compiles once per shape and dtype (seconds to
  tens of seconds each); compiling needs a C++ compiler on the CPU and Triton on CUDA.

What it gives up: moments rounded to 8 or 4 bits per block (torchao's own Llama-2-7B fine-tune:
truthfulqa_mc2 42.61 with fused AdamW, 41.50 at 8 bit, 42.27 at 4 bit; torchao/optim/README.md), no
DeepSpeed or FSDP here (the plans are not measured under them). Measured: the state of the real
optimizers after one step (tests/plan/test_torchao.py, byte for byte) and whole runs through
``lowvram train`` with the step compiled (bench/plan_fuzz.py --torchao).
"""

from __future__ import annotations

from collections import Counter
from math import prod

from lowvram.plan import constants as fitted
from lowvram.plan.model.layer import describe_layer
from lowvram.plan.model.models import ModelSpec, block_linears
from lowvram.plan.setup import RunSetup
from lowvram.vocab import (
    APOLLO_OPTIMIZERS,
    EIGHT_BIT_DEVICES,
    FUSED_BACKWARD_OPTIMIZERS,
    GALORE_8BIT_OPTIMIZERS,
    IN_BACKWARD_OPTIMIZERS,
    LAYERWISE_OPTIMIZERS,
    LOMO_OPTIMIZERS,
    PROJECTED_OPTIMIZERS,
    TORCHAO_OPTIMIZERS,
)

GALORE_RANK = 128  # transformers' default (optim_args rank)
GALORE_UPDATE_PROJ_GAP = 200  # transformers' default (optim_args update_proj_gap)
GALORE_SCALE = 0.25  # transformers' default (optim_args scale)
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes Optimizer2State min_8bit_size (galore_torch AdamW8bit's default)
BNB_BLOCKSIZE = 256  # bitsandbytes Optimizer2State.init_state: blocksize = 256 (one fp32 absmax each)
BNB_QMAPS_BYTES = 2 * 256 * 4  # name2qmap "dynamic" + "udynamic": 256 fp32 each, per optimizer
TORCHAO_BLOCK_SIZE = 256  # transformers _get_torchao_optimizer: optim_args block_size, default 256
TORCHAO_MIN_QUANTIZED = 4096  # torchao _AdamBase._new_buffer: "only quantize tensors >= 4096 values"
TORCHAO_QMAP_ENTRIES = {"adamw_torch_8bit": 256, "adamw_torch_4bit": 16}  # fp32 lookup table per moment
TORCHAO_CODE_BITS = {"adamw_torch_8bit": 8, "adamw_torch_4bit": 4}
BNB_UNORM_BYTES = 4  # state["unorm_vec"]: (1,) fp32, max_unorm > 0 (AdamW8bit's positional slip)


def galore_targets(spec: ModelSpec) -> tuple[str, ...]:
    """The Trainer's optim_target_modules for GaLore: the decoder blocks' Linears by name (never
    the embedding or lm_head, as in the paper)."""
    return tuple(dict.fromkeys(lin.name for lin in block_linears(spec)))


def projected(setup: RunSetup) -> bool:
    return setup.optimizer in PROJECTED_OPTIMIZERS


def layerwise(setup: RunSetup) -> bool:
    return setup.optimizer in LAYERWISE_OPTIMIZERS


def lomo(setup: RunSetup) -> bool:
    return setup.optimizer in LOMO_OPTIMIZERS


def fused_backward(setup: RunSetup) -> bool:
    return setup.optimizer in FUSED_BACKWARD_OPTIMIZERS


def in_backward(setup: RunSetup) -> bool:
    """Stepped one parameter at a time inside the backward (layerwise GaLore, LOMO, AdaLomo)."""
    return setup.optimizer in IN_BACKWARD_OPTIMIZERS


def apollo(setup: RunSetup) -> bool:
    return setup.optimizer in APOLLO_OPTIMIZERS


def torchao(setup: RunSetup) -> bool:
    return setup.optimizer in TORCHAO_OPTIMIZERS


def eight_bit(setup: RunSetup) -> bool:
    return setup.optimizer in GALORE_8BIT_OPTIMIZERS


IN_BACKWARD_GIVEN_UP = ("each parameter stepped in the backward, so no gradient clipping "
                        "(training.max_grad_norm has nothing left to clip), no gradient accumulation "
                        "and one process only")


def given_up(setup: RunSetup) -> str:
    """What the setup's GaLore or LOMO form gives up, for the plan's reason (the search's order:
    request.optimizer_given_up)."""
    if setup.optimizer == "lomo":
        return ("LOMO trains every weight with plain SGD (no momentum, no adaptive step, no weight decay: "
                "the Trainer hands it only the learning rate); " + IN_BACKWARD_GIVEN_UP)
    if fused_backward(setup):
        return "AdamW's own update, each parameter stepped in the backward and its gradient freed; " + IN_BACKWARD_GIVEN_UP
    if torchao(setup):
        return (f"{TORCHAO_CODE_BITS[setup.optimizer]}-bit AdamW moments (torchao, block-wise "
                "quantized, the embedding too); its step is compiled by torch.compile, the first "
                "step compiling once per tensor shape")
    if setup.optimizer == "adalomo":
        return ("AdaLomo trains every weight with a factored second moment and no first moment "
                "(Adafactor-like; CUDA only); " + IN_BACKWARD_GIVEN_UP)
    if apollo(setup):
        out = [f"APOLLO trains every weight with the raw gradient scaled channel-wise by AdamW moments "
               f"kept in a random rank-{setup.galore_rank} projection (its step takes about AdamW's time: "
               "APOLLO's Table 7, docs/constants.md)"]
    else:
        out = [f"GaLore trains every weight but each decoder Linear's update lives in a rank-"
               f"{setup.galore_rank} subspace (renewed by an SVD every update_proj_gap steps, which makes "
               "its step about 3.2x AdamW's at 7B: APOLLO's Table 7, docs/constants.md)"]
    if eight_bit(setup):
        out.append("8-bit moments (bitsandbytes blockwise)")
    if layerwise(setup):
        out.append("layerwise: " + IN_BACKWARD_GIVEN_UP)
    return "; ".join(out)


def optimizer_problems(setup: RunSetup) -> list[str]:
    """Why the setup's optimizer cannot run (empty when it can)."""
    if lomo(setup):
        return lomo_problems(setup)
    if torchao(setup):
        return torchao_problems(setup)
    if fused_backward(setup):
        return fused_backward_problems(setup)
    if not projected(setup):
        return []
    o, out = setup.optimizer, []
    if setup.lora:
        out.append(f"optimizer {o} projects the gradients of full weights; with lora there are none "
                   "(use it with lora: off, or optimizer adamw)")
    if setup.offload != "none":
        out.append(f"optimizer {o} cannot run under offload {setup.offload}: DeepSpeed flattens and "
                   "FSDP2 shards the weights it projects (use offload none, one GPU)")
    if setup.model.is_moe:
        out.append(f"optimizer {o} on an MoE model: its routed experts are no nn.Linear, so it "
                   "would leave most weights unprojected (use adamw_8bit)")
    if setup.model.model_type == "gpt2":
        out.append(f"optimizer {o}: GPT-2's projections are Conv1D, not nn.Linear (transformers' "
                   "optim_target_modules takes Linears only)")
    if eight_bit(setup) and setup.device not in EIGHT_BIT_DEVICES:
        out.append(f"optimizer {o} needs CUDA or the CPU: bitsandbytes 0.50 has no 8-bit optimizer kernel "
                   f"for {setup.device} (use galore_adamw or galore_adamw_layerwise on this machine)")
    if layerwise(setup) and setup.grad_accum != 1:
        out.append(f"optimizer {o} steps each parameter inside the backward, so it cannot accumulate "
                   f"gradients (transformers raises for gradient_accumulation {setup.grad_accum}; "
                   f"use gradient_accumulation 1, or {o.replace('_layerwise', '')})")
    if layerwise(setup) and setup.gpus > 1:
        out.append(f"optimizer {o} runs in one process only (transformers raises NotImplementedError "
                   f"under DDP; use --gpus 1, or {o.replace('_layerwise', '')})")
    return out


def _stepped_in_backward_problems(setup: RunSetup) -> list[str]:
    """What no optimizer stepped inside the backward runs with (LOMO, AdamW in the backward)."""
    o, out = setup.optimizer, []
    if setup.lora:
        out.append(f"optimizer {o} steps full weights in the backward; with lora the adapters' gradients are "
                   "small already (use it with lora: off, or optimizer adamw)")
    if setup.offload != "none":
        out.append(f"optimizer {o} cannot run under offload {setup.offload}: DeepSpeed and FSDP2 own the "
                   "parameters it steps (use offload none, one GPU)")
    return out


def lomo_problems(setup: RunSetup) -> list[str]:
    """Why the setup's LOMO form cannot run (see the module)."""
    o, out = setup.optimizer, _stepped_in_backward_problems(setup)
    if o == "adalomo" and setup.device != "cuda":
        out.append("optimizer adalomo needs CUDA: lomo_optim's AdaLomo makes its state with .cuda() "
                   "(use lomo on this machine)")
    if o == "adalomo" and not setup.lora and setup.model.is_moe:
        out.append("optimizer adalomo factors a weight's second moment over its two dimensions; an MoE "
                   "model's fused 3-D expert weights do not fit it (use lomo)")
    if setup.precision.startswith("fp16"):
        out.append(f"optimizer {o} cannot train in {setup.precision}: accelerate's GradScaler backward runs "
                   "instead of LOMO's fused_backward (use bf16 or fp32)")
    if setup.grad_accum != 1:
        out.append(f"optimizer {o} steps each parameter inside the backward, so it cannot accumulate "
                   f"gradients (gradient_accumulation {setup.grad_accum} would step every micro-batch; "
                   "use gradient_accumulation 1)")
    if setup.gpus > 1:
        out.append(f"optimizer {o} runs in one process only (its hooks step on each rank's own gradient; "
                   "use --gpus 1)")
    return out


def fused_backward_problems(setup: RunSetup) -> list[str]:
    """Why AdamW in the backward cannot run as planned (see the module)."""
    o, out = setup.optimizer, _stepped_in_backward_problems(setup)
    if setup.grad_accum != 1:
        out.append(f"optimizer {o} steps each parameter inside the backward, so it cannot accumulate "
                   f"gradients (gradient_accumulation {setup.grad_accum}; use gradient_accumulation 1, or adamw)")
    if setup.gpus > 1:
        out.append(f"optimizer {o} runs in one process only (its hooks step before DDP's all-reduce; "
                   "use --gpus 1, or adamw)")
    return out


def torchao_problems(setup: RunSetup) -> list[str]:
    """Why the setup's torchao AdamW cannot run as planned (see the module)."""
    if setup.offload == "none":
        return []
    return [f"optimizer {setup.optimizer} under offload {setup.offload} is not planned: DeepSpeed flattens "
            "the parameters it would quantize per tensor, and FSDP2's sharded state was not measured "
            "(use offload none, one GPU or DDP)"]


def _torchao_quantized(numel: int) -> bool:
    return numel >= TORCHAO_MIN_QUANTIZED and numel % TORCHAO_BLOCK_SIZE == 0


def torchao_state_bytes(setup: RunSetup, w: int, shapes: list[tuple[int, ...]]) -> int:
    """torchao AdamW8bit / AdamW4bit's state (``_new_buffer``, ``OptimState8bit.zeros`` /
    ``OptimState4bit.zeros``): per quantized tensor two moments of codes + an fp32 scale per block
    + an fp32 qmap; per other tensor two moments in its dtype ``w``. On a CPU plan also each
    parameter's ``step`` scalar and the two groups' ``lr`` tensors (on CUDA they stay in host RAM)."""
    o = setup.optimizer
    total = 0
    for s in shapes:
        n = prod(s)
        if _torchao_quantized(n):
            codes = n * TORCHAO_CODE_BITS[o] // 8
            total += 2 * (codes + 4 * (n // TORCHAO_BLOCK_SIZE) + 4 * TORCHAO_QMAP_ENTRIES[o])
        else:
            total += 2 * w * n
    if setup.device == "cpu":
        total += 4 * len(shapes) + 4 * 2
    return total


def torchao_step_temp_bytes(setup: RunSetup, shapes: list[tuple[int, ...]]) -> int:
    """The compiled step's buffers for its largest quantized tensor (constants.TORCHAO_*BIT_STEP_TEMP_BYTES;
    a tensor kept in full precision steps in place)."""
    quantized = [prod(s) for s in shapes if _torchao_quantized(prod(s))]
    if not quantized:
        return 0
    c = fitted.TORCHAO_8BIT_STEP_TEMP_BYTES if setup.optimizer == "adamw_torch_8bit" else fitted.TORCHAO_4BIT_STEP_TEMP_BYTES
    return c.of(max(quantized))


def lomo_state_bytes(setup: RunSetup, shapes: list[tuple[int, ...]]) -> int:
    """AdaLomo's state (``AdaLomo.__init__``): fp32 ``exp_avg_sq_row`` (shape[0]) and
    ``exp_avg_sq_col`` (shape[1]) of a matrix, ``exp_avg_sq`` of a vector. LOMO: none."""
    if setup.optimizer != "adalomo":
        return 0
    return sum(4 * (s[0] + s[1]) if len(s) > 1 else 4 * s[0] for s in shapes)


def lomo_working_bytes(setup: RunSetup, w: int, numel: int) -> int:
    """One parameter's gradient and step temporaries at its step (see the module): AdaLomo 12n
    bytes (the fp32 gradient and two fp32 tensors); LOMO the fp32 gradient itself, or 8n bytes
    (fp32 copies of a 16-bit gradient and weight)."""
    if setup.optimizer == "adalomo":
        return 12 * numel
    return 4 * numel if w == 4 else 8 * numel


def _target_shapes(setup: RunSetup) -> list[tuple[int, int]]:
    return [(lin.d_out, lin.d_in) for lin in block_linears(setup.model)] * setup.model.num_layers


def _projected_shape(m: int, n: int, rank: int, capped: bool = True) -> tuple[int, int]:
    """The projected gradient: GaLore's rank is capped by the SVD's k = min(m, n); APOLLO's
    random projection is not (``capped`` False)."""
    q = min(rank, m, n) if capped else rank
    return (m, q) if m >= n else (q, n)


def _apollo_projector_numel(m: int, n: int, rank: int) -> int:
    return rank * n if m >= n else m * rank


def _bnb_state_bytes(numel: int) -> int:
    """A bitsandbytes Optimizer2State's two moments of one tensor (init_state): fp32 below
    min_8bit_size, else uint8 + an fp32 absmax per block of 256; plus unorm_vec (see the module)."""
    if numel < BNB_MIN_8BIT_SIZE:
        return 8 * numel + BNB_UNORM_BYTES
    return 2 * numel + 2 * 4 * -(-numel // BNB_BLOCKSIZE) + BNB_UNORM_BYTES


def _moments_bytes(setup: RunSetup, w: int, numel: int) -> int:
    return _bnb_state_bytes(numel) if eight_bit(setup) else 2 * w * numel


def _qmaps_bytes(setup: RunSetup, numels: list[int]) -> int:
    """The two 256-entry fp32 maps of the 8-bit optimizers: one optimizer, or one per parameter
    when layerwise. Every instance makes them in its ``__init__`` (bitsandbytes
    ``Optimizer8bit.__init__``: ``fill_qmap()`` when optim_bits == 8, galore_torch's always), as
    CPU tensors; ``init_state`` moves them to the device of a tensor whose state it quantizes
    (``name2qmap[...].to(p.device)``). So on a GPU only the optimizers holding an 8-bit state keep
    maps there; on the CPU every optimizer's maps are in the same memory (measured: held-out seed
    2005, Gemma-3 full fp32 layerwise, 41 optimizers, 39 of them fp32-only, was +5.45% without
    them)."""
    if not eight_bit(setup):
        return 0
    optimizers = len(numels) if layerwise(setup) else 1
    if setup.device == "cpu":
        return BNB_QMAPS_BYTES * optimizers
    quantized = [n for n in numels if n >= BNB_MIN_8BIT_SIZE]
    if not quantized:
        return 0
    return BNB_QMAPS_BYTES * (len(quantized) if layerwise(setup) else 1)


def galore_state_bytes(setup: RunSetup, w: int, shapes: list[tuple[int, ...]]) -> int:
    """GaLore's state: projected moments and projectors of the target weights, AdamW's (or
    bitsandbytes' 8-bit) moments of every other trainable tensor (``shapes``:
    states.trainable_tensors). ``w``: bytes of the parameter (and gradient) dtype."""
    targets = _target_shapes(setup)
    rest = list(shapes)
    total, numels = 0, []
    for m, n in targets:
        rest.remove((m, n))
        rank = setup.galore_rank
        if apollo(setup):  # projector, moments, the 0-d scaled_grad norm, all in the dtype w
            pm, pn = _projected_shape(m, n, rank, capped=False)
            total += w * _apollo_projector_numel(m, n, rank) + 2 * w * pm * pn + w
            continue
        pm, pn = _projected_shape(m, n, rank)
        k = min(m, n)
        if w == 4:  # a view of the SVD factor keeps all of it: Vh (k x n) or U (m x k)
            projector = 4 * (k * n if m >= n else m * k)
        else:
            projector = w * (min(rank, k) * n if m >= n else m * min(rank, k))
        total += _moments_bytes(setup, w, pm * pn) + projector
        numels.append(pm * pn)
    numels += [prod(s) for s in rest]
    return total + sum(_moments_bytes(setup, w, prod(s)) for s in rest) + _qmaps_bytes(setup, numels)


def _svd_bytes(w: int, m: int, n: int, rank: int) -> int:
    """A projector's renewal (``GaLoreProjector.get_orthogonal_matrix``):
    ``torch.linalg.svd(matrix.float())``, U (m x k), S, Vh (k x n); beside them the fp32 product
    it builds and drops, ``U[:, :q] @ diag(S[:q])`` (m >= n) or ``diag(S[:q]) @ Vh[:q]`` (m < n),
    q x max(m, n) with the q x q diagonal alive while it is made; then a 16-bit weight's projector,
    the other factor's slice in its dtype (q x min(m, n); an fp32 one is a view). Measured exactly
    against the real projector under the live-bytes tracker (tests/plan/test_galore.py)."""
    k = min(m, n)
    q = min(rank, k)
    copy = 0 if w == 4 else 4 * m * n  # matrix.float()
    product = 4 * q * max(m, n)
    made = 4 * q * q if w == 4 else max(4 * q * q, w * q * min(m, n))
    return copy + 4 * (m * k + k + k * n) + product + made


def _step_temps(setup: RunSetup, w: int, shape: tuple[int, ...], target: bool) -> int:
    """Temporaries of one parameter's step beyond its gradient (see the module).

    32-bit: ``denom`` and ``exp_avg / denom`` (state-sized; a target's ``project_back`` and
    ``* scale`` full-sized): 2 x the parameter's size, or a renewal's SVD. 8-bit: bitsandbytes
    updates in place (0 for a tensor it does not project); a target's projected gradient, the
    ``saved_data`` clone (m x n beside the full gradient) and the projected gradient's clone made
    the new ``p.data`` (while the old weight is still alive: it is dropped by that assignment), or a
    renewal's SVD; its two full-sized projection-back tensors come after the full gradient and
    the old weight are dropped, so they count as the clone plus the gradient
    (:func:`layerwise_step_bytes` adds the gradient). Measured exactly, renewal and steady step,
    against the real optimizer on the CPU (tests/plan/test_galore.py)."""
    numel = prod(shape)
    if fused_backward(setup):  # torch's fused AdamW steps in place
        return 0
    if apollo(setup) and target:  # three projected-size tensors + two m x n (+ the channel scale
        m, n = shape              # over the larger side, a 0-d norm), or a renewal
        pm, pn = _projected_shape(m, n, setup.galore_rank, capped=False)
        steady = 3 * w * pm * pn + 2 * w * numel + w * max(m, n) + w
        return max(steady, 8 * _apollo_projector_numel(m, n, setup.galore_rank))
    if eight_bit(setup):
        if not target:
            return 0
        pm, pn = _projected_shape(*shape, setup.galore_rank)
        return max(w * numel + 2 * w * pm * pn, _svd_bytes(w, *shape, setup.galore_rank))
    if not target:
        return 2 * w * numel
    return max(2 * w * numel, _svd_bytes(w, *shape, setup.galore_rank))


def _all_tensors(setup: RunSetup, shapes: list[tuple[int, ...]]) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, projected?) of every trainable tensor."""
    rest = list(shapes)
    out = []
    for t in _target_shapes(setup):
        rest.remove(t)
        out.append((t, True))
    return out + [(s, False) for s in rest]


def galore_step_temp_bytes(setup: RunSetup, w: int, shapes: list[tuple[int, ...]]) -> int:
    """The step's largest working set beside every gradient (see the module): two tensors of the
    largest parameter, or a projector's renewal (the SVD of the largest target's gradient, beside
    its old projector); 8-bit: the largest target's clone or renewal. Layerwise: 0, the Trainer's
    optimizer.step() is LayerWiseDummyOptimizer's no-op (the steps ran in the backward)."""
    if layerwise(setup):
        return 0
    return max(_step_temps(setup, w, s, target) for s, target in _all_tensors(setup, shapes))


def _stepped_tensors(setup: RunSetup, shapes: list[tuple[int, ...]],
                     which: str) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, projected?) of the tensors ``which`` names: "block" (the decoder layers'), "head"
    (the untied lm_head, the first stepped) or "all"."""
    spec = setup.model
    head = (spec.vocab_size, spec.hidden_size)
    tensors = _all_tensors(setup, shapes) if projected(setup) else [(s, False) for s in shapes]
    if which == "head":
        return [(head, False)]
    if which == "block":  # an MoE layer's fused 3-D experts too (LOMO only: GaLore refuses MoE)
        block = {(lin.d_out, lin.d_in) for lin in block_linears(spec)}
        return [(s, t) for s, t in tensors if t or (s != head and (len(s) != 2 or s in block))]
    return tensors


def layerwise_step_bytes(setup: RunSetup, w: int, shapes: list[tuple[int, ...]],
                         which: str = "block") -> int:
    """Layerwise: the largest gradient + step working set of one parameter, stepped in its
    post-accumulate-grad hook (transformers _setup_low_rank_optimizer ``optimizer_hook``:
    ``step()`` then ``zero_grad()``). ``which``: as :func:`_stepped_tensors`."""
    tensors = _stepped_tensors(setup, shapes, which)
    if not tensors:
        return 0
    return max(w * prod(s) + _step_temps(setup, w, s, target) for s, target in tensors)


def lomo_step_bytes(setup: RunSetup, w: int, shapes: list[tuple[int, ...]], which: str = "block") -> int:
    """LOMO/AdaLomo at a hook: the largest parameter's gradient and step temporaries; for
    "block" beside the incoming gradient of another (its tensor hook runs before that gradient
    is accumulated): the second largest block tensor's (the MLP's three matrices are one size; an
    MoE layer's gate_up experts twice its down experts: measured, held-out seed 406, Mixtral
    fp32 with checkpointing, +16% over a plan without the experts, -11% with two gate_up
    gradients, those of two layers). For "head": the untied lm_head, stepped at the final norm's hook (a vector's
    gradient)."""
    # one layer's tensors (a size every layer has once counts once): the hooks pair neighbours;
    # an MoE layer's fused experts (routed, no biases) pair as lomo_experts_steps says
    fused = which == "block" and describe_layer(setup.model).experts == "routed"
    count = Counter(prod(s) for s, _ in _stepped_tensors(setup, shapes, which) if not (fused and len(s) == 3))
    layers = max(1, setup.model.num_layers)
    sizes = sorted((n for n, c in count.items() for _ in range(max(1, c // layers))), reverse=True)
    if not sizes:
        return 0
    step = lomo_working_bytes(setup, w, sizes[0])
    return step + (w * sizes[1] if which == "block" and len(sizes) > 1 else 0)


def lomo_experts_steps(setup: RunSetup, w: int) -> tuple[int, int]:
    """LOMO/AdaLomo at an MoE layer's fused experts (routed, no biases; grouped_mm's backward makes
    both weight gradients): (down_proj's step at gate_up_proj's hook, beside gate_up's incoming
    gradient; gate_up's step at the router weight's hook, beside the router's gradient, E x h).
    In fp32 the first is the larger (each step only its gradient), in 16-bit the second (fp32
    copies of the largest tensor's weight and gradient). Measured: held-out seed 534 (Mixtral
    bf16, checkpointing) was 10.8% under a plan pairing gate_up's step with down_proj's
    gradient; at its peak the tracker found gate_up's two fp32 copies beside the router's (8, 64)
    gradient. Seed 406 (fp32) peaks at the first, in the experts' backward."""
    spec = setup.model
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    router, gate_up, down = e * h, e * 2 * i * h, e * h * i
    return (lomo_working_bytes(setup, w, down) + w * gate_up,
            lomo_working_bytes(setup, w, gate_up) + w * router)


def lomo_pending_bytes(setup: RunSetup, w: int, shapes: list[tuple[int, ...]]) -> int:
    """LOMO between hooks: the last accumulated block gradient, stepped at the next hook; a
    Linear's or a norm's (an MoE layer's fused experts are stepped inside its backward, at the
    router's or the next expert's hook, and counted there: :func:`lomo_step_bytes`; with them
    here, held-out seed 406 was 11% under its plan)."""
    return max((w * prod(s) for s, _ in _stepped_tensors(setup, shapes, "block") if len(s) < 3), default=0)


__all__ = ["GALORE_RANK", "GALORE_SCALE", "GALORE_UPDATE_PROJ_GAP", "eight_bit", "galore_state_bytes",
           "galore_step_temp_bytes", "galore_targets", "given_up", "in_backward", "layerwise",
           "layerwise_step_bytes", "lomo", "lomo_experts_steps", "lomo_pending_bytes", "lomo_problems", "lomo_state_bytes",
           "lomo_step_bytes", "lomo_working_bytes", "optimizer_problems", "projected", "apollo", "fused_backward",
           "fused_backward_problems", "torchao", "torchao_problems", "torchao_state_bytes", "torchao_step_temp_bytes"]
