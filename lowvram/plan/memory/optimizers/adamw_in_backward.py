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

from lowvram.plan.setup import RunSetup

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


def fused_backward_problems(setup: RunSetup) -> list[str]:
    """Why AdamW in the backward cannot run as planned (see the module)."""
    o, out = setup.optimizer, stepped_in_backward_problems(setup)
    if setup.grad_accum != 1:
        out.append(f"optimizer {o} steps each parameter inside the backward, so it cannot accumulate "
                   f"gradients (gradient_accumulation {setup.grad_accum}; use gradient_accumulation 1, or adamw)")
    if setup.gpus > 1:
        out.append(f"optimizer {o} runs in one process only (its hooks step before DDP's all-reduce; "
                   "use --gpus 1, or adamw)")
    return out
