"""`--resume` checks the base model as it checks the data (issue 42, item 6): a run records a
fingerprint of its base model's folder in its manifest (small files whole, weight files by size,
head and 8 sampled blocks: manifest.model_hashes), and a resume on a base that changed at the
same path (weights, config.json, a file added or gone) is refused with error/hint before anything
is rewritten; the same model copied again (new modification times) resumes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lowvram.train.run import manifest
from tests.train.test_e2e import metrics, train, write_recipe

MIXING = "error: --resume would continue the run in {out} with different settings, mixing two runs:"
HINT = ("hint: resume with the run's own settings, data and base model ({out}/recipe.yaml is its recipe), or start "
        "over: --overwrite, or a new training.output_dir (--set training.output_dir=runs/new)")


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _refused(result, out: Path, line: str) -> None:
    assert result.exit_code == 1, result.output
    lines = [x for x in result.output.splitlines() if x.startswith(("error:", "hint:", "  "))]
    assert lines == [MIXING.format(out=out), f"  {line}", HINT.format(out=out)], result.output


def test_resume_refuses_a_base_model_changed_at_the_same_path(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    recipe = write_recipe(tmp_path, model, steps=2, save_steps=1, extra="")
    assert train(str(recipe), "--set", "training.max_steps=1", "--set", "training.report_to=none").exit_code == 0
    out = tmp_path / "out"
    (out / "metrics.json").unlink()  # as if stopped after checkpoint-1
    before = _files(out)
    recorded = manifest.read(out)["model_sha256"]
    assert sorted(recorded) == sorted(p.name for p in model.iterdir())

    # Other weights in the same file: the same names, shapes, dtypes and size (a fine-tune of the same base).
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    save_file({k: v + 0.01 for k, v in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    assert weights.stat().st_size == size
    _refused(train(str(recipe), "--resume"), out,
             f"base model file model.safetensors changed since the run started (in {model})")
    shutil.copy(tiny_model_dir / "model.safetensors", weights)

    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    _refused(train(str(recipe), "--resume"), out, f"base model file config.json changed since the run started (in {model})")
    (model / "generation_config.json").unlink()
    assert "base model file generation_config.json is gone since the run started" in train(str(recipe), "--resume").output
    assert _files(out) == before  # nothing of the run was rewritten

    shutil.rmtree(model)
    shutil.copytree(tiny_model_dir, model)  # the same model again: new mtimes, the same fingerprint
    resumed = train(str(recipe), "--resume", "--set", "training.report_to=none")
    assert resumed.exit_code == 0, resumed.output
    assert metrics(out)["steps"] == 2


def test_a_weight_file_is_fingerprinted_by_its_size_head_and_sampled_blocks(tmp_path, monkeypatch):
    """A weight file over SMALL_FILE_BYTES: its size, first HEAD_BYTES and SAMPLES blocks of
    SAMPLE_BYTES evenly spread (the first right after the head, the last at the end); the rest
    is not read (scaled down here: a 1 MiB file, 4 KiB head, 1 KiB blocks)."""
    monkeypatch.setattr(manifest, "SMALL_FILE_BYTES", 0)
    monkeypatch.setattr(manifest, "HEAD_BYTES", 4096)
    monkeypatch.setattr(manifest, "SAMPLE_BYTES", 1024)
    path = tmp_path / "model.safetensors"
    data = bytearray(range(256)) * 4096
    path.write_bytes(bytes(data))
    first = manifest._weight_fingerprint(path)
    assert first.startswith("sampled:")

    def changed_at(offset: int) -> bool:
        path.write_bytes(bytes(data[:offset]) + bytes([data[offset] ^ 1]) + bytes(data[offset + 1:]))
        return manifest._weight_fingerprint(path) != first

    span = len(data) - 4096 - 1024
    assert changed_at(10) and changed_at(4096) and changed_at(4096 + span * 3 // 7 + 5) and changed_at(len(data) - 1)
    assert not changed_at(4096 + 1024 + 10)  # between two blocks: not read
    path.write_bytes(bytes(data) + b"\0")
    assert manifest._weight_fingerprint(path) != first
