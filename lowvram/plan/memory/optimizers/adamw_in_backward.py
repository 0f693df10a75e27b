"""**AdamW in the backward** (optimizer adamw_in_backward; lowvram.train.build.in_backward, PyTorch's
pattern "How to save memory by fusing the optimizer step into the backward pass", torchtune's
``optimizer_in_bwd``): the Trainer's fused AdamW, one per parameter, stepped and its gradient set
to None by ``register_post_accumulate_grad_hook`` (the Trainer holds ``LayerWiseDummyOptimizer``).
AdamW's state, and its fused step works in place (no temporaries, as for adamw); the moments are
layerwise GaLore's: one parameter's gradient alive beside the backward, never the full set. What it
gives up: the in-backward limits only (no gradient clipping, no accumulation, one process); the
update is AdamW's. Measured: whole runs through ``lowvram train`` (bench/plan_fuzz.py
--in-backward).

What every optimizer stepped inside the backward gives up and refuses (LOMO and AdaLomo too:
lomo_adalomo.py)."""

from __future__ import annotations

from lowvram.plan.memory.optimizers.family import fused_backward, layerwise
from lowvram.plan.setup import RunSetup
from lowvram.vocab import FUSED_BACKWARD_OPTIMIZERS, LOMO_OPTIMIZERS

IN_BACKWARD_GIVEN_UP = ("each parameter stepped in the backward, so no gradient clipping "
                        "(training.max_grad_norm has nothing left to clip), no gradient accumulation "
                        "and one process only")


def stepped_in_backward_problems(setup: RunSetup) -> list[str]:
    """What no optimizer stepped inside the backward runs with (LOMO, AdamW in the backward)."""
    o, out = setup.optimizer, []
    if setup.lora:
        out.append(f"optimizer {o} steps full weights in the backward; with lora the adapters' gradients are "
                   "small already (use it with lora: off, or optimizer adamw)")
    if setup.offload != "none":
        out.append(f"optimizer {o} cannot run under offload {setup.offload}: DeepSpeed and FSDP2 own the "
                   "parameters it steps (use offload none, one GPU)")
    return out


# Under fp16 loss scaling an optimizer stepped in the backward applies scaled gradients: accelerate's
# GradScaler (``AcceleratedOptimizer.step``: ``scaler.step(optimizer)``) unscales and checks for
# inf/NaN only at the end of the step, on the optimizer the Trainer holds, which here is transformers'
# LayerWiseDummyOptimizer whose one parameter has no gradient, so ``GradScaler.unscale_`` records no
# inf check and ``step`` asserts "No inf checks were recorded for this optimizer"
# (tests/train/test_fp16_in_backward.py runs it with a real GradScaler on the CPU). By then each
# parameter's hook has already stepped it with its gradient times the loss scale (65536 at first),
# and no step is skipped on inf/NaN. Unscaling in each hook cannot be made consistent with
# GradScaler: its skip is all-or-nothing over a step, decided after every gradient exists.
FP16_IN_BACKWARD_WHY = ("each parameter is stepped in its gradient hook, before accelerate's GradScaler "
                        "unscales: every update would use gradients multiplied by the loss scale, no "
                        "inf/NaN step would be skipped, and GradScaler then fails the step")


def scaled_gradient_problem(setup: RunSetup) -> str | None:
    """Why an optimizer stepped in the backward (AdamW in the backward, layerwise GaLore/APOLLO)
    cannot train under fp16 loss scaling (None when it can). LOMO has its own (lomo_problems)."""
    if not setup.precision.startswith("fp16") or not (layerwise(setup) or fused_backward(setup)):
        return None
    return (f"optimizer {setup.optimizer} cannot train in {setup.precision}: {FP16_IN_BACKWARD_WHY} "
            f"(use bf16 or fp32, or optimizer {in_backward_alternative(setup.optimizer)})")


def in_backward_alternative(optimizer: str) -> str:
    """The same optimizer stepped after the backward (what an in-backward form's hint names)."""
    if optimizer in FUSED_BACKWARD_OPTIMIZERS:
        return "adamw"
    if optimizer in LOMO_OPTIMIZERS:
        return "adamw_8bit"
    return optimizer.replace("_8bit", "").replace("_layerwise", "")


def fused_backward_problems(setup: RunSetup) -> list[str]:
    """Why AdamW in the backward cannot run as planned (see the module)."""
    o, out = setup.optimizer, stepped_in_backward_problems(setup)
    if problem := scaled_gradient_problem(setup):
        out.append(problem)
    if setup.grad_accum != 1:
        out.append(f"optimizer {o} steps each parameter inside the backward, so it cannot accumulate "
                   f"gradients (gradient_accumulation {setup.grad_accum}; use gradient_accumulation 1, or adamw)")
    if setup.gpus > 1:
        out.append(f"optimizer {o} runs in one process only (its hooks step before DDP's all-reduce; "
                   "use --gpus 1, or adamw)")
    return out
