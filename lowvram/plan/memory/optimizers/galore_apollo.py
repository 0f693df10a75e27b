"""The projected-gradient optimizers, counted from their source: GaLore (optimizer galore_adamw) and
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
"""

from __future__ import annotations

from math import prod

from lowvram.plan.memory.optimizers.adamw_in_backward import scaled_gradient_problem
from lowvram.plan.memory.optimizers.family import (
    all_tensors,
    apollo,
    eight_bit,
    fused_backward,
    layerwise,
    stepped_tensors,
    target_shapes,
)
from lowvram.plan.model.models import ModelSpec, block_linears
from lowvram.plan.setup import RunSetup
from lowvram.vocab import EIGHT_BIT_DEVICES

GALORE_RANK = 128  # transformers' default (optim_args rank)
GALORE_UPDATE_PROJ_GAP = 200  # transformers' default (optim_args update_proj_gap)
GALORE_SCALE = 0.25  # transformers' default (optim_args scale)
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes Optimizer2State min_8bit_size (galore_torch AdamW8bit's default)
BNB_BLOCKSIZE = 256  # bitsandbytes Optimizer2State.init_state: blocksize = 256 (one fp32 absmax each)
BNB_QMAPS_BYTES = 2 * 256 * 4  # name2qmap "dynamic" + "udynamic": 256 fp32 each, per optimizer
BNB_UNORM_BYTES = 4  # state["unorm_vec"]: (1,) fp32, max_unorm > 0 (AdamW8bit's positional slip)


def galore_targets(spec: ModelSpec) -> tuple[str, ...]:
    """The Trainer's optim_target_modules for GaLore: the decoder blocks' Linears by name (never
    the embedding or lm_head, as in the paper)."""
    return tuple(dict.fromkeys(lin.name for lin in block_linears(spec)))


def projected_problems(setup: RunSetup) -> list[str]:
    """Why the setup's GaLore or APOLLO form cannot run (empty when it can)."""
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
    if problem := scaled_gradient_problem(setup):
        out.append(problem)
    if layerwise(setup) and setup.gpus > 1:
        out.append(f"optimizer {o} runs in one process only (transformers raises NotImplementedError "
                   f"under DDP; use --gpus 1, or {o.replace('_layerwise', '')})")
    return out


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
    targets = target_shapes(setup)
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


def galore_step_temp_bytes(setup: RunSetup, w: int, shapes: list[tuple[int, ...]]) -> int:
    """The step's largest working set beside every gradient (see the module): two tensors of the
    largest parameter, or a projector's renewal (the SVD of the largest target's gradient, beside
    its old projector); 8-bit: the largest target's clone or renewal. Layerwise: 0, the Trainer's
    optimizer.step() is LayerWiseDummyOptimizer's no-op (the steps ran in the backward)."""
    if layerwise(setup):
        return 0
    return max(_step_temps(setup, w, s, target) for s, target in all_tensors(setup, shapes))


def layerwise_step_bytes(setup: RunSetup, w: int, shapes: list[tuple[int, ...]],
                         which: str = "block") -> int:
    """Layerwise: the largest gradient + step working set of one parameter, stepped in its
    post-accumulate-grad hook (transformers _setup_low_rank_optimizer ``optimizer_hook``:
    ``step()`` then ``zero_grad()``). ``which``: as :func:`stepped_tensors`."""
    tensors = stepped_tensors(setup, shapes, which)
    if not tensors:
        return 0
    return max(w * prod(s) + _step_temps(setup, w, s, target) for s, target in tensors)
