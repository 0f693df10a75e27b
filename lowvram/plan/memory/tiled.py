"""Tiled MLP (techniques.tiled_mlp): each decoder layer's MLP computed over the sequence in
shards, its forward without autograd and recomputed shard by shard in the backward, as ALST's
TiledMLP does (Arctic Long Sequence Training, Bekman et al. 2025, arXiv:2506.13996, sec. 3.2;
the code lowvram runs: DeepSpeed 0.19 ``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP``,
wired to peft / transformers MLP modules by lowvram.train.build.tiled_mlp).

What DeepSpeed's TiledMLP keeps, from its source:

* forward: ``ctx.save_for_backward(x)`` (the MLP's input, the post-attention norm's output) and
  nothing else: every shard runs under ``torch.no_grad()``; the output is the ``torch.cat`` of
  the shards' outputs. So a layer saves its attention side, its norms and x: its MLP's saved
  tensors (SwiGLU's gate, silu(gate), up, their product; the adapters' casts) are gone
  (:func:`layer_activation_bytes`).
* backward: ``x_grad = torch.zeros_like(x)`` (t x h), the incoming gradient (t x h), and per
  shard (``torch.chunk`` of the flattened b*s rows: ceil(t / shards) rows) the shard's MLP
  recomputed with autograd and its backward, the shard's gradient written into x_grad in place
  (:func:`tiled_mlp_backward_bytes`, the moments ``*_tiled_mlp_backward``). A 4/8-bit base's
  dequantized weight is whole-weight per Linear, not per shard.

The shard count DeepSpeed's docstring example (and Axolotl's default) takes:
ceil(seq_len / hidden_size), so a shard's t/N x I intermediates are about an h x I weight.

Step time: the MLP's forward runs once more ("forward occurs twice each iteration. And if you're
using activation checkpointing it then occurs trice": TiledMLP's docstring; "25% more
computation" with checkpointing, DeepSpeed PR #7664), weighted by the MLP's share of a block's
matmuls (:func:`tiled_mlp_slowdown`).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from lowvram.plan import constants as fitted
from lowvram.plan.memory import activations, backward
from lowvram.plan.memory.activations import dtypes as dtypes_of
from lowvram.plan.memory.moments import Moment
from lowvram.plan.memory.states import target_linears
from lowvram.plan.model.models import ModelSpec, block_linears, mlp_linears
from lowvram.plan.setup import RunSetup, per_activations


def tiled_mlp_shards(setup: RunSetup) -> int:
    """Shards of the flattened b*s rows: tiled_mlp_shards, or DeepSpeed's ceil(seq_len / h)."""
    if setup.tiled_mlp_shards:
        return setup.tiled_mlp_shards
    return max(1, -(-setup.seq_len // setup.model.hidden_size))


def _shard_rows(setup: RunSetup) -> int:
    """Rows of the largest shard: torch.chunk gives ceil(t / shards) rows per chunk."""
    t = setup.micro_batch_size * setup.seq_len
    return -(-t // min(t, tiled_mlp_shards(setup)))


def without_mlp(setup: RunSetup) -> RunSetup:
    """The same block without its MLP (ModelSpec.mlp "none": no MLP Linears, no MLP tensors):
    what a tiled layer saves besides x, and whose backward follows the MLP's."""
    return replace(setup, tiled_mlp=False, model=_without_mlp_model(setup.model))


@lru_cache(maxsize=256)  # per model
def _without_mlp_model(spec: ModelSpec) -> ModelSpec:
    return replace(spec, mlp="none", intermediate_size=0)


def _x_bytes(setup: RunSetup) -> int:
    """x, the MLP's input (the norm's output in the residual dtype), t x h."""
    r, _, _ = activations.dtypes(setup)
    return r * setup.micro_batch_size * setup.seq_len * setup.model.hidden_size


# The per-layer terms of lowvram.plan.memory.activations / backward, with the MLP tiled where the setup
# says so (the same numbers as theirs otherwise): lowvram.plan.memory.memory asks these.

@per_activations
def layer_activation_bytes(setup: RunSetup, first: bool = False, attention_side: bool = False) -> int:
    """What a decoder layer saves; with a tiled MLP the layer without its MLP plus x (TiledMLP's
    ``ctx.save_for_backward(x)``). Layer 0 under LoRA is traced on the whole block (its MLP
    included: the layout the first-layer terms know; without it every saved tensor of layer 0
    was counted, and held-out tiled seed 48's 16-bit copy of layer 0's probabilities with v frozen)."""
    if not setup.tiled_mlp:
        return activations.layer_activation_bytes(setup, first, attention_side)
    rest = activations.layer_activation_bytes(without_mlp(setup), first, attention_side, traced=setup)
    return rest if attention_side else rest + _x_bytes(setup)


def activation_bytes(setup: RunSetup) -> int:
    """All layers' saved activations at the start of the backward (activations.activation_bytes),
    each layer's MLP tensors replaced by x when tiled (checkpoints keep layer inputs only either way)."""
    plain = activations.activation_bytes(setup)
    if not setup.tiled_mlp or setup.gradient_checkpointing:
        return plain
    untiled = replace(setup, tiled_mlp=False)
    first = activations.layer_activation_bytes(untiled, first=True) - layer_activation_bytes(setup, first=True)
    other = activations.layer_activation_bytes(untiled) - layer_activation_bytes(setup)
    return plain - first - (setup.model.num_layers - 1) * other


@per_activations
def layer_backward_bytes(setup: RunSetup) -> int:
    """One layer's backward (backward.layer_backward_bytes); with a tiled MLP, once its MLP's is
    done: the attention side, norms, hidden-state gradients (the layer without its MLP). The
    MLP's own is :func:`tiled_mlp_backward_bytes`."""
    if not setup.tiled_mlp:
        return backward.layer_backward_bytes(setup)
    return backward.layer_backward_bytes(without_mlp(setup))


@per_activations
def recompute_bytes(setup: RunSetup, last: bool = True) -> int:
    """backward.recompute_bytes with the tiled layer's activations and backward."""
    if not setup.tiled_mlp:
        return backward.recompute_bytes(setup, last)
    if not setup.gradient_checkpointing:
        return 0
    return (layer_activation_bytes(setup) + layer_backward_bytes(setup)
            + activations.recomputed_mask_bytes(setup, last))


@per_activations
def tiled_mlp_backward_bytes(setup: RunSetup) -> int:
    """The tiled MLP's backward beside the layer's saved tensors: the incoming gradient and
    x_grad (2 x t*h), and one shard's MLP recomputed with autograd plus its backward's
    gradients (the untiled MLP's saved tensors and mlp_backward_floor_bytes' t x I gradients,
    at ceil(t / shards) rows), and a 4/8-bit base's dequantized weight (whole)."""
    plain = replace(setup, tiled_mlp=False)
    t = setup.micro_batch_size * setup.seq_len
    saved = activations.layer_activation_bytes(plain) - activations.layer_activation_bytes(without_mlp(setup))
    work = backward.mlp_backward_floor_bytes(plain) - _x_bytes(setup)  # its t x I gradients
    step = max(max(0, work), _shard_adapter_forward_bytes(plain))  # its backward, or its recompute's
    shard = (max(0, saved) + step) * _shard_rows(setup) // t
    return 2 * _x_bytes(setup) + shard + backward.dequantized_weight_bytes(setup)


def _shard_adapter_forward_bytes(setup: RunSetup) -> int:
    """A shard's recompute reaching its last adapted MLP Linear, before the shard's backward:
    beside the MLP's saved tensors, peft's fp32 cast of the 16-bit input for the fp32 adapter
    (``_cast_input_dtype``, under autocast) and, with lora.dropout, the dropped fp32 input
    (``dropout(x)``, its noise counted as saved), 4 x d_in each per token, the widest adapted MLP
    input (down_proj's: the t x I product). Measured: tiled seed 12 (Gemma-3 LoRA all-linear,
    dropout 0.1, bf16 with checkpointing) peaked there with a (256, 512) fp32 cast and dropped
    input beside the shard's gate, up and product, +8.46% over a plan without it and the mask.

    At down_proj's adapter also the product itself (no saved tensor: the frozen base saves no
    input, lora_A its 16-bit cast), down_proj's 16-bit outputs (the base's ``result``, lora_B's
    and its scaled copy, peft ``lora.Linear.forward``) and, past the first shard, the previous
    shard's output (DeepSpeed's TiledMLP.backward keeps ``output`` until the next shard's is
    made). Measured: held-out tiled seed 66 (Qwen2 LoRA all-linear, bf16, checkpointing, b2
    s1024, 4 shards) peaked at the second shard's lora_B scaling with a (512, 512) bf16 product,
    its fp32 cast, three (512, 128) bf16 outputs and the first shard's, 10.3% over a plan with
    the cast alone."""
    _, _, autocast = dtypes_of(setup)
    if not setup.lora or not autocast:
        return 0
    mlp = {lin.name for lin in mlp_linears(setup.model)}
    widest = max((lin.d_in for lin in target_linears(setup) if lin.name in mlp), default=0)
    t = setup.micro_batch_size * setup.seq_len
    cast = t * 4 * widest * (2 if setup.lora_dropout else 1)
    if widest != setup.model.intermediate_size:  # gate / up: their input is x, saved already
        return cast
    outputs = 3 + (1 if tiled_mlp_shards(setup) > 1 else 0)  # result, lora_B's, scaled; the last shard's
    return cast + t * (activations.mlp_elementwise_bytes(setup) * widest + 2 * outputs * setup.model.hidden_size)


def tiled_mlp_moments(setup: RunSetup, last: int, first: int, last_grads: int, first_grads: int,
                      not_gathered: int) -> list[Moment]:
    """The tiled MLP's backward in the last decoder layer (``last``: every saved activation or
    checkpoint alive, and with checkpointing the recomputed layer's) and in the first (``first``)."""
    mlp = tiled_mlp_backward_bytes(setup)
    moments = [Moment("last_layer_tiled_mlp_backward", last + mlp, 0, last_grads),
               Moment("first_layer_tiled_mlp_backward", first + mlp, 0, first_grads, not_gathered)]
    norm = pre_mlp_norm_backward_delta(setup)
    if norm is not None:
        moments += [Moment("last_layer_tiled_mlp_norm_backward", last + norm, 0, last_grads),
                    Moment("first_layer_tiled_mlp_norm_backward", first + norm, 0, first_grads, not_gathered)]
    return moments


@per_activations
def pre_mlp_norm_backward_delta(setup: RunSetup) -> int | None:
    """Once TiledMLP's backward is done, the RMSNorm before the MLP (Gemma-3's
    pre_feedforward_layernorm, Llama's post_attention_layernorm) runs its backward; against the
    layer's saved tensors counted by :func:`layer_activation_bytes` (None: no norm before the MLP,
    OLMo-2's post-norm block).

    Freed by then: x (TiledMLP's ``ctx.save_for_backward(x)``, released with its node) and, in a
    block with a norm after the MLP (Gemma-2/3's post_feedforward_layernorm, whose backward ran
    first), that norm's fp32 input and rsqrt (4 x h + 4 a token; with a trainable weight the
    normalized input too, activations.normed_bytes). Made: the residual stream's gradient, alive
    until the residual add (r x t*h), and the norm's backward, computed in fp32 as
    Gemma3RMSNorm / LlamaRMSNorm compute it (``x.float()``, ``x * rsqrt(x.pow(2).mean(-1) +
    eps)``): its incoming gradient (TiledMLP's x_grad, r x t*h) and the fp32 cast and temporaries
    of backward.post_norm_backward_bytes (constants.POST_NORM_BACKWARD_TEMPORARIES). Measured:
    held-out tiled seed 27 (Gemma-3 LoRA, dropout 0.1, fp32 with checkpointing, b2 s1024, h 128)
    peaked at the pow backward's mul there, 3.94% over a plan without it: x_grad, the residual
    gradient and 6 fp32 (2048, 128) temporaries (mul x3, div.Scalar, pow, mul.Scalar).

    A Llama-style block (two norms, both before; LlamaRMSNorm applies its weight in the input
    dtype, so one fp32 product fewer) makes less there: one hidden-state gradient and
    constants.PRE_NORM_BACKWARD_TEMPORARIES fp32 t x h, and frees only x. Measured: the context
    table's 16 GB plan at 1/16 width (bench/long_context_scaled.py: Llama QLoRA bf16, packed,
    2,960 tokens) peaked there, 4.6% over its plan without this moment: 5 fp32 (2960, 256)
    temporaries and a bf16 gradient beside the recomputed attention side and its (2960, 2960)
    mask. Counted the Gemma way it put held-out tiled seed 45 (Mistral LoRA fp32 with
    checkpointing) 15.1% under its peak."""
    spec = setup.model
    if not setup.tiled_mlp or spec.norm_after or spec.norms_per_layer not in (2, 4):  # OLMo-2: none before
        return None
    r, _, _ = activations.dtypes(setup)
    t = setup.micro_batch_size * setup.seq_len
    h = spec.hidden_size
    freed = _x_bytes(setup)
    if spec.norms_per_layer == 2:
        return (r + fitted.PRE_NORM_BACKWARD_TEMPORARIES.value * 4) * t * h - freed
    normed = 0 if setup.lora else activations.normed_bytes(setup) * h  # the post-MLP norm's saved
    freed += t * (4 * h + 4 + normed)
    made = (2 * r + fitted.POST_NORM_BACKWARD_TEMPORARIES.value * 4) * t * h
    return made - freed


def mlp_matmul_share(setup: RunSetup) -> float:
    """The MLP's share of a block's Linear weights (its share of the matmul FLOPs per token)."""
    return _mlp_matmul_share(setup.model)


@lru_cache(maxsize=256)  # per model
def _mlp_matmul_share(spec: ModelSpec) -> float:
    total = sum(lin.numel for lin in block_linears(spec))
    return sum(lin.numel for lin in mlp_linears(spec)) / total if total else 0.0


def tiled_mlp_slowdown(setup: RunSetup) -> float:
    """Step-time factor of the tiled MLP: one more MLP forward per step (TiledMLP's docstring) on
    top of forward + backward (1 + 2 units, 3 + 1 with checkpointing: DeepSpeed PR #7664's 25%),
    times the MLP's share of the block's matmuls (attention scores and the head not counted)."""
    if not setup.tiled_mlp:
        return 1.0
    units = 4 if setup.gradient_checkpointing else 3
    return 1.0 + mlp_matmul_share(setup) / units


__all__ = [
    "activation_bytes", "layer_activation_bytes", "layer_backward_bytes", "mlp_matmul_share",
    "pre_mlp_norm_backward_delta",
    "recompute_bytes", "tiled_mlp_backward_bytes", "tiled_mlp_moments", "tiled_mlp_shards",
    "tiled_mlp_slowdown", "without_mlp",
]
