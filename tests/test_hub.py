"""`lowvram plan --model org/name` for a model outside the catalog: its config.json only, from the
hub (a stand-in downloader here; no network), cached, HF_HUB_OFFLINE honoured with an error."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lowvram import hub
from lowvram.cli import app
from lowvram.errors import LowvramError
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.model.models import count_parameters

runner = CliRunner()
CONFIG = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
          "tie_word_embeddings": True}
# embed 64000 + 2 x (q 4096 + k 2048 + v 2048 + o 4096 + mlp 3 x 8192 + norms 128 + q/k norms 32) + 64
COUNT = 64000 + 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192 + 128 + 32) + 64


@pytest.fixture
def online_cache(tmp_path, monkeypatch):
    """An empty hub cache, HF_HUB_OFFLINE unset, and a downloader that writes the file where
    huggingface_hub would (models--org--name/snapshots/<rev>/config.json) and counts its calls."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls = []

    def download(repo_id: str, filename: str) -> str:
        calls.append((repo_id, filename))
        path = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "rev0" / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(CONFIG))
        return str(path)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(hub, "_REACHABLE", {"huggingface.co:443": True})  # the stand-in is the network
    return calls


def test_fetches_config_json_only_once_then_reads_the_cache(online_cache):
    assert hub.ensure_config("someorg/new-model") is not None
    assert online_cache == [("someorg/new-model", "config.json")]
    spec = resolve_model("someorg/new-model")
    assert count_parameters(spec) == COUNT and spec.qk_norm == "head"
    assert hub.ensure_config("someorg/new-model") is None  # cached: no second download
    assert len(online_cache) == 1


def test_catalog_names_and_local_paths_never_download(online_cache, tmp_path, monkeypatch):
    for ref in ("qwen3-8b", "Qwen/Qwen3-8B", "meta-llama/Llama-3.3-70B-Instruct", "llama-7b"):
        assert hub.ensure_config(ref) is None
    folder = tmp_path / "org" / "local"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    monkeypatch.chdir(tmp_path)
    assert hub.ensure_config("org/local") is None  # an existing folder of that name wins
    assert online_cache == []


def test_cli_plans_a_hub_model_outside_the_catalog(online_cache):
    r = runner.invoke(app, ["plan", "--model", "someorg/new-model", "--vram", "8GB", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["parameters"] == COUNT
    assert online_cache == [("someorg/new-model", "config.json")]


def test_train_plans_a_hub_model_outside_the_catalog_before_loading_it(online_cache, tmp_path):
    """`lowvram train` on a hub id the catalog does not know: config.json is fetched first, so
    the plan printed before the (large) download predicts the run instead of a fixed plan."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: {name_or_path: someorg/new-model}\n"
                      "data: {datasets: [{path: data.jsonl, format: text}]}\n"
                      "training: {seq_len: 256, batch_size: 2}\ntechniques: {lora: on}\n")
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    r = runner.invoke(app, ["train", str(recipe), "--dry-run", "--json", "--vram", "8GB"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["plan"]
    assert plan["predicted_peak_bytes"] > 0
    assert online_cache == [("someorg/new-model", "config.json")]


def test_offline_is_one_error_with_a_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LowvramError) as e:
        hub.ensure_config("someorg/not-cached", download=lambda **kw: pytest.fail("downloaded offline"))
    assert "HF_HUB_OFFLINE" in e.value.message and "unset HF_HUB_OFFLINE" in e.value.hint
    r = runner.invoke(app, ["plan", "--model", "someorg/not-cached", "--vram", "8GB"])
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("error: 'someorg/not-cached' is not in the catalog") and "HF_HUB_OFFLINE" in lines[0]
    assert lines[1].startswith("hint: unset HF_HUB_OFFLINE") and len(lines) == 2


def _http_error(cls, status: int):
    from types import SimpleNamespace

    # huggingface_hub's HTTP errors read only .headers and .request of the response
    return cls("refused", response=SimpleNamespace(status_code=status, headers={}, request=None))


@pytest.mark.parametrize("kind,status,message,hint", [
    ("GatedRepoError", 403, "is a gated model", "set HF_TOKEN"),
    ("RepositoryNotFoundError", 404, "no model 'org/x' on the Hugging Face Hub", "HF_TOKEN"),
    ("RemoteEntryNotFoundError", 404, "has no config.json", "pass its folder"),
])
def test_hub_errors_become_one_message_and_hint(kind, status, message, hint, monkeypatch):
    from huggingface_hub import errors

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    err = _http_error(getattr(errors, kind), status)

    def download(**kw):
        raise err

    with pytest.raises(LowvramError) as e:
        hub.fetch_config("org/x", download=download)
    assert message in e.value.message and hint in e.value.hint


def test_network_failure_names_the_hub(monkeypatch):
    def download(**kw):
        raise ConnectionError("Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(LowvramError) as e:
        hub.fetch_config("org/x", download=download)
    assert "could not fetch the config.json of 'org/x'" in e.value.message
    assert "Name or service not known" in e.value.message and "network" in e.value.hint


@pytest.mark.parametrize("ref,ok", [("org/name", True), ("Qwen/Qwen3-8B", True), ("org/a.b-c_d", True),
                                    ("name", False), ("a/b/c", False), ("org/..x", False),
                                    ("org/a--b", False), ("./rel", False)])
def test_looks_like_hub_id(ref, ok):
    assert hub.looks_like_hub_id(ref) is ok
