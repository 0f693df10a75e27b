"""The memory terms of online RL with generation (training.objective grpo, rloo), read from TRL 1.16.

A step of TRL's GRPOTrainer (trl/trainer/grpo_trainer.py) or RLOOTrainer (rloo_trainer.py) has two
phases, each a set of named moments here (lowvram.plan.memory.moments.MOMENTS):

- **Generation** (``_prepare_inputs`` L1522-1551: once every steps_per_generation x num_iterations
  micro-steps, at the start of a training step, after the previous optimizer step: the weights and
  the optimizer state are alive, and the gradients too when a generation round starts inside an
  accumulation, steps_per_generation < gradient_accumulation). ``_generate_single_turn`` L1763-1891
  runs ``unwrapped_model.generate`` on the generation batch's rows (micro_batch_size x
  steps_per_generation per GPU: the sampler repeats each prompt num_generations times) under
  ``torch.no_grad`` and NO autocast, so the cache and the activations are in the weights' dtype.
  The cache is transformers' DynamicCache (cache_utils.py DynamicLayer.update: ``torch.cat`` of
  each layer's keys and values, so the last token's update holds the layer's old and new tensors):
  2 x layers x rows x kv_heads x head_dim x (prompt + completion) elements
  (:func:`kv_cache_bytes`). Two moments: ``generation_prefill`` (the prompt's forward over rows x
  prompt tokens, one layer's no-grad working tensors beside the cache made so far) and
  ``generation_decode`` (the last token: the whole cache, one layer's keys and values repeated to
  every query head by ``repeat_kv`` (sdpa_attention.py use_gqa_in_sdpa: never with the padding
  mask the left-padded prompts bring) and the sampling logits: ``logits_to_keep=1``
  (generation/utils.py L2955-2959), then an fp32 copy and its softmax, L3251-3278).
  ``paged`` (transformers' continuous batching, ``generate_batch``): the PagedAttentionCache the
  plan sizes (:func:`paged_cache_bytes`; cache.py PagedAttentionCache and
  PagedAttentionMemoryHandler) in place of the DynamicCache. ``vllm``: a second copy of the weights
  and its KV cache inside ``vllm_gpu_memory_utilization`` of the card, held for the whole run
  (:func:`engine_share`).
- **Scoring** (``_generate_and_score_completions`` L2630-2740, under ``torch.no_grad``): the old
  log-probs where generation and optimizer steps do not line up (``gradient_accumulation_steps %
  (steps_per_generation x num_iterations) != 0``; RLOO always, rloo_trainer.py L1598-1610) and the
  reference log-probs where beta > 0 (under LoRA a frozen copy of the adapter TRL adds as "ref",
  ``use_adapter(model, "ref")``;
  else the frozen copy ``ref_model``, L986-1003). Each is a forward of micro_batch_size rows of
  prompt + completion through TRL's fused LM head (``_get_per_token_logps_and_entropies`` L1419-1508,
  ``batch_size = per_device_train_batch_size``): ``scoring_forward``.
- **Training** (``_compute_loss`` L3020-3200): the forward and backward of micro_batch_size rows of
  prompt + completion tokens (padded; an attention mask), scored by the fused, chunked LM head
  (trl/trainer/utils.py add_fused_lm_head L1548-1700, trl/kernels/chunked_logprob.py
  ChunkedLogProbFunction: tiles of at most TOKEN_CHUNK_SIZE 4,096 positions x
  _CHUNKED_LOGPROB_CHUNK_SIZE 32,768 vocabulary columns, ``mm_buf`` allocated at that full width
  whatever the vocabulary). With Triton (CUDA) only the completion positions are projected
  (``hidden_states[mask]``); elsewhere every position (``reshape(-1, h)``). GRPO asks for log-probs
  and entropy (``outputs=("log_probs", "entropy")``, L1068-1073). The policy's activations,
  recompute and gradients are SFT's for those rows (:func:`policy_setup`); the head's terms are
  DPO's (lowvram.plan.memory.preference.fused_head_bytes) over its positions; the loss's per-token fp32
  tensors over the completion (:func:`loss_token_bytes`).

Dropout: GRPOConfig and RLOOConfig leave ``disable_dropout`` False, so lora.dropout stays counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lowvram.plan import constants as fitted
from lowvram.plan.memory import nograd, preference
from lowvram.plan.memory.activations import dtypes
from lowvram.plan.memory.moments import Moment
from lowvram.plan.memory.paged import (
    PAGE_SIZE,
    paged_cache_bytes,
    paged_groups,
    paged_mask_bytes,
    paged_max_batch_tokens,
    paged_num_blocks,
)
from lowvram.plan.memory.states import lora_parameters, weight_bytes
from lowvram.plan.setup import GrpoSetup, RunSetup

GRPO_OBJECTIVES = ("grpo", "rloo")
# grpo.generation: "auto" resolves to "generate" (transformers' generate, the DynamicCache)
ENGINES = ("generate", "paged", "vllm")


@dataclass(frozen=True)
class GrpoRequest:
    """The recipe's grpo section as the planner reads it (PlanRequest.grpo). None = auto."""

    num_generations: int = 8
    prompt_len: int = 512  # grpo.max_prompt_length
    completion_len: int = 256  # grpo.max_completion_length
    generation_batch_size: int | None = None  # global, as TRL's; None: auto (with steps_per_generation)
    steps_per_generation: int | None = None  # None: auto
    num_iterations: int = 1
    beta: float = 0.0
    engine: str = "auto"  # auto | generate | paged | vllm
    vllm_gpu_memory_utilization: float | None = None  # None: the plan computes it
    rloo: bool = False

    @classmethod
    def from_dict(cls, data: dict | None) -> GrpoRequest | None:
        return None if data is None else cls(**data)


def resolved_engine(req: GrpoRequest) -> str:
    """grpo.generation auto: transformers' generate (the DynamicCache), which runs everywhere."""
    return "generate" if req.engine == "auto" else req.engine


def steps_per_generation_options(req: GrpoRequest, micro: int, grad_accum: int, gpus: int) -> list[int]:
    """The micro-steps per generation round the search tries for a micro-batch, largest first.
    Fixed (steps_per_generation, or generation_batch_size / (micro x gpus)): that one, or none
    when it does not divide. Auto: every divisor of the accumulation whose generation batch
    (micro x steps x gpus) holds whole groups of num_generations: a smaller generation batch
    changes the speed, not the algorithm (each optimizer step still sees batch_size completions
    of the same policy: TRL computes no old log-probs when the accumulation is a multiple of
    steps_per_generation x num_iterations), so the search may pick it; num_generations it never
    changes (the group size is the algorithm: GRPO's advantage is relative to its group)."""
    if req.steps_per_generation is not None:
        ks = [req.steps_per_generation]
    elif req.generation_batch_size is not None:
        per = micro * gpus
        ks = [req.generation_batch_size // per] if req.generation_batch_size % per == 0 else []
    else:
        ks = [k for k in range(grad_accum, 0, -1) if grad_accum % k == 0]
    return [k for k in ks if k >= 1 and (micro * k * gpus) % req.num_generations == 0]


def generation_batch_problem(req: GrpoRequest, batch_size: int, gpus: int, micro: int | None) -> tuple[str, str] | None:
    """(message, hint) when no micro-batch of the per-GPU batch gives a generation batch TRL
    takes with ``gpus`` processes, None when one does (``micro``: the recipe's fixed micro-batch;
    None: any divisor of the per-GPU batch, as the search tries them). TRL's rules
    (GRPOConfig.__post_init__ L1098-1135): generation_batch_size = per_device_train_batch_size x
    processes x steps_per_generation, divisible by num_generations; a fixed one divisible by
    per_device_train_batch_size x processes. The processes share each generation batch (the
    sampler gives each prompt's group to every rank, the rewards are gathered)."""
    if batch_size % gpus:
        return None  # validate_request's own error (batch_size is not divisible by the GPUs)
    per_gpu = batch_size // gpus
    micros = [micro] if micro else [m for m in range(per_gpu, 0, -1) if per_gpu % m == 0]
    if any(steps_per_generation_options(req, m, per_gpu // m, gpus) for m in micros if per_gpu % m == 0):
        return None
    shown = f"micro_batch_size {micro}" if micro else f"any micro-batch of its {per_gpu} completions per process"
    m = micro or 1
    whole = math.lcm(m * gpus, req.num_generations)
    if req.generation_batch_size is not None:
        what = f"grpo.generation_batch_size {req.generation_batch_size}"
        rule = (f"it divisible by micro-batch x processes ({m} x {gpus} = {m * gpus}) and by num_generations "
                f"{req.num_generations}")
        hint = f"use a generation_batch_size that is a multiple of {whole}, or leave it auto"
    elif req.steps_per_generation is not None:
        what = f"grpo.steps_per_generation {req.steps_per_generation}"
        rule = (f"micro-batch x {gpus} processes x {req.steps_per_generation} steps (the generation batch) "
                f"divisible by num_generations {req.num_generations}")
        hint = f"use a steps_per_generation that makes that product a multiple of {req.num_generations}, or leave it auto"
    else:
        what = f"training.batch_size {batch_size}"
        rule = (f"a generation batch (micro-batch x {gpus} processes x steps dividing the accumulation) "
                f"divisible by num_generations {req.num_generations}")
        hint = f"use a training.batch_size that is a multiple of {whole}, or fewer processes"
    return f"{what} does not split over {gpus} processes at {shown}: TRL needs {rule}", hint


def grpo_setup(req: GrpoRequest, steps_per_generation: int) -> GrpoSetup:
    return GrpoSetup(num_generations=req.num_generations, prompt_len=req.prompt_len,
                     completion_len=req.completion_len, steps_per_generation=steps_per_generation,
                     num_iterations=req.num_iterations, beta=req.beta, engine=resolved_engine(req), rloo=req.rloo)


def generation_rounds(setup: RunSetup) -> int:
    """Generation rounds per optimizer step (1: TRL's default, one round per accumulation); the
    search ranks plans with fewer rounds first (search.rank): each round decodes max_completion_length
    tokens one after another, whatever its rows, so more rounds cost about that much more time.
    TRL generates once every steps_per_generation x num_iterations micro-steps (grpo_trainer.py
    _prepare_inputs L1538, rloo_trainer.py L1107)."""
    if setup.grpo is None:
        return 0
    return max(1, setup.grad_accum // (setup.grpo.steps_per_generation * setup.grpo.num_iterations))


def grpo_request_problem(req: GrpoRequest, batch_size: int, gpus: int, offload: str | None,
                         attention: str | None = None) -> tuple[str, str] | None:
    """(message, hint) for a grpo request TRL would refuse at start, or lowvram cannot plan;
    None when it plans (GRPOConfig.__post_init__ L1098-1140: the generation batch holds whole
    groups of num_generations, and divides into micro-batches x processes)."""
    if req.num_generations < 2:
        return (f"grpo.num_generations must be at least 2, got {req.num_generations} (the advantage is "
                "relative to the other completions of the same prompt)", "set grpo.num_generations: 2 or more")
    if min(req.prompt_len, req.completion_len, req.num_iterations) < 1:
        return ("grpo.max_prompt_length, max_completion_length and num_iterations must be positive",
                "e.g. grpo.max_completion_length: 256")
    if req.engine not in ("auto", *ENGINES):
        return f"unknown grpo.generation {req.engine!r}", "use auto, generate, paged or vllm"
    if req.steps_per_generation is not None and req.generation_batch_size is not None:
        return ("grpo.generation_batch_size and grpo.steps_per_generation are both set (TRL takes one)",
                "set one of them, or neither (auto)")
    if req.generation_batch_size is not None and req.generation_batch_size % req.num_generations:
        return (f"grpo.generation_batch_size {req.generation_batch_size} is not divisible by num_generations "
                f"{req.num_generations}", f"use a multiple of {req.num_generations}")
    if req.generation_batch_size is None and req.steps_per_generation is None and batch_size % req.num_generations:
        return (f"training.batch_size {batch_size} (completions per step) is not divisible by "
                f"grpo.num_generations {req.num_generations}",
                f"use a batch_size that is a multiple of {req.num_generations}")
    if offload not in (None, "none"):
        return (f"offload {offload} with grpo/rloo is not modelled (DeepSpeed and FSDP gather the weights "
                "for generation)", "use offload none (LoRA or QLoRA for a model too big to train whole)")
    if req.engine == "paged" and attention == "eager":  # held-out seed 905: measured 39.7% above its plan
        return ("grpo.generation paged with attention eager is not modelled: a held-out run measured 39.7% above "
                "its plan (docs/accuracy.md)", "use grpo.generation: generate, or techniques.attention: sdpa")
    return None


PAGED_PRECISION_HINT = "set grpo.generation: generate (or auto), or techniques.mixed_precision: fp32"


def paged_precision_problem(precision: str, lora: bool | None) -> str | None:
    """Why TRL 1.16's paged engine cannot run a 16-bit ``precision`` (None where it can: fp32;
    ``lora`` None: the method is the search's). LoRA's adapters and the master weights of
    ``*-mixed``: TRL's continuous-batching path casts the whole model to the run's 16-bit dtype
    before each generation (grpo_trainer.py _generate_single_turn L1796-1800,
    ``unwrapped_model.to(torch.bfloat16)``), turning those fp32 weights into 16-bit ones for the
    rest of the run. Full fine-tuning in pure bf16/fp16: accelerate's mixed precision wraps the
    model's forward in ``convert_outputs_to_fp32`` (accelerate/utils/operations.py convert_to_fp32:
    anything with a 16-bit ``.dtype`` is taken for a tensor), and the continuous-batching forward
    returns transformers' PagedAttentionCache (continuous_batching/cache.py: ``self.dtype``, the
    model's) in its output (``cache=cache``): ``.float()`` raises inside the generation loop
    (continuous_api.py _run_generation_loop logs it), every request fails and TRL indexes the empty
    result (held-out seed 908: ``IndexError: list index out of range``)."""
    if not precision.startswith(("bf16", "fp16")):
        return None
    def cast(trained: str) -> str:
        return (f"TRL 1.16 casts the whole model to {precision[:4]} before each paged generation (grpo_trainer.py "
                f"_generate_single_turn), which would turn {trained} into 16-bit weights for the rest of the run")

    crash = (f"accelerate's {precision[:4]} output conversion (utils/operations.py convert_to_fp32) calls .float() on "
             "the PagedAttentionCache the paged forward returns, so every generation request fails (TRL 1.16 then "
             "raises IndexError)")
    if lora:
        why = cast("LoRA's fp32 adapters")
    elif precision.endswith("mixed"):
        why = cast("the fp32 master weights" + (" (or LoRA's adapters)" if lora is None else ""))
    elif lora is None:
        why = f"with LoRA, {cast('the fp32 adapters')}; full fine-tuning: {crash}"
    else:
        why = crash
    return f"grpo.generation paged with mixed_precision {precision}: {why}"


def grpo_problems(setup: RunSetup) -> list[str]:
    """What the grpo terms cannot plan (lowvram.plan.memory.memory's checks)."""
    g = setup.grpo
    out = []
    if g.engine not in ENGINES:
        out.append(f"generation {g.engine!r} (known: {', '.join(ENGINES)})")
    if min(g.prompt_len, g.completion_len, g.steps_per_generation, g.num_iterations) < 1 or g.num_generations < 2:
        out.append("max_prompt_length, max_completion_length, steps_per_generation and num_iterations must be "
                   ">= 1, num_generations >= 2")
    elif (generation_rows(setup) * setup.gpus) % g.num_generations:
        out.append(f"generation_batch_size {generation_rows(setup) * setup.gpus} is not divisible by "
                   f"num_generations {g.num_generations}")
    if setup.offload != "none":  # ZeRO/FSDP gather the weights for generation: not modelled
        out.append(f"objective {setup.objective} with offload {setup.offload} is not modelled")
    return out


def is_grpo(setup: RunSetup) -> bool:
    return setup.grpo is not None


def generation_rows(setup: RunSetup) -> int:
    """Rows of one generate call per GPU: micro_batch_size x steps_per_generation (TRL's sampler
    yields generation_batch_size / processes rows, each prompt repeated num_generations times)."""
    return setup.micro_batch_size * setup.grpo.steps_per_generation


def old_logprobs_computed(setup: RunSetup) -> bool:
    """TRL computes the old log-probs in a no-grad pass when generation and optimizer steps do not
    line up (grpo_trainer.py L2642-2646); RLOO always (rloo_trainer.py L1598-1610)."""
    g = setup.grpo
    return g.rloo or setup.grad_accum % (g.steps_per_generation * g.num_iterations) != 0


def grads_at_generation(setup: RunSetup) -> bool:
    """A generation round inside an accumulation starts with the gradients of the micro-steps
    before it alive; one at an optimizer step's first micro-step has none (the Trainer's zero_grad
    sets them to None). TRL generates every steps_per_generation x num_iterations micro-steps
    (grpo_trainer.py L1538), so the rounds start steps only where that is a multiple of the
    accumulation."""
    g = setup.grpo
    return (g.steps_per_generation * g.num_iterations) % setup.grad_accum != 0


def policy_setup(setup: RunSetup) -> RunSetup:
    """The SFT setup of the training forward: micro_batch_size rows of prompt + completion tokens,
    right-padded with an attention mask (SDPA gets a mask in every layer)."""
    g = setup.grpo
    return replace(setup, seq_len=g.prompt_len + g.completion_len, objective="sft", padded=True, grpo=None)


def _positions(setup: RunSetup) -> int:
    """N, the positions the fused head projects: the completions' (CUDA, Triton: only the valid
    labels) or every position's next-token label (elsewhere)."""
    g = setup.grpo
    if setup.device == "cuda":
        return setup.micro_batch_size * g.completion_len
    return setup.micro_batch_size * max(1, g.prompt_len + g.completion_len - 1)


def loss_token_bytes(setup: RunSetup) -> int:
    """The loss's per-token tensors over the completion beside the head (constants.GRPO_LOSS_TOKEN_BYTES
    per completion token: the log-probs and entropy sliced out, the log ratio, its exp and clamp, the
    two surrogate terms, their minimum, the masks; measured with TRL's _compute_loss)."""
    return fitted.GRPO_LOSS_TOKEN_BYTES.value * setup.micro_batch_size * setup.grpo.completion_len


def logprob_bytes(setup: RunSetup) -> int:
    """The training forward's head and loss at the start of the backward (SFT's logits' place)."""
    return preference.fused_head_bytes(setup, _positions(setup)) + loss_token_bytes(setup)


def reference_weight_bytes(setup: RunSetup) -> int:
    """beta > 0 under full fine-tuning: TRL loads a frozen copy (``create_model_from_path``,
    grpo_trainer.py L1003), counted in the policy's dtype. Under LoRA/QLoRA lowvram hands TRL a
    PeftModel, and with beta > 0 TRL adds a frozen "ref" adapter, a copy of the "default" one
    (grpo_trainer.py L478-506, rloo_trainer.py L421: ``model.add_adapter("ref", ...)``, its
    parameters copied), scored with ``use_adapter(model, "ref")``: the adapters once more, fp32
    (measured: in-sample seed 151, OLMo-2 LoRA r16, 2.23 MB at the start of the run)."""
    if setup.grpo.beta <= 0:
        return 0
    if setup.lora:
        return 4 * lora_parameters(setup)
    return weight_bytes(setup)


def kv_cache_bytes(setup: RunSetup, rows: int, tokens: int, windowed: bool = True) -> int:
    """Keys and values of every layer for rows x tokens, in generate's dtypes (the weights' dtype,
    or under a *-mixed full fine-tuning's autocast fp32 keys and 16-bit values:
    nograd.generation_dtypes). A DynamicSlidingWindowLayer keeps at most its window
    (:func:`_cached_tokens`); ``windowed`` False: the prompt's forward, whose cat every layer
    keeps whole (the window is a view of it until the next token)."""
    m = setup.model
    _, _, key, value = nograd.generation_dtypes(setup)
    return rows * m.num_kv_heads * m.head_dim * _cached_tokens(setup, tokens, windowed) * (key + value)


def _sliding_cache_layers(setup: RunSetup) -> int:
    """The layers generate's DynamicCache makes DynamicSlidingWindowLayers (ModelSpec.sliding_cache:
    the sliding ones of a model with both kinds, else every layer)."""
    m = setup.model
    return (m.sliding_layers or m.num_layers) if m.sliding_cache else 0


def _window_tokens(setup: RunSetup, tokens: int) -> int:
    """What one DynamicSlidingWindowLayer holds at a length of ``tokens``: its update cats the new
    token to the last window - 1 and keeps a view of that cat (cache_utils.py L242-247), so at most
    the window (ModelSpec.cache_window; 0: unknown, all of them). Measured: held-out seed 1073
    (Gemma-3, window 128, 64 + 96 tokens): five sliding layers of 128 tokens, three full of 159."""
    w = setup.model.cache_window
    return min(tokens, w) if w else tokens


def _cached_tokens(setup: RunSetup, tokens: int, windowed: bool = True) -> int:
    """Layer-tokens of generate's DynamicCache at a length of ``tokens``, summed over the layers."""
    m = setup.model
    sliding = _sliding_cache_layers(setup) if windowed else 0
    return (m.num_layers - sliding) * tokens + sliding * _window_tokens(setup, tokens)


def sampling_bytes(setup: RunSetup, rows: int) -> int:
    """The last position's logits (lm_head's dtype), their fp32 copy and the softmax."""
    v = setup.model.vocab_size
    return rows * v * (nograd.generation_dtypes(setup)[1] + 4 + 4)


def generation_moments(setup: RunSetup) -> list[Moment]:
    """The generation phase's moments, bytes beside the weights, the optimizer state and the
    gradients (gradients: the caller's, grads_at_generation). The batch's token buffers (prompt
    and completion ids and masks, int64) are alive through the whole round."""
    g = setup.grpo
    rows = generation_rows(setup)
    p, c = g.prompt_len, g.completion_len
    buffers = 8 * 2 * rows * (p + c)
    if g.engine == "vllm":  # vLLM's share is held for the whole run (engine_share), not here
        return [Moment("generation_decode", buffers)]
    m = setup.model
    if g.engine == "paged":
        # the cache and the static attention mask, allocated once for the round; the last
        # token's attention reads one layer's keys and values of every row out of the pages
        static = paged_cache_bytes(setup) + paged_mask_bytes(setup)
        gathered = kv_cache_bytes(setup, rows, p + c, windowed=False) // m.num_layers
        prefill = Moment("generation_prefill", buffers + static + nograd.layer_bytes(setup, rows, p, p)
                         + sampling_bytes(setup, rows))
        return [prefill, Moment("generation_decode", buffers + static + nograd.layer_bytes(setup, rows, 1, p + c, gathered)
                                + sampling_bytes(setup, rows))]
    # the last token's cat: one layer's old and new keys at once (then its values, no larger);
    # a DynamicSlidingWindowLayer cats the values with the old keys still held (ModelSpec.sliding_cache,
    # transformers cache_utils.py L242-247): its old keys and values at once, at most its window
    _, _, key, value = nograd.generation_dtypes(setup)
    sliding = _sliding_cache_layers(setup)
    old = max((p + c) * key if sliding < m.num_layers else 0,
              _window_tokens(setup, p + c) * (key + value) if sliding else 0)
    one_layer_key = rows * m.num_kv_heads * m.head_dim * old
    prefill = Moment("generation_prefill", buffers + kv_cache_bytes(setup, rows, p, windowed=False)
                     + nograd.layer_bytes(setup, rows, p, p), sampling_bytes(setup, rows))
    decode = Moment("generation_decode", buffers + kv_cache_bytes(setup, rows, p + c)
                    + nograd.layer_bytes(setup, rows, 1, p + c, one_layer_key), sampling_bytes(setup, rows))
    return [prefill, decode]


def scoring_moment(setup: RunSetup) -> Moment | None:
    """The no-grad log-prob forward of micro_batch_size rows (old log-probs, reference log-probs),
    after generation (the cache freed): its layer's working tensors, the last hidden states and
    their flattened copy, the fused head's forward tiles; None when TRL runs neither."""
    g = setup.grpo
    if not (g.beta > 0 or old_logprobs_computed(setup)):
        return None
    rows = generation_rows(setup)
    b, s = setup.micro_batch_size, g.prompt_len + g.completion_len
    r, _, _ = dtypes(setup)
    n = _positions(setup)
    mm_buf, tile = preference.tile_bytes(setup, n)
    head = 2 * r * b * s * setup.model.hidden_size + mm_buf + int(preference.CPU_FORWARD_TILES * tile)
    buffers = 8 * 2 * rows * s + 4 * 2 * rows * g.completion_len  # ids, masks; the log-probs kept
    return Moment("scoring_forward", buffers + max(head, nograd.layer_bytes(setup, b, s, s)))


def engine_share(setup: RunSetup) -> int:
    """vllm colocated: the bytes its share must hold, a second copy of the weights (16-bit) and
    the generation batch's KV cache (vLLM pages, counted as the paged cache); 0 for the others."""
    if setup.grpo.engine != "vllm":
        return 0
    w16 = replace(setup, precision="bf16", quantization="none", lora=False)
    return weight_bytes(w16) + paged_cache_bytes(replace(setup, precision="bf16"))


def generation_fields(setup: RunSetup, est, budget, req: GrpoRequest | None) -> dict:
    """The Plan's generation fields (types.Plan) for a grpo/rloo setup; {} otherwise. The engine's
    share: paged, the cache the plan sized for the whole generation batch (its blocks go to
    ContinuousBatchingConfig.num_blocks, so transformers does not size it from the free memory);
    vllm, what is left of the budget beside the training peak, plus the need the peak counted
    (engine_share), as a fraction of the card (vllm_gpu_memory_utilization), unless the recipe
    fixed it."""
    if setup.grpo is None:
        return {}
    g = setup.grpo
    out = {"generation": g.engine, "steps_per_generation": g.steps_per_generation,
           "generation_batch_size": generation_rows(setup) * setup.gpus}
    if g.engine == "paged":
        out["paged_num_blocks"] = paged_num_blocks(setup)
        out["paged_max_batch_tokens"] = paged_max_batch_tokens(setup)
        out["generation_cache_bytes"] = paged_cache_bytes(setup)
    elif g.engine == "generate":  # its largest: after the prompt's forward, or at the last token
        rows = generation_rows(setup)
        out["generation_cache_bytes"] = max(kv_cache_bytes(setup, rows, g.prompt_len, windowed=False),
                                            kv_cache_bytes(setup, rows, g.prompt_len + g.completion_len))
    else:
        need = engine_share(setup)
        share = need + max(0, budget.usable_bytes - est.peak_bytes)
        fixed = req.vllm_gpu_memory_utilization if req is not None else None
        out["vllm_gpu_memory_utilization"] = fixed if fixed is not None else round(
            min(0.95, share / budget.vram_bytes) if budget.vram_bytes else 0.0, 3)
        out["generation_cache_bytes"] = need
    return out


__all__ = [
    "engine_share", "ENGINES", "generation_fields", "generation_moments", "generation_rows", "grads_at_generation", "GRPO_OBJECTIVES",
    "generation_batch_problem", "generation_rounds", "grpo_problems", "grpo_request_problem", "grpo_setup", "GrpoRequest", "GrpoSetup", "is_grpo", "kv_cache_bytes", "logprob_bytes", "loss_token_bytes", "old_logprobs_computed",
    "paged_cache_bytes", "paged_groups", "paged_mask_bytes", "PAGED_PRECISION_HINT", "paged_precision_problem", "paged_max_batch_tokens", "paged_num_blocks", "PAGE_SIZE", "policy_setup", "reference_weight_bytes", "resolved_engine",
    "steps_per_generation_options",
    "sampling_bytes", "scoring_moment",
]
