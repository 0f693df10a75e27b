"""The recipe's sections that say what to train and how long: the model, the data (each dataset
and how its rows become tokens) and the training loop, with the base every section shares
(``extra="forbid"``: an unknown key is an error). The Recipe root is schema.py's.

No torch here: ``lowvram validate`` must be instant.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lowvram.plan.memory.preference import OBJECTIVES
from lowvram.recipe.formats import unknown_field
from lowvram.vocab import DTYPES, SWITCH

# Each technique is auto, on, off or one of its values (lowvram.vocab); Literal[tuple] is the
# same type as Literal with those values written out.
OnOffAuto = Literal[SWITCH]
DataFormat = Literal["auto", "alpaca", "chat", "sharegpt", "image_chat", "completion", "text", "preference",
                     "unpaired", "prompt"]
# The roles a chat template renders (OpenAI's message roles).
CHAT_ROLES = ("user", "assistant", "system", "tool")
# training.objective: sft trains on responses (the Trainer); the others align on preference data
# through TRL (lowvram.train.build.preference), the planner's list (lowvram.plan.memory.preference).
Objective = Literal[OBJECTIVES]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
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


class DatasetSpec(Section):
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


class DataSection(Section):
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
    max_pixels: int | Literal["auto"] | None = Field(
        None, description="The largest image, in pixels (width x height), the processor resizes an "
        "image_chat image to (Qwen2.5-VL, Qwen3-VL: the image processor's max_pixels, size.longest_edge); "
        "the plan bounds each image's tokens by it. Default: the processor's own (Qwen-VL: 1003520, or its "
        "preprocessor_config.json's). auto: the processor's own, lowered by the planner on its grid "
        "(multiples of (patch x merge)^2 px, not under min_pixels) to the largest that fits only when no "
        "plan fits at it, after every memory technique (it changes the data: larger images lose detail); "
        "the plan says the size chosen. Not for fixed-size towers (Gemma-3, Llava: auto is their size).",
    )
    min_pixels: int | None = Field(
        None, ge=1, description="The smallest image, in pixels, the processor resizes to (Qwen-VL: min_pixels, "
        "size.shortest_edge). Default: the processor's own.",
    )

    @field_validator("max_pixels")
    @classmethod
    def _pixels(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v < 1:
            raise ValueError("max_pixels must be at least 1 (or auto)")
        return v

    @field_validator("validation")
    @classmethod
    def _fraction(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, float) and not 0.0 < v <= 0.5:
            raise ValueError("a validation fraction must be > 0 and <= 0.5")
        return v


class TrainingSection(Section):
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
