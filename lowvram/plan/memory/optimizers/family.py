"""Which family an optimizer name belongs to (lowvram.vocab's lists), and which trainable tensors
it steps: a GaLore or APOLLO target (a decoder block's Linear weight, projected) or not, and at a
hook inside the backward the block's tensors or the untied lm_head."""

from __future__ import annotations

from lowvram.plan.model.models import block_linears
from lowvram.plan.setup import RunSetup
from lowvram.vocab import (
    APOLLO_OPTIMIZERS,
    FUSED_BACKWARD_OPTIMIZERS,
    GALORE_8BIT_OPTIMIZERS,
    IN_BACKWARD_OPTIMIZERS,
    LAYERWISE_OPTIMIZERS,
    LOMO_OPTIMIZERS,
    PROJECTED_OPTIMIZERS,
    TORCHAO_OPTIMIZERS,
)


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


def target_shapes(setup: RunSetup) -> list[tuple[int, int]]:
    return [(lin.d_out, lin.d_in) for lin in block_linears(setup.model)] * setup.model.num_layers


def all_tensors(setup: RunSetup, shapes: list[tuple[int, ...]]) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, projected?) of every trainable tensor."""
    rest = list(shapes)
    out = []
    for t in target_shapes(setup):
        rest.remove(t)
        out.append((t, True))
    return out + [(s, False) for s in rest]


def stepped_tensors(setup: RunSetup, shapes: list[tuple[int, ...]],
                     which: str) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, projected?) of the tensors ``which`` names: "block" (the decoder layers'), "head"
    (the untied lm_head, the first stepped) or "all"."""
    spec = setup.model
    head = (spec.vocab_size, spec.hidden_size)
    tensors = all_tensors(setup, shapes) if projected(setup) else [(s, False) for s in shapes]
    if which == "head":
        return [(head, False)]
    if which == "block":  # an MoE layer's fused 3-D experts too (LOMO only: GaLore refuses MoE)
        block = {(lin.d_out, lin.d_in) for lin in block_linears(spec)}
        return [(s, t) for s, t in tensors if t or (s != head and (len(s) != 2 or s in block))]
    return tensors
