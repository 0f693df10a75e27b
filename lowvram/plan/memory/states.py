"""The exact model states of a run: parameter counts (LoRA included), bytes of weights (quantized
or not), gradients and optimizer states, bytes per element. Exact where the math is exact; sources
as in :mod:`lowvram.plan.memory.memory`."""

from __future__ import annotations

from lowvram.plan import constants as fitted
from lowvram.plan.memory import optimizers
from lowvram.plan.model import moe
from lowvram.plan.model.models import (
    ModelSpec,
    block_linears,
    count_parameters,
    cross_attention_numel,
    vision_numel,
)
from lowvram.plan.model.vision import tower_buffer_bytes
from lowvram.plan.setup import RunSetup
from lowvram.vocab import OPTIMIZERS_8BIT

# --------------------------------------------------------------------------------------------
# Sizes per element


def dtype_bytes(setup: RunSetup) -> tuple[int, int]:
    """(weight storage bytes, compute/activation bytes) per element.

    bf16/fp16: 16-bit storage and compute; *-mixed: fp32 master weights, 16-bit autocast compute
    (PyTorch AMP docs); fp32: 4 and 4.
    """
    p = setup.precision
    if p in ("bf16", "fp16"):
        return 2, 2
    if p in ("bf16-mixed", "fp16-mixed"):
        return 4, 2
    return 4, 4


def dtypes(setup: RunSetup) -> tuple[int, int, bool]:
    """(r, c, autocast): bytes of the residual stream, of 16/32-bit compute, and whether the
    forward runs under autocast (the Trainer/accelerate wraps forward in autocast whenever
    bf16/fp16 is on, also for 16-bit weights). A quantized base after
    prepare_model_for_kbit_training has fp32 embeddings and norms, so its residual stream is fp32.
    """
    w, c = dtype_bytes(setup)
    autocast = setup.precision != "fp32"
    r = w
    if setup.quantization != "none" and setup.kbit_prepare:
        r = 4
    return r, c, autocast


def quantized_bytes(numel: int, quantization: str, d_out: int) -> int:
    """Bytes of one bitsandbytes-quantized weight matrix.

    NF4/FP4 (bitsandbytes functional.quantize_4bit, blocksize 64): numel/2 packed bytes + one fp32
    absmax per 64 + the 16-entry fp32 code. Double quantization (QLoRA paper sec. 3): absmax in
    uint8 + fp32 absmax per 256 blocks + 256-entry fp32 code + fp32 offset.
    int8 (LLM.int8, Int8Params): 1 byte per element + fp32 scale per output row (SCB).
    """
    if quantization == "int8":
        return numel + 4 * d_out
    blocks = -(-numel // 64)
    packed = -(-numel // 2)
    code = 16 * 4
    if quantization == "nf4-dq":
        return packed + blocks + 4 * -(-blocks // 256) + 256 * 4 + 4 + code
    return packed + 4 * blocks + code


# --------------------------------------------------------------------------------------------
# Parameters


def target_linears(setup: RunSetup):
    lins = block_linears(setup.model)
    if "all-linear" in setup.lora_targets:
        return lins  # peft all-linear: every Linear in the blocks, never the output layer
    return [lin for lin in lins if lin.name in setup.lora_targets]


def lora_parameters(setup: RunSetup) -> int:
    """r x (d_in + d_out) per adapted Linear (LoRA paper, Hu et al. 2021, sec. 4), + DoRA's
    magnitudes (magnitude_shapes)."""
    per_block = sum(setup.lora_r * (lin.d_in + lin.d_out) for lin in target_linears(setup))
    magnitudes = sum(s[0] for s in magnitude_shapes(setup))
    return per_block * setup.model.num_layers + _moe_lora_parameters(setup) + magnitudes


def magnitude_shapes(setup: RunSetup) -> list[tuple[int, ...]]:
    """DoRA (lora.use_dora; lowvram.plan.memory.dora): one trainable fp32 magnitude of d_out per adapted
    Linear (peft DoraLinearLayer.update_layer: nn.Parameter(weight_norm))."""
    if not (setup.lora and setup.lora_use_dora):
        return []
    return [(lin.d_out,) for lin in target_linears(setup)] * setup.model.num_layers


def _moe_lora_parameters(setup: RunSetup) -> int:
    """peft's adapters on fused experts and the router (lowvram.plan.model.moe)."""
    return moe.expert_lora_parameters(setup.model, setup.lora_r, setup.lora_targets)


def trainable_parameters(setup: RunSetup) -> int:
    return lora_parameters(setup) if setup.lora else count_parameters(setup.model)


def weight_bytes(setup: RunSetup) -> int:
    """Base weights (+ LoRA adapters in fp32: peft autocast_adapter_dtype=True upcasts them)."""
    spec = setup.model
    w, _ = dtype_bytes(setup)
    total = count_parameters(spec)
    if setup.quantization != "none":
        q_numel, q_bytes = _quantized_blocks(setup, spec.num_layers)
        rest = total - q_numel  # embeddings, lm_head, norms, biases stay in the load dtype
        # peft prepare_model_for_kbit_training casts every non-quantized fp16/bf16 param to fp32.
        rest_bytes = rest * (4 if setup.kbit_prepare else w)
        base = q_bytes + rest_bytes
    else:
        base = total * w
    lora = 4 * lora_parameters(setup) if setup.lora else 0
    return base + lora + cross_attention_weight_bytes(setup) + vision_weight_bytes(setup)


def _quantized_blocks(setup: RunSetup, layers: int) -> tuple[int, int]:
    """(weights, bytes) of ``layers`` decoder blocks' Linears as bitsandbytes quantizes them."""
    lins = block_linears(setup.model)
    q_numel = sum(lin.d_in * lin.d_out for lin in lins) * layers
    return q_numel, sum(quantized_bytes(lin.d_in * lin.d_out, setup.quantization, lin.d_out) for lin in lins) * layers


def cross_attention_weight_bytes(setup: RunSetup) -> int:
    """Mllama's cross-attention layers (models.cross_attention_numel), loaded and frozen: lowvram
    keeps them out of LoRA and out of the optimizer (lowvram.train.build.vision.frozen_modules; on text
    data the forward skips them, so they would get no gradient anyway), and bitsandbytes quantizes
    their Linears like every other language-model Linear; their norms and gates stay in the load
    dtype (fp32 under peft's k-bit upcast)."""
    spec = setup.model
    n = cross_attention_numel(spec)
    if not n:
        return 0
    w, _ = dtype_bytes(setup)
    if setup.quantization == "none":
        return n * w
    q_numel, q_bytes = _quantized_blocks(setup, len(spec.cross_attention_layers))
    return q_bytes + (n - q_numel) * (4 if setup.kbit_prepare else w)


def vision_weight_bytes(setup: RunSetup) -> int:
    """A multimodal checkpoint's vision tower and projector, frozen, in the load dtype: lowvram
    keeps them out of bitsandbytes' quantization (lowvram.train.build.vision.VISION_MODULES in
    llm_int8_skip_modules, as Unsloth's dynamic 4-bit checkpoints leave the vision encoder in
    16 bits), so under QLoRA too they stay 16-bit (fp32 under peft's k-bit upcast); and the
    tower's buffers (vision.tower_buffer_bytes)."""
    n = vision_numel(setup.model)
    if not n:
        return 0
    w, _ = dtype_bytes(setup)
    buffers = tower_buffer_bytes(setup.model.vision)
    return n * (4 if setup.quantization != "none" and setup.kbit_prepare else w) + buffers


def gradient_bytes(setup: RunSetup) -> int:
    """One gradient per trainable param in the param's dtype (PyTorch autograd)."""
    if setup.lora:
        return 4 * lora_parameters(setup)
    w, _ = dtype_bytes(setup)
    return w * count_parameters(setup.model)


def trainable_tensors(setup: RunSetup) -> list[tuple[int, ...]]:
    """Shapes of the trainable tensors (optimizer states are allocated per tensor)."""
    spec = setup.model
    if setup.lora:
        per = [s for lin in target_linears(setup)
               for s in ((setup.lora_r, lin.d_in), (lin.d_out, setup.lora_r))]
        per += moe.expert_trainable_shapes(spec, True, setup.lora_r, setup.lora_targets)
        return per * spec.num_layers + magnitude_shapes(setup)
    h = spec.hidden_size
    norm = [(h,)] * (2 if spec.norm == "layer" else 1)
    per = [s for lin in block_linears(spec)
           for s in ([(lin.d_out, lin.d_in)] + ([(lin.d_out,)] if lin.bias else []))]
    per += norm * spec.norms_per_layer + _qk_norm_shapes(spec)
    per += moe.expert_trainable_shapes(spec, False, setup.lora_r, setup.lora_targets)
    out = [(spec.embedding_rows, h)] + per * spec.num_layers + norm
    if spec.learned_positions:
        out.append((spec.learned_positions, h))
    if spec.embedding_norm:
        out += norm
    if not spec.tie_word_embeddings:
        out.append((spec.vocab_size, h))
        if spec.lm_head_bias:
            out.append((spec.vocab_size,))
    return out


def _qk_norm_shapes(spec: ModelSpec) -> list[tuple[int, ...]]:
    if spec.qk_norm == "head":
        return [(spec.head_dim,)] * 2
    if spec.qk_norm == "full":
        return [(spec.q_dim,), (spec.kv_dim,)]
    return []


def shape_numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def optimizer_bytes(setup: RunSetup) -> int:
    """Optimizer state of the trainable tensors.

    AdamW (torch.optim.AdamW; the Trainer default adamw_torch_fused): exp_avg + exp_avg_sq in
    the param dtype (fp32 LoRA adapters: 8 bytes/param). bitsandbytes 8-bit AdamW (Dettmers et al.
    2022, blockwise): two uint8 states + fp32 absmax per 256 elements; tensors under 4096
    elements (min_8bit_size) keep two fp32 states; plus two shared 256-entry fp32 maps.
    Paged variants: same bytes, in CUDA unified memory. Adafactor (Shazeer & Stern 2018,
    transformers.optimization.Adafactor, no momentum): fp32 row + column factors per matrix, a full
    fp32 second moment per vector. SGD without momentum: 0. LOMO / AdaLomo: plan/memory/optimizers/.
    """
    w = 4 if setup.lora else dtype_bytes(setup)[0]
    shapes = trainable_tensors(setup)
    o = setup.optimizer
    if optimizers.projected(setup):
        return optimizers.galore_state_bytes(setup, w, shapes)
    if optimizers.lomo(setup):  # LOMO none, AdaLomo its factored fp32 second moment
        return optimizers.lomo_state_bytes(setup, shapes)
    if optimizers.torchao(setup):  # torchao's block-wise 8/4-bit moments
        return optimizers.torchao_state_bytes(setup, w, shapes)
    if o in ("adamw", "paged_adamw_32bit", "adamw_in_backward"):
        return 2 * w * sum(shape_numel(s) for s in shapes)
    if o in OPTIMIZERS_8BIT:
        # The Trainer registers every nn.Embedding weight for 32-bit state (bnb
        # GlobalOptimManager override, transformers Trainer.create_optimizer): 8 bytes/param.
        h = setup.model.hidden_size
        embeddings = [] if setup.lora else [(setup.model.embedding_rows, h)] + (
            [(setup.model.learned_positions, h)] if setup.model.learned_positions else [])
        total = 2 * 256 * 4
        for s in shapes:
            n = shape_numel(s)
            if s in embeddings:
                embeddings.remove(s)
                total += 8 * n
                continue
            total += 8 * n if n < 4096 else 2 * n + 2 * 4 * -(-n // 256)
        return total
    if o == "adafactor":
        # factored over the last two dims (transformers Adafactor: exp_avg_sq_row = shape[:-1],
        # exp_avg_sq_col = shape[:-2] + shape[-1:]): 3-D fused MoE experts too
        return sum(4 * (shape_numel(s[:-1]) + shape_numel(s[:-2]) * s[-1]) if len(s) >= 2 else 4 * shape_numel(s)
                   for s in shapes)
    return 0


def optimizer_step_temp_bytes(setup: RunSetup) -> int:
    """Temporaries inside optimizer.step(). Fused AdamW and bitsandbytes update in place (0,
    measured: bench/plan_accuracy.py). transformers' Adafactor works one tensor at a time on
    fp32 copies (grad.float(), update, p.float()): constants.ADAFACTOR_TEMP_BYTES_FP32 x the
    largest tensor for fp32 params, ADAFACTOR_TEMP_BYTES_16BIT for 16-bit (measured:
    bench/plan_accuracy.py)."""
    if optimizers.projected(setup):
        return optimizers.galore_step_temp_bytes(setup, dtype_bytes(setup)[0], trainable_tensors(setup))
    if optimizers.torchao(setup):  # the compiled step's buffers (plan/memory/optimizers/)
        return optimizers.torchao_step_temp_bytes(setup, trainable_tensors(setup))
    if setup.optimizer != "adafactor":
        return 0
    largest = max(shape_numel(s) for s in trainable_tensors(setup))
    fp32 = setup.lora or dtype_bytes(setup)[0] == 4
    return largest * (fitted.ADAFACTOR_TEMP_BYTES_FP32 if fp32 else fitted.ADAFACTOR_TEMP_BYTES_16BIT).value


__all__ = [
    "cross_attention_weight_bytes", "dtype_bytes", "gradient_bytes", "lora_parameters", "magnitude_shapes",
    "optimizer_bytes",
    "optimizer_step_temp_bytes", "quantized_bytes", "shape_numel", "target_linears",
    "trainable_parameters", "trainable_tensors", "weight_bytes",
]
