"""`lowvram eval` on a tiny Llama trained through the real CLI: the held-out rows are training's
own eval set, the loss and perplexity equal a plain forward's, greedy answers are the model's own,
the base is the model without its adapter, lm-eval runs a local task offline, the results land in
evals.json and in `show` / `runs`; and the user errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from tests.conftest import REPO
from tests.train.test_after_training import assert_user_error, cli
from tests.train.test_e2e import write_recipe


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A finished 4-step LoRA run that held out a quarter of its 48 rows."""
    tmp = tmp_path_factory.mktemp("eval")
    recipe = write_recipe(tmp, tiny_model_dir, steps=4, validation="0.25")
    result = cli("train", str(recipe))
    assert result.exit_code == 0, result.output
    return tmp / "out"


def recipe_and_tokenizer(run: Path):
    from transformers import AutoTokenizer

    from lowvram.train.after.evaluate import run_recipe

    tok = AutoTokenizer.from_pretrained(run)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return run_recipe(run), tok


def plain_mean_loss(model, samples) -> float:
    """exp's argument, computed the plain way: the model's own loss (mean over one row's predicted
    tokens) times that row's count, summed, over the total count."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in samples:
            n = sum(x != -100 for x in labels[1:])
            out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]))
            total += out.loss.item() * n
            count += n
    return total / count


# --------------------------------------------------------------------------------------------
# The held-out rows


def test_held_out_rows_are_the_training_eval_set(run_dir):
    from lowvram.train.data.build import build_datasets
    from lowvram.train.data.heldout import held_out_set

    recipe, tok = recipe_and_tokenizer(run_dir)
    held = held_out_set(recipe, tok)
    ev = build_datasets(recipe, tok).eval
    assert len(held.rows) == len(ev) == 12
    assert [r.input_ids for r in held.rows] == [list(x) for x in ev["input_ids"]]
    assert [r.labels for r in held.rows] == [list(x) for x in ev["labels"]]
    r = held.rows[0]
    # the prompt is the sample up to its answer; the reference is the row's output column
    assert r.input_ids[:len(r.prompt_ids)] == r.prompt_ids and r.labels[len(r.prompt_ids)] != -100
    assert r.answer.startswith("The answer is ") and tok.decode(r.input_ids[len(r.prompt_ids):-1]) == r.answer


# --------------------------------------------------------------------------------------------
# The command


@pytest.fixture(scope="module")
def evaluated(run_dir):
    result = cli("eval", str(run_dir), "--answers", "3", "--max-new-tokens", "6", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_perplexity_is_exp_of_the_mean_token_loss(evaluated, run_dir, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lowvram.train.data.build import build_datasets

    recipe, tok = recipe_and_tokenizer(run_dir)
    ev = build_datasets(recipe, tok).eval
    samples = list(zip(ev["input_ids"], ev["labels"], strict=True))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    base_loss = plain_mean_loss(base, samples)
    trained_loss = plain_mean_loss(PeftModel.from_pretrained(base, str(run_dir)).eval(), samples)
    b, t = evaluated["base"], evaluated["trained"]
    assert b["loss"] == pytest.approx(base_loss, rel=1e-5) and t["loss"] == pytest.approx(trained_loss, rel=1e-5)
    assert b["perplexity"] == pytest.approx(math.exp(base_loss), rel=1e-5)
    assert t["perplexity"] == pytest.approx(math.exp(trained_loss), rel=1e-5)
    assert t["loss"] < b["loss"]  # 4 steps at lr 3e-3 on the same kind of rows
    p = evaluated["plan"]
    assert (p["rows"], p["answers"], p["device"], p["kind"]) == (12, 3, "cpu", "adapter")
    assert p["tokens"] == sum(sum(x != -100 for x in lab[1:]) for _, lab in samples)


def test_answers_are_the_models_greedy_output(evaluated, run_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lowvram.train.after.scoring import score
    from lowvram.train.data.heldout import held_out_set

    recipe, tok = recipe_and_tokenizer(run_dir)
    rows = held_out_set(recipe, tok).rows[:3]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(recipe.model.name_or_path), str(run_dir)).eval()
    texts = []
    for r in rows:
        ids = torch.tensor([r.prompt_ids])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             stop_strings=["\n### "], tokenizer=tok)  # the run trained on alpaca rows
        texts.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    samples = evaluated["trained"]["samples"]
    assert [s[2] for s in samples] == [t.split("\n### ", 1)[0].strip() for t in texts]
    assert [s[1] for s in samples] == [r.answer for r in rows]
    assert evaluated["trained"]["exact_match"] == sum(score(t, r.answer).exact for t, r in zip(texts, rows, strict=True)) / 3


def test_recorded_and_listed(evaluated, run_dir):
    rows = json.loads((run_dir / "evals.json").read_text())
    assert rows[-1]["trained"]["loss"] == evaluated["trained"]["loss"] and rows[-1]["rows"] == 12
    shown = cli("show", str(run_dir))
    assert shown.exit_code == 0 and "eval: data.validation 0.25" in shown.output, shown.output
    assert f"-> {evaluated['trained']['loss']:.4f}" in shown.output
    listed = CliRunner().invoke(app, ["runs", str(run_dir)], env={"COLUMNS": "300"})
    assert listed.exit_code == 0 and "finished, 1 eval(s)" in listed.output, listed.output
    as_json = json.loads(cli("show", str(run_dir), "--json").stdout)
    assert as_json["evals"][-1]["base"]["loss"] == evaluated["base"]["loss"]


def test_table_shows_base_and_trained(run_dir):
    result = cli("eval", str(run_dir), "--answers", "0")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "base vs trained" in out and "held-out loss" in out and "perplexity" in out, out
    assert "exact match" not in out  # --answers 0: the loss only
    assert "needs" in result.stderr and "on the CPU" in result.stderr


def test_data_file_in_another_layout(run_dir, tmp_path):
    """--data FILE: question/answer rows (recognised as completion), a numeric answer scored as a number."""
    f = tmp_path / "qa.jsonl"
    f.write_text("".join(json.dumps({"question": f"Add {a} and {b}.", "answer": str(a + b)}) + "\n"
                         for a, b in ((1, 2), (3, 4))))
    # the recipe's format is alpaca: the file's rows need its columns
    assert_user_error(cli("eval", str(run_dir), "--data", str(f)), "missing field 'instruction'")
    g = tmp_path / "alpaca.jsonl"
    g.write_text("".join(json.dumps({"instruction": f"Add {a} and {b}.", "output": str(a + b)}) + "\n"
                         for a, b in ((1, 2), (3, 4))))
    result = cli("eval", str(run_dir), "--data", str(g), "--max-new-tokens", "4", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["plan"]["data"], out["plan"]["rows"], out["plan"]["answers"]) == (str(g), 2, 2)


def test_scoring_normalises_as_users_expect():
    from lowvram.train.after.scoring import normalize, score

    assert normalize("  The Answer is  5. ") == "the answer is  5".replace("  ", " ")
    assert score("The answer is 5.", "the answer is 5").exact
    assert score('"Paris!"', "paris").exact and not score("Paris, France", "paris").exact
    assert score("Paris, France", "Paris").contains
    assert score("3 + 4 = 7", "7").exact and score("It is 1,024.", "1024").exact
    assert not score("7 apples, not 8", "7").exact and score("7 apples, not 8", "7").contains
    assert not score("", "x").exact and not score("anything", "").contains


def test_full_run_and_its_checkpoint(tmp_path, tiny_model_dir):
    """A full fine-tune: the trained folder and, after it is freed, the recipe's model as the base;
    a checkpoint of the run is evaluated with the run's recipe (the folder above it)."""
    from transformers import AutoModelForCausalLM

    from lowvram.train.data.build import build_datasets

    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2, save_steps=1, validation="0.25",
                          techniques="lora: off, mixed_precision: fp32")
    assert cli("train", str(recipe)).exit_code == 0
    run = tmp_path / "out"
    rec, tok = recipe_and_tokenizer(run)
    ev = build_datasets(rec, tok).eval
    samples = list(zip(ev["input_ids"], ev["labels"], strict=True))
    for folder in (run, run / "checkpoint-1"):
        result = cli("eval", str(folder), "--answers", "0", "--json")
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        assert out["plan"]["kind"] == "full" and out["base"]["exact_match"] is None
        trained = AutoModelForCausalLM.from_pretrained(folder).eval()
        assert out["trained"]["loss"] == pytest.approx(plain_mean_loss(trained, samples), rel=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert out["base"]["loss"] == pytest.approx(plain_mean_loss(base, samples), rel=1e-5)
    assert len(json.loads((run / "evals.json").read_text())) == 2  # the checkpoint's is the run's record too


# --------------------------------------------------------------------------------------------
# lm-eval


HAS_LM_EVAL = __import__("importlib").util.find_spec("lm_eval") is not None


@pytest.mark.skipif(not HAS_LM_EVAL, reason="lm-eval (the [eval] extra) not installed")
def test_lm_eval_task_on_local_files(run_dir, tiny_model_dir, monkeypatch):
    """A real lm-eval run of a local multiple-choice task, base and trained; the base's score is
    lm-eval's own on the base model folder (its HF loader: the adapter really was off)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(REPO)  # the task reads tests/data/lmeval/tiny_mc.jsonl from here
    result = cli("eval", str(run_dir), "--answers", "0", "--tasks", "lowvram_tiny_mc",
                 "--task-dir", "tests/data/lmeval", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    tasks = out["base"]["tasks"]
    assert set(tasks) == {"lowvram_tiny_mc acc"} and set(out["trained"]["tasks"]) == set(tasks)
    own = simple_evaluate(model="hf", model_args={"pretrained": str(tiny_model_dir), "device": "cpu"},
                          tasks=["lowvram_tiny_mc"], task_manager=TaskManager(include_path="tests/data/lmeval",
                                                                                include_defaults=False),
                          log_samples=False, bootstrap_iters=0)
    assert tasks["lowvram_tiny_mc acc"] == own["results"]["lowvram_tiny_mc"]["acc,none"]
    assert "Traceback" not in result.stderr and "fatal:" not in result.stderr


def test_lm_eval_unknown_task(run_dir):
    if not HAS_LM_EVAL:
        pytest.skip("lm-eval not installed")
    assert_user_error(cli("eval", str(run_dir), "--tasks", "nope", "--task-dir", str(REPO / "tests/data/lmeval")),
                      "no task nope", "lowvram_tiny_mc")


def test_tasks_without_lm_eval_is_refused(run_dir, monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version

    def version(name):
        if name == "lm_eval":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert_user_error(cli("eval", str(run_dir), "--tasks", "x"), "needs lm-eval", "lowvram[eval]")


# --------------------------------------------------------------------------------------------
# User errors


def test_no_held_out_data(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=1)
    assert cli("train", str(recipe)).exit_code == 0
    assert_user_error(cli("eval", str(tmp_path / "out")), "held no data out", "--data FILE")


def test_refused_when_memory_is_short(run_dir, monkeypatch):
    import lowvram.hardware

    monkeypatch.setattr(lowvram.hardware, "host_memory", lambda: (2**30, 100 * 2**10))  # 100 KiB free
    assert_user_error(cli("eval", str(run_dir)), "eval needs", "of host RAM", "0.1 MiB available", "--data FILE")


def test_not_a_run(tmp_path):
    assert_user_error(cli("eval", str(tmp_path)), "not a lowvram run")


def test_docs_eval_commands(run_dir, tmp_path, monkeypatch):
    """docs/eval.md's commands, run as written on a copy of the run at runs/quickstart."""
    import re
    import shlex
    import shutil

    text = (REPO / "docs" / "eval.md").read_text()
    cmds = [line.split("  #", 1)[0].strip() for block in re.findall(r"```text\n(.*?)```", text, re.S)
            for line in block.splitlines() if line.startswith("lowvram ")]
    assert len(cmds) == 3 and all(c.split()[1] == "eval" for c in cmds), cmds
    shutil.copytree(run_dir, tmp_path / "runs" / "quickstart")
    shutil.copytree(REPO / "tests" / "data" / "lmeval", tmp_path / "tests" / "data" / "lmeval")
    monkeypatch.chdir(tmp_path)
    for cmd in cmds:
        if "--tasks" in cmd and not HAS_LM_EVAL:
            continue
        result = cli(*shlex.split(cmd)[1:], "--max-new-tokens", "4")
        assert result.exit_code == 0, (cmd, result.output)
    assert len(json.loads((tmp_path / "runs" / "quickstart" / "evals.json").read_text())) >= 2
