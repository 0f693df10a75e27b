"""The plan for a model whose architecture cannot be read (a hub id not cached here): every
technique resolved without a memory model, and the plan says its memory was not predicted. The
golden snapshot covers only predicted plans; these pin the unpredicted path (`lowvram train` and
`lowvram plan RECIPE`)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lowvram.errors import LowvramError
from lowvram.hardware import Device, Hardware
from lowvram.planning.entry import make_plan, plan_for_recipe
from lowvram.recipe import parse_recipe

GB = 2**30
CARDS = {
    "cuda": Hardware("cuda", (Device(0, "fake 24GB", 24 * GB, 24 * GB, (8, 6), True),),
                     host_total_bytes=64 * GB, host_available_bytes=60 * GB),
    "t4": Hardware("cuda", (Device(0, "fake T4", 16 * GB, 16 * GB, (7, 5), False),),
                   host_total_bytes=64 * GB, host_available_bytes=60 * GB),
    "cpu": Hardware("cpu", (), host_total_bytes=64 * GB, host_available_bytes=60 * GB),
}
MODEL = "someorg/not-cached-model"  # a hub id: no catalog entry, no cached config.json


def recipe(techniques: str = "", training: str = "", model: str = ""):
    text = (f"model: {{name_or_path: {MODEL}{', ' + model if model else ''}}}\n"
            "data: {datasets: [{path: d.jsonl}]}\n")
    text += f"training: {{{training}}}\n" if training else ""
    text += f"techniques: {{{techniques}}}\n" if techniques else ""
    return parse_recipe(text, "r.yaml")


FIELDS = ("mixed_precision", "gradient_checkpointing", "micro_batch_size", "grad_accum", "lora",
          "quantization", "optimizer", "offload", "attention", "loss", "gpus", "activation_offload")


def settings(plan) -> tuple:
    return tuple(getattr(plan, f) for f in FIELDS)


# (techniques, training, model, card, gpus) -> precision, checkpointing, micro, accumulation,
# lora, quantization, optimizer, offload, attention, loss, gpus, activation offload
CASES = [
    ("", "", "", "cuda", 1, ("bf16", False, 4, 4, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("", "", "", "t4", 1, ("fp16-mixed", False, 4, 4, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("", "", "", "cpu", 1, ("fp32", False, 4, 4, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("", "", "", "cuda", 2, ("bf16", False, 4, 2, True, "none", "adamw", "none", "sdpa", "standard", 2, False)),
    ("", "batch_size: 6", "", "cuda", 1, ("bf16", False, 3, 2, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("", "batch_size: 7", "", "cuda", 1, ("bf16", False, 1, 7, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("", "batch_size: 1", "", "cuda", 1, ("bf16", False, 1, 1, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("gradient_accumulation: 2", "", "", "cuda", 1, ("bf16", False, 8, 2, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("gradient_accumulation: 'off'", "", "", "cuda", 2, ("bf16", False, 8, 1, True, "none", "adamw", "none", "sdpa", "standard", 2, False)),
    ("", "micro_batch_size: 2", "", "cuda", 1, ("bf16", False, 2, 8, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("quantization: 'on'", "", "", "cuda", 1, ("bf16", False, 4, 4, True, "nf4-dq", "adamw", "none", "sdpa", "standard", 1, False)),
    ("quantization: int8, lora: 'on'", "", "", "t4", 1, ("fp16-mixed", False, 4, 4, True, "int8", "adamw", "none", "sdpa", "standard", 1, False)),
    ("lora: 'off'", "", "", "cuda", 1, ("bf16", False, 4, 4, False, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("activation_offload: 'on'", "", "", "cuda", 1, ("bf16", True, 4, 4, True, "none", "adamw", "none", "sdpa", "standard", 1, True)),
    ("gradient_checkpointing: 'on'", "", "", "cpu", 1, ("fp32", True, 4, 4, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("loss: fused", "", "", "cpu", 1, ("fp32", False, 4, 4, True, "none", "adamw", "none", "sdpa", "chunked", 1, False)),
    ("loss: chunked", "", "", "cuda", 1, ("bf16", False, 4, 4, True, "none", "adamw", "none", "sdpa", "chunked", 1, False)),
    ("mixed_precision: 'off'", "", "", "cuda", 1, ("fp32", False, 4, 4, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("mixed_precision: 'on'", "", "", "t4", 1, ("fp16-mixed", False, 4, 4, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("mixed_precision: fp16-mixed", "", "", "cuda", 1, ("fp16-mixed", False, 4, 4, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("", "", "dtype: float32", "cuda", 1, ("bf16-mixed", False, 4, 4, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("", "", "dtype: float32", "t4", 1, ("fp16-mixed", False, 4, 4, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("", "", "dtype: bfloat16", "cpu", 1, ("bf16", False, 4, 4, True, "none", "adamw", "none", "sdpa", "standard", 1, False)),
    ("optimizer: 'on'", "", "", "cuda", 1, ("bf16", False, 4, 4, True, "none", "adamw_8bit", "none", "sdpa", "standard", 1, False)),
    ("offload: 'on'", "", "", "cuda", 1, ("bf16", False, 4, 4, True, "none", "adamw", "optimizer", "sdpa", "standard", 1, False)),
    ("offload: zero3", "", "", "cuda", 2, ("bf16", False, 4, 2, True, "none", "adamw", "zero3", "sdpa", "standard", 2, False)),
    ("attention: eager", "", "", "cuda", 1, ("bf16", False, 4, 4, True, "none", "adamw", "none", "eager", "standard", 1, False)),
]


@pytest.mark.parametrize("techniques, training, model, card, gpus, expected", CASES)
def test_unpredicted_plan_settings(techniques, training, model, card, gpus, expected):
    plan = plan_for_recipe(recipe(techniques, training, model), hardware=CARDS[card], gpus=gpus)
    assert settings(plan) == expected
    assert plan.predicted_peak_bytes is None and plan.budget_bytes is None and plan.fits is None
    assert plan.breakdown == {} and plan.host_ram_bytes is None
    assert plan.reasons["memory"] == (f"memory not predicted: unknown model '{MODEL}' "
                                      "(fixed defaults used)")
    assert plan.effective_batch == recipe(techniques, training, model).training.batch_size


def test_unpredicted_plan_carries_the_recipe_run_setup():
    r = recipe(training="seq_len: 2048")
    r = parse_recipe(r.to_yaml().replace("r: 16", "r: 8").replace("alpha: 32", "alpha: 16"), "r.yaml")
    plan = plan_for_recipe(r, hardware=CARDS["cuda"])
    assert (plan.seq_len, plan.lora_r, plan.lora_alpha, plan.lora_targets) == (2048, 8, 16, ("all-linear",))


def test_unpredicted_reasons_say_what_was_defaulted():
    plan = plan_for_recipe(recipe(), hardware=CARDS["cuda"])
    assert plan.reasons == {
        "mixed_precision": "the card supports bf16: 16-bit weights, half the memory of fp32",
        "lora": "default: train LoRA adapters (16 bytes per adapter param instead of per weight)",
        "quantization": "default: full-precision base",
        "optimizer": "default: torch AdamW",
        "offload": "default: no offload",
        "gradient_checkpointing": "default: off",
        "activation_offload": "default: off",
        "gradient_accumulation": "micro-batch 4 x 4 steps = batch 16",
        "attention": "default: SDPA (no s x s matrix stored)",
        "tiled_mlp": "default: off",
        "loss": "default: standard cross-entropy",
        "memory": f"memory not predicted: unknown model '{MODEL}' (fixed defaults used)",
    }
    cpu = plan_for_recipe(recipe("activation_offload: 'on'"), hardware=CARDS["cpu"]).reasons
    assert cpu["mixed_precision"] == "CPU run: fp32 (bf16 on CPU is slower here); mixed precision applies on a GPU"
    assert cpu["activation_offload"] == "off on the CPU: activations are in host RAM already"
    fused = plan_for_recipe(recipe("loss: fused"), hardware=CARDS["cpu"]).reasons["loss"]
    assert fused.startswith("chunked: ") and "fused" in fused and "the chunked loss runs instead" in fused


@pytest.mark.parametrize("techniques, training, gpus, message", [
    ("gradient_accumulation: 3", "", 1, "is not divisible by"),
    ("", "micro_batch_size: 3", 1, "is not divisible by"),
    ("", "batch_size: 7", 2, "batch_size 7 is not divisible by 2 GPUs"),
])
def test_unpredicted_plan_refuses_a_batch_that_does_not_divide(techniques, training, gpus, message):
    with pytest.raises(LowvramError, match=message) as e:
        plan_for_recipe(recipe(techniques, training), hardware=CARDS["cuda"], gpus=gpus)
    assert "batch_size" in e.value.hint or "multiple" in e.value.hint


def test_plan_and_train_agree_on_the_unpredicted_plan(monkeypatch):
    """`lowvram plan RECIPE --vram` (no card queried, bf16 assumed) and `lowvram train` on a bf16
    card give the same unpredicted plan."""
    monkeypatch.delenv("LOWVRAM_VRAM", raising=False)
    shown = make_plan(recipe("gradient_checkpointing: 'on'"), vram="24GB")
    trained = plan_for_recipe(recipe("gradient_checkpointing: 'on'"), hardware=CARDS["cuda"])
    assert settings(shown) == settings(trained)
    assert shown.reasons["memory"] == trained.reasons["memory"]


def test_cli_plan_json_of_an_unpredicted_recipe(tmp_path, monkeypatch):
    from lowvram.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tmp_path / "r.yaml"
    path.write_text(f"model: {{name_or_path: {MODEL}}}\ndata: {{datasets: [{{path: d.jsonl}}]}}\n"
                    "techniques: {quantization: 'on'}\n")
    r = CliRunner().invoke(app, ["plan", str(path), "--vram", "24GB", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["fits"], d["peak_bytes"], d["breakdown"]) == (None, None, None)
    assert d["techniques"] == {
        "mixed_precision": "bf16", "gradient_checkpointing": False, "gradient_accumulation": 4,
        "lora": True, "quantization": "nf4-dq", "optimizer": "adamw", "offload": "none",
        "activation_offload": False, "attention": "sdpa", "loss": "standard", "tiled_mlp": False,
    }
    assert (d["micro_batch_size"], d["grad_accum"]) == (4, 4)
    assert d["reasons"]["memory"].startswith("memory not predicted: unknown model")


def test_unpredicted_plan_follows_the_search_where_it_used_to_differ(monkeypatch):
    """The fixed choices the old fixed defaults resolved otherwise than the search (issue 25 item
    5): mixed_precision off is fp32 whatever model.dtype; a micro-batch and an accumulation that do
    not make the batch are refused; the flags of `lowvram plan` apply. An activation offload asked
    for on a CPU still turns checkpointing on (the request needs it) and then runs without it."""
    monkeypatch.delenv("LOWVRAM_VRAM", raising=False)
    f32_off = plan_for_recipe(recipe("mixed_precision: 'off'", model="dtype: float32"), hardware=CARDS["cuda"])
    assert f32_off.mixed_precision == "fp32"
    assert f32_off.reasons["mixed_precision"] == "set by the recipe; fp32 weights and compute (2x the memory of bf16)"
    with pytest.raises(LowvramError, match=r"micro_batch_size 2 x gradient_accumulation 2 x 1 GPU\(s\) != batch_size 16"):
        plan_for_recipe(recipe("gradient_accumulation: 2", "micro_batch_size: 2"), hardware=CARDS["cuda"])
    cpu = plan_for_recipe(recipe("activation_offload: 'on'"), hardware=CARDS["cpu"])
    assert (cpu.gradient_checkpointing, cpu.activation_offload) == (True, False)
    assert cpu.reasons["gradient_checkpointing"] == "on: activation_offload needs it"
    flagged = make_plan(recipe("gradient_accumulation: 2"), vram="24GB", method="full", gpus=2, optimizer="adamw_8bit")
    assert (flagged.lora, flagged.optimizer, flagged.gpus, flagged.micro_batch_size, flagged.grad_accum) == (
        False, "adamw_8bit", 2, 4, 2)
    assert flagged.reasons["lora"] == "set by --method full"
    assert flagged.reasons["optimizer"] == "set by --optimizer adamw_8bit"
    assert flagged.reasons["gradient_accumulation"] == "micro-batch 4 x 2 steps = batch 16; set by the recipe"
    with pytest.raises(LowvramError, match="flash_attention_2.*cannot run here"):
        make_plan(recipe("attention: flash_attention_2, mixed_precision: 'off'"), vram="24GB")


@pytest.mark.parametrize("techniques, training, flags", [
    ("gradient_accumulation: 3", "", {}), ("", "micro_batch_size: 3", {"gpus": 2}),
    ("", "batch_size: 7", {"gpus": 2}), ("quantization: nf4", "", {"method": "full", "quantization": "nf4"}),
    ("offload: fsdp", "", {"gpus": 2, "optimizer": "adamw_8bit"}),
    ("activation_offload: 'on'", "", {"gradient_checkpointing": False}),
])
def test_unpredicted_and_predicted_plans_refuse_alike(techniques, training, flags):
    """One statement of the rules (lowvram.plan.choose.request.validate_request): a recipe whose model
    cannot be read is refused with the words a catalog model gets."""
    known = recipe(techniques, training).model_copy(
        update={"model": recipe().model.model_copy(update={"name_or_path": "smollm2-135m"})})
    errors = []
    for r in (recipe(techniques, training), known):
        with pytest.raises(LowvramError) as e:
            make_plan(r, vram="24GB", **flags)
        errors.append((e.value.message, e.value.hint))
    assert errors[0] == errors[1]
