"""The recipe schema: one pydantic model is the truth for every key, default and help text
(``extra="forbid"``: an unknown key is an error); reading YAML into it is load.py's.

No torch, transformers or other heavy imports here: ``lowvram validate`` must be instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lowvram.plan.memory.preference import OBJECTIVES, PREFERENCE_OBJECTIVES, RL_OBJECTIVES
from lowvram.plan.setup import activation_offload_conflict, quantization_conflict
from lowvram.recipe.formats import unknown_field
from lowvram.recipe.grpo import GrpoSection, grpo_problem, rl_format_problem
from lowvram.vocab import (
    ANY_OPTIMIZER,
    ATTENTIONS,
    DTYPES,
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

# Each technique is auto, on, off or one of its values (lowvram.vocab); Literal[tuple] is the
# same type as Literal with those values written out.
OnOffAuto = Literal[SWITCH]
MixedPrecision = Literal[(*SWITCH, *PRECISIONS)]
Quantization = Literal[(*SWITCH, *(q for q in QUANTIZATIONS if q != "none"))]
Optimizer = Literal[(*SWITCH, ANY_OPTIMIZER, *OPTIMIZERS)]
Offload = Literal[(*SWITCH, *(o for o in OFFLOADS if o != "none"))]
Attention = Literal[("auto", *ATTENTIONS)]
Loss = Literal[("auto", *LOSSES)]
DataFormat = Literal["auto", "alpaca", "chat", "sharegpt", "image_chat", "completion", "text", "preference",
                     "unpaired", "prompt"]
# The roles a chat template renders (OpenAI's message roles).
CHAT_ROLES = ("user", "assistant", "system", "tool")
# training.objective: sft trains on responses (the Trainer); the others align on preference data
# through TRL (lowvram.train.build.preference), the planner's list (lowvram.plan.memory.preference).
Objective = Literal[OBJECTIVES]
# the data formats of the preference objectives (kto also reads pairs: TRL unpairs them)
PREFERENCE_FORMATS = ("preference", "unpaired")
# DPOTrainer's loss types (trl/trainer/dpo_config.py, TRL 1.16), one per recipe.
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
                  "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    name_or_path: str = Field(
        description="Hub id (e.g. Qwen/Qwen2.5-1.5B) or a local folder with config.json."
    )
    revision: str | None = Field(None, description="Hub branch, tag or commit to load.")
    dtype: Literal[("auto", *DTYPES)] = Field(
        "auto",
        description="Storage dtype of the weights; auto follows mixed_precision (bf16/fp16 "
        "keep 16-bit weights, *-mixed and fp32 keep fp32 weights). Set, it picks the precision "
        "(float32: bf16-mixed on a bf16 card) and must agree with a fixed mixed_precision.",
    )
    trust_remote_code: bool = Field(
        False, description="Run Python code shipped with the model. Off unless you trust it."
    )
    gguf_file: str | None = Field(
        None, description="Load weights from this GGUF file inside name_or_path (dequantized)."
    )
    tokenizer: str | None = Field(None, description="Tokenizer id or path if not the model's.")

    @field_validator("name_or_path")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v


class DatasetSpec(_Section):
    path: str = Field(
        description="Local .json/.jsonl/.csv/.parquet/.txt file (relative to the recipe) or a hub id."
    )
    format: DataFormat = Field(
        "auto",
        description="auto (recognised from the file's columns: messages, conversations, instruction/output, "
        "prompt/response, prompt/completion, question/answer, input/output, text, chosen/rejected; the choice is "
        "printed), alpaca (instruction/input/output), chat (messages with roles, rendered by the "
        "tokenizer's chat template; OpenAI tool calls kept as the template renders them), sharegpt "
        "(conversations of {from, value}: human/gpt/system/observation/function_call), image_chat "
        "(messages whose content holds {type: image} parts, "
        "plus images: image files relative to the data file, or a hub dataset's image column; "
        "rendered by the model's processor; a model with a vision tower), completion (prompt/completion), text (raw text), preference "
        "(prompt/chosen/rejected: text or messages; no prompt field: the shared start of chosen and "
        "rejected; for training.objective dpo, orpo, simpo, kto), unpaired (prompt/completion/label: "
        "true for a desirable completion, false for an undesirable one; for training.objective kto), prompt "
        "(a prompt column, text or messages, that the model completes; every other column is handed to the "
        "rewards by name; for training.objective grpo and rloo, which also take chat and alpaca rows' prompts).",
    )
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="Map the format's field names to your column names, e.g. {output: response}; chat and "
        "sharegpt also map the keys inside a message, e.g. {messages: conversations, role: from, content: value}.",
    )
    roles: dict[str, str] = Field(
        default_factory=dict,
        description="chat, sharegpt: map your data's role names to user, assistant, system or tool, e.g. "
        "{human: user, gpt: assistant} (sharegpt maps ShareGPT's tags by default).",
    )
    split: str = Field("train", description="Split to read (hub datasets; local files have 'train').")
    name: str | None = Field(None, description="Hub dataset configuration name.")
    max_samples: int | None = Field(None, gt=0, description="Use at most this many rows.")

    @model_validator(mode="after")
    def _known_fields(self) -> DatasetSpec:
        if self.format == "auto":
            return self
        if wrong := unknown_field(self.format, self.fields):
            key, tip, known = wrong
            raise ValueError(f"fields: '{key}' is not a field of format {self.format} ({tip}format "
                             f"{self.format} has {', '.join(known)}; fields maps them to your column names)")
        if self.roles and self.format not in ("chat", "sharegpt", "image_chat"):
            raise ValueError(f"roles: maps the speakers of a conversation; format {self.format} has none "
                             "(use format: chat or sharegpt)")
        wrong = sorted({v for v in self.roles.values() if v not in CHAT_ROLES})
        if wrong:
            raise ValueError(f"roles: {', '.join(wrong)} is not a chat role (map each to one of "
                             f"{', '.join(CHAT_ROLES)})")
        return self


class DataSection(_Section):
    datasets: list[DatasetSpec] = Field(min_length=1, description="One or more datasets, concatenated.")
    validation: float | str | None = Field(
        None,
        description="A fraction (0-0.5) of the training rows held out, or a split name to evaluate on.",
    )
    train_on_inputs: bool = Field(
        False, description="Also train on prompt tokens (default: loss on response tokens only); true is "
        "train_on: all.",
    )
    train_on: Literal["assistant", "last", "all"] = Field(
        "assistant", description="Which tokens carry the loss: assistant (every response: each assistant turn "
        "of a conversation), last (only a conversation's last assistant turn; other formats: the response), "
        "all (every token, prompts and user turns too).",
    )
    packing: bool = Field(False, description="Pack several samples into each seq_len window.")
    images_per_row: int = Field(
        1, ge=1, description="The most images one row of format image_chat holds: the plan counts "
        "this many per row (their tokens and the vision tower's forward); a row with more is an error.",
    )
    skip_bad_rows: bool = Field(
        False, description="Skip and count malformed rows instead of stopping with an error."
    )
    max_pixels: int | None = Field(
        None, ge=1, description="The largest image, in pixels (width x height), the processor resizes an "
        "image_chat image to (Qwen2.5-VL, Qwen3-VL: the image processor's max_pixels, size.longest_edge); "
        "the plan bounds each image's tokens by it. Default: the processor's own (Qwen-VL: 1003520, or its "
        "preprocessor_config.json's). Not for fixed-size towers (Gemma-3, Llava).",
    )
    min_pixels: int | None = Field(
        None, ge=1, description="The smallest image, in pixels, the processor resizes to (Qwen-VL: min_pixels, "
        "size.shortest_edge). Default: the processor's own.",
    )

    @field_validator("validation")
    @classmethod
    def _fraction(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, float) and not 0.0 < v <= 0.5:
            raise ValueError("a validation fraction must be > 0 and <= 0.5")
        return v


class TrainingSection(_Section):
    epochs: float = Field(1.0, gt=0, description="Passes over the data (ignored if max_steps is set).")
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps.")
    learning_rate: float = Field(2e-4, gt=0, lt=1, description="Peak learning rate.")
    lr_scheduler: Literal[
        "linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial"
    ] = Field("cosine", description="Learning-rate schedule after warmup.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of steps spent warming up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm (0 = off).")
    batch_size: int = Field(
        16, gt=0, description="Effective batch: micro_batch_size x gradient_accumulation x GPUs."
    )
    micro_batch_size: int | Literal["auto"] = Field(
        "auto", description="Samples per forward pass per GPU; auto lets the planner choose."
    )
    seq_len: int = Field(1024, gt=0, le=1_048_576, description="Tokens per sample (longer are truncated).")
    seed: int = Field(42, ge=0, description="Random seed for data order and initialisation.")
    logging_steps: int = Field(10, gt=0, description="Log loss every N steps.")
    eval_steps: int | None = Field(None, gt=0, description="Evaluate every N steps (default: at the end).")
    save_steps: int = Field(200, gt=0, description="Write a checkpoint every N steps.")
    save_total_limit: int = Field(2, gt=0, description="Keep at most this many checkpoints (a checkpoint counts "
                                  "once the step after it is finite: the last finite one is never rotated away).")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="A step whose loss or gradient norm is NaN/inf: stop there with error/hint (no "
        "final model; the last finite checkpoint kept), or skip its update (up to nonfinite_skips steps, then stop).")
    nonfinite_skips: int = Field(3, ge=0, description="on_nonfinite skip: how many non-finite steps are skipped "
                                 "(no weight update) before the run stops.")
    worst_batch_first: OnOffAuto = Field(
        "auto", description="One forward+backward on the batch with the most tokens before the run, so a peak the "
        "plan missed shows at step 0 (costs one step; weights, optimizer and data order untouched); auto: on a GPU.")
    output_dir: str = Field("runs/run", description="Where the adapter/model, metrics and checkpoints go.")
    objective: Objective = Field(
        "sft",
        description="sft (train on responses), or align on preference pairs through TRL: dpo (against a "
        "frozen reference: LoRA turns the adapter off, full fine-tuning keeps a second copy), orpo or "
        "simpo (no reference), kto (unpaired desirable/undesirable completions, against a reference as dpo; "
        "a micro-batch of at least 2), or learn online from rewards through TRL: grpo (each prompt completed "
        "grpo.num_generations times, scored by grpo.rewards, each completion against its group's mean) or rloo "
        "(the same generation, each completion against the mean of the others); training.batch_size then "
        "counts completions per optimizer step.",
    )
    report_to: Literal["none", "tensorboard", "wandb"] = Field(
        "tensorboard",
        description="Experiment tracker for the Trainer's logs (tensorboard: logs in output_dir/runs; "
        "`tensorboard --logdir OUTPUT_DIR`).",
    )

    @field_validator("micro_batch_size")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v <= 0:
            raise ValueError("must be > 0 or 'auto'")
        return v


class LoraSection(_Section):
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


class GaloreSection(_Section):
    """optimizer galore_adamw's settings (transformers passes them as optim_args)."""

    rank: int = Field(128, gt=0, le=65536, description="GaLore projection rank: the optimizer state of each "
                      "decoder Linear is 2 x rank x its longer side (lower: less memory, further from AdamW).")
    update_proj_gap: int = Field(200, gt=0, description="Steps between projector renewals (an SVD of each "
                                 "projected gradient).")
    scale: float = Field(0.25, gt=0, description="GaLore's update scale (alpha).")


class PreferenceSection(_Section):
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


class TechniquesSection(_Section):
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


class Recipe(_Section):
    model: ModelSection
    data: DataSection
    training: TrainingSection = Field(default_factory=TrainingSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    galore: GaloreSection = Field(default_factory=GaloreSection)
    preference: PreferenceSection = Field(default_factory=PreferenceSection)
    grpo: GrpoSection = Field(default_factory=GrpoSection)
    techniques: TechniquesSection = Field(default_factory=TechniquesSection)

    @model_validator(mode="after")
    def _dora_needs_lora(self) -> Recipe:
        if self.lora.use_dora and self.techniques.lora == "off":
            raise ValueError("lora.use_dora needs LoRA: DoRA decomposes the adapter update "
                             "(set techniques.lora: on or auto, or lora.use_dora: false)")
        if self.lora.init != "default" and self.techniques.lora == "off":
            raise ValueError(f"lora.init {self.lora.init} needs LoRA: it initialises the adapters "
                             "(set techniques.lora: on or auto, or lora.init: default)")
        return self

    @model_validator(mode="after")
    def _objective_matches_data(self) -> Recipe:
        problem = objective_problem(self.training.objective, [d.format for d in self.data.datasets],
                                    self.data.packing)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _grpo_batch(self) -> Recipe:
        # written: a grpo section that says something (a resolved recipe.yaml of an sft run carries the defaults)
        written = "grpo" in self.model_fields_set and self.grpo != GrpoSection()
        problem = grpo_problem(self.grpo, self.training, written, self.data.validation)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _images_not_packed(self) -> Recipe:
        if self.data.packing and any(d.format == "image_chat" for d in self.data.datasets):
            raise ValueError("data.packing does not apply to format image_chat: a window's images and "
                             "their tokens are not packed (set data.packing: false)")
        return self

    # Where the recipe came from; relative data paths resolve against it. Not a YAML key.
    _source: Path | None = None
    # What load_recipe decided for the user (a data format recognised from the columns), to print.
    _notes: list[str] = PrivateAttr(default_factory=list)

    @property
    def notes(self) -> list[str]:
        return self._notes

    @property
    def source(self) -> Path | None:
        return self._source

    def base_dir(self) -> Path:
        return self._source.parent if self._source else Path.cwd()

    def resolve_path(self, p: str) -> Path:
        """A path from the recipe, relative to the recipe file, with ``..`` and ``.`` folded away
        (the recipe's folder is already resolved, so folding cannot cross a link of it)."""
        import os

        path = Path(p).expanduser()
        return Path(os.path.normpath(path if path.is_absolute() else self.base_dir() / path))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def objective_problem(objective: str, formats: list[str], packing: bool) -> str | None:
    """Why training.objective cannot train on data of these formats (None when it can)."""
    formats = [f for f in formats if f != "auto"]  # recognised from the rows when they are read
    if objective in RL_OBJECTIVES or "prompt" in formats:
        return rl_format_problem(objective, formats, packing)
    preference = objective in PREFERENCE_OBJECTIVES
    allowed = PREFERENCE_FORMATS if objective == "kto" else ("preference",)
    wrong = sorted({f for f in formats if ((f not in allowed) if preference else (f in PREFERENCE_FORMATS))})
    if wrong and preference:
        want = ("format: preference (prompt/chosen/rejected) or unpaired (prompt/completion/label)"
                if objective == "kto" else "format: preference, with prompt/chosen/rejected")
        return (f"training.objective {objective} does not train on format {', '.join(wrong)} (set the datasets' {want})")
    if wrong:
        return (f"format {', '.join(wrong)} needs a preference objective (preference: dpo, orpo, simpo or kto; "
                f"unpaired: kto; training.objective is {objective})")
    if preference and packing:
        return (f"data.packing does not apply to training.objective {objective}: TRL pads each "
                "row of the batch (set data.packing: false)")
    return None


# --------------------------------------------------------------------------------------------
# The schema as documentation (`lowvram keys`, the recipe reference in docs/recipes.md)


def _type_name(ann: Any) -> str:
    args = getattr(ann, "__args__", None)
    origin = getattr(ann, "__origin__", None)
    if origin is Literal:
        return ", ".join(str(a) for a in args)
    if args and origin is not None and origin is not list and origin is not dict:
        return ", ".join(_type_name(a) for a in args if a is not type(None)) + (
            ", null" if type(None) in args else ""
        )
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    if args and origin is None:  # a union written with |
        return ", ".join(_type_name(a) for a in args if a is not type(None))
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "mapping"
    if origin is dict:
        return "mapping"
    if type(None) in (args or ()):
        return ", ".join(_type_name(a) for a in args if a is not type(None)) + ", null"
    return getattr(ann, "__name__", str(ann))


def describe_schema() -> list[tuple[str, str, str, str]]:
    """(key path, type, default, help) for every recipe key, from the pydantic schema."""
    from pydantic_core import PydanticUndefined

    rows: list[tuple[str, str, str, str]] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            key = f"{prefix}{name}"
            ann = f.annotation
            inner = [a for a in (ann, *getattr(ann, "__args__", ())) if isinstance(a, type) and issubclass(a, BaseModel)]
            if inner and not f.description:
                walk(inner[0], key + ".")
                continue
            item = ann.__args__[0] if getattr(ann, "__origin__", None) is list else None
            if isinstance(item, type) and issubclass(item, BaseModel):
                rows.append((key, "list", "(required)", f.description or ""))
                walk(ann.__args__[0], key + "[].")
                continue
            if f.default is PydanticUndefined and f.default_factory is None:
                default = "(required)"
            elif f.default_factory is not None:
                default = repr(f.default_factory()) if not inner else ""
            else:
                default = "null" if f.default is None else (str(f.default).lower() if isinstance(f.default, bool) else str(f.default))
            rows.append((key, _type_name(ann), default, f.description or ""))

    walk(Recipe, "")
    return rows
