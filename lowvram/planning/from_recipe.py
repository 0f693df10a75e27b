"""Recipe + command-line choices -> PlanRequest: the recipe's fixed techniques, then the flags on
top (flags win), and the recipe's model as a ModelSpec."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.plan.types import precisions_for_dtype
from lowvram.vocab import ANY_OPTIMIZER, OFF_VALUES, ON_VALUES, WEIGHT_DTYPE, on_off

if TYPE_CHECKING:  # the recipe's pydantic schema is imported only where a recipe is read
    from lowvram.recipe import Recipe

# `--method` is a shorthand for the lora and quantization techniques.
METHODS = {"full": (False, "none"), "lora": (True, "none"), "qlora": (True, ON_VALUES["quantization"])}


def check_dtype(recipe: Recipe) -> None:
    """model.dtype and a fixed mixed_precision must agree on the weights' dtype."""
    dtype, mp = recipe.model.dtype, recipe.techniques.mixed_precision
    fixed = "fp32" if mp == "off" else mp
    if dtype == "auto" or fixed in ("auto", "on") or fixed in precisions_for_dtype(dtype):
        return
    raise LowvramError(
        f"model.dtype {dtype} and techniques.mixed_precision {mp} disagree: {fixed} keeps "
        f"{WEIGHT_DTYPE[fixed]} weights",
        f"set mixed_precision to one of {', '.join(precisions_for_dtype(dtype))}, or model.dtype: auto")


def recipe_choices(recipe: Recipe) -> dict:
    """The recipe's fixed (non-auto) techniques as PlanRequest fields."""
    t = recipe.techniques
    out: dict = {}
    check_dtype(recipe)
    if t.mixed_precision not in ("auto", "on"):  # on = bf16 where supported: what auto picks
        out["mixed_precision"] = on_off(t.mixed_precision, None, OFF_VALUES["mixed_precision"])
    elif recipe.model.dtype != "auto":
        out["weight_dtype"] = recipe.model.dtype  # the chooser picks a precision storing it
    if t.gradient_checkpointing != "auto":
        out["gradient_checkpointing"] = t.gradient_checkpointing == "on"
    if t.activation_offload != "auto":
        out["activation_offload"] = t.activation_offload == "on"
    out.update(tiled_mlp_fields(t.tiled_mlp))
    if isinstance(t.gradient_accumulation, int):
        out["grad_accum"] = t.gradient_accumulation
    elif t.gradient_accumulation == "off":
        out["grad_accum"] = 1
    if isinstance(recipe.training.micro_batch_size, int):
        out["micro_batch_size"] = recipe.training.micro_batch_size
    if t.lora != "auto":
        out["lora"] = t.lora == "on"
    if t.quantization != "auto":
        out["quantization"] = on_off(t.quantization, ON_VALUES["quantization"], OFF_VALUES["quantization"])
    if t.optimizer == ANY_OPTIMIZER:
        out["optimizer_any"] = True
    elif t.optimizer != "auto":
        out["optimizer"] = on_off(t.optimizer, ON_VALUES["optimizer"], OFF_VALUES["optimizer"])
    if t.offload != "auto":
        out["offload"] = on_off(t.offload, ON_VALUES["offload"], OFF_VALUES["offload"])
    if t.attention != "auto":
        out["attention"] = t.attention
    if t.loss != "auto":
        out["loss"] = t.loss
    return {k: v for k, v in out.items() if v is not None}


def tiled_mlp_fields(value: int | str) -> dict:
    """techniques.tiled_mlp / --tiled-mlp (auto, on, off or a number of shards) as PlanRequest
    fields: {} on auto; tiled_mlp, and tiled_mlp_shards for a number."""
    if value == "auto":
        return {}
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        shards = int(value)
        if shards < 1:
            raise LowvramError(f"tiled_mlp shards must be a positive integer, got {shards}",
                               "use on (ceil(seq_len / hidden_size) shards), off, auto or a number >= 1")
        return {"tiled_mlp": True, "tiled_mlp_shards": shards}
    if value not in ("on", "off"):
        raise LowvramError(f"unknown tiled_mlp {value!r}", "use --tiled-mlp auto, on, off or a number of shards")
    return {"tiled_mlp": value == "on"}


def flag_choices(method: str | None = None, **flags) -> tuple[dict, dict]:
    """Command-line choices as PlanRequest fields, and which flag set each (for the reasons)."""
    names = {
        "mixed_precision": ("mixed_precision", "--mixed-precision"),
        "quantization": ("quantization", "--quantization"), "optimizer": ("optimizer", "--optimizer"),
        "loss": ("loss", "--loss"), "attention": ("attention", "--attention"),
        "gradient_accumulation": ("grad_accum", "--gradient-accumulation"), "offload": ("offload", "--offload"),
        "gradient_checkpointing": ("gradient_checkpointing", "--gradient-checkpointing"),
        "activation_offload": ("activation_offload", "--activation-offload"),
        "seq_len": ("seq_len", "--seq-len"), "batch_size": ("batch_size", "--batch-size"),
        "gpus": ("gpus", "--gpus"), "lora_r": ("lora_r", "--lora-r"),
        "lora_targets": ("lora_targets", "--lora-targets"), "packing": ("packing", "--packing"),
        "tiled_mlp": ("tiled_mlp", "--tiled-mlp"),
        "objective": ("objective", "--objective"),
        "images_per_row": ("images_per_row", "--images-per-row"),
        "max_pixels": ("max_pixels", "--max-pixels"), "min_pixels": ("min_pixels", "--min-pixels"),
        # grpo/rloo: the grpo section's keys (build_request gathers them into PlanRequest.grpo)
        **{k: ("grpo." + k, "--" + k.replace("_", "-")) for k in GRPO_FLAGS},
    }
    out: dict = {}
    sources: dict = {}
    if method is not None:
        if method not in METHODS:
            raise LowvramError(f"unknown method {method!r}", "use --method full, lora or qlora")
        out["lora"], quant = METHODS[method]
        sources["lora"] = f"--method {method}"
        if flags.get("quantization") is None:
            out["quantization"] = quant
            sources["quantization"] = f"--method {method}"
    for key, value in flags.items():
        if value is None:
            continue
        field, flag = names[key]
        if key == "tiled_mlp":
            tiled = tiled_mlp_fields(value)
            out.update(tiled)
            sources.update({k: f"--tiled-mlp {value}" for k in tiled})
            continue
        if key == "lora_targets" and isinstance(value, str):
            value = tuple(x.strip() for x in value.split(",") if x.strip())
        if key in ("gradient_checkpointing", "activation_offload", "packing"):
            flag = flag if value else flag.replace("--", "--no-", 1)
        if key == "optimizer" and value == ANY_OPTIMIZER:
            field, value = "optimizer_any", True
        if key == "max_pixels" and value == "auto":  # the processor's own, lowered by the chooser if need be
            field, value = "max_pixels_auto", True
        out[field] = value
        switch = key in ("lora_targets", "gradient_checkpointing", "activation_offload", "packing")
        sources[field] = flag if switch else f"{flag} {'auto' if field == 'max_pixels_auto' else _shown(value)}"
    return out, sources


def _shown(value) -> str:
    return ",".join(value) if isinstance(value, tuple) else str(value)


def _grpo_objectives():
    from lowvram.plan.memory.grpo import GRPO_OBJECTIVES

    return GRPO_OBJECTIVES


def build_request(model, recipe: Recipe | None = None, flags: dict | None = None,
                  flag_sources: dict | None = None):
    """PlanRequest: schema defaults, then the recipe, then the flags (flags win)."""
    from lowvram.plan.choose.request import PlanRequest

    # without a recipe the request's own defaults, the schema's (tests/planning pins them equal)
    fields: dict = {}
    sources: dict = {}
    if recipe is not None:
        fields.update(seq_len=recipe.training.seq_len, batch_size=recipe.training.batch_size)
        fields.update(lora_fields(recipe))
        fields.update(galore_fields(recipe))
        # a max_grad_norm the recipe writes is asked for; the default (1.0) a layerwise optimizer
        # drops, and its plan says so (plan/memory/optimizers/ given_up)
        t = recipe.training
        fields["gradient_clipping"] = "max_grad_norm" in t.model_fields_set and t.max_grad_norm > 0
        fields["packing"] = recipe.data.packing
        if any(d.format == "image_chat" for d in recipe.data.datasets):  # lowvram.plan.memory.images
            fields["images_per_row"] = recipe.data.images_per_row
            fields.update(pixel_fields(recipe))
        elif recipe.data.max_pixels or recipe.data.min_pixels:  # --set data.max_pixels=N without a recipe
            fields.update({k: v for k in ("max_pixels", "min_pixels") if (v := getattr(recipe.data, k))})
            if fields.get("max_pixels") == "auto":
                fields["max_pixels_auto"] = True
                del fields["max_pixels"]
        fields["objective"] = recipe.training.objective
        fields["precompute_ref"] = recipe.preference.precompute_ref_log_probs
        fixed = recipe_choices(recipe)
        fields.update(fixed)
        sources.update({k: "the recipe" for k in fixed})
    for key, value in (flags or {}).items():
        fields[key] = value
    sources.update(flag_sources or {})
    if isinstance((flags or {}).get("max_pixels"), int):  # a flag's own max_pixels is fixed
        fields["max_pixels_auto"] = False
    elif fields.get("max_pixels_auto"):  # auto starts from the processor's own (plan/choose/pixels.py)
        fields.pop("max_pixels", None)
        fields.update({k: v for k, v in own_pixels(recipe).items() if k == "max_pixels"})
    if (fields.get("max_pixels") or fields.get("min_pixels") or fields.get("max_pixels_auto")) \
            and not fields.get("images_per_row"):
        fields["images_per_row"] = 1  # --max-pixels asks for an image plan: one image a row unless told
    grpo = {k.removeprefix("grpo."): fields.pop(k) for k in list(fields) if k.startswith("grpo.")}
    if fields.get("objective") in _grpo_objectives():  # seq_len: the training forward's prompt + completion
        fields["grpo"] = grpo_request(recipe, fields["objective"], grpo)
        fields["seq_len"] = fields["grpo"].prompt_len + fields["grpo"].completion_len
    elif grpo:
        raise LowvramError(f"--{next(iter(grpo)).replace('_', '-')} applies to objective grpo or rloo only",
                           "add --objective grpo (or rloo), or drop it")
    # A flag fixing accumulation releases a micro-batch fixed by the recipe (and vice versa).
    if flags and "grad_accum" in flags and "micro_batch_size" not in flags:
        fields.pop("micro_batch_size", None)
    return PlanRequest(model=model, sources=sources, **fields)


# the grpo section's keys `lowvram plan` takes as flags (--num-generations, ...), as the recipe names them
GRPO_FLAGS = ("num_generations", "max_prompt_length", "max_completion_length", "generation_batch_size",
              "steps_per_generation", "beta", "num_iterations", "generation", "vllm_gpu_memory_utilization")


def grpo_request(recipe: Recipe | None, objective: str, flags: dict):
    """The recipe's grpo section (its defaults without one), then the flags, as a GrpoRequest."""
    from lowvram.plan.memory.grpo import GrpoRequest
    from lowvram.recipe.grpo import GrpoSection

    section = recipe.grpo if recipe is not None else GrpoSection()  # no recipe: the schema's defaults
    values = {k: getattr(section, k) for k in GRPO_FLAGS}
    values.update(flags)
    for key in ("generation_batch_size", "steps_per_generation", "vllm_gpu_memory_utilization"):
        if values.get(key) == "auto":
            values[key] = None
    renamed = {"max_prompt_length": "prompt_len", "max_completion_length": "completion_len", "generation": "engine"}
    fields = {renamed.get(k, k): v for k, v in values.items()}
    return GrpoRequest(rloo=objective == "rloo", **fields)


def pixel_fields(recipe: Recipe) -> dict:
    """data.max_pixels / data.min_pixels, each defaulting to the model folder's own processor's
    (its preprocessor_config.json, or processor_config.json's image_processor: min_pixels /
    max_pixels, or size shortest_edge / longest_edge, as Qwen2VLImageProcessor reads them);
    absent when neither says (the class default applies)."""
    auto = recipe.data.max_pixels == "auto"  # the processor's own, which the chooser may lower
    out = {"max_pixels": None if auto else recipe.data.max_pixels, "min_pixels": recipe.data.min_pixels}
    own = own_pixels(recipe) if None in out.values() else {}
    out = {k: v if v is not None else own.get(k) for k, v in out.items()}
    return {k: v for k, v in out.items() if v is not None} | ({"max_pixels_auto": True} if auto else {})


def own_pixels(recipe: Recipe | None) -> dict:
    """The model folder's own processor's max_pixels / min_pixels (its preprocessor_config.json, or
    processor_config.json's image_processor: min_pixels / max_pixels, or size shortest_edge /
    longest_edge, as Qwen2VLImageProcessor reads them); those it does not say are left out."""
    from pathlib import Path

    if recipe is None:
        return {}
    folder = Path(recipe.model.name_or_path).expanduser()
    files = [p for p in (folder / "preprocessor_config.json", folder / "processor_config.json") if p.is_file()]
    if not files:
        return {}
    import json

    try:
        cfg = json.loads(files[0].read_text())
    except (OSError, ValueError):
        cfg = {}
    cfg = cfg.get("image_processor", cfg) if isinstance(cfg, dict) else {}  # transformers 5 nests it
    if not str(cfg.get("image_processor_type", "")).startswith("Qwen2VLImageProcessor"):
        return {}  # another family's sizes (CLIP's shortest_edge is a side, not pixels)
    size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
    own = {"max_pixels": cfg.get("max_pixels", size.get("longest_edge")),
           "min_pixels": cfg.get("min_pixels", size.get("shortest_edge"))}
    return {k: v for k, v in own.items() if isinstance(v, int)}


def check_grpo_processes(recipe: Recipe, gpus: int) -> None:
    """`lowvram validate --gpus N` on a grpo/rloo recipe: TRL's rule on the generation batch with N
    processes (plan.memory.grpo.generation_batch_problem, the planner's own check), no model read."""
    from lowvram.plan.memory.grpo import generation_batch_problem

    t = recipe.training
    if t.objective not in _grpo_objectives() or gpus <= 1:
        return
    if t.batch_size % gpus:
        raise LowvramError(f"training.batch_size {t.batch_size} is not divisible by {gpus} processes",
                           f"use a batch size that is a multiple of {gpus}")
    fixed = recipe_choices(recipe)
    micro = fixed.get("micro_batch_size") or (t.batch_size // gpus // fixed["grad_accum"]
                                              if fixed.get("grad_accum") else None)
    problem = generation_batch_problem(grpo_request(recipe, t.objective, {}), t.batch_size, gpus, micro)
    if problem:
        raise LowvramError(*problem)


def lora_fields(recipe: Recipe) -> dict:
    """The recipe's lora section as PlanRequest / Plan fields."""
    lc = recipe.lora
    targets = (lc.target_modules,) if isinstance(lc.target_modules, str) else tuple(lc.target_modules)
    return {"lora_r": lc.r, "lora_alpha": lc.alpha, "lora_dropout": lc.dropout, "lora_targets": targets,
            "lora_use_dora": lc.use_dora, "lora_use_rslora": lc.use_rslora, "lora_init": lc.init}


def galore_fields(recipe: Recipe) -> dict:
    """The recipe's galore section as PlanRequest / Plan fields."""
    g = recipe.galore
    return {"galore_rank": g.rank, "galore_update_proj_gap": g.update_proj_gap, "galore_scale": g.scale}


# what `lowvram plan --model M --set KEY=VALUE` may set without a recipe: every key the request
# reads except the model and the data files themselves (--model names the model; a plan reads no data)
_SETTABLE_WITHOUT_RECIPE = ("training.", "lora.", "galore.", "preference.", "grpo.", "techniques.", "model.dtype",
                            "data.packing", "data.images_per_row", "data.max_pixels", "data.min_pixels")


def recipe_from_sets(model: str | None, overrides: list[str] | tuple) -> Recipe:
    """`lowvram plan --model M --set KEY=VALUE` (no recipe): the schema's defaults with the sets
    applied, validated like a recipe file, so each set reaches the request as it would from a
    recipe (a default recipe asks exactly what no recipe asks). The model is --model's; a key that
    has no meaning without a recipe (model.name_or_path, data.datasets) is refused."""
    from lowvram.recipe import parse_recipe

    if model is None:
        raise LowvramError("--set without a recipe needs --model: there is no model to plan",
                           "e.g. lowvram plan --model llama-2-7b --vram 24GB --set lora.use_dora=true, "
                           "or lowvram plan recipes/quickstart.yaml --set ...")
    for item in overrides:
        key = item.partition("=")[0].strip()
        if not key.startswith(_SETTABLE_WITHOUT_RECIPE):
            raise LowvramError(f"--set {item}: {key} cannot be set without a recipe",
                               "name the model with --model; write data and model keys in a recipe "
                               "(lowvram plan RECIPE --set ...), e.g. start from recipes/quickstart.yaml")
    from lowvram.plan.memory.preference import PREFERENCE_OBJECTIVES

    objective = [i.partition("=")[2].strip() for i in overrides if i.partition("=")[0].strip() == "training.objective"]
    # the placeholder data's format follows the objective (the schema pairs the two); never read
    fmt = ("preference" if objective and objective[-1] in PREFERENCE_OBJECTIVES
           else "prompt" if objective and objective[-1] in ("grpo", "rloo") else "text")
    text = json.dumps({"model": {"name_or_path": model},
                       "data": {"datasets": [{"path": "none.jsonl", "format": fmt}]}})  # JSON is YAML
    return parse_recipe(text, "--set", overrides)


def recipe_model(recipe: Recipe):
    """The recipe's model as a ModelSpec (a local folder resolves against the recipe file)."""
    from lowvram.plan.model.catalog import resolve_model

    return resolve_model(recipe_model_ref(recipe))


def recipe_model_ref(recipe: Recipe) -> str:
    """model.name_or_path: a local path resolved against the recipe file, else as written (a
    catalog name or hub id)."""
    local = recipe.resolve_path(recipe.model.name_or_path)
    return str(local) if local.exists() else recipe.model.name_or_path
