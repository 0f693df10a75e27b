"""Optimizers beyond AdamW's kin, counted from their source: GaLore (optimizer galore_adamw).

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

Measured: the state of a real GaLoreAdamW after one Trainer step (tests/plan/test_galore.py,
exact) and whole runs through ``lowvram train`` (the differential test's GaLore draws).
"""

from __future__ import annotations

from math import prod

from lowvram.plan.models import ModelSpec, block_linears
from lowvram.plan.setup import RunSetup
from lowvram.vocab import PROJECTED_OPTIMIZERS

GALORE_RANK = 128  # transformers' default (optim_args rank)
GALORE_UPDATE_PROJ_GAP = 200  # transformers' default (optim_args update_proj_gap)
GALORE_SCALE = 0.25  # transformers' default (optim_args scale)


def galore_targets(spec: ModelSpec) -> tuple[str, ...]:
    """The Trainer's optim_target_modules for GaLore: the decoder blocks' Linears by name (never
    the embedding or lm_head, as in the paper)."""
    return tuple(dict.fromkeys(lin.name for lin in block_linears(spec)))


def projected(setup: RunSetup) -> bool:
    return setup.optimizer in PROJECTED_OPTIMIZERS


def optimizer_problems(setup: RunSetup) -> list[str]:
    """Why the setup's optimizer cannot run (empty when it can)."""
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
        out.append(f"optimizer {o} on an MoE model: its routed experts are no nn.Linear, so GaLore "
                   "would leave most weights unprojected (use adamw_8bit)")
    if setup.model.model_type == "gpt2":
        out.append(f"optimizer {o}: GPT-2's projections are Conv1D, not nn.Linear (transformers' "
                   "optim_target_modules takes Linears only)")
    return out


def _target_shapes(setup: RunSetup) -> list[tuple[int, int]]:
    return [(lin.d_out, lin.d_in) for lin in block_linears(setup.model)] * setup.model.num_layers


def _projected_shape(m: int, n: int, rank: int) -> tuple[int, int]:
    q = min(rank, m, n)
    return (m, q) if m >= n else (q, n)


def galore_state_bytes(setup: RunSetup, w: int, shapes: list[tuple[int, ...]]) -> int:
    """GaLoreAdamW's state: projected moments and projectors of the target weights, AdamW's
    moments of every other trainable tensor (``shapes``: states.trainable_tensors). ``w``: bytes
    of the parameter (and gradient) dtype."""
    targets = _target_shapes(setup)
    rest = list(shapes)
    total = 0
    for m, n in targets:
        rest.remove((m, n))
        rank = setup.galore_rank
        pm, pn = _projected_shape(m, n, rank)
        k = min(m, n)
        if w == 4:  # a view of the SVD factor keeps all of it: Vh (k x n) or U (m x k)
            projector = 4 * (k * n if m >= n else m * k)
        else:
            projector = w * (min(rank, k) * n if m >= n else m * min(rank, k))
        total += 2 * w * pm * pn + projector
    return total + 2 * w * sum(prod(s) for s in rest)


def galore_step_temp_bytes(setup: RunSetup, w: int, shapes: list[tuple[int, ...]]) -> int:
    """The step's largest working set (see the module): two tensors of the largest parameter, or a
    projector's renewal (the SVD of the largest target's gradient, beside its old projector)."""
    largest = max(prod(s) for s in shapes)
    svd = 0
    for m, n in _target_shapes(setup):
        k = min(m, n)
        copy = 0 if w == 4 else 4 * m * n  # matrix.float()
        svd = max(svd, copy + 4 * (m * k + k + k * n))
    return max(2 * w * largest, svd)


__all__ = ["GALORE_RANK", "GALORE_SCALE", "GALORE_UPDATE_PROJ_GAP", "galore_state_bytes",
           "galore_step_temp_bytes", "galore_targets", "optimizer_problems", "projected"]
