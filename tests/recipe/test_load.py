"""Recipe validation: every error kind, line numbers, did-you-mean, several at once, overrides."""

from __future__ import annotations

import pytest

from lowvram.errors import LowvramError, RecipeError
from lowvram.recipe import load_recipe, parse_recipe

GOOD = """\
model:
  name_or_path: some/model
data:
  datasets:
    - path: data.jsonl
"""


def problems(text: str, overrides=()) -> list[str]:
    with pytest.raises(RecipeError) as e:
        parse_recipe(text, "r.yaml", overrides)
    return e.value.problems


def test_minimal_recipe_gets_defaults():
    r = parse_recipe(GOOD, "r.yaml")
    assert r.training.learning_rate == 2e-4
    assert r.techniques.mixed_precision == "auto"
    assert r.lora.target_modules == "all-linear"
    assert r.data.datasets[0].format == "auto"  # recognised from the file's columns when it is read
    assert r.data.train_on_inputs is False


def test_misspelled_key_gets_line_and_did_you_mean():
    text = GOOD + "training:\n  learning_rte: 1.0e-4\n"
    (p,) = problems(text)
    assert p == "r.yaml:7: training.learning_rte: unknown key 'learning_rte'; did you mean 'learning_rate'?"


def test_every_problem_reported_at_once_sorted_by_line():
    text = GOOD + "training:\n  seq_len: 0\n  epochs: -1\ntechniques:\n  optimizer: adam9000\n"
    ps = problems(text)
    assert len(ps) == 3
    assert ps[0].startswith("r.yaml:7: training.seq_len:")
    assert ps[1].startswith("r.yaml:8: training.epochs:")
    assert ps[2].startswith("r.yaml:10: techniques.optimizer:")
    assert "adam9000" in ps[2]


def test_missing_required_section():
    ps = problems("model:\n  name_or_path: x\n")
    assert ps == ["r.yaml: data: required key is missing"]


def test_list_items_have_index_and_line():
    ps = problems(GOOD + "    - path: b.csv\n      format: alpacca\n")
    assert len(ps) == 1 and ps[0].startswith("r.yaml:7: data.datasets[1].format:")


def test_yaml_on_off_are_words_for_techniques():
    r = parse_recipe(GOOD + "techniques:\n  lora: on\n  gradient_checkpointing: off\n", "r.yaml")
    assert r.techniques.lora == "on" and r.techniques.gradient_checkpointing == "off"


def test_yaml_11_words_stay_words_where_a_string_is_expected():
    r = parse_recipe(GOOD + "training:\n  output_dir: off\n", "r.yaml", ["lora.target_modules=[on, no]"])
    assert r.training.output_dir == "off" and r.lora.target_modules == ["on", "no"]
    r = parse_recipe(GOOD, "r.yaml", ["training.output_dir=no", "model.trust_remote_code=yes",
                                     "techniques.lora=yes", "techniques.offload=N"])
    assert r.training.output_dir == "no" and r.model.trust_remote_code is True
    assert r.techniques.lora == "on" and r.techniques.offload == "off"
    r = parse_recipe(GOOD + "techniques:\n  lora: true\n  gradient_checkpointing: OFF\n", "r.yaml")
    assert (r.techniques.lora, r.techniques.gradient_checkpointing) == ("on", "off")


def test_quantization_without_lora_is_rejected():
    (p,) = problems(GOOD + "techniques:\n  lora: off\n  quantization: nf4\n")
    assert "needs lora: a quantized base cannot be trained directly" in p


def test_deepspeed_offload_with_another_optimizer_is_rejected():
    (p,) = problems(GOOD + "techniques:\n  optimizer: on\n  offload: on\n")  # adamw_8bit + optimizer
    assert "DeepSpeed's CPU Adam" in p and "optimizer adamw_8bit" in p and "use optimizer: adamw" in p
    (p,) = problems(GOOD + "techniques:\n  optimizer: adafactor\n  offload: zero3-offload\n")
    assert "optimizer adafactor" in p and "offload: fsdp-offload" in p
    for ok in ("optimizer: adamw\n  offload: full", "optimizer: adafactor\n  offload: fsdp-offload",
               "optimizer: adamw_8bit\n  offload: auto", "optimizer: off\n  offload: on"):
        parse_recipe(GOOD + f"techniques:\n  {ok}\n", "r.yaml")


@pytest.mark.parametrize("optimizer", ["on", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"])
@pytest.mark.parametrize("offload", ["fsdp", "fsdp-offload"])
def test_fsdp_with_a_bitsandbytes_optimizer_is_rejected(optimizer, offload):
    """Issue 24 item 1: bitsandbytes' optimizers fail at FSDP2's first step (no DTensor support,
    tests/train/test_fsdp2_step.py); a recipe asking for the pair is refused, naming what works."""
    (p,) = problems(GOOD + f"techniques:\n  optimizer: {optimizer}\n  offload: {offload}\n")
    assert "cannot step FSDP2's sharded parameters" in p and "no DTensor support" in p
    assert f"use optimizer: adamw with offload: {offload}" in p and "with offload: none (DDP)" in p


def test_overrides_are_validated_and_named():
    r = parse_recipe(GOOD, "r.yaml", ["training.learning_rate=1e-4", "techniques.lora=off"])
    assert r.training.learning_rate == 1e-4 and r.techniques.lora == "off"
    ps = problems(GOOD, ["training.seq_len=abc", "training.learning_rte=1"])
    assert any(p.startswith("--set training.seq_len=abc: training.seq_len:") for p in ps)
    assert any("did you mean 'learning_rate'" in p for p in ps)


def test_override_without_equals():
    with pytest.raises(RecipeError, match="expected KEY.PATH=VALUE"):
        parse_recipe(GOOD, "r.yaml", ["training.seq_len"])


def test_duplicate_key_is_an_error_with_line():
    with pytest.raises(LowvramError, match=r"r.yaml:3: invalid YAML: duplicate key 'model' \(first on line 1\)"):
        parse_recipe("model:\n  name_or_path: a\nmodel:\n  name_or_path: b\n", "r.yaml")


def test_python_tags_are_refused():
    with pytest.raises(LowvramError, match="invalid YAML"):
        parse_recipe("model: !!python/object/apply:os.system ['echo hi']\n", "r.yaml")


def test_not_a_mapping():
    with pytest.raises(LowvramError, match="must be a YAML mapping"):
        parse_recipe("- a\n- b\n", "r.yaml")


def test_alias_bomb_is_refused():
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    prev = "a"
    for i in range(8):
        name = f"b{i}"
        bomb += f"{name}: &{name} [{', '.join(['*' + prev] * 10)}]\n"
        prev = name
    with pytest.raises(LowvramError, match="too many YAML aliases"):
        parse_recipe(bomb, "r.yaml")


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(LowvramError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(LowvramError, match="is a folder"):
        load_recipe(tmp_path)


def test_binary_file(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(LowvramError, match="not UTF-8"):
        load_recipe(p)


def test_paths_resolve_against_recipe(tmp_path):
    p = tmp_path / "sub" / "r.yaml"
    p.parent.mkdir()
    p.write_text(GOOD)
    r = load_recipe(p)
    assert r.resolve_path("data.jsonl") == p.resolve().parent / "data.jsonl"


def test_activation_offload_needs_checkpointing():
    off = problems(GOOD + "techniques: {activation_offload: on, gradient_checkpointing: off}\n")
    assert len(off) == 1 and "activation_offload needs gradient_checkpointing" in off[0]
    r = parse_recipe(GOOD + "techniques: {activation_offload: yes, loss: fused}\n", "r.yaml")
    assert (r.techniques.activation_offload, r.techniques.loss) == ("on", "fused")
