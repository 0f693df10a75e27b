"""Dependency bounds (issue 24, item 10): lower bounds, not pins, the same in pyproject.toml and
lowvram.deps, and met by the libraries installed here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from lowvram.deps import MIN_VERSIONS, installed_versions, pip_line, version_problems

ROOT = Path(__file__).resolve().parents[1]


def _dependencies() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    out = {}
    for d in deps:
        name = re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower()
        out[name] = d[len(name):].strip()
    return out


def test_no_dependency_is_pinned_exactly():
    # torch==2.13.0 made pip replace a user's CUDA torch of another version (a multi-GB download,
    # maybe a build that does not match the driver); the Makefile pins this machine's CPU torch
    pinned = {n: spec for n, spec in _dependencies().items() if "==" in spec or "~=" in spec}
    assert pinned == {}


def test_the_bounds_in_pyproject_are_the_bounds_lowvram_checks():
    deps = _dependencies()
    for name, (low, why) in MIN_VERSIONS.items():
        assert f">={low}" in deps[name].split(","), (name, deps[name])
        assert why  # each bound says which API sets it
    # 5.17-5.22 have no TrainingArguments.activation_checkpointing (lowvram.train.build.trainer)
    assert MIN_VERSIONS["transformers"][0] == "5.23" and "<6" in deps["transformers"]


def test_the_installed_libraries_meet_the_bounds():
    found = installed_versions()
    assert set(found) == set(MIN_VERSIONS)
    assert version_problems(found) == []


def test_the_transformers_bound_is_the_api_lowvram_calls():
    # the API that sets the bound exists in the installed transformers (>= the bound)
    import dataclasses

    from transformers import PreTrainedModel, TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert {"activation_checkpointing", "activation_checkpointing_kwargs"} <= fields
    assert hasattr(PreTrainedModel, "activation_checkpointing_enable")


def test_an_old_or_missing_library_is_named_with_its_bound():
    problems = version_problems({"transformers": "5.17.0", "torch": "2.11.0+cu130",
                                 "bitsandbytes": None, "peft": "0.18.0"})
    assert len(problems) == 2, problems
    assert problems[0].startswith("transformers 5.17.0 is older than lowvram needs (>=5.23: ")
    assert "activation_checkpointing" in problems[0]
    assert problems[1].startswith("bitsandbytes is not installed (lowvram needs >=0.50: ")
    assert "'transformers>=5.23'" in pip_line()
