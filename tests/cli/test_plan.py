"""`lowvram plan` through Typer's CliRunner: exit codes, messages, JSON; and no torch import."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from lowvram.cli import app
from tests.conftest import REPO

runner = CliRunner()

JSON_KEYS = {
    "model", "parameters", "trainable_parameters", "vram_bytes", "fits", "peak_bytes", "breakdown",
    "techniques", "micro_batch_size", "grad_accum", "cpu_ram_bytes", "alternatives", "reasons",
    "safety_margin_bytes", "max_seq_len", "max_micro_batch_size",
}
TECHNIQUES = {
    "mixed_precision", "gradient_checkpointing", "gradient_accumulation", "lora", "quantization",
    "optimizer", "offload", "activation_offload", "tiled_mlp", "attention", "loss",
}


def plan(*args: str, env: dict | None = None):
    return runner.invoke(app, ["plan", *args], env=env)


def plan_json(*args: str) -> dict:
    r = plan(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_json_object():
    d = plan_json("--model", "llama-7b", "--vram", "24GB")
    assert JSON_KEYS <= set(d)
    assert set(d["techniques"]) == TECHNIQUES
    assert set(d["breakdown"]) == {"weights", "gradients", "optimizer", "activations", "logits",
                                   "cuda_context", "allocator"}
    assert sum(d["breakdown"].values()) == d["peak_bytes"]
    assert d["vram_bytes"] == 24 * 2**30 * 39 // 40  # a card sold as 24 GB, as CUDA reports it
    assert d["fits"] is True
    assert d["peak_bytes"] <= d["vram_bytes"] - d["safety_margin_bytes"]
    assert d["micro_batch_size"] * d["grad_accum"] == 16
    for alt in d["alternatives"]:
        assert {"peak_bytes", "relative_speed", "techniques", "fits"} <= set(alt)
    assert set(d["reasons"]) == TECHNIQUES


def test_table_output():
    r = plan("--model", "llama-7b", "--vram", "12GB")
    assert r.exit_code == 0, r.output
    for words in ("Chosen setup", "gradient_checkpointing", "Peak memory", "headroom", "Ladder",
                  "longest seq_len", "largest micro-batch", "safety margin"):
        assert words in r.stdout


@pytest.mark.parametrize("vram, code", [("80GB", 0), ("2GB", 1)])
def test_check_exit_code(vram, code):
    r = plan("--model", "llama-7b", "--vram", vram, "--method", "full", "--check")
    assert r.exit_code == code, r.output


def test_nothing_fits_says_what_helps():
    # 6 GB: at 4 GB even ZeRO-3 full offload does not fit (its live parameters and gradient bucket
    # stay on the GPU: memory.zero_residency_bytes).
    d = json.loads(plan("--model", "llama-2-70b", "--vram", "6GB", "--offload", "none", "--json").stdout)
    assert d["fits"] is False
    assert d["min_vram_bytes"] > 6 * 10**9
    assert d["suggestion"] and "--offload" in d["suggestion"]


def test_flags_fix_choices():
    d = plan_json("--model", "llama-7b", "--vram", "80GB", "--method", "qlora", "--optimizer",
                  "paged_adamw_8bit", "--gradient-checkpointing", "--loss", "chunked",
                  "--gradient-accumulation", "4", "--seq-len", "2048", "--lora-r", "8",
                  "--lora-targets", "q_proj,v_proj")
    t = d["techniques"]
    assert t["lora"] is True and t["quantization"] == "nf4-dq"
    assert t["optimizer"] == "paged_adamw_8bit" and t["gradient_checkpointing"] is True
    assert t["loss"] == "chunked" and d["grad_accum"] == 4 and d["micro_batch_size"] == 4
    assert d["lora_r"] == 8 and d["lora_targets"] == ["q_proj", "v_proj"]
    assert "--optimizer" in d["reasons"]["optimizer"]


def test_packing_is_a_plan_input():
    """--packing (data.packing in a recipe): every layer's SDPA keeps a b x s x s mask."""
    from lowvram.plan.memory.activations import masked_attention_bytes
    from lowvram.plan.model.catalog import resolve_model
    from lowvram.plan.setup import RunSetup

    fixed = ("--model", "llama-7b", "--vram", "80GB", "--method", "lora", "--mixed-precision", "bf16",
             "--attention", "sdpa", "--gradient-checkpointing", "--loss", "chunked", "--gradient-accumulation", "1",
             "--seq-len", "2048")
    plain, packed = plan_json(*fixed, "--no-packing"), plan_json(*fixed, "--packing")
    assert (plain["packing"], packed["packing"]) == (False, True)
    assert plain["techniques"] == packed["techniques"] and packed["micro_batch_size"] == 16
    mask = masked_attention_bytes(RunSetup(resolve_model("llama-7b"), precision="bf16", lora=True,
                                           micro_batch_size=16, seq_len=2048, packing=True))
    assert mask == 2 * 16 * 2048**2  # bf16, 32 kv heads: nothing expanded
    # checkpointing with small logits: the recomputed layer's mask and the bool mask the
    # checkpoints keep (and the allocator's share of them on a GPU)
    assert packed["peak_bytes"] - plain["peak_bytes"] >= mask + 16 * 2048**2
    assert "packed" in plan(*fixed, "--packing").stdout


def test_vram_from_env():
    r = plan("--model", "llama-7b", "--json", env={"LOWVRAM_VRAM": "12000MB"})
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["vram_bytes"] == 12 * 10**9


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["--model", "llama-7bb"], 1, "unknown model"),
        (["--model", "llama-7b", "--seq-len", "0"], 1, "seq_len must be a positive"),
        (["--model", "llama-7b", "--batch-size", "-2"], 1, "batch_size must be a positive"),
        (["--model", "llama-7b", "--quantization", "nf4", "--method", "full"], 1, "needs lora"),
        (["--model", "llama-7b", "--method", "half"], 2, "--method"),
        (["--model", "llama-7b", "--optimizer", "adam"], 2, "--optimizer"),
        (["--model", "llama-7b", "--vram", "lots"], 1, "cannot read memory size"),
        ([], 1, "nothing to plan"),
    ],
)
def test_bad_input(args, code, words):
    r = plan(*args, *([] if "--vram" in args else ["--vram", "24GB"]))
    assert r.exit_code == code, r.output
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("error:") and words in lines[0]
    assert lines[-1].startswith("hint:")
    assert "Traceback" not in r.output


def test_unknown_model_suggests_names():
    r = plan("--model", "llama-7bb", "--vram", "24GB")
    assert "did you mean" in r.stderr


def test_list_models():
    r = plan("--list-models", "--json")
    assert r.exit_code == 0
    names = {m["name"] for m in json.loads(r.stdout)}
    assert "llama-2-7b" in names


def test_recipe_with_config_folder(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(textwrap.dedent("""\
        model: {name_or_path: m}
        data: {datasets: [{path: d.jsonl}]}
        training: {batch_size: 8, seq_len: 128}
        techniques: {lora: off, gradient_checkpointing: on}
    """))
    d = plan_json(str(recipe), "--vram", "8GB")
    assert d["techniques"]["lora"] is False and d["techniques"]["gradient_checkpointing"] is True
    assert "recipe" in d["reasons"]["lora"]
    # a flag overrides the recipe
    d = plan_json(str(recipe), "--vram", "8GB", "--no-gradient-checkpointing", "--seq-len", "64")
    assert d["techniques"]["gradient_checkpointing"] is False


def test_gguf_only_recipe_predicts_from_the_gguf_metadata(quickstart_model):
    r = plan(str(REPO / "recipes" / "quickstart.yaml"), "--vram", "8GB", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["fits"] is True and d["parameters"] > 134_515_008  # + LoRA adapters


def test_plan_path_does_not_import_torch():
    code = textwrap.dedent("""\
        import sys
        import lowvram.cli
        assert "torch" not in sys.modules, "import lowvram.cli pulled torch"
        from typer.testing import CliRunner
        r = CliRunner().invoke(lowvram.cli.app, ["plan", "--model", "llama-7b", "--vram", "24GB", "--json"])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(lowvram.cli.app, ["plan", "--model", "llama-7b", "--vram", "24GB"])
        assert r.exit_code == 0, r.output
        heavy = [m for m in ("torch", "transformers", "peft", "bitsandbytes", "datasets") if m in sys.modules]
        assert not heavy, heavy
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_limits_over_all_plans_are_printed_with_their_plan():
    r = plan("--model", "llama-3.1-8b", "--method", "qlora", "--seq-len", "2048", "--batch-size", "1",
             "--vram", "12GB", "--offload", "none")
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stdout.splitlines() if x.startswith("over all plans: longest seq_len"))
    longest = int(line.split("seq_len ")[1].split(" ")[0].replace(",", ""))
    under = next(x for x in r.stdout.splitlines() if x.startswith("under this plan"))
    assert longest > int(under.split("fits ")[1].split(";")[0].replace(",", ""))
    # the loss: chunked, or Liger's fused loss where the liger extra is installed
    assert "QLoRA nf4-dq" in line and ("chunked loss" in line or "fused loss" in line)
    assert "offload none" not in line and "offload " not in line.replace("activation offload", "")


def test_a_reason_says_why_the_fitting_alternative_was_not_taken():
    """llama-7b at 5.6 GB (issue 13's case, at 6 GB before the allocator's shares, where QLoRA now
    fits without offload): full fine-tuning with offload fits too; the LoRA line must not read as
    if full fine-tuning had been ruled out by memory."""
    d = json.loads(plan("--model", "llama-7b", "--seq-len", "2048", "--batch-size", "1", "--vram", "5600MB",
                        "--json").stdout)
    assert d["techniques"]["offload"] == "full" and d["techniques"]["lora"] is True
    lora = d["reasons"]["lora"]
    assert "full fine-tuning would be 4.92 GiB <= budget 4.95 GiB" in lora
    assert "chosen as the faster of the two (step time x4.08 vs x5.10" in lora


def test_flash_attention_in_fp32_does_not_fit_it_is_refused():
    """Issue 24 item 8: `lowvram plan --mixed-precision fp32 --attention flash_attention_2` said "fits"."""
    r = plan("--model", "llama-2-7b", "--vram", "24GB", "--mixed-precision", "fp32", "--attention", "flash_attention_2")
    assert r.exit_code == 1 and "fits" not in r.output
    assert "error: attention flash_attention_2 (set by --attention flash_attention_2) cannot run here: precision fp32" in r.output
    assert "hint: use a 16-bit precision (--mixed-precision bf16, bf16-mixed or fp16-mixed) with it, or --attention sdpa" in r.output


# issue 41: `lowvram plan --model M --set KEY=VALUE` without a recipe was accepted and ignored
# (exit 0, the plan unchanged). Now the sets apply to the schema's defaults, as in a recipe.
GALORE = ("--model", "llama-2-7b", "--vram", "80GB", "--set", "techniques.optimizer=galore_adamw",
          "--set", "techniques.lora=off", "--set", "techniques.quantization=off")


def test_set_without_a_recipe_changes_the_plan():
    plain = plan_json(*GALORE)
    assert plain["techniques"]["optimizer"] == "galore_adamw"  # the sets themselves reached the plan
    wide = plan_json(*GALORE, "--set", "galore.rank=1024")
    assert wide["peak_bytes"] > plain["peak_bytes"]  # rank 1024's projected state over the default 128
    lora = ("--model", "llama-2-7b", "--vram", "24GB", "--method", "lora", "--mixed-precision", "bf16")
    # DoRA's saved tensors and magnitudes (plan/memory/dora.py) on top of the same LoRA plan
    assert plan_json(*lora, "--set", "lora.use_dora=true")["peak_bytes"] > plan_json(*lora)["peak_bytes"]


def test_set_without_a_recipe_is_the_same_as_in_a_default_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name_or_path: llama-2-7b}\ndata: {datasets: [{path: x.jsonl, format: text}]}\n")
    sets = ("--set", "lora.use_dora=true", "--set", "techniques.lora=on", "--set", "training.seq_len=4096")
    via_model = plan_json("--model", "llama-2-7b", "--vram", "24GB", *sets)
    via_recipe = plan_json(str(recipe), "--vram", "24GB", *sets)
    assert via_model["peak_bytes"] == via_recipe["peak_bytes"]
    assert via_model["techniques"] == via_recipe["techniques"] and via_model["seq_len"] == 4096


@pytest.mark.parametrize("args, words", [
    (["--set", "lora.use_dora=true"], "--set without a recipe needs --model"),
    (["--model", "llama-2-7b", "--set", "data.datasets=x.jsonl"], "cannot be set without a recipe"),
    (["--model", "llama-2-7b", "--set", "lora.use_dora=maybe"], "use_dora"),
    (["--model", "llama-2-7b", "--set", "galore.rnak=3"], "rnak"),
])
def test_set_without_a_recipe_that_cannot_apply_is_refused(args, words):
    r = plan(*args, "--vram", "24GB")
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("error:") and words in r.stderr, r.stderr
    assert lines[-1].startswith("hint:") and "Traceback" not in r.output
