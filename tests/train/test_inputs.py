"""Only ordinary files are read, and never more than a limit (issue 42, item 3), through the real
CLI in a subprocess: a recipe, data file, model or tokenizer file that is a FIFO (os.mkfifo),
/dev/zero, /dev/urandom or a link to one is refused with error/hint at once; one enormous data
line and an oversized recipe are errors naming the file (and line) while memory stays small.

Each command runs with a timeout and a 4 GiB address-space limit, so a regression (a FIFO that
blocks, /dev/zero read to the end: 23 GB of RSS before this fix) fails instead of hanging or
eating the machine.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.train.test_e2e import write_recipe

# The child prints its own peak RSS (VmHWM, KiB) on stderr when the command ends (getrusage's
# ru_maxrss would carry the forking pytest's peak across exec).
_CHILD = (
    "import sys\n"
    "from lowvram.cli import main\n"
    "try:\n    main()\n"
    "finally:\n"
    "    hwm = [x for x in open('/proc/self/status') if x.startswith('VmHWM:')][0].split()[1]\n"
    "    sys.stderr.write(f'maxrss_kib {hwm}\\n')\n"
)
LIMIT_BYTES = 4 << 30
TIMEOUT_S = 120


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))


def lowvram(*args: str, cwd: Path) -> tuple[int, str, int]:
    """(exit code, stderr without the rss line, peak RSS in bytes) of `lowvram ARGS`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _CHILD, *args], cwd=cwd, env=env, text=True, capture_output=True,
                          timeout=TIMEOUT_S, preexec_fn=_limit)
    lines = done.stderr.splitlines()
    rss = next((int(x.split()[1]) * 1024 for x in lines if x.startswith("maxrss_kib ")), 0)
    return done.returncode, "\n".join(x for x in lines if not x.startswith("maxrss_kib ")), rss


def refused(code: int, err: str, *needles: str) -> None:
    assert code == 1, err
    assert "Traceback" not in err, err
    assert sum(x.startswith("error: ") for x in err.splitlines()) == 1, err
    assert sum(x.startswith("hint: ") for x in err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


@pytest.fixture
def recipe(tmp_path, tiny_model_dir) -> Path:
    return write_recipe(tmp_path, tiny_model_dir, steps=2)


# --------------------------------------------------------------------------------------------
# The recipe itself


@pytest.mark.parametrize("kind", ["fifo", "zero-link", "urandom"])
def test_a_recipe_that_is_not_a_file_is_refused_at_once(tmp_path, kind):
    path = tmp_path / "recipe.yaml"
    if kind == "fifo":
        os.mkfifo(path)
        why = "is a FIFO (named pipe), not an ordinary file"
    elif kind == "zero-link":
        path.symlink_to("/dev/zero")
        why = "is a link to /dev/zero, a character device, not an ordinary file"
    else:
        path = Path("/dev/urandom")
        why = "is a character device, not an ordinary file"
    for command in ("validate", "train"):
        code, err, rss = lowvram(command, str(path), cwd=tmp_path)
        refused(code, err, f"error: the recipe {path} {why}")
        assert rss < 1 << 30, rss


def test_a_recipe_larger_than_the_limit_is_refused(tmp_path, recipe):
    big = tmp_path / "big.yaml"
    big.write_text(recipe.read_text() + "# " + "x" * (2 << 20) + "\n")
    code, err, _ = lowvram("validate", str(big), cwd=tmp_path)
    refused(code, err, f"error: the recipe {big} is larger than 1.0 MiB")


# --------------------------------------------------------------------------------------------
# Data, model and tokenizer files


def _data_link(tmp_path: Path, recipe: Path, kind: str) -> Path:
    data = tmp_path / "data.jsonl"
    data.unlink()
    if kind == "fifo":
        os.mkfifo(data)
    else:
        data.symlink_to(f"/dev/{kind}")
    return data


@pytest.mark.parametrize(("kind", "why"), [("fifo", "a FIFO (named pipe)"),
                                           ("zero", "a link to /dev/zero, a character device"),
                                           ("urandom", "a link to /dev/urandom, a character device")])
def test_a_data_file_that_is_not_a_file_is_refused_at_once(tmp_path, recipe, kind, why):
    data = _data_link(tmp_path, recipe, kind)
    for command in ("validate", "train"):
        code, err, rss = lowvram(command, str(recipe), cwd=tmp_path)
        refused(code, err, f"data file {data} is {why}, not an ordinary file")
        assert rss < 1 << 30, rss


@pytest.mark.parametrize(("name", "kind"), [("config.json", "fifo"), ("tokenizer.json", "zero")])
def test_a_model_file_that_is_not_a_file_is_refused_at_once(tmp_path, tiny_model_dir, name, kind):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / name).unlink()
    if kind == "fifo":
        os.mkfifo(model / name)
        why = "a FIFO (named pipe)"
    else:
        (model / name).symlink_to("/dev/zero")
        why = "a link to /dev/zero, a character device"
    recipe = write_recipe(tmp_path, model, steps=2)
    for command in ("validate", "train"):
        code, err, _ = lowvram(command, str(recipe), cwd=tmp_path)
        refused(code, err, f"{model / name} is {why}, not an ordinary file")


def test_a_tokenizer_path_that_is_a_fifo_is_refused_at_once(tmp_path, tiny_model_dir):
    os.mkfifo(tmp_path / "tok")
    recipe = write_recipe(tmp_path, tiny_model_dir, steps=2, extra="")
    recipe.write_text(recipe.read_text().replace(f"name_or_path: {tiny_model_dir}}}",
                                                 f"name_or_path: {tiny_model_dir}, tokenizer: tok}}"))
    code, err, _ = lowvram("train", str(recipe), cwd=tmp_path)
    refused(code, err, f"model.tokenizer {tmp_path / 'tok'} is a FIFO (named pipe), not an ordinary file")


# --------------------------------------------------------------------------------------------
# One enormous line


def _huge_line(tmp_path: Path) -> Path:
    """data.jsonl with a 40 MB row on line 3 (and ordinary rows around it)."""
    data = tmp_path / "data.jsonl"
    rows = data.read_text().splitlines(keepends=True)
    huge = json.dumps({"instruction": "word " * (8 << 20), "input": "", "output": "y"}) + "\n"
    data.write_text("".join(rows[:2]) + huge + "".join(rows[2:]))
    return data


def test_validate_names_an_enormous_line_and_stays_small(tmp_path, recipe):
    data = _huge_line(tmp_path)
    code, err, rss = lowvram("validate", str(recipe), cwd=tmp_path)
    refused(code, err, f"{data}:3: the line is longer than 1.0 MiB, the most read for training.seq_len 64")
    assert rss < 200 << 20, rss  # the 40 MB line is never held: ~40 MiB of interpreter and libraries


def test_reading_an_enormous_line_allocates_no_more_than_the_limit(tmp_path, recipe):
    import tracemalloc

    from lowvram.errors import LowvramError
    from lowvram.recipe import load_recipe
    from lowvram.train.data.read import load_rows

    data = _huge_line(tmp_path)
    r = load_recipe(recipe)
    tracemalloc.start()
    try:
        with pytest.raises(LowvramError) as raised:
            load_rows(r, r.data.datasets[0], "train", None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert raised.value.message.startswith(f"{data}:3: the line is longer than 1.0 MiB"), raised.value.message
    assert raised.value.hint == "split it into samples of at most seq_len tokens, or raise training.seq_len"
    assert peak < 3 << 20, peak  # one line's limit (1 MiB + 1) and the rows before it


@pytest.mark.slow
def test_train_names_an_enormous_line_and_stays_small(tmp_path, recipe):
    data = _huge_line(tmp_path)
    code, err, rss = lowvram("train", str(recipe), cwd=tmp_path)
    refused(code, err, f"{data}:3: the line is longer than 1.0 MiB")
    assert rss < 1 << 30, rss  # the model and libraries (~450 MiB); before: many GB


def test_a_json_row_longer_than_the_limit_is_named(tmp_path, tiny_model_dir):
    from lowvram.errors import LowvramError
    from lowvram.recipe import load_recipe
    from lowvram.train.data.read import load_rows

    rows = [{"instruction": "Add 1 and 2.", "input": "", "output": "3"}] * 3
    rows[1] = {"instruction": "x" * (2 << 20), "input": "", "output": "3"}
    (tmp_path / "data.json").write_text(json.dumps(rows))
    r = load_recipe(write_recipe(tmp_path, tiny_model_dir, data="data.json"))
    with pytest.raises(LowvramError, match=r"^data.json: row 2: the row is longer than 1.0 MiB"):
        load_rows(r, r.data.datasets[0], "train", None)


def test_line_limits_and_bounded_lines(tmp_path):
    import io

    from lowvram.inputfiles import LineTooLong, bounded_lines, line_limit_bytes

    assert line_limit_bytes(64) == 1 << 20 and line_limit_bytes(8192) == 1 << 20
    assert line_limit_bytes(32768) == 32 * 32768 * 4
    text = b"abc\n" + b"x" * 8 + b"\n" + b"y" * 8
    assert list(bounded_lines(io.BytesIO(text), 8)) == [(1, 0, b"abc\n"), (2, 4, b"x" * 8 + b"\n"), (3, 13, b"y" * 8)]
    with pytest.raises(LineTooLong) as raised:
        list(bounded_lines(io.BytesIO(b"ok\n" + b"z" * 9 + b"\n"), 8))
    assert raised.value.line == 2
