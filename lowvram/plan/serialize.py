"""A Choice as plain data for `lowvram plan --json` and the report (bytes; report.py formats)."""

from __future__ import annotations

from lowvram.plan.choose.request import Choice
from lowvram.plan.choose.search import describe_setup, technique_words
from lowvram.plan.memory.calibration import term_checks
from lowvram.plan.memory.grpo import (
    PAGE_SIZE,
    generation_rounds,
    generation_rows,
    old_logprobs_computed,
)
from lowvram.plan.memory.image_moment import vision_moment
from lowvram.plan.memory.memory import phase_estimates
from lowvram.plan.memory.preference import REFERENCE_OBJECTIVES
from lowvram.plan.memory.states import cross_attention_weight_bytes, vision_weight_bytes
from lowvram.plan.model.image_size import patches_per_image, pixel_limits, pixel_values_bytes
from lowvram.plan.model.models import cross_attention_numel, vision_numel
from lowvram.plan.model.vision import QWEN_VL_TOWERS
from lowvram.plan.setup import MemoryEstimate, RunSetup, cuda_overheads

# --------------------------------------------------------------------------------------------
# Plain data for `lowvram plan --json` and the report (bytes; report.py formats)


def _setup_techniques(s: RunSetup) -> dict:
    return {
        "mixed_precision": s.precision, "gradient_checkpointing": s.gradient_checkpointing,
        "gradient_accumulation": s.grad_accum, "lora": s.lora, "quantization": s.quantization,
        "optimizer": s.optimizer, "offload": s.offload, "activation_offload": s.activation_offload,
        "tiled_mlp": s.tiled_mlp, "attention": s.attention, "loss": s.loss,
    }


def choice_to_dict(choice: Choice) -> dict:
    c, b, req = choice.chosen, choice.budget, choice.request
    est = c.estimate
    return {
        "model": req.model.name,
        "parameters": est.parameters,
        "trainable_parameters": est.trainable_parameters,
        "device": b.device,
        "vram_bytes": b.vram_bytes,
        "vram_source": b.source,
        "host_ram_bytes": b.host_ram_bytes,  # what the plan may use in host RAM (None: not checked)
        "host_ram_source": b.host_ram_source,
        "safety_margin_bytes": b.safety_margin_bytes,
        "budget_bytes": b.usable_bytes,
        "fits": choice.fits,
        "peak_bytes": est.peak_bytes,
        "headroom_bytes": b.usable_bytes - est.peak_bytes,
        "peak_phase": est.peak_phase,
        "peak_moment": est.peak_moment,  # lowvram.plan.memory.moments.MOMENTS, or "optimizer_step"
        "breakdown": dict(est.breakdown),
        "checked": term_checks(c.setup),  # what each part was checked against (plan.calibration)
        "techniques": _setup_techniques(c.setup),
        "seq_len": req.seq_len,
        "packing": req.packing,
        # format image_chat: the images per row the plan counts (lowvram.plan.memory.images); absent for text
        **({"images_per_row": req.images_per_row} if req.images_per_row else {}),
        "batch_size": req.batch_size,
        "micro_batch_size": c.setup.micro_batch_size,
        "grad_accum": c.setup.grad_accum,
        "gpus": c.setup.gpus,
        "lora_r": c.setup.lora_r if c.setup.lora else None,
        "lora_targets": list(c.setup.lora_targets) if c.setup.lora else None,
        "cpu_ram_bytes": est.cpu_ram_bytes,
        "relative_step_time": round(c.slowdown, 3),
        "reasons": dict(choice.plan.reasons),
        "max_seq_len": choice.max_seq_len,
        "max_micro_batch_size": choice.max_micro_batch_size,
        "longest_seq_len": choice.longest[0],
        "longest_seq_len_plan": describe_setup(choice.longest[1]) if choice.longest[1] else None,
        "largest_micro_batch_size": choice.largest_micro[0],
        "largest_micro_batch_plan": describe_setup(choice.largest_micro[1]) if choice.largest_micro[1] else None,
        "min_vram_bytes": choice.min_vram_bytes,
        "suggestion": choice.suggestion,
        "suggestions": list(choice.suggestions),
        "alternatives": [
            {
                "techniques": _setup_techniques(a.setup),
                "micro_batch_size": a.setup.micro_batch_size,
                "grad_accum": a.setup.grad_accum,
                "peak_bytes": a.peak_bytes,
                "fits": a.fits,
                # > 1: faster than the chosen plan; < 1: slower (techniques.py factors).
                "relative_speed": round(c.slowdown / a.slowdown, 3),
            }
            for a in choice.alternatives
        ],
        "ladder": [
            {
                "technique": r.technique, "value": r.value, "peak_bytes": r.peak_bytes,
                "saved_bytes": r.saved_bytes, "slowdown": round(r.slowdown, 3), "fits": r.fits,
                "fixed": r.fixed, "host_ram_bytes": r.host_ram_bytes,
            }
            for r in choice.ladder
        ],
        "notes": list(choice.notes),
        # a multimodal checkpoint's vision tower (lowvram.plan.model.vision); absent for a text model
        **({"vision": _vision(c.setup, req)} if req.model.vision is not None else {}),
        # data.max_pixels auto (plan/choose/pixels.py): the size chosen, the processor's own, what it costs
        **({"max_pixels_auto": dict(choice.max_pixels_auto)} if choice.max_pixels_auto else {}),
        # the allocator term's named parts (setup.CudaOverheads); absent off CUDA
        **({"allocator": _allocator(c.setup, est)} if est.allocator_parts else {}),
        # training.objective dpo/orpo/simpo (lowvram.plan.memory.preference); absent for SFT
        **({"objective": req.objective, "reference_model": _reference(c.setup)} if req.objective != "sft" else {}),
        # training.objective grpo/rloo: both phases, the engine and its share (lowvram.plan.memory.grpo)
        **({"grpo": _grpo(choice)} if c.setup.grpo is not None else {}),
    }


def _vision(s: RunSetup, req) -> dict:
    """The vision tower and projector as loaded: frozen, in the weights (states.vision_weight_bytes);
    with images, the largest image the plan sizes for and its vision_encoder_forward moment."""
    v = s.model.vision
    min_pixels, max_pixels = (pixel_limits(v, req.max_pixels, req.min_pixels) if v.tower in QWEN_VL_TOWERS
                              else (None, None))
    out = {"tower": v.tower, "projector": v.projector, "layers": v.num_layers + v.global_layers,
           "parameters": vision_numel(s.model), "weight_bytes": vision_weight_bytes(s),
           "trainable": False, "tokens_per_image": v.tokens_per_image,
           "quantized": False}
    if s.images_per_row:  # format image_chat: the largest image the plan sizes for (plan/model/image_size.py)
        out["image"] = {"tokens_per_image": v.tokens_per_image, "patches_per_image": patches_per_image(v),
                        "max_pixels": max_pixels, "min_pixels": min_pixels,
                        "pixel_values_bytes": pixel_values_bytes(v),
                        "encoder_forward_bytes": vision_moment(s).bytes}
    if s.model.cross_attention_layers:  # Mllama: loaded, frozen, skipped on text (models.ModelSpec)
        out["cross_attention"] = {"layers": len(s.model.cross_attention_layers),
                                  "parameters": cross_attention_numel(s.model),
                                  "weight_bytes": cross_attention_weight_bytes(s),
                                  "quantized": s.quantization != "none",
                                  # image data: the cross layers run and train (plan/memory/cross_attention.py)
                                  **({"trained": True} if s.images_per_row else {})}
    return out


def _allocator(s: RunSetup, est: MemoryEstimate) -> dict:
    """The allocator slack's two parts, the bytes and share each is taken on, and where the
    shares come from (constants.ALLOCATOR_*; docs/constants.md)."""
    ov = cuda_overheads()
    churn = ov.churn_fraction_expandable if s.expandable_segments else ov.churn_fraction
    tensors = est.peak_bytes - est.breakdown["cuda_context"] - est.breakdown["allocator"]
    return {
        "expandable_segments": s.expandable_segments,
        "parts": dict(est.allocator_parts),
        "on_bytes": {"loaded_once": est.allocated_once_bytes, "churn": tensors - est.allocated_once_bytes},
        "fractions": {"loaded_once": ov.once_fraction, "churn": churn},
        "source": ("published pairs of reserved and allocated bytes (bench/gpu_truth/allocator_pairs.yaml, "
                   "fms_acceleration.yaml; constants ALLOCATOR_ONCE_FRACTION, ALLOCATOR_CHURN_FRACTION"
                   + ("_EXPANDABLE" if s.expandable_segments else "") + ")"),
    }


def _grpo(choice: Choice) -> dict:
    """A grpo/rloo plan's generation side: the settings, each phase's peak and binding moment, the
    engine's share and why, and which knob the search may lower (speed) or never does (the algorithm)."""
    s, plan = choice.chosen.setup, choice.plan
    g = s.grpo
    phases = {name: {"peak_bytes": e.peak_bytes, "moment": e.peak_moment, "breakdown": dict(e.breakdown)}
              for name, e in phase_estimates(s).items()}
    binds = max(phases, key=lambda p: phases[p]["peak_bytes"])
    other = min(phases, key=lambda p: phases[p]["peak_bytes"])
    rows = generation_rows(s)
    share = {"engine": g.engine, "bytes": plan.generation_cache_bytes}
    if g.engine == "generate":
        share["reason"] = (f"transformers' DynamicCache grows to {rows} rows x {g.prompt_len + g.completion_len} "
                           "tokens during each round and is freed after it; nothing is reserved")
    elif g.engine == "paged":
        share["paged_num_blocks"] = plan.paged_num_blocks
        share["reason"] = (f"{plan.paged_num_blocks} blocks of {PAGE_SIZE} tokens: every row of the generation batch "
                           "its whole prompt + completion at once (transformers would otherwise size the cache "
                           "from 80-90% of the free memory)")
    else:
        share["vllm_gpu_memory_utilization"] = plan.vllm_gpu_memory_utilization
        share["reason"] = ("vLLM's copy of the weights and the generation batch's KV cache, plus what the "
                           "budget leaves beside the training peak, as a fraction of the card")
    return {
        "num_generations": g.num_generations, "max_prompt_length": g.prompt_len,
        "max_completion_length": g.completion_len, "generation_batch_size": rows * s.gpus,
        "steps_per_generation": g.steps_per_generation, "generation_rounds_per_step": generation_rounds(s),
        "num_iterations": g.num_iterations, "beta": g.beta, "generation": g.engine,
        "old_logprobs": old_logprobs_computed(s),
        "reference": ("none (beta 0)" if g.beta <= 0 else "a frozen copy of the adapter (TRL's \"ref\" adapter)" if s.lora
                      else "a frozen copy of the weights"),
        "phases": phases, "binds": binds, "other_phase_below_bytes": phases[binds]["peak_bytes"] - phases[other]["peak_bytes"],
        "engine_share": share,
        "knobs": {"generation_batch_size": "speed only: the search lowers it before anything that gives up more "
                                           "(more generation rounds per step, the same algorithm)",
                  "num_generations": "the algorithm: the group each advantage is relative to; never lowered by "
                                     "the search (lower it yourself if nothing fits)"},
    }


def _reference(s: RunSetup) -> str:
    """How DPO's or KTO's reference model is held (lowvram.plan.memory.preference.reference_weight_bytes)."""
    if s.objective not in REFERENCE_OBJECTIVES:
        return "none"
    if s.precompute_ref:
        return "precomputed log-probs"
    return "the policy with its adapter disabled" if s.lora else "a frozen copy of the weights"


def context_table_to_dict(req, rows, budget=None) -> dict:
    """`lowvram plan --context-table --json`: the request in words and one row per card
    (``budget``: one of the cards', for the host RAM the table was planned with)."""
    cards_host_ram = budget.host_ram_bytes if budget else None
    host_source = budget.host_ram_source if budget else ""
    return {
        "model": req.model.name, "lora_r": req.lora_r if req.lora is not False else None,
        "max_position_embeddings": req.model.max_position_embeddings,
        "host_ram_bytes": cards_host_ram,
        "host_ram_source": host_source,
        "rows": [{"card": r.card, "budget_bytes": r.usable_bytes, "longest_seq_len": r.longest,
                  "plan": describe_setup(r.setup) if r.setup else None,
                  "techniques_used": (", ".join(technique_words(r.setup)) or "nothing") if r.setup else None,
                  "techniques": _setup_techniques(r.setup) if r.setup else None,
                  "peak_bytes": r.peak_bytes, "host_ram_bytes": r.host_ram_bytes, "binds": r.binds or None,
                  "beyond_positions": r.beyond_positions}
                 for r in rows],
    }


__all__ = [
    "choice_to_dict", "context_table_to_dict",
]

