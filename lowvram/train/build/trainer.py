"""(Recipe, Plan) -> TrainingArguments -> transformers.Trainer. No decisions here: each
technique in the Plan maps to one TrainingArguments setting (or a model setting in model.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from lowvram.errors import LowvramError
from lowvram.plan.memory.backward import CHUNK_TOKENS
from lowvram.plan.memory.preference import RL_OBJECTIVES
from lowvram.plan.setup import FSDP_OFFLOADS
from lowvram.vocab import (
    APOLLO_OPTIMIZERS,
    FUSED_BACKWARD_OPTIMIZERS,
    GALORE_8BIT_OPTIMIZERS,
    IN_BACKWARD_OPTIMIZERS,
    LOMO_OPTIMIZERS,
    OPTIMIZER_EXTRAS,
    PROJECTED_OPTIMIZERS,
    TORCHAO_OPTIMIZERS,
    TRAINER_OPTIMIZERS,
)


def output_dir(recipe) -> Path:
    """training.output_dir, relative to the recipe file (like data paths)."""
    return recipe.resolve_path(recipe.training.output_dir).resolve()


def precision_flags(plan) -> dict:
    """bf16/fp16 for the Trainer. bf16 = bf16 weights (model.py) + bf16 autocast; *-mixed = fp32
    weights + autocast; fp16 weights cannot be trained with the Trainer's GradScaler, so "fp16" also
    runs as autocast over whatever dtype model.py loaded.

    FSDP2 full fine-tuning in bf16 runs without the Trainer's autocast: with bf16=True the
    Accelerator's mixed precision is "bf16", and accelerate's fsdp2_prepare_model
    (accelerate/utils/fsdp_utils.py) then upcasts every trainable non-fp32 parameter to fp32
    (fp32 master weights, fp32 gradients and AdamW state: twice what the plan counts). Off, the
    shards stay bf16 and train in pure bf16, as the plan counts (plan.states.dtype_bytes) and as
    torchtune's FSDP2 recipes train (bf16 weights, no MixedPrecisionPolicy). LoRA is unaffected
    (its trainable adapters are fp32 already), a 4-bit base too (accelerate skips the upcast)."""
    mp = plan.mixed_precision
    if mp == "bf16" and not plan.lora and plan.offload in FSDP_OFFLOADS:
        return {"bf16": False, "fp16": False}
    return {"bf16": mp.startswith("bf16"), "fp16": mp.startswith("fp16")}


def projected_optimizer_arguments(plan) -> dict:
    """optimizer galore_adamw (and its 8-bit and layerwise forms): the Linears it projects (optim_target_modules, by name, as
    transformers' _setup_low_rank_optimizer matches them) and its optim_args; checks the extra."""
    if plan.optimizer not in PROJECTED_OPTIMIZERS + LOMO_OPTIMIZERS + TORCHAO_OPTIMIZERS:
        return {}
    import importlib.util

    extra, module = OPTIMIZER_EXTRAS[plan.optimizer]
    if importlib.util.find_spec(module) is None:
        raise LowvramError(f"optimizer {plan.optimizer} needs {module}, which is not installed",
                           f"pip install 'lowvram[{extra}]', or set techniques.optimizer: adamw_8bit")
    if plan.optimizer in LOMO_OPTIMIZERS:  # the Trainer hands lomo_optim the model itself: no arguments
        return {}
    if plan.optimizer in TORCHAO_OPTIMIZERS:  # block_size 256, the Trainer's default (plan/memory/optimizers/)
        _check_compiler(plan)
        return {}
    if not plan.optimizer_target_modules:
        raise LowvramError(f"optimizer {plan.optimizer} needs the model's architecture to pick the Linears it "
                           "projects, and the model's config could not be read",
                           "make model.name_or_path a folder with config.json or a catalog model")
    if plan.optimizer in APOLLO_OPTIMIZERS:  # galore.rank / update_proj_gap; APOLLO's own scale (1.0)
        return {"optim_target_modules": list(plan.optimizer_target_modules),
                "optim_args": f"rank={plan.galore_rank},update_proj_gap={plan.galore_update_proj_gap}"}
    return {"optim_target_modules": list(plan.optimizer_target_modules),
            "optim_args": f"rank={plan.galore_rank},update_proj_gap={plan.galore_update_proj_gap},"
                          f"scale={plan.galore_scale}"}


def _check_compiler(plan) -> None:
    """torchao's step is torch.compile'd: inductor's CPU backend builds C++ (it needs a compiler)."""
    import shutil

    if plan.device == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise LowvramError(f"optimizer {plan.optimizer} compiles its step with torch.compile, which needs a C++ "
                           "compiler on the CPU, and none (g++, c++, clang++) is on PATH",
                           "install one (apt-get install g++), or set techniques.optimizer: adamw_8bit")


def max_grad_norm(plan, asked: float) -> float:
    """training.max_grad_norm, or 0 under a layerwise GaLore optimizer or LOMO: its hooks step each
    parameter and set its .grad to None inside the backward (transformers _setup_low_rank_optimizer
    ``optimizer_hook``), so the Trainer's clip_grad_norm_ afterwards would clip nothing and log a
    norm of 0. A recipe that writes a max_grad_norm is refused before training
    (plan.request.check_optimizer); the default is dropped, as the plan's reason says."""
    return 0.0 if plan.optimizer in IN_BACKWARD_OPTIMIZERS else asked


def fsdp_on_cpu(plan) -> bool:
    """Whether this process trains on the CPU under an FSDP config (``--gpus N --cpu``)."""
    return plan.device == "cpu" and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"


def configure_cpu_fsdp_state() -> None:
    """Let accelerate run FSDP2 over gloo on the CPU (``lowvram train --gpus N --cpu``, offload fsdp).

    torch's ``fully_shard`` works on CPU tensors over gloo, but accelerate (1.15) turns its FSDP
    plugin on only for processes on an accelerator: ``PartialState._prepare_backend`` makes a
    ``cpu`` process MULTI_CPU, and ``AcceleratorState.__init__`` keeps the FSDP plugin only when
    the type is MULTI_GPU/NPU/XPU/... (accelerate/state.py). So we set up the process state here
    (gloo, device cpu), label it MULTI_GPU, the one thing that branch reads, and hand it to the
    Trainer with ``accelerator_config.use_configured_state`` (transformers' way to train on a
    state configured beforehand). The Accelerator then shards the model as on GPUs, on the CPU.
    tests/train/test_multi_gpu.py checks that accelerate still needs this and that it shards.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True)
    if state.distributed_type == DistributedType.MULTI_CPU:
        state.distributed_type = DistributedType.MULTI_GPU


def build_training_args(recipe, plan, has_eval: bool = False):
    """TrainingArguments of the Plan; a preference objective: TRL's config of the same settings
    plus its own (lowvram.train.build.preference)."""
    arguments = training_arguments(recipe, plan, has_eval)
    if recipe.training.objective in RL_OBJECTIVES:
        from lowvram.train.build.grpo import grpo_config

        return grpo_config(recipe, plan, arguments)
    if recipe.training.objective != "sft":
        from lowvram.train.build.preference import preference_config

        return preference_config(recipe, plan, arguments)
    from transformers import TrainingArguments

    return TrainingArguments(**arguments)


def training_arguments(recipe, plan, has_eval: bool = False) -> dict:
    """The TrainingArguments keywords of the Plan (each technique one setting)."""
    from lowvram.train.build.loss import fused_loss_arguments
    from lowvram.train.build.model import checkpointing_kwargs

    # FSDP/DeepSpeed come from the accelerate config `lowvram train` launches with (the Trainer's
    # Accelerator reads ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED); in-process they cannot.
    launched = any(os.environ.get(k, "").lower() == "true" for k in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"))
    if plan.offload != "none" and not launched:
        raise LowvramError(
            f"offload={plan.offload} runs through accelerate (DeepSpeed/FSDP), not in this process",
            "run `lowvram train RECIPE` from the command line (it launches accelerate), or set techniques.offload: off",
        )
    if plan.mixed_precision == "fp16" and not plan.lora:
        # fp16 weights cannot take the Trainer's loss-scaled updates (GradScaler refuses fp16 grads).
        raise LowvramError(
            "mixed_precision fp16 (16-bit weights) cannot train all weights",
            "use techniques.mixed_precision: fp16-mixed (fp32 master weights), or lora: on",
        )
    if plan.mixed_precision.startswith("fp16") and plan.optimizer in IN_BACKWARD_OPTIMIZERS:
        # the planner never makes this plan (plan.optimizers.scaled_gradient_problem); one made
        # elsewhere stops here, before the model loads
        from lowvram.plan.memory.optimizers import FP16_IN_BACKWARD_WHY, in_backward_alternative

        raise LowvramError(f"optimizer {plan.optimizer} cannot train in {plan.mixed_precision}: {FP16_IN_BACKWARD_WHY}",
                           f"set techniques.optimizer: {in_backward_alternative(plan.optimizer)}, or "
                           "techniques.mixed_precision: bf16 (or fp32)")
    configured = {}
    if fsdp_on_cpu(plan):
        configure_cpu_fsdp_state()
        configured = {"accelerator_config": {"use_configured_state": True}}
    t = recipe.training
    steps = {"max_steps": t.max_steps} if t.max_steps else {"num_train_epochs": t.epochs}
    if has_eval:
        # eval_steps unset: evaluate at the end only (run.py calls evaluate()).
        evals = {"eval_strategy": "steps", "eval_steps": t.eval_steps} if t.eval_steps else {"eval_strategy": "no"}
    else:
        evals = {"eval_strategy": "no"}
    return dict(
        output_dir=str(output_dir(recipe)),
        per_device_train_batch_size=plan.micro_batch_size,
        per_device_eval_batch_size=plan.micro_batch_size,
        gradient_accumulation_steps=plan.grad_accum,
        # transformers 5 name; gradient_checkpointing is its deprecated alias (removed in v6).
        activation_checkpointing=plan.gradient_checkpointing,
        # non-reentrant; activation_offload adds transformers' offload (train/build/model.py)
        activation_checkpointing_kwargs=checkpointing_kwargs(plan) if plan.gradient_checkpointing else None,
        optim=TRAINER_OPTIMIZERS[plan.optimizer],
        **projected_optimizer_arguments(plan),
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup_ratio,  # a float < 1 is a fraction of the total steps (transformers 5)
        weight_decay=t.weight_decay,
        max_grad_norm=max_grad_norm(plan, t.max_grad_norm),
        **steps,
        **evals,
        **precision_flags(plan),
        use_cpu=plan.device == "cpu",
        logging_strategy="steps",
        logging_steps=t.logging_steps,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=t.save_steps,
        # Rotation is train/run/guard.py's: a checkpoint counts against training.save_total_limit only
        # once the step after it is finite (the Trainer's own would rotate the last finite one away).
        save_total_limit=None,
        # A non-finite step is read as it is (train/run/guard.py stops or skips it): the filter would log it
        # as the window's average, 0.0 right after a log (transformers Trainer._run_epoch).
        logging_nan_inf_filter=False,
        seed=t.seed,
        data_seed=t.seed,
        report_to=[] if t.report_to == "none" else [t.report_to],
        remove_unused_columns=False,  # our columns are exactly what the model takes
        include_num_input_tokens_seen="non_padding",
        disable_tqdm=True,  # progress.py draws the bar
        dataloader_pin_memory=plan.device == "cuda",
        # Every trainable parameter (adapters or all weights) takes part in each forward: DDP need
        # not search the graph for unused ones (an extra traversal per step, and a warning).
        ddp_find_unused_parameters=False,
        **fused_loss_arguments(plan),  # loss fused: Liger's fused linear cross-entropy
        **configured,
    )


def _forget_bitsandbytes_overrides() -> None:
    """Start a Trainer with none of bitsandbytes' per-parameter overrides. Its GlobalOptimManager is
    one per process: the Trainer registers every Embedding weight for 32-bit state
    (Trainer.create_optimizer), and an 8-bit optimizer's first step records that override by
    position, index2config[(group, index)] (bitsandbytes optim/optimizer.py check_overrides). A
    second Trainer in the same process (train_with_recovery's re-plan after an OOM, a test after a
    test) then gave 32-bit state to whatever sat at that position: with the layerwise 8-bit forms
    (one optimizer a parameter, each at (0, 0)) every parameter's. A new process starts empty;
    this makes a new Trainer start the same."""
    import sys

    bnb = sys.modules.get("bitsandbytes")
    if bnb is not None:
        bnb.optim.GlobalOptimManager.get_instance().initialize()


def build_trainer(loaded, bundle, args, collator, callbacks=(), loss: str = "standard",
                  loss_chunk_tokens: int = CHUNK_TOKENS, optimizer: str = "adamw", recipe=None):
    """The Hugging Face Trainer over a DataBundle (lowvram.train.data); ``loss`` is plan.loss
    ("chunked": lowvram.train.build.loss computes the training loss in chunks of plan.loss_chunk_tokens
    tokens; "fused": the plain Trainer, whose ``use_liger_kernel`` argument patches the model's loss).
    ``optimizer``: plan.optimizer (adamw_in_backward: lowvram.train.build.in_backward steps each parameter in
    its gradient hook; galore_adamw_8bit and its layerwise form: lowvram.train.build.galore_cpu lets its
    step run without CUDA). ``recipe``: grpo/rloo's rewards (lowvram.train.build.grpo)."""
    from transformers import PrinterCallback, Trainer

    from lowvram.train.build.preference import build_preference_trainer, is_preference_config

    _forget_bitsandbytes_overrides()
    from lowvram.train.build.grpo import build_rl_trainer, is_rl_config

    if is_rl_config(args):  # training.objective grpo/rloo: TRL's trainer generates and scores
        return build_rl_trainer(loaded, bundle, args, recipe, callbacks)
    if is_preference_config(args):  # training.objective dpo/orpo/simpo: TRL's trainer, its collator
        return build_preference_trainer(loaded, bundle, args, callbacks)
    if loss == "chunked":
        from lowvram.train.build.loss import chunked_loss_trainer_class

        Trainer = chunked_loss_trainer_class(loss_chunk_tokens)  # noqa: N806 - a Trainer subclass
    if optimizer in FUSED_BACKWARD_OPTIMIZERS:
        from lowvram.train.build.in_backward import in_backward_trainer_class

        Trainer = in_backward_trainer_class(Trainer)  # noqa: N806 - a Trainer subclass
    if optimizer in GALORE_8BIT_OPTIMIZERS:  # without CUDA: its step's torch.cuda.synchronize() a no-op
        from lowvram.train.build.galore_cpu import allow_cpu_step

        allow_cpu_step()
    trainer = Trainer(
        model=loaded.model,
        args=args,
        data_collator=collator,
        train_dataset=bundle.train,
        eval_dataset=bundle.eval,
        processing_class=loaded.tokenizer,
        callbacks=list(callbacks),
    )
    # With disable_tqdm the Trainer prints every log dict; progress.py reports instead.
    trainer.remove_callback(PrinterCallback)
    return trainer
