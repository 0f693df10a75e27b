"""The recipe's memory techniques: the techniques section (each auto, on, off or a value; the
rules between them checked when the recipe loads) and the settings of the LoRA adapters and of
GaLore's optimizer.

No torch here: ``lowvram validate`` must be instant.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from lowvram.plan.setup import activation_offload_conflict, quantization_conflict
from lowvram.recipe.sections import OnOffAuto, Section
from lowvram.vocab import (
    ANY_OPTIMIZER,
    ATTENTIONS,
    LOSSES,
    OFF_VALUES,
    OFFLOADS,
    ON_OFF_WORDS,
    ON_VALUES,
    OPTIMIZERS,
    PRECISIONS,
    QUANTIZATIONS,
    SWITCH,
    on_off,
)

MixedPrecision = Literal[(*SWITCH, *PRECISIONS)]
Quantization = Literal[(*SWITCH, *(q for q in QUANTIZATIONS if q != "none"))]
Optimizer = Literal[(*SWITCH, ANY_OPTIMIZER, *OPTIMIZERS)]
Offload = Literal[(*SWITCH, *(o for o in OFFLOADS if o != "none"))]
Attention = Literal[("auto", *ATTENTIONS)]
Loss = Literal[("auto", *LOSSES)]


class LoraSection(Section):
    r: int = Field(16, gt=0, le=4096, description="Adapter rank.")
    alpha: int = Field(32, gt=0, description="Scaling numerator (scale = alpha / r).")
    dropout: float = Field(
        0.0, ge=0, lt=1,
        description="Dropout on the adapter input (0 = off, torchtune's default). > 0 keeps a dropped "
                    "copy of each adapted layer's input and its mask: +30-45% activation memory.")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear", description="Module names to adapt (e.g. [q_proj, v_proj]) or all-linear."
    )
    use_dora: bool = Field(
        False,
        description="DoRA (peft use_dora): a trained magnitude per output row; each adapted layer forms "
                    "its dense weight + B@A in every forward to take its norm (planned; slower, more memory). "
                    "Not on fused MoE experts.")
    use_rslora: bool = Field(
        False, description="rsLoRA (peft use_rslora): scale = alpha / sqrt(r) instead of alpha / r; no memory change.")
    init: str = Field(
        "default",
        description="Adapter initialisation (peft init_lora_weights): default (A Kaiming-uniform, B zeros), "
                    "gaussian (A normal, B zeros), pissa (PiSSA: A and B from the top r singular vectors of each "
                    "weight, which becomes the residual; one full SVD per adapted Linear at start, planned as the "
                    "lora_init moment) or pissa_niter_N (a randomised SVD with N iterations: much faster). "
                    "PiSSA needs a 16/32-bit base on one GPU (not QLoRA, DoRA, offload or several GPUs).")

    @field_validator("init")
    @classmethod
    def _known_init(cls, v: str) -> str:
        from lowvram.plan.memory.lora_init import init_name_problem

        if problem := init_name_problem(v):
            raise ValueError(problem)
        return v


class GaloreSection(Section):
    """optimizer galore_adamw's settings (transformers passes them as optim_args)."""

    rank: int = Field(128, gt=0, le=65536, description="GaLore projection rank: the optimizer state of each "
                      "decoder Linear is 2 x rank x its longer side (lower: less memory, further from AdamW).")
    update_proj_gap: int = Field(200, gt=0, description="Steps between projector renewals (an SVD of each "
                                 "projected gradient).")
    scale: float = Field(0.25, gt=0, description="GaLore's update scale (alpha).")



class TechniquesSection(Section):
    """Each technique is auto (the planner decides), on/off, or a value."""

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_booleans(cls, v: object, info: ValidationInfo) -> object:
        # true/false, and the YAML 1.1 words yes/no/y/n, mean on/off here.
        if v == "none" and info.field_name in ("offload", "quantization"):
            return "off"  # the flags' spelling (--offload none, --quantization none) is accepted too
        if isinstance(v, bool):
            return "on" if v else "off"
        if isinstance(v, str) and v.lower() in ON_OFF_WORDS:
            return ON_OFF_WORDS[v.lower()]
        return v

    mixed_precision: MixedPrecision = Field(
        "auto", description="bf16/fp16 weights (on = bf16 where supported, else fp16); *-mixed keeps fp32 master weights."
    )
    gradient_checkpointing: OnOffAuto = Field(
        "auto", description="on: activations recomputed in backward; much less memory, ~25% slower."
    )
    gradient_accumulation: int | OnOffAuto = Field(
        "auto", description="Micro-batches per optimizer step, same effective batch: an integer fixes it, off = 1 (micro-batch = batch), on/auto = the planner picks."
    )
    lora: OnOffAuto = Field("auto", description="on: train LoRA adapters (peft) instead of all weights.")
    quantization: Quantization = Field(
        "auto", description="Frozen base in 4-bit (nf4, nf4-dq, fp4) or 8-bit (int8); on = nf4-dq. Needs lora."
    )
    optimizer: Optimizer = Field(
        "auto", description="auto: the AdamW family only (AdamW, 8-bit, torchao 4-bit, paged, offloaded, stepped in "
        "the backward), never an optimizer that changes the training algorithm; any-that-fits: auto, and the search "
        "may also pick GaLore, APOLLO or LOMO/AdaLomo when nothing else fits; or one of: "
        "adamw (on: adamw_8bit), paged_*, adafactor, sgd, or galore_adamw (GaLore: full "
        "fine-tuning with projected AdamW state, pip install 'lowvram[galore]'), galore_adamw_8bit (8-bit "
        "state), galore_adamw_layerwise / galore_adamw_8bit_layerwise (each weight stepped in the "
        "backward: no full set of gradients; no accumulation, no clipping, one GPU), lomo / adalomo (LOMO's SGD "
        "or AdaLomo's factored second moment fused into the backward, pip install 'lowvram[lomo]'; the same "
        "limits, no fp16, adalomo CUDA only), adamw_torch_8bit / adamw_torch_4bit (torchao's block-wise 8/4-bit "
        "moments, the step compiled, pip install 'lowvram[torchao]'; no offload), apollo_adamw / "
        "apollo_adamw_layerwise (APOLLO: channel-wise scaled gradients from random rank-galore.rank moments, pip "
        "install 'lowvram[apollo]'; GaLore's limits); 8-bit AdamW saves 6 bytes/param."
    )
    offload: Offload = Field(
        "auto", description="Offload/shard optimizer or parameters via DeepSpeed ZeRO or FSDP; slowest, last resort."
    )
    activation_offload: OnOffAuto = Field(
        "auto", description="on: the checkpointed layer inputs wait in pinned host RAM for the backward "
                            "(needs gradient_checkpointing; a GPU: nothing to move on a CPU); ~10% slower.")
    tiled_mlp: int | OnOffAuto = Field(
        "auto", description="on: each layer's MLP runs over the sequence in shards, recomputed shard by shard "
                            "in the backward (DeepSpeed's TiledMLP, ALST); an integer: on with that many shards "
                            "(on: ceil(seq_len / hidden_size)); dense MLPs only; ~20% slower.")
    attention: Attention = Field("auto", description="Attention kernel; sdpa/flash never store the s x s matrix.")
    loss: Loss = Field(
        "auto", description="chunked: cross-entropy in chunks, no full fp32 logits copy; fused: Liger Kernel's "
                            "fused linear cross-entropy (CUDA, pip install 'lowvram[liger]'), else chunked.")

    @field_validator("gradient_accumulation", "tiled_mlp")
    @classmethod
    def _accum_positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v <= 0:
            raise ValueError("must be a positive integer, on, off or auto")
        return v

    @model_validator(mode="after")
    def _quant_needs_lora(self) -> TechniquesSection:
        conflict = quantization_conflict(self.quantization, self.lora != "off")
        if conflict:
            raise ValueError(f"{conflict} (set lora: on or quantization: off)")
        return self

    @model_validator(mode="after")
    def _offload_needs_checkpointing(self) -> TechniquesSection:
        conflict = activation_offload_conflict(self.activation_offload == "on", self.gradient_checkpointing != "off")
        if conflict:
            raise ValueError(f"{conflict} (set gradient_checkpointing: on or auto, or activation_offload: off)")
        return self

    @model_validator(mode="after")
    def _offload_keeps_optimizer(self) -> TechniquesSection:
        from lowvram.plan.setup import offload_conflict, offload_conflict_hint

        optimizer = on_off(self.optimizer, ON_VALUES["optimizer"], OFF_VALUES["optimizer"])
        offload = on_off(self.offload, ON_VALUES["offload"], OFF_VALUES["offload"])
        conflict = offload_conflict(optimizer, offload) if "auto" not in (optimizer, offload) else None
        if conflict:
            hint = offload_conflict_hint(optimizer, offload, lambda key, value: f"{key}: {value}")
            raise ValueError(f"{conflict} ({hint})")
        return self
