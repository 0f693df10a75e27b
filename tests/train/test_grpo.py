"""Online RL (training.objective grpo, rloo) through TRL 1.16's own GRPOTrainer and RLOOTrainer: the
prompt data and its bad rows by file and line, the rewards checked by `lowvram validate` before any
model (missing file, syntax error, signature, return, a raise), the built-ins, TRL's config from the
plan, the engines (generate, paged; vllm refused), and runs of the tiny Llama on the CPU: what the
user sees, a reward that raises mid-run, and --resume to the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.errors import LowvramError

pytest.importorskip("trl")

REWARD_FILE = '''\
def short(prompts, completions, **kwargs):
    return [-len(c) / 10 for c in completions]


def says_answer(prompts, completions, answer, **kwargs):
    return [float(a in c) for c, a in zip(completions, answer)]
'''


def write_prompts(path: Path, n: int = 16, chat: bool = False) -> Path:
    rows = []
    for i in range(n):
        prompt = f"Add {i} and {i + 1}."
        rows.append({"prompt": [{"role": "user", "content": prompt}] if chat else prompt, "answer": str(2 * i + 1)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def recipe_text(model, rewards="[rewards.py:short, exact_match]", objective="grpo", grpo="", steps=2,
                extra="", data="p.jsonl", fmt="prompt", save_steps=100) -> str:
    return f"""\
model: {{name_or_path: {model}}}
data: {{datasets: [{{path: {data}, format: {fmt}}}]}}
training: {{objective: {objective}, max_steps: {steps}, batch_size: 4, micro_batch_size: 2, logging_steps: 1,
  save_steps: {save_steps}, output_dir: out, report_to: none, learning_rate: 1.0e-3, lr_scheduler: constant,
  warmup_ratio: 0.0, seed: 7}}
grpo: {{num_generations: 2, max_completion_length: 6, max_prompt_length: 8, rewards: {rewards}{grpo}}}
lora: {{r: 8, alpha: 16}}
techniques: {{lora: on}}
{extra}"""


def setup_run(tmp_path: Path, model, reward_code: str = REWARD_FILE, chat=False, **kw) -> Path:
    write_prompts(tmp_path / "p.jsonl", chat=chat)
    (tmp_path / "rewards.py").write_text(reward_code)
    (tmp_path / "r.yaml").write_text(recipe_text(model, **kw))
    return tmp_path / "r.yaml"


def validate(path: Path):
    return CliRunner().invoke(app, ["validate", str(path)])


# ---------------------------------------------------------------------------------- data


def _bundle(tmp_path: Path, rows: list, fmt="prompt", fields=""):
    from lowvram.recipe import load_recipe
    from lowvram.train.data.build import build_datasets

    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "r.yaml").write_text(recipe_text("m", rewards="[exact_match]", fmt=fmt + fields))
    return build_datasets(load_recipe(tmp_path / "r.yaml"), None)


GOOD = {"prompt": "2+2?", "answer": "4"}


@pytest.mark.parametrize("bad, words", [
    ({"answer": "4"}, "missing field 'prompt'"),
    ({"prompt": " ", "answer": "4"}, "field 'prompt': expected non-empty text"),
    ({"prompt": 3, "answer": "4"}, "expected text or a list of {role, content} messages"),
    ({"prompt": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "answer": "4"},
     "the messages end with an assistant turn"),
    ({"prompt": "Q", "answer": "4", "trainer_state": 1}, "column 'trainer_state' has a name TRL gives"),
    # TRL leaves a "completion" column out of the rewards' arguments (grpo_trainer.py L1584)
    ({"prompt": "Q", "completion": "4"}, "column 'completion' has a name TRL gives"),
])
def test_bad_prompt_rows_are_named_by_file_and_line(tmp_path, bad, words):
    with pytest.raises(LowvramError) as e:
        _bundle(tmp_path, [GOOD, GOOD, bad])
    assert str(e.value).startswith("p.jsonl:3: ") and words in str(e.value), str(e.value)
    assert "skip_bad_rows" in e.value.hint


def test_prompt_rows_keep_every_other_column(tmp_path):
    b = _bundle(tmp_path, [{"prompt": "2+2?", "answer": "4", "level": 1}, {"prompt": "3+3?", "answer": "6", "level": 2}])
    assert b.train.column_names == ["prompt", "answer", "level"] and b.train["level"] == [1, 2]
    assert b.stats.train_rows == 2


def test_chat_and_alpaca_give_their_prompt_side(tmp_path):
    chat = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4"}]}]
    b = _bundle(tmp_path, chat, fmt="chat")
    assert b.train[0]["prompt"] == chat[0]["messages"][:2] and b.train[0]["answer"] == "4"
    b = _bundle(tmp_path, [{"instruction": "Add 2 and 2.", "output": "4"}], fmt="alpaca")
    assert b.train[0]["prompt"].endswith("### Instruction:\nAdd 2 and 2.\n\n### Response:\n")
    assert b.train[0]["answer"] == "4"


def test_mixed_prompt_kinds_are_refused(tmp_path):
    with pytest.raises(LowvramError, match="mix text and messages"):
        _bundle(tmp_path, [GOOD, {"prompt": [{"role": "user", "content": "Q"}], "answer": "1"}])


def test_chat_prompts_need_a_chat_template(tmp_path, tiny_tokenizer):
    """TRL renders message prompts with apply_chat_template at the first generation: without a
    template that was a ValueError mid-run; now error/hint when the data is built."""
    import copy

    from lowvram.recipe import load_recipe
    from lowvram.train.data.build import build_datasets

    recipe = load_recipe(setup_run(tmp_path, "m", chat=True))
    assert build_datasets(recipe, tiny_tokenizer).stats.train_rows == 16
    plain = copy.deepcopy(tiny_tokenizer)
    plain.chat_template = None
    with pytest.raises(LowvramError, match="no chat template") as e:
        build_datasets(recipe, plain)
    assert "model.tokenizer" in e.value.hint


# ---------------------------------------------------------------------------------- rewards


def test_builtins():
    from lowvram.train.build.rewards import exact_match, format_reward, length_reward

    assert exact_match(None, ["the answer is 4.", "#### 5", r"so \boxed{4}", "4"], answer=["4", "5", "4", "3"]) == [
        1.0, 1.0, 1.0, 0.0]
    chat = [[{"role": "assistant", "content": "<answer>4</answer>"}]]
    assert exact_match(None, chat, solution=["4"]) == [1.0]
    assert format_reward(r"<b>.*</b>")(None, ["<b>x\ny</b>", "x<b>y</b>"]) == [1.0, 0.0]
    assert length_reward(10)(None, ["x" * 10, "x" * 5, "x" * 30, ""]) == [1.0, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("code, rewards, words", [
    (REWARD_FILE, "[missing.py:short]", "reward missing.py:short: file not found"),
    ("def short(prompts, completions, **kwargs)\n    return [0.0]\n", "[rewards.py:short]",
     "syntax error in rewards.py line 1"),
    (REWARD_FILE, "[rewards.py:shrt]", "has no function 'shrt'"),
    ("import not_a_module_xyz\n", "[rewards.py:short]", "importing rewards.py raised ModuleNotFoundError"),
    ("def short(prompts, completions):\n    return [0.0] * len(prompts)\n", "[rewards.py:short]",
     "does not take 'completion_ids'"),
    ("def short(prompts, completions, level, **kwargs):\n    return [0.0] * len(prompts)\n", "[rewards.py:short]",
     "needs 'level', which the data has no column of (its columns: answer)"),
    ("def short(prompts, completions, **kwargs):\n    return [0.0]\n", "[rewards.py:short]",
     "returned 1 values for 2 completions"),
    ("def short(prompts, completions, **kwargs):\n    return ['good'] * len(prompts)\n", "[rewards.py:short]",
     "returned str 'good', not a number"),
    ("def short(prompts, completions, **kwargs):\n    return 1.0\n", "[rewards.py:short]",
     "returned float, not a list of numbers"),
    ("def short(prompts, completions, **kwargs):\n    raise KeyError('x')\n", "[rewards.py:short]",
     "reward rewards.py:short raised KeyError on a sample row"),
    ("async def short(prompts, completions, **kwargs):\n    return [0.0]\n", "[rewards.py:short]", "is async"),
    (REWARD_FILE, "[no_such_pkg_xyz:f]", "no module named 'no_such_pkg_xyz'"),
    (REWARD_FILE, "[{function: rewards.py:short, target: 3}]", "pattern and target are the built-ins'"),
    (REWARD_FILE, "[rewards.py:short, {function: rewards.py:short, weight: 2}]", "two rewards are named 'short'"),
    (REWARD_FILE, "[{function: format, pattern: '(unclosed'}]", "is not a regular expression"),
])
def test_validate_names_the_bad_reward_before_any_model(tmp_path, tiny_model_dir, code, rewards, words):
    """`lowvram validate` imports and calls each reward on a sample row: one error/hint naming the
    function, and no model loaded (validate reads no weights)."""
    result = validate(setup_run(tmp_path, tiny_model_dir, reward_code=code, rewards=rewards))
    assert result.exit_code == 1, result.output
    assert words in result.output and "Traceback" not in result.output, result.output
    assert "hint:" in result.output


def test_validate_names_every_bad_reward_at_once(tmp_path, tiny_model_dir):
    """Two broken rewards (a missing function, a missing module) and a good one: both problems under
    one error, each with its own hint, so one edit fixes both."""
    result = validate(setup_run(tmp_path, tiny_model_dir, rewards="[rewards.py:shrt, rewards.py:short, no_such_pkg_xyz:f]"))
    assert result.exit_code == 1, result.output
    assert "error: 2 rewards cannot be used:" in result.output, result.output
    assert "has no function 'shrt'" in result.output and "no module named 'no_such_pkg_xyz'" in result.output
    assert "hint: fix each reward above" in result.output and "Traceback" not in result.output


def test_validate_accepts_good_rewards(tmp_path, tiny_model_dir):
    result = validate(setup_run(tmp_path, tiny_model_dir,
                                rewards="[rewards.py:short, rewards.py:says_answer, exact_match, "
                                        "{function: format, weight: 0.5}, {function: length, target: 12}]"))
    assert result.exit_code == 0, result.output


def test_vllm_is_refused_with_the_versions(tmp_path, tiny_model_dir):
    import transformers

    result = validate(setup_run(tmp_path, tiny_model_dir, grpo=", generation: vllm"))
    assert result.exit_code == 1
    assert "TRL 1.16 accepts vLLM 0.22.0-0.31.0 only" in result.output
    assert f"require transformers < 5.18; this environment has transformers {transformers.__version__}" in result.output
    assert "grpo.generation: generate" in result.output


# ---------------------------------------------------------------------------------- TRL config


def _config(tmp_path, model, **kw):
    from lowvram.planning.fixed import resolve_fixed
    from lowvram.recipe import load_recipe
    from lowvram.train.build.trainer import build_training_args

    recipe = load_recipe(setup_run(tmp_path, model, **kw))
    plan = resolve_fixed(recipe)
    return recipe, plan, build_training_args(recipe, plan)


def test_trl_config_carries_the_plan(tmp_path, tiny_model_dir):
    from trl import GRPOConfig, RLOOConfig

    recipe, plan, args = _config(tmp_path, tiny_model_dir, grpo=", beta: 0.04, loss_type: dr_grpo, temperature: 0.7")
    assert type(args) is GRPOConfig
    assert args.gradient_checkpointing is plan.gradient_checkpointing is False
    assert (args.bf16, args.use_cpu, args.per_device_train_batch_size) == (False, True, plan.micro_batch_size)
    assert (args.num_generations, args.max_completion_length, args.beta, args.loss_type) == (2, 6, 0.04, "dr_grpo")
    assert (args.temperature, args.reward_weights, args.use_vllm) == (0.7, [1.0, 1.0], False)
    # TRL's rule: one generation per optimizer step, the effective batch of completions
    assert args.steps_per_generation == plan.grad_accum and args.generation_batch_size == 4
    assert not args.use_transformers_continuous_batching
    _, _, args = _config(tmp_path, tiny_model_dir, objective="rloo", grpo=", generation: paged")
    assert type(args) is RLOOConfig and args.use_transformers_continuous_batching
    # the paged cache holds one generation batch's rows, no share of the free memory; its footprint may
    # reach all the free memory (transformers' _check_footprint raises above free x max_memory_percent,
    # which TRL sets to 0.5 when unset: a cache planned into more than half the free memory would fail)
    assert args.transformers_continuous_batching_config == {"num_blocks": 4, "max_batch_tokens": 56,
                                                            "max_memory_percent": 1.0}


CAST, CONVERSION = "casts the whole model", "calls .float[(][)] on the PagedAttentionCache"


@pytest.mark.parametrize("precision, lora, refused", [
    ("bf16", True, CAST), ("bf16-mixed", False, CAST), ("fp16-mixed", True, CAST), ("bf16", False, CONVERSION),
    ("fp16", False, CONVERSION), ("fp32", True, None), ("fp32", False, None)])
def test_paged_is_refused_where_trl_casts_trained_weights(tmp_path, tiny_model_dir, precision, lora, refused):
    """TRL 1.16's continuous batching casts the model to bf16/fp16 before generating: fp32 adapters
    or master weights would silently become 16-bit; in pure bf16/fp16 full fine-tuning accelerate's
    output conversion fails on the paged cache (held-out seed 908; the library's behaviour:
    test_accelerate_output_conversion_fails_the_paged_engine). paged asked: refused; auto: generate."""
    from dataclasses import replace

    from lowvram.train.build.grpo import generation_settings, paged_cast_problem

    recipe, plan, _ = _config(tmp_path, tiny_model_dir, grpo=", generation: paged")
    plan = replace(plan, mixed_precision=precision, lora=lora)
    assert (paged_cast_problem(plan) is not None) is bool(refused)
    if refused:
        with pytest.raises(LowvramError, match=refused):
            generation_settings(recipe, plan)
        recipe.grpo.generation = "auto"
        # the plan's engine (Plan.generation, the planner's field) paged for an auto recipe
        from dataclasses import fields
        from types import SimpleNamespace

        planned = SimpleNamespace(**{**{f.name: getattr(plan, f.name) for f in fields(plan)}, "generation": "paged"})
        assert "use_transformers_continuous_batching" not in generation_settings(recipe, planned)
    else:
        assert generation_settings(recipe, plan)["use_transformers_continuous_batching"] is True


def test_accelerate_output_conversion_fails_the_paged_engine(tiny_model_dir):
    """Why paged is refused in pure bf16/fp16 (held-out seed 908 ended in IndexError): with the
    Trainer's bf16/fp16, accelerate wraps the model's forward in convert_outputs_to_fp32, which
    takes anything with a 16-bit ``.dtype`` for a tensor; transformers' continuous batching returns
    its PagedAttentionCache in the output, ``.float()`` raises, and every request fails. The same
    generation without the wrapper (or in fp32) works. When this test fails, the libraries have
    fixed it: lift plan.memory.grpo.paged_precision_problem's pure-16-bit refusal."""
    import torch
    from accelerate.utils import convert_outputs_to_fp32
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    cfg, cb = GenerationConfig(max_new_tokens=2, do_sample=False), ContinuousBatchingConfig(num_blocks=4, max_batch_tokens=16)

    def generated():
        with torch.no_grad():
            out = model.generate_batch([[1, 2, 3], [4, 5]], generation_config=cfg, continuous_batching_config=cb,
                                       progress_bar=False)
        return [(o.generated_tokens, o.error) for o in out.values()]

    assert [len(tokens) for tokens, _ in generated()] == [2, 2]
    model.forward = convert_outputs_to_fp32(model.forward)  # what accelerate's prepare_model does under bf16
    assert generated() == [([], "'PagedAttentionCache' object has no attribute 'float'")] * 2


def test_validate_refuses_paged_in_16_bit(tmp_path, tiny_model_dir):
    """A recipe that fixes paged and a 16-bit precision is refused by `lowvram validate`, before any
    model (auto precision: the plan's check, tests/plan/test_grpo.py)."""
    path = setup_run(tmp_path, tiny_model_dir, grpo=", generation: paged",
                     extra="techniques: {lora: off, mixed_precision: bf16}").read_text()
    (tmp_path / "r.yaml").write_text(path.replace("techniques: {lora: on}\n", ""))
    r = validate(tmp_path / "r.yaml")
    assert r.exit_code == 1 and "calls .float() on the PagedAttentionCache" in r.stderr, r.output
    assert "hint: set grpo.generation: generate" in r.stderr
    (tmp_path / "r.yaml").write_text(path.replace("techniques: {lora: on}\n", "").replace("bf16", "fp32"))
    assert validate(tmp_path / "r.yaml").exit_code == 0


@pytest.mark.parametrize("objective", ["grpo", "rloo"])
def test_trl_keeps_the_adapters_fp32_over_a_quantized_base(tmp_path, tiny_model_dir, monkeypatch, objective):
    """GRPOTrainer/RLOOTrainer cast the trainable parameters to bf16 over a 4/8-bit base
    (grpo_trainer.py L538-541, rloo_trainer.py L458-461); SFT of the same recipe and the plan's
    states train fp32 adapters, as DPO's path restores (train/build/preference.py _restore_dtypes)."""
    pytest.importorskip("bitsandbytes")
    import torch

    from lowvram.planning.fixed import resolve_fixed
    from lowvram.recipe import load_recipe
    from lowvram.train.build.model import load_model
    from lowvram.train.build.trainer import build_trainer, build_training_args
    from lowvram.train.data.build import build_datasets

    monkeypatch.chdir(tmp_path)
    path = setup_run(tmp_path, tiny_model_dir, objective=objective, rewards="[rewards.py:short]")
    path.write_text(path.read_text().replace("techniques: {lora: on}",
                                             "techniques: {lora: on, quantization: nf4, mixed_precision: bf16-mixed}"))
    recipe = load_recipe(path)
    plan = resolve_fixed(recipe)
    loaded = load_model(recipe, plan)
    assert loaded.model.is_loaded_in_4bit  # what TRL tests before its cast
    before = {n: p.dtype for n, p in loaded.model.named_parameters() if p.requires_grad}
    assert set(before.values()) == {torch.float32}
    trainer = build_trainer(loaded, build_datasets(recipe, loaded.tokenizer), build_training_args(recipe, plan),
                            None, recipe=recipe)
    assert type(trainer).__name__ == {"grpo": "GRPOTrainer", "rloo": "RLOOTrainer"}[objective]
    assert {n: p.dtype for n, p in trainer.model.named_parameters() if p.requires_grad} == before


@pytest.mark.parametrize("objective,beta,library_ref,kept_ref", [
    ("rloo", 0.0, True, False), ("rloo", 0.04, True, True), ("grpo", 0.0, False, False), ("grpo", 0.04, True, True)])
def test_the_reference_adapter_exists_only_where_it_is_read(tmp_path, tiny_model_dir, monkeypatch, objective, beta,
                                                            library_ref, kept_ref):
    """TRL 1.16's RLOOTrainer adds a frozen "ref" copy of a PEFT model's adapter whatever beta
    (rloo_trainer.py L398-421; GRPOTrainer only with beta != 0), and reads it only with beta != 0:
    lowvram deletes it at beta 0 (held-out seed 982: the copy was 2.23 MB the plan did not count).
    ``library_ref`` pins TRL's own behaviour: when RLOO stops adding it at beta 0, the deletion can go."""
    from lowvram.planning.fixed import resolve_fixed
    from lowvram.recipe import load_recipe
    from lowvram.train.build import grpo as build_grpo
    from lowvram.train.build.model import load_model
    from lowvram.train.build.trainer import build_trainer, build_training_args
    from lowvram.train.data.build import build_datasets

    monkeypatch.chdir(tmp_path)
    path = setup_run(tmp_path, tiny_model_dir, objective=objective, rewards="[rewards.py:short]", grpo=f", beta: {beta}")
    recipe = load_recipe(path)
    plan = resolve_fixed(recipe)

    def adapters(drop: bool):
        if not drop:
            monkeypatch.setattr(build_grpo, "_drop_unused_reference_adapter", lambda trainer: None)
        loaded = load_model(recipe, plan)
        trainer = build_trainer(loaded, build_datasets(recipe, loaded.tokenizer), build_training_args(recipe, plan),
                                None, recipe=recipe)
        names = {n.split(".")[-2] for n, _ in trainer.model.named_parameters() if "lora_" in n}
        return set(trainer.model.peft_config), names, trainer.model.active_adapters

    configs, names, active = adapters(drop=True)
    assert ("ref" in configs) == kept_ref and ("ref" in names) == kept_ref
    assert "default" in names and active == ["default"]
    assert ("ref" in adapters(drop=False)[0]) == library_ref


@pytest.mark.parametrize("objective,beta", [("rloo", 0.0), ("grpo", 0.04)])
def test_pissa_base_weights_are_decomposed_once(tmp_path, tiny_model_dir, monkeypatch, objective, beta):
    """TRL adds its "ref" adapter with the default adapter's config (rloo_trainer.py L421: RLOO
    always, GRPO with beta > 0), so under lora.init pissa peft ran PiSSA a second time and took a
    second slice out of the base weights the adapter was fitted to. lowvram builds the trainer with
    that init off for "ref": the base weights are those the model builder made, and "ref" is
    the starting adapter (TRL's copy). Without it (the library's behaviour) the base changes."""
    import contextlib

    import torch

    from lowvram.planning.fixed import resolve_fixed
    from lowvram.recipe import load_recipe
    from lowvram.train.build import grpo as build_grpo
    from lowvram.train.build.model import load_model
    from lowvram.train.build.trainer import build_trainer, build_training_args
    from lowvram.train.data.build import build_datasets

    monkeypatch.chdir(tmp_path)
    path = setup_run(tmp_path, tiny_model_dir, objective=objective, rewards="[rewards.py:short]", grpo=f", beta: {beta}")
    path.write_text(path.read_text().replace("lora: {r: 8, alpha: 16}", "lora: {r: 8, alpha: 16, init: pissa}"))
    recipe = load_recipe(path)
    plan = resolve_fixed(recipe)

    def build(guarded: bool):
        if not guarded:
            monkeypatch.setattr(build_grpo, "_reference_adapter_not_reinitialised", lambda m: contextlib.nullcontext())
        loaded = load_model(recipe, plan)
        base = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if "base_layer" in n}
        trainer = build_trainer(loaded, build_datasets(recipe, loaded.tokenizer), build_training_args(recipe, plan),
                                None, recipe=recipe)
        params = dict(trainer.model.named_parameters())
        changed = [n for n, w in base.items() if not torch.equal(params[n], w)]
        return trainer, changed

    trainer, changed = build(guarded=True)
    assert changed == [] and trainer.model.peft_config["default"].init_lora_weights == "pissa"
    params = dict(trainer.model.named_parameters())
    refs = [n for n in params if ".ref." in n]
    assert bool(refs) == (beta > 0)
    assert all(torch.equal(params[n], params[n.replace(".ref.", ".default.")]) for n in refs)
    assert build(guarded=False)[1], "TRL no longer re-initialises 'ref' with PiSSA: the guard can go"


# ---------------------------------------------------------------------------------- runs


def _train(recipe: Path, *flags):
    """The recipe trained through lowvram's own run (train/run/run.py) on the fixed plan: TRL's trainer,
    lowvram's model builder, the run folder (the planner's GRPO terms are grpoplan's, issue 44)."""
    from lowvram.planning.fixed import resolve_fixed
    from lowvram.recipe import load_recipe
    from lowvram.train.run.run import run_training
    from lowvram.train.types import TrainOptions

    r = load_recipe(recipe)
    return run_training(r, resolve_fixed(r), TrainOptions(resume="--resume" in flags, overwrite="--overwrite" in flags))


def test_grpo_run_shows_the_rewards(tmp_path, tiny_model_dir, capsys):
    result = _train(setup_run(tmp_path, tiny_model_dir, grpo=", beta: 0.04"))
    printed = capsys.readouterr().out
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert m["steps"] == 2 and len(m["reward_history"]) == 2
    assert set(m["reward_functions"]) == {"short", "exact_match"}
    assert m["reward_functions"]["short"]["mean"] < 0 and m["completion_length"] <= 6
    assert "kl_history" in m and "clip_ratio" in m  # beta > 0: TRL logs the KL
    assert "reward " in printed and "(short " in printed and " kl " in printed and " clip " in printed
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file() and result.metrics.steps == 2
    shown = CliRunner().invoke(app, ["show", str(tmp_path / "out")])
    assert shown.exit_code == 0 and "reward short (last)" in shown.output and "completion length" in shown.output
    assert "prompt 8 + completion 6 tokens, 2 per prompt" in shown.output  # the row, not training.seq_len
    listed = CliRunner().invoke(app, ["runs", str(tmp_path)], env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and f"(reward {m['reward']:+.3f})" in listed.output
    # an 80-column terminal: a block of two lines per run, nothing squeezed out (the table's
    # recipe, model, techniques and peak columns had no width left beside the reward)
    narrow = CliRunner().invoke(app, ["runs", str(tmp_path)], env={"COLUMNS": "80"})
    assert narrow.exit_code == 0 and f"(reward {m['reward']:+.3f})" in narrow.output, narrow.output
    line = next(x for x in narrow.output.splitlines() if x.startswith("out  finished"))
    assert " peak " in line and " / " in line and len(line) <= 80, line
    assert "grpo, " in narrow.output and "┃" not in narrow.output


def test_rloo_paged_run_on_chat_prompts(tmp_path, tiny_model_dir):
    _train(setup_run(tmp_path, tiny_model_dir, chat=True, objective="rloo", grpo=", generation: paged",
                     rewards="[rewards.py:short]"))
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert m["steps"] == 2 and m["reward"] <= 0 and m["peak_memory_bytes"] < 64 * 2**20  # no memory-share cache


UNSCORED = REWARD_FILE + '''

def never(prompts, completions, **kwargs):
    return [None] * len(completions)
'''


def test_a_reward_that_scores_nothing_is_left_out_of_the_progress_and_metrics(tmp_path, tiny_model_dir):
    """A reward returning None for every completion: TRL logs rewards/never/mean None (GRPOTrainer.log
    L3311-3312), which ended the run in the progress line's format (a TypeError) before."""
    _train(setup_run(tmp_path, tiny_model_dir, reward_code=UNSCORED, steps=1, rewards="[rewards.py:short, rewards.py:never]"))
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert m["steps"] == 1 and set(m["reward_functions"]) == {"short"} and m["reward"] < 0


RAISES_AT_STEP_3 = REWARD_FILE + '''

def fragile(prompts, completions, trainer_state, **kwargs):
    if trainer_state.global_step == 2:
        raise ZeroDivisionError("no")
    return [0.0] * len(prompts)
'''


def test_a_reward_that_raises_names_itself_and_the_step_and_resume_goes_on(tmp_path, tiny_model_dir):
    from lowvram.train.run.checkpoints import complete_checkpoints

    recipe = setup_run(tmp_path, tiny_model_dir, reward_code=RAISES_AT_STEP_3, steps=4, save_steps=2,
                       rewards="[rewards.py:short, rewards.py:fragile]")
    with pytest.raises(LowvramError) as e:
        _train(recipe)
    assert str(e.value) == "reward rewards.py:fragile raised ZeroDivisionError at step 3: no"
    assert "--resume" in e.value.hint
    assert [c.name for c in complete_checkpoints(tmp_path / "out")] == ["checkpoint-2"]
    (tmp_path / "rewards.py").write_text(RAISES_AT_STEP_3.replace("== 2", "== -1"))  # fixed
    result = _train(recipe, "--resume")
    assert result.metrics.steps == 4 and result.resumed_from.endswith("checkpoint-2")


@pytest.mark.slow  # ~100 s on 2 shared cores: `make test-all`
def test_resume_reaches_the_same_weights(tmp_path, tiny_model_dir):
    """A checkpoint mid-run and --resume give the weights of the uninterrupted run (fixed seed:
    the Trainer restores the RNG, so the resumed run samples the same completions)."""
    from safetensors.torch import load_file

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for d in (whole, cut):
        d.mkdir()
    _train(setup_run(whole, tiny_model_dir, steps=4, save_steps=2))
    _train(setup_run(cut, tiny_model_dir, steps=2, save_steps=2))
    (cut / "r.yaml").write_text(recipe_text(tiny_model_dir, steps=4, save_steps=2))
    _train(cut / "r.yaml", "--resume")
    a, b = load_file(str(whole / "out" / "adapter_model.safetensors")), load_file(str(cut / "out" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max().item() < 1e-6, k
    ra = json.loads((whole / "out" / "metrics.json").read_text())["reward_history"]
    rb = json.loads((cut / "out" / "metrics.json").read_text())["reward_history"]
    assert ra[2:] == rb[-2:]


# ---------------------------------------------------------------------------------- the shipped recipe

GRPO_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m-grpo.yaml"


def test_shipped_recipe_validates_with_its_rewards(quickstart_model):
    """validate imports recipes/rewards/addition.py and scores the first prompt (no model loaded)."""
    result = validate(GRPO_RECIPE)
    assert result.exit_code == 0, result.output
    from lowvram.recipe import load_recipe
    from lowvram.train.build.rewards import load_rewards

    rewards = {r.name: r.function for r in load_rewards(load_recipe(GRPO_RECIPE))}
    done = [[{"role": "assistant", "content": t}] for t in ("15", "It is 15.", "16", "The sum of 4 and 11 is 15.",
                                                             "4 + 11 = 15", "15, or 4 + 11 = 16", "")]
    # the last number is the answer: the base model writes "A + B = C"
    assert rewards["correct"](None, done, answer=["15"] * 7) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert rewards["brief"](None, done[:4]) == [1.0, 1 - 2 / 15, 1.0, 1 - 7 / 15]


def test_shipped_prompts_are_what_the_generator_writes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_addition", GRPO_RECIPE.parent / "data" / "make_addition_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = (GRPO_RECIPE.parent / "data" / "addition_prompts.jsonl").read_text()
    assert written == "".join(json.dumps(r) + "\n" for r in module.rows())


@pytest.mark.slow
def test_shipped_recipe_trains_two_steps(tmp_path, quickstart_model):
    """The real SmolLM2-135M through TRL's GRPOTrainer, two steps (the learning run is
    bench/grpo_demo.py's, minutes long)."""
    from lowvram.planning.fixed import resolve_fixed
    from lowvram.recipe import load_recipe
    from lowvram.train.run.run import run_training
    from lowvram.train.types import TrainOptions

    r = load_recipe(GRPO_RECIPE, ["training.max_steps=2", f"training.output_dir={tmp_path / 'out'}"])
    m = run_training(r, resolve_fixed(r), TrainOptions(overwrite=True)).metrics
    assert m.steps == 2 and set(m.reward_functions) == {"correct", "brief"}


def test_grpo_trains_through_the_cli_with_the_planners_plan(tmp_path, tiny_model_dir):
    """`lowvram train` on a grpo recipe: planned by the GRPO terms (plan/memory/grpo.py), both phases
    printed before the model loads, then TRL's trainer; the plan carries the generation engine."""
    recipe = setup_run(tmp_path, tiny_model_dir)
    result = CliRunner().invoke(app, ["train", str(recipe)])
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["generation"] in ("generate", "paged") and plan["steps_per_generation"] >= 1
    # batch_size counts completions (2 prompts x 2 generations), each row prompt 8 + completion 6 tokens
    assert "objective grpo: 4 completions per step (2 prompts x 2 generations)" in result.output
    assert "tokens per optimizer step (at most): 56" in result.output and "pairs" not in result.output
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert m["steps"] == 2 and len(m["reward_history"]) == 2 and m["predicted_peak_bytes"] > 0


def test_run_is_compared_with_the_plan_at_its_longest_prompt(tmp_path, tiny_model_dir, tiny_tokenizer):
    """TRL pads each generation batch to its longest prompt, not to max_prompt_length: on prompts
    shorter than it the run is compared with the plan at the data's longest prompt (as TRL
    tokenizes it) + max_completion_length (the shipped CPU recipe's 47-token prompts under a
    max_prompt_length of 64 measured 22% below the plan at 64)."""
    recipe = setup_run(tmp_path, tiny_model_dir)
    recipe.write_text(recipe.read_text().replace("max_prompt_length: 8", "max_prompt_length: 48"))
    result = CliRunner().invoke(app, ["train", str(recipe)])
    assert result.exit_code == 0, result.output
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    longest = max(len(ids) for ids in tiny_tokenizer(text=prompts)["input_ids"])
    assert longest < 48 and m["data_longest_tokens"] == longest + 6
    assert m["predicted_peak_bytes_at_data"] < m["predicted_peak_bytes"]
    assert m["peak_memory_bytes"] <= m["predicted_peak_bytes_at_data"] * 1.03
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert f"the longest prompt is {longest} tokens" in plan["reasons"]["data_length"]



def test_reference_model_is_measured_with_the_weights(tmp_path, tiny_model_dir):
    """Full fine-tuning with beta > 0: TRL loads a frozen reference copy in GRPOTrainer.__init__,
    before the run's live-bytes tracker starts; the run registers it like the weights (held-out
    seed 977 measured 18% under its plan, which counts the copy, when it did not; the case itself:
    tests/plan/test_fuzz.py test_grpo_recipes_stay_within_their_plan, slow)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lowvram.train.run.run import _memory_tracker

    _, plan, _ = _config(tmp_path, tiny_model_dir)
    model, ref = (AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32) for _ in range(2))
    size = _memory_tracker(plan, model, True).current_bytes  # its parameters and buffers
    assert size >= sum(p.numel() * 4 for p in model.parameters())
    assert _memory_tracker(plan, model, True, ref).current_bytes == 2 * size
