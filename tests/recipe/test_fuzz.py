"""Hostile recipes never produce a traceback: exit 1 or 2 and a message naming the problem."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from lowvram.cli import app

runner = CliRunner()

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
)
keys = st.one_of(
    st.sampled_from(["model", "data", "training", "lora", "techniques", "name_or_path", "datasets",
                     "seq_len", "learning_rate", "optimizer", "path", "format", "r"]),
    st.text(min_size=1, max_size=12),
)
trees = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(keys, inner, max_size=5)), max_leaves=25)


def invoke_on(tmp_path, data: bytes):
    p = tmp_path / "fuzz.yaml"
    p.write_bytes(data)
    return runner.invoke(app, ["validate", str(p)])


def assert_clean(r):
    assert r.exit_code in (0, 1, 2), r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    if r.exit_code == 1:
        assert r.stderr.startswith("error: ")
        assert "hint: " in r.stderr


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=st.dictionaries(keys, trees, max_size=6))
def test_random_structures(tmp_path, tree):
    text = yaml.safe_dump(tree, allow_unicode=True)
    assert_clean(invoke_on(tmp_path, text.encode()))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=200))
def test_binary_garbage(tmp_path, blob):
    assert_clean(invoke_on(tmp_path, blob))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_unicode_text(tmp_path, text):
    assert_clean(invoke_on(tmp_path, text.encode("utf-8", "surrogatepass")))


def test_hostile_yaml_constructs(tmp_path):
    cases = {
        "python tag": "model: !!python/object/apply:os.system ['echo pwned']\n",
        "python name": "model: !!python/name:os.system\n",
        "deep nesting": "a: " + "[" * 5000 + "]" * 5000 + "\n",
        "huge number": "model: {name_or_path: x}\ndata: {datasets: [{path: a}]}\ntraining: {seq_len: 1e400}\n",
        "duplicate keys": "model: {name_or_path: x}\nmodel: {name_or_path: y}\n",
        "unhashable key": "? [a, b]\n: 1\n",
    }
    for name, text in cases.items():
        r = invoke_on(tmp_path, text.encode())
        assert_clean(r)
        assert r.exit_code == 1, name
    assert not (tmp_path / "pwned").exists()
