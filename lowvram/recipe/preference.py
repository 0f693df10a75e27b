"""The recipe's preference section: TRL's options for training.objective dpo, orpo, simpo and kto,
and the data formats those objectives read.

No torch here: ``lowvram validate`` must be instant.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from lowvram.recipe.sections import Section

# the data formats of the preference objectives (kto also reads pairs: TRL unpairs them)
PREFERENCE_FORMATS = ("preference", "unpaired")
# DPOTrainer's loss types (trl/trainer/dpo_config.py, TRL 1.16), one per recipe.
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
                  "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")


class PreferenceSection(Section):
    """TRL's options that change a preference run's memory or results (training.objective dpo,
    orpo, simpo, kto). The sequence length is training.seq_len (TRL's max_length: prompt + completion)."""

    beta: float = Field(
        0.1, gt=0,
        description="dpo: how far from the reference (higher: stays closer); orpo: weight of the "
                    "odds-ratio term (lambda); simpo: reward scale (the SimPO paper uses 2.0-2.5).")
    loss_type: Literal[DPO_LOSS_TYPES] = Field(
        "sigmoid", description="dpo's loss (sigmoid: the DPO paper's; ipo, hinge, robust ...): same memory, other results.")
    precompute_ref_log_probs: bool = Field(
        False,
        description="dpo, kto: true computes the reference log-probs in one pass before training: no reference "
                    "forward per step (full fine-tuning: no second copy of the weights while training), one "
                    "extra forward over the data first.")
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5,
        description="dpo robust/exo_pair: the probability a preference label is flipped (0 = trust the labels).")
    simpo_gamma: float = Field(
        0.5, ge=0, description="simpo: target reward margin (higher: separates chosen from rejected more).")
    desirable_weight: float = Field(
        1.0, gt=0, description="kto: weight of the desirable completions' loss (raise it when they are "
                               "fewer than the undesirable ones; KTO paper eq. 8). No memory change.")
    undesirable_weight: float = Field(
        1.0, gt=0, description="kto: weight of the undesirable completions' loss. No memory change.")

    padding_free: bool = Field(
        False,
        description="TRL's padding_free (each batch flattened into one row, FlashAttention only): would save "
                    "the padding's memory; refused, since TRL 1.16's DPOTrainer ignores it (it warns and pads) "
                    "and its KTO, ORPO and CPO trainers have no such option.")

    @field_validator("padding_free")
    @classmethod
    def _no_padding_free(cls, v: bool) -> bool:
        # trl/trainer/dpo_trainer.py L732-739 (TRL 1.16): padding_free=True logs a warning and is set
        # back to False; accepting it would plan and report a run that is not the one trained
        if v:
            raise ValueError("not available in TRL 1.16 (lowvram's pin): DPOTrainer warns and pads every batch "
                             "anyway (dpo_trainer.py L732-739), KTO, ORPO and CPO have no such option, and it "
                             "needs FlashAttention 2 or 3 (CUDA); set it false (each batch is padded to its "
                             "longest pair, and the run is planned there)")
        return v

    @model_validator(mode="after")
    def _exo_needs_smoothing(self) -> PreferenceSection:
        # TRL's DPOTrainer raises at start for this pair (trl/trainer/dpo_trainer.py, exo_pair)
        if self.loss_type == "exo_pair" and self.label_smoothing == 0.0:
            raise ValueError("loss_type exo_pair needs label_smoothing > 0 (the EXO paper uses 1e-3)")
        return self
