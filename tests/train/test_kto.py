"""KTO (training.objective kto) through TRL's KTOTrainer: unpaired rows (format: unpaired) and
pairs TRL unpairs itself, their errors by file and line, the plan's rows and reference, the
micro-batch of 2 that TRL needs, and `lowvram train` end to end on the tiny Llama."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.errors import LowvramError
from lowvram.recipe import parse_recipe
from tests.train.test_preference import _setup, recipe_text, write_pairs

pytest.importorskip("trl")


def write_unpaired(path: Path, n: int = 24) -> Path:
    with path.open("w") as f:
        for i in range(n):
            a, b = i % 10, (3 * i) % 10
            good = i % 2 == 0
            row = {"prompt": f"Add {a} and {b}.", "completion": f" The answer is {a + b + (0 if good else 1)}.",
                   "label": good}
            f.write(json.dumps(row) + "\n")
    return path


def kto_recipe(model_dir, fmt="unpaired", data="rows.jsonl", **kw) -> str:
    return recipe_text(model_dir, objective="kto", data=data, **kw).replace("format: preference", f"format: {fmt}")


def test_kto_formats_are_checked():
    assert parse_recipe(kto_recipe("m")).training.objective == "kto"
    assert parse_recipe(kto_recipe("m", fmt="preference")).data.datasets[0].format == "preference"
    with pytest.raises(LowvramError) as e:
        parse_recipe(kto_recipe("m", fmt="alpaca"))
    assert "does not train on format alpaca" in str(e.value)
    with pytest.raises(LowvramError) as e:  # unpaired rows are KTO's alone
        parse_recipe(recipe_text("m", objective="dpo").replace("format: preference", "format: unpaired"))
    assert "does not train on format unpaired" in str(e.value)


@pytest.mark.parametrize("bad, words", [
    ({"prompt": "Q?", "completion": " yes"}, "field 'label' must be true"),
    ({"prompt": "Q?", "completion": " yes", "label": "maybe"}, "field 'label' must be true"),
    ({"prompt": "", "completion": " yes", "label": True}, "field 'prompt': expected non-empty text"),
    ({"prompt": "Q?", "label": False}, "missing field 'completion'"),
    ({"prompt": "Q?", "completion": " yes", "label": [True]}, "field 'label' must be true"),
])
def test_bad_unpaired_rows_are_named_by_file_and_line(tmp_path, bad, words):
    from lowvram.recipe import load_recipe
    from lowvram.train.data.build import build_datasets

    good = {"prompt": "Q?", "completion": " yes", "label": True}
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [good, good, bad]))
    (tmp_path / "r.yaml").write_text(kto_recipe("m"))
    with pytest.raises(LowvramError) as e:
        build_datasets(load_recipe(tmp_path / "r.yaml"), None)
    assert str(e.value).startswith("rows.jsonl:3: ") and words in str(e.value), str(e.value)
    assert "label" in e.value.hint


def test_unpaired_labels_read_as_bools():
    from lowvram.recipe import DatasetSpec
    from lowvram.train.data.preference import unpaired_row

    spec = DatasetSpec(path="x.jsonl", format="unpaired", fields={"label": "kto_tag"})
    assert unpaired_row({"prompt": "Q", "completion": "A", "kto_tag": "true"}, spec)["label"] is True
    assert unpaired_row({"prompt": "Q", "completion": "A", "kto_tag": 0}, spec)["label"] is False


def test_kto_plans_one_row_per_example_and_the_reference():
    from lowvram.plan.memory import preference
    from lowvram.plan.memory.activations import activation_bytes
    from lowvram.plan.memory.memory import estimate_memory
    from lowvram.plan.memory.states import weight_bytes

    kto, dpo, sft = _setup(objective="kto"), _setup(objective="dpo"), _setup()
    assert preference.policy_setup(kto).micro_batch_size == 2  # b rows, not 2b
    assert activation_bytes(preference.policy_setup(kto)) == activation_bytes(replace(sft, padded=True))  # TRL pads
    # the same fused head as DPO over half the positions
    assert preference.dpo_saved_bytes(kto) * 2 == preference.dpo_saved_bytes(dpo)
    # full fine-tuning: a frozen reference copy as DPO's; none when precomputed or under LoRA
    assert estimate_memory(kto).breakdown["weights"] == estimate_memory(sft).breakdown["weights"] + weight_bytes(sft)
    assert preference.reference_weight_bytes(_setup(objective="kto", precompute_ref=True)) == 0
    assert preference.reference_weight_bytes(_setup(objective="kto", lora=True)) == 0
    qlora = dict(lora=True, quantization="nf4-dq")  # the forward/backward binds, not the optimizer step
    assert estimate_memory(_setup(objective="kto", **qlora)).peak_bytes < estimate_memory(
        _setup(objective="dpo", **qlora)).peak_bytes


def test_kto_needs_a_micro_batch_of_two():
    ok = CliRunner().invoke(app, ["plan", "--objective", "kto", "--model", "llama-3.1-8b", "--method", "qlora",
                                  "--vram", "12GB", "--batch-size", "4", "--json"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.output)
    assert data["objective"] == "kto" and data["micro_batch_size"] >= 2
    assert data["reference_model"] == "the policy with its adapter disabled"
    one = CliRunner().invoke(app, ["plan", "--objective", "kto", "--model", "llama-3.1-8b", "--method", "qlora",
                                   "--vram", "12GB", "--batch-size", "1"])
    assert one.exit_code == 1 and "micro-batch of at least 2" in one.output
    # a fixed accumulation that leaves one row per micro-batch is refused too
    accum = CliRunner().invoke(app, ["plan", "--objective", "kto", "--model", "llama-3.1-8b", "--method", "qlora",
                                     "--vram", "12GB", "--batch-size", "4", "--gradient-accumulation", "4"])
    assert accum.exit_code == 1 and "micro-batch of at least 2" in accum.output


def _train(tmp_path: Path, text: str, paired: bool):
    if paired:
        write_pairs(tmp_path / "rows.jsonl")
    else:
        write_unpaired(tmp_path / "rows.jsonl")
    (tmp_path / "r.yaml").write_text(text)
    result = CliRunner().invoke(app, ["train", str(tmp_path / "r.yaml")])
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == 0, result.output
    if not paired:  # unpaired rows: no "pairs" in what the run says of its batch
        assert "unpaired completions per step" in result.output and "pairs per step" not in result.output
    return json.loads((tmp_path / "out" / "metrics.json").read_text())


def test_lora_kto_run_end_to_end(tmp_path, tiny_model_dir):
    m = _train(tmp_path, kto_recipe(tiny_model_dir), paired=False)
    assert m["steps"] == 4 and m["train_rows"] == 24
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert m["rewards_chosen_history"] and m["rewards_rejected_history"]
    # the adapter starts as zeros: policy == reference, KTO's loss 1 - sigmoid(0) = 0.5
    assert abs(m["first_loss"] - 0.5) < 1e-3
    shown = CliRunner().invoke(app, ["show", str(tmp_path / "out")])
    assert shown.exit_code == 0 and "objective kto" in shown.output
    # KTO's own term beside the rewards: its KL estimate (TRL's ``kl``)
    assert len(m["kl_history"]) == 4 and "kl (last)" in shown.output


@pytest.mark.slow
def test_full_kto_on_pairs_with_precomputed_reference(tmp_path, tiny_model_dir):
    m = _train(tmp_path, kto_recipe(tiny_model_dir, fmt="preference", techniques="lora: off",
                                    extra="preference: {precompute_ref_log_probs: true}"), paired=True)
    assert m["steps"] == 4 and (tmp_path / "out" / "model.safetensors").is_file()
    assert abs(m["first_loss"] - 0.5) < 1e-3
