"""**LOMO** (optimizer lomo; Lv et al. 2024, "Full Parameter Fine-tuning for Large Language Models
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
"""

from __future__ import annotations

from collections import Counter
from math import prod

from lowvram.plan.memory.optimizers.adamw_in_backward import stepped_in_backward_problems
from lowvram.plan.memory.optimizers.family import stepped_tensors
from lowvram.plan.model.layer import describe_layer
from lowvram.plan.setup import RunSetup


def lomo_problems(setup: RunSetup) -> list[str]:
    """Why the setup's LOMO form cannot run (see the module)."""
    o, out = setup.optimizer, stepped_in_backward_problems(setup)
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
    count = Counter(prod(s) for s, _ in stepped_tensors(setup, shapes, which) if not (fused and len(s) == 3))
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
    return max((w * prod(s) for s, _ in stepped_tensors(setup, shapes, "block") if len(s) < 3), default=0)
