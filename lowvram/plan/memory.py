"""Peak memory of one training step: pure functions, bytes in, bytes out (no torch).

Every constant cites its source: a paper or doc, or "measured: bench/plan_accuracy.py", which
runs real steps of small Llama-style models on CPU under lowvram.measure's exact live-bytes
tracker and compares them with these formulas (tests/test_plan_accuracy.py pins them at 3%).
Symbols as in /work/shared/reference/memory-model.md: h hidden, I MLP width, V vocabulary,
t = micro_batch_size x seq_len tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowvram.plan.models import (
    ModelSpec,
    block_linears,
    count_parameters,
    embedding_numel,
    lm_head_numel,
)

BREAKDOWN_KEYS = ("weights", "gradients", "optimizer", "activations", "logits", "cuda_context",
                  "allocator")

PRECISIONS = ("bf16", "fp16", "bf16-mixed", "fp16-mixed", "fp32")
QUANTIZATIONS = ("none", "nf4", "nf4-dq", "fp4", "int8")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor", "sgd")
OFFLOADS = ("none", "optimizer", "full", "zero2", "zero2-offload", "zero3", "zero3-offload",
            "fsdp", "fsdp-offload")


@dataclass(frozen=True)
class RunSetup:
    """One training run, as the memory model sees it."""

    model: ModelSpec
    precision: str = "bf16"  # bf16/fp16: weights stored and trained in 16 bit; *-mixed: fp32 + autocast
    quantization: str = "none"  # none | nf4 | nf4-dq | fp4 | int8 (needs lora)
    lora: bool = False
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ("all-linear",)
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False
    attention: str = "sdpa"  # sdpa | eager | flash_attention_2
    loss: str = "standard"  # standard | chunked
    micro_batch_size: int = 1
    seq_len: int = 512
    grad_accum: int = 1
    gpus: int = 1
    offload: str = "none"
    device: str = "cuda"  # "cpu": no CUDA context, no allocator slack
    kbit_prepare: bool = True  # peft prepare_model_for_kbit_training: non-quantized params -> fp32


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    trainable_parameters: int
    peak_bytes: int
    breakdown: dict[str, int]  # BREAKDOWN_KEYS, bytes at the peak moment, summing to peak_bytes
    peak_phase: str  # "forward_backward" or "optimizer_step"
    cpu_ram_bytes: int
    persistent_bytes: int


@dataclass(frozen=True)
class CudaOverheads:
    """Memory a CUDA process holds beyond tensors. NOT YET CALIBRATED ON A GPU (bench/gpu_check.py)."""

    context_bytes: int
    allocator_fraction: float  # reserved - allocated, as a fraction of the tensor peak
    calibrated: bool = False


def cuda_overheads() -> CudaOverheads:
    """CUDA context 0.3-0.6 GB with lazy module loading (CUDA >= 12.2, torch >= 2; PyTorch CUDA
    semantics notes, CUDA_MODULE_LOADING=LAZY) -> 0.5 GiB taken. Caching-allocator slack
    (reserved over allocated, PyTorch docs "Memory management"): 5% assumed until measured."""
    return CudaOverheads(context_bytes=512 * 2**20, allocator_fraction=0.05)


# --------------------------------------------------------------------------------------------
# Sizes per element


def _dtype_bytes(setup: RunSetup) -> tuple[int, int]:
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


def _target_linears(setup: RunSetup):
    lins = block_linears(setup.model)
    if "all-linear" in setup.lora_targets:
        return lins  # peft all-linear: every Linear in the blocks, never the output layer
    return [lin for lin in lins if lin.name in setup.lora_targets]


def lora_parameters(setup: RunSetup) -> int:
    """r x (d_in + d_out) per adapted Linear (LoRA paper, Hu et al. 2021, sec. 4)."""
    per_block = sum(setup.lora_r * (lin.d_in + lin.d_out) for lin in _target_linears(setup))
    return per_block * setup.model.num_layers


def trainable_parameters(setup: RunSetup) -> int:
    return lora_parameters(setup) if setup.lora else count_parameters(setup.model)


def weight_bytes(setup: RunSetup) -> int:
    """Base weights (+ LoRA adapters in fp32: peft autocast_adapter_dtype=True upcasts them)."""
    spec = setup.model
    w, _ = _dtype_bytes(setup)
    total = count_parameters(spec)
    if setup.quantization != "none":
        qlins = block_linears(spec)
        q_numel = sum(lin.d_in * lin.d_out for lin in qlins) * spec.num_layers
        q_bytes = sum(quantized_bytes(lin.d_in * lin.d_out, setup.quantization, lin.d_out)
                      for lin in qlins) * spec.num_layers
        rest = total - q_numel  # embeddings, lm_head, norms, biases stay in the load dtype
        # peft prepare_model_for_kbit_training casts every non-quantized fp16/bf16 param to fp32.
        rest_bytes = rest * (4 if setup.kbit_prepare else w)
        base = q_bytes + rest_bytes
    else:
        base = total * w
    lora = 4 * lora_parameters(setup) if setup.lora else 0
    return base + lora


def gradient_bytes(setup: RunSetup) -> int:
    """One gradient per trainable param in the param's dtype (PyTorch autograd)."""
    if setup.lora:
        return 4 * lora_parameters(setup)
    w, _ = _dtype_bytes(setup)
    return w * count_parameters(setup.model)


def _state_bytes_per_param(setup: RunSetup) -> float:
    """Optimizer state per trainable param.

    AdamW: exp_avg + exp_avg_sq in the param dtype (torch.optim.AdamW). 8-bit AdamW
    (bitsandbytes, Dettmers et al. 2022): 2 uint8 states + fp32 absmax per 256 (tensors under
    4096 elements stay 32-bit). Adafactor: factored second moment (Shazeer & Stern 2018), ~0.
    SGD without momentum: 0.
    """
    w = 4 if setup.lora else _dtype_bytes(setup)[0]
    o = setup.optimizer
    if o in ("adamw", "paged_adamw_32bit"):
        return 2 * w
    if o in ("adamw_8bit", "paged_adamw_8bit"):
        return 2 + 2 * 4 / 256
    return 0.0


def optimizer_bytes(setup: RunSetup) -> int:
    return int(_state_bytes_per_param(setup) * trainable_parameters(setup))


# --------------------------------------------------------------------------------------------
# Activations and logits


def layer_activation_bytes(setup: RunSetup) -> int:
    """Bytes autograd keeps for one decoder layer (no recomputation).

    Llama-style (SwiGLU, GQA, RMSNorm upcast to fp32, SDPA): b*s*(22h + 4h_kv + 8I) at 16-bit,
    counted from the tensors autograd saves (memory-model.md); eager attention adds the softmax
    (fp32) and its 16-bit copy: 6*a*s^2*b (Korthikanti et al. 2022 sec. 4.1, plus the upcast).
    """
    spec = setup.model
    _, c = _dtype_bytes(setup)
    t = setup.micro_batch_size * setup.seq_len
    h, kv, i = spec.hidden_size, spec.kv_dim, spec.intermediate_size
    mlp = 4 * i if spec.mlp == "gated" else 2 * i
    per_token = c * (11 * h + 2 * kv + mlp)
    eager = 0
    if setup.attention == "eager":
        eager = (4 + c) * spec.num_heads * setup.seq_len**2 * setup.micro_batch_size
    return t * per_token + eager


def activation_bytes(setup: RunSetup) -> int:
    """All layers' saved activations at the start of backward.

    Gradient checkpointing (Chen et al. 2016; transformers checkpoints each decoder layer): the
    layer inputs (c*t*h per layer) plus one layer's activations recomputed during backward.
    """
    spec = setup.model
    _, c = _dtype_bytes(setup)
    t = setup.micro_batch_size * setup.seq_len
    layer = layer_activation_bytes(setup)
    if setup.gradient_checkpointing:
        return spec.num_layers * c * t * spec.hidden_size + layer
    return spec.num_layers * layer


def logits_bytes(setup: RunSetup) -> int:
    """Logits around the loss: transformers upcasts logits to fp32 for cross-entropy; in its
    backward the saved log-softmax, its gradient and the input gradient coexist: 12*t*V
    (memory-model.md "Logits and loss"). Chunked loss keeps one chunk of 1024 tokens."""
    spec = setup.model
    t = setup.micro_batch_size * setup.seq_len
    if setup.loss == "chunked":
        t = min(t, 1024)
    return 12 * t * spec.vocab_size


# --------------------------------------------------------------------------------------------
# The peak


def _shard(setup: RunSetup, weights: int, grads: int, optim: int) -> tuple[int, int, int, int]:
    """Per-GPU model states and the bytes moved to CPU RAM (ZeRO paper, Rajbhandari et al. 2020)."""
    n = max(1, setup.gpus)
    o = setup.offload
    host = 0
    if o in ("optimizer", "zero2-offload", "zero3-offload", "fsdp-offload", "full"):
        host += optim
        optim = 0
    if o in ("zero2", "zero3", "fsdp"):
        optim //= n
    if o in ("zero2", "zero2-offload", "zero3", "zero3-offload", "fsdp", "fsdp-offload"):
        grads //= n
    if o in ("zero3", "fsdp"):
        weights //= n
    if o in ("zero3-offload", "fsdp-offload", "full"):
        host += weights
        weights = 0
    return weights, grads, optim, host


def estimate_memory(setup: RunSetup) -> MemoryEstimate:
    """Peak bytes of a steady-state step (optimizer state already allocated)."""
    weights, grads, optim, host = _shard(
        setup, weight_bytes(setup), gradient_bytes(setup), optimizer_bytes(setup))
    acts = activation_bytes(setup)
    logits = logits_bytes(setup)
    kept_grads = grads if setup.grad_accum > 1 else 0  # accumulation keeps grads across micro-steps
    fb = weights + optim + kept_grads + acts + logits
    step = weights + optim + grads
    if fb >= step:
        phase = "forward_backward"
        parts = dict(weights=weights, gradients=kept_grads, optimizer=optim, activations=acts,
                     logits=logits)
    else:
        phase = "optimizer_step"
        parts = dict(weights=weights, gradients=grads, optimizer=optim, activations=0, logits=0)
    tensors = sum(parts.values())
    if setup.device == "cuda":
        ov = cuda_overheads()
        parts["cuda_context"] = ov.context_bytes
        parts["allocator"] = int(ov.allocator_fraction * tensors)
    else:
        parts["cuda_context"] = 0
        parts["allocator"] = 0
    breakdown = {k: int(parts[k]) for k in BREAKDOWN_KEYS}
    persistent = weights + optim + kept_grads
    # Host RAM: what is offloaded, plus the process itself (torch + CUDA libraries, ~2 GiB
    # measured RSS of an idle import) plus one checkpoint shard staged while loading (<= 5 GB,
    # the transformers default max_shard_size).
    process = 2 * 2**30
    staging = min(count_parameters(setup.model) * _dtype_bytes(setup)[0], 5 * 10**9)
    if setup.device == "cpu":
        cpu_ram = sum(breakdown.values()) + host + process
    else:
        cpu_ram = host + process + staging
    return MemoryEstimate(
        parameters=count_parameters(setup.model) + (lora_parameters(setup) if setup.lora else 0),
        trainable_parameters=trainable_parameters(setup),
        peak_bytes=sum(breakdown.values()),
        breakdown=breakdown,
        peak_phase=phase,
        cpu_ram_bytes=int(cpu_ram),
        persistent_bytes=int(persistent),
    )


__all__ = [
    "BREAKDOWN_KEYS", "CudaOverheads", "MemoryEstimate", "RunSetup", "activation_bytes",
    "cuda_overheads", "embedding_numel", "estimate_memory", "gradient_bytes", "lm_head_numel",
    "logits_bytes", "lora_parameters", "optimizer_bytes", "quantized_bytes", "weight_bytes",
]
