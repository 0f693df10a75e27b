"""Preference tuning through TRL 1.16: training.objective dpo (trl.DPOTrainer), orpo
(trl.experimental.orpo.ORPOTrainer), simpo (trl.experimental.cpo.CPOTrainer, loss_type simpo) or
kto (trl.KTOTrainer, loss_type kto: unpaired rows, or pairs that TRL unpairs itself).

The same Plan -> configuration mapping as SFT: every TrainingArguments setting comes from
lowvram.train.build.trainer.training_arguments (precision, checkpointing, optimizer, batch, accumulation,
FSDP/DeepSpeed through the launch), and the model arrives prepared by lowvram.train.build.model
(LoRA/QLoRA adapters, checkpointing) exactly as for SFT. What TRL adds is named in its config
below; the memory each keeps is lowvram.plan.memory.preference's.

- The reference model (dpo): with LoRA, TRL disables the adapter for the reference forward
  (DPOTrainer.__init__: ``ref_model = None`` for a peft model; ``_compute_loss``: ``use_adapter(...,
  None)``), no second copy. Full fine-tuning: TRL loads a frozen second copy from the policy's
  folder (``create_model_from_path``, the policy's dtype), unless
  preference.precompute_ref_log_probs, which computes the reference log-probs in a pass over the
  data before training (``_precompute_ref_logps``) and keeps no reference.
- TRL's own collators pad each pair (DataCollatorForPreference, DPODataCollatorWithPadding); the
  sequence limit is training.seq_len (TRL's max_length).
"""

from __future__ import annotations

from lowvram.errors import LowvramError
from lowvram.metrics import OBJECTIVE_METRIC_KEYS
from lowvram.train.data.preference import require_trl

# Each objective's TRL trainer, as (module, trainer class, config class).
TRAINERS = {
    "dpo": ("trl", "DPOTrainer", "DPOConfig"),
    "orpo": ("trl.experimental.orpo", "ORPOTrainer", "ORPOConfig"),
    "simpo": ("trl.experimental.cpo", "CPOTrainer", "CPOConfig"),
    "kto": ("trl", "KTOTrainer", "KTOConfig"),
}


def _classes(objective: str):
    import importlib
    import warnings

    require_trl()
    module, trainer, config = TRAINERS[objective]
    with warnings.catch_warnings():  # trl.experimental warns on import that its API may change
        warnings.simplefilter("ignore")
        mod = importlib.import_module(module)
    return getattr(mod, trainer), getattr(mod, config)


def objective_settings(recipe) -> dict:
    """TRL's own config keys for the recipe's objective and preference section."""
    p, objective = recipe.preference, recipe.training.objective
    common = {"beta": p.beta, "max_length": recipe.training.seq_len}
    if objective == "dpo":
        return {**common, "loss_type": [p.loss_type], "label_smoothing": p.label_smoothing,
                "precompute_ref_log_probs": p.precompute_ref_log_probs,
                "padding_free": p.padding_free}  # always False: the recipe refuses true (schema.py)
    if objective == "simpo":
        # SimPO (Meng et al. 2024) is CPO's simpo loss without CPO's behaviour-cloning term:
        # TRL's docs set cpo_alpha=0 for it (trl/experimental/cpo/cpo_config.py).
        return {**common, "loss_type": "simpo", "cpo_alpha": 0.0, "simpo_gamma": p.simpo_gamma,
                "label_smoothing": p.label_smoothing}
    if objective == "kto":
        # loss_type kto estimates the KL term from the batch's mismatched rows, which needs TRL's
        # sequential sampler (KTOConfig's default) and a micro-batch of 2 or more (planned so)
        return {**common, "loss_type": "kto", "desirable_weight": p.desirable_weight,
                "undesirable_weight": p.undesirable_weight,
                "precompute_ref_log_probs": p.precompute_ref_log_probs}
    return common  # orpo: beta is ORPO's lambda


def trl_config_kwargs(plan, objective: str, arguments: dict, loss: str) -> dict:
    """The keywords every TRL config of lowvram starts from: the SFT TrainingArguments keywords,
    checkpointing and bf16/fp16 passed explicitly (TRL's configs default both on), and a loss other
    than TRL's own refused (``loss``: whose loss TRL computes, for the message)."""
    if plan.loss != "standard":
        raise LowvramError(f"loss {plan.loss} does not apply to training.objective {objective}",
                           f"TRL computes the {loss} loss itself; set techniques.loss: standard or auto")
    kwargs = {**arguments, "gradient_checkpointing": arguments.get("activation_checkpointing", False)}
    kwargs.setdefault("bf16", False)
    kwargs.setdefault("fp16", False)
    return kwargs


def preference_config(recipe, plan, arguments: dict):
    """The TRL config (a TrainingArguments subclass) of ``arguments`` (the SFT TrainingArguments
    keywords, lowvram.train.build.trainer.training_arguments) plus the objective's own settings.
    TRL's configs default gradient checkpointing and bf16 on (trl/trainer/base_config.py): both
    are passed explicitly from the Plan, as every other setting."""
    objective = recipe.training.objective
    kwargs = trl_config_kwargs(plan, objective, arguments, "preference")
    _, config_class = _classes(objective)
    if objective in ("orpo", "simpo"):
        # ORPO/CPO batches hold chosen_input_ids and rejected_input_ids, no input_ids: the
        # Trainer's token count would warn at every step and count nothing
        kwargs["include_num_input_tokens_seen"] = "no"
    return config_class(**kwargs, **objective_settings(recipe))


def is_preference_config(args) -> bool:
    return type(args).__module__.startswith("trl.")


def build_preference_trainer(loaded, bundle, args, callbacks=()):
    """TRL's trainer for ``args`` (from preference_config) over the preference pairs in
    ``bundle`` (lowvram.train.data.build: prompt/chosen/rejected); the model as loaded."""
    from transformers import PrinterCallback

    objective = {v[2]: k for k, v in TRAINERS.items()}[type(args).__name__]
    trainer_class, _ = _classes(objective)
    trained = _trainable_dtypes(loaded.model)
    trainer = trainer_class(
        model=loaded.model,
        args=args,
        train_dataset=bundle.train,
        eval_dataset=bundle.eval,
        processing_class=loaded.tokenizer,
        callbacks=list(callbacks),
    )
    trainer.remove_callback(PrinterCallback)  # progress.py reports, as for SFT
    _restore_dtypes(trainer.model, trained)
    return trainer


def _trainable_dtypes(model) -> dict:
    return {name: p.dtype for name, p in model.named_parameters() if p.requires_grad}


def _restore_dtypes(model, dtypes: dict) -> None:
    """The trained parameters back in the dtype lowvram.train.build.model gave them (fp32 LoRA adapters,
    as SFT trains them and plan/memory/states.py counts them, with fp32 AdamW state). Over a 4/8-bit base,
    TRL 1.16's DPOTrainer and KTOTrainer cast every trainable parameter but DoRA's magnitude to
    bf16 in __init__ ("to follow the recommendations of the QLoRA paper", dpo_trainer.py L726-729,
    kto_trainer.py L777-780): DPO would train other adapters than SFT of the same recipe, and bf16
    ones on an fp16-only card. The optimizer is made later (Trainer.train), so it sees these."""
    for name, p in model.named_parameters():
        if name in dtypes and p.dtype != dtypes[name]:
            p.data = p.data.to(dtypes[name])


def longest_tokenized_row(dataset, objective: str, max_length: int) -> int:
    """The longest row a batch of ``dataset`` (the trainer's train_dataset, as TRL tokenized it
    in its __init__) can reach, truncated as TRL truncates it; TRL pads each batch to its longest
    row, so a run on shorter pairs peaks there, not at max_length (training.seq_len).

    - dpo: prompt_ids, chosen_ids, rejected_ids; DataCollatorForPreference truncates prompt +
      completion to max_length (keep_start, dpo_trainer.py L152-165).
    - orpo, simpo: chosen_input_ids and rejected_input_ids hold the prompt already, truncated to
      max_length by ``tokenize_row`` (orpo_trainer.py L520-545, cpo_trainer.py alike).
    - kto: prompt_ids, completion_ids, truncated to max_length by DataCollatorForUnpairedPreference
      (kto_trainer.py L163-178); its KL rows pair a prompt with another row's completion, so the
      bound taken is the longest prompt plus the longest completion (truncated)."""
    cols = dataset.column_names
    if objective == "dpo":
        rows = (len(p) + max(len(c), len(r))
                for p, c, r in zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"], strict=True))
        return min(max(rows, default=0), max_length)
    if objective == "kto":
        return min(max(map(len, dataset["prompt_ids"]), default=0) + max(map(len, dataset["completion_ids"]), default=0),
                   max_length)
    if "chosen_input_ids" in cols:  # orpo, simpo
        return min(max(max(map(len, dataset["chosen_input_ids"]), default=0),
                       max(map(len, dataset["rejected_input_ids"]), default=0)), max_length)
    raise LowvramError(f"cannot read the tokenized pairs of objective {objective} (columns {', '.join(cols)})",
                       "this TRL version tokenizes otherwise than TRL 1.16 (lowvram's pin): pip install trl==1.16.0")


# The metrics each objective's trainer logs (TRL 1.16: DPOTrainer._compute_loss, ORPOTrainer and
# CPOTrainer.get_batch_loss_metrics), the ones `lowvram runs` and `show` report.
REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
# Each objective's own terms beside the rewards: KTO's KL estimate (kto_trainer.py ``kl``), ORPO's
# log odds ratio and the chosen's log odds (orpo_trainer.py get_batch_loss_metrics), ORPO's and
# SimPO's NLL on the chosen rows (``nll_loss``; SimPO runs with cpo_alpha 0, logged all the same)
OBJECTIVE_METRICS = OBJECTIVE_METRIC_KEYS


def preference_metrics(log_history: list[dict]) -> dict:
    """metrics.json's preference part: each reward metric's history ([[step, value], ...]) and
    its last value, from the Trainer's log history; {} for an SFT run (no such keys logged)."""
    out: dict = {}
    for key in REWARD_METRICS + OBJECTIVE_METRICS:
        points = [[e["step"], float(e[key])] for e in log_history
                  if e.get(key) is not None and "step" in e]  # TRL logs None for a window without a value
        if points:
            name = key.replace("/", "_")  # rewards_margins
            out[f"{name}_history"] = points
            out[name] = points[-1][1]
    return out
