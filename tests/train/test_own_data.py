"""Your own data (issue 45): ShareGPT read directly, formats recognised from the columns, which
turns are trained, and `validate` / `lowvram data` checking every row as training reads it,
without loading the model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.train.build.loss import IGNORE_INDEX
from lowvram.train.data.build import build_datasets
from tests.train.test_data import recipe, write_jsonl

SHAREGPT = [
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                       {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "2+2?"},
                       {"from": "gpt", "value": "4"}]},
    {"conversations": [{"from": "human", "value": "Name a colour"}, {"from": "gpt", "value": "Blue"}]},
]
OPENAI = [{"messages": [{"role": {"system": "system", "human": "user", "gpt": "assistant"}[m["from"]],
                         "content": m["value"]} for m in row["conversations"]]} for row in SHAREGPT]


def trained_text(tokenizer, row) -> list[str]:
    """The decoded runs of tokens that carry the loss."""
    runs, cur = [], []
    for i, lab in zip(row["input_ids"], row["labels"], strict=True):
        if lab != IGNORE_INDEX:
            cur.append(i)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    return runs + ([tokenizer.decode(cur)] if cur else [])


def write_recipe(tmp_path: Path, model_dir: Path, datasets: list[dict], **data_keys) -> Path:
    doc = {"model": {"name_or_path": str(model_dir)}, "data": {"datasets": datasets, **data_keys},
           "training": {"seq_len": 64, "batch_size": 2, "output_dir": str(tmp_path / "run")}}
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps(doc))
    return path


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


# --------------------------------------------------------------------------------------------
# Formats


def test_sharegpt_trains_with_no_conversion_same_tokens_as_openai_messages(tmp_path, tiny_tokenizer):
    write_jsonl(tmp_path / "sg.jsonl", SHAREGPT)
    write_jsonl(tmp_path / "oa.jsonl", OPENAI)
    sg = build_datasets(recipe(tmp_path, [{"path": "sg.jsonl"}]), tiny_tokenizer)  # format left out
    oa = build_datasets(recipe(tmp_path, [{"path": "oa.jsonl", "format": "chat"}]), tiny_tokenizer)
    assert sg.train["input_ids"] == oa.train["input_ids"] and sg.train["labels"] == oa.train["labels"]
    first = next(r for r in sg.train if len(r["input_ids"]) == max(map(len, sg.train["input_ids"])))
    assert trained_text(tiny_tokenizer, first) == ["Hello!<|im_end|>\n", "4<|im_end|>\n"]


def test_chat_with_a_property_and_role_mapping_reads_sharegpt(tmp_path, tiny_tokenizer):
    write_jsonl(tmp_path / "sg.jsonl", SHAREGPT)
    mapped = {"path": "sg.jsonl", "format": "chat", "fields": {"messages": "conversations", "role": "from",
                                                                 "content": "value"},
              "roles": {"human": "user", "gpt": "assistant"}}
    a = build_datasets(recipe(tmp_path, [mapped]), tiny_tokenizer)
    b = build_datasets(recipe(tmp_path, [{"path": "sg.jsonl", "format": "sharegpt"}]), tiny_tokenizer)
    assert a.train["labels"] == b.train["labels"] and a.train["input_ids"] == b.train["input_ids"]


def test_train_on_last_trains_only_the_final_assistant_turn_and_all_every_token(tmp_path, tiny_tokenizer):
    write_jsonl(tmp_path / "sg.jsonl", SHAREGPT[:1])
    last = build_datasets(recipe(tmp_path, [{"path": "sg.jsonl"}], train_on="last"), tiny_tokenizer)
    assert trained_text(tiny_tokenizer, last.train[0]) == ["4<|im_end|>\n"]
    every = build_datasets(recipe(tmp_path, [{"path": "sg.jsonl"}], train_on="all"), tiny_tokenizer)
    assert IGNORE_INDEX not in every.train[0]["labels"]


def test_tool_calls_reach_the_chat_template(tmp_path):
    from lowvram.recipe import DatasetSpec
    from lowvram.train.data.format import _messages

    call = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]
    row = {"messages": [{"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": None, "tool_calls": call},
                        {"role": "tool", "content": "4", "tool_call_id": "c1", "name": "add"},
                        {"role": "assistant", "content": "4"}]}
    out = _messages(row, DatasetSpec(path="x.jsonl", format="chat"))
    assert out[1] == {"role": "assistant", "content": "", "tool_calls": call}
    assert out[2] == {"role": "tool", "content": "4", "tool_call_id": "c1", "name": "add"}


@pytest.mark.parametrize(("header", "rows", "fmt", "fields"), [
    ("prompt,response", [("Hi", "Hello")], "completion", {"completion": "response"}),
    ("question,answer", [("2+2?", "4")], "completion", {"prompt": "question", "completion": "answer"}),
    ("instruction,output", [("Say hi", "hi")], "alpaca", {}),
    ("prompt,completion", [("a", "b")], "completion", {}),
])
def test_common_column_pairs_are_recognised_and_the_choice_printed(tmp_path, tiny_model_dir, header, rows, fmt,
                                                                   fields):
    (tmp_path / "d.csv").write_text(header + "\n" + "".join(f"{a},{b}\n" for a, b in rows * 4))
    path = write_recipe(tmp_path, tiny_model_dir, [{"path": "d.csv"}])
    from lowvram.recipe import load_recipe

    r = load_recipe(path)
    assert (r.data.datasets[0].format, r.data.datasets[0].fields) == (fmt, fields)
    result = cli("validate", str(path))
    assert result.exit_code == 0, result.output
    assert f"note: d.csv: format {fmt} (recognised from the columns" in result.output


# --------------------------------------------------------------------------------------------
# validate checks every row, before any model loads


@pytest.mark.parametrize(("rows", "dataset", "message"), [
    (SHAREGPT, {"format": "chat"}, "d.jsonl:1: missing field 'messages'"),  # ShareGPT given as chat
    ([{"question": "q", "answer": "a"}] * 3, {"format": "alpaca"}, "d.jsonl:1: missing field 'instruction'"),
])
def test_validate_names_every_row_that_lacks_the_formats_fields(tmp_path, tiny_model_dir, rows, dataset, message):
    write_jsonl(tmp_path / "d.jsonl", rows)
    result = cli("validate", str(write_recipe(tmp_path, tiny_model_dir, [{"path": "d.jsonl", **dataset}])))
    assert result.exit_code == 1
    assert f"problems in the data:\n  {message}" in result.stderr
    assert len(re.findall(r"d\.jsonl:\d+:", result.stderr)) == len(rows)  # all at once
    assert result.stderr.splitlines()[-1].startswith("hint: ") and "Traceback" not in result.output


def test_validate_refuses_a_csv_given_the_wrong_format_and_fields_the_format_lacks(tmp_path, tiny_model_dir):
    (tmp_path / "d.csv").write_text("prompt,response\nHi,Hello\nA,B\n")
    result = cli("validate", str(write_recipe(tmp_path, tiny_model_dir, [{"path": "d.csv", "format": "completion"}])))
    assert result.exit_code == 1 and "d.csv:2: missing field 'completion'" in result.stderr
    bad_keys = [{"path": "d.csv", "format": "alpaca", "fields": {"role": "from", "content": "value"}}]
    result = cli("validate", str(write_recipe(tmp_path, tiny_model_dir, bad_keys)))
    assert result.exit_code == 1 and "fields: 'role' is not a field of format alpaca" in result.stderr


def test_validate_reports_token_lengths_and_what_seq_len_cuts(tmp_path, tiny_model_dir):
    long = {"prompt": "word " * 10, "completion": "answer " * 80}
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hi", "completion": "Hello"}] * 3 + [long])
    result = cli("validate", str(write_recipe(tmp_path, tiny_model_dir, [{"path": "d.jsonl"}])))
    assert result.exit_code == 0, result.output
    assert "d.jsonl: format completion, all 4 rows read" in result.output
    assert re.search(r"tokens per sample: min \d+, median \d+, p95 \d+, max \d+ \(seq_len 64\); 4 samples", result.output)
    assert "cut to seq_len: 1 sample(s), of which 0 dropped" in result.output


def test_a_large_file_is_checked_on_a_spread_sample_with_true_line_numbers(tmp_path, monkeypatch):
    from lowvram.train.data import check

    rows = [{"prompt": f"p{i}", "completion": "c"} for i in range(400)]
    rows[300] = {"prompt": "p300"}  # line 301 lacks its completion
    write_jsonl(tmp_path / "d.jsonl", rows)
    monkeypatch.setattr(check, "FULL_CHECK_BYTES", 1024)
    monkeypatch.setattr(check, "SPREAD_ROWS", 400)
    r = recipe(tmp_path, [{"path": "d.jsonl", "format": "completion"}])
    report = check.check_data(r)
    assert report.files[0].sampled and 300 <= report.files[0].rows <= 400
    assert report.problems == ("d.jsonl:301: missing field 'completion'; expected text (columns present: prompt)",)


# --------------------------------------------------------------------------------------------
# lowvram data: the data as the model sees it


def test_data_command_marks_the_trained_tokens(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "sg.jsonl", SHAREGPT)
    path = write_recipe(tmp_path, tiny_model_dir, [{"path": "sg.jsonl"}])
    result = cli("data", str(path), "--samples", "1")
    assert result.exit_code == 0, result.output
    assert "--- sg.jsonl:1: 50 tokens, 10 trained (trained text in [[ ]])" in result.output
    assert "<|im_start|>assistant\n[[Hello!<|im_end|>\n]]<|im_start|>user" in result.output
    data = json.loads(cli("data", str(path), "--json", "-n", "2").stdout)
    assert [s["where"] for s in data["samples"]] == ["sg.jsonl:1", "sg.jsonl:2"]
    assert data["samples"][1]["pieces"][-1] == ["Blue<|im_end|>\n", True]
    assert data["tokens"]["samples"] == 2 and data["files"][0]["format"] == "sharegpt"


def test_dry_run_shows_a_rendered_sample(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "sg.jsonl", SHAREGPT * 2)
    result = cli("train", str(write_recipe(tmp_path, tiny_model_dir, [{"path": "sg.jsonl"}])), "--dry-run")
    assert result.exit_code == 0, result.output
    assert "# the data as the model sees it" in result.output and "[[Hello!<|im_end|>" in result.output
