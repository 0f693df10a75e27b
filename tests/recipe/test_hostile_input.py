"""Hostile and broken input: malformed data files give an error naming the file and row (or are
skipped and counted), never a traceback; no shell runs recipe text; remote code is opt-in and
announced; `lowvram env` prints no secret."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from lowvram.cli import app
from lowvram.errors import DataError
from lowvram.recipe import parse_recipe
from lowvram.train.data.build import build_datasets
from tests.train.test_e2e import train, write_recipe

REPO = Path(__file__).resolve().parents[2]


def _recipe(data: Path, skip: bool = False):
    text = f"""\
model: {{name_or_path: tiny}}
data:
  datasets: [{{path: {data.name}, format: alpaca}}]
  skip_bad_rows: {str(skip).lower()}
training: {{seq_len: 64, batch_size: 4}}
"""
    return parse_recipe(text, "recipe.yaml", source=data.parent / "recipe.yaml")


GOOD = {"instruction": "Add 1 and 2.", "input": "", "output": "The answer is 3."}

# One jsonl line: a good row, or something broken in one of the ways real files are broken.
bad_lines = st.one_of(
    st.text(max_size=40).filter(lambda t: t.strip() and "\n" not in t and "\r" not in t),  # not JSON
    st.builds(json.dumps, st.one_of(st.integers(), st.lists(st.integers(), max_size=3), st.none(), st.text(max_size=10))),
    st.builds(lambda k: json.dumps({k2: v for k2, v in GOOD.items() if k2 != k}), st.sampled_from(["instruction", "output"])),
    st.builds(lambda v: json.dumps({**GOOD, "output": v}), st.one_of(st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2), st.just(""))),
    st.builds(lambda s: json.dumps(GOOD)[: s], st.integers(1, len(json.dumps(GOOD)) - 1)),  # truncated row
)
good_lines = st.builds(lambda t: json.dumps({**GOOD, "output": t or "x"}, ensure_ascii=False),
                       st.text(min_size=1, max_size=30).filter(lambda t: t.strip()))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.tuples(st.booleans(), st.one_of(good_lines, bad_lines)), min_size=1, max_size=8))
def test_malformed_jsonl_names_the_row_or_is_skipped_and_counted(tmp_path, tiny_tokenizer, lines):
    data = tmp_path / "rows.jsonl"
    text = [line for _, line in lines]
    data.write_text("\n".join(text) + "\n", encoding="utf-8")
    bad = [i for i, line in enumerate(text, 1) if not _is_good(line)]
    try:
        bundle = build_datasets(_recipe(data), tiny_tokenizer)
        assert not bad, f"rows {bad} were accepted"
        assert bundle.stats.skipped_bad_rows == 0
    except DataError as e:
        assert bad, e.message
        assert re.search(rf"rows\.jsonl:{bad[0]}\b", e.message), e.message
    try:
        skipped = build_datasets(_recipe(data, skip=True), tiny_tokenizer)
        assert skipped.stats.skipped_bad_rows == len(bad)
    except DataError as e:  # every row bad: nothing left to train on, and it says so
        assert len(bad) == len(text) and "no training samples left" in e.message and f"skipped bad rows: {len(bad)}" in e.hint


def _is_good(line: str) -> bool:
    try:
        row = json.loads(line)
    except ValueError:
        return False
    return (isinstance(row, dict) and all(isinstance(row.get(k), str) and row.get(k).strip() for k in ("instruction", "output")))


def test_a_row_with_unicode_line_separators_is_one_row(tmp_path, tiny_tokenizer):
    """JSON strings may hold U+2028, U+0085 and friends raw; they do not end a jsonl line."""
    data = tmp_path / "rows.jsonl"
    row = {**GOOD, "output": "first\u2028second\x85third\x1cfourth"}
    data.write_text(json.dumps(row, ensure_ascii=False) + "\n" + json.dumps(GOOD) + "\n", encoding="utf-8")
    assert build_datasets(_recipe(data), tiny_tokenizer).stats.train_rows == 2


def test_wrong_encoding_empty_file_and_missing_columns(tmp_path, tiny_tokenizer):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(json.dumps(GOOD).encode() + b"\n" + '{"instruction": "caf\u00e9", "output": "x"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"rows\.jsonl: not UTF-8 text \(byte \d+, line 2\)"):
        build_datasets(_recipe(data), tiny_tokenizer)
    data.write_bytes(b"")
    with pytest.raises(DataError, match=r"rows\.jsonl: the data file is empty"):
        build_datasets(_recipe(data), tiny_tokenizer)
    data.write_text("\n  \n")
    with pytest.raises(DataError, match="empty"):
        build_datasets(_recipe(data), tiny_tokenizer)
    data.write_text(json.dumps(GOOD) + "\n" + json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    with pytest.raises(DataError, match=r"rows\.jsonl:2: missing field 'instruction'.*columns present: prompt, completion"):
        build_datasets(_recipe(data), tiny_tokenizer)
    assert build_datasets(_recipe(data, skip=True), tiny_tokenizer).stats.skipped_bad_rows == 1


def test_a_20_mb_line(tmp_path, tiny_tokenizer):
    data = tmp_path / "rows.jsonl"
    huge = "x" * 20_000_000
    data.write_text(json.dumps(GOOD) + "\n" + '{"instruction": "' + huge + "\n")  # unterminated
    # past the line limit of seq_len 64 (1 MiB): named by file and line before it is parsed (issue 42)
    with pytest.raises(DataError, match=r"rows\.jsonl:2: the line is longer than 1\.0 MiB") as e:
        build_datasets(_recipe(data), tiny_tokenizer)
    assert len(e.value.message) < 500  # the row is named, not printed
    data.write_text(json.dumps({**GOOD, "output": "word " * 200_000}) + "\n" + json.dumps(GOOD) + "\n")  # 1 MB
    bundle = build_datasets(_recipe(data), tiny_tokenizer)  # truncated or dropped, never a crash
    assert bundle.stats.train_rows + bundle.stats.truncated >= 1


def test_bad_data_through_the_cli_is_an_error_not_a_traceback(tmp_path, tiny_model_dir):
    (tmp_path / "bad.jsonl").write_text(json.dumps(GOOD) + "\n[1, 2]\n")
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=1, data="bad.jsonl")
    result = train(str(recipe))
    assert result.exit_code == 1
    assert re.search(r"error: .*bad\.jsonl:2: expected an object with fields, got list", result.output), result.output
    assert "hint:" in result.output and "Traceback" not in result.output


# --------------------------------------------------------------------------------------------
# Code execution and secrets


def test_no_shell_runs_anything():
    hits = []
    for path in (REPO / "lowvram").rglob("*.py"):
        text = path.read_text()
        for pattern in ("shell=True", "os.system(", "os.popen(", "commands.getoutput"):
            if pattern in text:
                hits.append(f"{path.relative_to(REPO)}: {pattern}")
    assert not hits


def test_trust_remote_code_is_off_unless_set_and_announced(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir)
    from lowvram.recipe import load_recipe

    assert load_recipe(recipe).model.trust_remote_code is False
    plain = CliRunner().invoke(app, ["train", str(recipe), "--dry-run"])
    assert plain.exit_code == 0 and "trust_remote_code is on" not in plain.output
    on = CliRunner().invoke(app, ["train", str(recipe), "--dry-run", "--set", "model.trust_remote_code=true"])
    assert on.exit_code == 0, on.output
    assert "warning: model.trust_remote_code is on: Python code shipped with the model will run" in on.output


def test_env_prints_no_secret(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret-hf-xyz")
    monkeypatch.setenv("WANDB_API_KEY", "secret-wandb-xyz")
    monkeypatch.setenv("SOME_SERVICE_SECRET", "secret-svc-xyz")
    for args in (["env"], ["env", "--json"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0 and "secret-" not in result.output
