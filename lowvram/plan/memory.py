"""Peak memory of one training step: pure functions, bytes in, bytes out (no torch).

Every constant cites its source: a paper or doc, or "measured: bench/plan_accuracy.py", which
runs real steps of small Llama-style models on CPU under lowvram.livebytes' exact live-bytes
tracker and compares them with these formulas (tests/test_plan_accuracy.py pins them at 3%).
Symbols as in /work/shared/reference/memory-model.md: h hidden, I MLP width, V vocabulary,
t = micro_batch_size x seq_len tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lowvram.errors import LowvramError
from lowvram.plan import moe
from lowvram.plan.models import (
    ModelSpec,
    block_linears,
    count_parameters,
    embedding_numel,
    lm_head_numel,
    norm_numel,
)
from lowvram.vocab import (
    ATTENTIONS,
    LOSSES,
    OFFLOADS,
    OPTIMIZERS,
    OPTIMIZERS_8BIT,
    PRECISIONS,
    QUANTIZATIONS,
)

BREAKDOWN_KEYS = ("weights", "gradients", "optimizer", "activations", "logits", "cuda_context",
                  "allocator")

# Host RAM of one training process before any tensor of the run: torch + CUDA libraries, ~2 GiB
# (measured RSS of an idle import). estimate_memory and lowvram.check.simulate add it.
PROCESS_HOST_BYTES = 2 * 2**30

# Tokens per chunk of the chunked cross-entropy (lowvram.train.loss uses the same number).
CHUNK_TOKENS = 1024

# DeepSpeed offloads that run the optimizer on the CPU. There DeepSpeed's own CPU Adam takes the
# place of the Trainer's optimizer (accelerate.utils.deepspeed.map_pytorch_optim_to_deepspeed,
# called from Accelerator._prepare_deepspeed when offload_optimizer is set): only adamw keeps
# its meaning (a bitsandbytes 8-bit AdamW would silently become Adam with L2 decay).
DEEPSPEED_CPU_OPTIMIZER = ("optimizer", "full", "zero2-offload", "zero3-offload")


def offload_conflict(optimizer: str, offload: str) -> str | None:
    """Why ``optimizer`` cannot run under ``offload`` (None when it can)."""
    if offload in DEEPSPEED_CPU_OPTIMIZER and optimizer != "adamw":
        return (f"offload {offload} runs DeepSpeed's CPU Adam on the CPU; optimizer {optimizer} "
                "cannot run there")
    return None


@dataclass(frozen=True)
class RunSetup:
    """One training run, as the memory model sees it."""

    model: ModelSpec
    precision: str = "bf16"  # bf16/fp16: weights stored and trained in 16 bit; *-mixed: fp32 + autocast
    quantization: str = "none"  # none | nf4 | nf4-dq | fp4 | int8 (needs lora)
    lora: bool = False
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ("all-linear",)
    lora_dropout: float = 0.0  # lora.dropout: > 0 saves a dropped input and a mask per adapter
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False
    attention: str = "sdpa"  # sdpa | eager | flash_attention_2
    loss: str = "standard"  # standard | chunked
    micro_batch_size: int = 1
    seq_len: int = 512
    grad_accum: int = 1
    gpus: int = 1
    offload: str = "none"
    # techniques.activation_offload: checkpointed layer inputs in pinned host RAM (needs
    # gradient_checkpointing; no effect on a CPU: activation_offloaded)
    activation_offload: bool = False
    device: str = "cuda"  # "cpu": no CUDA context, no allocator slack
    # True: peft prepare_model_for_kbit_training (non-quantized params -> fp32). lowvram trains
    # QLoRA without that upcast (lowvram.train.model.prepare_kbit_model), so False is the default.
    kbit_prepare: bool = False


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
    """Memory a CUDA process holds beyond tensors. Fitted on published measurements; not yet
    calibrated on a GPU by this project (bench/gpu_check.py)."""

    context_bytes: int
    allocator_fraction: float  # reserved - allocated, as a fraction of the tensor peak
    calibrated: bool = False


def cuda_overheads() -> CudaOverheads:
    """Fitted on published GPU measurements (bench/published_accuracy.py, the `split: fit`
    sources of bench/gpu_truth; not yet measured by this project's bench/gpu_check.py, hence
    calibrated=False). CUDA context: 300 MiB, the median of three published nvidia-smi readings
    right after CUDA init with lazy module loading (~300 MB in pytorch/pytorch#107667, ~400 MB in
    #109888, 256 MiB in invoke-ai/InvokeAI#9413). Allocator fraction: 0.12, the least-squares
    slope of (nvidia-smi peak - peak allocated - context) over peak allocated in nine
    single-GPU Hugging Face Trainer runs of the fms-acceleration benchmark
    (scripts/benchmarks/refs/a100_80gb.csv): it carries the caching allocator's slack and the
    kernels training loads beyond the initial context. Held-out error of the device and reserved
    predictions: bench/results/published_accuracy.txt. The slack there tracks the largest
    transient (the fp32 logits) more than the total: 4-11 GiB on 20-70 GiB runs."""
    return CudaOverheads(context_bytes=300 * 2**20, allocator_fraction=0.12)


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
    return per_block * setup.model.num_layers + _moe_lora_parameters(setup)


def _moe_lora_parameters(setup: RunSetup) -> int:
    """peft's adapters on fused experts and the router (lowvram.plan.moe)."""
    return moe.expert_lora_parameters(setup.model, setup.lora_r, setup.lora_targets)


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


def trainable_tensors(setup: RunSetup) -> list[tuple[int, ...]]:
    """Shapes of the trainable tensors (optimizer states are allocated per tensor)."""
    spec = setup.model
    if setup.lora:
        per = [s for lin in _target_linears(setup)
               for s in ((setup.lora_r, lin.d_in), (lin.d_out, setup.lora_r))]
        per += moe.expert_trainable_shapes(spec, True, setup.lora_r, setup.lora_targets)
        return per * spec.num_layers
    h = spec.hidden_size
    norm = [(h,)] * (2 if spec.norm == "layer" else 1)
    per = [s for lin in block_linears(spec)
           for s in ([(lin.d_out, lin.d_in)] + ([(lin.d_out,)] if lin.bias else []))]
    per += norm * spec.norms_per_layer + _qk_norm_shapes(spec)
    per += moe.expert_trainable_shapes(spec, False, setup.lora_r, setup.lora_targets)
    out = [(spec.vocab_size, h)] + per * spec.num_layers + norm
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


def _numel(shape: tuple[int, ...]) -> int:
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
    fp32 second moment per vector. SGD without momentum: 0.
    """
    w = 4 if setup.lora else _dtype_bytes(setup)[0]
    shapes = trainable_tensors(setup)
    o = setup.optimizer
    if o in ("adamw", "paged_adamw_32bit"):
        return 2 * w * sum(_numel(s) for s in shapes)
    if o in OPTIMIZERS_8BIT:
        # The Trainer registers every nn.Embedding weight for 32-bit state (bnb
        # GlobalOptimManager override, transformers Trainer.create_optimizer): 8 bytes/param.
        h = setup.model.hidden_size
        embeddings = [] if setup.lora else [(setup.model.vocab_size, h)] + (
            [(setup.model.learned_positions, h)] if setup.model.learned_positions else [])
        total = 2 * 256 * 4
        for s in shapes:
            n = _numel(s)
            if s in embeddings:
                embeddings.remove(s)
                total += 8 * n
                continue
            total += 8 * n if n < 4096 else 2 * n + 2 * 4 * -(-n // 256)
        return total
    if o == "adafactor":
        # factored over the last two dims (transformers Adafactor: exp_avg_sq_row = shape[:-1],
        # exp_avg_sq_col = shape[:-2] + shape[-1:]): 3-D fused MoE experts too
        return sum(4 * (_numel(s[:-1]) + _numel(s[:-2]) * s[-1]) if len(s) >= 2 else 4 * _numel(s)
                   for s in shapes)
    return 0


def optimizer_step_temp_bytes(setup: RunSetup) -> int:
    """Temporaries inside optimizer.step(). Fused AdamW and bitsandbytes update in place (0,
    measured: bench/plan_accuracy.py). transformers' Adafactor works one tensor at a time on
    fp32 copies (grad.float(), update, p.float()): about 8 bytes x the largest tensor for fp32
    params, 16 for 16-bit (measured: bench/plan_accuracy.py)."""
    if setup.optimizer != "adafactor":
        return 0
    largest = max(_numel(s) for s in trainable_tensors(setup))
    return largest * (8 if (setup.lora or _dtype_bytes(setup)[0] == 4) else 16)


# --------------------------------------------------------------------------------------------
# Activations and logits


def _dtypes(setup: RunSetup) -> tuple[int, int, bool]:
    """(r, c, autocast): bytes of the residual stream, of 16/32-bit compute, and whether the
    forward runs under autocast (the Trainer/accelerate wraps forward in autocast whenever
    bf16/fp16 is on, also for 16-bit weights). A quantized base after
    prepare_model_for_kbit_training has fp32 embeddings and norms, so its residual stream is fp32.
    """
    w, c = _dtype_bytes(setup)
    autocast = setup.precision != "fp32"
    r = w
    if setup.quantization != "none" and setup.kbit_prepare:
        r = 4
    return r, c, autocast


def _linear_sources(spec: ModelSpec) -> list[str]:
    """Which tensor feeds each block linear: the attention norm, the attention output, the MLP
    norm, or the MLP activation (same order as block_linears)."""
    out = []
    for lin in block_linears(spec):
        d_in = lin.d_in
        if len(out) < (1 if spec.fused_qkv else 3):
            out.append("norm_attn")
        elif len(out) == (1 if spec.fused_qkv else 3):
            out.append("attn_out")
        elif d_in == spec.intermediate_size:
            out.append("mlp_act")
        else:
            out.append("norm_attn" if spec.parallel_attn else "norm_mlp")
    return out


def _first_layer_grads(setup: RunSetup) -> tuple[bool, bool, bool, bool]:
    """Which parts of decoder layer 0 carry a gradient under LoRA: (attention, residual after
    attention, MLP gate branch, MLP up branch). The embedding is frozen, so autograd records (and
    saves for) nothing upstream of the first adapter: with LoRA on down_proj only, layer 0 saves
    nothing but down_proj's input (measured on a 3-layer Phi-3: the plan was 15% high). Standard
    pre-norm gated blocks only; other layouts count everything (over, never under)."""
    spec = setup.model
    if (not setup.lora or spec.norms_per_layer != 2 or spec.norm_after or spec.parallel_attn
            or spec.mlp != "gated" or spec.resid_dropout):
        return True, True, True, True
    names = {lin.name for lin in _target_linears(setup)}
    lins = block_linears(spec)
    srcs = _linear_sources(spec)
    attn = any(lin.name in names for lin, s in zip(lins, srcs, strict=True) if s == "norm_attn")
    resid = attn or any(lin.name in names for lin, s in zip(lins, srcs, strict=True) if s == "attn_out")
    mlp_in = [lin for lin, s in zip(lins, srcs, strict=True) if s == "norm_mlp"]
    # [gate, up] or [gate_up] (one tensor: both branches)
    gate = resid or mlp_in[0].name in names
    up = resid or mlp_in[-1].name in names
    return attn, resid, gate, up


def _attention_output_copied(spec: ModelSpec) -> bool:
    """Rotary applied by concatenation (Phi-3's apply_rotary_pos_emb: ``cat([rotated, pass])``)
    leaves q contiguous head-major, so SDPA's output is head-major too and
    ``attn_output.transpose(1, 2).contiguous()`` copies it: o_proj reads a new tensor, not SDPA's
    saved output (Llama's rotated q keeps the token-major layout and the call is a no-op).
    Measured with the live-bytes tracker on a CPU: a Phi-3 LoRA run on o_proj was 3.4% above its
    plan without it."""
    return not spec.learned_positions and (spec.model_type == "phi3" or spec.partial_rotary_factor < 1)


def layer_activation_bytes(setup: RunSetup, first: bool = False) -> int:
    """Bytes autograd saves for one decoder layer (no recomputation).

    Counted tensor by tensor from what autograd saves (PyTorch derivatives.yaml saves only what a
    backward needs), checked with saved_tensors_hooks and the live-bytes tracker
    (measured: bench/plan_accuracy.py, bench/plan_fuzz.py). Llama block, t tokens, pure bf16 full
    fine-tuning: t*(20h + 4h_kv + 8I + 4a + 8) at q_dim = h, i.e. the Korthikanti et al. 2022 count
    without dropout; RMSNorm saves its fp32 upcast (4h) and rsqrt (4); SDPA saves q, k, v, out and
    an fp32 logsumexp per head; SwiGLU saves gate, silu(gate), up and their product.
    """
    spec = setup.model
    if spec.is_moe:
        return _moe_layer_activation_bytes(setup, first)
    r, c, autocast = _dtypes(setup)
    t = setup.micro_batch_size * setup.seq_len
    h, i = spec.hidden_size, spec.intermediate_size
    full = not setup.lora
    cc = 2 if autocast else c  # dtype of matmul outputs under autocast
    attn_grad, resid_grad, gate_grad, up_grad = _first_layer_grads(setup) if first else (True,) * 4
    grad_of = {"norm_attn": not first or full, "attn_out": attn_grad, "norm_mlp": resid_grad,
               "mlp_act": gate_grad or up_grad}
    per_tok = _qk_norm_activation_bytes(setup) if attn_grad else 0
    fixed = 0
    # norms: fp32 upcast of the input + rsqrt; a trainable weight also saves the normalized x
    for n in range(spec.norms_per_layer):
        if first and not full and ((n == 0 and not spec.norm_after) or (n == 1 and not resid_grad)):
            continue  # LoRA: no gradient flows into the embedding output (OLMo-2: no norm there)
        per_tok += 4 * h + 4 + (_normed_bytes(setup) * h if full else 0)
    fixed += _norm_weight_fixed_bytes(setup)
    if attn_grad:
        # attention (SDPA / flash): q, k, v, out + fp32 logsumexp per head
        per_tok += cc * (2 * spec.q_dim + 2 * spec.kv_dim) + 4 * spec.num_heads
    if spec.resid_dropout:
        # dropout masks on the attention output and the MLP output: bool from CUDA's fused
        # kernel (native_dropout); on a CPU ATen multiplies by a noise tensor of the input dtype
        per_tok += 2 * h * (1 if setup.device == "cuda" else cc)
    if spec.fused_qkv and not spec.learned_positions and attn_grad:
        # Fused qkv + rotary (Phi-3): q and k are rotated into new tensors, but v stays a view of
        # the fused output, whose whole storage SDPA keeps alive (measured -3% without this)
        per_tok += cc * (spec.q_dim + spec.kv_dim)
    # MLP elementwise: silu saves its input (gate) and the product saves each factor the other
    # branch needs a gradient for: silu(gate) for up's, up for gate's
    e = cc if full else (4 if (setup.quantization != "none" and r == 4) or c == 4 else 2)
    if spec.mlp == "gated":
        per_tok += e * i * (2 * gate_grad + up_grad)  # gate out (silu input), up out; silu out
    else:
        # act input; transformers' gelu_new is composed in Python (NewGELUActivation:
        # 0.5*x*(1+tanh(...))), so autograd also saves the tanh output, 0.5*x and 1+tanh
        per_tok += e * i * (4 if spec.hidden_act in ("gelu_new", "gelu_fast") else 1)
    # o_proj's input as it is (what a Linear saves without a cast): SDPA's saved output, unless
    # that is a copy (Phi-3) or SDPA saved nothing (layer 0 with frozen attention under LoRA)
    attn_out_extra = cc * spec.q_dim if (_attention_output_copied(spec) or not attn_grad) else 0
    targets = {lin for lin in _target_linears(setup)} if setup.lora else set()
    shared: set[str] = set()
    for lin, src in zip(block_linears(spec), _linear_sources(spec), strict=True):
        src_fp32 = src.startswith("norm") and r == 4
        if full:
            if autocast and _dtype_bytes(setup)[0] == 4:
                fixed += 2 * lin.d_in * lin.d_out  # autocast's bf16 weight copy, saved
                if src_fp32 and autocast:
                    per_tok += 2 * lin.d_in  # bf16 cast of the fp32 input, per linear
                elif src not in shared and src in ("mlp_act", "norm_attn", "norm_mlp"):
                    per_tok += cc * lin.d_in
                    shared.add(src)
                elif src == "attn_out":
                    per_tok += attn_out_extra  # a 16-bit input: autocast's cast is a no-op
            elif src not in shared:
                per_tok += attn_out_extra if src == "attn_out" else c * lin.d_in  # one input, shared
                shared.add(src)
        else:
            if autocast and setup.quantization == "none" and _dtype_bytes(setup)[0] == 4:
                fixed += 2 * lin.d_in * lin.d_out  # frozen fp32 base: bf16 copy for grad input
            if lin in targets:
                # no mask where x needs no gradient (layer 0 upstream of every adapter)
                per_tok += _lora_dropout_bytes(setup, lin.d_in, autocast, mask=grad_of[src])
                if autocast:
                    per_tok += 2 * lin.d_in + 2 * setup.lora_r  # peft casts x; lora_A output
                    fixed += 2 * setup.lora_r * (lin.d_in + lin.d_out)  # bf16 adapter copies
                else:
                    if not setup.lora_dropout and src not in shared:
                        # lora_A saves x (shared by the adapters reading it)
                        per_tok += attn_out_extra if src == "attn_out" else c * lin.d_in
                        shared.add(src)
                    per_tok += c * setup.lora_r
    attention = _eager_bytes(setup) + _attention_dropout_bytes(setup) if attn_grad else 0
    return t * per_tok + fixed + attention


def _lora_dropout_layer_bytes(setup: RunSetup) -> tuple[int, int]:
    """(bytes, widest d_in): what lora.dropout adds to one decoder layer's saved tensors
    (_lora_dropout_bytes over its adapted Linears), and the widest adapted input."""
    if not setup.lora or not setup.lora_dropout or setup.model.is_moe:
        return 0, 0
    _, _, autocast = _dtypes(setup)
    t = setup.micro_batch_size * setup.seq_len
    lins = _target_linears(setup)
    return (t * sum(_lora_dropout_bytes(setup, lin.d_in, autocast) for lin in lins),
            max((lin.d_in for lin in lins), default=0))


def _lora_dropout_bytes(setup: RunSetup, d_in: int, autocast: bool, mask: bool = True) -> int:
    """Per token, what lora.dropout > 0 adds to one adapted Linear (peft ``lora.Linear.forward``:
    ``lora_B(lora_A(dropout(x)))`` on x cast to the fp32 adapter dtype; each adapter has its own
    dropout module, so nothing is shared between q, k and v). The dropout keeps its mask: bool
    from CUDA's fused kernel (``native_dropout``), on a CPU a noise tensor of x's dtype (ATen
    ``_dropout``: ``x * noise``, noise saved). Without autocast lora_A saves the dropped fp32
    input itself (instead of x, which several adapters share); under autocast it saves its
    16-bit cast, counted with the adapter either way. No mask where x needs no gradient (the
    first layer's q/k/v under LoRA: autograd records no dropout node). Measured: tests/test_plan_accuracy.py
    dropout cases (a new user's recipe with dropout 0.05 was 40% above the plan before this)."""
    if not setup.lora_dropout:
        return 0
    mask_bytes = (1 if setup.device == "cuda" else 4) if mask else 0
    return d_in * (mask_bytes + (0 if autocast else 4))


def _qk_norm_activation_bytes(setup: RunSetup) -> int:
    """Per token: q_norm and k_norm (RMSNorm, Qwen3 / OLMo-2 / OLMoE) save their fp32 upcast and
    rsqrt, and with trainable weights the normalized input, like the block's norms."""
    spec = setup.model
    if not spec.qk_norm:
        return 0
    r, _, _ = _dtypes(setup)
    width = spec.q_dim + spec.kv_dim
    rows = spec.num_heads + spec.num_kv_heads if spec.qk_norm == "head" else 2
    return 4 * width + 4 * rows + (_normed_bytes(setup) * width if not setup.lora else 0)


def _normed_bytes(setup: RunSetup) -> int:
    """Bytes per element of the normalized x an RMSNorm with a trainable weight saves: the residual
    dtype where the weight multiplies the cast-back x (LlamaRMSNorm), fp32 where it multiplies
    the fp32 x (Gemma3RMSNorm, Olmo2RMSNorm; measured with saved_tensors_hooks)."""
    return 4 if setup.model.norm_weight_fp32 else _dtypes(setup)[0]


def _norm_weight_fixed_bytes(setup: RunSetup) -> int:
    """Gemma3RMSNorm saves its fp32 (1 + weight) for the input gradient, trainable or frozen: 4
    bytes per weight element of one layer's norms and q/k norms (measured with
    saved_tensors_hooks)."""
    spec = setup.model
    if spec.model_type != "gemma3_text":
        return 0
    return 4 * (spec.norms_per_layer * spec.hidden_size + 2 * spec.head_dim)


def _moe_layer_activation_bytes(setup: RunSetup, first: bool) -> int:
    """An MoE layer: its Linears as a dense block (attention, a shared expert) plus the router and
    routed experts (lowvram.plan.moe.routed_activation_bytes)."""
    from dataclasses import replace

    from lowvram.plan.models import dense_view

    spec = setup.model
    dense = layer_activation_bytes(replace(setup, model=dense_view(spec)), first)
    w, c = _dtype_bytes(setup)
    _, _, autocast = _dtypes(setup)
    cc = 2 if autocast else c
    # the router reads the MLP norm's output, which a trainable shared-expert Linear saves already
    shared_saves = bool(spec.shared_expert_intermediate_size) and (
        not setup.lora or any(lin.name in ("gate_proj", "up_proj") for lin in _target_linears(setup)))
    t = setup.micro_batch_size * setup.seq_len
    # transformers' grouped_mm is not autocast-enabled (integrations/moe.py casts the input to
    # the weights' dtype): the routed experts compute in the stored dtype, fp32 under *-mixed;
    # the router is an autocast linear (its saved input is the 16-bit copy).
    return dense + moe.routed_activation_bytes(spec, t, w, w, autocast, setup.lora, setup.lora_r,
                                               setup.lora_targets, shared_saves, router_c=cc)


def _attention_dropout_bytes(setup: RunSetup) -> int:
    """Attention dropout under SDPA: CUDA's flash and memory-efficient kernels drop inside the
    kernel (a random seed is saved, nothing s x s); on a CPU SDPA falls back to its math path
    and keeps the probabilities, the dropout noise and the dropped probabilities in fp32:
    12*a*s^2*b (measured with the simulated step, GPT-2: 12.1-12.5)."""
    spec = setup.model
    if not spec.attn_dropout or setup.attention != "sdpa" or setup.device == "cuda":
        return 0
    return 12 * spec.num_heads * setup.seq_len**2 * setup.micro_batch_size


def _eager_bytes(setup: RunSetup) -> int:
    """Eager attention stores the s x s scores: softmax in fp32 (saved) and its 16-bit copy
    (saved by the matmul with v): (4 + c)*a*s^2*b (Korthikanti et al. 2022 sec. 4.1, with
    transformers' fp32 softmax upcast). In fp32 the cast back is a no-op: the matmul saves the
    softmax output itself, 4*a*s^2*b (a plain fp32 LoRA run was 17% under its plan with 8)."""
    if setup.attention != "eager":
        return 0
    _, c, autocast = _dtypes(setup)
    cc = 2 if autocast else c
    copy = 0 if cc == 4 else cc
    return (4 + copy) * setup.model.num_heads * setup.seq_len**2 * setup.micro_batch_size


def _head_activation_bytes(setup: RunSetup) -> int:
    """Final norm, lm_head input, rotary cos/sin, labels (not the logits: logits_bytes)."""
    spec = setup.model
    r, c, autocast = _dtypes(setup)
    t = setup.micro_batch_size * setup.seq_len
    h = spec.hidden_size
    full = not setup.lora
    per_tok = 4 * h + 4 + (_normed_bytes(setup) * h if full else 0) + 8  # final norm; int64 labels
    # rotary cos and sin, shared by all layers (of a type: Gemma-3 has two tables)
    per_tok += 2 * spec.head_dim * (4 if spec.rotary_fp32 else r) * spec.rotary_tables
    if spec.embd_dropout and full:  # its mask (as above); LoRA: no gradient flows there
        per_tok += h * (1 if setup.device == "cuda" else r)
    if full:
        per_tok += 2 * h if (autocast and r == 4) else c * h
    fixed = 0
    w = _dtype_bytes(setup)[0]
    head_fp32 = w == 4 or (setup.quantization != "none" and setup.kbit_prepare)
    if autocast and head_fp32:
        fixed += 2 * spec.vocab_size * h  # autocast's bf16 copy of lm_head, saved for backward
    return t * per_tok + fixed


def sliding_window_bytes(setup: RunSetup) -> int:
    """What one sliding-window layer (Gemma-3) saves beyond a full-attention one. From
    seq_len >= sliding_window on, transformers builds the sliding mask (masking_utils
    _ignore_causal_mask_sdpa skips it only below the window); with a mask, sdpa_attention_forward
    expands k and v to all heads (use_gqa_in_sdpa: only without a mask) and SDPA saves the
    additive mask it makes from the bool one, b*s*s in the query's dtype, in every such layer
    (measured with saved_tensors_hooks on a 2-layer Gemma-3: q, expanded k and v, out, mask)."""
    spec = setup.model
    if not spec.sliding_layers or setup.seq_len < spec.sliding_window or setup.attention != "sdpa":
        return 0
    _, c, autocast = _dtypes(setup)
    cc = 2 if autocast else c
    t = setup.micro_batch_size * setup.seq_len
    # one kv head: repeat_kv's expand + reshape stays a view (no copy; measured at Gemma-3-1B size)
    expanded = 2 * (spec.q_dim - spec.kv_dim) if spec.num_kv_heads > 1 else 0
    return cc * (t * expanded + setup.micro_batch_size * setup.seq_len**2)


def _checkpointed_mask_bytes(setup: RunSetup) -> int:
    """With checkpointing, the sliding layers' bool mask (b*s*s bytes, one for all of them) is an
    input the checkpoints keep for the recompute (measured: lowvram train on a 2-layer Gemma-3,
    seq 512 x 2, was 2.9% above its plan without it)."""
    if not sliding_window_bytes(setup):
        return 0
    return setup.micro_batch_size * setup.seq_len**2


def activation_bytes(setup: RunSetup) -> int:
    """All layers' saved activations at the start of backward.

    Gradient checkpointing (Chen et al. 2016; transformers checkpoints each decoder layer,
    use_reentrant=False): each layer keeps only its input (r*t*h); at the peak one layer is
    recomputed (its saved tensors alive again).
    """
    spec = setup.model
    r, _, _ = _dtypes(setup)
    t = setup.micro_batch_size * setup.seq_len
    head = _head_activation_bytes(setup)
    if setup.gradient_checkpointing:
        kept = 0 if activation_offloaded(setup) else spec.num_layers  # offloaded: in host RAM
        return kept * r * t * spec.hidden_size + head + _checkpointed_mask_bytes(setup)
    return (layer_activation_bytes(setup, first=True)
            + (spec.num_layers - 1) * layer_activation_bytes(setup) + head
            + spec.sliding_layers * sliding_window_bytes(setup))


def recompute_bytes(setup: RunSetup) -> int:
    """With checkpointing: one layer's recomputed activations and what its backward makes while
    they are alive (layer_backward_bytes): the peak when the logits are small (chunked loss,
    small vocabulary; bench/plan_accuracy.py "checkpointing + chunked" cases)."""
    if not setup.gradient_checkpointing:
        return 0
    return layer_activation_bytes(setup) + layer_backward_bytes(setup) + sliding_window_bytes(setup)


def layer_backward_bytes(setup: RunSetup) -> int:
    """What one decoder layer's backward makes while its saved tensors are alive: the incoming
    and outgoing hidden-state gradients (2 x t*h) and its intermediates' gradients, as a share of
    the layer's activations, measured on CPU (bench/plan_accuracy.py, small-logits cases; the
    share taken is at or above each measurement): full fine-tuning and fp32 0.19-0.22 -> 1/4;
    LoRA over 16-bit weights 0.46-0.47 -> 1/2 (the adapter path's gradients are fp32 beside
    16-bit activations); LoRA under autocast with fp32 weights 0.32-0.38 -> 3/8; full
    fine-tuning under autocast 0.02 -> 1/8 (its activations include the 16-bit weight copies,
    which make no gradients). A 4/8-bit base adds the dequantized weight of its largest linear
    in the compute dtype (bitsandbytes MatMul4Bit dequantizes the whole weight in forward and
    backward; measured with the simulated step: Llama-2-7B QLoRA + checkpointing at seq 256 was
    -1.4% without it, Phi-3-mini -2.7%, now +0.5% / +0.9%)."""
    r, c, autocast = _dtypes(setup)
    t = setup.micro_batch_size * setup.seq_len
    # Eager attention's s x s part has a backward of its own (below); the shares are of the rest.
    eager = _eager_bytes(setup)
    dropout, widest = _lora_dropout_layer_bytes(setup)
    layer = layer_activation_bytes(setup) - eager - dropout
    mixed = autocast and _dtype_bytes(setup)[0] == 4
    if setup.lora and c == 2:
        backward = layer * 3 // 8 if mixed else layer // 2
    else:
        backward = layer // 8 if mixed else layer // 4
    dequant = 0
    if setup.quantization != "none":
        dequant = c * max(lin.numel for lin in block_linears(setup.model))
    # Eager attention: the softmax backward's fp32 gradients beside the saved scores, measured
    # 0.7-2.0 x a*s^2*b beyond them (eager + checkpointing on a 3-layer Llama, b4 s512: LoRA bf16,
    # QLoRA, full bf16, LoRA fp32; two of them in tests/test_plan_accuracy.py); 2 taken.
    scores = 2 * setup.model.num_heads * setup.seq_len**2 * setup.micro_batch_size if eager else 0
    # lora.dropout: its masks and dropped inputs make no gradients of their own (not in the
    # share); the backward multiplies the widest adapter's fp32 input gradient by the mask, one
    # more fp32 t x d_in (measured: a Gemma LoRA run, dropout 0.05 under bf16-mixed with
    # checkpointing, was 3.2% above its plan with the masks inside the share)
    drop_grad = 4 * t * widest if dropout else 0
    return backward + 2 * r * t * setup.model.hidden_size + dequant + scores + drop_grad


def backward_gradient_bytes(setup: RunSetup) -> tuple[int, int]:
    """Trainable gradients that exist when the backward recomputes its first checkpointed layer
    (the last decoder layer: the head's gradients, lm_head and final norm, with a tied embedding's)
    and its last one (the first decoder layer: every gradient but the embedding's and that
    layer's own, except its last linear's, the first its backward makes). Autograd writes each
    .grad as the backward reaches the parameter (PyTorch autograd; measured: the peak of a
    checkpointed full fine-tuning step holds all but the embedding's and most of layer 0's)."""
    total = gradient_bytes(setup)
    spec = setup.model
    layers = max(1, spec.num_layers)
    if setup.lora:  # adapters only inside the decoder layers
        per_layer = total // layers
        return 0, total - per_layer
    w, _ = _dtype_bytes(setup)
    head = w * (lm_head_numel(spec) + norm_numel(spec))
    if spec.tie_word_embeddings:
        head += w * embedding_numel(spec)
    embed = 0 if spec.tie_word_embeddings else w * embedding_numel(spec)
    per_layer = (total - head - embed) // layers
    last_linear = w * block_linears(spec)[-1].numel
    return head, total - embed - per_layer + last_linear


def logits_bytes(setup: RunSetup) -> int:
    """Logits around the loss: transformers upcasts logits to fp32 for cross-entropy
    (ForCausalLMLoss); in its backward the saved log-softmax, the incoming gradient and the
    input gradient coexist, 12*t*V fp32 bytes (memory-model.md "Logits and loss"; measured:
    bench/plan_accuracy.py). Chunked loss (lowvram.train.loss) keeps one chunk of CHUNK_TOKENS
    tokens' logits, plus the gradient of all final hidden states, accumulated chunk by chunk
    next to the current chunk's (2 x t*h in the hidden dtype), and the flat int64 targets
    (measured: bench/plan_accuracy.py; the
    same error as the standard loss, within 2%)."""
    spec = setup.model
    t = setup.micro_batch_size * setup.seq_len
    if setup.loss == "fused":
        return fused_loss_bytes(setup)
    if setup.loss == "chunked" and t > CHUNK_TOKENS:  # one chunk: the same as the standard loss
        r, _, _ = _dtypes(setup)
        return 12 * CHUNK_TOKENS * spec.vocab_size + 2 * r * t * spec.hidden_size + 8 * t
    return 12 * t * spec.vocab_size


def fused_loss_chunk_tokens(setup: RunSetup) -> int:
    """Rows of one logits chunk in Liger Kernel's fused linear cross-entropy
    (liger_kernel/ops/fused_linear_cross_entropy.py, ``fused_linear_cross_entropy_forward``,
    v0.8.2): inc_factor = ceil(V / h), chunk = next_power_of_2(ceil(t / inc_factor)), so that a
    chunk's logits are about as large as the hidden states; at most t."""
    spec = setup.model
    t = setup.micro_batch_size * setup.seq_len
    inc = -(-spec.vocab_size // spec.hidden_size)
    rows = -(-t // inc)
    return min(t, 1 << (rows - 1).bit_length())


def fused_loss_bytes(setup: RunSetup) -> int:
    """Liger Kernel's fused linear cross-entropy (loss: fused; Hsu et al. 2024, arXiv:2410.10989),
    from ``fused_linear_cross_entropy_forward`` (v0.8.2): the forward computes the loss and the
    gradients at once, chunk by chunk, and keeps them for the backward. Alive at its highest:
    ``grad_input`` (zeros_like the hidden states, r*t*h, saved for the backward), one chunk's
    logits in the compute dtype (their gradient is written in place), the chunk's
    ``grad_logits @ weight`` product before it is copied into grad_input (rows*h), the fp32
    ``loss_1d`` (4t), the ``target != ignore_index`` mask (t) and the shifted int64 labels (8t).
    A trainable lm_head (full fine-tuning) adds ``grad_weight`` (zeros_like the weight) and, off
    the fp32-accumulator addmm path (bf16/fp16 weights), ``torch.mm(...).float()``: a V x h
    product in the compute dtype and its fp32 copy. No full logits, ever (the model returns none
    in training: liger's lce_forward skips them when labels are given). From the source, not
    measured (Liger needs a GPU)."""
    spec = setup.model
    t = setup.micro_batch_size * setup.seq_len
    h, v = spec.hidden_size, spec.vocab_size
    r, c, autocast = _dtypes(setup)
    cc = 2 if autocast else c
    rows = fused_loss_chunk_tokens(setup)
    total = r * t * h + cc * rows * v + cc * rows * h + (4 + 1 + 8) * t
    if not setup.lora:
        w, _ = _dtype_bytes(setup)
        total += w * v * h
        if not (w == 4 and cc == 2):  # the addmm path (fp32 grad_weight, 16-bit logits) makes none
            total += cc * v * h + (4 * v * h if cc != 4 else 0)
    return total


# --------------------------------------------------------------------------------------------
# Activation offloading (techniques.activation_offload)


def activation_offloaded(setup: RunSetup) -> bool:
    """Whether the checkpointed layer inputs leave the device: activation_offload with gradient
    checkpointing, on a GPU. On a CPU host RAM is the device memory: transformers' offload path
    (``save_on_cpu`` around the checkpoint) has nowhere to move them (``tensor.cpu()`` of a CPU
    tensor is itself; its pinned variant needs a GPU), so nothing is saved and nothing is
    claimed: the live-bytes tracker would see the same tensors."""
    return setup.activation_offload and setup.gradient_checkpointing and setup.device == "cuda"


def offloaded_layer_input_bytes(setup: RunSetup) -> int:
    """One checkpointed decoder layer's input (r*t*h), the only tensor its checkpoint saves.

    transformers' ``activation_checkpointing_enable(offload=True)`` (modeling_utils
    ``_activation_checkpointing_enable``: ``save_on_cpu(pin_memory=True)`` *around*
    ``torch.utils.checkpoint.checkpoint``): the non-reentrant checkpoint saves the positional
    inputs through ``_NoopSaveInputs`` outside its own saved-tensor hooks, so the outer
    ``save_on_cpu`` packs exactly those into pinned host RAM; everything the layer's forward saves
    goes to the checkpoint's own (inner) hooks and is dropped, as without offload. The layer's
    keyword arguments (rotary cos/sin, masks, position ids) ride in a ``functools.partial``
    (GradientCheckpointingLayer), not through the checkpoint, so they stay on the GPU, counted
    as without offload. In the backward ``unpack_from_cpu`` copies the input back for that
    layer's recompute: one layer's input on the GPU at a time."""
    r, _, _ = _dtypes(setup)
    return r * setup.micro_batch_size * setup.seq_len * setup.model.hidden_size


def activation_offload_host_bytes(setup: RunSetup) -> int:
    """Pinned host RAM of the offloaded layer inputs: every decoder layer's, from its forward to
    its backward (``save_on_cpu`` allocates one pinned tensor per packed input). PyTorch's
    pinned-memory allocator rounds each block up to a power of two and caches it
    (ATen/core/CachingHostAllocator.h ``allocate``: ``PowerOf2Ceil(size)`` below
    ``pinned_max_round_threshold``, unlimited by default), so a 10,429-token Llama-3.1-8B input
    of 81.5 MiB holds 128 MiB."""
    if not activation_offloaded(setup):
        return 0
    size = offloaded_layer_input_bytes(setup)
    return setup.model.num_layers * (1 << (size - 1).bit_length())


# --------------------------------------------------------------------------------------------
# The peak


# --------------------------------------------------------------------------------------------
# DeepSpeed ZeRO: what each engine keeps on the GPU beyond its share of the model states


@dataclass(frozen=True)
class ZeroSettings:
    """The ZeRO settings a lowvram DeepSpeed run trains with, in elements.

    lowvram writes accelerate's DeepSpeed *plugin* keys only (lowvram.train.launch.accelerate_config:
    zero_stage, offload_optimizer_device, offload_param_device); accelerate builds the DeepSpeed
    config from them without any bucket key (accelerate/utils/dataclasses.py,
    DeepSpeedPlugin.__post_init__, the ``config = {...}`` branch without hf_ds_config, v1.15.0
    lines 1302-1318). accelerate fills reduce_bucket_size (h*h), stage3_prefetch_bucket_size
    (0.9*h*h) and stage3_param_persistence_threshold (10*h) from the model's hidden size only for
    keys set to ``"auto"`` (accelerate/accelerator.py, _prepare_deepspeed, lines 2295-2326;
    transformers' HfTrainerDeepSpeedConfig.trainer_config_finalize the same): absent keys are not
    ``auto``, so DeepSpeed's own defaults apply (deepspeed/runtime/zero/config.py,
    DeepSpeedZeroConfig): the values below. :func:`auto_zero_settings` gives what ``auto`` would.
    """

    stage: int
    offload_optimizer: bool
    offload_param: bool
    reduce_bucket_size: int = 500_000_000  # reduce_bucket_size: Field(pp_int(5e8))
    allgather_bucket_size: int = 500_000_000  # allgather_bucket_size: Field(pp_int(5e8))
    prefetch_bucket_size: int = 50_000_000  # stage3_prefetch_bucket_size: Field(pp_int(5e7))
    param_persistence_threshold: int = 100_000  # stage3_param_persistence_threshold: pp_int(1e5)
    max_live_parameters: int = 1_000_000_000  # stage3_max_live_parameters: pp_int(1e9)
    contiguous_gradients: bool = True  # contiguous_gradients: bool = True

    @property
    def overlap_comm(self) -> bool:
        # DeepSpeedZeroConfig.overlap_comm_valid: None -> True for stage 3 only.
        return self.stage == 3


# plan.offload -> (ZeRO stage, offload optimizer, offload params); lowvram.train.launch.BACKENDS
# writes the same (tests/test_plan_memory.py checks that the two agree).
ZERO_OFFLOADS = {
    "optimizer": (2, True, False), "zero2": (2, False, False), "zero2-offload": (2, True, False),
    "zero3": (3, False, False), "zero3-offload": (3, True, True), "full": (3, True, True),
}


def zero_settings(setup: RunSetup) -> ZeroSettings | None:
    """The ZeRO settings of ``setup``'s offload (None: not DeepSpeed)."""
    if setup.offload not in ZERO_OFFLOADS:
        return None
    return ZeroSettings(*ZERO_OFFLOADS[setup.offload])


def auto_zero_settings(setup: RunSetup) -> ZeroSettings | None:
    """What the three hidden-size keys become when a DeepSpeed config sets them to ``auto``
    (accelerate/accelerator.py lines 2322-2326: h*h, int(0.9*h*h), 10*h)."""
    zs = zero_settings(setup)
    if zs is None:
        return None
    h = setup.model.hidden_size
    return replace(zs, reduce_bucket_size=h * h, prefetch_bucket_size=int(0.9 * h * h),
                   param_persistence_threshold=10 * h)


def _zero_element_bytes(setup: RunSetup) -> int:
    """DeepSpeed runs the model in the dtype its bf16/fp16 section enables (accelerate enables it
    from mixed_precision): 2 bytes, 4 for fp32."""
    return 4 if setup.precision == "fp32" else 2


def zero_residency_bytes(setup: RunSetup, zs: ZeroSettings | None = None) -> dict[str, int]:
    """Bytes one DeepSpeed process holds on the GPU beyond its partition of the model states.

    - ``gathered`` (ZeRO-3, with and without offload_param): parameters all-gathered for compute
      stay resident until ``stage3_max_live_parameters`` elements are live (and are not released
      while reused within stage3_max_reuse_distance, 1e9 too): at most that many, at least the
      largest module gathered at once (the embedding, or the untied lm_head)
      (deepspeed/runtime/zero/partitioned_param_coordinator.py; DeepSpeedZeroConfig docs).
    - ``prefetch``: ``stage3_prefetch_bucket_size`` elements fetched ahead of use.
    - ``persistent``: every parameter under ``stage3_param_persistence_threshold`` elements is
      never partitioned (norms, biases, LoRA A matrices of r x d_in), on the GPU whatever the
      offload (DeepSpeedZeroConfig.param_persistence_threshold).
    - ``buckets``: the gradient reduction buffer of ``reduce_bucket_size`` elements in the model
      dtype, allocated whole however few parameters train: ZeRO-3's ``__ipg_bucket_flat_buffer``
      (stage3.py, with contiguous_gradients), ZeRO-1/2's ``ipg_buffer`` made in ``backward()``
      (stage_1_and_2.py; a second one with overlap_comm, off for stage 2). The allgather of
      updated parameters writes in place into the flat partitions in chunks of
      ``allgather_bucket_size`` (deepspeed/runtime/utils.py all_gather_dp_groups; nothing with
      one GPU): no buffer of its own.
    Weights at ``weight_bytes``' average bytes per element (quantized bases included).
    """
    zs = zs or zero_settings(setup)
    out = dict(gathered=0, prefetch=0, persistent=0, buckets=0)
    if zs is None:
        return out
    elt = _zero_element_bytes(setup)
    out["buckets"] = zs.reduce_bucket_size * elt * (2 if zs.overlap_comm and zs.stage < 3 else 1)
    if zs.stage < 3:
        return out
    spec = setup.model
    lora = lora_parameters(setup) if setup.lora else 0
    total = count_parameters(spec) + lora
    per_elt = weight_bytes(setup) / total
    largest = max(spec.vocab_size * spec.hidden_size, *(lin.numel for lin in block_linears(spec)))
    live = min(total, max(zs.max_live_parameters, largest))
    out["gathered"] = int(live * per_elt)
    out["prefetch"] = int(min(zs.prefetch_bucket_size, total - live) * per_elt)
    shapes = trainable_tensors(replace(setup, lora=False))
    small = sum(_numel(s) for s in shapes if _numel(s) < zs.param_persistence_threshold)
    out["persistent"] = small * _dtype_bytes(setup)[0]
    if setup.lora:
        adapters = trainable_tensors(setup)
        out["persistent"] += 4 * sum(_numel(s) for s in adapters if _numel(s) < zs.param_persistence_threshold)
    return out


def zero_optimizer_bytes(setup: RunSetup) -> int:
    """A ZeRO optimizer without optimizer offload: fp32 master partitions of the trainable
    parameters (stage_1_and_2.py ``single_partition_of_fp32_groups``, stage3.py
    ``fp32_partitioned_groups_flat``) plus the wrapped optimizer's state over those fp32
    parameters (before partitioning over N)."""
    master = 4 * trainable_parameters(setup)
    return master + optimizer_bytes(replace(setup, precision="fp32"))


def _shard(setup: RunSetup, weights: int, grads: int, optim: int) -> tuple[int, int, int, int]:
    """Per-GPU model states and the host RAM (bytes per process) of what is offloaded.

    Sharding (ZeRO paper, Rajbhandari et al. 2020): ZeRO-2 and FSDP shard gradients and optimizer
    states over the N ranks, ZeRO-3 and FSDP the weights too. A ZeRO optimizer keeps fp32 master
    partitions (zero_optimizer_bytes).
    DeepSpeed optimizer offload (ZeRO-Offload, Ren et al. 2021, sec. 4.1; DeepSpeed
    stage_1_and_2 keeps ``single_partition_of_fp32_groups`` and their fp32 gradients on the
    offload device, DeepSpeedCPUAdam its fp32 exp_avg/exp_avg_sq): 16 bytes per trainable
    parameter in CPU RAM (fp32 master copy 4 + Adam 8 + fp32 gradient 4), whatever optimizer the
    recipe named (offload_conflict). The gradients leave the GPU through the reduction bucket
    (ZeRO-2: ``ipg_buffer``, then copied into the CPU fp32 partition; ZeRO-3: the partitioned
    gradient buffer is allocated on the offload device, stage3.py ``grad_partitions_flat_buffer``):
    none stay on the GPU beyond the bucket (zero_residency_bytes).
    DeepSpeed parameter offload (ZeRO-3 ``offload_param``): every weight at its 16-bit dtype in
    CPU RAM; the GPU keeps the gathered, prefetched and persistent ones (zero_residency_bytes).
    FSDP2 CPU offload (torch ``CPUOffloadPolicy``): the sharded parameters, their
    gradients and the optimizer states (at the parameters' dtype; the step runs on the CPU) in
    CPU RAM (the GPU keeps the gathered units and one layer's gradients before they move).
    Each rank offloads only its own partition: host RAM per process is 1/N of the total.
    """
    n = max(1, setup.gpus)
    o = setup.offload
    host = 0
    if o in ("zero2", "zero3"):
        optim = zero_optimizer_bytes(setup)
    if o in DEEPSPEED_CPU_OPTIMIZER:
        host += 16 * trainable_parameters(setup)
        optim = 0
        grads = 0  # on the CPU; the reduction bucket: zero_residency_bytes
    if o == "fsdp-offload":
        host += weights + grads + optim
        weights = grads = optim = 0  # the gathered units and layer gradients: sharding_overhead_bytes
    if o in ("zero3-offload", "full"):
        host += weights
        weights = 0
    if o in ("zero2", "zero3", "fsdp"):
        optim //= n
    if o in ("zero2", "zero3", "fsdp"):
        grads //= n
    if o in ("zero3", "fsdp"):
        weights //= n
    return weights, grads, optim, host // n


def root_weight_bytes(setup: RunSetup) -> int:
    """Weights outside the decoder layers (embeddings, final norm, lm_head), at their dtype."""
    spec = setup.model
    w, _ = _dtype_bytes(setup)
    numel = embedding_numel(spec) + norm_numel(spec) + lm_head_numel(spec)
    return numel * (4 if setup.quantization != "none" and setup.kbit_prepare else w)


def layer_weight_bytes(setup: RunSetup) -> int:
    """One decoder layer's weights, quantized storage and LoRA adapters included."""
    return (weight_bytes(setup) - root_weight_bytes(setup)) // max(1, setup.model.num_layers)


def sharding_overhead_bytes(setup: RunSetup) -> tuple[int, int, int]:
    """(weights, layer gradients, gradient buckets) a process holds beyond its share of the
    model states, per engine.

    FSDP2 (torch ``fully_shard`` as accelerate applies it with TRANSFORMER_BASED_WRAP: one unit
    per decoder layer, the root for embeddings, final norm and lm_head) all-gathers a unit's
    parameters into full-size tensors before its forward and backward and frees them after
    (reshard_after_forward); the root is not resharded between forward and backward (FSDP2 docs,
    ``fully_shard``). At the peak: the root's full parameters plus two layers' worth (the
    all-gather output and the parameters copied out of it, or the next layer prefetched). In a
    layer's backward its full-size gradients and the reduce-scatter input (two layers' worth of
    trainable gradients) join them: the peak with gradient checkpointing, whose recompute
    happens inside the backward.
    DDP (torch DistributedDataParallel, gradient_as_bucket_view=False as the Trainer leaves it)
    keeps its gradient buckets, one more copy of the trainable gradients, for the whole run.
    Measured on CPU (2-3 processes over gloo, lowvram.livebytes; bench/multi_process_accuracy.py):
    DDP within 0.8%, FSDP2 without checkpointing +0.5% / +3.5% (full / LoRA); with checkpointing
    the recompute term (recompute_bytes) over-predicts small models by 11-14%.
    DeepSpeed ZeRO (any stage, offloaded or not): zero_residency_bytes, from the engine's
    defaults as lowvram's generated config leaves them (ZeroSettings). Not measured: DeepSpeed
    does not run on the CPU.
    """
    if setup.offload in ("fsdp", "fsdp-offload"):
        layers = max(1, setup.model.num_layers)
        return root_weight_bytes(setup) + 2 * layer_weight_bytes(setup), 2 * gradient_bytes(setup) // layers, 0
    if setup.offload == "none" and setup.gpus > 1:
        return 0, 0, gradient_bytes(setup)
    zero = zero_residency_bytes(setup)
    return zero["gathered"] + zero["prefetch"] + zero["persistent"], 0, zero["buckets"]


def _check(setup: RunSetup) -> None:
    problems = [f"{k} {v!r} (known: {', '.join(opts)})" for k, v, opts in [
        ("precision", setup.precision, PRECISIONS), ("quantization", setup.quantization, QUANTIZATIONS),
        ("optimizer", setup.optimizer, OPTIMIZERS), ("offload", setup.offload, OFFLOADS),
        ("attention", setup.attention, ATTENTIONS),
        ("loss", setup.loss, LOSSES), ("device", setup.device, ("cuda", "cpu")),
    ] if v not in opts]
    if setup.quantization != "none" and not setup.lora:
        problems.append("quantization needs lora")
    if setup.loss == "fused" and setup.device != "cuda":
        problems.append("loss fused needs CUDA (Liger Kernel's Triton kernels); use chunked")
    if setup.activation_offload and not setup.gradient_checkpointing:
        problems.append("activation_offload needs gradient_checkpointing")
    problems += moe.moe_problems(setup.model, setup.lora, setup.lora_r, setup.lora_targets,
                                 setup.lora_dropout)
    conflict = offload_conflict(setup.optimizer, setup.offload)
    if conflict:
        problems.append(conflict)
    if min(setup.micro_batch_size, setup.seq_len, setup.grad_accum, setup.gpus, setup.lora_r) < 1:
        problems.append("micro_batch_size, seq_len, grad_accum, gpus and lora_r must be >= 1")
    if problems:
        raise LowvramError("cannot estimate memory: " + "; ".join(problems),
                           "use the values listed in `lowvram keys`")


validate_setup = _check  # public name: simulate.py validates the same way


def unmodelled(setup: RunSetup) -> str | None:
    """Why the analytic model cannot be trusted for this setup (None when it can): the chooser
    never picks such a setup and refuses when nothing else is allowed (never a silent guess on the
    side that says "fits": lowvram train on the CPU measured these above the plan)."""
    if setup.attention == "eager" and setup.gradient_checkpointing:
        return ("eager attention with gradient checkpointing is not modelled (lowvram train measured "
                "-6% to +21% off the analytic peak: bench/plan_fuzz.py, tests/test_plan_accuracy.py)")
    return None


def _forward_backward_peak(setup: RunSetup, acts: int, logits: int, grads: int,
                           layer_grads: int) -> tuple[int, int, int, int]:
    """(activations, logits, gradients made so far, weights not gathered) at the highest moment
    of forward + backward.

    Candidates: the start of the backward (every saved activation plus the logits; logits_bytes);
    the backward of the last decoder layer and of the first. Going down the layers, saved
    activations (or checkpoints) are freed and gradients made at a fixed rate per layer, so the
    peak is at one end: with long sequences the start, with short ones or checkpointing the
    first layer (nearly every gradient made; backward_gradient_bytes). With gradient
    checkpointing each layer's backward first recomputes it (recompute_bytes). Under autocast
    (*-mixed) with checkpointing the end of the forward also counts: autocast caches a 16-bit
    copy of every trainable fp32 weight it casts until the forward ends (torch autocast
    ``cached_cast``: leaves that require grad; without checkpointing the copies are saved
    activations already). FSDP adds the unsharded gradients of the layers in their backward
    (layer_grads: two layers'); in the first layer's backward there is no next layer to
    prefetch, so one layer's gathered weights and gradients fewer.
    Measured on CPU (bench/plan_accuracy.py, bench/multi_process_accuracy.py, tests).
    """
    spec = setup.model
    layers = max(1, spec.num_layers)
    total = gradient_bytes(setup)
    # This process's share of each gradient (DDP all, FSDP 1/N, offloaded none); with
    # accumulation every gradient exists already (counted as kept gradients).
    share = grads / total if total and setup.grad_accum == 1 else 0.0
    head_g, late_g = backward_gradient_bytes(setup)
    fsdp = setup.offload in ("fsdp", "fsdp-offload")
    not_gathered = layer_weight_bytes(setup) if fsdp else 0  # layer 0: no prefetch
    late_layer_grads = layer_grads // 2 if fsdp else layer_grads
    candidates = [(acts, logits, 0, 0)]
    if spec.tie_word_embeddings and not setup.lora:
        # The very end of the backward, with a tied embedding: every gradient exists (lm_head's
        # in the shared .grad) when the embedding's dense gradient arrives and is accumulated
        # into it: two more V x h tensors (measured: 2.0 x V*h*w; embedding_dense_backward then
        # AccumulateGrad's sum). Peaks at short sequences (Qwen2.5-0.5B full bf16, seq 256:
        # +0.5 GiB, found by bench/simulate_full_size.py-style simulation).
        w, _ = _dtype_bytes(setup)
        candidates.append((0, 0, int(share * total) + 2 * w * embedding_numel(spec), 0))
    if setup.gradient_checkpointing:
        checkpoints = acts - _head_activation_bytes(setup)
        one_layer = checkpoints // layers
        if activation_offloaded(setup):  # only the recomputed layer's input is back on the GPU
            checkpoints = one_layer = checkpoints + offloaded_layer_input_bytes(setup)
        rec = recompute_bytes(setup)
        candidates += [(checkpoints + rec, 0, layer_grads + int(share * head_g), 0),
                       (one_layer + rec, 0, late_layer_grads + int(share * late_g), not_gathered)]
        _, c, autocast = _dtypes(setup)
        if autocast and _dtype_bytes(setup)[0] == 4 and not setup.lora:  # LoRA: frozen, not cached
            cache = c * sum(lin.numel for lin in block_linears(spec)) * spec.num_layers
            candidates.append((acts + cache, logits * 10 // 12, 0, 0))  # forward: no logits gradient
    else:
        first_layer = layer_activation_bytes(setup, first=True)
        candidates.append((first_layer + layer_backward_bytes(setup), 0,
                           late_layer_grads + int(share * late_g), not_gathered))
    return max(candidates, key=lambda cand: cand[0] + cand[1] + cand[2] - cand[3])


def estimate_memory(setup: RunSetup) -> MemoryEstimate:
    """Peak bytes of a steady-state step (optimizer state already allocated)."""
    _check(setup)
    weights, grads, optim, host = _shard(
        setup, weight_bytes(setup), gradient_bytes(setup), optimizer_bytes(setup))
    gathered, layer_grads, buckets = sharding_overhead_bytes(setup)
    acts = activation_bytes(setup)
    logits = logits_bytes(setup)
    kept_grads = grads if setup.grad_accum > 1 else 0  # accumulation keeps grads across micro-steps
    kept_grads += buckets
    live_weights = weights + gathered  # FSDP: shards plus the units gathered for compute
    persistent = weights + optim + kept_grads  # what lives across steps
    fb_acts, fb_logits, made, not_gathered = _forward_backward_peak(setup, acts, logits, grads, layer_grads)
    kept_grads += made
    acts, logits = fb_acts, fb_logits
    live_weights -= not_gathered
    fb = live_weights + optim + kept_grads + acts + logits
    step = weights + optim + grads + buckets + optimizer_step_temp_bytes(setup)
    if fb >= step:
        phase = "forward_backward"
        parts = dict(weights=live_weights, gradients=kept_grads, optimizer=optim, activations=acts,
                     logits=logits)
    else:
        phase = "optimizer_step"
        # step temporaries are working memory of the optimizer: reported under "optimizer"
        parts = dict(weights=weights, gradients=grads + buckets, optimizer=step - weights - grads - buckets,
                     activations=0, logits=0)
    tensors = sum(parts.values())
    if setup.device == "cuda":
        ov = cuda_overheads()
        parts["cuda_context"] = ov.context_bytes
        parts["allocator"] = int(ov.allocator_fraction * tensors)
    else:
        parts["cuda_context"] = 0
        parts["allocator"] = 0
    breakdown = {k: int(parts[k]) for k in BREAKDOWN_KEYS}
    # Host RAM: what is offloaded, plus the process itself (PROCESS_HOST_BYTES) plus one
    # checkpoint shard staged while loading (<= 5 GB, the transformers default max_shard_size).
    process = PROCESS_HOST_BYTES
    host += activation_offload_host_bytes(setup)
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
    "BREAKDOWN_KEYS", "DEEPSPEED_CPU_OPTIMIZER", "activation_offload_host_bytes", "activation_offloaded",
    "offloaded_layer_input_bytes", "fused_loss_bytes", "fused_loss_chunk_tokens", "ZERO_OFFLOADS", "CudaOverheads", "ZeroSettings", "MemoryEstimate", "RunSetup",
    "activation_bytes", "backward_gradient_bytes", "cuda_overheads", "embedding_numel",
    "estimate_memory", "gradient_bytes", "layer_backward_bytes", "lm_head_numel", "logits_bytes",
    "lora_parameters", "offload_conflict", "optimizer_bytes", "quantized_bytes", "recompute_bytes",
    "trainable_tensors", "validate_setup", "weight_bytes", "auto_zero_settings", "zero_optimizer_bytes",
    "zero_residency_bytes", "zero_settings",
]
