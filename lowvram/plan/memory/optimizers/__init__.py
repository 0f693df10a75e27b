"""The optimizers beyond AdamW's kin, counted from their source, one family a module: GaLore and
APOLLO, whose gradients are projected, with their 8-bit and layerwise forms (galore_apollo.py),
LOMO and AdaLomo (lomo_adalomo.py), torchao's low-bit AdamW (torchao_adamw.py) and AdamW stepped in
the backward (adamw_in_backward.py); family.py says which family a name is and which tensors it
steps. Here: what a setup's optimizer gives up (the plan's reason) and why it cannot run, each
family asked; the terms (states, memory) read every family's state and step through this package.
"""

from __future__ import annotations

from lowvram.plan.memory.optimizers.adamw_in_backward import (
    FP16_IN_BACKWARD_WHY,
    IN_BACKWARD_GIVEN_UP,
    fused_backward_problems,
    in_backward_alternative,
    scaled_gradient_problem,
)
from lowvram.plan.memory.optimizers.family import (
    apollo,
    eight_bit,
    fused_backward,
    in_backward,
    layerwise,
    lomo,
    projected,
    torchao,
)
from lowvram.plan.memory.optimizers.galore_apollo import (
    GALORE_RANK,
    GALORE_SCALE,
    GALORE_UPDATE_PROJ_GAP,
    galore_state_bytes,
    galore_step_temp_bytes,
    galore_targets,
    layerwise_step_bytes,
    projected_problems,
)
from lowvram.plan.memory.optimizers.lomo_adalomo import (
    lomo_experts_steps,
    lomo_pending_bytes,
    lomo_problems,
    lomo_state_bytes,
    lomo_step_bytes,
    lomo_working_bytes,
)
from lowvram.plan.memory.optimizers.torchao_adamw import (
    TORCHAO_CODE_BITS,
    torchao_problems,
    torchao_state_bytes,
    torchao_step_temp_bytes,
)
from lowvram.plan.setup import RunSetup


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
    return projected_problems(setup)


__all__ = ["GALORE_RANK", "GALORE_SCALE", "GALORE_UPDATE_PROJ_GAP", "eight_bit", "galore_state_bytes",
           "galore_step_temp_bytes", "galore_targets", "given_up", "in_backward", "layerwise",
           "layerwise_step_bytes", "lomo", "lomo_experts_steps", "lomo_pending_bytes", "lomo_problems", "lomo_state_bytes",
           "lomo_step_bytes", "lomo_working_bytes", "optimizer_problems", "projected", "apollo", "fused_backward",
           "fused_backward_problems", "FP16_IN_BACKWARD_WHY", "in_backward_alternative", "scaled_gradient_problem", "torchao", "torchao_problems", "torchao_state_bytes", "torchao_step_temp_bytes"]
