"""`lowvram export RUN --gguf` through the real CLI on tiny models: the file is read back with
transformers' own GGUF loader and agrees with the merged model; the Modelfile; the refusals
(K-quants, a family the writer does not handle, a disk too small: a real 64 KiB tmpfs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.train.test_after_training import assert_user_error, cli
from tests.train.test_e2e import write_recipe


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A finished 4-step LoRA run (alpaca format) on the tiny Llama."""
    tmp = tmp_path_factory.mktemp("export")
    result = cli("train", str(write_recipe(tmp, tiny_model_dir, steps=4)))
    assert result.exit_code == 0, result.output
    return tmp / "out"


def full_run(folder: Path, model_type: str = "llama", **config_kwargs) -> Path:
    """A full fine-tune's run folder: a tiny model of ``model_type`` saved there with the ChatML
    tokenizer, and the recipe.yaml a run keeps (chat format)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lowvram.testing import build_tokenizer

    tok = build_tokenizer()
    sizes = {"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "tie_word_embeddings": model_type == "qwen3", "eos_token_id": tok.eos_token_id,
             "pad_token_id": tok.pad_token_id}
    config = AutoConfig.for_model(model_type, **{**sizes, **config_kwargs})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "recipe.yaml").write_text("model: {name_or_path: x}\ndata:\n  datasets: [{path: d.jsonl, format: chat}]\n")
    return folder


def logits_of(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("quantization", ["f16", "q8_0"])
def test_export_adapter_run_reads_back_and_agrees(run_dir, tmp_path, quantization):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / f"model-{quantization}.gguf"
    result = cli("export", str(run_dir), "--gguf", "--quantization", quantization, "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "same tokenization" in result.output and "top-1 agreement" in result.output
    assert "Converting" not in result.output  # no library progress bar
    assert f"ollama create model-{quantization.replace('_', '-')} -f {tmp_path / 'Modelfile'}" in result.output
    # The run trained on alpaca prompts: no chat template is claimed for it.
    modelfile = (tmp_path / "Modelfile").read_text()
    assert f"FROM ./model-{quantization}.gguf" in modelfile and 'TEMPLATE """' not in modelfile
    assert "alpaca" in modelfile

    # Read back independently of lowvram and compared with the merged model.
    merged = tmp_path / "merged"
    assert cli("merge", str(run_dir), "--out", str(merged)).exit_code == 0
    ref = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    ref_tok = AutoTokenizer.from_pretrained(merged)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32)
    back_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    ids = ref_tok(text)["input_ids"]
    assert back_tok(text)["input_ids"] == ids
    a, b = logits_of(ref, ids), logits_of(back, ids)
    diff = float((a - b).abs().max())
    assert diff / float(a.abs().max()) < {"f16": 0.005, "q8_0": 0.15}[quantization]
    # The top token agrees wherever the reference's lead over the runner-up exceeds twice the
    # largest difference (a random tiny model has near-ties elsewhere).
    top2 = a.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * diff
    assert decided.any() and bool((a.argmax(-1) == b.argmax(-1))[decided].all())

    record = json.loads((run_dir / "exports.json").read_text())
    assert any(r["file"] == str(out) and r["agreement"]["ok"] for r in record)
    shown = cli("show", str(run_dir))
    assert f"export: {out} ({quantization}" in shown.output, shown.output


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "olmo2", "smollm3"])
def test_export_full_run_of_each_family_with_chatml_modelfile(tmp_path, model_type):
    """Each byte-level BPE family; OLMo-2 and SmolLM3, which transformers' GGUF loader does not
    know, are read back through gguf's reader and dequantizers (gguf_readback.py)."""
    run = full_run(tmp_path / "run", model_type)
    result = cli("export", str(run), "--gguf", "--json")
    assert result.exit_code == 0, result.output
    r = json.loads(result.output)
    assert r["agreement"]["ok"] and r["agreement"]["same_tokenization"] and r["plan"]["kind"] == "full"
    assert r["agreement"]["top1_agreement"] == 1.0
    assert r["agreement"]["read_back_by"] == ("gguf" if model_type in ("olmo2", "smollm3") else "transformers")
    gguf = run / "gguf-f16" / "run-f16.gguf"
    assert r["out_file"] == str(gguf) and gguf.is_file()
    modelfile = (run / "gguf-f16" / "Modelfile").read_text()
    assert '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>' in modelfile
    assert 'PARAMETER stop "<|im_end|>"' in modelfile

    import gguf as gg

    reader = gg.GGUFReader(gguf)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == {"mistral": "llama"}.get(model_type, model_type)
    assert "tokenizer.chat_template" in reader.fields and "tokenizer.ggml.merges" in reader.fields


def spm_full_run(folder: Path, model_type: str) -> tuple[Path, object]:
    """A full run of a tiny Gemma-2 / Gemma-3 (text) / Phi-3 with a SentencePiece-style tokenizer
    (byte fallback, ▁ pieces; Gemma's or Phi-3's layout), its norms randomised (a zero-init
    Gemma norm would hide a missing +1), Gemma's sliding window shorter than the prompts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lowvram.testing import build_sentencepiece_tokenizer

    tok = build_sentencepiece_tokenizer("gemma" if model_type.startswith("gemma") else "llama")
    extra = {"head_dim": 16, "sliding_window": 8} if model_type.startswith("gemma") else {
        "original_max_position_embeddings": 256}
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "recipe.yaml").write_text("model: {name_or_path: x}\ndata:\n  datasets: [{path: d.jsonl, format: chat}]\n")
    return folder, model


def field(reader, key):
    f = reader.fields[key]
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types[0].name == "STRING" else value.tolist()[0]


@pytest.mark.parametrize(("model_type", "quantization"), [("gemma2", "f16"), ("gemma3_text", "q8_0"), ("phi3", "bf16")])
def test_export_sentencepiece_families(tmp_path, model_type, quantization):
    """Gemma-2, Gemma-3 (text) and Phi-3 with SentencePiece vocabularies: read back by transformers'
    GGUF loader and agreeing (with the BOS each adds); in the file, as llama.cpp's converter writes
    them: the "llama" tokenizer model with scores and byte tokens, Gemma's norms stored + 1, its
    softcapping and sliding window, Phi-3's fused qkv and gate_up."""
    import gguf as gg
    import numpy as np

    run, model = spm_full_run(tmp_path / "run", model_type)
    result = cli("export", str(run), "--gguf", "--quantization", quantization, "--json")
    assert result.exit_code == 0, result.output
    a = json.loads(result.output)["agreement"]
    assert a["ok"] and a["same_tokenization"] and a["top1_agreement"] >= 0.95, a
    assert a["relative_diff"] < {"f16": 0.002, "bf16": 0.01, "q8_0": 0.05}[quantization], a

    reader = gg.GGUFReader(run / f"gguf-{quantization}" / f"run-{quantization}.gguf")
    arch = field(reader, "general.architecture")
    assert arch == {"gemma3_text": "gemma3"}.get(model_type, model_type)
    assert field(reader, "tokenizer.ggml.model") == "llama"
    types = reader.fields["tokenizer.ggml.token_type"]
    tokens = reader.fields["tokenizer.ggml.tokens"]
    byte_a = next(i for i, d in enumerate(tokens.data) if bytes(tokens.parts[d]) == b"<0x41>")
    assert int(types.parts[types.data[byte_a]][0]) == gg.TokenType.BYTE
    assert "tokenizer.ggml.scores" in reader.fields
    assert bool(field(reader, "tokenizer.ggml.add_bos_token"))
    assert bool(field(reader, "tokenizer.ggml.add_space_prefix")) == (model_type == "phi3")
    tensors = {t.name: t for t in reader.tensors}
    if model_type.startswith("gemma"):
        stored = np.asarray(tensors["blk.0.attn_norm.weight"].data)
        hf = model.model.layers[0].input_layernorm.weight.detach().numpy()
        assert np.allclose(stored, hf + 1, atol=1e-6)
        assert field(reader, f"{arch}.attention.sliding_window") == 8
        assert "blk.0.post_ffw_norm.weight" in tensors and "output.weight" not in tensors
    if model_type == "gemma2":
        assert field(reader, "gemma2.attn_logit_softcapping") == 50.0
        assert field(reader, "gemma2.final_logit_softcapping") == 30.0
    if model_type == "phi3":
        assert tuple(tensors["blk.0.attn_qkv.weight"].shape) == (64, 64 + 2 * 32)
        assert tuple(tensors["blk.0.ffn_up.weight"].shape) == (64, 256)
        assert field(reader, "phi3.rope.scaling.original_context_length") == 256


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def llama3_run(folder: Path) -> Path:
    """full_run()'s Llama with Llama-3.1's rope scaling (its original context shrunk to 64, so the
    scaled band falls inside a 16-wide head and the prompts see it)."""
    return full_run(folder, "llama", rope_scaling=LLAMA3_ROPE)


def test_export_llama3_rope_scaling_as_rope_freqs(tmp_path):
    """Llama-3.1's rope scaling goes in as llama.cpp's rope_freqs tensor (F32, one factor per
    frequency: 1 for the fast ones, the factor 8 for the slow ones, as convert_hf_to_gguf.py writes
    it), matched against transformers' own llama3 rope, and the weights agree under it."""
    import gguf as gg
    import numpy as np

    run = llama3_run(tmp_path / "run")
    result = cli("export", str(run), "--gguf", "--json")
    assert result.exit_code == 0, result.output
    a = json.loads(result.output)["agreement"]
    assert a["ok"] and a["rope_freqs_match"] is True and a["same_tokenization"] and a["relative_diff"] < 0.002, a
    reader = gg.GGUFReader(run / "gguf-f16" / "run-f16.gguf")
    freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    factors = np.asarray(freqs.data).reshape(-1)
    assert freqs.tensor_type == gg.GGMLQuantizationType.F32 and factors.shape == (8,)
    # head_dim 16, base 10000: wavelength 2 pi 10000^(2i/16); below 64/4 = 16 unscaled, above 64 x 8
    wavelengths = 2 * np.pi * 10000 ** (np.arange(0, 16, 2) / 16)
    assert np.allclose(factors[wavelengths < 16], 1.0) and np.allclose(factors[wavelengths > 64], 8.0)
    assert ((factors > 1) & (factors < 8)).any()  # the smoothed band


def test_wrong_rope_freqs_fail_the_check(tmp_path, monkeypatch):
    """A writer that put no scaling in rope_freqs (all ones) is caught by the check."""
    import torch

    import lowvram.train.after.gguf_file as gguf_file

    monkeypatch.setattr(gguf_file, "rope_factors", lambda config: torch.ones(8))
    run = llama3_run(tmp_path / "run")
    result = cli("export", str(run), "--gguf")
    assert_user_error(result, "does not match the model", "rope_freqs differ from the llama3 rope", "the file was removed")
    assert not (run / "gguf-f16" / "run-f16.gguf").exists()


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "yarn", "factor": 4.0}])
def test_other_rope_scaling_refused(tmp_path, rope):
    run = full_run(tmp_path / "run", "qwen2")
    config = json.loads((run / "config.json").read_text())
    config["rope_parameters"] = {**config.get("rope_parameters", {}), **rope}
    (run / "config.json").write_text(json.dumps(config))
    result = cli("export", str(run), "--gguf")
    assert_user_error(result, f"{rope['rope_type']!r} rope scaling", "could not be checked", "convert_hf_to_gguf.py")


def test_gemma_config_the_loader_cannot_read_back_refused(tmp_path):
    """A Gemma-2 whose query_pre_attn_scalar is not the default: the file cannot carry it to
    transformers' loader, so the export could not be checked: refused before loading."""
    run, _ = spm_full_run(tmp_path / "run", "gemma2")
    config = json.loads((run / "config.json").read_text())
    config["query_pre_attn_scalar"] = 144
    (run / "config.json").write_text(json.dumps(config))
    result = cli("export", str(run), "--gguf")
    assert_user_error(result, "query_pre_attn_scalar=144", "default 256", "convert_hf_to_gguf.py")
    assert not (run / "gguf-f16").exists()


def test_smollm3_without_its_default_no_rope_layers_refused(tmp_path):
    """llama.cpp's smollm3 takes every 4th layer as the one without rope; the file cannot say
    otherwise, so another layout is refused before loading."""
    run = full_run(tmp_path / "run", "smollm3", num_hidden_layers=4, no_rope_layers=[1, 0, 1, 1])
    result = cli("export", str(run), "--gguf")
    assert_user_error(result, "no_rope_layers=[1, 0, 1, 1]", "default [1, 1, 1, 0]", "convert_hf_to_gguf.py")


def test_own_read_back_catches_a_writer_mistake(tmp_path, monkeypatch):
    """SmolLM3 written without llama.cpp's q/k permutation: gguf_readback.py undoes the
    permutation llama.cpp's converter makes (transformers' LlamaTensorProcessor), not the writer's
    own table, so the mistake shows as a logit difference and the export fails."""
    import lowvram.train.after.gguf_family as gguf_family

    monkeypatch.setitem(gguf_family.FAMILIES, "smollm3", gguf_family.Family("smollm3"))
    run = full_run(tmp_path / "run", "smollm3")
    result = cli("export", str(run), "--gguf")
    assert_user_error(result, "does not match the model", "the file was removed")


def test_k_quant_refused_naming_what_can(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-quantize on it
    result = cli("export", str(run_dir), "--gguf", "--quantization", "q4_k_m", "--out", str(tmp_path / "m.gguf"))
    assert_user_error(result, "none is on PATH", "f16, bf16 and q8_0", "--llama-quantize PATH",
                      "llama-quantize MODEL-f16.gguf MODEL-q4_k_m.gguf Q4_K_M")
    assert not (tmp_path / "m.gguf").exists()


def test_llama_quantize_arguments_refused(run_dir, tmp_path):
    result = cli("export", str(run_dir), "--gguf", "--quantization", "q4_k_m", "--llama-quantize", str(tmp_path / "nope"))
    assert_user_error(result, "not an executable file", "lowvram builds nothing")
    result = cli("export", str(run_dir), "--gguf", "--llama-quantize", "/bin/true")
    assert_user_error(result, "--llama-quantize is for K-quants", "writes f16 itself")
    result = cli("export", str(run_dir), "--gguf", "--quantization", "q3_x")
    assert_user_error(result, "unknown --quantization 'q3_x'", "q4_k_m")


@pytest.mark.parametrize(("program", "said"), [("false", "exited with 1"), ("true", "wrote no file")])
def test_llama_quantize_that_fails_leaves_nothing(run_dir, tmp_path, monkeypatch, program, said):
    """A real program that fails (false) or writes nothing (true), found on PATH as
    llama-quantize: the f16 file is written and handed to it, its failure is said, no file is kept.
    (No llama-quantize is on this machine and none is faked: a successful K-quant is not tested.)"""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "llama-quantize").symlink_to(shutil.which(program))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    out = tmp_path / "exp" / "m-q4_k_m.gguf"
    result = cli("export", str(run_dir), "--gguf", "--quantization", "q4_k_m", "--out", str(out))
    assert_user_error(result, str(bin_dir / "llama-quantize"), said, "Q4_K_M", "lowvram kept no file")
    assert list(out.parent.iterdir()) == []


def test_unsupported_family_refused(tmp_path):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from lowvram.testing import build_tokenizer

    run = tmp_path / "run"
    tok = build_tokenizer()
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2)).save_pretrained(run)
    tok.save_pretrained(run)
    (run / "recipe.yaml").write_text("model: {name_or_path: x}\n")
    result = cli("export", str(run), "--gguf")
    assert_user_error(result, "'gpt2'", "gemma2, gemma3_text, llama, mistral, olmo2, phi3, qwen2, qwen3, smollm3",
                      "convert_hf_to_gguf.py")


def test_needs_gguf_flag(run_dir):
    result = cli("export", str(run_dir))
    assert result.exit_code == 2 and "--gguf" in result.output


def test_modelfile_templates():
    from lowvram.testing import CHAT_TEMPLATE
    from lowvram.train.after.modelfile import modelfile_text

    llama3 = "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
    text, note = modelfile_text("m.gguf", llama3, "chat")
    assert note is None and 'PARAMETER stop "<|eot_id|>"' in text
    assert "<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>" in text
    text, note = modelfile_text("m.gguf", "{{ '[INST] ' + m['content'] + ' [/INST]' }}", "chat")
    assert 'TEMPLATE """' not in text and "none of ChatML, Llama-3, Gemma, Phi-3" in note and note in text
    from lowvram.testing import GEMMA_CHAT_TEMPLATE, build_sentencepiece_tokenizer

    text, note = modelfile_text("m.gguf", GEMMA_CHAT_TEMPLATE, "chat")
    assert note is None and 'PARAMETER stop "<end_of_turn>"' in text
    assert "<start_of_turn>{{ if eq $m.Role \"assistant\" }}model{{ else }}user{{ end }}" in text
    text, note = modelfile_text("m.gguf", build_sentencepiece_tokenizer("llama").chat_template, "chat")
    assert note is None and "<|{{ .Role }}|>\n{{ .Content }}<|end|>" in text and 'PARAMETER stop "<|end|>"' in text
    text, _ = modelfile_text("m.gguf", CHAT_TEMPLATE, None, system="Be brief.")
    assert text.splitlines()[1] == "FROM ./m.gguf" and text.endswith('SYSTEM """Be brief."""\n')


def test_disk_too_small_refused_before_loading(run_dir, small_disk):
    result = cli("export", str(run_dir), "--gguf", "--out", str(small_disk / "m.gguf"))
    assert_user_error(result, "export needs", "of disk in", "free", "--out")
    assert list(small_disk.iterdir()) == []


def test_host_ram_too_small_refused(run_dir, tmp_path, monkeypatch):
    import lowvram.hardware

    monkeypatch.setattr(lowvram.hardware, "host_memory", lambda: (2**30, 100 * 2**10))
    result = cli("export", str(run_dir), "--gguf", "--out", str(tmp_path / "m.gguf"))
    assert_user_error(result, "export needs", "host RAM", "0.1 MiB available")


@pytest.mark.slow
def test_export_demo_smollm2(quickstart_model, tmp_path):
    """The demo's SmolLM2-135M-Instruct (its GGUF converted as training does) as a full run, to
    q8_0: read back and within bounds; the ChatML Modelfile."""
    from lowvram.demo import GGUF_NAME
    from lowvram.train.build.gguf import gguf_folder

    folder, _ = gguf_folder(str(quickstart_model), GGUF_NAME)
    run = tmp_path / "smollm2"
    run.mkdir()
    for p in folder.iterdir():
        (run / p.name).symlink_to(p)
    (run / "recipe.yaml").write_text("model: {name_or_path: x}\ndata:\n  datasets: [{path: d.jsonl, format: chat}]\n")
    result = cli("export", str(run), "--gguf", "--quantization", "q8_0", "--json")
    assert result.exit_code == 0, result.output
    a = json.loads(result.output)["agreement"]
    assert a["ok"] and a["same_tokenization"] and a["relative_diff"] < 0.06 and a["top1_agreement"] > 0.93, a
    assert 'PARAMETER stop "<|im_end|>"' in (run / "gguf-q8_0" / "Modelfile").read_text()


def test_out_of_bounds_fails_and_removes_the_file(run_dir, tmp_path, monkeypatch):
    """A bound no F16 file can meet (0): the export fails with the figures and keeps no file."""
    import lowvram.train.after.gguf_check as check

    monkeypatch.setitem(check.RELATIVE_TOLERANCE, "f16", 0.0)
    out = tmp_path / "m.gguf"
    result = cli("export", str(run_dir), "--gguf", "--out", str(out))
    assert_user_error(result, "does not match the model", "bound 0.00%", "the file was removed")
    assert not out.exists() and not (tmp_path / "Modelfile").exists()
    record = run_dir / "exports.json"
    assert not record.exists() or not any(r["file"] == str(out) for r in json.loads(record.read_text()))
