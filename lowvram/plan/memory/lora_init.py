"""LoRA initialisation (lora.init): what peft's initialisations cost when the model is built,
counted from its source (peft 0.21 ``tuners/lora/layer.py`` LoraLayer.update_layer,
reset_lora_parameters, pissa_init).

- ``default`` (peft ``init_lora_weights=True``): lora_A Kaiming-uniform, lora_B zeros;
  ``gaussian``: lora_A normal with std 1/r, lora_B zeros. Nothing beyond the adapters.
- ``pissa`` (Meng et al. 2024, "PiSSA: Principal Singular Values and Singular Vectors
  Adaptation"): the adapters are the top r singular triplets of each adapted weight W (lora_A =
  sqrt(S_r) U_r^T, lora_B = V_r sqrt(S_r), each divided by the scaling's square root) and the
  base weight is rewritten to the residual W - scaling x B@A, so the model's output at step 0 is
  the original one. ``pissa``: a full ``torch.linalg.svd`` per adapted Linear;
  ``pissa_niter_N``: ``torch.svd_lowrank`` (randomised, N subspace iterations: much faster, the
  paper's fast-SVD variant).

The SVD runs once per adapted Linear, one after the other, inside ``get_peft_model``: before the
optimizer exists and before any activation, beside the loaded weights and the adapters made so
far. Per adapted Linear (d_out m, d_in n, k = min(m, n)) alive together at the subtraction
``weight - scaling * lora_B @ lora_A``, in fp32 whatever the weight's dtype:

- the SVD's factors: full, V (m x k), S (k) and U^T (k x n); fast, V_r (m x r), S_r (r), U_r (n x r);
- the product B@A and the residual (m x n each; scaling x B is freed once the product exists);
- a 16-bit weight also its fp32 copy (``weight.to(torch.float32)``; an fp32 weight is used as is).

The new adapters replace the ones nn.Linear made (no net bytes). Under a 16-bit weight, peft
casts each layer's adapters to the weight's dtype after its init
(``_move_adapter_to_device_of_base_layer``) and back to fp32 once all are made
(autocast_adapter_dtype), so at the widest Linear's SVD the earlier adapters weigh half what
:func:`lowvram.plan.memory.states.weight_bytes` counts: the moment is exact for fp32 weights and over by
at most half the adapters' bytes for 16-bit ones. Measured with the live-bytes tracker around
``get_peft_model`` on tiny Llamas (tests/plan/test_lora_init.py): exact. Not counted: LAPACK's
(CPU) or cuSOLVER's (CUDA) own workspace inside the SVD kernel, which no tensor op returns.

Time: one SVD per adapted Linear (full: O(m n k) each, 224 of them on a 7-8B model; fast:
O(m n r N)), once, before the first step.

PiSSA needs a float base weight (peft raises TypeError on a 4/8-bit one: "re-quantize the
residual model"): refused under quantization, as on fused MoE experts (peft's ParamWrapper
path), with DoRA (its magnitude is initialised from the residual: not modelled), and where the
weights are sharded or several processes would each initialise (offload, gpus > 1: a randomised
SVD per rank would differ).
"""

from __future__ import annotations

import re

from lowvram.plan.memory.states import dtype_bytes, target_linears
from lowvram.plan.model import moe
from lowvram.plan.setup import RunSetup

INITS = ("default", "gaussian", "pissa")  # and pissa_niter_N (N >= 1)
_FAST = re.compile(r"pissa_niter_([1-9][0-9]*)")


def init_name_problem(init: str) -> str | None:
    """Why ``init`` is not a lora.init value (None when it is)."""
    if init in INITS or _FAST.fullmatch(init):
        return None
    return f"lora.init {init!r} (known: {', '.join(INITS)}, pissa_niter_N with N >= 1)"


def is_svd_init(init: str) -> bool:
    return init.startswith("pissa")


def peft_init_lora_weights(init: str) -> bool | str:
    """peft LoraConfig's init_lora_weights for a lora.init value."""
    return True if init == "default" else init


def init_problems(setup: RunSetup) -> list[str]:
    """Why peft cannot initialise this setup's adapters as lora.init says, as the planner models
    it (empty when it can)."""
    if not setup.lora:
        return []
    problems = init_conflicts(setup.lora_init, setup.quantization, setup.lora_use_dora,
                              bool(moe.expert_adapters(setup.model, setup.lora_r, setup.lora_targets)),
                              setup.gpus, setup.offload)
    narrow = min((min(lin.d_in, lin.d_out) for lin in target_linears(setup)), default=setup.lora_r)
    if is_svd_init(setup.lora_init) and setup.lora_r > narrow:
        # pissa_init keeps min(d_out, d_in) singular triplets when r is larger: smaller adapters
        # than planned (and torch.svd_lowrank refuses q > min(m, n))
        problems.append(f"lora.init {setup.lora_init} needs lora.r <= {narrow}, the narrowest adapted Linear's "
                        "smaller side (its SVD has no more singular vectors): lower lora.r or use lora.init default")
    return problems


def init_conflicts(init: str, quantization: str, use_dora: bool, expert_adapters: bool, gpus: int,
                   offload: str) -> list[str]:
    """What an SVD initialisation cannot be combined with (see the module); each says what to set."""
    if not is_svd_init(init):
        return []
    name = f"lora.init {init}"
    problems = []
    if quantization != "none":
        problems.append(f"{name} needs a float base weight (peft pissa_init rewrites it to the residual "
                        "W - USV^T and refuses a 4/8-bit one): use quantization none, or lora.init default under QLoRA")
    if use_dora:
        problems.append(f"{name} with lora.use_dora is not modelled (DoRA's magnitude is initialised from the "
                        "residual): use one of them")
    if expert_adapters:
        problems.append(f"{name} on fused MoE experts is not modelled: set lora.target_modules to the "
                        "attention projections, or lora.init default")
    if gpus > 1 or offload != "none":
        problems.append(f"{name} with several GPUs or an offload is not modelled (each process would "
                        "initialise its own copy): train it on one GPU with offload none, or lora.init default")
    return problems


def svd_bytes(setup: RunSetup, lin) -> int:
    """One adapted Linear's SVD initialisation: its fp32 temporaries at the residual's subtraction
    (see the module)."""
    m, n = lin.d_out, lin.d_in
    k = setup.lora_r if _FAST.fullmatch(setup.lora_init) else min(m, n)
    factors = m * k + k + k * n
    fp32_copy = m * n if dtype_bytes(setup)[0] != 4 else 0
    return 4 * (factors + 2 * m * n + fp32_copy)


def init_bytes(setup: RunSetup) -> int:
    """The adapters and the SVD's temporaries at the initialisation's highest point, the
    difference with the fp32 adapters :func:`lowvram.plan.memory.states.weight_bytes` counts (negative
    when the adapters made so far weigh less); 0 for the initialisations that make nothing but
    the adapters. peft initialises the Linears in module order, layer after layer: at the last
    layer's i-th adapted Linear, the earlier layers' adapters and this layer's before it exist (in
    the weight's dtype), its own in fp32, the later ones not yet (see the module)."""
    if not (setup.lora and is_svd_init(setup.lora_init)):
        return 0
    w = dtype_bytes(setup)[0]
    lins = target_linears(setup)
    adapter = [setup.lora_r * (lin.d_in + lin.d_out) for lin in lins]
    earlier_layers = w * sum(adapter) * (setup.model.num_layers - 1)
    best = None
    for i, lin in enumerate(lins):
        made = earlier_layers + w * sum(adapter[:i]) + 4 * adapter[i]
        at = made + svd_bytes(setup, lin)
        best = at if best is None else max(best, at)
    return best - 4 * sum(adapter) * setup.model.num_layers


__all__ = ["INITS", "init_bytes", "init_conflicts", "init_name_problem", "init_problems", "is_svd_init", "peft_init_lora_weights", "svd_bytes"]
