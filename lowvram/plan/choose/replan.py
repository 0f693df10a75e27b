"""What a run asks the planner once it is under way: the peak at another sequence length, and the
next cheaper plan after out of memory. Built from the run's PlanRequest (lowvram.planning makes it
from the recipe) and handed to train/, which imports nothing from planning; the request's JSON form
lets a launched rank rebuild it from the run folder without the recipe or the model's files."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from lowvram.plan.choose.request import PlanRequest
from lowvram.plan.memory.grpo import GrpoRequest, grpo_setup
from lowvram.plan.model.image_size import sized_model
from lowvram.plan.model.models import spec_from_dict
from lowvram.plan.types import Plan


@dataclass(frozen=True)
class Replanner:
    """The run's request, asked again. ``request`` None: the model could not be read, so neither
    the peak nor a cheaper plan can be predicted."""

    request: PlanRequest | None = None

    def peak_at(self, plan: Plan, seq_len: int) -> int | None:
        """The plan's peak if every batch were ``seq_len`` tokens long.

        Batches are padded to their longest row, not to ``training.seq_len``: on data shorter than
        seq_len the run peaks at the longest batch it meets, which this predicts."""
        breakdown = self.breakdown_at(plan, seq_len)
        return None if breakdown is None else sum(breakdown.values())

    def breakdown_at(self, plan: Plan, seq_len: int, packing: bool | None = None) -> dict[str, int] | None:
        """The parts of :meth:`peak_at` (the plan's breakdown keys, summing to it). ``packing``:
        whether windows hold several samples (None: as the request, i.e. data.packing). grpo/rloo:
        ``seq_len`` is the row, the prompt + max_completion_length."""
        from lowvram.plan.memory.memory import estimate_memory
        from lowvram.plan.setup import RunSetup

        if self.request is None:
            return None
        grpo = self.request.grpo
        if grpo is not None:  # grpo/rloo: the row is the prompt (padded to the longest) + max_completion_length
            grpo = replace(grpo, prompt_len=max(1, seq_len - grpo.completion_len))
        model = self.request.model
        if plan.max_pixels is not None:  # data.max_pixels auto: the images at the size the plan chose
            model = sized_model(model, plan.max_pixels, self.request.min_pixels, self.request.image_tokens)
        setup = RunSetup(
            model=model, precision=plan.mixed_precision, quantization=plan.quantization,
            lora=plan.lora, lora_r=plan.lora_r, lora_targets=plan.lora_targets, lora_dropout=plan.lora_dropout,
            lora_use_dora=plan.lora_use_dora, lora_init=plan.lora_init, galore_rank=plan.galore_rank,
            optimizer=plan.optimizer, gradient_checkpointing=plan.gradient_checkpointing,
            attention=plan.attention, loss=plan.loss, micro_batch_size=plan.micro_batch_size,
            seq_len=seq_len, grad_accum=plan.grad_accum, gpus=plan.gpus, offload=plan.offload,
            device=plan.device, expandable_segments=plan.expandable_segments, activation_offload=plan.activation_offload, packing=self.request.packing if packing is None else packing,
            images_per_row=self.request.images_per_row,
            tiled_mlp=plan.tiled_mlp, tiled_mlp_shards=plan.tiled_mlp_shards,
            loss_chunk_tokens=plan.loss_chunk_tokens, objective=self.request.objective, precompute_ref=self.request.precompute_ref,
            grpo=grpo_setup(grpo, plan.steps_per_generation) if grpo else None,
        )
        return dict(estimate_memory(setup).breakdown)

    def next_cheaper(self, plan: Plan, measured_peak_bytes: int | None) -> Plan | None:
        """The plan to retry with after ``plan`` ran out of memory (the same request: the recipe's
        fixed techniques stay fixed, the effective batch is kept); None when nothing is cheaper."""
        from lowvram.plan.choose.choose import next_cheaper

        if self.request is None:
            return None
        req = replace(self.request, gpus=plan.gpus) if plan.gpus > 1 else self.request
        return next_cheaper(plan, req, measured_peak_bytes)

    def to_dict(self) -> dict | None:
        """The request as JSON-ready data (None without one)."""
        return None if self.request is None else asdict(self.request)

    @classmethod
    def from_dict(cls, data: dict | None) -> Replanner:
        if data is None:
            return cls()
        data = dict(data)
        model = spec_from_dict(data.pop("model"))
        data["lora_targets"] = tuple(data["lora_targets"])
        data["grpo"] = GrpoRequest.from_dict(data.get("grpo"))
        return cls(PlanRequest(model=model, **data))
