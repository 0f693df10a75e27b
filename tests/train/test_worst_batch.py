"""Worst batch first (issue 42 item 2), through `lowvram train` on the tiny model: the longest batch
runs before the run and changes nothing of it (the same losses and weights with a fixed seed,
dropout on); an out-of-memory error there re-plans at step 0 on an emulated card; where the
check cannot run as the run's steps do, `on` is refused and `auto` skips it."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from lowvram.errors import LowvramError
from lowvram.train.run import oom, worst_batch
from tests.train.test_e2e import metrics, train, write_recipe
from tests.train.test_recover import CARD


def _recipe(tmp_path, tiny_model_dir, asked: str):
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=3)
    text = recipe.read_text().replace("output_dir: out", f"output_dir: out\n  worst_batch_first: {asked}")
    recipe.write_text(text.replace("dropout: 0.0", "dropout: 0.1"))  # dropout draws from the generators
    return recipe


def test_the_worst_batch_runs_first_and_changes_nothing_of_the_run(tmp_path, tiny_model_dir):
    (tmp_path / "on").mkdir(), (tmp_path / "off").mkdir()
    on = train(str(_recipe(tmp_path / "on", tiny_model_dir, "on")))
    off = train(str(_recipe(tmp_path / "off", tiny_model_dir, "auto")))  # auto: off on the CPU
    assert on.exit_code == 0 and off.exit_code == 0, on.output + off.output
    longest = max(metrics(tmp_path / "on" / "out").get("data_longest_tokens") or 0, 0)
    found = re.search(r"worst batch first: 4 rows of up to (\d+) tokens, forward and backward: peak ([\d.]+) MiB "
                      r"measured; the plan predicts [\d.]+ MiB for a whole step", on.output)
    assert found, on.output
    assert "worst batch first" not in off.output
    assert "worst batch first (" in on.output  # the summary's row
    a, b = metrics(tmp_path / "on" / "out"), metrics(tmp_path / "off" / "out")
    assert a["loss_history"] == b["loss_history"]  # exactly: no weight, moment, schedule or draw moved
    assert a["worst_batch_tokens"] == int(found.group(1)) and a["worst_batch_peak_bytes"] > 0
    assert longest in (0, int(found.group(1)))
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "on" / "out" / "adapter_model.safetensors"))
    wb = load_file(str(tmp_path / "off" / "out" / "adapter_model.safetensors"))
    assert all(bool((wa[k] == wb[k]).all()) for k in wa)


def test_an_oom_on_the_worst_batch_re_plans_at_step_0(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv(oom.EMULATE_ENV, CARD)
    result = train(str(_recipe(tmp_path, tiny_model_dir, "on")))
    assert result.exit_code == 0, result.output
    assert re.search(r"OOM at step 0 \(measured 3\.\d MiB\); retrying with micro-batch 2 x 2; starting over "
                     r"\(retry 1 of 3\)", result.output), result.output
    assert "worst batch first: 2 rows of up to" in result.output
    m = metrics(tmp_path / "out")
    assert m["oom_retries"][0]["step"] == 0 and m["final_plan"]["micro_batch_size"] == 2


def test_on_is_refused_where_the_check_cannot_run_and_auto_skips_it(tmp_path):
    from lowvram.planning.fixed import resolve_fixed
    from lowvram.recipe import parse_recipe

    recipe = parse_recipe("model: {name_or_path: x}\ndata: {datasets: [{path: d.jsonl}]}\n"
                          "training: {worst_batch_first: on}\n", source=tmp_path / "r.yaml")
    plan = resolve_fixed(recipe)
    assert worst_batch.wanted(recipe, plan, processes=1)  # on: also on the CPU
    for changed, processes, why in ((replace(plan, optimizer="adamw_in_backward"), 1, "steps inside the backward"),
                                    (plan, 2, "several processes"), (replace(plan, loss="fused"), 1, "Liger")):
        with pytest.raises(LowvramError, match=why):
            worst_batch.wanted(recipe, changed, processes)
        auto = recipe.model_copy(update={"training": recipe.training.model_copy(update={"worst_batch_first": "auto"})})
        assert not worst_batch.wanted(auto, replace(changed, device="cuda"), processes)
    auto = recipe.model_copy(update={"training": recipe.training.model_copy(update={"worst_batch_first": "auto"})})
    assert worst_batch.wanted(auto, replace(plan, device="cuda"), 1) and not worst_batch.wanted(auto, plan, 1)


def test_worst_rows_are_the_longest_then_the_most_images():
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": [[1] * 5, [1] * 9, [1] * 9, [1] * 2],
                                     "images": [[], [], ["a.png"], ["a.png", "b.png"]]})
    assert worst_batch.worst_rows(ds, 2) == (2, 1)
    assert worst_batch.worst_rows(ds, 1) == (2,)
