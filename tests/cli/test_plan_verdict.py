"""The search never changes the training algorithm unasked, and a plan that does not fit says so
on stderr with the changes that would fit; the plan's texts follow the plan (issue 45 items 5, 6)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.vocab import LOMO_OPTIMIZERS, PROJECTED_OPTIMIZERS

ALGORITHM_CHANGING = set(PROJECTED_OPTIMIZERS) | set(LOMO_OPTIMIZERS) | {"adafactor", "sgd"}
FULL_8B = ["plan", "--model", "llama-3-8b", "--method", "full", "--vram", "24GB", "--offload", "none"]


def plan(*args: str):
    return CliRunner().invoke(app, list(args))


def test_full_fine_tuning_on_auto_keeps_adamw_and_check_exits_1_naming_what_would_fit():
    result = plan(*FULL_8B, "--check")
    assert result.exit_code == 1
    err = result.stderr
    assert err.startswith("error: does not fit: the lowest-memory plan peaks at ")
    assert "changes that would fit, the smallest first:" in err
    assert ("  techniques.optimizer: any-that-fits (--optimizer any-that-fits): lomo fits (peak " in err
            and "but it changes the training algorithm: SGD without momentum" in err)
    assert err.splitlines()[-1].startswith("hint: ")
    data = json.loads(plan(*FULL_8B, "--json").stdout)
    assert data["fits"] is False and data["techniques"]["optimizer"] not in ALGORITHM_CHANGING
    assert any("any-that-fits" in s for s in data["suggestions"])


def test_opting_in_lets_the_search_take_an_algorithm_changing_optimizer():
    result = plan(*FULL_8B, "--optimizer", "any-that-fits", "--check", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["techniques"]["optimizer"] in ALGORITHM_CHANGING


@pytest.mark.parametrize("model", ["llama-3-8b", "qwen2.5-1.5b", "llama-3.2-3b"])
def test_auto_never_picks_an_optimizer_that_changes_the_algorithm(model):
    for vram in ("8GB", "16GB", "24GB"):
        data = json.loads(plan("plan", "--model", model, "--method", "full", "--vram", vram, "--json").stdout)
        assert data["techniques"]["optimizer"] not in ALGORITHM_CHANGING, (model, vram)


def test_a_recipe_opts_in_with_techniques_optimizer(tmp_path):
    from lowvram.planning.from_recipe import recipe_choices
    from lowvram.recipe import parse_recipe

    r = parse_recipe("model: {name_or_path: x}\ndata: {datasets: [{path: a.jsonl}]}\n"
                     "techniques: {optimizer: any-that-fits, lora: off}\n")
    assert recipe_choices(r)["optimizer_any"] is True and "optimizer" not in recipe_choices(r)


def test_a_method_that_fits_a_larger_card_is_named():
    result = plan("plan", "--model", "llama-3.3-70b", "--method", "full", "--vram", "24GB", "--offload", "none")
    assert "drop --method full: QLoRA (nf4-dq) fits a 48 GB card" in result.stderr or \
        "drop --method full and let the planner choose lora" in result.stderr, result.stderr


# --------------------------------------------------------------------------------------------
# Texts generated from the plan they describe


def test_the_peak_line_describes_the_plans_own_loss_and_method():
    from lowvram.plan.memory.moments import describe_moment

    qlora = describe_moment("backward_start", {"loss": "standard", "lora": True, "gradient_checkpointing": True})
    assert qlora == "every layer's checkpoint and the full logits and their gradient, at the loss"
    full = describe_moment("backward_start", {"loss": "chunked", "lora": False, "gradient_checkpointing": False})
    assert full.endswith("lm_head's new weight gradient beside the accumulated one")


def test_ladder_rows_say_host_ram_and_never_negative_savings():
    result = plan("plan", "--model", "llama-3-8b", "--method", "full", "--vram", "24GB", "--host-ram", "16GiB")
    assert "no (host RAM)" in result.stdout
    assert "-0." not in result.stdout.split("Ladder")[1].split("Other plans")[0]


def test_the_accumulation_reason_says_why_a_larger_micro_batch_was_not_taken():
    data = json.loads(plan("plan", "--model", "llama-3-8b", "--method", "full", "--vram", "24GB",
                           "--host-ram", "16GiB", "--json").stdout)
    why = data["reasons"]["gradient_accumulation"]
    assert "<= budget" not in why or "host RAM" in why or "no plan fits" in why, why


@pytest.mark.parametrize(("gb", "words"), [(8, "an 8 GB card"), (12, "a 12 GB card"), (80, "an 80 GB card"),
                                          (11, "an 11 GB card"), (24, "a 24 GB card")])
def test_card_articles(gb, words):
    from lowvram.plan.cards import card_words, read_vram

    assert card_words(gb) == words
    assert read_vram(f"{gb}GB").how.startswith(words)
