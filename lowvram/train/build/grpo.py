"""Online RL through TRL 1.16: training.objective grpo (trl.GRPOTrainer) or rloo (trl.RLOOTrainer).

The same Plan -> configuration mapping as SFT and preference tuning: every TrainingArguments
setting comes from lowvram.train.build.trainer.training_arguments (precision, checkpointing, optimizer,
micro-batch, accumulation, FSDP/DeepSpeed through the launch) and the model arrives prepared by
lowvram.train.build.model (LoRA/QLoRA adapters, checkpointing) exactly as for SFT. What TRL adds is
named in its config below; the recipe's grpo section says what (lowvram.recipe.grpo).

- The micro-batch counts completions: TRL's per_device_train_batch_size; the generation batch is
  TRL's (``steps_per_generation`` micro-batches of completions, whole groups of num_generations),
  the plan's when it resolved one.
- The engine: ``generate`` (transformers' generate over a left-padded batch) or ``paged``
  (transformers' continuous batching, ``use_transformers_continuous_batching``, with the cache the
  plan sized); ``vllm`` is refused (:func:`engine_problem`).
- Prompts longer than grpo.max_prompt_length lose their start (:func:`_truncating`): TRL 1.16
  keeps whole prompts, TRL before 1.0 cut ``prompt_ids[:, -max_prompt_length:]``.
- The reference model (beta > 0): full fine-tuning loads a second copy (GRPOTrainer.__init__
  L986-1003); with LoRA the model arrives as a PEFT model, so TRL adds a frozen adapter "ref", a copy
  of the starting adapter (L478-502), and scores the reference through it (L2722-2724): no copy of
  the weights, one of the adapter, saved beside it in every checkpoint and the output (``ref/``);
  beta 0 loads none (RLOOTrainer adds the "ref" adapter whatever beta; lowvram deletes it when beta
  is 0, :func:`_drop_unused_reference_adapter`).
"""

from __future__ import annotations

from contextlib import contextmanager

from lowvram.errors import LowvramError

# Each objective's TRL trainer, as (module, trainer class, config class).
TRAINERS = {"grpo": ("trl", "GRPOTrainer", "GRPOConfig"), "rloo": ("trl", "RLOOTrainer", "RLOOConfig")}
# TRL's own guard on vLLM (trl/import_utils.py is_vllm_available, TRL 1.16): the releases it takes
VLLM_RANGE = ("0.22.0", "0.31.0")
# transformers releases those vLLM versions accept (issue 44: vLLM 0.22-0.31 pin transformers < 5.18)
VLLM_TRANSFORMERS_BELOW = "5.18"
ENGINE_HINT = "set grpo.generation: generate (or paged, or auto: the plan picks one of the two)"


def engine_problem(generation: str) -> str | None:
    """Why the generation engine cannot run here (None when it can): vLLM, which TRL 1.16 takes
    only in versions 0.22-0.31, and those need a transformers older than lowvram's."""
    if generation != "vllm":
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("transformers")
    except PackageNotFoundError:  # pragma: no cover - lowvram depends on it
        installed = "not installed"
    try:
        vllm = f"vLLM {version('vllm')} is installed"
    except PackageNotFoundError:
        vllm = "vLLM is not installed"
    return (f"grpo.generation vllm: TRL 1.16 accepts vLLM {VLLM_RANGE[0]}-{VLLM_RANGE[1]} only "
            f"(trl/import_utils.py is_vllm_available), and those vLLM releases require transformers < "
            f"{VLLM_TRANSFORMERS_BELOW}; this environment has transformers {installed} ({vllm}), so TRL's vLLM "
            "engine cannot run beside it")


def check_grpo(recipe) -> list:
    """``lowvram validate`` and the start of ``lowvram train`` for grpo/rloo, before any model: the
    engine can run, and every reward imports, takes TRL's arguments and scores a sample row."""
    from lowvram.train.build.rewards import check_rewards

    problem = engine_problem(recipe.grpo.generation)
    if problem:
        raise LowvramError(problem, ENGINE_HINT)
    problem = paged_recipe_problem(recipe)
    if problem:
        from lowvram.plan.memory.grpo import PAGED_PRECISION_HINT

        raise LowvramError(problem, PAGED_PRECISION_HINT)
    return check_rewards(recipe)


def _classes(objective: str):
    import importlib

    from lowvram.train.data.preference import require_trl

    require_trl()
    module, trainer, config = TRAINERS[objective]
    mod = importlib.import_module(module)
    return getattr(mod, trainer), getattr(mod, config)


def generation_settings(recipe, plan) -> dict:
    """TRL's generation keys: the batch (the plan's resolved steps_per_generation when it has one,
    else the recipe's, else TRL's default) and the engine (the plan's for auto)."""
    g = recipe.grpo
    out: dict = {}
    planned_steps = getattr(plan, "steps_per_generation", 0) or 0
    if planned_steps:
        out["steps_per_generation"] = planned_steps
    elif isinstance(g.generation_batch_size, int):
        out["generation_batch_size"] = g.generation_batch_size
    elif isinstance(g.steps_per_generation, int):
        out["steps_per_generation"] = g.steps_per_generation
    engine = getattr(plan, "generation", "") or g.generation
    cast = paged_cast_problem(plan)
    if engine == "auto" or (engine == "paged" and g.generation == "auto" and cast):
        engine = "generate"  # auto: the plan's paged only where TRL's cast changes nothing
    if engine == "paged" and cast:
        from lowvram.plan.memory.grpo import PAGED_PRECISION_HINT

        raise LowvramError(cast, PAGED_PRECISION_HINT)
    problem = engine_problem(engine)
    if problem:
        raise LowvramError(problem, ENGINE_HINT)
    if engine == "paged":
        cache = {k: v for k, v in (("num_blocks", getattr(plan, "paged_num_blocks", None)),
                                   ("max_batch_tokens", getattr(plan, "paged_max_batch_tokens", None))) if v}
        out["use_transformers_continuous_batching"] = True
        if cache:
            out["transformers_continuous_batching_config"] = {**cache, "max_memory_percent": PAGED_MEMORY_PERCENT}
    return out


def paged_cast_problem(plan) -> str | None:
    """Why the paged engine cannot run the plan's precision (None where it can: fp32):
    lowvram.plan.memory.grpo.paged_precision_problem (TRL 1.16's 16-bit cast of trained fp32
    weights; accelerate's output conversion failing on the paged cache in pure bf16/fp16)."""
    from lowvram.plan.memory.grpo import paged_precision_problem

    return paged_precision_problem(plan.mixed_precision, plan.lora)


def paged_recipe_problem(recipe) -> str | None:
    """``lowvram validate``: a recipe that asks for the paged engine and fixes a 16-bit
    mixed_precision (auto: the plan's precision, checked when it plans)."""
    from lowvram.plan.memory.grpo import paged_precision_problem

    t = recipe.techniques
    if recipe.grpo.generation != "paged" or t.mixed_precision in ("auto", "on", "off"):
        return None  # on: bf16 where the card has it, else fp16 (the plan's check)
    lora = True if t.lora == "on" or t.quantization not in ("auto", "off") else (False if t.lora == "off" else None)
    return paged_precision_problem(t.mixed_precision, lora)


def objective_settings(recipe, plan) -> dict:
    """TRL's own config keys for the recipe's grpo section."""
    g, objective = recipe.grpo, recipe.training.objective
    from lowvram.train.build.rewards import load_rewards

    weights = [r.weight for r in load_rewards(recipe)]
    out = {
        "num_generations": g.num_generations, "max_completion_length": g.max_completion_length,
        "temperature": g.temperature, "beta": g.beta, "num_iterations": g.num_iterations,
        "mask_truncated_completions": g.mask_truncated_completions, "reward_weights": weights,
        "use_vllm": False, "log_completions": False,
        **generation_settings(recipe, plan),
    }
    if objective == "grpo":
        out["loss_type"] = g.loss_type
    return out


def grpo_config(recipe, plan, arguments: dict):
    """The TRL config (a TrainingArguments subclass) of ``arguments`` (the SFT TrainingArguments
    keywords, lowvram.train.build.trainer.training_arguments) plus the grpo section's settings. TRL's
    configs default gradient checkpointing and bf16 on (trl/trainer/base_config.py): both are
    passed explicitly from the Plan, as every other setting."""
    import warnings

    from lowvram.train.build.preference import trl_config_kwargs

    objective = recipe.training.objective
    kwargs = trl_config_kwargs(plan, objective, arguments, "policy")
    _, config_class = _classes(objective)
    # TRL counts no input tokens of its own batches (prompt_ids/completion_ids, no input_ids)
    kwargs["include_num_input_tokens_seen"] = "no"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's notes on its defaults; the run's settings are the plan's
        try:
            config = config_class(**kwargs, **objective_settings(recipe, plan))
        except ValueError as e:  # TRL's batch rules the plan's micro-batch broke (a fixed micro-batch)
            raise LowvramError(f"TRL refuses the {objective} batch: {e}",
                               "make grpo.generation_batch_size (or training.batch_size) a multiple of "
                               "num_generations and of the micro-batch x GPUs") from None
    if config.use_transformers_continuous_batching and not config.transformers_continuous_batching_config:
        config.transformers_continuous_batching_config = paged_cache(
            config.generation_batch_size // max(1, config.world_size), recipe.grpo)
    return config


# The share of the free memory transformers lets the paged cache's footprint reach. A planned cache
# (num_blocks, max_batch_tokens) is still checked against it (continuous_batching/cache.py
# _check_footprint: MemoryError above free x max_memory_percent), and TRL sets 0.5 where none is given
# (grpo_trainer.py L803-807, rloo_trainer.py L554-558): a cache the plan fitted in more than half the free
# memory would fail at the first generation. The plan sized it, so all the free memory may hold it.
PAGED_MEMORY_PERCENT = 1.0
# transformers' ContinuousBatchingConfig defaults: tokens per page of the paged cache, and the most
# tokens of one forward (generation/continuous_batching/cache.py _default_max_batch_tokens)
PAGE_TOKENS = 256
DEFAULT_MAX_BATCH_TOKENS = 8192


def paged_cache(completions: int, g) -> dict:
    """The paged engine's cache for one process's generation batch when the plan sized none: every
    completion's prompt and completion in whole pages, and no more (transformers' own default takes
    a share of the free memory: 0.5 under TRL, grpo_trainer.py L800-806, all of a CPU's RAM's share
    here), the forward's tokens at transformers' default or the whole batch if smaller."""
    row = g.max_prompt_length + g.max_completion_length
    pages = -(-row // PAGE_TOKENS)
    return {"num_blocks": completions * pages, "max_batch_tokens": min(DEFAULT_MAX_BATCH_TOKENS, completions * row),
            "max_memory_percent": PAGED_MEMORY_PERCENT}


def is_rl_config(args) -> bool:
    return type(args).__name__ in {v[2] for v in TRAINERS.values()}


def _truncating(trainer_class, max_prompt_length: int):
    """``trainer_class`` whose prompts keep their last max_prompt_length tokens (TRL before 1.0:
    ``prompt_ids[:, -max_prompt_length:]``, the left side cut, the generation prompt kept)."""

    class Trainer(trainer_class):
        def _tokenize_prompts(self, prompts: list):
            prompt_ids, images, multimodal = super()._tokenize_prompts(prompts)
            return [list(ids)[-max_prompt_length:] for ids in prompt_ids], images, multimodal

    Trainer.__name__ = Trainer.__qualname__ = trainer_class.__name__
    return Trainer


def longest_prompt_tokens(trainer, chunk: int = 256) -> int | None:
    """The longest prompt of ``trainer``'s training data as TRL tokenizes it for generation (the
    trainer's own ``_tokenize_prompts``: the chat template with the generation prompt for
    messages, the tokenizer for text; cut to max_prompt_length by :func:`_truncating`). TRL pads
    each generation batch to its longest prompt (grpo_trainer.py _generate_and_score_completions
    L2441-2451, ``pad(prompt_ids, padding_side="left")``; the generate path likewise, L1814-1826),
    not to max_prompt_length. None for a vision-language model (its prompts carry images)."""
    if getattr(trainer, "_is_vlm", False):
        return None
    prompts = trainer.train_dataset["prompt"]
    longest = 0
    for start in range(0, len(prompts), chunk):
        ids, _, _ = trainer._tokenize_prompts(list(prompts[start:start + chunk]))
        longest = max(longest, *(len(x) for x in ids))
    return longest or None


def resume_hint(recipe) -> str:
    return (f"fix the reward; the checkpoints in {recipe.training.output_dir} are whole: "
            "`lowvram train RECIPE --resume` goes on from the last one")


def build_rl_trainer(loaded, bundle, args, recipe, callbacks=()):
    """TRL's GRPOTrainer or RLOOTrainer for ``args`` (from grpo_config) over the prompts in
    ``bundle`` (lowvram.train.data.prompts), the model as loaded, the recipe's rewards guarded
    (lowvram.train.build.rewards.guarded: a failing reward names itself and the step)."""
    from transformers import PrinterCallback

    from lowvram.train.build.preference import _restore_dtypes, _trainable_dtypes
    from lowvram.train.build.rewards import guarded, load_rewards

    trainer_class, _ = _classes(recipe.training.objective)
    rewards = [guarded(r, resume_hint(recipe)) for r in load_rewards(recipe)]
    trained = _trainable_dtypes(loaded.model)
    with _reference_adapter_not_reinitialised(loaded.model):
        trainer = _truncating(trainer_class, recipe.grpo.max_prompt_length)(
            model=loaded.model,
            reward_funcs=rewards,
            args=args,
            train_dataset=bundle.train,
            processing_class=loaded.tokenizer,
            callbacks=list(callbacks),
        )
    trainer.remove_callback(PrinterCallback)  # progress.py reports, as for SFT
    # over a 4/8-bit base GRPOTrainer and RLOOTrainer cast every trainable parameter to bf16 in
    # __init__ (grpo_trainer.py L538-541, rloo_trainer.py L458-461), as DPO does: back to SFT's fp32 adapters
    _restore_dtypes(trainer.model, trained)
    _drop_unused_reference_adapter(trainer)
    return trainer


@contextmanager
def _reference_adapter_not_reinitialised(model):
    """TRL adds its "ref" adapter with the default adapter's own config (rloo_trainer.py L421,
    grpo_trainer.py L502: ``model.add_adapter("ref", default_config)``), then copies the default
    adapter's weights into it. Under lora.init pissa peft would run PiSSA again for "ref"
    (tuners/lora/layer.py pissa_init: ``base_layer.weight = W - s·B·A``), taking a second slice out
    of the base weights the default adapter was fitted to, with a second full SVD per Linear.
    While TRL builds, the config says init True (B zeros: the base untouched; TRL's copy then makes
    "ref" the starting adapter); the recipe's init is restored after, for the final save's PiSSA
    conversion (train/run/run.py _as_plain_lora)."""
    config = getattr(model, "peft_config", {}).get("default")
    init = getattr(config, "init_lora_weights", True)
    if config is None or init in (True, False, "gaussian"):
        yield
        return
    config.init_lora_weights = True
    try:
        yield
    finally:
        config.init_lora_weights = init


def _drop_unused_reference_adapter(trainer) -> None:
    """RLOOTrainer adds its frozen "ref" adapter to every PEFT model (rloo_trainer.py L398-421:
    ``elif is_peft_model(model)``; GRPOTrainer only where ``args.beta != 0.0``, L478), but scores
    the reference only where beta != 0 (L1613): with beta 0 the copy is never read, yet it holds the
    adapters once more in fp32 (held-out seed 982: 2.23 MB, 5.9% above its plan) and is saved in
    every checkpoint (``ref/``). Deleted, as GRPOTrainer would never have made it."""
    model = trainer.model
    if trainer.beta == 0.0 and "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")  # not the active adapter: "default" stays the one trained


# TRL 1.16's log keys (GRPOTrainer/RLOOTrainer.log: the means over the completions since the last
# log) -> metrics.json's (lowvram.metrics.RunMetrics).
_RL_LOG_KEYS = {"reward": "reward", "reward_std": "reward_std", "completions/mean_length": "completion_length",
                "completions/clipped_ratio": "truncated_completions", "clip_ratio/region_mean": "clip_ratio"}
_HISTORIES = ("reward", "completion_length", "clip_ratio")


def rl_metrics(log_history: list[dict]) -> dict:
    """metrics.json's grpo/rloo part from the Trainer's log history: each logged value's last
    value (and history, for the reward, the completion length and the clip ratio), and each reward
    function's mean, std and history (TRL's rewards/<name>/mean, /std); {} for other runs. TRL logs
    None for a value with no number in its window (GRPOTrainer.log L3311-3312: a reward that
    returned None for every completion): such a point is left out."""
    logs = [_numbers(e) for e in log_history if "step" in e and "reward" in e]
    if not logs:
        return {}
    out: dict = {}
    for key, name in _RL_LOG_KEYS.items():
        points = [[e["step"], float(e[key])] for e in logs if key in e]
        if points:
            out[name] = points[-1][1]
            if name in _HISTORIES:
                out[f"{name}_history"] = points
    functions: dict = {}
    for e in logs:
        for key, value in e.items():
            if key.startswith("rewards/") and key.endswith("/mean"):
                name = key[len("rewards/"):-len("/mean")]
                f = functions.setdefault(name, {"history": []})
                f["history"].append([e["step"], float(value)])
                f["mean"], f["std"] = float(value), float(e.get(f"rewards/{name}/std", 0.0))
    if functions:
        out["reward_functions"] = functions
    return out


def _numbers(logs: dict) -> dict:
    """``logs`` without TRL's None values (a metric with no number since the last log)."""
    return {k: v for k, v in logs.items() if v is not None}


def rl_progress(logs: dict) -> str:
    """The progress line's grpo/rloo part of one log: the summed reward (mean +- std), each
    function's mean, the completion length, the KL (beta > 0) and the clip ratio; "" otherwise
    (and for a log whose summed reward is None: no completion was scored)."""
    logs = _numbers(logs)
    if "reward" not in logs:
        return ""
    parts = [f"reward {logs['reward']:+.3f}" + (f" ±{logs['reward_std']:.3f}" if "reward_std" in logs else "")]
    functions = [k[len("rewards/"):-len("/mean")] for k in logs if k.startswith("rewards/") and k.endswith("/mean")]
    if len(functions) > 1:
        parts.append("(" + ", ".join(f"{n} {logs[f'rewards/{n}/mean']:+.2f}" for n in functions) + ")")
    if "completions/mean_length" in logs:
        parts.append(f"len {logs['completions/mean_length']:.0f}")
    if "kl" in logs:
        parts.append(f"kl {logs['kl']:.4f}")
    if "clip_ratio/region_mean" in logs:
        parts.append(f"clip {logs['clip_ratio/region_mean']:.3f}")
    return "  ".join(parts)
