"""DoRA (lora.use_dora; Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation"): what
peft's implementation adds to a LoRA run, counted from its source (peft 0.21
``tuners/lora/dora.py`` DoraLinearLayer, ``tuners/lora/variants.py`` DoraLinearVariant).

- **Magnitudes**: one trainable fp32 vector of d_out per adapted Linear
  (``lora_magnitude_vector``, the column norm of the base weight at initialisation), with its
  gradient and optimizer state like the adapters' (states.magnitude_shapes).
- **Saved for the backward, per adapted Linear**: ``(mag_norm_scale - 1) * base_result`` keeps the
  base layer's output and ``mag_norm_scale * lora_result`` the adapter path's output (t x d_out
  each) for the magnitude's gradient. With lora.dropout > 0 peft recomputes the base product on the
  dropped input, ``F.linear(x, weight.to(x.dtype))``: its output is in the adapter dtype (fp32, or
  bf16 under autocast) and the weight copy it multiplies by is saved (a dense d_out x d_in per
  adapted Linear, unless the weight is an fp32 parameter outside autocast).
- **The weight norm, in every forward**: ``get_lora_weight`` multiplies an fp32 identity
  (d_in x d_in) through both factors to form B@A (d_in x d_out), and ``get_weight_norm`` takes the
  row norm of ``weight + scaling * lora_weight`` in fp32: the dense base weight (dequantized under
  QLoRA, cast to fp32 when stored in 16 bit), the scaled product and the sum are alive together
  (the weight norm is detached, so all of it is freed after the layer). Under checkpointing the
  recompute forms it again, with the gradients made so far alive.
- **Its backward**: the magnitude's gradient reduces ``grad * base_result`` and ``grad *
  lora_result`` over the tokens, two t x d_out temporaries beside the layer's. It runs in reverse
  order: when an adapted Linear's magnitude backward runs, the DoRA tensors of the Linears after
  it are freed already. With checkpointing that is its own moment (dora_magnitude_backward:
  magnitude_backward_bytes), not a term stacked on the recompute's; the recompute's weight norm
  also holds peft's fp32 cast of the input and a 16-bit copy (recompute_input_bytes).
- **A biased base** (Qwen2's q/k/v): peft subtracts the bias from the base result before saving
  it, which promotes it to the bias's dtype (fp32 master weights under *-mixed).

Measured per adapted Linear with the live-bytes tracker (one peft DoRA Linear against a plain
LoRA one, d_in 256/512, d_out 384/768, 64/256 tokens; fp32, bf16 and fp32 weights under bf16
autocast, dropout 0 and 0.1): the saved bytes exactly as above; the forward's transient
as weight_norm_bytes states it; the backward 2 x 4 x t x d_out
(3.4 under autocast, taken as 3.5: a 2-layer OLMo-2 DoRA run, bf16 with checkpointing and
dropout, was 3.4% over its plan at 2). Measured end to end through ``lowvram train`` by the
differential test (tests/plan/test_dora.py).
"""

from __future__ import annotations

from lowvram.plan import constants as fitted
from lowvram.plan.memory.activations import dtypes, linear_sources, mlp_elementwise_bytes
from lowvram.plan.memory.states import dtype_bytes, target_linears
from lowvram.plan.model import moe
from lowvram.plan.model.models import block_linears
from lowvram.plan.setup import RunSetup


def dora_on(setup: RunSetup) -> bool:
    return setup.lora and setup.lora_use_dora


def dora_problems(setup: RunSetup) -> list[str]:
    """Why peft cannot train this setup with DoRA (empty when it can)."""
    if not setup.lora_use_dora:
        return []
    if not setup.lora:
        return ["lora.use_dora needs lora: DoRA decomposes the LoRA update (set lora: on or use_dora: false)"]
    if moe.expert_adapters(setup.model, setup.lora_r, setup.lora_targets):
        # peft tuners/lora/layer.py ParamWrapper.__init__: "does not work with use_dora=True"
        return ["lora.use_dora on fused MoE experts (peft's ParamWrapper refuses DoRA): "
                "set lora.target_modules to the attention projections, or use_dora: false"]
    return []


def _autocast(setup: RunSetup) -> bool:
    return setup.precision != "fp32"  # as activations.dtypes: the Trainer's autocast


def _weight_is_fp32_parameter(setup: RunSetup) -> bool:
    return setup.quantization == "none" and dtype_bytes(setup)[0] == 4


def _saved_by_linear(setup: RunSetup) -> list[tuple[object, int]]:
    """What DoRA saves for the backward per adapted Linear of a decoder layer, beyond LoRA's, in
    forward order (see the module)."""
    t = setup.micro_batch_size * setup.seq_len
    autocast = _autocast(setup)
    c = dtype_bytes(setup)[1]
    lora_out = 2 if autocast else 4  # lora_B's output: bf16 under autocast, else fp32 adapters
    # a 4/8-bit base's result is cast back to its input's dtype (bitsandbytes Linear4bit.forward:
    # ``.to(inp_dtype)``), which autocast does not touch: the residual's, or the MLP product's
    # (measured: held-out extended seed 130, OLMo-2 QLoRA DoRA bf16-mixed, held fp32 base results,
    # 5.5% over a plan with 16-bit ones)
    r, _, _ = dtypes(setup)
    source = {lin.name: src for lin, src in zip(block_linears(setup.model), linear_sources(setup.model), strict=True)}
    x_bytes = {"attn_out": 2, "mlp_act": mlp_elementwise_bytes(setup)}
    out = []
    for lin in target_linears(setup):
        total = 0
        if setup.lora_dropout:
            base_out = 2 if autocast else 4  # F.linear on the dropped fp32 input
            if autocast:
                total += 2 * lin.d_in * lin.d_out  # autocast's bf16 copy of the weight, saved
            elif not _weight_is_fp32_parameter(setup):
                total += 4 * lin.d_in * lin.d_out  # weight.to(fp32), saved
        elif setup.quantization != "none" and autocast:
            base_out = x_bytes.get(source.get(lin.name, ""), r)
        elif lin.bias and setup.quantization == "none":
            # peft takes the bias off the base result (``base_result - bias``): promoted to the
            # bias's dtype, fp32 master weights' under *-mixed (measured: held-out extended seed
            # 160, Qwen2 LoRA DoRA bf16-mixed, saved fp32 q/k/v results, 3.27% over a plan with
            # 16-bit ones)
            base_out = max(c, dtype_bytes(setup)[0])
        else:
            base_out = c
        total += t * lin.d_out * (base_out + lora_out) + 2 * 4 * lin.d_out  # + mag_norm_scale
        out.append((lin, total))
    return out


def saved_layer_bytes(setup: RunSetup) -> int:
    """What DoRA saves for the backward in one decoder layer, beyond LoRA's (see the module)."""
    if not dora_on(setup):
        return 0
    return sum(n for _, n in _saved_by_linear(setup))


def weight_norm_bytes(setup: RunSetup) -> int:
    """The forward's transient of the largest adapted Linear: identity, B@A, the dense weight and
    its sum with the scaled product (see the module). Outside autocast: the fp32 identity beside
    16 bytes per weight element (B@A, the scaled product, their sum, the norm's working tensor).
    Under autocast lora_A multiplies autocast's bf16 copy of the identity (the fp32 one is freed
    when get_lora_weight returns): first the two identities together, then the bf16 one beside
    16 bytes per element (fp32 weights; a 2-layer Llama DoRA run under bf16-mixed was +2.9% over
    its plan at the 15 measured on one Linear) or 19 (16-bit weights: + their fp32 copy); a 4/8-bit base
    adds its dequantized 16-bit weight. Coefficients measured with the live-bytes tracker on one
    peft DoRA Linear (d_in x d_out 1024 x 256 to 256 x 2048, 64 tokens): 16.4-17.2 bytes per
    element in fp32, 14.7-14.8 under autocast over fp32 weights, 18.7-18.8 over bf16 ones."""
    if not dora_on(setup):
        return 0
    return _weight_norm_bytes(setup, target_linears(setup))


def _weight_norm_bytes(setup: RunSetup, lins) -> int:
    """weight_norm_bytes over the adapted Linears ``lins`` (0 for none)."""
    if not lins:
        return 0
    autocast = _autocast(setup)
    fp32_param = _weight_is_fp32_parameter(setup)
    per_weight = (fitted.DORA_NORM_BYTES_FP32 if fp32_param else fitted.DORA_NORM_BYTES_16BIT_AUTOCAST
                  if autocast else fitted.DORA_NORM_BYTES_16BIT).value
    if setup.quantization != "none":
        per_weight += 2  # the dequantized 16-bit weight beside its fp32 copy

    def one(lin) -> int:
        identity = 4 * lin.d_in * lin.d_in
        norm = per_weight * lin.d_in * lin.d_out + 4 * lin.d_in * setup.lora_r
        if autocast:
            return max(identity * 3 // 2, identity // 2 + norm)
        return identity + norm

    return max(one(lin) for lin in lins)


def _attention_side(setup: RunSetup) -> set[str]:
    """The block's Linears that run before its MLP (the attention's projections, o_proj)."""
    return {lin.name for lin, src in zip(block_linears(setup.model), linear_sources(setup.model), strict=True)
            if src in ("norm_attn", "attn_out")}


def recompute_weight_norm_bytes(setup: RunSetup, layer_bytes: int, attention_bytes: int) -> int:
    """With checkpointing, the recompute's weight norm (the dora_weight_norm moment, beside the
    checkpoints and the gradients made so far): the recompute runs the layer's forward in order
    (torch.utils.checkpoint), so when an attention Linear forms its weight norm only the
    attention's saved tensors exist (``attention_bytes``: activations.layer_activation_bytes with
    attention_side, from the input norm to SDPA's output that o_proj reads) and only the
    attention Linears' DoRA tensors; an MLP Linear's sees the whole layer's (``layer_bytes``).
    Each side adds its widest Linear's weight norm (weight_norm_bytes), peft's input cast
    (recompute_input_bytes) and the layer's two hidden-state gradients (hidden_grads). The larger
    side is the moment. Measured with the live-bytes tracker: extended seed 142 (SmolLM3 QLoRA
    DoRA on o_proj only, bf16, checkpointing) formed o_proj's norm in the recompute at 1.14 MB
    live with no MLP tensor alive, under a plan of 1.43 MB that counted the whole layer."""
    if not dora_on(setup):
        return 0
    attention = _attention_side(setup)
    saved = _saved_by_linear(setup)
    best = 0
    for side, acts in ((True, attention_bytes), (False, layer_bytes)):
        lins = [lin for lin in target_linears(setup) if (lin.name in attention) == side]
        if not lins:
            continue
        dora_saved = sum(n for lin, n in saved if side is False or lin.name in attention)
        best = max(best, acts + dora_saved + _weight_norm_bytes(setup, lins) + _recompute_input_bytes(setup, lins))
    return best


def backward_bytes(setup: RunSetup) -> int:
    """The magnitude gradient's temporaries in the widest adapted Linear's backward (see the
    module)."""
    if not dora_on(setup):
        return 0
    t = setup.micro_batch_size * setup.seq_len
    # outside autocast 2 fp32 t x d_out; under autocast the bf16 outputs' gradients are upcast
    # and cast back around the fp32 combine: 3.3-3.4 fp32 t x d_out measured, taken as 3.5
    per = (fitted.DORA_MAGNITUDE_BACKWARD_BYTES_AUTOCAST if _autocast(setup) else fitted.DORA_MAGNITUDE_BACKWARD_BYTES).value
    return per * t * max(lin.d_out for lin in target_linears(setup))


def recompute_backward_bytes(setup: RunSetup) -> int:
    """With checkpointing, under autocast, in the recomputed layer's backward (the
    last_layer_recompute moment, every tensor of the layer alive): the widest adapted Linear's
    16-bit output gradients upcast to fp32 around the magnitude's combine, 2 fp32 t x d_out
    (DORA_MAGNITUDE_BACKWARD_BYTES); outside autocast none (fp32 throughout: its 2 fp32 products
    are :func:`magnitude_backward_bytes`' own). The rest of the magnitude backward is counted
    where it runs, beside only the DoRA tensors saved up to its Linear. Measured: extended seeds
    123/128 (Llama QLoRA, Phi-3 LoRA, bf16 with checkpointing) were 12.1% and 14.6% under a plan
    that stacked 3.5 fp32 t x d_out here on every DoRA tensor; held-out seed 206 (Llama LoRA DoRA
    fp32 with checkpointing) 11.0% under one with 2 fp32 t x d_out here, +0.34% without."""
    if not dora_on(setup) or not _autocast(setup):
        return 0
    t = setup.micro_batch_size * setup.seq_len
    return fitted.DORA_MAGNITUDE_BACKWARD_BYTES.value * t * max(lin.d_out for lin in target_linears(setup))


def recompute_input_bytes(setup: RunSetup) -> int:
    """With checkpointing and 16-bit activations, the recompute's weight norm of the widest-input
    adapted Linear also holds peft's fp32 cast of its input for the fp32 adapters
    (``_cast_input_dtype``, 4 x t x d_in) and a 16-bit copy of it made in the DoRA forward (2 x t
    x d_in), DORA_RECOMPUTE_INPUT_BYTES in all. Measured: extended seed 111 (Phi-3 LoRA DoRA, bf16,
    checkpointing) peaked at down_proj's weight norm in the recompute with a (4, 128, 512) fp32
    cast and a bf16 copy of it, 4.3% over a plan without them."""
    if not dora_on(setup):
        return 0
    return _recompute_input_bytes(setup, target_linears(setup))


def _recompute_input_bytes(setup: RunSetup, lins) -> int:
    if dtypes(setup)[0] == 4 or not lins:
        return 0
    t = setup.micro_batch_size * setup.seq_len
    return fitted.DORA_RECOMPUTE_INPUT_BYTES.value * t * max(lin.d_in for lin in lins)


def magnitude_backward_bytes(setup: RunSetup) -> int:
    """With checkpointing, an adapted Linear's magnitude backward in the recomputed layer: the DoRA
    tensors saved by the adapted Linears up to it in forward order (the later ones' freed: the
    backward runs in reverse) and its magnitude gradient's temporaries, ``per`` bytes per token x
    d_out (backward_bytes' coefficient), the largest over the adapted Linears. peft
    DoraLinearLayer.forward: ``(mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result
    * scaling``; its backward multiplies the incoming gradient by base_result, lora_result and the
    scales (t x d_out each). Measured: extended seed 128 (Phi-3, gate_up_proj d_out 1024) peaked in
    gate_up's magnitude backward with down_proj's DoRA tensors freed."""
    if not dora_on(setup):
        return 0
    t = setup.micro_batch_size * setup.seq_len
    per = (fitted.DORA_MAGNITUDE_BACKWARD_BYTES_AUTOCAST if _autocast(setup)
           else fitted.DORA_MAGNITUDE_BACKWARD_BYTES).value
    best, before = 0, 0
    for lin, n in _saved_by_linear(setup):
        before += n
        best = max(best, before + per * t * lin.d_out)
    return best


__all__ = ["backward_bytes", "dora_on", "dora_problems", "magnitude_backward_bytes",
           "recompute_backward_bytes", "recompute_input_bytes", "recompute_weight_norm_bytes", "saved_layer_bytes",
           "weight_norm_bytes"]
