"""Model catalog and exact parameter counts (no weights, no network)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.model import models as models_module
from lowvram.plan.model.catalog import catalog_names, resolve_model
from lowvram.plan.model.models import count_parameters

# Published parameter counts (model cards / papers; tied embeddings counted once).
PUBLISHED = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-3-8b": 8_030_261_248,
    "llama-3.2-3b": 3_212_749_824,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-0.5b": 494_032_768,
    "gpt2": 124_439_808,
    "tinyllama": 1_100_048_384,
    "phi-2": 2_779_683_840,
}


@pytest.mark.parametrize(
    "alias,name",
    [("llama-7b", "llama-2-7b"), ("LLaMA-2-7B", "llama-2-7b"), ("meta-llama/Llama-2-7b-hf", "llama-2-7b"),
     ("Qwen/Qwen2.5-0.5B", "qwen2.5-0.5b"), ("TinyLlama", "tinyllama"), ("Phi-3-mini-4k-instruct", "phi-3-mini")],
)
def test_aliases_case_insensitive(alias, name):
    assert resolve_model(alias).name == name


def test_llama31_same_shape_as_llama3():
    a, b = resolve_model("llama-3.1-8b"), resolve_model("llama-3-8b")
    assert (a.vocab_size, a.num_kv_heads, a.intermediate_size, a.rope_theta) == (128256, 8, 14336, 500000.0)
    assert count_parameters(a) == count_parameters(b)


def test_unknown_model_suggests_close_names():
    with pytest.raises(LowvramError) as e:
        resolve_model("lama-2-7b")
    assert "unknown model 'lama-2-7b'" in e.value.message
    assert "llama-2-7b" in e.value.hint


def test_local_folder_and_missing_fields(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve_model(str(tmp_path))
    # embed 64000 + 2 x (q 4096 + k 2048 + v 2048 + o 4096 + mlp 3 x 8192 + norms 128) + norm 64 + head 64000
    assert count_parameters(spec) == 64000 + 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192 + 128) + 64 + 64000
    assert resolve_model(str(tmp_path / "config.json")) == spec
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(LowvramError) as e:
        resolve_model(str(tmp_path))
    assert "num_hidden_layers" in e.value.message and "vocab_size" in e.value.message


def test_hub_cache_lookup(tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "vocab_size": 100}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    spec = resolve_model("org/tiny")
    assert spec.qkv_bias and not spec.tie_word_embeddings  # Qwen2Config defaults
    # embed 3200 + (q,k,v with bias 3 x 1056 + o 1024 + mlp 3 x 2048 + norms 64) + norm 32 + head 3200
    assert count_parameters(spec) == 3200 + 3 * 1056 + 1024 + 3 * 2048 + 64 + 32 + 3200


def test_catalog_names_cover_the_brief():
    names = set(catalog_names())
    for n in ["llama-2-7b", "llama-2-13b", "llama-3-8b", "llama-3.1-8b", "llama-3.2-1b", "llama-3.2-3b",
              "mistral-7b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "gemma-2b", "gemma-7b",
              "phi-2", "phi-3-mini", "tinyllama", "gpt2"]:
        assert n in names


# Current families (catalog entries with a "source"): their exact counts, from the same fields.
# Llama-3.3-70B 70.55B, Phi-4 14.66B, Mistral-Small-24B (safetensors index: 47,144,806,400 bytes
# of bf16), Mistral-Nemo 12.25B, Mixtral-8x7B 46.7B, Qwen3-30B-A3B 30.5B: model cards.
CURRENT = {
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200,
    "qwen3-30b-a3b": 30_532_122_624,
    "llama-3.3-70b": 70_553_706_496,
    "mistral-nemo-12b": 12_247_782_400,
    "mistral-small-24b": 47_144_806_400 // 2,
    "phi-4": 14_659_507_200,
    "phi-4-mini": 3_836_021_760,
    "mixtral-8x7b": 46_702_792_704,
    # Gemma-3-1B 999,885,952 (its model card's 1B; the transformers model built from the same
    # config.json agrees, test below), OLMo-2 7.30B / 13.7B, SmolLM3 3.08B
    "gemma-3-1b": 999_885_952,
    "olmo-2-7b": 7_298_617_344,
    "olmo-2-13b": 13_716_198_400,
    "smollm3-3b": 3_075_098_624,
}


@pytest.mark.parametrize("name,count", sorted({**PUBLISHED, **CURRENT}.items()))
def test_published_parameter_counts(name, count):
    """The catalog's older families (PUBLISHED) and the current ones (CURRENT), to the parameter."""
    assert count_parameters(resolve_model(name)) == count


def test_every_current_entry_names_its_source():
    raw = json.loads((Path(models_module.__file__).with_name("catalog.json")).read_text())["models"]
    assert set(CURRENT) <= set(raw)
    for name in CURRENT:
        assert "config.json" in raw[name]["source"] or "params.json" in raw[name]["source"]


def test_current_families_architecture_fields():
    q8, moe, nemo = resolve_model("Qwen/Qwen3-8B"), resolve_model("qwen3-30b-a3b"), resolve_model("mistral-nemo")
    assert (q8.qk_norm, q8.tie_word_embeddings, resolve_model("qwen3-4b").tie_word_embeddings) == ("head", False, True)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.num_kv_heads) == (128, 8, 768, 4)
    assert nemo.head_dim == 128 and nemo.q_dim == 4096 != nemo.hidden_size  # head_dim is not hidden / heads
    mini = resolve_model("microsoft/Phi-4-mini-instruct")
    assert (mini.fused_qkv, mini.partial_rotary_factor, mini.tie_word_embeddings) == (True, 0.75, True)
    assert resolve_model("mistralai/Mixtral-8x7B-Instruct-v0.1").name == "mixtral-8x7b"


@pytest.mark.parametrize("name", ["llama-2-7b", "llama-3.2-1b", "mistral-7b", "qwen2.5-0.5b", "tinyllama",
                                  *sorted(CURRENT)])
def test_count_matches_transformers_model(name):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from lowvram.check.builders import hf_config
    spec = resolve_model(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(spec))
    assert sum(p.numel() for p in model.parameters()) == count_parameters(spec)


# Hub ids with suffixes (-Instruct, Meta- prefix, v0.2) resolve to the right shape; exact counts
# (model cards / safetensors metadata; SmolLM2 checked against the real weights below).
HUB_IDS = [
    ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b", 8_030_261_248),
    ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b", 8_030_261_248),
    ("Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5-0.5b", 494_032_768),
    ("Qwen/Qwen2.5-1.5B-Instruct", "qwen2.5-1.5b", 1_543_714_304),
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b", 7_615_616_512),
    ("mistralai/Mistral-7B-Instruct-v0.2", "mistral-7b-instruct-v0.2", 7_241_732_096),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m", 134_515_008),
]


@pytest.mark.parametrize("hub_id,name,count", HUB_IDS)
def test_instruct_hub_ids_resolve_with_exact_counts(hub_id, name, count):
    spec = resolve_model(hub_id)
    assert spec.name == name and count_parameters(spec) == count
    assert resolve_model(hub_id.rsplit("/", 1)[-1].upper()).name == name  # bare name, any case


def test_mistral_v02_is_the_v01_shape_with_rope_theta_1e6():
    a, b = resolve_model("mistral-7b-instruct-v0.2"), resolve_model("mistral-7b")
    assert a.rope_theta == 1e6 and b.rope_theta == 1e4
    assert count_parameters(a) == count_parameters(b)


def test_smollm2_count_matches_the_real_weights():
    import struct

    found = sorted(Path.home().glob(".cache/lowvram/gguf/*/model.safetensors"))
    if not found:
        pytest.skip("no GGUF-converted SmolLM2 folder (run the quickstart once)")
    raw = found[0].read_bytes()[:8]
    with found[0].open("rb") as f:
        f.seek(8)
        header = json.loads(f.read(struct.unpack("<Q", raw)[0]))
    numel = 0
    for key, t in header.items():
        if key != "__metadata__":
            n = 1
            for d in t["shape"]:
                n *= d
            numel += n
    assert numel == count_parameters(resolve_model("smollm2-135m")) == 134_515_008


def test_gguf_only_folder_reads_the_architecture_from_metadata(quickstart_model):
    import time

    folder = quickstart_model
    t0 = time.perf_counter()
    spec = resolve_model(str(folder))
    assert time.perf_counter() - t0 < 1.0  # metadata only, no tensor data
    assert count_parameters(spec) == 134_515_008 and spec.tie_word_embeddings
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.rope_theta) == (30, 3, 64, 1e5)


def test_broken_gguf_is_a_model_error(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(LowvramError, match="GGUF metadata"):
        resolve_model(str(tmp_path))


def test_dropout_is_read_from_the_config():
    from lowvram.plan.model.readers import spec_from_config

    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
    gpt2 = spec_from_config({**base, "model_type": "gpt2"}, "g")  # GPT2Config defaults: 0.1 each
    assert (gpt2.resid_dropout, gpt2.embd_dropout, gpt2.attn_dropout) == (0.1, 0.1, 0.1)
    gpt2 = spec_from_config({**base, "model_type": "gpt2", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                             "attn_pdrop": 0.0}, "g")
    assert (gpt2.resid_dropout, gpt2.embd_dropout, gpt2.attn_dropout) == (0.0, 0.0, 0.0)
    phi = spec_from_config({**base, "model_type": "phi", "intermediate_size": 256, "resid_pdrop": 0.1,
                            "attention_dropout": 0.0}, "p")
    assert (phi.resid_dropout, phi.attn_dropout) == (0.1, 0.0)
    llama = spec_from_config({**base, "model_type": "llama", "intermediate_size": 256,
                              "attention_dropout": 0.0}, "l")
    assert (llama.resid_dropout, llama.embd_dropout, llama.attn_dropout) == (0.0, 0.0, 0.0)
    assert resolve_model("phi-2").resid_dropout == 0.1 and resolve_model("gpt2").attn_dropout == 0.1
