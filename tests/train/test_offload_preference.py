"""activation_offload under TRL's preference trainers (issue 41 item 2).

TRL 1.16 switches checkpointing off around every reference forward and back on with
``model.gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)`` (trl/models/utils.py
``disable_gradient_checkpointing``; dpo_trainer.py ``_compute_loss``, kto_trainer.py). Those kwargs
carry ``offload: True`` (TrainingArguments copies activation_checkpointing_kwargs there), which
transformers' deprecated alias passes on to ``torch.utils.checkpoint`` instead of wrapping it in
``save_on_cpu``: from the second forward on, no offload. Here TRL's own trainers run several steps
and each step's policy forward must run its checkpointed layers inside transformers' save_on_cpu.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("trl")


def _offloaded_layers_per_step(tmp_path, model_dir, objective: str, extra: str = "", steps: int = 3) -> list[int]:
    import transformers.modeling_utils as modeling_utils
    from transformers import TrainerCallback

    from lowvram.planning.fixed import resolve_fixed
    from lowvram.recipe import load_recipe
    from lowvram.train.build.model import load_model
    from lowvram.train.build.trainer import build_trainer, build_training_args
    from lowvram.train.data.build import build_datasets
    from tests.train.test_kto import kto_recipe, write_unpaired
    from tests.train.test_preference import recipe_text, write_pairs

    if objective == "kto":
        write_unpaired(tmp_path / "rows.jsonl")
        text = kto_recipe(model_dir).replace("max_steps: 4", f"max_steps: {steps}")
    else:
        write_pairs(tmp_path / "pairs.jsonl")
        text = recipe_text(model_dir, objective=objective, steps=steps, extra=extra)
    (tmp_path / "r.yaml").write_text(text.replace("output_dir: out", f"output_dir: {tmp_path / 'out'}"))
    recipe = load_recipe(tmp_path / "r.yaml")
    # The planner sets activation_offload on GPU plans only; the mechanism is the same on the CPU
    # (transformers' save_on_cpu around each layer's checkpoint).
    plan = dataclasses.replace(resolve_fixed(recipe), gradient_checkpointing=True, activation_offload=True)
    loaded = load_model(recipe, plan)
    args = build_training_args(recipe, plan)
    args.save_strategy = "no"
    trainer = build_trainer(loaded, build_datasets(recipe, loaded.tokenizer), args, None)

    entered: list[int] = []
    real = modeling_utils.save_on_cpu

    def counting(pin_memory=False, device_type="cuda"):
        assert pin_memory  # transformers' offload pins; a CPU-only torch has no pinned allocator
        entered[-1] += 1
        return real(pin_memory=False, device_type=device_type)

    class PerStep(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            entered.append(0)

    trainer.add_callback(PerStep())
    modeling_utils.save_on_cpu = counting
    try:
        trainer.train()
    finally:
        modeling_utils.save_on_cpu = real
    return entered


@pytest.mark.parametrize("objective", ["dpo", pytest.param("kto", marks=pytest.mark.slow)])
def test_activation_offload_holds_on_every_preference_step(tmp_path, tiny_model_dir, objective):
    per_step = _offloaded_layers_per_step(tmp_path, tiny_model_dir, objective)
    layers = 2  # the tiny Llama
    # each step's policy forward under checkpointing: one save_on_cpu per layer (before the fix:
    # [2, 0, 0], the Trainer's own enabling in train() holding for the first forward only)
    assert per_step == [layers] * 3, per_step


def test_trl_reenabling_keeps_transformers_offload(tiny_model_dir):
    """The mechanism on its own: TRL's context manager, with the kwargs TRL passes (DPOConfig's
    gradient_checkpointing_kwargs as lowvram's TrainingArguments make them), around a model that
    lowvram prepared with activation_offload."""
    import tempfile

    from transformers import AutoModelForCausalLM
    from trl import DPOConfig
    from trl.models.utils import disable_gradient_checkpointing

    from lowvram.train.build.model import checkpointing_kwargs, enable_checkpointing

    plan = type("P", (), {"activation_offload": True})()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    enable_checkpointing(model, plan)
    args = DPOConfig(output_dir=tempfile.mkdtemp(), activation_checkpointing=True, report_to=[], use_cpu=True,
                     activation_checkpointing_kwargs=checkpointing_kwargs(plan))
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False, "offload": True}
    layer = model.model.layers[0]
    before = layer._gradient_checkpointing_func
    with disable_gradient_checkpointing(model, args.gradient_checkpointing_kwargs):
        assert not model.is_activation_checkpointing
    after = layer._gradient_checkpointing_func
    assert after.func.__name__ == before.func.__name__ == "checkpoint_func"  # save_on_cpu around checkpoint
    assert after.keywords == before.keywords == {"use_reentrant": False}
