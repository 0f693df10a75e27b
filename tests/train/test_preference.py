"""Preference tuning (training.objective dpo/orpo/simpo) through TRL: the recipe keys, the
preference data and its errors by file and line, TRL's config from the Plan, and `lowvram train`
end to end on the tiny Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.errors import LowvramError
from lowvram.recipe import parse_recipe

pytest.importorskip("trl")


def write_pairs(path: Path, n: int = 24, conversational: bool = False) -> Path:
    with path.open("w") as f:
        for i in range(n):
            a, b = i % 10, (3 * i) % 10
            prompt, good, bad = f"Add {a} and {b}.", f" The answer is {a + b}.", f" The answer is {a + b + 1}."
            if conversational:
                row = {"prompt": [{"role": "user", "content": prompt}],
                       "chosen": [{"role": "assistant", "content": good.strip()}],
                       "rejected": [{"role": "assistant", "content": bad.strip()}]}
            else:
                row = {"prompt": prompt, "chosen": good, "rejected": bad}
            f.write(json.dumps(row) + "\n")
    return path


def recipe_text(model_dir, objective="dpo", data="pairs.jsonl", techniques="lora: on", extra="", steps=4) -> str:
    return f"""\
model: {{name_or_path: {model_dir}}}
data:
  datasets: [{{path: {data}, format: preference}}]
training:
  objective: {objective}
  max_steps: {steps}
  learning_rate: 1.0e-3
  lr_scheduler: constant
  warmup_ratio: 0.0
  batch_size: 2
  seq_len: 64
  logging_steps: 1
  save_steps: 100
  output_dir: out
  report_to: none
lora: {{r: 8, alpha: 16}}
techniques: {{{techniques}}}
{extra}"""


def _parse(text: str):
    return parse_recipe(text)


# ---------------------------------------------------------------------------------- recipe keys


def test_objective_defaults_to_sft_and_preference_keys_validate():
    r = _parse(recipe_text("m", extra="preference: {beta: 0.2, loss_type: ipo, precompute_ref_log_probs: true}"))
    assert r.training.objective == "dpo"
    assert (r.preference.beta, r.preference.loss_type, r.preference.precompute_ref_log_probs) == (0.2, "ipo", True)
    plain = _parse("model: {name_or_path: m}\ndata: {datasets: [{path: d.jsonl}]}\n")
    assert plain.training.objective == "sft" and plain.preference.beta == 0.1


@pytest.mark.parametrize("text, words", [
    (recipe_text("m").replace("format: preference", "format: alpaca"), "does not train on format alpaca"),
    (recipe_text("m", objective="sft"), "format preference needs a preference objective"),
    (recipe_text("m", extra="preference: {loss_type: sigmod}"), "loss_type"),
    (recipe_text("m", extra="preference: {label_smoothing: 0.6}"), "label_smoothing"),
    (recipe_text("m", extra="preference: {beta: 0}"), "beta"),
    (recipe_text("m", extra="preference: {loss_type: exo_pair}"), "needs label_smoothing > 0"),
    # TRL 1.16's DPOTrainer warns and pads anyway (dpo_trainer.py L732-739): refused, not ignored
    (recipe_text("m", extra="preference: {padding_free: true}"), "not available in TRL 1.16"),
    (recipe_text("m").replace("output_dir: out", "output_dir: out\n  objective_typo: 1"), "objective_typo"),
    (recipe_text("m").replace("  datasets:", "  packing: true\n  datasets:"), "data.packing does not apply"),
])
def test_bad_preference_recipes_are_refused(text, words):
    with pytest.raises(LowvramError) as e:
        _parse(text)
    assert words in str(e.value) + (e.value.hint or "")


# ---------------------------------------------------------------------------------- data


def _recipe_at(tmp_path: Path, rows: list, model="m"):
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "r.yaml").write_text(recipe_text(model))
    from lowvram.recipe import load_recipe

    return load_recipe(tmp_path / "r.yaml")


GOOD = {"prompt": "Q?", "chosen": " yes", "rejected": " no"}


@pytest.mark.parametrize("bad, words", [
    ({"prompt": "Q?", "chosen": " yes"}, "missing field 'rejected'"),
    ({"prompt": "Q?", "chosen": " same", "rejected": " same"}, "chosen and rejected are identical"),
    ({"prompt": "", "chosen": " yes", "rejected": " no"}, "field 'prompt': expected non-empty text"),
    ({"chosen": "yes", "rejected": "no"}, "no prompt"),
    ({"prompt": "Q?", "chosen": 3, "rejected": " no"}, "field 'chosen': expected text or a list"),
])
def test_bad_rows_are_named_by_file_and_line(tmp_path, bad, words):
    from lowvram.train.data.build import build_datasets

    recipe = _recipe_at(tmp_path, [GOOD, GOOD, bad, GOOD])
    with pytest.raises(LowvramError) as e:
        build_datasets(recipe, None)
    assert str(e.value).startswith("pairs.jsonl:3: ") and words in str(e.value), str(e.value)
    assert "skip_bad_rows" in e.value.hint


def test_skip_bad_rows_counts_them(tmp_path):
    from lowvram.train.data.build import build_datasets

    recipe = _recipe_at(tmp_path, [GOOD, {"prompt": "Q", "chosen": "x", "rejected": "x"}, GOOD])
    recipe.data.skip_bad_rows = True
    bundle = build_datasets(recipe, None)
    assert (bundle.stats.train_rows, bundle.stats.skipped_bad_rows) == (2, 1)


def test_implicit_prompt_and_field_mapping(tmp_path):
    from lowvram.recipe import DatasetSpec
    from lowvram.train.data.preference import preference_pair

    spec = DatasetSpec(path="x.jsonl", format="preference", fields={"chosen": "good", "rejected": "bad"})
    # no prompt field: the shared start, as TRL's extract_prompt finds it
    pair = preference_pair({"good": "Q: 2+2? A: 4", "bad": "Q: 2+2? A: 5"}, spec)
    assert pair == {"prompt": "Q: 2+2? A:", "chosen": " 4", "rejected": " 5"}
    user = [{"role": "user", "content": "2+2?"}]
    pair = preference_pair({"good": [*user, {"role": "assistant", "content": "4"}],
                            "bad": [*user, {"role": "assistant", "content": "5"}]}, spec)
    assert pair["prompt"] == user and pair["chosen"] == [{"role": "assistant", "content": "4"}]
    # a text prompt with message answers: one user message, so the row is plainly conversational
    pair = preference_pair({"prompt": "2+2?", "good": [{"role": "assistant", "content": "4"}], "bad": " 5"}, spec)
    assert pair["prompt"] == user and pair["rejected"] == [{"role": "assistant", "content": " 5"}]


# ---------------------------------------------------------------------------------- TRL config


def test_trl_config_carries_the_plan(tmp_path, tiny_model_dir):
    """TRL's own config class (its __post_init__ validates), from the Plan as for SFT: its
    defaults (gradient checkpointing on, bf16 on) do not leak in."""
    from trl import DPOConfig

    from lowvram.planning.fixed import resolve_fixed
    from lowvram.train.build.trainer import build_training_args

    write_pairs(tmp_path / "pairs.jsonl")
    (tmp_path / "r.yaml").write_text(recipe_text(tiny_model_dir, extra="preference: {beta: 0.3, loss_type: hinge}"))
    from lowvram.recipe import load_recipe

    recipe = load_recipe(tmp_path / "r.yaml")
    plan = resolve_fixed(recipe)
    args = build_training_args(recipe, plan)
    assert type(args) is DPOConfig
    assert args.gradient_checkpointing is plan.gradient_checkpointing is False
    assert (args.bf16, args.fp16, args.use_cpu) == (False, False, True)
    assert (args.beta, args.loss_type, args.max_length) == (0.3, ["hinge"], 64)
    assert args.per_device_train_batch_size == plan.micro_batch_size


# ---------------------------------------------------------------------------------- end to end


def _train(tmp_path: Path, text: str, conversational=False):
    write_pairs(tmp_path / "pairs.jsonl", conversational=conversational)
    (tmp_path / "r.yaml").write_text(text)
    result = CliRunner().invoke(app, ["train", str(tmp_path / "r.yaml")])
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == 0, result.output
    return json.loads((tmp_path / "out" / "metrics.json").read_text())


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_lora_preference_run_end_to_end(tmp_path, tiny_model_dir, objective):
    m = _train(tmp_path, recipe_text(tiny_model_dir, objective=objective), conversational=objective == "orpo")
    assert m["steps"] == 4 and m["train_rows"] == 24
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert len(m["rewards_margins_history"]) == 4 and 0.0 <= m["rewards_accuracies"] <= 1.0
    if objective == "dpo":  # the adapter starts as zeros: policy == reference, margin 0, loss log 2
        assert m["rewards_margins_history"][0][1] == 0.0
        assert abs(m["first_loss"] - 0.6931) < 1e-3
    shown = CliRunner().invoke(app, ["show", str(tmp_path / "out")])
    assert shown.exit_code == 0 and "rewards/margins (last)" in shown.output and "reward margin" in shown.output
    assert f"objective {objective}" in shown.output
    if objective == "orpo":  # ORPO's own terms beside the rewards (TRL's log_odds_ratio, nll_loss)
        assert len(m["log_odds_ratio_history"]) == 4 and m["nll_loss"] > 0
        assert "log_odds_ratio (last)" in shown.output and "nll_loss (last)" in shown.output
    listed = CliRunner().invoke(app, ["runs", str(tmp_path)], env={"COLUMNS": "200"})  # no wrapping
    assert listed.exit_code == 0 and f"(margin {m['rewards_margins']:+.3f})" in listed.output
    assert f"{objective}, " in listed.output  # the objective leads the techniques
    # pairs far below seq_len 64: TRL pads each batch to its longest pair, so the run is compared
    # with the plan at the longest tokenized pair, and the run's plan says so
    assert 0 < m["data_longest_tokens"] < 64 and m["predicted_peak_bytes_at_data"] < m["predicted_peak_bytes"]
    assert m["memory_comparison"][0]["predicted_bytes"] == m["predicted_peak_bytes_at_data"]
    reason = json.loads((tmp_path / "out" / "plan.json").read_text())["reasons"]["data_length"]
    assert f"the longest tokenized pair is {m['data_longest_tokens']} tokens" in reason
    assert f"data_length: the longest tokenized pair is {m['data_longest_tokens']} tokens" in shown.output
    if objective == "dpo":  # the trained adapter answers like an SFT one
        gen = CliRunner().invoke(app, ["generate", str(tmp_path / "out"), "--prompt", "Add 1 and 2.",
                                       "--max-new-tokens", "4", "--greedy", "--cpu"])
        assert gen.exit_code == 0, gen.output


def test_full_dpo_with_precomputed_reference(tmp_path, tiny_model_dir):
    m = _train(tmp_path, recipe_text(tiny_model_dir, techniques="lora: off",
                                     extra="preference: {precompute_ref_log_probs: true}"))
    assert m["steps"] == 4 and (tmp_path / "out" / "model.safetensors").is_file()
    assert abs(m["first_loss"] - 0.6931) < 1e-3  # the reference is the initial policy


def test_longest_tokenized_row_truncates_as_trl():
    """The longest row a batch reaches, from the columns TRL 1.16 tokenizes into: DPO's prompt +
    the longer completion, ORPO/SimPO's rows (the prompt inside), KTO's longest prompt + longest
    completion (its KL rows mismatch them); each cut at max_length as TRL's collators cut."""
    from datasets import Dataset

    from lowvram.train.build.preference import longest_tokenized_row

    dpo = Dataset.from_dict({"prompt_ids": [[1] * 5, [1] * 9], "chosen_ids": [[2] * 7, [2] * 3],
                             "rejected_ids": [[3] * 2, [3] * 6]})
    assert longest_tokenized_row(dpo, "dpo", 64) == 15 and longest_tokenized_row(dpo, "dpo", 12) == 12
    orpo = Dataset.from_dict({"chosen_input_ids": [[1] * 11, [1] * 4], "rejected_input_ids": [[1] * 3, [1] * 13]})
    assert longest_tokenized_row(orpo, "orpo", 64) == 13 and longest_tokenized_row(orpo, "simpo", 10) == 10
    kto = Dataset.from_dict({"prompt_ids": [[1] * 9, [1] * 2], "completion_ids": [[2] * 1, [2] * 8]})
    assert longest_tokenized_row(kto, "kto", 64) == 17 and longest_tokenized_row(kto, "kto", 16) == 16
    with pytest.raises(LowvramError, match="cannot read the tokenized pairs"):
        longest_tokenized_row(Dataset.from_dict({"input_ids": [[1]]}), "orpo", 64)


# ---------------------------------------------------------------------------------- the plan


def _setup(**kw):
    from lowvram.plan.model.catalog import resolve_model
    from lowvram.plan.setup import RunSetup

    base = dict(model=resolve_model("llama-3.1-8b"), gradient_checkpointing=True, seq_len=1024, micro_batch_size=2)
    return RunSetup(**{**base, **kw})


def test_dpo_counts_both_rows_and_the_reference():
    from lowvram.plan.memory import preference
    from lowvram.plan.memory.activations import activation_bytes
    from lowvram.plan.memory.memory import estimate_memory
    from lowvram.plan.memory.states import weight_bytes

    sft = _setup()
    dpo = _setup(objective="dpo")
    # the concatenated forward: b pairs are 2b rows
    assert preference.policy_setup(dpo).micro_batch_size == 4
    assert activation_bytes(preference.policy_setup(dpo)) == activation_bytes(_setup(micro_batch_size=4, padded=True))
    # full fine-tuning: a frozen second copy of the weights, unless the reference is precomputed
    full = estimate_memory(dpo).breakdown["weights"]
    assert full == estimate_memory(sft).breakdown["weights"] + weight_bytes(sft)
    pre = _setup(objective="dpo", precompute_ref=True)
    assert estimate_memory(pre).breakdown["weights"] == estimate_memory(sft).breakdown["weights"]
    assert preference.reference_forward_bytes(pre) == 0
    # LoRA: the adapter disabled is the reference, no copy
    lora = dict(lora=True, quantization="nf4-dq")
    assert estimate_memory(_setup(objective="dpo", **lora)).breakdown["weights"] == \
        estimate_memory(_setup(**lora)).breakdown["weights"]
    assert preference.reference_weight_bytes(_setup(objective="orpo")) == 0


@pytest.mark.parametrize("objective", ["dpo", "orpo", "simpo", "kto"])
def test_padded_rows_mask_every_layer(objective):
    """TRL's collators pad the rows to the batch's longest and pass their attention_mask, so
    transformers builds a b x 1 x s x s bool mask per attention type (the padding ANDed in) and
    SDPA gets it in every layer: the checkpoints keep the masks of all rows (preference seed 12,
    a Gemma-3 ORPO LoRA run with checkpointing, b2 s512, was 3.4% above a plan that counted one
    s x s mask for the batch)."""
    from dataclasses import replace

    from lowvram.plan.memory import activations, preference
    from lowvram.plan.model.catalog import resolve_model

    gemma = _setup(model=resolve_model("gemma-3-1b"), objective=objective, lora=True, seq_len=512,
                   micro_batch_size=2)
    core = preference.policy_setup(gemma)
    rows = preference.rows_per_example(gemma) * 2
    assert core.padded and core.micro_batch_size == rows
    assert activations.masked_layers(core) == gemma.model.num_layers  # full-attention layers too
    assert activations._checkpointed_mask_bytes(core) == 2 * rows * 512 * 512  # sliding + full, bool
    # SFT without packing: lowvram's collator sends no attention_mask, one sliding mask for the batch
    sft = replace(gemma, objective="sft", micro_batch_size=rows)
    assert activations.masked_layers(sft) == gemma.model.sliding_layers
    assert activations._checkpointed_mask_bytes(sft) == 512 * 512
    # Llama: no sliding window, yet the padded rows' mask reaches every layer's SDPA
    llama = preference.policy_setup(_setup(objective=objective, gradient_checkpointing=False))
    assert activations.masked_layers(llama) == llama.model.num_layers
    assert activations.masked_layers(replace(llama, attention="eager")) == 0


@pytest.mark.parametrize("objective", ["dpo", "orpo", "simpo", "kto"])
def test_trl_disables_dropout_so_the_plan_counts_none(objective):
    """TRL's preference trainers set every nn.Dropout to p = 0 (disable_dropout=True by default),
    peft's lora_dropout included: a run with lora.dropout plans exactly as one without (seeds 12,
    13, 17 of the preference draw were 12-26% below their plans with the masks counted)."""
    from dataclasses import replace

    from lowvram.plan.memory import preference
    from lowvram.plan.memory.memory import estimate_memory

    plain = _setup(objective=objective, lora=True, lora_r=16, micro_batch_size=2, gradient_checkpointing=False)
    dropped = replace(plain, lora_dropout=0.1)
    core = preference.policy_setup(dropped)
    assert core.lora_dropout == 0 and core == preference.policy_setup(plain)
    assert core.micro_batch_size == preference.rows_per_example(plain) * 2
    assert estimate_memory(dropped).peak_bytes == estimate_memory(plain).peak_bytes
    # SFT keeps its dropout terms (the Trainer leaves dropout on)
    sft = replace(plain, objective="sft")
    assert estimate_memory(replace(sft, lora_dropout=0.1)).peak_bytes > estimate_memory(sft).peak_bytes


def test_dpo_log_probs_are_tiles_not_logits():
    """TRL's fused head: mm_buf is min(N, 4096) x 32768 in the compute dtype, never N x V."""
    from lowvram.plan.memory import preference

    s = _setup(objective="dpo", lora=True, quantization="nf4-dq", device="cuda")
    n = 2 * 2 * 1023
    mm_buf = min(n, 4096) * 32768 * 2
    saved = 2 * n * 4096 + 16 * n + 13 * n
    assert preference.dpo_logprob_bytes(s) == saved + 4 * n * 4096 + mm_buf
    # ORPO keeps the logits of all 2b rows
    assert preference.full_logits_bytes(_setup(objective="orpo")) == 18 * 2 * 2 * 1024 * 128256


def test_sft_plan_json_has_no_objective_keys():
    from lowvram.plan.serialize import choice_to_dict
    from lowvram.planning.entry import make_plan

    data = choice_to_dict(make_plan(model="llama-3.1-8b", method="qlora", vram="12GB"))
    assert "objective" not in data and "reference_model" not in data


def test_plan_objective_dpo_cli():
    result = CliRunner().invoke(app, ["plan", "--objective", "dpo", "--model", "llama-3.1-8b", "--method", "qlora",
                                      "--vram", "12GB", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["objective"] == "dpo" and data["reference_model"] == "the policy with its adapter disabled"
    assert data["techniques"]["loss"] == "standard" and data["fits"]
    sft = json.loads(CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", "--method", "qlora", "--vram",
                                              "12GB", "--json", "--gradient-checkpointing", "--loss", "standard",
                                              "--batch-size", str(data["micro_batch_size"]),
                                              "--gradient-accumulation", "1"]).output)
    assert data["breakdown"]["activations"] > sft["breakdown"]["activations"]  # two rows per pair
    bad = CliRunner().invoke(app, ["plan", "--objective", "dop", "--model", "llama-3.1-8b"])
    assert bad.exit_code == 2 and "did you mean dpo" in bad.output


def test_recipe_objective_reaches_the_request(tmp_path):
    from lowvram.plan.model.catalog import resolve_model
    from lowvram.planning.from_recipe import build_request

    r = _parse(recipe_text("m", extra="preference: {precompute_ref_log_probs: true}"))
    req = build_request(resolve_model("llama-3.1-8b"), r)
    assert (req.objective, req.precompute_ref) == ("dpo", True)


# ---------------------------------------------------------------------------------- OOM re-plan, resume


def _oom_recipe(model_dir) -> str:
    """DPO LoRA at batch 4 on pairs cut to 16 tokens (every batch reaches seq_len): micro-batch 4
    peaks at 19.4 MB (live tensor bytes, CPU), 2 x 2 at 10.2 MB; a 15 MiB card holds only the second."""
    return (recipe_text(model_dir, steps=4).replace("seq_len: 64", "seq_len: 16")
            .replace("batch_size: 2", "batch_size: 4").replace("save_steps: 100", "save_steps: 2"))


@pytest.mark.slow  # `make test-all`: three DPO runs
def test_dpo_oom_replans_and_resumes_as_sft(tmp_path, tiny_model_dir, monkeypatch):
    """Issue 28: the OOM re-plan and --resume work for a preference objective as for SFT (the
    same recover loop, tests/train/test_recover.py): an OOM at step 1 on an emulated card retries
    with micro-batch 2 x 2 from the start; an OOM in step 3 resumes from checkpoint-2; both end at
    the uninterrupted run's loss (the same effective batch, TRL's same pairs)."""
    from lowvram.train.run import oom
    from tests.train.test_recover import raise_oom_in_step_3

    for name in ("ref", "card", "step3"):
        (tmp_path / name).mkdir()
    ref = _train(tmp_path / "ref", _oom_recipe(tiny_model_dir))
    monkeypatch.setenv(oom.EMULATE_ENV, "15MiB")
    m = _train(tmp_path / "card", _oom_recipe(tiny_model_dir))
    assert [(r["step"], r["changed"], r["resumed_from"]) for r in m["oom_retries"]] == [(1, "micro-batch 2 x 2", None)]
    assert m["final_plan"]["micro_batch_size"] == 2 and m["peak_memory_bytes"] <= 15 * 2**20
    assert m["train_loss"] == pytest.approx(ref["train_loss"], abs=1e-5)
    assert len(m["rewards_margins_history"]) == 4
    monkeypatch.delenv(oom.EMULATE_ENV)

    raise_oom_in_step_3(monkeypatch)
    m = _train(tmp_path / "step3", _oom_recipe(tiny_model_dir))
    assert m["oom_retries"][0]["step"] == 3 and m["oom_retries"][0]["resumed_from"].endswith("checkpoint-2")
    assert m["resumed_from"].endswith("checkpoint-2") and m["steps"] == 4
    assert m["train_loss"] == pytest.approx(ref["train_loss"], abs=1e-5)


@pytest.mark.slow  # `make test-all`: two DPO runs
def test_dpo_resume_continues_from_the_last_checkpoint(tmp_path, tiny_model_dir):
    """`lowvram train --resume` on a DPO run cut after checkpoint-2 (its checkpoint-4 and
    metrics.json gone, as a killed run leaves it) trains steps 3-4 only and ends at the loss of
    the uninterrupted run."""
    import shutil

    full = _train(tmp_path, _oom_recipe(tiny_model_dir))
    shutil.rmtree(tmp_path / "out" / "checkpoint-4")
    (tmp_path / "out" / "metrics.json").unlink()
    result = CliRunner().invoke(app, ["train", str(tmp_path / "r.yaml"), "--resume"])
    assert result.exit_code == 0, result.output
    assert "resumed at step 2" in result.output
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert m["resumed_from"].endswith("checkpoint-2") and m["steps"] == 4
    assert m["train_loss"] == pytest.approx(full["train_loss"], abs=1e-6)


# issue 41 item 11: over a 4/8-bit base TRL's DPOTrainer and KTOTrainer cast the LoRA adapters to
# bf16 in __init__ (dpo_trainer.py L726-729, kto_trainer.py L777-780), while SFT of the same recipe
# trains fp32 adapters and the plan counts fp32 adapters and fp32 AdamW state (plan/memory/states.py)
@pytest.mark.parametrize("objective, quantization", [("dpo", "nf4"), ("kto", "nf4"), ("dpo", "int8")])
def test_trl_keeps_the_adapters_fp32_over_a_quantized_base(tmp_path, tiny_model_dir, monkeypatch,
                                                              objective, quantization):
    pytest.importorskip("bitsandbytes")
    import torch

    from lowvram.planning.fixed import resolve_fixed
    from lowvram.recipe import load_recipe
    from lowvram.train.build.model import load_model
    from lowvram.train.build.trainer import build_trainer, build_training_args
    from lowvram.train.data.build import build_datasets

    monkeypatch.chdir(tmp_path)
    write_pairs(tmp_path / "pairs.jsonl")
    text = recipe_text(tiny_model_dir, objective=objective,
                       techniques=f"lora: on, quantization: {quantization}, mixed_precision: bf16-mixed")
    if objective == "kto":  # KTO estimates its KL term from the batch: 2 rows or more
        text = text.replace("batch_size: 2", "batch_size: 2\n  micro_batch_size: 2")
    (tmp_path / "r.yaml").write_text(text)
    recipe = load_recipe(tmp_path / "r.yaml")
    plan = resolve_fixed(recipe)
    assert plan.quantization == quantization and plan.lora
    loaded = load_model(recipe, plan)
    assert getattr(loaded.model, f"is_loaded_in_{quantization[-1]}bit")  # what TRL tests before its cast
    before = {n: p.dtype for n, p in loaded.model.named_parameters() if p.requires_grad}
    assert set(before.values()) == {torch.float32}  # as lowvram.train.build.model makes them (SFT trains these)
    trainer = build_trainer(loaded, build_datasets(recipe, loaded.tokenizer), build_training_args(recipe, plan),
                            None)
    assert type(trainer).__name__ == {"dpo": "DPOTrainer", "kto": "KTOTrainer"}[objective]
    after = {n: p.dtype for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert after == before
